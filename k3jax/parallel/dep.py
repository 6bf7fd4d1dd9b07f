"""DEP: attention data-parallel (each rank its own requests, state and KV) + expert-parallel MoE.

Over a 1-D mesh of n ranks (axis "x"), rank r owns experts [r*El, (r+1)*El) (El = E/n, experts
zero-padded to a multiple of n) and its own rows of the batch, KDA slots and MLA pages. Everything but
the routed experts is replicated and runs on the rank's own tokens; the MoE layer:

  1. routes its tokens, projects them to the latent width (latent_down) and runs the shared experts locally;
  2. dispatch, deduplicated per destination rank: a token goes once to every rank owning at least one of
     its top-k experts (never once per expert), its latent row plus its k expert ids and fp32 weights
     (2k int32 words, a second all-to-all: ids and weights must not be rounded to a bf16 activation);
  3. the destination runs its local experts on what it received and sums a token's local experts into one
     row (still latent width);
  4. combine: that row goes back to the token's owner (the same all-to-all, reversed), which adds the
     partial sums, then applies latent_norm / latent_up.

XLA all-to-all buffers are static: each round carries `capacity` rows from every rank to every rank
(default floor(B*min(k, n)/n) for B local tokens, at least 1: n*capacity <= B*min(k, n) <= B*k rows,
never more than a rank can send after deduplication, also when B*k is not a multiple of n).
A destination that needs more rows than that gets them in further rounds (a while loop whose trip
count is the pmax of what every rank needs), so nothing is dropped and results are exact for any routing.
One round moves n*capacity <= B*k rows each way: the published bound of <= 2BK token payloads per rank
and layer. The one exception is B*min(k, n) < n (a decode step with fewer routed rows than ranks): a
static all-to-all needs at least one row per rank pair, n > B*k. XLA:CPU has no ragged all-to-all, which
would send only the rows used.
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
from k3jax.parallel.tep import local_expert_cfg
from k3jax.compile_options import STEP_COMPILER_OPTIONS


def param_specs(params: dict) -> dict:
    """PartitionSpecs of DEP params: routed experts split by expert, everything else replicated."""
    def layer(lp):
        specs = jax.tree.map(lambda _: P(), lp)
        if "router" in lp["mlp"]:
            specs["mlp"]["experts"] = {k: P(AXIS, *([None] * (w.ndim - 1))) for k, w in lp["mlp"]["experts"].items()}
        return specs

    specs = {k: jax.tree.map(lambda _: P(), v) for k, v in params.items() if k != "layers"}
    specs["layers"] = [layer(lp) for lp in params["layers"]]
    return specs


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Single-device params -> DEP params (experts zero-padded to a multiple of the ranks, placed)."""
    n = mesh_size(mesh)
    out = dict(params)
    out["layers"] = []
    for lp in params["layers"]:
        lp = dict(lp)
        if "router" in lp["mlp"]:
            lp["mlp"] = dict(lp["mlp"])
            lp["mlp"]["experts"] = {k: pad_groups(w, 0, cfg.num_experts, padded(cfg.num_experts, n))
                                    for k, w in lp["mlp"]["experts"].items()}
        out["layers"].append(lp)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), out, param_specs(out),
                        is_leaf=lambda x: isinstance(x, P))


def default_capacity(local_tokens: int, cfg: ModelConfig, ranks: int) -> int:
    """Rows per (source, destination) pair and round: the largest capacity with n * capacity <=
    B * min(k, n) (the most one rank can send after deduplication), so one round's dispatch + combine
    buffers stay within 2BK token payloads; routing that needs more rows takes further rounds."""
    return max(1, local_tokens * min(cfg.num_experts_per_tok, ranks) // ranks)


def routed_experts(z: jax.Array, ids: jax.Array, weights: jax.Array, valid: jax.Array, experts: dict, cfg: ModelConfig,
                   ranks: int, capacity: int, backend_name: str, axis=AXIS) -> jax.Array:
    """Inside shard_map: sum_i w_i E_i(z) for this rank's tokens z [N, Dl] routed to ids / weights [N, k],
    with the experts spread over the ranks (`experts`: this rank's [El, ...] slice). Tokens with
    valid=False (padding) are not sent. `axis`: the mesh axis (or tuple of axes) the experts are split
    over, ranks its size. Returns [N, Dl] in z's dtype."""
    num_tokens, width = z.shape
    k = ids.shape[1]
    expert_cfg = local_expert_cfg(cfg, ranks)
    local_experts = expert_cfg.num_experts
    rank = jax.lax.axis_index(axis)

    dest = ids // local_experts  # [N, k] owning rank of each choice
    sends = jnp.any(dest[:, :, None] == jnp.arange(ranks)[None, None, :], axis=1) & valid[:, None]  # [N, n]
    position = jnp.cumsum(sends, axis=0) - 1  # row of token t in the list for destination r
    rounds = jax.lax.pmax(-(-jnp.max(jnp.sum(sends, axis=0)) // capacity), axis)
    # one row per sent token: the latent in its own dtype, and the routing as int32 (expert ids | fp32
    # weights bit-cast), so neither ids nor weights are rounded to a bf16 activation dtype
    rows_z = jnp.concatenate([z, jnp.zeros((1, width), z.dtype)])  # row N: an empty slot
    routing = jnp.concatenate([ids.astype(jnp.int32), jax.lax.bitcast_convert_type(weights.astype(jnp.float32), jnp.int32)], 1)
    # the empty slot's ids are -1 (dropped on every rank), its weights 0.0
    rows_routing = jnp.concatenate([routing, jnp.concatenate([jnp.full((1, k), -1, jnp.int32),
                                                              jnp.zeros((1, k), jnp.int32)], 1)])
    sink = num_tokens

    def one_round(i, out):
        in_round = sends & (position >= i * capacity) & (position < (i + 1) * capacity)
        slot = jnp.where(in_round, jnp.arange(ranks)[None, :] * capacity + position - i * capacity, ranks * capacity)
        token_of_slot = jnp.full((ranks * capacity,), sink, jnp.int32).at[slot.reshape(-1)].set(
            jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], slot.shape).reshape(-1), mode="drop")
        recv_z = jax.lax.all_to_all(rows_z[token_of_slot].reshape(ranks, capacity, width), axis, 0, 0)
        recv_routing = jax.lax.all_to_all(rows_routing[token_of_slot].reshape(ranks, capacity, 2 * k), axis, 0, 0)
        r_z = recv_z.reshape(ranks * capacity, width)  # [source, slot] rows
        r_ids = recv_routing[..., :k].reshape(ranks * capacity, k)
        r_w = jax.lax.bitcast_convert_type(recv_routing[..., k:], jnp.float32).reshape(ranks * capacity, k)
        # other ranks' picks (and empty slots) are dropped assignments (id -1): no MMA rows, zero contribution.
        # Of its ranks * capacity * k received assignments a rank keeps about num_tokens * k (each rank's picks
        # spread evenly over the ranks): the kernels' tiling follows that, not the received count
        mine = r_ids // local_experts == rank
        partial_sums = backend.get("moe_experts", backend_name)(
            r_z, jnp.where(mine, r_ids - rank * local_experts, -1), r_w,
            experts, expert_cfg, expected_rows=max(1, min(num_tokens, ranks * capacity) * k))
        back = jax.lax.all_to_all(partial_sums.reshape(ranks, capacity, width), axis, 0, 0).reshape(ranks * capacity, width)
        return out.at[token_of_slot].add(back.astype(jnp.float32))

    out = jax.lax.fori_loop(0, rounds, one_round, jnp.zeros((num_tokens + 1, width), jnp.float32))
    return out[:num_tokens].astype(z.dtype)


def _dep_ffn(cfg: ModelConfig, ranks: int, valid: jax.Array, capacity: int | None, backend_name: str, axis=AXIS,
             shared_fn=None):
    """The DEP feed-forward; valid [B, T] marks real tokens (padding is not dispatched). `axis`: the mesh
    axis (or axes) of the expert split; shared_fn(params, x [N, D]) -> [N, D] replaces the local shared
    experts (TP subgroups shard them)."""
    shared_fn = shared_fn or (lambda p, x: mlp(p, x, cfg))

    def ffn(l, p, x):
        if "router" not in p:
            return mlp(p, x, cfg)
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        ids, weights = route(p["router"], p["router_bias"], xf, cfg)
        z = dense(xf, p["latent_down"]) if cfg.moe_latent_size else xf
        cap = capacity or default_capacity(xf.shape[0], cfg, ranks)
        y = routed_experts(z, ids, weights, valid.reshape(-1), p["experts"], cfg, ranks, cap, backend_name, axis)
        if cfg.moe_latent_size:
            if cfg.moe_latent_norm:
                y = rms_norm(y, p["latent_norm"], cfg.rms_norm_eps)
            y = dense(y, p["latent_up"])
        if cfg.num_shared_experts:
            y = y + shared_fn(p["shared"], xf)
        return y.reshape(shape)

    return ffn


@partial(jax.jit, static_argnames=("cfg", "mesh", "capacity", "backend_name"))
def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, mesh: Mesh, capacity: int | None = None,
            backend_name: str = "reference") -> jax.Array:
    """`k3jax.model.forward` under DEP: tokens int32 [n*Bl, T], rows r*Bl.. belong to rank r ->
    logits float32 [n*Bl, T, V] (sharded by row)."""
    check_tokens(tokens, 2, "dep.forward")
    n = mesh_size(mesh)
    if tokens.shape[0] % n:
        raise ValueError(f"dep.forward: {tokens.shape[0]} rows do not split over {n} ranks")

    def body(p, toks):
        ffn = _dep_ffn(cfg, n, jnp.ones(toks.shape, bool), capacity, backend_name)
        hidden = run_decoder(p, cfg, embed(p, toks), cache_free_mixer(cfg, toks.shape[0], backend_name), ffn, backend_name)
        return lm_head(p, cfg, hidden)

    return jax.shard_map(body, mesh=mesh, check_vma=False, in_specs=(param_specs(params), P(AXIS)),
                         out_specs=P(AXIS))(params, tokens)


STATE_SPECS = DecodeState(kda=P(None, AXIS), conv=P(None, AXIS), kv_pages=P(None, AXIS))


def shard_state(state: DecodeState, mesh: Mesh) -> DecodeState:
    """Places a state pool of n*S slots and n*Pg pages on the mesh: rank r owns slots r*S.. and pages
    r*Pg.. (its meta uses local ids 0..S-1 and 0..Pg-1)."""
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, STATE_SPECS,
                        is_leaf=lambda x: isinstance(x, P))


def _step(params, cfg, state, tokens, meta, mesh, kda_mode, capacity, backend_name):
    n = mesh_size(mesh)
    if tokens.shape[0] % n:
        raise ValueError(f"dep: {tokens.shape[0]} rows do not split over {n} ranks")

    def body(p, st, toks, m):
        caches = {"kda": st.kda, "conv": st.conv, "kv_pages": st.kv_pages}
        valid = jnp.arange(toks.shape[1])[None, :] < m.lengths[:, None]
        ffn = _dep_ffn(cfg, n, valid, capacity, backend_name)
        hidden = run_decoder(p, cfg, embed(p, toks), cached_mixer(cfg, caches, m, kda_mode, backend_name), ffn,
                             backend_name)
        return lm_head(p, cfg, last_token_hidden(hidden, m.lengths)), DecodeState(**caches)

    meta_specs = jax.tree.map(lambda _: P(AXIS), meta)
    return jax.shard_map(body, mesh=mesh, check_vma=False,
                         in_specs=(param_specs(params), STATE_SPECS, P(AXIS), meta_specs),
                         out_specs=(P(AXIS), STATE_SPECS))(params, state, tokens, meta)


@partial(jax.jit, static_argnames=("cfg", "mesh", "capacity", "backend_name"), donate_argnames=("state",),
         compiler_options=STEP_COMPILER_OPTIONS)
def prefill(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta, mesh: Mesh,
            capacity: int | None = None, backend_name: str = "reference"):
    """`k3jax.model.prefill` under DEP: rows of tokens [n*Bl, T] and meta split by rank (local slot and
    page ids; padding rows have length 0). Returns (logits float32 [n*Bl, V], new state)."""
    check_tokens(tokens, 2, "dep.prefill")
    return _step(params, cfg, state, tokens, meta, mesh, "chunked", capacity, backend_name)


@partial(jax.jit, static_argnames=("cfg", "mesh", "capacity", "backend_name"), donate_argnames=("state",),
         compiler_options=STEP_COMPILER_OPTIONS)
def decode(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta, mesh: Mesh,
           capacity: int | None = None, backend_name: str = "reference"):
    """`k3jax.model.decode` under DEP: tokens int32 [n*Bl] -> (logits float32 [n*Bl, V], new state)."""
    check_tokens(tokens, 1, "dep.decode")
    return _step(params, cfg, state, tokens[:, None], meta, mesh, "recurrent", capacity, backend_name)


@partial(jax.jit, static_argnames=("cfg", "layer", "mesh", "capacity", "backend_name"))
def moe_block(params: dict, cfg: ModelConfig, layer: int, x: jax.Array, mesh: Mesh, capacity: int | None = None,
              backend_name: str = "reference"):
    """Layer `layer`'s feed-forward alone under DEP (params from `shard_params`): pre-normed x [n*Bl, T, D]
    split by row -> [n*Bl, T, D]; equals `k3jax.moe.ffn` on the single-device params."""
    n = mesh_size(mesh)
    spec = param_specs(params)["layers"][layer]["mlp"]

    def body(p, h):
        return _dep_ffn(cfg, n, jnp.ones(h.shape[:2], bool), capacity, backend_name)(layer, p, h)

    return jax.shard_map(body, mesh=mesh, check_vma=False, in_specs=(spec, P(AXIS)), out_specs=P(AXIS))(
        params["layers"][layer]["mlp"], x)
