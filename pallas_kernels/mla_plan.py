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

Measured (benchmarks/mla.py, H200, 2026-11-29): 12 batches of 32 histories log-uniform in 4k..200k, the
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


def _items_from_counts(xp, kv_blocks, num_splits, max_items: int) -> SplitPlan:
    """Expands per-request split counts into `max_items` work items, each request's blocks cut into
    num_splits near-equal contiguous chunks (chunk j: [j*n//s, (j+1)*n//s))."""
    batch = kv_blocks.shape[0]
    ends = xp.cumsum(num_splits)  # [B]
    first = ends - num_splits
    items = xp.arange(max_items, dtype=xp.int32)
    # searchsorted(ends, items, side="right") as compare-and-count (== B past the last item): jnp's searchsorted is
    # a while loop, a few small kernels per step on the GPU; B x W compares are cheap at decode batch sizes
    request = (ends[None, :] <= items[:, None]).sum(1).astype(xp.int32)  # [W]
    valid = request < batch
    req = xp.minimum(request, batch - 1)
    split = items - first[req]
    blocks, splits = kv_blocks[req], num_splits[req]
    start = xp.where(valid, split * blocks // splits, 0).astype(xp.int32)
    end = xp.where(valid, (split + 1) * blocks // splits, 0).astype(xp.int32)
    return SplitPlan(
        work_request=xp.where(valid, request, -1).astype(xp.int32),
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
                  min_chunk_blocks: int = DEFAULT_MIN_CHUNK_BLOCKS, xp=np) -> SplitPlan:
    """Per-request split counts giving each of `num_parts` parts about the same number of KV blocks.

    kv_lens: [B] int, tokens each request attends to (history including this step's new tokens).
    The chunk limit is max(ceil((sum_b blocks_b + overhead_blocks * B) / num_parts), min_chunk_blocks) blocks;
    request b gets ceil(blocks_b / chunk) splits (>= 1). Returns a SplitPlan with max_work_items(B, num_parts)
    items whatever the knobs (the chunk is never below sum_b blocks_b / num_parts, see the module docstring).
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
    return _items_from_counts(xp, kv_blocks, num_splits, max_work_items(kv_lens.shape[0], num_parts))


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
