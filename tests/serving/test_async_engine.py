"""AsyncEngine on k3-tiny (CPU): concurrent streams match the synchronous engine token for token, abort
mid-stream frees the request's memory, bad requests fail alone while others run, overload and drain.

Run: python -m pytest -q tests/serving/test_async_engine.py
"""

import asyncio
import threading

import numpy as np
import pytest

from serving.async_engine import AsyncEngine, EngineOverloaded, EngineStopped
from serving.request import SamplingParams

GREEDY = SamplingParams(max_tokens=7, ignore_eos=True)


# The `make_engine` fixture's defaults (tests/serving/conftest.py). Few shape buckets, each a CPU compile:
# rows {1, 2} x prefill tokens {16} x pages {1, 8}; prompts are longer than a page, so only the 8-page bucket
# is used.
ENGINE_OPTS = dict(page_size=16, num_pages=64, num_slots=24, max_running=2, max_prefill_tokens=16, max_model_len=128,
                   bucket_growth=64)


def prompts(seed, n, lo=17, hi=50):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, rng.integers(lo, hi)).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def served(make_engine):
    """One engine for the module: reference outputs computed synchronously first, then served async."""
    engine = make_engine()
    ps = prompts(0, 5)
    expected = engine.generate(ps, GREEDY)
    ae = AsyncEngine(engine, max_pending=6).start()
    yield ae, ps, expected
    ae.stop(drain=False, timeout=10)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def test_concurrent_streams_match_sync_engine(served):
    ae, ps, expected = served

    async def one(p):
        chunks = [c async for c in ae.stream(p, GREEDY)]
        return chunks

    async def main():
        return await asyncio.gather(*(one(p) for p in ps))

    results = run(main())
    for p, chunks, exp in zip(ps, results, expected):
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == exp
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert not any(c.finished for c in chunks[:-1])
        assert chunks[-1].prompt_tokens == len(p) and chunks[-1].completion_tokens == len(exp)
        # the sync run cached these prompts' full pages: the second time is a prefix hit
        assert chunks[-1].cached_tokens == (len(p) - 1) // 16 * 16
    assert ae.num_live == 0


def test_abort_mid_stream_frees_memory(served):
    ae, ps, _ = served
    aborted_before = ae.stats()["aborted"]

    async def main():
        handle = await ae.submit(prompts(9, 1, 20, 21)[0], SamplingParams(max_tokens=40, ignore_eos=True))
        got = []
        async for chunk in handle:
            got.append(chunk)
            if len(got) == 2:
                handle.abort()
        return got

    got = run(main())
    assert got[-1].finished and got[-1].finish_reason == "abort"
    assert 2 <= sum(len(c.token_ids) for c in got) < 40

    def check(engine):
        engine.check_integrity()
        return engine.kv.pages.num_used, engine.kv.slots.num_used, engine.stats()

    pages, slots, stats = run(ae.run(check))
    # no request holds memory any more: every page and slot still in use belongs to the prefix cache (the
    # engine publishes a prompt's checkpoint while the request runs, so the cache may keep that part)
    assert stats["aborted"] == aborted_before + 1 and stats["running"] == 0 and stats["waiting"] == 0
    assert pages == stats["prefix_cache"]["cached_pages"] and slots == stats["prefix_cache"]["checkpoints"]
    assert run(ae.run(lambda e: e.requests)) == {}


def test_bad_requests_fail_alone_while_others_run(served):
    ae, ps, expected = served

    async def main():
        good = [asyncio.create_task(ae.generate(p, GREEDY)) for p in ps[:3]]
        await asyncio.sleep(0.01)
        errors = []
        for bad in ([1, 2, 999], [], "abc"):  # out of vocab, empty, not ids
            with pytest.raises(ValueError) as e:
                await ae.submit(bad, GREEDY)
            errors.append(str(e.value))
        with pytest.raises(ValueError, match="max_model_len"):
            await ae.submit([5] * 125, SamplingParams(max_tokens=4))
        # passes the up-front checks, fails inside Engine.add_request on the engine thread (no detokenizer)
        with pytest.raises(ValueError, match="stop strings"):
            await ae.submit([1, 2, 3], SamplingParams(max_tokens=4, stop=("x",)))
        long_running = await ae.submit(prompts(3, 1)[0], SamplingParams(max_tokens=30, ignore_eos=True), request_id="dup")
        with pytest.raises(ValueError, match="duplicate"):
            await ae.submit([1, 2], GREEDY, request_id="dup")
        long_running.abort()
        return await asyncio.gather(*good), errors

    outs, errors = run(main())
    assert outs == expected[:3]
    assert "vocab_size" in errors[0] and "empty" in errors[1]
    assert ae.health() == (True, "ok") and ae.num_live == 0


def test_prefill_in_hand_counts_requests_the_engine_has_not_yet_answered(served):
    """What the KV-event heartbeat reports between engine steps: requests count from submission (even while
    the engine thread is busy and has not taken them), their prompts until their first token."""
    ae, ps, _ = served
    release = threading.Event()
    blocker = ae.call(lambda engine: release.wait(30))  # the engine thread, busy as in a long compile

    async def main():
        tasks = [asyncio.create_task(ae.submit(p, SamplingParams(max_tokens=30, ignore_eos=True))) for p in ps[:2]]
        while ae.num_live < 2:
            await asyncio.sleep(0.01)
        held = ae.prefill_in_hand()
        release.set()
        handles = await asyncio.gather(*tasks)
        first = [await h.__aiter__().__anext__() for h in handles]  # both have produced a token
        mid = ae.prefill_in_hand()
        for h in handles:
            h.abort()
        while ae.num_live:
            await asyncio.sleep(0.01)
        return held, first, mid

    held, first, mid = run(main())
    blocker.result(timeout=5)
    assert held == (2, len(ps[0]) + len(ps[1]))
    assert all(c.token_ids for c in first) and mid == (2, 0)
    assert ae.prefill_in_hand() == (0, 0)


def test_overload_and_reset_prefix_cache(served):
    ae, ps, _ = served

    async def main():
        handles = [await ae.submit(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in ps[:5]]
        handles.append(await ae.submit(ps[0], SamplingParams(max_tokens=40, ignore_eos=True)))
        with pytest.raises(EngineOverloaded):
            await ae.submit(ps[1], GREEDY)
        # not idle: a reset that may not wait fails instead of dropping pages under live requests
        with pytest.raises(TimeoutError):
            await asyncio.wrap_future(ae.reset_prefix_cache(timeout=0.0))
        for h in handles:
            h.abort()
        while ae.num_live:
            await asyncio.sleep(0.01)
        return await asyncio.wrap_future(ae.reset_prefix_cache(timeout=5.0))

    removed = run(main())
    assert removed > 0
    stats = run(ae.run(lambda e: e.stats()))
    assert stats["prefix_cache"]["cached_pages"] == 0


def test_stop_drains_running_requests(make_engine):
    ae = AsyncEngine(make_engine()).start()
    done = threading.Event()

    async def main():
        handle = await ae.submit(prompts(4, 1)[0], SamplingParams(max_tokens=12, ignore_eos=True))
        stopper = threading.Thread(target=lambda: (ae.stop(drain=True, timeout=60), done.set()))
        stopper.start()
        chunks = [c async for c in handle]
        with pytest.raises(EngineStopped):
            await ae.submit([1, 2, 3], GREEDY)
        await asyncio.to_thread(stopper.join, 60)
        return chunks

    chunks = run(main())
    assert done.is_set() and not ae.running
    assert sum(len(c.token_ids) for c in chunks) == 12 and chunks[-1].finish_reason == "length"
