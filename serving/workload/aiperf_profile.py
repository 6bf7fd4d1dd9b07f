"""AIPerf `profile` against a k3jax HTTP server: a short synthetic run and a short multi-turn mooncake_trace run,
checked against the server's own Prometheus counters.

AIPerf 0.13.0 lives in its own environment, .venv-aiperf (scripts/extras/aiperf.sh). Its tokenizer is the
server's byte tokenizer in an HF-cache layout under the repo id `local/k3-byte`, loaded with HF_HUB_OFFLINE=1
(aiperf_agree.hf_home_with_tokenizer; shared/design/interfaces.md §2.1). The command lines this module runs
(`--api-key` only when the server has one):

    # synthetic: fixed ISL/OSL, streaming chat, closed loop at concurrency 2
    HF_HOME=<hf_home> HF_HUB_OFFLINE=1 .venv-aiperf/bin/aiperf profile --model k3-tiny --url <url> \
        --endpoint-type chat --streaming --tokenizer local/k3-byte --use-server-token-count \
        --concurrency 2 --request-count 6 --synthetic-input-tokens-mean 32 --synthetic-input-tokens-stddev 0 \
        --output-tokens-mean 8 --output-tokens-stddev 0 --extra-inputs ignore_eos:true --random-seed 1 \
        --ui-type none --no-gpu-telemetry --no-server-metrics --artifact-dir <dir>

    # mooncake_trace, multi-turn: rows grouped by session_id, each session one conversation
    HF_HOME=<hf_home> HF_HUB_OFFLINE=1 .venv-aiperf/bin/aiperf profile --model k3-tiny --url <url> \
        --endpoint-type chat --streaming --tokenizer local/k3-byte --use-server-token-count \
        --input-file trace.jsonl --custom-dataset-type mooncake_trace --isl-block-size 16 --concurrency 2 \
        --conversation-num 3 --extra-inputs ignore_eos:true --random-seed 1 --ui-type none --no-gpu-telemetry \
        --no-server-metrics --artifact-dir <dir>

or `python -m serving.workload.aiperf_profile --url http://127.0.0.1:8000 [--api-key KEY]` for both, with a
table. `--conversation-num <sessions>` makes AIPerf replay each trace session once: without it, a trace of 3
sessions and 12 turns under --concurrency 2 sent 10 requests (AIPerf's default count), the last one session 0's
first turn again.

Why the trace is rewritten for AIPerf (`aiperf_mooncake_rows`): traces.write_mooncake writes each turn's whole
context as `input_length` (+ the `hash_ids` of all of it), as a recorded request log does. AIPerf 0.13.0 reads
rows that share a session_id as deltas: each row is one new user message, appended to the conversation with the
live assistant replies (ConversationContextMode.DELTAS_WITHOUT_RESPONSES, the default for mooncake rows without
`messages`/`payload`: aiperf/dataset/loader/mooncake_trace.py `_infer_context_mode`, base_trace_loader.py
`_infer_context_mode`; there is no CLI flag for it). Fed the full-context rows, turn k's prompt would hold every
earlier turn's context again (quadratic growth). The rewrite keeps turn 0 as it is and gives turn k only its new
tokens (input_k - input_{k-1} - output_{k-1}) and no hash_ids (the new tokens start inside the previous context's
last, partial block, which no whole-block hash id can describe), so AIPerf's prompt for turn k is the trace's
context plus the chat template's tokens, and AIPerf's history is what makes later turns extend earlier prompts.

Cache-read tokens: AIPerf parses `usage.prompt_tokens_details.cached_tokens` of the final streamed usage chunk
into the per-request metric `usage_prompt_cache_read_tokens` and sums it into `total_usage_prompt_cache_read_tokens`
(aiperf/metrics/types/usage_cache_metrics.py, usage_total_metrics.py). The server counts the same tokens in
`vllm:prefix_cache_hits` (+ `vllm:external_prefix_cache_hits` for the host tier); `profile` returns both, the
counters as deltas over the run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from serving.workload.aiperf_agree import aiperf_command, aiperf_exports
from serving.workload.traces import MooncakeRow, Session, generate, load_preset, read_mooncake, to_mooncake

# the server counters a run is checked against (Prometheus names without the _total suffix)
SERVER_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits",
                   "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions")


@dataclass(frozen=True)
class SyntheticConfig:
    """AIPerf's synthetic prompts: `requests` chat requests of exactly `input_tokens` prompt tokens (before the
    chat template) and `output_tokens` generated tokens (ignore_eos), `concurrency` at a time."""

    requests: int = 6
    input_tokens: int = 32
    output_tokens: int = 8
    concurrency: int = 2

    def __post_init__(self):
        if min(self.requests, self.input_tokens, self.output_tokens, self.concurrency) < 1:
            raise ValueError(f"SyntheticConfig fields must all be >= 1, got {self}")

    def args(self) -> list[str]:
        return ["--concurrency", str(self.concurrency), "--request-count", str(self.requests),
                "--synthetic-input-tokens-mean", str(self.input_tokens), "--synthetic-input-tokens-stddev", "0",
                "--output-tokens-mean", str(self.output_tokens), "--output-tokens-stddev", "0"]


def tiny_sessions(num_sessions: int = 3, max_turns: int = 4, seed: int = 20261130) -> list[Session]:
    """A few short root chains from the `short` preset, scaled to fit a 256-token context through AIPerf (the
    chat template adds ~13 tokens per turn, and a reply re-tokenised from its text can be longer than the
    tokens generated: the byte tokenizer's invalid UTF-8 comes back as 3-byte U+FFFD). No subagents: mooncake
    has no spawn/join, so they would only be more independent sessions."""
    preset = load_preset("short", num_sessions=num_sessions, max_turns=max_turns, seed=seed, system_tokens=32,
                         first_input_tokens=(16, 32), new_input_tokens=(8, 16), output_tokens=(4, 8),
                         max_context=112, subagent_probability=0.0, think_time_median_s=0.02,
                         think_time_p90_s=0.1)
    return generate(preset)


def aiperf_mooncake_rows(rows: Sequence[MooncakeRow]) -> list[MooncakeRow]:
    """Full-context mooncake rows (traces.to_mooncake) as AIPerf's per-session deltas (module docstring): a
    session's first row unchanged, each later row only the tokens that are new since the previous row's context
    and output, without hash_ids. Raises ValueError when a row's context does not extend the previous one."""
    out: list[MooncakeRow] = []
    prev: dict[str, MooncakeRow] = {}
    for r in rows:
        p = prev.get(r.session_id)
        if p is None:
            out.append(r)
        else:
            new = r.input_length - p.input_length - p.output_length
            if new < 1:
                raise ValueError(f"session {r.session_id!r}: a turn of {r.input_length} input tokens does not extend "
                                 f"the previous turn's {p.input_length} + {p.output_length} output tokens")
            out.append(MooncakeRow(r.session_id, new, r.output_length, (), r.delay_ms))
        prev[r.session_id] = r
    return out


def write_aiperf_mooncake(sessions: Sequence[Session], path: str | Path) -> Path:
    """The sessions as an AIPerf multi-turn mooncake_trace file (aiperf_mooncake_rows of traces.to_mooncake)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for row in aiperf_mooncake_rows(to_mooncake(sessions)):
        d = row.to_json()
        if not d["hash_ids"]:
            del d["hash_ids"]  # a delta row: AIPerf synthesises input_length tokens of fresh text
        lines.append(json.dumps(d, separators=(",", ":")) + "\n")
    path.write_text("".join(lines))
    return path


def scrape_counters(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """SERVER_COUNTERS from `url`/metrics (summed over label sets; 0 when absent), plus the running/waiting gauges."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s).text
    values = {name: 0.0 for name in (*SERVER_COUNTERS, "vllm:num_requests_running", "vllm:num_requests_waiting")}
    for family in text_string_to_metric_families(text):
        if family.name in values:
            values[family.name] = sum(s.value for s in family.samples if s.name in (family.name, family.name + "_total"))
    return values


def settled_counters(url: str, timeout_s: float = 15.0) -> dict[str, float]:
    """The counters once the engine is idle and they stop moving: /metrics reads the engine thread's latest
    snapshot, which can trail the last response by a step."""
    deadline = time.monotonic() + timeout_s
    last = scrape_counters(url)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = scrape_counters(url)
        idle = now["vllm:num_requests_running"] == 0 and now["vllm:num_requests_waiting"] == 0
        if idle and now == last:
            return now
        last = now
    return last


def run_aiperf_profile(url: str, work: str | Path, dataset_args: Sequence[str], *, model: str = "k3-tiny",
                       api_key: str | None = None, seed: int = 1, timeout_s: float = 600.0) -> dict:
    """One `aiperf profile` run (streaming chat, server token counts, ignore_eos) with `dataset_args` (the
    synthetic or trace flags); returns the summary numbers, the per-request records, the server counters' gains
    over the run and the command. Raises RuntimeError when AIPerf is missing or fails."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    cmd, env, art = aiperf_command(work, "artifacts", model=model, url=url)
    cmd += [*dataset_args, "--extra-inputs", "ignore_eos:true", "--random-seed", str(seed)]
    if api_key:
        cmd += ["--api-key", api_key]
    before = settled_counters(url)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"aiperf did not finish within {timeout_s} s:\n{(e.output or '')[-3000:]}") from e
    wall = time.monotonic() - t0
    (work / "aiperf.log").write_text(proc.stdout)
    summary_path = art / "profile_export_aiperf.json"
    if proc.returncode != 0 or not summary_path.is_file():
        raise RuntimeError(f"aiperf exited {proc.returncode} after {wall:.0f} s:\n{proc.stdout[-3000:]}")
    after = settled_counters(url)
    summary, exported = aiperf_exports(art)
    records = []
    for d, meta, val in exported:
        records.append({"conversation_id": meta.get("conversation_id"), "turn_index": meta.get("turn_index"),
                        "phase": meta.get("benchmark_phase"), "cancelled": bool(meta.get("was_cancelled")),
                        "error": d.get("error"), "prompt_tokens": val("usage_prompt_tokens"),
                        "cached_tokens": val("usage_prompt_cache_read_tokens"),
                        "output_tokens": val("usage_completion_tokens")})

    def total(tag: str) -> float | None:
        v = summary.get(tag)
        return v.get("avg") if isinstance(v, dict) else None

    return {"command": cmd, "wall_s": wall,
            "benchmark_duration_s": total("benchmark_duration"),
            "requests": total("request_count"), "completed": total("completed_request_count"),
            "error_rate_pct": total("request_error_rate"), "error_summary": summary.get("error_summary") or [],
            "prompt_tokens": total("total_usage_prompt_tokens"),
            "output_tokens": total("total_usage_completion_tokens"),
            "cache_read_tokens": total("total_usage_prompt_cache_read_tokens"),
            "cache_read_pct": total("overall_usage_prompt_cache_read_pct"),
            "records": records,
            "server": {k: after[k] - before[k] for k in SERVER_COUNTERS}}


def profile_synthetic(url: str, work: str | Path, cfg: SyntheticConfig = SyntheticConfig(), **kw) -> dict:
    """`aiperf profile` with synthetic prompts (cfg) against `url`; run_aiperf_profile's result."""
    return {"kind": "synthetic", "config": cfg.__dict__, **run_aiperf_profile(url, work, cfg.args(), **kw)}


def profile_mooncake(url: str, work: str | Path, sessions: Sequence[Session] | None = None, concurrency: int = 2,
                     **kw) -> dict:
    """`aiperf profile` on a multi-turn mooncake_trace of `sessions` (default tiny_sessions()) against `url`;
    run_aiperf_profile's result plus the trace's row count and path."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    sessions = list(sessions) if sessions is not None else tiny_sessions()
    if not sessions:
        raise ValueError("no sessions to replay")
    work = Path(work)
    trace = write_aiperf_mooncake(sessions, work / "trace.jsonl")
    rows = read_mooncake(trace)
    args = ["--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
            "--isl-block-size", str(sessions[0].block_size), "--concurrency", str(concurrency),
            "--conversation-num", str(len({r.session_id for r in rows}))]
    return {"kind": "mooncake_trace", "trace": str(trace), "trace_rows": len(rows),
            "trace_sessions": len({r.session_id for r in rows}), **run_aiperf_profile(url, work, args, **kw)}


def format_table(results: Sequence[dict]) -> str:
    """One line per run: AIPerf's counts next to the server's counter gains."""
    head = (f"{'run':<15} {'req':>4} {'err%':>5} {'prompt':>7} {'out':>6} {'srv out':>7} {'cache rd':>8} "
            f"{'srv hits':>8} {'wall s':>7}")
    lines = [head]
    for r in results:
        s = r["server"]
        hits = s["vllm:prefix_cache_hits"] + s["vllm:external_prefix_cache_hits"]
        lines.append(f"{r['kind']:<15} {r['requests'] or 0:>4.0f} {r['error_rate_pct'] or 0:>5.1f} "
                     f"{r['prompt_tokens'] or 0:>7.0f} {r['output_tokens'] or 0:>6.0f} "
                     f"{s['vllm:generation_tokens']:>7.0f} {r['cache_read_tokens'] or 0:>8.0f} {hits:>8.0f} "
                     f"{r['wall_s']:>7.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the k3jax HTTP server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", default="k3-tiny")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--only", choices=("synthetic", "mooncake"), default=None, help="run one profile, not both")
    ap.add_argument("--work", default=None, help="artifact directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write the results (without per-request records) here")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="aiperf_profile_"))
    kw = {"model": args.model, "api_key": args.api_key}
    results = []
    if args.only in (None, "synthetic"):
        results.append(profile_synthetic(args.url, work / "synthetic", **kw))
    if args.only in (None, "mooncake"):
        results.append(profile_mooncake(args.url, work / "mooncake", **kw))
    print(format_table(results))
    print(f"artifacts under {work}")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "records"} for r in results],
                                              indent=1))
    return 0 if all(not r["error_summary"] and (r["error_rate_pct"] or 0) == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
