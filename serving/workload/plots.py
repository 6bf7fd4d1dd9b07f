"""PNG plots of concurrency sweeps (matplotlib, Agg backend: no display needed).

- `plot_pareto(sweeps, path)`: output tokens/s per GPU against P90 interactivity (tok/s per user), one
  line per sweep (deployment label), each point annotated with its concurrency. The published AgentX
  charts put interactivity on x and throughput per GPU on y; up and to the right is better.
- `plot_throughput_over_time(sweep, path)`: output tokens/s per GPU in each time bin of every level's
  run, the scored window shaded, to show warm-up, steady state and drain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from serving.workload.sweep import THROUGHPUT_KEY, pareto_frontier, sweep_points

_THROUGHPUT_LABELS = {"output_tokens_per_s_per_gpu": "output tokens/s per GPU",
                      "total_tokens_per_s_per_gpu": "total (input + output) tokens/s per GPU"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(sweeps: Sequence[dict], path: str | Path, throughput_key: str = THROUGHPUT_KEY,
                title: str | None = None) -> Path:
    """One line per sweep through its levels in concurrency order (dominated levels drawn hollow: they are
    not on the Pareto frontier the matched ratio uses). Returns the PNG's path."""
    if not sweeps:
        raise ValueError("plot_pareto needs at least one sweep")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5.0), dpi=120)
    for sweep in sweeps:
        levels = sorted(sweep["levels"], key=lambda lv: lv["concurrency"])
        pts = sweep_points({"levels": levels}, throughput_key)
        ok = [(lv["concurrency"], x, y) for lv, (x, y) in zip(levels, pts, strict=True)
              if math.isfinite(x) and math.isfinite(y)]
        if not ok:
            continue
        frontier = set(pareto_frontier([(x, y) for _, x, y in ok]))
        line, = ax.plot([x for _, x, _ in ok], [y for _, _, y in ok], "-", label=sweep.get("label", "?"))
        for c, x, y in ok:
            on = (x, y) in frontier
            ax.plot(x, y, "o", color=line.get_color(), markerfacecolor=line.get_color() if on else "white")
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("P90 interactivity = 1 / P90 inter-token latency (tokens/s per user)")
    ax.set_ylabel(_THROUGHPUT_LABELS.get(throughput_key, throughput_key))
    ax.set_title(title or "AgentX replay: throughput vs interactivity (c = concurrent sessions)")
    ax.set_xlim(left=0, right=ax.get_xlim()[1] * 1.08)  # room for the last point's label
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(title="deployment")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_throughput_over_time(sweep: dict, path: str | Path, title: str | None = None) -> Path:
    """Each level's output tokens/s per GPU per time bin (step line) from its replay's start; the scored
    window [warm-up end, warm-up + duration) shaded. Returns the PNG's path."""
    levels = [lv for lv in sweep["levels"] if lv.get("timeline")]
    if not levels:
        raise ValueError("the sweep has no level with a throughput timeline")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    bin_s = levels[0]["timeline"]["bin_s"]
    unit, scale = ("min", 60.0) if bin_s >= 60 else ("s", 1.0)
    w = levels[0]["window"]
    ax.axvspan(w["start_s"] / scale, w["end_s"] / scale, color="0.9", label="scored window")
    for lv in sorted(levels, key=lambda lv: lv["concurrency"]):
        tl = lv["timeline"]
        ts = [t / scale for t in tl["t_s"]] + [(tl["t_s"][-1] + tl["bin_s"]) / scale]
        ys = tl["output_tokens_per_s_per_gpu"]
        ax.stairs(ys, ts, label=f"c={lv['concurrency']}", linewidth=1.6)
    ax.set_xlabel(f"time since the level's start ({unit}); bins of {bin_s:g} s")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title or f"{sweep.get('label', '?')}: output throughput over time per concurrency level")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out

