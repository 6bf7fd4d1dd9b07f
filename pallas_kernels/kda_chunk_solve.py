"""KDA chunked prefill, stage 1's opt-in Pallas part (`kda_chunk(..., solve="pallas")`): L, Aqk and the
block inverse of one chunk per program.

Per head and chunk of C = 64 tokens, with normalised q (scaled), k, beta and the in-chunk cumsum G of the
log decay (k3-model.md §3.1; k3jax/kda.py `kda_chunked_reference`):

    L[i,j] = beta_i sum_d k_i e^(G_i - G_j) k_j   (j < i)      A diag(beta) = (I + L)^-1 diag(beta)
    Aqk[i,j] = sum_d q_i e^(G_i - G_j) k_j   (j <= i)

Layout (fla's inter + solve): grid = heads x chunks; each program accumulates the 10 lower 16x16 blocks
of L and Aqk over K in slices of `block_k` (bounded register use) from q, k and G read once, instead of
the XLA stage's 4x column-factor tensor, then inverts I + L in 16x16 blocks in registers (diagonal blocks
by the exact nilpotent product (I - L)(I + L^2)(I + L^4)(I + L^8), off-diagonal blocks by
A_ij = -A_ii sum_{j<=m<i} L_im A_mj) in IEEE fp32.

Exponent safety: e^(G_i - G_j) is split as e^(G_i - P_b) e^(P_b - G_j) with P_b the cumsum just before
i's 16-row sub-block b. The first factor is <= 1; the second is <= 1 for columns before the block and
<= e^(16 |g|max) inside it, which stays finite only for a bounded gate: every g >= -5 (K3's lower-bound
gate with lb >= -5, so 16 |lb| <= 80). Unbounded gates must use the XLA stage (kda_chunk does so itself).

Measured: not yet timed on the GPU (added after the 2026-11-30 device runs). Its purpose: the XLA stage 1
takes 6.26 ms of the 7.84 ms prefill at B1 T32768 H32 D128 bf16 on the H200 (benchmarks/kda.py,
docs/results/kda_h200_2026-11-30.json), and the column-factor tensor its L / Aqk einsums read is ~1 GB
of bf16 traffic there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kda_common import CHUNK, HIGHEST, NSUB, SUB, dot, identity, is_pow2_at_least_16


def _solve_kernel(q_ref, k_ref, g_ref, b_ref, abeta_ref, aqk_ref, *, block_k):
    # q_ref, k_ref: [C, K] normalised q (scaled) and k (stored dtype); g_ref: [C, K] fp32 in-chunk cumsum G
    # b_ref: [C] fp32 beta (0 on padding); abeta_ref, aqk_ref: [C, C] (stored dtype), blocks of [H, NC, C, C]
    # Bounded gate only (e^(P_i - G_s) <= e^80 on diagonal blocks). Accumulates the 10 lower 16x16 blocks
    # of L and of Aqk over K in slices of block_k (bounded register use), then inverts in 16x16 blocks.
    f32 = jnp.float32
    stored = q_ref.dtype
    prec = HIGHEST if stored == f32 else None
    dk = q_ref.shape[-1]
    lkk = {(i, j): jnp.zeros((SUB, SUB), f32) for i in range(NSUB) for j in range(i + 1)}
    aqk = dict(lkk)
    for kb in range(dk // block_k):
        ks = pl.ds(kb * block_k, block_k)
        rows = lambda ref, i: ref[pl.ds(i * SUB, SUB), ks].astype(f32)  # [SUB, BK]
        q4 = [rows(q_ref, i) for i in range(NSUB)]
        k4 = [rows(k_ref, i) for i in range(NSUB)]
        g4 = [rows(g_ref, i) for i in range(NSUB)]
        for i in range(NSUB):
            ref_g = g_ref[pl.ds(i * SUB - 1, 1), ks] if i else jnp.zeros((1, block_k), f32)  # P_i [1, BK]
            row_f = jnp.exp(g4[i] - ref_g)  # <= 1
            kr, qr = (k4[i] * row_f).astype(stored), (q4[i] * row_f).astype(stored)
            for j in range(i + 1):
                kc = (k4[j] * jnp.exp(ref_g - g4[j])).astype(stored)  # <= 1 (j < i), <= e^80 (j == i)
                lkk[i, j] = lkk[i, j] + dot(kr, kc, tb=True, precision=prec)
                aqk[i, j] = aqk[i, j] + dot(qr, kc, tb=True, precision=prec)
    r = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    c = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    beta = [b_ref[pl.ds(i * SUB, SUB)].astype(f32) for i in range(NSUB)]
    low = {}
    for i in range(NSUB):
        for j in range(i + 1):
            blk = beta[i][:, None] * lkk[i, j]
            low[i, j] = jnp.where(r > c, blk, 0.0) if i == j else blk
            a = jnp.where(r >= c, aqk[i, j], 0.0) if i == j else aqk[i, j]
            aqk_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = a.astype(aqk_ref.dtype)
        for j in range(i + 1, NSUB):
            zero = jnp.zeros((SUB, SUB), aqk_ref.dtype)
            aqk_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = zero
            abeta_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = zero
    mm = lambda a, b: dot(a, b, precision=HIGHEST)
    eye = identity(SUB)
    inv = {}
    for i in range(NSUB):  # as kda_chunk._block_inverse, in registers
        l1 = low[i, i]
        l2 = mm(l1, l1)
        l4 = mm(l2, l2)
        x = eye - l1
        x = x + mm(x, l2)
        x = x + mm(x, l4)
        inv[i, i] = x + mm(x, mm(l4, l4))
        for j in range(i - 1, -1, -1):
            acc = mm(low[i, j], inv[j, j])
            for m in range(j + 1, i):
                acc = acc + mm(low[i, m], inv[m, j])
            inv[i, j] = -mm(inv[i, i], acc)
        for j in range(i + 1):
            abeta_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = (inv[i, j] * beta[j][None, :]).astype(abeta_ref.dtype)


def _solve_call(qn, kn, cum, bc, *, interpret, num_warps=4, block_k=32):
    """pallas_call wrapper: grid = heads x chunks, one [C, K] tile of q, k, G and the [C] beta per program;
    returns A diag(beta) and Aqk [H, NC, C, C] in q's dtype."""
    h, num_chunks, _, dk = qn.shape
    block_k = min(block_k, dk)
    tile = lambda d: pl.BlockSpec((None, None, CHUNK, d), lambda hh, cc: (hh, cc, 0, 0))
    out = jax.ShapeDtypeStruct((h, num_chunks, CHUNK, CHUNK), qn.dtype)
    params = {} if interpret else dict(compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1))
    return pl.pallas_call(
        functools.partial(_solve_kernel, block_k=block_k),
        grid=(h, num_chunks),
        in_specs=[tile(dk), tile(dk), tile(dk), pl.BlockSpec((None, None, CHUNK), lambda hh, cc: (hh, cc, 0))],
        out_specs=[tile(CHUNK), tile(CHUNK)],
        out_shape=[out, out],
        interpret=interpret, name="kda_chunk_solve", **params,
    )(qn, kn, cum, bc)


def _check(q, k, gate_cumsum, beta, block_k):
    if q.ndim != 4 or q.shape[2] != CHUNK:
        raise ValueError(f"q must be the chunk layout [H, NC, {CHUNK}, K]; got {q.shape}")
    if k.shape != q.shape or gate_cumsum.shape != q.shape:
        raise ValueError(f"k and gate_cumsum must be shaped like q {q.shape}; got {k.shape}, {gate_cumsum.shape}")
    if k.dtype != q.dtype or q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q and k must share a stored dtype, float32 or bfloat16; got {q.dtype}, {k.dtype}")
    if gate_cumsum.dtype != jnp.float32 or beta.dtype != jnp.float32:
        raise ValueError(f"gate_cumsum and beta must be float32; got {gate_cumsum.dtype}, {beta.dtype}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [H, NC, C] = {q.shape[:3]}; got {beta.shape}")
    dk = q.shape[3]
    if not is_pow2_at_least_16(dk):
        raise ValueError(f"head dim K={dk} must be a power of two >= 16 (Triton block shapes)")
    if not is_pow2_at_least_16(block_k):
        raise ValueError(f"block_k={block_k} must be a power of two >= 16")


def kda_chunk_solve(q, k, gate_cumsum, beta, *, block_k=32, num_warps=4, interpret=False):
    """Per chunk: L and Aqk, then A diag(beta) = (I + L)^-1 diag(beta) (one Pallas kernel, heads x chunks).

    Args:
      q, k: [H, NC, C, K] (C = 64) normalised q (already scaled) and k, in the stored dtype (bf16: the
        factored operands are rounded to bf16 for tensor-core dots, as the XLA stage does; fp32: IEEE).
      gate_cumsum: [H, NC, C, K] fp32 in-chunk cumsum G of the log decay (non-increasing along C). Every
        per-token g = G_i - G_{i-1} must be >= -5 (bounded gate, see the module docstring).
      beta: [H, NC, C] fp32 (0 on padding rows).
      block_k: the K slice accumulated per step (min'd with K); num_warps: Triton warps;
      interpret: Pallas interpret mode (CPU tests).

    Returns:
      a_beta: [H, NC, C, C] A diag(beta), zero above the diagonal; aqk: [H, NC, C, C] Aqk, zero above the
      diagonal; both in q's dtype.
    """
    _check(q, k, gate_cumsum, beta, block_k)
    return tuple(_solve_call(q, k, gate_cumsum, beta, interpret=interpret, num_warps=num_warps, block_k=block_k))


def kda_chunk_solve_reference(q, k, gate_cumsum, beta):
    """Plain-jnp twin of `kda_chunk_solve` (same arguments; results in fp32): the intra-chunk part of
    k3jax.kda.kda_chunked_reference, with pairwise decays e^(G_i - G_j) of masked (non-positive)
    differences and a triangular solve instead of the block inverse, at HIGHEST precision."""
    _check(q, k, gate_cumsum, beta, 32)
    f32 = lambda x: x.astype(jnp.float32)
    q, k, g = f32(q), f32(k), gate_cumsum
    rows = jnp.arange(CHUNK)
    strict = rows[:, None] > rows[None, :]
    incl = rows[:, None] >= rows[None, :]
    diff = g[..., :, None, :] - g[..., None, :, :]  # [H, NC, C, C, K] G_i - G_j
    decay = lambda mask: jnp.exp(jnp.where(mask[:, :, None], diff, -jnp.inf))
    lower = beta[..., :, None] * jnp.einsum("hnik,hnjk,hnijk->hnij", k, k, decay(strict), precision=HIGHEST)
    aqk = jnp.einsum("hnik,hnjk,hnijk->hnij", q, k, decay(incl), precision=HIGHEST)
    eye = jnp.eye(CHUNK, dtype=jnp.float32)
    a = lax.linalg.triangular_solve(eye + lower, jnp.broadcast_to(eye, lower.shape), left_side=True, lower=True,
                                    unit_diagonal=True)
    return a * beta[..., None, :], aqk
