"""Engine behaviour on k3-tiny (CPU): greedy equivalences, prefix-cache reuse across turns, a random
workload with aborts and preemptions, and input validation.

Run: python -m pytest tests/serving/test_engine.py -q
"""

import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
import serving.runner as runner_module
from k3jax.sampling import sample
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


# the `make_engine` fixture's defaults (tests/serving/conftest.py); few shape buckets: each costs a CPU compile
ENGINE_OPTS = dict(page_size=4, num_pages=96, num_slots=24, max_running=4, max_prefill_tokens=32, max_model_len=128,
                   bucket_growth=64)


def argmax_chain(model, prompt, n):
    """Greedy continuation computed independently with the cache-free forward pass (right-padded to a
    fixed length: causal, so the padding cannot affect earlier positions, and one compile serves all)."""
    cfg, params = model
    ids = list(prompt)
    for _ in range(n):
        padded = np.full((1, 64), cfg.pad_token_id, np.int32)
        padded[0, : len(ids)] = ids
        logits = k3jax.forward(params, cfg, jnp.asarray(padded))
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    return ids[len(prompt):]


def prompts(seed, n, lo=3, hi=30, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(lo, hi)).tolist() for _ in range(n)]


def test_greedy_matches_forward_argmax(model, make_engine):
    engine = make_engine()
    ps = prompts(0, 3)
    outs = engine.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o == argmax_chain(model, p, 6)
    engine.check_integrity()


def test_a_reused_slot_does_not_leak_its_previous_state(model, make_engine):
    """A cache-miss request on a slot that served another request (3 slots, 5 requests, one at a time)
    still decodes its own greedy chain: the engine never clears slots, the model starts context 0 at zero."""
    engine = make_engine(num_slots=3, max_running=1, prefix_cache=False)
    ps = prompts(7, 5, lo=9, hi=26)
    outs = [engine.generate([p], GREEDY)[0] for p in ps]
    assert outs[-1] == argmax_chain(model, ps[-1], 6) and outs[-2] == argmax_chain(model, ps[-2], 6)
    engine.check_integrity()


@pytest.mark.parametrize("budget", [4, 12])
def test_chunked_prefill_budgets_and_cache_do_not_change_greedy_outputs(make_engine, budget):
    ps = prompts(1, 5)
    base = make_engine(prefix_cache=False, max_prefill_tokens=64).generate(ps, GREEDY)
    engine = make_engine(max_prefill_tokens=budget)
    assert engine.generate(ps, GREEDY) == base
    # the same prompts again: now served from the prefix cache, still the same tokens
    assert engine.generate(ps, GREEDY) == base
    assert engine.stats()["prefix_hit_tokens"] > 0
    engine.check_integrity()


def test_multi_turn_session_reuses_history(make_engine):
    engine = make_engine(max_prefill_tokens=64)
    history = prompts(2, 1, 40, 41)[0]
    for turn in range(3):
        before = engine.kv.hit_tokens
        [out] = engine.generate([history], SamplingParams(max_tokens=9, ignore_eos=True), sessions=["agent-1"])
        hit = engine.kv.hit_tokens - before
        if turn >= 1:
            # everything up to the last full page of the previous turn's (prompt + output) is cached
            assert hit >= 0.9 * len(history) - engine.ecfg.page_size, (turn, hit, len(history))
        history = history + out + prompts(10 + turn, 1, 5, 6)[0]
    engine.check_integrity()


def test_history_evicted_to_host_tier_comes_back(make_engine):
    """Turn 2 after the device cache was emptied: the history is restored from the host L2 tier, the hit
    is attributed to it, and greedy outputs equal a cache-free engine's."""
    engine = make_engine(host_cache_gb=0.01, max_prefill_tokens=64)
    plain = make_engine(prefix_cache=False, max_prefill_tokens=64)
    history = prompts(7, 1, 37, 38)[0]
    sp = SamplingParams(max_tokens=7, ignore_eos=True)
    [out] = engine.generate([history], sp, sessions=["agent-2"])
    assert out == plain.generate([history], sp)[0]
    engine.kv.prefix.evict(engine.kv.pages.size, engine.kv.slots.size)  # push everything to L2
    assert len(engine.kv.prefix) == 0 and engine.kv.store.used_bytes > 0
    turn2 = history + out + [9, 8, 7]
    before = engine.kv.hit_tokens
    [out2] = engine.generate([turn2], sp, sessions=["agent-2"])
    hit = engine.kv.hit_tokens - before
    assert hit >= 0.9 * len(turn2) - engine.ecfg.page_size
    assert engine.kv.store_hit_tokens == hit
    assert out2 == plain.generate([turn2], sp)[0]
    engine.check_integrity()


def test_preemption_keeps_greedy_outputs(make_engine):
    ps = prompts(3, 4, 20, 30)
    base = make_engine().generate(ps, SamplingParams(max_tokens=12, ignore_eos=True))
    tight = make_engine(num_pages=34, max_running=4)  # 4 requests x ~10 pages do not fit at once
    assert tight.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True)) == base
    assert tight.counters["preemptions"] > 0
    tight.check_integrity()


def test_random_workload_with_aborts_ends_clean(make_engine):
    rng = np.random.default_rng(4)
    engine = make_engine(num_pages=34, max_running=4)  # test_preemption_keeps_greedy_outputs's pool: its programs
    live = []
    for step in range(120):
        if rng.random() < 0.3 and len(live) < 10:
            p = rng.integers(0, 256, rng.integers(2, 40)).tolist()
            sp = SamplingParams(max_tokens=int(rng.integers(1, 10)), temperature=float(rng.choice([0, 0.8])),
                                seed=int(rng.integers(1 << 30)), ignore_eos=bool(rng.random() < 0.5))
            live.append(engine.add_request(p, sp, session=f"s{rng.integers(3)}"))
        if rng.random() < 0.1 and live:
            engine.abort(live[rng.integers(len(live))])
        engine.step()
        engine.check_integrity()
        live = [r for r in live if not engine.requests[r].is_finished]
    for r in live:
        engine.abort(r)
    assert not engine.scheduler.has_work
    engine.kv.prefix.clear()
    engine.check_integrity()
    assert engine.kv.pages.num_used == 0 and engine.kv.slots.num_used == 0


@pytest.mark.parametrize(
    "prompt,sampling",
    [
        ([], SamplingParams()),
        ([1, 2, 10_000], SamplingParams()),
        ([1, -1], SamplingParams()),
        (list(range(120)), SamplingParams(max_tokens=20)),  # over max_model_len 128
    ],
)
def test_bad_requests_raise_and_engine_keeps_serving(make_engine, prompt, sampling):
    engine = make_engine()
    with pytest.raises(ValueError):
        engine.add_request(prompt, sampling)
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    engine.check_integrity()


def test_bad_sampling_params_raise():
    for bad in (dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=-1), dict(temperature=-0.1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_stream_yields_the_generate_tokens(model, make_engine):
    engine = make_engine()
    p = prompts(5, 1)[0]
    streamed = [t for chunk in engine.stream(p, GREEDY) for t in chunk]
    assert streamed == argmax_chain(model, p, 6)


def test_stop_strings_and_stop_ids(model, make_engine):
    """A byte-level detokenizer; the greedy chain's text is cut at a stop string taken from its middle."""
    detok = lambda ids: "".join(chr(65 + i % 26) for i in ids)
    cfg, params = model
    engine = Engine(EngineConfig(**ENGINE_OPTS), cfg=cfg, params=params, detokenize=detok)  # make_engine's programs
    p = prompts(8, 1)[0]
    chain = argmax_chain(model, p, 6)
    stop = detok(chain[2:4])
    rid = engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True, stop=(stop,)))
    engine.run_until_done([rid])
    req = engine.requests[rid]
    assert req.finish_reason == "stop" and req.output_ids == chain[: len(req.output_ids)]
    assert stop in detok(req.output_ids) and len(req.output_ids) <= 4
    rid = engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=(chain[1],)))
    engine.run_until_done([rid])
    assert engine.requests[rid].output_ids == chain[: chain.index(chain[1]) + 1]
    plain = make_engine()
    with pytest.raises(ValueError, match="tokenizer"):
        plain.add_request(p, SamplingParams(stop=("x",)))


def test_steady_state_never_recompiles(make_engine):
    """After warm-up (every rows x tokens x pages bucket), serving a mixed workload compiles nothing."""
    engine = make_engine()
    assert engine.runner.warmup() == len(engine.runner.row_buckets) * len(engine.runner.page_buckets) * (
        1 + len(engine.runner.token_buckets))
    programs = lambda: (k3jax.prefill._cache_size(), k3jax.decode._cache_size(), sample._cache_size(),
                        runner_module._take_rows._cache_size())
    sizes = programs()
    engine.generate(prompts(12, 7, 2, 60), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.generate(prompts(13, 2, 2, 10), SamplingParams(max_tokens=3, temperature=0.9, seed=3))
    # 1, 2 and 3 prompts finish in one step (3: a padded bucket): the sampler sees row buckets, never a count of prompts
    engine.generate(prompts(14, 11, 3, 9), SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9, seed=4))
    assert programs() == sizes
