"""Reference speculative decoding with an EAGLE-3 drafter over the explicit-state serving steps.

    speculative_generate(params, cfg, drafter_params, dcfg, prompts, max_tokens, k, sampling=...)

One batch, host-driven rounds (k3-model.md §7):
  1. prefill the target on a paged DecodeState (its captured features feed the drafter's catch-up);
     the first token comes from the prefill logits
  2. per round: the drafter catches up on the newly accepted positions and proposes k tokens; the target
     scores [last token + k drafts] in one verify step (every position's KDA state update kept aside);
     accept a prefix (greedy: drafts equal to the target's argmax; "rejection": standard speculative
     sampling), emit one more token from the target, and commit_verified(num_accepted = a + 1) so the
     KDA/conv states keep the accepted prefix while the MLA context advances by a + 1.

Features: k3jax.prefill / k3jax.verify return no hidden states, so `target_step` here is those steps with
the EAGLE-3 capture added: it calls model.step_body, the body every serving step shares, with
`capture` set. tests/model/test_speculative.py checks it against k3jax.prefill / k3jax.verify.

Benchmark-only mode: `fixed_accepted=n` accepts exactly n drafts every round whatever the target says,
so rounds have a fixed shape for throughput measurements. Its outputs are NOT the target's; it raises
unless `benchmark_only=True` is passed as well.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.compile_options import STEP_COMPILER_OPTIONS
from k3jax.config import ModelConfig
from k3jax.drafter import DrafterConfig, draft_tokens, init_drafter_state, target_ids
from k3jax.model import (
    DecodeState, StepMeta, commit_verified, init_state, last_token_hidden, lm_head, step_body,
)

SAMPLINGS = ("greedy", "rejection")


# ----------------------------------------------------------------------------------------------------
# target step with features
# ----------------------------------------------------------------------------------------------------


@partial(jax.jit, static_argnames=("cfg", "capture", "verify", "backend_name"), donate_argnames=("state",),
         compiler_options=STEP_COMPILER_OPTIONS)
def target_step(params: dict, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta,
                capture: tuple[int, ...], verify: bool, backend_name: str = "reference"):
    """k3jax.prefill (verify=False; chunked KDA, logits at each row's last new token) or k3jax.verify
    (verify=True; recurrent KDA, logits at every position, every position's KDA state update) that also
    returns the EAGLE-3 features: the hidden states entering the `capture` layers.

    Returns (logits, new state, VerifiedStates or None, features [B, T, len(capture), D]).
    """
    hidden, new_state, verified, feats = step_body(
        params, cfg, state, tokens, meta, kda_mode="recurrent" if verify else "chunked", all_states=verify,
        backend_name=backend_name, capture=capture,
    )
    if not verify:
        hidden = last_token_hidden(hidden, meta.lengths)
    return lm_head(params, cfg, hidden), new_state, verified, jnp.stack(feats, axis=2)


# ----------------------------------------------------------------------------------------------------
# acceptance rules
# ----------------------------------------------------------------------------------------------------


@jax.jit
def greedy_accept(target_logits: jax.Array, drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Longest prefix with drafts[:, i] == argmax target_logits[:, i], then the target's bonus token.

    target_logits [B, k+1, V] (position i scores the token after [last, d_1..d_i]); drafts [B, k].
    Returns (accepted [B] in 0..k, next token [B] = argmax at position accepted).
    """
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    accepted = jnp.sum(jnp.cumprod(drafts == best[:, :-1], axis=1), axis=1).astype(jnp.int32)
    return accepted, jnp.take_along_axis(best, accepted[:, None], axis=1)[:, 0]


@jax.jit
def rejection_accept(target_probs: jax.Array, draft_probs: jax.Array, drafts: jax.Array, key: jax.Array):
    """Standard speculative sampling (vLLM): accept draft i with probability min(1, p_i(d)/q_i(d)); at the
    first rejection sample norm(max(p_i - q_i, 0)); if all k are accepted sample the bonus from p_k.

    target_probs [B, k+1, V], draft_probs [B, k, V] (the distribution each draft was drawn from, over the
    target vocab; one-hot for greedy drafts), drafts [B, k]. Returns (accepted [B], next token [B]).
    The emitted tokens are distributed exactly as sampling the target token by token.
    """
    b, k1, v = target_probs.shape
    k = k1 - 1
    key_u, key_x = jax.random.split(key)
    p_d = jnp.take_along_axis(target_probs[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(key_u, (b, k))
    ok = u * q_d < p_d  # u < p/q without dividing (q_d > 0 for a drawn draft)
    accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    q_ext = jnp.concatenate([draft_probs, jnp.zeros((b, 1, v), draft_probs.dtype)], axis=1)  # q_k = 0: bonus
    p_a = jnp.take_along_axis(target_probs, accepted[:, None, None], axis=1)[:, 0]
    q_a = jnp.take_along_axis(q_ext, accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_a - q_a, 0.0)
    total = residual.sum(-1, keepdims=True)
    residual = jnp.where(total > 1e-12, residual / jnp.maximum(total, 1e-30), p_a)  # p == q: never rejected
    nxt = jax.random.categorical(key_x, jnp.log(residual), axis=-1).astype(jnp.int32)
    return accepted, nxt


# ----------------------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------------------


@dataclass
class SpeculativeResult:
    """tokens[b]: the max_tokens generated ids of prompt b (the first comes from the prefill logits).
    accepted: [rounds, B] drafts accepted per round (-1 where the row had already finished)."""

    tokens: list[list[int]]
    accepted: np.ndarray
    k: int
    stats: dict = field(default_factory=dict)

    @property
    def num_rounds(self) -> int:
        return int(self.accepted.shape[0])

    @property
    def mean_acceptance_length(self) -> float:
        """mean(accepted + 1) over the rounds each row took part in: tokens per target verify."""
        valid = self.accepted[self.accepted >= 0]
        return float(np.mean(valid + 1)) if valid.size else float("nan")


def _check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, (np.ndarray, jax.Array)):
        prompts = np.asarray(prompts).tolist()
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts: expected a non-empty sequence of token sequences")
    out = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompt {i}: token ids must be in [0, {vocab_size})")
        out.append(p)
    return out


@partial(jax.jit, static_argnames=("vocab_size",))
def _draft_distribution(drafter_params: dict, logits: jax.Array, temperature, greedy_drafts: bool, vocab_size: int):
    """q over the target vocab [B, k, V] of draft-vocab logits [B, k, Vd]."""
    vd = logits.shape[-1]
    q = jnp.where(greedy_drafts, jax.nn.one_hot(jnp.argmax(logits, -1), vd), jax.nn.softmax(logits / temperature, -1))
    return jnp.zeros((*logits.shape[:2], vocab_size), jnp.float32).at[..., target_ids(drafter_params)].set(q)


def speculative_generate(
    params: dict,
    cfg: ModelConfig,
    drafter_params: dict,
    dcfg: DrafterConfig,
    prompts,
    max_tokens: int,
    k: int,
    sampling: str = "greedy",
    *,
    temperature: float = 1.0,
    seed: int = 0,
    draft_sampling: str = "sample",
    fixed_accepted: int | None = None,
    benchmark_only: bool = False,
    page_size: int = 16,
    backend_name: str = "reference",
) -> SpeculativeResult:
    """Generates max_tokens tokens for each prompt (list of token-id lists, ragged) with speculation.

    sampling: "greedy" (output = the target's greedy chain) or "rejection" (speculative sampling at
      `temperature` > 0; output distributed as sampling the target). draft_sampling ("sample" or
      "greedy") picks how the drafter proposes in rejection mode; both keep the target distribution.
    fixed_accepted: BENCHMARK ONLY -- accept exactly this many drafts (0..k) every round regardless of the
      target; the output is then not the target's. Requires benchmark_only=True. The extra token of each
      round is the target's argmax there (whatever `sampling` says).
    Rows run in one batch until every row has max_tokens; a finished row idles (verify length 0).
    """
    d = dcfg.resolve(cfg)
    prompts = _check_prompts(prompts, cfg.vocab_size)
    if max_tokens < 1 or k < 1:
        raise ValueError(f"max_tokens and k must be >= 1, got {max_tokens}, {k}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    if sampling == "rejection" and not temperature > 0:
        raise ValueError(f"rejection sampling needs temperature > 0, got {temperature}")
    if draft_sampling not in ("sample", "greedy"):
        raise ValueError(f"draft_sampling must be 'sample' or 'greedy', got {draft_sampling!r}")
    if fixed_accepted is not None:
        if not benchmark_only:
            raise ValueError("fixed_accepted is a benchmark-only mode whose outputs are NOT the target's; "
                             "pass benchmark_only=True to enable it")
        if not 0 <= fixed_accepted <= k:
            raise ValueError(f"fixed_accepted must be in [0, {k}], got {fixed_accepted}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")

    b = len(prompts)
    plens = np.array([len(p) for p in prompts], np.int32)
    pmax = int(plens.max())
    capacity = pmax + max_tokens + k + 1  # target context never exceeds prompt + outputs + one verify
    max_pages = math.ceil(capacity / page_size)
    state = init_state(cfg, num_slots=b, num_pages=b * max_pages, page_size=page_size)
    slots = jnp.arange(b, dtype=jnp.int32)
    table = jnp.arange(b * max_pages, dtype=jnp.int32).reshape(b, max_pages)
    meta = lambda ctx, lens: StepMeta(slots, table, jnp.asarray(ctx, jnp.int32), jnp.asarray(lens, jnp.int32))
    key = jax.random.key(seed)
    sampled = sampling == "rejection"

    padded = np.full((b, pmax), cfg.pad_token_id, np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    logits, state, _, feats = target_step(params, cfg, state, jnp.asarray(padded), meta(np.zeros(b), plens),
                                          d.capture_layers, False, backend_name)
    if sampled:
        first = np.asarray(jax.random.categorical(jax.random.fold_in(key, 0), logits / temperature, axis=-1))
    else:
        first = np.asarray(jnp.argmax(logits, -1))
    outputs = [[int(t)] for t in first]
    # the drafter's catch-up input: position t with the token after it (the prompt shifted, then `first`)
    nxt = np.zeros((b, pmax), np.int32)
    for i, p in enumerate(prompts):
        nxt[i, : len(p)] = p[1:] + [int(first[i])]
    dstate = init_drafter_state(cfg, dcfg, b, capacity + k)
    catch_lens = plens.copy()
    context = plens.copy()  # tokens in the target cache: all but the last emitted token
    last = first.astype(np.int32)
    embed_table = params["embed"]
    history = []
    rnd = 0
    while min(len(o) for o in outputs) < max_tokens:
        rnd += 1
        active = np.array([len(o) < max_tokens for o in outputs])
        rkey = jax.random.fold_in(key, rnd)
        dkey = jax.random.fold_in(rkey, 1) if sampled and draft_sampling == "sample" else None
        drafts, dlogits, dstate = draft_tokens(drafter_params, cfg, dcfg, embed_table, dstate, feats,
                                               jnp.asarray(nxt), jnp.asarray(np.where(active, catch_lens, 0)), k,
                                               temperature, dkey)
        vtokens = jnp.concatenate([jnp.asarray(last)[:, None], drafts], axis=1)
        vlens = np.where(active, k + 1, 0)
        tlogits, state, verified, feats = target_step(params, cfg, state, vtokens, meta(context, vlens),
                                                      d.capture_layers, True, backend_name)
        if fixed_accepted is not None:
            accepted = jnp.full((b,), fixed_accepted, jnp.int32)
            bonus = jnp.argmax(tlogits[:, fixed_accepted], -1).astype(jnp.int32)
        elif sampled:
            q = _draft_distribution(drafter_params, dlogits, temperature, draft_sampling == "greedy", cfg.vocab_size)
            accepted, bonus = rejection_accept(jax.nn.softmax(tlogits / temperature, -1), q, drafts,
                                               jax.random.fold_in(rkey, 2))
        else:
            accepted, bonus = greedy_accept(tlogits, drafts)
        state = commit_verified(state, verified, slots, accepted + 1, backend_name=backend_name)
        accepted, bonus, drafts_np = np.asarray(accepted), np.asarray(bonus), np.asarray(drafts)
        history.append(np.where(active, accepted, -1))
        nxt = np.zeros((b, k + 1), np.int32)
        for i in np.flatnonzero(active):
            a = int(accepted[i])
            emitted = drafts_np[i, :a].tolist() + [int(bonus[i])]
            outputs[i].extend(emitted[: max_tokens - len(outputs[i])])
            nxt[i, : a + 1] = emitted
        catch_lens = np.where(active, accepted + 1, 0)
        context = context + catch_lens
        last = bonus.astype(np.int32)
    acc = np.stack(history) if history else np.zeros((0, b), np.int32)
    return SpeculativeResult(tokens=outputs, accepted=acc, k=k, stats={"rounds": rnd, "prefill_len": pmax})
