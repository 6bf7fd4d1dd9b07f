"""DWDP: data-parallel everything, experts sharded only for storage; no token ever leaves its rank.

Every rank runs its own requests through the whole model, attention and MoE alike, with all E experts.
The routed experts are stored split over the n ranks (rank r keeps experts [r*El, (r+1)*El), El = E/n,
zero-padded to a multiple of n); before a MoE layer runs, its remote shards are brought over. Two forms:

  SPMD (`forward`, `prefill`, `decode`): one `shard_map` program. The decoder's feed-forward at MoE
      layer l uses buffer l % 2 and, before computing, issues the all-gather of the *next* MoE layer's
      shards into the other buffer, so at most two gathered layers are alive (double buffering) and the
      gather has the whole layer l (and layer l+1's attention) to hide behind. The token path has no
      collective at all: the only collectives are the weight all-gathers.

  independent (`IndependentDWDP`): one program per device, driven from Python, layer by layer. Device d
      keeps its own shard; at MoE layer l it copies (`jax.device_put`, asynchronous) the peers' shards of
      the next MoE layer into the other of two alternating buffers, then runs layer l from the buffer
      filled one layer earlier. There is no collective between ranks: a slow rank never makes another
      wait (what `benchmarks/sync_wait.py` measures against DEP).

Unlike DEP, nothing couples the ranks' batches: each rank may have any number of rows and tokens.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from k3jax.config import ModelConfig
from k3jax.layers import mlp
from k3jax.model import DecodeState, StepMeta, embed, last_token_hidden, lm_head
from k3jax.moe import moe
from k3jax.parallel import dep
from k3jax.parallel.common import (AXIS, cache_free_mixer, cached_mixer, check_tokens, mesh_size, pad_groups,
                                   run_decoder)
from k3jax.parallel.common import padded as padded_count
from k3jax.compile_options import STEP_COMPILER_OPTIONS

param_specs = dep.param_specs  # same storage layout as DEP: routed experts split by expert, the rest replicated
shard_params = dep.shard_params
shard_state = dep.shard_state
STATE_SPECS = dep.STATE_SPECS


def moe_layers(cfg: ModelConfig) -> list[int]:
    return [l for l in range(cfg.num_layers) if cfg.is_moe(l)]


def _prefetching_ffn(params: dict, cfg: ModelConfig, backend_name: str):
    """Inside shard_map: the DWDP feed-forward over this rank's tokens. `params` is the rank's whole param
    tree (experts: its [El, ...] shards), so the ffn of MoE layer l can start gathering layer l+1's."""
    layers = moe_layers(cfg)
    following = dict(zip(layers, layers[1:]))
    buffers: dict[int, dict] = {}  # MoE layer -> its gathered experts; at most 2 alive (this layer, the next)

    def gather(l):  # [El, ...] shards of all ranks -> [E, ...] (padding experts dropped: never routed to)
        return {k: jax.lax.all_gather(w, AXIS, axis=0, tiled=True)[: cfg.num_experts]
                for k, w in params["layers"][l]["mlp"]["experts"].items()}

    def ffn(l, p, x):
        if "router" not in p:
            return mlp(p, x, cfg)
        experts = buffers.pop(l) if l in buffers else gather(l)
        if l in following:  # issued before this layer's compute: it does not depend on it
            buffers[following[l]] = gather(following[l])
        return moe(dict(p, experts=experts), x, cfg, backend_name=backend_name)

    return ffn


@partial(jax.jit, static_argnames=("cfg", "mesh", "backend_name"))
def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, mesh: Mesh, backend_name: str = "reference") -> jax.Array:
    """`k3jax.model.forward` under SPMD DWDP: tokens int32 [n*Bl, T], rows r*Bl.. on rank r ->
    logits float32 [n*Bl, T, V] (sharded by row)."""
    check_tokens(tokens, 2, "dwdp.forward")
    n = mesh_size(mesh)
    if tokens.shape[0] % n:
        raise ValueError(f"dwdp.forward: {tokens.shape[0]} rows do not split over {n} ranks")

    def body(p, toks):
        ffn = _prefetching_ffn(p, cfg, backend_name)
        hidden = run_decoder(p, cfg, embed(p, toks), cache_free_mixer(cfg, toks.shape[0], backend_name), ffn, backend_name)
        return lm_head(p, cfg, hidden)

    return jax.shard_map(body, mesh=mesh, check_vma=False, in_specs=(param_specs(params), P(AXIS)),
                         out_specs=P(AXIS))(params, tokens)


def _step(params, cfg, state, tokens, meta, mesh, kda_mode, backend_name):
    n = mesh_size(mesh)
    if tokens.shape[0] % n:
        raise ValueError(f"dwdp: {tokens.shape[0]} rows do not split over {n} ranks")

    def body(p, st, toks, m):
        caches = {"kda": st.kda, "conv": st.conv, "kv_pages": st.kv_pages}
        hidden = run_decoder(p, cfg, embed(p, toks), cached_mixer(cfg, caches, m, kda_mode, backend_name),
                             _prefetching_ffn(p, cfg, backend_name), backend_name)
        return lm_head(p, cfg, last_token_hidden(hidden, m.lengths)), DecodeState(**caches)

    meta_specs = jax.tree.map(lambda _: P(AXIS), meta)
    return jax.shard_map(body, mesh=mesh, check_vma=False,
                         in_specs=(param_specs(params), STATE_SPECS, P(AXIS), meta_specs),
                         out_specs=(P(AXIS), STATE_SPECS))(params, state, tokens, meta)


@partial(jax.jit, static_argnames=("cfg", "mesh", "backend_name"), donate_argnames=("state",),
         compiler_options=STEP_COMPILER_OPTIONS)
def prefill(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta, mesh: Mesh,
            backend_name: str = "reference"):
    """`k3jax.model.prefill` under SPMD DWDP (layout as `dep.prefill`: rows and meta split by rank, local
    slot and page ids). Returns (logits float32 [n*Bl, V], new state)."""
    check_tokens(tokens, 2, "dwdp.prefill")
    return _step(params, cfg, state, tokens, meta, mesh, "chunked", backend_name)


@partial(jax.jit, static_argnames=("cfg", "mesh", "backend_name"), donate_argnames=("state",),
         compiler_options=STEP_COMPILER_OPTIONS)
def decode(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta, mesh: Mesh,
           backend_name: str = "reference"):
    """`k3jax.model.decode` under SPMD DWDP: tokens int32 [n*Bl] -> (logits float32 [n*Bl, V], new state)."""
    check_tokens(tokens, 1, "dwdp.decode")
    return _step(params, cfg, state, tokens[:, None], meta, mesh, "recurrent", backend_name)


# --- independent form: one program per device, no collective ----------------------------------------


def _layer_cfg(cfg: ModelConfig, kind: str) -> tuple[ModelConfig, int]:
    """A config and layer index under which `model.cached_mixer` runs one layer of `kind` whose caches are
    passed as a stack of one (mixer slot 0): one compiled attention program per kind, shared by all layers."""
    layer = cfg.mla_layers[0] if kind == "mla" else cfg.kda_layers[0]
    return cfg, layer


@partial(jax.jit, static_argnames=("cfg", "kind", "kda_mode", "backend_name"))
def _attention_step(p, x, caches: dict, meta: StepMeta, cfg: ModelConfig, kind: str, kda_mode: str, backend_name: str):
    """One attention layer of kind "kda" / "mla" on its own caches (leading axis 1) -> (y, new caches)."""
    cfg, layer = _layer_cfg(cfg, kind)
    caches = dict(caches)
    y = cached_mixer(cfg, caches, meta, kda_mode, backend_name)(layer, p, x)
    return y, caches


@partial(jax.jit, static_argnames=("cfg", "batch", "kind", "backend_name"))
def _attention_free(p, x, cfg: ModelConfig, batch: int, kind: str, backend_name: str):
    cfg, layer = _layer_cfg(cfg, kind)
    return cache_free_mixer(cfg, batch, backend_name)(layer, p, x)


@partial(jax.jit, static_argnames=("cfg", "backend_name"))
def _moe_step(p, x, shards: tuple, cfg: ModelConfig, backend_name: str):
    """The MoE layer with experts assembled from per-rank shards (a tuple of {name: [El, ...]} in rank
    order, all on this device)."""
    experts = {k: jnp.concatenate([s[k] for s in shards])[: cfg.num_experts] for k in shards[0]}
    return moe(dict(p, experts=experts), x, cfg, backend_name=backend_name)


_dense_step = jax.jit(mlp, static_argnums=2)
_embed = jax.jit(embed)
_lm_head_last = jax.jit(lambda p, cfg, h, lengths: lm_head(p, cfg, last_token_hidden(h, lengths)), static_argnums=1)
_lm_head = jax.jit(lm_head, static_argnums=1)


class IndependentDWDP:
    """Independent-form DWDP over `devices`: device d holds replicated dense params and its expert shard.

    run_forward / prefill / decode(d, ...) run device d's own batch as one per-device program; call them for
    every device (JAX dispatch is asynchronous, so the devices compute concurrently). Nothing is exchanged
    between devices except the expert-shard copies into device d's two alternating buffers.
    """

    def __init__(self, params: dict, cfg: ModelConfig, devices, backend_name: str = "reference"):
        self.cfg, self.devices, self.backend_name = cfg, list(devices), backend_name
        n = len(self.devices)
        if n < 1:
            raise ValueError("IndependentDWDP needs at least one device")
        e_pad = padded_count(cfg.num_experts, n)
        local = e_pad // n
        self.moe_layers = moe_layers(cfg)
        dense_part = dict(params, layers=[dict(lp, mlp={k: v for k, v in lp["mlp"].items() if k != "experts"})
                                          for lp in params["layers"]])
        self.params = [jax.device_put(dense_part, d) for d in self.devices]  # replicated: one copy per device
        # shards[d][l]: device d's own expert shard of MoE layer l, stored on device d only
        self.shards = []
        for r, d in enumerate(self.devices):
            own = {}
            for l in self.moe_layers:
                experts = params["layers"][l]["mlp"]["experts"]
                own[l] = jax.device_put({k: pad_groups(w, 0, cfg.num_experts, e_pad)[r * local:(r + 1) * local]
                                         for k, w in experts.items()}, d)
            self.shards.append(own)

    def _fetch(self, d: int, layer: int) -> tuple:
        """Starts copying every peer's shard of `layer` to device d (asynchronous); own shard as is."""
        dev = self.devices[d]
        return tuple(self.shards[d][layer] if r == d else jax.device_put(self.shards[r][layer], dev)
                     for r in range(len(self.devices)))

    def _ffn(self, d: int):
        cfg, following = self.cfg, dict(zip(self.moe_layers, self.moe_layers[1:]))
        buffers: list = [None, None]  # two alternating buffers, indexed by the MoE layer's parity
        slot = {l: i % 2 for i, l in enumerate(self.moe_layers)}

        def ffn(l, p, x):
            if "router" not in p:
                return _dense_step(p, x, cfg)
            if buffers[slot[l]] is None:  # the first MoE layer: nothing prefetched it
                buffers[slot[l]] = self._fetch(d, l)
            shards, buffers[slot[l]] = buffers[slot[l]], None
            if l in following:  # prefetch the next MoE layer into the other buffer, before computing this one
                buffers[slot[following[l]]] = self._fetch(d, following[l])
            return _moe_step(p, x, shards, cfg, self.backend_name)

        return ffn

    def forward(self, d: int, tokens: jax.Array) -> jax.Array:
        """Device d's rows: tokens int32 [B, T] -> logits float32 [B, T, V] (on device d)."""
        check_tokens(tokens, 2, "IndependentDWDP.forward")
        cfg, p = self.cfg, self.params[d]
        tokens = jax.device_put(tokens, self.devices[d])
        mixer = lambda l, lp, x: _attention_free(lp, x, cfg, tokens.shape[0], "mla" if cfg.is_mla(l) else "kda",  # noqa: E731
                                                 self.backend_name)
        return _lm_head(p, cfg, run_decoder(p, cfg, _embed(p, tokens), mixer, self._ffn(d), self.backend_name))

    def _step(self, d: int, state: DecodeState, tokens, meta: StepMeta, kda_mode: str):
        cfg, p, dev = self.cfg, self.params[d], self.devices[d]
        tokens, meta, state = jax.device_put((tokens, meta, state), dev)
        new = {"kda": list(state.kda), "conv": list(state.conv), "kv_pages": list(state.kv_pages)}

        def mixer(l, lp, x):
            j = cfg.mixer_slot[l]
            if cfg.is_mla(l):
                y, c = _attention_step(lp, x, {"kda": state.kda[:0], "conv": state.conv[:0], "kv_pages": new["kv_pages"][j][None]},
                                       meta, cfg, "mla", kda_mode, self.backend_name)
                new["kv_pages"][j] = c["kv_pages"][0]
            else:
                y, c = _attention_step(lp, x, {"kda": new["kda"][j][None], "conv": new["conv"][j][None],
                                               "kv_pages": state.kv_pages[:0]}, meta, cfg, "kda", kda_mode, self.backend_name)
                new["kda"][j], new["conv"][j] = c["kda"][0], c["conv"][0]
            return y

        hidden = run_decoder(p, cfg, _embed(p, tokens), mixer, self._ffn(d), self.backend_name)
        stack = lambda xs, like: jnp.stack(xs) if xs else like  # noqa: E731
        state = DecodeState(kda=stack(new["kda"], state.kda), conv=stack(new["conv"], state.conv),
                            kv_pages=stack(new["kv_pages"], state.kv_pages))
        return _lm_head_last(p, cfg, hidden, meta.lengths), state

    def prefill(self, d: int, state: DecodeState, tokens: jax.Array, meta: StepMeta):
        """Device d's own state pool and rows: tokens [B, T] -> (logits float32 [B, V], new state)."""
        check_tokens(tokens, 2, "IndependentDWDP.prefill")
        return self._step(d, state, tokens, meta, "chunked")

    def decode(self, d: int, state: DecodeState, tokens: jax.Array, meta: StepMeta):
        """Device d's own state pool and rows: tokens [B] -> (logits float32 [B, V], new state)."""
        check_tokens(tokens, 1, "IndependentDWDP.decode")
        return self._step(d, state, tokens[:, None], meta, "recurrent")
