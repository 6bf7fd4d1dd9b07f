"""TP subgroups inside DEP: groups of T consecutive ranks share the TP-selected weights, split 1/T each.

Mesh: 2-D, axes ("x", "tp") of shape (n/T, T); rank (g, t) is the t-th member of group g. DEP runs as usual
over all n ranks (its routed-expert all-to-all spans both axes); inside a group:

  column_parallel(x, w_cols)   the TP primitive, for a projection [H, O] whose columns are split over the
      group: all-gather the group's tokens (each member then holds T*N rows), multiply by the local
      O/T columns, all-to-all the [T*N, O/T] result back so each token's owner gets its full O columns.
      Per local token and rank: (T-1)*H*s_a all-gathered + (T-1)/T*O*s_a all-to-all (O = H: the
      published table), weights H*O*s_w/T.

  shared experts (in the model): the same all-gather, then the GLU's gate/up as column GEMMs (hidden
      units split over the group), the down projection on the local hidden units (rows), and the
      partial [T*N, D] sums all-to-all'd back to the owners, who add the T partials: every shared-expert
      weight is 1/T per rank; per local token (T-1)*D*s_a each way (a reduce-scatter spelled as
      all-to-all + local sum, because the down GEMM's output is a partial sum, not a column slice).

The attention projections of the model path stay replicated here: `k3jax.kda` / `k3jax.mla` compute
their projections inside the mixers, with no hook for a sharded GEMM; `column_parallel` is what they would
call, and its bytes are tested against the table on its own (tests/parallel/test_strategies.py). The
planner (k3jax/plan.py) counts the published TP selection (attention projections + shared experts).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.config import ModelConfig
from k3jax.layers import glu_activation
from k3jax.model import DecodeState, StepMeta, embed, last_token_hidden, lm_head
from k3jax.parallel import dep
from k3jax.parallel.common import AXIS, cache_free_mixer, cached_mixer, check_tokens, pad_groups, padded, run_decoder

TP = "tp"
RANKS = (AXIS, TP)  # DEP's expert split and the rows: both axes, rank = g*T + t


def make_mesh(num_devices: int, tp: int) -> Mesh:
    """A (num_devices/tp, tp) mesh over the first num_devices devices, axes ("x", "tp")."""
    devices = jax.devices()
    if not 1 <= num_devices <= len(devices):
        raise ValueError(f"need 1..{len(devices)} devices, asked for {num_devices}")
    if tp < 1 or num_devices % tp:
        raise ValueError(f"tp={tp} must be >= 1 and divide {num_devices} devices")
    return Mesh(np.array(devices[:num_devices]).reshape(num_devices // tp, tp), (AXIS, TP))


def _sizes(mesh: Mesh) -> tuple[int, int]:
    if mesh.axis_names != (AXIS, TP):
        raise ValueError(f"expected a mesh with axes {(AXIS, TP)}, got {mesh.axis_names} (use tp_subgroup.make_mesh)")
    return mesh.shape[AXIS] * mesh.shape[TP], mesh.shape[TP]


def column_parallel(x: jax.Array, w_cols: jax.Array) -> jax.Array:
    """Inside shard_map: x [N, H] (this rank's tokens) times a column-split weight (w_cols [H, O/T], this
    rank's columns of its group) -> [N, O], the full output for this rank's tokens."""
    t = jax.lax.axis_size(TP)
    gathered = jax.lax.all_gather(x, TP, axis=0, tiled=True)  # [T*N, H]: the group's tokens, in member order
    cols = jnp.einsum("nh,ho->no", gathered, w_cols.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    # rows of member j go back to member j; the columns arrive in member order: [N, T * O/T]
    return jax.lax.all_to_all(cols, TP, 0, 1, tiled=True) if t > 1 else cols


def shared_experts(p: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Inside shard_map: the shared-expert GLU for this rank's tokens x [N, D] with its hidden units split
    over the group (p: gate/up [D, I/T], down [I/T, D]) -> [N, D]."""
    t = jax.lax.axis_size(TP)
    gathered = jax.lax.all_gather(x, TP, axis=0, tiled=True)  # [T*N, D]
    dense = lambda a, w: jnp.einsum("ni,io->no", a, w.astype(a.dtype), preferred_element_type=jnp.float32).astype(a.dtype)  # noqa: E731
    hidden = glu_activation(dense(gathered, p["gate"]), dense(gathered, p["up"]), cfg)
    partial_sums = jnp.einsum("ni,io->no", hidden, p["down"].astype(hidden.dtype), preferred_element_type=jnp.float32)
    if t == 1:
        return partial_sums.astype(x.dtype)
    n = x.shape[0]
    back = jax.lax.all_to_all(partial_sums.reshape(t, n, -1), TP, 0, 0)  # [T, N, D]: every member's partial of my rows
    return jnp.sum(back, axis=0).astype(x.dtype)


def param_specs(params: dict) -> dict:
    """DEP's specs with experts split over both axes and the shared experts' hidden units over "tp"."""
    specs = dep.param_specs(params)
    for lp, ls in zip(params["layers"], specs["layers"]):
        if "router" in lp["mlp"]:
            ls["mlp"]["experts"] = {k: P(RANKS, *([None] * (w.ndim - 1))) for k, w in lp["mlp"]["experts"].items()}
            ls["mlp"]["shared"] = {"gate": P(None, TP), "up": P(None, TP), "down": P(TP, None)}
    return specs


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Single-device params -> TP-subgroup params (experts padded to a multiple of n, shared hidden width
    to a multiple of T -- zero hidden units contribute zero -- and placed)."""
    n, t = _sizes(mesh)
    out = dict(params)
    out["layers"] = []
    for lp in params["layers"]:
        lp = dict(lp)
        if "router" in lp["mlp"]:
            m = dict(lp["mlp"])
            m["experts"] = {k: pad_groups(w, 0, cfg.num_experts, padded(cfg.num_experts, n)) for k, w in m["experts"].items()}
            width = m["shared"]["gate"].shape[1]
            m["shared"] = {"gate": pad_groups(m["shared"]["gate"], 1, width, padded(width, t)),
                           "up": pad_groups(m["shared"]["up"], 1, width, padded(width, t)),
                           "down": pad_groups(m["shared"]["down"], 0, width, padded(width, t))}
            lp["mlp"] = m
        out["layers"].append(lp)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), out, param_specs(out),
                        is_leaf=lambda x: isinstance(x, P))


def _ffn(cfg, n, valid, capacity, backend_name):
    return dep._dep_ffn(cfg, n, valid, capacity, backend_name, axis=RANKS,
                        shared_fn=lambda p, x: shared_experts(p, x, cfg))


@partial(jax.jit, static_argnames=("cfg", "mesh", "capacity", "backend_name"))
def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, mesh: Mesh, capacity: int | None = None,
            backend_name: str = "reference") -> jax.Array:
    """`k3jax.model.forward` under DEP with TP subgroups: tokens [n*Bl, T], rows r*Bl.. on rank r = g*T + t."""
    check_tokens(tokens, 2, "tp_subgroup.forward")
    n, _ = _sizes(mesh)
    if tokens.shape[0] % n:
        raise ValueError(f"tp_subgroup.forward: {tokens.shape[0]} rows do not split over {n} ranks")

    def body(p, toks):
        ffn = _ffn(cfg, n, jnp.ones(toks.shape, bool), capacity, backend_name)
        hidden = run_decoder(p, cfg, embed(p, toks), cache_free_mixer(cfg, toks.shape[0], backend_name), ffn, backend_name)
        return lm_head(p, cfg, hidden)

    return jax.shard_map(body, mesh=mesh, check_vma=False, in_specs=(param_specs(params), P(RANKS)),
                         out_specs=P(RANKS))(params, tokens)


STATE_SPECS = DecodeState(kda=P(None, RANKS), conv=P(None, RANKS), kv_pages=P(None, RANKS))


def shard_state(state: DecodeState, mesh: Mesh) -> DecodeState:
    """As `dep.shard_state`: rank r = g*T + t owns slots r*S.. and pages r*Pg.. (local ids in its meta)."""
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, STATE_SPECS,
                        is_leaf=lambda x: isinstance(x, P))


def _step(params, cfg, state, tokens, meta, mesh, kda_mode, capacity, backend_name):
    n, _ = _sizes(mesh)
    if tokens.shape[0] % n:
        raise ValueError(f"tp_subgroup: {tokens.shape[0]} rows do not split over {n} ranks")

    def body(p, st, toks, m):
        caches = {"kda": st.kda, "conv": st.conv, "kv_pages": st.kv_pages}
        valid = jnp.arange(toks.shape[1])[None, :] < m.lengths[:, None]
        hidden = run_decoder(p, cfg, embed(p, toks), cached_mixer(cfg, caches, m, kda_mode, backend_name),
                             _ffn(cfg, n, valid, capacity, backend_name), backend_name)
        return lm_head(p, cfg, last_token_hidden(hidden, m.lengths)), DecodeState(**caches)

    meta_specs = jax.tree.map(lambda _: P(RANKS), meta)
    return jax.shard_map(body, mesh=mesh, check_vma=False,
                         in_specs=(param_specs(params), STATE_SPECS, P(RANKS), meta_specs),
                         out_specs=(P(RANKS), STATE_SPECS))(params, state, tokens, meta)


@partial(jax.jit, static_argnames=("cfg", "mesh", "capacity", "backend_name"), donate_argnames=("state",))
def prefill(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta, mesh: Mesh,
            capacity: int | None = None, backend_name: str = "reference"):
    """`dep.prefill` with TP subgroups (same row / slot / page layout)."""
    check_tokens(tokens, 2, "tp_subgroup.prefill")
    return _step(params, cfg, state, tokens, meta, mesh, "chunked", capacity, backend_name)


@partial(jax.jit, static_argnames=("cfg", "mesh", "capacity", "backend_name"), donate_argnames=("state",))
def decode(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta, mesh: Mesh,
           capacity: int | None = None, backend_name: str = "reference"):
    """`dep.decode` with TP subgroups: tokens int32 [n*Bl] -> (logits float32 [n*Bl, V], new state)."""
    check_tokens(tokens, 1, "tp_subgroup.decode")
    return _step(params, cfg, state, tokens[:, None], meta, mesh, "recurrent", capacity, backend_name)


@partial(jax.jit, static_argnames=("mesh",))
def column_parallel_block(x: jax.Array, w: jax.Array, mesh: Mesh) -> jax.Array:
    """`column_parallel` alone: x [n*N, H] (rows by rank), w [H, O] (columns split over "tp", O % T == 0)
    -> x @ w [n*N, O] (rows by rank). Used to measure the TP table's bytes."""
    _, t = _sizes(mesh)
    if w.shape[1] % t:
        raise ValueError(f"column_parallel_block: {w.shape[1]} columns do not split over tp={t}")
    return jax.shard_map(column_parallel, mesh=mesh, check_vma=False, in_specs=(P(RANKS), P(None, TP)),
                         out_specs=P(RANKS))(x, w)
