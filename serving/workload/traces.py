"""AgentX-like traces: a seeded synthetic generator, AIPerf's `weka_trace` / `mooncake_trace` formats.

A trace is a list of `Session`s, each the record of one coding-agent session tree (the weka_trace
shape, /work/shared/design/agentx.md): a root chain of requests whose history grows turn by turn, and
`Subagent`s spawned in parallel bursts between two root turns. Every request carries `hash_ids`: one id
per `block_size`-token block of its input, chained (equal ids = equal prefix up to that block) and
local to the session (the root and its subagents share one namespace, so a subagent's leading system
prompt blocks have the root's ids).

    preset = load_preset("short")                  # configs/workloads/short.yaml
    sessions = generate(preset)                    # deterministic in preset.seed
    write_weka(sessions, "trace_dir")              # one JSON object per session file
    write_mooncake(sessions, "trace.jsonl")        # one row per request, sessions by session_id
    prefix_reuse(sessions)                         # theoretical reuse with an infinite cache (>= 0.96)

Times are seconds on the session's clock (`t`: start of the recorded request; `api_time`: how long it
took; `think_time`: the end-to-start gap before it). A replayer waits max(0, t_k - t_{k-1} - api_{k-1})
after the previous root turn finishes; a root turn waits for the subagents that ended before its `t`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "workloads"
JOIN_EPSILON_S = 1e-6  # a root turn joins a subagent whose recorded end is at most this much after its start


# ------------------------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class TraceRequest:
    """One recorded LLM call. `input_tokens` is the prompt length (the `in` field); `hash_ids` covers it in
    blocks (the last block may be partial in real traces)."""

    t: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    api_time: float = 0.0
    think_time: float = 0.0
    model: str = ""
    streamed: bool = True  # weka type "s" (adds ttft) or "n"
    ttft: float | None = None
    stop: str = ""


@dataclass(frozen=True)
class Subagent:
    """A child conversation spawned at `t` (root clock); its requests run as one chain."""

    t: float
    agent_id: str
    requests: tuple[TraceRequest, ...]
    subagent_type: str = "general-purpose"
    duration_ms: int = 0  # an integer in weka_trace (AIPerf's model rejects fractions)
    status: str = "completed"
    tool_use_count: int = 0

    @property
    def end(self) -> float:
        return self.t + self.duration_ms / 1000.0


@dataclass(frozen=True)
class Session:
    """One weka_trace object: the root chain's requests and the subagents, in `t` order."""

    id: str
    block_size: int
    requests: tuple[TraceRequest, ...]
    subagents: tuple[Subagent, ...] = ()
    models: tuple[str, ...] = ()
    system_tokens: int = 0  # leading tokens shared by the root and every subagent
    tool_tokens: int = 0

    def all_requests(self) -> list[TraceRequest]:
        """Root and subagent requests in start order (ties: root first)."""
        reqs = [(r.t, 0, i, r) for i, r in enumerate(self.requests)]
        for j, sub in enumerate(self.subagents):
            reqs += [(r.t, 1 + j, i, r) for i, r in enumerate(sub.requests)]
        return [r for *_, r in sorted(reqs, key=lambda x: x[:3])]


# ------------------------------------------------------------------------------------------------ presets


@dataclass(frozen=True)
class TracePreset:
    """Shape of a synthetic AgentX-like trace. Token ranges are (low, high), drawn log-uniformly; times are
    seconds on the recorded clock. One session's root context starts at system_tokens + first_input
    and grows by (previous output + new input) each turn until the next turn would pass max_context."""

    name: str
    seed: int = 0
    num_sessions: int = 8
    block_size: int = 64
    model: str = "k3"
    system_tokens: int = 16384  # shared by the root and its subagents (a multiple of block_size)
    first_input_tokens: tuple[int, int] = (8192, 32768)  # the task, tool definitions, first files
    new_input_tokens: tuple[int, int] = (200, 3000)  # tool results / user text per root turn
    output_tokens: tuple[int, int] = (30, 600)
    max_context: int = 200_000  # input + output of a root turn stays below this
    max_turns: int = 200
    think_time_median_s: float = 1.2  # end-to-start gaps: lognormal with this median and p90
    think_time_p90_s: float = 10.0
    recorded_ttft_s: float = 0.5  # the recorded api_time = ttft + output * itl (only shapes the clock)
    recorded_itl_s: float = 0.02
    subagent_probability: float = 0.08  # per root turn: a burst of subagents follows it
    subagents_per_burst: tuple[int, int] = (2, 6)
    subagent_turns: tuple[int, int] = (4, 20)
    subagent_first_input_tokens: tuple[int, int] = (2000, 8000)  # the subagent's task after the system prompt
    subagent_max_context: int = 60_000

    def __post_init__(self):
        problems = []
        if self.num_sessions < 1:
            problems.append("num_sessions must be >= 1")
        if self.block_size < 1:
            problems.append("block_size must be >= 1")
        if self.system_tokens < 0 or self.system_tokens % self.block_size:
            problems.append(f"system_tokens must be a non-negative multiple of block_size ({self.block_size})")
        for name in ("first_input_tokens", "new_input_tokens", "output_tokens", "subagents_per_burst",
                     "subagent_turns", "subagent_first_input_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                problems.append(f"{name} must be (low, high) with 1 <= low <= high, got {(lo, hi)}")
        first = self.system_tokens + self.first_input_tokens[1] + self.output_tokens[1]
        if first > self.max_context:
            problems.append(f"max_context {self.max_context} is below the largest first turn ({first})")
        sub_first = self.system_tokens + self.subagent_first_input_tokens[1] + self.output_tokens[1]
        if sub_first > self.subagent_max_context:
            problems.append(f"subagent_max_context {self.subagent_max_context} is below the largest first subagent "
                            f"turn ({sub_first})")
        if not 0 <= self.subagent_probability <= 1:
            problems.append("subagent_probability must be in [0, 1]")
        if not 0 < self.think_time_median_s <= self.think_time_p90_s:
            problems.append("need 0 < think_time_median_s <= think_time_p90_s")
        if self.max_turns < 1:
            problems.append("max_turns must be >= 1")
        if problems:
            raise ValueError(f"invalid TracePreset {self.name!r}: " + "; ".join(problems))

    def replace(self, **changes) -> TracePreset:
        return dataclasses.replace(self, **changes)


def load_preset(name_or_path: str | Path, **overrides) -> TracePreset:
    """A preset from configs/workloads/<name>.yaml (or a YAML path), with field overrides."""
    import yaml

    path = Path(name_or_path)
    if not path.suffix:
        path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ValueError(f"no workload preset {str(name_or_path)!r} (known: {known})")
    raw = yaml.safe_load(path.read_text()) or {}
    raw.update(overrides)
    names = {f.name for f in dataclasses.fields(TracePreset)}
    unknown = set(raw) - names
    if unknown:
        raise ValueError(f"{path}: unknown preset fields {sorted(unknown)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    values.setdefault("name", path.stem)
    return TracePreset(**values)


# ------------------------------------------------------------------------------------------------ generator


class _Blocks:
    """The session's hash-id namespace: fresh ids for new blocks; a context is a list of ids plus the token
    count in its last, possibly partial, block (new tokens fill that block first, which changes its id:
    a chained hash covers the block's whole content)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.next_id = 0

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def extend(self, ids: list[int], length: int, new_tokens: int) -> list[int]:
        """ids of a context of `length` tokens after `new_tokens` more are appended."""
        full = length // self.block_size  # blocks that stay as they are
        total = -(-(length + new_tokens) // self.block_size)
        return ids[:full] + self.fresh(total - full)


def _log_uniform(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    lo, hi = lo_hi
    # floor of a log-uniform draw on [lo, hi + 1): every integer in [lo, hi] is reachable, none outside
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))) if hi > lo else lo


def _think(rng: np.random.Generator, p: TracePreset) -> float:
    sigma = max(math.log(p.think_time_p90_s / p.think_time_median_s) / 1.2815515655446004, 1e-9)
    return float(p.think_time_median_s * math.exp(sigma * rng.standard_normal()))


def _ms(x: float) -> float:
    return round(x, 3)


def generate(preset: TracePreset) -> list[Session]:
    """Deterministic synthetic sessions (the same preset gives the same trace on every machine)."""
    rng = np.random.default_rng(preset.seed)
    return [_session(preset, np.random.default_rng(rng.integers(2**63)), i) for i in range(preset.num_sessions)]


def _session(p: TracePreset, rng: np.random.Generator, index: int) -> Session:
    bs = p.block_size
    blocks = _Blocks(bs)
    system_ids = blocks.fresh(p.system_tokens // bs)
    clamp = lambda n, cap: max(1, min(n, cap))  # noqa: E731

    def request(t, ids, length, out, think):
        api = p.recorded_ttft_s + out * p.recorded_itl_s
        assert len(ids) == -(-length // bs), (length, len(ids))  # hash_ids cover the input in blocks
        return TraceRequest(t=_ms(t), input_tokens=length, output_tokens=out, hash_ids=tuple(ids),
                            api_time=_ms(api), think_time=_ms(think), model=p.model, ttft=_ms(p.recorded_ttft_s),
                            stop="tool_use")

    root: list[TraceRequest] = []
    subagents: list[Subagent] = []
    t, length = 0.0, p.system_tokens
    ids = list(system_ids)
    new = _log_uniform(rng, p.first_input_tokens)
    think = 0.0
    for turn in range(p.max_turns):
        ids = blocks.extend(ids, length, new)
        length += new
        out = clamp(_log_uniform(rng, p.output_tokens), p.max_context - length)
        req = request(t, ids, length, out, think)
        root.append(req)
        end = t + req.api_time
        if rng.random() < p.subagent_probability and turn + 1 < p.max_turns:
            burst = _log_uniform(rng, p.subagents_per_burst)
            spawn = end + _think(rng, p) * 0.25  # the tool call that spawns them follows the turn closely
            for k in range(burst):
                sub = _subagent(p, rng, blocks, system_ids, spawn, f"{index}-{len(subagents)}", request)
                subagents.append(sub)
                end = max(end, sub.end)
        think = _think(rng, p)
        t = end + think
        # the next root turn sees this turn's output and a new tool result / user message
        new_next = _log_uniform(rng, p.new_input_tokens)
        if length + out + new_next + p.output_tokens[0] > p.max_context:
            break
        new = out + new_next
    return Session(id=f"session-{p.seed}-{index:04d}", block_size=bs, requests=tuple(root),
                   subagents=tuple(subagents), models=(p.model,), system_tokens=p.system_tokens)


def _subagent(p: TracePreset, rng, blocks: _Blocks, system_ids: list[int], spawn: float, agent_id: str,
              request) -> Subagent:
    turns = _log_uniform(rng, p.subagent_turns)
    ids, length = list(system_ids), p.system_tokens
    new = _log_uniform(rng, p.subagent_first_input_tokens)
    t, think, reqs = spawn, 0.0, []
    for _ in range(turns):
        if length + new + p.output_tokens[0] > p.subagent_max_context:
            break
        ids = blocks.extend(ids, length, new)
        length += new
        out = max(1, min(_log_uniform(rng, p.output_tokens), p.subagent_max_context - length))
        req = request(t, ids, length, out, think)
        reqs.append(req)
        think = _think(rng, p) * 0.5  # tool calls inside a subagent are quicker than a user's turn
        t = t + req.api_time + think
        new = out + _log_uniform(rng, p.new_input_tokens)
    end = reqs[-1].t + reqs[-1].api_time
    return Subagent(t=_ms(spawn), agent_id=agent_id, requests=tuple(reqs),
                    duration_ms=math.ceil((end - spawn) * 1000 - 1e-6), tool_use_count=len(reqs) - 1)


# ------------------------------------------------------------------------------------------------ analysis


def request_reuse(requests: Iterable[TraceRequest], block_size: int) -> list[int]:
    """Per request (in the order given, one session's namespace): tokens of its prefix an infinite cache
    already holds, i.e. the leading blocks whose ids an earlier request sent."""
    seen: set[int] = set()
    reused = []
    for r in requests:
        n = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            n += 1
        reused.append(min(n * block_size, r.input_tokens))
        seen.update(r.hash_ids)
    return reused


def prefix_reuse(sessions: Sequence[Session]) -> float:
    """Theoretical prefix-cache hit rate with an infinite cache: reused input tokens / input tokens."""
    reused = total = 0
    for s in sessions:
        reqs = s.all_requests()
        reused += sum(request_reuse(reqs, s.block_size))
        total += sum(r.input_tokens for r in reqs)
    return reused / total if total else 0.0


def summary(sessions: Sequence[Session]) -> dict:
    """Shape figures comparable to the published corpus table (agentx.md)."""
    reqs = [r for s in sessions for r in s.all_requests()]
    ins = np.array([r.input_tokens for r in reqs])
    outs = np.array([r.output_tokens for r in reqs])
    thinks = np.array([r.think_time for s in sessions for r in s.requests[1:]] or [0.0])
    return {
        "sessions": len(sessions),
        "requests": len(reqs),
        "root_turns": sum(len(s.requests) for s in sessions),
        "subagents": sum(len(s.subagents) for s in sessions),
        "subagent_requests": sum(len(a.requests) for s in sessions for a in s.subagents),
        "sessions_with_subagents": sum(bool(s.subagents) for s in sessions),
        "input_tokens": {"mean": float(ins.mean()), "p10": float(np.percentile(ins, 10)),
                         "p50": float(np.median(ins)), "p90": float(np.percentile(ins, 90)), "max": int(ins.max())},
        "output_tokens": {"mean": float(outs.mean()), "p50": float(np.median(outs)), "max": int(outs.max())},
        "root_think_time_s": {"p50": float(np.median(thinks)), "p90": float(np.percentile(thinks, 90))},
        "prefix_reuse": prefix_reuse(sessions),
    }


# ------------------------------------------------------------------------------------------------ weka_trace


def _request_json(r: TraceRequest) -> dict:
    d = {"type": "s" if r.streamed else "n", "t": r.t, "model": r.model, "in": r.input_tokens,
         "out": r.output_tokens, "hash_ids": list(r.hash_ids), "stop": r.stop, "api_time": r.api_time,
         "think_time": r.think_time}
    if r.streamed and r.ttft is not None:
        d["ttft"] = r.ttft
    return d


def session_to_weka(s: Session) -> dict:
    items = [(r.t, 0, _request_json(r)) for r in s.requests]
    for sub in s.subagents:
        items.append((sub.t, 1, {
            "type": "subagent", "t": sub.t, "agent_id": sub.agent_id, "subagent_type": sub.subagent_type,
            "duration_ms": sub.duration_ms,
            "total_tokens": sum(r.input_tokens + r.output_tokens for r in sub.requests),
            "tool_use_count": sub.tool_use_count, "status": sub.status,
            "models": sorted({r.model for r in sub.requests if r.model}),
            # a subagent starts from the session's system prompt and tool definitions (the weka format's
            # per-subagent fields): without them AIPerf renders those blocks as user text behind its
            # cache-busting marker, and no subagent's first request can resume the shared system prompt
            "tool_tokens": s.tool_tokens, "system_tokens": s.system_tokens,
            "requests": [_request_json(r) for r in sub.requests]}))
    items.sort(key=lambda x: (x[0], x[1]))
    all_reqs = s.all_requests()
    return {"id": s.id, "models": list(s.models), "block_size": s.block_size, "hash_id_scope": "local",
            "tool_tokens": s.tool_tokens, "system_tokens": s.system_tokens,
            "totals": {"requests": len(all_reqs), "input_tokens": sum(r.input_tokens for r in all_reqs),
                       "output_tokens": sum(r.output_tokens for r in all_reqs)},
            "requests": [d for *_, d in items]}


def _parse_request(d: dict, where: str) -> TraceRequest:
    try:
        hash_ids = tuple(int(h) for h in d.get("hash_ids") or ())
        return TraceRequest(t=float(d.get("t", 0.0)), input_tokens=int(d["in"]), output_tokens=int(d["out"]),
                            hash_ids=hash_ids, api_time=float(d.get("api_time") or 0.0),
                            think_time=float(d.get("think_time") or 0.0), model=str(d.get("model") or ""),
                            streamed=d.get("type", "s") == "s",
                            ttft=None if d.get("ttft") is None else float(d["ttft"]), stop=str(d.get("stop") or ""))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a weka_trace request ({e!r}): {str(d)[:200]}") from None


def session_from_weka(obj: dict, where: str = "weka trace") -> Session:
    """A weka_trace object (generated or a real cc-traces file). Unknown fields are ignored; request
    types other than n/s/subagent are skipped."""
    if not isinstance(obj, dict) or not isinstance(obj.get("requests"), list):
        raise ValueError(f"{where}: a weka_trace object needs a 'requests' list")
    scope = obj.get("hash_id_scope", "local")
    if scope != "local":
        raise ValueError(f"{where}: hash_id_scope {scope!r} is not supported (only 'local')")
    root, subs = [], []
    for i, d in enumerate(obj["requests"]):
        kind = d.get("type")
        if kind in ("n", "s"):
            root.append(_parse_request(d, f"{where} request {i}"))
        elif kind == "subagent":
            spawn = float(d.get("t", 0.0))
            inner = [_parse_request(x, f"{where} subagent {i}") for x in d.get("requests") or ()
                     if x.get("type") in ("n", "s")]
            # current captures put inner `t` on the root clock; older ones relative to the spawn (as AIPerf reads it)
            inner = [dataclasses.replace(r, t=spawn + r.t) if r.t + JOIN_EPSILON_S < spawn else r for r in inner]
            duration = d.get("duration_ms")
            if duration is None and inner:
                duration = (inner[-1].t + inner[-1].api_time - float(d.get("t", 0.0))) * 1000
            subs.append(Subagent(t=float(d.get("t", 0.0)), agent_id=str(d.get("agent_id", f"sub{i}")),
                                 requests=tuple(inner), subagent_type=str(d.get("subagent_type") or ""),
                                 duration_ms=math.ceil(float(duration or 0.0)), status=str(d.get("status") or ""),
                                 tool_use_count=int(d.get("tool_use_count") or 0)))
    return Session(id=str(obj.get("id", where)), block_size=int(obj.get("block_size", 64)), requests=tuple(root),
                   subagents=tuple(subs), models=tuple(obj.get("models") or ()),
                   system_tokens=int(obj.get("system_tokens") or 0), tool_tokens=int(obj.get("tool_tokens") or 0))


def write_weka(sessions: Sequence[Session], out_dir: str | Path) -> list[Path]:
    """One `<id>.json` per session (what `aiperf --custom-dataset-type weka_trace --input-file DIR` reads)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in sessions:
        path = out / f"{s.id}.json"
        path.write_text(json.dumps(session_to_weka(s), separators=(",", ":")))
        paths.append(path)
    return paths


def read_weka(path: str | Path) -> list[Session]:
    """Sessions from a directory of weka_trace JSON files, one JSON file (an object or a list of them), or a
    JSONL file with one object per line (real cc-traces corpora come as per-session files)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl"))
        if not files:
            raise ValueError(f"{path}: no .json/.jsonl weka_trace files")
        return [s for f in files for s in read_weka(f)]
    if not path.exists():
        raise ValueError(f"{path}: no such weka trace file or directory")
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [session_from_weka(json.loads(line), f"{path}:{i + 1}")
                for i, line in enumerate(text.splitlines()) if line.strip()]
    obj = json.loads(text)
    objs = obj if isinstance(obj, list) else [obj]
    return [session_from_weka(o, str(path)) for o in objs]


# ------------------------------------------------------------------------------------------------ mooncake_trace


@dataclass(frozen=True)
class MooncakeRow:
    """One mooncake_trace line: `delay` (ms, end-to-start) before a session's later turns; no timestamps,
    so AIPerf replays it as multi-turn sessions under --concurrency instead of a fixed schedule."""

    session_id: str
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    delay_ms: float | None = None

    def to_json(self) -> dict:
        d = {"session_id": self.session_id, "input_length": self.input_length, "output_length": self.output_length,
             "hash_ids": list(self.hash_ids)}
        if self.delay_ms is not None:
            d["delay"] = self.delay_ms
        return d


def to_mooncake(sessions: Sequence[Session]) -> list[MooncakeRow]:
    """Each root chain and each subagent becomes one session_id (`<id>` and `<id>/<agent_id>`): the format
    has no spawn/join, so subagents replay as independent conversations. Hash ids are made global by
    offsetting each session's local ids (mooncake has one namespace for the whole file)."""
    rows, next_free = [], 0
    for s in sessions:
        local = [h for r in s.all_requests() for h in r.hash_ids]
        # shift this session's ids past every id used so far (ids already past it stay: a re-write is stable)
        offset = max(0, next_free - min(local)) if local else 0
        chains = [(s.id, s.requests)] + [(f"{s.id}/{a.agent_id}", a.requests) for a in s.subagents]
        for sid, reqs in chains:
            prev_end = None
            for r in reqs:
                delay = None if prev_end is None else _ms(max(0.0, r.t - prev_end) * 1000)
                rows.append(MooncakeRow(sid, r.input_tokens, r.output_tokens, tuple(h + offset for h in r.hash_ids),
                                        delay))
                prev_end = r.t + r.api_time
        next_free = max(next_free, max(local) + offset + 1) if local else next_free
    return rows


def write_mooncake(sessions: Sequence[Session], path: str | Path) -> Path:
    """mooncake_trace JSONL, one row per request with its whole context (input_length + hash_ids of every
    block: the Mooncake trace convention, which read_mooncake reads back). Replay with `--isl-block-size
    <block_size>` (AIPerf's default is 512). AIPerf 0.13.0 reads rows that share a session_id as multi-turn
    *deltas* appended to the live conversation: for that replay write the file with
    serving.workload.aiperf_profile.write_aiperf_mooncake instead (each later turn carries only its new tokens)."""
    sizes = {s.block_size for s in sessions}
    if len(sizes) > 1:
        raise ValueError(f"mooncake_trace has one block size per file; these sessions use {sorted(sizes)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r.to_json(), separators=(",", ":")) + "\n" for r in to_mooncake(sessions)))
    return path


def read_mooncake(path: str | Path) -> list[MooncakeRow]:
    """Rows of a mooncake_trace JSONL file that uses input_length (+ hash_ids); rows without a session_id
    are single-turn sessions of their own."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        d = json.loads(line)
        if "input_length" not in d:
            raise ValueError(f"{path}:{i + 1}: only input_length rows are supported (text/messages/payload are not)")
        delay = d.get("delay")
        rows.append(MooncakeRow(str(d.get("session_id", f"row-{i}")), int(d["input_length"]),
                                int(d.get("output_length") or 1), tuple(int(h) for h in d.get("hash_ids") or ()),
                                None if delay is None else float(delay)))
    return rows


def sessions_from_mooncake(rows: Sequence[MooncakeRow], block_size: int) -> list[Session]:
    """Sessions rebuilt from mooncake rows: each session_id becomes a root chain (`a/b` ids become
    subagents of `a`, spawned when `a`'s first turn ends). Recorded times are lost in the format: a
    request's api_time is 0 and `t` is the sum of the delays before it."""
    chains: dict[str, list[MooncakeRow]] = {}
    for r in rows:
        chains.setdefault(r.session_id, []).append(r)

    def chain(rs, t0):
        out, t = [], t0
        for r in rs:
            t += (r.delay_ms or 0.0) / 1000
            out.append(TraceRequest(t=_ms(t), input_tokens=r.input_length, output_tokens=r.output_length,
                                    hash_ids=r.hash_ids, think_time=_ms((r.delay_ms or 0.0) / 1000)))
        return tuple(out)

    roots = {sid: chain(rs, 0.0) for sid, rs in chains.items() if "/" not in sid}
    subs: dict[str, list[Subagent]] = {sid: [] for sid in roots}
    for sid, rs in chains.items():
        if "/" in sid:
            parent, agent = sid.split("/", 1)
            if parent not in roots:
                roots[parent], subs[parent] = (), []
            spawn = roots[parent][0].t if roots[parent] else 0.0
            reqs = chain(rs, spawn)
            subs[parent].append(Subagent(t=spawn, agent_id=agent, requests=reqs,
                                         duration_ms=math.ceil((reqs[-1].t - spawn) * 1000 - 1e-6)))
    return [Session(id=sid, block_size=block_size, requests=roots[sid], subagents=tuple(subs[sid])) for sid in roots]


def main(argv: Sequence[str] | None = None) -> int:
    """python -m serving.workload.traces --preset short --weka out/weka --mooncake out/trace.jsonl"""
    import argparse

    p = argparse.ArgumentParser(prog="python -m serving.workload.traces",
                                description="Generate an AgentX-like trace and write it in AIPerf's formats.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="configs/workloads/<name>.yaml or a YAML path")
    src.add_argument("--weka-in", help="read a weka_trace file or directory instead (e.g. a real corpus)")
    p.add_argument("--num-sessions", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--weka", help="write weka_trace files (one per session) into this directory")
    p.add_argument("--mooncake", help="write a mooncake_trace JSONL file")
    a = p.parse_args(argv)
    if a.preset:
        overrides = {k: v for k, v in (("num_sessions", a.num_sessions), ("seed", a.seed)) if v is not None}
        sessions = generate(load_preset(a.preset, **overrides))
    else:
        sessions = read_weka(a.weka_in)
    if a.weka:
        write_weka(sessions, a.weka)
    if a.mooncake:
        write_mooncake(sessions, a.mooncake)
    print(json.dumps(summary(sessions), indent=2))
    return 0


__all__ = ["MooncakeRow", "Session", "Subagent", "TracePreset", "TraceRequest", "generate", "load_preset",
           "prefix_reuse", "read_mooncake", "read_weka", "request_reuse", "session_from_weka", "session_to_weka",
           "sessions_from_mooncake", "summary", "to_mooncake", "write_mooncake", "write_weka"]


if __name__ == "__main__":
    raise SystemExit(main())
