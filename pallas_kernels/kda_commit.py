"""Keeping a verify step's accepted prefix: the KDA state after `count` positions, rebuilt in the pool in place.

Verify (speculative decoding) does not write states: it returns every position's rank-one update of the V-first
state S [V, K] (k3jax.kda's module docstring),

    S_t = S_{t-1} * decay_t[None, :] + err_t[:, None] key_t[None, :]

and the pool keeps the state before the step. Once the target has accepted a prefix, this kernel reads each row's
state from its source slot, applies the first count[r] updates and writes the result to its destination slot: one
state read and one written per (layer, row, head), the floor of the job. XLA's gather -> update -> scatter of the
same math (`kda_commit_reference`) measured 2.2-2.8x slower than a copy of those bytes on the H200 (2026-12-03:
B64 H96 0.439 ms, B256 2.241 ms against 0.201 / 0.793 ms for a gather-scatter of stored states).

Measured on the H200 (2026-12-03, docs/benchmarks.md; raw docs/results/kda_commit_verify_h200_2026-12-03b.json), L1
H96 T4 with every row keeping all 4 positions: B64 0.250-0.266 ms, B256 0.957-1.003 ms (3.0-3.4 TB/s of state read
and written, 73-81 % of the XLA copy of the pool in the same run), against 0.440 / 2.236 ms for XLA's form. block_v
16 and 32 tie (8: 0.29 ms, 64: 0.30 ms, 128: 2.1 ms at B64; a whole 64 KB state per program, not profiled); 2, 4 and 8
warps tie at every block_v. Hence block_v 32, 4 warps.

Backend: Pallas Triton lowering, grid (V / block_v, H, L * n): each program owns block_v state rows of one
(layer, row, head) and keeps them in registers across the T positions; the operands are read through the row's slot
indices (ordinary int32 inputs) and the pool is aliased to the output, so the caller's donated pool is updated in
place. The delta rule is row-separable over V, so programs share nothing.

Precondition (not checkable inside jit): the destination slots are distinct, and none is another row's source (a
row's destination may be its own source: the main commit; a checkpoint's is a free slot). Rows that share a slot
must compute the same state there (the serving engine's padding rows: one scratch slot, fresh and idle, all zeros).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

DEFAULT_BLOCK_V = 32
NUM_WARPS = 4


def _commit_kernel(src_ref, dst_ref, count_ref, fresh_ref, pool_ref, err_ref, key_ref, decay_ref, out_ref, *,
                   num_rows, block_v, num_tokens):
    # src_ref, dst_ref, count_ref, fresh_ref: [n] int32 (fresh != 0: start from zeros, whatever the slot holds)
    # pool_ref: [L, P, H, V, K] fp32 state pool (aliased to out_ref: rows are written in place)
    # err_ref: [L, n, T, H, V]; key_ref, decay_ref: [L, n, T, H, K] fp32, each position's update
    # out_ref: [L, P, H, V, K] the pool, row r's block written at its destination slot
    vb, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, r = i // num_rows, i % num_rows
    rows = pl.ds(vb * block_v, block_v)
    count = count_ref[r]
    s = pool_ref[layer, src_ref[r], h, rows, :]  # [block_v, K]
    s = jnp.where(fresh_ref[r] != 0, 0.0, s)  # a select: exact zeros over NaN / inf garbage
    for t in range(num_tokens):
        stepped = (s * decay_ref[layer, r, t, h, :][None, :]
                   + err_ref[layer, r, t, h, rows][:, None] * key_ref[layer, r, t, h, :][None, :])
        s = jnp.where(t < count, stepped, s)
    out_ref[layer, dst_ref[r], h, rows, :] = s


def _check(pool, err, key, decay, src, dst, count, fresh):
    if pool.ndim != 5 or pool.dtype != jnp.float32:
        raise ValueError(f"pool must be a [L, P, H, V, K] fp32 state pool; got {pool.shape} {pool.dtype}")
    layers, _, h, dv, dk = pool.shape
    n, t = (err.shape[1], err.shape[2]) if err.ndim == 5 else (None, None)
    if err.shape != (layers, n, t, h, dv) or key.shape != (layers, n, t, h, dk) or decay.shape != key.shape:
        raise ValueError(f"updates must be err [L={layers}, n, T, H={h}, V={dv}], key / decay [L, n, T, H, K={dk}]; "
                         f"got {err.shape}, {key.shape}, {decay.shape}")
    for name, a in (("src", src), ("dst", dst), ("count", count), ("fresh", fresh)):
        if a.shape != (n,):
            raise ValueError(f"{name} must be [n={n}]; got {a.shape}")


def kda_commit_reference(pool, err, key, decay, src, dst, count, fresh):
    """Plain-jnp twin of `kda_commit`: gather the source rows (zeros where fresh), apply the updates, scatter."""
    from k3jax.kda import apply_verify_updates  # (here: k3jax.kda registers this module's functions as it loads)

    _check(pool, err, key, decay, src, dst, count, fresh)
    before = pool[:, src]  # [L, n, H, V, K]
    before = jnp.where((fresh != 0)[None, :, None, None, None], 0.0, before)
    return pool.at[:, dst].set(apply_verify_updates(before, err, key, decay, count[None, :]))


@functools.partial(jax.jit, static_argnames=("block_v", "interpret"))
def kda_commit(pool, err, key, decay, src, dst, count, fresh, *, block_v=None, interpret=False):
    """The KDA state after the first count[r] verify positions of row r, written to pool[:, dst[r]].

    Args:
      pool: [L, P, H, V, K] fp32 state pool; row r's state before the verify step is at pool[:, src[r]]. Donate it
        for an in-place update (it is aliased to the result).
      err: [L, n, T, H, V]; key, decay: [L, n, T, H, K] fp32, the verify step's per-position updates.
      src, dst: [n] int32 slots (dst distinct, and none another row's src); count: [n] int32 positions to keep
        (clamped to 0..T by the arithmetic: t < count); fresh: [n] bool / int, rows that start from zeros.
      block_v: state rows per program, a power of two dividing V (None: min(32, V)).

    Returns: the pool with each row's kept state at its destination slot; every other slot unchanged.
    """
    _check(pool, err, key, decay, src, dst, count, fresh)
    layers, _, h, dv, dk = pool.shape
    n, t = err.shape[1], err.shape[2]
    block_v = min(DEFAULT_BLOCK_V, dv) if block_v is None else block_v
    if not isinstance(block_v, int) or block_v < 1 or block_v & (block_v - 1) or dv % block_v:
        raise ValueError(f"block_v must be a power of two dividing V = {dv}; got {block_v!r}")
    if n == 0:
        return pool
    ints = [a.astype(jnp.int32) for a in (src, dst, count, fresh)]
    ins = [*ints, pool, err.astype(jnp.float32), key.astype(jnp.float32), decay.astype(jnp.float32)]
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731 (refs indexed by slot)
    return pl.pallas_call(
        functools.partial(_commit_kernel, num_rows=n, block_v=block_v, num_tokens=t),
        grid=(dv // block_v, h, layers * n),
        in_specs=[full(x) for x in ins],
        out_specs=full(pool),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={4: 0},
        compiler_params=None if interpret else plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="kda_commit",
    )(*ins)


__all__ = ["kda_commit", "kda_commit_reference"]
