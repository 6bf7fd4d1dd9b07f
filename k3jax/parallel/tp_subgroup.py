"""TP subgroups inside DEP: groups of T consecutive ranks share the TP-selected weights, split 1/T each.

Mesh: 2-D, axes ("x", "tp") of shape (n/T, T); rank (g, t) is the t-th member of group g. DEP runs as usual
over all n ranks (requests stay on their rank: attention DP; the routed-expert all-to-all spans both
axes); inside a group, per local token (s_a activation bytes, s_w weight bytes):

  column_parallel(x, w_cols)   a projection [H, O] reading the hidden state, its columns split over the
      group: all-gather the group's tokens (each member then holds T*N rows), multiply by the local O/T
      columns, all-to-all the [T*N, O/T] result back so each token's owner gets its full O columns:
      (T-1)*H*s_a all-gathered + (T-1)/T*O*s_a all-to-all (O = H: the published table), weights H*O*s_w/T.
      `column_parallel_fused` runs several projections of the same x this way with one all-gather and
      one all-to-all (their columns side by side): O is then the sum of their (padded) widths.

  row_parallel(a, w_rows)      a projection [I, O] writing the hidden state (o_proj), its rows split over
      the group: all-to-all each owner's input columns to the member holding those rows ([T*N, I/T]),
      multiply, all-to-all the [T*N, O] partial sums back, the owner adds the T partials:
      (T-1)/T*I*s_a + (T-1)*O*s_a, weights I*O*s_w/T (a reduce-scatter spelled as all-to-all + local sum).

  attention (the model path)   the published TP selection, `k3jax.plan.TP_COLUMN_PROJECTIONS` /
      `TP_ROW_PROJECTIONS` (one list: the planner counts the same tensors). `projection_hooks` gives the
      mixers (`k3jax.kda.kda_mixer`, `k3jax.mla`) a `linear` hook: KDA's q/k/v/g_proj go through one
      `column_parallel_fused` (one all-gather of x, one all-to-all of 4*H*K columns), MLA's g_proj (and
      q_proj when there is no q LoRA) another, each o_proj through `row_parallel`. The low-rank and
      latent-side projections (KDA f_a/f_b/b_proj/g_a/g_b, MLA q_a/q_b/kv_a/kv_b) stay replicated and
      run locally. The attention core (the KDA scan, MLA over the rank's own pages) never moves: each
      owner computes its tokens' heads in full, so caches stay per rank as in DEP.

  shared experts (the model)   the same all-gather, then the GLU's gate/up as column GEMMs (hidden units
      split over the group), the down projection on the local hidden units (rows), and the partial
      [T*N, D] sums all-to-all'd back to the owners, who add the T partials: every shared-expert weight
      is 1/T per rank; per local token (T-1)*D*s_a each way.

Widths that do not divide by T (k3-tiny: MLA's 3 heads x 12 = 36 at T = 8) are zero-padded at the end to
the next multiple: zero columns are cut off after the all-to-all, zero rows meet zero-padded input
columns, so results are exact; the padding shows in the bytes ((T-1)/T * padded width).
`closed_form_bytes_per_token` is that accounting, from the config; tests/parallel/test_strategies.py holds
the compiled HLO to it for T = 1, 2, 4, 8, and the logits to the single-device model.
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.config import ModelConfig
from k3jax.layers import Linear
from k3jax.layers import dense, glu_activation
from k3jax.model import DecodeState, StepMeta, embed, last_token_hidden, lm_head
from k3jax.parallel import dep
from k3jax.parallel.common import AXIS, cache_free_mixer, cached_mixer, check_tokens, pad_groups, padded, run_decoder
from k3jax.plan import TP_COLUMN_PROJECTIONS, TP_ROW_PROJECTIONS

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


def column_parallel_fused(x: jax.Array, w_cols: dict[str, jax.Array], widths: dict[str, int]) -> dict[str, jax.Array]:
    """Inside shard_map: several column-split projections of the same x [N, H] with one all-gather and one
    all-to-all. w_cols: {name: [H, O_pad/T]} this rank's columns (O_pad: the width O rounded up to a multiple
    of T, zero columns at the end); widths: {name: O} -> {name: [N, O]}."""
    t = jax.lax.axis_size(TP)
    names = list(w_cols)
    local = [w_cols[name].shape[1] for name in names]
    # [N, T * sum(local)]: member j's block holds its columns of every projection, in `names` order
    full = column_parallel(x, jnp.concatenate([w_cols[name] for name in names], axis=1)).reshape(x.shape[0], t, -1)
    out, start = {}, 0
    for name, cols in zip(names, local):
        out[name] = full[:, :, start:start + cols].reshape(x.shape[0], t * cols)[:, : widths[name]]
        start += cols
    return out


def row_parallel(a: jax.Array, w_rows: jax.Array) -> jax.Array:
    """Inside shard_map: a [N, I] (this rank's tokens, all I input columns) times a row-split weight
    (w_rows [I_pad/T, O], this rank's rows of its group; I_pad = I rounded up to a multiple of T, zero rows
    at the end) -> [N, O], the full output for this rank's tokens."""
    t = jax.lax.axis_size(TP)
    n, width = a.shape
    rows = w_rows.shape[0]
    if rows * t < width:
        raise ValueError(f"row_parallel: {rows} rows per rank x {t} ranks < {width} input columns")
    a = jnp.pad(a, ((0, 0), (0, rows * t - width)))  # zero columns meet the zero rows of the padded weight
    if t > 1:  # member j gets columns j*rows.. of every member's tokens: [T*N, I_pad/T], in member order
        a = jax.lax.all_to_all(a, TP, 1, 0, tiled=True)
    partial_sums = jnp.einsum("ni,io->no", a, w_rows.astype(a.dtype), preferred_element_type=jnp.float32)
    if t == 1:
        return partial_sums.astype(a.dtype)
    # [T, N, O]: every member's partial of my rows; they travel in the activation dtype (s_a), added in fp32
    back = jax.lax.all_to_all(partial_sums.astype(a.dtype).reshape(t, n, -1), TP, 0, 0)
    return jnp.sum(back.astype(jnp.float32), axis=0).astype(a.dtype)


def _kind(cfg: ModelConfig, layer: int) -> str:
    return "mla" if cfg.is_mla(layer) else "kda"


@lru_cache(maxsize=16)
def _split_widths(cfg: ModelConfig) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    """{kind: ({column projection: output width O}, {row projection: input width I})} of the TP-selected
    projections the config has (MLA q_proj only without q LoRA, g_proj only with an output gate), from the
    single-device param shapes."""
    from k3jax.params import param_shapes

    shapes = param_shapes(cfg)["layers"]
    out = {}
    for l in range(cfg.num_layers):
        attn, kind = shapes[l]["attn"], _kind(cfg, l)
        out.setdefault(kind, ({name: attn[name].shape[1] for name in TP_COLUMN_PROJECTIONS[kind] if name in attn},
                              {name: attn[name].shape[0] for name in TP_ROW_PROJECTIONS[kind] if name in attn}))
    return out


def projection_hooks(cfg: ModelConfig) -> dict[str, Linear]:
    """Inside shard_map: the mixers' `linear` hooks per kind ("kda" / "mla") over `shard_params`' weights:
    the TP-selected column projections of one call through one `column_parallel_fused`, the row ones through
    `row_parallel`, the rest (replicated) as plain `dense`."""
    widths = {kind: cols for kind, (cols, _) in _split_widths(cfg).items()}

    def hook(kind: str) -> Linear:
        column, row = TP_COLUMN_PROJECTIONS[kind], TP_ROW_PROJECTIONS[kind]

        def linear(x: jax.Array, weights: dict[str, jax.Array]) -> dict[str, jax.Array]:
            lead, flat = x.shape[:-1], x.reshape(-1, x.shape[-1])
            cols = {name: w for name, w in weights.items() if name in column}
            out = column_parallel_fused(flat, cols, {name: widths[kind][name] for name in cols}) if cols else {}
            for name, w in weights.items():
                if name in row:
                    out[name] = row_parallel(flat, w)
                elif name not in column:
                    out[name] = dense(flat, w)
            return {name: out[name].reshape(*lead, -1) for name in weights}

        return linear

    return {"kda": hook("kda"), "mla": hook("mla")}


def closed_form_bytes_per_token(cfg: ModelConfig, t: int, act_bytes: int) -> dict[str, dict[str, float]]:
    """Bytes one rank sends per local token in each decoder layer's TP-selected attention projections,
    {"kda" / "mla": {"all-gather", "all-to-all"}}: per `column_parallel_fused` call (H = hidden size)
    (T-1)*H*s_a all-gathered + (T-1)/T*sum(O_pad)*s_a back; per row projection (T-1)/T*I_pad*s_a
    out + (T-1)*H*s_a back (the partial sums). Widths padded to multiples of T as `shard_params` does."""
    h = cfg.hidden_size
    out = {}
    for kind, (columns, rows) in _split_widths(cfg).items():
        gathered = (t - 1) * h * act_bytes if columns else 0.0
        to_all = (t - 1) / t * sum(padded(o, t) for o in columns.values()) * act_bytes
        for width in rows.values():
            to_all += (t - 1) / t * padded(width, t) * act_bytes + (t - 1) * h * act_bytes
        out[kind] = {"all-gather": float(gathered), "all-to-all": float(to_all)}
    return out


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


def param_specs(params: dict, cfg: ModelConfig) -> dict:
    """DEP's specs with experts split over both axes, the shared experts' hidden units over "tp", and the
    TP-selected attention projections' columns (column projections) or rows (o_proj) over "tp"."""
    specs = dep.param_specs(params)
    for l, (lp, ls) in enumerate(zip(params["layers"], specs["layers"])):
        for name in TP_COLUMN_PROJECTIONS[_kind(cfg, l)]:
            if name in lp["attn"]:
                ls["attn"][name] = P(None, TP)
        for name in TP_ROW_PROJECTIONS[_kind(cfg, l)]:
            if name in lp["attn"]:
                ls["attn"][name] = P(TP, None)
        if "router" in lp["mlp"]:
            ls["mlp"]["experts"] = {k: P(RANKS, *([None] * (w.ndim - 1))) for k, w in lp["mlp"]["experts"].items()}
            ls["mlp"]["shared"] = {"gate": P(None, TP), "up": P(None, TP), "down": P(TP, None)}
    return specs


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Single-device params -> TP-subgroup params (experts padded to a multiple of n, shared hidden width
    to a multiple of T -- zero hidden units contribute zero --, the TP-selected attention projections' split
    axis to a multiple of T with zeros at the end, and placed)."""
    n, t = _sizes(mesh)
    out = dict(params)
    out["layers"] = []
    for l, lp in enumerate(params["layers"]):
        lp = dict(lp)
        attn = dict(lp["attn"])
        for axis, names in ((1, TP_COLUMN_PROJECTIONS[_kind(cfg, l)]), (0, TP_ROW_PROJECTIONS[_kind(cfg, l)])):
            for name in names:
                if name in attn:
                    width = attn[name].shape[axis]
                    attn[name] = pad_groups(attn[name], axis, width, padded(width, t))
        lp["attn"] = attn
        if "router" in lp["mlp"]:
            m = dict(lp["mlp"])
            m["experts"] = {k: pad_groups(w, 0, cfg.num_experts, padded(cfg.num_experts, n)) for k, w in m["experts"].items()}
            width = m["shared"]["gate"].shape[1]
            m["shared"] = {"gate": pad_groups(m["shared"]["gate"], 1, width, padded(width, t)),
                           "up": pad_groups(m["shared"]["up"], 1, width, padded(width, t)),
                           "down": pad_groups(m["shared"]["down"], 0, width, padded(width, t))}
            lp["mlp"] = m
        out["layers"].append(lp)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), out, param_specs(out, cfg),
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
        mixer = cache_free_mixer(cfg, toks.shape[0], backend_name, projection_hooks(cfg))
        hidden = run_decoder(p, cfg, embed(p, toks), mixer, ffn, backend_name)
        return lm_head(p, cfg, hidden)

    return jax.shard_map(body, mesh=mesh, check_vma=False, in_specs=(param_specs(params, cfg), P(RANKS)),
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
        mixer = cached_mixer(cfg, caches, m, kda_mode, backend_name, projection_hooks(cfg))
        hidden = run_decoder(p, cfg, embed(p, toks), mixer, _ffn(cfg, n, valid, capacity, backend_name), backend_name)
        return lm_head(p, cfg, last_token_hidden(hidden, m.lengths)), DecodeState(**caches)

    meta_specs = jax.tree.map(lambda _: P(RANKS), meta)
    return jax.shard_map(body, mesh=mesh, check_vma=False,
                         in_specs=(param_specs(params, cfg), STATE_SPECS, P(RANKS), meta_specs),
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
