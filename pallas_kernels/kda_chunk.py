"""Chunked KDA prefill (chunk 64): parallel intra-chunk stages (XLA), then a sequential Pallas state pass.
Packed variable-length batches, V-first fp32 states, optional page-boundary checkpoints.

This file holds the public entry `kda_chunk`, the chunk table, the XLA intra-chunk stage and the plain-jnp
`kda_chunk_reference`; each Pallas kernel has its own file: `kda_state_pass.py` (fused state pass, the
default), `kda_state_pass_split.py` (split state pass + its output einsum), `kda_chunk_solve.py` (the
opt-in `solve="pallas"` L / Aqk + block inverse); shared constants and helpers are in `kda_common.py`.

Math (k3-model.md §3.1; k3jax/kda.py `kda_chunked_reference`), per head, chunk of C = 64 tokens, state S
at the chunk start (V-first [V, K]), G = cumsum(g) inside the chunk:

    L[i,j] = beta_i sum_d k_i e^(G_i - G_j) k_j   (j < i)        A = (I + L)^-1   (fp32)
    W = A diag(beta) (e^G * K)      U = A diag(beta) V      Aqk[i,j] = sum_d q_i e^(G_i - G_j) k_j  (j <= i)
    V' = U - W S^T      O = (e^G * Q) S^T + Aqk V'      S <- S * e^(G_C) + V'^T (e^(G_C - G) * K)

Stages (the split of fla's `chunk_kda` forward: gate cumsum / intra / state pass / output):
1. `_intra_stage` (XLA, every chunk and head at once): one gather puts the packed tokens into the
   chunk layout [H, NC, C, D] and fuses the K3 gate (lower-bound or softplus form from the raw f_b output +
   A_log + dt_bias), beta = sigmoid(b), the q/k L2 norm, the q scale and the in-chunk cumsum; L and Aqk are
   batched einsums on the tensor cores, each 16-row sub-block i against all 64 columns with its own decay
   reference P_i (G just before the block); the inverse goes in 16x16 blocks in IEEE fp32 (diagonal blocks
   by the exact nilpotent product (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8), off-diagonal ones by
   A_ij = -A_ii sum_{j<=m<i} L_im A_mj); W and U are batched einsums. It returns W, U, e^G Q,
   e^(G_C - G) K, Aqk and e^(G_C). Opt-in `solve="pallas"` replaces the L / Aqk einsums and the inverse
   by one Pallas kernel per (head, chunk) (`kda_chunk_solve`, fla's inter+solve layout: the 10 lower 16x16
   blocks of L and Aqk accumulated over K in 32-wide slices, then the inverse in registers), which reads
   q, k, G once instead of a 4x column-factor tensor; on the H200 it made the prefill 2x slower (15.5 ms).
   Opt-in `stage1="v2"` (`_intra_stage_v2`, same outputs and precisions) cuts the XLA stage's intermediates:
   L / Aqk per 16-row block against only the lower triangle's columns (2.5x instead of 4x column factors,
   each operand read by one dot), the inverse by halves (10 dots instead of 23), the L2 norms as packed
   [T, H] scalars. CPU traffic proxy at B1 T32768 H32 (XLA cost_analysis bytes accessed of the compiled
   stage): 38.0 GB -> 29.7 GB, buffers written 12.5 -> 9.2 GB (benchmarks/kda.py --stage1-hlo-only);
   On the H200 (2026-11-30, benchmarks/kda.py --stage1 default,v2) 6.66 ms against 7.72 ms for the first
   stage at B1 T32768 H32, output within 1.1e-4 of it: the model passed stage1="v2" until "pallas" beat it (k3jax.kda.KDA_STAGE1);
   this function's default stays the first stage, the one the GPU tests and the earlier figures cover.
   Opt-in `stage1="pallas"` (`kda_intra.py`, same outputs): the whole stage as ONE Pallas kernel per chunk
   and head, reading the packed inputs through the chunk table (no gathered copies), L / Aqk as 8 full-tile
   [64, K] x [K, 64] dots, the inverse by masked 16x16 blocks and halves in 64x64 dots at tf32x3, W / U as 2 dots;
   bounded gate only (an unbounded gate takes "v2"). On the H200 (2026-11-30) 8.26 ms against v2's 5.09 ms at
   B1 T32768 H32 (register spills: `kda_intra`'s docstring), so it stays opt-in. An H200 ablation put ~3 ms of
   that in its masked 64x64 tf32x3 inverse (the rest at 8 warps: 2.29 ms), hence two cheaper inverses:
   `kda_intra`'s stage1_inverse="blocks" (16x16-block substitution; at 8 warps 2.93 ms, now "pallas"'s default
   and the model's stage on the GPU, k3jax.kda.KDA_STAGE1) and opt-in `stage1="pallas2"` (3.80 ms) (`_intra_stage_pallas2`: `kda_intra_lk` walks each chunk in
   16-row blocks for the elementwise outputs, Aqk and A diag(beta) -- only needed blocks, the inverse by 16x16
   block substitution -- then `kda_intra_wu` forms W, U as two [64, 64] x [64, D] dots; bounded gate only).
2. The state pass (Pallas, grid = sequences x heads x V-blocks) walks a sequence's chunks in order with
   the state block in registers and writes the final state and the state after every chunk that ends on a
   multiple of `checkpoint_page_size` (absolute positions: chunks are aligned to multiples of 64 of
   `start_positions`, so every page boundary is a chunk boundary). "fused" (`kda_state_pass`, the default)
   also forms O in the walk and stores it into the packed output; "split" (`kda_state_pass_split`, fla's
   layout) stores every chunk's starting state and V', and O follows as one parallel einsum + gather.

Exponent safety: the factor e^(G_r - P_i) is <= 1; e^(P_i - G_s) is <= 1 for columns before block i, and
<= e^(16 |lb|) <= e^80 (finite in fp32 and bf16) inside it when the gate is bounded (lower-bound form with
-16 lb <= 80); columns after the block are masked and their factor is capped at e^80 to stay finite.
Factors that underflow drop terms below 1e-38. For an unbounded gate (softplus, or a precomputed g) the
diagonal blocks take the pairwise exp(G_r - G_s) of masked (non-positive) differences instead.
g must be <= 0 (a log decay), as both gate forms guarantee.

Why XLA for stage 1 and Pallas (Triton lowering) for stage 2, measured on the H200 (benchmarks/kda.py,
docs/results/kda_h200_2026-11-30.json), B1 T32768 H32 D128 bf16: the previous all-Pallas version
(one intra-chunk kernel holding ~30 [16, K] fp32 tiles, its 16x16 dots in IEEE fp32 on CUDA cores) took
49 ms, and minutes to compile; with stage 1 in XLA the whole prefill takes 7.9 ms (fused state pass;
split 8.2 ms), B8 T4096 H32 7.4 ms, B1 T32768 H96 21.8 ms: 6x faster, but still ~2x slower than
fla-core 0.6.0 `chunk_kda` (3.8 / 3.9 / 10.9 ms on the same machine and inputs, 2026-11-29; this
session's fla runs were cut short by its first-call autotuning). Stages apart at B1 T32768 H32: stage 1
(this file, XLA) 6.26 ms of the 7.84 ms total; the state passes' own numbers are in their files. Stage 1
is therefore the bottleneck: the next step is a Pallas kernel for L / Aqk (the 4x column-factor tensor
that the einsums read is ~1 GB of bf16 traffic here; `kda_chunk_solve.py`, later measured 2x slower) and for the
solve + W / U, measured against these XLA numbers.
Checkpoints: page 256 +0% (-0.8%, noise), page 64 +2.5% over no checkpoints.

Precision: with bf16 inputs (the model's activations) the einsum operands of L, Aqk, W and U are bf16
(tensor cores, fp32 accumulation), and W, U, e^G Q, e^(G_C-G) K, Aqk are stored in bf16, as fla does
(fla forms L and Aqk in tf32); L itself, the inverse and all states are fp32. Measured: bf16 output
within 5e-3 relative of fla and within 4e-3 of the fp32 reference at D128 (GPU test). With fp32 inputs
every stored value and every dot is IEEE fp32 (precision HIGHEST): within 2e-6 of the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda_chunk_solve import kda_chunk_solve
from pallas_kernels.kda_common import CHUNK, NSUB, SUB, bdot
from pallas_kernels.kda_common import HIGHEST as _HI
from pallas_kernels.kda_common import MAX_DIAG_EXPONENT as _MAX_DIAG_EXPONENT
from pallas_kernels.kda_common import identity as _identity
from pallas_kernels.kda_intra import kda_intra
from pallas_kernels.kda_intra_lk import kda_intra_lk
from pallas_kernels.kda_intra_wu import kda_intra_wu
from pallas_kernels.kda_state_pass import kda_state_pass
from pallas_kernels.kda_state_pass_split import kda_state_pass_split

GATES = ("none", "lower_bound", "softplus")
_L2_EPS = 1e-6


def _gate(z, a_log, dt_bias, gate, lower_bound):
    """Log decay from the raw gate input z [..., K] with a_log scalar and dt_bias [K] (k3jax.kda.kda_gate)."""
    if gate == "none":
        return z
    x = z + dt_bias
    a = jnp.exp(a_log)
    if gate == "lower_bound":
        return lower_bound * jax.nn.sigmoid(a * x)
    return -a * jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _to_chunks(x, tok_start, length):
    """Packed [T, H, ...] -> chunk layout [H, NC, C, ...] (zeros past each chunk's length): one gather."""
    rows = jnp.arange(CHUNK, dtype=jnp.int32)
    valid = rows[None, :] < length[:, None]  # [NC, C]
    idx = jnp.where(valid, tok_start[:, None] + rows[None, :], 0)
    y = jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), x[idx], 0)  # [NC, C, H, ...]
    return jnp.moveaxis(y, 2, 0)


def _block_inverse(lower):
    """(I + L)^-1 for strictly lower-triangular L [..., C, C] fp32, in 16x16 blocks (IEEE fp32 dots).

    Diagonal blocks by the exact nilpotent product (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8) (L^16 = 0
    on a 16x16 block): three squarings and three products, all 4 blocks batched. Off-diagonal blocks by
    A_ij = -A_ii sum_{j<=m<i} L_im A_mj, row block by row block."""
    lb = lower.reshape(lower.shape[:-2] + (NSUB, SUB, NSUB, SUB))
    blk = lambda i, j: lb[..., i, :, j, :]  # [..., SUB, SUB]
    mm = lambda a, b: jnp.matmul(a, b, precision=_HI)
    l1 = jnp.stack([blk(i, i) for i in range(NSUB)], axis=-3)  # [..., NSUB, SUB, SUB]
    l2 = mm(l1, l1)
    l4 = mm(l2, l2)
    x = _identity(SUB) - l1
    x = x + mm(x, l2)
    x = x + mm(x, l4)
    diag = x + mm(x, mm(l4, l4))
    inv = {(i, i): diag[..., i, :, :] for i in range(NSUB)}
    for i in range(1, NSUB):
        for j in range(i - 1, -1, -1):
            acc = sum(mm(blk(i, m), inv[m, j]) for m in range(j, i))
            inv[i, j] = -mm(inv[i, i], acc)
    zero = jnp.zeros_like(diag[..., 0, :, :])
    rows = [jnp.concatenate([inv.get((i, j), zero) for j in range(NSUB)], axis=-1) for i in range(NSUB)]
    return jnp.concatenate(rows, axis=-2)


def _intra_stage(tok_start, length, q, k, v, g, beta, a_log, dt_bias, *, gate, lower_bound, beta_sigmoid,
                 qk_l2norm, scale, bounded, stored, solve="xla", interpret=False):
    """Every chunk's W, U, e^G Q, e^(G_C - G) K, Aqk and e^(G_C), all chunks and heads at once (XLA).

    Inputs packed [T, H, D]; outputs in the chunk layout [H, NC, C, D] (Aqk [H, NC, C, C], e^(G_C) [H, NC, K]
    fp32). Stages: gather to chunks + gate + beta + L2 norm + in-chunk cumsum (elementwise, one fusion);
    L and Aqk as batched tensor-core dots with per-sub-block decay references; the 16x16-block inverse in
    IEEE fp32; W, U as batched dots in the stored dtype."""
    f32 = jnp.float32
    prec = _HI if stored == f32 else None  # bf16 inputs: default precision (bf16 / tf32 tensor cores)
    rows = jnp.arange(CHUNK, dtype=jnp.int32)
    valid = (rows[None, :] < length[:, None])[None, :, :, None]  # [1, NC, C, 1]
    qc, kc, gc_raw = (_to_chunks(x, tok_start, length).astype(f32) for x in (q, k, g))  # [H, NC, C, K]
    vc = _to_chunks(v, tok_start, length)  # [H, NC, C, V]
    bc = _to_chunks(beta, tok_start, length).astype(f32)  # [H, NC, C]
    gl = _gate(gc_raw, a_log[:, None, None, None], dt_bias[:, None, None, :], gate, lower_bound)
    gl = jnp.where(valid, gl, 0.0)
    bc = jnp.where(valid[..., 0], jax.nn.sigmoid(bc) if beta_sigmoid else bc, 0.0)
    if qk_l2norm:
        qc = qc * lax.rsqrt(jnp.sum(qc * qc, -1, keepdims=True) + _L2_EPS) * scale
        kc = kc * lax.rsqrt(jnp.sum(kc * kc, -1, keepdims=True) + _L2_EPS)
    cum = jnp.cumsum(gl, axis=2)  # G [H, NC, C, K], non-increasing along C
    g_last = cum[:, :, -1, :]  # G_C
    sub = lambda x: x.reshape(x.shape[:2] + (NSUB, SUB) + x.shape[3:])
    if solve == "pallas" and bounded:
        a_beta, aqk = kda_chunk_solve(qc.astype(stored), kc.astype(stored), cum, bc, interpret=interpret)
    else:
        cum4, q4, k4 = sub(cum), sub(qc), sub(kc)
        prev = cum4[:, :, :, 0, :] - sub(gl)[:, :, :, 0, :]  # P_i: G just before sub-block i [H, NC, NSUB, K]
        # Row i, column s: e^(G_r - G_s) = e^(G_r - P_i) e^(P_i - G_s). The first factor is <= 1; the second is
        # <= 1 for s before sub-block i, <= e^(16 |lb|) <= e^80 inside it when the gate is bounded, and only
        # masked entries (s after the block) exceed that, so it is capped there to stay finite.
        row_f = jnp.exp(cum4 - prev[:, :, :, None, :])  # [H, NC, NSUB, SUB, K]
        col_f = jnp.exp(jnp.minimum(prev[:, :, :, None, :] - cum[:, :, None, :, :], _MAX_DIAG_EXPONENT))  # [H,NC,NSUB,C,K]
        kcol = (kc[:, :, None] * col_f).astype(stored)
        lkk = bdot("hcirk,hcisk->hcirs", (k4 * row_f).astype(stored), kcol, prec).reshape(cum.shape[:2] + (CHUNK, CHUNK))
        aqk = bdot("hcirk,hcisk->hcirs", (q4 * row_f).astype(stored), kcol, prec).reshape(lkk.shape)
        if not bounded:  # diagonal blocks from pairwise e^(G_r - G_s) of masked (non-positive) differences
            incl4 = rows[:SUB, None] >= rows[None, :SUB]
            decay = jnp.exp(jnp.where(incl4[:, :, None], cum4[..., :, None, :] - cum4[..., None, :, :], -jnp.inf))
            lii = jnp.einsum("hcnrk,hcnsk,hcnrsk->hcnrs", k4, k4, decay, precision=_HI)
            aii = jnp.einsum("hcnrk,hcnsk,hcnrsk->hcnrs", q4, k4, decay, precision=_HI)
            eye4 = jnp.eye(NSUB, dtype=bool)[:, None, :, None]  # [NSUB, 1, NSUB, 1]: diagonal sub-blocks
            expand = lambda d: (d[:, :, :, :, None, :] * eye4).reshape(lkk.shape)
            on_diag = jnp.broadcast_to(eye4, (NSUB, SUB, NSUB, SUB)).reshape(CHUNK, CHUNK)
            lkk = jnp.where(on_diag, expand(lii), lkk)
            aqk = jnp.where(on_diag, expand(aii), aqk)
        strict = rows[:, None] > rows[None, :]
        lkk = jnp.where(strict, bc[..., :, None] * lkk, 0.0)
        aqk = jnp.where(strict | (rows[:, None] == rows[None, :]), aqk, 0.0)
        a_beta = (_block_inverse(lkk) * bc[:, :, None, :]).astype(stored)  # A diag(beta)
    w = bdot("hcij,hcjk->hcik", a_beta, (kc * jnp.exp(cum)).astype(stored), prec).astype(stored)
    u = bdot("hcij,hcjv->hciv", a_beta, vc.astype(stored), prec).astype(stored)
    qg = (qc * jnp.exp(cum)).astype(stored)
    kg = (kc * jnp.exp(g_last[:, :, None, :] - cum)).astype(stored)
    return w, u, qg, kg, aqk.astype(stored), jnp.exp(g_last)


def _inverse_by_halves(diag_l, pair_l, quad_l):
    """(I + L)^-1 for strictly lower-triangular 64x64 L given as its 16x16 diagonal blocks diag_l
    [..., NSUB, SUB, SUB], the sub-diagonal blocks L_10 and L_32 as pair_l [..., 2, SUB, SUB] and the lower-left
    32x32 quadrant quad_l [..., 32, 32]; IEEE fp32 dots. Diagonal blocks by the exact nilpotent product
    (I - L)(I + L^2)(I + L^4)(I + L^8); then by halves: A_21 = -A_22 L_21 A_11 for the 16x16 pairs, then for
    the 32x32 quadrant. 10 batched dots (the row-by-row form takes 23)."""
    mm = lambda a, b: jnp.matmul(a, b, precision=_HI)
    l2 = mm(diag_l, diag_l)
    l4 = mm(l2, l2)
    x = _identity(SUB) - diag_l
    x = x + mm(x, l2)
    x = x + mm(x, l4)
    diag = x + mm(x, mm(l4, l4))  # [..., NSUB, SUB, SUB]
    pair = -mm(diag[..., 1::2, :, :], mm(pair_l, diag[..., 0::2, :, :]))  # A_10, A_32
    zero = jnp.zeros_like(diag[..., 0, :, :])
    half = jnp.concatenate([  # A_00 | A_11 and A_22 | A_33 as two 32x32 lower-triangular blocks [..., 2, 32, 32]
        jnp.concatenate([diag[..., 0::2, :, :], jnp.broadcast_to(zero[..., None, :, :], pair.shape)], axis=-1),
        jnp.concatenate([pair, diag[..., 1::2, :, :]], axis=-1)], axis=-2)
    quad = -mm(half[..., 1, :, :], mm(quad_l, half[..., 0, :, :]))  # [..., 32, 32]
    upper = jnp.concatenate([half[..., 0, :, :], jnp.zeros_like(quad)], axis=-1)
    lower = jnp.concatenate([quad, half[..., 1, :, :]], axis=-1)
    return jnp.concatenate([upper, lower], axis=-2)


def _intra_stage_v2(tok_start, length, q, k, v, g, beta, a_log, dt_bias, *, gate, lower_bound, beta_sigmoid,
                    qk_l2norm, scale, bounded, stored):
    """`_intra_stage` (same outputs, same operand precisions) with fewer and smaller intermediates:

    - L and Aqk by row block: sub-block i's q and k rows (scaled by e^(G_r - P_i) <= 1, stacked as one
      [2 * SUB, K] operand) against only the columns 0 .. 16(i+1) that the lower triangle needs (scaled by
      e^(P_i - G_s)): 10 of the 16 column blocks, each operand written once and read by one dot, instead of
      the 4x [NSUB, C, K] column-factor tensor read by two einsums. (Unbounded gate: columns 0 .. 16i only,
      the diagonal blocks pairwise as in `_intra_stage`.)
    - the q / k L2 norms as [T, H] scalars from the packed inputs, so the chunk-layout q, k are elementwise
      in the gather (no normalised [H, NC, C, K] fp32 copy for every consumer to read);
    - each row block's factors computed inside its own operand (a shared, sliced factor tensor is
      materialised first);
    - the inverse by halves (`_inverse_by_halves`, 10 batched 16x16 / 32x32 dots instead of 23), straight
      from the blocks of the row-block dots.
    Exponent safety as in the module docstring; the capped factor only reaches masked entries."""
    f32 = jnp.float32
    prec = _HI if stored == f32 else None
    rows = jnp.arange(CHUNK, dtype=jnp.int32)
    valid = (rows[None, :] < length[:, None])[None, :, :, None]  # [1, NC, C, 1]
    qc, kc, gc_raw = (_to_chunks(x, tok_start, length).astype(f32) for x in (q, k, g))  # [H, NC, C, K]
    vc = _to_chunks(v, tok_start, length).astype(stored)  # [H, NC, C, V]
    bc = _to_chunks(beta, tok_start, length).astype(f32)  # [H, NC, C]
    gl = _gate(gc_raw, a_log[:, None, None, None], dt_bias[:, None, None, :], gate, lower_bound)
    gl = jnp.where(valid, gl, 0.0)
    bc = jnp.where(valid[..., 0], jax.nn.sigmoid(bc) if beta_sigmoid else bc, 0.0)
    if qk_l2norm:  # the norms as [T, H] scalars in the packed layout: the chunk-layout q, k stay elementwise
        inv_norm = lambda x: lax.rsqrt(jnp.sum(jnp.square(x.astype(f32)), -1) + _L2_EPS)  # [T, H]
        qc = qc * (_to_chunks(inv_norm(q), tok_start, length) * scale)[..., None]
        kc = kc * _to_chunks(inv_norm(k), tok_start, length)[..., None]
    cum = jnp.cumsum(gl, axis=2)  # G [H, NC, C, K]
    g_last = cum[:, :, -1, :]
    sub = lambda x: x.reshape(x.shape[:2] + (NSUB, SUB) + x.shape[3:])
    cum4, q4, k4 = sub(cum), sub(qc), sub(kc)
    # P_i: G at the last row of sub-block i-1 (0 for i = 0) [H, NC, NSUB, K]; read from G itself (not G - g at
    # the block's first row) so the factor fusions need not read g, and e^(G_r - P_i) <= 1 holds exactly.
    prev = jnp.concatenate([jnp.zeros_like(cum[:, :, :1]), cum[:, :, SUB - 1:CHUNK - 1:SUB]], axis=2)
    blocks = []  # blocks[i]: [H, NC, 2 SUB, cols_i] = Aqk | L (before beta) rows of sub-block i
    for i in range(NSUB):
        cols = SUB * (i + 1) if bounded else SUB * i
        if cols == 0:
            blocks.append(None)
            continue
        # each operand its own array (a slice of a shared one would be copied again before its dot)
        row_f = jnp.exp(cum4[:, :, i] - prev[:, :, i, None, :])  # [H, NC, SUB, K], <= 1 (per block: not shared)
        left = jnp.concatenate([q4[:, :, i] * row_f, k4[:, :, i] * row_f], axis=2)
        col_f = jnp.exp(jnp.minimum(prev[:, :, i, None, :] - cum[:, :, :cols, :], _MAX_DIAG_EXPONENT))
        right = (kc[:, :, :cols] * col_f).astype(stored)  # [H, NC, cols, K]
        blocks.append(bdot("hcrk,hcsk->hcrs", left.astype(stored), right, prec))  # left: [H, NC, 2 SUB, K] q | k
    if not bounded:  # diagonal blocks from pairwise e^(G_r - G_s) of masked (non-positive) differences
        incl4 = rows[:SUB, None] >= rows[None, :SUB]
        decay = jnp.exp(jnp.where(incl4[:, :, None], cum4[..., :, None, :] - cum4[..., None, :, :], -jnp.inf))
        aii = jnp.einsum("hcnrk,hcnsk,hcnrsk->hcnrs", q4, k4, decay, precision=_HI)
        lii = jnp.einsum("hcnrk,hcnsk,hcnrsk->hcnrs", k4, k4, decay, precision=_HI)
        blocks = [jnp.concatenate([aii[:, :, i], lii[:, :, i]], axis=2) if b is None
                  else jnp.concatenate([b, jnp.concatenate([aii[:, :, i], lii[:, :, i]], axis=2)], axis=3)
                  for i, b in enumerate(blocks)]
    b4 = sub(bc)  # beta [H, NC, NSUB, SUB]
    r16 = rows[:SUB]
    strict16 = r16[:, None] > r16[None, :]
    lblk = lambda i, j: blocks[i][:, :, SUB:, SUB * j:SUB * (j + 1)] * b4[:, :, i, :, None]  # beta_r L_ij
    diag_l = jnp.stack([jnp.where(strict16, lblk(i, i), 0.0) for i in range(NSUB)], axis=2)
    pair_l = jnp.stack([lblk(1, 0), lblk(3, 2)], axis=2)
    quad_l = jnp.concatenate([blocks[2][:, :, SUB:, :2 * SUB] * b4[:, :, 2, :, None],
                              blocks[3][:, :, SUB:, :2 * SUB] * b4[:, :, 3, :, None]], axis=2)
    a_beta = (_inverse_by_halves(diag_l, pair_l, quad_l) * bc[:, :, None, :]).astype(stored)  # A diag(beta)
    incl = rows[:, None] >= rows[None, :]
    aqk = jnp.concatenate([jnp.pad(b[:, :, :SUB], ((0, 0), (0, 0), (0, 0), (0, CHUNK - b.shape[3])))
                           for b in blocks], axis=2)
    aqk = jnp.where(incl, aqk, 0.0).astype(stored)
    e_cum = jnp.exp(cum)
    w = bdot("hcij,hcjk->hcik", a_beta, (kc * e_cum).astype(stored), prec).astype(stored)
    u = bdot("hcij,hcjv->hciv", a_beta, vc, prec).astype(stored)
    qg = (qc * e_cum).astype(stored)
    kg = (kc * jnp.exp(g_last[:, :, None, :] - cum)).astype(stored)
    return w, u, qg, kg, aqk, jnp.exp(g_last)


def _intra_stage_pallas2(tok_start, length, q, k, v, g, beta, a_log, dt_bias, *, lower_bound, beta_sigmoid,
                         qk_l2norm, scale, stored, num_warps=8, block_k=128, wu_num_warps=4, inverse_precision="ieee",
                         keep="stored", interpret=False):
    """Stage 1 as two Pallas kernels (`kda_chunk(stage1="pallas2")`, bounded gate): `kda_intra_lk` (gate, norms,
    cumsum, the elementwise outputs, Aqk and A diag(beta) by 16-row blocks) then `kda_intra_wu` (W, U); the
    same six outputs as `_intra_stage_v2`."""
    a_beta, kw, qg, kg, aqk, gc = kda_intra_lk(
        tok_start, length, q, k, g, beta, a_log, dt_bias, lower_bound=lower_bound, beta_sigmoid=beta_sigmoid,
        qk_l2norm=qk_l2norm, scale=scale, stored=stored, num_warps=num_warps, block_k=block_k,
        inverse_precision=inverse_precision, keep=keep, interpret=interpret)
    w, u = kda_intra_wu(tok_start, length, v, a_beta, kw, num_warps=wu_num_warps, interpret=interpret)
    return w, u, qg, kg, aqk, gc


def chunk_table(cu_seqlens, start_positions, num_chunks, page_size, seq_lens=None):
    """Chunks of every sequence, aligned to absolute multiples of CHUNK.

    Args: cu_seqlens [N+1] int32 (and seq_lens [N], see `kda_chunk`); start_positions [N] int32 absolute
      position of each sequence's first token;
      num_chunks: static bound on the table size; page_size: checkpoint page (or 0 for none).
    Returns: first [N+1] (chunk range of sequence n = first[n]..first[n+1]), token_start [NC], length [NC]
      (0 past the last chunk), checkpoint_index [NC] (-1 where the chunk does not end on a page boundary).
    """
    lens = cu_seqlens[1:] - cu_seqlens[:-1] if seq_lens is None else seq_lens
    end = start_positions + lens
    count = jnp.where(lens > 0, -(-end // CHUNK) - start_positions // CHUNK, 0)
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(count).astype(jnp.int32)])
    cid = jnp.arange(num_chunks, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(first[1:], cid, side="right"), 0, lens.shape[0] - 1)
    lo_abs = (start_positions[seq] // CHUNK + cid - first[seq]) * CHUNK
    lo = jnp.maximum(lo_abs, start_positions[seq])
    hi = jnp.minimum(lo_abs + CHUNK, end[seq])
    used = cid < first[-1]
    length = jnp.where(used, hi - lo, 0).astype(jnp.int32)
    token_start = jnp.where(used, cu_seqlens[seq] + lo - start_positions[seq], 0).astype(jnp.int32)
    if page_size:
        offsets = checkpoint_offsets(cu_seqlens, start_positions, page_size, seq_lens)
        ck = offsets[seq] + hi // page_size - start_positions[seq] // page_size - 1
        ckpt = jnp.where(used & (hi % page_size == 0), ck, -1).astype(jnp.int32)
    else:
        ckpt = jnp.full((num_chunks,), -1, jnp.int32)
    return first, token_start, length, ckpt


def checkpoint_offsets(cu_seqlens, start_positions, page_size, seq_lens=None):
    """[N+1] int32: sequence n's checkpoints are rows offsets[n]..offsets[n+1] of the checkpoint output, in
    order: the states after absolute positions p*page_size with start < p*page_size <= start + length."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1] if seq_lens is None else seq_lens
    count = (start_positions + lens) // page_size - start_positions // page_size
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(count).astype(jnp.int32)])


def _check(q, k, v, g, beta, initial_state, cu_seqlens, gate, a_log, dt_bias, page_size):
    if q.ndim != 3 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must be [T, H, K] alike; got {q.shape}, {k.shape}, {g.shape}")
    t, h, dk = q.shape
    if v.ndim != 3 or v.shape[:2] != (t, h):
        raise ValueError(f"v must be [T, H, V] with T, H = {(t, h)}; got {v.shape}")
    dv = v.shape[2]
    if beta.shape != (t, h):
        raise ValueError(f"beta must be [T, H] = {(t, h)}; got {beta.shape}")
    for name, d in (("K", dk), ("V", dv)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"head dim {name}={d} must be a power of two >= 16 (Triton block shapes)")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2 or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise ValueError(f"cu_seqlens must be an integer [N+1] array, N >= 1; got {cu_seqlens.dtype}{cu_seqlens.shape}")
    n = cu_seqlens.shape[0] - 1
    if initial_state.shape != (n, h, dv, dk):
        raise ValueError(f"initial_state must be V-first [N, H, V, K] = {(n, h, dv, dk)}; got {initial_state.shape}")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}; got {gate!r}")
    if gate != "none" and (a_log is None or dt_bias is None):
        raise ValueError(f"gate={gate!r} needs a_log [H] and dt_bias [H*K]")
    if gate != "none" and (a_log.shape[0] < h or dt_bias.size != h * dk):
        raise ValueError(f"a_log must have >= {h} entries and dt_bias {h * dk}; got {a_log.shape}, {dt_bias.shape}")
    if page_size is not None and (page_size <= 0 or page_size % CHUNK):
        raise ValueError(f"checkpoint_page_size must be a positive multiple of {CHUNK}; got {page_size}")


def _preprocess_args(q, g, beta, initial_state, cu_seqlens, gate, a_log, dt_bias, start_positions):
    t, h, dk = q.shape
    n = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    start = jnp.zeros((n,), jnp.int32) if start_positions is None else start_positions.astype(jnp.int32)
    a = jnp.zeros((h,), jnp.float32) if a_log is None else a_log[:h].astype(jnp.float32)
    b = jnp.zeros((h, dk), jnp.float32) if dt_bias is None else dt_bias.astype(jnp.float32).reshape(h, dk)
    return cu, start, a, b


@functools.partial(jax.jit, static_argnames=(
    "gate", "lower_bound", "beta_sigmoid", "qk_l2norm", "scale", "checkpoint_page_size", "interpret",
    "block_v", "num_warps", "state_pass", "solve", "stage1", "stage1_num_warps", "stage1_inverse",
    "num_stages", "state_layout", "output_order", "checkpoint_branch"))
def kda_chunk(q, k, v, g, beta, initial_state, cu_seqlens, *, a_log=None, dt_bias=None, gate="none",
              lower_bound=-5.0, beta_sigmoid=False, qk_l2norm=False, scale=None, start_positions=None,
              seq_lens=None, checkpoint_page_size=None, interpret=False, block_v=None, num_warps=None,
              state_pass="fused", solve="xla", stage1="default", stage1_num_warps=None, stage1_inverse=None,
              num_stages=None, state_layout=None, output_order="between", checkpoint_branch=None):
    """Chunked KDA over a packed batch of sequences.

    Args:
      q, k: [T, H, K] packed tokens of N sequences (raw if qk_l2norm, else normalised, q already scaled).
      v: [T, H, V]. Its dtype is the output dtype and, if bf16, the stored-intermediate / matmul dtype.
      g: [T, H, K] raw gate input z (gate="lower_bound" / "softplus") or the log decay itself (gate="none",
        must be <= 0).
      beta: [T, H] logits (beta_sigmoid) or beta itself.
      initial_state: [N, H, V, K] V-first state of each sequence (fp32).
      cu_seqlens: [N+1] int32 sequence n is tokens cu_seqlens[n]..cu_seqlens[n+1] (lengths may be 0).
      seq_lens: [N] int32, optional: sequence n is only its first seq_lens[n] tokens (a padded batch:
        cu_seqlens = arange(N+1) * T); the output rows of the padding are left unwritten.
      a_log: [>= H] and dt_bias: [H*K], the gate parameters (ignored for gate="none").
      lower_bound: the K3 gate's bound (g in (lower_bound, 0)).
      scale: q scale after the fused L2 norm (default K^-1/2).
      start_positions: [N] absolute position of each sequence's first token (default 0): chunks align to
        multiples of 64 of it, and checkpoints fall on multiples of checkpoint_page_size of it.
      checkpoint_page_size: emit the state after every absolute position p*page (start < p*page <= end).
      block_v, num_warps: the state pass's V-block and warps (None: the fused pass picks them with
        `kda_common.pick_state_tiling`, the split pass from N x H and 4 warps);
      state_pass: "fused" (the sequential walk also writes O) or "split" (it stores every chunk's state,
        O follows as one parallel einsum); same results up to rounding.
      solve: "xla" (default, measured) or "pallas": L / Aqk and the block inverse in one Pallas kernel per
        (head, chunk) (`kda_chunk_solve`; bounded gate only, else XLA). Same math and operand precisions;
        2x slower on the H200.
      stage1: "default" (`_intra_stage`) or "v2" (`_intra_stage_v2`: the same stage with fewer and smaller
        intermediates, 1.16x faster on the H200 and the model's choice; XLA L / Aqk only, so solve must be "xla")
        or "pallas" (`kda_intra`: the whole stage as one Pallas kernel per chunk and head, reading the packed
        inputs; bounded gate only: an unbounded one takes "v2"; solve must be "xla"; slower than v2 on the H200
        with its default tf32x3 inverse) or "pallas2" (`_intra_stage_pallas2`: `kda_intra_lk` by 16-row blocks,
        then `kda_intra_wu`; bounded gate only, as "pallas"; not yet timed on a GPU).
      stage1_num_warps, stage1_inverse: stage1="pallas"'s Triton warps (default 8) and its inverse (default
        "blocks", the 16x16-block substitution: 2.93 ms on the H200 at B1 T32768 H32 against 8.24 ms at 4 warps
        with "tf32x3" and 5.09 ms for v2, 2026-11-30; see `kda_intra`), or stage1="pallas2"'s
        `kda_intra_lk` warps (default 8) and inverse dot precision (default "ieee"; or "tf32x3").
      num_stages, state_layout, output_order, checkpoint_branch: the fused state pass's variants, passed
        through to `kda_state_pass` (state_pass="fused" only; num_stages / state_layout None: picked with the
        V-block, `kda_common.pick_state_tiling`; checkpoint_branch None: on with K-first and a page).

    Returns:
      o: [T, H, V] in v's dtype; final_state: [N, H, V, K] fp32; checkpoints: [T // page + N, H, V, K] fp32
      (rows per sequence as `checkpoint_offsets`; unused rows are unspecified) or None.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens, gate, a_log, dt_bias, checkpoint_page_size)
    if state_pass not in ("fused", "split"):
        raise ValueError(f"state_pass must be 'fused' or 'split'; got {state_pass!r}")
    fused_kw = dict(num_stages=num_stages, state_layout=state_layout, output_order=output_order,
                    checkpoint_branch=checkpoint_branch)
    if state_pass == "split" and fused_kw != dict(num_stages=None, state_layout=None, output_order="between",
                                                  checkpoint_branch=None):
        raise ValueError(f"num_stages / state_layout / output_order / checkpoint_branch are the fused state "
                         f"pass's; got {fused_kw} with state_pass='split'")
    if solve not in ("xla", "pallas"):
        raise ValueError(f"solve must be 'xla' or 'pallas'; got {solve!r}")
    if stage1 not in ("default", "v2", "pallas", "pallas2"):
        raise ValueError(f"stage1 must be 'default', 'v2', 'pallas' or 'pallas2'; got {stage1!r}")
    if stage1 != "default" and solve != "xla":
        raise ValueError(f"stage1={stage1!r} computes L / Aqk itself: solve must be 'xla'; got {solve!r}")
    t, h, dk = q.shape
    n = cu_seqlens.shape[0] - 1
    cu, start, a, b = _preprocess_args(q, g, beta, initial_state, cu_seqlens, gate, a_log, dt_bias, start_positions)
    num_chunks = t // CHUNK + 2 * n
    page = checkpoint_page_size or 0
    lens = None if seq_lens is None else seq_lens.astype(jnp.int32)
    first, tok_start, length, ckpt_idx = chunk_table(cu, start, num_chunks, page, lens)
    stored = jnp.bfloat16 if v.dtype == jnp.bfloat16 else jnp.float32
    bounded = gate == "lower_bound" and -SUB * lower_bound <= _MAX_DIAG_EXPONENT
    scale = dk**-0.5 if scale is None else scale
    stage_kw = dict(gate=gate, lower_bound=lower_bound, beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm,
                    scale=scale, bounded=bounded, stored=stored)
    if stage1 == "pallas" and bounded:
        w, u, qg, kg, aqk, gc = kda_intra(tok_start, length, q, k, v, g, beta, a, b, gate=gate,
                                          lower_bound=lower_bound, beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm,
                                          scale=scale, stored=stored, num_warps=stage1_num_warps or 8,
                                          inverse_precision=stage1_inverse or "blocks", interpret=interpret)
    elif stage1 == "pallas2" and bounded:
        w, u, qg, kg, aqk, gc = _intra_stage_pallas2(
            tok_start, length, q, k, v, g, beta, a, b, lower_bound=lower_bound, beta_sigmoid=beta_sigmoid,
            qk_l2norm=qk_l2norm, scale=scale, stored=stored, num_warps=stage1_num_warps or 8,
            inverse_precision=stage1_inverse or "ieee", interpret=interpret)
    elif stage1 in ("v2", "pallas", "pallas2"):  # a Pallas stage with an unbounded gate: the XLA stage (kda_intra)
        w, u, qg, kg, aqk, gc = _intra_stage_v2(tok_start, length, q, k, v, g, beta, a, b, **stage_kw)
    else:
        w, u, qg, kg, aqk, gc = _intra_stage(tok_start, length, q, k, v, g, beta, a, b, solve=solve,
                                             interpret=interpret, **stage_kw)
    extra = fused_kw if state_pass == "fused" else {}
    state_pass = {"fused": kda_state_pass, "split": kda_state_pass_split}[state_pass]
    return state_pass(first, tok_start, length, ckpt_idx, w, u, qg, kg, aqk, gc, initial_state, num_tokens=t,
                      checkpoint_page_size=page, block_v=block_v, out_dtype=v.dtype, num_warps=num_warps,
                      interpret=interpret, **extra)


def kda_chunk_reference(q, k, v, g, beta, initial_state, cu_seqlens, *, a_log=None, dt_bias=None, gate="none",
                        lower_bound=-5.0, beta_sigmoid=False, qk_l2norm=False, scale=None, start_positions=None,
                        seq_lens=None, checkpoint_page_size=None):
    """Plain-jnp twin of `kda_chunk` (same arguments and results): the gate, beta and norm in fp32, then
    the token-by-token recurrence over each sequence (k3jax.kda.kda_recurrent_reference), unpacked."""
    from k3jax.kda import kda_recurrent_reference, states_from_updates

    _check(q, k, v, g, beta, initial_state, cu_seqlens, gate, a_log, dt_bias, checkpoint_page_size)
    t, h, dk = q.shape
    n = cu_seqlens.shape[0] - 1
    cu, start, a, b = _preprocess_args(q, g, beta, initial_state, cu_seqlens, gate, a_log, dt_bias, start_positions)
    f32 = lambda x: x.astype(jnp.float32)
    q, k, v, g, beta = map(f32, (q, k, v, g, beta))
    g = jax.vmap(lambda z, al, db: _gate(z, al, db, gate, lower_bound), in_axes=(1, 0, 0), out_axes=1)(g, a, b)
    if beta_sigmoid:
        beta = jax.nn.sigmoid(beta)
    if qk_l2norm:
        scale = dk**-0.5 if scale is None else scale
        q = q * lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + _L2_EPS) * scale
        k = k * lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + _L2_EPS)
    lens = cu[1:] - cu[:-1] if seq_lens is None else seq_lens.astype(jnp.int32)
    pos = jnp.arange(t)
    idx = jnp.clip(cu[:-1, None] + pos[None, :], 0, t - 1)  # [N, T] unpacked (rows padded to T)
    valid = pos[None, :] < lens[:, None]
    unpack = lambda x: jnp.where(valid.reshape(n, t, *([1] * (x.ndim - 1))), x[idx], 0.0)
    o, updates = kda_recurrent_reference(*map(unpack, (q, k, v, g, beta)), f32(initial_state), all_states=True)
    states = states_from_updates(f32(initial_state), *updates)  # [N, T, H, V, K]
    last = jnp.clip(lens - 1, 0, t - 1)
    final = jnp.where((lens > 0)[:, None, None, None], states[jnp.arange(n), last], f32(initial_state))
    seq = jnp.clip(jnp.searchsorted(cu[1:], pos, side="right"), 0, n - 1)
    o_packed = jnp.where((pos - cu[seq] < lens[seq])[:, None, None], o[seq, pos - cu[seq]], 0.0).astype(v.dtype)
    ckpt = None
    if checkpoint_page_size:
        p = checkpoint_page_size
        offsets = checkpoint_offsets(cu, start, p, lens)
        rows = jnp.arange(t // p + n)
        owner = jnp.clip(jnp.searchsorted(offsets[1:], rows, side="right"), 0, n - 1)
        boundary = (start[owner] // p + 1 + rows - offsets[owner]) * p  # absolute position of the row's page end
        ckpt = states[owner, jnp.clip(boundary - start[owner] - 1, 0, t - 1)]
        ckpt = jnp.where((rows < offsets[-1])[:, None, None, None], ckpt, 0.0)
    return o_packed, final, ckpt
