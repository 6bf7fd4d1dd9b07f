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

Variants (keywords of `kda_state_pass` and `kda_chunk`), with the offline evidence that led to them (pip
triton 3.6 TTGIR/PTX + ptxas sm_90a, docs/results/kda_state_pass_ptxas_sm90a_2026-12-01.json). Timed on the
H200 on 2026-12-01 (whole prefill with the Pallas stage 1; docs/benchmarks.md): 3 stages + K-first at V-block
32 took B1 T32768 H32 from 4.29 ms (2 stages, V-first) to 3.70 ms, so V-blocks of 16 / 32 now default to it
in bf16 (`kda_common.pick_state_tiling`, which also picks the V-block). Since the tenth session every bf16 V-block
runs K-first at 3 stages (2 at V-block 128), and the rule prefers the widest V-block with >= 96 programs (W, Qg, Kg
and Aqk are read once per V-block program: at H96, V-block 128 took B1 T32768 from 11.54 to 10.13-10.19 ms) when no
checkpoints are asked for; with checkpoints (eleventh session) the widest up to 64, K-first, the checkpoint store
under a branch (K-first transposes the state for it):
- num_stages: at 2 Triton issues chunk c+1's copies (W, Qg, Kg, U, Aqk) at the end of step c and waits for
  them (cp.async.wait_group 0) at the top of step c+1, so the load latency is paid every chunk; at 3 the loop
  top waits with one chunk's copies still in flight. +60 KB shared memory per CTA.
- state_layout="k_first": the walk keeps S^T [K, BV], so W S^T and e^G Q S^T read it as their B operand as
  is and the update Kg^T V' has M = 128 rows: four wgmma dots, no mma.sync, fewer registers (bv32 4 warps
  177 -> 156; bv64 4 warps no longer spills). Transposed once at each end and at checkpoints.
- output_order: O's dots and store before ("first"), around ("between") or after ("last") the update. Every
  wgmma wait is 0 in this lowering (no dot has a loop-carried accumulator with pipelined operands), so the
  order moves registers (bv32: 177 / 167 / 141) but does not overlap O's dots with the chain.
- checkpoint_branch: a pl.when around the checkpoint store instead of a masked store on every chunk.
Two [BV, 64] K-halves as fla were not built: with k_first the [128, BV] update is already two m64 wgmma
behind one wait; halves would add waits, not shorten the chain.

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
    CHUNK, HIGHEST, check_state_pass_args, dot, full_block, pick_state_tiling, store_checkpoint,
)


def _state_kernel(first_ref, start_ref, len_ref, ckpt_idx_ref, w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gc_ref,
                  s0_ref, o_ref, final_ref, ckpt_ref, *, block_v, has_ckpt, k_first, output_order,
                  checkpoint_branch):
    # first_ref: [N+1] int32 first chunk of each sequence; start_ref, len_ref, ckpt_idx_ref: [NC] int32
    # w_ref, qg_ref, kg_ref: [H, NC, C, K]; u_ref: [H, NC, C, V]; aqk_ref: [H, NC, C, C]; gc_ref: [H, NC, K] fp32
    # s0_ref: [BV, K] (block of [N, H, V, K]); o_ref: [T, H, V]; final_ref: [BV, K]; ckpt_ref: [NCK, H, V, K]
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * block_v, block_v)
    stored = w_ref.dtype
    prec = HIGHEST if stored == jnp.float32 else None
    rows = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    # k_first keeps the state as S^T [K, BV]: then W S^T and e^G Q S^T take it as their B operand as is, and
    # the update Kg^T V' has M = K = 128 rows (a Hopper wgmma), where V'^T Kg has M = BV = 16/32 (mma.sync).
    v_first = lambda s: s.T if k_first else s  # walk's state <-> the refs' [BV, K] block (either way)

    def chunk(c, s):  # s: [BV, K] fp32 ([K, BV] if k_first), the state before chunk c
        w, qg, kg = w_ref[h, c], qg_ref[h, c], kg_ref[h, c]  # [C, K]
        u = u_ref[h, c, :, vs].astype(jnp.float32)  # [C, BV]
        aqk = aqk_ref[h, c]  # [C, C]
        gc = gc_ref[h, c]  # [K]
        sd = s.astype(stored)
        v_new = u - dot(w, sd, tb=not k_first, precision=prec)  # [C, BV]
        vd = v_new.astype(stored)

        def output_dots():  # O of chunk c from the state before it (sd) and V': no part of the state's chain
            return dot(qg, sd, tb=not k_first, precision=prec) + dot(aqk, vd, precision=prec)  # [C, BV]

        def store_output(o):
            plt.store(o_ref.at[pl.ds(start_ref[c], CHUNK), h, vs], o.astype(o_ref.dtype),
                      mask=(rows < len_ref[c])[:, None])

        if output_order != "last":
            o = output_dots()
            if output_order == "first":
                store_output(o)
        if k_first:
            s = s * gc[:, None] + dot(kg, vd, ta=True, precision=prec)  # [K, BV]
        else:
            s = s * gc[None, :] + dot(vd, kg, ta=True, precision=prec)  # [BV, K]
        if output_order == "last":
            o = output_dots()
        if output_order != "first":
            store_output(o)
        if has_ckpt:
            idx = ckpt_idx_ref[c]
            if checkpoint_branch:  # only chunks that end on a page pay for the (transposed) state store
                @pl.when(idx >= 0)
                def _():
                    ckpt_ref[idx, h, vs, :] = v_first(s)
            else:
                store_checkpoint(ckpt_ref, idx, h, vs, v_first(s))
        return s

    s = lax.fori_loop(first_ref[n], first_ref[n + 1], chunk, v_first(s0_ref[...].astype(jnp.float32)))
    final_ref[...] = v_first(s)


def _state_call(first, tok_start, length, ckpt_idx, w, u, qg, kg, aqk, gc, initial_state, *, t, n, page, block_v,
                out_dtype, interpret, num_warps, num_stages, k_first, output_order, checkpoint_branch):
    """pallas_call wrapper: grid = sequences x heads x V-blocks, whole-array blocks for the chunk tensors
    (the kernel indexes chunks itself) and one [BV, K] state block per program."""
    h, num_chunks, _, dk = w.shape
    dv = u.shape[3]
    tp = t + CHUNK if interpret else t  # interpret mode clamps out-of-range stores instead of masking them
    num_ckpt = t // page + n if page else 1
    state_block = pl.BlockSpec((None, None, block_v, dk), lambda nn, hh, vv: (nn, hh, vv, 0))
    params = {} if interpret else dict(
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    o, final, ckpt = pl.pallas_call(
        functools.partial(_state_kernel, block_v=block_v, has_ckpt=bool(page), k_first=k_first,
                          output_order=output_order, checkpoint_branch=checkpoint_branch),
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
                   num_tokens, checkpoint_page_size=0, block_v=None, out_dtype=None, num_warps=None, num_stages=None,
                   state_layout=None, output_order="between", checkpoint_branch=None, interpret=False):
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
      block_v, num_warps: V-block and Triton warps; out_dtype: O's dtype (default the stored dtype);
        interpret: Pallas interpret mode (CPU tests). block_v, num_warps, num_stages and state_layout left None
        are picked by `kda_common.pick_state_tiling` from N x H, V and the stored dtype (the H200's measured best).
      num_stages: Triton's software-pipeline depth over the chunk loop. At 2 the next chunk's loads are
        issued at the end of a step and waited for at the top of the next, so their latency is not hidden;
        3 keeps one chunk's loads in flight through a whole step (offline TTGIR/ptxas, see the module doc);
        bf16 only: the fp32 stored dtype at 3 stages needs 256 KB of shared memory.
      state_layout: "v_first" (the state block as [BV, K], today's measured default) or "k_first" (kept
        as S^T [K, BV] in the walk, transposed only at the ends: all four dots become Hopper wgmma).
      output_order: where O's two dots and its store sit in a chunk step: "between" (today's: dots, then the
        state update, then the store), "first" (dots and store, then the update: O dies early) or "last"
        (the chain V' -> S first, then O's dots and store).
      checkpoint_branch: store checkpoints under a branch on the chunk's index instead of a masked store
        that every chunk pays for. None: True with K-first and a page (K-first transposes the state for the
        store: the branch keeps that to page-ending chunks; `pick_state_tiling`'s timings), else False.
        All four are variants with the same results up to rounding order.

    Returns:
      o: [T, H, V] (rows in no chunk are left unwritten), final_state: [N, H, V, K] fp32, checkpoints:
      [T // page + N, H, V, K] fp32 (rows never indexed are unspecified) or None without a page.
    """
    page = checkpoint_page_size or 0
    check_state_pass_args(first, token_start, length, checkpoint_index, w, u, qg, kg, aqk, gate_last,
                          initial_state, num_tokens, page)
    block_v, num_warps, num_stages, state_layout = pick_state_tiling(
        first.shape[0] - 1, w.shape[0], u.shape[3], w.dtype, block_v, num_warps, num_stages, state_layout,
        checkpoints=bool(checkpoint_page_size))
    if state_layout not in ("v_first", "k_first"):
        raise ValueError(f"state_layout must be 'v_first' or 'k_first'; got {state_layout!r}")
    if output_order not in ("between", "first", "last"):
        raise ValueError(f"output_order must be 'between', 'first' or 'last'; got {output_order!r}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1; got {num_stages}")
    if checkpoint_branch is None:
        checkpoint_branch = state_layout == "k_first" and bool(page)
    return _state_call(first, token_start, length, checkpoint_index, w, u, qg, kg, aqk, gate_last, initial_state,
                       t=num_tokens, n=first.shape[0] - 1, page=page, block_v=block_v,
                       out_dtype=out_dtype or w.dtype, interpret=interpret, num_warps=num_warps,
                       num_stages=num_stages, k_first=state_layout == "k_first",
                       output_order=output_order, checkpoint_branch=checkpoint_branch)


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
