"""Batched token sampling: one jitted function, one shape for every mix of greedy and sampled rows.

    sample(logits, params)              float32 [B, V] -> int32 [B]
    process_logits(logits, params)      float32 [B, V] -> float32 [B, V] (softmax = the sampled distribution)
    greedy(logits)                      float32 [B, V] -> int32 [B]

Per row, in vLLM's order: banned ids -> -inf, temperature scaling, top-k, top-p, min-p, then Gumbel-max.
A row with temperature < SAMPLING_EPS is greedy: exactly the argmax of its (ban-masked) logits.

Reproducibility: row b draws its noise from fold_in(key(seed[b]), position[b]), so a request's token at
output position i is a pure function of (seed, i, logits row), whatever else shares the batch.

Every knob is a per-row array of SamplingTensors, so changing values never recompiles; only B, V and the
ban width S are shapes. `SamplingTensors.from_params` builds them on the host, with two static flags read from
the same values (all rows greedy; some row needs the top-k / top-p sort): at most four programs, and no
data-dependent branch on the device. (A `lax.cond` on a device value makes XLA's GPU runtime copy the predicate
to the host and wait for it: that stalled the host in every step until the step's own forward had finished, and
so defeated the engine's overlap scheduling. Tensors built without the flags keep the device-side branches.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS); dividing by them would overflow.
SAMPLING_EPS = 1e-5
DEFAULT_BAN_WIDTH = 8


class SamplingLike(Protocol):
    """What from_params reads (serving.request.SamplingParams has these; k3jax never imports serving)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    min_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool


def fold_seed(seed: int) -> int:
    """A Python int seed as uint32: itself when it fits, else a hash of its value (stable across runs)."""
    if 0 <= seed < 2**32:
        return seed
    digest = hashlib.blake2b(str(seed).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@flax.struct.dataclass
class SamplingTensors:
    """Per-row sampling parameters of one batch (all leading dims B).

    temperature: [B] float32, < SAMPLING_EPS = greedy
    top_k:       [B] int32, 0 = off (values >= V are off too)
    top_p:       [B] float32 in (0, 1], 1 = off
    min_p:       [B] float32 in [0, 1), 0 = off
    seed:        [B] uint32 per-request seed
    position:    [B] int32 output index of the token being sampled (the request's num_output)
    banned_ids:  [B, S] int32 ids forced to -inf (eos / stop ids while under min_tokens); -1 = unused
    all_greedy:  static: every row is greedy (no noise drawn); None = decide on the device
    needs_sort:  static: some sampled row has top-k or top-p (False skips the sort); None = decide on the device

    from_params leaves the arrays as host numpy arrays: a jitted consumer moves them to the device with its
    arguments (one transfer each, without the eager `jnp.asarray` dispatch per array).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array
    position: jax.Array
    banned_ids: jax.Array
    all_greedy: bool | None = flax.struct.field(pytree_node=False, default=None)
    needs_sort: bool | None = flax.struct.field(pytree_node=False, default=None)

    def device_branches(self) -> SamplingTensors:
        """The same tensors without the static flags: one program for every mix of rows, the greedy / sort
        branches decided on the device (a consumer that reads its result at once loses nothing by that)."""
        return self.replace(all_greedy=None, needs_sort=None)

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def greedy(cls, batch_size: int, ban_width: int = DEFAULT_BAN_WIDTH) -> SamplingTensors:
        """All rows greedy, nothing banned."""
        return cls.from_params([], [], batch_size, ban_width=ban_width)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingLike],
        positions: Sequence[int],
        pad_to: int,
        *,
        seeds: Sequence[int] | None = None,
        eos_id: int | Sequence[int] | None = None,
        suppress_eos: Sequence[bool] | None = None,
        ban_width: int = DEFAULT_BAN_WIDTH,
    ) -> SamplingTensors:
        """Host-side build for rows params[i] at output positions[i], padded with greedy rows to pad_to.

        seeds overrides params[i].seed per row (pass the request's resolved seed); without it every
        params[i].seed must be set. Row i bans eos_id (unless ignore_eos) and its stop_token_ids while
        suppress_eos[i], by default while positions[i] < min_tokens. The ban width is max(ban_width,
        next power of two of the longest row's list): it changes shape (and recompiles) only for
        unusually long stop lists.
        """
        n = len(params)
        for name, arg in (("positions", positions), ("seeds", seeds), ("suppress_eos", suppress_eos)):
            if arg is not None and len(arg) != n:
                raise ValueError(f"{name}: expected {n} entries (one per params row), got {len(arg)}")
        eos_ids = [] if eos_id is None else [int(eos_id)] if isinstance(eos_id, (int, np.integer)) else list(eos_id)
        if pad_to < n:
            raise ValueError(f"pad_to={pad_to} is smaller than the number of rows {n}")
        if ban_width < 1:
            raise ValueError(f"ban_width must be >= 1, got {ban_width}")

        temperature = np.zeros(pad_to, np.float32)
        top_k = np.zeros(pad_to, np.int32)
        top_p = np.ones(pad_to, np.float32)
        min_p = np.zeros(pad_to, np.float32)
        seed = np.zeros(pad_to, np.uint32)
        position = np.zeros(pad_to, np.int32)
        banned: list[list[int]] = []
        for i, p in enumerate(params):
            s = seeds[i] if seeds is not None else p.seed
            if s is None:
                raise ValueError(f"row {i}: seed is None; pass seeds= (e.g. each Request.seed)")
            if positions[i] < 0:
                raise ValueError(f"row {i}: position must be >= 0, got {positions[i]}")
            temperature[i] = p.temperature
            top_k[i] = max(int(p.top_k), 0)
            top_p[i] = p.top_p
            min_p[i] = p.min_p
            seed[i] = fold_seed(int(s))
            position[i] = positions[i]
            ids: list[int] = []
            if (positions[i] < p.min_tokens) if suppress_eos is None else suppress_eos[i]:
                ids = ([] if p.ignore_eos else list(eos_ids)) + list(p.stop_token_ids)
            banned.append(ids)
        longest = max((len(b) for b in banned), default=0)
        width = max(ban_width, 1 << max(longest - 1, 0).bit_length())
        banned_ids = np.full((pad_to, width), -1, np.int32)
        for i, ids in enumerate(banned):
            banned_ids[i, : len(ids)] = ids
        sampled = temperature >= SAMPLING_EPS
        return cls(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, position=position,
            banned_ids=banned_ids, all_greedy=not sampled.any(),
            needs_sort=bool((sampled & ((top_k > 0) | (top_p < 1.0))).any()),
        )


def greedy(logits: jax.Array) -> jax.Array:
    """int32 [B] argmax of logits [B, V] (first index on ties)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def mask_tokens(logits: jax.Array, banned_mask: jax.Array) -> jax.Array:
    """logits [B, V] with -inf where banned_mask [B, V] bool is set."""
    return jnp.where(banned_mask, -jnp.inf, logits)


def suppress_ids(logits: jax.Array, banned_ids: jax.Array) -> jax.Array:
    """logits [B, V] with -inf at banned_ids [B, S] (entries outside [0, V), e.g. -1, are ignored)."""
    b, v = logits.shape
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], banned_ids.shape)
    ids = jnp.where((banned_ids >= 0) & (banned_ids < v), banned_ids, v)  # v is out of bounds: dropped
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def row_keys(seed: jax.Array, position: jax.Array) -> jax.Array:
    """[B] typed PRNG keys fold_in(key(seed[b]), position[b])."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)


def _top_k_top_p(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """x [B, V] scaled logits with tokens outside each row's top-k, then top-p, set to -inf.

    Both cuts are thresholds on the descending sort, so ties with the last kept value are kept.
    """
    v = x.shape[-1]
    desc = -jnp.sort(-x, axis=-1)  # [B, V]
    k = jnp.where((top_k <= 0) | (top_k > v), v, top_k)  # [B]
    in_k = jnp.arange(v)[None, :] < k[:, None]  # [B, V] positions of desc within the top-k
    desc = jnp.where(in_k, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # [B, V] mass strictly ahead of each sorted position
    kept = jnp.sum(in_k & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0)), axis=-1)  # [B] >= 1
    threshold = jnp.take_along_axis(desc, (kept - 1)[:, None], axis=-1)  # [B, 1]
    return jnp.where(x < threshold, -jnp.inf, x)


def _min_p(x: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drops tokens with prob < min_p * max prob: in log space, x < max(x) + log(min_p)."""
    threshold = jnp.max(x, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]  # log(0) = -inf keeps all
    return jnp.where(x < threshold, -jnp.inf, x)


@jax.jit
def process_logits(logits: jax.Array, params: SamplingTensors) -> jax.Array:
    """float32 [B, V]: bans, temperature, top-k, top-p, min-p applied; softmax is the sampled distribution.

    Greedy rows come back ban-masked but unscaled and unfiltered (their token is the argmax).
    """
    x = suppress_ids(logits.astype(jnp.float32), params.banned_ids)
    is_greedy = params.temperature < SAMPLING_EPS
    t = jnp.where(is_greedy, 1.0, params.temperature)
    x = x / t[:, None]
    v = x.shape[-1]
    top_k = jnp.where(is_greedy, 0, params.top_k)
    top_p = jnp.where(is_greedy, 1.0, params.top_p)
    # The sort is the costly part: batches with no top-k / top-p row skip it (decided on the host when known).
    if params.needs_sort is None:
        needs_sort = jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1.0))
        x = jax.lax.cond(needs_sort, _top_k_top_p, lambda x, k, p: x, x, top_k, top_p)
    elif params.needs_sort:
        x = _top_k_top_p(x, top_k, top_p)
    return _min_p(x, jnp.where(is_greedy, 0.0, params.min_p))


@jax.jit
def sample(logits: jax.Array, params: SamplingTensors, keys: jax.Array | None = None) -> jax.Array:
    """int32 [B] tokens for logits [B, V] (any float dtype).

    keys: optional [B] typed PRNG keys; by default row_keys(params.seed, params.position). Greedy rows
    ignore their key. Sampling is Gumbel-max over process_logits.
    """
    if logits.ndim != 2:
        raise ValueError(f"sample: expected logits [B, V], got shape {list(logits.shape)}")
    if params.batch_size != logits.shape[0]:
        raise ValueError(f"sample: params have {params.batch_size} rows, logits {logits.shape[0]}")
    x = process_logits(logits, params)
    is_greedy = params.temperature < SAMPLING_EPS
    if keys is None:
        keys = row_keys(params.seed, params.position)

    def draw(x):
        noise = jax.vmap(lambda k: jax.random.gumbel(k, x.shape[-1:], jnp.float32))(keys)  # [B, V]
        return greedy(x + noise)

    # All-greedy batches (the common agentic case) skip the [B, V] noise.
    if params.all_greedy:
        return greedy(x)
    drawn = jax.lax.cond(jnp.all(is_greedy), greedy, draw, x) if params.all_greedy is None else draw(x)
    return jnp.where(is_greedy, greedy(x), drawn)
