"""MooncakeStore against a real `mooncake_master` started here (TCP loopback, P2PHANDSHAKE, free ports).
Skips with the reason when Mooncake is not installed (scripts/extras/mooncake.sh installs it).

Run: python -m pytest -q tests/cache/test_mooncake_store.py
"""

import logging
import threading
import time

import numpy as np
import pytest

from cache_helpers import Master, assert_same_blob, hash_chain, random_blob, wait_until
from serving.cache.mooncake_store import MooncakeStore, import_mooncake_store, mooncake_master_command
from serving.cache.store import PageBlob

try:
    import_mooncake_store()
    _MISSING = None if mooncake_master_command() else "mooncake_master not found"
except ImportError as e:
    _MISSING = f"Mooncake not installed (bash scripts/extras/mooncake.sh): {e}"
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))

_MIB = 1 << 20


@pytest.fixture(scope="module")
def master():
    m = Master()
    yield m
    m.kill()


@pytest.fixture(scope="module")
def store(master):
    s = MooncakeStore(f"127.0.0.1:{master.port}", global_segment_bytes=64 * _MIB, local_buffer_bytes=16 * _MIB,
                      namespace="test/")
    yield s
    s.close()


def test_round_trip_and_checkpoint_semantics(store, rng):
    keys = hash_chain(rng, 5)
    blobs = [random_blob(rng, checkpoint=i % 2 == 1, layers=int(rng.integers(1, 5)), page=int(rng.integers(1, 9)),
                         width=int(rng.integers(1, 40)), bf16="uint16" if i % 2 else "bfloat16") for i in range(5)]
    assert store.put_many(list(zip(keys, blobs))) == [True] * 5
    got = store.get_many([keys[3], "absent", *keys])
    assert got[1] is None
    assert_same_blob(got[0], blobs[3])
    for g, b in zip(got[2:], blobs):
        assert_same_blob(g, b)
    # immutable pages: a checkpoint-less put keeps the checkpointed object; a checkpoint upgrades one
    assert store.put(keys[1], random_blob(rng, checkpoint=False))
    assert_same_blob(store.get(keys[1]), blobs[1])
    upgraded = random_blob(rng, checkpoint=True)
    assert store.put(keys[0], upgraded)
    assert_same_blob(store.get(keys[0]), upgraded)


def test_contains_prefix_on_partial_chains(store, rng):
    chain = hash_chain(rng, 8)
    assert store.contains_prefix(chain) == 0 and store.contains_prefix([]) == 0
    store.put_many([(chain[i], random_blob(rng, checkpoint=i == 5)) for i in (0, 1, 2, 4, 5)])
    assert store.contains_prefix(chain) == 3
    assert store.contains_prefix(chain[4:]) == 2
    store.put(chain[3], random_blob(rng, checkpoint=False))
    assert store.contains_prefix(chain) == 6


def test_concurrent_threads(store, rng):
    per_thread = [[(f"t{t}-{i}-{rng.integers(1 << 30)}", random_blob(rng, checkpoint=i % 2 == 0)) for i in range(6)]
                  for t in range(6)]
    errors = []

    def work(items):
        try:
            assert store.put_many(items) == [True] * len(items)
            for (key, blob), got in zip(items, store.get_many([k for k, _ in items])):
                assert_same_blob(got, blob)
            assert store.contains_prefix([k for k, _ in items]) == len(items)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(items,)) for items in per_thread]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not errors, errors[0]


def test_a_put_larger_than_the_buffer_is_refused_not_raised(store):
    big = PageBlob(latents=np.ones((1, 12 * _MIB, 1), np.uint16))  # 24 MiB: more than the 16 MiB local buffer
    assert store.put("too-big", big) is False
    assert store.get("too-big") is None and store.available


def test_a_read_that_fails_for_an_object_that_exists_is_made_once_more(store, rng, monkeypatch):
    """get_batch answers b"" for a failed read as for an absent key (LEASE_EXPIRED when the client outlived its read
    lease on a loaded CI machine, which cost a shared-pool hit): objects that exist are read once more, absent keys
    are not, and nothing is marked down."""
    keys = hash_chain(rng, 3)
    blobs = [random_blob(rng, checkpoint=i == 1) for i in range(3)]
    assert store.put_many(list(zip(keys, blobs))) == [True] * 3
    real = store._store
    calls = []

    class FirstReadOfKey1Fails:  # the binding's attributes are read-only: wrap the client instead
        def __getattr__(self, name):
            return getattr(real, name)

        def get_batch(self, batch):
            calls.append(list(batch))
            values = real.get_batch(batch)
            return [b"" if len(calls) == 1 and k == store.namespace + keys[1] else v for k, v in zip(batch, values)]

    monkeypatch.setattr(store, "_store", FirstReadOfKey1Fails())
    before = store.stats()["reread"]
    got = store.get_many([keys[0], keys[1], "absent", keys[2]])
    assert got[2] is None
    for g, b in zip([got[0], got[1], got[3]], blobs):
        assert_same_blob(g, b)
    assert calls[1] == [store.namespace + keys[1]]  # the re-read: key 1 only, not the absent key
    assert len(calls) == 2 and store.stats()["reread"] == before + 1 and store.available


def test_dead_master_degrades_to_misses_quickly_then_recovers(rng, caplog):
    """Its own master, killed: calls answer "absent" without raising and, once the store is marked down,
    without calling into Mooncake at all; logged once. A master restarted on the same port is picked up
    by the background probe and the same client serves again."""
    master = Master()
    store = MooncakeStore(f"127.0.0.1:{master.port}", global_segment_bytes=16 * _MIB, local_buffer_bytes=16 * _MIB,
                          retry_after_s=0.2)
    try:
        chain = hash_chain(rng, 3)
        blob = random_blob(rng, checkpoint=True)
        assert store.put(chain[0], blob) and store.contains_prefix(chain) == 1
        master.kill()
        time.sleep(0.3)  # dead, not dying: see the module doc of mooncake_store on the first call
        caplog.set_level(logging.WARNING, logger="serving.cache.mooncake_store")
        assert store.get(chain[0]) is None and not store.available  # a get alone notices the outage
        start = time.monotonic()
        for _ in range(20):
            assert store.contains_prefix(chain) == 0
            assert store.get(chain[0]) is None
            assert store.put(chain[1], blob) is False
        assert time.monotonic() - start < 1.0
        assert not store.available and store.stats()["skipped_while_down"] >= 55
        assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
        master = Master(port=master.port)  # a fresh, empty master where the old one was
        assert wait_until(lambda: store.available, timeout_s=5)
        assert store.contains_prefix(chain) == 0  # the old master's objects died with it
        # puts succeed once the client has re-mounted its segment on the new master (its heartbeat)
        assert wait_until(lambda: store.put(chain[1], blob), timeout_s=10, interval_s=0.1)
        assert_same_blob(store.get(chain[1]), blob)
    finally:
        store.close()
        master.kill()


def test_url_and_constructor_errors(master):
    with pytest.raises(ValueError, match="mooncake://"):
        MooncakeStore.from_url("pool://127.0.0.1:1")
    with pytest.raises(ValueError, match="unknown mooncake URL option"):
        MooncakeStore.from_url(f"mooncake://127.0.0.1:{master.port}?segment=1")
    with pytest.raises(ValueError, match="global_segment_bytes"):
        MooncakeStore(f"127.0.0.1:{master.port}", global_segment_bytes=1 * _MIB)
    s = MooncakeStore.from_url(f"mooncake://127.0.0.1:{master.port}?segment_mb=16&buffer_mb=16&namespace=u/")
    try:
        assert s.capacity_bytes == 16 * _MIB and s.namespace == "u/"
    finally:
        s.close()
