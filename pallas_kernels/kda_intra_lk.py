"""KDA chunked prefill, stage 1 without W / U as one Pallas kernel that walks each chunk in 16-row blocks
(`kda_chunk(..., stage1="pallas2")`, followed by `kda_intra_wu`; together they give `_intra_stage_v2`'s six
outputs in its layouts, so the state passes consume them unchanged).

Per head and chunk of C = 64 tokens (k3-model.md §3.1; the math of `kda_intra`'s docstring):

    g = lb sigmoid(e^a_log (z + dt_bias))   beta = sigmoid(b)   q, k L2-normalised, q scaled   G = cumsum(g)
    L[i,j] = beta_i sum_d k_i e^(G_i - G_j) k_j (j < i)   A = (I + L)^-1   Aqk[i,j] = sum_d q_i e^(G_i - G_j) k_j (j <= i)
    outputs: A diag(beta), e^G K (for `kda_intra_wu`), e^G Q, e^(G_C - G) K, Aqk (stored dtype), e^(G_C) (fp32)

Why row blocks: the one-tile kernel `kda_intra` made L / Aqk with masked 64-row dots (4x the needed FLOPs)
and inverted with masked 64x64 dots at tf32x3, which the H200 ablation (skip-inverse) put at ~3 ms of its
8.2 ms. Here a program (one chunk, one head) loads its chunk in four 16-row blocks b = 0..3 straight from the
packed inputs, each in K slices of `block_k` columns (the gate and the cumsum are per key channel), and
finishes block b's rows before the next, so every dot computes only needed blocks:
- gate, beta, norms (a first pass over the slices for the row norms); G_b = P_b + cumsum(g_b) with P_b = G at
  the last row of block b-1 (0 for b = 0; the carry, per slice); e^G Q and e^G K stored;
- row operands q e^(G - P_b), k e^(G - P_b) (<= 1); column operands for every block j <= b: for j < b,
  kc_j e^(P_b - P_(j+1)) where kc_j = k_j e^(P_(j+1) - G_j) was kept from block j (both factors <= 1: no
  overflow; their product is v2's single factor e^(P_b - G_s) up to rounding: kc_j is kept in the stored
  dtype by default, `keep`); for j = b, k_b e^(P_b - G_b) (<= e^(16 |lb|) <= e^80: bounded gate). Aqk_bj and
  L_bj as [16, block_k] x [block_k, 16] dots summed over the slices (stored-dtype operands as v2, fp32
  accumulation); Aqk blocks stored (zeros above the diagonal);
- the inverse by block forward substitution in fp32: A_bb = (I + L_bb)^-1 by the exact nilpotent product
  (I - L)(I + L^2)(I + L^4)(I + L^8) (6 dots; L_bb^16 = 0), A_bj = -A_bb sum_{j<=m<b} L_bm A_mj (no power
  series over 64 rows: that one cancels catastrophically with correlated keys, see `kda_intra`); row block b
  of A diag(beta) stored (rounded once, as v2 rounds it).
After block 3: e^(G_C - G) K of every block as kc_b e^(G_C - P_(b+1)) (both factors <= 1), and e^(G_C).
Per program: 20 x (K / block_k) [16, block_k] x [block_k, 16] dots (L, Aqk) and 40 [16, 16] x [16, 16] fp32
dots (inverse: 24 diagonal, 16 off-diagonal; ~1/13 of the masked 64x64 forms' FLOPs, IEEE FMAs by default).
Traffic at B1 T32768 H32 D128 bf16: reads q, k, z, beta (0.8 GB), writes 3 [C, K] and 2 [C, C] stored tiles
(1.1 GB).
Registers (offline ptxas for sm_90a, docs/results/kda_intra2_ptxas_sm90a_2026-11-30g.json): still 255 a
thread with small spills at 8 warps (the unrolled straight-line body; 16-row dots replicate their operands
across warps) -- not yet timed on a GPU: benchmarks/kda.py --stage1 pallas2[_knobs].

Exponent safety: bounded gate only (lower-bound form with 16 |lb| <= 80, as `kda_chunk`'s `bounded`); an
unbounded gate routes to the XLA stage in `kda_chunk` and raises here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kda_common import CHUNK, HIGHEST, MAX_DIAG_EXPONENT, NSUB, SUB, dot, full_block, identity
from pallas_kernels.kda_intra import _check, _gate_lower_bound, reference_chunk_terms

INVERSE_PRECISIONS = ("ieee", "tf32x3")  # the 16x16 inverse dots: fp32 FMAs, or three tf32 tensor passes
KEEP_DTYPES = ("stored", "f32")  # the factored key blocks kept across row blocks (see kda_intra_lk)
_L2_EPS = 1e-6  # as kda_chunk (the L2 norm's epsilon)
_DOUBLINGS = 3  # (I + D)^-1 = (I - D)(I + D^2)(I + D^4)(I + D^8) for D strictly lower 16x16


def _lk_kernel(start_ref, len_ref, q_ref, k_ref, z_ref, b_ref, alog_ref, bias_ref,
               ab_ref, kw_ref, qg_ref, kg_ref, aqk_ref, gc_ref, *, lower_bound, beta_sigmoid, qk_l2norm, scale,
               inverse_precision, keep_dtype, block_k):
    # start_ref, len_ref: [NC] int32 chunk table (first packed token, token count; 0 = unused chunk)
    # q_ref, k_ref, z_ref: [T(+C), H, K] packed (any float dtype); b_ref: [T(+C), H] beta logits
    # alog_ref: [H] fp32; bias_ref: [H, K] fp32
    # ab_ref, aqk_ref: [C, C] (stored dtype), blocks of [H, NC, C, C]: A diag(beta) and Aqk
    # kw_ref, qg_ref, kg_ref: [C, K] (stored dtype), blocks of [H, NC, C, K]: e^G K, e^G Q, e^(G_C - G) K
    # gc_ref: [K] fp32, block of [H, NC, K]: e^(G_C)
    f32 = jnp.float32
    stored = ab_ref.dtype
    prec = HIGHEST if stored == f32 else None  # bf16: tensor cores, fp32 accumulation
    inv_prec = {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3, "ieee": HIGHEST}[inverse_precision]
    mm = lambda a, b: dot(a, b, precision=inv_prec)
    c, h = pl.program_id(0), pl.program_id(1)
    start, count = start_ref[c], len_ref[c]
    r16 = lax.broadcasted_iota(jnp.int32, (SUB,), 0)
    r2 = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    c2 = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    eye = identity(SUB)
    a_log = alog_ref[h]
    slices = [pl.ds(block_k * s, block_k) for s in range(q_ref.shape[-1] // block_k)]  # K slices

    # Per K slice s (the gate and the cumsum are per key channel, so slices are independent until the dots):
    # carry[s] = P_b, G at the last row of block b-1 [block_k]; carries[j][s] = P_j;
    # kcs[j][s] = k_j e^(P_(j+1) - G_j) [SUB, block_k] (keep dtype)
    carry = [jnp.zeros((block_k,), f32) for _ in slices]
    carries, kcs, betas = [carry], [], []
    lower, inv = {}, {}  # L_bj (beta applied) and A_bj [SUB, SUB] fp32
    for b in range(NSUB):
        valid = SUB * b + r16 < count  # [SUB]
        rows = pl.ds(SUB * b, SUB)

        def load(ref, sl):  # [SUB, block_k]: K slice sl of block b's rows, head h; zeros past the chunk's length
            return plt.load(ref.at[pl.ds(start + SUB * b, SUB), h, sl],
                            mask=jnp.broadcast_to(valid[:, None], (SUB, block_k)), other=0).astype(f32)

        beta = plt.load(b_ref.at[pl.ds(start + SUB * b, SUB), h], mask=valid, other=0).astype(f32)
        beta = jnp.where(valid, jax.nn.sigmoid(beta) if beta_sigmoid else beta, 0.0)  # [SUB]
        q_scale, k_scale = jnp.full((SUB,), 1.0, f32), jnp.full((SUB,), 1.0, f32)
        if qk_l2norm:  # row norms over all of K first (a second read of the slices, from the cache)
            q_sq, k_sq = jnp.zeros((SUB,), f32), jnp.zeros((SUB,), f32)
            for sl in slices:
                q_sq = q_sq + jnp.sum(jnp.square(load(q_ref, sl)), axis=1)
                k_sq = k_sq + jnp.sum(jnp.square(load(k_ref, sl)), axis=1)
            q_scale, k_scale = lax.rsqrt(q_sq + _L2_EPS) * scale, lax.rsqrt(k_sq + _L2_EPS)
        lkk = [jnp.zeros((SUB, SUB), f32) for _ in range(b + 1)]  # L_bj before beta, j <= b
        akk = [jnp.zeros((SUB, SUB), f32) for _ in range(b + 1)]  # Aqk_bj
        new_carry, kc_b = [], []
        for s, sl in enumerate(slices):
            q, k = load(q_ref, sl) * q_scale[:, None], load(k_ref, sl) * k_scale[:, None]
            g = _gate_lower_bound(load(z_ref, sl), a_log, bias_ref[h, sl][None, :], lower_bound)
            g = jnp.where(valid[:, None], g, 0.0)  # (lb, 0]; 0 on padding rows
            cum = carry[s][None, :] + jnp.cumsum(g, axis=0)  # G [SUB, block_k], non-increasing along rows
            e_cum = jnp.exp(cum)
            qg_ref[rows, sl] = (q * e_cum).astype(stored)
            kw_ref[rows, sl] = (k * e_cum).astype(stored)
            nxt = jnp.sum(jnp.where((r16 == SUB - 1)[:, None], cum, 0.0), axis=0)  # P_(b+1) (one term: exact)
            row_f = jnp.exp(cum - carry[s][None, :])  # e^(G_r - P_b) <= 1
            qr, kr = (q * row_f).astype(stored), (k * row_f).astype(stored)
            for j in range(b + 1):
                if j < b:  # e^(P_b - G_s) = e^(P_b - P_(j+1)) e^(P_(j+1) - G_s), both <= 1
                    col = kcs[j][s].astype(f32) * jnp.exp(carry[s] - carries[j + 1][s])[None, :]
                else:  # inside the block: <= e^(16 |lb|) <= e^80 (bounded gate)
                    col = k * jnp.exp(jnp.minimum(carry[s][None, :] - cum, MAX_DIAG_EXPONENT))
                col = col.astype(stored)
                lkk[j] = lkk[j] + dot(kr, col, tb=True, precision=prec)
                akk[j] = akk[j] + dot(qr, col, tb=True, precision=prec)
            kc_b.append((k * jnp.exp(nxt[None, :] - cum)).astype(keep_dtype))  # <= 1
            new_carry.append(nxt)
        carry = new_carry
        carries.append(carry)
        kcs.append(kc_b)
        betas.append(beta)
        for j in range(NSUB):
            if j <= b:
                lower[b, j] = beta[:, None] * (jnp.where(r2 > c2, lkk[j], 0.0) if j == b else lkk[j])
            aqk_ref[rows, pl.ds(SUB * j, SUB)] = (
                jnp.where(r2 >= c2, akk[j], 0.0) if j == b else akk[j] if j < b else jnp.zeros((SUB, SUB), f32)
            ).astype(stored)

        # A_bb = (I + L_bb)^-1 exactly (L_bb^16 = 0), then A_bj = -A_bb sum_{j<=m<b} L_bm A_mj
        power = lower[b, b]
        a_bb = eye - power
        for _ in range(_DOUBLINGS):
            power = mm(power, power)
            a_bb = a_bb + mm(a_bb, power)
        inv[b, b] = a_bb
        for j in range(b - 1, -1, -1):
            acc = mm(lower[b, j], inv[j, j])
            for m in range(j + 1, b):
                acc = acc + mm(lower[b, m], inv[m, j])
            inv[b, j] = -mm(a_bb, acc)
        for j in range(NSUB):  # (A diag(beta)) row block b, rounded once as v2 rounds it; zeros above
            ab = inv[b, j] * betas[j][None, :] if j <= b else jnp.zeros((SUB, SUB), f32)
            ab_ref[rows, pl.ds(SUB * j, SUB)] = ab.astype(stored)
    for b in range(NSUB):  # e^(G_C - G_r) = e^(G_C - P_(b+1)) e^(P_(b+1) - G_r), both <= 1
        for s, sl in enumerate(slices):
            kg_ref[pl.ds(SUB * b, SUB), sl] = (
                kcs[b][s].astype(f32) * jnp.exp(carry[s] - carries[b + 1][s])[None, :]).astype(stored)
            if b == 0:
                gc_ref[sl] = jnp.exp(carry[s])


def _lk_call(tok_start, length, q, k, z, beta, a_log, dt_bias, *, lower_bound, beta_sigmoid, qk_l2norm, scale,
             stored, num_warps, num_stages, inverse_precision, keep_dtype, block_k, interpret):
    """pallas_call wrapper: grid = chunks x heads, whole-array blocks for the packed inputs (the kernel loads
    its chunk's rows at the table's dynamic offset), one chunk-layout block per output."""
    t, h, dk = q.shape
    num_chunks = tok_start.shape[0]
    if interpret:  # interpret mode clamps an out-of-range dynamic slice instead of masking it: pad one chunk
        pad = lambda x: jnp.pad(x, ((0, CHUNK),) + ((0, 0),) * (x.ndim - 1))
        q, k, z, beta = map(pad, (q, k, z, beta))
        inverse_precision = "ieee"  # the CPU has no tf32x3 algorithm; IEEE fp32 is its exact counterpart
    tile = lambda d: pl.BlockSpec((None, None, CHUNK, d), lambda cc, hh: (hh, cc, 0, 0))
    out = lambda d: jax.ShapeDtypeStruct((h, num_chunks, CHUNK, d), stored)
    params = {} if interpret else dict(
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    return pl.pallas_call(
        functools.partial(_lk_kernel, lower_bound=lower_bound, beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm,
                          scale=scale, inverse_precision=inverse_precision, keep_dtype=keep_dtype,
                          block_k=block_k),
        grid=(num_chunks, h),
        in_specs=[full_block((num_chunks,)), full_block((num_chunks,)), full_block(q.shape), full_block(k.shape),
                  full_block(z.shape), full_block(beta.shape), full_block((h,)), full_block((h, dk))],
        out_specs=[tile(CHUNK), tile(dk), tile(dk), tile(dk), tile(CHUNK),
                   pl.BlockSpec((None, None, dk), lambda cc, hh: (hh, cc, 0))],
        out_shape=[out(CHUNK), out(dk), out(dk), out(dk), out(CHUNK),
                   jax.ShapeDtypeStruct((h, num_chunks, dk), jnp.float32)],
        interpret=interpret, name="kda_intra_lk", **params,
    )(tok_start, length, q, k, z, beta, a_log, dt_bias)


def kda_intra_lk(token_start, length, q, k, z, beta, a_log, dt_bias, *, gate="lower_bound", lower_bound=-5.0,
                 beta_sigmoid=True, qk_l2norm=True, scale=None, stored=jnp.bfloat16, num_warps=4, num_stages=1,
                 inverse_precision="ieee", keep="stored", block_k=128, interpret=False):
    """KDA prefill stage 1 without W / U (`kda_intra_wu` does those), every chunk and head: one Pallas kernel,
    grid = chunks x heads, each chunk in 16-row blocks.

    Args:
      token_start, length: [NC] int32 chunk table (`kda_chunk.chunk_table`): each chunk's first packed token
        and its token count (0 = unused chunk: its outputs are zeros, A diag(beta) too, and e^(G_C) = 1).
      q, k: [T, H, K] packed raw q, k (normalised here if qk_l2norm, else already normalised, q scaled);
      z: [T, H, K] the gate's raw input; beta: [T, H] logits (beta_sigmoid) or beta itself.
      a_log: [H] fp32 and dt_bias: [H, K] fp32, the gate's parameters.
      gate: "lower_bound" only, with -5 <= lower_bound < 0 (bounded: see the module docstring).
      scale: q's scale after the L2 norm (default K^-1/2); stored: the outputs' dtype (bf16 or fp32); bf16
        also makes the L / Aqk dot operands bf16 (fp32 accumulation), fp32 makes every dot IEEE fp32.
      num_warps, num_stages: Triton launch settings; inverse_precision: the 16x16 inverse dots, "ieee" (fp32
        FMAs) or "tf32x3" (tensor cores, ~fp32 accuracy); interpret: Pallas interpret mode (CPU tests; IEEE).
      keep: "stored" or "f32", the dtype of the factored key blocks kc_j kept across row blocks (registers;
        "stored" rounds the earlier blocks' L / Aqk column operands twice in bf16 instead of once).

    Returns: a_beta [H, NC, C, C] = A diag(beta) (zeros above the diagonal blocks), e^G K, e^G Q,
    e^(G_C - G) K [H, NC, C, K], Aqk [H, NC, C, C] in the stored dtype, and e^(G_C) [H, NC, K] fp32.
    """
    _check(token_start, length, q, k, z, z, beta, a_log, dt_bias, gate, lower_bound, stored, "ieee")
    if inverse_precision not in INVERSE_PRECISIONS:
        raise ValueError(f"inverse_precision must be one of {INVERSE_PRECISIONS}; got {inverse_precision!r}")
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16 (K slices: min(block_k, K)); got {block_k}")
    if keep not in KEEP_DTYPES:
        raise ValueError(f"keep must be one of {KEEP_DTYPES}; got {keep!r}")
    scale = q.shape[2] ** -0.5 if scale is None else scale
    return tuple(_lk_call(token_start, length, q, k, z, beta, a_log.astype(jnp.float32), dt_bias.astype(jnp.float32),
                          lower_bound=lower_bound, beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm, scale=scale,
                          stored=stored, num_warps=num_warps, num_stages=num_stages,
                          inverse_precision=inverse_precision, keep_dtype=stored if keep == "stored" else jnp.float32,
                          block_k=min(block_k, q.shape[2]), interpret=interpret))


def kda_intra_lk_reference(token_start, length, q, k, z, beta, a_log, dt_bias, *, gate="lower_bound",
                           lower_bound=-5.0, beta_sigmoid=True, qk_l2norm=True, scale=None, stored=jnp.bfloat16):
    """Plain-jnp twin of `kda_intra_lk` (same arguments and outputs), in fp32 at HIGHEST precision and rounded
    to the stored dtype once at the end: gather to chunks, the gate, pairwise decays e^(G_i - G_j) of masked
    (non-positive) differences and a triangular solve instead of the block inverse."""
    _check(token_start, length, q, k, z, z, beta, a_log, dt_bias, gate, lower_bound, stored, "ieee")
    scale = q.shape[2] ** -0.5 if scale is None else scale
    t = reference_chunk_terms(token_start, length, q, k, z, beta, a_log, dt_bias, lower_bound=lower_bound,
                              beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm, scale=scale)
    outs = (t["a_beta"], t["kc"] * t["e_cum"], t["qc"] * t["e_cum"], t["kg"], t["aqk"])
    return tuple(x.astype(stored) for x in outs) + (t["gate_last"],)
