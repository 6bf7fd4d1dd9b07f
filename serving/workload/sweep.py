"""Concurrency sweep of the AgentX replay, the matched-interactivity ratio, and comparing two sweeps.

    k3jax bench sweep --preset short --concurrency 1,2,4 --url http://127.0.0.1:8000 --out runs/sweep
    k3jax bench sweep --preset agentx --concurrency 1,4,16 --serve-args="--model k3-small" --out runs/s
    k3jax bench compare runs/disagg/sweep.json runs/coloc/sweep.json --plot runs/pareto_both.png

A sweep runs one replay (serving/workload/replay.py) per concurrency level, in the order given, against
one server: `--url` for a running one, or `--serve-args` to start `python -m k3jax serve <args>` for the
sweep and stop it after (its log goes to <out>/server.log). Each level gets a fresh prompt namespace (salt),
so no level reuses another's cache. Written under --out:
- c<N>/report.json, summary.csv, requests.csv: each level's replay report;
- sweep.json: the label, the replay settings, and per level the headline numbers plus its throughput
  timeline (`compare` and the plots read only this file);
- sweep.csv: one row of headline numbers per level;
- pareto.png: output tok/s per GPU against P90 interactivity (one line per label);
- throughput_over_time.png: output tok/s per GPU per time bin (60 s by default) for each level.

Matched-interactivity ratio (`matched_interactivity_ratio`): each sweep's points (P90 interactivity,
output tok/s per GPU) are reduced to their Pareto frontier (a point with both lower interactivity and
lower throughput than another is dropped), and each frontier's throughput is interpolated linearly in
interactivity at the asked interactivity. No extrapolation: an interactivity outside either frontier's
measured range (from its lowest to its highest interactivity) is refused with a ValueError, because
throughput beyond the last measured concurrency can saturate or collapse and no line through two points
says which.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from serving.ports import free_port
from serving.workload.replay import (
    Replay,
    ReplayConfig,
    RequestRecord,
    add_replay_arguments,
    config_from_args,
    sessions_from_args,
)
from serving.workload.traces import Session

THROUGHPUT_KEY = "output_tokens_per_s_per_gpu"
INTERACTIVITY_KEY = "p90_interactivity_tokens_per_s"
# the headline numbers a level keeps in sweep.json / sweep.csv (dicts flatten to "key.sub" in the CSV)
LEVEL_KEYS = ("output_tokens_per_s_per_gpu", "total_tokens_per_s_per_gpu", "output_tokens_per_s",
              "request_throughput_per_s", "p90_interactivity_tokens_per_s", "median_interactivity_tokens_per_s",
              "itl_s", "ttft_s", "cache_hit_rate", "requests", "window")
SERVER_READY_LINE = "k3jax serve: ready"


# ------------------------------------------------------------------------------------------------ timeline


def throughput_timeline(records: Iterable[RequestRecord], bin_s: float, num_gpus: int,
                        t_end: float | None = None) -> dict:
    """Output tokens/s per GPU in consecutive `bin_s` bins from t=0 (the replay's start).

    Every finished request counts (warm-up turns included: the server generated those tokens too); its
    output tokens are spread evenly over its decode span [start + ttft, end], the first token at the first
    token's time, so a long request raises every bin it decoded in rather than only the bin it ended in.
    """
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    done = [r for r in records if not r.error and r.completion_tokens > 0 and math.isfinite(r.end)]
    last = max([r.end for r in done] + [t_end or 0.0])
    n_bins = max(1, math.ceil(last / bin_s - 1e-9))
    tokens = np.zeros(n_bins)
    edges = np.arange(n_bins + 1) * bin_s
    for r in done:
        first = r.start + (r.ttft if math.isfinite(r.ttft) else 0.0)
        first = min(first, r.end)
        tokens[min(int(first // bin_s), n_bins - 1)] += 1  # the first token lands at the first token's time
        rest = r.completion_tokens - 1
        if rest <= 0:
            continue
        if r.end <= first:
            tokens[min(int(first // bin_s), n_bins - 1)] += rest
            continue
        # the overlap of [first, end] with each bin, as a share of the span
        overlap = np.clip(np.minimum(edges[1:], r.end) - np.maximum(edges[:-1], first), 0.0, None)
        tokens += rest * overlap / (r.end - first)
    return {"bin_s": bin_s, "t_s": edges[:-1].tolist(),
            "output_tokens_per_s_per_gpu": (tokens / bin_s / num_gpus).tolist()}


# ------------------------------------------------------------------------------------------------ server


class ServerProcess:
    """`python -m k3jax serve <args> --http-port <port>` as a child process, ready once it prints
    SERVER_READY_LINE. Use as a context manager; stop() sends SIGINT (the server drains) and kills the
    process group if it has not exited after `stop_timeout_s`."""

    def __init__(self, serve_args: Sequence[str], port: int | None = None, log_path: str | Path | None = None,
                 env: dict | None = None, ready_timeout_s: float = 900.0, stop_timeout_s: float = 30.0):
        if any(a == "--http-port" or a.startswith("--http-port=") for a in serve_args):
            raise ValueError("serve_args must not set --http-port (the sweep picks the port)")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "k3jax", "serve", *serve_args, "--http-port", str(self.port)]
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=root, start_new_session=True)
        ready = threading.Event()
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w") if self.log_path else None

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if log:
                    log.write(line)
                    log.flush()
                if SERVER_READY_LINE in line:
                    ready.set()
            if log:
                log.close()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(self.lines[-40:])
                raise RuntimeError(f"k3jax serve did not become ready ({' '.join(self.args)}):\n{tail}")
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------------ sweep


def parse_concurrency(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; every level a distinct integer >= 1."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"concurrency levels must be comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise ValueError(f"concurrency levels must be distinct integers >= 1, got {text!r}")
    return levels


def run_sweep(sessions: Sequence[Session], base: ReplayConfig, concurrencies: Sequence[int], out_dir: str | Path,
              label: str = "k3jax", timeline_bin_s: float = 60.0, plots: bool = True,
              extra: dict | None = None, append_to: dict | None = None) -> dict:
    """Replays `sessions` once per concurrency level (base's other settings, a fresh salt each level) and
    writes the per-level reports, sweep.json, sweep.csv and (plots=True) both PNGs under out_dir.
    `append_to`: an earlier sweep (load_sweep) whose levels are kept (one measured again is replaced), for
    sweeps split over several commands. Returns the sweep dict (sweep.json's content, plus "files")."""
    if not concurrencies or min(concurrencies) < 1:
        raise ValueError(f"need concurrency levels >= 1, got {list(concurrencies)}")
    if base.salt is not None and len(concurrencies) > 1:
        raise ValueError("a fixed salt would let later levels hit the cache of earlier ones: leave salt None")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweep = {"label": label, "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
             "num_gpus": base.num_gpus, "timeline_bin_s": timeline_bin_s, "sessions": len(sessions),
             "replay_config": {k: v for k, v in dataclasses.asdict(base).items()
                               if k not in ("concurrency", "api_key", "salt")},
             **(extra or {}), "levels": []}
    if append_to is not None:
        sweep["levels"] = [lv for lv in append_to["levels"] if lv["concurrency"] not in concurrencies]
        sweep["earlier_commands"] = [*append_to.get("earlier_commands", []), append_to.get("command")]
    for c in concurrencies:
        cfg = dataclasses.replace(base, concurrency=c)
        replay = Replay(sessions, cfg)
        report = asyncio.run(replay.run())
        level_dir = out / f"c{c}"
        replay.write(report, level_dir)
        level = {"concurrency": c, "dir": level_dir.name, **{k: report[k] for k in LEVEL_KEYS},
                 "server_metrics": report.get("server_metrics"),
                 "timeline": throughput_timeline(replay.records, timeline_bin_s, cfg.num_gpus,
                                                 t_end=report["window"]["end_s"])}
        sweep["levels"].append(level)
        sweep["levels"].sort(key=lambda lv: lv["concurrency"])
        _write_sweep(sweep, out)  # after every level, so an interrupted sweep keeps what it measured
    files = {"json": out / "sweep.json", "csv": out / "sweep.csv"}
    if plots:
        from serving.workload.plots import plot_pareto, plot_throughput_over_time

        files["pareto_png"] = plot_pareto([sweep], out / "pareto.png")
        files["timeline_png"] = plot_throughput_over_time(sweep, out / "throughput_over_time.png")
    sweep["files"] = {k: str(v) for k, v in files.items()}
    return sweep


def _write_sweep(sweep: dict, out: Path) -> None:
    (out / "sweep.json").write_text(json.dumps(sweep, indent=2, default=str) + "\n")
    rows = [_flatten({k: v for k, v in level.items() if k not in ("timeline", "server_metrics")})
            for level in sweep["levels"]]
    rows = [{k: v for k, v in row.items() if not isinstance(v, list)} for row in rows]
    names = list(dict.fromkeys(k for row in rows for k in row))
    with (out / "sweep.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["label", *names])
        w.writeheader()
        for row in rows:
            w.writerow({"label": sweep["label"], **row})


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_sweep(path: str | Path) -> dict:
    """A sweep.json (or the directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "sweep.json"
    if not p.is_file():
        raise ValueError(f"no sweep.json at {path}")
    sweep = json.loads(p.read_text())
    if not isinstance(sweep, dict) or not isinstance(sweep.get("levels"), list):
        raise ValueError(f"{p} is not a sweep (no 'levels' list)")
    return sweep


# ------------------------------------------------------------------------------------------------ ratio


def pareto_frontier(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (interactivity, throughput) points no other point beats on both axes (ties kept once), sorted
    by interactivity; along it throughput falls as interactivity rises. Non-finite points are dropped."""
    pts = sorted({(float(x), float(y)) for x, y in points if math.isfinite(x) and math.isfinite(y)},
                 key=lambda p: (-p[0], -p[1]))
    frontier = []
    best_y = -math.inf
    for x, y in pts:  # from the most interactive down: keep a point only if it adds throughput
        if y > best_y:
            frontier.append((x, y))
            best_y = y
    return frontier[::-1]


def sweep_points(sweep: dict | Sequence[tuple[float, float]], throughput_key: str = THROUGHPUT_KEY
                 ) -> list[tuple[float, float]]:
    """(P90 interactivity, throughput) per level of a sweep dict; a list of pairs passes through."""
    if isinstance(sweep, dict):
        if not isinstance(sweep.get("levels"), list):
            raise ValueError("a sweep dict needs a 'levels' list (load it with load_sweep)")
        return [(lv.get(INTERACTIVITY_KEY, math.nan), lv.get(throughput_key, math.nan)) for lv in sweep["levels"]]
    return [(float(x), float(y)) for x, y in sweep]


def throughput_at(sweep, interactivity: float, throughput_key: str = THROUGHPUT_KEY) -> float:
    """Throughput on the sweep's Pareto frontier at `interactivity`, interpolated linearly between the two
    neighbouring frontier points; ValueError outside the frontier's measured interactivity range."""
    frontier = pareto_frontier(sweep_points(sweep, throughput_key))
    if not frontier:
        raise ValueError("the sweep has no level with finite interactivity and throughput")
    xs = np.array([p[0] for p in frontier])
    ys = np.array([p[1] for p in frontier])
    lo, hi = xs[0], xs[-1]
    tol = 1e-9 * max(1.0, abs(hi))
    if not lo - tol <= interactivity <= hi + tol:
        raise ValueError(f"interactivity {interactivity:g} tok/s is outside the sweep's measured range "
                         f"[{lo:g}, {hi:g}] tok/s: no extrapolation")
    return float(np.interp(interactivity, xs, ys))


def matched_interactivity_ratio(sweep_a, sweep_b, interactivity: float, throughput_key: str = THROUGHPUT_KEY
                                ) -> float:
    """Throughput of deployment A over deployment B at the same P90 interactivity (tok/s per user).

    Each sweep (a sweep dict, or a list of (interactivity, throughput) pairs) is reduced to its Pareto
    frontier and interpolated linearly in interactivity. Raises ValueError when `interactivity` lies
    outside either frontier's measured range (no extrapolation) or B's throughput there is not positive.
    """
    if not math.isfinite(interactivity) or interactivity <= 0:
        raise ValueError(f"interactivity must be a positive number, got {interactivity}")
    a = throughput_at(sweep_a, interactivity, throughput_key)
    b = throughput_at(sweep_b, interactivity, throughput_key)
    if b <= 0:
        raise ValueError(f"deployment B's throughput at {interactivity:g} tok/s is {b:g}: no ratio")
    return a / b


def overlap(sweep_a, sweep_b, throughput_key: str = THROUGHPUT_KEY) -> tuple[float, float] | None:
    """The interactivity range both frontiers cover, or None."""
    fa = pareto_frontier(sweep_points(sweep_a, throughput_key))
    fb = pareto_frontier(sweep_points(sweep_b, throughput_key))
    if not fa or not fb:
        return None
    lo, hi = max(fa[0][0], fb[0][0]), min(fa[-1][0], fb[-1][0])
    return (lo, hi) if lo <= hi else None


def compare(sweep_a: dict, sweep_b: dict, interactivities: Sequence[float] | None = None,
            throughput_key: str = THROUGHPUT_KEY) -> dict:
    """Matched-interactivity ratios of A over B at the given interactivities, or (None) at every measured
    frontier interactivity of either sweep inside the overlap. The ratio at the overlap's lowest
    interactivity (the high-concurrency end) is `ratio_at_high_concurrency`."""
    span = overlap(sweep_a, sweep_b, throughput_key)
    if interactivities is None:
        if span is None:
            grid = []
        else:
            xs = {p[0] for s in (sweep_a, sweep_b) for p in pareto_frontier(sweep_points(s, throughput_key))}
            grid = sorted(x for x in xs if span[0] <= x <= span[1])
    else:
        grid = list(interactivities)
    rows = []
    for x in grid:
        row = {"p90_interactivity_tokens_per_s": x}
        try:
            row["a"] = throughput_at(sweep_a, x, throughput_key)
            row["b"] = throughput_at(sweep_b, x, throughput_key)
            row["ratio"] = matched_interactivity_ratio(sweep_a, sweep_b, x, throughput_key)
        except ValueError as e:
            row["error"] = str(e)
        rows.append(row)
    ok = [r for r in rows if "ratio" in r]
    return {"a": sweep_a.get("label", "A"), "b": sweep_b.get("label", "B"), "throughput_key": throughput_key,
            "overlap": list(span) if span else None, "rows": rows,
            "ratio_at_high_concurrency": ok[0]["ratio"] if ok else None}


# ------------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    """`k3jax bench sweep`."""
    p = argparse.ArgumentParser(prog="k3jax bench sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", required=True, help="comma-separated levels, run in this order, e.g. 1,2,4")
    p.add_argument("--out", required=True, help="directory for sweep.json, sweep.csv, the PNGs and c<N>/ reports")
    p.add_argument("--label", default=None, help="deployment name on plots and in compare (default: the model)")
    p.add_argument("--timeline-bin-s", type=float, default=60.0, help="bin width of the throughput-over-time plot")
    p.add_argument("--append", action="store_true",
                   help="keep the levels of an existing <out>/sweep.json and add these (a sweep split over commands)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running OpenAI-compatible server")
    where.add_argument("--serve-args", help="start `python -m k3jax serve <these args>` for the sweep "
                                            "(quote them: --serve-args=\"--model k3-small --max-running 64\")")
    add_replay_arguments(p, skip=("url", "concurrency"))
    a = p.parse_args(argv)
    try:
        levels = parse_concurrency(a.concurrency)
    except ValueError as e:
        p.error(str(e))
    sessions = sessions_from_args(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = {"command": ["k3jax", "bench", "sweep", *(sys.argv[1:] if argv is None else argv)],
             "source": {"preset": a.preset, "trace": a.trace, "num_sessions": a.num_sessions}}
    append_to = load_sweep(out) if a.append and (out / "sweep.json").is_file() else None
    if a.serve_args is not None:
        import shlex

        serve_args = shlex.split(a.serve_args)
        with ServerProcess(serve_args, log_path=out / "server.log") as server:
            extra["serve_args"] = serve_args
            sweep = run_sweep(sessions, config_from_args(a, url=server.url, concurrency=levels[0]), levels, out,
                              label=a.label or a.model or "k3jax", timeline_bin_s=a.timeline_bin_s, extra=extra,
                              append_to=append_to)
    else:
        sweep = run_sweep(sessions, config_from_args(a, url=a.url, concurrency=levels[0]), levels, out,
                          label=a.label or a.model or "k3jax", timeline_bin_s=a.timeline_bin_s, extra=extra,
                              append_to=append_to)
    print(format_levels(sweep))
    print("wrote " + ", ".join(sweep["files"].values()))
    return 0


def format_levels(sweep: dict) -> str:
    head = f"{'conc':>5} {'out tok/s/GPU':>14} {'P90 intvty':>11} {'TTFT p90 s':>11} {'hit srv':>8} " \
           f"{'hit theo':>8} {'scored':>7}"
    lines = [f"[{sweep.get('label', '?')}]", head]
    for lv in sweep["levels"]:
        hits = lv.get("cache_hit_rate") or {}
        lines.append(f"{lv['concurrency']:>5} {lv[THROUGHPUT_KEY]:>14.2f} {lv[INTERACTIVITY_KEY]:>11.2f} "
                     f"{lv['ttft_s']['p90']:>11.3f} {hits.get('server_reported', math.nan):>8.3f} "
                     f"{hits.get('theoretical', math.nan):>8.3f} {lv['requests']['scored']:>7}")
    return "\n".join(lines)


def compare_main(argv: Sequence[str] | None = None) -> int:
    """`k3jax bench compare A B`: matched-interactivity throughput ratio of sweep A over sweep B."""
    p = argparse.ArgumentParser(prog="k3jax bench compare",
                                description="Throughput of sweep A over sweep B at matched P90 interactivity "
                                            "(Pareto frontiers interpolated linearly; no extrapolation).")
    p.add_argument("a", help="sweep.json (or its directory) of deployment A")
    p.add_argument("b", help="sweep.json (or its directory) of deployment B")
    p.add_argument("--interactivity", type=float, action="append",
                   help="P90 interactivity (tok/s per user) to compare at; repeatable (default: every measured "
                        "frontier point inside both ranges)")
    p.add_argument("--throughput", default=THROUGHPUT_KEY,
                   choices=("output_tokens_per_s_per_gpu", "total_tokens_per_s_per_gpu"))
    p.add_argument("--plot", help="write both Pareto curves to this PNG")
    p.add_argument("--json", help="write the comparison to this JSON file")
    a = p.parse_args(argv)
    try:
        sa, sb = load_sweep(a.a), load_sweep(a.b)
    except ValueError as e:
        p.error(str(e))
    result = compare(sa, sb, a.interactivity, a.throughput)
    print(format_levels(sa))
    print(format_levels(sb))
    print(f"\n{a.throughput} of {result['a']} / {result['b']} at matched P90 interactivity "
          f"(overlap {result['overlap']}):")
    print(f"{'P90 intvty':>11} {'A':>12} {'B':>12} {'A/B':>7}")
    for row in result["rows"]:
        x = row["p90_interactivity_tokens_per_s"]
        if "ratio" in row:
            print(f"{x:>11.2f} {row['a']:>12.2f} {row['b']:>12.2f} {row['ratio']:>7.3f}")
        else:
            print(f"{x:>11.2f}  refused: {row['error']}")
    if not result["rows"]:
        print("  no interactivity inside both sweeps' measured ranges: no ratio without extrapolation")
    if a.plot:
        from serving.workload.plots import plot_pareto

        print("wrote", plot_pareto([sa, sb], a.plot, throughput_key=a.throughput))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
