"""Smoke run of benchmarks/moe.py's MXFP4 variant section (CPU, Pallas interpret mode, tiny shapes): bf16 and the
MXFP4 decode variants run end to end on identical inputs, each is checked against the dense einsum over the
dequantised weights, a wrong variant is flagged and never reported as the best, and the JSON matches the result.

Run: python -m pytest -q tests/test_moe_benchmark_smoke.py
"""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "moe.py"
SMOKE_ARGS = ["--smoke", "--skip", "norms,moe,sweep", "--mxfp4-variants", "interleave,swap,swap_wscale",
              "--sweep-tokens", "5", "--mxfp4-configs", "16/64/64/128/4/4"]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("moe_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mxfp4_variant_section_checks_every_case(tmp_path, capsys, monkeypatch):
    module = load_benchmark()
    real = module.moe_gemm.moe_grouped_mlp

    def wrong_when_scaling_weights(*args, **kwargs):  # swap_wscale returns outputs 5% too large
        out = real(*args, **kwargs)
        return out * 1.05 if kwargs["config"].mxfp4_scale == "weight" else out

    monkeypatch.setattr(module.moe_gemm, "moe_grouped_mlp", wrong_when_scaling_weights)
    out = tmp_path / "mxfp4.json"
    result = module.main(SMOKE_ARGS + ["--out", str(out)])
    table = capsys.readouterr().out
    section = result["mxfp4_variants"]
    assert json.loads(out.read_text())["mxfp4_variants"]["cases"] == json.loads(json.dumps(section["cases"]))
    # bf16 at moe_grouped_mlp's own tiling for 8 rows, then bf16 and each variant at the --mxfp4-configs tiling
    assert [(c["variant"], c["tiling"]) for c in section["cases"]] == [
        ("bf16", "default 16/64/64/128/4/4")] + [(v, "16/64/64/128/4/4") for v in ("bf16", "interleave", "swap", "swap_wscale")]
    assert not section["skipped"]
    cases = {c["variant"]: c for c in section["cases"][1:]}
    # bf16 weights and activations, fp32 accumulation, h rounded to bf16 once: ~4e-3 against the einsum
    # (measured 4.2e-3 / 4.5e-3 on this input), 1e-2 the bound (gpu.md's bf16 band)
    for name in ("bf16", "interleave", "swap"):
        assert cases[name]["correct"] and 1e-4 < cases[name]["rel_err"] < 1e-2, cases[name]
    # the injected 5% error is caught (|1.05 o - o| / |o| = 0.05, plus the bf16 band) and never the best
    assert not cases["swap_wscale"]["correct"] and abs(cases["swap_wscale"]["rel_err"] - 0.05) < 1e-2
    assert section["best"][5]["mxfp4_variant"] in ("interleave", "swap")
    assert "bf16/this" in table and "issue 4 bar" in table and "WRONG" in table
