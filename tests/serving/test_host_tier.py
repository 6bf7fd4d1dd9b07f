"""HostStore: LRU by bytes, capacity, checkpoint-keeping puts, counters, thread safety.

Run: `python -m pytest tests/serving/test_host_tier.py -q`
"""

import threading

import numpy as np
import pytest

from serving.cache import CacheStore, HostStore, PageBlob


def blob(nbytes: int, checkpoint: bool = False, fill: int = 0) -> PageBlob:
    """A blob of exactly `nbytes` latents bytes (+ 16 checkpoint bytes when asked)."""
    latents = np.full((1, 1, nbytes), fill, dtype=np.uint8)
    if not checkpoint:
        return PageBlob(latents)
    return PageBlob(latents, kda=np.zeros(2, np.float32), conv=np.zeros(4, np.uint16))


def test_page_blob():
    b = PageBlob(np.zeros((24, 16, 576), np.uint16))
    assert b.nbytes == 24 * 16 * 576 * 2 and not b.has_checkpoint
    c = blob(10, checkpoint=True)
    assert c.nbytes == 10 + 8 + 8 and c.has_checkpoint
    with pytest.raises(ValueError):
        PageBlob(np.zeros((16, 576)))
    with pytest.raises(ValueError):
        PageBlob(np.zeros((1, 1, 1)), kda=np.zeros(1))  # conv missing


def test_put_get_and_lru_eviction_by_bytes():
    store = HostStore(capacity_bytes=100)
    assert isinstance(store, CacheStore) and store.capacity_bytes == 100
    assert store.put("a", blob(40)) and store.put("b", blob(40))
    assert store.get("a") is not None  # a is now more recent than b
    assert store.put("c", blob(30))  # 110 > 100: evicts b, the least recently used
    assert "b" not in store and "a" in store and "c" in store
    assert store.used_bytes == 70
    assert store.put("d", blob(80))  # 110 > 100: evicts a; 110 > 100 again: evicts c
    assert len(store) == 1 and store.used_bytes == 80
    st = store.stats()
    assert (st["hits"], st["evictions"], st["blobs"], st["used_bytes"]) == (1, 3, 1, 80)
    store.check_integrity()


def test_blob_larger_than_capacity_is_rejected_without_evicting():
    store = HostStore(capacity_bytes=100)
    store.put("a", blob(50))
    assert store.put("huge", blob(101)) is False
    assert "a" in store and "huge" not in store and store.used_bytes == 50
    assert store.stats()["rejected"] == 1
    assert store.put("exact", blob(100))  # exactly the capacity fits (evicting a)
    store.check_integrity()


def test_put_existing_key_replaces_but_keeps_a_checkpoint():
    store = HostStore(capacity_bytes=1000)
    store.put("k", blob(10))
    store.put("k", blob(10, checkpoint=True))
    assert store.get("k").has_checkpoint and store.used_bytes == 26
    assert store.put("k", blob(10))  # no checkpoint: the stored one (with checkpoint) is kept
    assert store.get("k").has_checkpoint and store.used_bytes == 26
    store.put("k", blob(10, checkpoint=True, fill=7))
    assert store.get("k").latents[0, 0, 0] == 7 and len(store) == 1
    store.check_integrity()


def test_contains_prefix_and_counters():
    store = HostStore(capacity_gb=1e-6)  # ~1 KiB
    assert store.capacity_bytes == int(1e-6 * (1 << 30))
    for k in "abd":
        store.put(k, blob(8))
    assert store.contains_prefix(["a", "b", "c", "d"]) == 2
    assert store.contains_prefix(["x", "a"]) == 0
    assert store.contains_prefix([]) == 0
    assert store.get("c") is None and store.get("a") is not None
    st = store.stats()
    assert (st["hits"], st["misses"], st["blobs"]) == (1, 1, 3)


def test_bad_input():
    with pytest.raises(ValueError):
        HostStore()
    with pytest.raises(ValueError):
        HostStore(1.0, capacity_bytes=10)
    with pytest.raises(ValueError):
        HostStore(capacity_gb=0)
    store = HostStore(capacity_bytes=10)
    with pytest.raises(ValueError):
        store.put("", blob(1))
    with pytest.raises(ValueError):
        store.put("a", np.zeros(3))


def test_concurrent_puts_and_gets_keep_accounting_exact():
    store = HostStore(capacity_bytes=4000)

    def worker(seed: int):
        rng = np.random.default_rng(seed)
        for _ in range(400):
            key = f"k{rng.integers(64)}"
            if rng.random() < 0.5:
                store.put(key, blob(int(rng.integers(1, 200)), checkpoint=bool(rng.random() < 0.3)))
            else:
                store.get(key)
            store.contains_prefix([f"k{i}" for i in range(4)])

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.check_integrity()
    assert 0 < store.used_bytes <= 4000
