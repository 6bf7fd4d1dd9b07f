"""AIPerf's AgentX scenario and our replay client on a tiny trace (k3-tiny on CPU).

The AIPerf test needs .venv-aiperf (scripts/extras/aiperf.sh, run by scripts/setup.sh
--with-test-extras) and skips without it; AIPerf takes ~15 s to start and configure before its first
request, and the test runs two pairs of runs, so it is slow-marked. The pooling test runs everywhere.
"""

from __future__ import annotations

import pytest

from serving.workload import aiperf_agree
from serving.workload.aiperf_agree import AgreeConfig, aiperf_available, compare_clients
from serving.workload.traces import generate, load_preset


@pytest.mark.slow
@pytest.mark.skipif(not aiperf_available(),
                    reason="AIPerf is not installed (.venv-aiperf): bash scripts/extras/aiperf.sh")
def test_aiperf_agentx_scenario_runs_on_our_trace_and_server(server, tmp_path):
    """AIPerf's AgentX scenario replays a generated weka_trace against k3jax serve, and our replay the same
    sessions (from their first turn, one at a time). Both score requests; AIPerf's own per-request records
    under our ITL formula give AIPerf's P90 ITL (the two clients define ITL alike); and the server's prefix
    cache serves both clients' prompts about alike (hit rates within 0.06: in this short run, which scores
    whatever requests fit its 20 s window, measured 0.016 and 0.036 apart; 0.00-0.03 over the 60 s pairs of
    the agreement trace at concurrency 1; 0.05-0.11 before later turns went out as user messages and
    subagents' system prompts were declared, serving/workload/aiperf_agree.py).

    Not asserted: the 10% agreement of the two runs' throughput and P90 ITL (issue 9). Pooled over several
    pairs on the agreement trace throughput agrees within 10% but the P90 ITL does not at concurrency 1, and
    one run's numbers move by tens of percent on a shared 2-core machine (docs/results/
    aiperf_agree_cpu_same_work_2026-11-30.json)."""
    sessions = generate(load_preset("short", num_sessions=3))
    cfg = AgreeConfig(concurrency=1, duration_s=20.0, grace_s=30.0, seed=3)
    # one unscored pair first (ours, then AIPerf): it compiles the shapes both clients' prompts hit
    result = compare_clients(sessions, server, tmp_path, cfg, repeats=1, warmup_pairs=1)
    [run] = result["runs"]
    assert run["aiperf"]["requests"] >= 2 and run["ours"]["requests"] >= 2, result
    assert result["definitions_check"]["p90_itl"] == pytest.approx(1.0, abs=0.01)
    ratios = result["ratios_ours_over_aiperf"]
    assert ratios["output_throughput"] > 0 and ratios["p90_itl"] > 0
    [hit_aiperf], [hit_ours] = result["server_cache_hit_rate"]["aiperf"], result["server_cache_hit_rate"]["ours"]
    assert 0.5 < hit_ours < 1 and hit_aiperf == pytest.approx(hit_ours, abs=0.06), result["server_cache_hit_rate"]


def test_user_turn_prompts_diverge_from_the_previous_prompt_where_aiperfs_do():
    """Our replay with chat_turn_role="user" (what the agreement runs use) renders each later turn as AIPerf
    0.13.0 sends it: a new user message, so the next prompt keeps the previous one up to its generation
    prompt's role and differs from there on ('user' where the previous prompt had 'assistant', 10 tokens
    before its end: the divergence captured from AIPerf's requests, see aiperf_agree.py). With the user-turn
    overhead (8) taken off each message, every prompt is the trace's length plus the first turn's fixed 21
    tokens of wrapping. The default role keeps the whole previous prompt."""
    from serving.api.tokenizer import load_tokenizer
    from serving.workload.aiperf_agree import BYTE_CHAT_OVERHEAD_TOKENS, BYTE_CHAT_USER_TURN_OVERHEAD_TOKENS
    from serving.workload.replay import ReplayConfig, _ChatHistory, _Scope

    tok = load_tokenizer()
    assistant_role = tok.encode("assistant\n")
    [session] = generate(load_preset("short", num_sessions=1, seed=5))
    scope = _Scope("agree", session.block_size, [7, 9])
    user = _ChatHistory(session.system_tokens, BYTE_CHAT_USER_TURN_OVERHEAD_TOKENS, turn_role="user")
    assistant = _ChatHistory(session.system_tokens, BYTE_CHAT_OVERHEAD_TOKENS)
    prev_ids = prev_asst_ids = prev = None
    for r in session.requests[:9]:
        tokens = scope.tokens(r.hash_ids, r.input_tokens, 70)
        messages = user.messages_for(tokens, prev, r, session.block_size)
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        asst_ids = tok.encode(tok.apply_chat_template(assistant.messages_for(tokens, prev, r, session.block_size)))
        assert len(ids) == r.input_tokens + 21
        if prev_ids is not None:
            assert [m["role"] for m in messages[2:]] == ["user"] * (len(messages) - 2)
            cut = len(prev_ids) - len(assistant_role)
            assert prev_ids[cut:] == assistant_role
            assert ids[:cut] == prev_ids[:cut] and ids[cut:cut + 5] == tok.encode("user\n")
            assert asst_ids[: len(prev_asst_ids)] == prev_asst_ids
        prev_ids, prev_asst_ids, prev = ids, asst_ids, r
    with pytest.raises(ValueError, match="chat_turn_role"):
        ReplayConfig(url="http://x", chat_turn_role="tool")
    with pytest.raises(ValueError, match="AgreeConfig"):
        AgreeConfig(chat_turn_role="system")


def test_compare_clients_pools_the_scored_pairs(tmp_path, monkeypatch):
    """Fake clients: the warm-up pair is kept but not scored; throughput pools tokens over time and the
    P90 ITL is taken over every scored request of every pair."""
    calls = {"aiperf": 0, "ours": 0}

    def fake_aiperf(url, trace_dir, work, cfg, alongside=None):
        i = calls["aiperf"]
        calls["aiperf"] += 1
        assert (trace_dir / "session-20261129-0000.json").is_file()
        # pair 0 (warm-up) is slow; pairs 1, 2: 100 tokens over 10 s and 300 over 20 s; ITLs 1..10 ms, 11..20 ms
        t, span, itl = [(10, 50.0, [1.0] * 10), (100, 10.0, list(range(1, 11))), (300, 20.0, list(range(11, 21)))][i]
        records = [{"start_ns": 0, "end_ns": int(span * 1e9), "ttft_ms": 5.0, "itl_ms": v, "output_tokens": t / 10,
                    "prompt_tokens": 50, "cached_tokens": 0, "error": False} for v in itl]
        return {"command": [], "wall_s": 1.0, "submission_valid": False, "output_tokens_per_s": t / span,
                "p90_itl_s": float(sorted(itl)[8]) / 1000, "ttft_p90_s": 0.005, "requests": 10,
                "benchmark_duration_s": span, "records": records}

    def fake_ours(sessions, url, cfg, out_dir=None):
        i = calls["ours"]
        calls["ours"] += 1
        t, span, itl = [(10, 50.0, [0.001] * 10), (110, 10.0, [v / 1000 for v in range(1, 11)]),
                        (330, 20.0, [v / 1000 for v in range(11, 21)])][i]
        return {"output_tokens_per_s": t / span, "output_tokens": t, "elapsed_s": span, "itl_values_s": itl,
                "p90_itl_s": 0.0, "ttft_p90_s": 0.005, "requests": 10, "unfinished": 0, "server_cache_hit_rate": 0.5}

    monkeypatch.setattr(aiperf_agree, "run_aiperf", fake_aiperf)
    monkeypatch.setattr(aiperf_agree, "run_ours", fake_ours)
    sessions = generate(load_preset("short", num_sessions=2))
    result = compare_clients(sessions, "http://unused", tmp_path, AgreeConfig(), repeats=2, warmup_pairs=1)
    assert calls == {"aiperf": 3, "ours": 3}
    assert len(result["runs"]) == 2 and len(result["warmup_runs"]) == 1
    assert result["aiperf"]["output_tokens_per_s"] == pytest.approx(400 / 30)
    assert result["ours"]["output_tokens_per_s"] == pytest.approx(440 / 30)
    assert result["ratios_ours_over_aiperf"]["output_throughput"] == pytest.approx(1.1)
    # the same 20 ITLs (1..20 ms) on both sides: P90 = 18.1 ms, ratio 1
    assert result["aiperf"]["p90_itl_s"] == pytest.approx(0.0181)
    assert result["ratios_ours_over_aiperf"]["p90_itl"] == pytest.approx(1.0)
    assert "itl_values_s" not in result["runs"][0]["ours"]
    with pytest.raises(ValueError, match="repeats"):
        compare_clients(sessions, "http://unused", tmp_path, AgreeConfig(), repeats=0)
