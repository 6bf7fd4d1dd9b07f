"""TEP, the baseline: tensor-parallel attention + expert-parallel MoE, every rank seeing every token.

Over a 1-D mesh of n ranks (axis "x"):
  - KDA and MLA heads are split over the ranks (q/k/v/gate/output projections by head; MLA's shared
    latent projection kv_a, its norm and the latent KV cache are replicated: every rank writes the same
    latents). Each rank's o_proj gives a partial sum: all-reduce #1.
  - MoE: the router and latent_down are replicated; rank r runs its E/n experts on every token's
    assignments to them; the latent-width partial sums are all-reduced (#2) before latent_norm (which
    is nonlinear, so the sum must be complete) and the replicated latent_up. The shared experts (and
    layer 0's dense MLP) are split along their hidden width: all-reduce #3.
  - Embedding, norms, AttnRes and lm_head are replicated.
So a MoE layer all-reduces three [tokens, width] payloads (widths D, Dl, D) and every rank holds all B*T
tokens: per rank a ring all-reduce moves 2(n-1)/n of each, ~2 x tokens payloads (the "2BN" of the
published analysis, B tokens per rank and N ranks).

Heads, experts and hidden widths that do not divide by n are zero-padded (a zero head / expert / unit
contributes exactly zero), so k3-tiny's 3 heads and 7 experts run on 8 ranks. TEP state: the KDA
recurrent and conv states are split by head (see `shard_state`); MLA pages are replicated.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax import backend
from k3jax.config import ModelConfig
from k3jax.layers import dense, mlp, rms_norm
from k3jax.model import DecodeState, StepMeta, embed, last_token_hidden, lm_head
from k3jax.moe import route
from k3jax.parallel.common import (AXIS, cache_free_mixer, cached_mixer, check_tokens, mesh_size, pad_groups, padded,
                                   run_decoder)

_KDA_BY_HEAD_COLS = ("q_proj", "k_proj", "v_proj", "q_conv", "k_conv", "v_conv", "f_b", "b_proj", "g_proj", "g_b")
_MLA_BY_HEAD_COLS = ("q_b", "q_proj", "kv_b", "g_proj")


def local_attention_cfg(cfg: ModelConfig, ranks: int) -> ModelConfig:
    """The per-rank attention config: the padded head counts divided by the rank count."""
    return cfg.replace(kda_num_heads=padded(cfg.kda_num_heads, ranks) // ranks,
                       mla_num_heads=padded(cfg.mla_num_heads, ranks) // ranks)


def local_expert_cfg(cfg: ModelConfig, ranks: int) -> ModelConfig:
    """The per-rank expert config (the grouped-experts op reads num_experts for its group sizes)."""
    local = padded(cfg.num_experts, ranks) // ranks
    return cfg.replace(num_experts=local, num_experts_per_tok=min(cfg.num_experts_per_tok, local))


def _split(x: jax.Array, axis: int, groups: int, ranks: int) -> tuple[jax.Array, P]:
    spec = [None] * x.ndim
    spec[axis % x.ndim] = AXIS
    return pad_groups(x, axis, groups, padded(groups, ranks)), P(*spec)


def _replicated(tree):
    return tree, jax.tree.map(lambda _: P(), tree)


def _attention(p: dict, cfg: ModelConfig, mla_layer: bool, n: int) -> tuple[dict, dict]:
    out, specs = {}, {}
    heads = cfg.mla_num_heads if mla_layer else cfg.kda_num_heads
    by_cols = _MLA_BY_HEAD_COLS if mla_layer else _KDA_BY_HEAD_COLS
    for name, w in p.items():
        if name in by_cols:
            out[name], specs[name] = _split(w, -1, heads, n)
        elif name == "o_proj" or name in ("dt_bias", "A_log"):
            out[name], specs[name] = _split(w, 0, heads, n)
        else:  # f_a, g_a, o_norm; q_a, q_a_norm, kv_a, kv_a_norm
            out[name], specs[name] = w, P()
    return out, specs


def _glu_by_width(p: dict, n: int) -> tuple[dict, dict]:
    width = p["gate"].shape[-1]
    gate, sg = _split(p["gate"], -1, width, n)
    up, su = _split(p["up"], -1, width, n)
    down, sd = _split(p["down"], 0, width, n)
    return {"gate": gate, "up": up, "down": down}, {"gate": sg, "up": su, "down": sd}


def _experts_by_expert(experts: dict, num_experts: int, n: int) -> tuple[dict, dict]:
    pairs = {k: _split(w, 0, num_experts, n) for k, w in experts.items()}
    return {k: v[0] for k, v in pairs.items()}, {k: v[1] for k, v in pairs.items()}


def shard_layout(params: dict, cfg: ModelConfig, n: int) -> tuple[dict, dict]:
    """(padded params, PartitionSpec tree) of the TEP layout for n ranks."""
    out, specs = {}, {}
    for name, value in params.items():
        if name != "layers":
            out[name], specs[name] = _replicated(value)
    out["layers"], specs["layers"] = [], []
    for l, lp in enumerate(params["layers"]):
        lo, ls = {}, {}
        for name, value in lp.items():
            if name == "attn":
                lo[name], ls[name] = _attention(value, cfg, cfg.is_mla(l), n)
            elif name == "mlp" and "router" in value:
                mo, ms = {}, {}
                for k, v in value.items():
                    if k == "experts":
                        mo[k], ms[k] = _experts_by_expert(v, cfg.num_experts, n)
                    elif k == "shared":
                        mo[k], ms[k] = _glu_by_width(v, n)
                    else:
                        mo[k], ms[k] = _replicated(v)
                lo[name], ls[name] = mo, ms
            elif name == "mlp":
                lo[name], ls[name] = _glu_by_width(value, n)
            else:
                lo[name], ls[name] = _replicated(value)
        out["layers"].append(lo)
        specs["layers"].append(ls)
    return out, specs


def _place(tree, specs, mesh: Mesh):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs,
                        is_leaf=lambda x: isinstance(x, P))


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Single-device params -> TEP params (padded, placed on the mesh)."""
    n = mesh_size(mesh)
    padded_params = jax.jit(lambda p: shard_layout(p, cfg, n)[0])(params)  # one program, not an op per leaf
    return _place(padded_params, shard_layout_specs(params, cfg, n), mesh)


def shard_layout_specs(params: dict, cfg: ModelConfig, n: int) -> dict:
    """PartitionSpecs of TEP params (single-device or already sharded: only names and ranks are read)."""
    specs = {}
    for name, value in params.items():
        if name != "layers":
            specs[name] = jax.tree.map(lambda _: P(), value)
    specs["layers"] = []
    for l, lp in enumerate(params["layers"]):
        ls = {}
        for name, value in lp.items():
            if name == "attn":
                by_cols = _MLA_BY_HEAD_COLS if cfg.is_mla(l) else _KDA_BY_HEAD_COLS
                ls[name] = {k: (P(*([None] * (w.ndim - 1)), AXIS) if k in by_cols else
                                P(AXIS, *([None] * (w.ndim - 1))) if k in ("o_proj", "dt_bias", "A_log") else P())
                            for k, w in value.items()}
            elif name == "mlp":
                glu = lambda g: {"gate": P(None, AXIS), "up": P(None, AXIS), "down": P(AXIS, None)}
                if "router" in value:
                    ls[name] = {k: (glu(v) if k == "shared" else
                                    {e: P(AXIS, *([None] * (w.ndim - 1))) for e, w in v.items()} if k == "experts" else
                                    jax.tree.map(lambda _: P(), v))
                                for k, v in value.items()}
                else:
                    ls[name] = glu(value)
            else:
                ls[name] = jax.tree.map(lambda _: P(), value)
        specs["layers"].append(ls)
    return specs


def _psum(x: jax.Array) -> jax.Array:
    return jax.lax.psum(x, AXIS)


def _tep_ffn(cfg: ModelConfig, n: int, backend_name: str):
    expert_cfg = local_expert_cfg(cfg, n)

    def ffn(l, p, x):
        if "router" not in p:  # dense MLP split along its hidden width
            return _psum(mlp(p, x, cfg))
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        ids, weights = route(p["router"], p["router_bias"], xf, cfg)
        rank = jax.lax.axis_index(AXIS)
        mine = ids // expert_cfg.num_experts == rank
        # assignments to other ranks' experts are dropped (id -1): computed nowhere here, exactly zero
        local_ids = jnp.where(mine, ids - rank * expert_cfg.num_experts, -1)
        z = dense(xf, p["latent_down"]) if cfg.moe_latent_size else xf
        # each rank keeps about 1 / n of the N * k assignments (the tiling hint; results do not depend on it)
        y = _psum(backend.get("moe_experts", backend_name)(z, local_ids, weights, p["experts"], expert_cfg,
                                                           expected_rows=max(1, -(-ids.size // n))))
        if cfg.moe_latent_size:
            if cfg.moe_latent_norm:
                y = rms_norm(y, p["latent_norm"], cfg.rms_norm_eps)
            y = dense(y, p["latent_up"])
        if cfg.num_shared_experts:
            y = y + _psum(mlp(p["shared"], xf, cfg))
        return y.reshape(shape)

    return ffn


def _tp_mixer(mixer):
    return lambda l, p, x: _psum(mixer(l, p, x))


@partial(jax.jit, static_argnames=("cfg", "mesh", "backend_name"))
def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, mesh: Mesh, backend_name: str = "reference") -> jax.Array:
    """`k3jax.model.forward` under TEP: params from `shard_params`; tokens int32 [B, T] (replicated)
    -> logits float32 [B, T, V] (replicated)."""
    check_tokens(tokens, 2, "tep.forward")
    n = mesh_size(mesh)
    attn_cfg = local_attention_cfg(cfg, n)

    def body(p, toks):
        mixer = _tp_mixer(cache_free_mixer(attn_cfg, toks.shape[0], backend_name))
        hidden = run_decoder(p, cfg, embed(p, toks), mixer, _tep_ffn(cfg, n, backend_name), backend_name)
        return lm_head(p, cfg, hidden)

    specs = shard_layout_specs(params, cfg, n)
    # check_vma=False: the model's scans start from replicated zero carries and would need pcasts inside model code
    return jax.shard_map(body, mesh=mesh, check_vma=False, in_specs=(specs, P()), out_specs=P())(params, tokens)


# --- serving state ---------------------------------------------------------------------------------

_STATE_SPECS = DecodeState(kda=P(None, None, AXIS), conv=P(None, None, None, None, AXIS), kv_pages=P())


def shard_state(state: DecodeState, cfg: ModelConfig, mesh: Mesh) -> DecodeState:
    """Single-device state -> TEP state: kda [L, S, Hp, V, K] split by head; conv reshaped to
    [L, S, W-1, 3, Hp, K] (q|k|v by head) and split by head; kv_pages replicated."""
    n = mesh_size(mesh)
    h, k = cfg.kda_num_heads, cfg.kda_head_dim
    conv = state.conv.reshape(*state.conv.shape[:3], 3, h, k)
    tep = DecodeState(kda=pad_groups(state.kda, 2, h, padded(h, n)), conv=pad_groups(conv, 4, h, padded(h, n)),
                      kv_pages=state.kv_pages)
    return _place(tep, _STATE_SPECS, mesh)


def unshard_state(state: DecodeState, cfg: ModelConfig) -> DecodeState:
    """TEP state -> the single-device layout (padding heads dropped)."""
    h = cfg.kda_num_heads
    conv = state.conv[:, :, :, :, :h]
    return DecodeState(kda=jnp.asarray(state.kda[:, :, :h]), conv=conv.reshape(*conv.shape[:3], -1),
                       kv_pages=jnp.asarray(state.kv_pages))


def _step(params, cfg: ModelConfig, state: DecodeState, tokens, meta: StepMeta, mesh: Mesh, kda_mode: str,
          backend_name: str):
    n = mesh_size(mesh)
    attn_cfg = local_attention_cfg(cfg, n)

    def body(p, st, toks, m):
        conv_shape = st.conv.shape
        caches = {"kda": st.kda, "conv": st.conv.reshape(*conv_shape[:3], -1), "kv_pages": st.kv_pages}
        mixer = _tp_mixer(cached_mixer(attn_cfg, caches, m, kda_mode, backend_name))
        hidden = run_decoder(p, cfg, embed(p, toks), mixer, _tep_ffn(cfg, n, backend_name), backend_name)
        new = DecodeState(kda=caches["kda"], conv=caches["conv"].reshape(conv_shape), kv_pages=caches["kv_pages"])
        return lm_head(p, cfg, last_token_hidden(hidden, m.lengths)), new

    specs = shard_layout_specs(params, cfg, n)
    meta_specs = jax.tree.map(lambda _: P(), meta)
    return jax.shard_map(body, mesh=mesh, check_vma=False, in_specs=(specs, _STATE_SPECS, P(), meta_specs),
                         out_specs=(P(), _STATE_SPECS))(params, state, tokens, meta)


@partial(jax.jit, static_argnames=("cfg", "mesh", "backend_name"), donate_argnames=("state",))
def prefill(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta, mesh: Mesh,
            backend_name: str = "reference"):
    """`k3jax.model.prefill` under TEP (logits at each row's last new token): state from `shard_state`,
    tokens int32 [B, T] and meta replicated. Returns (logits float32 [B, V], new TEP state)."""
    check_tokens(tokens, 2, "tep.prefill")
    return _step(params, cfg, state, tokens, meta, mesh, "chunked", backend_name)


@partial(jax.jit, static_argnames=("cfg", "mesh", "backend_name"), donate_argnames=("state",))
def decode(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta, mesh: Mesh,
           backend_name: str = "reference"):
    """`k3jax.model.decode` under TEP: tokens int32 [B] -> (logits float32 [B, V], new TEP state)."""
    check_tokens(tokens, 1, "tep.decode")
    return _step(params, cfg, state, tokens[:, None], meta, mesh, "recurrent", backend_name)


@partial(jax.jit, static_argnames=("cfg", "layer", "mesh", "backend_name"))
def moe_block(params: dict, cfg: ModelConfig, layer: int, x: jax.Array, mesh: Mesh, backend_name: str = "reference"):
    """Layer `layer`'s feed-forward alone under TEP (params from `shard_params`): pre-normed x [B, T, D],
    replicated -> [B, T, D]; equals `k3jax.moe.ffn` on the single-device params."""
    n = mesh_size(mesh)
    specs = shard_layout_specs(params, cfg, n)["layers"][layer]["mlp"]
    body = lambda p, h: _tep_ffn(cfg, n, backend_name)(layer, p, h)
    return jax.shard_map(body, mesh=mesh, check_vma=False, in_specs=(specs, P()), out_specs=P())(
        params["layers"][layer]["mlp"], x)
