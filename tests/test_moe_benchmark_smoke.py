"""Smoke run of benchmarks/moe.py's MXFP4 variant section (CPU, Pallas interpret mode, tiny shapes): bf16 and the
MXFP4 decode variants run end to end on identical inputs, each is checked against the dense einsum over the
dequantised weights, a wrong variant is flagged and never reported as the best, and the JSON matches the result.

Run: python -m pytest -q tests/test_moe_benchmark_smoke.py
"""

import json

import numpy as np

from k3jax.testing import load_benchmark_script

SMOKE_ARGS = ["--smoke", "--skip", "norms,moe,sweep", "--mxfp4-variants", "interleave,kmajor",
              "--sweep-tokens", "5", "--mxfp4-configs", "16/64/64/128/4/4"]


def load_benchmark():
    return load_benchmark_script("moe")


def test_mxfp4_variant_section_checks_every_case(tmp_path, capsys, monkeypatch):
    module = load_benchmark()
    real = module.moe_gemm.moe_grouped_mlp

    def wrong_on_checkpoint_layout(x, ids, w, experts, **kwargs):  # "interleave" returns outputs 5% too large
        out = real(x, ids, w, experts, **kwargs)
        return out * 1.05 if module.moe_gemm.mxfp4_layout(experts["gate"]) == "hf" else out

    monkeypatch.setattr(module.moe_gemm, "moe_grouped_mlp", wrong_on_checkpoint_layout)
    out = tmp_path / "mxfp4.json"
    result = module.main(SMOKE_ARGS + ["--out", str(out)])
    table = capsys.readouterr().out
    section = result["mxfp4_variants"]
    assert json.loads(out.read_text())["mxfp4_variants"]["cases"] == json.loads(json.dumps(section["cases"]))
    # bf16 at moe_grouped_mlp's own tiling for 8 rows (DECODE_CONFIG, down kernel at 2 stages), then bf16 and each
    # variant at the --mxfp4-configs tiling
    assert [(c["variant"], c["tiling"]) for c in section["cases"]] == [
        ("bf16", "default 16/64/64/128/4/4/0/2")] + [(v, "16/64/64/128/4/4") for v in ("bf16", "interleave", "kmajor")]
    assert not section["skipped"]
    cases = {c["variant"]: c for c in section["cases"][1:]}
    # bf16 weights and activations, fp32 accumulation, h rounded to bf16 once: ~4e-3 against the einsum
    # (measured 4.2e-3 / 4.5e-3 on this input), 1e-2 the bound (gpu.md's bf16 band)
    for name in ("bf16", "kmajor"):
        assert cases[name]["correct"] and 1e-4 < cases[name]["rel_err"] < 1e-2, cases[name]
    # the injected 5% error is caught (|1.05 o - o| / |o| = 0.05, plus the bf16 band) and never the best
    assert not cases["interleave"]["correct"] and abs(cases["interleave"]["rel_err"] - 0.05) < 1e-2
    assert section["best"][5]["mxfp4_variant"] == "kmajor"
    assert "bf16/this" in table and "issue 4 bar" in table and "WRONG" in table


def test_mgpu_peer_padding_leaves_the_result_unchanged():
    """ragged_dot_mgpu failed at T=16384 on 16361 rows (not a multiple of its tiling): mgpu_moe now pads the sorted
    rows with zero rows counted in the last group. With jax.lax.ragged_dot standing in for the GPU-only kernel, the
    padded peer equals the unpadded ragged_dot MoE exactly (the same bf16 products; pad rows are dropped), also when
    the last expert has no rows of its own."""
    import jax
    import jax.numpy as jnp

    module = load_benchmark()
    rng = np.random.default_rng(0)
    e, k_dim, i_dim = 5, 48, 32
    ids = jnp.asarray(rng.integers(0, e - 1, (37, 2)), jnp.int32)  # expert 4 (the last) empty; 74 rows
    w = jnp.asarray(rng.uniform(0.1, 1, ids.shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((37, k_dim)), jnp.bfloat16)
    keys = jax.random.split(jax.random.key(1), 3)
    experts = {n: (jax.random.normal(kk, (e, *shp)) * shp[0] ** -0.5).astype(jnp.bfloat16)
               for n, kk, shp in zip(("gate", "up", "down"), keys, ((k_dim, i_dim), (k_dim, i_dim), (i_dim, k_dim)))}
    xs, sizes = module.pad_sorted_rows(x, jnp.asarray([10, 0, 27], jnp.int32), 16)  # 37 rows -> 48
    assert xs.shape == (48, k_dim) and sizes.tolist() == [10, 0, 38] and not np.asarray(xs[37:], np.float32).any()
    gate_up = jnp.concatenate([experts["gate"], experts["up"]], axis=-1)
    got = module.mgpu_moe(x, ids, w, gate_up, experts["down"], num_experts=e, ragged=module.xla_ragged_dot_bf16)
    want = module.xla_ragged_moe(x, ids, w, experts, num_experts=e)
    assert got.shape == want.shape and (np.asarray(got, np.float32) == np.asarray(want, np.float32)).all()


def test_sweep_checks_modes_and_reports_the_peer(tmp_path, capsys):
    """--sweep-configs takes the mid-size mode (/tail_block_m); each case is checked against the dense
    einsum, the peer (the padded ragged_dot stand-in on a CPU) is listed, and the summary names the bar."""
    module = load_benchmark()
    args = ["--smoke", "--skip", "norms,moe", "--sweep-tokens", "150", "--sweep-budget-s", "60",
            "--sweep-configs", "64/64/64/64/4/3/32", "--out", str(tmp_path / "s.json")]
    rows = module.main(args)["sweep"]
    table = capsys.readouterr().out
    assert [(r["impl"], r["tiling"]) for r in rows] == [
        ("pallas", "default 64/64/128/64/4/3"), ("pallas", "64/64/64/64/4/3/32"),
        ("ragged_dot_padded_xla", "")]
    assert rows[1]["config"]["tail_block_m"] == 32
    # bf16 activations and weights against the fp32-accumulated bf16 einsum: the 1e-2 band (measured ~4e-3)
    assert all(r["correct"] and r["rel_err"] < 1e-2 for r in rows)
    assert "issue 4 bar" in table and "ragged_dot_padded_xla" in table and "MMA rows / rows" in table
    # the wasted-work model: groups of 100, 0 and 30 rows in 64-row tiles. Packed: tiles 0-1 for expert 0 and 1-2
    # for expert 2 (tile 1 is shared) = 4 items; with 32-row tails an item of at most 32 rows costs 32
    counts = np.array([100, 0, 30])
    cfg = lambda **kw: module.MoeGemmConfig(block_m=64, **kw)
    assert module.mma_rows(cfg(), counts) == 4 * 64
    assert module.mma_rows(cfg(tail_block_m=32), counts) == 64 + 64 + 32 + 32  # items of 64, 36, 28, 2 rows
    assert rows[1]["mma_rows_over_rows"] >= 1


def test_tiling_strings_round_trip():
    """A tiling string names every field it sets (tail_block_m, down_num_stages, down_split_k, aligned, column_group
    only as far as set), and parse_configs reads back the config it names; a wrong field count is refused."""
    import dataclasses

    import pytest

    from pallas_kernels.moe_gemm import DECODE_CONFIG, LARGE_GROUP_DEFAULT, MoeGemmConfig

    bench = load_benchmark()
    down3 = MoeGemmConfig(16, 64, 64, 128, 4, 4, down_num_stages=3)
    split2 = MoeGemmConfig(16, 64, 64, 128, 4, 4, down_split_k=2)
    aligned = MoeGemmConfig(128, 128, 256, 64, 8, 3, tail_block_m=64, aligned=True, down_split_k=2)
    for cfg, name in ((DECODE_CONFIG, "16/64/64/128/4/4/0/2"), (LARGE_GROUP_DEFAULT, "128/128/256/64/8/3/64/0/1/1/8"),
                      (down3, "16/64/64/128/4/4/0/3"), (split2, "16/64/64/128/4/4/0/0/2"),
                      (aligned, "128/128/256/64/8/3/64/0/2/1"),
                      (dataclasses.replace(aligned, column_group=8), "128/128/256/64/8/3/64/0/2/1/8")):
        assert bench.config_name(cfg) == name
        assert bench.parse_configs(name) == [cfg]
    assert bench.parse_configs("128/128/256/64/8/3/64/0/2/1")[0].aligned is True
    with pytest.raises(ValueError, match="6 fields"):
        bench.parse_configs("16/64/64/128/4")
    with pytest.raises(ValueError, match="aligned"):
        bench.parse_configs("16/64/64/128/4/4/0/0/1/2")
    with pytest.raises(ValueError, match="stages"):
        MoeGemmConfig(16, 64, 64, 128, 4, 4, down_num_stages=-1)
    with pytest.raises(ValueError, match="down_split_k"):
        MoeGemmConfig(16, 64, 64, 128, 4, 4, down_split_k=0)


def test_adjacent_peak_rounds_and_the_bar_use_the_paired_share():
    """--sweep-rounds: every round is timed after its own peak (one time and one peak per round, the medians
    reported); the summary judges the bar on the median of the per-round shares, not on the run's one peak."""
    import jax
    import jax.numpy as jnp

    module = load_benchmark()
    f = jax.jit(lambda a: a @ a)
    sec, paired = module.timed_with_adjacent_peak(f, (jnp.ones((32, 32)),), rounds=3, peak_n=48)
    assert len(paired["round_ms"]) == 3 and len(paired["round_peaks_tflops"]) == 3
    assert sec * 1e3 == sorted(paired["round_ms"])[1] and paired["adjacent_peak_tflops"] == sorted(
        paired["round_peaks_tflops"])[1]
    base = dict(tokens=16384, impl="pallas", weights="bf16", correct=True, rows_per_expert=294.0, tiling="t",
                ms=2.8, of_matmul_peak=0.61)
    peer = dict(tokens=16384, impl="ragged_dot_mgpu", weights="bf16", ms=3.8, rows_per_expert=294.0)
    paired_row = dict(base, of_adjacent_peak=0.59, of_adjacent_peak_min=0.55, of_adjacent_peak_max=0.62,
                      round_ms=[2.8] * 5)
    (line,) = module.sweep_summary([paired_row, peer])
    assert "59.0 % of the adjacent jnp.dot peaks (median of 5 rounds, 55.0-62.0 %)" in line and "NOT met" in line
    (line,) = module.sweep_summary([base, peer])
    assert "61.0 % of the jnp.dot peak" in line and line.endswith(": met")


def test_dep_section_receives_tokens_with_local_picks_and_agrees(tmp_path, capsys):
    """The DEP section (--dep-tokens): a rank receives exactly the tokens with a local pick, their other picks as -1;
    the forms agree (the weight-0 rows add exact zeros; the expected-rows tiling only tiles; one row per pick
    rounds each row to bf16 before the per-token sum: within the bf16 band) and the table reports them."""
    module = load_benchmark()
    shape = module.SMOKE_SHAPES["tiny"]
    ids, weights, local_picks = module.dep_routing(shape, 40, seed=3)
    assert ids.shape[1] == shape["top_k"] and weights.shape == ids.shape
    kept = ids >= 0
    assert kept.any(axis=1).all() and kept.sum() == local_picks and ids.max() < shape["local"]
    assert (ids[~kept] == -1).all() and (~kept).any()
    result = module.main(["--smoke", "--skip", "norms,moe,sweep", "--dep-tokens", "30",
                          "--out", str(tmp_path / "dep.json")])
    (row,) = result["dep"]
    assert row["rel_err_weight0_vs_dropped"] == 0.0
    assert row["rel_err_expected_vs_dropped"] < 1e-6 and row["expected_rows"] >= 1  # a tiling choice only
    assert row["rel_err_expected_xla_combine_vs_dropped"] < 1e-6  # (and the combine kernel the same adds as XLA's)
    assert 0 < row["rel_err_one_row_vs_dropped"] < 1e-2
    assert "dep: 30 tokens routed" in capsys.readouterr().out
