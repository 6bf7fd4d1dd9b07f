"""Page/slot allocators, the device prefix cache with KDA checkpoints, and the tiers below it.

    page_allocator.py  PageAllocator (MLA pages), SlotPool (KDA state rows): refcounted id pools
    hashing.py         page_hash / prefix_hashes: chained SHA-256 page keys, shared by all tiers
    prefix_cache.py    PrefixCache: the device tier (pages + KDA checkpoints, locking, eviction)
    store.py           CacheStore: interface of the tiers below the device; PageBlob: one page
    host_tier.py       HostStore: the host-memory LRU tier

Pure Python + numpy: the engine does the device copies (`PrefixCache.on_evict`, its own loads).
"""

from serving.cache.hashing import page_hash, prefix_hashes
from serving.cache.host_tier import HostStore
from serving.cache.page_allocator import (
    IntegrityError,
    OutOfPages,
    OutOfResources,
    OutOfSlots,
    PageAllocator,
    RefCountedPool,
    SlotPool,
)
from serving.cache.prefix_cache import CacheEntry, InsertResult, PrefixCache, PrefixHit
from serving.cache.store import CacheStore, PageBlob

__all__ = [
    "CacheEntry",
    "CacheStore",
    "HostStore",
    "InsertResult",
    "IntegrityError",
    "OutOfPages",
    "OutOfResources",
    "OutOfSlots",
    "PageAllocator",
    "PageBlob",
    "PrefixCache",
    "PrefixHit",
    "RefCountedPool",
    "SlotPool",
    "page_hash",
    "prefix_hashes",
]
