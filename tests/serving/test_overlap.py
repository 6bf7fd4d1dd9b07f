"""Overlap scheduling (EngineConfig.overlap_schedule): the same tokens as synchronous steps, while decode steps
are dispatched before the previous step's tokens are read back.

Every test runs the same requests through an overlapped and a synchronous engine over the same k3-tiny params
and compares token for token: greedy and seeded sampling, stops on sampled tokens (stop ids, stop strings:
the overlapped engine has already given such a request one more row when it finds the stop), aborts while a
step is in flight, preemption, and prefix-cache reuse of histories that ended on such a stop.

Run: python -m pytest tests/serving/test_overlap.py -q
"""

import numpy as np

from serving.request import SamplingParams

# the shapes of test_engine.py (same buckets: its compiled programs are reused in one pytest process)
ENGINE_OPTS = dict(page_size=4, num_pages=96, num_slots=24, max_running=4, max_prefill_tokens=32, max_model_len=128,
                   bucket_growth=64)


def prompts(seed, n, lo=3, hi=30, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(lo, hi)).tolist() for _ in range(n)]


def both(make_engine, **overrides):
    return make_engine(overlap_schedule=True, **overrides), make_engine(overlap_schedule=False, **overrides)


def test_decode_steps_are_dispatched_before_the_previous_tokens_are_read(make_engine):
    """A decode-only step leaves its tokens on the device; the next step() dispatches the following step
    first and then emits them: outputs arrive one call later, and the device always has a step queued."""
    engine = make_engine(overlap_schedule=True)
    rid = engine.add_request(prompts(1, 1)[0], SamplingParams(max_tokens=5, ignore_eos=True))
    while not engine.requests[rid].output_ids:  # prefill chunks, then the first token (synchronous steps)
        engine.step()
        assert engine.inflight is None
    assert engine.step() == [] and engine.inflight is not None  # decode 1 dispatched, not read
    in_flight = engine.inflight
    outs = engine.step()  # decode 2 dispatched, then decode 1 emitted
    assert [len(o.new_tokens) for o in outs] == [1] and engine.inflight is not in_flight
    engine.run_until_done([rid])
    req = engine.requests[rid]
    assert req.num_output == 5 and req.finish_reason == "length"
    # max_tokens is known ahead: the last token's step was not followed by a wasted one
    assert req.num_computed_tokens == req.num_tokens - 1
    engine.check_integrity()


def test_overlap_matches_synchronous_steps_greedy_and_sampled(make_engine):
    ps = prompts(11, 6, lo=3, hi=26)
    samplings = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 9, 14, 1, 7, 11)]
    samplings[2] = SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    samplings[5] = SamplingParams(max_tokens=11, temperature=1.3, seed=3, min_tokens=4)
    overlapped, synchronous = both(make_engine)
    assert overlapped.generate(ps, samplings) == synchronous.generate(ps, samplings)
    assert overlapped.counters["generation_tokens"] == synchronous.counters["generation_tokens"]
    overlapped.check_integrity()


def test_stops_on_sampled_tokens_drop_the_extra_row(make_engine):
    """Stop ids and stop strings end requests mid-run: the overlapped engine learns of it a step late and drops
    that row's token; outputs equal the synchronous engine's, and all memory comes back."""
    ps = prompts(23, 4, lo=5, hi=20)
    free = SamplingParams(max_tokens=16, ignore_eos=True)
    reference = make_engine(overlap_schedule=False).generate(ps, free)
    # stop each request on the token it produces at a different position (2, 4, 6, 8)
    samplings = [SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[out[2 + 2 * i]])
                 for i, out in enumerate(reference)]
    detok = lambda ids: "".join(chr(97 + t % 26) for t in ids)  # noqa: E731 -- a toy tokenizer for stop strings
    stop_text = detok(reference[1][3:5])
    samplings[1] = SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop_text])
    outs = {}
    for overlap in (True, False):
        engine = make_engine(overlap_schedule=overlap)
        engine.detokenize = detok
        outs[overlap] = engine.generate(ps, samplings)
        engine.check_integrity()
        engine.reset_prefix_cache()  # what the cache held goes; nothing else may stay allocated
        assert engine.kv.pages.num_used == 0 and engine.kv.slots.num_used == 0
    assert outs[True] == outs[False]
    assert all(len(o) < 16 for o in outs[True])


def test_prefix_reuse_after_a_stop_in_flight(make_engine):
    """A history that ended on a stop found one step late (its extra row wrote the stop token's KV and
    advanced the KDA state by it) is reused by the next turn exactly as the synchronous engine reuses it."""
    overlapped, synchronous = both(make_engine)
    prompt = prompts(31, 1, lo=14, hi=15)[0]
    free = synchronous.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[free[6]])
    turns = {}
    for name, engine in (("overlap", overlapped), ("sync", synchronous)):
        engine.reset_prefix_cache()
        first = engine.generate([prompt], stop, sessions=["s"])[0]
        follow = prompt + first + prompts(32, 1, lo=5, hi=6)[0]
        hits = engine.kv.hit_tokens
        second = engine.generate([follow], SamplingParams(max_tokens=6, ignore_eos=True), sessions=["s"])[0]
        turns[name] = (first, second, engine.kv.hit_tokens - hits)
        engine.check_integrity()
    assert turns["overlap"][:2] == turns["sync"][:2]
    assert turns["overlap"][2] > 0 and turns["overlap"][2] >= turns["sync"][2]


def test_abort_while_in_flight_and_preemption(make_engine):
    """An abort of a request whose token is in flight, and page pressure that preempts (a full schedule,
    after the in-flight step is processed): the survivors' outputs equal the synchronous engine's."""
    ps = prompts(41, 4, lo=10, hi=24)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    results = {}
    for overlap in (True, False):
        engine = make_engine(overlap_schedule=overlap, num_pages=20)  # survivors need up to 3 x 11 pages
        ids = [engine.add_request(p, sp) for p in ps]
        in_flight = lambda: engine.inflight is not None and any(r.request_id == ids[1] for r in engine.inflight.reqs)  # noqa: E731
        for _ in range(40):  # until ids[1] decodes (overlapped: with a token in flight)
            engine.step()
            if len(engine.requests[ids[1]].output_ids) >= 2 and (in_flight() or not overlap):
                break
        assert not overlap or in_flight()
        assert engine.abort(ids[1])
        engine.run_until_done([ids[0], ids[2], ids[3]])
        engine.check_integrity()
        results[overlap] = ([engine.requests[i].output_ids for i in (ids[0], ids[2], ids[3])],
                            engine.counters["preemptions"])
    assert results[True][0] == results[False][0]
    assert results[False][1] > 0  # the page budget did force preemptions
