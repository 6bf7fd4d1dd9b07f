"""TieredStore([host L2, shared pool]): promotion, per-tier counters, a chain split across tiers, a dead
lower tier; and the URL constructors the engine/CLI pick a store with.

Run: python -m pytest -q tests/cache/test_tiered_store.py
"""

import logging

import numpy as np
import pytest

from cache_helpers import assert_same_blob, hash_chain, random_blob
from serving.cache import HostStore, PoolStore, TieredStore, make_cache_store, open_cache_pool
from serving.cache.store import CacheStore


def tiers(pool_server, host_bytes=1 << 20, **pool_kw):
    host = HostStore(capacity_bytes=host_bytes)
    pool = PoolStore("127.0.0.1", pool_server.port, **pool_kw)
    return host, pool, TieredStore([host, pool], names=["host", "pool"])


def test_get_promotes_pool_hits_into_the_host_tier(pool_server, rng):
    host, pool, store = tiers(pool_server)
    chain = hash_chain(rng, 6)
    blobs = [random_blob(rng, checkpoint=i in (2, 5)) for i in range(6)]
    # another worker published pages 0..5 to the pool; this worker's host tier has only 0 and 1
    assert pool.put_many(list(zip(chain, blobs))) == [True] * 6
    host.put(chain[0], blobs[0])
    host.put(chain[1], blobs[1])
    got = store.get_many(chain + ["absent"])
    for g, b in zip(got, blobs):
        assert_same_blob(g, b)
    assert got[6] is None
    stats = store.stats()
    assert stats["hits_by_tier"] == {"host": 2, "pool": 4} and stats["misses"] == 1
    assert stats["promotions_by_tier"] == {"host": 4, "pool": 0}
    assert host.contains_prefix(chain) == 6  # promoted: the next read is local
    for key, blob in zip(chain, blobs):
        assert_same_blob(store.get(key), blob)
    assert store.stats()["hits_by_tier"] == {"host": 8, "pool": 4}
    assert stats["tiers"]["pool"]["hits"] == 4 and stats["tiers"]["host"]["hits"] == 2


def test_put_writes_through_and_contains_prefix_spans_tiers(pool_server, rng):
    host, pool, store = tiers(pool_server)
    chain = hash_chain(rng, 7)
    blobs = [random_blob(rng, checkpoint=False) for _ in chain]
    assert store.put(chain[0], blobs[0])
    assert host.contains_prefix(chain) == 1 and pool.contains_prefix(chain) == 1
    # pages 1-2 only on the host, 3-4 only in the pool, 5 on the host again, 6 nowhere:
    # together they cover 0..5, more than either tier alone
    host.put(chain[1], blobs[1]), host.put(chain[2], blobs[2]), host.put(chain[5], blobs[5])
    pool.put_many([(chain[3], blobs[3]), (chain[4], blobs[4])])
    assert host.contains_prefix(chain) == 3 and pool.contains_prefix(chain) == 1
    assert store.contains_prefix(chain) == 6
    assert store.contains_prefix(chain[3:]) == 3 and store.contains_prefix([]) == 0
    assert store.capacity_bytes == host.capacity_bytes + pool.capacity_bytes
    assert store.used_bytes == host.used_bytes + pool.used_bytes
    # clear(): the host tier drops its blobs, the shared pool keeps what other workers rely on
    assert store.clear() == 4 and host.used_bytes == 0 and pool.contains_prefix(chain) == 1


def test_dead_pool_tier_leaves_the_host_tier_serving(pool_server, rng, caplog):
    host, pool, store = tiers(pool_server, retry_after_s=60)
    chain = hash_chain(rng, 4)
    blobs = [random_blob(rng, checkpoint=True) for _ in chain]
    assert store.put_many(list(zip(chain[:2], blobs[:2]))) == [True, True]
    pool.put_many(list(zip(chain[2:], blobs[2:])))
    pool_server.stop()
    # host pages still hit, pool-only pages miss, puts keep a local copy; nothing raises
    assert store.contains_prefix(chain) == 2
    got = store.get_many(chain)
    assert_same_blob(got[0], blobs[0]) and assert_same_blob(got[1], blobs[1])
    assert got[2] is None and got[3] is None
    extra = random_blob(rng, checkpoint=False)
    assert store.put("later", extra) and pool.stats()["available"] == 0
    assert_same_blob(store.get("later"), extra)
    assert store.used_bytes == host.used_bytes  # the dead pool counts 0


class _BrokenTier(CacheStore):
    """A tier whose every call raises (a backend without its own degradation)."""

    def contains_prefix(self, hashes):
        raise RuntimeError("backend exploded")

    get = put = contains_prefix

    @property
    def capacity_bytes(self):
        raise RuntimeError("backend exploded")

    used_bytes = capacity_bytes


def test_a_raising_tier_counts_as_misses_and_is_logged_once(rng, caplog):
    host = HostStore(capacity_bytes=1 << 20)
    store = TieredStore([host, _BrokenTier()], names=["host", "remote"])
    caplog.set_level(logging.WARNING, logger="serving.cache.tiered")
    blob = random_blob(rng, checkpoint=False)
    for _ in range(3):
        assert store.put("k", blob) and store.get("absent") is None and store.contains_prefix(["k", "x"]) == 1
    assert_same_blob(store.get("k"), blob)
    assert store.capacity_bytes == host.capacity_bytes
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 3 and all("remote" in m for m in logged)  # once each for put, get, contains_prefix
    with pytest.raises(ValueError, match="key"):
        store.put("", blob)  # a caller bug still surfaces


def test_constructors_from_urls(pool_server):
    assert open_cache_pool(None) is None and open_cache_pool("none") is None and open_cache_pool("") is None
    pool = open_cache_pool(f"pool://127.0.0.1:{pool_server.port}?namespace=m1/")
    assert isinstance(pool, PoolStore) and pool.namespace == "m1/" and pool.capacity_bytes == 1 << 20
    for bad in ("redis://x:1", "pool:/x", 42):
        with pytest.raises(ValueError):
            open_cache_pool(bad)
    assert make_cache_store() is None
    assert isinstance(make_cache_store(host_cache_gb=0.001), HostStore)
    assert isinstance(make_cache_store(cache_pool=f"pool://127.0.0.1:{pool_server.port}"), PoolStore)
    both = make_cache_store(0.001, f"pool://127.0.0.1:{pool_server.port}")
    assert isinstance(both, TieredStore) and both.names == ["host", "shared"]
    with pytest.raises(ValueError, match="host_cache_gb"):
        make_cache_store(-1)
    with pytest.raises(ValueError, match="tiers"):
        TieredStore([])
    with pytest.raises(ValueError, match="names"):
        TieredStore([HostStore(capacity_bytes=10), HostStore(capacity_bytes=10)], names=["a", "a"])
    rng = np.random.default_rng(3)
    assert both.put("k", random_blob(rng, checkpoint=False))
