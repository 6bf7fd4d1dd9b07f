"""AIPerf `profile` against the k3jax HTTP server (issue 6): a synthetic run and a multi-turn mooncake_trace run.

Both use the session's API worker (tests/api/conftest.py: k3-tiny, one running request, 16-token pages,
256-token context, an API key). AIPerf comes from .venv-aiperf (scripts/extras/aiperf.sh, run by
scripts/setup.sh --with-test-extras); without it the AIPerf tests skip. AIPerf takes ~10-15 s to start before
its first request, so they are slow-marked. serving/workload/aiperf_profile.py has the command lines.
"""

from __future__ import annotations

import httpx
import pytest

from serving.api.tokenizer import load_tokenizer
from serving.workload.aiperf_agree import aiperf_available
from serving.workload.aiperf_profile import (SyntheticConfig, aiperf_mooncake_rows, profile_mooncake,
                                             profile_synthetic, tiny_sessions)
from serving.workload.traces import MooncakeRow, to_mooncake

needs_aiperf = pytest.mark.skipif(
    not aiperf_available(),
    reason="AIPerf is not installed (.venv-aiperf): bash scripts/extras/aiperf.sh (scripts/setup.sh --with-test-extras)")
PAGE_SIZE = 16  # the worker's --page-size: the prefix cache shares whole pages


def _profiling(records: list[dict]) -> list[dict]:
    return [r for r in records if r["phase"] == "profiling"]


def _assert_no_errors(result: dict) -> None:
    assert result["error_rate_pct"] == 0 and result["error_summary"] == [], result["error_summary"]
    recs = _profiling(result["records"])
    assert all(r["error"] is None and not r["cancelled"] for r in recs), [r for r in recs if r["error"]]


def _template_overhead(input_tokens: int) -> int:
    """Tokens the byte tokenizer's chat template adds around one user message of `input_tokens` ASCII bytes."""
    tok = load_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "x" * input_tokens}])
    return len(tok.encode(prompt)) - input_tokens


@pytest.mark.slow
@needs_aiperf
def test_aiperf_synthetic_profile_matches_server_counts(worker, tmp_path):
    """5 synthetic streaming chat requests (29 prompt tokens, 7 output tokens, ignore_eos) at concurrency 2:
    no errors, every request done, each prompt the 29 tokens plus the chat template, and AIPerf's output and
    prompt token totals (the server's usage, --use-server-token-count) equal what the server's /metrics
    counters gained during the run."""
    cfg = SyntheticConfig(requests=5, input_tokens=29, output_tokens=7, concurrency=2)
    result = profile_synthetic(worker.url, tmp_path, cfg, api_key=worker.api_key, timeout_s=300)
    _assert_no_errors(result)
    recs = _profiling(result["records"])
    assert result["requests"] == result["completed"] == len(recs) == cfg.requests
    assert [r["output_tokens"] for r in recs] == [cfg.output_tokens] * cfg.requests
    prompt_len = cfg.input_tokens + _template_overhead(cfg.input_tokens)
    assert [r["prompt_tokens"] for r in recs] == [prompt_len] * cfg.requests
    server = result["server"]
    assert result["output_tokens"] == server["vllm:generation_tokens"] == cfg.requests * cfg.output_tokens
    assert result["prompt_tokens"] == server["vllm:prompt_tokens"] == cfg.requests * prompt_len
    # AIPerf's prompts may share a prefix with earlier ones (the same seed, other tests): whatever the server
    # reused, AIPerf reports the same number
    hits = server["vllm:prefix_cache_hits"] + server["vllm:external_prefix_cache_hits"]
    assert result["cache_read_tokens"] == hits


@pytest.mark.slow
@needs_aiperf
def test_aiperf_mooncake_multi_turn_reports_cache_reads(worker, tmp_path):
    """A generated 3-session x 4-turn trace, as AIPerf's multi-turn mooncake_trace at concurrency 2: every
    trace request done once with no errors, its output length as in the trace, and AIPerf's cache-read tokens
    (usage.prompt_tokens_details.cached_tokens) > 0 and equal to the server's prefix-cache hit counter's gain.

    Each later turn's prompt extends the previous one (AIPerf appends the reply and the new user message), so
    the server reuses at least the previous prompt's whole pages: cached >= previous prompt rounded down to
    16 (the worker's 256-token context and 96 pages hold both running sessions; nothing is evicted)."""
    sessions = tiny_sessions(num_sessions=3, max_turns=4)
    trace_rows = to_mooncake(sessions)
    expected = {}
    for r in trace_rows:
        expected.setdefault(r.session_id, []).append(r.output_length)
    assert len(expected) == 3 and all(3 <= len(v) <= 4 for v in expected.values()), expected
    result = profile_mooncake(worker.url, tmp_path, sessions, concurrency=2, api_key=worker.api_key, timeout_s=300)
    _assert_no_errors(result)
    recs = _profiling(result["records"])
    assert result["trace_rows"] == len(trace_rows) == len(recs) == result["requests"] == result["completed"]
    by_session: dict[str, dict[int, dict]] = {}
    for r in recs:
        turns = by_session.setdefault(r["conversation_id"], {})
        assert r["turn_index"] not in turns, f"turn sent twice: {r}"
        turns[r["turn_index"]] = r
    assert {sid: [t["output_tokens"] for _, t in sorted(turns.items())] for sid, turns in by_session.items()} \
        == expected
    for sid, turns in by_session.items():
        for k in range(1, len(turns)):
            prev, cur = turns[k - 1], turns[k]
            assert cur["prompt_tokens"] > prev["prompt_tokens"] + prev["output_tokens"], (sid, k, prev, cur)
            reusable = prev["prompt_tokens"] // PAGE_SIZE * PAGE_SIZE
            assert reusable <= cur["cached_tokens"] < cur["prompt_tokens"], (sid, k, prev, cur)
    server = result["server"]
    hits = server["vllm:prefix_cache_hits"] + server["vllm:external_prefix_cache_hits"]
    assert result["cache_read_tokens"] == sum(r["cached_tokens"] for r in recs) == hits > 0
    assert result["output_tokens"] == server["vllm:generation_tokens"]
    assert result["prompt_tokens"] == server["vllm:prompt_tokens"]
    # the server is still healthy and serving. The prompt is longer than a page: a one-page context is a shape
    # the runs above did not compile (~25 s on this machine)
    headers = {"Authorization": f"Bearer {worker.api_key}"}
    assert httpx.get(worker.url + "/health", timeout=30).status_code == 200
    r = httpx.post(worker.url + "/v1/completions", headers=headers, timeout=120,
                   json={"model": "k3-tiny", "prompt": "Is the server still serving after the AIPerf runs?",
                         "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_aiperf_mooncake_rows_are_per_turn_deltas():
    """Full-context rows become AIPerf's deltas: turn 0 unchanged, turn k only input_k - input_{k-1} -
    output_{k-1} new tokens and no hash ids; sessions interleaved in the file stay apart; a turn that does
    not extend its predecessor is refused."""
    rows = [MooncakeRow("a", 70, 5, (0, 1, 2, 3, 4)), MooncakeRow("b", 33, 9, (9, 10, 11)),
            MooncakeRow("a", 91, 3, (0, 1, 2, 3, 5, 6), 12.5), MooncakeRow("b", 57, 4, (9, 10, 12, 13), 0.0),
            MooncakeRow("a", 113, 8, (0, 1, 2, 3, 5, 6, 7, 8), 40.0)]
    out = aiperf_mooncake_rows(rows)
    assert out[0] == rows[0] and out[1] == rows[1]
    assert out[2] == MooncakeRow("a", 91 - 70 - 5, 3, (), 12.5)
    assert out[3] == MooncakeRow("b", 57 - 33 - 9, 4, (), 0.0)
    assert out[4] == MooncakeRow("a", 113 - 91 - 3, 8, (), 40.0)
    with pytest.raises(ValueError, match="does not extend"):
        aiperf_mooncake_rows([MooncakeRow("a", 70, 5, ()), MooncakeRow("a", 75, 5, ())])
    # a generated trace converts, and its deltas add back up to each turn's context
    for sid, chain in _by_session(to_mooncake(tiny_sessions(num_sessions=2, max_turns=3))).items():
        deltas = aiperf_mooncake_rows(chain)
        context = deltas[0].input_length
        for k in range(1, len(chain)):
            context += chain[k - 1].output_length + deltas[k].input_length
            assert context == chain[k].input_length, (sid, k)


def _by_session(rows: list[MooncakeRow]) -> dict[str, list[MooncakeRow]]:
    out: dict[str, list[MooncakeRow]] = {}
    for r in rows:
        out.setdefault(r.session_id, []).append(r)
    return out
