"""SamplingParams / prompt validation, Request bookkeeping, stop checks and stop strings.

Run: python -m pytest tests/serving/test_request.py -q
"""

import numpy as np
import pytest

from serving.request import (
    Request,
    RequestStatus,
    SamplingParams,
    StopStringMatcher,
    check_stop,
    derive_seed,
    validate_prompt,
)

EOS = 2

# A toy tokenizer: id -> piece; ids 100.. are single UTF-8 bytes (so characters can span tokens).
PIECES = {0: "", 1: "<s>", 2: "</s>", 3: "Hel", 4: "lo", 5: " wor", 6: "ld", 7: "!", 8: "\n", 9: "END", 10: "EN", 11: "D"}


def detok(ids):
    out, pending = [], b""
    for t in ids:
        if t >= 100:
            pending += bytes([t - 100])
            continue
        out.append(pending.decode("utf-8", errors="replace"))
        pending = b""
        out.append(PIECES[t])
    out.append(pending.decode("utf-8", errors="replace"))
    return "".join(out)


def byte_ids(s):
    return [100 + b for b in s.encode()]


# --- SamplingParams ------------------------------------------------------------------------------


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.max_tokens, p.min_tokens) == (0.0, 0, 1.0, 0.0, None, 16, 0)
    assert p.stop_token_ids == () and p.stop == () and p.ignore_eos is False and p.is_greedy
    q = SamplingParams(temperature=1, top_k=-1, top_p=1, stop_token_ids=[4, np.int64(5)], stop="x", seed=2**40)
    assert q.top_k == 0 and isinstance(q.temperature, float) and q.stop_token_ids == (4, 5) and q.stop == ("x",)
    assert not q.is_greedy
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # frozen


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=None), "top_p"),
        (dict(min_p=1.0), "min_p"),
        (dict(min_p=-0.01), "min_p"),
        (dict(seed=1.0), "seed"),
        (dict(seed="7"), "seed"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=17), "min_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(stop_token_ids=(1, -1)), "stop_token_ids"),
        (dict(stop_token_ids=(1, "2")), "stop_token_ids"),
        (dict(stop_token_ids="12"), "stop_token_ids"),
        (dict(stop_token_ids=3), "stop_token_ids"),
        (dict(stop=("ok", "")), "stop"),
        (dict(stop=("ok", 3)), "stop"),
        (dict(stop=5), "stop"),
        (dict(ignore_eos=1), "ignore_eos"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}=.* is invalid: must be "):
        SamplingParams(**kwargs)


def test_sampling_params_boundaries_are_accepted():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=1, min_tokens=1)
    SamplingParams(top_p=1e-9, min_p=0.999, seed=0, min_tokens=16)


def test_sampling_params_validate_vocab():
    SamplingParams(stop_token_ids=(0, 99)).validate(100)
    with pytest.raises(ValueError, match=r"stop_token_ids=.*vocab_size=100.*bad entry 100"):
        SamplingParams(stop_token_ids=(5, 100)).validate(100)


# --- prompts -------------------------------------------------------------------------------------


def test_validate_prompt_accepts_and_normalises():
    assert validate_prompt([1, np.int32(2), 99], 100, 10, max_tokens=7) == (1, 2, 99)
    assert validate_prompt(np.array([5, 6]), 100, 2) == (5, 6)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "empty"),
        ((), "empty"),
        ("abc", "sequence of ints"),
        (None, "sequence of ints"),
        ([1, 2.0], r"prompt_ids\[1\]=2.0 is invalid: must be an int"),
        ([1, True], r"prompt_ids\[1\]=True is invalid: must be an int"),
        ([1, "2"], r"prompt_ids\[1\]='2' is invalid"),
        ([-1], r"prompt_ids\[0\]=-1 is invalid: must be in \[0, vocab_size=100\)"),
        ([3, 100], r"prompt_ids\[1\]=100 is invalid: must be in \[0, vocab_size=100\)"),
        ([1] * 9, "prompt length 9 \\+ max_tokens 2 = 11 exceeds max_model_len=10"),
    ],
)
def test_validate_prompt_errors(prompt, message):
    with pytest.raises(ValueError, match=message):
        validate_prompt(prompt, 100, 10, max_tokens=2)


def test_request_validate_uses_its_max_tokens_and_vocab():
    r = Request("r", (1, 2, 3), SamplingParams(max_tokens=7))
    r.validate(vocab_size=100, max_model_len=10)
    with pytest.raises(ValueError, match="max_model_len=9"):
        r.validate(vocab_size=100, max_model_len=9)
    with pytest.raises(ValueError, match="stop_token_ids"):
        Request("s", (1,), SamplingParams(stop_token_ids=(200,))).validate(100, 100)


# --- Request -------------------------------------------------------------------------------------


def test_request_state_and_derived_lengths():
    r = Request("req-1", [5, 6, 7], SamplingParams(max_tokens=4), session="agent-3")
    assert r.prompt_ids == (5, 6, 7) and r.session == "agent-3"
    assert r.status is RequestStatus.WAITING and not r.is_finished
    assert (r.num_tokens, r.num_output, r.num_prompt, r.remaining_prompt) == (3, 0, 3, 3)
    assert r.slot is None and r.pages == [] and r.finish_reason is None and r.finish_time is None
    assert r.hit is None and r.checkpoints == [] and r.prompt_boundary == 0 and r.num_preemptions == 0
    r.num_computed_tokens = 2
    assert r.remaining_prompt == 1
    r.num_computed_tokens = r.num_cached_tokens = 3
    r.output_ids += [8, 9]
    assert r.all_ids == [5, 6, 7, 8, 9] and (r.num_tokens, r.num_output, r.remaining_prompt) == (5, 2, 0)
    r.finish("length")
    assert r.is_finished and r.status is RequestStatus.FINISHED and r.finish_reason == "length"
    assert r.finish_time >= r.arrival_time
    with pytest.raises(ValueError, match="finish reason 'done'"):
        r.finish("done")
    assert Request("a", (1,)).arrival_time <= Request("b", (1,)).arrival_time


def test_request_rejects_bad_construction():
    with pytest.raises(ValueError, match="sampling must be a SamplingParams"):
        Request("r", (1,), sampling={"temperature": 1.0})
    with pytest.raises(AssertionError):
        Request("r", (1, 2), num_cached_tokens=2, num_computed_tokens=1)


def test_request_seed():
    assert Request("r", (1,), SamplingParams(seed=42)).seed == 42
    assert 0 <= Request("r", (1,), SamplingParams(seed=-5)).seed < 2**32
    a, b = Request("req-a", (1,)), Request("req-b", (1,))
    assert a.seed == derive_seed("req-a") and a.seed != b.seed and 0 <= a.seed < 2**32
    assert Request("req-a", (2,)).seed == a.seed  # stable for the same id


# --- check_stop ----------------------------------------------------------------------------------


def run(sampling, outputs, eos=EOS, detokenize=detok):
    """Appends outputs one by one; returns (finish reason, number of tokens emitted, matcher)."""
    r = Request("r", (1,), sampling)
    m = StopStringMatcher(sampling.stop, detokenize) if sampling.stop else None
    for t in outputs:
        r.output_ids.append(t)
        reason = check_stop(r, eos, m)
        if reason is not None:
            return reason, r.num_output, m
    return None, r.num_output, m


def test_eos_stops():
    assert run(SamplingParams(), [3, 4, EOS, 5])[:2] == ("stop", 3)
    assert run(SamplingParams(), [3, 4, 7], eos=(7, 8))[:2] == ("stop", 3)
    assert run(SamplingParams(), [3, EOS], eos=None)[:2] == (None, 2)


def test_ignore_eos_runs_to_length():
    assert run(SamplingParams(ignore_eos=True, max_tokens=4), [EOS, EOS, 3, EOS, 5])[:2] == ("length", 4)


def test_stop_token_ids():
    assert run(SamplingParams(stop_token_ids=(7, 8)), [3, 4, 8, 5])[:2] == ("stop", 3)
    # stop ids count even with ignore_eos
    assert run(SamplingParams(stop_token_ids=(7,), ignore_eos=True), [EOS, 7])[:2] == ("stop", 2)


def test_min_tokens_delays_eos_and_stop_ids():
    sp = SamplingParams(min_tokens=3, stop_token_ids=(7,))
    assert run(sp, [EOS, 7, EOS, 3])[:2] == ("stop", 3)  # the 3rd token may stop (num_output >= min_tokens)
    assert run(sp, [EOS, 7, 3, 7])[:2] == ("stop", 4)
    assert run(SamplingParams(min_tokens=2, max_tokens=2), [EOS, 3])[:2] == ("length", 2)


def test_max_tokens_length_and_precedence():
    assert run(SamplingParams(max_tokens=3), [3, 4, 5, 6])[:2] == ("length", 3)
    assert run(SamplingParams(max_tokens=1), [3])[:2] == ("length", 1)
    # a stop on the last allowed token is reported as a stop
    assert run(SamplingParams(max_tokens=2), [3, EOS])[:2] == ("stop", 2)
    assert run(SamplingParams(max_tokens=2, stop=("lo",)), [3, 4])[:2] == ("stop", 2)


def test_check_stop_needs_matcher_for_stop_strings():
    r = Request("r", (1,), SamplingParams(stop=("x",)))
    r.output_ids.append(3)
    with pytest.raises(ValueError, match="needs its matcher"):
        check_stop(r, EOS, None)
    assert check_stop(Request("q", (1,)), EOS) is None  # nothing generated yet


# --- stop strings --------------------------------------------------------------------------------


def test_stop_string_across_token_boundaries_truncates_text():
    # "Hel" + "lo" + " wor" + "ld": "lo wo" spans three tokens
    reason, n, m = run(SamplingParams(stop=("lo wo",)), [3, 4, 5, 6, 7])
    assert (reason, n) == ("stop", 3) and m.text == "Hel" and m.match.stop == "lo wo" and m.match.offset == 3
    reason, n, m = run(SamplingParams(stop=("END",)), [3, 10, 11, 7])
    assert (reason, n, m.text) == ("stop", 3, "Hel")


def test_stop_string_earliest_match_wins_and_no_false_positive():
    reason, n, m = run(SamplingParams(stop=("world", "wor")), [3, 4, 5, 6])
    assert (reason, n, m.text, m.match.stop) == ("stop", 3, "Hello ", "wor")
    reason, n, m = run(SamplingParams(stop=("xyz",), max_tokens=5), [3, 4, 5, 6, 7])
    assert (reason, n, m.text) == ("length", 5, "Hello world!")


def test_stop_string_short_one_after_long_one_was_ruled_out():
    # the short stop appears only in the newest token, past a region the long stop was searched in
    reason, n, m = run(SamplingParams(stop=("Hello world!", "!")), [3, 4, 5, 7])
    assert (reason, n, m.text) == ("stop", 4, "Hello wor")


def test_stop_string_in_multibyte_characters():
    ids = byte_ids("añb€c")  # ñ is 2 bytes, € is 3 bytes
    reason, n, m = run(SamplingParams(stop=("€",)), ids)
    assert (reason, n, m.text) == ("stop", len(byte_ids("añb€")), "añb")
    m = StopStringMatcher(("zz",), detok)
    for i in range(1, len(ids) + 1):
        m.update(ids[:i])
        assert "\ufffd" not in m.text  # incomplete characters are held back
    assert m.text == "añb€c"
    m = StopStringMatcher(("zz",), detok)
    ids = byte_ids("añ")[:-1]
    m.update(ids[:1])
    m.update(ids)
    assert m.text == "a" and m.final_text() == "a\ufffd"  # the held-back tail, for the last response


def test_stop_strings_ignored_under_min_tokens_but_found_after():
    # "lo" completes at token 2 (< min_tokens=3): ignored; the next "lo" (tokens 4..5) stops
    reason, n, m = run(SamplingParams(stop=("lo",), min_tokens=3), [3, 4, 7, 3, 4, 7])
    assert (reason, n, m.text) == ("stop", 5, "Hello!Hel")
    # a stop string that starts under min_tokens and ends after it counts
    reason, n, m = run(SamplingParams(stop=("lo wor",), min_tokens=2), [3, 4, 5, 6])
    assert (reason, n, m.text) == ("stop", 3, "Hel")


def test_matcher_contract():
    m = StopStringMatcher("!", detok)
    assert m.update([3]) is None and m.text == "Hel"
    with pytest.raises(ValueError, match="must extend"):
        m.update([4])
    match = m.update([3, 4, 7, 8])
    assert match.stop == "!" and m.text == "Hello"
    assert m.update([3, 4, 7, 8, 9]) is None and m.text == m.final_text() == "Hello"  # stays stopped
    with pytest.raises(ValueError, match="non-empty str"):
        StopStringMatcher(("",), detok)
