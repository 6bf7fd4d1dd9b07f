"""KDA kernels on one GPU: ours (pallas_kernels/kda_*.py) vs fla-core 0.6.0 on identical inputs.

    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/kda.py --out $OUT/kda.json

Shapes (issue 3), bf16 activations, fp32 V-first states, D = 128, K3's gate (lower bound -5), gate / beta
sigmoid / q-k L2 norm fused on both sides:
  prefill  packed (cu_seqlens) B1 T32768 / B8 T4096 at H32 and H96: ours `kda_chunk` (both state passes,
           and the opt-in solve="pallas") vs fla `chunk_kda` (safe_gate, state_v_first); throughput =
           tokens / time. On the first case
           also: our stages apart (XLA intra-chunk stage, Pallas state pass), the state pass's V-block
           sweep, and page-64 / page-256 checkpoint emission vs none. --stage1 default,v2 times every
           kda_chunk stage-1 variant at every prefill case (ours_stage1_<v>_ms, ratio_stage1_<v>; first
           case: stage_intra_<v>_ms and stage1_hlo, the compiled stage's traffic proxy on this backend);
           --prefill-parts picks the rest. Stage-1 comparison alone (at most 570 s on the H200; fla from
           the carried wheel: python3 -m pip install -q --no-index --no-deps --target /tmp/site
           .whl/fla_core-0.6.0-py3-none-any.whl, then PYTHONPATH=/tmp/site:.):
             XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 timeout 570 python3 benchmarks/kda.py \
               --order prefill1,prefill --prefill 1x32768x32,8x4096x32 --stage1 default,v2 \
               --prefill-parts stages --case-limit 200 --fla-first-call-limit 240 --out $OUT/kda.json
           --stage1-hlo-only prints the proxy alone (compile only; runs on CPU). The Pallas stage-1 forms
           by knob (names: pallas_stage1_knobs, pallas2_stage1_knobs), stage 1 alone plus the whole prefill
           for plain "pallas2", without fla:
             ... benchmarks/kda.py --no-fla --order prefill1 --prefill 1x32768x32 --prefill-parts stages \
               --stage1 v2,pallas2,pallas_w8_blocks,pallas2_k64,pallas2_w4,pallas2_tf32x3 --case-limit 540
  decode   B64 / B256 at T1 (decode) and T4 (verify), H96: ours `kda_decode` (conv + norms + gate + delta rule +
           gated RMSNorm, pools in place; verify reads each state once and writes every position's state update,
           k3jax.kda's module docstring) vs fla `fused_recurrent_kda` (no conv, no output norm; final state only)
           and fla's kernel in its pooled mode (vLLM's: states read and written in place through slot indices,
           verify writing every position's state to its own slot; fla_pooled_ms, ratio_pooled). State traffic =
           fp32 state bytes read + written (decode: read + write once; verify: read once, plus the updates); the
           limit is the copy bandwidth. Verify cases also time keeping the accepted prefix (all T positions) in the
           pool, donated: ours rebuilds it from the updates (commit_ms: pallas_kernels.kda_commit, one state read
           and written per row; commit_xla_ms its XLA twin), fla's job copies the kept position's state
           (commit_states_ms); the whole round of each: ours_round_ms = ours_ms + commit_ms against
           fla_pooled_round_ms (ratio_round).
           Ours runs at every --decode-block-v x --decode-warps tiling (ours_bv{V}_w{W}_ms; 128 = the
           whole-state kernel; warps outer) while the case has time left; ours_ms is the best (ours_best);
           fla is timed once, after the first tiling. hlo_pool_copies: copies of a pool in the blocked
           decode step's optimized HLO (0 = the q|k conv-state scatter stays in place in the donated pool).
           --decode-variants
           mgpu[_s<stages>][_o<operand stages>][_c<ctas>][_perpos][_pnorm][_seq][_prepnorm][_prep1] adds
           the Mosaic GPU kernel (kda_decode_mgpu, decode and verify; _o sets verify's operand ring, the
           flags turn verify's T = 4 forms off, MGPU_FORM_FLAGS): ours_mgpu*_ms, its outputs against the Triton
           default's (rel_*_mgpu*_vs_triton) and its pool copies (hlo_pool_copies_mgpu*); it competes for
           ours_best like any tiling.
           --decode-profile: each variant's step also traced under jax.profiler (10 calls; needs --no-fla,
           torch's CUPTI takes the device trace away): profile_<variant> holds the kernels' device time per
           step against the step's span (what the 2026-12-03 fix was found with: 3 broadcast kernels per step).
  copy     torch and XLA device copies (bytes read + written) measured in the same run: the bandwidth limit.
Timing: one warm-up (compile) call, then reps sized to ~25 ms per trial, median over --trials.
Every case runs under --case-limit seconds (SIGALRM; a compile in progress is only interrupted when it
returns), except fla chunk_kda's first call, which autotunes for over a minute (the 2026-11-30 runs
lost every fla prefill time to a 35 s and then a 110 s limit) and has --fla-first-call-limit of its own;
later cases reuse fla's tuned configs where its autotune keys match. The first prefill case measures our
time and fla's before its stages, checkpoints and sweep; the JSON is rewritten after every measurement.
Prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import re
import signal
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kda_chunk as kc
from pallas_kernels import kda_intra, kda_intra_lk
from pallas_kernels.kda_decode import kda_decode
from pallas_kernels.kda_decode_mgpu import kda_decode_mgpu
from pallas_kernels.kda_state_pass import kda_state_pass
from pallas_kernels.kda_state_pass_split import kda_state_pass_split

D = 128
LB = -5.0
# kda_chunk's stage1 values; other --stage1 names time stage 1 alone
KDA_CHUNK_STAGE1 = ("default", "v2", "pallas", "pallas2")


class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout("case time limit")


def _reps(one_call_s, target_s=0.025):
    return int(min(100, max(1, math.ceil(target_s / max(one_call_s, 1e-6)))))


def time_jax(fn, trials):
    jax.block_until_ready(fn())  # compile + warm
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    reps = _reps(time.perf_counter() - t0)
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def time_torch(fn, trials):
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    reps = _reps(time.perf_counter() - t0)
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def to_torch(x):
    import torch

    return torch.from_dlpack(x)


def copy_bandwidth(results, trials, use_torch=True):
    n = 1 << 28  # 1 GiB of fp32
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0)
    results["copy_xla_TBps"] = 2 * 4 * n / time_jax(functools.partial(f, x), trials) / 1e12
    del x  # (a partial, not a lambda: the timed call holds no reference to the name once it returns)
    if not use_torch:  # --no-fla: no torch in the process (its bundled CUPTI took jax.profiler's device trace away)
        return
    try:
        import torch

        a = torch.ones(n, device="cuda")
        b = torch.empty_like(a)
        results["copy_torch_TBps"] = 2 * 4 * n / time_torch(functools.partial(b.copy_, a), trials) / 1e12
        del a, b
    except Exception as e:  # noqa: BLE001 -- torch is optional
        results["copy_torch_error"] = repr(e)


def prefill_inputs(b, t, h):
    ks = jax.random.split(jax.random.key(b * 7 + h), 8)
    total = b * t
    q, k, v, z = (jax.random.normal(ks[i], (total, h, D), jnp.bfloat16) for i in range(4))
    return dict(q=q, k=k, v=v, z=z, beta=jax.random.normal(ks[4], (total, h), jnp.float32),
                s0=0.1 * jax.random.normal(ks[5], (b, h, D, D), jnp.float32),
                a_log=0.5 * jax.random.normal(ks[6], (h,), jnp.float32),
                dt_bias=jax.random.normal(ks[7], (h * D,), jnp.float32),
                cu=jnp.arange(b + 1, dtype=jnp.int32) * t)


def prefill_case(row, b, t, h, args, fla, deadline, detail, save):
    """Ours (both state passes); on the detail case the stages apart and checkpoints; fla; then the sweep."""
    x = prefill_inputs(b, t, h)
    kw = dict(a_log=x["a_log"], dt_bias=x["dt_bias"], gate="lower_bound", lower_bound=LB, beta_sigmoid=True,
              qk_l2norm=True, interpret=args.interpret)
    ours = lambda **extra: kc.kda_chunk(x["q"], x["k"], x["v"], x["z"], x["beta"], x["s0"], x["cu"],
                                        **{**kw, "stage1": args.base_stage1, **extra})
    row["tokens"] = b * t
    o, final, _ = ours()
    row["ours_ms"] = 1e3 * time_jax(ours, args.trials)
    row["ours_Mtok_s"] = b * t / row["ours_ms"] / 1e3
    save()
    for variant in args.stage1:  # opt-in stage-1 variants beside the default, before fla's long first call
        if variant == "default" or variant not in KDA_CHUNK_STAGE1:  # the others are timed in prefill_stages
            continue
        try:
            o_var, final_var, _ = ours(stage1=variant)
            row[f"ours_stage1_{variant}_ms"] = 1e3 * time_jax(lambda: ours(stage1=variant), args.trials)
            row[f"rel_o_stage1_{variant}_vs_default"] = rel(jnp.asarray(o_var, jnp.float32),
                                                            jnp.asarray(o, jnp.float32))
            row[f"rel_state_stage1_{variant}_vs_default"] = rel(final_var, final)
        except CaseTimeout:
            raise
        except Exception as e:  # noqa: BLE001 -- keep the case's other numbers
            row[f"ours_stage1_{variant}_error"] = repr(e)[:500]
        save()
    if fla is not None:  # the ratio first; fla's first call (autotuning) runs on its own time limit
        prefill_fla(row, args, fla, x, o, final)
        deadline += row.get("fla_first_call_s", 0.0)
        save()
    if detail and "stages" in args.prefill_parts:  # stage 1 alone per variant first: this run's question
        staged = prefill_stages(row, b, t, args, x, ours, save)
    if "split" in args.prefill_parts:
        o_split, _, _ = ours(state_pass="split")
        row["ours_split_ms"] = 1e3 * time_jax(lambda: ours(state_pass="split"), args.trials)
        row["rel_o_split_vs_fused"] = rel(jnp.asarray(o_split, jnp.float32), jnp.asarray(o, jnp.float32))
        row["ours_Mtok_s"] = b * t / min(row["ours_ms"], row["ours_split_ms"]) / 1e3
        if "fla_ms" in row:
            row["ratio_split"] = row["fla_ms"] / row["ours_split_ms"]
        save()
    if "solve_pallas" in args.prefill_parts:
        prefill_solve_pallas(row, args, ours, o, save)
    if detail and "ckpt" in args.prefill_parts:
        prefill_checkpoints(row, args, ours, save)
    if detail and "sweep" in args.prefill_parts and "stages" in args.prefill_parts:
        state_sweep(row, b * t, b, args, deadline, x["s0"], staged, save)


def prefill_solve_pallas(row, args, ours, o, save):
    """The opt-in Pallas L / Aqk / inverse kernel (solve="pallas"), whole prefill."""
    try:
        o_pallas, _, _ = ours(solve="pallas")
        row["ours_solve_pallas_ms"] = 1e3 * time_jax(lambda: ours(solve="pallas"), args.trials)
        row["rel_o_solve_pallas_vs_xla"] = rel(jnp.asarray(o_pallas, jnp.float32), jnp.asarray(o, jnp.float32))
        if "fla_ms" in row:
            row["ratio_solve_pallas"] = row["fla_ms"] / row["ours_solve_pallas_ms"]
    except CaseTimeout:
        raise
    except Exception as e:  # noqa: BLE001 -- not yet run on a GPU: keep the case's other numbers
        row["ours_solve_pallas_error"] = repr(e)[:500]
    save()


def prefill_checkpoints(row, args, ours, save):
    """Page-256 and page-64 checkpoint emission vs none (whole prefill)."""
    for page in (256, 64):
        row[f"ours_ckpt{page}_ms"] = 1e3 * time_jax(lambda page=page: ours(checkpoint_page_size=page), args.trials)
        row[f"ckpt{page}_overhead"] = row[f"ours_ckpt{page}_ms"] / row["ours_ms"] - 1
        save()


def prefill_fla(row, args, fla, x, o, final):
    """fla chunk_kda on the same inputs. Its first call autotunes many Triton kernels (over a minute on
    the H200): that call runs under --fla-first-call-limit instead of the case's limit."""
    import torch

    tq, tk, tv, tz = (to_torch(x[n]).unsqueeze(0) for n in ("q", "k", "v", "z"))
    tb, ts0 = to_torch(x["beta"]).unsqueeze(0), to_torch(x["s0"]).clone()
    tcu = to_torch(x["cu"]).long()
    call = lambda: fla.chunk_kda(
        tq, tk, tv, tz, tb, A_log=to_torch(x["a_log"]), dt_bias=to_torch(x["dt_bias"]), initial_state=ts0,
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB, state_v_first=True, cu_seqlens=tcu)
    case_left = signal.alarm(int(args.fla_first_call_limit))
    t0 = time.monotonic()
    try:
        with torch.no_grad():
            fo, ff = call()
        torch.cuda.synchronize()
    finally:
        row["fla_first_call_s"] = time.monotonic() - t0
        signal.alarm(max(1, case_left) if case_left else 0)
    with torch.no_grad():
        row["fla_ms"] = 1e3 * time_torch(call, args.trials)
    row["rel_o_vs_fla"] = rel(jnp.asarray(o, jnp.float32), np.asarray(fo[0].float().cpu()))
    row["rel_state_vs_fla"] = rel(final, np.asarray(ff.float().cpu()))
    row["ratio"] = row["fla_ms"] / row["ours_ms"]
    for key in [k for k in row if k.startswith("ours_stage1_") and k.endswith("_ms")]:
        row["ratio_" + key[len("ours_"):-3]] = row["fla_ms"] / row[key]


def prefill_stages(row, b, t, args, x, ours, save):
    """The XLA intra-chunk stage alone (every --stage1 variant; on a GPU also its compiled HLO's traffic
    proxy), then each state pass (default V-block) on the default stage's output. Returns that output for
    the sweep."""
    total = b * t
    num_chunks = total // kc.CHUNK + 2 * b
    cu32, start, a, bias = kc._preprocess_args(x["q"], x["z"], x["beta"], x["s0"], x["cu"], "lower_bound",
                                               x["a_log"], x["dt_bias"], None)

    @functools.partial(jax.jit, static_argnames=("solve", "stage1"))
    def intra(solve="xla", stage1="default"):
        first, tok_start, length, ckpt_idx = kc.chunk_table(cu32, start, num_chunks, 0)
        return (first, tok_start, length, ckpt_idx) + stage1_call(stage1, tok_start, length, x, a, bias, solve,
                                                                  args.interpret)

    row["stage_intra_ms"] = 1e3 * time_jax(intra, args.trials)
    for variant in args.stage1:
        if variant != "default":
            try:  # one variant failing to compile (a Triton limit) must not cost the others their timings
                row[f"stage_intra_{variant}_ms"] = 1e3 * time_jax(lambda: intra(stage1=variant), args.trials)
            except CaseTimeout:
                raise
            except Exception as e:  # noqa: BLE001
                row[f"stage_intra_{variant}_error"] = repr(e)[:500]
            save()
    if not args.interpret:  # the GPU's own fusion decisions: the traffic proxy as XLA compiled it here
        try:
            # XLA stages only: a kda_intra variant is one custom call (no proxy), and its compile costs ~10 s
            xla_stages = [v for v in args.stage1 if not v.startswith("pallas")]
            row["stage1_hlo"] = stage1_hlo(xla_stages, b, t, x["q"].shape[1])
        except CaseTimeout:
            raise
        except Exception as e:  # noqa: BLE001 -- a proxy only: keep the timings
            row["stage1_hlo_error"] = repr(e)[:500]
        save()
    if "profile" in args.prefill_parts:  # where stage 1's time goes: device time per kernel, per variant
        for variant in args.stage1:
            row[f"stage_intra_{variant}_profile"] = profile_stage(lambda: intra(stage1=variant))
            save()
    if "solve_pallas" in args.prefill_parts:
        try:
            row["stage_intra_solve_pallas_ms"] = 1e3 * time_jax(lambda: intra(solve="pallas"), args.trials)
        except CaseTimeout:
            raise
        except Exception as e:  # noqa: BLE001 -- keep the case's other numbers
            row["stage_intra_solve_pallas_error"] = repr(e)[:500]
    staged = intra()
    for name in ("fused", "split") if "split" in args.prefill_parts else ("fused",):
        row[f"stage_state_{name}_ms"] = time_state(name, None, 4, staged, x["s0"], total, b, args)
        save()
    return staged


def profile_stage(fn, calls: int = 3) -> dict:
    """Device time per kernel of `fn` (warm) over `calls` calls traced by jax.profiler, per call (the breakdown of
    benchmarks/model_forward.py --profile; its top 80 kernels)."""
    import tempfile

    from k3jax.testing import load_benchmark_script

    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn())
        return load_benchmark_script("model_forward").profile_kernel_times(trace_dir, calls)


def pallas_stage1_knobs(variant):
    """kda_intra's settings from a stage-1 variant name "pallas[_w<warps>][_s<stages>][_<inverse>][_skip-<part>
    [+<part>...]]", knobs in any order: warps (default 4), Triton num_stages (default 1), the inverse's dot
    precision (ieee, tf32, tf32x3, or blocks: the 16x16-block substitution with IEEE dots; default tf32x3) and the
    benchmark-only ablation parts (kda_intra.SKIPPABLE:
    load, exp, scan, lk, inverse, wu; wrong outputs, cost by difference). E.g. "pallas_w2", "pallas_w8_blocks",
    "pallas_w4_skip-inverse", "pallas_w8_skip-lk+inverse+wu"."""
    knobs = dict(num_warps=4, num_stages=1, inverse_precision="tf32x3", _skip=frozenset())
    for knob in variant.split("_")[1:]:
        if re.fullmatch(r"w\d+", knob):
            knobs["num_warps"] = int(knob[1:])
        elif re.fullmatch(r"s\d+", knob):
            knobs["num_stages"] = int(knob[1:])
        elif knob in kda_intra.INVERSE_PRECISIONS:
            knobs["inverse_precision"] = knob
        elif knob.startswith("skip-") and set(knob[5:].split("+")) <= set(kda_intra.SKIPPABLE):
            knobs["_skip"] = frozenset(knob[5:].split("+"))
        else:
            raise ValueError(f"unknown knob {knob!r} in stage1 variant {variant!r} (see pallas_stage1_knobs)")
    return knobs


def pallas2_stage1_knobs(variant):
    """The two-kernel stage 1's settings (`kda_chunk._intra_stage_pallas2`: `kda_intra_lk` then `kda_intra_wu`)
    from a variant name "pallas2[_w<lk warps>][_k<block_k>][_wu<wu warps>][_<inverse>][_f32keep]", knobs in any
    order: kda_intra_lk's warps (default 8), its K slice (default 128: the whole head dim), kda_intra_wu's warps
    (default 4), the 16x16 inverse's dot precision (ieee or tf32x3; default ieee) and f32keep (the factored key
    blocks kept in fp32 instead of the stored dtype). E.g. "pallas2", "pallas2_w4_k32", "pallas2_k64_wu8_tf32x3"."""
    knobs = dict(num_warps=8, block_k=128, wu_num_warps=4, inverse_precision="ieee", keep="stored")
    for knob in variant.split("_")[1:]:
        if re.fullmatch(r"w\d+", knob):
            knobs["num_warps"] = int(knob[1:])
        elif re.fullmatch(r"k\d+", knob):
            knobs["block_k"] = int(knob[1:])
        elif re.fullmatch(r"wu\d+", knob):
            knobs["wu_num_warps"] = int(knob[2:])
        elif knob in kda_intra_lk.INVERSE_PRECISIONS:
            knobs["inverse_precision"] = knob
        elif knob == "f32keep":
            knobs["keep"] = "f32"
        else:
            raise ValueError(f"unknown knob {knob!r} in stage1 variant {variant!r} (see pallas2_stage1_knobs)")
    return knobs


def stage1_call(variant, tok_start, length, x, a, bias, solve="xla", interpret=False):
    """Stage 1 (`kda_chunk._intra_stage`, the opt-in `_intra_stage_v2`, the one-kernel `kda_intra` as
    "pallas[_knob...]", see `pallas_stage1_knobs`: warps, stages, inverse precision, ablations; or the
    two-kernel `_intra_stage_pallas2` as "pallas2[_knob...]", see `pallas2_stage1_knobs`; only plain "pallas"
    and "pallas2" are also kda_chunk stage1 values, the others time the stage alone) as kda_chunk calls it."""
    kw = dict(gate="lower_bound", lower_bound=LB, beta_sigmoid=True, qk_l2norm=True, scale=D**-0.5, bounded=True,
              stored=jnp.bfloat16)
    args = (tok_start, length, x["q"], x["k"], x["v"], x["z"], x["beta"], a, bias)
    if variant == "v2":
        return kc._intra_stage_v2(*args, **kw)
    if variant == "pallas2" or variant.startswith("pallas2_"):
        del kw["bounded"], kw["gate"]
        return kc._intra_stage_pallas2(*args, **kw, **pallas2_stage1_knobs(variant), interpret=interpret)
    if variant == "pallas" or variant.startswith("pallas_"):
        del kw["bounded"]
        return kda_intra.kda_intra(*args, **kw, **pallas_stage1_knobs(variant), interpret=interpret)
    if variant != "default":
        raise ValueError(f"unknown stage1 variant {variant!r}")
    return kc._intra_stage(*args, solve=solve, interpret=interpret, **kw)


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8}
_HLO_SHAPE = re.compile(r"\b(pred|s8|u8|bf16|f16|f32|s32|u32|f64|s64)\[([0-9,]*)\]")
_HLO_INSTR = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)")


def _hlo_bytes(text):
    return sum(_DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in _HLO_SHAPE.findall(text))


def _hlo_instr(rhs):
    """'f32[2,3]{1,0} fusion(%a, %b), kind=...' -> (result type text, opcode, operand names, the rest)."""
    out_t = rhs[: rhs.index(")") + 1] if rhs.startswith("(") else rhs.split(" ", 1)[0]
    rest = rhs[len(out_t):].strip()
    if "(" not in rest:
        return out_t, rest, [], rest
    op, args = rest[: rest.index("(")], rest[rest.index("(") + 1:]
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            end = i
            break
    return out_t, op, re.findall(r"%([\w.\-]+)", args[:end]), rest


def hlo_traffic(hlo_text):
    """Traffic proxy of an optimized HLO module: its entry computation's ops (fusions, custom calls, ...;
    parameters, constants, tuples and bitcasts apart), the bytes they write (every result is a buffer in
    memory) and read (each distinct operand once; a fusion operand used only through slices / gathers
    counts those). Ignores caching and fusion-internal re-reads: a proxy for comparing variants."""
    comps, cur, entry = {}, None, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if head:
            cur = comps.setdefault(head.group(2), [])
            entry = head.group(2) if head.group(1) else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None and (m := _HLO_INSTR.match(line)):
            cur.append((m.group(1),) + _hlo_instr(m.group(2)))

    def fusion_reads(comp):  # parameter number -> bytes read of it
        params, users, reads = {}, {}, {}
        for name, out_t, op, operands, rest in comp:
            if op == "parameter":
                params[name] = (int(re.search(r"parameter\((\d+)\)", rest).group(1)), _hlo_bytes(out_t))
            for o in operands:
                users.setdefault(o, []).append((op, _hlo_bytes(out_t)))
        for name, (i, size) in params.items():
            us = users.get(name, [])
            sliced = us and all(op in ("slice", "dynamic-slice", "gather") for op, _ in us)
            reads[i] = min(size, sum(n for _, n in us)) if sliced else size
        return reads

    sizes, ops, written, read = {}, 0, 0, 0
    for name, out_t, op, operands, rest in comps[entry]:
        sizes[name] = _hlo_bytes(out_t)
        if op in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            continue
        called = re.search(r"calls=%([\w.\-]+)", rest)
        fused = op == "fusion" and called and called.group(1) in comps
        per_param = fusion_reads(comps[called.group(1)]) if fused else {}
        ops += 1
        written += sizes[name]
        seen = set()
        for i, o in enumerate(operands):
            if o not in seen:
                seen.add(o)
                read += per_param.get(i, sizes.get(o, 0))
    fusions = sum(1 for instr in comps[entry] if instr[2] == "fusion")
    return dict(ops=ops, fusions=fusions, written_GB=written / 1e9, read_GB=read / 1e9)


def stage1_hlo(variants, b, t, h):
    """Per stage-1 variant, compiled (not run) on this backend at B x T x H: hlo_traffic of the optimized
    HLO, XLA's own cost_analysis bytes, and the temp buffer bytes of the compiled stage."""
    total, n = b * t, b
    num_chunks = total // kc.CHUNK + 2 * n
    spec = jax.ShapeDtypeStruct
    shapes = [spec((total, h, D), jnp.bfloat16)] * 4 + [spec((total, h), jnp.float32), spec((h,), jnp.float32),
                                                         spec((h, D), jnp.float32), spec((n + 1,), jnp.int32)]
    out = {}
    for variant in variants:
        def stage(q, k, v, z, beta, a, bias, cu, variant=variant):
            _, tok_start, length, _ = kc.chunk_table(cu, jnp.zeros((n,), jnp.int32), num_chunks, 0)
            return stage1_call(variant, tok_start, length, dict(q=q, k=k, v=v, z=z, beta=beta), a, bias)

        compiled = jax.jit(stage).lower(*shapes).compile()
        stats = hlo_traffic(compiled.as_text())
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        stats["xla_bytes_accessed_GB"] = float(cost.get("bytes accessed", 0.0)) / 1e9
        stats["temp_GB"] = compiled.memory_analysis().temp_size_in_bytes / 1e9
        out[variant] = stats
    return out


def time_state(name, block_v, num_warps, staged, s0, total, n, args):
    fn = dict(fused=kda_state_pass, split=kda_state_pass_split)[name]
    f = jax.jit(lambda *xs: fn(*xs, s0, num_tokens=total, checkpoint_page_size=0, block_v=block_v,
                               out_dtype=jnp.bfloat16, interpret=args.interpret, num_warps=num_warps))
    return 1e3 * time_jax(lambda: f(*staged), args.trials)


def state_sweep(row, total, n, args, deadline, s0, staged, save):
    """The state passes' V-block and warps, while the case has time left."""
    for name in ("fused", "split"):
        for bv in args.block_v:
            for nw in args.state_warps:
                if time.monotonic() > deadline - 5:
                    row["sweep_cut"] = True
                    return
                key = f"stage_state_{name}_bv{bv}_w{nw}"
                try:
                    row[key + "_ms"] = time_state(name, bv, nw, staged, s0, total, n, args)
                except CaseTimeout:
                    raise
                except Exception as e:  # noqa: BLE001
                    row[key + "_error"] = repr(e)[:300]
                save()


def decode_case(row, b, t, h, args, fla, copy_tbps, deadline, save):
    """Ours at every --decode-block-v x --decode-warps combination (block_v > D skipped), the best as ours_ms;
    fla once, right after our first combination, so the sweep's time limit never costs the ratio."""
    ks = jax.random.split(jax.random.key(b + t), 10)
    c = 3 * h * D
    qkv = jax.random.normal(ks[0], (b, t, c), jnp.bfloat16)
    conv = jax.random.normal(ks[1], (b, 3, c), jnp.bfloat16)
    conv_w = 0.5 * jax.random.normal(ks[2], (4, c), jnp.float32)
    z = jax.random.normal(ks[3], (b, t, h, D), jnp.bfloat16)
    beta = jax.random.normal(ks[4], (b, t, h), jnp.float32)
    og = jax.random.normal(ks[5], (b, t, h, D), jnp.bfloat16)
    state = 0.1 * jax.random.normal(ks[6], (b, h, D, D), jnp.float32)
    slots = jax.random.permutation(ks[7], b).astype(jnp.int32)
    lens = jnp.full((b,), t, jnp.int32)
    a_log = 0.5 * jax.random.normal(ks[8], (h,), jnp.float32)
    dt_bias = jax.random.normal(ks[9], (h * D,), jnp.float32)
    onw = jnp.ones((D,), jnp.float32)
    kw = dict(a_log=a_log, dt_bias=dt_bias, gate="lower_bound", lower_bound=LB, interpret=args.interpret)
    verify = t > 1
    row["kind"] = "verify" if verify else "decode"
    state_bytes = b * h * D * D * 4
    # verify reads each state once and writes a [V] and two [K] fp32 vectors per position and head
    ours_bytes = state_bytes + b * t * h * 3 * D * 4 if verify else state_bytes * 2

    # the step's small per-row operands are arguments, as in the model: closed over, the all-equal ones (lengths,
    # the norm weight, no fresh rows) became constants that XLA rebuilds with one broadcast kernel each per step
    # (three ~0.7 us kernels and their launch gaps, ~10 us per step, seen in a profile on the H200, 2026-12-03)
    rows = (slots, lens, jnp.zeros((b,), jnp.int32), onw)

    def time_ours(name, block_v, num_warps, loop_v=False, **extra):
        tiling = dict(block_v=block_v, num_warps=num_warps, loop_v=loop_v, **extra)
        if "mgpu" in extra:  # the Mosaic GPU kernel; checked against the Triton default first
            # (decode has one ring: a variant's operand ring depth is verify's alone)
            knobs = {k: v for k, v in extra["mgpu"].items() if verify or k != "operand_stages"}
            call = lambda cv, st, r: kda_decode_mgpu(qkv, cv, conv_w, z, beta, og, st, r[0], r[1], fresh=r[2],
                                                     o_norm_weight=r[3], all_states=verify, **kw, **knobs)
            ref = kda_decode(qkv, conv, conv_w, z, beta, og, state, slots, lens, o_norm_weight=onw,
                             all_states=verify, **kw)
            got = jax.jit(call)(jnp.copy(conv), jnp.copy(state), rows)
            tag = mgpu_tag(extra["mgpu"])
            names, flat = (("y", "err", "key", "decay"), lambda o: (o[0], *o[1])) if verify else (
                ("y", "conv", "state"), tuple)
            for out_name, a, r in zip(names, flat(got), flat(ref)):
                row[f"rel_{out_name}_{tag}_vs_triton"] = rel(jnp.asarray(a, jnp.float32), jnp.asarray(r, jnp.float32))
        else:
            call = lambda cv, st, r: kda_decode(qkv, cv, conv_w, z, beta, og, st, r[0], r[1], fresh=r[2],
                                                o_norm_weight=r[3], all_states=verify, **kw, **tiling)
        if verify:
            f = jax.jit(call)
            step, run = None, lambda: f(conv, state, rows)
        else:
            step = jax.jit(lambda cv, st, r: call(cv, st, r)[1:], donate_argnums=(0, 1))
            pools = [jnp.copy(conv), jnp.copy(state)]  # donated and replaced every step

            def run():
                pools[:] = step(*pools, rows)
                return pools[1]

        if args.decode_profile:  # the step's kernels on the device, beside its wall time (ours_<name>_ms)
            prof = profile_stage(run, calls=10)
            row[f"profile_{name}"] = {k: prof[k] for k in (
                "source", "ms_per_step", "kernels_per_step", "span_ms_per_step", "idle_short_ms_per_step")} | {
                "by_kernel": prof["by_kernel"][:6]}
        return 1e3 * time_jax(run, args.trials), step

    # warps outer: the first listed warp count covers every V-block before the next one starts, so a sweep
    # cut by the case limit loses the least likely tilings (put them last on the command line)
    combos = [(bv, nw, loop, {}) for nw in args.decode_warps
              for bv, loop in [(v, False) for v in args.decode_block_v] + [(v, True) for v in args.decode_loop_v]
              if bv <= D]
    combos += [decode_variant(name) for name in args.decode_variants]
    for i, (bv, nw, loop, extra) in enumerate(combos):
        if i and time.monotonic() > deadline - 5:
            row["sweep_cut"] = True
            break
        key = "ours_" + (mgpu_tag(extra["mgpu"]) if "mgpu" in extra else f"{'loop' if loop else 'bv'}{bv}_w{nw}"
                         + "".join(f"_pf{v}" if k == "prefetch" else "_fold" for k, v in extra.items()))
        try:
            row[key + "_ms"], step = time_ours(key[len("ours_"):], bv, nw, loop, **extra)
        except CaseTimeout:
            raise
        except Exception as e:  # noqa: BLE001 -- an unsupported tiling: keep the others
            row[key + "_error"] = repr(e)[:300]
            step = None
        # pools that must stay in place in the donated step: the blocked decode scatters the q|k conv state into
        # them (checked once), the Mosaic kernel writes them through mutable refs (checked per variant)
        copies_key = ("hlo_pool_copies_" + key[len("ours_"):] if "mgpu" in extra
                      else "hlo_pool_copies" if bv < D and not loop and "hlo_pool_copies" not in row else None)
        if step is not None and copies_key and not args.interpret:
            try:
                row[copies_key] = count_pool_copies(step, conv, state, rows)
            except CaseTimeout:
                raise
            except Exception as e:  # noqa: BLE001
                row["hlo_pool_copies_error"] = repr(e)[:300]
        timed = {k[len("ours_"):-3]: v for k, v in row.items()
                 if k.startswith(("ours_bv", "ours_loop", "ours_mgpu")) and k.endswith("_ms")}
        if timed:
            row["ours_best"] = min(timed, key=timed.get)
            row["ours_ms"] = timed[row["ours_best"]]
            row["ours_state_TBps"] = ours_bytes / (row["ours_ms"] * 1e-3) / 1e12
            row["ours_frac_of_copy"] = row["ours_state_TBps"] / copy_tbps
            if "copy_torch_state_size_TBps" in row:  # (probed after the first variant; the best may come later)
                row["ours_frac_of_state_size_copy"] = row["ours_state_TBps"] / row["copy_torch_state_size_TBps"]
            if "fla_ms" in row:
                row["ratio"] = row["fla_ms"] / row["ours_ms"]
            if "fla_pooled_ms" in row:
                row["ratio_pooled"] = row["fla_pooled_ms"] / row["ours_ms"]
            round_times(row)
        save()
        if i == 0 and fla is not None:
            decode_fla(row, b, t, h, args, fla, ks, z, beta, a_log, dt_bias, state_bytes)
            if "ours_ms" in row:  # (decode_fla_pooled sets ratio_pooled itself)
                row["ratio"] = row["fla_ms"] / row["ours_ms"]
            same_size_copy(row, state_bytes, args.trials)
            save()
        if i == 0 and verify:
            commit_times(row, state, slots, t, args.trials, args.interpret)
            save()
    if "ours_best" not in row:
        row["error"] = "no decode tiling ran: " + "; ".join(f"{k}: {v}" for k, v in row.items() if k.endswith("_error"))
    else:
        print(f"decode B{b} T{t} H{h}: best tiling {row['ours_best']} ({row['ours_ms']:.3f} ms)", file=sys.stderr)


# decode variant mgpu_s<stages>_o<operand_stages>_c<ctas> (operand_stages: verify's operand ring; decode ignores it)
MGPU_KNOB_TAGS = {"stages": "s", "operand_stages": "o", "num_ctas": "c"}
# verify at T = 4, the forms a variant turns off (kda_decode_mgpu's defaults otherwise): mgpu_perpos (prep position
# by position, and with it the norm and the updates), mgpu_pnorm (the gated norm position by position), mgpu_seq
# (the updates position by position instead of the chunk form), mgpu_prepnorm (the tiled norm in prep, not in a
# warpgroup of its own), mgpu_prep1 (one prep warpgroup, not two taking alternate items); other cases run the same
# kernel either way
MGPU_FORM_FLAGS = {"perpos": "tiled_prep", "pnorm": "tiled_norm", "seq": "chunk_verify", "prepnorm": "norm_warpgroup",
                   "prep1": "prep_warpgroups"}
MGPU_FORM_OFF = {"prep_warpgroups": 1}  # a flag's knob value (False unless here)


def mgpu_tag(knobs: dict) -> str:
    """The Mosaic decode variant's name from its kda_decode_mgpu knobs (decode_variant's inverse)."""
    forms = {knob: flag for flag, knob in MGPU_FORM_FLAGS.items()}
    return "mgpu" + "".join(f"_{MGPU_KNOB_TAGS[k]}{v}" if k in MGPU_KNOB_TAGS else f"_{forms[k]}"
                            for k, v in knobs.items())


def decode_variant(name):
    """(block_v, num_warps, loop_v, extra kda_decode keywords) from "{loop|bv}<rows>_w<warps>[_pf<n>][_fold]",
    e.g. "loop32_w4_pf1_fold" = kda_decode(loop_v=True, block_v=32, num_warps=4, prefetch=1, fold_v=True);
    or the Mosaic GPU kernel from
    "mgpu[_s<stages>][_o<operand stages>][_c<ctas>][_perpos][_pnorm][_seq][_prepnorm][_prep1]" (kda_decode_mgpu;
    the flags turn verify forms off, MGPU_FORM_FLAGS; key ours_mgpu_s<n>..)."""
    m = re.fullmatch(r"mgpu((?:_s\d+)?)((?:_o\d+)?)((?:_c\d+)?)((?:_perpos)?)((?:_pnorm)?)((?:_seq)?)((?:_prepnorm)?)"
                     r"((?:_prep1)?)", name)
    if m is not None:
        knobs = {}
        for knob, group in zip(("stages", "operand_stages", "num_ctas"), m.groups()[:3]):
            if group:
                knobs[knob] = int(group[2:])
        for flag in m.groups()[3:]:
            if flag:
                knob = MGPU_FORM_FLAGS[flag[1:]]
                knobs[knob] = MGPU_FORM_OFF.get(knob, False)
        return 0, 0, False, {"mgpu": knobs}
    m = re.fullmatch(r"(loop|bv)(\d+)_w(\d+)((?:_pf\d+)?)((?:_fold)?)", name)
    if m is None:
        raise ValueError(f"decode variant {name!r}: expected {{loop|bv}}<rows>_w<warps>[_pf<n>][_fold]")
    extra = {}
    if m.group(4):
        extra["prefetch"] = int(m.group(4)[3:])
    if m.group(5):
        extra["fold_v"] = True
    return int(m.group(2)), int(m.group(3)), m.group(1) == "loop", extra


def count_pool_copies(step, conv, state, *rest):
    """Copy instructions producing a conv- or state-pool-shaped array in `step`'s optimized HLO (`rest`: the
    step's other arguments)."""
    hlo = step.lower(jax.ShapeDtypeStruct(conv.shape, conv.dtype),
                     jax.ShapeDtypeStruct(state.shape, state.dtype), *rest).compile().as_text()
    dims = [f"[{','.join(map(str, x.shape))}]" for x in (conv, state)]  # e.g. "[64,3,36864]"
    return sum(1 for line in hlo.splitlines()
               if " copy(" in line and any(d in line.split("=", 1)[-1].split("copy(")[0] for d in dims))


def commit_times(row, state, slots, t, trials, interpret=False):
    """Keeping a verify step's accepted prefix (here all T positions) in the state pool, donated, per job:
    commit_ms rebuilds each row's state in place from the pool and the updates (pallas_kernels.kda_commit, what
    k3jax.commit_verified runs per step on the GPU; commit_xla_ms: its XLA twin, gather -> update -> scatter);
    commit_states_ms copies the kept position's state out of per-position states [B, T, H, V, K] (the job of a
    verify that writes them: fla pooled, ours before 2026-12-03). Each reads and writes one state per row."""
    from pallas_kernels.kda_commit import kda_commit, kda_commit_reference

    b, h = slots.shape[0], state.shape[1]
    ks = jax.random.split(jax.random.key(t), 3)
    updates = (0.1 * jax.random.normal(ks[0], (1, b, t, h, D), jnp.float32), jax.random.normal(ks[1], (1, b, t, h, D)),
               jax.random.uniform(ks[2], (1, b, t, h, D), minval=0.5, maxval=1.0))
    count, fresh = jnp.full((b,), t, jnp.int32), jnp.zeros((b,), jnp.int32)
    kernel = jax.jit(lambda pool, u, n: kda_commit(pool, *u, slots, slots, n, fresh, interpret=interpret),
                     donate_argnums=(0,))
    xla = jax.jit(lambda pool, u, n: kda_commit_reference(pool, *u, slots, slots, n, fresh), donate_argnums=(0,))
    states = jnp.broadcast_to(state[:, None], (b, t, *state.shape[1:])) + 0.0  # [B, T, H, V, K] (materialised)
    pick = jax.jit(lambda pool, st, n: pool.at[0, slots].set(st[jnp.arange(b), n - 1]), donate_argnums=(0,))
    for key, fn, operand in (("commit_ms", kernel, updates), ("commit_xla_ms", xla, updates),
                             ("commit_states_ms", pick, states)):
        pools = [state[None] + 0.0]

        def run(fn=fn, operand=operand, pools=pools):
            pools[0] = fn(pools[0], operand, count)
            return pools[0]
        row[key] = 1e3 * time_jax(run, trials)
    row["commit_state_TBps"] = 2 * b * h * D * D * 4 / (row["commit_ms"] * 1e-3) / 1e12
    round_times(row)


def round_times(row):
    """A whole verify round (verify + keeping the prefix) of each job, once both halves are measured."""
    if "ours_ms" in row and "commit_ms" in row:
        row["ours_round_ms"] = row["ours_ms"] + row["commit_ms"]
    if "fla_pooled_ms" in row and "commit_states_ms" in row:
        row["fla_pooled_round_ms"] = row["fla_pooled_ms"] + row["commit_states_ms"]
        if "ours_round_ms" in row:
            row["ratio_round"] = row["fla_pooled_round_ms"] / row["ours_round_ms"]


def same_size_copy(row, state_bytes, trials):
    """torch's device copy of a buffer as large as the case's state pool (the 1 GiB probe of `copy_bandwidth`
    moves 2 GiB; a 64 x 96-head pool is 0.4 GB, where a copy may ramp differently): the like-for-like limit
    for ours_state_TBps, beside the headline fraction of the 1 GiB copy. Reads + writes / time."""
    try:
        import torch

        a = torch.ones(state_bytes // 4, device="cuda")
        b = torch.empty_like(a)
        row["copy_torch_state_size_TBps"] = 2 * state_bytes / time_torch(lambda: b.copy_(a), trials) / 1e12
        if "ours_state_TBps" in row:
            row["ours_frac_of_state_size_copy"] = row["ours_state_TBps"] / row["copy_torch_state_size_TBps"]
    except Exception as e:  # noqa: BLE001 -- torch comes with fla; a probe failing must not cost the case
        row["copy_torch_state_size_error"] = repr(e)[:300]


def decode_fla(row, b, t, h, args, fla, ks, z, beta, a_log, dt_bias, state_bytes):
    """fla fused_recurrent_kda on the same z / beta / gate parameters (its own q, k, v: it has no conv)."""
    import torch

    kk = jax.random.split(ks[0], 3)
    q, k, v = (to_torch(jax.random.normal(kk[i], (b, t, h, D), jnp.bfloat16)) for i in range(3))
    tz, tb = to_torch(z), to_torch(beta)
    ts0 = to_torch(0.1 * jax.random.normal(ks[6], (b, h, D, D), jnp.float32)).clone()
    call = lambda: fla.fused_recurrent_kda(
        q, k, v, tz, tb, A_log=to_torch(a_log), dt_bias=to_torch(dt_bias), initial_state=ts0,
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=LB, state_v_first=True)
    with torch.no_grad():
        row["fla_ms"] = 1e3 * time_torch(call, args.trials)
    row["fla_state_TBps"] = 2 * state_bytes / (row["fla_ms"] * 1e-3) / 1e12
    try:
        decode_fla_pooled(row, b, t, h, args, q, k, v, tz, tb, a_log, dt_bias, ts0, state_bytes)
    except Exception as e:  # noqa: BLE001 -- the pooled mode is an extra: its failure must not cost the case
        row["fla_pooled_error"] = repr(e)[:300]


def decode_fla_pooled(row, b, t, h, args, q, k, v, tz, tb, a_log, dt_bias, ts0, state_bytes):
    """fla's kernel in the mode vLLM serves it (continuous batching, speculative decoding): states live in a pool
    and are read and written in place through slot indices, and verify writes the state after every position to
    that position's own slot (ssm_state_indices [B, T]) -- our verify's job until 2026-12-03 (ours now writes each
    position's update instead: `commit_times` adds the prefix-keeping step each job needs), where the public
    `fused_recurrent_kda` above writes one final state. fla_pooled_ms, ratio_pooled = fla_pooled_ms / ours_ms."""
    import torch
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    gen = torch.Generator(device="cpu").manual_seed(b * 1000 + t)
    pool = ts0.repeat(t, 1, 1, 1) if t > 1 else ts0.clone()  # [B*T, H, V, K]: one slot per (sequence, position)
    idx = torch.randperm(b * t, generator=gen).to(torch.int32).to(pool.device)
    idx = idx.view(b, t) if t > 1 else idx
    call = lambda: fused_recurrent_kda_fwd(
        q, k, v, tz, tb, A_log=to_torch(a_log), dt_bias=to_torch(dt_bias), initial_state=pool,
        inplace_final_state=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=LB, state_v_first=True)
    with torch.no_grad():
        row["fla_pooled_ms"] = 1e3 * time_torch(call, args.trials)
    row["fla_pooled_state_TBps"] = state_bytes * (1 + t) / (row["fla_pooled_ms"] * 1e-3) / 1e12
    if "ours_ms" in row:
        row["ratio_pooled"] = row["fla_pooled_ms"] / row["ours_ms"]


def _shapes(spec):
    return [tuple(int(x) for x in s.split("x")) for s in spec.split(",") if s]


def print_table(results):
    print(f"\ncopy bandwidth: torch {results.get('copy_torch_TBps', float('nan')):.2f} TB/s, "
          f"XLA {results['copy_xla_TBps']:.2f} TB/s ({results['device']}, jax {results['jax']})")
    print(f"{'case':<24}{'ours ms':>9}{'split ms':>9}{'fla ms':>9}{'fla/ours':>9}  extra")
    for r in results["rows"]:
        name = f"{r['kind']} B{r['B']} T{r['T']} H{r['H']}"
        if "error" in r and "ours_ms" not in r:
            print(f"{name:<24} error: {r['error'][:100]}")
            continue
        nan = float("nan")
        if r["kind"] == "prefill":
            best = max((r[k] for k in ("ratio", "ratio_split") if k in r), default=nan)
            extra = f"{r['ours_Mtok_s']:.2f} Mtok/s"
            if "ours_solve_pallas_ms" in r:
                extra += f"; solve=pallas {r['ours_solve_pallas_ms']:.3f} ms"
            for key in [k for k in r if k.startswith("ours_stage1_") and k.endswith("_ms")]:
                ratio = r.get("ratio_" + key[len("ours_"):-3])
                extra += (f"; stage1={key[len('ours_stage1_'):-3]} {r[key]:.3f} ms"
                          + (f" ({ratio:.2f}x fla)" if ratio else ""))
            stages = {k[len("stage_"):-3]: v for k, v in r.items() if k.startswith("stage_") and k.endswith("_ms")}
            if stages:
                extra += "; stages ms " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
            for page in (256, 64):
                if f"ckpt{page}_overhead" in r:
                    extra += f"; ckpt{page} {100 * r[f'ckpt{page}_overhead']:+.1f}%"
            print(f"{name:<24}{r['ours_ms']:>9.3f}{r.get('ours_split_ms', nan):>9.3f}{r.get('fla_ms', nan):>9.3f}"
                  f"{best:>9.2f}  {extra}")
        else:
            extra = f"state {r['ours_state_TBps']:.2f} TB/s = {100 * r['ours_frac_of_copy']:.0f}% of copy"
            if "ours_frac_of_state_size_copy" in r:
                extra += (f" ({100 * r['ours_frac_of_state_size_copy']:.0f}% of a same-size copy, "
                          f"{r['copy_torch_state_size_TBps']:.2f} TB/s)")
            if "commit_ms" in r:
                extra += (f"; keep prefix {r['commit_ms']:.3f} ms ({r['commit_state_TBps']:.2f} TB/s; XLA "
                          f"{r['commit_xla_ms']:.3f}; per-position states: {r['commit_states_ms']:.3f})")
            if "ratio_round" in r:
                extra += (f"; round {r['ours_round_ms']:.3f} vs fla pooled {r['fla_pooled_round_ms']:.3f} ms "
                          f"({r['ratio_round']:.2f}x)")
            if "fla_state_TBps" in r:
                extra += f" (fla {r['fla_state_TBps']:.2f} TB/s)"
            if "fla_pooled_ms" in r:
                extra += (f"; fla pooled in place {r['fla_pooled_ms']:.3f} ms "
                          f"({r.get('ratio_pooled', float('nan')):.2f}x, {r['fla_pooled_state_TBps']:.2f} TB/s)")
            extra += f"; best {r['ours_best']}"
            if f"ours_bv{D}_w8_ms" in r:
                extra += f" (whole-state bv{D}_w8 {r[f'ours_bv{D}_w8_ms']:.3f} ms)"
            print(f"{name:<24}{r['ours_ms']:>9.3f}{'':>9}{r.get('fla_ms', nan):>9.3f}"
                  f"{r.get('ratio', nan):>9.2f}  {extra}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--prefill", default="1x32768x32,8x4096x32,1x32768x96", help="BxTxH list (first: stages, sweep)")
    p.add_argument("--decode", default="64x1x96,256x1x96,64x4x96,256x4x96", help="BxTxH list")
    p.add_argument("--order", default="prefill1,decode,prefill", help="prefill1 = the first prefill case")
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p.add_argument("--block-v", type=ints, default=[16, 32, 64], help="state-pass sweep (first prefill case)")
    p.add_argument("--state-warps", type=ints, default=[4, 8], help="state-pass sweep (first prefill case)")
    p.add_argument("--decode-block-v", type=ints, default=[32, 128],
                   help="kda_decode V-blocks to time (128 = the whole-state kernel); the best is ours_ms")
    p.add_argument("--decode-warps", type=ints, default=[4, 8], help="kda_decode warps, crossed with --decode-block-v")
    p.add_argument("--decode-loop-v", type=ints, default=[],
                   help="kda_decode loop_v=True (one program per head walking V-blocks of this size; "
                        "ours_loop{V}_w{W}), crossed with --decode-warps after the --decode-block-v tilings")
    p.add_argument("--decode-variants", type=lambda v: [x for x in v.split(",") if x], default=[],
                   help="further kda_decode settings by name, {loop|bv}<rows>_w<warps>[_pf<n>][_fold], or the "
                        "Mosaic GPU kernel mgpu[_s<n>][_o<n>][_c<n>][_perpos][_pnorm][_seq][_prepnorm][_prep1] "
                        "(see decode_variant)")
    p.add_argument("--case-limit", type=float, default=60.0, help="seconds per case, fla's first call apart")
    p.add_argument("--fla-first-call-limit", type=float, default=240.0, help="seconds for fla's autotuning call")
    p.add_argument("--stage1", type=lambda v: [x for x in v.split(",") if x], default=["default", "v2"],
                   help="kda_chunk stage-1 variants to time at every prefill case (ours_stage1_<v>_ms; the first "
                        "case also times each stage alone, stage_intra_<v>_ms, and its compiled HLO, stage1_hlo); "
                        "kda_intra variants pallas_<knobs> (see pallas_stage1_knobs) are timed alone only")
    p.add_argument("--base-stage1", default="pallas", choices=KDA_CHUNK_STAGE1,
                   help="kda_chunk's stage1 for ours_ms and the parts built on it (split, solve_pallas, ckpt); "
                        "default 'pallas', the model's GPU stage ('default' is kda_chunk's own API default, the "
                        "XLA stage that CPU interpret runs keep)")
    p.add_argument("--prefill-parts", type=lambda v: {x for x in v.split(",") if x},
                   default={"stages", "split", "solve_pallas", "ckpt", "sweep"},
                   help="what a prefill case times beside ours (default state pass, stage-1 variants) and fla: "
                        "stages (first case: stage 1 per variant, its HLO proxy, the state passes), profile "
                        "(first case, with stages: stage 1's device time per kernel, per variant), split, "
                        "solve_pallas, ckpt (first case), sweep (first case; needs stages)")
    p.add_argument("--stage1-hlo-only", action="store_true",
                   help="only the stage-1 HLO traffic proxy of every --stage1 variant at every --prefill shape, "
                        "compiled (not run) on this backend; no timing, no fla (a CPU check)")
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--decode-profile", action="store_true",
                   help="trace each decode variant's step under jax.profiler: the kernels' device time per step beside "
                        "its wall time (profile_<variant>; use with --no-fla)")
    p.add_argument("--interpret", action="store_true", help="CPU smoke run of this script (tiny shapes)")
    args = p.parse_args(argv)
    if args.stage1_hlo_only:
        rows = [dict(B=b, T=t, H=h, backend=jax.default_backend(), **{f"stage1_{v}": st for v, st in
                                                                      stage1_hlo(args.stage1, b, t, h).items()})
                for b, t, h in _shapes(args.prefill)]
        print(json.dumps(rows, indent=1))
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(dict(date=datetime.date.today().isoformat(), jax=jax.__version__, argv=sys.argv[1:],
                               rows=rows), fh, indent=1)
        return
    fla = None
    if not args.no_fla:
        try:
            import fla.ops.kda as fla  # noqa: PLC0415
        except Exception as e:  # noqa: BLE001
            print(f"fla unavailable: {e!r}", file=sys.stderr)
    results = dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                   jax=jax.__version__, argv=sys.argv[1:], rows=[])
    copy_bandwidth(results, args.trials, use_torch=not args.no_fla)
    copy_tbps = results.get("copy_torch_TBps", results["copy_xla_TBps"])
    prefill, decode = _shapes(args.prefill), _shapes(args.decode)
    groups = dict(prefill1=[("prefill", s, True) for s in prefill[:1]],
                  prefill=[("prefill", s, False) for s in prefill[1:]],
                  decode=[("decode", s, False) for s in decode])
    cases = [c for g in args.order.split(",") for c in groups[g]]
    signal.signal(signal.SIGALRM, _alarm)

    def save():
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=1)

    for kind, (b, t, h), detail in cases:
        t0 = time.monotonic()
        signal.alarm(int(args.case_limit))
        row = dict(kind=kind, B=b, T=t, H=h)  # filled in place: a case cut short keeps what it measured
        results["rows"].append(row)
        try:
            if kind == "prefill":
                prefill_case(row, b, t, h, args, fla, t0 + args.case_limit, detail, save)
            else:
                decode_case(row, b, t, h, args, fla, copy_tbps, t0 + args.case_limit, save)
        except Exception as e:  # noqa: BLE001 -- CaseTimeout included: keep the other cases' numbers
            traceback.print_exc()
            row["error"] = repr(e)[:500]
        finally:
            signal.alarm(0)
        row["case_s"] = time.monotonic() - t0
        print(json.dumps(row), file=sys.stderr, flush=True)
        save()
    print_table(results)


if __name__ == "__main__":
    main()
