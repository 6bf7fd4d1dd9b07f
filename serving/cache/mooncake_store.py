"""`MooncakeStore`: a `CacheStore` over Mooncake Store (`mooncake_master` + `MooncakeDistributedStore`),
for cache pools that span hosts. TCP transport, P2PHANDSHAKE metadata (no metadata server needed).

    store = MooncakeStore.from_url("mooncake://127.0.0.1:50051?segment_mb=1024")
    # needs `pip install mooncake-transfer-engine-non-cuda` and libibverbs1: scripts/extras/mooncake.sh

Encoding: one Mooncake object per page key, `pool_client.blob_to_bytes` (frame prefix + msgpack descriptor
+ raw array bytes), not separate objects for latents and checkpoint. Why one object:
- a page and its checkpoint are evicted together, so a hit never finds half a page (latents without the
  KDA state the engine restores with it, or the reverse);
- `contains_prefix` is one `batch_is_exist` over one key per page, and `get_many` one `get_batch`;
- the contract's "keep an existing checkpoint when the new blob has none" maps onto Mooncake itself:
  `put` of an existing key keeps the old object (verified on 0.3.13.post1), and a blob *with* a checkpoint
  is written with `upsert`, which replaces a checkpoint-less one. The cost is that a checkpoint-less put
  cannot shrink an object that has one, which the contract allows.
Mooncake object keys are `<namespace><page hash>`: give each model (and page layout) its own namespace
when several share a master, since page hashes name tokens, not models.

Degradation: every call is guarded. A failed call (an RPC error code such as -900, or an exception)
answers "absent" (0 / None / False) and marks the store down; while down, calls answer "absent" without
touching Mooncake. A background thread probes the master every `retry_after_s` (a plain TCP connect,
then one Mooncake call once the port accepts) and marks the store up again when it answers; a restarted
master is picked up by the same client. The outage is logged once when it starts and once when it ends.
Known limit: Mooncake's client holds the GIL inside its calls, and the first call made while the master
is dying can block for ~4 s (its own reconnect) before it fails; after that the store is marked down and
nothing blocks again until the master is back. Mooncake's own eviction is asynchronous (a
watermark, objects under a lease): a put into a full store is refused (False) until it has made room.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

from serving.cache.pool_client import blob_from_bytes, blob_to_bytes, parse_host_port
from serving.cache.store import CacheStore, PageBlob

log = logging.getLogger(__name__)

_MIB = 1 << 20
_MIN_SEGMENT_BYTES = 16 * _MIB  # Mooncake refuses smaller segments ("Total size must be at least 16777216")
_PROBE_KEY = "k3jax-probe"


def import_mooncake_store():
    """The `MooncakeDistributedStore` class; ImportError with the install command if mooncake is absent."""
    _add_unpacked_libibverbs()
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError(
            "MooncakeStore needs Mooncake: `bash scripts/extras/mooncake.sh` (pip "
            "mooncake-transfer-engine-non-cuda==0.3.13.post1 and libibverbs1); import failed: " + str(e)
        ) from e
    return MooncakeDistributedStore


def _unpacked_lib_dirs() -> list[str]:
    import glob
    import sys

    return sorted(glob.glob(os.path.join(sys.prefix, "mooncake-libs", "usr", "lib", "*"))
                  + glob.glob(os.path.join(sys.prefix, "mooncake-libs", "lib", "*")))


def mooncake_master_command() -> list[str] | None:
    """argv prefix that runs `mooncake_master` (the console script next to this interpreter, else on
    PATH), or None if Mooncake is not installed."""
    import shutil
    import sys

    local = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if os.path.exists(local):
        return [local]
    found = shutil.which("mooncake_master")
    return [found] if found else None


def mooncake_env(base: dict | None = None) -> dict:
    """Environment for a `mooncake_master` subprocess: LD_LIBRARY_PATH gains the libibverbs1 that
    scripts/extras/mooncake.sh unpacked when apt could not install it."""
    env = dict(os.environ if base is None else base)
    dirs = _unpacked_lib_dirs()
    if dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dirs + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    return env


def _add_unpacked_libibverbs() -> None:
    """scripts/extras/mooncake.sh unpacks libibverbs1 into .venv/mooncake-libs when apt cannot install it;
    preload it so store.so resolves (LD_LIBRARY_PATH is read at process start, too late here)."""
    import ctypes
    import glob
    import sys

    for pattern in ("usr/lib/*/libnl-3.so.200", "lib/*/libnl-3.so.200", "usr/lib/*/libnl-route-3.so.200",
                    "lib/*/libnl-route-3.so.200", "usr/lib/*/libibverbs.so.1", "lib/*/libibverbs.so.1"):
        for path in glob.glob(os.path.join(sys.prefix, "mooncake-libs", pattern)):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass


class MooncakeStore(CacheStore):
    """Mooncake Store as a `CacheStore` (see module doc). Thread-safe; never raises once constructed.

    master: "host:port" of mooncake_master's RPC address.
    global_segment_bytes: host memory this process contributes to the pool (>= 16 MiB; 0 with
        `segment_required=False` only if other clients contribute).
    local_buffer_bytes: this client's staging buffer; a single get/put moves at most this much.
    """

    tier = "shared"  # how the engine labels hits from this store (stats: prefix_hit_tokens_by_tier)

    def __init__(self, master: str = "127.0.0.1:50051", *, local_hostname: str = "127.0.0.1",
                 metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp",
                 global_segment_bytes: int = 512 * _MIB, local_buffer_bytes: int = 128 * _MIB,
                 namespace: str = "", retry_after_s: float = 2.0):
        if not isinstance(master, str) or ":" not in master:
            raise ValueError(f"master must be 'host:port', got {master!r}")
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if not isinstance(global_segment_bytes, int) or not (global_segment_bytes == 0 or global_segment_bytes >= _MIN_SEGMENT_BYTES):
            raise ValueError(f"global_segment_bytes must be 0 or >= {_MIN_SEGMENT_BYTES}, got {global_segment_bytes!r}")
        if not isinstance(local_buffer_bytes, int) or local_buffer_bytes < _MIN_SEGMENT_BYTES:
            raise ValueError(f"local_buffer_bytes must be an int >= {_MIN_SEGMENT_BYTES}, got {local_buffer_bytes!r}")
        if not isinstance(namespace, str) or len(namespace) > 128:
            raise ValueError(f"namespace must be a str of at most 128 chars, got {namespace!r}")
        if not isinstance(retry_after_s, (int, float)) or not retry_after_s > 0:
            raise ValueError(f"retry_after_s must be a positive number, got {retry_after_s!r}")
        store_cls = import_mooncake_store()
        self.master = master
        self.namespace = namespace
        self.retry_after_s = float(retry_after_s)
        self._capacity = global_segment_bytes
        self._store = store_cls()
        rc = self._store.setup({
            "local_hostname": local_hostname, "metadata_server": metadata_server,
            "global_segment_size": global_segment_bytes, "local_buffer_size": local_buffer_bytes,
            "protocol": protocol, "master_server_addr": master,
        })
        if rc != 0:
            raise ConnectionError(f"MooncakeDistributedStore.setup failed (rc={rc}) for master {master}: is "
                                  f"mooncake_master running there?")
        self._lock = threading.Lock()
        self._down = False
        self._closed = False
        self._counts = dict(hits=0, misses=0, puts=0, stored=0, errors=0, skipped_while_down=0, reread=0)

    @classmethod
    def from_url(cls, url: str, **kwargs) -> "MooncakeStore":
        """`mooncake://master_host:port[?segment_mb=..&buffer_mb=..&namespace=..&local_hostname=..
        &metadata_server=..&protocol=..&retry_after_s=..]`."""
        host, port, query = parse_host_port(url, "mooncake")
        converters = {"segment_mb": ("global_segment_bytes", lambda v: int(float(v) * _MIB)),
                      "buffer_mb": ("local_buffer_bytes", lambda v: int(float(v) * _MIB)),
                      "namespace": ("namespace", str), "local_hostname": ("local_hostname", str),
                      "metadata_server": ("metadata_server", str), "protocol": ("protocol", str),
                      "retry_after_s": ("retry_after_s", float)}
        for key, value in query.items():
            if key not in converters:
                raise ValueError(f"unknown mooncake URL option {key!r} in {url!r} (known: {sorted(converters)})")
            name, convert = converters[key]
            try:
                kwargs.setdefault(name, convert(value))
            except ValueError:
                raise ValueError(f"mooncake URL option {key}={value!r} is not valid") from None
        return cls(f"{host}:{port}", **kwargs)

    def __repr__(self) -> str:
        return f"MooncakeStore(mooncake://{self.master}, namespace={self.namespace!r})"

    # --- degradation -----------------------------------------------------------------------------------
    def _usable(self) -> bool:
        with self._lock:
            if self._down or self._closed:
                self._counts["skipped_while_down"] += 1
                return False
            return True

    def _mark_down(self, reason: str) -> None:
        with self._lock:
            if self._down or self._closed:
                return
            self._down = True
            self._counts["errors"] += 1
        log.warning("mooncake store %s unavailable (%s): answering 'absent', probing every %.1f s",
                    self.master, reason, self.retry_after_s)
        threading.Thread(target=self._probe_until_up, name="mooncake-probe", daemon=True).start()

    def _probe_until_up(self) -> None:
        """Every retry_after_s: a plain TCP connect to the master first (Mooncake's client holds the GIL
        while it retries a dead master, for seconds, which would stall every engine thread), then one
        batch_is_exist through Mooncake once the port accepts."""
        import socket

        host, port = self.master.rsplit(":", 1)
        while True:
            time.sleep(self.retry_after_s)
            with self._lock:
                if self._closed:
                    return
            try:
                socket.create_connection((host, int(port)), timeout=1.0).close()
            except OSError:
                continue
            try:
                ok = self._store.batch_is_exist([_PROBE_KEY])[0] >= 0
            except Exception:
                ok = False
            if ok:
                with self._lock:
                    self._down = False
                log.warning("mooncake store %s reachable again", self.master)
                return

    def _guard(self, what: str, fn, *args):
        """fn(*args), or None after marking the store down if it raises."""
        try:
            return fn(*args)
        except Exception as e:  # the binding raises RuntimeError & co.; none may reach the engine
            self._mark_down(f"{what}: {type(e).__name__}: {e}")
            return None

    # --- CacheStore ------------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty str, got {key!r}")
        return self.namespace + key

    def contains_prefix(self, hashes: Sequence[str]) -> int:
        keys = [self._key(h) for h in hashes]
        if not keys or not self._usable():
            return 0
        flags = self._guard("batch_is_exist", self._store.batch_is_exist, keys)
        if flags is None:
            return 0
        if any(f < 0 for f in flags):  # an RPC error code (e.g. -900: master gone)
            self._mark_down(f"batch_is_exist returned {min(flags)}")
        n = 0
        for f in flags:
            if f != 1:
                break
            n += 1
        return n

    def get(self, key: str) -> PageBlob | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[PageBlob | None]:
        """Blobs for `keys` (None where absent) in one `get_batch`."""
        full = [self._key(k) for k in keys]
        out: list[PageBlob | None] = [None] * len(full)
        if full and self._usable():
            # each key once: get_batch with a repeated key returned a truncated copy for one of them
            unique = list(dict.fromkeys(full))
            blobs: dict[str, PageBlob] = {}
            self._get_into(blobs, unique)
            missing = [key for key in unique if key not in blobs]
            if missing:
                # b"" is "absent" and also "failed": a dead master, or a read that outlived its lease (Mooncake's
                # LEASE_EXPIRED, seen on a loaded 2-core CI machine). Objects that exist get one more read.
                flags = self._guard("batch_is_exist", self._store.batch_is_exist, missing)
                if flags and min(flags) < 0:
                    self._mark_down(f"batch_is_exist returned {min(flags)}")
                elif flags:
                    again = [key for key, flag in zip(missing, flags) if flag == 1]
                    if again:
                        with self._lock:
                            self._counts["reread"] += len(again)
                        self._get_into(blobs, again)
            out = [blobs.get(key) for key in full]
        with self._lock:
            found = sum(b is not None for b in out)
            self._counts["hits"] += found
            self._counts["misses"] += len(out) - found
        return out

    def _get_into(self, blobs: dict[str, PageBlob], keys: list[str]) -> None:
        """One get_batch of `keys` (each once); the non-empty answers decoded into `blobs`."""
        values = self._guard("get_batch", self._store.get_batch, keys)
        if values is None or len(values) != len(keys):
            return
        for key, data in zip(keys, values):
            if data:
                try:
                    blobs[key] = blob_from_bytes(data)
                except ValueError as e:
                    log.error("mooncake object %s is not a page blob: %s", key, e)

    def put(self, key: str, blob: PageBlob) -> bool:
        return self.put_many([(key, blob)])[0]

    def put_many(self, items: Sequence[tuple[str, PageBlob]]) -> list[bool]:
        """Store each (key, blob): blobs without a checkpoint with `put_batch` (an existing object wins),
        blobs with one with `upsert_batch`. Per item, whether Mooncake kept it."""
        encoded = [(self._key(key), blob_to_bytes(blob), blob.has_checkpoint) for key, blob in items]
        stored = [False] * len(encoded)
        if encoded and self._usable():
            for with_ckpt, write in ((False, self._store.put_batch), (True, self._store.upsert_batch)):
                idx = [i for i, e in enumerate(encoded) if e[2] == with_ckpt]
                if not idx:
                    continue
                rc = self._guard("put", write, [encoded[i][0] for i in idx], [encoded[i][1] for i in idx])
                if rc is None:
                    break
                if rc == 0:
                    for i in idx:
                        stored[i] = True
                    continue
                if rc == -900:  # RPC_FAIL: the master is gone
                    self._mark_down("put returned RPC_FAIL")
                    break
                # a partial failure (store full: -200, object too large: -600): which ones went in?
                flags = self._guard("batch_is_exist", self._store.batch_is_exist, [encoded[i][0] for i in idx]) or []
                for i, f in zip(idx, flags):
                    stored[i] = f == 1
        with self._lock:
            self._counts["puts"] += len(stored)
            self._counts["stored"] += sum(stored)
        return stored

    # clear(): the CacheStore default (drops nothing): other workers rely on the shared pool.

    @property
    def capacity_bytes(self) -> int:
        """The memory this client contributes (global_segment_bytes); the pool may hold more."""
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Not reported by the client API: 0 (the master's metrics endpoint has pool-wide usage)."""
        return 0

    @property
    def available(self) -> bool:
        with self._lock:
            return not self._down

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "available": int(not self._down)}

    def close(self) -> None:
        """Unmount this client's segment and close (about a second). While the master is down Mooncake's
        close blocks for many seconds holding the GIL, so a down store is abandoned instead: its client
        stays referenced (never destroyed) and the process keeps its segment until it exits."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            down = self._down
        if down:
            _ABANDONED.append(self._store)
        else:
            self._guard("close", self._store.close)


_ABANDONED: list = []  # clients closed while their master was down (see MooncakeStore.close)
