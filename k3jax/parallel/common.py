"""Pieces shared by the strategies: the decoder loop with a pluggable feed-forward, the attention mixers
of `forward` / `prefill` / `decode`, zero padding of head / expert / width axes, and the mesh.

The model's `k3jax.model.decoder` calls `k3jax.moe.ffn` itself, so a strategy cannot swap in a sharded MoE
through it; `run_decoder` is the same loop (same AttnRes bookkeeping, same fused mix+norm op) with the
feed-forward passed in. tests/parallel check that it stays equal to the model's.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from k3jax import kda, mla
from k3jax.attnres import attn_res_mix_norm
from k3jax.config import ModelConfig
from k3jax.layers import rms_norm

AXIS = "x"  # the one mesh axis every strategy here shards over

Mixer = Callable[[int, dict, jax.Array], jax.Array]  # (layer, attn params, normed x [B, T, D]) -> [B, T, D]
Ffn = Callable[[int, dict, jax.Array], jax.Array]  # (layer, mlp params, normed x [B, T, D]) -> [B, T, D]


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh over the first `num_devices` devices (all by default), axis name AXIS."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"need 1..{len(devices)} devices, asked for {n}")
    return Mesh(np.array(devices[:n]), (AXIS,))


def mesh_size(mesh: Mesh) -> int:
    if mesh.axis_names != (AXIS,):
        raise ValueError(f"expected a 1-D mesh with axis {AXIS!r}, got axes {mesh.axis_names}")
    return mesh.shape[AXIS]


def padded(count: int, ranks: int) -> int:
    """count rounded up to a multiple of ranks (heads / experts / widths split evenly over the mesh)."""
    return -(-count // ranks) * ranks


def pad_groups(w: jax.Array, axis: int, groups: int, padded_groups: int) -> jax.Array:
    """Zero-pads axis `axis` of w, read as `groups` contiguous equal blocks (e.g. heads of an H*K axis),
    to `padded_groups` blocks. Zero heads / experts / hidden units contribute exactly zero (their output
    rows are zero), which is what lets 3 heads or 7 experts split over 8 ranks."""
    if padded_groups == groups:
        return w
    axis = axis % w.ndim
    size = w.shape[axis]
    if size % groups:
        raise ValueError(f"axis {axis} of size {size} is not {groups} equal groups")
    blocks = w.reshape(*w.shape[:axis], groups, size // groups, *w.shape[axis + 1 :])
    pad = [(0, 0)] * blocks.ndim
    pad[axis] = (0, padded_groups - groups)
    blocks = jnp.pad(blocks, pad)
    return blocks.reshape(*w.shape[:axis], padded_groups * (size // groups), *w.shape[axis + 1 :])


def run_decoder(params: dict, cfg: ModelConfig, h: jax.Array, mixer: Mixer, ffn: Ffn, backend_name: str) -> jax.Array:
    """`k3jax.model.decoder` (without feature capture) with the feed-forward `ffn` passed in.
    h: embeddings [B, T, D] -> final-normed hidden states [B, T, D]."""
    block = cfg.attn_res_block_size
    eps = cfg.rms_norm_eps
    if block is None:
        for l, lp in enumerate(params["layers"]):
            h = h + mixer(l, lp["attn"], rms_norm(h, lp["input_layernorm"], eps))
            h = h + ffn(l, lp["mlp"], rms_norm(h, lp["post_attention_layernorm"], eps))
        return rms_norm(h, params["norm"], eps)
    bank: list[jax.Array] = []
    partial_sum: jax.Array | None = h
    for l, lp in enumerate(params["layers"]):
        if bank:
            _, normed = attn_res_mix_norm(bank + [partial_sum], lp["self_attention_res_proj"], lp["self_attention_res_norm"],
                                          lp["input_layernorm"], eps, backend_name=backend_name)
        else:
            normed = rms_norm(partial_sum, lp["input_layernorm"], eps)
        if l % block == 0:
            bank.append(partial_sum)
            partial_sum = None
        a = mixer(l, lp["attn"], normed)
        partial_sum = a if partial_sum is None else partial_sum + a
        _, normed = attn_res_mix_norm(bank + [partial_sum], lp["mlp_res_proj"], lp["mlp_res_norm"],
                                      lp["post_attention_layernorm"], eps, backend_name=backend_name)
        partial_sum = partial_sum + ffn(l, lp["mlp"], normed)
    _, hidden = attn_res_mix_norm(bank + [partial_sum], params["output_attn_res_proj"], params["output_attn_res_norm"],
                                  params["norm"], eps, backend_name=backend_name)
    return hidden


def cache_free_mixer(cfg: ModelConfig, batch: int, backend_name: str) -> Mixer:
    """Attention of `forward`: naive MLA, chunked KDA from zero states (cfg may be a per-rank head slice)."""

    def mixer(l, p, x):
        if cfg.is_mla(l):
            return mla.naive_attention(p, x, cfg)
        conv0 = jnp.zeros((batch, cfg.kda_conv_kernel - 1, cfg.conv_channels), x.dtype)
        rec0 = jnp.zeros((batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32)
        return kda.kda_mixer(p, x, conv0, rec0, cfg, mode="chunked", backend_name=backend_name)[0]

    return mixer


def cached_mixer(cfg: ModelConfig, caches: dict, meta, kda_mode: str, backend_name: str) -> Mixer:
    """Attention of `prefill` / `decode` (as in `k3jax.model.step_body`): reads and updates
    caches = {"kda", "conv", "kv_pages"} in place of the dict; meta is a `k3jax.model.StepMeta`."""

    def mixer(l, p, x):
        j = cfg.mixer_slot[l]
        if cfg.is_mla(l):
            y, caches["kv_pages"] = mla.paged_attention(p, x, caches["kv_pages"], j, meta.page_table, meta.context_lens,
                                                        meta.lengths, cfg, backend_name=backend_name)
            return y
        conv, rec = caches["conv"][j][meta.slots], caches["kda"][j][meta.slots]
        y, new_conv, new_rec = kda.kda_mixer(p, x, conv, rec, cfg, lengths=meta.lengths, mode=kda_mode,
                                             backend_name=backend_name)
        caches["conv"] = caches["conv"].at[j, meta.slots].set(new_conv)
        caches["kda"] = caches["kda"].at[j, meta.slots].set(new_rec)
        return y

    return mixer


def check_tokens(tokens: jax.Array, ndim: int, what: str) -> None:
    if tokens.ndim != ndim or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{what}: expected integer tokens of rank {ndim}, got {tokens.dtype}{list(tokens.shape)}")
