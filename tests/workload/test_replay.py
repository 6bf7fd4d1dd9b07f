"""The AgentX replay client against a real `k3jax serve` worker (k3-tiny on CPU, short preset; the
`server` fixture is in conftest.py), and its session-tree scheduling against a fake server."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import time
from pathlib import Path

import pytest

from serving.workload.replay import Replay, ReplayConfig, RequestRecord, replay
from serving.workload.traces import generate, load_preset


def test_replay_short_preset_reports_throughput_latency_and_cache_hits(server, tmp_path):
    sessions = generate(load_preset("short", num_sessions=3))
    # sessions start in their first fifth (warm-up prompts of ~1-1.5k tokens: cold prefills are slow here)
    cfg = ReplayConfig(url=server, concurrency=2, warmup_s=5.0, duration_s=20.0, grace_s=15.0, idle_gap_cap_s=0.5,
                       seed=3, start_max_ratio=0.2, progress=False)
    report = replay(sessions, cfg, tmp_path / "run")
    req = report["requests"]
    assert report["config"]["model"] == "k3-tiny"
    assert req["errors"] == 0, req["error_examples"]
    assert req["warmup"] >= 2  # every session tree starts with its warm-up turn
    assert req["scored"] >= 3, req
    assert req["scored"] + req["unfinished_after_drain"] == req["started_in_window"]
    # the scored requests extend histories the session already sent: the server must report hits, and with
    # token-id prompts whose blocks are whole 16-token pages it reuses what an infinite cache would
    hits = report["cache_hit_rate"]
    assert hits["theoretical"] > 0.8
    assert 0.5 < hits["server_reported"] <= hits["theoretical"] + 1e-9
    assert report["output_tokens_per_s"] > 0 and report["total_tokens_per_s"] > report["output_tokens_per_s"]
    assert math.isfinite(report["p90_interactivity_tokens_per_s"]) and report["p90_interactivity_tokens_per_s"] > 0
    assert report["p90_interactivity_tokens_per_s"] == pytest.approx(1 / report["itl_s"]["p90"])
    assert 0 < report["ttft_s"]["p50"] <= report["ttft_s"]["p90"]
    assert report["window"]["elapsed_s"] >= cfg.duration_s
    metrics = report["server_metrics"]
    assert metrics is not None and metrics["prefix_cache_hits"] > 0 and metrics["queue_time_count"] >= req["scored"]

    files = report["files"]
    on_disk = json.loads(Path(files["json"]).read_text())
    assert on_disk["requests"] == req
    with open(files["requests_csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == req["sent"]
    scored = [r for r in rows if r["scored"] == "True"]
    assert len(scored) == req["scored"]
    assert all(r["warmup"] == "False" and float(r["start"]) >= cfg.warmup_s for r in scored)
    # the server counted exactly the prompt the trace asked for (token-id prompts), and the output it was told
    assert all(int(r["prompt_tokens"]) == int(r["trace_input_tokens"]) for r in scored)
    assert all(int(r["completion_tokens"]) == int(r["trace_output_tokens"]) for r in scored)
    assert sum(int(r["completion_tokens"]) for r in scored) == report["output_tokens"]
    with open(files["summary_csv"]) as f:
        [summary] = list(csv.DictReader(f))
    assert float(summary["output_tokens_per_s"]) == pytest.approx(report["output_tokens_per_s"])


def test_replay_config_and_inputs_are_checked():
    with pytest.raises(ValueError, match="concurrency"):
        ReplayConfig(url="http://x", concurrency=0)
    with pytest.raises(ValueError, match="endpoint"):
        ReplayConfig(url="http://x", endpoint="embeddings")
    with pytest.raises(ValueError, match="no sessions"):
        Replay([], ReplayConfig(url="http://x"))


def test_chat_prompts_extend_the_previous_prompt_and_keep_trace_lengths():
    """Chat mode: each root turn's rendered prompt (generation prompt included) starts with the previous
    turn's, so a server's prefix cache can hit it, and with the byte tokenizer's template overhead (13
    tokens per turn) taken off the text every prompt is the trace's length plus the fixed 16 tokens of
    the first turn's system/user wrapping."""
    import numpy as np

    from serving.api.tokenizer import load_tokenizer
    from serving.workload.replay import _ChatHistory, _Scope

    tok = load_tokenizer()
    [session] = generate(load_preset("short", num_sessions=1, seed=11))
    scope = _Scope("s", session.block_size, [1, 2, 3])
    chat = _ChatHistory(session.system_tokens, overhead=13)
    prev_ids, prev = None, None
    for r in session.requests[:12]:
        tokens = scope.tokens(r.hash_ids, r.input_tokens, 70)
        messages = chat.messages_for(tokens, prev, r, session.block_size)
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        assert len(ids) == r.input_tokens + 16
        # the template's own special tokens only (2 per message + the generation prompt): none in the text
        assert sum(i >= 256 for i in ids) == 2 * len(messages) + 1
        if prev_ids is not None:
            assert ids[: len(prev_ids)] == prev_ids
        prev_ids, prev = ids, r
    # a request that does not extend the previous one starts a new conversation with the same system text
    r = session.requests[3]
    fresh = chat.messages_for(scope.tokens(r.hash_ids, r.input_tokens, 70), session.requests[8], r, 16)
    assert [m["role"] for m in fresh] == ["system", "user"]
    assert np.all(np.array([len(m["content"]) for m in fresh]) > 0)


class _FakeServerReplay(Replay):
    """The replay's scheduling with the HTTP request replaced by a fixed sleep: records who ran when."""

    LATENCY_S = 0.02

    async def _send(self, client, lane, scope, chat, session, agent, turn, r, prev, warmup):
        if self._stop.is_set():
            return
        rec = RequestRecord(lane=lane, session=scope.name, agent=agent, turn=turn, warmup=warmup, start=self.now(),
                            trace_input_tokens=r.input_tokens, trace_output_tokens=r.output_tokens,
                            theoretical_cached_tokens=scope.theoretical(r))
        self.records.append(rec)
        await asyncio.sleep(self.LATENCY_S)
        rec.end, rec.ttft, rec.itl = self.now(), self.LATENCY_S / 2, 0.001
        rec.prompt_tokens, rec.completion_tokens = r.input_tokens, r.output_tokens
        rec.cached_tokens = rec.theoretical_cached_tokens


def test_session_tree_scheduling_spawns_joins_and_waits():
    """One lane over a session with subagent bursts (no server): the warm-up turn comes first, each subagent
    starts after the root turn before its spawn ends and finishes before the root turn that joins it starts,
    subagents of one burst overlap, and root turns wait (capped) think times end to start."""
    import asyncio as aio

    preset = load_preset("short", num_sessions=1, seed=5, subagent_probability=0.3, max_turns=14,
                         think_time_median_s=0.01, think_time_p90_s=0.03)
    [session] = generate(preset)
    assert len(session.subagents) >= 2
    cap = 0.05
    replay = _FakeServerReplay([session], ReplayConfig(url="http://unused", concurrency=1, duration_s=30.0,
                                                       grace_s=0.0, idle_gap_cap_s=cap, seed=1,
                                                       start_max_ratio=0.0, salt="x", progress=False))

    async def one_tree():
        replay._t0 = time.perf_counter()
        await replay._tree(None, 0, session, 0)

    aio.run(one_tree())
    recs = replay.records
    root = [r for r in recs if not r.agent]
    assert [r.turn for r in root] == list(range(len(session.requests)))  # start ratio 0: from turn 0, no warm-up
    assert not any(r.warmup for r in recs)
    assert len(recs) == len(session.all_requests())
    for a in session.subagents:
        sub = [r for r in recs if r.agent == a.agent_id]
        assert [r.turn for r in sub] == list(range(len(a.requests)))
        before = max(i for i, q in enumerate(session.requests) if q.t <= a.t)
        after = [i for i, q in enumerate(session.requests) if q.t >= a.end]
        assert sub[0].start >= root[before].end - 1e-6
        if after:
            assert root[after[0]].start >= sub[-1].end - 1e-6
    bursts = {}
    for a in session.subagents:
        bursts.setdefault(a.t, []).append(a.agent_id)
    burst = next(ids for ids in bursts.values() if len(ids) > 1)
    firsts = [next(r for r in recs if r.agent == i) for i in burst]
    assert max(r.start for r in firsts) < min(r.end for r in firsts)  # launched together
    # end-to-start gaps between root turns with no subagents in between: the recorded gap, capped
    for k in range(1, len(session.requests)):
        prev, cur = session.requests[k - 1], session.requests[k]
        if any(prev.t <= a.t < cur.t for a in session.subagents):
            continue
        gap = root[k].start - root[k - 1].end
        want = min(cur.t - prev.t - prev.api_time, cap)
        assert want - 0.002 <= gap <= want + 0.25, (k, gap, want)
    # every root turn after the first is a prefix hit in the infinite-cache model
    assert all(r.theoretical_cached_tokens > 0 for r in root[1:])


def test_warm_up_turn_precedes_a_random_start():
    preset = load_preset("short", num_sessions=1, seed=5, max_turns=10)
    [session] = generate(preset)
    replay = _FakeServerReplay([session], ReplayConfig(url="http://unused", concurrency=1, idle_gap_cap_s=0.0,
                                                       start_min_ratio=0.5, seed=2, salt="x", progress=False))

    async def one_tree():
        replay._t0 = time.perf_counter()
        await replay._tree(None, 0, session, 0)

    asyncio.run(one_tree())
    root = [r for r in replay.records if not r.agent]
    assert root[0].warmup and not any(r.warmup for r in root[1:])
    assert root[1].turn == root[0].turn + 1 >= 5
    assert root[0].theoretical_cached_tokens == 0 and root[1].theoretical_cached_tokens > 0
