"""`TieredStore`: several `CacheStore`s seen as one, fastest first (host L2, then the shared pool), and
`open_cache_pool` / `make_cache_store`: the constructors the engine and CLI pick a store with.

    store = make_cache_store(host_cache_gb=4, cache_pool="pool://127.0.0.1:7790")   # TieredStore
    store = open_cache_pool("mooncake://10.0.0.5:50051?segment_mb=4096&namespace=k3-")

Policy:
- `get` tries the tiers in order; a hit in a slower tier is promoted (put) into every faster tier, so
  the next read of that page is local.
- `put` writes through to every tier: the engine puts a page when its device cache evicts it (and the
  prefill worker when it publishes pages), and a page must reach the shared pool to be a hit for the
  other workers; the host tier keeps a local copy that outlives a pool outage. Returns True if any tier
  kept the blob.
- `contains_prefix` is the length of the chain that the tiers cover *together* (page i may be in any
  tier), at least the max over the tiers: `get` reads every page from whichever tier has it.
- Per-tier counters (`stats()["hits_by_tier"]`, in pages) let the engine attribute hits to host vs
  shared pool. A tier that raises (other than ValueError, a caller bug) counts as a miss / not kept and
  is logged once; PoolStore and MooncakeStore never raise, they answer "absent" while down, so a dead
  pool leaves the host tier serving.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from serving.cache.store import CacheStore, PageBlob

log = logging.getLogger(__name__)


class TieredStore(CacheStore):
    """`tiers` fastest first; `names` label them in stats (default "tier0", "tier1", ...)."""

    def __init__(self, tiers: Sequence[CacheStore], names: Sequence[str] | None = None):
        tiers = list(tiers)
        if not tiers or not all(isinstance(t, CacheStore) for t in tiers):
            raise ValueError("tiers must be a non-empty sequence of CacheStore, fastest first")
        names = [f"tier{i}" for i in range(len(tiers))] if names is None else list(names)
        if len(names) != len(tiers) or len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"names must be {len(tiers)} distinct non-empty strs, got {names!r}")
        self.tiers = tiers
        self.names = names
        self._lock = threading.Lock()
        self._hits = [0] * len(tiers)
        self._promotions = [0] * len(tiers)  # blobs promoted *into* tier i
        self._misses = 0
        self._failed: set[tuple[int, str]] = set()  # (tier, method) already logged

    # --- guarded tier calls --------------------------------------------------------------------------------
    def _call(self, i: int, method: str, default, *args):
        try:
            return getattr(self.tiers[i], method)(*args)
        except ValueError:
            raise
        except Exception as e:  # a broken tier must not break the engine
            with self._lock:
                first = (i, method) not in self._failed
                self._failed.add((i, method))
            if first:
                log.warning("cache tier %s: %s failed (%s: %s); treating as a miss", self.names[i], method,
                            type(e).__name__, e)
            return default

    def _get_many(self, i: int, keys: list[str]) -> list[PageBlob | None]:
        tier = self.tiers[i]
        if hasattr(tier, "get_many"):
            out = self._call(i, "get_many", None, keys)
            return out if isinstance(out, list) and len(out) == len(keys) else [None] * len(keys)
        return [self._call(i, "get", None, key) for key in keys]

    def _put_many(self, i: int, items: list[tuple[str, PageBlob]]) -> list[bool]:
        tier = self.tiers[i]
        if hasattr(tier, "put_many"):
            out = self._call(i, "put_many", None, items)
            return out if isinstance(out, list) and len(out) == len(items) else [False] * len(items)
        return [bool(self._call(i, "put", False, key, blob)) for key, blob in items]

    # --- CacheStore ----------------------------------------------------------------------------------------
    def contains_prefix(self, hashes: Sequence[str]) -> int:
        hashes = list(hashes)
        covered = 0
        advanced = True
        while advanced and covered < len(hashes):
            advanced = False
            for i in range(len(self.tiers)):
                n = self._call(i, "contains_prefix", 0, hashes[covered:])
                if isinstance(n, int) and n > 0:
                    covered += min(n, len(hashes) - covered)
                    advanced = True
                    if covered == len(hashes):
                        break
        return covered

    def get(self, key: str) -> PageBlob | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[PageBlob | None]:
        """Blobs for `keys` (None where no tier has them): each tier asked once, in order, for what the
        faster tiers lacked; hits promoted into the faster tiers."""
        keys = list(keys)
        out: list[PageBlob | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for i in range(len(self.tiers)):
            if not missing:
                break
            found = self._get_many(i, [keys[j] for j in missing])
            hit = [(j, blob) for j, blob in zip(missing, found) if blob is not None]
            for j, blob in hit:
                out[j] = blob
            if hit and i > 0:
                for faster in range(i):
                    kept = self._put_many(faster, [(keys[j], blob) for j, blob in hit])
                    with self._lock:
                        self._promotions[faster] += sum(kept)
            with self._lock:
                self._hits[i] += len(hit)
            missing = [j for j, blob in zip(missing, found) if blob is None]
        with self._lock:
            self._misses += len(missing)
        return out

    def put(self, key: str, blob: PageBlob) -> bool:
        return self.put_many([(key, blob)])[0]

    def put_many(self, items: Sequence[tuple[str, PageBlob]]) -> list[bool]:
        """Write through to every tier; per item, whether any tier kept it."""
        items = list(items)
        for key, blob in items:
            if not isinstance(key, str) or not key:
                raise ValueError(f"key must be a non-empty str, got {key!r}")
            if not isinstance(blob, PageBlob):
                raise ValueError(f"blob must be a PageBlob, got {type(blob).__name__}")
        kept = [False] * len(items)
        for i in range(len(self.tiers)):
            kept = [a or b for a, b in zip(kept, self._put_many(i, items))]
        return kept

    def clear(self) -> int:
        """Each tier's clear() (the host tier drops its blobs; a shared pool keeps them)."""
        return sum(int(self._call(i, "clear", 0)) for i in range(len(self.tiers)))

    @property
    def capacity_bytes(self) -> int:
        return sum(self._int_attr(i, "capacity_bytes") for i in range(len(self.tiers)))

    @property
    def used_bytes(self) -> int:
        return sum(self._int_attr(i, "used_bytes") for i in range(len(self.tiers)))

    def _int_attr(self, i: int, name: str) -> int:
        try:
            return int(getattr(self.tiers[i], name))
        except Exception:  # a dead tier's size is unknown: count 0
            return 0

    def stats(self) -> dict:
        """hits_by_tier / promotions_by_tier (pages, by tier name), misses (pages no tier had), and each
        tier's own stats() under "tiers"."""
        with self._lock:
            out = {
                "hits_by_tier": dict(zip(self.names, self._hits)),
                "promotions_by_tier": dict(zip(self.names, self._promotions)),
                "misses": self._misses,
            }
        out["tiers"] = {name: (self._call(i, "stats", {}) if hasattr(self.tiers[i], "stats") else {})
                        for i, name in enumerate(self.names)}
        return out


def open_cache_pool(url: str | None, **kwargs) -> CacheStore | None:
    """The shared store named by `url`: "pool://host:port[?...]" (PoolStore, the embedded pool server),
    "mooncake://master_host:port[?...]" (MooncakeStore), or None / "" / "none" (no shared pool).
    Extra kwargs go to the store's constructor. ValueError for anything else."""
    if url is None or url in ("", "none"):
        return None
    if not isinstance(url, str):
        raise ValueError(f"cache pool must be a URL string or None, got {url!r}")
    if url.startswith("pool://"):
        from serving.cache.pool_client import PoolStore

        return PoolStore.from_url(url, **kwargs)
    if url.startswith("mooncake://"):
        from serving.cache.mooncake_store import MooncakeStore

        return MooncakeStore.from_url(url, **kwargs)
    raise ValueError(f"cache pool URL must be pool://host:port, mooncake://host:port or none; got {url!r}")


def make_cache_store(host_cache_gb: float = 0.0, cache_pool: str | None = None) -> CacheStore | None:
    """The store below the device cache: HostStore (host_cache_gb > 0), the shared pool (cache_pool URL),
    both as TieredStore(["host", "shared"]) (the engine's tier names), or None."""
    from serving.cache.host_tier import HostStore

    if not isinstance(host_cache_gb, (int, float)) or host_cache_gb < 0:
        raise ValueError(f"host_cache_gb must be a non-negative number, got {host_cache_gb!r}")
    host = HostStore(host_cache_gb) if host_cache_gb > 0 else None
    pool = open_cache_pool(cache_pool)
    if host is not None and pool is not None:
        return TieredStore([host, pool], names=["host", "shared"])
    return host if host is not None else pool
