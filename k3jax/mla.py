"""Gated multi-head latent attention, NoPE (k3-model.md §4): naive and absorbed forms.

Shapes: B batch, T query tokens, S key tokens, H heads, N = qk_nope dim, R = qk_rope dim (kept as a
content channel, never rotated), Vd = v dim, C = kv_lora_rank. One cached token is the 576-wide latent
[c (C, post-norm) | k_pe (R)], shared by all heads.

Naive form (no cache, `forward`): expand c through kv_b into per-head k_nope / v, then causal softmax.
Absorbed form (serving): q_hat_h = W_UK,h^T q_nope_h in latent space; scores against cached latents;
o_h = W_UV,h (sum_s p_s c_s). Both scale by (N + R)^-1/2 and are equal in exact arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax import backend, fuse
from k3jax.config import ModelConfig
from k3jax.layers import Linear, dense, dense_each_with, rms_norm

# `linear` (every function below that takes it): how the block multiplies by the weights reading or writing
# the hidden state -- q_a (or q_proj) and kv_a in `project`, g_proj and o_proj in `output` -- see
# `k3jax.layers.Linear`; default plain `dense`, a parallel strategy passes sharded GEMMs. Params in the serving
# layout (k3jax.fuse.fuse_for_serving: q|kv_a|g_proj as one "in_proj", one GEMM per step) take the default only.


def project(params: dict, x: jax.Array, cfg: ModelConfig, *, linear: Linear | None = None,
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries and the latent to cache for pre-normed x [B, T, D].

    Returns: q_nope [B, T, H, N], q_pe [B, T, H, R], latent [B, T, C + R] (= [c | k_pe]).
    """
    return _queries_and_latent(params, _input_projections(params, x, cfg, linear), cfg)


def _input_projections(params: dict, x: jax.Array, cfg: ModelConfig, linear: Linear | None, matmul=dense,
                       ) -> dict[str, jax.Array]:
    """The GEMMs reading x, {q_a or q_proj, kv_a} and, in the fused serving layout (k3jax.fuse: "in_proj" =
    q|kv_a|g_proj), the output gate's g_proj too: one GEMM, sliced. Otherwise `linear` over {q_a or q_proj, kv_a}
    (g_proj is multiplied in `output`, as before)."""
    if fuse.is_fused(params):
        if linear is not None:
            raise ValueError("MLA: params in the fused serving layout (k3jax.fuse.fuse_for_serving) take the default "
                             "linear only; a parallel strategy needs the unfused params")
        return fuse.split_columns(matmul(x, params[fuse.FUSED_INPUT]), fuse.mla_input_columns(cfg))
    q_in = "q_a" if cfg.q_lora_rank is not None else "q_proj"
    return (linear or dense_each_with(matmul))(x, {q_in: params[q_in], "kv_a": params["kv_a"]})


def _queries_and_latent(params: dict, proj: dict[str, jax.Array], cfg: ModelConfig, matmul=dense,
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`project` from the input projections `proj` (see `_input_projections`)."""
    b, t = proj["kv_a"].shape[:2]
    if cfg.q_lora_rank is not None:
        q = matmul(rms_norm(proj["q_a"], params["q_a_norm"], cfg.mla_norm_eps), params["q_b"])
    else:
        q = proj["q_proj"]
    q = q.reshape(b, t, cfg.mla_num_heads, cfg.mla_q_head_dim)
    kv = proj["kv_a"]
    c = rms_norm(kv[..., : cfg.kv_lora_rank], params["kv_a_norm"], cfg.mla_norm_eps)
    latent = jnp.concatenate([c, kv[..., cfg.kv_lora_rank :]], axis=-1)
    return q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :], latent


def output(params: dict, attn: jax.Array, x: jax.Array, cfg: ModelConfig, *, linear: Linear | None = None,
           gate_logits: jax.Array | None = None, matmul=dense) -> jax.Array:
    """Output gate (K3: attn * sigmoid(g_proj x)) and o_proj. attn: [B, T, H, Vd].
    gate_logits: g_proj x [B, T, H*Vd] when already computed (the fused input GEMM); else multiplied here.
    matmul: the default linear's GEMM (a backend's "dense" op)."""
    linear = linear or dense_each_with(matmul)
    b, t = attn.shape[:2]
    attn = attn.reshape(b, t, -1).astype(x.dtype)
    if cfg.mla_output_gate:
        if gate_logits is None:
            if fuse.is_fused(params):
                raise ValueError("MLA output: fused params hold g_proj inside in_proj; pass gate_logits")
            gate_logits = linear(x, {"g_proj": params["g_proj"]})["g_proj"]
        attn = attn * jax.nn.sigmoid(gate_logits)
    return linear(attn, {"o_proj": params["o_proj"]})["o_proj"]


def split_kv_b(params: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """kv_b [C, H*(N+Vd)] -> W_UK [C, H, N] and W_UV [C, H, Vd].

    The serving layout (k3jax.fuse) stores them split, head-major ([H, N, C], [H, C, Vd] fp32): the transposes
    here are views that XLA folds into the consuming GEMMs (no per-step slice, convert or weight transpose)."""
    if fuse.ABSORB_UK in params:
        return jnp.transpose(params[fuse.ABSORB_UK], (2, 0, 1)), jnp.transpose(params[fuse.ABSORB_UV], (1, 0, 2))
    w = params["kv_b"].reshape(cfg.kv_lora_rank, cfg.mla_num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
    return w[..., : cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim :]


def naive_attention(params: dict, x: jax.Array, cfg: ModelConfig, *, linear: Linear | None = None) -> jax.Array:
    """Causal MLA over x [B, T, D] alone (no cache), in the naive per-head form."""
    proj = _input_projections(params, x, cfg, linear)
    q_nope, q_pe, latent = _queries_and_latent(params, proj, cfg)
    c, k_pe = latent[..., : cfg.kv_lora_rank], latent[..., cfg.kv_lora_rank :]
    w_uk, w_uv = split_kv_b(params, cfg)
    k_nope = jnp.einsum("bsc,chn->bshn", c, w_uk.astype(c.dtype), preferred_element_type=jnp.float32)
    v = jnp.einsum("bsc,chv->bshv", c, w_uv.astype(c.dtype), preferred_element_type=jnp.float32)
    k_nope, v = k_nope.astype(x.dtype), v.astype(x.dtype)
    scores = (
        jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, preferred_element_type=jnp.float32)
        + jnp.einsum("bthr,bsr->bhts", q_pe, k_pe, preferred_element_type=jnp.float32)
    ) * cfg.mla_q_head_dim**-0.5
    t = x.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    attn = jnp.einsum("bhts,bshv->bthv", probs, v, preferred_element_type=jnp.float32)
    return output(params, attn, x, cfg, linear=linear, gate_logits=proj.get("g_proj"))


@backend.register("mla_paged_attention", "reference")
def paged_attention_reference(
    q_latent: jax.Array,
    q_pe: jax.Array,
    kv_pages: jax.Array,
    page_table: jax.Array,
    query_positions: jax.Array,
    *,
    kv_lora_rank: int,
    scale: float,
    layer: int | None = None,
) -> jax.Array:
    """Absorbed MLA over a paged latent cache (the cache already holds the new tokens).

    Args:
      q_latent: [B, T, H, C] absorbed queries (W_UK^T q_nope); q_pe: [B, T, H, R].
      kv_pages: [P, page_size, C + R] the layer's page pool, or the stacked pool [L_mla, P, page_size, C + R]
        with `layer`; page_table: [B, max_pages] page ids.
      query_positions: [B, T] absolute position of each query; it sees keys at positions <= its own.
      scale: softmax scale, (N + R)^-1/2.

    Returns: o_latent [B, T, H, C] fp32 (sum_s p_s c_s, before W_UV).
    """
    if layer is not None:
        kv_pages = kv_pages[layer]
    b, max_pages = page_table.shape
    page_size = kv_pages.shape[1]
    hist = kv_pages[page_table].reshape(b, max_pages * page_size, -1)  # [B, S, C+R]
    c, k_pe = hist[..., :kv_lora_rank], hist[..., kv_lora_rank:]
    scores = (
        jnp.einsum("bthc,bsc->bhts", q_latent, c.astype(q_latent.dtype), preferred_element_type=jnp.float32)
        + jnp.einsum("bthr,bsr->bhts", q_pe, k_pe.astype(q_pe.dtype), preferred_element_type=jnp.float32)
    ) * scale
    visible = jnp.arange(max_pages * page_size)[None, None, :] <= query_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhts,bsc->bthc", probs, c.astype(jnp.float32))


# The decode kernel of the "pallas" op: "triton" (pallas_kernels/mla_decode.py's Triton kernel) or "mosaic" (its
# Mosaic GPU kernel: TMA page copies, wgmma; bf16 pages and kv_lora_rank 512 only, other sizes fall back to Triton).
# Read at trace time. Mosaic, by the H200 (2026-11-30, benchmarks/model_forward.py --mla-kernel, k3-small decode B64 x
# 8k): the whole step took 12.07 ms against Triton's 13.41 at 34a154c, and 10.17 against 11.78 with the serving layout
# at eb8fe6f (MLA kernels 1.22 ms per step against 3.23; docs/results/model_decode_*_h200_2026-11-30f.json). The sixth
# session's contrary run (16.6 ms) shared its process with the reference backend and the shadow check.
MLA_DECODE_KERNEL = "mosaic"
# The "interpret" op's kernel (CPU CI): Triton, as the Mosaic GPU interpreter takes ~17 s per model-sized call; the
# Mosaic kernel's interpreter tests are in tests/kernels/test_mla_decode.py.
MLA_INTERPRET_KERNEL = "triton"


def _kernel_paged_attention(interpret: bool):
    """The "pallas" / "interpret" implementation of mla_paged_attention: the Pallas MLA kernels
    (pallas_kernels/mla_decode.py for q_len <= 8, with a balanced split plan built on device from the
    positions, Triton or Mosaic GPU as MLA_DECODE_KERNEL / MLA_INTERPRET_KERNEL say; mla_prefill.py for longer chunks). Sizes the
    kernels' Triton tiling cannot take (C or R not a power of two >= 16, page_size not a power of two <= 64: e.g.
    the tiny test configs) use the reference."""

    def attend(q_latent, q_pe, kv_pages, page_table, query_positions, *, kv_lora_rank, scale, layer=None):
        from pallas_kernels import mla_decode, mla_prefill  # imported on use: k3jax does not need Pallas

        kernel = MLA_INTERPRET_KERNEL if interpret else MLA_DECODE_KERNEL
        if kernel not in ("triton", "mosaic"):
            name = "MLA_INTERPRET_KERNEL" if interpret else "MLA_DECODE_KERNEL"
            raise ValueError(f"k3jax.mla.{name} must be 'triton' or 'mosaic', got {kernel!r}")
        if not mla_decode.supported(kv_lora_rank, q_pe.shape[-1], kv_pages.shape[-2], kv_pages.dtype):
            return paged_attention_reference(q_latent, q_pe, kv_pages, page_table, query_positions,
                                             kv_lora_rank=kv_lora_rank, scale=scale, layer=layer)
        if q_latent.shape[1] > mla_decode.MAX_Q_LEN:
            return mla_prefill.mla_prefill(q_latent, q_pe, kv_pages, page_table, query_positions,
                                           kv_lora_rank=kv_lora_rank, scale=scale, layer=layer, interpret=interpret)
        page_size = kv_pages.shape[-2]
        mosaic = kernel == "mosaic" and mla_decode.mgpu_supported(
            kv_lora_rank, q_pe.shape[-1], page_size, kv_pages.dtype,
            mla_decode.default_mgpu_block_kv(page_size))
        return mla_decode.mla_decode(q_latent, q_pe, kv_pages, page_table, query_positions, kv_lora_rank=kv_lora_rank,
                                     scale=scale, layer=layer, backend="mosaic" if mosaic else "triton",
                                     interpret=interpret)

    return attend


# The GPU registration was withheld while the Triton decode kernel differed from the reference on the H200; the cause
# was 2 Triton pipeline stages (miscompiled), and at 1 stage tests/gpu/test_mla_gpu.py passes (2026-11-30).
backend.register("mla_paged_attention", "pallas")(_kernel_paged_attention(interpret=False))
backend.register("mla_paged_attention", "interpret")(_kernel_paged_attention(interpret=True))


def write_latents(
    kv_pages: jax.Array, layer: int, latent: jax.Array, page_table: jax.Array, context_lens: jax.Array,
    lengths: jax.Array,
) -> jax.Array:
    """Writes latent [B, T, C+R] at positions context_lens + t (t < lengths) into layer `layer` of the
    stacked pool kv_pages [L_mla, P, page_size, C+R]; padding positions are dropped."""
    num_pages, page_size = kv_pages.shape[1:3]
    t = latent.shape[1]
    pos = context_lens[:, None] + jnp.arange(t)[None, :]  # [B, T]
    page = jnp.take_along_axis(page_table, jnp.minimum(pos // page_size, page_table.shape[1] - 1), axis=1)
    page = jnp.where(jnp.arange(t)[None, :] < lengths[:, None], page, num_pages)  # out of range -> dropped
    return kv_pages.at[layer, page, pos % page_size].set(latent.astype(kv_pages.dtype), mode="drop")


def paged_attention(
    params: dict,
    x: jax.Array,
    kv_pages: jax.Array,
    layer: int,
    page_table: jax.Array,
    context_lens: jax.Array,
    lengths: jax.Array,
    cfg: ModelConfig,
    *,
    backend_name: str = "reference",
    linear: Linear | None = None,
) -> tuple[jax.Array, jax.Array]:
    """MLA for new tokens x [B, T, D] appended after context_lens [B] cached tokens.

    Writes the new latents into layer `layer` of the stacked pool kv_pages [L_mla, P, page_size, C+R]
    (updated in place under donation), then attends in the absorbed form to the whole history.
    Returns (y [B, T, D], new kv_pages).
    """
    matmul = backend.get("dense", backend_name)
    proj = _input_projections(params, x, cfg, linear, matmul)
    q_nope, q_pe, latent = _queries_and_latent(params, proj, cfg, matmul)
    kv_pages = write_latents(kv_pages, layer, latent, page_table, context_lens, lengths)
    w_uk, w_uv = split_kv_b(params, cfg)
    q_latent = jnp.einsum("bthn,chn->bthc", q_nope, w_uk.astype(q_nope.dtype), preferred_element_type=jnp.float32)
    positions = context_lens[:, None] + jnp.arange(x.shape[1])[None, :]
    o_latent = backend.get("mla_paged_attention", backend_name)(
        q_latent.astype(x.dtype), q_pe, kv_pages, page_table, positions,
        kv_lora_rank=cfg.kv_lora_rank, scale=cfg.mla_q_head_dim**-0.5, layer=layer,
    )
    attn = jnp.einsum("bthc,chv->bthv", o_latent, w_uv.astype(jnp.float32))
    return output(params, attn, x, cfg, linear=linear, gate_logits=proj.get("g_proj"), matmul=matmul), kv_pages
