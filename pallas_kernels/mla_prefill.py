"""Pallas MLA prefill: causal absorbed attention of a chunk of new tokens against [cached prefix + chunk].

The model writes the chunk's latents into the request's pages before attending (k3jax/mla.py), so the
keys of a prefill are all paged: the prefix (a prefix-cache hit of any length, page-aligned or not, or
the earlier chunks of a chunked prefill) followed by the chunk itself. Query row (t, h) with position
pos[b, t] sees keys at positions <= pos.

Kernel: rows (t, h) flattened t-major and cut into blocks of `block_rows`; one program per (row block,
request), the row block fastest so that the blocks of one request run together and share its KV through
L2. Each program walks the KV blocks [0, ceil((max row position + 1) / block_kv)) -- the causal limit of
its last row, nothing beyond -- with the online softmax of mla_decode.attend_kv_blocks (pages gathered
through the page table, per-row causal mask, fp8 pages with per-token scales). No split plan is needed:
a prefill chunk has T*H/block_rows row blocks per request, enough programs to fill the GPU; decode-sized
queries (T <= 8) go to mla_decode, which splits the KV instead.

Pallas backend: the Triton lowering, for the reasons measured in mla_decode's docstring (tiled-matmul rate
of Pallas-Triton on the H200, in-kernel page gathers and data-dependent trip counts without scalar
prefetch, interpret mode for CPU CI). This is the absorbed form (2*(C+R+C) FLOP per head per key); a naive
(per-head k/v expanded, 2*(N+R+Vd)) prefill is ~3.4x fewer FLOPs for long prompts and is not built here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.mla_decode import (
    _check_inputs,
    _pad_page_table,
    _row_layout,
    attend_kv_blocks,
    default_block_kv,
    default_block_rows,
    default_num_stages,
    stacked_pool,
    mla_decode_reference,
    normalise,
)


def _prefill_kernel(
    q_ref,  # [block_rows, C+R] (block of [B, M_pad, C+R]) queries, rows (t, h) t-major
    row_pos_ref,  # [block_rows] int32 (block of [B, M_pad]) positions, -1 for padding rows
    page_table_ref,  # [B, max_pages_padded] int32
    layer_ref,  # [1] int32 layer of the stacked pool
    kv_ref,  # [L, P, page_size, C+R] latent pages
    *rest,  # kv_scale_ref [L, P, page_size] fp32 when has_scales, then out_ref [block_rows, C] fp32
    has_scales: bool,
    kv_lora_rank: int,
    block_kv: int,
    page_size: int,
    max_tokens: int,
    softmax_scale: float,
):
    kv_scale_ref = rest[0] if has_scales else None
    out_ref = rest[-1]
    b = pl.program_id(1)
    c_dim, r_dim = kv_lora_rank, q_ref.shape[-1] - kv_lora_rank
    q_c = q_ref[:, pl.ds(0, c_dim)]  # [block_rows, C]
    q_r = q_ref[:, pl.ds(c_dim, r_dim)]  # [block_rows, R]
    row_pos = row_pos_ref[...]  # [block_rows]
    last_key = jnp.minimum(jnp.max(row_pos) + 1, max_tokens)
    num_blocks = jnp.maximum(last_key + block_kv - 1, 0) // block_kv
    acc, m, l = attend_kv_blocks(
        q_c, q_r, row_pos, page_table_ref, b, kv_ref, kv_scale_ref, layer_ref[0], 0, num_blocks,
        kv_lora_rank=kv_lora_rank, block_kv=block_kv, page_size=page_size, softmax_scale=softmax_scale,
    )
    out_ref[...] = normalise(acc, m, l)[0]


def mla_prefill(
    q_latent: jax.Array,
    q_pe: jax.Array,
    kv_pages: jax.Array,
    page_table: jax.Array,
    query_positions: jax.Array,
    *,
    kv_lora_rank: int,
    scale: float,
    kv_scales: jax.Array | None = None,
    layer: int | jax.Array | None = None,
    block_kv: int | None = None,
    block_rows: int | None = None,
    num_warps: int = 8,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal absorbed MLA of new tokens over the paged cache (which already holds them).

    Args:
      q_latent: [B, T, H, C] absorbed queries; q_pe: [B, T, H, R].
      kv_pages: [P, page_size, C+R] one layer's pages, or the stacked pool [L, P, page_size, C+R] with `layer`
        (bf16/fp16/fp32 or float8_e4m3fn with kv_scales).
      page_table: [B, max_pages] int32 page ids in history order (any pool order).
      query_positions: [B, T] int32 absolute positions (context_len + t for a chunk after a prefix of
        context_len tokens; padding rows may carry any position); a query sees keys <= its position.
      kv_scales: kv_pages.shape[:-1] fp32 per-token scales, or None (= 1); layer: as mla_decode.
      block_kv / block_rows / num_warps / num_stages: tiling and Triton launch parameters (None: block_kv =
        max(64, page_size), block_rows = T*H rounded up to a power of two, at most 64; stages as mla_decode).
      interpret: run the Pallas interpreter (CPU).

    Returns: o_latent [B, T, H, C] fp32 (before W_UV).
    """
    page_size = kv_pages.shape[-2]
    block_kv = default_block_kv(page_size) if block_kv is None else block_kv
    block_rows = default_block_rows(q_latent.shape[1] * q_latent.shape[2], 64) if block_rows is None else block_rows
    num_stages = default_num_stages(kv_pages.dtype) if num_stages is None else num_stages
    _check_inputs(q_latent, q_pe, kv_pages, page_table, query_positions, kv_lora_rank, kv_scales, block_kv, block_rows,
                  layer)
    return _mla_prefill(q_latent, q_pe, kv_pages, page_table, query_positions, kv_scales, layer, kv_lora_rank=kv_lora_rank,
                        scale=float(scale), block_kv=block_kv, block_rows=block_rows, num_warps=num_warps,
                        num_stages=num_stages, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "scale", "block_kv", "block_rows", "num_warps",
                                             "num_stages", "interpret"))
def _mla_prefill(q_latent, q_pe, kv_pages, page_table, query_positions, kv_scales, layer, *, kv_lora_rank, scale, block_kv,
                 block_rows, num_warps, num_stages, interpret):
    kv_pages, kv_scales, layer = stacked_pool(kv_pages, kv_scales, layer)
    b, t, h, c_dim = q_latent.shape
    page_size = kv_pages.shape[-2]
    max_tokens = page_table.shape[1] * page_size
    q, row_pos, m_pad = _row_layout(q_latent, q_pe, query_positions, block_rows)
    page_table = _pad_page_table(page_table, block_kv // page_size)
    has_scales = kv_scales is not None
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    inputs = [q, row_pos, page_table, layer, kv_pages]
    in_specs = [
        pl.BlockSpec((None, block_rows, q.shape[-1]), lambda r, i: (i, r, 0)),
        pl.BlockSpec((None, block_rows), lambda r, i: (i, r)),
        full(page_table),
        full(layer),
        full(kv_pages),
    ]
    if has_scales:
        inputs.append(kv_scales)
        in_specs.append(full(kv_scales))
    out = pl.pallas_call(
        functools.partial(_prefill_kernel, has_scales=has_scales, kv_lora_rank=kv_lora_rank, block_kv=block_kv,
                          page_size=page_size, max_tokens=max_tokens, softmax_scale=scale),
        grid=(m_pad // block_rows, b),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_rows, c_dim), lambda r, i: (i, r, 0)),
        out_shape=jax.ShapeDtypeStruct((b, m_pad, c_dim), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_prefill",
    )(*inputs)
    return out[:, : t * h].reshape(b, t, h, c_dim)


def mla_prefill_reference(q_latent, q_pe, kv_pages, page_table, query_positions, *, kv_lora_rank: int, scale: float,
                          kv_scales=None, layer=None) -> jax.Array:
    """Plain-jnp fp32 reference (the paged absorbed attention of mla_decode_reference, any T)."""
    return mla_decode_reference(q_latent, q_pe, kv_pages, page_table, query_positions, kv_lora_rank=kv_lora_rank,
                                scale=scale, kv_scales=kv_scales, layer=layer)
