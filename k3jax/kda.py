"""Kimi Delta Attention (k3-model.md §3): the layer, its gate, and the two reference scans.

Shapes: B batch, T tokens, H heads, K = d_k, V = d_v. The recurrent state is V-first [B, H, V, K] fp32
(K3's `state_v_first=True`). Per head and token, with decay e^g (per key channel) and strength beta:

    S <- S * e^g[None, :]            (decay the key columns)
    S <- S + beta * (v - S k) k^T    (delta rule)
    o  = S q

`kda_recurrent_reference` runs that token by token; `kda_chunked_reference` runs the same recurrence in
chunks of 64 with the WY/UT form (fp32 unit-lower-triangular inverse), which is what prefill uses.
Padding tokens must carry g = 0 and beta = 0: then they leave the state untouched in both forms.

Verify (speculative decoding) needs the state after every position, to keep an accepted prefix. It does not write
them: each position's step is a rank-one update of the decayed state,

    S_t = S_{t-1} * d_t[None, :] + e_t k_t^T,   d_t = e^g_t,   e_t = beta_t (v_t - (S_{t-1} * d_t[None, :]) k_t)

so verify returns the per-position (e_t [V], k_t [K], d_t [K]) -- 1.5 KB per head and position instead of a 64 KB
state -- and `apply_verify_updates` rebuilds the state after any prefix from the state before the step (which the
pool still holds) with the same arithmetic. A verify step then moves one state per (row, head) instead of 1 + T,
and keeping a prefix moves two (read, write). At K3's 69 KDA layers x 96 heads, B64, T4, the per-position states
were 108 GB; the updates are 2.6 GB.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax import backend, fuse
from k3jax.config import ModelConfig
from k3jax.layers import Linear  # the projection hook
from k3jax.layers import causal_conv_with_state, dense, dense_each_with, l2_normalize

CHUNK_SIZE = 64


def kda_gate(z: jax.Array, a_log: jax.Array, dt_bias: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Log-space forget gate g [..., H, K] (fp32) from the raw f_b output z [..., H, K].

    lower_bound (K3):  g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias))   in (lb, 0)
    softplus (Kimi-Linear): g = -exp(A_log[h]) * softplus(z + dt_bias)
    """
    h, k = z.shape[-2:]
    a = jnp.exp(a_log[:h].astype(jnp.float32))[:, None]  # [H, 1]; K3 pads A_log to 128 entries
    x = z.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(h, k)
    if cfg.kda_gate == "lower_bound":
        return cfg.kda_gate_lower_bound * jax.nn.sigmoid(a * x)
    return -a * jax.nn.softplus(x)


@backend.register("kda_recurrent", "reference")
def kda_recurrent_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
    *, all_states: bool = False,
) -> tuple[jax.Array, jax.Array | tuple[jax.Array, jax.Array, jax.Array]]:
    """Token-by-token KDA.

    Args:
      q, k: [B, T, H, K] fp32, already L2-normalised (q also scaled by K^-1/2).
      v: [B, T, H, V]; g: [B, T, H, K] log decay; beta: [B, T, H]; state: [B, H, V, K] fp32.
      all_states: (verify) return every position's update (err [B, T, H, V], key [B, T, H, K], decay
        [B, T, H, K], fp32; the module docstring) instead of the final state: `apply_verify_updates` turns
        them into the state after any prefix.

    Returns:
      o: [B, T, H, V] fp32 and the final state [B, H, V, K] (or the updates, see above).
    """
    def step(s, inputs):
        q_t, k_t, v_t, g_t, b_t = inputs  # [B,H,K] [B,H,K] [B,H,V] [B,H,K] [B,H]
        decay = jnp.exp(g_t)
        s = s * decay[:, :, None, :]
        err = b_t[..., None] * (v_t - jnp.einsum("bhvk,bhk->bhv", s, k_t))
        s = s + err[..., :, None] * k_t[..., None, :]
        o_t = jnp.einsum("bhvk,bhk->bhv", s, q_t)
        return s, (o_t, (err, k_t, decay) if all_states else None)

    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)
    final, (o, updates) = jax.lax.scan(step, state.astype(jnp.float32), tuple(map(f32, (q, k, v, g, beta))))
    o = jnp.moveaxis(o, 0, 1)
    return (o, tuple(jnp.moveaxis(u, 0, 1) for u in updates)) if all_states else (o, final)


def apply_verify_updates(state: jax.Array, err: jax.Array, key: jax.Array, decay: jax.Array,
                         count: jax.Array) -> jax.Array:
    """The KDA state after the first `count` positions of a verify step, from the state before it.

    state [..., H, V, K] fp32 (before the step); err [..., T, H, V], key and decay [..., T, H, K] fp32: the step's
    per-position updates (`kda_recurrent_reference(all_states=True)`, the fused verify kernels); count [...] int
    (0..T; more counts as T). Position t applies S <- S * decay_t[None, :] + err_t[:, None] key_t[None, :], the
    recurrence's own operations in its order, so the result is the state a decode step by step reaches (to fp32
    rounding of the last bit, where a kernel fuses the multiply-add differently)."""
    t = err.shape[-3]
    if key.shape != decay.shape or err.shape[:-1] != key.shape[:-1] or state.shape[:-3] != err.shape[:-3]:
        raise ValueError(f"apply_verify_updates: state [..., H, V, K], err [..., T, H, V], key / decay [..., T, H, K] "
                         f"with equal leading dims; got {state.shape}, {err.shape}, {key.shape}, {decay.shape}")
    s = state.astype(jnp.float32)
    count = jnp.asarray(count)[..., None, None, None]
    for i in range(t):
        s = jnp.where(i < count, _apply_update(s, err[..., i, :, :], key[..., i, :, :], decay[..., i, :, :]), s)
    return s


def _apply_update(s, err, key, decay):
    """One verify position's update of states s [..., H, V, K]: err [..., H, V], key and decay [..., H, K]."""
    return s * decay[..., None, :] + err[..., :, None] * key[..., None, :]


def conv_window_after(window: jax.Array, inputs: jax.Array, count: jax.Array) -> jax.Array:
    """The short conv's state after the first `count` positions of a verify step: the last W-1 rows of
    [window; inputs[:count]] -- verify writes no conv states; the commit rebuilds the kept one from these.

    window [..., W-1, C] the state before the step (zeros for a fresh row); inputs [..., T, C] the step's q|k|v
    inputs before the conv (valid or not: a kept prefix never reaches padding); count [...] int, 0..T (clamped).
    Returns [..., W-1, C] in window's dtype: the inputs ending at position count - 1, as a decode step by step
    would have left them."""
    w1, t = window.shape[-2], inputs.shape[-2]
    if window.shape[:-2] != inputs.shape[:-2] or window.shape[-1] != inputs.shape[-1]:
        raise ValueError(f"conv_window_after: window [..., W-1, C] and inputs [..., T, C] with equal leading dims; "
                         f"got {window.shape}, {inputs.shape}")
    seq = jnp.concatenate([window.astype(inputs.dtype), inputs], axis=-2)  # [..., W-1+T, C]
    first = jnp.clip(jnp.asarray(count), 0, t)[..., None] + jnp.arange(w1)  # rows count .. count + W-2
    return jnp.take_along_axis(seq, first[..., None], axis=-2).astype(window.dtype)


def states_from_updates(state: jax.Array, err: jax.Array, key: jax.Array, decay: jax.Array) -> jax.Array:
    """The state after every position, [..., T, H, V, K], from the state before them [..., H, V, K] and their
    updates (`apply_verify_updates`' arguments; the same operations, so each equals apply_verify_updates at t + 1).
    For references and tests: the model never materialises them."""
    def step(s, update):
        s = _apply_update(s, *update)
        return s, s

    _, states = jax.lax.scan(step, state.astype(jnp.float32), tuple(jnp.moveaxis(u, -3, 0) for u in (err, key, decay)))
    return jnp.moveaxis(states, 0, -4)


@backend.register("kda_chunked", "reference")
def kda_chunked_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
    *, chunk_size: int = CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:
    """Chunked KDA (WY/UT form), same arguments and results as `kda_recurrent_reference`.

    Within a chunk, with G = cumsum(g) and S the state at the chunk start (V-first):
      L[i,j] = beta_i sum_d k_i e^(G_i-G_j) k_j  (j < i);  A = (I + L)^-1 (unit lower triangular, fp32)
      W = A diag(beta) (e^G * K);  U = A diag(beta) V;  V' = U - W S^T
      O = (Q * e^G) S^T + Aqk V',   Aqk[i,j] = sum_d q_i e^(G_i-G_j) k_j  (j <= i)
      S <- S * e^(G_C) + V'^T (e^(G_C - G) * K)
    Pairwise decays are formed as exp(G_i - G_j) of masked differences, never e^G_i * e^-G_j, which
    overflows fp32 for lower-bounded gates (G reaches -5 * 64).
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    n = -(-t // c)
    pad = n * c - t

    def chunks(x):  # [B, T, H, ...] -> [N, B, H, C, ...] (zero padded: g = beta = 0 is a no-op token)
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, c, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    qc, kc, vc, gc, bc = map(chunks, (q, k, v, g, beta))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    incl = jnp.tril(jnp.ones((c, c), bool))
    eye = jnp.eye(c, dtype=jnp.float32)

    def step(s, inputs):
        q_c, k_c, v_c, g_c, b_c = inputs  # [B,H,C,K] x2, [B,H,C,V], [B,H,C,K], [B,H,C]
        cum = jnp.cumsum(g_c, axis=2)
        diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [B,H,C,C,K], G_i - G_j
        decay_strict = jnp.exp(jnp.where(strict[:, :, None], diff, -jnp.inf))
        decay_incl = jnp.exp(jnp.where(incl[:, :, None], diff, -jnp.inf))
        lower = b_c[..., :, None] * jnp.einsum("bhik,bhjk,bhijk->bhij", k_c, k_c, decay_strict)
        a = jax.scipy.linalg.solve_triangular(
            eye + lower, jnp.broadcast_to(eye, lower.shape), lower=True, unit_diagonal=True
        )
        t_mat = a * b_c[..., None, :]
        w = t_mat @ (jnp.exp(cum) * k_c)
        u = t_mat @ v_c
        v_new = u - jnp.einsum("bhck,bhvk->bhcv", w, s)
        a_qk = jnp.einsum("bhik,bhjk,bhijk->bhij", q_c, k_c, decay_incl)
        o = jnp.einsum("bhck,bhvk->bhcv", q_c * jnp.exp(cum), s) + a_qk @ v_new
        last = cum[:, :, -1, :]  # [B,H,K]
        s = s * jnp.exp(last)[:, :, None, :] + jnp.einsum(
            "bhcv,bhck->bhvk", v_new, jnp.exp(last[:, :, None, :] - cum) * k_c
        )
        return s, o

    final, o = jax.lax.scan(step, state.astype(jnp.float32), (qc, kc, vc, gc, bc))
    o = jnp.moveaxis(o, 0, 1).transpose(0, 1, 3, 2, 4).reshape(b, n * c, h, dv)[:, :t]
    return o, final


def kda_mixer(
    params: dict,
    x: jax.Array,
    conv_state: jax.Array,
    rec_state: jax.Array,
    cfg: ModelConfig,
    *,
    lengths: jax.Array | None = None,
    mode: str = "chunked",
    all_states: bool = False,
    backend_name: str = "reference",
    linear: Linear | None = None,
    slots: jax.Array | None = None,
    fresh: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One KDA attention block on pre-normed x [B, T, D].

    Args:
      conv_state: [B, W-1, 3*H*K] last inputs of the q|k|v short convs. rec_state: [B, H, V, K] fp32.
        With `slots`, pools instead: [P, W-1, 3*H*K] and [P, H, V, K], row b's states at slots[b].
      lengths: [B] valid tokens per row (None = all T); padding leaves both states unchanged.
      mode: "chunked" (prefill) or "recurrent" (decode / verify) -- mathematically identical.
      all_states: (recurrent only, verify) return the step's conv inputs [B, T, C] (the q|k|v projections before
        the conv) and every token's recurrent-state update (err [B, T, H, V], key, decay [B, T, H, K]; the module
        docstring), so speculative verification can keep any prefix (`conv_window_after`,
        `apply_verify_updates`).
      linear: how the block multiplies by the weights on the hidden-state boundary (see `Linear`): called
        once with every projection reading x (q/k/v, f_a, b, and g or g_a) and once with o_proj. Default:
        plain `dense` each; a parallel strategy passes sharded GEMMs (k3jax.parallel.tp_subgroup). Params in the
        serving layout (k3jax.fuse.fuse_for_serving: one "in_proj" for all six) take the default only.
      slots: [B] int32 distinct pool rows (None: the states are per row, see above). The fused decode kernel
        reads the pools at `slots` itself and, in decode, writes them in place (when the caller donates them);
        with all_states (verify) it only reads them: the conv inputs and updates are new [B, T, ...]
        arrays and the pools are neither written nor copied (not aliased to any output). Every other path gathers
        the B rows and runs as without slots, then scatters them back (decode) or returns the per-position results.
      fresh: [B] bool / int (None: none) rows that start from the zero conv and recurrent states whatever
        conv_state / rec_state hold for them (a new request in a reused slot). The fused decode kernel takes the
        flag itself (it skips reading those slots, then overwrites them); every other path zeroes the rows it
        gathered (or was given) with a select, so no pool is written to clear a slot.

    Returns: (y [B, T, D], new_conv_state, new_rec_state) -- with `slots`, the pools updated at those rows;
      with all_states (slots or not), the B rows' conv inputs and state updates instead (see all_states), and
      the pools, if given, stay as they were.
    """
    b, t, _ = x.shape
    h, dk = cfg.kda_num_heads, cfg.kda_head_dim
    fused_op = {"chunked": "kda_chunked_fused", "recurrent": "kda_decode_fused"}.get(mode)
    fused = fused_op is not None and backend_name in backend.implemented(fused_op)
    fused_decode = fused and mode == "recurrent"  # the only path that indexes pools and zeroes fresh rows itself
    if fresh is not None and fresh.shape != (b,):
        raise ValueError(f"kda_mixer: fresh must be [B={b}]; got {fresh.shape}")
    if all_states and mode != "recurrent":
        raise ValueError(f"kda_mixer: all_states needs mode='recurrent'; got {mode!r}")
    if slots is not None:
        if slots.shape != (b,):
            raise ValueError(f"kda_mixer: slots must be [B={b}]; got {slots.shape}")
        if not fused_decode:  # gather the rows, run as without slots; decode scatters them back
            y, new_conv, new_rec = kda_mixer(params, x, conv_state[slots], rec_state[slots], cfg, lengths=lengths,
                                             mode=mode, all_states=all_states, backend_name=backend_name,
                                             linear=linear, fresh=fresh)
            if all_states:  # per-position results of the B rows; the pools stay as they were
                return y, new_conv, new_rec
            return (y, conv_state.at[slots].set(new_conv),
                    rec_state.at[slots].set(new_rec))
    if fresh is not None and not fused_decode:  # a select, not a multiply: exact zeros whatever the rows hold
        keep = fresh == 0
        conv_state = jnp.where(keep[:, None, None], conv_state, jnp.zeros_like(conv_state))
        rec_state = jnp.where(keep[:, None, None, None], rec_state, jnp.zeros_like(rec_state))
        fresh = None
    matmul = backend.get("dense", backend_name)
    qkv, proj, conv_w, packed = _input_projections(params, x, cfg, linear, matmul)
    linear = linear or dense_each_with(matmul)
    z = matmul(proj["f_a"], params["f_b"]).reshape(b, t, h, dk)  # raw forget-gate logits
    beta_logits = proj["b_proj"].astype(jnp.float32)  # [B, T, H]
    gate = (proj["g_proj"] if "g_proj" in proj else matmul(proj["g_a"], params["g_b"])).reshape(b, t, h, dk)
    if fused:
        y, new_conv, new_rec = _fused_mixer(backend.get(fused_op, backend_name), params, x, qkv, z, beta_logits, gate,
                                            conv_w, conv_state, rec_state, cfg, lengths=lengths, mode=mode,
                                            all_states=all_states, backend_name=backend_name, slots=slots,
                                            fresh=fresh, packed=packed)
        return linear(y.reshape(b, t, h * dk), {"o_proj": params["o_proj"]})["o_proj"], new_conv, new_rec
    if all_states:  # verify returns the conv's inputs: a kept window is rebuilt from them (conv_window_after)
        y, _ = causal_conv_with_state(qkv, conv_state, conv_w)
        new_conv = qkv
    else:
        y, new_conv = causal_conv_with_state(qkv, conv_state, conv_w, lengths)
    q, k, v = (y[..., i * h * dk : (i + 1) * h * dk].reshape(b, t, h, dk) for i in range(3))
    q = l2_normalize(q) * dk**-0.5
    k = l2_normalize(k)
    g = kda_gate(z, params["A_log"], params["dt_bias"], cfg)
    beta = jax.nn.sigmoid(beta_logits)  # [B, T, H]
    if lengths is not None:
        valid = jnp.arange(t)[None, :] < lengths[:, None]
        g = jnp.where(valid[..., None, None], g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
    if mode == "chunked":
        o, new_rec = backend.get("kda_chunked", backend_name)(q, k, v, g, beta, rec_state)
    elif mode == "recurrent":
        o, new_rec = backend.get("kda_recurrent", backend_name)(q, k, v, g, beta, rec_state, all_states=all_states)
    else:
        raise ValueError(f"unknown KDA mode {mode!r}")
    o = backend.get("gated_rms_norm", backend_name)(o.astype(x.dtype), gate, params["o_norm"], cfg.rms_norm_eps)
    out = linear(o.reshape(b, t, h * dk), {"o_proj": params["o_proj"]})["o_proj"]
    return out, new_conv, new_rec


def _input_projections(params: dict, x: jax.Array, cfg: ModelConfig, linear: Linear | None, matmul=dense):
    """The GEMMs reading x: (qkv [B, T, 3HK] before the conv, {f_a, b_proj, g_proj or g_a: [B, T, N]},
    conv weight [W, 3HK], packed).

    Serving layout (k3jax.fuse: "in_proj" = q|k|v|f_a|b|gate, "qkv_conv" pre-concatenated): ONE GEMM whose
    output is sliced -- qkv is its leading 3HK columns, so nothing is concatenated per step; with a full-rank
    output gate, packed = (the whole GEMM output, (gate column, beta column)) for the fused decode kernel, which
    reads it in place (pallas_kernels.kda_decode's `packed`). Otherwise the checkpoint layout through `linear`
    (one call with the six weights), the q|k|v outputs and conv weights concatenated here, and packed None.
    """
    if fuse.is_fused(params):
        if linear is not None:
            raise ValueError("kda_mixer: params in the fused serving layout (k3jax.fuse.fuse_for_serving) take the "
                             "default linear only; a parallel strategy needs the unfused params")
        q, k, v, *rest = fuse.kda_input_columns(cfg)  # q|k|v lead: one slice is the conv's input
        whole = matmul(x, params[fuse.FUSED_INPUT])
        cols = fuse.split_columns(whole, (("qkv", q[1] + k[1] + v[1]), *rest))
        starts = fuse.column_starts((q, k, v, *rest))
        packed = (whole, (starts["g_proj"], starts["b_proj"])) if "g_proj" in starts else None
        return cols.pop("qkv"), cols, params[fuse.FUSED_CONV], packed
    gate_in = "g_proj" if "g_proj" in params else "g_a"  # full-rank output gate (K3) or low-rank (Kimi-Linear)
    proj = (linear or dense_each_with(matmul))(x, {name: params[name]
                                      for name in ("q_proj", "k_proj", "v_proj", "f_a", "b_proj", gate_in)})
    qkv = jnp.concatenate([proj["q_proj"], proj["k_proj"], proj["v_proj"]], -1)
    conv_w = jnp.concatenate([params["q_conv"], params["k_conv"], params["v_conv"]], axis=-1)  # [W, 3HK]
    return qkv, {name: proj[name] for name in ("f_a", "b_proj", gate_in)}, conv_w, None


def _fused_mixer(op, params, x, qkv, z, beta_logits, gate, conv_w, conv_state, rec_state, cfg: ModelConfig, *,
                 lengths, mode, all_states, backend_name, slots=None, fresh=None, packed=None):
    """kda_mixer's core through a fused kernel op, from the input projections (qkv [B, T, 3HK], z and gate
    [B, T, H, K], beta_logits [B, T, H] fp32) to the gated-normed heads y [B, T, H, K] before o_proj (same
    results as the reference path, to kernel tolerance).

    chunked: the short conv stays in XLA; the kernel fuses the L2 norms, gate, beta and the chunked scan.
    recurrent: the kernel fuses conv, norms, gate, beta, the delta rule and the gated RMSNorm; the states are
    pools indexed by `slots` (None: per-row states, rows 0..B-1), and rows flagged `fresh` start from zero states;
    with `packed` (`_input_projections`) the op gets the whole projection instead of the qkv / beta / gate slices.
    """
    b, t, _ = x.shape
    h, dk = cfg.kda_num_heads, cfg.kda_head_dim
    lens = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    gate_kw = dict(gate=cfg.kda_gate, lower_bound=cfg.kda_gate_lower_bound)
    if mode == "recurrent":
        rows = jnp.arange(b, dtype=jnp.int32) if slots is None else slots.astype(jnp.int32)
        operands = (qkv, beta_logits, gate) if packed is None else (packed[0], None, None)
        extra = {} if packed is None else {"packed": packed[1]}
        out = op(operands[0], conv_state, conv_w, z, *operands[1:], rec_state, rows, lens, a_log=params["A_log"],
                 dt_bias=params["dt_bias"], o_norm_weight=params["o_norm"], eps=cfg.rms_norm_eps,
                 all_states=all_states, fresh=fresh, **gate_kw, **extra)
        # verify: (y, updates) -- no conv states; the step's conv inputs stand in for them (conv_window_after)
        y, new_conv, new_rec = (out[0], qkv, out[1]) if all_states else out
    else:
        conv_out, new_conv = causal_conv_with_state(qkv, conv_state, conv_w, lengths)
        q, k, v = (conv_out[..., i * h * dk : (i + 1) * h * dk].reshape(b, t, h, dk) for i in range(3))
        o, new_rec = op(q, k, v, z, beta_logits, rec_state, lens, a_log=params["A_log"], dt_bias=params["dt_bias"],
                        **gate_kw)
        y = backend.get("gated_rms_norm", backend_name)(o.astype(x.dtype), gate, params["o_norm"], cfg.rms_norm_eps)
    return y, new_conv, new_rec


# The model's chunked-prefill stage 1 (pallas_kernels/kda_chunk.py). On the GPU "pallas" (kda_intra, 8 warps,
# 16x16-block inverse): 2.93 ms against 5.09 ms for the XLA "v2" stage at B1 T32768 H32 on the H200 (2026-11-30,
# docs/benchmarks.md). The CPU interpret backend keeps "v2": the one-kernel stage in interpret mode would add
# minutes to CI's model tests, and tests/kernels/test_kda_intra.py checks that kernel against v2 on its own.
KDA_STAGE1 = "pallas"
KDA_STAGE1_INTERPRET = "v2"
# The fused decode kernel (read at trace time): "mosaic" (pallas_kernels/kda_decode_mgpu.py: the state streamed by
# TMA; decode and verify, K a multiple of 128 -- other sizes fall back to the Triton kernel) or "triton"
# (pallas_kernels/kda_decode.py). On the H200 (2026-12-03, docs/benchmarks.md) "mosaic" is 1.05x / 1.10x the Triton
# kernel at B64 / B256 T1 H96 (79-86 % of copy); in verify T4 2.5x since 2026-12-04 (0.160 / 0.593 ms against
# 0.396 / 1.514, thirtieth session; tiled prep and norm, chunk form, own rings, two prep warpgroups). In the whole
# k3-small decode step (16 heads), once it read the fused projection in place (`packed`, as the Triton kernel does),
# 0.768 against 0.813 ms/step of KDA decode, the same 581 kernels, 0.1 ms less device time per step, shadow check
# passed (2026-12-04). The interpret backend (CPU) keeps the Triton kernel: Mosaic GPU's interpreter costs seconds
# per model step in CI; tests/kernels/test_kda_model.py runs the model through it.
KDA_DECODE_KERNEL = "mosaic"
KDA_DECODE_KERNEL_INTERPRET = "triton"
# Keeping a verify step's accepted prefix on the GPU (op "kda_commit", read at trace time): "kernel"
# (pallas_kernels/kda_commit.py: one state read and one written per row, in place) or "xla" (gather -> update ->
# scatter). H200, 2026-12-03 (docs/benchmarks.md, two calls), B64 / B256 H96 T4: kernel 0.266 / 1.003 ms (3.0-3.2
# TB/s, 73-77 % of copy), XLA 0.440 / 2.236 ms; tests/gpu/test_kda_gpu.py -k commit passed. The CPU "interpret"
# backend always runs the kernel.
KDA_COMMIT_KERNEL = "kernel"


def _packed_fused_chunk(chunk_fn, q, k, v, z, beta_logits, state, lengths, *, a_log, dt_bias, gate, lower_bound,
                        **chunk_kw):
    """Op "kda_chunked_fused" through `chunk_fn` (kda_chunk or its reference, same arguments): the B padded rows
    packed as B sequences of T tokens (lengths[b] valid), the gate, beta sigmoid and q/k L2 norm fused; padding
    rows of the output are zero."""
    b, t, h, dk = q.shape
    cu = jnp.arange(b + 1, dtype=jnp.int32) * t
    flat = lambda a: a.reshape(b * t, *a.shape[2:])
    o, final, _ = chunk_fn(flat(q), flat(k), flat(v), flat(z), flat(beta_logits), state, cu, a_log=a_log,
                           dt_bias=dt_bias, gate=gate, lower_bound=lower_bound, beta_sigmoid=True, qk_l2norm=True,
                           seq_lens=lengths, **chunk_kw)
    valid = jnp.arange(t)[None, :] < lengths[:, None]  # the kernel leaves padding rows unwritten
    return jnp.where(valid[..., None, None], o.reshape(b, t, h, -1), 0), final


def _fused_decode(*args, interpret: bool, all_states: bool = False, packed=None, **kw):
    """The fused decode / verify op: KDA_DECODE_KERNEL's kernel (KDA_DECODE_KERNEL_INTERPRET's in interpret mode)
    where it applies, else the Triton one. Both read a packed projection in place; the Mosaic one gets the slices
    only where TMA cannot address the packed columns."""
    from pallas_kernels.kda_decode import kda_decode, unpack_projection
    from pallas_kernels import kda_decode_mgpu

    kernel = KDA_DECODE_KERNEL_INTERPRET if interpret else KDA_DECODE_KERNEL
    if kernel not in ("triton", "mosaic"):
        raise ValueError(f"KDA_DECODE_KERNEL{'_INTERPRET' if interpret else ''} must be 'triton' or 'mosaic'; "
                         f"got {kernel!r}")
    if kernel == "mosaic":
        if packed is not None and kda_decode_mgpu.supported(*args, packed=packed):
            return kda_decode_mgpu.kda_decode_mgpu(*args, interpret=interpret, all_states=all_states, packed=packed,
                                                   **kw)
        unpacked = list(args)
        if packed is not None:
            state = args[6]
            unpacked[0], unpacked[4], unpacked[5] = unpack_projection(args[0], packed, state.shape[1], state.shape[2])
        if kda_decode_mgpu.supported(*unpacked):
            return kda_decode_mgpu.kda_decode_mgpu(*unpacked, interpret=interpret, all_states=all_states, **kw)
    return kda_decode(*args, interpret=interpret, all_states=all_states, packed=packed, **kw)


def _commit(*args, interpret: bool):
    """Op "kda_commit" on a kernel backend: the kernel in interpret mode, on the GPU per KDA_COMMIT_KERNEL."""
    from pallas_kernels.kda_commit import kda_commit, kda_commit_reference

    if KDA_COMMIT_KERNEL not in ("xla", "kernel"):
        raise ValueError(f"KDA_COMMIT_KERNEL must be 'xla' or 'kernel'; got {KDA_COMMIT_KERNEL!r}")
    if interpret or KDA_COMMIT_KERNEL == "kernel":
        return kda_commit(*args, interpret=interpret)
    return kda_commit_reference(*args)


def _register_pallas() -> None:
    """Registers the Pallas kernels (pallas_kernels/) for the GPU ("pallas") and CPU CI ("interpret")."""
    from pallas_kernels.kda_chunk import kda_chunk, kda_chunk_reference
    from pallas_kernels.kda_commit import kda_commit_reference
    from pallas_kernels.kda_decode import kda_decode_reference

    backend.register("kda_commit", "reference")(kda_commit_reference)

    for name, interpret in (("pallas", False), ("interpret", True)):

        stage1 = KDA_STAGE1_INTERPRET if interpret else KDA_STAGE1

        def chunked(q, k, v, g, beta, state, *, interpret=interpret, stage1=stage1):
            b, t, h, dk = q.shape
            cu = jnp.arange(b + 1, dtype=jnp.int32) * t
            flat = lambda a: a.reshape(b * t, *a.shape[2:])
            o, final, _ = kda_chunk(flat(q), flat(k), flat(v), flat(g), flat(beta), state, cu, stage1=stage1,
                                    interpret=interpret)
            return o.reshape(b, t, h, -1), final

        chunked_fused = functools.partial(_packed_fused_chunk, kda_chunk, stage1=stage1, interpret=interpret)

        backend.register("kda_chunked", name)(chunked)
        backend.register("kda_chunked_fused", name)(chunked_fused)
        backend.register("kda_decode_fused", name)(functools.partial(_fused_decode, interpret=interpret))
        backend.register("kda_commit", name)(functools.partial(_commit, interpret=interpret))

    backend.register_twin("kda_chunked_fused")(functools.partial(_packed_fused_chunk, kda_chunk_reference))
    backend.register_twin("kda_decode_fused")(kda_decode_reference)


_register_pallas()
