"""Pallas MLA decode: absorbed attention of 1..8 new tokens per request over the paged latent cache.

Math (k3-model.md §4, absorbed form): every cached token is one latent [c (C) | k_pe (R)] shared by all
heads, so MLA decode is MQA with a (C+R)-wide key and a C-wide value (the key's first C channels). Query
row (t, h) of request b holds [q_latent | q_pe] (W_UK already folded into q_latent) and position
pos[b, t]; it sees the keys at positions <= pos (the causal mask inside a speculative draft), and
    o[b, t, h] = sum_s softmax_s(scale * q . kv_s) c_s       (fp32, before W_UV).

Kernel: rows are (t, h) flattened t-major, so every program works on a block of `block_rows` query rows
of ONE request against a range of its KV: all heads (and all draft tokens) of a request share each KV
load. The grid is (row block, work item) with the row block fastest, so the row blocks of a work item
run side by side and its KV comes from HBM once (then L2). A work item is a (request, KV block range)
from a split plan (pallas_kernels/mla_plan.py: balanced per-request split counts, or uniform). Pages are
gathered `block_kv // page_size` at a time through the page table, so page tables need not be ordered.
A request with one work item gets its normalised output written directly; a split request writes
per-item partials (normalised output + base-2 log-sum-exp) that a second small kernel merges.

fp8-e4m3 caches carry one fp32 scale per cached token (kv_scales [P, page_size], value = fp8 * scale).
The kernels read the model's stacked pool [L_mla, P, page_size, C+R] directly at a layer index (a slice
kv_pages[layer] handed to a custom call could be materialised as a copy of the whole layer pool per step).
The scale factors out of both products: s_j = scale_j * (q . kv8_j) and sum_j p_j scale_j c8_j, so the
kernel converts fp8 to the query dtype for the MMA and applies scales to the [rows, block_kv] tile.

Pallas backend: the Triton lowering (`pl.pallas_call` + `plgpu.CompilerParams`). Why: it indexes pages with
in-kernel gathers and runs data-dependent loop bounds (what a split plan needs, without scalar prefetch),
and runs under `interpret=True` in CPU CI.

Measured (one H200, 2026-11-30; K3 MLA, 96 heads, bf16 pages; copy bandwidth 4.13-4.27 TB/s):
  B64 x 32k q_len 1, 1 pipeline stage (the default, see default_num_stages): 3.63 ms = 0.665 TB/s = 16% of
  copy, in a pool just above 2^31 bytes and in one above 2^32 bytes (64-bit offsets) alike. Earlier tables
  (docs/results/mla_h200_2026-11-29.json, -11-30.json: 3.45 / 6.25 ms, q_len 4 12.1 ms) were taken with 2
  stages, which are miscompiled (wrong outputs, default_num_stages says how much): they are not valid.
Where the time goes (same shape, 64 rows x 64 keys, 8 warps, 2 stages; the loop with stages left out):
  page gathers alone 1.03 ms (2.36 TB/s: one program per SM, two stages in flight cap the loads at 56% of
  copy), + scores and softmax statistics 2.37 ms, + P @ C with the 64 x 512 fp32 rescale 6.2 ms. Split-KV
  decode in plain XLA (cuBLAS batched GEMMs, 16 splits) over a contiguous history takes 2.27 ms (193
  TFLOP/s, 25% of copy; q_len 4 6.27 ms), over pages (an XLA gather first) 5.3 ms. Tilings: 32-key blocks
  (3 stages) 7.75 ms; value_groups=2 (each program owns 256 output columns and recomputes the scores: half
  the accumulator, 1.5x the MMA work) 9.0-10.5 ms where it fits shared memory (at 64 x 64 x 2 stages it
  needs 272 KiB); 128-row blocks and 128-key blocks overflow shared memory. The Triton lowering here is
  latency-bound (one 150-220 KiB program per SM, no warp specialisation), not bandwidth-bound.
The memory limit needs FlashMLA's structure: `backend="mosaic"` (_mgpu_decode_kernel below) is a first
Mosaic GPU version of it (TMA page copies by a memory warpgroup, wgmma, two compute warpgroups owning
256 value columns each). The model takes it when k3jax.mla.MLA_DECODE_KERNEL == "mosaic" (default "triton": with it the
whole k3-small decode step was slower, 16.6 vs 13.4 ms, host-bound around the Mosaic calls; see k3jax/mla.py). At
k3-small's 16 heads (16 query rows padded to its 64-row tile, 64-token pages,
B64 x 8k; benchmarks/mla.py --shape-sweep on the H200, 2026-11-30, docs/results/mla_small_h200_2026-11-30e.json) it
takes 0.206 ms per layer with one wave of programs (66 parts; 69 % of copy bandwidth; default_plan_knobs) against
0.384 ms for Triton's best tiling (37 %), 1.88x, within 7e-4 of the reference. It lowers to Mosaic GPU MLIR on CPU and matches the
reference under the Mosaic GPU interpreter (tests/kernels/test_mla_decode.py); on the H200 (2026-11-30,
benchmarks/mla.py --backends, docs/results/mla_backends_h200_2026-11-30b.json) it compiled, matched the
reference to <= 9.7e-4 relative at histories 1/63/513/4097 for q_len 1 and 4. With the current plan defaults
(2026-12-03, docs/results/mla_mosaic96_h200_2026-12-03.json): 1.56-1.62 ms at B64 x 32k (35-37 % of copy; the
shipped decode_attention 2.82 ms) and 5.23 ms at q_len 4; its loads alone take 1.24-1.27 ms there (both row-block
programs stream the KV through L2). (The 4.2-4.25 ms that benchmarks/mla.py reported until 2026-12-03 included a
copy of its whole page pool per eager call; see stacked_pool.) Its shared memory (Q 72 KiB + two 72 KiB KV slots,
the output reusing the KV ring) is ~221 KiB of the 227 KiB.
A second schedule, "split" (2026-12-03; _mgpu_split_decode_kernel): each compute warpgroup scores only its half of
a block's keys, so Q K^T is no longer computed twice. The warpgroups swap row maxima and probabilities through
shared memory, two barriers per block. On the H200 it matched the reference (<= 9.6e-4 relative, q_len 1 and 4)
and, at K3's 96 heads, B64 x 32k with the default plans, took 1.473 ms against "duplicate"'s 1.514 at q_len 1 and
4.407 against 5.042 ms at q_len 4 (benchmarks/mla.py --backends, docs/results/mla_pool_copy_fix_h200_2026-12-03.json).
With 64-token pages (devscripts timing, docs/results/mla_schedules_h200_2026-12-03.json): 96 heads 1.458 against
1.492 ms (q_len 1) and 4.714 against 5.013 (q_len 4); at k3-small's 16 heads split is 1.06x faster at q_len 4
(64 rows: 0.751 against 0.795 ms) and 1.04x slower at q_len 1 (16 rows padded to 64: 0.718 against 0.692 ms, where
the MMA is a small share and the exchange is not). So default_mgpu_schedule takes "split" from one full 64-row
block of query rows per request.
Paired clusters (2026-12-04; mosaic_paired): a work item's row blocks run two by two as 2-CTA clusters; each CTA
issues half of every page tile by multicast TMA into both rings (a page crosses L2 -> SM once per pair), a slot is
refilled once both CTAs' compute warpgroups released it (cluster barriers), and each CTA prefetches its half of
the blocks 4 ahead into L2. At 96 heads, B64 x 32k (one H200, docs/results/mla_paired_h200_2026-12-04.json): with
the same plan, 1.00-1.08x over the unpaired kernel in 8 comparisons over two calls (q_len 1 and 4, 16- and 64-token
pages; median 1.03x; e.g. 1.396 against 1.441 ms at q_len 1, 64-token pages, 40 % -> 41 % of copy). Half the plan's
parts gave more on these equal histories (1.365 against 1.427 ms, 4.124 against 4.612 at q_len 4; benchmarks/mla.py
--backends) but is not the default: see default_plan_knobs. So halving the L2 -> SM traffic barely moved the
kernel: the loads were not bound by it. A 2-slot ring (all the shared memory the queries leave) paces a block per
~2.7 us per SM at 16 and 96 heads alike.
Tried and not kept (2026-12-05, thirty-third session; docs/results/mla_overlap_h200_2026-12-05.json): "split"
software-pipelined by one block, as FlashAttention-3 overlaps within a warpgroup -- each step issued block s's Q K^T,
then block s-1's P @ C (probabilities as the register A operand), waited for the scores only
(wgmma_accumulator_load(wait_n=1)) and ran block s's softmax and both exchanges while P @ C was in flight. Right on
the H200 (8 GPU cases at 96 heads; outputs identical to "split"), but 1.43-1.74x slower in three interleaved calls:
B64 x 32k q_len 1 2.11-2.37 against 1.41-1.44 ms, q_len 4 6.22-6.87 against 4.34-4.35, mixed 4k-200k 1.47-1.81
against 0.99-1.21, 16 heads 0.34-0.38 against 0.23. With the probabilities loop-carried, ptxas serialised the wgmmas
(C7513: a carried A operand is redefined while its product is in flight); reloaded from shared memory each step, the
serialisation went away and the time barely moved. ptxas reports 168 registers for the kernel and spills 212 bytes in
the pipelined form against 100 in "split" (the extra live [64, 32] scores and [64, 64] operands beside the in-flight
[64, 256] accumulator); moving the key-offset iota into the loop changed neither spills nor time.
Tried and not kept (2026-12-05, thirty-fourth session; docs/results/mla_alternate_h100_2026-12-05.json): an
"alternate" schedule after FlashMLA's Hopper design -- compute warpgroup w scored the blocks s % 2 == w whole
([64, 64] = Q K^T, block s's scores issued before waiting for block s - 1's probabilities), published the block's
probabilities and row maxima / rescale through shared memory, and both warpgroups accumulated every block's P @ C
(P read from shared memory; a variant loaded the other's P into registers and released the buffer before its own
softmax). Right on the GPU (8 cases at 96 and 16 heads, 16- and 64-token pages, paired and not), but on one H100,
interleaved with "split": B64 x 32k q_len 1 2.44 / 2.39 against 1.46 ms, q_len 4 7.24 / 7.00 against 4.07, 32
histories 4k-131k 1.59 / 1.54 against 0.95; at 16 heads 1.41 / 1.47 against 0.88 ("duplicate" 0.87). ptxas: 168
registers and 784 / 724 bytes of spills against "split"'s 104 -- block s's [64, 64] fp32 scores and its key offsets
live beside the [64, 256] accumulator during block s - 1's P @ C. The same lesson as the pipelined form: two
64-row compute warpgroups with a 128-register accumulator each have no room for a second block's scores.
Floors at B64 x 32k: 0.57 ms by bandwidth and 0.57 ms by bf16 MMA (769 TFLOP/s measured, 438 GFLOP
useful; 0.76 ms with 96 heads padded to 128 rows); q_len 4 is compute-bound: >= 2.3 ms (25% of the copy
bandwidth at best), so "q_len 4 at the q_len 1 bandwidth" cannot be met by any kernel."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.mla_plan import SplitPlan, plan_balanced

LOG2E = math.log2(math.e)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# The merge of split requests' partials (combine_partials): programs of at most COMBINE_ROWS x COMBINE_COLS outputs,
# COMBINE_UNROLL partials a loop step. A long request's merge is a chain of dependent steps (one per partial before
# 2026-12-05: 25-35 of them for a 200k history in the balanced plan, 0.17-0.22 ms of a 1.5 ms step on the H200).
COMBINE_ROWS = 32
COMBINE_COLS = 64
COMBINE_UNROLL = 4
KV_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)
MAX_Q_LEN = 8  # decode / speculative verify; longer queries go to mla_prefill


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


# --------------------------------------------------------------------------------------------------
# Shared inner loop (also used by mla_prefill): online softmax over KV blocks [blk_start, blk_end).
# --------------------------------------------------------------------------------------------------
def attend_kv_blocks(q_c, q_r, row_pos, page_table_ref, b, kv_ref, kv_scale_ref, layer, blk_start, blk_end, *,
                     kv_lora_rank: int, block_kv: int, page_size: int, softmax_scale: float, value_start=None,
                     value_width: int | None = None):
    """Runs inside a kernel. q_c [rows, C], q_r [rows, R] (query dtype), row_pos [rows] int32; reads request
    b's pages through page_table_ref [B, max_pages] from layer `layer` of kv_ref [L, P, page_size, C+R]
    (kv_scale_ref [L, P, page_size] or None). Returns (acc [rows, Vw] fp32 un-normalised, m [rows] base-2 running max,
    l [rows] sum of exp2) over keys at positions in blocks [blk_start, blk_end) that each row may see.
    value_start / value_width (default 0 / C): the value columns [value_start, value_start + Vw) of c this call
    accumulates (a program owning a column group of the output; the scores always use all C + R channels)."""
    rows = q_c.shape[0]
    c_dim, r_dim = kv_lora_rank, kv_ref.shape[-1] - kv_lora_rank
    value_width = c_dim if value_width is None else value_width
    whole_value = value_width == c_dim
    pages_per_block = block_kv // page_size
    compute_dtype = q_c.dtype
    key_offsets = jnp.arange(block_kv, dtype=jnp.int32)

    def body(blk, carry):
        acc, m_prev, l_prev = carry
        pages = page_table_ref[b, pl.ds(blk * pages_per_block, pages_per_block)]  # [pages_per_block]
        kv_c = kv_ref[layer, pages, :, pl.ds(0, c_dim)].reshape(block_kv, c_dim).astype(compute_dtype)
        kv_r = kv_ref[layer, pages, :, pl.ds(c_dim, r_dim)].reshape(block_kv, r_dim).astype(compute_dtype)
        s = jnp.dot(q_c, kv_c.T, preferred_element_type=jnp.float32)
        s += jnp.dot(q_r, kv_r.T, preferred_element_type=jnp.float32)  # [rows, block_kv]
        if kv_scale_ref is not None:
            token_scale = kv_scale_ref[layer, pages].reshape(1, block_kv).astype(jnp.float32)
            s = s * token_scale
        s = s * (softmax_scale * LOG2E)  # base-2 logits
        visible = (blk * block_kv + key_offsets)[None, :] <= row_pos[:, None]
        s = jnp.where(visible, s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp2 finite (-> 0).
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.exp2(s - m_safe[:, None])
        alpha = jnp.exp2(m_prev - m_safe)
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        if kv_scale_ref is not None:
            p = p * token_scale
        if whole_value:
            kv_v = kv_c
        else:  # a second gather of this group's columns (in L1/L2 after the score load)
            kv_v = kv_ref[layer, pages, :, pl.ds(value_start, value_width)].reshape(block_kv, value_width)
            kv_v = kv_v.astype(compute_dtype)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(compute_dtype), kv_v, preferred_element_type=jnp.float32)
        return acc, m_next, l_next

    init = (
        jnp.zeros((rows, value_width), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    return jax.lax.fori_loop(blk_start, blk_end, body, init)


def normalise(acc, m, l):
    """(acc / l, base-2 lse); rows that saw no key give (0, -inf)."""
    seen = l > 0
    out = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0)
    lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)
    return out, lse


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------
def _decode_kernel(
    work_request_ref,  # [W] int32, -1 = padding item
    work_start_ref,  # [W] int32 first KV block
    work_end_ref,  # [W] int32 one past the last KV block
    request_num_work_ref,  # [B] int32
    q_ref,  # [B, M_pad, C+R] queries, rows (t, h) t-major
    row_pos_ref,  # [B, M_pad] int32 position of each row's token (-1 for padding rows)
    page_table_ref,  # [B, max_pages_padded] int32
    layer_ref,  # [1] int32 layer of the stacked pool
    kv_ref,  # [L, P, page_size, C+R] latent pages
    *rest,  # kv_scale_ref [L, P, page_size] fp32 (fp8 caches), then outputs:
    # out_ref [B, M_pad, C] fp32 final output (single-item requests);
    # part_o_ref [block_rows, C / value_groups] fp32 (block of [W, M_pad, C]); part_lse_ref [block_rows] (block of
    # [W, M_pad]; every column group writes the same values)
    has_scales: bool,
    kv_lora_rank: int,
    value_groups: int,
    block_rows: int,
    block_kv: int,
    page_size: int,
    softmax_scale: float,
):
    kv_scale_ref = rest[0] if has_scales else None
    out_ref, part_o_ref, part_lse_ref = rest[1:] if has_scales else rest
    row_block, group, item = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b = work_request_ref[item]
    value_width = kv_lora_rank // value_groups

    @pl.when(b >= 0)
    def _():
        rows = pl.ds(row_block * block_rows, block_rows)
        c_dim, r_dim = kv_lora_rank, q_ref.shape[-1] - kv_lora_rank
        q_c = q_ref[b, rows, pl.ds(0, c_dim)]  # [block_rows, C]
        q_r = q_ref[b, rows, pl.ds(c_dim, r_dim)]  # [block_rows, R]
        row_pos = row_pos_ref[b, rows]  # [block_rows]
        acc, m, l = attend_kv_blocks(
            q_c, q_r, row_pos, page_table_ref, b, kv_ref, kv_scale_ref, layer_ref[0], work_start_ref[item],
            work_end_ref[item],
            kv_lora_rank=kv_lora_rank, block_kv=block_kv, page_size=page_size, softmax_scale=softmax_scale,
            value_start=group * value_width, value_width=value_width,
        )
        out, lse = normalise(acc, m, l)
        single = request_num_work_ref[b] == 1

        @pl.when(single)
        def _():
            out_ref[b, rows, pl.ds(group * value_width, value_width)] = out

        @pl.when(jnp.logical_not(single))
        def _():
            part_o_ref[...] = out
            part_lse_ref[...] = lse


def _combine_kernel(
    request_first_work_ref,  # [B] int32
    request_num_work_ref,  # [B] int32
    part_o_ref,  # [W, M_pad, C] fp32 normalised partial outputs
    part_lse_ref,  # [W, M_pad] fp32 base-2 log-sum-exp of each partial
    *refs,  # out_in_ref [B, M_pad, C] fp32 aliased to out_ref (single-item requests already written; not with
    #         all_partials), then out_ref [block_rows, block_cols] fp32 (block of [B, M_pad or M, C])
    block_rows: int,
    block_cols: int,
    unroll: int,  # partials merged per loop step: their loads are independent, so they are in flight together
    all_partials: bool = False,  # every item wrote a partial (the Mosaic kernel): merge requests of >= 1 item too
):
    out_ref = refs[-1]
    row_block, col_block, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_items = request_num_work_ref[b]

    @pl.when(num_items >= (0 if all_partials else 2))  # (no items: the loop runs none and writes zeros)
    def _():
        first = request_first_work_ref[b]
        rows = pl.ds(row_block * block_rows, block_rows)
        cols = pl.ds(col_block * block_cols, block_cols)

        def body(step, carry):
            acc, m_prev, l_prev = carry
            # the last step's surplus slots re-read the request's last partial (written, finite) at weight 0
            slots = [step * unroll + j for j in range(unroll)]
            items = [first + jnp.minimum(j, num_items - 1) for j in slots]
            lses = [jnp.where(j < num_items, part_lse_ref[w, rows], -jnp.inf) for j, w in zip(slots, items)]
            parts = [part_o_ref[w, rows, cols] for w in items]  # [block_rows, block_cols] each
            m_next = functools.reduce(jnp.maximum, lses, m_prev)
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            alpha = jnp.exp2(m_prev - m_safe)
            weights = [jnp.exp2(lse - m_safe) for lse in lses]
            acc = functools.reduce(lambda a, pw: a + pw[0] * pw[1][:, None], zip(parts, weights),
                                   acc * alpha[:, None])
            return acc, m_next, functools.reduce(jnp.add, weights, l_prev * alpha)

        init = (
            jnp.zeros((block_rows, block_cols), jnp.float32),
            jnp.full((block_rows,), -jnp.inf, jnp.float32),
            jnp.zeros((block_rows,), jnp.float32),
        )
        acc, _, l = jax.lax.fori_loop(0, (num_items + unroll - 1) // unroll, body, init)
        out_ref[...] = jnp.where((l > 0)[:, None], acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)


# --------------------------------------------------------------------------------------------------
# Mosaic GPU kernel (Hopper: TMA page copies, wgmma, a memory warpgroup and two compute warpgroups).
# Mosaic GPU decode (see the module docstring): H200-checked in benchmarks/mla.py at 96 and 16 heads; the model's
# when k3jax.mla.MLA_DECODE_KERNEL == "mosaic".
# Program = (64-row block, work item). Warpgroup 2 copies each KV block's pages (TMA, `stages` slots deep);
# warpgroups 0 and 1 both compute the [64, block_kv] scores and softmax (duplicated: 1.5x the MMA work of
# one score pass, but no exchange between them) and each accumulates its own 256 of the 512 value columns.
# Every item writes a normalised partial + lse; `_combine_kernel` merges them (one launch; `merge_partials`, its
# XLA form, took five kernels per layer: 10 us per k3-small decode layer on the H200, 2026-12-02).
# --------------------------------------------------------------------------------------------------
MGPU_ROWS = 64  # one wgmma M tile: the query rows (t, h) of a program; fewer rows (k3-small's 16 heads x q_len 1)
# are padded to it (position -1: they see no key, their output rows are dropped before the merge)
MGPU_VALUE_HALF = 256  # each compute warpgroup owns half of the 512 value columns (its accumulator: 64 x 256 fp32)
# The H200-checked setting (benchmarks/mla.py --backends, 2026-11-30): 64-key blocks, a 2-slot TMA ring (~216 KiB)
MGPU_DEFAULT_BLOCK_KV = 64
MGPU_DEFAULT_STAGES = 2
# how the two compute warpgroups share a KV block (mla_decode's mosaic_schedule)
MGPU_SCHEDULES = ("duplicate", "split")
# setmaxnreg caps (compute warpgroups, memory warpgroup) by schedule: 384 threads launch at 168 registers each, so
# 2 x compute + memory <= 504. "split" spills less at 240 (ptxas: 56 bytes against 104 at 232) and ran 1.03-1.05x
# faster at 96 heads x q_len 1 (one H100, 2026-12-05, two calls; q_len 4 and 16 heads unchanged; 224 / 56: 204
# bytes, 1.13x slower), so its memory warpgroup gets by on 24; "duplicate" measured the same at 16 heads either way.
MGPU_REGISTERS = {"duplicate": (232, 40), "split": (240, 24)}
# mla_decode's mosaic_skip_masks when not given. Off until timed on a GPU: skipping the masks (2026-12-06) is checked
# against the reference under the interpreter and lowers for sm_90, but no GPU could be had that session.
MGPU_DEFAULT_SKIP_MASKS = False


def default_mgpu_schedule(rows: int) -> str:
    """The Mosaic kernel's schedule when none is given, by a request's query rows T*H: "split" from one full 64-row
    block (H200, B64 x 32k: 1.02-1.14x "duplicate" at 96 heads, 1.06x at 16 heads x q_len 4), "duplicate" below it
    (16 heads x q_len 1, rows padded to 64: "split" 1.04x slower)."""
    return "split" if rows >= MGPU_ROWS else "duplicate"


def default_mgpu_paired(row_blocks: int, interpret: bool) -> bool:
    """Whether the Mosaic kernel runs row blocks in 2-CTA clusters when mosaic_paired is not given: on the GPU
    wherever the row blocks pair up (K3's 96 heads: 2 at q_len 1, 6 at 4); not under the interpreter, which runs a
    cluster's CTAs as concurrent threads that wait on each other (as the split schedule's warpgroups do)."""
    return not interpret and row_blocks % 2 == 0


def default_mgpu_l2_prefetch(paired: bool) -> int:
    """KV blocks prefetched into L2 ahead of the ring when mosaic_l2_prefetch is not given: 4 for paired clusters
    (each CTA prefetches half of each block; 96 heads, B64 x 32k, one H200 call: q_len 1 1.396 / 1.416 ms with / without
    at 64-token pages, 1.415 / 1.446 at 16; q_len 4 4.315 / 4.534 and 4.337 / 4.355; 8 blocks ahead no better), none
    otherwise (both row-block programs of an item prefetch the same pages: 1.94 against 1.44 ms)."""
    return 4 if paired else 0


def default_mgpu_block_kv(page_size: int) -> int:
    """The Mosaic kernel's KV block when none is given: MGPU_DEFAULT_BLOCK_KV, or one page if pages are larger."""
    return max(MGPU_DEFAULT_BLOCK_KV, page_size)
MGPU_SMEM_LIMIT = 227 * 1024  # Hopper's shared memory per block
MGPU_MAX_L2_PREFETCH = 16  # KV blocks prefetched into L2 ahead of the ring (mla_decode's mosaic_l2_prefetch)
MGPU_PAIR_AXIS = "pair"  # the cluster axis of the paired kernels: the two row blocks of one work item
_MGPU_INTERPRET_KW = {}


def _mgpu_work_item(work_request_ref, work_start_ref, work_end_ref, paired: bool = False):
    """This Mosaic program's work item: (item, request b, valid (False: a padding item), its first KV block, the
    number of KV blocks it walks (0 when padding), its 64 query rows). `paired`: the program is one of a 2-CTA
    cluster (grid axis "row_pairs", cluster axis MGPU_PAIR_AXIS) holding row blocks 2 * pair and 2 * pair + 1."""
    if paired:
        row_block = 2 * jax.lax.axis_index("row_pairs") + jax.lax.axis_index(MGPU_PAIR_AXIS)
    else:
        row_block = jax.lax.axis_index("rows")
    item = jax.lax.axis_index("items")
    b_raw = work_request_ref[item]
    valid = b_raw >= 0
    blk_start = work_start_ref[item]
    num_steps = jnp.where(valid, work_end_ref[item] - blk_start, 0)
    return item, jnp.maximum(b_raw, 0), valid, blk_start, num_steps, pl.ds(row_block * MGPU_ROWS, MGPU_ROWS)


def _mgpu_issue_queries(q_ref, row_pos_ref, q_c_smem, q_r_smem, pos_smem, q_barrier, *, b, rows):
    """The item's 64 query rows by TMA onto q_barrier: q_latent's two 256-column halves, q_pe (unless q_r_smem is
    None: the split schedule loads it into registers) and the rows' positions."""
    c_half = MGPU_VALUE_HALF
    for half in range(2):
        plmgpu.copy_gmem_to_smem(q_ref.at[b, rows, pl.ds(half * c_half, c_half)], q_c_smem.at[half], q_barrier)
    if q_r_smem is not None:
        plmgpu.copy_gmem_to_smem(q_ref.at[b, rows, pl.ds(2 * c_half, q_r_smem.shape[-1])], q_r_smem, q_barrier)
    plmgpu.copy_gmem_to_smem(row_pos_ref.at[b, rows], pos_smem, q_barrier)


def _mgpu_softmax_start():
    """A compute warpgroup's online-softmax state before its first KV block: row maxima -inf and row sums 0 (one
    value a row, WGMMA row layout) and its [64, 256] fp32 accumulator at zero."""
    row_layout = plmgpu.Layout.WGMMA.reduce(1)
    return (plmgpu.layout_cast(jnp.full((MGPU_ROWS,), -jnp.inf, jnp.float32), row_layout),
            plmgpu.layout_cast(jnp.full((MGPU_ROWS,), 0.0, jnp.float32), row_layout),
            plmgpu.layout_cast(jnp.full((MGPU_ROWS, MGPU_VALUE_HALF), 0.0, jnp.float32), plmgpu.Layout.WGMMA))


def _mgpu_stream_kv(kv_ref, page_table_ref, c_smem, r_smem, kv_barriers, consumed_barriers, *, b, blk_start,
                    num_steps, layer, page_size, stages, registers, paired=False, l2_prefetch=0):
    """The Mosaic kernels' memory warpgroup: streams the item's KV blocks page by page into the `stages`-slot TMA
    ring (c_smem [stages, 2, block_kv, 256] latent halves, r_smem [stages, block_kv, R] rope part), refilling a
    slot once both compute warpgroups have arrived on its consumed barrier. It first lowers its register cap to
    `registers` (the schedule's MGPU_REGISTERS entry), freeing them for the compute warpgroups.
    `paired` (a 2-CTA cluster on the same work item): each CTA's copy is half of every tile, multicast into both
    CTAs' rings, so a page crosses L2 -> SM once for both row blocks (each CTA's kv barrier still counts the whole
    tile's bytes); consumed_barriers are then cluster barriers: a slot is refilled once the compute warpgroups of
    both CTAs are done with it, since the refill writes the peer's ring too.
    `l2_prefetch` > 0: issuing block s also asks TMA to bring block s + l2_prefetch into L2 (no shared memory, no
    barrier), so the ring's refills read L2 rather than HBM; the ring holds only 2 blocks (the queries take a third
    of shared memory), too shallow to cover HBM latency by itself."""
    plmgpu.set_max_registers(registers, action="decrease")
    block_kv, c_half, r_dim = c_smem.shape[2], MGPU_VALUE_HALF, r_smem.shape[-1]
    pages_per_block = block_kv // page_size
    pair = MGPU_PAIR_AXIS if paired else None
    columns = [pl.ds(0, c_half), pl.ds(c_half, c_half), pl.ds(2 * c_half, r_dim)]  # the three tiles of a page

    def pages(step):
        return [page_table_ref[b, (blk_start + step) * pages_per_block + i] for i in range(pages_per_block)]

    def prefetch(step):
        @pl.when(step < num_steps)
        def _():
            for page in pages(step):
                for cols in columns:
                    plmgpu.async_prefetch(kv_ref.at[layer, page, :, cols], collective_axes=pair)

    def issue(step, slot):
        for i, page in enumerate(pages(step)):
            dst_rows = pl.ds(i * page_size, page_size)
            dsts = [c_smem.at[slot, 0, dst_rows], c_smem.at[slot, 1, dst_rows], r_smem.at[slot, dst_rows]]
            for cols, dst in zip(columns, dsts):
                plmgpu.copy_gmem_to_smem(kv_ref.at[layer, page, :, cols], dst, kv_barriers.at[slot],
                                        collective_axes=pair)
        if l2_prefetch:
            prefetch(step + l2_prefetch)

    for first in range(stages):
        pl.when(first < num_steps)(functools.partial(issue, first, first))
    for ahead in range(stages, l2_prefetch):  # the blocks the first issues' prefetches skip over
        prefetch(ahead)

    @pl.loop(0, jnp.maximum(num_steps - stages, 0))
    def _refill(step):
        slot = jax.lax.rem(step, stages)
        plmgpu.barrier_wait(consumed_barriers.at[slot])  # both compute warpgroups are done with it
        issue(step + stages, slot)

    for last in range(stages):  # observe the consumed barriers' last phases too (the interpreter checks)
        step = num_steps - stages + last

        @pl.when(step >= 0)
        def _():
            plmgpu.barrier_wait(consumed_barriers.at[jax.lax.rem(jnp.maximum(step, 0), stages)])


def _mgpu_write_partial(acc, m_i, l_i, o_smem, lse_smem, part_o_ref, part_lse_ref, *, item, rows, wg):
    """A compute warpgroup's normalised partial output (its 256 value columns) and, from warpgroup 0, the rows'
    base-2 log-sum-exp, through shared memory (o_smem / lse_smem alias the KV ring: called after both compute
    warpgroups are past their last read of it)."""
    seen = l_i > 0
    inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
    out_smem = o_smem.at[wg]
    out_smem[...] = acc * jax.lax.broadcast_in_dim(inv_l, acc.shape, [0])
    plmgpu.commit_smem()
    plmgpu.copy_smem_to_gmem(out_smem, part_o_ref.at[item, rows, pl.ds(wg * MGPU_VALUE_HALF, MGPU_VALUE_HALF)])
    plmgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 0)
    def _():
        lse_smem[...] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), -jnp.inf)
        plmgpu.commit_smem()
        plmgpu.copy_smem_to_gmem(lse_smem, part_lse_ref.at[item, rows])
        plmgpu.wait_smem_to_gmem(0)


def _mgpu_queries_with_pe_in_registers(q_ref, row_pos_ref, q_c_smem, pos_smem, q_barrier, interpret_scratch, *, b,
                                       rows, wg, r_dim, interpret):
    """A compute warpgroup of the "split" kernel: warpgroup 0 issues the item's q_latent halves and row positions by
    TMA, every compute warpgroup loads q_pe [64, R] into registers (a wgmma A operand; staged in interpret_scratch[0]
    for the interpreter), then waits for the TMA. Returns (q_pe operand, row positions [64] in the WGMMA row layout)."""
    pl.when(wg == 0)(lambda: _mgpu_issue_queries(q_ref, row_pos_ref, q_c_smem, None, pos_smem, q_barrier, b=b,
                                                 rows=rows))
    q_pe = plmgpu.load(q_ref.at[b, rows, pl.ds(2 * MGPU_VALUE_HALF, r_dim)], (), layout=plmgpu.Layout.WGMMA,
                       optimized=False)
    q_pe_operand = _staged_for_interpreter(q_pe, interpret_scratch[0].at[wg]) if interpret else q_pe
    plmgpu.barrier_wait(q_barrier)
    return q_pe_operand, plmgpu.load(pos_smem, (), layout=plmgpu.Layout.WGMMA.reduce(1), optimized=False)


def _mgpu_visible_scores(s, first_key, row_pos, softmax_scale, *, masked, key_offsets=None):
    """A compute warpgroup's raw scores s [64, width] (keys first_key + key_offsets, the [64, width] int32 column
    index) as base-2 logits; with `masked`, -inf where a key lies after the row's position (the causal mask inside a
    draft; padding rows, position -1, see none). key_offsets None: made here, in the masked step itself -- the
    kernels pass None with skip_masks, since offsets made before the KV loop would stay live in registers through
    its unmasked part too."""
    s = s * (softmax_scale * LOG2E)
    if not masked:
        return s
    if key_offsets is None:
        key_offsets = plmgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plmgpu.Layout.WGMMA)
    visible = first_key + key_offsets <= jax.lax.broadcast_in_dim(row_pos, s.shape, [0])
    return jnp.where(visible, s, -jnp.inf)


def _mgpu_kv_loop(kv_step, carry, *, unmasked_blocks_ref, b, blk_start, num_steps, skip_masks):
    """The compute warpgroups' KV loop over the item's blocks, each step masked; with `skip_masks`, in two parts:
    the blocks that every real query row of request b sees whole (unmasked_blocks_ref[b] of the request, counted
    from its first block: no causal mask), then the rest (masked: the blocks crossing the rows' positions).
    Padding rows (position -1) see keys in the first part; their outputs are never merged (combine_partials takes
    the real rows only)."""
    if not skip_masks:
        return jax.lax.fori_loop(0, num_steps, functools.partial(kv_step, masked=True), carry)
    first_masked = jnp.clip(unmasked_blocks_ref[b] - blk_start, 0, num_steps)
    carry = jax.lax.fori_loop(0, first_masked, functools.partial(kv_step, masked=False), carry)
    return jax.lax.fori_loop(first_masked, num_steps, functools.partial(kv_step, masked=True), carry)


def _mgpu_probabilities(s, m_prev, m_next):
    """exp2(s - m_next) per row and the accumulator's rescale exp2(m_prev - m_next); a row that has seen no key
    yet (m_next = -inf) subtracts 0 instead, which keeps both finite (-> 0)."""
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    return jnp.exp2(s - jax.lax.broadcast_in_dim(m_safe, s.shape, [0])), jnp.exp2(m_prev - m_safe)


def _mgpu_decode_kernel(
    work_request_ref,  # [W] int32 GMEM, -1 = padding item
    work_start_ref,  # [W] int32 GMEM first KV block
    work_end_ref,  # [W] int32 GMEM one past the last KV block
    q_ref,  # [B, M_pad, C+R] bf16 GMEM queries, rows (t, h) t-major
    row_pos_ref,  # [B, M_pad] int32 GMEM position of each row (-1 padding)
    page_table_ref,  # [B, max_pages_padded] int32 GMEM
    layer_ref,  # [1] int32 GMEM
    unmasked_blocks_ref,  # [B] int32 GMEM KV blocks every real query row of the request sees whole
    kv_ref,  # [L, P, page_size, C+R] bf16 GMEM
    part_o_ref,  # [W, M_pad, C] fp32 GMEM normalised partial outputs
    part_lse_ref,  # [W, M_pad] fp32 GMEM base-2 log-sum-exp of each partial
    q_c_smem,  # [2, 64, 256] bf16: q_latent halves
    q_r_smem,  # [64, R] bf16
    pos_smem,  # [64] int32 row positions
    kv_union,  # shared memory used twice: ((c_smem, r_smem) in the KV loop, (o_smem, lse_smem) after it):
    # c_smem [stages, 2, block_kv, 256] bf16 the latent halves of each KV block; r_smem [stages, block_kv, R] bf16
    # its k_pe; o_smem [2, 64, 256] fp32 each compute warpgroup's output; lse_smem [64] fp32
    q_barrier,  # 1 barrier, 4 TMA arrivals (two q halves, q_pe, positions)
    kv_barriers,  # [stages] barriers, 3 TMA arrivals per page
    consumed_barriers,  # [stages] barriers, one arrival per compute warpgroup
    done_barrier,  # both compute warpgroups are past their last read of c_smem / r_smem (2 arrivals)
    *interpret_scratch,  # interpret mode: p_smem [2, 64, block_kv] bf16, probabilities as a wgmma operand
    block_kv: int,
    page_size: int,
    stages: int,
    softmax_scale: float,
    interpret: bool,
    paired: bool = False,
    l2_prefetch: int = 0,
    skip_masks: bool = False,
):
    (c_smem, r_smem), (o_smem, lse_smem) = kv_union
    item, b, valid, blk_start, num_steps, rows = _mgpu_work_item(work_request_ref, work_start_ref, work_end_ref,
                                                                 paired)
    wg = jax.lax.axis_index("wg")
    layer = layer_ref[0]

    @pl.when(wg == 2)
    def _memory_warpgroup():
        _mgpu_stream_kv(kv_ref, page_table_ref, c_smem, r_smem, kv_barriers, consumed_barriers, b=b,
                        blk_start=blk_start, num_steps=num_steps, layer=layer, page_size=page_size, stages=stages,
                        registers=MGPU_REGISTERS["duplicate"][1], paired=paired, l2_prefetch=l2_prefetch)

    @pl.when(wg < 2)
    def _compute_warpgroup():
        plmgpu.set_max_registers(MGPU_REGISTERS["duplicate"][0], action="increase")

        pl.when(wg == 0)(lambda: _mgpu_issue_queries(q_ref, row_pos_ref, q_c_smem, q_r_smem, pos_smem, q_barrier,
                                                     b=b, rows=rows))

        plmgpu.barrier_wait(q_barrier)
        row_pos = plmgpu.load(pos_smem, (), layout=plmgpu.Layout.WGMMA.reduce(1), optimized=False)
        m_i, l_i, acc = _mgpu_softmax_start()
        key_offsets = None if skip_masks else plmgpu.broadcasted_iota(jnp.int32, (MGPU_ROWS, block_kv), 1,
                                                                      layout=plmgpu.Layout.WGMMA)

        def kv_step(step, carry, *, masked):
            acc, m_prev, l_prev = carry
            slot = jax.lax.rem(step, stages)
            plmgpu.barrier_wait(kv_barriers.at[slot])

            def scores(acc_ref):  # both warpgroups compute the whole [64, block_kv] score tile
                for half in range(2):
                    plmgpu.wgmma(acc_ref, q_c_smem.at[half], c_smem.at[slot, half].transpose((1, 0)))
                plmgpu.wgmma(acc_ref, q_r_smem, r_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(scores, plmgpu.ACC((MGPU_ROWS, block_kv), jnp.float32))
            s = _mgpu_visible_scores(s, (blk_start + step) * block_kv, row_pos, softmax_scale, masked=masked,
                                     key_offsets=key_offsets)
            m_next = jnp.maximum(m_prev, s.max(axis=1))
            p, alpha = _mgpu_probabilities(s, m_prev, m_next)
            l_next = l_prev * alpha + p.sum(axis=1)
            p16 = p.astype(q_c_smem.dtype)
            values = c_smem.at[slot, wg]  # [block_kv, 256]: this warpgroup's value columns

            p_operand = _staged_for_interpreter(p16, interpret_scratch[0].at[wg]) if interpret else p16
            acc = _mgpu_rescale_accumulate(acc, alpha, p_operand, values, interpret=interpret)
            plmgpu.barrier_arrive(consumed_barriers.at[slot])
            return acc, m_next, l_next

        acc, m_i, l_i = _mgpu_kv_loop(kv_step, (acc, m_i, l_i), unmasked_blocks_ref=unmasked_blocks_ref, b=b,
                                      blk_start=blk_start, num_steps=num_steps, skip_masks=skip_masks)
        # o_smem / lse_smem alias c_smem / r_smem: neither warpgroup writes them before both are done reading
        plmgpu.barrier_arrive(done_barrier)
        plmgpu.barrier_wait(done_barrier)

        pl.when(valid)(lambda: _mgpu_write_partial(acc, m_i, l_i, o_smem, lse_smem, part_o_ref, part_lse_ref,
                                                   item=item, rows=rows, wg=wg))


def _mgpu_split_decode_kernel(
    # GMEM refs, as _mgpu_decode_kernel's
    work_request_ref, work_start_ref, work_end_ref, q_ref, row_pos_ref, page_table_ref, layer_ref, unmasked_blocks_ref,
    kv_ref, part_o_ref, part_lse_ref,
    q_c_smem,  # [2, 64, 256] bf16: q_latent halves
    p_smem,  # [2, 64, block_kv / 2] bf16: each compute warpgroup's probabilities (its half of the keys)
    kv_union,  # shared memory used twice: ((c_smem, r_smem) in the KV loop, (o_smem, lse_smem) after it):
    # c_smem [stages, 2, block_kv, 256] bf16 (slot, latent half, key, column); r_smem [stages, block_kv, R] bf16;
    # o_smem [2, 64, 256] fp32; lse_smem [64]
    pos_smem,  # [64] int32 row positions (the small buffers last: no alignment gaps between the swizzled ones)
    stat_smem,  # [2, 64] fp32: each compute warpgroup's row maxima (then, after the loop, its row sums)
    q_barrier,  # 1 barrier, 3 TMA arrivals (two q_latent halves, positions)
    kv_barriers,  # [stages] barriers, 3 TMA arrivals per page
    consumed_barriers,  # [stages] barriers, one arrival per compute warpgroup
    max_barrier,  # both compute warpgroups wrote their row maxima (2 arrivals; once per KV block, once after)
    probs_barrier,  # both compute warpgroups wrote their probabilities (2 arrivals, once per KV block)
    done_barrier,  # both compute warpgroups are past their last read of c_smem / r_smem (2 arrivals)
    *interpret_scratch,  # interpret mode: [2, 64, R] and [2, 64, block_kv] bf16, the register A operands staged
    block_kv: int,
    page_size: int,
    stages: int,
    softmax_scale: float,
    interpret: bool,
    paired: bool = False,
    l2_prefetch: int = 0,
    skip_masks: bool = False,
):
    """The "split" schedule of the Mosaic kernel: each compute warpgroup scores its own half of a KV block's keys
    (no duplicated Q K^T), the two exchange row maxima and probabilities through shared memory, and each
    accumulates P @ C over all the block's keys for its 256 value columns. Per 64-key block and 64 rows: 64 x 64 x
    (576 + 512) MMA FLOPs x 2 where the "duplicate" schedule does 64 x 64 x (2 x 576 + 512) x 2; two warpgroup
    barriers per block instead of none. Memory warpgroup and epilogue as _mgpu_decode_kernel's.
    Two wgmma A operands come from registers: q_pe [64, R] (loaded once from global memory; a shared-memory buffer
    for it put the kernel 1,088 B over the H200's shared memory), and the block's probabilities [64, block_kv] in
    P @ C (both halves read back from the exchange buffer and joined: an A operand in shared memory must share B's
    128-byte swizzle, and a half's 32-key rows are 64 bytes; a register A needs K % 64 == 0, hence one [64, 64]
    operand rather than two). The interpreter takes wgmma operands from shared memory only: in interpret mode both
    are staged through interpret_scratch. Under the Mosaic GPU interpreter this kernel needs >= 3 host CPU devices
    (XLA_FLAGS=--xla_force_host_platform_device_count; the test suite sets 8): the interpreter runs each warpgroup as
    its own CPU computation on a Python thread, and on the 2-core CI machine XLA ran only two of them at once with 1
    or 2 host devices (a stack dump of the hang with 1 device: two warpgroups blocked in barrier waits, the third
    never started) and all three with 3 (the interpreter test then passes in 6.5 s). Here the two compute warpgroups
    wait on each other, so all three must run at once; in the "duplicate" kernel they wait only on the memory
    warpgroup, and it runs with 1 device. On the H200 it ran to the reference's results."""
    (c_smem, r_smem), (o_smem, lse_smem) = kv_union
    item, b, valid, blk_start, num_steps, rows = _mgpu_work_item(work_request_ref, work_start_ref, work_end_ref,
                                                                 paired)
    wg = jax.lax.axis_index("wg")
    layer = layer_ref[0]
    r_dim = r_smem.shape[-1]
    key_half = block_kv // 2
    own_keys = pl.ds(pl.multiple_of(wg * key_half, key_half), key_half)  # this compute warpgroup's keys of a block

    @pl.when(wg == 2)
    def _memory_warpgroup():
        _mgpu_stream_kv(kv_ref, page_table_ref, c_smem, r_smem, kv_barriers, consumed_barriers, b=b,
                        blk_start=blk_start, num_steps=num_steps, layer=layer, page_size=page_size, stages=stages,
                        registers=MGPU_REGISTERS["split"][1], paired=paired, l2_prefetch=l2_prefetch)

    @pl.when(wg < 2)
    def _compute_warpgroup():
        plmgpu.set_max_registers(MGPU_REGISTERS["split"][0], action="increase")

        q_pe_operand, row_pos = _mgpu_queries_with_pe_in_registers(
            q_ref, row_pos_ref, q_c_smem, pos_smem, q_barrier, interpret_scratch, b=b, rows=rows, wg=wg, r_dim=r_dim,
            interpret=interpret)
        row_layout = plmgpu.Layout.WGMMA.reduce(1)
        load_rows = lambda ref: plmgpu.load(ref, (), layout=row_layout, optimized=False)
        m_i, l_i, acc = _mgpu_softmax_start()
        key_offsets = None if skip_masks else plmgpu.broadcasted_iota(jnp.int32, (MGPU_ROWS, key_half), 1,
                                                                      layout=plmgpu.Layout.WGMMA)

        def kv_step(step, carry, *, masked):
            acc, m_prev, l_prev = carry
            slot = jax.lax.rem(step, stages)
            plmgpu.barrier_wait(kv_barriers.at[slot])

            def scores(acc_ref):  # this warpgroup's half of the keys
                for half in range(2):
                    plmgpu.wgmma(acc_ref, q_c_smem.at[half], c_smem.at[slot, half, own_keys].transpose((1, 0)))
                plmgpu.wgmma(acc_ref, q_pe_operand, r_smem.at[slot, own_keys].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(scores, plmgpu.ACC((MGPU_ROWS, key_half), jnp.float32))
            s = _mgpu_visible_scores(s, (blk_start + step) * block_kv + wg * key_half, row_pos, softmax_scale,
                                     masked=masked, key_offsets=key_offsets)
            # row maxima over both halves: each warpgroup publishes its own, then reads both (the barrier's phase
            # also orders this block's writes after the other warpgroup's reads of the previous block's: those came
            # before its probabilities, which this warpgroup waited for)
            stat_smem.at[wg][...] = jnp.maximum(m_prev, s.max(axis=1))
            plmgpu.barrier_arrive(max_barrier)
            plmgpu.barrier_wait(max_barrier)
            m_next = jnp.maximum(load_rows(stat_smem.at[0]), load_rows(stat_smem.at[1]))
            p, alpha = _mgpu_probabilities(s, m_prev, m_next)
            l_next = l_prev * alpha + p.sum(axis=1)  # this warpgroup's keys only: the halves are summed at the end
            p_smem.at[wg][...] = p.astype(p_smem.dtype)
            plmgpu.commit_smem()
            plmgpu.barrier_arrive(probs_barrier)
            plmgpu.barrier_wait(probs_barrier)

            # both halves' probabilities as one [64, block_kv] A operand in registers (a register A needs K % 64 == 0)
            p_all = jnp.concatenate([plmgpu.load(p_smem.at[kh], (), layout=plmgpu.Layout.WGMMA, optimized=False)
                                     for kh in range(2)], axis=1)
            if interpret:
                p_all = _staged_for_interpreter(p_all, interpret_scratch[1].at[wg])
            acc = _mgpu_rescale_accumulate(acc, alpha, p_all, c_smem.at[slot, wg], interpret=interpret)
            plmgpu.barrier_arrive(consumed_barriers.at[slot])
            return acc, m_next, l_next

        acc, m_i, l_i = _mgpu_kv_loop(kv_step, (acc, m_i, l_i), unmasked_blocks_ref=unmasked_blocks_ref, b=b,
                                      blk_start=blk_start, num_steps=num_steps, skip_masks=skip_masks)
        # the row sums of both halves (stat_smem's maxima were last read before the last probabilities barrier)
        stat_smem.at[wg][...] = l_i
        plmgpu.barrier_arrive(max_barrier)
        plmgpu.barrier_wait(max_barrier)
        l_i = load_rows(stat_smem.at[0]) + load_rows(stat_smem.at[1])
        plmgpu.barrier_arrive(done_barrier)
        plmgpu.barrier_wait(done_barrier)

        pl.when(valid)(lambda: _mgpu_write_partial(acc, m_i, l_i, o_smem, lse_smem, part_o_ref, part_lse_ref,
                                                   item=item, rows=rows, wg=wg))


def _mgpu_rescale_accumulate(acc, alpha, probs, values, *, interpret):
    """acc * alpha (per row) + probs @ values by wgmma: one online-softmax step of a compute warpgroup's [64, 256]
    accumulator (probs [64, block_kv] bf16 in registers, or staged in shared memory for the interpreter)."""
    def pv(acc_ref):
        plmgpu.wgmma(acc_ref, probs, values)

    acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
    if interpret:  # the interpreter cannot run wgmma into an initialised accumulator (run_state): add
        return acc + pl.run_scoped(lambda ref: (pv(ref), ref[...])[1], plmgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(pv)(plmgpu.ACC.init(acc))  # on the GPU it stays in place (128 registers a thread)


def _staged_for_interpreter(value, ref):
    """`value` written to the shared-memory `ref` (this warpgroup's own) and `ref` returned: a wgmma A operand the
    Mosaic GPU interpreter accepts (it reads wgmma operands from shared memory only; on the GPU they stay in
    registers)."""
    ref[...] = value
    plmgpu.commit_smem()
    return ref


def mgpu_smem_bytes(block_kv: int, stages: int, r_dim: int, schedule: str = "duplicate") -> int:
    """Shared memory of the Mosaic kernel: queries [64, 512 + R] bf16 and row positions, then the KV ring
    [stages, block_kv, 512 + R] bf16 sharing its space with the outputs [2, 64, 256] fp32 + lse [64]; the "split"
    schedule adds the probabilities [64, block_kv] bf16 and row statistics [2, 64] fp32 and holds q_pe in registers
    instead (barriers and alignment not counted: ~1 KiB of slack is left under MGPU_SMEM_LIMIT)."""
    q = MGPU_ROWS * (2 * MGPU_VALUE_HALF + r_dim) * 2 + MGPU_ROWS * 4
    ring = stages * block_kv * (2 * MGPU_VALUE_HALF + r_dim) * 2
    outputs = 2 * MGPU_ROWS * MGPU_VALUE_HALF * 4 + MGPU_ROWS * 4
    if schedule == "split":  # + probabilities and row statistics, - the q_pe buffer (q_pe in registers)
        q += MGPU_ROWS * block_kv * 2 + 2 * MGPU_ROWS * 4 - MGPU_ROWS * r_dim * 2
    return q + max(ring, outputs)


def mgpu_supported(c_dim: int, r_dim: int, page_size: int, kv_dtype, block_kv: int) -> bool:
    """Sizes the Mosaic GPU kernel takes: C = 512 (two 256-column halves), R a multiple of 64, bf16 pages of
    a power-of-two size >= 8 dividing block_kv, a multiple of 64 (the P @ C wgmma's K with 128-byte swizzle)."""
    return (c_dim == 2 * MGPU_VALUE_HALF and r_dim % 64 == 0 and jnp.dtype(kv_dtype) == jnp.bfloat16
            and _is_pow2(page_size) and block_kv % page_size == 0 and block_kv % 64 == 0 and page_size % 8 == 0)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "scale", "block_kv", "stages", "schedule", "paired",
                                             "l2_prefetch", "skip_masks", "interpret"))
def _mla_decode_mgpu(q_latent, q_pe, kv_pages, page_table, query_positions, plan, layer, *, kv_lora_rank, scale,
                     block_kv, stages, schedule, paired, l2_prefetch, skip_masks, interpret):
    kv_pages, _, layer = stacked_pool(kv_pages, None, layer)
    mgpu = plmgpu
    b, t, h, c_dim = q_latent.shape
    page_size, r_dim = kv_pages.shape[-2], kv_pages.shape[-1] - kv_lora_rank
    work_request, work_start, work_end, _, _ = plan
    num_items = work_request.shape[0]
    q, row_pos, m_pad = _row_layout(q_latent, q_pe, query_positions, MGPU_ROWS)
    page_table = _pad_page_table(page_table, block_kv // page_size)
    dtype = kv_pages.dtype
    swizzled = lambda shape, dt=dtype: mgpu.SMEM(shape, dt, transforms=(mgpu.TilingTransform((8, 64)),
                                                                        mgpu.SwizzleTransform(128)))
    outputs = (mgpu.SMEM((2, MGPU_ROWS, MGPU_VALUE_HALF), jnp.float32), mgpu.SMEM((MGPU_ROWS,), jnp.float32))
    row_blocks = m_pad // MGPU_ROWS
    if paired:  # one 2-CTA cluster per (row-block pair, work item); a slot's refill waits for both CTAs
        assert row_blocks % 2 == 0, row_blocks
        consumed = mgpu.ClusterBarrier(collective_axes=(MGPU_PAIR_AXIS,), num_arrivals=2, num_barriers=stages)
        launch = dict(grid=(row_blocks // 2, num_items), grid_names=("row_pairs", "items"), cluster=(2,),
                      cluster_names=(MGPU_PAIR_AXIS,))
    else:
        consumed = mgpu.Barrier(num_arrivals=2, num_barriers=stages)
        launch = dict(grid=(row_blocks, num_items), grid_names=("rows", "items"))
    scratch = dict(q_c_smem=swizzled((2, MGPU_ROWS, MGPU_VALUE_HALF)))
    if schedule == "split":
        key_half = block_kv // 2
        scratch.update(
            p_smem=mgpu.SMEM((2, MGPU_ROWS, key_half), dtype, transforms=(
                mgpu.TilingTransform((8, min(key_half, 64))), mgpu.SwizzleTransform(min(2 * key_half, 128)))),
            kv_union=mgpu.RefUnion(
                (swizzled((stages, 2, block_kv, MGPU_VALUE_HALF)), swizzled((stages, block_kv, r_dim))),
                outputs),
            pos_smem=mgpu.SMEM((MGPU_ROWS,), jnp.int32),
            stat_smem=mgpu.SMEM((2, MGPU_ROWS), jnp.float32),
            q_barrier=mgpu.Barrier(num_arrivals=3),
            kv_barriers=mgpu.Barrier(num_arrivals=3 * (block_kv // page_size), num_barriers=stages),
            consumed_barriers=consumed,
            max_barrier=mgpu.Barrier(num_arrivals=2),
            probs_barrier=mgpu.Barrier(num_arrivals=2),
            done_barrier=mgpu.Barrier(num_arrivals=2),
        )
        if interpret:
            scratch["q_pe_staged"] = swizzled((2, MGPU_ROWS, r_dim))
            scratch["p_staged"] = swizzled((2, MGPU_ROWS, block_kv))
        body = _mgpu_split_decode_kernel
    else:
        scratch.update(
            q_r_smem=swizzled((MGPU_ROWS, r_dim)),
            pos_smem=mgpu.SMEM((MGPU_ROWS,), jnp.int32),
            kv_union=mgpu.RefUnion(
                (swizzled((stages, 2, block_kv, MGPU_VALUE_HALF)), swizzled((stages, block_kv, r_dim))), outputs),
            q_barrier=mgpu.Barrier(num_arrivals=4),
            kv_barriers=mgpu.Barrier(num_arrivals=3 * (block_kv // page_size), num_barriers=stages),
            consumed_barriers=consumed,
            done_barrier=mgpu.Barrier(num_arrivals=2),
        )
        if interpret:
            scratch["p_smem"] = swizzled((2, MGPU_ROWS, block_kv))
        body = _mgpu_decode_kernel
    kernel = mgpu.kernel(
        functools.partial(body, block_kv=block_kv, page_size=page_size, stages=stages, softmax_scale=scale,
                          interpret=interpret, paired=paired, l2_prefetch=l2_prefetch, skip_masks=skip_masks),
        out_type=(jax.ShapeDtypeStruct((num_items, m_pad, c_dim), jnp.float32),
                  jax.ShapeDtypeStruct((num_items, m_pad), jnp.float32)),
        scratch_types=list(scratch.values()),
        **launch,
        num_threads=3,
        thread_name="wg",
        compiler_params=mgpu.CompilerParams(approx_math=True),
        interpret=mgpu.InterpretGPUParams(**_MGPU_INTERPRET_KW) if interpret else None,
    )
    # KV blocks that every real row of a request sees whole (up to its earliest query position; a -1 row: none); read
    # only with skip_masks (without, a constant: no extra op in the step)
    if skip_masks:
        unmasked_blocks = (jnp.min(query_positions, axis=1).astype(jnp.int32) + 1) // block_kv
    else:
        unmasked_blocks = jnp.zeros((b,), jnp.int32)
    part_o, part_lse = kernel(work_request, work_start, work_end, q, row_pos, page_table, layer, unmasked_blocks,
                              kv_pages)
    # only the real rows are merged (16 heads x q_len 1: 16 of the 64 rows)
    out = combine_partials(part_o, part_lse, plan[3], plan[4], t * h, interpret=interpret)
    return out.reshape(b, t, h, c_dim)


def combine_partials(part_o, part_lse, request_first_work, request_num_work, rows: int, *, written=None,
                     block_rows: int | None = None, block_cols: int | None = None, unroll: int = COMBINE_UNROLL,
                     interpret: bool):
    """[B, rows, C] fp32: each request's partials (its items are consecutive: request_first_work .. + num_work)
    merged by log-sum-exp, rows 0..rows-1 of part_o [W, M_pad, C] / part_lse [W, M_pad] (base 2); a request with no
    item gets zeros. One Pallas launch (`_combine_kernel`), a program per (row block, column block, request), each
    merging `unroll` partials a step.

    written: [B, rows, C], the outputs single-item requests already wrote (the Triton kernel's), updated in place
    for the others; None: every item wrote a partial (the Mosaic kernel) and every request is merged here.
    block_rows / block_cols: None takes the largest divisor of rows up to COMBINE_ROWS / of C up to COMBINE_COLS."""
    b, c_dim = request_num_work.shape[0], part_o.shape[-1]
    if block_rows is None:
        block_rows = max(r for r in (1, 2, 4, 8, 16, 32, 64) if rows % r == 0 and r <= COMBINE_ROWS)
    if block_cols is None:
        block_cols = max([c for c in (16, 32, 64, 128, 256, 512) if c_dim % c == 0 and c <= COMBINE_COLS] or [c_dim])
    if rows % block_rows or c_dim % block_cols or unroll < 1:
        raise ValueError(f"block_rows {block_rows} must divide rows {rows}, block_cols {block_cols} the {c_dim} "
                         f"columns, and unroll {unroll} be >= 1")
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    operands = [request_first_work, request_num_work, part_o, part_lse] + ([] if written is None else [written])
    return pl.pallas_call(
        functools.partial(_combine_kernel, block_rows=block_rows, block_cols=block_cols, unroll=unroll,
                          all_partials=written is None),
        grid=(rows // block_rows, c_dim // block_cols, b),
        in_specs=[full(x) for x in operands],
        out_specs=pl.BlockSpec((None, block_rows, block_cols), lambda r, c, i: (i, r, c)),
        out_shape=jax.ShapeDtypeStruct((b, rows, c_dim), jnp.float32),
        input_output_aliases={} if written is None else {4: 0},
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="mla_decode_combine",
    )(*operands)


def merge_partials(part_o, part_lse, work_request, batch: int):  # the plain-XLA twin of combine_partials
    """Log-sum-exp merge of normalised partials part_o [W, M, C] (base-2 lse [W, M]) into [B, M, C] (plain
    XLA: one pass over the partials); padding items (request -1) and empty partials (lse -inf) weigh 0."""
    seg = jnp.where(work_request >= 0, work_request, batch)
    lse = jnp.where((work_request >= 0)[:, None], part_lse, -jnp.inf)
    top = jax.ops.segment_max(lse, seg, num_segments=batch + 1)  # [B+1, M]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.exp2(lse - top[seg])  # [W, M]
    weight = jnp.where(jnp.isfinite(lse), weight, 0.0)
    # where, not a product: a padding item's partial is never written (may hold NaN)
    num = jax.ops.segment_sum(jnp.where(weight[..., None] > 0, part_o * weight[..., None], 0.0), seg,
                              num_segments=batch + 1)[:batch]
    den = jax.ops.segment_sum(weight, seg, num_segments=batch + 1)[:batch]
    return jnp.where((den > 0)[..., None], num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------
def supported(c_dim: int, r_dim: int, page_size: int, kv_dtype) -> bool:
    """Whether the kernels' Triton tiling takes these sizes (C, R powers of two >= 16, page_size a power of
    two <= 64 -- the default block_kv -- and a KV dtype of KV_DTYPES)."""
    return (_is_pow2(c_dim) and c_dim >= 16 and _is_pow2(r_dim) and r_dim >= 16 and _is_pow2(page_size)
            and page_size <= 64 and any(jnp.dtype(kv_dtype) == d for d in KV_DTYPES))


def _check_inputs(q_latent, q_pe, kv_pages, page_table, query_positions, kv_lora_rank, kv_scales, block_kv,
                  block_rows, layer=None):
    if q_latent.ndim != 4 or q_pe.ndim != 4 or q_latent.shape[:3] != q_pe.shape[:3]:
        raise ValueError(f"q_latent [B, T, H, C] and q_pe [B, T, H, R] disagree: {q_latent.shape} vs {q_pe.shape}")
    b, t, _, c_dim = q_latent.shape
    r_dim = q_pe.shape[-1]
    if kv_pages.ndim not in (3, 4) or kv_pages.shape[-1] != c_dim + r_dim:
        raise ValueError(f"kv_pages must be [P, page_size, {c_dim + r_dim}] or [L, P, page_size, {c_dim + r_dim}], "
                         f"got {kv_pages.shape}")
    if (kv_pages.ndim == 4) != (layer is not None):
        raise ValueError("a stacked pool [L, P, page_size, C+R] needs `layer`, a single layer's pool takes none")
    if c_dim != kv_lora_rank:
        raise ValueError(f"q_latent width {c_dim} != kv_lora_rank {kv_lora_rank}")
    for name, n in (("kv_lora_rank", c_dim), ("rope dim", r_dim)):
        if not _is_pow2(n) or n < 16:
            raise ValueError(f"{name} must be a power of two >= 16 (Triton tiles), got {n}")
    page_size = kv_pages.shape[-2]
    if not _is_pow2(page_size):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if not _is_pow2(block_kv) or block_kv < max(16, page_size):
        raise ValueError(f"block_kv must be a power of two >= max(16, page_size={page_size}), got {block_kv}")
    if not _is_pow2(block_rows) or block_rows < 16:
        raise ValueError(f"block_rows must be a power of two >= 16, got {block_rows}")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be [B={b}, max_pages], got {page_table.shape}")
    if query_positions.shape != (b, t):
        raise ValueError(f"query_positions must be [B, T] = {(b, t)}, got {query_positions.shape}")
    if not any(kv_pages.dtype == d for d in KV_DTYPES):
        raise ValueError(f"kv_pages dtype {kv_pages.dtype} not one of {[jnp.dtype(d).name for d in KV_DTYPES]}")
    if kv_scales is not None and kv_scales.shape != kv_pages.shape[:-1]:
        raise ValueError(f"kv_scales must be kv_pages.shape[:-1] = {kv_pages.shape[:-1]}, got {kv_scales.shape}")
    if kv_pages.dtype.itemsize == 1 and 2**31 <= kv_pages.size and kv_pages.size * kv_pages.dtype.itemsize <= 2**32:
        # jax 0.11.2's Triton lowering picks 32-bit element offsets whenever the array is <= 2^32 BYTES; a 1-byte
        # pool of 2^31..2^32 elements then overflows them (seen on the H200: CUDA_ERROR_ILLEGAL_ADDRESS).
        raise ValueError(f"an fp8 pool of {kv_pages.size} elements (2^31..2^32) overflows the Triton lowering's "
                         "32-bit offsets; size the pool below 2^31 elements or above 4 GiB")


def _row_layout(q_latent, q_pe, query_positions, block_rows):
    """q [B, M_pad, C+R] (rows (t, h) t-major, zero padding) and row positions [B, M_pad] (-1 padding)."""
    b, t, h, _ = q_latent.shape
    m = t * h
    m_pad = -(-m // block_rows) * block_rows
    q = jnp.concatenate([q_latent, q_pe.astype(q_latent.dtype)], axis=-1).reshape(b, m, -1)
    q = jnp.pad(q, ((0, 0), (0, m_pad - m), (0, 0)))
    row_pos = jnp.repeat(query_positions.astype(jnp.int32), h, axis=1)
    row_pos = jnp.pad(row_pos, ((0, 0), (0, m_pad - m)), constant_values=-1)
    return q, row_pos, m_pad


def _pad_page_table(page_table, pages_per_block):
    """[B, max_pages] -> [B, multiple of pages_per_block]; padding entries are page 0 (read, masked out)."""
    extra = -page_table.shape[1] % pages_per_block
    return jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, extra)))


def stacked_pool(kv_pages, kv_scales, layer):
    """(pool [L, P, page_size, C+R], scales [L, P, page_size] fp32 or None, layer [1] int32): a single layer's
    pool gains a leading axis of 1. Call it inside jit only: there it is a bitcast, while an eager `[None]` copies
    the whole pool (5.8 GB, ~2.7 ms per call on the H200 at benchmarks/mla.py's 5M-token pool)."""
    if kv_pages.ndim == 3:
        kv_pages, kv_scales, layer = kv_pages[None], None if kv_scales is None else kv_scales[None], 0
    scales = None if kv_scales is None else kv_scales.astype(jnp.float32)
    return kv_pages, scales, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))


def attended_lengths(query_positions, max_tokens: int):
    """Tokens each request reads: max query position + 1, at most the page table's extent. [B]."""
    return jnp.clip(jnp.max(query_positions, axis=1) + 1, 0, max_tokens).astype(jnp.int32)


def default_block_kv(page_size: int) -> int:
    return max(64, page_size)


def default_decode_block_kv(page_size: int, block_rows: int) -> int:
    """KV tokens per step of mla_decode: 128 for row blocks of <= 32 (a request's heads x draft tokens), else 64.
    Measured on the H200 (benchmarks/mla.py --shape-sweep, 2026-11-30; 16 heads, B64 x 8192, 64-token pages,
    1 stage, 8 warps): 16 rows 0.382 ms at 128 keys vs 0.464 ms at 64 (1.21x); 32 rows 0.493 vs 0.582 ms. At 64
    rows (K3's 96 heads) a 128-key block does not fit shared memory."""
    return max(128 if block_rows <= 32 else 64, page_size)


def default_num_stages(kv_dtype) -> int:
    """Triton pipeline depth: 1 for every cache dtype. Two stages are miscompiled on the H200 (jax 0.11.2's
    Triton): measured 2026-11-30 (scratch run, H200), bf16 pages at histories 1/63/513/4097, the 2-stage kernel
    differs from mla_decode_reference by 0.07-0.14 relative per request in every pool tried (1.8M and 2.4M
    tokens; pages below and above the 2^31-byte mark alike) and by 5e-3 at B64 x 32k, while 1 stage agrees to
    <= 1e-3 everywhere (tests/gpu/test_mla_gpu.py). The page-table load feeds the gather's addresses in the same
    loop iteration; the pipeliner gets that chain wrong. fp8 pages could not take 2 stages anyway (their
    converted tiles overflow the 227 KiB of shared memory: 241920 B requested). Cost of 1 stage: 3.63 vs
    3.44 ms (+5%) at B64 x 32k q_len 1."""
    del kv_dtype
    return 1


TRITON_NUM_PARTS = 132  # the Triton kernel's parts: 1-2 programs per H200 SM (16 / 96 heads), as measured since 11-29
H200_SM_COUNT = 132
# Whether the on-device balanced plan lays items out longest chunks first (mla_plan.plan_balanced's longest_first).
PLAN_LONGEST_FIRST = True


def default_plan_knobs(backend: str, batch: int, row_blocks: int, sm_count: int = H200_SM_COUNT) -> tuple[int, int]:
    """(num_parts, overhead_blocks) of the on-device balanced plan. Triton: TRITON_NUM_PARTS parts, overhead 1 block.
    Mosaic, whose programs each hold a whole SM (the shared-memory ring), by two H200 measurements (2026-11-30):
    - one row block per request (<= 64 query rows: k3-small's 16 heads): one wave, num_parts = sm_count - batch, so the
      plan's <= num_parts + batch items all start at once. 16 heads, B64 x 8k (benchmarks/mla.py --shape-sweep): 66 parts
      (128 items) 0.206 ms per layer against 0.223 / 0.260 / 0.245 ms at 264 / 132 / 528 parts;
    - more row blocks (K3's 96 heads: 2): 4 programs per SM with an overhead of 64 blocks per request. 96 heads, 32
      histories 4k-200k (benchmarks/mla.py --plan-sweep --backend mosaic, first batch): 264 parts / overhead 64 1.54 ms,
      overhead 1 1.66 ms, 132 parts 1.83 ms, one wave (34 parts) 2.32 ms; the best uniform split 1.98 ms.
    The same for paired 2-CTA clusters (mosaic_paired; a work item still runs row_blocks CTAs). On equal-length
    B64 x 32k they ran 1.02-1.04x faster with half the parts at q_len 1 and 0.98-1.02x at q_len 4
    (docs/results/mla_paired_h200_2026-12-04.json), but mixed histories balance worse on fewer parts (132 parts were
    1.19x slower above). On the 12 mixed batches, paired (docs/results/mla_plan_paired_h200_2026-12-04.json): this
    plan 17.43 ms against 17.48 for uniform 16 splits in one call; 198 parts with overhead 128 17.32 against 17.46 ms
    for this plan in another (0.9 %), too little to move the default."""
    if backend != "mosaic":
        return TRITON_NUM_PARTS, 1
    if row_blocks == 1:
        return max(sm_count - batch, 1), 1
    return max(4 * sm_count // row_blocks, 1), 64


def default_block_rows(num_rows: int, cap: int) -> int:
    """Smallest power of two >= 16 holding num_rows = T*H, at most cap."""
    return min(cap, max(16, 1 << (num_rows - 1).bit_length()))


def mla_decode(
    q_latent: jax.Array,
    q_pe: jax.Array,
    kv_pages: jax.Array,
    page_table: jax.Array,
    query_positions: jax.Array,
    plan: SplitPlan | None = None,
    *,
    kv_lora_rank: int,
    scale: float,
    kv_scales: jax.Array | None = None,
    layer: int | jax.Array | None = None,
    num_parts: int | None = None,
    block_kv: int | None = None,
    block_rows: int | None = None,
    num_warps: int = 8,
    num_stages: int | None = None,
    value_groups: int = 1,
    backend: str = "triton",
    mosaic_schedule: str | None = None,
    mosaic_paired: bool | None = None,
    mosaic_l2_prefetch: int | None = None,
    mosaic_skip_masks: bool | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Absorbed MLA decode over a paged latent cache (the cache already holds this step's tokens).

    Args:
      q_latent: [B, T, H, C] absorbed queries (W_UK^T q_nope), T = 1..8; q_pe: [B, T, H, R].
      kv_pages: [P, page_size, C+R] one layer's pages, or the stacked pool [L, P, page_size, C+R] with `layer`;
        bf16/fp16/fp32 or float8_e4m3fn.
      page_table: [B, max_pages] int32 page ids of each request's history in order (any pool order).
      query_positions: [B, T] int32 absolute position of each query; it sees keys at positions <= its own.
      plan: SplitPlan over block_kv-token blocks of attended_lengths(query_positions, max_pages*page_size)
        (mla_plan.plan_balanced / plan_uniform, built on the host); None builds a balanced plan with
        `num_parts` parts on device from the traced positions (None: `default_plan_knobs`), longest chunks first
        (PLAN_LONGEST_FIRST).
      kv_scales: kv_pages.shape[:-1] fp32 per-token dequantisation scales (fp8 caches); None = 1.
      layer: the layer of a stacked pool (int or int32 scalar array).
      block_kv: KV tokens per inner step (power of two, multiple of page_size; None = default_decode_block_kv);
        block_rows: query rows (t, h) per program (None = T*H rounded up to a power of two, at most 64);
        num_warps / num_stages: Triton launch parameters.
      value_groups: programs sharing one (row block, work item), each accumulating C / value_groups of the output
        columns (scores recomputed by each: a smaller accumulator for more score FLOPs; measured slower).
      backend: "triton" (default) or "mosaic" (the Mosaic GPU kernel: bf16 pages, C = 512, any T*H <= 64 per row
        block (padded to 64 rows); block_kv (a multiple of 64, default default_mgpu_block_kv) and num_stages
        (default MGPU_DEFAULT_STAGES) as its KV block and TMA ring depth, within mgpu_smem_bytes <= 226 KiB; the
        model takes it when k3jax.mla.MLA_DECODE_KERNEL == "mosaic").
      mosaic_schedule: the Mosaic kernel's division of a KV block between its two compute warpgroups: "duplicate"
        (both score every key; no exchange) or "split" (each scores half the keys; row maxima and probabilities
        exchanged through shared memory, a third less MMA work; _mgpu_split_decode_kernel); None:
        default_mgpu_schedule(T*H) on the GPU, "duplicate" under the interpreter.
      mosaic_paired: run each work item's row blocks in 2-CTA clusters whose KV pages are multicast by TMA (each
        page read from L2 once per pair instead of once per row block); needs an even number of 64-row blocks
        (96 heads x q_len 1: 2). None: default_mgpu_paired.
      mosaic_l2_prefetch: KV blocks ahead of the TMA ring that the Mosaic kernel prefetches into L2 (0: none; None:
        default_mgpu_l2_prefetch).
      mosaic_skip_masks: the Mosaic kernel skips the causal mask on the KV blocks every real query row of a request
        sees whole (all but the last one or two), so the mask's [64, block] key offsets are not live through the
        whole loop (None: MGPU_DEFAULT_SKIP_MASKS).
      interpret: run the Pallas interpreter (CPU).

    Returns: o_latent [B, T, H, C] fp32 (sum_s p_s c_s, before W_UV).
    """
    page_size = kv_pages.shape[-2]
    b, t, h, c_dim = q_latent.shape
    block_rows = default_block_rows(t * h, 64) if block_rows is None else block_rows
    if backend == "mosaic":
        block_kv = default_mgpu_block_kv(page_size) if block_kv is None else block_kv
        num_stages = MGPU_DEFAULT_STAGES if num_stages is None else num_stages
    block_kv = default_decode_block_kv(page_size, block_rows) if block_kv is None else block_kv
    num_stages = default_num_stages(kv_pages.dtype) if num_stages is None else num_stages
    _check_inputs(q_latent, q_pe, kv_pages, page_table, query_positions, kv_lora_rank, kv_scales, block_kv, block_rows,
                  layer)
    if t > MAX_Q_LEN:
        raise ValueError(f"mla_decode takes q_len <= {MAX_Q_LEN} per request, got {t}; use mla_prefill")
    if value_groups < 1 or c_dim % value_groups or not _is_pow2(c_dim // value_groups) or c_dim // value_groups < 16:
        raise ValueError(f"value_groups must split kv_lora_rank {c_dim} into power-of-two groups >= 16, "
                         f"got {value_groups}")
    row_blocks = -(-(t * h) // (MGPU_ROWS if backend == "mosaic" else block_rows))
    if plan is None:
        kv_lens = attended_lengths(query_positions, page_table.shape[1] * page_size)
        default_parts, overhead = default_plan_knobs(backend, b, row_blocks)
        plan = plan_balanced(kv_lens, block_kv=block_kv, num_parts=default_parts if num_parts is None else num_parts,
                             overhead_blocks=overhead, longest_first=PLAN_LONGEST_FIRST, xp=jnp)
    if plan.request_num_work.shape != (b,):
        raise ValueError(f"plan is for batch {plan.request_num_work.shape}, queries for {b}")
    if backend == "mosaic":
        if kv_scales is not None or not mgpu_supported(c_dim, q_pe.shape[-1], page_size, kv_pages.dtype, block_kv):
            raise ValueError("the Mosaic GPU kernel takes bf16 pages, kv_lora_rank 512, a rope dim that is a multiple "
                             f"of 64 and pages of >= 8 tokens dividing block_kv; got C={c_dim}, R={q_pe.shape[-1]}, "
                             f"page_size={page_size}, {kv_pages.dtype}, block_kv={block_kv}")
        if mosaic_schedule is None:  # the interpreter: "duplicate" (split needs >= 3 host devices there, see
            # _mgpu_split_decode_kernel)
            mosaic_schedule = "duplicate" if interpret else default_mgpu_schedule(t * h)
        if mosaic_schedule not in MGPU_SCHEDULES:
            raise ValueError(f"mosaic_schedule must be one of {MGPU_SCHEDULES}, got {mosaic_schedule!r}")
        if mosaic_paired is None:
            mosaic_paired = default_mgpu_paired(row_blocks, interpret)
        if mosaic_paired and row_blocks % 2:
            raise ValueError(f"mosaic_paired runs row blocks in pairs; T*H = {t * h} query rows make {row_blocks} "
                             f"64-row blocks, an odd number")
        if mosaic_l2_prefetch is None:
            mosaic_l2_prefetch = default_mgpu_l2_prefetch(bool(mosaic_paired))
        if not 0 <= mosaic_l2_prefetch <= MGPU_MAX_L2_PREFETCH:
            raise ValueError(f"mosaic_l2_prefetch must be in [0, {MGPU_MAX_L2_PREFETCH}], got {mosaic_l2_prefetch}")
        if mosaic_skip_masks is None:
            mosaic_skip_masks = MGPU_DEFAULT_SKIP_MASKS
        smem = mgpu_smem_bytes(block_kv, num_stages, q_pe.shape[-1], mosaic_schedule)
        if num_stages < 2:  # one slot: the Mosaic GPU interpreter never finishes (2026-11-30, not understood)
            raise ValueError(f"the Mosaic GPU kernel needs num_stages >= 2 (a TMA ring of >= 2 slots), "
                             f"got {num_stages}")
        if smem > MGPU_SMEM_LIMIT - 1024:
            raise ValueError(f"the Mosaic GPU kernel's block_kv={block_kv} x num_stages={num_stages} ring needs "
                             f"{smem} B of shared memory, over the {MGPU_SMEM_LIMIT - 1024} B it may use")
        return _mla_decode_mgpu(q_latent, q_pe, kv_pages, page_table, query_positions, tuple(plan), layer,
                                kv_lora_rank=kv_lora_rank, scale=float(scale), block_kv=block_kv,
                                stages=num_stages, schedule=mosaic_schedule, paired=bool(mosaic_paired),
                                l2_prefetch=int(mosaic_l2_prefetch), skip_masks=bool(mosaic_skip_masks),
                                interpret=interpret)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'mosaic', got {backend!r}")
    return _mla_decode(q_latent, q_pe, kv_pages, page_table, query_positions, tuple(plan), kv_scales, layer,
                       kv_lora_rank=kv_lora_rank, scale=float(scale), block_kv=block_kv, block_rows=block_rows,
                       num_warps=num_warps, num_stages=num_stages, value_groups=value_groups, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "scale", "block_kv", "block_rows", "num_warps",
                                             "num_stages", "value_groups", "interpret"))
def _mla_decode(q_latent, q_pe, kv_pages, page_table, query_positions, plan, kv_scales, layer, *, kv_lora_rank, scale,
                block_kv, block_rows, num_warps, num_stages, value_groups, interpret):
    kv_pages, kv_scales, layer = stacked_pool(kv_pages, kv_scales, layer)
    b, t, h, c_dim = q_latent.shape
    page_size = kv_pages.shape[-2]
    work_request, work_start, work_end, request_first_work, request_num_work = plan
    num_items = work_request.shape[0]
    q, row_pos, m_pad = _row_layout(q_latent, q_pe, query_positions, block_rows)
    page_table = _pad_page_table(page_table, block_kv // page_size)
    n_row_blocks = m_pad // block_rows
    has_scales = kv_scales is not None
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    inputs = [work_request, work_start, work_end, request_num_work, q, row_pos, page_table, layer, kv_pages]
    if has_scales:
        inputs.append(kv_scales)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out_shape = jax.ShapeDtypeStruct((b, m_pad, c_dim), jnp.float32)
    out, part_o, part_lse = pl.pallas_call(
        functools.partial(_decode_kernel, has_scales=has_scales, kv_lora_rank=kv_lora_rank, value_groups=value_groups,
                          block_rows=block_rows, block_kv=block_kv, page_size=page_size, softmax_scale=scale),
        # row blocks fastest, then column groups: the programs of one work item run side by side and share its
        # KV through L2
        grid=(n_row_blocks, value_groups, num_items),
        in_specs=[full(x) for x in inputs],
        out_specs=[
            pl.BlockSpec(out_shape.shape, lambda r, g, w: (0, 0, 0)),
            pl.BlockSpec((None, block_rows, c_dim // value_groups), lambda r, g, w: (w, r, g)),
            pl.BlockSpec((None, block_rows), lambda r, g, w: (w, r)),
        ],
        out_shape=[
            out_shape,
            jax.ShapeDtypeStruct((num_items, m_pad, c_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_items, m_pad), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="mla_decode",
    )(*inputs)
    out = combine_partials(part_o, part_lse, request_first_work, request_num_work, m_pad, written=out,
                           block_rows=block_rows, interpret=interpret)
    return out[:, : t * h].reshape(b, t, h, c_dim)


# --------------------------------------------------------------------------------------------------
# References (plain jnp) and fp8 helpers
# --------------------------------------------------------------------------------------------------
def dequantize_pages(kv_pages: jax.Array, kv_scales: jax.Array | None) -> jax.Array:
    """[P, page_size, C+R] (any KV dtype) -> fp32 values (times per-token scales when given)."""
    kv = kv_pages.astype(jnp.float32)
    return kv if kv_scales is None else kv * kv_scales.astype(jnp.float32)[..., None]


def mla_decode_reference(q_latent, q_pe, kv_pages, page_table, query_positions, *, kv_lora_rank: int, scale: float,
                         kv_scales=None, layer=None) -> jax.Array:
    """Plain-jnp fp32 absorbed MLA over pages (also the reference of mla_prefill). Shapes as mla_decode;
    returns o_latent [B, T, H, C] fp32."""
    if layer is not None:
        kv_pages, kv_scales = kv_pages[layer], None if kv_scales is None else kv_scales[layer]
    b, max_pages = page_table.shape
    page_size = kv_pages.shape[1]
    hist = dequantize_pages(kv_pages, kv_scales)[page_table].reshape(b, max_pages * page_size, -1)  # [B, S, C+R]
    c, k_pe = hist[..., :kv_lora_rank], hist[..., kv_lora_rank:]
    hi = jax.lax.Precision.HIGHEST
    scores = (
        jnp.einsum("bthc,bsc->bhts", q_latent.astype(jnp.float32), c, precision=hi)
        + jnp.einsum("bthr,bsr->bhts", q_pe.astype(jnp.float32), k_pe, precision=hi)
    ) * scale
    visible = jnp.arange(max_pages * page_size)[None, None, :] <= query_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhts,bsc->bthc", probs, c, precision=hi)


def quantize_latents_fp8(latent: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token fp8-e4m3 quantisation of latents [..., C+R]: returns (fp8 [..., C+R], fp32 scale [...]) with
    latent ~= fp8 * scale, the token's max |value| mapped to 448."""
    x = latent.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    token_scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (x / token_scale[..., None]).astype(jnp.float8_e4m3fn), token_scale

