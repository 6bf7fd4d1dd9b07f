"""Smoke runs of benchmarks/model_forward.py and benchmarks/engine.py on k3-tiny (CPU): they run end to
end and their JSON is sane.

Run: python -m pytest -q tests/test_benchmark_smoke.py
"""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "model_forward.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("model_forward", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_forward_smoke(tmp_path, capsys):
    out = tmp_path / "model_forward.json"
    argv = ["--model", "k3-tiny", "--tokens", "64", "--batch", "4", "--context", "100", "--page-size", "16",
            "--iters", "2", "--steps", "3", "--warmup", "1", "--copy-mib", "16", "--out", str(out)]
    result = load_benchmark().main(argv)
    table = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(result, default=str))
    assert result["model"]["name"] == "k3-tiny" and result["model"]["params"] > 0
    assert result["prefill"]["tokens"] == 64 and result["prefill"]["tokens_per_s"] > 0
    assert result["prefill"]["logits_finite"] and result["decode"]["logits_finite"]
    assert result["decode"]["batch"] == 4 and result["decode"]["tokens_per_s"] > 0
    roof = result["decode_roofline"]
    parts = roof["bytes_per_step"]
    assert parts["total"] == sum(parts[k] for k in ("dense_weights", "activated_experts", "mla_latents",
                                                     "kda_state", "conv_state"))
    # k3-tiny: 7 experts, top 3, batch 4 -> 7 * (1 - (4/7)^4) of each MoE layer's experts are touched
    assert 0 < parts["activated_experts"] < parts["all_weights"]
    assert roof["copy_bandwidth_gbps"] > 0 and roof["ratio"] > 0
    for metric in ("prefill", "decode", "decode roofline", "peak memory"):
        assert metric in table


def test_engine_benchmark_smoke(tmp_path, capsys):
    """benchmarks/engine.py end to end on k3-tiny: every batch size is measured at one token per row per
    step, the host-only fraction is a fraction, the JSON matches what was returned."""
    spec = importlib.util.spec_from_file_location("engine_bench", BENCH.parent / "engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "engine.json"
    result = module.main(["--model", "k3-tiny", "--batches", "3,1", "--prefix", "40", "--suffix", "5",
                          "--page-size", "8", "--steps", "2", "--spec-deadline-s", "0", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [r["batch"] for r in result["decode"]] == [3, 1]
    for r in result["decode"]:
        assert r["tokens_per_step"] == r["batch"] and r["tok_s"] > 0 and r["step_ms"] > 0
        assert 0 <= r["host_only_fraction"] < 1
    assert "engine decode" in capsys.readouterr().out
