"""The K3 decoder stack and its entry points: `forward` (no cache) and the serving steps.

Every step takes its caches and metadata as arguments and returns the new caches; nothing is global.

    forward(params, cfg, tokens)                      int32 [B, T] -> float32 logits [B, T, V]
    prefill(params, cfg, state, tokens, meta)         append T (ragged) tokens per row to the state
    decode(params, cfg, state, tokens, meta)          one token per row
    verify(params, cfg, state, tokens, meta)          k tokens per row; KDA state updates of every position
    commit_verified(state, verified, slots, accepted) keep an accepted prefix of a verify

Layer l (k3-model.md §6, K3 bookkeeping with B = attn_res_block_size decoder layers per block):

    P = embed(ids); bank = []
    for l: h = mix(bank + [P]) if bank else P
           if l % B == 0: bank.append(P); P = None
           P = P + Mixer_l(input_layernorm(h))           (P = Mixer_l(...) when P is None)
           h = mix(bank + [P]); P = P + FFN_l(post_attention_layernorm(h))
    logits = lm_head(norm(mix(bank + [P])))

Without AttnRes (Kimi-Linear) the same loop is the usual pre-norm residual stream.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import flax.struct
import jax
import jax.numpy as jnp

from k3jax import backend, kda, mla
from k3jax.attnres import attn_res_mix_norm
from k3jax.compile_options import STEP_COMPILER_OPTIONS
from k3jax.config import ModelConfig
from k3jax.layers import Linear, rms_norm
from k3jax.moe import ffn


@flax.struct.dataclass
class DecodeState:
    """Per-request model state, pooled. KDA rows are indexed by slot, MLA latents by page.

    kda:      [L_kda, num_slots, H, V, K] fp32 recurrent states (V-first)
    conv:     [L_kda, num_slots, W-1, 3*H*K] last inputs of the q|k|v short convs
    kv_pages: [L_mla, num_pages, page_size, C+R] cached MLA latents; a page is immutable once full
    """

    kda: jax.Array
    conv: jax.Array
    kv_pages: jax.Array

    @property
    def page_size(self) -> int:
        return self.kv_pages.shape[2]


@flax.struct.dataclass
class StepMeta:
    """Where each row of a step's batch lives in the state.

    slots:        [B] int32 KDA/conv slot of each row (distinct within a step)
    page_table:   [B, max_pages] int32 page ids of each row's history, in order
    context_lens: [B] int32 tokens already cached for the row (0: the row starts from the zero KDA/conv
                  state, whatever its slot holds -- slots are reused without being cleared)
    lengths:      [B] int32 valid new tokens of the row in this step (the rest of T is padding;
                  a row with 0 leaves its state unchanged)
    """

    slots: jax.Array
    page_table: jax.Array
    context_lens: jax.Array
    lengths: jax.Array


@flax.struct.dataclass
class VerifiedStates:
    """What a verify step leaves for `commit_verified`, per KDA layer: every position's recurrent-state update
    (k3jax.kda's module docstring: S_t = S_{t-1} * decay_t + err_t key_t^T) -- err [L_kda, B, T, H, V], key and
    decay [L_kda, B, T, H, K] fp32 -- and the step's short-conv inputs, inputs [L_kda, B, T, C] (the kept conv
    window is the last W-1 rows of [window before the step; inputs[:count]], k3jax.kda.conv_window_after); slots and
    fresh [B]: where each row's states before the step live (verify leaves the pools alone) and whether they start
    from zeros instead. 1.5 KB per layer, row, position and head instead of a 64 KB state, and one input row per
    position instead of W-1 conv-state rows."""

    err: jax.Array
    key: jax.Array
    decay: jax.Array
    inputs: jax.Array
    slots: jax.Array
    fresh: jax.Array


def init_state(cfg: ModelConfig, num_slots: int, num_pages: int, page_size: int, kv_dtype=None) -> DecodeState:
    """A zeroed state pool: `num_slots` KDA slots and `num_pages` MLA pages of `page_size` tokens."""
    act = jnp.dtype(cfg.dtype)
    return DecodeState(
        kda=jnp.zeros((cfg.num_kda_layers, num_slots, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32),
        conv=jnp.zeros((cfg.num_kda_layers, num_slots, cfg.kda_conv_kernel - 1, cfg.conv_channels), act),
        kv_pages=jnp.zeros((cfg.num_mla_layers, num_pages, page_size, cfg.latent_cache_dim), kv_dtype or act),
    )


Mixer = Callable[[int, dict, jax.Array], jax.Array]


def decoder(params: dict, cfg: ModelConfig, h: jax.Array, mixer: Mixer, backend_name: str,
            capture: tuple[int, ...] = (), ffn_fn: Mixer | None = None) -> tuple[jax.Array, list[jax.Array]]:
    """Runs all layers on embeddings h [B, T, D]; `mixer(layer, attn_params, x)` is the attention block,
    `ffn_fn(layer, mlp_params, x)` the feed-forward (default: moe.ffn; parallel strategies pass sharded ones).

    Returns the final-normed hidden states [B, T, D] and, for each layer in `capture`, the hidden
    state entering that layer (EAGLE-3 features). With AttnRes that is the layer's attention-side mix
    over the bank and the partial block sum -- the full residual picture the layer sees -- rather than
    the bare partial sum P (vLLM's choice), which lacks every completed block.
    """
    block = cfg.attn_res_block_size
    eps = cfg.rms_norm_eps
    if ffn_fn is None:
        ffn_fn = lambda l, p, x: ffn(p, x, cfg, backend_name=backend_name)  # noqa: E731
    bank: list[jax.Array] = []
    partial_sum: jax.Array | None = h
    pending = None  # a sublayer output not yet added to partial_sum: the next mix point's op adds it (in its kernel)
    captured: dict[int, jax.Array] = {}

    def mix_point(proj, norm, out_weight, with_mix=False):
        nonlocal partial_sum, pending
        mix, normed, *summed = attn_res_mix_norm(bank + [partial_sum], proj, norm, out_weight, eps, with_mix=with_mix,
                                                 addend=pending, backend_name=backend_name)
        if summed:
            partial_sum, pending = summed[0], None
        return mix, normed

    for l, lp in enumerate(params["layers"]):
        if block is None:
            if l in capture:
                captured[l] = h
            h = h + mixer(l, lp["attn"], rms_norm(h, lp["input_layernorm"], eps))
            h = h + ffn_fn(l, lp["mlp"], rms_norm(h, lp["post_attention_layernorm"], eps))
            continue
        if bank:  # the mix and the pre-norm of the mix: one fused op (the mix is kept only for a capture)
            x, normed = mix_point(lp["self_attention_res_proj"], lp["self_attention_res_norm"], lp["input_layernorm"],
                                  with_mix=l in capture)
        else:  # layer 0: nothing pending yet
            assert pending is None
            x, normed = partial_sum, rms_norm(partial_sum, lp["input_layernorm"], eps)
        if l in capture:
            captured[l] = x
        if l % block == 0:
            bank.append(partial_sum)
            partial_sum = None
        a = mixer(l, lp["attn"], normed)
        if partial_sum is None:
            partial_sum = a
        else:
            pending = a
        _, normed = mix_point(lp["mlp_res_proj"], lp["mlp_res_norm"], lp["post_attention_layernorm"])
        pending = ffn_fn(l, lp["mlp"], normed)
    if block is not None:
        _, hidden = mix_point(params["output_attn_res_proj"], params["output_attn_res_norm"], params["norm"])
        return hidden, [captured[l] for l in capture]
    return rms_norm(h, params["norm"], eps), [captured[l] for l in capture]


def eagle_capture_layers(cfg: ModelConfig) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high feature layers: the inputs of layers 2, L//2 and L-3 (K3: 2, 46, 90)."""
    return (2, cfg.num_layers // 2, cfg.num_layers - 3)


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    return params["embed"][tokens]


def lm_head(params: dict, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """float32 logits of hidden states h [..., D]."""
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.einsum("...d,dv->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)


def _check_tokens(tokens: jax.Array, ndim: int, what: str) -> None:
    if tokens.ndim != ndim or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{what}: expected integer tokens of rank {ndim}, got {tokens.dtype}{list(tokens.shape)}")


def cache_free_mixer(cfg: ModelConfig, batch: int, backend_name: str, linear: dict[str, Linear] | None = None,
                     ) -> Mixer:
    """Attention for a whole sequence with no cache: naive MLA, chunked KDA from zero states.
    linear: per mixer kind ("kda" / "mla") the hook its hidden-state projections go through (`layers.Linear`;
    a kind left out, or None, multiplies with plain `dense`): how parallel strategies shard those GEMMs."""
    act = jnp.dtype(cfg.dtype)
    linear = linear or {}

    def mixer(l, p, x):
        if cfg.is_mla(l):
            return mla.naive_attention(p, x, cfg, linear=linear.get("mla"))
        conv0 = jnp.zeros((batch, cfg.kda_conv_kernel - 1, cfg.conv_channels), act)
        rec0 = jnp.zeros((batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32)
        return kda.kda_mixer(p, x, conv0, rec0, cfg, mode="chunked", backend_name=backend_name,
                             linear=linear.get("kda"))[0]

    return mixer


@partial(jax.jit, static_argnames=("cfg", "backend_name"))
def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, backend_name: str = "reference") -> jax.Array:
    """Logits float32 [B, T, V] for tokens int32 [B, T], with no cache (naive MLA, chunked KDA)."""
    _check_tokens(tokens, 2, "forward")
    mixer = cache_free_mixer(cfg, tokens.shape[0], backend_name)
    return lm_head(params, cfg, decoder(params, cfg, embed(params, tokens), mixer, backend_name)[0])


@partial(jax.jit, static_argnames=("cfg", "capture", "backend_name"))
def forward_with_features(params: dict, cfg: ModelConfig, tokens: jax.Array, capture: tuple[int, ...],
                          backend_name: str = "reference") -> tuple[jax.Array, jax.Array]:
    """`forward` plus the hidden states entering the `capture` layers: (logits [B, T, V],
    features [B, T, len(capture), D]). Used to train and run EAGLE-3 drafters."""
    _check_tokens(tokens, 2, "forward_with_features")
    mixer = cache_free_mixer(cfg, tokens.shape[0], backend_name)
    hidden, feats = decoder(params, cfg, embed(params, tokens), mixer, backend_name, capture)
    return lm_head(params, cfg, hidden), jnp.stack(feats, axis=2)


def step_body(params, cfg, state: DecodeState, tokens, meta: StepMeta, *, kda_mode: str, all_states: bool,
              backend_name: str, capture: tuple[int, ...] = ()):
    """Shared body of prefill / decode / verify (and the speculative loop's feature-capturing step):
    returns (hidden [B, T, D], new state, verified states or None, features entering `capture` layers)."""
    caches = {"kda": state.kda, "conv": state.conv, "kv_pages": state.kv_pages}
    verified_kda, verified_inputs = [], []
    mixer = cached_mixer(cfg, caches, meta, kda_mode=kda_mode, backend_name=backend_name,
                         verified=(verified_kda, verified_inputs) if all_states else None)
    hidden, feats = decoder(params, cfg, embed(params, tokens), mixer, backend_name, capture)
    new_state = DecodeState(**caches)
    verified = None
    if all_states:
        def stack(xs, like):  # [L_kda, B, T, ...]; a model without KDA layers gets empty arrays
            return jnp.stack(xs) if xs else jnp.zeros((0, *tokens.shape, *like.shape), like.dtype)
        h, dv, dk = state.kda.shape[2:]
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        err, key, decay = ([u[i] for u in verified_kda] for i in range(3))
        input_like = jax.ShapeDtypeStruct(state.conv.shape[3:], jnp.dtype(cfg.dtype))
        verified = VerifiedStates(err=stack(err, f32(h, dv)), key=stack(key, f32(h, dk)), decay=stack(decay, f32(h, dk)),
                                  inputs=stack(verified_inputs, input_like), slots=meta.slots.astype(jnp.int32),
                                  fresh=meta.context_lens == 0)
    return hidden, new_state, verified, feats


def cached_mixer(cfg: ModelConfig, caches: dict, meta: StepMeta, *, kda_mode: str, backend_name: str,
                 verified: tuple[list, list] | None = None, linear: dict[str, Linear] | None = None) -> Mixer:
    """The attention block of the serving steps over caches = {"kda", "conv", "kv_pages"}, updated in the
    dict as layers run. With `verified` = (kda list, inputs list), KDA layers append their per-position
    state updates and conv inputs there and leave the pooled states alone (verify: commit_verified keeps a prefix
    later).
    linear: the projection hooks per mixer kind, as in `cache_free_mixer`."""
    linear = linear or {}

    def mixer(l, p, x):
        j = cfg.mixer_slot[l]
        if cfg.is_mla(l):
            y, caches["kv_pages"] = mla.paged_attention(
                p, x, caches["kv_pages"], j, meta.page_table, meta.context_lens, meta.lengths, cfg,
                backend_name=backend_name, linear=linear.get("mla"),
            )
            return y
        # a row with nothing cached starts from the zero state, whatever its (reused) slot still holds: kda_mixer
        # zeroes such rows as it reads them (the fused decode kernel masks their loads), never in the pool
        fresh = meta.context_lens == 0
        # The pools go to the mixer whole, as [L_kda * num_slots, ...] (a free reshape; layer j's slot s is row
        # j * num_slots + s), with the step's rows: the fused decode kernel reads just those rows (decode also
        # updates them in place; verify writes per-position updates to new arrays and leaves the pools unwritten).
        # Gathering the step's state rows first reads and writes 2 x B x H x V x K x 4 bytes per layer (k3-small,
        # B 64: 134 MB per KDA layer), and decode's scatter back as much again. Fresh rows are not zeroed in the
        # pool (a scatter per pool and layer, 0.36 ms of the k3-small step): the kernel reads them as zeros (and
        # decode overwrites their slots); the gathering paths zero the gathered rows.
        layers, num_slots = caches["kda"].shape[:2]
        rows = j * num_slots + meta.slots.astype(jnp.int32)
        flat = lambda pool: pool.reshape(layers * num_slots, *pool.shape[2:])  # noqa: E731
        if verified is not None:  # the pools keep the pre-verify states until commit_verified keeps a prefix
            y, inputs, updates = kda.kda_mixer(
                p, x, flat(caches["conv"]), flat(caches["kda"]), cfg, lengths=meta.lengths, mode=kda_mode,
                all_states=True, slots=rows, fresh=fresh, backend_name=backend_name, linear=linear.get("kda"),
            )
            verified[0].append(updates)
            verified[1].append(inputs)
            return y
        y, conv, rec = kda.kda_mixer(p, x, flat(caches["conv"]), flat(caches["kda"]), cfg, lengths=meta.lengths,
                                     mode=kda_mode, slots=rows, fresh=fresh, backend_name=backend_name,
                                     linear=linear.get("kda"))
        caches["conv"] = conv.reshape(caches["conv"].shape)
        caches["kda"] = rec.reshape(caches["kda"].shape)
        return y

    return mixer


def last_token_hidden(hidden: jax.Array, lengths: jax.Array) -> jax.Array:
    """hidden [B, T, D] at each row's last valid new token -> [B, D]."""
    last = jnp.maximum(lengths - 1, 0)
    return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]


@partial(jax.jit, static_argnames=("cfg", "all_logits", "backend_name"), donate_argnames=("state",),
         compiler_options=STEP_COMPILER_OPTIONS)
def prefill(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta,
            all_logits: bool = False, backend_name: str = "reference"):
    """Appends tokens int32 [B, T] (row b's first meta.lengths[b] are real) to the state.

    Uses chunked KDA. Pages covering positions context_lens .. context_lens + lengths - 1 must be in the
    page table. Returns (logits, new state): logits float32 [B, V] at each row's last new token, or
    [B, T, V] at every position with all_logits=True.
    """
    _check_tokens(tokens, 2, "prefill")
    hidden, state, _, _ = step_body(params, cfg, state, tokens, meta, kda_mode="chunked", all_states=False,
                                    backend_name=backend_name)
    if not all_logits:
        hidden = last_token_hidden(hidden, meta.lengths)
    return lm_head(params, cfg, hidden), state


@partial(jax.jit, static_argnames=("cfg", "backend_name"), donate_argnames=("state",),
         compiler_options=STEP_COMPILER_OPTIONS)
def decode(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta,
           backend_name: str = "reference"):
    """One token per row: tokens int32 [B] -> (logits float32 [B, V], new state). meta.lengths is 1 (or 0
    for an idle row, which leaves its state unchanged)."""
    _check_tokens(tokens, 1, "decode")
    hidden, state, _, _ = step_body(params, cfg, state, tokens[:, None], meta, kda_mode="recurrent", all_states=False,
                                    backend_name=backend_name)
    return lm_head(params, cfg, hidden[:, 0]), state


@partial(jax.jit, static_argnames=("cfg", "backend_name"), donate_argnames=("state",),
         compiler_options=STEP_COMPILER_OPTIONS)
def verify(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta,
           backend_name: str = "reference"):
    """Scores k tokens per row (tokens int32 [B, k]: the last accepted token, then k-1 drafts).

    Writes all k latents to the MLA pages (positions past the accepted prefix are simply overwritten
    later) but leaves the pooled KDA states untouched. Returns (logits float32 [B, k, V], new state,
    VerifiedStates: every position's KDA state update and conv input) -- pass the latter to `commit_verified`.
    """
    _check_tokens(tokens, 2, "verify")
    hidden, state, verified, _ = step_body(params, cfg, state, tokens, meta, kda_mode="recurrent", all_states=True,
                                           backend_name=backend_name)
    return lm_head(params, cfg, hidden), state, verified


@partial(jax.jit, donate_argnames=("state",), static_argnames=("backend_name",))
def commit_verified(state: DecodeState, verified: VerifiedStates, slots: jax.Array, num_accepted: jax.Array,
                    rows: jax.Array | None = None, backend_name: str = "reference") -> DecodeState:
    """Keeps the first num_accepted[b] (>= 1) verified positions of each row: writes the KDA and conv states
    after position num_accepted - 1 into the row's slot. The KDA state is rebuilt from the state before the verify
    step, still in the pool at the row's own slot (verified.slots), and the step's updates
    (k3jax.kda.apply_verify_updates; op "kda_commit", in place in the donated pool on the kernel backends): one
    state read and one written per layer and row. The conv state likewise: the last W-1 rows of [the slot's window
    before the step (zeros for a fresh row); the step's inputs up to the kept position] (k3jax.kda.conv_window_after).

    rows: which verify rows to take (default all, in order); with rows, slots[i] receives row rows[i] (e.g. a
    KDA checkpoint at a page boundary inside an accepted run). Every such copy must come before the commit that
    overwrites the rows' own slots: it reads the states from before the step there."""
    if rows is None:
        rows = jnp.arange(slots.shape[0])
    count = jnp.clip(num_accepted, 1, verified.inputs.shape[2]).astype(jnp.int32)
    src, fresh = verified.slots[rows], verified.fresh[rows]
    window = jnp.where(fresh[None, :, None, None], jnp.zeros((), state.conv.dtype), state.conv[:, src])
    kept_window = kda.conv_window_after(window, verified.inputs[:, rows], count[None, :])
    commit = backend.get("kda_commit", backend_name)
    return state.replace(
        kda=commit(state.kda, verified.err[:, rows], verified.key[:, rows], verified.decay[:, rows], src,
                   slots.astype(jnp.int32), count, fresh),
        conv=state.conv.at[:, slots].set(kept_window),
    )
