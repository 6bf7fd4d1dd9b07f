"""Feed-forward blocks (k3-model.md §5): the dense MLP of layer 0 and K3's "Stable LatentMoE".

For a token x (already post_attention_layernorm'd, full width D):
  router (fp32): s = sigmoid(W_r x); select top-k of s + bias; weights = s_sel / sum(s_sel) * scaling
  routed: z = W_down x (latent width); y = sum_i w_i E_i(z) (fp32 accumulation); y = W_up RMSNorm(y)
  shared: gated MLP on the full-width x
The expert computation is grouped: assignments are sorted by expert and each expert multiplies its
contiguous group (`jax.lax.ragged_dot`), never a dense all-experts matmul. The "pallas" and "interpret"
backends of op "moe_experts" run pallas_kernels/moe_gemm.py (fused GLU epilogue, in-kernel MXFP4).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from k3jax import backend
from k3jax.config import ModelConfig
from k3jax.layers import dense, glu_activation, mlp, rms_norm
from k3jax.quant import dequantize_experts
from pallas_kernels import moe_gemm


def route(router_w: jax.Array, bias: jax.Array, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Expert ids [N, k] int32 and routing weights [N, k] fp32 for tokens x [N, D].

    The correction bias steers *selection* only; weights use the unbiased scores (pitfall 7).
    """
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), router_w.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits) if cfg.router_score == "sigmoid" else jax.nn.softmax(logits, -1)
    choice = scores + bias.astype(jnp.float32)[None, :]
    if cfg.num_expert_group > 1 and cfg.num_expert_group > cfg.topk_group:
        n = x.shape[0]
        grouped = choice.reshape(n, cfg.num_expert_group, -1)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)
        group_mask = jnp.zeros_like(group_score, bool).at[jnp.arange(n)[:, None], keep].set(True)
        choice = jnp.where(group_mask[:, :, None], grouped, -jnp.inf).reshape(n, -1)
    _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.num_experts_per_tok > 1 and cfg.moe_renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * cfg.routed_scaling_factor


@backend.register("moe_experts", "reference")
def grouped_experts_reference(
    x: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict, cfg: ModelConfig
) -> jax.Array:
    """sum_i w_i E_i(x) for tokens x [N, Dx] routed to ids/weights [N, k]; result in x's dtype.

    experts: {"gate", "up": [E, Dx, I], "down": [E, I, Dx]} in any float dtype, or MXFP4-packed in the
    checkpoint's or the kernel's layout (see k3jax.quant), dequantised here (bit-identically for both).
    """
    n, k = ids.shape
    experts = dequantize_experts(experts, x.dtype)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // k
    group_sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    xs = x[token]  # [N*k, Dx]

    def grouped(lhs, w):
        return jax.lax.ragged_dot(lhs, w.astype(lhs.dtype), group_sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)

    h = glu_activation(grouped(xs, experts["gate"]), grouped(xs, experts["up"]), cfg)
    y = grouped(h, experts["down"]).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(y).astype(x.dtype)


def _grouped_experts_pallas(x: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict, cfg: ModelConfig,
                            *, interpret: bool) -> jax.Array:
    """`grouped_experts_reference` on the Pallas grouped GEMM (MXFP4 entries stay packed and are decoded in
    the kernel: fastest in the kernel layout, load_pretrained(experts="kernel"))."""
    return moe_gemm.moe_grouped_mlp(
        x, ids, weights, experts, activation="silu" if cfg.hidden_act == "silu" else "situ",
        situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta, interpret=interpret,
    )


backend.register("moe_experts", "pallas")(partial(_grouped_experts_pallas, interpret=False))
backend.register("moe_experts", "interpret")(partial(_grouped_experts_pallas, interpret=True))


def moe(params: dict, x: jax.Array, cfg: ModelConfig, *, backend_name: str = "reference") -> jax.Array:
    """Latent MoE + shared experts on pre-normed x [..., D]."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    ids, weights = route(params["router"], params["router_bias"], xf, cfg)
    z = dense(xf, params["latent_down"]) if cfg.moe_latent_size else xf
    y = backend.get("moe_experts", backend_name)(z, ids, weights, params["experts"], cfg)
    if cfg.moe_latent_size:
        if cfg.moe_latent_norm:
            y = rms_norm(y, params["latent_norm"], cfg.rms_norm_eps)
        y = dense(y, params["latent_up"])
    if cfg.num_shared_experts:
        y = y + mlp(params["shared"], xf, cfg)
    return y.reshape(shape)


def ffn(params: dict, x: jax.Array, cfg: ModelConfig, *, backend_name: str = "reference") -> jax.Array:
    """The layer's feed-forward: `moe` if the layer has one, else the dense gated MLP."""
    if "router" in params:
        return moe(params, x, cfg, backend_name=backend_name)
    return mlp(params, x, cfg)
