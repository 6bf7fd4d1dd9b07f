"""Pieces shared by the strategies: the model's decoder loop with a pluggable feed-forward and its
attention mixers of `forward` / `prefill` / `decode` (all from k3jax.model, so a strategy runs exactly the
model's code around its own communication), zero padding of head / expert / width axes, and the mesh.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from k3jax import model
from k3jax.config import ModelConfig

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
    """`k3jax.model.decoder` with the strategy's feed-forward `ffn(layer, mlp_params, x)`.
    h: embeddings [B, T, D] -> final-normed hidden states [B, T, D]."""
    return model.decoder(params, cfg, h, mixer, backend_name, ffn_fn=ffn)[0]


def cache_free_mixer(cfg: ModelConfig, batch: int, backend_name: str, linear: dict | None = None) -> Mixer:
    """Attention of `forward` (cfg may be a per-rank head slice): `k3jax.model.cache_free_mixer`; `linear`:
    the strategy's projection hooks per mixer kind (None: plain dense, the weights as the rank holds them)."""
    return model.cache_free_mixer(cfg, batch, backend_name, linear)


def cached_mixer(cfg: ModelConfig, caches: dict, meta, kda_mode: str, backend_name: str,
                 linear: dict | None = None) -> Mixer:
    """Attention of `prefill` / `decode` over caches = {"kda", "conv", "kv_pages"}: `k3jax.model.cached_mixer`
    (`linear` as in `cache_free_mixer`)."""
    return model.cached_mixer(cfg, caches, meta, kda_mode=kda_mode, backend_name=backend_name, linear=linear)


def check_tokens(tokens: jax.Array, ndim: int, what: str) -> None:
    if tokens.ndim != ndim or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{what}: expected integer tokens of rank {ndim}, got {tokens.dtype}{list(tokens.shape)}")
