"""Prefill/decode roles in one process (k3-tiny, CPU): a prefill Engine and a decode Engine paired by
bootstrap room, driven step by step on this thread, against a colocated Engine with the same weights.

Covers: greedy equality over both transports (tcp loopback and in-process), independent admission
(decode saturated: prefill keeps computing and holds finished prompts; backpressure at the bound),
an unpaired prefill freed after its timeout, a failed pull ending its request with an error, and a
second turn on another prefill worker hitting the shared pool server (write-through at publication).
Every engine has the same pool sizes and bucket shapes, so they share one set of compiled programs.

Run: python -m pytest -q tests/disagg/test_roles.py
"""

import itertools
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import k3jax
from serving.config import EngineConfig
from serving.disagg.roles import Bootstrap
from serving.engine import Engine
from serving.request import SamplingParams

SIZES = dict(page_size=16, num_pages=96, num_slots=24, max_running=1, max_prefill_tokens=16, max_model_len=512,
             bucket_growth=64)  # one row bucket, one token bucket: every compile counts on 2 CPU cores
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
_rooms = itertools.count(1000)


@pytest.fixture(scope="module")
def model(shared_compile_cache):
    cfg = k3jax.load_config("k3-tiny")
    return cfg, k3jax.init_params(cfg, jax.random.key(0))


def engine(model, **kw):
    cfg, params = model
    store = kw.pop("store", None)
    return Engine(EngineConfig(**SIZES, **kw), cfg=cfg, params=params, store=store)


@pytest.fixture(scope="module")
def colocated(model):
    return engine(model)


def prompts(seed, n, lo=5, hi=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def submit(prefill, decode, prompt, sampling=GREEDY, rid=None):
    """Both legs of one request, as the gateway sends them: same id, same room."""
    room = next(_rooms)
    rid = rid or f"r{room}"
    boot = Bootstrap("127.0.0.1", prefill.disagg.port, room)
    prefill.add_request(prompt, sampling, request_id=rid, bootstrap=boot)
    decode.add_request(prompt, sampling, request_id=rid, bootstrap=boot)
    return rid


def drive(engines, rids, decode, timeout=120.0, until=None):
    """Steps every engine in turn until the decode engine finished `rids` (or `until()` holds)."""
    deadline = time.monotonic() + timeout
    outputs = {}
    while not (until() if until else all(decode.requests[r].is_finished for r in rids)):
        for e in engines:
            for out in e.step():
                if e is decode:
                    outputs.setdefault(out.request_id, []).append(out)
        assert time.monotonic() < deadline, "P/D pair made no progress"
    return outputs


def reference(colocated, ps, sampling=GREEDY):
    return colocated.generate(ps, sampling)


@pytest.mark.parametrize("transport", ["tcp", "inprocess"])
def test_pd_pair_matches_colocated(model, colocated, transport):
    ps = prompts(1, 4)
    want = reference(colocated, ps)
    prefill = engine(model, role="prefill", disagg_transport=transport)
    decode = engine(model, role="decode", disagg_transport=transport)
    rids = [submit(prefill, decode, p) for p in ps]
    drive([prefill, decode], rids, decode)
    assert [decode.requests[r].output_ids for r in rids] == want
    # the prefill leg ends with the first token; its state went to the decode worker and was freed
    assert [prefill.requests[r].output_ids for r in rids] == [w[:1] for w in want]
    assert not prefill.disagg.held and prefill.stats()["disagg"]["handoff_sent"] == 4
    stats = decode.stats()["disagg"]
    assert stats["kv_transfers"] == 4 and stats["kv_transfer_bytes_received"] > 0
    for e in (prefill, decode):
        e.check_integrity()
        assert not e.scheduler.running
        e.close()


def test_independent_admission_and_backpressure(model, colocated):
    """Decode holds one long request (max_running=1): the prefill worker still computes the others and
    holds them finished, until its bound (handoff_max_held=2) stops admission; all then complete."""
    long_sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    ps = prompts(2, 4)
    want = reference(colocated, ps[:1], long_sampling) + reference(colocated, ps[1:])
    prefill = engine(model, role="prefill", handoff_max_held=2)
    decode = engine(model, role="decode")
    rids = [submit(prefill, decode, ps[0], long_sampling)] + [submit(prefill, decode, p) for p in ps[1:]]
    # until decode starts the long one and prefill holds two finished prompts
    drive([prefill, decode], rids, decode, until=lambda: len(prefill.disagg.held) == 2)
    assert decode.requests[rids[0]].num_output < 40  # decode is still busy with the first
    assert len(decode.disagg.awaiting) == 3 and not decode.disagg.inflight  # no room: nothing reserved
    for _ in range(5):  # backpressure: the fourth prompt is not admitted while two are held
        prefill.step()
    assert len(prefill.scheduler.waiting) == 1 and len(prefill.disagg.held) == 2
    prefill.check_integrity()
    drive([prefill, decode], rids, decode)
    assert [decode.requests[r].output_ids for r in rids] == want
    for e in (prefill, decode):
        e.check_integrity()
        e.close()


def test_unpaired_prefill_is_freed_after_timeout(model):
    prefill = engine(model, role="prefill", handoff_timeout_s=0.3)
    used_before = prefill.kv.pages.num_used
    rid = prefill.add_request(prompts(3, 1, 40, 41)[0], GREEDY, bootstrap=Bootstrap("127.0.0.1", 1, 77))
    while not prefill.requests[rid].is_finished:
        prefill.step()
    assert 77 in prefill.disagg.held and prefill.requests[rid].pages  # held: its pages stay allocated
    prefill.check_integrity()
    time.sleep(0.35)
    prefill.step()
    assert not prefill.disagg.held and prefill.stats()["disagg"]["handoff_expired"] == 1
    assert not prefill.requests[rid].pages
    # what stays allocated is the prefix cache's (its published prompt prefix), nothing of the request
    assert prefill.kv.pages.num_used - used_before == len(prefill.kv.prefix)
    prefill.check_integrity()
    prefill.close()


def test_failed_pull_ends_request_with_error(model):
    decode = engine(model, role="decode", transfer_timeout_s=2.0)
    free = decode.kv.pages.num_free, decode.kv.slots.num_free
    rid = decode.add_request(prompts(4, 1)[0], GREEDY, bootstrap=Bootstrap("127.0.0.1", 9, 5))  # nobody listens
    outs = drive([decode], [rid], decode, timeout=30)[rid]
    assert outs[-1].finished and outs[-1].finish_reason == "abort" and "room 5" in outs[-1].error
    assert (decode.kv.pages.num_free, decode.kv.slots.num_free) == free
    decode.check_integrity()


@pytest.fixture(scope="module")
def pool_server():
    """The embedded pool server (serving.cache.pool_server) in its own process, as a deployment runs it."""
    proc = subprocess.Popen([sys.executable, "-m", "serving.cache.pool_server", "--port", "0", "--capacity-gb", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not lines or "pool-server listening on" not in lines[-1]:  # (runpy may warn first)
            lines.append(proc.stdout.readline())
            assert lines[-1] or proc.poll() is None, lines
        yield "pool://" + lines[-1].split("listening on ")[1].split()[0]
    finally:
        proc.terminate()
        proc.wait(10)


def test_turn_two_on_another_prefill_worker_hits_the_shared_pool(model, colocated, pool_server):
    """Each prefill worker has its own PoolStore client of one pool server; turn 1 runs on p0, turn 2
    (turn 1 + its answer + a new message) on p1, whose device cache has never seen the session."""
    from serving.cache.pool_client import PoolStore

    p0, p1 = (engine(model, role="prefill", store=PoolStore.from_url(pool_server)) for _ in range(2))
    decode = engine(model, role="decode", store=PoolStore.from_url(pool_server))
    turn1 = prompts(5, 1, 300, 301)[0]
    [r1] = [submit(p0, decode, turn1)]
    drive([p0, decode], [r1], decode)
    turn2 = turn1 + decode.requests[r1].output_ids + prompts(6, 1, 10, 11)[0]
    r2 = submit(p1, decode, turn2)
    drive([p1, decode], [r2], decode)
    cached = p1.requests[r2].num_cached_tokens
    assert cached / len(turn2) >= 0.9, (cached, len(turn2))
    by_tier = p1.stats()["prefix_hit_tokens_by_tier"]
    assert by_tier["shared"] == cached and by_tier["device"] == 0
    assert decode.requests[r2].output_ids == reference(colocated, [turn2])[0]
    for e in (p0, p1, decode):
        e.check_integrity()
        e.close()
