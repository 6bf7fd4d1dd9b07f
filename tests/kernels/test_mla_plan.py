"""The MLA split planner's knobs (pallas_kernels/mla_plan.py): every setting keeps the fixed-size metadata and
covers each request's KV blocks exactly once, on ragged histories including 1 and 0 tokens.

Run: python -m pytest -q tests/kernels/test_mla_plan.py

Pure integer arithmetic (numpy on the host, jnp in a jit), so the checks are exact.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla_plan

PARTS = (1, 5, 66, 132, 528)
OVERHEADS = (0, 1, 4, 16)
MIN_CHUNKS = (1, 3, 32)


def ragged_lens(seed: int) -> np.ndarray:
    """Log-uniform 4k..200k histories (the benchmark's mixed batches) next to 0, 1, 63 and 64-token ones."""
    rng = np.random.default_rng(seed)
    long = np.exp(rng.uniform(np.log(4096), np.log(200_000), 13)).astype(np.int64)
    return rng.permutation(np.concatenate([long, [0, 1, 63, 64, 65]]))


def check_plan(plan, lens, block_kv, num_parts, overhead, min_chunk):
    """Fixed-size metadata, exact once-only coverage of every request's blocks, and chunk sizes within
    [chunk // 2, chunk] for split requests (s = ceil(n / chunk) near-equal pieces of n > chunk blocks are each
    > n / (n / chunk + 1) > chunk / 2 blocks)."""
    batch = len(lens)
    blocks = -(-lens // block_kv)
    bound = mla_plan.max_work_items(batch, num_parts)
    assert all(np.asarray(a).shape == (bound,) for a in plan[:3])
    assert all(np.asarray(a).shape == (batch,) for a in plan[3:])
    request, start, end = (np.asarray(a) for a in plan[:3])
    first, count = np.asarray(plan.request_first_work), np.asarray(plan.request_num_work)
    assert (request >= 0).sum() == count.sum() <= bound
    assert (count >= 1).all()
    padding = request < 0
    assert (start[padding] == 0).all() and (end[padding] == 0).all()
    chunk = max(-(-(blocks.sum() + overhead * batch) // num_parts), min_chunk)
    for b in range(batch):
        items = np.arange(first[b], first[b] + count[b])
        assert (request[items] == b).all()
        hits = np.zeros(blocks[b], np.int64)  # how often each block of request b is read
        for w in items:
            assert 0 <= start[w] <= end[w] <= blocks[b]
            hits[start[w]: end[w]] += 1
        assert (hits == 1).all(), (b, hits)
        assert (np.diff(start[items]) >= 0).all()  # contiguous items in block order
        sizes = end[items] - start[items]
        assert sizes.max(initial=0) <= chunk
        if count[b] > 1:
            assert sizes.min() >= chunk // 2, (b, sizes, chunk)
        assert count[b] == max(1, -(-blocks[b] // chunk))


@pytest.mark.parametrize("block_kv", [64, 128])
def test_every_knob_setting_keeps_the_bound_and_covers_each_block_once(block_kv):
    lens = ragged_lens(block_kv)
    for num_parts, overhead, min_chunk in itertools.product(PARTS, OVERHEADS, MIN_CHUNKS):
        plan = mla_plan.plan_balanced(lens, block_kv=block_kv, num_parts=num_parts, overhead_blocks=overhead,
                                      min_chunk_blocks=min_chunk)
        check_plan(plan, lens, block_kv, num_parts, overhead, min_chunk)


def test_knobs_move_the_split_counts_the_documented_way():
    lens = ragged_lens(3)
    base = mla_plan.plan_balanced(lens, block_kv=64, num_parts=132)
    today = mla_plan.plan_balanced(lens, block_kv=64, num_parts=132, overhead_blocks=1, min_chunk_blocks=1)
    for a, b in zip(base, today):  # the defaults are today's behaviour
        np.testing.assert_array_equal(a, b)
    more_parts = mla_plan.plan_balanced(lens, block_kv=64, num_parts=528)
    heavy = mla_plan.plan_balanced(lens, block_kv=64, num_parts=132, overhead_blocks=64)
    floored = mla_plan.plan_balanced(lens, block_kv=64, num_parts=528, min_chunk_blocks=256)
    assert (more_parts.request_num_work >= base.request_num_work).all() and more_parts.request_num_work.sum() > 400
    assert (heavy.request_num_work <= base.request_num_work).all()
    assert heavy.request_num_work.sum() < base.request_num_work.sum()
    # a 256-block floor: 200k tokens = 3125 blocks -> at most 13 splits
    assert floored.request_num_work.max() <= 13 and floored.request_num_work.sum() < more_parts.request_num_work.sum()
    # a batch of empty histories: one empty item each, nothing read
    empty = mla_plan.plan_balanced(np.zeros(3, np.int64), block_kv=64, num_parts=4, overhead_blocks=0)
    assert list(empty.request_num_work) == [1, 1, 1] and (empty.work_block_end == 0).all()


def test_device_plan_equals_host_plan_for_every_knob():
    lens = ragged_lens(7)
    for num_parts, overhead, min_chunk in [(132, 1, 1), (66, 0, 3), (528, 16, 32), (5, 4, 1)]:
        kw = dict(block_kv=64, num_parts=num_parts, overhead_blocks=overhead, min_chunk_blocks=min_chunk)
        host = mla_plan.plan_balanced(lens, **kw)
        device = jax.jit(lambda x, kw=kw: mla_plan.plan_balanced(x, xp=jnp, **kw))(jnp.asarray(lens, jnp.int32))
        for h, d in zip(host, device):
            np.testing.assert_array_equal(h, np.asarray(d))


@pytest.mark.parametrize("num_parts,overhead", [(132, 1), (264, 64), (5, 0)])
def test_longest_first_reorders_the_same_items_by_decreasing_chunk(num_parts, overhead):
    """longest_first keeps every request's split count and chunks (the same items), lays requests out by decreasing
    chunk size (ties in batch order), so item sizes never grow by more than the one block a request's own chunks
    differ by; host and device agree."""
    lens = ragged_lens(11)
    kw = dict(block_kv=64, num_parts=num_parts, overhead_blocks=overhead)
    plain = mla_plan.plan_balanced(lens, **kw)
    ordered = mla_plan.plan_balanced(lens, longest_first=True, **kw)
    check_plan(ordered, lens, 64, num_parts, overhead, 1)
    np.testing.assert_array_equal(ordered.request_num_work, plain.request_num_work)

    def sizes(p):
        return {b: sorted((p.work_block_end - p.work_block_start)[p.work_request == b]) for b in range(len(lens))}

    assert sizes(ordered) == sizes(plain)
    live = ordered.work_request >= 0
    assert live[: live.sum()].all()  # padding only at the end
    grid_sizes = (ordered.work_block_end - ordered.work_block_start)[live]
    assert (np.diff(grid_sizes) <= 1).all()
    splits = np.asarray(plain.request_num_work)
    order = np.argsort(ordered.request_first_work)  # requests in layout order
    blocks = -(-lens // 64)
    per_item = blocks[order] / splits[order]
    assert (np.diff(per_item) <= 0).all()
    assert not np.array_equal(ordered.work_request, plain.work_request)  # the batch is not already in that order
    device = jax.jit(lambda x: mla_plan.plan_balanced(x, longest_first=True, xp=jnp, **kw))(
        jnp.asarray(lens, jnp.int32))
    for h, d in zip(ordered, device):
        np.testing.assert_array_equal(h, np.asarray(d))


def test_parts_for_programs_per_sm_and_bad_knobs():
    # 132 SMs: K3's 96 heads in 64-row blocks are 2 row blocks per item, k3-small's 16 heads 1
    assert mla_plan.parts_for_programs_per_sm(2, 132, 2) == 132
    assert mla_plan.parts_for_programs_per_sm(1, 132, 1) == 132
    assert mla_plan.parts_for_programs_per_sm(4, 132, 2) == 264
    assert mla_plan.parts_for_programs_per_sm(0.5, 132, 3) == 22
    assert mla_plan.parts_for_programs_per_sm(0.01, 132, 2) == 1
    with pytest.raises(ValueError, match="programs_per_sm"):
        mla_plan.parts_for_programs_per_sm(0, 132, 2)
    lens = np.array([5, 700])
    with pytest.raises(ValueError, match="overhead_blocks"):
        mla_plan.plan_balanced(lens, block_kv=64, num_parts=4, overhead_blocks=-1)
    with pytest.raises(ValueError, match="min_chunk_blocks"):
        mla_plan.plan_balanced(lens, block_kv=64, num_parts=4, min_chunk_blocks=0)


def test_default_plan_knobs():
    """Mosaic with one row block: a balanced plan's items (<= parts + batch) fit the 132 SMs in one wave, and one more
    part would not; with more row blocks 4 programs per SM and 64 blocks of overhead; Triton keeps 132 parts."""
    from pallas_kernels import mla_decode as md

    for batch in (64, 5, 3):
        parts, overhead = md.default_plan_knobs("mosaic", batch, 1)
        assert overhead == 1 and mla_plan.max_work_items(batch, parts) <= md.H200_SM_COUNT
        assert mla_plan.max_work_items(batch, parts + 1) > md.H200_SM_COUNT
    assert md.default_plan_knobs("mosaic", 200, 1) == (1, 1)  # more requests than SMs: one item each
    assert md.default_plan_knobs("mosaic", 32, 2) == (264, 64)
    assert md.default_plan_knobs("triton", 64, 2) == (md.TRITON_NUM_PARTS, 1) == (132, 1)
