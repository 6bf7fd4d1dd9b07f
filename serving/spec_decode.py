"""Speculative decoding inside the engine: the drafter over a paged draft cache, and the acceptance rule.

One speculating decode step of a request whose computed length is p and whose newest token x is not yet
in the target's cache (k3-model.md §7):

  1. draft    the drafter catches up on the positions accepted since its last call (their target
              features and the token after each, kept per request as `pending`), then proposes k tokens
              greedily, chaining its own hidden state
  2. verify   the target scores [x, d_1 .. d_k] at positions p .. p+k in one step, keeping every position's
              KDA state update (k3jax.verify semantics, plus the EAGLE-3 features)
  3. accept   a drafts, then one more token from the target at position p+a (`accept` below)
  4. commit   KDA/conv states keep the accepted prefix (commit_verified(a + 1) rebuilds the KDA state from the
              state before the step and the step's per-position updates); pending becomes the features
              at p .. p+a with the emitted tokens [d_1 .. d_a, bonus] as "the token after"

Draft cache: the drafter's single MLA layer keeps its latents in a pool [1, P, page_size, C+R] addressed by
the *target's* page ids, so it needs no allocator of its own and a prefix-cache hit shares the drafter's
history as well. Positions past a request's accepted length are scratch (the chain writes there; the next
catch-up overwrites them). Drafts only ever change speed, never outputs: the target decides every token.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from k3jax import mla
from k3jax.config import ModelConfig
from k3jax.drafter import DrafterConfig, attention_input, draft_logits, draft_to_target, finish_layer, fuse_features
from k3jax.model import last_token_hidden
from k3jax.sampling import SAMPLING_EPS, SamplingTensors, process_logits, row_keys


def init_draft_pool(cfg: ModelConfig, dcfg: DrafterConfig, num_pages: int, page_size: int) -> jax.Array:
    """Zeroed draft-layer latents for every target page: [1, num_pages, page_size, C+R]."""
    lcfg = dcfg.layer_config(cfg)
    return jnp.zeros((1, num_pages, page_size, lcfg.latent_cache_dim), jnp.dtype(cfg.dtype))


def _draft_layer(dparams, cfg, lcfg, embed, pool, tokens, hidden, page_table, context_lens, lengths):
    """The draft layer on tokens [B, T] (each the token *after* its position) and hidden [B, T, D] at
    positions context_lens + t; writes the first lengths[b] latents. Returns (h' [B, T, D], pool)."""
    x = attention_input(dparams, cfg, embed[tokens].astype(hidden.dtype), hidden)
    y, pool = mla.paged_attention(dparams["attn"], x, pool, 0, page_table, context_lens, lengths, lcfg)
    return finish_layer(dparams, lcfg, hidden, y), pool


@partial(jax.jit, static_argnames=("cfg", "dcfg", "k"), donate_argnames=("pool",))
def draft_step(dparams: dict, cfg: ModelConfig, dcfg: DrafterConfig, embed: jax.Array, pool: jax.Array,
               features: jax.Array, tokens: jax.Array, page_table: jax.Array, context_lens: jax.Array,
               lengths: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Catch-up on lengths[b] positions starting at context_lens[b], then k greedy drafts (k = 0: catch-up only).

    features [B, T, n_capture, D]: the target's captured features at those positions; tokens [B, T]: the
    token after each. Rows with lengths 0 are idle (they write nothing). The chain writes scratch latents at
    positions context_lens + lengths .. + k - 2, which the caller's pages must cover.
    Returns (drafts int32 [B, k] target ids, new pool).
    """
    lcfg = dcfg.layer_config(cfg)
    lengths = lengths.astype(jnp.int32)
    hidden = fuse_features(dparams, features)
    h, pool = _draft_layer(dparams, cfg, lcfg, embed, pool, tokens, hidden, page_table, context_lens, lengths)
    b = tokens.shape[0]
    if k == 0:
        return jnp.zeros((b, 0), jnp.int32), pool
    h = last_token_hidden(h, lengths)[:, None]  # [B, 1, D]
    end = context_lens + lengths
    active = (lengths > 0).astype(jnp.int32)  # idle rows must not write (their table row is padding)
    ids = jnp.argmax(draft_logits(dparams, cfg, h[:, 0]), axis=-1)
    chain = [ids]
    for i in range(1, k):
        h, pool = _draft_layer(dparams, cfg, lcfg, embed, pool, draft_to_target(dparams, ids)[:, None], h,
                               page_table, end + i - 1, active)
        ids = jnp.argmax(draft_logits(dparams, cfg, h[:, 0]), axis=-1)
        chain.append(ids)
    return draft_to_target(dparams, jnp.stack(chain, axis=1)), pool


@partial(jax.jit, static_argnames=("fixed_accepted",))
def accept(logits: jax.Array, drafts: jax.Array, tensors: SamplingTensors,
           fixed_accepted: int | None = None) -> tuple[jax.Array, jax.Array]:
    """How many drafts each row keeps, and the tokens it emits.

    logits [B, k+1, V]: the target at [x, d_1 .. d_k] (position i scores the token after d_i).
    drafts [B, k]. tensors: B*(k+1) rows (callers pass them without the host flags, `device_branches()`: one
    program for every mix of rows, which the warm-up compiles; the host reads the result right away here), row b*(k+1)+i = request b's sampling at output index
    num_output + i (bans for min_tokens are per position; keys are (seed, output index), so a request's
    draws do not depend on the batch it runs in).

    Greedy rows (temperature 0): keep the longest prefix with d_i == argmax, then that argmax — the
    target's greedy chain exactly. Sampled rows: the drafts were greedy (q is one-hot), so speculative
    sampling reduces to: keep d_i with probability p_i(d_i); at the first rejection draw from p_i with d_i
    removed (max(p - q, 0) renormalised); after k acceptances draw the bonus from p_k. The emitted tokens
    are distributed exactly as sampling the processed target distribution token by token.
    fixed_accepted (BENCHMARK ONLY): keep exactly that many drafts whatever the target says, then its argmax.

    Returns (accepted int32 [B] in 0..k, emitted int32 [B, k+1]: the first accepted + 1 are the tokens).
    """
    b, k1, v = logits.shape
    k = k1 - 1
    x = process_logits(logits.reshape(b * k1, v), tensors).reshape(b, k1, v)
    greedy = (tensors.temperature < SAMPLING_EPS).reshape(b, k1)[:, 0]
    best = jnp.argmax(x, axis=-1).astype(jnp.int32)  # [B, k+1]
    keys = row_keys(tensors.seed, tensors.position).reshape(b, k1)
    if fixed_accepted is not None:
        accepted = jnp.full((b,), fixed_accepted, jnp.int32)
        nxt = best[:, fixed_accepted]
    else:
        logp = jax.nn.log_softmax(x[:, :k], axis=-1)
        p_draft = jnp.exp(jnp.take_along_axis(logp, drafts[..., None], axis=-1)[..., 0])  # [B, k]
        u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1))))(keys[:, :k])
        ok = jnp.where(greedy[:, None], drafts == best[:, :k], u < p_draft)
        accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
        rows = jnp.arange(b)
        x_a = x[rows, accepted]  # [B, V]
        rejected = jnp.take_along_axis(jnp.pad(drafts, ((0, 0), (0, 1)), constant_values=-1), accepted[:, None], 1)[:, 0]
        x_a = jnp.where(jnp.arange(v)[None, :] == rejected[:, None], -jnp.inf, x_a)  # -1 (all kept): no-op
        noise = jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(keys[rows, accepted])
        nxt = jnp.where(greedy, best[rows, accepted], jnp.argmax(x_a + noise, axis=-1).astype(jnp.int32))
    emitted = jnp.pad(drafts, ((0, 0), (0, 1)))
    emitted = emitted.at[jnp.arange(b), accepted].set(nxt)
    return accepted, emitted


__all__ = ["accept", "draft_step", "init_draft_pool"]
