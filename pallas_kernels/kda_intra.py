"""KDA chunked prefill, stage 1 as ONE Pallas kernel (`kda_chunk(..., stage1="pallas")`): everything the
state pass needs from one chunk of one head, read straight from the packed inputs.

Per head and chunk of C = 64 tokens (k3-model.md §3.1; the math of `kda_chunk._intra_stage_v2`, whose six
outputs and layouts this kernel reproduces so the state passes consume them unchanged):

    g = lb sigmoid(e^a_log (z + dt_bias)) (K3's bounded gate)   beta = sigmoid(b)   q, k L2-normalised, q scaled
    G = cumsum(g) in the chunk      L[i,j] = beta_i sum_d k_i e^(G_i - G_j) k_j  (j < i)
    A = (I + L)^-1   W = A diag(beta) (e^G K)   U = A diag(beta) V   Aqk[i,j] = sum_d q_i e^(G_i - G_j) k_j (j <= i)
    outputs: W, U, e^G Q, e^(G_C - G) K, Aqk (stored dtype), e^(G_C) (fp32)

Layout: grid = chunks x heads; each program loads its chunk's rows of the packed q, k, v, z [T, H, D] and
b [T, H] through the chunk table (masked past the chunk's length: no gathered chunk-layout copy), and writes
its [C, D] / [C, C] / [D] blocks of the chunk-layout outputs. Per program (K = V = D):
- gate, beta, norms, scale and the cumsum (Triton associative scan, fp32 adds) on [C, K] tiles;
- L and Aqk as 8 full-size dots [C, K] x [K, C] (stored dtype, fp32 accumulation): for each 16-row block b
  with decay reference P_b (G at the block's previous row; 0 for b = 0), rows of block b scaled by
  e^(G_r - P_b) (<= 1; other rows zero) against the columns up to block b's end scaled by e^(P_b - G_s)
  (<= 1 before the block, <= e^(16 |lb|) <= e^80 inside it; later columns zero, their exponent masked to 0
  BEFORE the exp). 4x the minimal FLOPs, but whole tiles: no 16x16 pieces, no layout shuffles;
- the inverse (fp32, 64x64 dots at tf32x3: ~fp32 accuracy on the tensor cores; IEEE in interpret mode) as
  `_inverse_by_halves` does it, with masks instead of slices: the 4 diagonal 16x16 blocks at once by the
  exact nilpotent product (I - D)(I + D^2)(I + D^4)(I + D^8) (6 dots), then the 16x16 pairs and the 32x32
  quadrant by block forward substitution A <- A - A M A (2 dots each). The one-shot 64x64 product
  (I - L)(I + L^2)...(I + L^32) has the same dot count but is unstable: with correlated keys (k_i . k_j ~ 0.9,
  weak decay) the powers of L grow like binomials (~1e17) and their alternating sum cancels to O(1), which
  gave relative errors of ~1e2 in IEEE fp32 (numpy study, and tests/kernels/test_kda_intra.py's weak-decay
  case) against ~3e-6 for this form, tf32x3 emulated or IEEE;
- W, U as 2 dots [C, C] x [C, D].
Totals per program: 20 dots (8 [64,128]x[128,64] in the stored dtype, 10 [64,64]x[64,64] fp32 at tf32x3,
2 [64,64]x[64,128] in the stored dtype) and 8 [C, K] exps (the gate's sigmoid, one row factor
e^(G - P_row), 4 column factors, e^G, e^(G_C - G)); the inverse's tf32x3 is ~60% of the tensor work
(three passes), hence the opt-in one-pass "tf32" (bf16 outputs). Elementwise outputs are stored early and
v loaded first (its latency hidden; see the kernel's comment).
Traffic at B1 T32768 H32 D128 bf16: reads q, k, v, z (1 GB), writes W, U, e^G Q, e^(G_C - G) K, Aqk
(1.3 GB): ~0.6 ms at the H200's copy bandwidth.

Exponent safety: bounded gate only (lower-bound form with 16 |lb| <= 80, as `kda_chunk`'s `bounded`); an
unbounded gate (softplus, or a precomputed g) needs the pairwise diagonal blocks, which as [16, 16, K]
tensors do not fit this kernel's whole-tile design: `kda_chunk` routes those to the XLA stage
(`_intra_stage_v2`) and this function raises.

Measured on the H200 (2026-11-30, benchmarks/kda.py --stage1 v2,pallas,pallas_w8; docs/results/
kda_intra_h200_2026-11-30f.json), B1 T32768 H32 D128 bf16: 8.26 ms at 4 warps, 10.63 ms at 8, against 5.09 ms for
the XLA `_intra_stage_v2` it would replace -- slower. The benchmark's whole prefill with it landed within 4.8e-4 of
the default stage's output. With inverse_precision="blocks" at 8 warps (eighth session, below) it takes 2.93 ms and is
the model's GPU stage (k3jax.kda.KDA_STAGE1; whole prefill 4.57 vs 6.63 ms with v2; GPU test vs v2 passed,
tests/gpu/test_kda_gpu.py -k pallas2_and_block_inverse; docs/results/kda_stage1_h200_2026-11-30g.json). Why it is slow
(docs/results/kda_intra_ptxas_sm90a_2026-11-30f.json, `ptxas -v` of its Triton PTX for sm_90a): 255 registers and
~1.5 KB of spill stores per thread at 4 warps (every [64, 128] fp32 tile is 64 registers per thread, and q, k, g, G
and the factors are live together), 2 programs per SM. The H200 ablation (docs/results, 2026-11-30 call 1) then
put ~3 ms of the 8.24 ms in the inverse (skip-inverse: 5.09 ms at 4 warps, 2.29 ms at 8), hence
inverse_precision="blocks" (`_block_inverse`: the tile split into 16x16 blocks with Triton's split, the
diagonal blocks by the nilpotent product and the others by block forward substitution in IEEE fp32 FMAs,
joined back; ~1/13 of the FLOPs; 112 B of spills at 8 warps offline, docs/results/
kda_intra2_ptxas_sm90a_2026-11-30g.json); timed since: 2.93 ms, above.
`kda_intra_lk` + `kda_intra_wu` (stage1="pallas2") split the stage in two kernels by 16-row blocks instead.

Tried and removed (ninth session, 0c3d98b / 814f09c): walking the head dims in K / k_split slices (k_split 2 / 4 / 8,
unrolled or as a loop) to cut register pressure. Offline it worked (8 warps, k_split 8 as two loops: 141 registers,
no spills, against 255 and 112 B; docs/results/kda_intra3_ptxas_sm90a_2026-12-01.json), but on the H200 stage 1 took
8.96 / 7.27 ms (k_split 8 / 4, 8 warps) and 5.40 ms (k_split 8, 4 warps) against 2.90 ms for this body
(docs/results/kda_intra_ksplit_h200_2026-12-01.json): the slice loop serialises what the unrolled body overlaps and
doubles the exps. Fewer registers are not this kernel's lever.

Profiled (tenth session, Nsight Compute on the H200, B1 T32768 H32, 8 warps, blocks; docs/results/
kda_intra_ncu_h200_2026-12-01.json): 2.82 ms, 255 registers, one 8-warp program per SM (12.5 % occupancy), 0.33
instructions issued per scheduler cycle; the ~6,650 SASS instructions run once per warp, straight line, and the
stall samples spread over the whole body (block inverse ~28 %, L / Aqk with their column factors ~24 %, exps and the
row reductions ~18 %, the cumsum ~11 %, loads and gate ~10 %, W / U and the stores ~9 %): latency with two warps per
scheduler, no single hot spot. fla's stage 1 in the same profile: l2norm x2 255 us, gate cumsum 237 us, intra
sub-chunk 608 us, inter + solve 645 us, W / U 559 us (2.35 ms). Variants timed the same day on the H200 (one
program compiled per variant; docs/results/kda_intra_variants_h200_2026-12-01.json), stage alone, against 2.80-2.84
ms: the block inverse's 16x16 dots on the tensor cores, tf32x3 6.26 ms / tf32 5.12 ms; G and the block references
as 0/1-matrix tf32x3 dots instead of the scan and row reductions, 24.1 ms (both spill heavily); 4 warps 6.29 ms;
v loaded first 2.72 ms (kept, above); then, against that 2.72: the decay exps as exp2 with g kept in log2 units and
the gate's sigmoid as rsqrt(1 + 2^-x)^2 (Pallas lowers exp to libdevice's expf and 1/x to a rounded division) 2.88
ms, the cumsum and row picks on g^T 2.73 ms. All but v-first were removed again.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kda_common import CHUNK, HIGHEST, MAX_DIAG_EXPONENT, NSUB, SUB, dot, full_block, identity
from pallas_kernels.kda_common import is_pow2_at_least_16

GATES = ("lower_bound",)  # bounded gates only; see the module docstring
INVERSE_PRECISIONS = ("tf32x3", "ieee", "tf32", "blocks")  # "blocks": 16x16-block substitution (see _block_inverse)
_L2_EPS = 1e-6  # as kda_chunk (the L2 norm's epsilon)
_DOUBLINGS = 3  # (I + D)^-1 = (I - D)(I + D^2)(I + D^4)(I + D^8) for D strictly lower inside 16x16 blocks
# Benchmark-only ablations (`kda_intra(_skip=...)`, benchmarks/kda.py stage1 "pallas_..._skip-<a>+<b>"): each
# replaces one part of the kernel by a cheap stand-in that keeps the outputs' shapes and the rest of the
# dataflow live (so Triton cannot drop the other parts), so a part's cost reads as the time difference.
# The outputs are then WRONG; kda_chunk never passes _skip.
#   load:    q, k, v, z, beta not read (per-tensor iota patterns instead; the chunk table is still read)
#   exp:     every e^x of the decay factors (not the gate's sigmoid) computed as 1 + x (an FMA, no MUFU)
#   scan:    the chunk cumsum G = cumsum(g) replaced by g itself (no cross-row / cross-warp scan)
#   lk:      the 4 column factors and 8 L / Aqk dots replaced by rank-1 outer products of row sums of qr, kr
#   inverse: A = I - L (one elementwise op) instead of the 10 inverse dots (L stays live)
#   wu:      W / U dots replaced by e^G K and V scaled by the row sums of A diag(beta)
SKIPPABLE = ("load", "exp", "scan", "lk", "inverse", "wu")


def _gate_lower_bound(z, a_log, dt_bias, lower_bound):
    """K3's bounded log decay lb * sigmoid(e^a_log (z + dt_bias)) in (lb, 0) (kda_chunk._gate's form)."""
    return lower_bound * jax.nn.sigmoid(jnp.exp(a_log) * (z + dt_bias))


def _intra_kernel(start_ref, len_ref, q_ref, k_ref, v_ref, z_ref, b_ref, alog_ref, bias_ref,
                  w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gc_ref, *, lower_bound, beta_sigmoid, qk_l2norm, scale,
                  inverse_precision, skip=frozenset()):
    # start_ref, len_ref: [NC] int32 chunk table (first packed token, token count; 0 = unused chunk)
    # q_ref, k_ref, z_ref: [T(+C), H, K] packed (any float dtype); v_ref: [T(+C), H, V]; b_ref: [T(+C), H] logits
    # alog_ref: [H] fp32; bias_ref: [H, K] fp32
    # w_ref, qg_ref, kg_ref: [C, K] and u_ref: [C, V] (stored dtype), blocks of [H, NC, C, D]
    # aqk_ref: [C, C] (stored dtype), block of [H, NC, C, C]; gc_ref: [K] fp32, block of [H, NC, K]
    f32 = jnp.float32
    stored = w_ref.dtype
    prec = HIGHEST if stored == f32 else None  # bf16: tensor cores, fp32 accumulation
    c, h = pl.program_id(0), pl.program_id(1)
    start, count = start_ref[c], len_ref[c]
    rows = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    valid = rows < count  # [C]

    def load(ref):  # [C, D] rows of head h, zeros past the chunk's length
        d = ref.shape[-1]
        return plt.load(ref.at[pl.ds(start, CHUNK), h, :], mask=jnp.broadcast_to(valid[:, None], (CHUNK, d)),
                        other=0)

    def load_beta():
        return plt.load(b_ref.at[pl.ds(start, CHUNK), h], mask=valid, other=0)

    if "load" in skip:  # ablation: distinct per-tensor patterns (equal ones would let Triton merge the tiles)
        def load(ref):  # noqa: F811
            salt = next(i for i, r in enumerate((q_ref, k_ref, v_ref, z_ref)) if r is ref) + 2
            cols = lax.broadcasted_iota(jnp.int32, (CHUNK, ref.shape[-1]), 1)
            x = ((rows[:, None] * salt + cols * (salt + 1) + start + h) % 17).astype(f32) * (1 / 17) - 0.5
            return jnp.where(valid[:, None], x, 0.0).astype(ref.dtype)

        def load_beta():
            return jnp.where(valid, ((rows * 3 + h) % 7).astype(f32) - 3.0, 0.0)

    exp = (lambda x: 1.0 + x) if "exp" in skip else jnp.exp  # the decay factors' exps (ablation: an FMA)

    q, k, z = load(q_ref).astype(f32), load(k_ref).astype(f32), load(z_ref).astype(f32)  # [C, K]
    # v is needed only by U's dot at the end, but its load is issued here so that its latency hides behind the
    # whole chunk's work (H200: 2.72 vs 2.82-2.84 ms for this stage at B1 T32768 H32; issued before the inverse
    # instead: 2.86 ms). It stays in the stored dtype: 16 registers a thread at 8 warps.
    v = load(v_ref)  # [C, V]
    beta = load_beta().astype(f32)  # [C]
    beta = jnp.where(valid, jax.nn.sigmoid(beta) if beta_sigmoid else beta, 0.0)
    g = _gate_lower_bound(z, alog_ref[h], bias_ref[h, :][None, :], lower_bound)
    g = jnp.where(valid[:, None], g, 0.0)  # [C, K] in (lb, 0]; 0 on padding rows
    if qk_l2norm:
        q = q * (lax.rsqrt(jnp.sum(q * q, axis=1) + _L2_EPS) * scale)[:, None]
        k = k * lax.rsqrt(jnp.sum(k * k, axis=1) + _L2_EPS)[:, None]
    cum = g if "scan" in skip else jnp.cumsum(g, axis=0)  # G [C, K], non-increasing along C
    # Order for register pressure (whole [C, K] fp32 tiles are 64 registers a thread at 4 warps): the
    # elementwise outputs are stored first, q dies into its factored bf16 copy.
    e_cum = exp(cum)
    qg_ref[...] = (q * e_cum).astype(stored)
    kw = (k * e_cum).astype(stored)  # e^G K, W's right operand
    g_last = jnp.sum(jnp.where((rows == CHUNK - 1)[:, None], cum, 0.0), axis=0)  # G_C [K] (exact: one term)
    kg_ref[...] = (k * exp(g_last[None, :] - cum)).astype(stored)
    gc_ref[...] = exp(g_last)

    block = rows // SUB  # [C] 16-row block of each row
    # P_b = G at row 16 b - 1 (0 for b = 0), read from G itself (a sum of one non-zero term: exact), so that
    # e^(G_r - P_b) <= 1 holds exactly for the rows of block b.
    refs = [jnp.zeros((cum.shape[1],), f32)] + [
        jnp.sum(jnp.where((rows == SUB * b - 1)[:, None], cum, 0.0), axis=0) for b in range(1, NSUB)]  # [K] each
    ref_row = refs[0][None, :]
    for b in range(1, NSUB):
        ref_row = jnp.where((block == b)[:, None], refs[b][None, :], ref_row)  # [C, K]: P of each row's block
    row_f = exp(cum - ref_row)  # [C, K], <= 1
    qr, kr = (q * row_f).astype(stored), (k * row_f).astype(stored)  # masking after the rounding is exact
    lkk = jnp.zeros((CHUNK, CHUNK), f32)
    aqk = jnp.zeros((CHUNK, CHUNK), f32)
    if "lk" in skip:  # ablation: rank-1 stand-ins keep qr, kr live without the column factors and dots
        sum_q, sum_k = jnp.sum(qr.astype(f32), axis=1), jnp.sum(kr.astype(f32), axis=1)  # [C]
        lkk, aqk = sum_k[:, None] * sum_k[None, :], sum_q[:, None] * sum_k[None, :]
    for b in range(0 if "lk" in skip else NSUB):
        in_b = (block == b)[:, None]
        upto_b = (rows < SUB * (b + 1))[:, None]  # columns that row block b's lower triangle reaches
        # e^(P_b - G_s): <= 1 before block b, <= e^80 inside it (bounded gate); later columns masked before the exp
        col = jnp.where(upto_b, k * exp(jnp.where(upto_b, refs[b][None, :] - cum, 0.0)), 0.0).astype(stored)
        lkk = lkk + dot(jnp.where(in_b, kr, 0), col, tb=True, precision=prec)
        aqk = aqk + dot(jnp.where(in_b, qr, 0), col, tb=True, precision=prec)
    r2 = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    c2 = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
    lkk = jnp.where(r2 > c2, beta[:, None] * lkk, 0.0)  # strictly lower L (beta applied)
    aqk_ref[...] = jnp.where(r2 >= c2, aqk, 0.0).astype(aqk_ref.dtype)

    inv_prec = {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3, "ieee": HIGHEST, "blocks": HIGHEST,
                "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32}[inverse_precision]
    mm = lambda a, b_: dot(a, b_, precision=inv_prec)
    same16 = r2 // SUB == c2 // SUB
    same32 = r2 // (2 * SUB) == c2 // (2 * SUB)
    if "inverse" in skip:  # ablation: first order, no dots (L stays live)
        inv = identity(CHUNK) - lkk
    elif inverse_precision == "blocks":
        inv = _block_inverse(lkk, mm)
    else:
        diag = jnp.where(same16, lkk, 0.0)  # the 4 diagonal 16x16 blocks of L
        power = diag
        inv = identity(CHUNK) - diag
        for _ in range(_DOUBLINGS):  # inv = (I - D)(I + D^2)(I + D^4)(I + D^8) = (I + D)^-1 exactly (D^16 = 0)
            power = mm(power, power)
            inv = inv + mm(inv, power)
        # by halves, each an exact block forward substitution [[A, 0], [M, B]]^-1 = [[A^-1, 0], [-B^-1 M A^-1,
        # B^-1]] with the block-diagonal inverse so far (no power series: its cancellation is what made the
        # 64x64 form fail)
        inv = inv - mm(inv, mm(jnp.where(same32 & ~same16, lkk, 0.0), inv))  # 16x16 pairs -> 32x32 diagonal
        inv = inv - mm(inv, mm(jnp.where(same32, 0.0, lkk), inv))  # lower-left 32x32 quadrant -> 64x64 inverse
    a_beta = (inv * beta[None, :]).astype(stored)  # A diag(beta)
    if "wu" in skip:  # ablation: row-scaled stand-ins keep A diag(beta), e^G K and V live without the dots
        row_sum = jnp.sum(a_beta.astype(f32), axis=1)[:, None]  # [C, 1]
        w_ref[...] = (row_sum * kw.astype(f32)).astype(stored)
        u_ref[...] = (row_sum * v.astype(f32)).astype(stored)
        return
    w_ref[...] = dot(a_beta, kw, precision=prec).astype(stored)
    u_ref[...] = dot(a_beta, v.astype(stored), precision=prec).astype(stored)


def _concat2(x, y, axis):
    """jnp.concatenate([x, y], axis) for equal shapes, from the ops Pallas lowers to Triton (its concatenate
    takes only [..., 1] operands): stack on a new last axis, move it before `axis`, merge the two."""
    st = jnp.moveaxis(jnp.stack([x, y], axis=-1), -1, axis)  # [..., 2, n, ...]
    return st.reshape(x.shape[:axis] + (2 * x.shape[axis],) + x.shape[axis + 1:])


def _block_inverse(lkk, mm):
    """(I + L)^-1 of strictly lower-triangular L [C, C] fp32 by 16x16 blocks (inverse_precision="blocks"): the
    tile split into blocks (Triton split: reshapes and transposes, no memory), A_ii = (I + L_ii)^-1 by the exact
    nilpotent product (I - L)(I + L^2)(I + L^4)(I + L^8) (6 dots each), A_ij = -A_ii sum_{j<=m<i} L_im A_mj
    (block forward substitution, 16 dots), joined back to [C, C]. 40 [16,16] x [16,16] dots (IEEE fp32 FMAs
    through `mm`): ~1/13 of the FLOPs of the masked 64x64 forms, whose tf32x3 dots cost ~3 ms of kda_intra's
    8.2 ms on the H200 (docs/results: skip-inverse ablation). Same algorithm as `kda_chunk._block_inverse`."""
    blocks = [jnp.split(r, NSUB, axis=1) for r in jnp.split(lkk, NSUB, axis=0)]  # blocks[i][j] [SUB, SUB]
    eye = identity(SUB)
    inv = {}
    for i in range(NSUB):
        power = blocks[i][i]
        a_ii = eye - power
        for _ in range(_DOUBLINGS):
            power = mm(power, power)
            a_ii = a_ii + mm(a_ii, power)
        inv[i, i] = a_ii
        for j in range(i - 1, -1, -1):
            acc = mm(blocks[i][j], inv[j, j])
            for m in range(j + 1, i):
                acc = acc + mm(blocks[i][m], inv[m, j])
            inv[i, j] = -mm(a_ii, acc)
    zero = jnp.zeros((SUB, SUB), jnp.float32)
    join = lambda parts, axis: _concat2(_concat2(parts[0], parts[1], axis), _concat2(parts[2], parts[3], axis), axis)
    return join([join([inv.get((i, j), zero) for j in range(NSUB)], 1) for i in range(NSUB)], 0)


def _intra_call(tok_start, length, q, k, v, z, beta, a_log, dt_bias, *, lower_bound, beta_sigmoid, qk_l2norm,
                scale, stored, num_warps, num_stages, inverse_precision, interpret, skip=frozenset()):
    """pallas_call wrapper: grid = chunks x heads, whole-array blocks for the packed inputs (the kernel loads
    its chunk's rows at the table's dynamic offset), one chunk-layout block per output."""
    t, h, dk = q.shape
    dv = v.shape[2]
    num_chunks = tok_start.shape[0]
    if interpret:  # interpret mode clamps an out-of-range dynamic slice instead of masking it: pad one chunk
        pad = lambda x: jnp.pad(x, ((0, CHUNK),) + ((0, 0),) * (x.ndim - 1))
        q, k, v, z, beta = map(pad, (q, k, v, z, beta))
        if inverse_precision != "blocks":  # the CPU has no tf32 / tf32x3 algorithm: IEEE fp32 is their counterpart
            inverse_precision = "ieee"
    tile = lambda d: pl.BlockSpec((None, None, CHUNK, d), lambda cc, hh: (hh, cc, 0, 0))
    out = lambda d: jax.ShapeDtypeStruct((h, num_chunks, CHUNK, d), stored)
    params = {} if interpret else dict(
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    return pl.pallas_call(
        functools.partial(_intra_kernel, lower_bound=lower_bound, beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm,
                          scale=scale, inverse_precision=inverse_precision, skip=skip),
        grid=(num_chunks, h),
        in_specs=[full_block((num_chunks,)), full_block((num_chunks,)), full_block(q.shape), full_block(k.shape),
                  full_block(v.shape), full_block(z.shape), full_block(beta.shape), full_block((h,)),
                  full_block((h, dk))],
        out_specs=[tile(dk), tile(dv), tile(dk), tile(dk), tile(CHUNK),
                   pl.BlockSpec((None, None, dk), lambda cc, hh: (hh, cc, 0))],
        out_shape=[out(dk), out(dv), out(dk), out(dk), out(CHUNK),
                   jax.ShapeDtypeStruct((h, num_chunks, dk), jnp.float32)],
        interpret=interpret, name="kda_intra", **params,
    )(tok_start, length, q, k, v, z, beta, a_log, dt_bias)


def _check(tok_start, length, q, k, v, z, beta, a_log, dt_bias, gate, lower_bound, stored, inverse_precision):
    if q.ndim != 3 or k.shape != q.shape or z.shape != q.shape:
        raise ValueError(f"q, k, z must be packed [T, H, K] alike; got {q.shape}, {k.shape}, {z.shape}")
    t, h, dk = q.shape
    if v.ndim != 3 or v.shape[:2] != (t, h):
        raise ValueError(f"v must be [T, H, V] with T, H = {(t, h)}; got {v.shape}")
    if beta.shape != (t, h):
        raise ValueError(f"beta must be [T, H] = {(t, h)}; got {beta.shape}")
    for name, d in (("K", dk), ("V", v.shape[2])):
        if not is_pow2_at_least_16(d):
            raise ValueError(f"head dim {name}={d} must be a power of two >= 16 (Triton block shapes)")
    if a_log.shape != (h,) or dt_bias.shape != (h, dk):
        raise ValueError(f"a_log must be [H] = [{h}] and dt_bias [H, K] = {(h, dk)}; got {a_log.shape}, "
                         f"{dt_bias.shape}")
    for name, x in (("token_start", tok_start), ("length", length)):
        if x.ndim != 1 or x.shape != tok_start.shape or x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 [NC] like token_start; got {x.dtype}{x.shape}")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES} (unbounded gates need the XLA stage); got {gate!r}")
    if not (lower_bound < 0 and -SUB * lower_bound <= MAX_DIAG_EXPONENT):
        raise ValueError(f"lower_bound must be in [-{MAX_DIAG_EXPONENT / SUB}, 0) (e^(16 |lb|) must stay finite); "
                         f"got {lower_bound}")
    if jnp.dtype(stored) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"stored must be float32 or bfloat16; got {stored}")
    if inverse_precision not in INVERSE_PRECISIONS:
        raise ValueError(f"inverse_precision must be one of {INVERSE_PRECISIONS}; got {inverse_precision!r}")


def kda_intra(token_start, length, q, k, v, z, beta, a_log, dt_bias, *, gate="lower_bound", lower_bound=-5.0,
              beta_sigmoid=True, qk_l2norm=True, scale=None, stored=None, num_warps=4, num_stages=1,
              inverse_precision="tf32x3", interpret=False, _skip=frozenset()):
    """KDA prefill stage 1 for every chunk and head (one Pallas kernel, grid = chunks x heads).

    Args:
      token_start, length: [NC] int32 chunk table (`kda_chunk.chunk_table`): each chunk's first packed token
        and its token count (0 = unused chunk: its outputs are zeros and e^(G_C) = 1).
      q, k: [T, H, K] packed raw q, k (normalised here if qk_l2norm, else already normalised, q scaled);
      v: [T, H, V]; z: [T, H, K] the gate's raw input; beta: [T, H] logits (beta_sigmoid) or beta itself.
      a_log: [H] fp32 and dt_bias: [H, K] fp32, the gate's parameters.
      gate: "lower_bound" only, with -5 <= lower_bound < 0 (bounded: see the module docstring).
      scale: q's scale after the L2 norm (default K^-1/2); stored: the outputs' dtype (default v's if bf16,
        else fp32); bf16 also makes the L / Aqk / W / U dot operands bf16 (fp32 accumulation), fp32 makes every
        dot IEEE fp32.
      num_warps, num_stages: Triton launch settings; inverse_precision: "tf32x3" (the 64x64 inverse's dots
        on the tensor cores, ~fp32 accuracy), "ieee" (fp32 FMAs) or "tf32" (one tensor-core pass, 2^-11
        relative operand rounding: a third of tf32x3's tensor work, for bf16 outputs only; untested for
        accuracy on the CPU, see tests/gpu/test_kda_gpu.py) or "blocks" (16x16-block substitution with IEEE
        fp32 dots, `_block_inverse`); interpret: Pallas interpret mode (CPU tests; always IEEE there, "blocks"
        keeps its block form).
      _skip: BENCHMARK-ONLY ablation (wrong outputs): parts of the kernel to replace by cheap stand-ins, a
        subset of SKIPPABLE (see its comment); timing with and without reads a part's cost by difference.

    Returns (exactly `kda_chunk._intra_stage_v2`'s outputs): w, qg, kg [H, NC, C, K], u [H, NC, C, V],
    aqk [H, NC, C, C] in the stored dtype, and e^(G_C) [H, NC, K] fp32.
    """
    stored = (jnp.bfloat16 if v.dtype == jnp.bfloat16 else jnp.float32) if stored is None else stored
    _check(token_start, length, q, k, v, z, beta, a_log, dt_bias, gate, lower_bound, stored, inverse_precision)
    if not set(_skip) <= set(SKIPPABLE):
        raise ValueError(f"_skip must be a subset of {SKIPPABLE}; got {sorted(_skip)}")
    scale = q.shape[2] ** -0.5 if scale is None else scale
    return tuple(_intra_call(token_start, length, q, k, v, z, beta, a_log.astype(jnp.float32),
                             dt_bias.astype(jnp.float32), lower_bound=lower_bound, beta_sigmoid=beta_sigmoid,
                             qk_l2norm=qk_l2norm, scale=scale, stored=stored, num_warps=num_warps,
                             num_stages=num_stages, inverse_precision=inverse_precision, interpret=interpret,
                             skip=frozenset(_skip)))


def kda_intra_reference(token_start, length, q, k, v, z, beta, a_log, dt_bias, *, gate="lower_bound",
                        lower_bound=-5.0, beta_sigmoid=True, qk_l2norm=True, scale=None, stored=None):
    """Plain-jnp twin of `kda_intra` (same arguments and outputs, computed in fp32 at HIGHEST precision and
    rounded to the stored dtype once at the end): gather to chunks, the gate, pairwise decays
    e^(G_i - G_j) of masked (non-positive) differences and a triangular solve instead of the inverse."""
    stored = (jnp.bfloat16 if v.dtype == jnp.bfloat16 else jnp.float32) if stored is None else stored
    _check(token_start, length, q, k, v, z, beta, a_log, dt_bias, gate, lower_bound, stored, "ieee")
    scale = q.shape[2] ** -0.5 if scale is None else scale
    t = reference_chunk_terms(token_start, length, q, k, z, beta, a_log, dt_bias, lower_bound=lower_bound,
                              beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm, scale=scale, values=v)
    ein = functools.partial(jnp.einsum, precision=HIGHEST)
    w = ein("hnij,hnjk->hnik", t["a_beta"], t["kc"] * t["e_cum"])
    u = ein("hnij,hnjv->hniv", t["a_beta"], t["vc"])
    return tuple(x.astype(stored) for x in (w, u, t["qc"] * t["e_cum"], t["kg"], t["aqk"])) + (t["gate_last"],)


def reference_chunk_terms(token_start, length, q, k, z, beta, a_log, dt_bias, *, lower_bound, beta_sigmoid, qk_l2norm,
                          scale, values=None):
    """The fp32 HIGHEST-precision chunk terms that `kda_intra_reference` and `kda_intra_lk_reference` share:
    the packed inputs gathered to [H, NC, C, ...] chunks (zeros past each chunk's length), the bounded gate and
    its cumsum G, beta, the L2 norms (q also scaled), A = (I + L)^-1 by a triangular solve (pairwise decays
    e^(G_i - G_j) of masked, non-positive differences) and Aqk. Returns a dict: qc, kc, vc (the gathered
    `values`, or None), a_beta = A diag(beta), e_cum = e^G, kg = e^(G_C - G) K, aqk, gate_last = e^(G_C)."""
    f32 = jnp.float32
    rows = jnp.arange(CHUNK, dtype=jnp.int32)
    valid = rows[None, :] < length[:, None]  # [NC, C]
    idx = jnp.where(valid, token_start[:, None] + rows[None, :], 0)

    def chunks(x):  # packed [T, H, ...] -> [H, NC, C, ...] fp32, zeros past each chunk's length
        y = jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), x[idx].astype(f32), 0.0)
        return jnp.moveaxis(y, 2, 0)

    qc, kc, zc, bc = map(chunks, (q, k, z, beta))
    gl = _gate_lower_bound(zc, a_log.astype(f32)[:, None, None, None], dt_bias.astype(f32)[:, None, None, :],
                           lower_bound)
    gl = jnp.where(valid[None, :, :, None], gl, 0.0)
    bc = jnp.where(valid[None], jax.nn.sigmoid(bc) if beta_sigmoid else bc, 0.0)
    if qk_l2norm:
        qc = qc * lax.rsqrt(jnp.sum(qc * qc, -1, keepdims=True) + _L2_EPS) * scale
        kc = kc * lax.rsqrt(jnp.sum(kc * kc, -1, keepdims=True) + _L2_EPS)
    cum = jnp.cumsum(gl, axis=2)  # [H, NC, C, K]
    diff = cum[..., :, None, :] - cum[..., None, :, :]  # [H, NC, C, C, K] G_i - G_j
    decay = lambda mask: jnp.exp(jnp.where(mask[:, :, None], diff, -jnp.inf))
    ein = functools.partial(jnp.einsum, precision=HIGHEST)
    lower = bc[..., :, None] * ein("hnik,hnjk,hnijk->hnij", kc, kc, decay(rows[:, None] > rows[None, :]))
    aqk = ein("hnik,hnjk,hnijk->hnij", qc, kc, decay(rows[:, None] >= rows[None, :]))
    eye = jnp.eye(CHUNK, dtype=f32)
    a = lax.linalg.triangular_solve(eye + lower, jnp.broadcast_to(eye, lower.shape), left_side=True, lower=True,
                                    unit_diagonal=True)
    g_last = cum[:, :, -1, :]
    return dict(qc=qc, kc=kc, vc=None if values is None else chunks(values), a_beta=a * bc[..., None, :],
                e_cum=jnp.exp(cum), kg=kc * jnp.exp(g_last[:, :, None, :] - cum), aqk=aqk, gate_last=jnp.exp(g_last))
