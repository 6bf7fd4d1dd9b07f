"""Page/slot allocators, the device prefix cache with KDA checkpoints, and the tiers below it.

    page_allocator.py  PageAllocator (MLA pages), SlotPool (KDA state rows): refcounted id pools
    hashing.py         page_hash / prefix_hashes: chained SHA-256 page keys, shared by all tiers
    prefix_cache.py    PrefixCache: the device tier (pages + KDA checkpoints, locking, eviction)
    store.py           CacheStore: interface of the tiers below the device; PageBlob: one page
    host_tier.py       HostStore: the host-memory LRU tier
    pool_wire.py       the pool's wire format (frames, blob descriptors; also used by the KV transfer)
    pool_server.py     the shared cache pool server (TCP, one per host; `python -m serving.cache.pool_server`)
    pool_client.py     PoolStore: the CacheStore of that server (pool://host:port)
    mooncake_store.py  MooncakeStore: the CacheStore over Mooncake Store (mooncake://master:port)
    tiered.py          TieredStore (host L2 + shared pool), open_cache_pool(url), make_cache_store(...)

Pure Python + numpy: the engine does the device copies (`PrefixCache.on_evict`, its own loads).
"""

from serving.cache.hashing import page_hash, prefix_hashes
from serving.cache.host_tier import HostStore
from serving.cache.mooncake_store import MooncakeStore
from serving.cache.page_allocator import (
    IntegrityError,
    OutOfPages,
    OutOfResources,
    OutOfSlots,
    PageAllocator,
    RefCountedPool,
    SlotPool,
)
from serving.cache.pool_client import PoolStore
from serving.cache.prefix_cache import CacheEntry, InsertResult, PrefixCache, PrefixHit
from serving.cache.store import CacheStore, PageBlob
from serving.cache.tiered import TieredStore, make_cache_store, open_cache_pool

__all__ = [
    "CacheEntry",
    "CacheStore",
    "HostStore",
    "InsertResult",
    "IntegrityError",
    "MooncakeStore",
    "OutOfPages",
    "OutOfResources",
    "OutOfSlots",
    "PageAllocator",
    "PageBlob",
    "PoolStore",
    "PrefixCache",
    "PrefixHit",
    "RefCountedPool",
    "SlotPool",
    "TieredStore",
    "make_cache_store",
    "open_cache_pool",
    "page_hash",
    "prefix_hashes",
]
