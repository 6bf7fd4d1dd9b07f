"""Split planning for MLA decode: which KV range of which request each program of the kernel reads.

A decode step attends B requests whose histories can differ by 50x (4k next to 200k). One program per
request leaves most SMs idle behind the longest history; a fixed number of splits per request (the
"uniform" mode) over-splits short requests and under-splits long ones. The balanced plan follows the idea
of FlashMLA's and FlashInfer's schedulers: count the batch's KV blocks plus a fixed per-request overhead,
cut that total into `num_parts` equal payloads, and split every request whose history is longer than one
payload into near-equal chunks. Each chunk is one *work item*; the GPU runs one program per (row block,
work item) and merges a split request's partial results by log-sum-exp.

Fixed-size metadata so jit never recompiles: a balanced plan has at most num_parts + B work items
(sum_b ceil(blocks_b / chunk) <= sum_b blocks_b / chunk + B <= num_parts + B since chunk >= total /
num_parts >= sum_b blocks_b / num_parts for any overhead >= 0 and any chunk floor), a uniform one exactly
B * splits. Unused items are padding (request -1) and do nothing.

Latest (H200, 2026-12-05, the Mosaic kernel at 96 heads with the unrolled merge, docs/benchmarks.md): the model's
plan (264 parts, overhead 64, longest first) is 1.22x uniform splits with the same items and 1.10x the best uniform
count (16) on 12 mixed batches; 1.11x / 1.04x on their equal-length controls.
First measured (benchmarks/mla.py, H200, 2026-11-29): 12 batches of 32 histories log-uniform in 4k..200k, the
balanced plan (132 parts) is 1.19x faster in aggregate than uniform splits with the same number of work
items (5 per request) but 0.90x uniform 16 splits (512 items: more, smaller programs hide this kernel's
latency better); on equal-length controls 0.998x and 0.937x (2026-11-30, 1 stage: 1.12x / 0.93x, controls
1.00x / 0.94x).

Knobs (explicit parameters of plan_balanced; benchmarks/mla.py --plan-sweep times a grid of them):
  num_parts        payloads the batch is cut into. The kernel runs row_blocks programs per work item (a request's
                   query rows in row blocks), so parts are better counted in programs per SM:
                   parts_for_programs_per_sm(programs_per_sm, sm_count, row_blocks). mla_decode's defaults
                   (`default_plan_knobs`): the Triton kernel 132 parts (1 program per SM at 16 heads, 2 at K3's 96);
                   the Mosaic kernel one wave at one row block, else 4 programs per SM with overhead 64 (paired
                   2-CTA clusters included).
  overhead_blocks  FlashMLA's fixed per-request cost, in KV blocks, added to the total before it is cut (more
                   overhead -> larger chunks -> fewer splits of short requests). Today's: 1.
  min_chunk_blocks the smallest chunk a split produces (a floor on the payload): a split costs a partial write and
                   a merge, which a few-block chunk does not repay. Today's: 1 (no floor).
  longest_first    lay the items out by decreasing size: the GPU starts programs in grid order, so the chunks of
                   different requests (between chunk / 2 and chunk blocks) are list-scheduled longest first and the
                   last wave ends more evenly. mla_decode's on-device plan uses it (PLAN_LONGEST_FIRST): H200,
                   2026-12-05, 12 mixed batches at 96 heads, 0.6-3.1 % faster than batch order (5 comparisons, 3 calls).

The same arithmetic runs in numpy on the host (serving, benchmarks: `xp=np`) or in jnp inside a jitted
step (`xp=jnp`, from traced lengths; the model's registry op does that, a few hundred integer ops per step
that XLA shares across the 24 MLA layers).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

# FlashMLA charges each request a fixed cost in blocks (setup, q load, output write); ours is one block.
DEFAULT_OVERHEAD_BLOCKS = 1
# No floor on the chunk size: the payload alone sets it.
DEFAULT_MIN_CHUNK_BLOCKS = 1


class SplitPlan(NamedTuple):
    """Work items of a decode step (W = max work items, B = batch). All int32.

    work_request:       [W] request of item w; -1 for padding items (they read and write nothing)
    work_block_start:   [W] first KV block of the item (a block is `block_kv` tokens)
    work_block_end:     [W] one past its last KV block (== start for an empty history)
    request_first_work: [B] first item of request b (a request's items are contiguous)
    request_num_work:   [B] number of items of request b (>= 1); 1 means the kernel writes the final
                        output directly and the combine leaves the request alone
    """

    work_request: object
    work_block_start: object
    work_block_end: object
    request_first_work: object
    request_num_work: object


def max_work_items(batch: int, num_parts: int) -> int:
    """Static size W of a balanced plan's metadata."""
    return num_parts + batch


def _items_from_counts(xp, kv_blocks, num_splits, max_items: int, longest_first: bool = False) -> SplitPlan:
    """Expands per-request split counts into `max_items` work items, each request's blocks cut into
    num_splits near-equal contiguous chunks (chunk j: [j*n//s, (j+1)*n//s)).

    longest_first: requests laid out by decreasing chunk size (n / s; ties by request index) instead of in batch
    order. The GPU starts programs in grid order, so this is longest-processing-time-first list scheduling of the
    items onto the SMs (a request's chunks differ by at most one block, so ordering requests orders items)."""
    batch = kv_blocks.shape[0]
    if longest_first:
        # rank of b = #requests with a strictly larger chunk (n' / s' > n / s <=> n' s > n s') + earlier ties
        n, s = kv_blocks[:, None], num_splits[:, None]
        larger = n.T * s > n * s.T  # [B, B]: [b, b'] = request b' has larger chunks than b
        tie = (n.T * s == n * s.T) & (xp.arange(batch)[None, :] < xp.arange(batch)[:, None])
        rank = (larger | tie).sum(1)  # [B], a permutation of 0..B-1
        before = rank[None, :] < rank[:, None]  # [b, b'] = b' is laid out before b
        first = (before * num_splits[None, :]).sum(1)  # [B]
    else:
        first = xp.cumsum(num_splits) - num_splits
    items = xp.arange(max_items, dtype=xp.int32)
    # the request holding item w, as compare-and-count over [W, B] (jnp's searchsorted is a while loop, a few
    # small kernels per step on the GPU; W x B compares are cheap at decode batch sizes)
    holds = (first[None, :] <= items[:, None]) & (items[:, None] < (first + num_splits)[None, :])  # [W, B]
    valid = holds.any(1)
    req = (holds * xp.arange(batch, dtype=xp.int32)[None, :]).sum(1)  # 0 where no request holds w
    split = items - first[req]
    blocks, splits = kv_blocks[req], num_splits[req]
    start = xp.where(valid, split * blocks // splits, 0).astype(xp.int32)
    end = xp.where(valid, (split + 1) * blocks // splits, 0).astype(xp.int32)
    return SplitPlan(
        work_request=xp.where(valid, req, -1).astype(xp.int32),
        work_block_start=start,
        work_block_end=end,
        request_first_work=first.astype(xp.int32),
        request_num_work=num_splits.astype(xp.int32),
    )


def _check(kv_lens, block_kv: int):
    if kv_lens.ndim != 1:
        raise ValueError(f"kv_lens must be [B], got shape {kv_lens.shape}")
    if block_kv < 1:
        raise ValueError(f"block_kv must be >= 1, got {block_kv}")


def parts_for_programs_per_sm(programs_per_sm: float, sm_count: int, row_blocks: int) -> int:
    """num_parts whose work items fill `programs_per_sm` programs on each of `sm_count` SMs when each item runs
    `row_blocks` programs (one per row block of a request's query rows): round(programs_per_sm * sm_count /
    row_blocks), at least 1. E.g. 132 SMs, K3's 96 heads in 64-row blocks (2 row blocks), 2 programs per SM -> 132."""
    if programs_per_sm <= 0 or sm_count < 1 or row_blocks < 1:
        raise ValueError(f"programs_per_sm must be > 0 and sm_count, row_blocks >= 1, got {programs_per_sm}, "
                         f"{sm_count}, {row_blocks}")
    return max(1, int(math.floor(programs_per_sm * sm_count / row_blocks + 0.5)))


def plan_balanced(kv_lens, *, block_kv: int, num_parts: int, overhead_blocks: int = DEFAULT_OVERHEAD_BLOCKS,
                  min_chunk_blocks: int = DEFAULT_MIN_CHUNK_BLOCKS, longest_first: bool = False,
                  xp=np) -> SplitPlan:
    """Per-request split counts giving each of `num_parts` parts about the same number of KV blocks.

    kv_lens: [B] int, tokens each request attends to (history including this step's new tokens).
    The chunk limit is max(ceil((sum_b blocks_b + overhead_blocks * B) / num_parts), min_chunk_blocks) blocks;
    request b gets ceil(blocks_b / chunk) splits (>= 1). Returns a SplitPlan with max_work_items(B, num_parts)
    items whatever the knobs (the chunk is never below sum_b blocks_b / num_parts, see the module docstring).
    longest_first: lay the requests' items out by decreasing chunk size (see _items_from_counts).
    """
    _check(kv_lens, block_kv)
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if overhead_blocks < 0:
        raise ValueError(f"overhead_blocks must be >= 0, got {overhead_blocks}")
    if min_chunk_blocks < 1:
        raise ValueError(f"min_chunk_blocks must be >= 1, got {min_chunk_blocks}")
    kv_lens = xp.asarray(kv_lens).astype(xp.int32)
    kv_blocks = (kv_lens + block_kv - 1) // block_kv
    total = xp.sum(kv_blocks) + overhead_blocks * kv_lens.shape[0]
    chunk = xp.maximum((total + num_parts - 1) // num_parts, min_chunk_blocks)
    num_splits = xp.maximum((kv_blocks + chunk - 1) // chunk, 1).astype(xp.int32)
    return _items_from_counts(xp, kv_blocks, num_splits, max_work_items(kv_lens.shape[0], num_parts), longest_first)


def plan_uniform(kv_lens, *, block_kv: int, splits: int, xp=np) -> SplitPlan:
    """The comparison mode: every request cut into the same `splits` chunks of its own history (chunks of a
    short history may be empty). Returns a SplitPlan with B * splits items."""
    _check(kv_lens, block_kv)
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    kv_lens = xp.asarray(kv_lens).astype(xp.int32)
    kv_blocks = (kv_lens + block_kv - 1) // block_kv
    num_splits = xp.full(kv_lens.shape, splits, xp.int32)
    return _items_from_counts(xp, kv_blocks, num_splits, kv_lens.shape[0] * splits)


def plan_to_device(plan: SplitPlan) -> SplitPlan:
    """A host (numpy) plan as int32 device arrays."""
    return SplitPlan(*(jnp.asarray(np.asarray(a), jnp.int32) for a in plan))
