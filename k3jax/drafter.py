"""EAGLE-3 drafter for a K3-family target (k3-model.md §7). Pure functions over a parameter pytree.

One draft step at position t (the target has produced features up to t and token x_{t+1} is known):

    f_t = fc(concat of the target's captured layer inputs at t)          3D -> D, no bias
    x   = concat[RMSNorm(emb(x_{t+1})), RMSNorm(hidden_t)]              2D wide; hidden_t = f_t, or the
                                                                         previous step's h' when chaining
    h   = hidden_t + GatedMLA_NoPE(x)                                    q/kv/gate projections take 2D
    h'  = h + SiTU_MLP(RMSNorm(h))                                       pre-norm output, fed back as hidden
    logits = lm_head(RMSNorm(h'))                                        over the reduced draft vocab
    target id = draft id + d2t[draft id]

The embedding is the target's (passed in, never copied). The attention heads, ranks and MLP width are
the target's unless DrafterConfig overrides them.

Draft KV cache: contiguous per request, DrafterState.kv [B, S, C+R] (row b is request b) holding the
576-wide-style latent [c | k_pe] of the draft layer; `length` counts the positions computed from the
target's own features. Entries written by chained draft steps lie past `length` and are scratch: the
next call overwrites them with the features the target computed for the accepted tokens.

Parameters (linear weights [in, out]):
    fc [3D, D]; emb_norm, hidden_norm [D]
    attn: q_a [2D, Q] q_a_norm [Q] q_b [Q, H*(N+R)] (or q_proj [2D, H*(N+R)]); kv_a [2D, C+R];
          kv_a_norm [C]; kv_b [C, H*(N+Vd)]; g_proj [2D, H*Vd] (gated MLA); o_proj [H*Vd, D]
    post_attention_layernorm [D]; mlp: gate, up [D, I], down [I, D]; norm [D]; lm_head [D, Vdraft]
    d2t [Vdraft] int32 (not trained)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from k3jax import mla
from k3jax.config import ModelConfig
from k3jax.layers import dense, mlp, rms_norm
from k3jax.model import eagle_capture_layers
from k3jax.params import INIT_STD


@dataclass(frozen=True)
class DrafterConfig:
    """Drafter hyper-parameters. Fields left None take the target's value (see `resolve`)."""

    draft_vocab_size: int
    capture_layers: tuple[int, ...] | None = None  # None = eagle_capture_layers(target)
    num_heads: int | None = None  # MLA heads of the draft layer
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    intermediate_size: int | None = None  # SiTU MLP width (None = the target's dense MLP width)

    def __post_init__(self) -> None:
        if self.capture_layers is not None:  # hashable (a static jit argument) whatever sequence was given
            object.__setattr__(self, "capture_layers", tuple(int(i) for i in self.capture_layers))

    def resolve(self, cfg: ModelConfig) -> DrafterConfig:
        """A copy with every None filled from the target config `cfg`; raises ValueError if invalid."""
        fill = {
            "capture_layers": tuple(eagle_capture_layers(cfg)),
            "num_heads": cfg.mla_num_heads,
            "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "intermediate_size": cfg.intermediate_size,
        }
        values = {k: (v if getattr(self, k) is None else getattr(self, k)) for k, v in fill.items()}
        out = dataclasses.replace(self, **values)
        problems = []
        if not 1 <= self.draft_vocab_size <= cfg.vocab_size:
            problems.append(f"draft_vocab_size must be in [1, {cfg.vocab_size}], got {self.draft_vocab_size}")
        if not out.capture_layers or any(not 0 <= l < cfg.num_layers for l in out.capture_layers):
            problems.append(f"capture_layers {out.capture_layers} out of range for {cfg.num_layers} layers")
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size"):
            if getattr(out, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(out, name)}")
        if out.qk_rope_head_dim < 0 or (out.q_lora_rank is not None and out.q_lora_rank <= 0):
            problems.append("qk_rope_head_dim must be >= 0 and q_lora_rank positive or None")
        if problems:
            raise ValueError("invalid DrafterConfig: " + "; ".join(problems))
        return out

    def layer_config(self, cfg: ModelConfig) -> ModelConfig:
        """The target config with the draft layer's attention and MLP sizes (what mla.* / mlp read)."""
        d = self.resolve(cfg)
        return cfg.replace(
            mla_num_heads=d.num_heads, q_lora_rank=d.q_lora_rank, kv_lora_rank=d.kv_lora_rank,
            qk_nope_head_dim=d.qk_nope_head_dim, qk_rope_head_dim=d.qk_rope_head_dim, v_head_dim=d.v_head_dim,
            intermediate_size=d.intermediate_size,
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["capture_layers"] is not None:
            out["capture_layers"] = list(out["capture_layers"])
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DrafterConfig:
        values = dict(values)
        if values.get("capture_layers") is not None:
            values["capture_layers"] = tuple(values["capture_layers"])
        return cls(**values)


@flax.struct.dataclass
class DrafterState:
    """The draft layer's latent KV cache, contiguous per request.

    kv:     [B, S, C+R] cached latents [c (post-norm) | k_pe]; position s of row b at kv[b, s]
    length: [B] int32 positions cached from the target's features (chained-draft entries lie past it)
    """

    kv: jax.Array
    length: jax.Array

    @property
    def max_len(self) -> int:
        return self.kv.shape[1]


def init_drafter_state(cfg: ModelConfig, dcfg: DrafterConfig, batch: int, max_len: int) -> DrafterState:
    """Empty caches for `batch` requests of up to `max_len` draft positions each (context + k)."""
    d = dcfg.resolve(cfg)
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"batch and max_len must be positive, got {batch}, {max_len}")
    return DrafterState(
        kv=jnp.zeros((batch, max_len, d.kv_lora_rank + d.qk_rope_head_dim), jnp.dtype(cfg.dtype)),
        length=jnp.zeros((batch,), jnp.int32),
    )


# ----------------------------------------------------------------------------------------------------
# vocabulary map and parameters
# ----------------------------------------------------------------------------------------------------


def build_vocab_map(token_counts, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The draft vocabulary = the `draft_vocab_size` most frequent target ids (ties: lower id first).

    token_counts: [V] non-negative counts over the training data. Returns (d2t int32 [Vd], t2d bool [V]):
    draft id i is target id i + d2t[i] (ids kept in ascending order); t2d marks target ids in the draft vocab.
    """
    counts = np.asarray(token_counts)
    if counts.ndim != 1 or counts.size == 0 or not np.issubdtype(counts.dtype, np.number) or (counts < 0).any():
        raise ValueError(f"token_counts must be a non-empty 1-D array of counts >= 0, got shape {counts.shape}")
    if not 1 <= draft_vocab_size <= counts.size:
        raise ValueError(f"draft_vocab_size must be in [1, {counts.size}], got {draft_vocab_size}")
    order = np.argsort(-counts, kind="stable")[:draft_vocab_size]
    ids = np.sort(order)
    t2d = np.zeros(counts.size, bool)
    t2d[ids] = True
    return (ids - np.arange(draft_vocab_size)).astype(np.int32), t2d


def draft_to_target(params: dict, draft_ids: jax.Array) -> jax.Array:
    """Target ids of draft-vocab ids (target = draft + d2t[draft])."""
    return (draft_ids + params["d2t"][draft_ids]).astype(jnp.int32)


def target_ids(params: dict) -> jax.Array:
    """int32 [Vd]: the target id of every draft id, in draft order."""
    return draft_to_target(params, jnp.arange(params["d2t"].shape[0]))


def _normals(key: jax.Array, shapes: tuple[tuple[int, ...], ...]) -> list[np.ndarray]:
    """normal(0, INIT_STD) float32 arrays of `shapes` from a numpy generator seeded by the key's bits
    (deterministic per key, and no XLA program to compile for a one-off initialisation)."""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    return [(INIT_STD * rng.standard_normal(s)).astype(np.float32) for s in shapes]


def init_drafter(cfg: ModelConfig, dcfg: DrafterConfig, key: jax.Array, *, d2t=None,
                 target_params: dict | None = None) -> dict:
    """Random drafter parameters (normal(0.02) projections, unit norms).

    d2t: the draft->target offsets of `build_vocab_map` (default: the first draft_vocab_size ids).
    target_params: if given, lm_head starts from the target's lm_head columns of the draft vocab and the
    final norm from the target's (a common EAGLE warm start); the embedding is never copied.
    """
    d = dcfg.resolve(cfg)
    lcfg = dcfg.layer_config(cfg)
    dtype = jnp.dtype(cfg.dtype)
    dim, vd = cfg.hidden_size, d.draft_vocab_size
    h = d.num_heads
    shapes = {"fc": (len(d.capture_layers) * dim, dim), "kv_a": (2 * dim, lcfg.latent_cache_dim),
              "kv_b": (d.kv_lora_rank, h * (d.qk_nope_head_dim + d.v_head_dim)), "o_proj": (h * d.v_head_dim, dim),
              "gate": (dim, d.intermediate_size), "up": (dim, d.intermediate_size), "down": (d.intermediate_size, dim),
              "lm_head": (dim, vd)}
    if d.q_lora_rank is not None:
        shapes.update(q_a=(2 * dim, d.q_lora_rank), q_b=(d.q_lora_rank, h * lcfg.mla_q_head_dim))
    else:
        shapes["q_proj"] = (2 * dim, h * lcfg.mla_q_head_dim)
    if cfg.mla_output_gate:
        shapes["g_proj"] = (2 * dim, h * d.v_head_dim)
    w = {name: jnp.asarray(x, dtype) for name, x in zip(shapes, _normals(key, tuple(shapes.values())))}
    attn = {name: w[name] for name in ("q_a", "q_b", "q_proj", "kv_a", "kv_b", "g_proj", "o_proj") if name in w}
    if d.q_lora_rank is not None:
        attn["q_a_norm"] = jnp.ones((d.q_lora_rank,), dtype)
    attn["kv_a_norm"] = jnp.ones((d.kv_lora_rank,), dtype)
    if d2t is None:
        d2t = np.zeros(vd, np.int32)
    d2t = jnp.asarray(d2t, jnp.int32)
    if d2t.shape != (vd,):
        raise ValueError(f"d2t must have shape ({vd},), got {d2t.shape}")
    params = {
        "fc": w["fc"],
        "emb_norm": jnp.ones((dim,), dtype),
        "hidden_norm": jnp.ones((dim,), dtype),
        "attn": attn,
        "post_attention_layernorm": jnp.ones((dim,), dtype),
        "mlp": {"gate": w["gate"], "up": w["up"], "down": w["down"]},
        "norm": jnp.ones((dim,), dtype),
        "lm_head": w["lm_head"],
        "d2t": d2t,
    }
    ids = np.asarray(target_ids(params))
    if ids.min() < 0 or ids.max() >= cfg.vocab_size or len(np.unique(ids)) != vd:
        raise ValueError("d2t must map the draft vocab to distinct target ids in range")
    if target_params is not None:
        head = target_params["embed"].T if cfg.tie_word_embeddings else target_params["lm_head"]
        params["lm_head"] = jnp.asarray(head)[:, ids].astype(dtype)
        params["norm"] = jnp.asarray(target_params["norm"]).astype(dtype)
    return params


# ----------------------------------------------------------------------------------------------------
# the draft layer
# ----------------------------------------------------------------------------------------------------


def fuse_features(params: dict, features: jax.Array) -> jax.Array:
    """f = fc(concat of captured states): features [..., n_capture, D] -> [..., D]."""
    return dense(features.reshape(*features.shape[:-2], -1), params["fc"])


def attention_input(params: dict, cfg: ModelConfig, emb: jax.Array, hidden: jax.Array) -> jax.Array:
    """concat[RMSNorm(emb(x_{t+1})), RMSNorm(hidden_t)]: [..., 2D]."""
    eps = cfg.rms_norm_eps
    return jnp.concatenate([rms_norm(emb, params["emb_norm"], eps), rms_norm(hidden, params["hidden_norm"], eps)], -1)


def finish_layer(params: dict, lcfg: ModelConfig, hidden: jax.Array, attn_out: jax.Array) -> jax.Array:
    """h' = h + MLP(RMSNorm(h)) with h = hidden + attention output (both residuals)."""
    h = hidden + attn_out
    return h + mlp(params["mlp"], rms_norm(h, params["post_attention_layernorm"], lcfg.rms_norm_eps), lcfg)


def draft_logits(params: dict, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """float32 logits over the draft vocab of pre-norm outputs h' [..., D]."""
    x = rms_norm(h, params["norm"], cfg.rms_norm_eps)
    return jnp.einsum("...d,dv->...v", x, params["lm_head"].astype(x.dtype), preferred_element_type=jnp.float32)


def _cached_attention(attn: dict, lcfg: ModelConfig, x: jax.Array, kv: jax.Array, context_lens: jax.Array,
                      lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Gated NoPE MLA for x [B, T, 2D] at positions context_lens + t over the contiguous cache kv [B, S, C+R].

    Writes the first lengths[b] latents (positions past S are dropped), then attends in the absorbed
    form (the reference paged kernel, one page of S tokens per row). Returns (y [B, T, D], new kv).
    """
    b, t = x.shape[:2]
    q_nope, q_pe, latent = mla.project(attn, x, lcfg)
    pos = context_lens[:, None] + jnp.arange(t)[None, :]
    write = jnp.where(jnp.arange(t)[None, :] < lengths[:, None], pos, kv.shape[1])
    kv = kv.at[jnp.arange(b)[:, None], write].set(latent.astype(kv.dtype), mode="drop")
    w_uk, w_uv = mla.split_kv_b(attn, lcfg)
    q_latent = jnp.einsum("bthn,chn->bthc", q_nope, w_uk.astype(q_nope.dtype), preferred_element_type=jnp.float32)
    o_latent = mla.paged_attention_reference(
        q_latent.astype(x.dtype), q_pe, kv, jnp.arange(b, dtype=jnp.int32)[:, None], pos,
        kv_lora_rank=lcfg.kv_lora_rank, scale=lcfg.mla_q_head_dim**-0.5,
    )
    out = jnp.einsum("bthc,chv->bthv", o_latent, w_uv.astype(jnp.float32))
    return mla.output(attn, out, x, lcfg), kv


def _cached_layer(params, cfg, lcfg, embed, kv, tokens, hidden, context_lens, lengths):
    """The draft layer on tokens [B, T] / hidden [B, T, D] with the cache: (h' [B, T, D], new kv)."""
    x = attention_input(params, cfg, embed[tokens].astype(hidden.dtype), hidden)
    y, kv = _cached_attention(params["attn"], lcfg, x, kv, context_lens, lengths)
    return finish_layer(params, lcfg, hidden, y), kv


def _choose(logits: jax.Array, temperature, key) -> jax.Array:
    """Draft-vocab ids [B] from logits [B, Vd]: argmax, or a sample of softmax(logits / temperature)."""
    if key is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("cfg", "dcfg", "k"))
def draft_tokens(params: dict, cfg: ModelConfig, dcfg: DrafterConfig, embed: jax.Array, state: DrafterState,
                 features: jax.Array, tokens: jax.Array, lengths: jax.Array, k: int,
                 temperature: float | jax.Array = 1.0, key: jax.Array | None = None):
    """Catches up on newly accepted positions, then proposes a chain of k tokens.

    Args:
      embed: the target's embedding [V, D] (frozen).
      state: the draft cache; state.length[b] positions are cached.
      features: [B, T, n_capture, D] the target's captured features at positions length .. length+T-1
        (the prompt, or the positions accepted since the last call; the first lengths[b] are real).
      tokens: [B, T] target ids: tokens[b, t] is the token *after* position length+t, so the last real
        one is the newest token (the target's bonus token, not yet verified).
      lengths: [B] real positions per row (0: the row is idle; its drafts are meaningless).
      k: static number of draft tokens.
      temperature, key: with key=None the chain is greedy; else each token is sampled from
        softmax(logits / temperature) (row-wise independent draws).

    The cache must hold length + lengths + k - 1 positions (later writes are dropped).
    Returns (drafts int32 [B, k] target ids, logits float32 [B, k, Vd] the draft-vocab logits each draft
    was chosen from, new state with length += lengths).
    """
    d = dcfg.resolve(cfg)
    if features.ndim != 4 or features.shape[2] != len(d.capture_layers) or features.shape[3] != cfg.hidden_size:
        raise ValueError(f"draft_tokens: features must be [B, T, {len(d.capture_layers)}, {cfg.hidden_size}], got {features.shape}")
    if tokens.shape != features.shape[:2] or lengths.shape != tokens.shape[:1]:
        raise ValueError(f"draft_tokens: tokens {tokens.shape} / lengths {lengths.shape} do not match features {features.shape}")
    if k < 1:
        raise ValueError(f"draft_tokens: k must be >= 1, got {k}")
    lcfg = dcfg.layer_config(cfg)
    lengths = lengths.astype(jnp.int32)
    b = tokens.shape[0]
    keys = [None] * k if key is None else list(jax.random.split(key, k))
    h, kv = _cached_layer(params, cfg, lcfg, embed, state.kv, tokens, fuse_features(params, features), state.length, lengths)
    last = jnp.maximum(lengths - 1, 0)
    h = jnp.take_along_axis(h, last[:, None, None], axis=1)  # [B, 1, D]
    length = state.length + lengths
    logits = draft_logits(params, cfg, h[:, 0])
    ids = _choose(logits, temperature, keys[0])
    all_ids, all_logits = [ids], [logits]
    for i in range(1, k):  # chain: the previous draft token and h' at the next (scratch) cache position
        h, kv = _cached_layer(params, cfg, lcfg, embed, kv, draft_to_target(params, ids)[:, None], h,
                              length + i - 1, jnp.ones((b,), jnp.int32))
        logits = draft_logits(params, cfg, h[:, 0])
        ids = _choose(logits, temperature, keys[i])
        all_ids.append(ids)
        all_logits.append(logits)
    drafts = draft_to_target(params, jnp.stack(all_ids, axis=1))
    return drafts, jnp.stack(all_logits, axis=1), DrafterState(kv=kv, length=length)


# ----------------------------------------------------------------------------------------------------
# training-time test (cache-free unroll used for training)
# ----------------------------------------------------------------------------------------------------


def _heads(attn: dict, lcfg: ModelConfig, x: jax.Array):
    """Per-head q_nope, q_pe, k_nope, k_pe, v of x [B, T, 2D] (naive form)."""
    q_nope, q_pe, latent = mla.project(attn, x, lcfg)
    c, k_pe = latent[..., : lcfg.kv_lora_rank], latent[..., lcfg.kv_lora_rank :]
    w_uk, w_uv = mla.split_kv_b(attn, lcfg)
    k_nope = jnp.einsum("bsc,chn->bshn", c, w_uk.astype(c.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    v = jnp.einsum("bsc,chv->bshv", c, w_uv.astype(c.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    return q_nope, q_pe, k_nope, k_pe, v


def unrolled_logits(params: dict, cfg: ModelConfig, dcfg: DrafterConfig, embed: jax.Array, features: jax.Array,
                    tokens: jax.Array, steps: int) -> jax.Array:
    """EAGLE-3 "training-time test": every position drafts `steps` tokens on its own outputs, in one pass.

    features [B, T, n_capture, D] at positions 0..T-1; tokens [B, T] with tokens[:, t] = x_{t+1}.
    Step j at position t reads token x_{t+1+j} (the data's own token; past the end: token 0, to be masked)
    and, as hidden, f_t (j = 0) or step j-1's h' at t. Its query sees the step-0 keys of positions <= t
    and the keys of steps 1..j at t itself -- exactly the cache a chained `draft_tokens` from t sees.

    Returns float32 logits [steps, B, T, Vd]: step j at t predicts x_{t+2+j}.
    """
    lcfg = dcfg.layer_config(cfg)
    b, t = tokens.shape
    scale = lcfg.mla_q_head_dim**-0.5
    hidden = fuse_features(params, features)
    causal = jnp.tril(jnp.ones((t, t), bool))
    past = []  # (k_nope, k_pe, v) of steps >= 1, each [B, T, ...]
    out = []
    for j in range(steps):
        tok = jnp.pad(tokens[:, j:], ((0, 0), (0, j)))
        x = attention_input(params, cfg, embed[tok].astype(hidden.dtype), hidden)
        q_nope, q_pe, k_nope, k_pe, v = _heads(params["attn"], lcfg, x)
        if j == 0:
            k0 = (k_nope, k_pe, v)
        else:
            past.append((k_nope, k_pe, v))
        s0 = (jnp.einsum("bthn,bshn->bhts", q_nope, k0[0], preferred_element_type=jnp.float32)
              + jnp.einsum("bthr,bsr->bhts", q_pe, k0[1], preferred_element_type=jnp.float32)) * scale
        s0 = jnp.where(causal, s0, -jnp.inf)
        diag = [(jnp.einsum("bthn,bthn->bht", q_nope, kn, preferred_element_type=jnp.float32)
                 + jnp.einsum("bthr,btr->bht", q_pe, kp, preferred_element_type=jnp.float32)) * scale
                for kn, kp, _ in past]
        scores = jnp.concatenate([s0] + [s[..., None] for s in diag], axis=-1)  # [B, H, T, T + j]
        probs = jax.nn.softmax(scores, axis=-1)
        o = jnp.einsum("bhts,bshv->bthv", probs[..., :t].astype(x.dtype), k0[2], preferred_element_type=jnp.float32)
        for i, (_, _, vi) in enumerate(past):
            o = o + probs[..., t + i].transpose(0, 2, 1)[..., None] * vi.astype(jnp.float32)
        hidden = finish_layer(params, lcfg, hidden, mla.output(params["attn"], o, x, lcfg))
        out.append(draft_logits(params, cfg, hidden))
    return jnp.stack(out)


# ----------------------------------------------------------------------------------------------------
# checkpoints (orbax, like k3jax.weights.save_checkpoint)
# ----------------------------------------------------------------------------------------------------


def save_drafter(path: str | os.PathLike, cfg: ModelConfig, dcfg: DrafterConfig, params: dict, *,
                 overwrite: bool = False, extra: dict | None = None) -> None:
    """Writes params with orbax to path/params and the configs to path/drafter.json."""
    from k3jax.weights import write_orbax_tree

    meta = {"format": "k3jax-eagle3-drafter", "version": 1, "drafter": dcfg.resolve(cfg).to_dict(),
            "target": {**cfg.to_dict(), "mla_layers": list(cfg.mla_layers)}, **(extra or {})}
    write_orbax_tree(path, params, "drafter.json", meta, overwrite=overwrite, what="drafter")


def load_drafter(path: str | os.PathLike) -> tuple[ModelConfig, DrafterConfig, dict]:
    """(target cfg, dcfg, params) written by `save_drafter`."""
    from k3jax.weights import read_orbax_tree

    meta, params = read_orbax_tree(path, "drafter.json", "k3jax-eagle3-drafter", "k3jax drafter checkpoint")
    return ModelConfig.from_dict(meta["target"]), DrafterConfig.from_dict(meta["drafter"]), params
