"""Concurrency sweep (k3jax bench sweep) against k3-tiny on CPU, the matched-interactivity ratio on curves
with known answers, the throughput timeline, the plots and `k3jax bench compare`."""

from __future__ import annotations

import csv
import json
import math
import random

import numpy as np
import pytest

from k3jax import cli
from serving.workload.replay import RequestRecord
from serving.workload.sweep import (
    compare,
    load_sweep,
    matched_interactivity_ratio,
    pareto_frontier,
    parse_concurrency,
    throughput_at,
    throughput_timeline,
)


def _png_ok(path, min_bytes: int = 15_000):
    """A PNG matplotlib reads back, of a plausible size, that is not one flat colour."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > min_bytes, path.stat().st_size
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] >= 400 and img.shape[1] >= 600
    # lines, text and the grid: many pixels differ from the white background
    assert (img[..., :3] < 0.9).any(axis=-1).mean() > 0.02


def test_full_sweep_of_three_levels_writes_report_and_plots(server, tmp_path, capsys):
    """`k3jax bench sweep` at concurrency 1,2 then 3 (--append) (short preset, k3-tiny, one CPU worker):
    three level reports, sweep.json/csv with the headline numbers, both PNGs, and a timeline that accounts for every
    generated token.

    The worker runs one request at a time and a cold ~1k-token prefill takes 3-8 s on a loaded 2-core
    machine, so sessions start at their first turn (no warm-up turn to wait behind) and every level scores
    at least the first turns that start at t=0; the 40 s grace is an upper bound (a level ends as soon as
    its in-flight requests finish)."""
    out = tmp_path / "sweep"
    common = ["bench", "sweep", "--url", server, "--preset", "short", "--num-sessions", "3", "--warmup-s", "0",
              "--duration-s", "10", "--grace-s", "40", "--idle-gap-cap-s", "0.3", "--no-random-start", "--seed", "4",
              "--timeline-bin-s", "2", "--label", "k3-tiny cpu", "--out", str(out), "--no-progress"]
    # split over two commands as on a machine with a per-command time limit: the second appends level 3
    assert cli.main([*common, "--concurrency", "1,2"]) == 0
    assert [lv["concurrency"] for lv in load_sweep(out)["levels"]] == [1, 2]
    assert cli.main([*common, "--concurrency", "3", "--append"]) == 0
    printed = capsys.readouterr().out
    assert "[k3-tiny cpu]" in printed and "pareto.png" in printed

    sweep = load_sweep(out)
    assert [lv["concurrency"] for lv in sweep["levels"]] == [1, 2, 3]
    assert sweep["label"] == "k3-tiny cpu" and sweep["num_gpus"] == 1
    assert sweep["earlier_commands"][0][-1] == "1,2"
    salts = set()
    for lv in sweep["levels"]:
        req = lv["requests"]
        assert req["errors"] == 0, req["error_examples"]
        assert req["scored"] >= 1, req
        assert lv["output_tokens_per_s_per_gpu"] > 0
        assert lv["p90_interactivity_tokens_per_s"] == pytest.approx(1 / lv["itl_s"]["p90"])
        report = json.loads((out / lv["dir"] / "report.json").read_text())
        assert report["config"]["concurrency"] == lv["concurrency"]
        assert report["output_tokens_per_s_per_gpu"] == lv["output_tokens_per_s_per_gpu"]
        salts.add(report["config"]["salt"])
        # the timeline integrates to every token the level's finished requests generated (warm-up included)
        with open(out / lv["dir"] / "requests.csv") as f:
            rows = list(csv.DictReader(f))
        generated = sum(int(r["completion_tokens"]) for r in rows if not r["error"])
        tl = lv["timeline"]
        assert tl["bin_s"] == 2
        assert sum(tl["output_tokens_per_s_per_gpu"]) * tl["bin_s"] == pytest.approx(generated, rel=1e-9)
    assert len(salts) == 3  # every level has its own prompt namespace: no cache hits across levels

    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["concurrency"]) for r in rows] == [1, 2, 3]
    want = sweep["levels"][2]["output_tokens_per_s_per_gpu"]
    assert float(rows[2]["output_tokens_per_s_per_gpu"]) == pytest.approx(want)
    assert rows[0]["label"] == "k3-tiny cpu"
    _png_ok(out / "pareto.png")
    _png_ok(out / "throughput_over_time.png")

    # a sweep compared with itself: ratio 1 at every point of its frontier
    result = compare(sweep, sweep)
    assert result["rows"] and all(r["ratio"] == pytest.approx(1.0) for r in result["rows"])


# ------------------------------------------------------------------------------------------------ ratio


def _sweep(label, points):
    return {"label": label, "levels": [{"concurrency": i + 1, "p90_interactivity_tokens_per_s": x,
                                        "output_tokens_per_s_per_gpu": y} for i, (x, y) in enumerate(points)]}


def test_matched_interactivity_ratio_interpolates_along_each_frontier():
    # A: y = 1000 - 10 x measured at x = 80, 40, 20, 10 (concurrency rising); B: y = 500 - 5 x at 60, 30, 15
    a = _sweep("A", [(80, 200), (40, 600), (20, 800), (10, 900)])
    b = _sweep("B", [(60, 200), (30, 350), (15, 425)])
    # both lines are exact on their segments: A(30) = 700 between its 20 and 40 points, B(30) = 350 measured
    assert matched_interactivity_ratio(a, b, 30) == pytest.approx(2.0)
    assert matched_interactivity_ratio(a, b, 50) == pytest.approx(500 / 250)
    assert matched_interactivity_ratio(b, a, 15) == pytest.approx(425 / 850)
    # the range ends are inside (B spans [15, 60])
    assert matched_interactivity_ratio(a, b, 60) == pytest.approx(400 / 200)
    # a dominated level (less throughput at less interactivity than another) is not on the frontier
    a_noisy = _sweep("A", [(80, 200), (40, 600), (35, 550), (20, 800), (10, 900)])
    assert pareto_frontier([(x, y) for x, y in [(80, 200), (40, 600), (35, 550)]]) == [(40, 600), (80, 200)]
    assert matched_interactivity_ratio(a_noisy, b, 30) == pytest.approx(2.0)
    # a piecewise-linear curve that is not one line: A'(25) between (20, 800) and (40, 400) is 700
    a_bent = [(20, 800), (40, 400), (10, 1000)]
    assert throughput_at(a_bent, 25) == pytest.approx(700)
    assert matched_interactivity_ratio(a_bent, [(15, 500), (35, 300)], 25) == pytest.approx(700 / 400)


def test_matched_interactivity_ratio_refuses_to_extrapolate():
    a = _sweep("A", [(80, 200), (40, 600), (20, 800), (10, 900)])
    b = _sweep("B", [(60, 200), (30, 350), (15, 425)])
    for x in (5, 12, 70, 100):  # below both; inside A only (below B); inside A only (above B); above both
        with pytest.raises(ValueError, match="outside"):
            matched_interactivity_ratio(a, b, x)
    with pytest.raises(ValueError, match="positive"):
        matched_interactivity_ratio(a, b, math.nan)
    with pytest.raises(ValueError, match="no level"):
        matched_interactivity_ratio(_sweep("E", [(math.nan, 1.0)]), b, 30)
    # compare() covers the overlap [15, 60] at every frontier point of either sweep inside it
    result = compare(a, b)
    assert result["overlap"] == [15, 60]
    assert [r["p90_interactivity_tokens_per_s"] for r in result["rows"]] == [15, 20, 30, 40, 60]
    assert result["ratio_at_high_concurrency"] == pytest.approx(850 / 425)
    assert "error" in compare(a, b, [100])["rows"][0]


def test_parse_concurrency():
    assert parse_concurrency("1,2, 8") == [1, 2, 8]
    for bad in ("", "0,1", "1,1", "a"):
        with pytest.raises(ValueError):
            parse_concurrency(bad)


# ------------------------------------------------------------------------------------------------ timeline


def test_throughput_timeline_spreads_each_request_over_its_decode_span():
    def rec(start, ttft, end, tokens, error=""):
        return RequestRecord(lane=0, session="s", agent="", turn=0, warmup=False, start=start, ttft=ttft, end=end,
                             completion_tokens=tokens, error=error)

    # 11 tokens: the first at t=1.0, ten over [1, 6]: bins of 2 s get 1 + 2 (t 1-2), 4 (2-4), 4 (4-6)
    tl = throughput_timeline([rec(0.5, 0.5, 6.0, 11)], bin_s=2.0, num_gpus=1)
    assert tl["t_s"] == [0.0, 2.0, 4.0]
    assert np.allclose(np.array(tl["output_tokens_per_s_per_gpu"]) * 2, [3, 4, 4])
    # per GPU, errors ignored, t_end extends the axis with empty bins
    tl = throughput_timeline([rec(0.5, 0.5, 6.0, 11), rec(0.0, 0.1, 1.0, 50, error="HTTP 500")], bin_s=2.0,
                             num_gpus=2, t_end=9.0)
    assert len(tl["t_s"]) == 5 and tl["output_tokens_per_s_per_gpu"][-1] == 0
    assert sum(tl["output_tokens_per_s_per_gpu"]) * 2 * 2 == pytest.approx(11)
    # random requests: the integral is every token
    rng = random.Random(0)
    recs = []
    for _ in range(40):
        s = rng.uniform(0, 50)
        recs.append(rec(s, rng.uniform(0.01, 2), s + rng.uniform(2, 20), rng.randint(1, 300)))
    tl = throughput_timeline(recs, bin_s=7.0, num_gpus=1)
    assert sum(tl["output_tokens_per_s_per_gpu"]) * 7 == pytest.approx(sum(r.completion_tokens for r in recs))
    with pytest.raises(ValueError, match="bin_s"):
        throughput_timeline(recs, bin_s=0, num_gpus=1)


# ------------------------------------------------------------------------------------------------ compare CLI


def test_compare_cli_prints_ratios_and_plots_both_curves(tmp_path, capsys):
    a = _sweep("disagg", [(80, 200), (40, 600), (20, 800), (10, 900)])
    b = _sweep("colocated", [(60, 200), (30, 350), (15, 425)])
    for sweep in (a, b):
        for lv in sweep["levels"]:  # what the table prints besides the two curve axes
            lv.update(ttft_s={"p90": 0.5}, cache_hit_rate={"server_reported": 0.9, "theoretical": 0.97},
                      requests={"scored": 10})
        (tmp_path / sweep["label"]).mkdir()
        (tmp_path / sweep["label"] / "sweep.json").write_text(json.dumps(sweep))
    rc = cli.main(["bench", "compare", str(tmp_path / "disagg"), str(tmp_path / "colocated" / "sweep.json"),
                   "--interactivity", "30", "--interactivity", "100", "--plot", str(tmp_path / "both.png"),
                   "--json", str(tmp_path / "cmp.json")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "2.000" in printed and "refused" in printed
    saved = json.loads((tmp_path / "cmp.json").read_text())
    assert saved["rows"][0]["ratio"] == pytest.approx(2.0) and "error" in saved["rows"][1]
    _png_ok(tmp_path / "both.png")
    with pytest.raises(SystemExit):
        cli.main(["bench", "compare", str(tmp_path / "nothing"), str(tmp_path / "colocated")])
