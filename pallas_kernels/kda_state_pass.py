"""KDA chunked prefill, stage 2 (fused): the sequential state pass that also forms every chunk's output.

Inputs are stage 1's per-chunk tensors (`pallas_kernels.kda_chunk._intra_stage`, chunk layout
[H, NC, C, ...], C = 64) and the chunk table (`kda_chunk.chunk_table`). Per head, a sequence's chunks in
order, with S the V-first [V, K] fp32 state before the chunk:

    V' = U - W S^T      O = (e^G Q) S^T + Aqk V'      S <- S * e^(G_C) + V'^T (e^(G_C - G) K)

Grid = sequences x heads x V-blocks; each program keeps its [BV, K] state block in registers for the
whole walk, stores O straight into the packed [T, H, V] output (masked past the chunk's length), the
final state, and the state after every chunk whose checkpoint index is >= 0 (chunks ending on a page).

Why Pallas: a sequential walk with the state in registers, per-sequence dynamic trip counts and masked
checkpoint stores would otherwise be a lax.scan of one small XLA step per chunk. Measured on the H200
(benchmarks/kda.py, docs/results/kda_h200_2026-11-30.json), B1 T32768 H32 D128 bf16: this pass alone
1.80 ms (default V-block 16, 4 warps); the whole prefill with it 7.84 ms vs 8.15 ms with the split pass
(`kda_state_pass_split`), so it is `kda_chunk`'s default. Mosaic GPU was not tried.

Precision: operands in the stored dtype (bf16: tensor cores, fp32 accumulation; fp32: IEEE, HIGHEST),
the state itself always fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kda_common import (
    CHUNK, HIGHEST, check_state_pass_args, dot, full_block, pick_block_v, store_checkpoint,
)


def _state_kernel(first_ref, start_ref, len_ref, ckpt_idx_ref, w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gc_ref,
                  s0_ref, o_ref, final_ref, ckpt_ref, *, block_v, has_ckpt):
    # first_ref: [N+1] int32 first chunk of each sequence; start_ref, len_ref, ckpt_idx_ref: [NC] int32
    # w_ref, qg_ref, kg_ref: [H, NC, C, K]; u_ref: [H, NC, C, V]; aqk_ref: [H, NC, C, C]; gc_ref: [H, NC, K] fp32
    # s0_ref: [BV, K] (block of [N, H, V, K]); o_ref: [T, H, V]; final_ref: [BV, K]; ckpt_ref: [NCK, H, V, K]
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * block_v, block_v)
    stored = w_ref.dtype
    prec = HIGHEST if stored == jnp.float32 else None
    rows = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)

    def chunk(c, s):  # s: [BV, K] fp32, the state before chunk c
        w, qg, kg = w_ref[h, c], qg_ref[h, c], kg_ref[h, c]  # [C, K]
        u = u_ref[h, c, :, vs].astype(jnp.float32)  # [C, BV]
        aqk = aqk_ref[h, c]  # [C, C]
        gc = gc_ref[h, c]  # [K]
        sd = s.astype(stored)
        v_new = u - dot(w, sd, tb=True, precision=prec)  # [C, BV]
        vd = v_new.astype(stored)
        o = dot(qg, sd, tb=True, precision=prec) + dot(aqk, vd, precision=prec)
        s = s * gc[None, :] + dot(vd, kg, ta=True, precision=prec)
        plt.store(o_ref.at[pl.ds(start_ref[c], CHUNK), h, vs], o.astype(o_ref.dtype),
                  mask=(rows < len_ref[c])[:, None])
        if has_ckpt:
            store_checkpoint(ckpt_ref, ckpt_idx_ref[c], h, vs, s)
        return s

    s = lax.fori_loop(first_ref[n], first_ref[n + 1], chunk, s0_ref[...].astype(jnp.float32))
    final_ref[...] = s


def _state_call(first, tok_start, length, ckpt_idx, w, u, qg, kg, aqk, gc, initial_state, *, t, n, page, block_v,
                out_dtype, interpret, num_warps):
    """pallas_call wrapper: grid = sequences x heads x V-blocks, whole-array blocks for the chunk tensors
    (the kernel indexes chunks itself) and one [BV, K] state block per program."""
    h, num_chunks, _, dk = w.shape
    dv = u.shape[3]
    tp = t + CHUNK if interpret else t  # interpret mode clamps out-of-range stores instead of masking them
    block_v = pick_block_v(n, h, dv, block_v)
    num_ckpt = t // page + n if page else 1
    state_block = pl.BlockSpec((None, None, block_v, dk), lambda nn, hh, vv: (nn, hh, vv, 0))
    params = {} if interpret else dict(compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2))
    o, final, ckpt = pl.pallas_call(
        functools.partial(_state_kernel, block_v=block_v, has_ckpt=bool(page)),
        grid=(n, h, dv // block_v),
        in_specs=[full_block((n + 1,)), full_block((num_chunks,)), full_block((num_chunks,)),
                  full_block((num_chunks,)), full_block(w.shape), full_block(u.shape), full_block(qg.shape),
                  full_block(kg.shape), full_block(aqk.shape), full_block(gc.shape), state_block],
        out_specs=[full_block((tp, h, dv)), state_block, full_block((num_ckpt, h, dv, dk))],
        out_shape=[jax.ShapeDtypeStruct((tp, h, dv), out_dtype), jax.ShapeDtypeStruct((n, h, dv, dk), jnp.float32),
                   jax.ShapeDtypeStruct((num_ckpt, h, dv, dk), jnp.float32)],
        interpret=interpret, name="kda_chunk_state", **params,
    )(first, tok_start, length, ckpt_idx, w, u, qg, kg, aqk, gc, initial_state.astype(jnp.float32))
    return o[:t], final, (ckpt if page else None)


def kda_state_pass(first, token_start, length, checkpoint_index, w, u, qg, kg, aqk, gate_last, initial_state, *,
                   num_tokens, checkpoint_page_size=0, block_v=None, out_dtype=None, num_warps=4, interpret=False):
    """Fused KDA state pass over packed sequences (one Pallas kernel): walks each sequence's chunks.

    Args:
      first: [N+1] int32, sequence n owns chunks first[n]..first[n+1] (`kda_chunk.chunk_table`).
      token_start, length: [NC] int32, each chunk's first packed token and its token count (0 = unused).
      checkpoint_index: [NC] int32, the checkpoint row written after the chunk, or -1 for none.
      w, qg, kg: [H, NC, C, K] W, e^G Q and e^(G_C - G) K; u: [H, NC, C, V] U; aqk: [H, NC, C, C], all in
        one stored dtype (bf16 or fp32); gate_last: [H, NC, K] fp32 e^(G_C).
      initial_state: [N, H, V, K] V-first state of each sequence (cast to fp32).
      num_tokens: T, the packed output's length; checkpoint_page_size: 0 (no checkpoints) or the page,
        a multiple of 64: sizes the checkpoint output as T // page + N rows.
      block_v, num_warps: V-block (None: picked from N x H) and Triton warps; out_dtype: O's dtype
        (default the stored dtype); interpret: Pallas interpret mode (CPU tests).

    Returns:
      o: [T, H, V] (rows in no chunk are left unwritten), final_state: [N, H, V, K] fp32, checkpoints:
      [T // page + N, H, V, K] fp32 (rows never indexed are unspecified) or None without a page.
    """
    page = checkpoint_page_size or 0
    check_state_pass_args(first, token_start, length, checkpoint_index, w, u, qg, kg, aqk, gate_last,
                          initial_state, num_tokens, page)
    return _state_call(first, token_start, length, checkpoint_index, w, u, qg, kg, aqk, gate_last, initial_state,
                       t=num_tokens, n=first.shape[0] - 1, page=page, block_v=block_v,
                       out_dtype=out_dtype or w.dtype, interpret=interpret, num_warps=num_warps)


def kda_state_pass_reference(first, token_start, length, checkpoint_index, w, u, qg, kg, aqk, gate_last,
                             initial_state, *, num_tokens, checkpoint_page_size=0, out_dtype=None):
    """Plain-jnp twin of `kda_state_pass` (same arguments and results; rows in no chunk come back 0).

    The inter-chunk step of k3jax.kda.kda_chunked_reference on stage 1's precomputed tensors, in fp32 at
    HIGHEST precision: one lax.scan over the chunk table, each step advancing the state of the sequence
    that owns the chunk (chunks past first[N] change nothing)."""
    page = checkpoint_page_size or 0
    check_state_pass_args(first, token_start, length, checkpoint_index, w, u, qg, kg, aqk, gate_last,
                          initial_state, num_tokens, page)
    out_dtype = out_dtype or w.dtype
    f32 = lambda x: x.astype(jnp.float32)
    n = first.shape[0] - 1
    num_chunks = w.shape[1]
    owner = jnp.clip(jnp.searchsorted(first[1:], jnp.arange(num_chunks), side="right"), 0, n - 1)
    used = jnp.arange(num_chunks) < first[-1]
    ein = functools.partial(jnp.einsum, precision=HIGHEST)
    per_chunk = tuple(jnp.moveaxis(f32(x), 1, 0) for x in (w, u, qg, kg, aqk, gate_last))  # [NC, H, ...]

    def step(states, xs):
        seq, use, (w_c, u_c, qg_c, kg_c, aqk_c, gl_c) = xs
        s = states[seq]  # [H, V, K]
        v_new = u_c - ein("hck,hvk->hcv", w_c, s)
        o = ein("hck,hvk->hcv", qg_c, s) + ein("hcj,hjv->hcv", aqk_c, v_new)
        s = s * gl_c[:, None, :] + ein("hcv,hck->hvk", v_new, kg_c)
        states = jnp.where(use, states.at[seq].set(s), states)
        return states, (o, s)

    final, (o, after) = lax.scan(step, f32(initial_state), (owner, used, per_chunk))  # o [NC, H, C, V]
    rows = jnp.arange(CHUNK)
    dest = jnp.where(rows[None, :] < length[:, None], token_start[:, None] + rows[None, :], num_tokens)
    o_packed = jnp.zeros((num_tokens,) + o.shape[1:2] + o.shape[3:], jnp.float32)
    o_packed = o_packed.at[dest].set(jnp.swapaxes(o, 1, 2), mode="drop").astype(out_dtype)  # [T, H, V]
    ckpt = None
    if page:
        ckpt = jnp.zeros((num_tokens // page + n,) + after.shape[1:], jnp.float32)
        ckpt = ckpt.at[jnp.where(checkpoint_index >= 0, checkpoint_index, ckpt.shape[0])].set(after, mode="drop")
    return o_packed, final, ckpt
