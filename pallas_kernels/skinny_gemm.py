"""Skinny GEMM: y = x @ w for the few rows of a decode step (M <= 128), streaming w once at full bandwidth.

    y [M, N] = x [M, K] @ w [K, N],  fp32 accumulation,  y in x's dtype

At decode the model's dense projections multiply 16-128 rows by weights of 0.25-670 MB: pure weight streaming.
XLA's choice for them on the H200 (k3-small decode step, 2026-12-01 profile) is a split-K-by-8 Triton GEMM writing
fp32 partials, plus a reduce fusion: two launches per projection, ~1.9 TB/s over the step's 2.3 GB of dense
weights. This kernel: program (n, s) owns the column tile n and the s-th of `split_k` slices of K,
runs its x [M, K/split_k] tile against the weight columns in `block_k` steps (the loop Triton pipelines, as any
matmul's), and with split_k = 1 stores y in x's dtype directly. With split_k > 1 (weights with few column
tiles: too few programs to keep 132 SMs streaming) it stores fp32 partials [split_k, M, N] that the wrapper sums
(a small XLA reduce over M x N, not over the weights: two launches again, as XLA's, so whether splitting beats
narrow column tiles without a split is for the H200 sweep to say).

Columns need not divide block_n: the last tile's loads and stores are masked (the fused projections are
ragged: 8336 columns in k3-small's KDA input). K must divide into split_k x block_k.

Pallas backend: Triton lowering (runs in interpret mode on CPU for CI).

Status: opt-in, measured not faster than XLA. The model reaches it through the "dense" op of the pallas / interpret
backends after k3jax.layers.use_dense_kernel("skinny") (default "xla": off). H200, 2026-12-02 (docs/benchmarks.md,
"Dense GEMMs at decode sizes"): tests/gpu/test_skinny_gemm_gpu.py passes (28 cases); benchmarks/dense_gemm.py --rows
64 puts the default tiling at 0.93-1.01x XLA's time on ten of k3-small's eleven shapes (lm_head 0.82x), with the best
swept tiling up to 1.6-2.0x on two (mla in_proj, mla q_b) and 1.0x on the rest; in the k3-small decode step
(benchmarks/model_forward.py --dense-kernel skinny --profile) its kernels take 0.98 ms/step where the XLA GEMMs they
replace took 1.05, and the step is unchanged (8.44 vs 8.43 ms back to back). The GEMMs of 4-34 MB run at 10-62 %
of copy bandwidth on either path; a fixed cost per launch (ramp-up, the split-K reduce) is the likely bound, not the
K loop (not profiled further). Offline (pip triton 3.6.0 + ptxas for sm_90a, not XLA's own Triton; docs/results/skinny_gemm_ptxas_sm90a_2026-12-02.json) the K loop compiles as intended: cp.async
global->shared loads over num_stages buffers feeding wgmma, 48-96 registers, no spills, 128 KB of shared memory per
CTA at block 64 x 128 and 4 stages (x's tile rides along with the weights' in every stage: one CTA per SM).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_ROWS = 128


@dataclasses.dataclass(frozen=True)
class SkinnyGemmConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def default_config(m: int, k: int, n: int, *, num_sms: int = 132) -> SkinnyGemmConfig:
    """The tiling for y[m, n] = x[m, k] @ w[k, n]: 64-column tiles, split along K (halving each program's slice)
    while the grid has fewer programs than SMs, keeping >= 2 x block_k rows of K per slice."""
    block_n = 64 if n >= 64 else max(16, 1 << (max(n, 1) - 1).bit_length())
    block_k = 128 if k % 128 == 0 else 64
    tiles = -(-n // block_n)
    split = 1
    while tiles * split < num_sms and k % (block_k * split * 2) == 0 and k // (split * 2) >= 2 * block_k:
        split *= 2
    return SkinnyGemmConfig(block_n=block_n, block_k=block_k, split_k=split)


def _skinny_kernel(x_ref, w_ref, y_ref, *, n_size: int, k_per_split: int, block_k: int, block_n: int,
                   split_k: int):
    # x_ref: [M, K] activations (whole, M a multiple of 16)
    # w_ref: [K, N] weights (whole; this program reads columns n0 .. n0 + block_n of its K slice)
    # y_ref: [M, N] out (split_k == 1) or [split_k, M, N] fp32 partials
    n_tile, k_slice = pl.program_id(0), pl.program_id(1)
    n0 = n_tile * block_n
    k_base = k_slice * k_per_split
    cols = n0 + jnp.arange(block_n)  # [block_n]
    col_ok = cols < n_size
    m = x_ref.shape[0]

    def step(i, acc):
        k0 = pl.multiple_of(k_base + i * block_k, block_k)
        a = x_ref[:, pl.ds(k0, block_k)]  # [M, block_k]
        w = plgpu.load(w_ref.at[pl.ds(k0, block_k), pl.ds(n0, block_n)], mask=col_ok[None, :], other=0.0)
        return acc + jnp.dot(a, w.astype(a.dtype), preferred_element_type=jnp.float32)  # [M, block_n]

    acc = jax.lax.fori_loop(0, k_per_split // block_k, step, jnp.zeros((m, block_n), jnp.float32))
    if split_k == 1:
        plgpu.store(y_ref.at[:, pl.ds(n0, block_n)], acc.astype(y_ref.dtype), mask=col_ok[None, :])
    else:
        plgpu.store(y_ref.at[k_slice, :, pl.ds(n0, block_n)], acc, mask=col_ok[None, :])


def skinny_matmul(x: jax.Array, w: jax.Array, *, config: SkinnyGemmConfig | None = None,
                  interpret: bool = False) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype, fp32 accumulation, for at most MAX_ROWS rows.

    config: tiling (`default_config(m, k, n)` when None). Raises ValueError for mismatched or oversized
    shapes, non-float inputs, or a K that does not divide into split_k x block_k.
    """
    if x.ndim < 1 or w.ndim != 2:
        raise ValueError(f"x must be [..., K] and w [K, N], got {list(x.shape)} and {list(w.shape)}")
    if not (jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(w.dtype, jnp.floating)):
        raise ValueError(f"x and w must be float, got {x.dtype} and {w.dtype}")
    *lead, k = x.shape
    k_w, n = w.shape
    if k != k_w:
        raise ValueError(f"x's last dim {k} must equal w's first dim {k_w}")
    m = 1
    for d in lead:
        m *= d
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"skinny_matmul takes 1..{MAX_ROWS} rows, got {m} (use a plain GEMM for more)")
    cfg = config or default_config(m, k, n)
    if k % (cfg.block_k * cfg.split_k):
        raise ValueError(f"K={k} must be a multiple of split_k x block_k = {cfg.split_k} x {cfg.block_k}")
    m_pad = max(16, -(-m // 16) * 16)  # the MMA's smallest row count
    x2 = x.reshape(m, k)
    if m_pad != m:
        x2 = jnp.pad(x2, ((0, m_pad - m), (0, 0)))
    grid = (pl.cdiv(n, cfg.block_n), cfg.split_k)
    out_shape = ((m_pad, n), x.dtype) if cfg.split_k == 1 else ((cfg.split_k, m_pad, n), jnp.float32)
    kernel = functools.partial(_skinny_kernel, n_size=n, k_per_split=k // cfg.split_k, block_k=cfg.block_k,
                               block_n=cfg.block_n, split_k=cfg.split_k)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(*out_shape),
        grid=grid,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=cfg.num_warps,
                                                                    num_stages=cfg.num_stages),
        interpret=interpret,
        name="skinny_matmul",
    )(x2, w)
    if cfg.split_k > 1:
        y = y.sum(axis=0).astype(x.dtype)
    return y[:m].reshape(*lead, n)


def skinny_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """The plain-JAX product the kernel computes (layers.dense's math)."""
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


__all__ = ["MAX_ROWS", "SkinnyGemmConfig", "default_config", "skinny_matmul", "skinny_matmul_reference"]
