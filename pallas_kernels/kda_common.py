"""Constants and small helpers shared by the KDA chunked-prefill kernels (no kernel here).

The chunked prefill is split one kernel per file: `kda_chunk` (public entry, XLA intra-chunk stage,
orchestration, reference), `kda_chunk_solve` (opt-in Pallas L / Aqk + block inverse), `kda_state_pass`
(fused sequential state pass) and `kda_state_pass_split` (split state pass + its output einsum). They all
use the chunk layout [H, NC, C, ...] with C = CHUNK tokens per chunk and this module's conventions.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

CHUNK = 64
SUB = 16  # sub-block of the triangular inverse
NSUB = CHUNK // SUB
HIGHEST = lax.Precision.HIGHEST
MAX_DIAG_EXPONENT = 80.0  # e^80 < 3.4e38 / 128 (a dot of 128 such terms stays finite)


def dot(a, b, *, ta=False, tb=False, precision=None):
    """a @ b (a^T if ta, b^T if tb) with fp32 accumulation."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def bdot(spec, a, b, precision):
    """Batched einsum with fp32 accumulation (XLA, tensor cores for bf16 operands)."""
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def identity(n):
    """[n, n] fp32 identity built from iotas (lowers inside Triton kernels, unlike jnp.eye)."""
    return jnp.where(lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1), 1.0, 0.0)


def full_block(shape):
    """A block covering the whole array: the kernel indexes it itself (dynamic chunk / token offsets)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def store_checkpoint(ckpt_ref, idx, h, vs, s):
    """Inside a state-pass kernel: writes the state s [BV, K] after a chunk as checkpoint row `idx` of
    ckpt_ref [P, H, V, K] (head h, V-block vs); idx < 0 marks a chunk that ends on no page boundary."""
    plt.store(ckpt_ref.at[jnp.maximum(idx, 0), h, vs, :], s, mask=jnp.full(s.shape, idx >= 0))


def is_pow2_at_least_16(d):
    return d >= 16 and not d & (d - 1)


def check_state_pass_args(first, token_start, length, checkpoint_index, w, u, qg, kg, aqk, gate_last,
                          initial_state, num_tokens, checkpoint_page_size):
    """ValueError checks shared by the fused and split state passes (same inputs, see `kda_state_pass`)."""
    if w.ndim != 4 or w.shape[2] != CHUNK:
        raise ValueError(f"w must be the chunk layout [H, NC, {CHUNK}, K]; got {w.shape}")
    h, num_chunks, _, dk = w.shape
    if qg.shape != w.shape or kg.shape != w.shape:
        raise ValueError(f"qg and kg must be shaped like w {w.shape}; got {qg.shape}, {kg.shape}")
    if u.ndim != 4 or u.shape[:3] != w.shape[:3]:
        raise ValueError(f"u must be [H, NC, C, V] with H, NC, C = {w.shape[:3]}; got {u.shape}")
    dv = u.shape[3]
    for name, d in (("K", dk), ("V", dv)):
        if not is_pow2_at_least_16(d):
            raise ValueError(f"head dim {name}={d} must be a power of two >= 16 (Triton block shapes)")
    if len({w.dtype, u.dtype, qg.dtype, kg.dtype, aqk.dtype}) != 1:
        raise ValueError(f"w, u, qg, kg, aqk must share the stored dtype; got "
                         f"{[x.dtype for x in (w, u, qg, kg, aqk)]}")
    if aqk.shape != (h, num_chunks, CHUNK, CHUNK):
        raise ValueError(f"aqk must be [H, NC, C, C] = {(h, num_chunks, CHUNK, CHUNK)}; got {aqk.shape}")
    if gate_last.shape != (h, num_chunks, dk) or gate_last.dtype != jnp.float32:
        raise ValueError(f"gate_last must be fp32 [H, NC, K] = {(h, num_chunks, dk)}; got "
                         f"{gate_last.dtype}{gate_last.shape}")
    for name, x in (("token_start", token_start), ("length", length), ("checkpoint_index", checkpoint_index)):
        if x.shape != (num_chunks,) or x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 [NC] = [{num_chunks}]; got {x.dtype}{x.shape}")
    if first.ndim != 1 or first.shape[0] < 2 or first.dtype != jnp.int32:
        raise ValueError(f"first must be int32 [N+1], N >= 1; got {first.dtype}{first.shape}")
    n = first.shape[0] - 1
    if initial_state.shape != (n, h, dv, dk):
        raise ValueError(f"initial_state must be V-first [N, H, V, K] = {(n, h, dv, dk)}; got {initial_state.shape}")
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1; got {num_tokens}")
    if checkpoint_page_size < 0 or checkpoint_page_size % CHUNK:
        raise ValueError(f"checkpoint_page_size must be 0 or a positive multiple of {CHUNK}; "
                         f"got {checkpoint_page_size}")


def pick_state_tiling(n, h, dv, stored, block_v=None, num_warps=None, num_stages=None, state_layout=None,
                      checkpoints=False):
    """The fused state pass's (block_v, num_warps, num_stages, state_layout): given values are kept, the
    others follow the whole-prefill sweeps on the H200 (docs/benchmarks.md; kda_chunk with the Pallas stage 1;
    programs = sequences x heads x V-blocks).

    bf16 without checkpoints (tenth session, 2026-12-01, benchmarks/kda_state_tiling.py): the widest V-block that
    still launches >= 96 programs, 4 warps, K-first, 3 pipeline stages (2 at V-block 128: 3 do not fit in shared
    memory). Every program reads its chunks' whole W, e^G Q, e^(G_C-G) K and Aqk whatever its V-block, so narrow
    V-blocks multiply that traffic; a wide V-block pays in programs. Whole prefill, ms:
    - B8 T4096 H32 (256 programs at 128): 128 3.42, 64 3.55 (2 stages V-first 3.87, the previous rule);
    - B1 T32768 H96 (96 at 128): 128 10.13-10.19, 64 10.20-10.37, 32 11.54-11.61 (the previous rule);
    - B8 T4096 H96 (768 at 128): 128 10.07, 64 10.40 (2 stages V-first 11.22, the previous rule);
    - B2 T16384 H32 (64 at 128, 128 at 64): 64 3.28, 128 3.74, 32 3.72;
    - B1 T32768 H32 (32 at 128, 64 at 64, 128 at 32): 32 3.59, 64 3.63, 128 4.57.
    Below 96 programs at 32, 16 (k3-small's 16 heads at B1). 8 warps were slower at 64 and 128 (B1 H96 11.89 /
    11.16 ms), 2 warps at 128 many times slower (spills).

    bf16 with checkpoints (the prefix cache's prefill; eleventh session, 2026-12-01): the widest V-block up to 64
    with >= 96 programs, K-first, 3 stages, and `kda_state_pass` stores the checkpoints under a branch
    (checkpoint_branch, its default with K-first and a page): K-first transposes the state for the checkpoint store,
    and the branch keeps that to page-ending chunks. V-block 128 stays out: even branched it cost +44 % at B1 T32768
    H96 (14.67 ms). Whole prefill at page size 256 against the same shape without checkpoints (3.574 / 3.431 /
    10.179 / 10.199 ms for B1 T32768 H32 / B8 T4096 H32 / B8 T4096 H96 / B1 T32768 H96):
    - this rule (32 branched at B1 H32, 64 branched elsewhere): +2.4 / +7.6 / +7.2 / +7.5 %;
    - the previous rule (64 at 2 stages V-first from 2 x 132 programs, else 32 K-first, masked): +5.8 / +14.8 /
      +14.3 / +17.6 %; 64 branched at B1 H32 +11.2 %; 32 branched at B8 +22 % (H32) / +23 % (H96).
    fp32: 64 at 2 stages V-first from 2 x 132 programs, else 32 or 16 (3 stages need 256 KB of shared memory)."""
    programs = lambda bv: n * h * (dv // bv) if dv % bv == 0 else 0
    bf16 = stored == jnp.bfloat16
    if block_v is None:
        if bf16:
            widths = (64, 32) if checkpoints else (128, 64, 32)
            block_v = next((bv for bv in widths if bv <= dv and programs(bv) >= 96), 16)
        else:
            block_v = 64 if programs(64) >= 2 * 132 else 32 if programs(32) >= 128 else 16
        block_v = min(block_v, dv)
    k_first = bf16
    num_warps = 4 if num_warps is None else num_warps
    if num_stages is None:
        num_stages = (2 if block_v >= 128 else 3) if k_first else 2
    state_layout = ("k_first" if k_first else "v_first") if state_layout is None else state_layout
    if dv % block_v:
        raise ValueError(f"block_v={block_v} must divide V={dv}")
    return block_v, num_warps, num_stages, state_layout


def pick_block_v(n, h, dv, block_v):
    """The state passes' V-block: given, or the largest of 64/32/16 that still gives sequences x heads x
    V-blocks >= 2 x 132 programs (the H200's SMs twice) when sequences x heads are few."""
    if block_v is None:
        block_v = min(dv, 64)
        while block_v > 16 and n * h * (dv // block_v) < 2 * 132:
            block_v //= 2
    if dv % block_v:
        raise ValueError(f"block_v={block_v} must divide V={dv}")
    return block_v
