"""Closed-loop AgentX replay over the OpenAI HTTP API (httpx streaming), and its report.

    python -m serving.workload.replay --url http://127.0.0.1:8000 --preset short --concurrency 4 \
        --warmup-s 10 --duration-s 60 --out runs/c4

Method (AIPerf's inferencex-agentx-mvp scenario, /work/shared/design/agentx.md):
- `concurrency` lanes each replay one session tree at a time (a root chain plus its subagents, so more
  requests than lanes can be in flight); a lane takes the next session when its tree ends.
- A session starts at a random root turn j; turn j-1 is sent first as a warm-up request (primes the
  cache, never scored).
- Root turn k waits max(0, t_k - t_{k-1} - api_{k-1}) after turn k-1 (and the subagents it joins) ends,
  capped at `idle_gap_cap_s`; subagents spawned between two root turns start after the first ends and
  are joined by the first later root turn whose `t` is past their recorded end. Every request sends the
  full history with max_tokens = the recorded output and ignore_eos.
- Time: `warmup_s` (requests that start in it are not scored), a scored window of `duration_s` (requests
  starting in it are scored), then a drain of up to `grace_s`: no new requests; in-flight requests that
  finish in it are scored (AIPerf's benchmark-duration + grace-period), those still running are
  cancelled and counted as unfinished.
- Throughput = scored tokens / (window end, or the last scored request's end if later, - window start).
  ITL of a request = (end - first token) / (output tokens - 1) (AIPerf's definition); interactivity =
  1 / ITL; the headline P90 interactivity is 1 / P90(ITL) over scored requests.
- Prompts: `completions` sends token ids built from the trace's hash blocks (exact lengths and exact
  prefix structure: one block id = one fixed run of ids); `chat` sends the system blocks as a system
  message, the first turn's input as a user message and each later turn's new blocks as one assistant
  message (so the previous prompt, generation prompt included, is a prefix of the next; `chat_turn_role=
  "user"` sends them as user messages instead, as AIPerf 0.13.0's weka replay does on the wire), with the text
  made of one printable character per token (exact lengths with a byte tokenizer; `chat_overhead_tokens`
  shortens each message by what the template adds, so prompts keep the trace's lengths).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.workload.traces import (
    JOIN_EPSILON_S,
    Session,
    Subagent,
    TraceRequest,
    generate,
    load_preset,
    read_weka,
)

ENDPOINTS = ("completions", "chat")
CHAT_TURN_ROLES = ("assistant", "user")
# printable characters for chat prompts: one byte = one token with the byte tokenizer; no '<' or '|' so a
# random block can never spell a special token
_CHAT_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;_-+=()", np.uint8)


@dataclass(frozen=True)
class ReplayConfig:
    url: str
    model: str | None = None  # None: the first id of GET /v1/models
    concurrency: int = 4
    warmup_s: float = 0.0
    duration_s: float = 60.0
    grace_s: float = 30.0
    endpoint: str = "completions"
    idle_gap_cap_s: float = 10.0
    time_scale: float = 1.0  # multiplies think times (before the cap)
    seed: int = 0  # session order and start points
    # lanes take sessions in a seeded random order; False: in trace order (lane i starts session i, as AIPerf's
    # sequential sampler does; used to replay exactly what AIPerf replays)
    shuffle_sessions: bool = True
    random_start: bool = True
    # the random start turn is drawn from this fraction range of each root chain (AIPerf's
    # --trajectory-start-min/max-ratio)
    start_min_ratio: float = 0.0
    start_max_ratio: float = 1.0
    num_gpus: int = 1  # throughput is reported per GPU
    api_key: str | None = None
    salt: str | None = None  # prompt content namespace; None: a fresh one per run (no hits from older runs)
    token_id_range: int = 256  # completions prompts use ids in [0, token_id_range)
    request_timeout_s: float = 600.0
    progress: bool = True
    # chat: tokens the chat template adds per turn (the new message's wrapping + the generation prompt); each
    # message's text is shortened by it so prompts keep the trace's lengths (13 for the bundled byte
    # tokenizer's template: '<|im_end|>\n<|im_start|>assistant\n')
    chat_overhead_tokens: int = 0
    # chat: the role of each later turn's new message. "assistant": the previous prompt, its generation prompt
    # included, is a prefix of the next (an agent's real history). "user": what AIPerf 0.13.0's weka replay
    # sends, whose next prompt replaces the previous generation prompt's role, so a server's prefix match ends
    # a few tokens before the previous prompt's end (serving/workload/aiperf_agree.py)
    chat_turn_role: str = "assistant"
    # chat: another prompt layout instead of the one above, as a factory (session, tree name, the chain's requests,
    # tokens_of(request, turn)) -> an object with messages_for(tokens, prev, r, block_size); the AIPerf agreement
    # uses it to send AIPerf 0.13.0's weka_trace layout (serving/workload/aiperf_agree.py)
    chat_layout: Callable | None = None
    # completions: declare where the shared system prompt ends (the k3jax `cache_boundaries` extension), so a
    # subagent's first request resumes from its parent's system prompt; turn off against other servers
    declare_shared_prefix: bool = True

    def __post_init__(self):
        problems = []
        if self.concurrency < 1:
            problems.append("concurrency must be >= 1")
        if self.duration_s <= 0:
            problems.append("duration_s must be > 0")
        if self.warmup_s < 0 or self.grace_s < 0:
            problems.append("warmup_s and grace_s must be >= 0")
        if self.endpoint not in ENDPOINTS:
            problems.append(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.idle_gap_cap_s < 0 or self.time_scale < 0:
            problems.append("idle_gap_cap_s and time_scale must be >= 0")
        if self.num_gpus < 1:
            problems.append("num_gpus must be >= 1")
        if not 0 <= self.start_min_ratio <= self.start_max_ratio <= 1:
            problems.append("need 0 <= start_min_ratio <= start_max_ratio <= 1")
        if self.chat_overhead_tokens < 0:
            problems.append("chat_overhead_tokens must be >= 0")
        if self.chat_turn_role not in CHAT_TURN_ROLES:
            problems.append(f"chat_turn_role must be one of {CHAT_TURN_ROLES}, got {self.chat_turn_role!r}")
        if self.token_id_range < 2:
            problems.append("token_id_range must be >= 2")
        if problems:
            raise ValueError("invalid ReplayConfig: " + "; ".join(problems))


@dataclass
class RequestRecord:
    """One sent request. Times are seconds since the run started."""

    lane: int
    session: str
    agent: str  # "" for the root chain
    turn: int
    warmup: bool
    start: float
    end: float = math.nan
    ttft: float = math.nan
    itl: float = math.nan
    trace_input_tokens: int = 0
    trace_output_tokens: int = 0
    theoretical_cached_tokens: int = 0  # infinite-cache reuse given what this session sent before
    prompt_tokens: int = 0  # server-reported usage
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    scored: bool = False


# ------------------------------------------------------------------------------------------------ prompts


class _Scope:
    """One replayed session tree: its prompt content namespace and what it has sent (theoretical reuse)."""

    def __init__(self, name: str, block_size: int, seed_words: Sequence[int]):
        self.name = name
        self.block_size = block_size
        self.seed_words = list(seed_words)
        self.blocks: dict[int, np.ndarray] = {}
        self.seen: set[int] = set()

    def block(self, h: int, high: int) -> np.ndarray:
        b = self.blocks.get(h)
        if b is None:
            b = np.random.default_rng([*self.seed_words, h & 0xFFFFFFFF, h >> 32]).integers(0, high, self.block_size)
            self.blocks[h] = b
        return b

    def tokens(self, hash_ids: Sequence[int], length: int, high: int) -> np.ndarray:
        if not hash_ids:
            return np.zeros(0, np.int64)
        return np.concatenate([self.block(h, high) for h in hash_ids])[:length]

    def theoretical(self, r: TraceRequest) -> int:
        n = 0
        for h in r.hash_ids:
            if h not in self.seen:
                break
            n += 1
        self.seen.update(r.hash_ids)
        return min(n * self.block_size, r.input_tokens)


def _text(tokens: np.ndarray) -> str:
    return _CHAT_ALPHABET[tokens % len(_CHAT_ALPHABET)].tobytes().decode()


class _ChatHistory:
    """Messages of one chain: the system blocks, the first input, then one `turn_role` message per later
    turn with its new blocks (a turn whose blocks do not extend the previous request starts over)."""

    def __init__(self, system_tokens: int, overhead: int = 0, turn_role: str = "assistant"):
        self.system_tokens = system_tokens
        self.overhead = overhead
        self.turn_role = turn_role
        self.messages: list[dict] = []
        self.covered = 0  # trace tokens the messages hold

    def messages_for(self, tokens: np.ndarray, prev: TraceRequest | None, r: TraceRequest, bs: int) -> list[dict]:
        extends = (prev is not None and self.messages and len(r.hash_ids) >= len(prev.hash_ids) - 1
                   and r.hash_ids[: prev.input_tokens // bs] == prev.hash_ids[: prev.input_tokens // bs])
        if extends:
            # earlier messages stay as sent (their rendering, generation prompt included, is the prefix the
            # server cached); the trace's re-hashed partial last block only changes what the new text is
            new = tokens[self.covered:]
            self.messages.append({"role": self.turn_role, "content": _text(new[: max(1, len(new) - self.overhead)])})
        else:
            self.messages = []
            sys_len = min(self.system_tokens, len(tokens) - 1)
            if sys_len > 0:
                self.messages.append({"role": "system", "content": _text(tokens[:sys_len])})
            user = tokens[max(sys_len, 0):]
            self.messages.append({"role": "user", "content": _text(user[: max(1, len(user) - self.overhead)])})
        self.covered = len(tokens)
        return [dict(m) for m in self.messages]


# ------------------------------------------------------------------------------------------------ replay


class Replay:
    def __init__(self, sessions: Sequence[Session], cfg: ReplayConfig):
        if not sessions:
            raise ValueError("no sessions to replay")
        if not any(s.requests for s in sessions):
            raise ValueError("the sessions have no root requests")
        self.sessions = [s for s in sessions if s.requests]
        self.cfg = cfg
        self.records: list[RequestRecord] = []
        self.salt = cfg.salt if cfg.salt is not None else os.urandom(4).hex()
        self._salt_word = int.from_bytes(self.salt.encode()[:8].ljust(8, b"\0"), "little") & 0xFFFFFFFF
        self._rng = random.Random(cfg.seed)
        self._next_session = 0
        self._stop = asyncio.Event()
        self._t0 = 0.0
        self.model = cfg.model

    # --- time ----------------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._t0

    @property
    def window_start(self) -> float:
        return self.cfg.warmup_s

    @property
    def window_end(self) -> float:
        return self.cfg.warmup_s + self.cfg.duration_s

    async def _sleep(self, seconds: float) -> bool:
        """Sleeps unless the run stops first; False when it stopped."""
        if seconds <= 0:
            return not self._stop.is_set()
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
            return False
        except TimeoutError:
            return True

    def _gap(self, start_clock: float, prev_end_clock: float) -> float:
        return min(max(0.0, start_clock - prev_end_clock) * self.cfg.time_scale, self.cfg.idle_gap_cap_s)

    # --- one request ---------------------------------------------------------------------------
    async def _send(self, client, lane: int, scope: _Scope, chat: _ChatHistory | None, session: Session,
                    agent: str, turn: int, r: TraceRequest, prev: TraceRequest | None, warmup: bool) -> None:
        if self._stop.is_set():
            return
        cfg = self.cfg
        tokens = self._prompt_tokens(scope, r, turn)
        rec = RequestRecord(lane=lane, session=scope.name, agent=agent, turn=turn, warmup=warmup, start=self.now(),
                            trace_input_tokens=r.input_tokens, trace_output_tokens=r.output_tokens,
                            theoretical_cached_tokens=scope.theoretical(r))
        self.records.append(rec)
        body = {"model": self.model, "max_tokens": max(1, r.output_tokens), "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        if cfg.endpoint == "completions":
            body["prompt"] = tokens.tolist()
            if cfg.declare_shared_prefix and 0 < session.system_tokens < len(tokens):
                body["cache_boundaries"] = [int(session.system_tokens)]
            path = "/v1/completions"
        else:
            body["messages"] = chat.messages_for(tokens, prev, r, session.block_size)
            path = "/v1/chat/completions"
        headers = {"x-session-id": f"{scope.name}/{agent}" if agent else scope.name}
        if cfg.api_key:
            headers["authorization"] = f"Bearer {cfg.api_key}"
        t_start = time.perf_counter()
        first = last = None
        try:
            async with client.stream("POST", cfg.url.rstrip("/") + path, json=body, headers=headers,
                                     timeout=cfg.request_timeout_s) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        rec.error = str(event["error"].get("message", event["error"]))[:300]
                        return
                    for choice in event.get("choices") or ():
                        piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                        if piece:
                            last = time.perf_counter()
                            first = first or last
                    usage = event.get("usage")
                    if usage:
                        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        rec.completion_tokens = int(usage.get("completion_tokens") or 0)
                        rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        except asyncio.CancelledError:
            rec.error = "cancelled (still running when the drain ended)"
            raise
        except Exception as e:  # noqa: BLE001 - a failed request is recorded, the run goes on
            rec.error = f"{type(e).__name__}: {e}"[:300]
            return
        finally:
            rec.end = self.now()
        if first is None:
            # every output token decoded to nothing printable: time the whole stream
            first = last = time.perf_counter()
        rec.ttft = first - t_start
        # first to LAST CONTENT chunk, AIPerf's definition (its request latency ends at the final content
        # response, not at the usage chunk or [DONE]); on our server these arrive ~0.3 ms apart, on another
        # server the finish may come a step later
        if rec.completion_tokens > 1:
            rec.itl = (last - first) / (rec.completion_tokens - 1)

    # --- one session tree ----------------------------------------------------------------------
    def _prompt_tokens(self, scope: _Scope, r: TraceRequest, turn: int) -> np.ndarray:
        cfg = self.cfg
        tokens = scope.tokens(r.hash_ids, r.input_tokens, cfg.token_id_range if cfg.endpoint == "completions"
                              else len(_CHAT_ALPHABET))
        if len(tokens) < r.input_tokens:  # a trace without hash_ids for part of the input: fresh content
            extra = np.random.default_rng([*scope.seed_words, 1 << 31, turn]).integers(
                0, cfg.token_id_range, r.input_tokens - len(tokens))
            tokens = np.concatenate([tokens, extra])
        return tokens

    def _chat_history(self, session: Session, scope: _Scope, chain: Sequence[TraceRequest]):
        if self.cfg.endpoint != "chat":
            return None
        if self.cfg.chat_layout is not None:
            return self.cfg.chat_layout(session, scope.name, chain,
                                        lambda r, turn: self._prompt_tokens(scope, r, turn))
        return _ChatHistory(session.system_tokens, self.cfg.chat_overhead_tokens, self.cfg.chat_turn_role)

    async def _chain(self, client, lane, scope, session, agent, reqs: Sequence[TraceRequest], first_delay: float):
        chat = self._chat_history(session, scope, reqs)
        if not await self._sleep(first_delay):
            return
        prev = None
        for i, r in enumerate(reqs):
            if prev is not None and not await self._sleep(self._gap(r.t, prev.t + prev.api_time)):
                return
            await self._send(client, lane, scope, chat, session, agent, i, r, prev, warmup=False)
            prev = r

    async def _tree(self, client, lane: int, session: Session, pass_index: int) -> None:
        root = session.requests
        j = 0
        if self.cfg.random_start:
            lo = min(int(self.cfg.start_min_ratio * len(root)), len(root) - 1)
            hi = max(lo, min(math.ceil(self.cfg.start_max_ratio * len(root)), len(root)) - 1)
            j = self._rng.randint(lo, hi)
        index = self.sessions.index(session)
        scope = _Scope(f"{self.salt}-{session.id}-p{pass_index}", session.block_size,
                       [self._salt_word, index, pass_index])
        chat = self._chat_history(session, scope, root)
        prev = None
        if j > 0:
            prev = root[j - 1]
            await self._send(client, lane, scope, chat, session, "", j - 1, prev, None, warmup=True)
        # subagents spawned before the start point belong to the skipped past
        start_clock = root[j - 1].t if j > 0 else -math.inf
        pending: list[Subagent] = sorted((a for a in session.subagents if a.t >= start_clock and a.requests),
                                         key=lambda a: a.t)
        running: list[tuple[Subagent, asyncio.Task]] = []
        prev_end_clock = prev.t + prev.api_time if prev else None
        try:
            for k in range(j, len(root)):
                r = root[k]
                # spawn the subagents that start before this turn (they run alongside the wait below)
                while pending and pending[0].t < r.t:
                    a = pending.pop(0)
                    delay = self._gap(a.t, prev_end_clock) if prev_end_clock is not None else 0.0
                    task = asyncio.ensure_future(self._chain(client, lane, scope, session, a.agent_id, a.requests,
                                                             delay))
                    running.append((a, task))
                # join the subagents that ended (on the recorded clock) before this turn
                joined = [(a, task) for a, task in running if a.end <= r.t + JOIN_EPSILON_S]
                if joined:
                    await asyncio.gather(*(task for _, task in joined))
                    running = [x for x in running if x not in joined]
                    ends = [a.end for a, _ in joined]
                    prev_end_clock = max([prev_end_clock or -math.inf, *ends])
                if prev_end_clock is not None and not await self._sleep(self._gap(r.t, prev_end_clock)):
                    return
                await self._send(client, lane, scope, chat, session, "", k, r, prev, warmup=False)
                if self._stop.is_set():
                    return
                prev, prev_end_clock = r, r.t + r.api_time
            for a in pending:  # spawned after the last root turn
                delay = self._gap(a.t, prev_end_clock) if prev_end_clock is not None else 0.0
                running.append((a, asyncio.ensure_future(self._chain(client, lane, scope, session, a.agent_id,
                                                                     a.requests, delay))))
            await asyncio.gather(*(task for _, task in running))
        finally:
            for _, task in running:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*(task for _, task in running), return_exceptions=True)

    async def _lane(self, client, lane: int) -> None:
        while not self._stop.is_set():
            n = self._next_session
            self._next_session += 1
            order = self._order
            session = self.sessions[order[n % len(order)]]
            await self._tree(client, lane, session, n // len(order))

    # --- the run -------------------------------------------------------------------------------
    async def run(self) -> dict:
        import httpx

        cfg = self.cfg
        self._order = list(range(len(self.sessions)))
        if cfg.shuffle_sessions:
            self._rng.shuffle(self._order)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits, timeout=cfg.request_timeout_s) as client:
            if self.model is None:
                headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
                resp = await client.get(cfg.url.rstrip("/") + "/v1/models", headers=headers)
                resp.raise_for_status()
                self.model = resp.json()["data"][0]["id"]
            metrics_before = await _scrape(client, cfg.url)
            self._t0 = time.perf_counter()
            lanes = [asyncio.ensure_future(self._lane(client, i)) for i in range(cfg.concurrency)]
            bar = _progress(cfg, self)
            try:
                await self._sleep_until(self.window_end, bar)
                self._stop.set()  # no new requests: drain
                done, running = await asyncio.wait(lanes, timeout=cfg.grace_s)
                for task in running:
                    task.cancel()
                await asyncio.gather(*lanes, return_exceptions=True)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
            finally:
                if bar is not None:
                    bar.close()
            metrics_after = await _scrape(client, cfg.url)
        return self.report(metrics_before, metrics_after)

    async def _sleep_until(self, t_end: float, bar) -> None:
        while (left := t_end - self.now()) > 0:
            await asyncio.sleep(min(left, 0.5))
            if bar is not None:
                bar.n = round(min(self.now(), t_end), 1)
                scored = sum(1 for r in self.records if self.window_start <= r.start and not r.warmup)
                bar.set_postfix(requests=len(self.records), scored=scored, refresh=False)
                bar.refresh()

    # --- report --------------------------------------------------------------------------------
    def report(self, metrics_before: dict | None = None, metrics_after: dict | None = None) -> dict:
        cfg = self.cfg
        grace_end = self.window_end + cfg.grace_s
        for r in self.records:
            r.scored = (not r.warmup and not r.error and self.window_start <= r.start < self.window_end
                        and r.end <= grace_end + 1e-6)
        scored = [r for r in self.records if r.scored]
        started = [r for r in self.records if not r.warmup and self.window_start <= r.start < self.window_end]
        last_end = max((r.end for r in scored), default=self.window_end)
        elapsed = max(self.window_end, last_end) - self.window_start
        out_tokens = sum(r.completion_tokens for r in scored)
        in_tokens = sum(r.prompt_tokens for r in scored)
        itl = np.array([r.itl for r in scored if not math.isnan(r.itl)])
        ttft = np.array([r.ttft for r in scored])
        pct = lambda a, q: float(np.percentile(a, q)) if len(a) else math.nan  # noqa: E731
        p90_itl = pct(itl, 90)
        prompt_sum = sum(r.prompt_tokens for r in scored)
        trace_in = sum(r.trace_input_tokens for r in scored)
        report = {
            "config": {**dataclasses.asdict(cfg), "salt": self.salt, "model": self.model,
                       "chat_layout": getattr(cfg.chat_layout, "__qualname__", None)},
            "sessions": len(self.sessions),
            "window": {"start_s": self.window_start, "end_s": self.window_end, "grace_s": cfg.grace_s,
                       "elapsed_s": elapsed},
            "requests": {"sent": len(self.records), "warmup": sum(r.warmup for r in self.records),
                         "started_in_window": len(started), "scored": len(scored),
                         "errors": sum(bool(r.error) and "cancelled" not in r.error for r in self.records),
                         "unfinished_after_drain": sum(r.error.startswith("cancelled") for r in started),
                         "finished_in_drain": sum(r.end > self.window_end for r in scored),
                         "error_examples": sorted({r.error for r in self.records if r.error})[:5]},
            "output_tokens": out_tokens,
            "input_tokens": in_tokens,
            "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (out_tokens + in_tokens) / elapsed,
            "output_tokens_per_s_per_gpu": out_tokens / elapsed / cfg.num_gpus,
            "total_tokens_per_s_per_gpu": (out_tokens + in_tokens) / elapsed / cfg.num_gpus,
            "request_throughput_per_s": len(scored) / elapsed,
            "itl_s": {"mean": float(itl.mean()) if len(itl) else math.nan, "p50": pct(itl, 50), "p90": p90_itl,
                      "p99": pct(itl, 99)},
            "p90_interactivity_tokens_per_s": 1.0 / p90_itl if p90_itl > 0 else math.nan,
            "median_interactivity_tokens_per_s": 1.0 / pct(itl, 50) if len(itl) and pct(itl, 50) > 0 else math.nan,
            "ttft_s": {"mean": float(ttft.mean()) if len(ttft) else math.nan, "p50": pct(ttft, 50),
                       "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
            "cache_hit_rate": {
                "server_reported": sum(r.cached_tokens for r in scored) / prompt_sum if prompt_sum else math.nan,
                "theoretical": sum(r.theoretical_cached_tokens for r in scored) / trace_in if trace_in else math.nan,
            },
        }
        report["server_metrics"] = _metric_deltas(metrics_before, metrics_after)
        return report

    def write(self, report: dict, out_dir: str | Path) -> dict[str, Path]:
        """report.json, summary.csv (one row of headline numbers) and requests.csv (one row per request)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "report.json", "summary_csv": out / "summary.csv", "requests_csv": out / "requests.csv"}
        paths["json"].write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
        flat = _flatten({k: v for k, v in report.items() if k not in ("config",)})
        flat = {k: v for k, v in flat.items() if not isinstance(v, list)}
        flat = {"concurrency": self.cfg.concurrency, "endpoint": self.cfg.endpoint, **flat}
        with paths["summary_csv"].open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(flat))
            w.writeheader()
            w.writerow(flat)
        names = [f.name for f in dataclasses.fields(RequestRecord)]
        with paths["requests_csv"].open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(names)
            for r in self.records:
                w.writerow([getattr(r, n) for n in names])
        return paths


def _json_default(x):
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _progress(cfg: ReplayConfig, replay: Replay):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=round(cfg.warmup_s + cfg.duration_s, 1), unit="s", desc=f"agentx c={cfg.concurrency}",
                file=sys.stderr, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}")


# ------------------------------------------------------------------------------------------------ /metrics

_COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "external_prefix_cache_queries": "vllm:external_prefix_cache_queries_total",
    "external_prefix_cache_hits": "vllm:external_prefix_cache_hits_total",
    "queue_time_sum_s": "vllm:request_queue_time_seconds_sum",
    "queue_time_count": "vllm:request_queue_time_seconds_count",
}


async def _scrape(client, url: str) -> dict | None:
    """The counters above from the server's /metrics (summed over label sets); None if unavailable."""
    try:
        resp = await client.get(url.rstrip("/") + "/metrics", timeout=10)
        if resp.status_code != 200:
            return None
    except Exception:  # noqa: BLE001 - a server without /metrics still gets a report
        return None
    values: dict[str, float] = {}
    for line in resp.text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return {k: values.get(v) for k, v in _COUNTERS.items()}


def _metric_deltas(before: dict | None, after: dict | None) -> dict | None:
    """Whole-run deltas (warm-up and drain included: the server cannot tell them apart)."""
    if not before or not after:
        return None
    d = {k: after[k] - before[k] for k in _COUNTERS if after.get(k) is not None and before.get(k) is not None}
    out = dict(d)
    if d.get("prefix_cache_queries"):
        out["prefix_cache_hit_rate"] = d.get("prefix_cache_hits", 0.0) / d["prefix_cache_queries"]
    if d.get("queue_time_count"):
        out["queue_time_mean_s"] = d.get("queue_time_sum_s", 0.0) / d["queue_time_count"]
    return out


# ------------------------------------------------------------------------------------------------ entry points


def replay(sessions: Sequence[Session], cfg: ReplayConfig, out_dir: str | Path | None = None) -> dict:
    """Runs one replay (blocking) and writes the report files when out_dir is given."""
    r = Replay(sessions, cfg)
    report = asyncio.run(r.run())
    if out_dir is not None:
        report["files"] = {k: str(v) for k, v in r.write(report, out_dir).items()}
    return report


def add_replay_arguments(p: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    """The trace source (--preset/--trace, --num-sessions) and one flag per ReplayConfig field not in skip."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="generate sessions from configs/workloads/<name>.yaml (or a YAML path)")
    src.add_argument("--trace", help="weka_trace file or directory (generated or a real cc-traces corpus)")
    p.add_argument("--num-sessions", type=int, help="override the preset's session count")
    for f in dataclasses.fields(ReplayConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",) or isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            p.add_argument(flag, type=kind, default=f.default)


def sessions_from_args(a: argparse.Namespace) -> list[Session]:
    if a.preset:
        overrides = {"num_sessions": a.num_sessions} if a.num_sessions else {}
        return generate(load_preset(a.preset, **overrides))
    return read_weka(a.trace)


def config_from_args(a: argparse.Namespace, **fixed) -> ReplayConfig:
    return ReplayConfig(**{f.name: fixed[f.name] if f.name in fixed else getattr(a, f.name)
                           for f in dataclasses.fields(ReplayConfig)})


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.workload.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--out", help="directory for report.json, summary.csv, requests.csv")
    add_replay_arguments(p, skip=("url",))
    a = p.parse_args(argv)
    report = replay(sessions_from_args(a), config_from_args(a), a.out)
    keys = ("output_tokens_per_s_per_gpu", "total_tokens_per_s_per_gpu", "p90_interactivity_tokens_per_s", "ttft_s",
            "cache_hit_rate", "requests")
    print(json.dumps({k: report[k] for k in keys}, indent=2, default=_json_default))
    return 0


if __name__ == "__main__":
    sys.exit(main())
