"""AIPerf's AgentX scenario and our replay client on a tiny trace (k3-tiny on CPU).

The AIPerf test needs .venv-aiperf (scripts/extras/aiperf.sh, run by scripts/setup.sh
--with-test-extras) and skips without it; AIPerf takes ~15 s to start and configure before its first
request, and the test runs two pairs of runs, so it is slow-marked. The pooling test runs everywhere.
"""

from __future__ import annotations

import pytest

import numpy as np

from serving.workload import aiperf_agree
from serving.workload.aiperf_agree import (
    AIPERF_WEKA_BLOCK_SIZE,
    AgreeConfig,
    AIPerfWekaLayout,
    aiperf_available,
    aiperf_cache_bust_marker,
    aiperf_layout_factory,
    compare_clients,
    run_ours,
)
from serving.workload.traces import TraceRequest, generate, load_preset


def _agree_sessions(n: int, **kw):
    return generate(load_preset("short", num_sessions=n, block_size=AIPERF_WEKA_BLOCK_SIZE, **kw))


@pytest.mark.slow
@pytest.mark.skipif(not aiperf_available(),
                    reason="AIPerf is not installed (.venv-aiperf): bash scripts/extras/aiperf.sh")
def test_aiperf_agentx_scenario_runs_on_our_trace_and_server(server, tmp_path):
    """AIPerf's AgentX scenario replays a generated weka_trace against k3jax serve, and our replay the same
    sessions (from their first turn, one at a time). Both score requests; AIPerf's own per-request records
    under our ITL formula give AIPerf's P90 ITL (the two clients define ITL alike).

    Both clients send the same prompts (AIPerfWekaLayout; the trace in AIPerf's 64-token weka blocks): equal
    server-reported prompt tokens for every (conversation, turn) both sent, AIPerf's raw export rendered with
    the server's template agrees, and the server's prefix cache serves both alike (hit rates within 0.06;
    0.841 / 0.849 in this short run on 2026-12-04, against 0.251 / 0.257 when this docstring was first written
    and 0.25-0.31 in the 2026-11-30 benchmark run serving/workload/aiperf_agree.py records; what raised them
    has not been traced).

    Not asserted: the 10% agreement of the two runs' throughput and P90 ITL (issue 9). Pooled over 4 pairs on
    the agreement trace throughput agrees within 10% at concurrency 1 and 2 and P90 ITL at 2, not at 1 (set
    by one subagent burst per run under the machine's momentary load), and one run's numbers move by tens of
    percent on a shared 2-core machine (docs/results/aiperf_agree_cpu_aligned_2026-11-30.json)."""
    sessions = _agree_sessions(3)
    cfg = AgreeConfig(concurrency=1, duration_s=20.0, grace_s=30.0, seed=3)
    # one unscored run of ours first: it hits the shapes both clients' prompts hit (the prompts are the same, asserted
    # below). Not compare_clients' warm-up pair (ours, then AIPerf): the fixture's _compile_shapes already compiles
    # everything these runs use (server log, JAX_LOG_COMPILES=1: 0 compiles in each run of the pair), and the pair's
    # AIPerf half added ~22 s. The scored pair's numbers came out the same (30 requests a side, hit rates
    # 0.841 / 0.849 after either warm-up).
    run_ours(sessions, server, cfg)
    result = compare_clients(sessions, server, tmp_path, cfg, repeats=1, warmup_pairs=0, aiperf_export_level="raw")
    [run] = result["runs"]
    assert run["aiperf"]["requests"] >= 2 and run["ours"]["requests"] >= 2, result
    # the same prompts: every (conversation, turn) both clients sent had the same server-reported prompt tokens,
    # and AIPerf's requests as sent, rendered with the server's template, count what the server reported for ours
    pt = result["prompt_tokens_equal"]
    assert pt["requests_in_both"] >= 2 and pt["equal"] == pt["requests_in_both"], pt
    rc = run["raw_export_check"]
    assert rc["requests_rendered_and_in_ours"] >= 2 and rc["equal_to_ours"] == rc["requests_rendered_and_in_ours"], rc
    assert rc["first_user_message_marked"] >= rc["requests_rendered_and_in_ours"], rc
    assert result["definitions_check"]["p90_itl"] == pytest.approx(1.0, abs=0.01)
    ratios = result["ratios_ours_over_aiperf"]
    assert ratios["output_throughput"] > 0 and ratios["p90_itl"] > 0
    [hit_aiperf], [hit_ours] = result["server_cache_hit_rate"]["aiperf"], result["server_cache_hit_rate"]["ours"]
    assert 0.1 < hit_ours < 1 and hit_aiperf == pytest.approx(hit_ours, abs=0.06), result["server_cache_hit_rate"]


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

    def fake_aiperf(url, trace_dir, work, cfg, alongside=None, export_level=None):
        i = calls["aiperf"]
        calls["aiperf"] += 1
        assert (trace_dir / "session-20261129-0000.json").is_file()
        # pair 0 (warm-up) is slow; pairs 1, 2: 100 tokens over 10 s and 300 over 20 s; ITLs 1..10 ms, 11..20 ms
        t, span, itl = [(10, 50.0, [1.0] * 10), (100, 10.0, list(range(1, 11))), (300, 20.0, list(range(11, 21)))][i]
        records = [{"start_ns": 0, "end_ns": int(span * 1e9), "ttft_ms": 5.0, "itl_ms": v, "output_tokens": t / 10,
                    "prompt_tokens": 50, "cached_tokens": 0, "error": False, "conversation_id": "s",
                    "turn_index": k} for k, v in enumerate(itl)]
        return {"command": [], "wall_s": 1.0, "submission_valid": False, "output_tokens_per_s": t / span,
                "p90_itl_s": float(sorted(itl)[8]) / 1000, "ttft_p90_s": 0.005, "requests": 10,
                "benchmark_duration_s": span, "records": records}

    def fake_ours(sessions, url, cfg, out_dir=None):
        i = calls["ours"]
        calls["ours"] += 1
        t, span, itl = [(10, 50.0, [0.001] * 10), (110, 10.0, [v / 1000 for v in range(1, 11)]),
                        (330, 20.0, [v / 1000 for v in range(11, 21)])][i]
        # the same ten (conversation, turn) as AIPerf's records; turn 9's prompt one token longer; ITLs 2x AIPerf's
        return {"output_tokens_per_s": t / span, "output_tokens": t, "elapsed_s": span, "itl_values_s": itl,
                "p90_itl_s": 0.0, "ttft_p90_s": 0.005, "requests": 10, "unfinished": 0, "server_cache_hit_rate": 0.5,
                "prompt_tokens_by_turn": {("s", k): 50 + (k == 9) for k in range(10)},
                "itl_by_turn": {("s", k): 2 * v for k, v in enumerate(itl)}}

    monkeypatch.setattr(aiperf_agree, "run_aiperf", fake_aiperf)
    monkeypatch.setattr(aiperf_agree, "run_ours", fake_ours)
    sessions = _agree_sessions(2)
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
    assert result["prompt_tokens_equal"] == {"requests_in_both": 20, "equal": 18, "max_abs_diff": 1}
    same = result["same_requests_itl"]
    assert same["requests"] == 20 and same["median_per_request_ratio"] == pytest.approx(2.0)
    assert same["tail_requests"] == {"aiperf": 2, "ours": 2, "in_both": 2}
    # every fake AIPerf request of a pair runs over the same span (each shares the server with the others)
    assert same["overlap_share_mean"]["aiperf"] == pytest.approx(1.0) and same["shared"]["requests"] == 20
    with pytest.raises(ValueError, match="repeats"):
        compare_clients(sessions, "http://unused", tmp_path, AgreeConfig(), repeats=0)
    # a trace in other blocks is refused: AIPerf would read its 16-token ids as 64-token blocks
    with pytest.raises(ValueError, match="64-token blocks"):
        compare_clients(generate(load_preset("short", num_sessions=1)), "http://unused", tmp_path, AgreeConfig())


def _req(length: int, out: int, ids: list[int]) -> TraceRequest:
    return TraceRequest(t=0.0, input_tokens=length, output_tokens=out, hash_ids=tuple(ids))


def test_aiperf_weka_layout_follows_aiperfs_reconstruction_by_hand():
    """A 4-token-block chain worked through AIPerf 0.13.0's weka reconstructor rules by hand (8-token system
    prefix): turn 0 [system 8, user 6 (one block + a 2-token tail)]; turn 1 cuts back to 3 blocks (the tail
    goes), then ceil(5 / 4) = 2 new blocks as assistant and the 3-token tail as user; turn 2 (no tail) cuts at
    the assistant's end (the tail-only user goes), 1 assistant block (previous output 2) and 2 user blocks;
    turn 3 has one new block and no tail, which goes to the user (a request ends with a user message). The
    content is the trace's tokens in order; the marker opens the first user message of every request."""
    from serving.workload.replay import _text

    chain = [_req(14, 5, [0, 1, 2, 3]), _req(23, 2, [0, 1, 2, 10, 11, 12]),
             _req(32, 1, [0, 1, 2, 10, 11, 20, 21, 22]), _req(36, 4, [0, 1, 2, 10, 11, 20, 21, 22, 30])]
    rng = np.random.default_rng(11)
    blocks = {h: rng.integers(0, 70, 4) for r in chain for h in r.hash_ids}

    def tokens_of(r, turn):
        return np.concatenate([blocks[h] for h in r.hash_ids])[: r.input_tokens]

    marker = aiperf_cache_bust_marker("run", "tree")
    assert len(marker) == 20 and marker.startswith("[rid:") and marker.endswith("]\n\n")
    expected = [[("system", 8), ("user", 6)],
                [("system", 8), ("user", 4), ("assistant", 8), ("user", 3)],
                [("system", 8), ("user", 4), ("assistant", 8), ("assistant", 4), ("user", 8)],
                [("system", 8), ("user", 4), ("assistant", 8), ("assistant", 4), ("user", 8), ("user", 4)]]
    layout = AIPerfWekaLayout(chain, 4, 8, marker, tokens_of)
    for k, r in enumerate(chain):
        msgs = layout.messages_for(tokens_of(r, k), chain[k - 1] if k else None, r, 4)
        assert msgs[1]["content"].startswith(marker) and sum(marker in m["content"] for m in msgs) == 1
        lengths = [(m["role"], len(m["content"]) - (len(marker) if i == 1 else 0)) for i, m in enumerate(msgs)]
        assert lengths == expected[k]
        assert "".join(m["content"] for m in msgs).replace(marker, "") == _text(tokens_of(r, k))
    # a chain entered at turn 3 (a random start) lays the skipped turns out first: the same messages
    late = AIPerfWekaLayout(chain, 4, 8, marker, tokens_of)
    assert late.messages_for(tokens_of(chain[3], 3), chain[2], chain[3], 4) == msgs
    with pytest.raises(ValueError, match="chain order"):
        late.messages_for(tokens_of(chain[1], 1), chain[0], chain[1], 4)


def test_aiperf_weka_layout_sends_the_traces_lengths_on_the_agreement_trace():
    """On the agreement trace (64-token blocks) every request of every chain, root and subagents, carries
    exactly the trace's input tokens of content in order plus one 20-token marker, starts with the shared
    system prompt as a system message, and ends with a user message; a later prompt repeats the previous
    one up to the previous prompt's last whole block (where AIPerf cuts its tail)."""
    from serving.workload.replay import _CHAT_ALPHABET, _Scope, _text

    make = aiperf_layout_factory("nonce")
    for i, s in enumerate(_agree_sessions(2, seed=7)):
        scope = _Scope(s.id, s.block_size, [3, i])
        marker = aiperf_cache_bust_marker("nonce", s.id)
        for chain in [s.requests] + [a.requests for a in s.subagents]:
            tokens_of = lambda r, k: scope.tokens(r.hash_ids, r.input_tokens, len(_CHAT_ALPHABET))  # noqa: E731
            layout = make(s, s.id, chain, tokens_of)
            prev_text = None
            for k, r in enumerate(chain):
                msgs = layout.messages_for(tokens_of(r, k), chain[k - 1] if k else None, r, s.block_size)
                text = "".join(m["content"] for m in msgs)
                assert text.count(marker) == 1 and text.replace(marker, "") == _text(tokens_of(r, k))
                assert msgs[0] == {"role": "system", "content": _text(tokens_of(r, k)[: s.system_tokens])}
                assert msgs[-1]["role"] == "user" and len(text) == r.input_tokens + len(marker)
                if prev_text is not None:
                    keep = len(marker) + chain[k - 1].input_tokens // s.block_size * s.block_size
                    assert text[:keep] == prev_text[:keep]
                prev_text = text
