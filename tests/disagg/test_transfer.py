"""KV transfer wire format and transports, deployment files, and the router's work estimate (no model).

Run: python -m pytest -q tests/disagg/test_transfer.py
"""

import socket
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from serving.disagg.deploy import load_deployment, worker_argv
from serving.disagg.router import RouterConfig, _Estimate
from serving.disagg.transfer import KVPayload, TransferError, make_transport, read_frame, send_frame

ROOT = Path(__file__).resolve().parents[2]


def payload(room, rng):
    return KVPayload(room=room, request_id=f"r{room}", first_tokens=[int(rng.integers(0, 263))], num_computed=37,
                     cached_tokens=16,
                     arrays={"kv": rng.standard_normal((3, 3, 16, 7)).astype(ml_dtypes.bfloat16),
                             "kda": rng.standard_normal((5, 2, 4, 4)).astype(np.float32),
                             "conv": rng.standard_normal((5, 3, 24)).astype(np.float32)},
                     spec_pending=[4, 5])


@pytest.mark.parametrize("name", ["tcp", "inprocess"])
def test_transport_round_trip_bit_exact(name):
    rng = np.random.default_rng(0)
    sent = {room: payload(room, rng) for room in (7, 2**31 - 2)}
    transport = make_transport(name, timeout_s=5)
    listener = transport.listen(0, lambda room, deadline: sent[room] if room in sent else _no_room(room))
    try:
        for room, want in sent.items():
            got = transport.pull("127.0.0.1", listener.port, room, 5)
            assert (got.room, got.request_id, got.first_tokens, got.num_computed, got.cached_tokens, got.spec_pending) == (
                want.room, want.request_id, want.first_tokens, want.num_computed, want.cached_tokens, want.spec_pending)
            for k, a in want.arrays.items():
                assert got.arrays[k].dtype == a.dtype and got.arrays[k].shape == a.shape
                assert got.arrays[k].tobytes() == a.tobytes()
        with pytest.raises(TransferError, match="room 3"):
            transport.pull("127.0.0.1", listener.port, 3, 5)
    finally:
        listener.close()
    with pytest.raises(TransferError):
        transport.pull("127.0.0.1", listener.port, 7, 1)  # nobody listens any more


def _no_room(room):
    raise TransferError(f"room {room} unknown")


def test_listener_rejects_garbage_and_keeps_serving():
    rng = np.random.default_rng(1)
    transport = make_transport("tcp", timeout_s=2)
    listener = transport.listen(0, lambda room, deadline: payload(room, rng))
    try:
        with socket.create_connection(("127.0.0.1", listener.port), timeout=2) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")  # not a frame: the connection is dropped
            try:
                assert s.recv(100) == b""
            except ConnectionResetError:
                pass
        with socket.create_connection(("127.0.0.1", listener.port), timeout=2) as s:
            send_frame(s, {"op": "push", "room": 1})
            header, _ = read_frame(s)
            assert header["op"] == "error" and "pull" in header["message"]
        assert transport.pull("127.0.0.1", listener.port, 9, 2).room == 9
    finally:
        listener.close()


@pytest.mark.parametrize("arrays", [
    [["kv", "object", [4]]],                        # not a state dtype (would be an object array)
    [["kv", "float32", [1 << 30, 1 << 20]]],        # a garbled shape: refused before allocating 4 PB
    [["kv", "float32", [-3, 2]]],
    [["kv", "float32"]],                            # not a [name, dtype, shape] triple
])
def test_read_frame_refuses_bad_array_specs_before_allocating(arrays):
    import msgpack

    from serving.disagg.transfer import _HEAD, MAGIC

    a, b = socket.socketpair()
    with a, b:
        head = msgpack.packb({"op": "kv", "arrays": arrays}, use_bin_type=True)
        a.sendall(_HEAD.pack(MAGIC, len(head)) + head)
        with pytest.raises(TransferError, match="malformed"):
            read_frame(b)


def test_deployment_files_load_and_reject_mistakes(tmp_path):
    one = load_deployment(ROOT / "configs/deploy/pd-1p1d.yaml")
    two = load_deployment(ROOT / "configs/deploy/pd-2p1d.yaml")
    colo = load_deployment(ROOT / "configs/deploy/colocated.yaml")
    assert [w.role for w in one.workers] == ["prefill", "decode"] and one.disaggregated
    assert [w.role for w in two.workers] == ["prefill", "prefill", "decode"] and not colo.disaggregated
    assert two.pool.port == 7790 and colo.pool is None
    assert worker_argv(two, two.workers[1])[-2:] == ["--cache-pool", "pool://127.0.0.1:7790"]
    rcfg = two.router_config()
    assert rcfg.prefill == (("127.0.0.1:50061", 8998), ("127.0.0.1:50063", 8999)) and rcfg.decode == ("127.0.0.1:50062",)
    argv = worker_argv(one, one.workers[0])
    assert argv[argv.index("--role") + 1] == "prefill" and argv[argv.index("--bootstrap-port") + 1] == "8998"
    for text, needle in (("model: k3-tiny\nworkers: [{role: prefill, grpc_port: 1}]\nrouter: {port: 2}\n", "bootstrap_port"),
                         ("model: k3-tiny\nworkers: [{role: decode, grpc_port: 1}]\nrouter: {port: 2}\n", "prefill and decode"),
                         ("model: k3-tiny\nengine: {page_sise: 16}\nworkers: [{role: both, grpc_port: 1}]\n", "page_sise"),
                         ("model: k3-tiny\nworkers: [{role: both, grpc_port: 5, http_port: 5}]\n", "distinct"),
                         ("workers: [{role: leader, grpc_port: 1}]\n", "role")):
        path = tmp_path / "d.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=needle):
            load_deployment(path)


def test_router_estimates_pool_hits_from_published_prefixes():
    est = _Estimate(page_size=4)
    rng = np.random.default_rng(2)
    turn1 = rng.integers(0, 200, 23).tolist()
    assert est.cached_tokens(turn1) == 0
    est.published(turn1)  # pages up to the last boundary before the final token: 20 tokens
    assert est.cached_tokens(turn1) == 20
    turn2 = turn1 + rng.integers(0, 200, 9).tolist()
    assert est.cached_tokens(turn2) == 20
    other = [turn1[0] + 1] + turn1[1:]
    assert est.cached_tokens(other) == 0  # chained hashes: a different first token shares nothing
    with pytest.raises(ValueError, match="prefill and one decode"):
        RouterConfig(prefill=(), decode=("127.0.0.1:1",))
