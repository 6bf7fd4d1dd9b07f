"""KDA chunked prefill, stage 1's WY factors (`kda_chunk(..., stage1="pallas2")`, after `kda_intra_lk`):

    W = (A diag(beta)) (e^G K)      U = (A diag(beta)) V        per head and chunk of C = 64 tokens

A diag(beta) [C, C] and e^G K [C, K] come from `kda_intra_lk` in the chunk layout (stored dtype); V is read
straight from the packed input through the chunk table (rows past the chunk's length are zeros). Two
[C, C] x [C, D] dots per program (stored-dtype operands, fp32 accumulation, as `_intra_stage_v2`'s einsums),
grid = chunks x heads. Kept apart from `kda_intra_lk` so that kernel keeps only [16, D] tiles live (its
row-block walk would otherwise hold every earlier block's e^G K and V for these products).
Traffic at B1 T32768 H32 D128 bf16: reads A diag(beta), e^G K, V (0.67 GB), writes W, U (0.54 GB).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kda_common import CHUNK, HIGHEST, dot, full_block, is_pow2_at_least_16


def _wu_kernel(start_ref, len_ref, v_ref, ab_ref, kw_ref, w_ref, u_ref):
    # start_ref, len_ref: [NC] int32 chunk table (first packed token, token count; 0 = unused chunk)
    # v_ref: [T(+C), H, V] packed; ab_ref: [C, C] A diag(beta), block of [H, NC, C, C]
    # kw_ref, w_ref: [C, K], blocks of [H, NC, C, K]; u_ref: [C, V], block of [H, NC, C, V]
    stored = w_ref.dtype
    prec = HIGHEST if stored == jnp.float32 else None  # bf16: tensor cores, fp32 accumulation
    c, h = pl.program_id(0), pl.program_id(1)
    start, count = start_ref[c], len_ref[c]
    valid = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0) < count
    a_beta = ab_ref[...]
    w_ref[...] = dot(a_beta, kw_ref[...], precision=prec).astype(stored)
    v = plt.load(v_ref.at[pl.ds(start, CHUNK), h, :], mask=jnp.broadcast_to(valid[:, None], (CHUNK, v_ref.shape[-1])),
                 other=0).astype(stored)
    u_ref[...] = dot(a_beta, v, precision=prec).astype(stored)


def _wu_call(tok_start, length, v, a_beta, kw, *, num_warps, num_stages, interpret):
    """pallas_call wrapper: grid = chunks x heads; v whole (read at the table's dynamic offset)."""
    h, num_chunks, _, dk = kw.shape
    dv = v.shape[2]
    stored = kw.dtype
    if interpret:  # interpret mode clamps an out-of-range dynamic slice instead of masking it: pad one chunk
        v = jnp.pad(v, ((0, CHUNK), (0, 0), (0, 0)))
    tile = lambda d: pl.BlockSpec((None, None, CHUNK, d), lambda cc, hh: (hh, cc, 0, 0))
    params = {} if interpret else dict(
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    return pl.pallas_call(
        _wu_kernel,
        grid=(num_chunks, h),
        in_specs=[full_block((num_chunks,)), full_block((num_chunks,)), full_block(v.shape), tile(CHUNK), tile(dk)],
        out_specs=[tile(dk), tile(dv)],
        out_shape=[jax.ShapeDtypeStruct((h, num_chunks, CHUNK, dk), stored),
                   jax.ShapeDtypeStruct((h, num_chunks, CHUNK, dv), stored)],
        interpret=interpret, name="kda_intra_wu", **params,
    )(tok_start, length, v, a_beta, kw)


def _check(tok_start, length, v, a_beta, kw):
    if kw.ndim != 4 or kw.shape[2] != CHUNK:
        raise ValueError(f"kw must be the chunk layout [H, NC, {CHUNK}, K]; got {kw.shape}")
    h, num_chunks, _, dk = kw.shape
    if a_beta.shape != (h, num_chunks, CHUNK, CHUNK) or a_beta.dtype != kw.dtype:
        raise ValueError(f"a_beta must be [H, NC, C, C] = {(h, num_chunks, CHUNK, CHUNK)} in kw's dtype {kw.dtype}; "
                         f"got {a_beta.dtype}{a_beta.shape}")
    if kw.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"kw / a_beta must be float32 or bfloat16; got {kw.dtype}")
    if v.ndim != 3 or v.shape[1] != h:
        raise ValueError(f"v must be packed [T, H, V] with H = {h}; got {v.shape}")
    for name, d in (("K", dk), ("V", v.shape[2])):
        if not is_pow2_at_least_16(d):
            raise ValueError(f"head dim {name}={d} must be a power of two >= 16 (Triton block shapes)")
    for name, x in (("token_start", tok_start), ("length", length)):
        if x.shape != (num_chunks,) or x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 [NC] = [{num_chunks}]; got {x.dtype}{x.shape}")


def kda_intra_wu(token_start, length, v, a_beta, kw, *, num_warps=4, num_stages=1, interpret=False):
    """W = a_beta kw and U = a_beta V per chunk and head (one Pallas kernel, grid = chunks x heads).

    Args:
      token_start, length: [NC] int32 chunk table (`kda_chunk.chunk_table`); v: [T, H, V] packed values.
      a_beta: [H, NC, C, C] A diag(beta) and kw: [H, NC, C, K] e^G K, from `kda_intra_lk` (same dtype, the
        stored dtype: bf16 dots on the tensor cores with fp32 accumulation, or IEEE fp32).
      num_warps, num_stages: Triton launch settings; interpret: Pallas interpret mode (CPU tests).

    Returns: w [H, NC, C, K], u [H, NC, C, V] in the stored dtype.
    """
    _check(token_start, length, v, a_beta, kw)
    return tuple(_wu_call(token_start, length, v, a_beta, kw, num_warps=num_warps, num_stages=num_stages,
                          interpret=interpret))


def kda_intra_wu_reference(token_start, length, v, a_beta, kw):
    """Plain-jnp twin of `kda_intra_wu`: gather V to chunks (zeros past each chunk's length), two einsums in
    fp32 at HIGHEST precision, rounded to the stored dtype."""
    _check(token_start, length, v, a_beta, kw)
    f32 = jnp.float32
    rows = jnp.arange(CHUNK, dtype=jnp.int32)
    valid = rows[None, :] < length[:, None]  # [NC, C]
    idx = jnp.where(valid, token_start[:, None] + rows[None, :], 0)
    vc = jnp.moveaxis(jnp.where(valid[..., None, None], v[idx].astype(kw.dtype).astype(f32), 0.0), 2, 0)
    ein = functools.partial(jnp.einsum, precision=HIGHEST)
    ab = a_beta.astype(f32)
    return ein("hnij,hnjk->hnik", ab, kw.astype(f32)).astype(kw.dtype), ein("hnij,hnjv->hniv", ab, vc).astype(kw.dtype)
