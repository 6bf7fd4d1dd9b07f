"""Parameter structure and random initialisation.

Parameters are a plain pytree of nested dicts (lists for the layer stack); linear weights are stored
[in, out]. The structure, written once here, is what `weights.py` maps HF checkpoint names onto:

    embed [V, D]   lm_head [D, V] (absent when tied)   norm [D]
    output_attn_res_norm [D]   output_attn_res_proj [D]                     (AttnRes only)
    layers[l]:
      input_layernorm [D]  post_attention_layernorm [D]
      self_attention_res_norm / _proj, mlp_res_norm / _proj [D]              (AttnRes only)
      attn (KDA): q_proj k_proj v_proj [D, H*K]; q_conv k_conv v_conv [W, H*K] (fp32, tap W-1 = current
            token); f_a [D, r]; f_b [r, H*K]; dt_bias [H*K] (fp32); A_log [H] (fp32); b_proj [D, H];
            g_proj [D, H*K] or g_a [D, rank] + g_b [rank, H*K]; o_norm [K]; o_proj [H*K, D]
      attn (MLA): q_a [D, Q] + q_a_norm [Q] + q_b [Q, H*(N+R)]  or  q_proj [D, H*(N+R)];
            kv_a [D, C+R]; kv_a_norm [C]; kv_b [C, H*(N+Vd)]; g_proj [D, H*Vd] (gated); o_proj [H*Vd, D]
      mlp (dense): gate up [D, I]; down [I, D]
      mlp (MoE): router [D, E]; router_bias [E] (fp32); latent_down [D, Dl]; latent_norm [Dl];
            latent_up [Dl, D]; experts {gate, up: [E, Dl, Ie]; down: [E, Ie, Dl]};
            shared {gate, up: [D, Is]; down: [Is, D]}

Initialisation follows the public recipes: normal(0.02) projections, fla's A_log / dt_bias init
(A_log = log U(1, 16), or zeros for the lower-bound gate; dt log-uniform in [1e-3, 1e-1]), PyTorch's
Conv1d default for the short convs, ones for norm gains. The AttnRes pseudo-queries and the router
correction bias, zero in a fresh training run, get small random values so that random-weight models
exercise the depth softmax and the biased selection.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax.linen import initializers

from k3jax.config import ModelConfig

INIT_STD = 0.02


class _Keys:
    """Deterministic per-parameter keys: fold the running count into the root key."""

    def __init__(self, key: jax.Array):
        self.key, self.count = key, 0

    def __call__(self) -> jax.Array:
        self.count += 1
        return jax.random.fold_in(self.key, self.count)


def _normal(keys: _Keys, shape, dtype, std: float = INIT_STD) -> jax.Array:
    return initializers.normal(std)(keys(), shape, jnp.float32).astype(dtype)


def _kda_params(cfg: ModelConfig, keys: _Keys, dtype) -> dict:
    d, h, dk, w = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_kernel
    hk = h * dk
    conv_bound = 1.0 / math.sqrt(w)  # torch Conv1d default (kaiming uniform, fan_in = kernel size)
    conv = lambda: initializers.uniform(2 * conv_bound)(keys(), (w, hk), jnp.float32) - conv_bound
    dt = jnp.exp(jax.random.uniform(keys(), (hk,), minval=math.log(1e-3), maxval=math.log(1e-1)))
    dt = jnp.maximum(dt, 1e-4)
    if cfg.kda_gate == "lower_bound":
        a_log = jnp.zeros((h,), jnp.float32)
    else:
        a_log = jnp.log(jax.random.uniform(keys(), (h,), minval=1.0, maxval=16.0))
    p = {
        "q_proj": _normal(keys, (d, hk), dtype),
        "k_proj": _normal(keys, (d, hk), dtype),
        "v_proj": _normal(keys, (d, hk), dtype),
        "q_conv": conv(),
        "k_conv": conv(),
        "v_conv": conv(),
        "f_a": _normal(keys, (d, cfg.kda_gate_rank), dtype),
        "f_b": _normal(keys, (cfg.kda_gate_rank, hk), dtype),
        "dt_bias": dt + jnp.log(-jnp.expm1(-dt)),  # inverse softplus
        "A_log": a_log,
        "b_proj": _normal(keys, (d, h), dtype),
        "o_norm": jnp.ones((dk,), dtype),
        "o_proj": _normal(keys, (hk, d), dtype),
    }
    if cfg.kda_output_gate_rank is None:
        p["g_proj"] = _normal(keys, (d, hk), dtype)
    else:
        p["g_a"] = _normal(keys, (d, cfg.kda_output_gate_rank), dtype)
        p["g_b"] = _normal(keys, (cfg.kda_output_gate_rank, hk), dtype)
    return p


def _mla_params(cfg: ModelConfig, keys: _Keys, dtype) -> dict:
    d, h = cfg.hidden_size, cfg.mla_num_heads
    p = {}
    if cfg.q_lora_rank is not None:
        p["q_a"] = _normal(keys, (d, cfg.q_lora_rank), dtype)
        p["q_a_norm"] = jnp.ones((cfg.q_lora_rank,), dtype)
        p["q_b"] = _normal(keys, (cfg.q_lora_rank, h * cfg.mla_q_head_dim), dtype)
    else:
        p["q_proj"] = _normal(keys, (d, h * cfg.mla_q_head_dim), dtype)
    p["kv_a"] = _normal(keys, (d, cfg.latent_cache_dim), dtype)
    p["kv_a_norm"] = jnp.ones((cfg.kv_lora_rank,), dtype)
    p["kv_b"] = _normal(keys, (cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim)), dtype)
    if cfg.mla_output_gate:
        p["g_proj"] = _normal(keys, (d, h * cfg.v_head_dim), dtype)
    p["o_proj"] = _normal(keys, (h * cfg.v_head_dim, d), dtype)
    return p


def _glu_params(keys: _Keys, d_in: int, d_hidden: int, dtype, lead: tuple[int, ...] = ()) -> dict:
    return {
        "gate": _normal(keys, (*lead, d_in, d_hidden), dtype),
        "up": _normal(keys, (*lead, d_in, d_hidden), dtype),
        "down": _normal(keys, (*lead, d_hidden, d_in), dtype),
    }


def _moe_params(cfg: ModelConfig, keys: _Keys, dtype) -> dict:
    d, e = cfg.hidden_size, cfg.num_experts
    p = {
        "router": _normal(keys, (d, e), dtype),
        "router_bias": _normal(keys, (e,), jnp.float32, std=0.01),
        "experts": _glu_params(keys, cfg.expert_width, cfg.moe_intermediate_size, dtype, lead=(e,)),
    }
    if cfg.moe_latent_size:
        p["latent_down"] = _normal(keys, (d, cfg.moe_latent_size), dtype)
        if cfg.moe_latent_norm:
            p["latent_norm"] = jnp.ones((cfg.moe_latent_size,), dtype)
        p["latent_up"] = _normal(keys, (cfg.moe_latent_size, d), dtype)
    if cfg.num_shared_experts:
        p["shared"] = _glu_params(keys, d, cfg.shared_intermediate_size, dtype)
    return p


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Random parameters for `cfg` (use `jax.eval_shape(init_params, cfg, key)` for shapes only)."""
    dtype = jnp.dtype(cfg.dtype)
    keys = _Keys(key)
    d = cfg.hidden_size
    layers = []
    for l in range(cfg.num_layers):
        layer = {"input_layernorm": jnp.ones((d,), dtype), "post_attention_layernorm": jnp.ones((d,), dtype)}
        if cfg.attn_res_block_size is not None:
            for name in ("self_attention_res", "mlp_res"):
                layer[f"{name}_norm"] = jnp.ones((d,), dtype)
                layer[f"{name}_proj"] = _normal(keys, (d,), dtype)
        layer["attn"] = _mla_params(cfg, keys, dtype) if cfg.is_mla(l) else _kda_params(cfg, keys, dtype)
        layer["mlp"] = _moe_params(cfg, keys, dtype) if cfg.is_moe(l) else _glu_params(keys, d, cfg.intermediate_size, dtype)
        layers.append(layer)
    params = {"embed": _normal(keys, (cfg.vocab_size, d), dtype), "layers": layers, "norm": jnp.ones((d,), dtype)}
    if cfg.attn_res_block_size is not None:
        params["output_attn_res_norm"] = jnp.ones((d,), dtype)
        params["output_attn_res_proj"] = _normal(keys, (d,), dtype)
    if not cfg.tie_word_embeddings:
        params["lm_head"] = _normal(keys, (d, cfg.vocab_size), dtype)
    return params


def param_shapes(cfg: ModelConfig) -> dict:
    """The parameter pytree of `cfg` as jax.ShapeDtypeStruct leaves (no memory is allocated)."""
    return jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))


def count_params(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
