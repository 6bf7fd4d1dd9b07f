"""KDA chunked prefill, stage 2 (split, fla's layout of the work): a sequential state pass that only
advances the state, then the output as one parallel einsum.

Same inputs, math and results as the fused pass (`kda_state_pass`, which see), per head and chunk:

    V' = U - W S^T      S <- S * e^(G_C) + V'^T (e^(G_C - G) K)      O = (e^G Q) S^T + Aqk V'

The Pallas walk (grid = sequences x heads x V-blocks, the [BV, K] fp32 state block in registers) stores
every chunk's starting state S and V' in the stored dtype, plus the final state and the page checkpoints;
O is then one batched, fully parallel tensor-core einsum (XLA) over all chunks and a gather back to the
packed token order (tokens in no chunk, e.g. seq_lens padding, get 0).

Measured on the H200 (benchmarks/kda.py, docs/results/kda_h200_2026-11-30.json), B1 T32768 H32 D128
bf16: the walk 1.97 ms (fused pass 1.80 ms) plus the output einsum; the whole prefill 8.15 ms with this
pass vs 7.84 ms with the fused one, so `kda_chunk` keeps "fused" as the default and this as an option.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kda_common import (
    CHUNK, HIGHEST, bdot, check_state_pass_args, dot, full_block, pick_block_v, store_checkpoint,
)
from pallas_kernels.kda_state_pass import kda_state_pass_reference


def _state_h_kernel(first_ref, ckpt_idx_ref, w_ref, u_ref, kg_ref, gc_ref, s0_ref,
                    h_ref, vnew_ref, final_ref, ckpt_ref, *, block_v, has_ckpt):
    # first_ref: [N+1] int32; ckpt_idx_ref: [NC] int32
    # w_ref, kg_ref: [H, NC, C, K]; u_ref: [H, NC, C, V]; gc_ref: [H, NC, K] fp32; s0_ref: [BV, K] (of [N, H, V, K])
    # h_ref: [H, NC, V, K] state before each chunk (stored dtype); vnew_ref: [H, NC, C, V] (stored dtype)
    # final_ref: [BV, K]; ckpt_ref: [NCK, H, V, K] fp32
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * block_v, block_v)
    stored = w_ref.dtype
    prec = HIGHEST if stored == jnp.float32 else None

    def chunk(c, s):  # s: [BV, K] fp32, the state before chunk c
        sd = s.astype(stored)
        h_ref[h, c, vs, :] = sd
        v_new = u_ref[h, c, :, vs].astype(jnp.float32) - dot(w_ref[h, c], sd, tb=True, precision=prec)  # [C, BV]
        vd = v_new.astype(stored)
        vnew_ref[h, c, :, vs] = vd
        s = s * gc_ref[h, c][None, :] + dot(vd, kg_ref[h, c], ta=True, precision=prec)
        if has_ckpt:
            store_checkpoint(ckpt_ref, ckpt_idx_ref[c], h, vs, s)
        return s

    s = lax.fori_loop(first_ref[n], first_ref[n + 1], chunk, s0_ref[...].astype(jnp.float32))
    final_ref[...] = s


def _from_chunks(y, tok_start, length, t):
    """Chunk layout [H, NC, C, ...] -> packed [T, H, ...]; tokens in no chunk (seq_lens padding) get 0."""
    rows = jnp.arange(CHUNK, dtype=jnp.int32)
    num_chunks = tok_start.shape[0]
    valid = rows[None, :] < length[:, None]
    dest = jnp.where(valid, tok_start[:, None] + rows[None, :], t)  # t = dropped
    owner = jnp.full((t,), num_chunks, jnp.int32).at[dest.reshape(-1)].set(
        jnp.broadcast_to(jnp.arange(num_chunks, dtype=jnp.int32)[:, None], dest.shape).reshape(-1), mode="drop")
    covered = owner < num_chunks
    chunk = jnp.where(covered, owner, 0)
    pos = jnp.where(covered, jnp.arange(t, dtype=jnp.int32) - tok_start[chunk], 0)
    out = jnp.moveaxis(y, 0, 2)[chunk, pos]  # [T, H, ...]
    return jnp.where(covered.reshape((t,) + (1,) * (out.ndim - 1)), out, 0)


def _state_split_call(first, tok_start, length, ckpt_idx, w, u, qg, kg, aqk, gc, initial_state, *, t, n, page,
                      block_v, out_dtype, interpret, num_warps):
    """pallas_call wrapper (grid = sequences x heads x V-blocks, whole-array chunk blocks, one [BV, K] state
    block per program), then the output einsum and the gather to packed order."""
    h, num_chunks, _, dk = w.shape
    dv = u.shape[3]
    block_v = pick_block_v(n, h, dv, block_v)
    num_ckpt = t // page + n if page else 1
    state_block = pl.BlockSpec((None, None, block_v, dk), lambda nn, hh, vv: (nn, hh, vv, 0))
    params = {} if interpret else dict(compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2))
    states, v_new, final, ckpt = pl.pallas_call(
        functools.partial(_state_h_kernel, block_v=block_v, has_ckpt=bool(page)),
        grid=(n, h, dv // block_v),
        in_specs=[full_block((n + 1,)), full_block((num_chunks,)), full_block(w.shape), full_block(u.shape),
                  full_block(kg.shape), full_block(gc.shape), state_block],
        out_specs=[full_block((h, num_chunks, dv, dk)), full_block(u.shape), state_block,
                   full_block((num_ckpt, h, dv, dk))],
        out_shape=[jax.ShapeDtypeStruct((h, num_chunks, dv, dk), w.dtype), jax.ShapeDtypeStruct(u.shape, w.dtype),
                   jax.ShapeDtypeStruct((n, h, dv, dk), jnp.float32),
                   jax.ShapeDtypeStruct((num_ckpt, h, dv, dk), jnp.float32)],
        interpret=interpret, name="kda_chunk_state_h", **params,
    )(first, ckpt_idx, w, u, kg, gc, initial_state.astype(jnp.float32))
    # Chunks past the table's end (length 0) were never visited: their state / V' rows are garbage, but
    # only rows of chunks with length > 0 reach the output below.
    prec = HIGHEST if w.dtype == jnp.float32 else None
    o = bdot("hcik,hcvk->hciv", qg, states, prec) + bdot("hcij,hcjv->hciv", aqk, v_new, prec)  # [H, NC, C, V]
    o = _from_chunks(o.astype(out_dtype), tok_start, length, t)
    return o, final, (ckpt if page else None)


def kda_state_pass_split(first, token_start, length, checkpoint_index, w, u, qg, kg, aqk, gate_last, initial_state,
                         *, num_tokens, checkpoint_page_size=0, block_v=None, out_dtype=None, num_warps=None,
                         interpret=False):
    """Split KDA state pass (Pallas walk + XLA output einsum): same arguments and results as
    `kda_state_pass`, except that output rows in no chunk are 0 rather than unwritten.

    Args: see `pallas_kernels.kda_state_pass.kda_state_pass` (here num_warps None means 4, and block_v None is
    picked by `kda_common.pick_block_v`).
    Returns: o [T, H, V], final_state [N, H, V, K] fp32, checkpoints [T // page + N, H, V, K] fp32 or None.
    """
    page = checkpoint_page_size or 0
    check_state_pass_args(first, token_start, length, checkpoint_index, w, u, qg, kg, aqk, gate_last,
                          initial_state, num_tokens, page)
    return _state_split_call(first, token_start, length, checkpoint_index, w, u, qg, kg, aqk, gate_last,
                             initial_state, t=num_tokens, n=first.shape[0] - 1, page=page, block_v=block_v,
                             out_dtype=out_dtype or w.dtype, interpret=interpret, num_warps=num_warps or 4)


def kda_state_pass_split_reference(*args, **kwargs):
    """Plain-jnp twin of `kda_state_pass_split`: the split pass computes exactly what the fused one does
    (only where O is formed differs), so its reference is `kda_state_pass_reference` (rows in no chunk 0)."""
    return kda_state_pass_reference(*args, **kwargs)
