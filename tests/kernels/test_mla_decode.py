"""MLA decode kernel (Pallas interpret mode) and its split planner against the plain-jnp references.

Run: python -m pytest -q tests/kernels/test_mla_decode.py

Shapes: the point here is sequence length and paging, so heads and widths are small (H = 6 so the rows
(t, h) fill one padded row block at q_len 1 and two at q_len 4; C = 32, R = 16, the smallest widths the
Triton tiling takes) and histories are the issue's ragged set 1, 63, 513, 4097 over shuffled 16-token pages.

Tolerance: the reference is fp32 (HIGHEST precision) on the same bf16 queries and the same cache values
(fp8 pages dequantised exactly as the kernel does: fp8 -> bf16 is exact, the scale multiply is fp32). The
kernel's only extra rounding is the bf16 cast of the probabilities before the P @ C product (the
normaliser l stays fp32): relative <= 2^-9 per probability, so <= 2 * 2^-9 ~ 4e-3 for a request whose
softmax is dominated by a few keys, and far less when it averages over many (measured 3e-4 over the
batch, 2.4e-3 worst single request). Asserted per request < 5e-3. A wrong mask, page, split boundary or
merge weight moves the result by O(1e-1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.testing import eager_ops_on_argument, shuffled_page_tables
from pallas_kernels import mla_decode as md
from pallas_kernels import mla_plan

HEADS, C, R, PAGE = 6, 32, 16, 16
HISTORIES = np.array([1, 63, 513, 4097])  # tokens cached before this step's q_len new ones
SCALE = (C + R) ** -0.5
TOL = 5e-3


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_case(seed: int, q_len: int, kv_dtype):
    """Random queries, a shuffled page pool holding each request's history + q_len draft tokens, and the
    draft's positions (row t of request b sits at history_b + t: the causal mask inside the draft)."""
    rng = np.random.default_rng(seed)
    b = len(HISTORIES)
    lens = HISTORIES + q_len
    max_pages = -(-lens.max() // PAGE) + 1  # one spare page column: never read
    num_pages = b * max_pages + 5
    table = shuffled_page_tables(rng, b, max_pages, num_pages)
    latents = rng.standard_normal((num_pages, PAGE, C + R)).astype(np.float32)
    latents[..., C:] *= 3.0  # k_pe is not normalised: a different range than c
    if kv_dtype == jnp.float8_e4m3fn:
        kv, scales = md.quantize_latents_fp8(jnp.asarray(latents))
    else:
        kv, scales = jnp.asarray(latents, kv_dtype), None
    q_latent = jnp.asarray(rng.standard_normal((b, q_len, HEADS, C)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((b, q_len, HEADS, R)), jnp.bfloat16)
    positions = jnp.asarray(HISTORIES[:, None] + np.arange(q_len)[None], jnp.int32)
    return q_latent, q_pe, kv, scales, jnp.asarray(table), positions


def kv_lens(positions, table):
    return np.asarray(md.attended_lengths(positions, table.shape[1] * PAGE))


# ---------------------------------------------------------------------------------------------- planner
def covered_blocks(plan, kv_blocks):
    """Asserts every request's blocks are covered exactly once, in order, by its contiguous items."""
    for b, n_blocks in enumerate(kv_blocks):
        first, count = plan.request_first_work[b], plan.request_num_work[b]
        assert count >= 1
        items = np.arange(first, first + count)
        assert (plan.work_request[items] == b).all()
        assert plan.work_block_start[items[0]] == 0 and plan.work_block_end[items[-1]] == n_blocks
        assert (plan.work_block_start[items[1:]] == plan.work_block_end[items[:-1]]).all()
    assert (plan.work_request >= 0).sum() == plan.request_num_work.sum()


@pytest.mark.parametrize("num_parts", [1, 7, 132])
def test_balanced_plan_covers_and_balances(num_parts):
    rng = np.random.default_rng(num_parts)
    lens = np.concatenate([rng.integers(4096, 200_000, 11), [0, 1, 63]])
    plan = mla_plan.plan_balanced(lens, block_kv=64, num_parts=num_parts)
    blocks = -(-lens // 64)
    assert plan.work_request.shape == (mla_plan.max_work_items(len(lens), num_parts),)
    covered_blocks(plan, blocks)
    sizes = (plan.work_block_end - plan.work_block_start)[plan.work_request >= 0]
    chunk = -(-(blocks.sum() + len(lens) * mla_plan.DEFAULT_OVERHEAD_BLOCKS) // num_parts)
    assert sizes.max() <= chunk  # no item is longer than one part's payload
    # longer histories never get fewer splits
    order = np.argsort(lens)
    assert (np.diff(plan.request_num_work[order]) >= 0).all()


def test_plan_on_device_equals_host_and_uniform_plan():
    lens = np.array([1, 63, 513, 4097, 200_000, 0], np.int32)
    host = mla_plan.plan_balanced(lens, block_kv=64, num_parts=9)
    device = jax.jit(lambda x: mla_plan.plan_balanced(x, block_kv=64, num_parts=9, xp=jnp))(jnp.asarray(lens))
    for h, d in zip(host, device):
        np.testing.assert_array_equal(h, np.asarray(d))
    uniform = mla_plan.plan_uniform(lens, block_kv=64, splits=3)
    assert (uniform.request_num_work == 3).all() and uniform.work_request.shape == (18,)
    covered_blocks(uniform, -(-lens // 64))
    with pytest.raises(ValueError, match="num_parts"):
        mla_plan.plan_balanced(lens, block_kv=64, num_parts=0)
    with pytest.raises(ValueError, match="kv_lens"):
        mla_plan.plan_uniform(lens[None], block_kv=64, splits=2)


# ----------------------------------------------------------------------------------------------- kernel
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_matches_reference_one_and_many_splits(q_len, kv_dtype):
    q_latent, q_pe, kv, scales, table, positions = make_case(10 * q_len, q_len, kv_dtype)
    want = md.mla_decode_reference(q_latent, q_pe, kv, table, positions, kv_lora_rank=C, scale=SCALE, kv_scales=scales)
    lens = kv_lens(positions, table)
    plans = {
        "one split each": mla_plan.plan_uniform(lens, block_kv=64, splits=1),
        "balanced": mla_plan.plan_balanced(lens, block_kv=64, num_parts=10),
    }
    assert plans["balanced"].request_num_work[-1] > 4  # the 4097-token request is split many ways
    assert plans["balanced"].request_num_work[0] == 1  # the 1-token one is written directly
    for name, plan in plans.items():
        # the balanced plan runs with the output columns split over two programs (value_groups: each
        # recomputes the scores and owns C/2 columns of the output and of the partials)
        groups = 2 if name == "balanced" else 1
        got = md.mla_decode(q_latent, q_pe, kv, table, positions, mla_plan.plan_to_device(plan), kv_lora_rank=C,
                            scale=SCALE, kv_scales=scales, block_rows=16, value_groups=groups, interpret=True)
        assert got.shape == (len(HISTORIES), q_len, HEADS, C) and got.dtype == jnp.float32
        for b in range(len(HISTORIES)):  # per request: a short history must not hide in a long one's norm
            assert rel(got[b], want[b]) < TOL, (name, b)


def test_decode_uniform_splits_and_device_plan_without_recompiling():
    """Uniform mode with more splits than a short history has blocks (empty items), then the device-side
    plan over a stacked pool: new lengths with the same batch reuse the compiled kernel (fixed-size metadata)."""
    q_len = 4
    q_latent, q_pe, kv, scales, table, positions = make_case(3, q_len, jnp.bfloat16)
    want = md.mla_decode_reference(q_latent, q_pe, kv, table, positions, kv_lora_rank=C, scale=SCALE)
    plan = mla_plan.plan_uniform(kv_lens(positions, table), block_kv=64, splits=4)
    got = md.mla_decode(q_latent, q_pe, kv, table, positions, plan, kv_lora_rank=C, scale=SCALE, block_rows=16,
                        interpret=True)
    assert rel(got, want) < TOL

    # the model's stacked pool [L, P, page_size, C+R] read at a layer index (here layer 1 of 2)
    stacked = jnp.stack([kv[::-1], kv])
    run = lambda pos: md.mla_decode(q_latent, q_pe, stacked, table, pos, layer=1, kv_lora_rank=C, scale=SCALE,
                                    num_parts=6, block_rows=16, interpret=True)
    assert rel(run(positions), want) < TOL
    compiled = md._mla_decode._cache_size()
    shorter = positions - jnp.asarray([[0], [40], [500], [3000]], jnp.int32)  # other lengths, other splits
    want_shorter = md.mla_decode_reference(q_latent, q_pe, kv, table, shorter, kv_lora_rank=C, scale=SCALE)
    assert rel(run(shorter), want_shorter) < TOL
    assert md._mla_decode._cache_size() == compiled


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("stacked", [False, True], ids=["one_layer", "stacked"])
def test_eager_call_hands_the_pool_to_jit_untouched(backend, stacked):
    """An eager call (as benchmarks/mla.py makes) must not reshape or cast the pool outside jit: that copies
    the whole pool per call, and at the benchmark's 5M-token pool it cost ~2.7 ms on every timed call."""
    q_latent, q_pe, kv, _, table, positions = make_case(4, 1, jnp.bfloat16)
    if backend == "mosaic":  # the Mosaic kernel's sizes (C = 512, R = 64); nothing runs here, only traces
        q_latent = jnp.zeros(q_latent.shape[:-1] + (512,), jnp.bfloat16)
        q_pe = jnp.zeros(q_pe.shape[:-1] + (64,), jnp.bfloat16)
        kv = jnp.zeros(kv.shape[:-1] + (576,), jnp.bfloat16)
    layer = None
    if stacked:
        kv, layer = jnp.stack([kv, kv]), 1
    call = lambda pool: md.mla_decode(q_latent, q_pe, pool, table, positions, kv_lora_rank=q_latent.shape[-1],
                                      scale=SCALE, layer=layer, backend=backend, block_kv=64, interpret=True)
    assert eager_ops_on_argument(call, (kv,), 0) == []


def test_fp8_quantisation_error_is_bounded():
    """The fp8 cache itself (not the kernel): per-token e4m3 keeps ~2^-4 relative error per value."""
    x = jax.random.normal(jax.random.key(0), (64, C + R)) * jnp.exp(jax.random.normal(jax.random.key(1), (64, 1)))
    q, s = md.quantize_latents_fp8(x)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (64,)
    assert rel(q.astype(jnp.float32) * s[:, None], x) < 0.04


def test_decode_rejects_bad_inputs():
    q_latent, q_pe, kv, _, table, positions = make_case(0, 1, jnp.bfloat16)
    call = lambda **kw: md.mla_decode(**{**dict(q_latent=q_latent, q_pe=q_pe, kv_pages=kv, page_table=table,
                                                query_positions=positions, kv_lora_rank=C, scale=SCALE,
                                                interpret=True), **kw})
    with pytest.raises(ValueError, match="kv_lora_rank"):
        call(kv_lora_rank=C + 1)
    with pytest.raises(ValueError, match="kv_pages"):
        call(kv_pages=kv[..., :-1])
    with pytest.raises(ValueError, match="query_positions"):
        call(query_positions=positions[:, :0])
    with pytest.raises(ValueError, match="block_rows"):
        call(block_rows=24)
    with pytest.raises(ValueError, match="value_groups"):
        call(value_groups=3)
    with pytest.raises(ValueError, match="backend"):
        call(backend="cuda")
    with pytest.raises(ValueError, match="Mosaic"):
        call(backend="mosaic")  # C = 32 here: the Mosaic kernel takes C = 512 only
    with pytest.raises(ValueError, match="kv_scales"):
        call(kv_scales=jnp.ones((3,)))
    with pytest.raises(ValueError, match="q_len"):
        call(q_latent=jnp.tile(q_latent, (1, 9, 1, 1)), q_pe=jnp.tile(q_pe, (1, 9, 1, 1)),
             query_positions=jnp.tile(positions, (1, 9)))
    with pytest.raises(ValueError, match="layer"):
        call(kv_pages=kv[None])
    with pytest.raises(ValueError, match="power of two"):
        call(q_latent=q_latent[..., :24], kv_pages=kv[..., 8:], kv_lora_rank=24)


def _mosaic_case(seed: int, heads: int, q_len: int):
    """The Mosaic kernel's interpreter cases (its only sizes are K3's: C = 512, R = 64, 64-key blocks): histories
    1 / 63 / 300 (+ a q_len-token draft) over shuffled 16-token pages, bf16, with a balanced plan of 3 parts:
    (q_latent, q_pe, kv pages, page table, positions, plan)."""
    c_dim, r_dim = 512, 64
    rng = np.random.default_rng(seed)
    hist = np.array([1, 63, 300])
    lens = hist + q_len
    b = len(hist)
    max_pages = -(-lens.max() // PAGE) + 1
    num_pages = b * max_pages + 3
    table = jnp.asarray(shuffled_page_tables(rng, b, max_pages, num_pages))
    kv = jnp.asarray(rng.standard_normal((num_pages, PAGE, c_dim + r_dim)), jnp.bfloat16)
    q_latent = jnp.asarray(rng.standard_normal((b, q_len, heads, c_dim)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((b, q_len, heads, r_dim)), jnp.bfloat16)
    positions = jnp.asarray(hist[:, None] + np.arange(q_len)[None], jnp.int32)
    plan = mla_plan.plan_balanced(kv_lens(positions, table), block_kv=64, num_parts=3)
    return q_latent, q_pe, kv, table, positions, plan


@pytest.mark.parametrize("schedule", md.MGPU_SCHEDULES)
def test_mosaic_decode_matches_reference_in_interpret_mode(schedule):
    """The experimental Mosaic GPU kernel (backend="mosaic") under the Mosaic GPU interpreter: its only sizes
    are K3's (C = 512 in two 256-column halves, R = 64, 64-key blocks), so heads stay few (8: one 64-row block
    at q_len 4) and histories short. Histories 1 / 63 / 300 (+ a 4-token draft, causal inside it) with a
    balanced plan of 3 parts: the 305-token request is split into 2 and 3 KV blocks, the 3-block item
    wraps the 2-slot TMA ring, and padding items write nothing. Tolerance as the Triton kernel's (bf16
    probabilities before P @ C). Both schedules: "duplicate" (each compute warpgroup scores every key) and "split"
    (each scores half the keys; maxima and probabilities exchanged through shared memory)."""
    heads, c_dim, q_len = 8, 512, 4
    q_latent, q_pe, kv, table, positions, plan = _mosaic_case(11, heads, q_len)
    b, scale = len(table), 192**-0.5
    assert list(plan.request_num_work) == [1, 1, 2] and (plan.work_request < 0).any()
    assert (plan.work_block_end - plan.work_block_start).max() == 3
    got = md.mla_decode(q_latent, q_pe, kv, table, positions, plan, kv_lora_rank=c_dim, scale=scale, block_kv=64,
                        num_stages=2, backend="mosaic", mosaic_schedule=schedule, interpret=True)
    want = md.mla_decode_reference(q_latent, q_pe, kv, table, positions, kv_lora_rank=c_dim, scale=scale)
    assert got.shape == (b, q_len, heads, c_dim)
    for r in range(b):
        assert rel(got[r], want[r]) < TOL, r


@pytest.mark.parametrize("schedule", md.MGPU_SCHEDULES)
def test_mosaic_paired_decode_matches_reference_in_interpret_mode(schedule):
    """mosaic_paired: a work item's two 64-row blocks run as one 2-CTA cluster, each CTA issuing half of every KV
    tile by multicast TMA into both rings, a slot refilled only after both CTAs' compute warpgroups released it
    (cluster barriers). 48 heads x q_len 2 = 96 query rows: the second block is half padding and holds the draft's
    second position (causal inside the draft across the pair). Histories 1 / 63 / 300 with a balanced plan of 3
    parts (items of 1-3 KV blocks, one wrapping the 2-slot ring, padding items). Tolerance as above. An odd number
    of row blocks (16 heads x q_len 2) is refused."""
    heads, c_dim, q_len = 48, 512, 2
    q_latent, q_pe, kv, table, positions, plan = _mosaic_case(23, heads, q_len)
    b, scale = len(table), 192**-0.5
    assert (plan.work_request < 0).any() and (plan.work_block_end - plan.work_block_start).max() == 3
    call = lambda q_l, q_r: md.mla_decode(q_l, q_r, kv, table, positions, plan, kv_lora_rank=c_dim, scale=scale,
                                          block_kv=64, num_stages=2, backend="mosaic", mosaic_schedule=schedule,
                                          mosaic_paired=True, interpret=True)
    got = call(q_latent, q_pe)
    want = md.mla_decode_reference(q_latent, q_pe, kv, table, positions, kv_lora_rank=c_dim, scale=scale)
    assert got.shape == (b, q_len, heads, c_dim)
    for r in range(b):
        assert rel(got[r], want[r]) < TOL, r
    with pytest.raises(ValueError, match="odd number"):
        call(q_latent[:, :, :16], q_pe[:, :, :16])


@pytest.mark.parametrize("heads,q_len,want", [(96, 1, True), (96, 4, True), (48, 2, True), (16, 4, False),
                                               (16, 1, False)])
def test_mosaic_paired_default_follows_the_row_blocks(heads, q_len, want, monkeypatch):
    """Without mosaic_paired the GPU kernel pairs row blocks wherever their number is even (K3's 96 heads: 2 at
    q_len 1, 6 at 4) and then prefetches 4 blocks into L2, with the plan it would use unpaired; k3-small's single
    row block (16 heads x q_len 1) and odd counts run one CTA per row block with no prefetch. The interpreter never
    pairs. The launch is recorded (no GPU here); out-of-range prefetch distances are refused."""
    seen = {}
    monkeypatch.setattr(md, "_mla_decode_mgpu", lambda *a, **kw: seen.update(kw, plan=a[5]) or "launched")
    b, page = 2, 64
    table = jnp.asarray(np.arange(2 * 8, dtype=np.int32).reshape(b, 8))
    positions = jnp.asarray(np.array([[300], [40]]) + np.arange(q_len)[None], jnp.int32)
    call = lambda interpret, **kw: md.mla_decode(
        jnp.ones((b, q_len, heads, 512), jnp.bfloat16), jnp.ones((b, q_len, heads, 64), jnp.bfloat16),
        jnp.ones((2 * 8, page, 576), jnp.bfloat16), table, positions, kv_lora_rank=512, scale=0.1, backend="mosaic",
        interpret=interpret, **kw)
    assert call(False) == "launched"
    assert seen["paired"] is want and seen["l2_prefetch"] == (4 if want else 0)
    row_blocks = -(-heads * q_len // 64)
    assert len(seen["plan"][0]) == mla_plan.max_work_items(
        b, md.default_plan_knobs("mosaic", b, row_blocks)[0])
    call(True)
    assert seen["paired"] is False and seen["l2_prefetch"] == 0
    with pytest.raises(ValueError, match="mosaic_l2_prefetch"):
        call(False, mosaic_l2_prefetch=md.MGPU_MAX_L2_PREFETCH + 1)


def test_mosaic_decode_at_16_heads_and_64_token_pages():
    """k3-small's decode shape under the Mosaic GPU interpreter: 16 heads x q_len 1 = 16 query rows, padded to the
    kernel's 64-row wgmma tile (the padding rows see no key and are dropped before the merge), 64-token pages, the
    kernel's defaults (64-key blocks = one page each, a 2-slot TMA ring). Histories 0 / 62 / 300 / 700 (+ the new
    token): a 1-token history, one a token short of a page, and a 701-token one the 4-part plan splits into items
    of 5 and 6 blocks (both wrap the ring). Tolerance as above."""
    heads, c_dim, r_dim, page = 16, 512, 64, 64
    rng = np.random.default_rng(16)
    hist = np.array([0, 62, 300, 700])
    b = len(hist)
    max_pages = -(-(hist.max() + 1) // page) + 1
    num_pages = b * max_pages + 3
    table = jnp.asarray(shuffled_page_tables(rng, b, max_pages, num_pages))
    kv = jnp.asarray(rng.standard_normal((num_pages, page, c_dim + r_dim)), jnp.bfloat16)
    q_latent = jnp.asarray(rng.standard_normal((b, 1, heads, c_dim)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((b, 1, heads, r_dim)), jnp.bfloat16)
    positions = jnp.asarray(hist[:, None], jnp.int32)
    scale = 192**-0.5
    lens = np.asarray(md.attended_lengths(positions, max_pages * page))
    plan = mla_plan.plan_balanced(lens, block_kv=md.MGPU_DEFAULT_BLOCK_KV, num_parts=4)
    assert list(plan.request_num_work) == [1, 1, 1, 2]
    assert list((plan.work_block_end - plan.work_block_start)[3:5]) == [5, 6]
    got = md.mla_decode(q_latent, q_pe, kv, table, positions, plan, kv_lora_rank=c_dim, scale=scale,
                        backend="mosaic", interpret=True)
    want = md.mla_decode_reference(q_latent, q_pe, kv, table, positions, kv_lora_rank=c_dim, scale=scale)
    assert got.shape == (b, 1, heads, c_dim)
    for r in range(b):
        assert rel(got[r], want[r]) < TOL, r
    call = lambda **kw: md.mla_decode(q_latent, q_pe, kv, table, positions, plan, kv_lora_rank=c_dim, scale=scale,
                                      backend="mosaic", interpret=True, **kw)
    with pytest.raises(ValueError, match="shared memory"):  # 2 slots of 128 keys: 288 KiB with the queries
        call(block_kv=128, num_stages=2)
    with pytest.raises(ValueError, match="num_stages >= 2"):
        call(num_stages=1)
    assert md.mgpu_smem_bytes(64, 2, r_dim) == 221440  # ~216 KiB: 72 KiB of queries + two 72 KiB slots


@pytest.mark.parametrize("skip_masks", [True, False], ids=["skip_masks", "every_block_masked"])
@pytest.mark.parametrize("schedule", md.MGPU_SCHEDULES)
def test_mosaic_mask_skipped_only_where_every_row_sees_the_whole_block(schedule, skip_masks):
    """mosaic_skip_masks: the Mosaic kernel masks only the KV blocks at or after a request's earliest query position
    (the loop's unmasked part ends at (min position + 1) // 64, counted from each work item's first block); without
    it every block is masked (the same results, the baseline here). Each request has a row that must not see the
    last keys of a block another row sees whole: a draft out of order (positions 63, 61, 64, 62: the earliest row
    is not t = 0, the first row completes block 0), one across a block edge (125-128), a 604-token one the plan
    splits so that its crossing block lies inside a later item, and a draft padded with position -1 (a padding
    row: every block masked for that request). Rows of real positions match the reference to the tolerance above;
    a block left unmasked for a row that must not see all of it moves that row by O(1e-1). (The bound taken from
    the last or the first row, or not offset by the item's first block, fails here.)"""
    heads, c_dim, r_dim, q_len, page = 8, 512, 64, 4, 16
    rng = np.random.default_rng(23)
    hist = np.array([61, 125, 600, 300])
    positions = hist[:, None] + np.array([[2, 0, 3, 1], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]])
    positions[3, 2:] = -1
    b = len(hist)
    max_pages = -(-(positions.max() + 1) // page) + 1
    num_pages = b * max_pages + 3
    table = jnp.asarray(shuffled_page_tables(rng, b, max_pages, num_pages))
    kv = jnp.asarray(rng.standard_normal((num_pages, page, c_dim + r_dim)), jnp.bfloat16)
    q_latent = jnp.asarray(rng.standard_normal((b, q_len, heads, c_dim)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((b, q_len, heads, r_dim)), jnp.bfloat16)
    positions = jnp.asarray(positions, jnp.int32)
    scale = 192**-0.5
    plan = mla_plan.plan_balanced(kv_lens(positions, table), block_kv=64, num_parts=6)
    assert (plan.request_num_work > 1).sum() >= 2, plan.request_num_work
    got = md.mla_decode(q_latent, q_pe, kv, table, positions, plan, kv_lora_rank=c_dim, scale=scale, block_kv=64,
                        num_stages=2, backend="mosaic", mosaic_schedule=schedule, mosaic_skip_masks=skip_masks,
                        interpret=True)
    want = md.mla_decode_reference(q_latent, q_pe, kv, table, positions, kv_lora_rank=c_dim, scale=scale)
    for r in range(b):
        real = np.asarray(positions[r]) >= 0
        assert rel(np.asarray(got[r])[real], np.asarray(want[r])[real]) < TOL, r


@pytest.mark.parametrize("block_rows,block_cols,unroll", [(None, None, md.COMBINE_UNROLL), (2, 16, 1), (3, 32, 2),
                                                          (6, 16, 5)])
def test_combine_partials_equals_the_xla_merge(block_rows, block_cols, unroll):
    """The Mosaic path's one-launch merge (`combine_partials`, interpret mode) equals `merge_partials` (plain XLA):
    requests of 3, 1, 0 (zeros) and 7 items, a partial with lse -inf (weight 0), rows past `rows` ignored, and the
    padding item at the end (request -1) never read, at the default blocks and at row / column blocks and unroll
    factors that leave a partly filled last step (3 and 7 items by 2 and 5)."""
    rng = np.random.default_rng(5)
    work_request = jnp.asarray([0, 0, 0, 1, 3, 3, 3, 3, 3, 3, 3, -1], jnp.int32)
    first, num = jnp.asarray([0, 3, 4, 4], jnp.int32), jnp.asarray([3, 1, 0, 7], jnp.int32)
    part_o = jnp.asarray(rng.standard_normal((12, 8, 32)).astype(np.float32))
    part_lse = jnp.asarray(rng.standard_normal((12, 8)).astype(np.float32) * 4)
    part_lse = part_lse.at[1, 2].set(-jnp.inf).at[11].set(jnp.nan)
    part_o = part_o.at[11].set(jnp.nan)
    got = md.combine_partials(part_o, part_lse, first, num, 6, block_rows=block_rows, block_cols=block_cols,
                              unroll=unroll, interpret=True)
    want = md.merge_partials(part_o[:, :6], part_lse[:, :6], work_request, 4)
    assert got.shape == (4, 6, 32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[2]), 0.0)
    with pytest.raises(ValueError, match="block_cols"):
        md.combine_partials(part_o, part_lse, first, num, 6, block_cols=12, interpret=True)


@pytest.mark.parametrize("heads,q_len,want", [(96, 1, "split"), (96, 4, "split"), (16, 4, "split"),
                                               (16, 2, "duplicate"), (16, 1, "duplicate")])
def test_mosaic_schedule_default_follows_the_rows(heads, q_len, want, monkeypatch):
    """Without mosaic_schedule the kernel takes "split" from one full 64-row block of query rows (where it measured
    1.02-1.14x faster on the H200) and "duplicate" below (16 heads x q_len 1: split 1.04x slower)."""
    monkeypatch.setattr(md, "_mla_decode_mgpu", lambda *a, schedule, **kw: schedule)
    b, hist, page = 2, 100, 16
    table = jnp.asarray(np.arange(2 * 8, dtype=np.int32).reshape(b, 8))
    positions = jnp.asarray(hist + np.arange(q_len)[None].repeat(b, 0), jnp.int32)
    call = lambda interpret: md.mla_decode(
        jnp.ones((b, q_len, heads, 512), jnp.bfloat16), jnp.ones((b, q_len, heads, 64), jnp.bfloat16),
        jnp.ones((2 * 8, page, 576), jnp.bfloat16), table, positions, kv_lora_rank=512, scale=0.1, backend="mosaic",
        interpret=interpret)
    assert call(False) == want
    assert call(True) == "duplicate"  # the interpreter keeps "duplicate" (split needs >= 3 host devices there)


@pytest.mark.parametrize("skip_masks", [False, True], ids=["masked", "skip_masks"])
@pytest.mark.parametrize("schedule,page,paired", [("duplicate", 64, False), ("split", 16, False), ("split", 64, True),
                                                   ("duplicate", 16, True)])
def test_mosaic_kernel_lowers_for_the_h200_offline(schedule, page, paired, skip_masks, monkeypatch):
    """The Mosaic kernel lowers for sm_90 at K3's decode shape (96 heads: two 64-row blocks, 64-key blocks, a 2-slot
    ring) on a machine without a GPU: Mosaic's layout inference and the shared-memory limit are checked at lowering,
    and the interpreter checks neither. The split schedule fits only with q_pe as a register operand (with a
    shared-memory buffer for it, it was 1,088 B over the H200's 227 KiB). `_infer_arch` asks the local GPU (none
    here); the Triton combine after the kernel needs a GPU to lower, so a stand-in replaces it. `paired`: the 2-CTA
    cluster form, whose multicast copies (each CTA half of a tile: the tiled, swizzled page must split on a leading
    dimension) the interpreter does not model -- it copies whole tiles -- so only lowering checks them here. Both
    loop forms: every block masked, and mosaic_skip_masks (an unmasked loop, then a masked one)."""
    import jax
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    monkeypatch.setattr(mgpu_utils, "_infer_arch", lambda: (9, 0))
    monkeypatch.setattr(md, "combine_partials", lambda part_o, part_lse, first, num, rows, **_: (  # uses both
        part_o[: first.shape[0], :rows] + part_lse[: first.shape[0], :rows, None]))
    b, heads, hist = 4, 96, 4096
    plan = mla_plan.plan_to_device(mla_plan.plan_balanced(np.full(b, hist + 1), block_kv=64, num_parts=8))
    s = jax.ShapeDtypeStruct
    args = (s((b, 1, heads, 512), jnp.bfloat16), s((b, 1, heads, 64), jnp.bfloat16),
            s((1, b * hist // page + b, page, 576), jnp.bfloat16), s((b, hist // page + 1), jnp.int32),
            s((b, 1), jnp.int32))
    fn = lambda *a: md.mla_decode(*a, plan, kv_lora_rank=512, scale=192**-0.5, layer=0, block_kv=64, num_stages=2,
                                  backend="mosaic", mosaic_schedule=schedule, mosaic_paired=paired,
                                  mosaic_l2_prefetch=4 if schedule == "split" else 0, mosaic_skip_masks=skip_masks)
    assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("schedule", md.MGPU_SCHEDULES)
def test_mosaic_register_caps_fit_the_launch(schedule):
    """setmaxnreg moves registers between the warpgroups of a CTA launched at 168 a thread (384 threads): the two
    compute warpgroups' raised caps and the memory warpgroup's lowered one must fit in those 504 per lane, or the
    raise waits forever; caps are multiples of 8 in 24..256 (PTX setmaxnreg)."""
    compute, memory = md.MGPU_REGISTERS[schedule]
    assert 2 * compute + memory <= 3 * 168
    assert all(24 <= r <= 256 and r % 8 == 0 for r in (compute, memory))
    assert compute >= 232 and memory < 168  # the accumulator (128 a thread) and the scores need the raise
