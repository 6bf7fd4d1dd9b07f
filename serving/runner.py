"""The model runner: host batches -> padded shape buckets -> jitted steps with donated state.

The runner owns the device state (`DecodeState`) and the parameters; the engine tells it which rows to
run with which slots and pages. Every batch is padded up to a bucket (rows, tokens, pages: powers of two
up to the configured limits) so that a warmed engine never recompiles in steady state. Padding rows use
a scratch slot that no request owns and carry zero new tokens, which leaves every state unchanged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import k3jax
from k3jax.config import ModelConfig
from k3jax.model import DecodeState, StepMeta, commit_verified
from k3jax.sampling import SamplingTensors, sample
from k3jax.speculative import target_step
from serving import spec_decode
from serving.config import EngineConfig, explicit_buckets
from serving.request import SamplingParams


log = logging.getLogger("k3jax.serving")


def buckets(limit: int, start: int = 1, growth: int = 2) -> tuple[int, ...]:
    """start, start*growth, ... below `limit`, then `limit` itself (which need not be a power)."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= growth
    return tuple(out) + (limit,)


def fit(n: int, sizes: tuple[int, ...]) -> int:
    for s in sizes:
        if n <= s:
            return s
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


@dataclass
class Row:
    """One request's part of a step: its KDA slot, its pages in order, cached length and new tokens."""

    slot: int
    pages: list[int]
    context_len: int
    tokens: list[int]


@partial(jax.jit, donate_argnums=0)
def _copy_slots(state: DecodeState, src: jax.Array, dst: jax.Array) -> DecodeState:
    return state.replace(kda=state.kda.at[:, dst].set(state.kda[:, src]), conv=state.conv.at[:, dst].set(state.conv[:, src]))


@jax.jit
def _gather_tokens(previous: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.where(index >= 0, previous[jnp.maximum(index, 0)], 0).astype(jnp.int32)


@jax.jit
def _take_rows(logits: jax.Array, index: jax.Array) -> jax.Array:
    return logits[index]


@partial(jax.jit, donate_argnums=0)
def _write_pages(state: DecodeState, pages: jax.Array, latents: jax.Array) -> DecodeState:
    return state.replace(kv_pages=state.kv_pages.at[:, pages].set(latents.astype(state.kv_pages.dtype)))


@partial(jax.jit, donate_argnums=0)
def _store_pending(pending: jax.Array, slots: jax.Array, feats: jax.Array, start: jax.Array) -> jax.Array:
    """pending[slots[b], j] = feats[b, start[b] + j] for j < pending's width (reads past T are clamped)."""
    width = pending.shape[1]
    idx = jnp.minimum(start[:, None] + jnp.arange(width)[None, :], feats.shape[1] - 1)
    return pending.at[slots].set(jnp.take_along_axis(feats, idx[:, :, None, None], axis=1).astype(pending.dtype))


@partial(jax.jit, donate_argnums=0)
def _set_axis1(pool: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
    return pool.at[:, index].set(values.astype(pool.dtype))


@partial(jax.jit, donate_argnums=0)
def _write_slot(state: DecodeState, slot: jax.Array, kda: jax.Array, conv: jax.Array) -> DecodeState:
    return state.replace(kda=state.kda.at[:, slot].set(kda), conv=state.conv.at[:, slot].set(conv.astype(state.conv.dtype)))


def _warm_sampler(rows: int, vocab: int) -> None:
    """Compiles the sampler for a decode row bucket: one program per host flag combination (all greedy; sampled
    without the top-k / top-p sort; with it), so that no request's sampling settings compile in steady state."""
    logits = jnp.zeros((rows, vocab), jnp.float32)
    for p in (SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)):
        sample(logits, SamplingTensors.from_params([p], [0], rows, seeds=[0]))


def pool_sizes(cfg: ModelConfig, ecfg: EngineConfig, device: jax.Device, draft_latent_dim: int = 0) -> tuple[int, int]:
    """(num_pages, num_slots): explicit values from the config, else sized from free device memory."""
    num_slots = ecfg.num_slots or 2 * ecfg.max_running + 8
    if ecfg.num_pages is not None:
        return ecfg.num_pages, num_slots
    page_bytes = cfg.num_mla_layers * ecfg.page_size * cfg.latent_cache_dim * jnp.dtype(cfg.dtype).itemsize
    if draft_latent_dim:  # the drafter's latents live beside the target's, one page id for both
        page_bytes += ecfg.page_size * draft_latent_dim * jnp.dtype(cfg.dtype).itemsize
    slot_bytes = cfg.num_kda_layers * cfg.kda_num_heads * cfg.kda_head_dim**2 * 4
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        budget = int(free * ecfg.cache_memory_fraction) - num_slots * slot_bytes
    else:  # CPU: no allocator statistics; a fixed 1 GiB budget is plenty for test-sized models
        budget = 2**30 - num_slots * slot_bytes
    if budget <= 0:
        raise ValueError("not enough device memory for the KDA slots; lower num_slots or max_running")
    return max(2, min(budget // max(page_bytes, 1), 1 << 20)), num_slots


class ModelRunner:
    """Runs prefill / decode / speculative batches of `Row`s against the pooled state. Not thread-safe.

    With a drafter (`drafter=(DrafterConfig, params)` and ecfg.speculative_k = k > 0) the runner also owns
    the draft-layer latent pool (same page ids as the target's) and `pending`: per slot, the target
    features of the positions the drafter has not caught up on yet (at most k + 1).
    """

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, params: dict, num_pages: int, num_slots: int,
                 drafter: tuple | None = None):
        self.cfg, self.ecfg, self.params = cfg, ecfg, params
        self.num_pages, self.num_slots = num_pages, num_slots
        self.scratch_slot = num_slots  # one extra row, owned by nobody, absorbs padding rows
        self.state = k3jax.init_state(cfg, num_slots + 1, num_pages, ecfg.page_size)
        self._set_buckets(ecfg)
        self._shapes_seen: set[tuple] = set()  # (kind, rows, tokens, pages) programs run so far
        self.k = ecfg.speculative_k if drafter is not None else 0
        if self.k:
            self.dcfg, self.dparams = drafter[0].resolve(cfg), drafter[1]
            self.capture = self.dcfg.capture_layers
            self.draft_pool = spec_decode.init_draft_pool(cfg, self.dcfg, num_pages, ecfg.page_size)
            self.pending = jnp.zeros((num_slots + 1, self.k + 1, len(self.capture), cfg.hidden_size), jnp.dtype(cfg.dtype))

    def _set_buckets(self, ecfg: EngineConfig) -> None:
        """Shape buckets: the config's explicit lists where given, else powers of bucket_growth."""
        g = ecfg.bucket_growth
        self.row_buckets = (explicit_buckets(ecfg.row_buckets, ecfg.max_running)
                            or buckets(ecfg.max_running, growth=g))
        self.token_buckets = (explicit_buckets(ecfg.token_buckets, ecfg.max_prefill_tokens)
                              or buckets(ecfg.max_prefill_tokens, start=min(16, ecfg.max_prefill_tokens), growth=g))
        self.page_buckets = (explicit_buckets(ecfg.page_buckets, ecfg.max_pages_per_request)
                             or buckets(ecfg.max_pages_per_request, growth=g))
        self.slot_copy_buckets = buckets(max(ecfg.max_running, 8), growth=g)

    # --- steps -------------------------------------------------------------------------------
    def _first_use(self, shape: tuple) -> float | None:
        """The start time when `shape` (kind, rows, tokens, pages) has not run yet: its step compiles."""
        if shape in self._shapes_seen:
            return None
        self._shapes_seen.add(shape)
        return time.perf_counter()

    def _log_first_use(self, shape: tuple, started: float | None, out) -> None:
        if started is not None:
            jax.block_until_ready(out)
            log.info("new step shape %s rows=%d tokens=%d pages=%d: compiled and ran in %.1f s (%d shapes so far)",
                     *shape, time.perf_counter() - started, len(self._shapes_seen))

    def _meta(self, rows: list[Row], b: int, max_pages: int, lengths: list[int]) -> StepMeta:
        slots = np.full(b, self.scratch_slot, np.int32)
        table = np.zeros((b, max_pages), np.int32)
        ctx = np.zeros(b, np.int32)
        lens = np.zeros(b, np.int32)
        for i, r in enumerate(rows):
            slots[i], ctx[i], lens[i] = r.slot, r.context_len, lengths[i]
            table[i, : len(r.pages)] = r.pages
        # host arrays: the jitted step moves them with its arguments (an eager jnp.asarray per array costs the
        # host a dispatch each, every step)
        return StepMeta(slots, table, ctx, lens)

    def _tokens(self, rows: list[Row], b: int, t: int) -> np.ndarray:
        tokens = np.full((b, t), self.cfg.pad_token_id, np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r.tokens)] = r.tokens
        return tokens

    def prefill(self, rows: list[Row]) -> jax.Array:
        """Appends each row's tokens; returns float32 logits [B_bucket, V] at each row's last token.

        When speculating, the target's features at every new position are kept for `draft_extend`."""
        b = fit(len(rows), self.row_buckets)
        t = fit(max(len(r.tokens) for r in rows), self.token_buckets)
        p = fit(max(len(r.pages) for r in rows), self.page_buckets)
        meta = self._meta(rows, b, p, [len(r.tokens) for r in rows])
        shape = ("prefill", b, t, p)
        started = self._first_use(shape)
        if self.k:
            logits, self.state, _, self._prefill_feats = target_step(
                self.params, self.cfg, self.state, self._tokens(rows, b, t), meta, self.capture, False, self.ecfg.backend)
            self._prefill_meta, self._prefill_slots = meta, [r.slot for r in rows]
        else:
            logits, self.state = k3jax.prefill(self.params, self.cfg, self.state, self._tokens(rows, b, t), meta,
                                               backend_name=self.ecfg.backend)
        self._log_first_use(shape, started, logits)
        return logits

    def decode(self, rows: list[Row], tokens: jax.Array | None = None) -> jax.Array:
        """One token per row; returns float32 logits [B_bucket, V]. The tokens are each row.tokens[0], or
        `tokens` already on the device ([B_bucket] int32, from `gather_tokens`; the rows' own lists unused)."""
        b = fit(len(rows), self.row_buckets)
        p = fit(max(len(r.pages) for r in rows), self.page_buckets)
        if tokens is None:
            tokens = np.zeros(b, np.int32)
            tokens[: len(rows)] = [r.tokens[0] for r in rows]
        elif tokens.shape != (b,):
            raise ValueError(f"device tokens of shape {tokens.shape} for {len(rows)} rows (bucket {b})")
        meta = self._meta(rows, b, p, [1] * len(rows))
        shape = ("decode", b, 1, p)
        started = self._first_use(shape)
        logits, self.state = k3jax.decode(self.params, self.cfg, self.state, tokens, meta,
                                          backend_name=self.ecfg.backend)
        self._log_first_use(shape, started, logits)
        return logits

    def gather_tokens(self, previous: jax.Array, index: list[int]) -> jax.Array:
        """The next decode step's input tokens on the device: previous[index[i]] for its rows, padded to the
        row bucket with zeros (overlap scheduling: `previous` is the last step's sampled tokens, not read back)."""
        return _gather_tokens(previous, self._bucket_index(index, -1))

    def take_rows(self, logits: jax.Array, index: list[int]) -> jax.Array:
        """logits[index] padded to index's row bucket (the padding repeats row index[0]), so the gather and the
        sampler after it see one shape per bucket instead of one per count of rows (no steady-state compiles)."""
        return _take_rows(logits, self._bucket_index(index, index[0]))

    def _bucket_index(self, index: list[int], fill: int) -> np.ndarray:
        """int32 index padded with `fill` to its row bucket: one jitted shape per bucket."""
        padded = np.full(fit(len(index), self.row_buckets), fill, np.int32)
        padded[: len(index)] = index
        return padded

    # --- speculative decoding ----------------------------------------------------------------
    def draft_extend(self, next_tokens: list[list[int]], pending_last: list[bool]) -> None:
        """After `prefill`: the drafter catches up on the prefilled positions. next_tokens[i] is, per
        position of row i, the token after it (row i catches up on len(next_tokens[i]) positions). Rows
        with pending_last[i] (their prompt is done) also park the features of their last prefilled
        position in `pending`, to be caught up on with the sampled token at their first draft."""
        meta, feats = self._prefill_meta, self._prefill_feats
        b, t = feats.shape[:2]
        tokens = np.zeros((b, t), np.int32)
        lengths = np.zeros(b, np.int32)
        start = np.zeros(b, np.int32)
        for i, nxt in enumerate(next_tokens):
            tokens[i, : len(nxt)] = nxt
            lengths[i] = len(nxt)
            start[i] = len(nxt)  # the position after the caught-up ones
        _, self.draft_pool = spec_decode.draft_step(
            self.dparams, self.cfg, self.dcfg, self.params["embed"], self.draft_pool, feats, jnp.asarray(tokens),
            meta.page_table, meta.context_lens, jnp.asarray(lengths), 0)
        slots = np.full(b, self.scratch_slot, np.int32)
        for i, (slot, park) in enumerate(zip(self._prefill_slots, pending_last)):
            if park:
                slots[i] = slot
        self.pending = _store_pending(self.pending, jnp.asarray(slots), feats, jnp.asarray(start))
        self._prefill_feats = self._prefill_meta = self._prefill_slots = None

    def speculate(self, rows: list[Row], pending: list[list[int]], tensors: SamplingTensors,
                  fixed_accepted: int | None = None):
        """One speculative decode step. rows[i].tokens == [newest token], context_len = computed length p;
        pending[i]: the tokens after the drafter's not-yet-seen positions p - len .. p - 1.

        Drafts k tokens, verifies them in one target step, accepts and refills `pending`. tensors: sampling rows
        for B_bucket * (k + 1) verify positions. The KDA states are not committed yet: the caller takes any in-run
        checkpoints (`snapshot_verified`), then calls `commit_speculated` with the handle before the next step.
        Returns (accepted np [n], emitted np [n, k+1], the verify step's handle for `commit_speculated`).
        """
        k, n = self.k, len(rows)
        b = fit(n, self.row_buckets)
        p = fit(max(len(r.pages) for r in rows), self.page_buckets)
        draft_rows = [Row(r.slot, r.pages, r.context_len - len(pend), []) for r, pend in zip(rows, pending)]
        meta = self._meta(draft_rows, b, p, [len(pend) for pend in pending])
        tokens = np.zeros((b, k + 1), np.int32)
        for i, pend in enumerate(pending):
            tokens[i, : len(pend)] = pend
        feats = self.pending[meta.slots]
        drafts, self.draft_pool = spec_decode.draft_step(
            self.dparams, self.cfg, self.dcfg, self.params["embed"], self.draft_pool, feats, jnp.asarray(tokens),
            meta.page_table, meta.context_lens, meta.lengths, k)
        last = np.zeros((b, 1), np.int32)
        last[:n, 0] = [r.tokens[0] for r in rows]
        vtokens = jnp.concatenate([jnp.asarray(last), drafts], axis=1)
        vmeta = self._meta(rows, b, p, [k + 1] * n)
        logits, self.state, verified, vfeats = target_step(
            self.params, self.cfg, self.state, vtokens, vmeta, self.capture, True, self.ecfg.backend)
        accepted, emitted = spec_decode.accept(logits, drafts, tensors.device_branches(), fixed_accepted=fixed_accepted)
        self.pending = _store_pending(self.pending, vmeta.slots, vfeats, jnp.zeros(b, jnp.int32))
        return np.asarray(accepted)[:n], np.asarray(emitted)[:n], (verified, accepted + 1)

    def snapshot_verified(self, handle, row: int, position: int, dst_slot: int) -> None:
        """KDA/conv state of row `row` after verify position `position` -> slot dst_slot (a checkpoint at a page
        boundary crossed inside an accepted run). Rebuilt from the state before the verify step in the row's
        slot, so only before `commit_speculated(handle)` overwrites it."""
        verified, _ = handle
        self.state = commit_verified(self.state, verified, jnp.asarray([dst_slot], jnp.int32),
                                     jnp.asarray([position + 1], jnp.int32), rows=jnp.asarray([row], jnp.int32),
                                     backend_name=self.ecfg.backend)

    def commit_speculated(self, handle) -> None:
        """Keeps each row's accepted prefix of the verify step `handle` (from `speculate`): its KDA and conv
        states go into the row's slot (after any `snapshot_verified` of the same step)."""
        verified, num_accepted = handle  # (each row goes back to its own slot, verified.slots)
        self.state = commit_verified(self.state, verified, verified.slots, num_accepted, backend_name=self.ecfg.backend)

    # --- state movement (checkpoints, host tier, swap) -------------------------------------------
    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """state[dst[i]] = state[src[i]] for KDA and conv rows (checkpoint take / restore)."""
        if not src:
            return
        n = fit(len(src), self.slot_copy_buckets)
        pad = [self.scratch_slot] * (n - len(src))
        self.state = _copy_slots(self.state, np.asarray(src + pad, np.int32), np.asarray(dst + pad, np.int32))

    def read_pages(self, pages: list[int]) -> np.ndarray:
        """Latents of the given pages, all MLA layers: [L_mla, n, page_size, C+R] on the host."""
        return np.asarray(self.state.kv_pages[:, np.asarray(pages, np.int32)])

    def write_pages(self, pages: list[int], latents: np.ndarray) -> None:
        self.state = _write_pages(self.state, jnp.asarray(pages, jnp.int32), jnp.asarray(latents))

    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.state.kda[:, slot]), np.asarray(self.state.conv[:, slot])

    def write_slot(self, slot: int, kda: np.ndarray, conv: np.ndarray) -> None:
        self.state = _write_slot(self.state, jnp.asarray(slot, jnp.int32), jnp.asarray(kda), jnp.asarray(conv))

    def read_request(self, slot: int, pages: list[int]) -> dict[str, np.ndarray]:
        """Everything the device holds for one request (swap-out): its pages' latents, its KDA/conv row
        and, when speculating, its draft-layer latents and pending features."""
        kda, conv = self.read_slot(slot)
        out = {"kv": self.read_pages(pages), "kda": kda, "conv": conv}
        if self.k:
            out["draft"] = np.asarray(self.draft_pool[:, np.asarray(pages, np.int32)])
            out["pending"] = np.asarray(self.pending[slot])
        return out

    def write_request(self, slot: int, pages: list[int], arrays: dict[str, np.ndarray]) -> None:
        """The inverse of read_request, into a (new) slot and pages."""
        if pages:
            self.write_pages(pages, arrays["kv"])
        self.write_slot(slot, arrays["kda"], arrays["conv"])
        if self.k:
            if pages:
                self.draft_pool = _set_axis1(self.draft_pool, jnp.asarray(pages, jnp.int32), jnp.asarray(arrays["draft"]))
            self.pending = self.pending.at[slot].set(jnp.asarray(arrays["pending"]))

    # --- warm-up -------------------------------------------------------------------------------
    def warmup(self, prefill: bool = True) -> int:
        """Compiles every shape bucket that steady-state steps use; returns how many programs ran.

        Warm-up rows carry zero new tokens on the scratch slot, so the state is unchanged. Prefill has
        rows x tokens x pages buckets: on a large configuration prefer a coarser `bucket_growth`.
        """
        count = 0
        # prefill steps never have more rows than the scheduler's cap, so larger row buckets need no prefill program
        prefill_rows = fit(self.ecfg.prefill_rows_limit, self.row_buckets)
        for b in self.row_buckets:
            for p in self.page_buckets:
                rows = [Row(self.scratch_slot, [0] * p, 0, []) for _ in range(b)]
                meta = self._meta(rows, b, p, [0] * b)
                if self.k:
                    self._warm_speculate(b, meta)
                else:
                    # tokens from the host, and (overlap scheduling) already on the device: the same program, but
                    # jit's dispatch cache keys the two argument kinds apart
                    for tokens in (np.zeros(b, np.int32), jnp.zeros(b, jnp.int32)):
                        _, self.state = k3jax.decode(self.params, self.cfg, self.state, tokens, meta,
                                                     backend_name=self.ecfg.backend)
                    self._shapes_seen.add(("decode", b, 1, p))
                count += 1
                for t in self.token_buckets if prefill and b <= prefill_rows else ():
                    tokens = np.full((b, t), self.cfg.pad_token_id, np.int32)  # host tokens, as `prefill` passes
                    if self.k:
                        _, self.state, _, self._prefill_feats = target_step(
                            self.params, self.cfg, self.state, tokens, meta, self.capture, False, self.ecfg.backend)
                        self._prefill_meta, self._prefill_slots = meta, []
                        self.draft_extend([], [])
                    else:
                        _, self.state = k3jax.prefill(self.params, self.cfg, self.state, tokens, meta,
                                                      backend_name=self.ecfg.backend)
                    self._shapes_seen.add(("prefill", b, t, p))
                    count += 1
            if not self.k:
                _warm_sampler(b, self.cfg.vocab_size)
            if prefill and b <= prefill_rows:  # the engine's pick of finished prompts from prefill logits
                logits = jnp.zeros((b, self.cfg.vocab_size), jnp.float32)
                for rows in (n for n in self.row_buckets if n <= b):
                    self.take_rows(logits, list(range(rows)))
        return count

    def _warm_speculate(self, b: int, meta: StepMeta) -> None:
        """The speculative programs of one (rows, pages) bucket, on idle rows (length 0: no writes)."""
        k = self.k
        _, self.draft_pool = spec_decode.draft_step(
            self.dparams, self.cfg, self.dcfg, self.params["embed"], self.draft_pool, self.pending[meta.slots],
            jnp.zeros((b, k + 1), jnp.int32), meta.page_table, meta.context_lens, meta.lengths, k)
        logits, self.state, verified, vfeats = target_step(
            self.params, self.cfg, self.state, jnp.zeros((b, k + 1), jnp.int32), meta, self.capture, True,
            self.ecfg.backend)
        tensors = SamplingTensors.greedy(b * (k + 1)).device_branches()
        accepted, _ = spec_decode.accept(logits, jnp.zeros((b, k), jnp.int32), tensors,
                                         fixed_accepted=self.ecfg.spec_fixed_accepted)
        self.state = commit_verified(self.state, verified, meta.slots, accepted + 1, backend_name=self.ecfg.backend)
        self.pending = _store_pending(self.pending, meta.slots, vfeats, jnp.zeros(b, jnp.int32))
