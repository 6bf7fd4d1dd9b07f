"""Smoke runs of benchmarks/model_forward.py and benchmarks/engine.py on k3-tiny (CPU): they run end to
end and their JSON is sane; model_forward compares the Pallas kernels (interpret mode) with the reference.

Run: python -m pytest -q tests/test_benchmark_smoke.py
"""

import json
import re

import pytest

import k3jax
from k3jax.testing import load_benchmark_script



def load_benchmark():
    return load_benchmark_script("model_forward")


# k3-tiny is fp32: the Pallas kernels (interpret mode) and the reference differ by summation order only (measured
# <= 1.6e-6 relative on logits and states, 2026-11-30), so 1e-4 catches any wiring error with a wide margin.
TINY_TOL = "1e-4"
TINY_ARGS = ["--model", "k3-tiny", "--tokens", "64", "--batch", "4", "--context", "100", "--page-size", "16",
             "--iters", "2", "--steps", "3", "--warmup", "1", "--copy-mib", "16"]


def test_model_forward_smoke_reference_vs_interpret(tmp_path, capsys):
    """Both backends measured on the same inputs; the kernels ran (dispatch), their results match the
    reference's, and the single-backend layout of earlier runs (top-level prefill/decode/roofline) remains."""
    out = tmp_path / "model_forward.json"
    argv = TINY_ARGS + ["--backends", "reference,interpret", "--decode-tol", TINY_TOL, "--prefill-tol", TINY_TOL,
                        "--out", str(out)]
    module = load_benchmark()
    result = module.main(argv)
    table = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(result, default=str))
    assert result["model"]["name"] == "k3-tiny" and result["model"]["params"] > 0 and result["complete"]
    assert result["backends_run"] == ["reference", "interpret"]
    for name in ("reference", "interpret"):
        r = result["backends"][name]
        assert r["prefill"]["tokens"] == 64 and r["prefill"]["tokens_per_s"] > 0 and r["prefill"]["logits_finite"]
        assert r["decode"]["batch"] == 4 and r["decode"]["tokens_per_s"] > 0 and r["decode"]["logits_finite"]
        assert r["decode"]["timed_steps"] == 3 and r["prefill"]["timed_runs"] == 2
        assert r["decode_roofline"]["ratio"] > 0
    # what ran: the reference backend only references; "interpret" the kernels, except MLA, whose kernels
    # take no k3-tiny latent width (24 + 8: not powers of two) and fall back inside the op
    ref_ops = result["backends"]["reference"]["dispatch"]
    assert {e["impl"] for ph in ref_ops.values() for e in ph["ops"].values()} == {"reference"}
    assert result["backends"]["reference"]["non_reference_ops"] == {"decode": [], "prefill": []}
    assert result["backends"]["interpret"]["non_reference_ops"] == {
        "decode": ["attn_res_mix_norm", "kda_decode_fused", "moe_out_input", "moe_route"],
        "prefill": ["attn_res_mix_norm", "gated_rms_norm", "kda_chunked_fused", "moe_out_input", "moe_route"],
    }
    mla_op = result["backends"]["interpret"]["dispatch"]["decode"]["ops"]["mla_paged_attention"]
    assert mla_op == {"impl": "interpret", "calls": 3, "kernels": {"reference (shape fallback)": 3}}
    # cross-backend checks: every compared output, per layer where it has layers
    checks = result["checks"]["interpret"]
    assert set(checks["decode"]) == {"logits_first_step", "logits_last_step"}
    assert set(checks["prefill"]) == {"logits", "kda_state", "conv_state", "mla_latents"}
    for phase in checks.values():
        for c in phase.values():
            assert c["passed"] and 0 <= c["rel_error"] < float(TINY_TOL), c
    assert len(checks["prefill"]["kda_state"]["per_layer"]) == 6 and len(checks["prefill"]["mla_latents"]["per_layer"]) == 3
    assert result["checks_passed"] is True
    assert set(result["speedup"]["interpret"]) == {"decode", "prefill"}
    # earlier runs' layout: the first backend's numbers at the top level
    assert result["prefill"] == result["backends"]["reference"]["prefill"]
    roof = result["decode_roofline"]
    parts = roof["bytes_per_step"]
    assert parts["total"] == sum(parts[k] for k in ("dense_weights", "activated_experts", "mla_latents",
                                                     "kda_state", "conv_state"))
    # k3-tiny: 7 experts, top 3, batch 4 -> 7 * (1 - (4/7)^4) of each MoE layer's experts are touched
    assert 0 < parts["activated_experts"] < parts["all_weights"]
    assert roof["copy_bandwidth_gbps"] > 0 and roof["ratio"] == result["backends"]["reference"]["decode_roofline"]["ratio"]
    assert list(roof["copy_probes_gbps"]) == ["xla"]  # torch's probe runs on a GPU only; the floor takes the best
    assert roof["copy_bandwidth_gbps"] == max(roof["copy_probes_gbps"].values())
    for metric in ("prefill [interpret]", "decode [reference]", "prefill vs reference", "kernels [interpret]",
                   "checks", "peak memory", "interpret / reference"):
        assert metric in table
    assert "PASS" in table
    header, decode_row, prefill_row = module.speedup_table(result)
    assert header == ["phase", "reference", "interpret", "interpret / reference"]
    assert decode_row[0] == "decode" and "roofline" in decode_row[1] and "roofline" in decode_row[2]
    assert prefill_row[0] == "prefill" and prefill_row[3] == f"{result['speedup']['interpret']['prefill']:.2f}x"


def test_model_forward_failed_phase_and_spent_budget_keep_the_rest(tmp_path, monkeypatch):
    """A phase that raises is recorded with its error; once the budget is spent every later phase is recorded
    as skipped; the JSON on disk holds all of it."""
    module = load_benchmark()
    spent = {"now": False}

    def failing_decode(*args, **kwargs):
        spent["now"] = True  # as if the failure had used up the budget
        raise RuntimeError("Triton compile failed")

    monkeypatch.setattr(module, "bench_decode", failing_decode)
    monkeypatch.setattr(module.Budget, "spent", lambda self: spent["now"])
    # no phase runs the model here: its shapes stand in for the weights (an eager init costs ~10 s)
    monkeypatch.setattr(module, "init_params", lambda cfg, seed, mode: (k3jax.param_shapes(cfg), "shapes", 0.0))
    out = tmp_path / "model_forward.json"
    result = module.main(TINY_ARGS + ["--backends", "reference,interpret", "--budget-s", "100", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result, default=str))
    ref, ker = result["backends"]["reference"], result["backends"]["interpret"]
    assert ref["decode"]["error"] == "RuntimeError: Triton compile failed" and "traceback" in ref["decode"]
    for entry in (ker["decode"], ref["prefill"], ker["prefill"]):
        assert entry["skipped"].startswith("budget of 100.0 s spent")
    assert result["checks"] == {} and result["checks_passed"] is None and result["speedup"] == {}


def test_model_forward_dispatch_only(tmp_path):
    """--dispatch-only traces each backend's steps from shapes alone (the path a step takes when its first call
    hits jax's trace cache and records nothing): k3-tiny's MLA latents (24 + 8) fall back inside the kernel op."""
    out = tmp_path / "dispatch.json"
    result = load_benchmark().main(["--model", "k3-tiny", "--dispatch-only", "--backends", "interpret,reference",
                                    "--batch", "3", "--context", "50", "--tokens", "40", "--page-size", "16",
                                    "--out", str(out)])
    assert json.loads(out.read_text()) == result
    ker, ref = result["backends"]["interpret"], result["backends"]["reference"]
    # the serving layout by default (--fuse 1), as the timed phases: its MoE op is moe_out_input
    assert ker["decode"]["non_reference_ops"] == ["attn_res_mix_norm", "kda_decode_fused", "moe_out_input", "moe_route"]
    assert ker["prefill"]["non_reference_ops"] == ["attn_res_mix_norm", "gated_rms_norm", "kda_chunked_fused",
                                                   "moe_out_input", "moe_route"]
    assert ker["decode"]["dispatch"]["ops"]["mla_paged_attention"]["kernels"] == {"reference (shape fallback)": 3}
    assert ref["decode"]["dispatch"]["ops"]["kda_recurrent"] == {"impl": "reference", "calls": 6}
    assert ref["prefill"]["non_reference_ops"] == []
    unfused = load_benchmark().main(["--model", "k3-tiny", "--dispatch-only", "--backends", "interpret", "--phases",
                                     "decode", "--batch", "3", "--context", "50", "--page-size", "16", "--fuse", "0"])
    assert "moe_experts" in unfused["backends"]["interpret"]["decode"]["non_reference_ops"]  # the checkpoint layout


def test_model_forward_backend_options():
    parse = load_benchmark().parse_args
    assert parse([]).backend_list == ["reference"]
    assert parse(["--backend", "pallas"]).backend_list == ["pallas"]
    assert parse(["--backends", "reference, pallas"]).backend_list == ["reference", "pallas"]
    assert parse(["--phases", "prefill"]).phase_list == ["prefill"]
    for bad in (["--backend", "pallas", "--backends", "reference"], ["--backends", "reference,reference"],
                ["--backends", "cuda"], ["--phases", "train"], ["--budget-s", "0"]):
        with pytest.raises(SystemExit):
            parse(bad)


def test_engine_benchmark_smoke(tmp_path, capsys):
    """benchmarks/engine.py end to end on k3-tiny: every batch size is measured in both scheduling modes at one
    token per row per step, the host-only fraction is a fraction, the floor is the byte count over the best
    probe, the JSON matches what was returned."""
    module = load_benchmark_script("engine")
    out = tmp_path / "engine.json"
    result = module.main(["--model", "k3-tiny", "--batches", "3,1", "--prefix", "40", "--suffix", "5",
                          "--page-size", "8", "--steps", "2", "--spec-deadline-s", "0", "--overlap", "1,0",
                          "--roofline", "--copy-mib", "4,8", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [(r["batch"], r["overlap"]) for r in result["decode"]] == [(3, True), (3, False), (1, True), (1, False)]
    assert result["copy_bandwidth_Bps"] == max(result["copy_probes_Bps"].values()) and len(result["copy_probes_Bps"]) == 4
    for r in result["decode"]:
        assert r["tokens_per_step"] == r["batch"] and r["tok_s"] > 0 and r["step_ms"] > 0
        assert 0 <= r["host_only_fraction"] < 1
        assert r["floor_ms"] > 0 and r["step_over_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"])
    assert "engine decode" in capsys.readouterr().out


def test_model_forward_shadow_check_finds_a_wrong_kernel_and_restriction_bisects(tmp_path, monkeypatch, capsys):
    """`interpret:OP+OP` runs only those kernels (the rest on the reference) and --shadow-check compares every
    kernel call with its twin on the same inputs: a gated RMSNorm 3 % off fails it, the MoE kernel passes, and the
    registry is whole again afterwards."""
    from k3jax import backend

    reference = backend.get("gated_rms_norm", "reference")
    monkeypatch.setitem(backend._REGISTRY, ("gated_rms_norm", "interpret"),
                        lambda *a, **kw: (reference(*a, **kw) * 1.03).astype(a[0].dtype))
    out = tmp_path / "shadow.json"
    argv = TINY_ARGS + ["--backends", "reference,interpret:moe_out_input+gated_rms_norm", "--phases", "prefill",
                        "--shadow-check", "--out", str(out)]
    result = load_benchmark().main(argv)
    spec = "interpret:moe_out_input+gated_rms_norm"  # (the serving layout's MoE op)
    assert sorted(result["backends"][spec]["non_reference_ops"]["prefill"]) == ["gated_rms_norm", "moe_out_input"]
    check = result["shadow_check"][spec]
    assert set(check["prefill"]) == {"gated_rms_norm", "moe_out_input"} and "decode" not in check
    moe, norm = check["prefill"]["moe_out_input"], check["prefill"]["gated_rms_norm"]
    assert moe["passed"] and moe["calls"] > 0 and moe["max_rel_error"] < 1e-4  # fp32: summation order only
    assert not norm["passed"] and abs(norm["max_rel_error"] - 0.03) < 1e-3
    assert not check["passed"]
    assert "interpret" in backend.implemented("kda_chunked_fused")  # the restriction was lifted
    table = capsys.readouterr().out
    assert re.search(rf"shadow check \[{re.escape(spec)}\]\s*\| FAIL", table)


def test_profile_idle_gaps_split_short_and_long():
    """Overlapping kernels cover each other; uncovered time is split at 100 us (launch gaps vs host waits)."""
    module = load_benchmark()
    intervals = [(0.0, 10.0), (12.5, 20.0), (15.0, 30.0), (30.0, 31.0), (231.0, 240.0), (243.0, 250.0)]
    gaps = module.idle_gaps(intervals)
    assert gaps == {"span_us": 250.0, "short_us": 2.5 + 3.0, "long_us": 200.0, "long_count": 1}
    assert module.idle_gaps([]) == {"span_us": 0.0, "short_us": 0.0, "long_us": 0.0, "long_count": 0}
