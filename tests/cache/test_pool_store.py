"""The embedded cache pool: pool_server.py + PoolStore over TCP loopback.

Run: python -m pytest -q tests/cache/test_pool_store.py
"""

import logging
import signal
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest

from serving.cache import pool_wire as wire
from serving.cache.pool_server import PoolServer
from serving.cache.pool_client import PoolStore, blob_from_bytes, blob_to_bytes
from serving.cache.store import PageBlob

from cache_helpers import assert_same_blob, hash_chain, random_blob, wait_until


def client(server_or_port, **kw) -> PoolStore:
    port = server_or_port if isinstance(server_or_port, int) else server_or_port.port
    return PoolStore("127.0.0.1", port, **kw)


def test_round_trip_of_random_blobs(pool_server, rng):
    """bf16 latents (as uint16 bits and as ml_dtypes bfloat16), fp32 KDA/conv checkpoints, odd shapes,
    with and without checkpoints: every byte comes back, in one batched get with absent keys between."""
    store = client(pool_server)
    keys = hash_chain(rng, 6)
    blobs = [random_blob(rng, checkpoint=i % 2 == 0, layers=int(rng.integers(1, 5)), page=int(rng.integers(1, 9)),
                         width=int(rng.integers(1, 40)), bf16="uint16" if i % 3 else "bfloat16") for i in range(6)]
    assert store.put_many(list(zip(keys, blobs))) == [True] * 6
    asked = [keys[0], "absent-key", keys[3], keys[5], keys[1], keys[2], keys[4]]
    got = store.get_many(asked)
    assert got[1] is None
    for blob, key in zip([got[0], *got[2:]], [keys[0], *asked[2:]]):
        assert_same_blob(blob, blobs[keys.index(key)])
    assert_same_blob(store.get(keys[4]), blobs[4])
    assert store.get("never-put") is None
    assert store.stats()["hits"] == 7 and store.stats()["misses"] == 2
    assert store.used_bytes == sum(b.nbytes for b in blobs) and store.capacity_bytes == 1 << 20
    # the self-contained object encoding (used by MooncakeStore) round-trips too
    assert_same_blob(blob_from_bytes(blob_to_bytes(blobs[0])), blobs[0])


def test_large_batches_survive_partial_sends(rng):
    """Pages of a few MiB, batched past the socket buffers (sendmsg sends them in parts, the reader
    gets them in parts) and split into several requests by max_batch_bytes: every byte comes back."""
    server = PoolServer("127.0.0.1", 0, capacity_bytes=64 << 20)
    server.start_in_thread()
    try:
        store = client(server, max_batch_bytes=5 << 20)
        items = [(f"big-{i}", PageBlob(latents=rng.integers(0, 1 << 16, (3, 1000 + i, 701), dtype=np.uint16)))
                 for i in range(5)]  # ~4 MiB each: 5 requests of one page
        items += [(f"small-{i}", random_blob(rng, checkpoint=True)) for i in range(300)]  # > 512 buffers
        assert store.put_many(items) == [True] * len(items)
        for (key, blob), got in zip(items, store.get_many([k for k, _ in items])):
            assert_same_blob(got, blob)
    finally:
        server.stop()


def test_contains_prefix_counts_the_leading_run(pool_server, rng):
    store = client(pool_server)
    chain = hash_chain(rng, 9)
    blobs = [random_blob(rng, checkpoint=False) for _ in chain]
    assert store.contains_prefix(chain) == 0 and store.contains_prefix([]) == 0
    store.put_many([(chain[i], blobs[i]) for i in (0, 1, 2, 3, 5, 6)])  # page 4 missing
    assert store.contains_prefix(chain) == 4
    assert store.contains_prefix(chain[:3]) == 3
    assert store.contains_prefix(chain[5:]) == 2
    assert store.contains_prefix(chain[4:]) == 0
    store.put(chain[4], blobs[4])
    assert store.contains_prefix(chain) == 7


def test_lru_eviction_at_capacity(rng):
    """Capacity of exactly 4 blobs: the 5th put evicts the least recently *used* one (a get refreshes);
    a blob larger than the pool is refused without evicting; a checkpoint-less put keeps a checkpoint."""
    blob_bytes = random_blob(rng, checkpoint=False).nbytes
    server = PoolServer("127.0.0.1", 0, capacity_bytes=4 * blob_bytes)
    server.start_in_thread()
    try:
        store = client(server)
        keys = [f"page-{i}" for i in range(6)]
        blobs = [random_blob(rng, checkpoint=False) for _ in keys]
        assert store.put_many(list(zip(keys[:4], blobs[:4]))) == [True] * 4
        assert store.get(keys[0]) is not None  # page-0 is now the most recent; page-1 the oldest
        assert store.put(keys[4], blobs[4])
        assert store.get(keys[1]) is None
        for i in (0, 2, 3, 4):
            assert_same_blob(store.get(keys[i]), blobs[i])
        huge = PageBlob(latents=np.ones((4, 4 * blob_bytes // 8 + 1, 1), np.uint16))
        assert not store.put("huge", huge)
        assert store.server_stats()["blobs"] == 4 and store.server_stats()["rejected"] == 1
        # pages are immutable: a later put without a checkpoint keeps the checkpointed blob
        small = random_blob(rng, checkpoint=False, layers=1, page=1, width=2)
        server2 = PoolServer("127.0.0.1", 0, capacity_bytes=1 << 16)
        server2.start_in_thread()
        try:
            other = client(server2)
            with_ckpt = random_blob(rng, checkpoint=True)
            assert other.put("k", small) and other.put("k", with_ckpt) and other.put("k", small)
            assert_same_blob(other.get("k"), with_ckpt)
        finally:
            server2.stop()
    finally:
        server.stop()


def test_concurrent_clients_from_threads(pool_server, rng):
    """8 threads, half sharing one PoolStore and half with their own, put and read back their own pages
    while reading a common chain: no frame is interleaved, every byte matches."""
    shared = client(pool_server)
    common = hash_chain(rng, 5)
    common_blobs = [random_blob(rng, checkpoint=True) for _ in common]
    shared.put_many(list(zip(common, common_blobs)))
    per_thread = [[(f"t{t}-{i}", random_blob(rng, checkpoint=i % 3 == 0)) for i in range(12)] for t in range(8)]
    errors = []

    def work(t):
        try:
            store = shared if t % 2 else client(pool_server)
            for round_ in range(3):
                items = per_thread[t][round_ * 4:(round_ + 1) * 4]
                assert store.put_many(items) == [True] * 4
                assert store.contains_prefix(common) == 5
                for (key, blob), got in zip(items, store.get_many([k for k, _ in items])):
                    assert_same_blob(got, blob)
                assert_same_blob(store.get(common[round_]), common_blobs[round_])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not errors, errors[0]
    assert pool_server.store.stats()["blobs"] == 5 + 8 * 12


def _raw_exchange(port, data: bytes) -> tuple[dict, socket.socket]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(data)
    header, _ = wire.recv_frame(sock, wire.MAX_HEADER_BYTES, 1 << 20)
    return header, sock


def _frame(header, payload=b"", *, magic=wire.MAGIC, header_len=None, payload_len=None) -> bytes:
    body = header if isinstance(header, bytes) else msgpack.packb(header)
    return (struct.pack("!4sIQ", magic, len(body) if header_len is None else header_len,
                        len(payload) if payload_len is None else payload_len) + body + payload)


def test_malformed_requests_get_error_replies_and_the_server_keeps_serving(pool_server, rng):
    store = client(pool_server)
    key, blob = "good", random_blob(rng, checkpoint=True)
    assert store.put(key, blob)
    arrays = [["latents", "uint16", [3, 5, 7], 210]]
    bad_headers = [
        b"\xc1not msgpack",  # 0xc1 is never valid msgpack
        msgpack.packb([1, 2, 3]),  # not a map
        {"op": "explode"},
        {"op": "get_many", "keys": "not-a-list"},
        {"op": "get_many", "keys": [1, 2]},
        {"op": "contains_prefix", "keys": ["x" * 300]},
        {"op": "put_many", "items": [{"key": "a", "arrays": [["latents", "object", [3, 5, 7], 210]]}]},
        {"op": "put_many", "items": [{"key": "a", "arrays": [["latents", "uint16", [3, 5, 7], 999]]}]},
        {"op": "put_many", "items": [{"key": "a", "arrays": [["latents", "uint16", [3, -5, 7], 210]]}]},
        {"op": "put_many", "items": [{"key": "a", "arrays": [["latents", "uint16", [210], 420]]}]},
        {"op": "put_many", "items": [{"key": "a", "arrays": arrays + [["kda", "float32", [2], 8]]}]},  # kda without conv
        {"op": "put_many", "items": [{"key": "a", "arrays": arrays}]},  # payload shorter than described
    ]
    for header in bad_headers:
        # a well-framed bad request: an error reply, and the same connection still serves a ping
        reply, sock = _raw_exchange(pool_server.port, _frame(header, b"\x00" * 10))
        with sock:
            assert reply["ok"] is False and reply["error"], header
            sock.sendall(_frame({"op": "ping"}))
            assert wire.recv_frame(sock, wire.MAX_HEADER_BYTES, 1 << 20)[0] == {"ok": True}
    for data in (_frame({"op": "ping"}, magic=b"HTTP"),  # bad magic
                 _frame({"op": "ping"}, header_len=1 << 30),  # header larger than allowed
                 _frame({"op": "ping"}, payload_len=1 << 40)):  # payload larger than allowed
        # a broken frame: an error reply, then the server closes that connection
        reply, sock = _raw_exchange(pool_server.port, data)
        with sock:
            assert reply["ok"] is False
            assert sock.recv(1) == b""
    with socket.create_connection(("127.0.0.1", pool_server.port), timeout=5) as sock:
        sock.sendall(wire.MAGIC + b"\x00\x00")  # a truncated frame, then hang up
    assert pool_server.store.stats()["bad_requests"] == len(bad_headers) + 3
    assert "a" not in [k for k in pool_server.store._blobs]  # nothing half-stored
    assert_same_blob(store.get(key), blob)  # the server is still up for everyone


def test_dead_server_degrades_to_misses_quickly_then_reconnects(pool_process, rng, caplog):
    """Kill -9 the pool process: calls answer "absent" at once (no exception, a bounded time), the outage
    is logged once; restart it on the same port: the client reconnects after its back-off."""
    proc = pool_process()
    store = client(proc.port, retry_after_s=0.3, connect_timeout_s=0.5)
    chain = hash_chain(rng, 4)
    blobs = [random_blob(rng, checkpoint=True) for _ in chain]
    assert store.put_many(list(zip(chain, blobs))) == [True] * 4
    assert store.contains_prefix(chain) == 4
    proc.kill()
    caplog.set_level(logging.WARNING, logger="serving.cache.pool_client")
    start = time.monotonic()
    for _ in range(20):
        assert store.contains_prefix(chain) == 0
        assert store.get(chain[0]) is None and store.get_many(chain) == [None] * 4
        assert store.put(chain[0], blobs[0]) is False and store.put_many(list(zip(chain, blobs))) == [False] * 4
    elapsed = time.monotonic() - start
    # 100 calls: the first finds the dead socket (reset/EOF, no timeout involved), the rest are skipped
    assert elapsed < 1.0, elapsed
    assert not store.available and store.stats()["skipped_while_down"] > 90
    assert store.used_bytes == 0
    outage_logs = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(outage_logs) == 1
    restarted = pool_process(proc.port)  # a fresh (empty) pool on the same port
    assert wait_until(lambda: store.contains_prefix(chain) == 0 and store.available, timeout_s=5)
    assert store.put(chain[0], blobs[0])
    assert store.contains_prefix(chain) == 1
    assert_same_blob(store.get(chain[0]), blobs[0])
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    restarted.kill()


def test_server_restarted_between_calls_costs_no_misses(pool_process, rng):
    """The pooled connection died with the old server: the next call retries on a fresh connection
    instead of marking the pool down."""
    proc = pool_process()
    store = client(proc.port, retry_after_s=60)
    blob = random_blob(rng, checkpoint=True)
    assert store.put("k", blob)
    proc.kill()
    pool_process(proc.port)
    assert store.put("k", blob) and store.available
    assert_same_blob(store.get("k"), blob)
    assert store.stats()["skipped_while_down"] == 0


def test_hung_server_times_out_into_misses(pool_process, rng):
    """A server that accepts but never answers (SIGSTOP): the call in flight gives up after op_timeout_s,
    later calls answer at once while the pool is marked down; SIGCONT and it serves again."""
    proc = pool_process()
    # the down window (retry_after_s) is long enough that a loaded CI machine cannot let it lapse between the
    # timed-out call and the next ones, which would then wait on the stopped server again; bounds: the first
    # call ends after op_timeout_s and far from a hang, the next ones well inside one op_timeout_s
    store = client(proc.port, op_timeout_s=0.3, retry_after_s=1.5)
    blob = random_blob(rng, checkpoint=False)
    assert store.put("k", blob)
    proc.stop()  # every server thread stopped before the next request is sent
    try:
        start = time.monotonic()
        assert store.get("k") is None
        assert 0.25 < time.monotonic() - start < 1.5
        start = time.monotonic()
        assert store.contains_prefix(["k"]) == 0 and store.get("k") is None
        assert time.monotonic() - start < 0.15
    finally:
        proc.proc.send_signal(signal.SIGCONT)
    assert wait_until(lambda: store.get("k") is not None, timeout_s=5)
    assert_same_blob(store.get("k"), blob)


def test_unreachable_server_and_bad_arguments(rng):
    """Nothing listening: calls answer "absent" within the connect timeout; constructor and URL errors
    are ValueErrors naming the problem; a bad key is a caller bug (ValueError), not a miss."""
    from cache_helpers import free_port

    store = PoolStore.from_url(f"pool://127.0.0.1:{free_port()}?retry_after_s=5&connect_timeout_s=0.2")
    start = time.monotonic()
    assert store.get("k") is None and store.contains_prefix(["k"]) == 0 and not store.put("k", random_blob(rng, checkpoint=False))
    assert time.monotonic() - start < 0.5
    assert store.retry_after_s == 5.0 and store.connect_timeout_s == 0.2
    for url in ("http://127.0.0.1:1", "pool://127.0.0.1", "pool://:80", "pool://h:1/x", "pool://h:1?bogus=1",
                "pool://h:1?retry_after_s=soon"):
        with pytest.raises(ValueError):
            PoolStore.from_url(url)
    with pytest.raises(ValueError, match="port"):
        PoolStore("127.0.0.1", 70000)
    with pytest.raises(ValueError, match="key"):
        store.put("", random_blob(rng, checkpoint=False))
    with pytest.raises(ValueError, match="PageBlob"):
        store.put("k", np.zeros(3))
    with pytest.raises(ValueError, match="dtype"):
        store.put("k", PageBlob(latents=np.zeros((1, 2, 3), np.complex64)))
    with pytest.raises(ValueError, match="capacity"):
        PoolServer(capacity_bytes=0)


def test_namespaces_separate_models_on_one_pool(pool_server, rng):
    a = PoolStore.from_url(f"pool://127.0.0.1:{pool_server.port}?namespace=model-a/")
    b = client(pool_server, namespace="model-b/")
    blob = random_blob(rng, checkpoint=False)
    assert a.put("h", blob)
    assert b.get("h") is None and b.contains_prefix(["h"]) == 0
    assert_same_blob(a.get("h"), blob)
