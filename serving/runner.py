"""The model runner: host batches -> padded shape buckets -> jitted steps with donated state.

The runner owns the device state (`DecodeState`) and the parameters; the engine tells it which rows to
run with which slots and pages. Every batch is padded up to a bucket (rows, tokens, pages: powers of two
up to the configured limits) so that a warmed engine never recompiles in steady state. Padding rows use
a scratch slot that no request owns and carry zero new tokens, which leaves every state unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import k3jax
from k3jax.config import ModelConfig
from k3jax.model import DecodeState, StepMeta
from serving.config import EngineConfig


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


@partial(jax.jit, donate_argnums=0)
def _write_pages(state: DecodeState, pages: jax.Array, latents: jax.Array) -> DecodeState:
    return state.replace(kv_pages=state.kv_pages.at[:, pages].set(latents.astype(state.kv_pages.dtype)))


@partial(jax.jit, donate_argnums=0)
def _write_slot(state: DecodeState, slot: jax.Array, kda: jax.Array, conv: jax.Array) -> DecodeState:
    return state.replace(kda=state.kda.at[:, slot].set(kda), conv=state.conv.at[:, slot].set(conv.astype(state.conv.dtype)))


def pool_sizes(cfg: ModelConfig, ecfg: EngineConfig, device: jax.Device) -> tuple[int, int]:
    """(num_pages, num_slots): explicit values from the config, else sized from free device memory."""
    num_slots = ecfg.num_slots or 2 * ecfg.max_running + 8
    if ecfg.num_pages is not None:
        return ecfg.num_pages, num_slots
    page_bytes = cfg.num_mla_layers * ecfg.page_size * cfg.latent_cache_dim * jnp.dtype(cfg.dtype).itemsize
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
    """Runs prefill / decode batches of `Row`s against the pooled state. Not thread-safe."""

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, params: dict, num_pages: int, num_slots: int):
        self.cfg, self.ecfg, self.params = cfg, ecfg, params
        self.num_pages, self.num_slots = num_pages, num_slots
        self.scratch_slot = num_slots  # one extra row, owned by nobody, absorbs padding rows
        self.state = k3jax.init_state(cfg, num_slots + 1, num_pages, ecfg.page_size)
        g = ecfg.bucket_growth
        self.row_buckets = buckets(ecfg.max_running, growth=g)
        self.token_buckets = buckets(ecfg.max_prefill_tokens, start=min(16, ecfg.max_prefill_tokens), growth=g)
        self.page_buckets = buckets(ecfg.max_pages_per_request, growth=g)
        self.slot_copy_buckets = buckets(max(ecfg.max_running, 8), growth=g)

    # --- steps -------------------------------------------------------------------------------
    def _meta(self, rows: list[Row], b: int, max_pages: int, lengths: list[int]) -> StepMeta:
        slots = np.full(b, self.scratch_slot, np.int32)
        table = np.zeros((b, max_pages), np.int32)
        ctx = np.zeros(b, np.int32)
        lens = np.zeros(b, np.int32)
        for i, r in enumerate(rows):
            slots[i], ctx[i], lens[i] = r.slot, r.context_len, lengths[i]
            table[i, : len(r.pages)] = r.pages
        return StepMeta(jnp.asarray(slots), jnp.asarray(table), jnp.asarray(ctx), jnp.asarray(lens))

    def prefill(self, rows: list[Row]) -> jax.Array:
        """Appends each row's tokens; returns float32 logits [B_bucket, V] at each row's last token."""
        b = fit(len(rows), self.row_buckets)
        t = fit(max(len(r.tokens) for r in rows), self.token_buckets)
        p = fit(max(len(r.pages) for r in rows), self.page_buckets)
        tokens = np.full((b, t), self.cfg.pad_token_id, np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r.tokens)] = r.tokens
        meta = self._meta(rows, b, p, [len(r.tokens) for r in rows])
        logits, self.state = k3jax.prefill(self.params, self.cfg, self.state, jnp.asarray(tokens), meta,
                                           backend_name=self.ecfg.backend)
        return logits

    def decode(self, rows: list[Row]) -> jax.Array:
        """One token per row (row.tokens == [token]); returns float32 logits [B_bucket, V]."""
        b = fit(len(rows), self.row_buckets)
        p = fit(max(len(r.pages) for r in rows), self.page_buckets)
        tokens = np.zeros(b, np.int32)
        tokens[: len(rows)] = [r.tokens[0] for r in rows]
        meta = self._meta(rows, b, p, [1] * len(rows))
        logits, self.state = k3jax.decode(self.params, self.cfg, self.state, jnp.asarray(tokens), meta,
                                          backend_name=self.ecfg.backend)
        return logits

    # --- state movement (checkpoints, host tier) -----------------------------------------------
    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """state[dst[i]] = state[src[i]] for KDA and conv rows (checkpoint take / restore)."""
        if not src:
            return
        n = fit(len(src), self.slot_copy_buckets)
        pad = [self.scratch_slot] * (n - len(src))
        self.state = _copy_slots(self.state, jnp.asarray(src + pad, jnp.int32), jnp.asarray(dst + pad, jnp.int32))

    def read_pages(self, pages: list[int]) -> np.ndarray:
        """Latents of the given pages, all MLA layers: [L_mla, n, page_size, C+R] on the host."""
        return np.asarray(self.state.kv_pages[:, np.asarray(pages, np.int32)])

    def write_pages(self, pages: list[int], latents: np.ndarray) -> None:
        self.state = _write_pages(self.state, jnp.asarray(pages, jnp.int32), jnp.asarray(latents))

    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.state.kda[:, slot]), np.asarray(self.state.conv[:, slot])

    def write_slot(self, slot: int, kda: np.ndarray, conv: np.ndarray) -> None:
        self.state = _write_slot(self.state, jnp.asarray(slot, jnp.int32), jnp.asarray(kda), jnp.asarray(conv))

    def warmup(self, prefill: bool = True) -> int:
        """Compiles every shape bucket that steady-state steps use; returns how many programs ran.

        Warm-up rows carry zero new tokens on the scratch slot, so the state is unchanged. Prefill has
        rows x tokens x pages buckets: on a large configuration prefer a coarser `bucket_growth`.
        """
        count = 0
        for b in self.row_buckets:
            for p in self.page_buckets:
                rows = [Row(self.scratch_slot, [0] * p, 0, []) for _ in range(b)]
                meta = self._meta(rows, b, p, [0] * b)
                _, self.state = k3jax.decode(self.params, self.cfg, self.state, jnp.zeros(b, jnp.int32), meta,
                                             backend_name=self.ecfg.backend)
                count += 1
                for t in self.token_buckets if prefill else ():
                    tokens = jnp.full((b, t), self.cfg.pad_token_id, jnp.int32)
                    _, self.state = k3jax.prefill(self.params, self.cfg, self.state, tokens, meta,
                                                  backend_name=self.ecfg.backend)
                    count += 1
        return count
