"""`HostStore`: the host-memory (L2) `CacheStore`, least recently used out first, bounded in bytes.

- `put` of a blob larger than the whole capacity is rejected (returns False, nothing evicted).
- Otherwise `put` evicts least recently used blobs until the new one fits, then stores it as most
  recently used. A put for a key already present refreshes it; the new blob replaces the old unless
  it has no KDA checkpoint and the old one has (pages are immutable: the latents are the same, and a
  checkpoint is worth keeping).
- `get` refreshes recency and counts a hit or a miss; `contains_prefix` only looks.
- One lock guards everything: the engine copies pages in from a background thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from serving.cache.page_allocator import IntegrityError
from serving.cache.store import CacheStore, PageBlob

_GIB = 1 << 30


class HostStore(CacheStore):
    """Blobs in host memory, LRU by bytes. Give `capacity_gb` (GiB, 2**30) or `capacity_bytes`."""

    def __init__(self, capacity_gb: float | None = None, *, capacity_bytes: int | None = None):
        if (capacity_gb is None) == (capacity_bytes is None):
            raise ValueError("give exactly one of capacity_gb and capacity_bytes")
        if capacity_bytes is None:
            if not isinstance(capacity_gb, (int, float)) or not capacity_gb > 0:
                raise ValueError(f"capacity_gb must be a positive number, got {capacity_gb!r}")
            capacity_bytes = int(capacity_gb * _GIB)
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self._capacity = capacity_bytes
        self._blobs: OrderedDict[str, PageBlob] = OrderedDict()  # oldest first
        self._used = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._rejected = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._blobs)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._blobs

    def clear(self) -> int:
        with self._lock:
            n = len(self._blobs)
            self._blobs.clear()
            self._used = 0
            return n

    def contains_prefix(self, hashes: Sequence[str]) -> int:
        with self._lock:
            n = 0
            for key in hashes:
                if key not in self._blobs:
                    break
                n += 1
            return n

    def get(self, key: str) -> PageBlob | None:
        with self._lock:
            blob = self._blobs.get(key)
            if blob is None:
                self._misses += 1
                return None
            self._hits += 1
            self._blobs.move_to_end(key)
            return blob

    def put(self, key: str, blob: PageBlob) -> bool:
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty str, got {key!r}")
        if not isinstance(blob, PageBlob):
            raise ValueError(f"blob must be a PageBlob, got {type(blob).__name__}")
        with self._lock:
            old = self._blobs.get(key)
            if old is not None and old.has_checkpoint and not blob.has_checkpoint:
                self._blobs.move_to_end(key)
                return True
            if blob.nbytes > self._capacity:
                self._rejected += 1
                return False
            if old is not None:
                del self._blobs[key]
                self._used -= old.nbytes
            while self._used + blob.nbytes > self._capacity:
                _, evicted = self._blobs.popitem(last=False)
                self._used -= evicted.nbytes
                self._evictions += 1
            self._blobs[key] = blob
            self._used += blob.nbytes
            return True

    def stats(self) -> dict[str, int]:
        """Counters for metrics: hits/misses of `get`, blobs evicted by `put`, puts rejected."""
        with self._lock:
            return {
                "blobs": len(self._blobs),
                "used_bytes": self._used,
                "capacity_bytes": self._capacity,
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
                "rejected": self._rejected,
            }

    def check_integrity(self) -> None:
        """Raise `IntegrityError` unless used_bytes is the sum of the blobs and within capacity."""
        with self._lock:
            total = sum(b.nbytes for b in self._blobs.values())
            if total != self._used:
                raise IntegrityError(f"host store used_bytes {self._used} != sum of blobs {total}")
            if self._used > self._capacity:
                raise IntegrityError(f"host store over capacity: {self._used} > {self._capacity}")
