"""Two `Engine`s (k3-tiny, CPU) sharing one pool, through `Engine(store=...)` with write-through at
publication, for each backend (the embedded pool server; Mooncake with a real mooncake_master): a
session's turn 2 on the other engine is served from the shared pool; then the pool dies and the first
engine serves turn 2 from its own device cache, with the same greedy output. All engines have the same
pool sizes and bucket shapes, so they share one set of compiled programs.

Issue 7's acceptance for both pool backends, so CI runs it (slow: ~50 s of CPU per backend for the
k3-tiny engines; the Mooncake case skips with a reason when mooncake is not installed).

Run: python -m pytest -q tests/cache/test_shared_pool_engine.py
"""

import jax
import numpy as np
import pytest

import k3jax
from cache_helpers import Master
from serving.cache import MooncakeStore, PoolStore
from serving.cache.mooncake_store import import_mooncake_store
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams

# one row bucket, one token bucket: every compile counts on 2 CPU cores. tests/disagg's sizes (test_roles.SIZES,
# test_deployment.ENGINE): its engines and workers load these programs from the run's XLA cache
SIZES = dict(page_size=16, num_pages=96, num_slots=24, max_running=1, max_prefill_tokens=16, max_model_len=512,
             bucket_growth=64)
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
pytestmark = pytest.mark.slow  # two k3-tiny engines per backend (~50 s CPU); issue 7's acceptance, so CI runs it


@pytest.fixture(scope="module")
def model():
    cfg = k3jax.load_config("k3-tiny")
    return cfg, k3jax.init_params(cfg, jax.random.key(0))


def engine(model, store=None, **kw):
    cfg, params = model
    return Engine(EngineConfig(**SIZES, **kw), cfg=cfg, params=params, store=store)


@pytest.fixture(params=["pool", "mooncake"])
def backend(request, pool_server):
    """(make a store client, kill the pool)."""
    if request.param == "pool":
        yield (lambda: PoolStore("127.0.0.1", pool_server.port)), pool_server.stop
        return
    try:
        import_mooncake_store()
    except ImportError as e:
        pytest.skip(f"Mooncake not installed: {e}")
    master = Master()
    clients = []

    def make():
        clients.append(MooncakeStore(f"127.0.0.1:{master.port}", global_segment_bytes=32 << 20,
                                     local_buffer_bytes=16 << 20))
        return clients[-1]

    yield make, master.kill
    master.kill()
    for c in clients:
        c.close()


def test_turn_two_on_another_engine_hits_the_shared_pool_and_a_dead_pool_degrades(model, backend):
    make_store, kill_pool = backend
    rng = np.random.default_rng(17)
    turn1 = rng.integers(0, 256, 150).tolist()
    shared_a, shared_b = make_store(), make_store()
    a = engine(model, store=shared_a, store_write_through=True)
    b = engine(model, store=shared_b, store_write_through=True)
    out1 = a.generate([turn1], GREEDY, sessions=["s"])[0]
    assert shared_a.contains_prefix(_hashes(turn1)) == len(turn1) // 16  # published at once, not at eviction

    turn2 = turn1 + out1 + rng.integers(0, 256, 9).tolist()
    out2_b = b.generate([turn2], GREEDY, sessions=["s"])[0]
    by_tier = b.stats()["prefix_hit_tokens_by_tier"]
    assert by_tier["shared"] >= 0.9 * len(turn2) - SIZES["page_size"], (by_tier, len(turn2))
    assert by_tier["device"] == 0 and shared_b.stats()["hits"] > 0

    # the pool server dies: engine a keeps serving (its device cache holds turn 1) and agrees with b,
    # which computed turn 2 on pages restored from the pool
    kill_pool()
    assert a.generate([turn2], GREEDY, sessions=["s"])[0] == out2_b
    assert not shared_a.available and a.stats()["prefix_hit_tokens_by_tier"]["device"] > 0
    for e in (a, b):
        e.check_integrity()


def _hashes(tokens):
    from serving.cache.hashing import prefix_hashes

    return prefix_hashes(tokens, SIZES["page_size"])
