"""MoE grouped GEMM and fused norms on one GPU: ours vs peers vs the limits measured in the same run.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python benchmarks/moe.py --out $OUT/moe.json   # H200
    python benchmarks/moe.py --smoke --out /tmp/moe.json     # CPU: tiny shapes, interpret mode, no timing claims

MXFP4 decode variants (pallas_kernels.moe_gemm.MXFP4_VARIANTS: "interleave" on the checkpoint layout, "kmajor" on
the "kn" kernel layout, "k4" / "k4r" on the word layouts the model loads, inline-PTX decodes) against bf16 weights
at decode sizes, one command, ~60 s on the H200 (limits ~15 s, then the section stops starting cases after
--budget-s, default 110 s):
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 benchmarks/moe.py --skip norms,moe,sweep \
        --mxfp4-variants k4,k4r --sweep-tokens 16,256 --out $OUT/mxfp4.json
  k3-ep16 shard; bf16 and every variant at each tiling of --mxfp4-configs (decode-sized, block_m 16) on identical
  inputs; each checked on the device against the dense einsum over the dequantised-bf16 weights (rel error);
  table column bf16/this = best bf16 ms at that T / this case's ms (> 1: faster than bf16).

Mid-size groups (issue 4: >= 60 % of the jnp.dot peak and >= 1.0x ragged_dot_mgpu from 256 rows/expert), one command,
<= 90 s on the H200 (limits ~15 s, then the sweep starts no new case after --sweep-budget-s 65):
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 benchmarks/moe.py --skip norms,moe \
        --sweep-tokens 16384,65536 --sweep-budget-s 65 --sweep-configs 128/128/256/64/8/3,\
128/128/256/64/8/3/64,128/128/256/64/8/3/64/0/1/1 --out $OUT/moe_mid.json
  per T: moe_grouped_mlp's default, each tiling (/tail_block_m and /aligned: MoeGemmConfig's mid-size modes), then
  ragged_dot_mgpu (rows zero-padded to its 128-row tile, pad_sorted_rows); each checked against the dense einsum on
  the device; TFLOP/s, % of the jnp.dot peak of the same run, peer ms / ours; a summary line per T against the bar.
  --sweep-rounds N: each case timed in N rounds, each right after its own jnp.dot peak; the share of the peak is
  then the median of the per-round shares (the peak drifts ~10 % within a run, and our times drift with it).

What one DEP rank computes (issue 4's kernels under k3jax.parallel.dep), one command:
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 benchmarks/moe.py --skip norms,moe,sweep \
        --dep-tokens 1024,16384 --out $OUT/moe_dep.json
  K3 EP16, rank 0: the tokens with a pick among its 56 experts, all 16 picks each, the non-local ones dropped
  (ids -1; tiled by all received assignments, and by the expected kept rows as k3jax.parallel.dep passes them, with
  the combine kernel that reads only kept slots and with XLA's) vs weight-0 rows of local expert 0 (the convention
  before) vs one row per local pick (top_k 1).

Limits (measured first, same process): bf16 matmul peak (jnp.dot 8192^3), XLA copy bandwidth (bf16 x*2 over
2 GiB, bytes read + written) and, when torch imports, torch's copy bandwidth (the higher ceiling).

MoE (the whole routed-expert op: sort, gate/up + GLU, down * routing weight, combine), per token count T:
  k3-ep16: one EP16 shard of K3 (56 of 896 experts, latent 3584 -> 3072 -> 3584, SiTU). Each of T tokens
           picks 16 of 896 experts uniformly; the shard keeps the picks among its 56 (about T rows, ~T/56
           per expert, natural imbalance) -- what one GPU computes after the dispatch all-to-all.
  k3-small: all 192 experts on one GPU (1024 -> 512 -> 1024), top 8 of 192, 8T rows.
  impls: pallas (ours, bf16 and MXFP4 weights; MXFP4 in the kernel layout the model loads, `prepare_mxfp4`, or
  the checkpoint's where a width is not a multiple of 64: row field mxfp4_layout), ragged_dot_mgpu (shipped
  Mosaic-GPU grouped GEMM, gate|up fused into one [E, K, 2I] GEMM, GLU in XLA), xla_ragged_dot (k3jax's
  reference op; small T only: it is the 11 TFLOP/s path), dense_loop (per-expert einsum at equal capacity = the
  largest group).
  Reported: ms, TFLOP/s (6 M K I useful FLOPs), weight GB/s (bytes of the experts that got rows), the
  floor max(FLOPs / peak, weight bytes / copy bandwidth) and ours / peer speedups.
Fused norms at 8192 tokens: AttnRes mix (5 and 9 sources) + RMSNorm at 7168 vs the unfused XLA code, and
gated RMSNorm at [8192 x 96 heads, 128] (bf16 out and fp8 out) vs XLA; GB/s vs the copy bandwidth.
Correctness on the GPU: ours vs dense_loop (fp32-accumulated bf16 einsum) relative error, per case.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.attnres import attn_res_mix_norm_unfused
from k3jax.layers import gated_rms_norm as gated_rms_norm_xla
from k3jax.quant import mxfp4_dequantize
from pallas_kernels import fused_norm, moe_gemm
from pallas_kernels.moe_gemm import MoeGemmConfig

SHAPES = {
    # name: (experts on this GPU, experts in the model, top_k, K (expert width), I (expert intermediate), EP shard)
    "k3-ep16": dict(local=56, total=896, top_k=16, k_dim=3584, i_dim=3072),
    "k3-small": dict(local=192, total=192, top_k=8, k_dim=1024, i_dim=512),
}
SMOKE_SHAPES = {"tiny": dict(local=6, total=12, top_k=3, k_dim=64, i_dim=32)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="CPU interpret-mode run on tiny shapes")
    p.add_argument("--tokens", type=str, default="16,1024,16384,65536")
    p.add_argument("--small-tokens", type=str, default="16,4096")
    p.add_argument("--xla-ragged-max-rows", type=int, default=4096)
    p.add_argument("--norm-tokens", type=int, default=8192)
    p.add_argument("--skip", type=str, default="", help="comma list of sections to skip: moe,sweep,norms")
    p.add_argument("--norm-decode", type=str, default="",
                   help="comma list of NxD decode shapes (e.g. 64x2048,64x7168): AttnRes mix + norm at 3 / 6 / 10 "
                        "sources, default tiling vs the previous rule vs the unfused XLA code (section norms_decode)")
    p.add_argument("--dep-tokens", type=str, default="",
                   help="comma list of token counts routed over all ranks: what one K3 EP16 DEP rank computes for "
                        "them, non-local picks dropped vs weight-0 rows vs one row per pick (section dep)")
    p.add_argument("--sweep-tokens", type=str, default=None,
                   help="comma list of token counts for the sweep (default: the first and second-last of the "
                        "shape's --tokens / --small-tokens)")
    p.add_argument("--sweep-shape", choices=sorted(SHAPES), default="k3-ep16",
                   help="the sweep's expert shape (k3-small: the model benchmarks/model_forward.py decodes)")
    p.add_argument("--mxfp4-variants", type=str, default="",
                   help="comma list of moe_gemm.MXFP4_VARIANTS to time against bf16 at --sweep-tokens (k3-ep16)")
    p.add_argument("--mxfp4-configs", type=str, default="16/64/64/128/4/4/0/2,16/128/128/128/4/3",
                   help="tilings (bm/gn/dn/bk/warps/stages[/tail_block_m[/down_stages[/down_split_k[/aligned"
                        "[/column_group]]]]], MoeGemmConfig.from_tiling) of the MXFP4 variant section, each run for "
                        "bf16 and every variant")
    p.add_argument("--budget-s", type=float, default=110.0,
                   help="the MXFP4 variant section starts no new case after this many seconds")
    p.add_argument("--sweep-budget-s", type=float, default=None,
                   help="the sweep section starts no new case after this many seconds (default: no limit)")
    p.add_argument("--sweep-rounds", type=int, default=1,
                   help="time each sweep case this many rounds, each right after its own jnp.dot peak (on a GPU; "
                        "the share of the peak is then taken per round: timed_with_adjacent_peak)")
    p.add_argument("--sweep-configs", type=str, default=None,
                   help="comma list of block_m/glu_block_n/down_block_n/block_k/num_warps/num_stages[/tail_block_m"
                        "[/down_stages[/down_split_k[/aligned[/column_group]]]]] tilings for the sweep (default: the "
                        "built-in alternatives)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------
# timing


def timed(fn, *args, target_s: float = 0.03, trials: int = 5) -> float:
    """Median seconds per call: calls are issued back to back (async dispatch) and synchronised once per
    trial, so host overhead overlaps device work; the first call compiles."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(200, max(2, target_s / one)))
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


@functools.cache
def _matmul_operands(n: int):
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    return jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)), a, b


def matmul_peak(n: int) -> float:
    f, a, b = _matmul_operands(n)
    return 2 * n**3 / timed(f, a, b) / 1e12


def copy_bandwidth(nbytes: int) -> float:
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    return 2 * nbytes / timed(jax.jit(lambda x: x * 2), x) / 1e9


def torch_copy_bandwidth(nbytes: int) -> float | None:
    try:
        import torch
    except Exception:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 10)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e9


# ----------------------------------------------------------------------------------------------------
# MoE inputs and peers


def routing(shape: dict, tokens: int, seed: int):
    """(ids [N, k], weights [N, k]) for this GPU: uniform top-k of `total` per token, keeping the local experts.

    EP shard: a token's number of local picks is hypergeometric (top_k draws from `total`, `local` of them
    here), the picks themselves uniform among the local experts; each local pick is one row (top_k = 1)."""
    rng = np.random.default_rng(seed)
    local, total, top_k = shape["local"], shape["total"], shape["top_k"]
    order = np.argsort(rng.random((tokens, local)), axis=1)
    if local == total:
        ids = order[:, :top_k].astype(np.int32)
    else:
        hits = rng.hypergeometric(local, total - local, top_k, size=tokens)
        ids = order[np.arange(local)[None, :] < hits[:, None]].astype(np.int32)[:, None]
        if ids.size == 0:
            ids = np.zeros((1, 1), np.int32)
    weights = rng.uniform(0.02, 0.2, ids.shape).astype(np.float32)
    return ids, weights


def make_experts(shape: dict, seed: int):
    e, k, i = shape["local"], shape["k_dim"], shape["i_dim"]
    keys = jax.random.split(jax.random.key(seed), 6)
    bf16 = {
        "gate": (jax.random.normal(keys[0], (e, k, i), jnp.float32) * k**-0.5).astype(jnp.bfloat16),
        "up": (jax.random.normal(keys[1], (e, k, i), jnp.float32) * k**-0.5).astype(jnp.bfloat16),
        "down": (jax.random.normal(keys[2], (e, i, k), jnp.float32) * i**-0.5).astype(jnp.bfloat16),
    }

    def packed(key, out_dim, in_dim, fan_in):
        kp, ks = jax.random.split(key)
        # random E2M1 codes; scales near 2^-2 / sqrt(fan_in) so values are ~ unit-variance / sqrt(fan_in)
        base = 127 - 2 - int(np.log2(np.sqrt(fan_in)))
        return {
            "packed": jax.random.randint(kp, (e, out_dim, in_dim // 2), 0, 256, jnp.int32).astype(jnp.uint8),
            "scale": jax.random.randint(ks, (e, out_dim, in_dim // 32), base - 1, base + 2, jnp.int32).astype(jnp.uint8),
        }

    mx = {"gate": packed(keys[3], i, k, k), "up": packed(keys[4], i, k, k), "down": packed(keys[5], k, i, i)}
    return bf16, mx


def dequantized(mx: dict) -> dict:
    return {n: jnp.swapaxes(mxfp4_dequantize(w["packed"], w["scale"], jnp.bfloat16), -1, -2) for n, w in mx.items()}


def _glu(gate, up):
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    return (4.0 * jnp.tanh(g / 4.0) * jax.nn.sigmoid(g) * 25.0 * jnp.tanh(u / 25.0)).astype(jnp.bfloat16)


def _sorted(x, ids):
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return x[order // k], order, flat[order]


def _combine(y, order, weights, n, k):
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return y[jnp.argsort(order)].reshape(n, k, -1).sum(1).astype(jnp.bfloat16)


MGPU_BLOCK_M = 128  # ragged_dot_mgpu's row tile in this benchmark


def pad_sorted_rows(xs, sizes, multiple: int):
    """Expert-sorted rows [M, K] + group sizes [E] -> rows padded with zero rows up to a multiple of `multiple`,
    the pad rows counted in the last group (they follow its rows, so the sort order holds). ragged_dot_mgpu needs
    M to be a multiple of its tiling (at T=16384 it failed on 16361 rows). A zero row stays zero through the GLU
    (SiTU(0) = 0) and the down GEMM, and the pad rows are dropped before the combine, so the result is unchanged."""
    m = xs.shape[0]
    pad = -m % multiple
    if not pad:
        return xs, sizes
    return jnp.pad(xs, ((0, pad), (0, 0))), sizes.at[-1].add(pad)


def mgpu_moe(x, ids, weights, gate_up, down, *, num_experts, ragged=None):
    """The shipped Mosaic-GPU grouped GEMM as a MoE: gate|up fused into one [E, K, 2I] GEMM, GLU in XLA, down.
    ragged(a, w, group_sizes) replaces ragged_dot_mgpu (the CPU test passes jax.lax.ragged_dot to check the
    padding; the peer itself only runs on a GPU)."""
    n, k = ids.shape
    xs, order, _ = _sorted(x, ids)
    m = xs.shape[0]
    sizes = jnp.bincount(ids.reshape(-1), length=num_experts).astype(jnp.int32)
    xs, sizes = pad_sorted_rows(xs, sizes, MGPU_BLOCK_M)
    if ragged is None:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        rd = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=sizes, block_m=MGPU_BLOCK_M, block_n=128,
                               block_k=64, max_concurrent_steps=4, grid_block_n=1)
    else:
        rd = lambda a, w: ragged(a, w, sizes)
    gu = rd(xs, gate_up)
    i = gu.shape[1] // 2
    y = rd(_glu(gu[:, :i], gu[:, i:]), down)[:m]
    return _combine(y, order, weights, n, k)


def xla_ragged_dot_bf16(a, w, sizes):
    """jax.lax.ragged_dot with fp32 accumulation, bf16 out (ragged_dot_mgpu's contract; CPU stand-in)."""
    return jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def xla_ragged_moe(x, ids, weights, experts, *, num_experts):
    n, k = ids.shape
    xs, order, _ = _sorted(x, ids)
    sizes = jnp.bincount(ids.reshape(-1), length=num_experts).astype(jnp.int32)
    rd = lambda a, w: jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    h = _glu(rd(xs, experts["gate"]), rd(xs, experts["up"]))
    return _combine(rd(h, experts["down"]), order, weights, n, k)


def dense_loop_moe(x, ids, weights, experts, *, num_experts, capacity):
    """Per-expert einsum at equal capacity (every expert padded to the largest group)."""
    n, k = ids.shape
    xs, order, expert = _sorted(x, ids)
    sizes = jnp.bincount(expert, length=num_experts)
    starts = jnp.cumsum(sizes) - sizes
    slot = jnp.arange(expert.shape[0]) - starts[expert]
    xcap = jnp.zeros((num_experts, capacity, x.shape[1]), x.dtype).at[expert, slot].set(xs)
    mm = lambda a, w: jnp.einsum("eck,eki->eci", a, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    h = _glu(mm(xcap, experts["gate"]), mm(xcap, experts["up"]))
    y = mm(h, experts["down"])[expert, slot]
    return _combine(y, order, weights, n, k)


def rel_err(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


# ----------------------------------------------------------------------------------------------------
# sections


def bench_moe(name, shape, token_counts, limits, args, interpret):
    rows_out = []
    e, k_dim, i_dim = shape["local"], shape["k_dim"], shape["i_dim"]
    bf16, mx = make_experts(shape, seed=1)
    mx_deq = dequantized(mx)
    # the layout load_pretrained(experts="kernel") gives (k4r where the scales allow, else k4), or the checkpoint's
    # where a width is not a multiple of 64
    if k_dim % moe_gemm.PLANE_BLOCK == 0 == i_dim % moe_gemm.PLANE_BLOCK:
        mx_model = {n: moe_gemm.prepare_mxfp4(v, moe_gemm.word_layout_for(v["scale"])) for n, v in mx.items()}
    else:
        mx_model = mx
    mx_layout = "/".join(sorted({moe_gemm.mxfp4_layout(v) for v in mx_model.values()}))
    gate_up = jnp.concatenate([bf16["gate"], bf16["up"]], axis=-1)
    ours = jax.jit(functools.partial(moe_gemm.moe_grouped_mlp, interpret=interpret))
    for t in token_counts:
        ids_np, w_np = routing(shape, t, seed=t)
        m = ids_np.size
        n = ids_np.shape[0]
        counts = np.bincount(ids_np.reshape(-1), minlength=e)
        touched = int((counts > 0).sum())
        x = jax.random.normal(jax.random.key(t), (n, k_dim), jnp.float32).astype(jnp.bfloat16)
        ids, w = jnp.asarray(ids_np), jnp.asarray(w_np)
        flops = moe_gemm.grouped_flops(m, k_dim, i_dim)
        base = dict(shape=name, tokens=t, rows=m, rows_per_expert=m / e, experts_touched=touched, flops=flops)
        dense = jax.jit(functools.partial(dense_loop_moe, num_experts=e, capacity=int(counts.max())))
        cases = [
            ("pallas", "bf16", lambda: ours(x, ids, w, bf16)),
            ("pallas", "mxfp4", lambda: ours(x, ids, w, mx_model)),
            ("dense_loop", "bf16", lambda: dense(x, ids, w, bf16)),
        ]
        if not interpret:
            mg = jax.jit(functools.partial(mgpu_moe, num_experts=e))
            cases.append(("ragged_dot_mgpu", "bf16", lambda: mg(x, ids, w, gate_up, bf16["down"])))
        if m <= args.xla_ragged_max_rows:
            xr = jax.jit(functools.partial(xla_ragged_moe, num_experts=e))
            cases.append(("xla_ragged_dot", "bf16", lambda: xr(x, ids, w, bf16)))
        results = {}
        for impl, quant, thunk in cases:
            row = dict(base, impl=impl, weights=quant, **({"mxfp4_layout": mx_layout} if quant == "mxfp4" else {}))
            try:
                out = thunk()
                results[(impl, quant)] = out
                sec = timed(lambda: thunk()) if not interpret else float("nan")
                wbytes = moe_gemm.expert_weight_bytes(touched, k_dim, i_dim, packed=quant == "mxfp4")
                floor = max(flops / (limits["matmul_tflops"] * 1e12), wbytes / (limits["copy_gbps"] * 1e9))
                row.update(ms=sec * 1e3, tflops=flops / sec / 1e12, weight_gbps=wbytes / sec / 1e9,
                           weight_bytes=wbytes, floor_ms=floor * 1e3, floor_ratio=sec / floor)
            except Exception as err:  # a peer that does not run at this shape is recorded, not fatal
                row.update(error=f"{type(err).__name__}: {str(err)[:300]}")
                traceback.print_exc(limit=2)
            rows_out.append(row)
        # correctness on the device: ours vs the einsum peer (same weights; MXFP4 vs its dequantised bf16)
        checks = {}
        if ("pallas", "bf16") in results and ("dense_loop", "bf16") in results:
            checks["pallas_bf16_vs_dense"] = rel_err(results[("pallas", "bf16")], results[("dense_loop", "bf16")])
        if ("pallas", "mxfp4") in results and t <= 4096:
            want = jax.jit(functools.partial(dense_loop_moe, num_experts=e, capacity=int(counts.max())))(x, ids, w, mx_deq)
            checks["pallas_mxfp4_vs_dense_dequant"] = rel_err(results[("pallas", "mxfp4")], want)
        for row in rows_out[-len(cases):]:
            row["checks"] = checks
        print(f"{name} T={t} rows={m} touched={touched} checks={checks}", flush=True)
    return rows_out


def parse_configs(spec: str) -> list[MoeGemmConfig]:
    """'128/128/128/64/8/3,...' -> MoeGemmConfigs (block_m/glu_block_n/down_block_n/block_k/num_warps/num_stages),
    optionally followed by /tail_block_m (0 = off), e.g. 128/128/256/64/8/3/64, /down_num_stages (0 = the
    same), e.g. 16/64/64/128/4/4/0/3, /down_split_k, /aligned (0 / 1) and /column_group, e.g.
    128/128/256/64/8/3/64/0/1/1/8."""
    return [MoeGemmConfig.from_tiling(item) for item in filter(None, spec.split(","))]


def config_name(cfg: MoeGemmConfig) -> str:
    """The tiling string parse_configs reads (mode fields only when not the defaults)."""
    return cfg.tiling


def timed_with_adjacent_peak(f, args, rounds: int, peak_n: int = 8192) -> tuple[float, dict]:
    """The case's time (median of `rounds`) with the jnp.dot peak measured right before each round: the card's
    matmul rate drifts by ~10 % between runs and within one (645-721 TFLOP/s seen on the same 8192^3 product),
    as much as tilings differ, so the share of the peak is taken per round against its neighbour. Returns the
    seconds and the row fields: adjacent_peak_tflops (median), of_adjacent_peak (median of the per-round shares),
    their spread. peak_n: the peak's matmul size (tests shrink it)."""
    secs, peaks = [], []
    for _ in range(rounds):
        peaks.append(matmul_peak(peak_n))
        secs.append(timed(f, *args))
    return statistics.median(secs), dict(adjacent_peak_tflops=statistics.median(peaks), round_ms=[1e3 * x for x in secs],
                                         round_peaks_tflops=peaks)


def bench_sweep(shape, token_counts, limits, interpret, configs=None, budget_s=None, rounds=1):
    """Tilings and row modes of ours per token count, against the dense einsum on the device (rel err, correct if
    < 1e-2) and ragged_dot_mgpu (on a CPU: jax.lax.ragged_dot through the same padding, untimed). Per T: first
    moe_grouped_mlp's own default tiling ("default ..."), then each config of the matching size class (block_m
    <= 32 at <= 16 rows/expert, larger otherwise), then the peer. Starts no new case after budget_s seconds.
    rounds > 1 (on a GPU): each case timed that many times, each after its own jnp.dot peak
    (`timed_with_adjacent_peak`); of_adjacent_peak then joins of_matmul_peak (the run's one peak)."""
    t_start = time.perf_counter()
    configs = configs or [  # the defaults (first of each group) are measured in the main table; alternatives
        MoeGemmConfig(16, 128, 128, 128, 4, 3), MoeGemmConfig(16, 64, 128, 256, 4, 3),
        MoeGemmConfig(128, 128, 128, 64, 8, 3), MoeGemmConfig(64, 64, 128, 64, 4, 4),
    ]
    out = []
    e, k_dim, i_dim = shape["local"], shape["k_dim"], shape["i_dim"]
    bf16, mx = make_experts(shape, seed=2)
    gate_up = jnp.concatenate([bf16["gate"], bf16["up"]], axis=-1)
    peak = limits["matmul_tflops"]
    for t in token_counts:
        ids_np, w_np = routing(shape, t, seed=t + 7)
        m = ids_np.size
        counts = np.bincount(ids_np.reshape(-1), minlength=e)
        x = jax.random.normal(jax.random.key(t), (ids_np.shape[0], k_dim), jnp.float32).astype(jnp.bfloat16)
        ids, w = jnp.asarray(ids_np), jnp.asarray(w_np)
        touched = int((counts > 0).sum())
        small = m / e <= 16
        flops = moe_gemm.grouped_flops(m, k_dim, i_dim)
        want = {"bf16": jax.jit(functools.partial(dense_loop_moe, num_experts=e, capacity=int(counts.max())))(
            x, ids, w, bf16)}
        default = moe_gemm.default_config(m, e)
        runs = [(default, "default ")] + [(c, "") for c in configs if (c.block_m <= 32) == small]
        cases = [("pallas", quant, cfg, tag) for cfg, tag in runs
                 for quant in (("bf16", "mxfp4") if small and tag == "" else ("bf16",))]
        cases.append(("ragged_dot_mgpu" if not interpret else "ragged_dot_padded_xla", "bf16", None, ""))
        for impl, quant, cfg, tag in cases:
            row = dict(tokens=t, rows=m, rows_per_expert=m / e, max_rows=int(counts.max()), impl=impl, weights=quant,
                       tiling=tag + (config_name(cfg) if cfg else ""), config=cfg.__dict__ if cfg else None)
            if cfg is not None:  # MMA rows computed / real rows (1.0 = no wasted MMA work)
                row["mma_rows_over_rows"] = mma_rows(cfg, counts) / m
            if budget_s is not None and time.perf_counter() - t_start > budget_s:
                row["skipped"] = f"past the {budget_s:.0f} s budget"
                out.append(row)
                continue
            try:
                if cfg is None:
                    args = (x, ids, w, gate_up, bf16["down"])
                    f = jax.jit(functools.partial(mgpu_moe, num_experts=e,
                                                  ragged=xla_ragged_dot_bf16 if interpret else None))
                else:
                    args = (x, ids, w, bf16 if quant == "bf16" else mx)
                    f = jax.jit(functools.partial(moe_gemm.moe_grouped_mlp, config=cfg, interpret=interpret))
                got = f(*args)
                if quant == "bf16":
                    err = rel_err(got, want["bf16"])
                    row.update(rel_err=err, correct=bool(err < 1e-2))
                paired = {}
                if interpret:
                    sec = float("nan")
                elif rounds > 1:
                    sec, paired = timed_with_adjacent_peak(f, args, rounds)
                else:
                    sec = timed(f, *args)
                wbytes = moe_gemm.expert_weight_bytes(touched, k_dim, i_dim, packed=quant == "mxfp4")
                tflops = flops / sec / 1e12
                row.update(ms=sec * 1e3, tflops=tflops, weight_gbps=wbytes / sec / 1e9, of_matmul_peak=tflops / peak)
                if paired:
                    shares = [flops / (ms * 1e-3) / 1e12 / pk for ms, pk in zip(paired["round_ms"],
                                                                             paired["round_peaks_tflops"])]
                    row.update(paired, of_adjacent_peak=statistics.median(shares), of_adjacent_peak_min=min(shares),
                               of_adjacent_peak_max=max(shares))
            except Exception as err:
                row.update(error=f"{type(err).__name__}: {str(err)[:300]}")
                traceback.print_exc(limit=2)
            out.append(row)
            print("sweep", {k: v for k, v in row.items() if k != "config"}, flush=True)
        at_t = [r for r in out if r["tokens"] == t and "ms" in r and r["weights"] == "bf16"]
        peer = next((r for r in at_t if r["impl"] != "pallas"), None)
        for r in at_t:
            if peer and r["impl"] == "pallas":
                r["peer_ms_over_this"] = peer["ms"] / r["ms"]
    return out


def mma_rows(cfg: MoeGemmConfig, counts: np.ndarray) -> int:
    """Rows the MMAs of one config compute for these group sizes (every work item costs block_m rows, or
    tail_block_m when it has at most that many): the wasted-work model behind the mid-size modes."""
    sizes = jnp.asarray(counts, jnp.int32)
    m = int(counts.sum())
    sched = moe_gemm.tile_schedule(sizes, m, cfg.block_m, cfg.aligned)
    n = np.asarray(sched[3] - sched[2])
    n = n[n > 0]
    if cfg.tail_block_m:
        return int(np.where(n <= cfg.tail_block_m, cfg.tail_block_m, cfg.block_m).sum())
    return int(n.size * cfg.block_m)


def dep_routing(shape: dict, tokens: int, seed: int):
    """What one DEP rank receives: the tokens (of `tokens` routed anywhere) with at least one pick among this rank's
    experts, each with all top_k picks as local ids -- the others -1 (k3jax.parallel.dep's dropped assignments) --
    and its weights. Returns (ids [R, top_k], weights [R, top_k], local picks)."""
    rng = np.random.default_rng(seed)
    local, total, top_k = shape["local"], shape["total"], shape["top_k"]
    picks = np.argsort(rng.random((tokens, total)), axis=1)[:, :top_k].astype(np.int32)  # rank 0 owns 0 .. local-1
    mine = picks < local
    received = mine.any(axis=1)
    ids = np.where(mine, picks, -1)[received]
    weights = rng.uniform(0.02, 0.2, ids.shape).astype(np.float32)
    return ids, weights, int(mine.sum())


def bench_dep(shape, token_counts, limits, interpret):
    """The rows a DEP rank computes: its received tokens' non-local picks dropped (ids -1, this tree) against the
    previous convention (weight-0 rows of local expert 0, all computed), and against one row per local pick with
    top_k = 1 (the sweep's shape: x duplicated per pick, nothing to select away), identical inputs; each checked
    against the dropped form (the weight-0 rows add exact zeros). "dropped_expected" is the dropped form tiled as
    k3jax.parallel.dep calls it: by the rank's expected kept rows (expected_rows = T * top_k * local / total, its
    even share), not by all received assignments ("dropped"); with few kept rows a token its combine is
    pallas_kernels/moe_combine.py (moe_grouped_mlp's "auto"), which "dropped_expected_xla_combine" replaces by XLA's."""
    e, k_dim, i_dim = shape["local"], shape["k_dim"], shape["i_dim"]
    bf16, _ = make_experts(shape, seed=3)
    out = []
    for t in token_counts:
        ids_np, w_np, local_picks = dep_routing(shape, t, seed=t + 11)
        r = ids_np.shape[0]
        x = jax.random.normal(jax.random.key(t), (r, k_dim), jnp.float32).astype(jnp.bfloat16)
        kept = ids_np >= 0
        token, slot = np.nonzero(kept)
        expected = max(1, round(t * shape["top_k"] * e / shape["total"]))
        dropped = (x, jnp.asarray(ids_np), jnp.asarray(w_np))
        forms = {
            "dropped": dropped,
            "dropped_expected": dropped,  # the same arrays, another tiling (and, by "auto", the combine kernel)
            "dropped_expected_xla_combine": dropped,  # that tiling with XLA's combine (all 16 slots read)
            "weight0_expert0": (x, jnp.asarray(np.where(kept, ids_np, 0)), jnp.asarray(np.where(kept, w_np, 0))),
            "one_row_per_pick": (x[jnp.asarray(token)], jnp.asarray(ids_np[token, slot][:, None]),
                                 jnp.asarray(w_np[token, slot][:, None])),
        }
        f = jax.jit(functools.partial(moe_gemm.moe_grouped_mlp, interpret=interpret))
        f_expected = jax.jit(functools.partial(moe_gemm.moe_grouped_mlp, expected_rows=expected, interpret=interpret))
        f_expected_xla = jax.jit(functools.partial(moe_gemm.moe_grouped_mlp, expected_rows=expected, combine="xla",
                                                   interpret=interpret))
        row = dict(tokens_routed=t, received=r, top_k=shape["top_k"], local_picks=local_picks,
                   rows_per_expert=local_picks / e, expected_rows=expected)
        results = {}
        for name, (xs, ids, w) in forms.items():
            fn = {"dropped_expected": f_expected, "dropped_expected_xla_combine": f_expected_xla}.get(name, f)
            results[name] = fn(xs, ids, w, bf16)
            row[f"{name}_ms"] = float("nan") if interpret else timed(fn, xs, ids, w, bf16) * 1e3
        row["rel_err_weight0_vs_dropped"] = rel_err(results["weight0_expert0"], results["dropped"])
        row["rel_err_expected_vs_dropped"] = rel_err(results["dropped_expected"], results["dropped"])
        row["rel_err_expected_xla_combine_vs_dropped"] = rel_err(results["dropped_expected_xla_combine"],
                                                                 results["dropped"])
        per_token = jax.ops.segment_sum(results["one_row_per_pick"].astype(jnp.float32), jnp.asarray(token), r)
        row["rel_err_one_row_vs_dropped"] = rel_err(per_token, results["dropped"].astype(jnp.float32))
        if not interpret:
            row["weight0_over_dropped"] = row["weight0_expert0_ms"] / row["dropped_ms"]
            row["dropped_over_one_row"] = row["dropped_ms"] / row["one_row_per_pick_ms"]
            row["dropped_over_expected"] = row["dropped_ms"] / row["dropped_expected_ms"]
            row["xla_combine_over_kernel"] = row["dropped_expected_xla_combine_ms"] / row["dropped_expected_ms"]
            row["dropped_tflops"] = moe_gemm.grouped_flops(local_picks, k_dim, i_dim) / (row["dropped_ms"] * 1e-3) / 1e12
        print("dep", row, flush=True)
        out.append(row)
    return out


def sweep_summary(rows) -> list[str]:
    """Per T: the best correct bf16 case of ours against issue 4's bar (>= 60 % of the jnp.dot peak, >= 1.0x the
    ragged_dot_mgpu peer)."""
    lines = []
    for t in sorted({r["tokens"] for r in rows}):
        ours = [r for r in rows if r["tokens"] == t and r["impl"] == "pallas" and r["weights"] == "bf16"
                and r.get("correct") and "ms" in r]
        peer = next((r for r in rows if r["tokens"] == t and r["impl"] != "pallas" and "ms" in r), None)
        if not ours:
            lines.append(f"sweep T={t}: no correct case of ours")
            continue
        b = min(ours, key=lambda r: r["ms"])
        vs = f"{peer['ms'] / b['ms']:.2f}x {peer['impl']}" if peer else "no peer"
        share = b.get("of_adjacent_peak", b["of_matmul_peak"])  # the paired share when the rounds measured one
        which = (f"the adjacent jnp.dot peaks (median of {len(b['round_ms'])} rounds, "
                 f"{100 * b['of_adjacent_peak_min']:.1f}-{100 * b['of_adjacent_peak_max']:.1f} %)"
                 if "of_adjacent_peak" in b else "the jnp.dot peak")
        bar = share >= 0.6 and (peer is None or peer["ms"] >= b["ms"])
        lines.append(f"sweep T={t} ({b['rows_per_expert']:.0f} rows/expert): best {b['tiling']} {b['ms']:.3f} ms = "
                     f"{100 * share:.1f} % of {which}, {vs}; issue 4 bar (>= 60 %, >= 1.0x): "
                     f"{'met' if bar else 'NOT met'}")
    return lines


MXFP4_SMOKE_SHAPE = dict(local=6, total=12, top_k=3, k_dim=128, i_dim=64)  # kernel layouts: dims multiples of 64


def bench_mxfp4_variants(shape, token_counts, limits, interpret, variants, configs, budget_s):
    """bf16 vs each MXFP4 decode variant at each tiling, identical inputs per token count, every case checked on
    the device against the dense einsum over the dequantised-bf16 weights. Stops starting cases after budget_s."""
    t_start = time.perf_counter()
    e, k_dim, i_dim = shape["local"], shape["k_dim"], shape["i_dim"]
    bf16, mx = make_experts(shape, seed=3)
    mx_deq = dequantized(mx)
    by_layout = {"hf": mx}
    for layout in {moe_gemm.MXFP4_VARIANTS[v] for v in variants} & set(moe_gemm.KERNEL_LAYOUTS):  # kn, k4, k4r
        by_layout[layout] = {n: moe_gemm.prepare_mxfp4(w, layout=layout) for n, w in mx.items()}
    cases, skipped, best = [], [], {}
    for t in token_counts:
        ids_np, w_np = routing(shape, t, seed=t + 11)
        m = ids_np.size
        counts = np.bincount(ids_np.reshape(-1), minlength=e)
        touched = int((counts > 0).sum())
        x = jax.random.normal(jax.random.key(t + 1), (ids_np.shape[0], k_dim), jnp.float32).astype(jnp.bfloat16)
        ids, w = jnp.asarray(ids_np), jnp.asarray(w_np)
        dense = jax.jit(functools.partial(dense_loop_moe, num_experts=e, capacity=int(counts.max())))
        want = {"bf16": dense(x, ids, w, bf16), "mxfp4": dense(x, ids, w, mx_deq)}
        # bf16 and the word layouts also at the tilings moe_grouped_mlp picks for this size (the model's paths: the
        # word layouts' down contraction cut at decode sizes, moe_gemm.word_down_split), then every tiling
        words = [v for v in variants if moe_gemm.MXFP4_VARIANTS[v] in moe_gemm.WORD_LAYOUTS]
        runs = [(moe_gemm.default_config(m, e), ["bf16"], "default "),
                *([(moe_gemm.default_config(m, e, (k_dim, i_dim)), words, "default ")] if words else []),
                *((cfg, ["bf16", *variants], "") for cfg in configs)]
        for cfg, names, tag in runs:
            for name in names:
                tiling = tag + config_name(cfg)
                row = dict(tokens=t, rows=m, rows_per_expert=m / e, experts_touched=touched, variant=name,
                           tiling=tiling)
                if time.perf_counter() - t_start > budget_s:
                    skipped.append(row)
                    continue
                quant = "bf16" if name == "bf16" else "mxfp4"
                experts = bf16 if name == "bf16" else by_layout[moe_gemm.MXFP4_VARIANTS[name]]
                try:
                    f = jax.jit(functools.partial(moe_gemm.moe_grouped_mlp, config=cfg, interpret=interpret))
                    out = f(x, ids, w, experts)
                    err = rel_err(out, want[quant])
                    sec = timed(f, x, ids, w, experts) if not interpret else float("nan")
                    wbytes = moe_gemm.expert_weight_bytes(touched, k_dim, i_dim, packed=quant == "mxfp4")
                    row.update(ms=sec * 1e3, rel_err=err, correct=bool(err < 1e-2), weight_bytes=wbytes,
                               weight_gbps=wbytes / sec / 1e9, of_copy=wbytes / sec / 1e9 / limits["copy_gbps"])
                except Exception as err:  # a variant that does not compile is recorded, not fatal
                    row.update(error=f"{type(err).__name__}: {str(err)[:300]}")
                    traceback.print_exc(limit=2)
                cases.append(row)
                print("mxfp4", row, flush=True)
        at_t = [c for c in cases if c["tokens"] == t and c.get("correct")]
        bf = [c for c in at_t if c["variant"] == "bf16"]
        mxs = [c for c in at_t if c["variant"] != "bf16"]
        if bf:
            b = min(bf, key=lambda c: c["ms"])
            for c in cases:
                if c["tokens"] == t and "ms" in c:
                    c["bf16_over_this"] = b["ms"] / c["ms"]
            best[t] = dict(bf16_ms=b["ms"], bf16_tiling=b["tiling"])
            if mxs:
                q = min(mxs, key=lambda c: c["ms"])
                best[t].update(mxfp4_ms=q["ms"], mxfp4_variant=q["variant"], mxfp4_tiling=q["tiling"],
                               bf16_over_mxfp4=b["ms"] / q["ms"])
    return dict(shape=shape, tokens=token_counts, variants=variants, budget_s=budget_s,
                elapsed_s=time.perf_counter() - t_start, cases=cases, skipped=skipped, best=best)


CHAIN = 10  # calls per timed jit in bench_norms_decode (each call a kernel of its own to compile)


def bench_norms_decode(shapes, interpret, source_counts=(3, 6, 10)):
    """AttnRes mix + RMSNorm at decode-batch sizes (few rows: the kernel's launch width, not bandwidth, sets the
    time): the default tiling (`fused_norm._tiling`) against the pre-2026-12-01 rule (rows from the register budget
    alone) and the unfused XLA code; each checked against XLA. A call here takes
    5-20 us of device time, less than one jitted dispatch from the host, so each is timed as CHAIN calls unrolled
    in one jit (each call's output the next call's first source, as the model chains them): ms per call."""
    out = []

    def chained(fn):
        def run(sources, proj, norm, ow):
            for _ in range(CHAIN):
                normed = fn(sources, proj, norm, ow)
                sources = [normed.astype(sources[0].dtype)] + list(sources[1:])
            return normed
        return jax.jit(run)

    key = jax.random.key(6)
    for n, d in shapes:
        old_rows = fused_norm._pow2_divisor(n, max(1, min(64, fused_norm._REGISTER_BUDGET // d)))
        new_rows = fused_norm._tiling(n, d, interpret=False)[0]
        for num_sources in source_counts:
            ks = jax.random.split(key, num_sources + 3)
            sources = [(jax.random.normal(ks[i], (n, d), jnp.float32) * (1 + i)).astype(jnp.bfloat16)
                       for i in range(num_sources)]
            proj, norm, ow = (jax.random.normal(ks[-j], (d,), jnp.float32).astype(jnp.bfloat16) * 0.1 + (j > 1)
                              for j in (1, 2, 3))
            unfused = lambda *a: attn_res_mix_norm_unfused(*a, 1e-5)[1]
            row = dict(op="attn_res_mix_norm_decode", rows=n, d=d, sources=num_sources, default_rows=new_rows,
                       old_rule_rows=old_rows, cases={})
            ref = jax.jit(unfused)(sources, proj, norm, ow)
            if not interpret:
                row["xla_ms"] = timed(chained(unfused), sources, proj, norm, ow) * 1e3 / CHAIN
            warps = fused_norm.ATTN_RES_WARPS  # the kernel's default launch width, named in the case keys
            for rows in sorted({old_rows, new_rows}):
                call = lambda s, a, b, c, r=rows: fused_norm.attn_res_mix_norm(
                    s, a, b, c, 1e-5, block_rows=r, interpret=interpret)[1]
                case = dict(rel_err_vs_xla=rel_err(jax.jit(call)(sources, proj, norm, ow), ref))
                if not interpret:
                    case["ms"] = timed(chained(call), sources, proj, norm, ow) * 1e3 / CHAIN
                row["cases"][f"rows{rows}_w{warps}"] = case
            timed_cases = {k: c["ms"] for k, c in row["cases"].items() if "ms" in c}
            if timed_cases:
                row["default_ms"] = timed_cases[f"rows{new_rows}_w{warps}"]
                row["old_rule_ms"] = timed_cases[f"rows{old_rows}_w{warps}"]
                row["best"] = min(timed_cases, key=timed_cases.get)
            out.append(row)
            print(row, flush=True)
    return out


def bench_norms(tokens, limits, interpret, d=7168, heads=96, head_dim=128):
    out = []
    key = jax.random.key(5)
    for num_sources in (5, 9):
        ks = jax.random.split(key, num_sources + 3)
        sources = [(jax.random.normal(ks[i], (tokens, d), jnp.float32) * (1 + i)).astype(jnp.bfloat16) for i in range(num_sources)]
        proj, norm, ow = (jax.random.normal(ks[-j], (d,), jnp.float32).astype(jnp.bfloat16) * 0.1 + (j > 1) for j in (1, 2, 3))
        nbytes = (num_sources + 1) * tokens * d * 2  # sources read once, normed output written once
        fused = jax.jit(lambda s, a, b, c: fused_norm.attn_res_mix_norm(s, a, b, c, 1e-5, interpret=interpret)[1])
        unfused = jax.jit(lambda s, a, b, c: attn_res_mix_norm_unfused(s, a, b, c, 1e-5)[1])
        row = dict(op="attn_res_mix_norm", tokens=tokens, d=d, sources=num_sources, bytes=nbytes)
        got, want = fused(sources, proj, norm, ow), unfused(sources, proj, norm, ow)
        row["rel_err_vs_xla"] = rel_err(got, want)
        if not interpret:
            tf, tu = timed(fused, sources, proj, norm, ow), timed(unfused, sources, proj, norm, ow)
            row.update(fused_ms=tf * 1e3, xla_ms=tu * 1e3, speedup=tu / tf, fused_gbps=nbytes / tf / 1e9,
                       xla_gbps=nbytes / tu / 1e9, floor_ms=nbytes / (limits["copy_gbps"] * 1e9) * 1e3)
        if not interpret:  # launch-width sweep (the default comes from fused_norm._num_warps)
            row["num_warps_ms"] = {}
            for warps in (4, 8, 16):
                f = jax.jit(lambda s, a, b, c, w=warps: fused_norm.attn_res_mix_norm(s, a, b, c, 1e-5, num_warps=w)[1])
                try:
                    row["num_warps_ms"][warps] = timed(f, sources, proj, norm, ow) * 1e3
                except Exception as err:
                    row["num_warps_ms"][warps] = f"{type(err).__name__}: {str(err)[:200]}"
        out.append(row)
        print(row, flush=True)
        del sources
    kx, kg, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (tokens, heads, head_dim), jnp.float32).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (tokens, heads, head_dim), jnp.float32).astype(jnp.bfloat16)
    wt = (1 + 0.1 * jax.random.normal(kw, (head_dim,), jnp.float32)).astype(jnp.bfloat16)
    for fp8 in (False, True):
        nbytes = x.size * 2 * 2 + x.size * (1 if fp8 else 2) + (tokens * heads * 4 if fp8 else 0)
        fused = jax.jit(lambda a, b, c: fused_norm.gated_rms_norm(a, b, c, 1e-5, fp8=fp8, interpret=interpret))
        xla = jax.jit(lambda a, b, c: fused_norm.gated_rms_norm_reference(a, b, c, 1e-5, fp8=fp8)) if fp8 else \
            jax.jit(lambda a, b, c: gated_rms_norm_xla(a, b, c, 1e-5))
        row = dict(op="gated_rms_norm" + ("_fp8" if fp8 else ""), rows=tokens * heads, d=head_dim, bytes=nbytes)
        got, want = fused(x, g, wt), xla(x, g, wt)
        if fp8:
            got = got[0].astype(jnp.float32) * got[1][..., None]
            want = want[0].astype(jnp.float32) * want[1][..., None]
        row["rel_err_vs_xla"] = rel_err(got, want)
        if not interpret:
            tf, tu = timed(fused, x, g, wt), timed(xla, x, g, wt)
            row.update(fused_ms=tf * 1e3, xla_ms=tu * 1e3, speedup=tu / tf, fused_gbps=nbytes / tf / 1e9,
                       xla_gbps=nbytes / tu / 1e9, floor_ms=nbytes / (limits["copy_gbps"] * 1e9) * 1e3)
        out.append(row)
        print(row, flush=True)
    return out


# ----------------------------------------------------------------------------------------------------


def table(result) -> str:
    lines = []
    lim = result["limits"]
    lines.append(f"limits: bf16 matmul {lim['matmul_tflops']:.0f} TFLOP/s, XLA copy {lim['xla_copy_gbps']:.0f} GB/s, "
                 f"torch copy {lim.get('torch_copy_gbps') or float('nan'):.0f} GB/s (copy ceiling used: {lim['copy_gbps']:.0f})")
    by = {}
    for r in result.get("moe", []):
        by.setdefault((r["shape"], r["tokens"]), {})[(r["impl"], r["weights"])] = r
    lines.append("| shape | T | rows/expert | impl | weights | ms | TFLOP/s | weight GB/s | x floor | ms / ours-bf16 ms |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for (shape, t), rs in by.items():
        ours = rs.get(("pallas", "bf16"), {}).get("ms")
        for (impl, quant), r in rs.items():
            if "error" in r:
                lines.append(f"| {shape} | {t} | {r['rows_per_expert']:.1f} | {impl} | {quant} | error: {r['error'][:60]} |||||")
                continue
            ratio = r["ms"] / ours if ours else float("nan")
            lines.append(f"| {shape} | {t} | {r['rows_per_expert']:.1f} | {impl} | {quant} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                         f"{r['weight_gbps']:.0f} | {r['floor_ratio']:.2f} | {ratio:.2f} |")
    lines.append("(x floor: ms / max(FLOPs / matmul peak, weight bytes / copy bandwidth); last column > 1: ours-bf16 is faster)")
    for r in result.get("dep", []):
        lines.append(
            f"dep: {r['tokens_routed']} tokens routed, {r['received']} received (top {r['top_k']}), {r['local_picks']} "
            f"local picks ({r['rows_per_expert']:.1f} rows/expert): dropped ids {r['dropped_ms']:.3f} ms, tiled by "
            f"{r['expected_rows']} expected rows {r['dropped_expected_ms']:.3f} ms "
            f"({r.get('dropped_over_expected', float('nan')):.2f}x; with XLA's combine "
            f"{r['dropped_expected_xla_combine_ms']:.3f} ms, {r.get('xla_combine_over_kernel', float('nan')):.2f}x), "
            f"weight-0 rows "
            f"of expert 0 {r['weight0_expert0_ms']:.3f} ms ({r.get('weight0_over_dropped', float('nan')):.2f}x), one "
            f"row per pick {r['one_row_per_pick_ms']:.3f} ms (dropped / it {r.get('dropped_over_one_row', float('nan')):.2f}); "
            f"rel err weight-0 {r['rel_err_weight0_vs_dropped']:.1e}, one-row {r['rel_err_one_row_vs_dropped']:.1e}")
    for r in result.get("sweep", []):
        head = f"sweep T={r['tokens']} {r['impl']} {r['weights']} {r['tiling']}"
        if "ms" in r:
            check = "" if "rel_err" not in r else f", rel err {r['rel_err']:.1e}{'' if r['correct'] else ' WRONG'}"
            vs = f", {r['peer_ms_over_this']:.2f}x the peer" if "peer_ms_over_this" in r else ""
            waste = ""
            if "mma_rows_over_rows" in r:  # the MMA rate on the rows actually computed, as a share of the peak
                waste = (f", MMA rows / rows {r['mma_rows_over_rows']:.2f} (computed rows at "
                         f"{100 * r['of_matmul_peak'] * r['mma_rows_over_rows']:.1f} % of the peak)")
            adj = (f"; {100 * r['of_adjacent_peak']:.1f} % of the adjacent peaks, median of {len(r['round_ms'])}"
                   if "of_adjacent_peak" in r else "")
            lines.append(f"{head}: {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s ({100 * r['of_matmul_peak']:.1f} % of "
                         f"the matmul peak{adj}){vs}{check}{waste}")
        else:
            lines.append(f"{head}: {(r.get('error') or r.get('skipped', ''))[:100]}")
    lines += sweep_summary(result.get("sweep", []))
    mv = result.get("mxfp4_variants")
    if mv:
        lines.append("| T | rows/expert | weights | tiling | ms | weight GB/s | % copy | bf16/this | rel err |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in mv["cases"]:
            if "error" in r:
                lines.append(f"| {r['tokens']} | {r['rows_per_expert']:.2f} | {r['variant']} | {r['tiling']} | "
                             f"error: {r['error'][:60]} |||||")
                continue
            lines.append(f"| {r['tokens']} | {r['rows_per_expert']:.2f} | {r['variant']} | {r['tiling']} | {r['ms']:.3f} | "
                         f"{r['weight_gbps']:.0f} | {100 * r['of_copy']:.1f} | {r.get('bf16_over_this', float('nan')):.2f} | "
                         f"{r['rel_err']:.1e}{'' if r['correct'] else ' WRONG'} |")
        for t, b in mv["best"].items():
            lines.append(f"T={t}: best bf16 {b['bf16_ms']:.3f} ms ({b['bf16_tiling']}); best MXFP4 "
                         f"{b.get('mxfp4_variant')} {b.get('mxfp4_tiling')} {b.get('mxfp4_ms', float('nan')):.3f} ms; "
                         f"bf16/mxfp4 = {b.get('bf16_over_mxfp4', float('nan')):.2f} (issue 4 bar: >= 1.5)")
        lines.append(f"mxfp4 section: {mv['elapsed_s']:.0f} s of a {mv['budget_s']:.0f} s budget, {len(mv['skipped'])} cases skipped")
    for r in result.get("norms_decode", []):
        if "default_ms" in r:
            lines.append(f"attn_res_mix_norm decode {r['rows']}x{r['d']}, {r['sources']} sources: default (rows "
                         f"{r['default_rows']}) {r['default_ms']:.4f} ms, old rule (rows {r['old_rule_rows']}) "
                         f"{r['old_rule_ms']:.4f} ms, XLA {r['xla_ms']:.4f} ms; best {r['best']}")
    for r in result.get("norms", []):
        if "fused_ms" in r:
            lines.append(f"{r['op']} {r.get('sources', '')}: fused {r['fused_ms']:.3f} ms ({r['fused_gbps']:.0f} GB/s) vs XLA "
                         f"{r['xla_ms']:.3f} ms ({r['xla_gbps']:.0f} GB/s): {r['speedup']:.2f}x; floor {r['floor_ms']:.3f} ms; "
                         f"rel err {r['rel_err_vs_xla']:.1e}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    interpret = args.smoke or jax.default_backend() != "gpu"
    skip = set(filter(None, args.skip.split(",")))
    result = dict(
        benchmark="moe", date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
        jax=jax.__version__, python=platform.python_version(), argv=sys.argv[1:] if argv is None else argv,
        interpret=interpret,
    )
    if interpret:
        limits = dict(matmul_tflops=1.0, xla_copy_gbps=1.0, torch_copy_gbps=None, copy_gbps=1.0)
    else:
        xla_copy = copy_bandwidth(2 << 30)
        torch_copy = torch_copy_bandwidth(2 << 30)
        limits = dict(matmul_tflops=matmul_peak(8192), xla_copy_gbps=xla_copy, torch_copy_gbps=torch_copy,
                      copy_gbps=max(xla_copy, torch_copy or 0))
    result["limits"] = limits
    print("limits", limits, flush=True)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    tokens = {"k3-ep16": [int(t) for t in args.tokens.split(",")], "k3-small": [int(t) for t in args.small_tokens.split(",")],
              "tiny": [5, 40]}

    def save():  # after every section, so a run cut short still leaves its numbers
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    save()
    if "norms" not in skip:
        result["norms"] = bench_norms(64 if args.smoke else args.norm_tokens, limits, interpret,
                                      *((72, 3, 16) if args.smoke else ()))
        save()
    if args.norm_decode:
        result["norms_decode"] = bench_norms_decode(
            [tuple(int(x) for x in s.split("x")) for s in args.norm_decode.split(",") if s], interpret)
        save()
    if "moe" not in skip:
        result["moe"] = []
        for name, shape in shapes.items():
            result["moe"] += bench_moe(name, shape, tokens[name], limits, args, interpret)
            save()
    if args.dep_tokens:
        result["dep"] = bench_dep(shapes["tiny" if args.smoke else "k3-ep16"],
                                  [int(t) for t in args.dep_tokens.split(",") if t], limits, interpret)
        save()
    if "sweep" not in skip:
        name = "tiny" if args.smoke else args.sweep_shape
        sweep_tokens = [tokens[name][0], tokens[name][-2]] if not args.smoke else [5]
        if args.sweep_tokens:
            sweep_tokens = [int(t) for t in args.sweep_tokens.split(",")]
        configs = parse_configs(args.sweep_configs) if args.sweep_configs else None
        result["sweep"] = bench_sweep(shapes[name], sweep_tokens, limits, interpret, configs, args.sweep_budget_s,
                                      args.sweep_rounds)
        save()
    if args.mxfp4_variants:
        variants = [v for v in args.mxfp4_variants.split(",") if v]
        unknown = set(variants) - set(moe_gemm.MXFP4_VARIANTS)
        if unknown:
            raise ValueError(f"unknown MXFP4 variants {sorted(unknown)}; known: {sorted(moe_gemm.MXFP4_VARIANTS)}")
        mtokens = [int(t) for t in args.sweep_tokens.split(",")] if args.sweep_tokens else ([5] if args.smoke else [16, 256, 1024])
        result["mxfp4_variants"] = bench_mxfp4_variants(
            MXFP4_SMOKE_SHAPE if args.smoke else SHAPES["k3-ep16"], mtokens, limits, interpret, variants,
            parse_configs(args.mxfp4_configs), args.budget_s)
        save()
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
