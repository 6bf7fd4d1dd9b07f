"""MoE grouped GEMM: the routed experts of one MoE layer as two Pallas kernels over expert-sorted rows.

    sum_i w_i E_i(x),   E(x) = down(act(x @ gate, x @ up)),   act = SiTU-GLU (K3) or SwiGLU

Pipeline (`moe_grouped_mlp`): two XLA kernels before the two Pallas ones (the sort and the compare-and-count; plus
a pad of `order` when M is not a multiple of block_m) and an elementwise combine after them, because every XLA
kernel costs a launch (~8 us of host time and a ~2.7 us GPU gap each in the k3-small decode step, H200 profile of
2026-11-30):
  1. one stable sort of the flat expert ids: `order`, the assignment (token * top_k + slot) of each expert-sorted
     row, expert e owning the contiguous rows bounds[e] .. bounds[e+1] (ragged groups; an expert may own none).
     At decode sizes (`ranks_in_kernel`) there is no sort: each GLU program finds its rows' tokens from the ids
     (`_ranked_tokens`: a per-token count of the expert, its cumulative sum over tokens, one [rows, N] compare), and
     each item's column-0 program also their assignments (`_ranked_assignments`), handed to the down kernel as a
     second output. On the H200 (k3-small decode B64, 2026-12-02) the first version of this (every program ranking
     over all N * K ids) cut 48 kernels per step and the step from 8.24 to 8.14 ms back to back, though the GLU
     kernels' own time rose by ~6 us per layer (the ranking) as the sort's ~5 us went; ranking by token took the
     GLU kernels from 2.43 to 2.39 ms per step (same call);
  2. one compare-and-count, `row_bounds` (no bincount scatter, no cumsum);
  3. `grouped_glu`: program (item, column tile) derives its work item from the bounds (`work_item`: the
     (tile, expert) pairs that overlap -- at most cdiv(M, block_m) + min(E, M) - 1 items, a bound known at trace
     time, so jit never recompiles for a new routing), gathers its x rows by token id (no sorted copy of x), runs
     gate and up on each x tile, the GLU epilogue on the fp32 accumulators, and stores only the rows of the item's
     expert (masked rows belong to a neighbouring expert's item);
  4. `grouped_down`: the down GEMM over the same items (each item's column-0 GLU program writes it to a [4, W]
     table, so a down program starts with four scalar loads instead of the bounds-wide schedule arithmetic: on the
     H200, k3-small decode B64, 1.22 vs 1.28 ms/step of down kernels, 2026-12-02), each row scaled by its routing
     weight (gathered in the kernel) and stored at its assignment's row of y [M, D] fp32 (each row written once;
     in x's dtype when there is nothing to sum, top_k = 1 and one contraction slice: the same rounding, once);
  5. each token sums its top_k consecutive rows of y (elementwise adds, deterministic: fuse into the consumer).
`tile_schedule` lists all items at once (tests, the benchmark's MMA-row count).

Dropped assignments: an id < 0 is an assignment this call does not compute (an expert-parallel rank's view of a
token's picks that live on other ranks, as vLLM's expert_map -1). It sorts after every expert's rows and no work
item covers it, so it costs no MMA rows; its y row is never written, and the combine selects zero for it.

Mid-size groups (MoeGemmConfig.tail_block_m, .aligned and .column_group; set in LARGE_GROUP_DEFAULT only). Every work item
costs a full block_m-row MMA, so items waste the rows of a tile that belong to a neighbouring expert: with 56
groups of ~292 rows in global 128-row tiles the MMAs compute 1.42x the real rows (1.11x at ~1170 rows).
tail_block_m=64 runs items of <= 64 rows as a 64-row MMA (a second compiled branch of each kernel): 1.21x
(counted by benchmarks/moe.py's sweep, `mma_rows`). aligned=True starts each expert's tiles at its first row, so
only its last tile is partial: 1.10x with 64-row tails, no copy (the kernels gather rows by index; the row buffers
get one more tile of padding), and 4-8 % faster at 294 rows/expert on the H200 (LARGE_GROUP_DEFAULT's comment).
An earlier group-aligned layout that copied the rows into a padded buffer was slower and was removed.
column_group=8 (also LARGE_GROUP_DEFAULT's) launches G column tiles of one item back to back, so an item's x rows
are read once per G column tiles rather than once per tile: 6-10 % faster at 294 and 1172 rows/expert.

Weights: {"gate", "up": [E, K, I], "down": [E, I, D]} in a float dtype, or any of them MXFP4 (E2M1 nibbles,
one E8M0 scale per 32 inputs), dequantised inside the kernel right before the MMA (weight-only: the
activations stay bf16), in one of four layouts (`mxfp4_layout`; gate and up may differ):
  "hf"  the checkpoint's ({"packed": [E, out, in/2] uint8, "scale": [E, out, in/32] uint8}, k3jax.quant);
        decode "interleave": nibbles interleaved back into input order, E2M1 built in fp32 by bit
        construction with two selects, scales broadcast by reshape, cast to bf16, transposed MMA operand.
  "kn"  a kernel layout, made once at load time by `prepare_mxfp4` (exact re-packing):
        {"planes_kn": [E, in/2, out], "scales_gn": [E, in/32, out]}; per block of 64 inputs byte j holds input j
        (low nibble) and input j + 32 (high), so each nibble plane is exactly one scale group: decoded with no
        shuffle (`_decode_plane`: f16 bits (m << 9) | sign << 15 = E2M1(m) * 2^-14, m = 1 the exact f16
        subnormal 2^-15, the 2^14 folded into the scale), multiplied a @ W (B operand, no transpose), the group
        scale applied to the fp32 partial product. Inputs must be multiples of 64.
  word layouts "k4" / "k4r" ({"planes_k4" | "planes_k4r": [E, in/8, 4 * out], "scale_words": [E, ceil(in/128),
        out] uint32}, WORD_LAYOUTS): per block of 64 inputs and output column, 8 little-endian 32-bit words, word j
        holding the codes of inputs 4j..4j+3 (c0..c3, low plane) and 32+4j..32+4j+3 (d0..d3, high plane); per 128
        inputs and column one scale word, byte g the bf16 exponent field of the factor applied to group g's decoded
        weights (`_scale_words`: k4 the E8M0 s, k4r s + 126), so that a k-step's scale load is one word and a
        shift and a mask give two groups' bf16 factors, one per 16-bit half. A k-step loads [8, 4 * block_n] bytes and
        views them as [32, block_n] rows 4j + i, so each thread's 4 k-consecutive MMA-operand bytes are one word;
        on the GPU one inline-PTX instance per plane and word decodes them (`_word_tile`), then one bf16 multiply
        applies the plane's group scale to the weights (exact: a power of two; the scale loads then feed the MMA
        operand and Triton pipelines them with the words), so the MMAs accumulate in place. Interpreted, jnp
        twins compute the same bits (`_k4_lut_bits`, `_k4r_bits`; checked by the CPU tests).
        "k4": magnitudes c_r & 7 in nibble r, d_r & 7 in nibble 4 + r, signs on bits 15 31 11 27 7 23 3 19
        (`_k4_words`); a PRMT table lookup gives exact bf16 E2M1 (`_K4_LUT_ASM`, 10-11 instructions per 4 weights
        plus the table constants ptxas rematerialises); any E8M0 scale.
        "k4r" (`prepare_mxfp4(w, layout="k4r")`, E8M0 scales <= 128 = 2^1, checked): the same codes placed so
        that a bf16 pair of a plane is one or two right rotations and masks away (`_K4R_ROTATIONS`, 11
        instructions per word = 8 weights), as E2M1 * 2^-126 (the E2M1 subnormal 0.5 becomes the bf16 subnormal
        2^-127, which the H200's bf16 multiply keeps), the 2^126 folded into the scale: 2^(s-1).
        Offline (pip Triton 3.6 with its TTIR passes, ptxas sm_90a; K3 EP16, decode tiling), loop SASS per k-step
        (block_k 128) of the GLU / down kernels and registers: k4 with the scale on the partial products 820 / 417
        (128 / 72 registers), k4 scaling the weights 771 / 400 (92 / 56), k4r 546 / 288 (77 / 48) with a byte of
        scale per group, 505 / 265 (80 / 58) with the scale words (k4 696 / 360), bf16 139 / 92.
        H200 (benchmarks/moe.py --mxfp4-variants k4,k4r, K3 EP16 shard, on-device check 4.3e-3 against the dense
        einsum; docs/benchmarks.md), bf16 ms / MXFP4 ms at 16 / 256 tokens, moe_grouped_mlp's default tiling (the
        down contraction cut in 3 at 16 tokens, `word_down_split`): k4r 1.57 / 1.57, k4 1.38 / 1.36 (2026-12-02,
        eighteenth session; k4r at one slice 1.45 / 1.57; with a byte of scale per group, same call: 1.29 / 1.42,
        and 1.39 cut in 2).
        Earlier: k4 with the scale on the partial products 1.05 / 1.16 (2026-12-02). Nsight Compute at 256 tokens
        (byte scales): the k4r GLU kernel issues 0.66 instructions per scheduler cycle (the loop is issue-bound;
        ~105 of its ~600 instructions per k-step are register moves assembling the activation operand for each MMA).
Measured on the H200 (benchmarks/moe.py --mxfp4-variants, K3 EP16 shard, 2026-11-30, all variants correct;
docs/results/moe_mxfp4_h200_2026-11-30e.json), bf16 ms / MXFP4 ms at 16 / 256 / 1024 tokens, best tiling each:
"kn" (variant "kmajor") 0.81 / 0.84 / 0.59, "hf" ("interleave") 0.59 / 0.55 / 0.37. Tried and removed, all
slower than "kn" at every size: an "nk" layout (weights [E, out, in/2] as the MMA's A operand, wgmma-eligible)
0.60 / 0.62 / 0.43; with the scale on the decoded weights 0.44 / 0.53 / 0.39; MMA in f16 0.55 / 0.56 / 0.39; an
inline-PTX plane decode 0.67 / 0.69 / 0.49; earlier, a per-group "interleave" (0.71 ms at 16 tokens). Their code is
in this file's git history. For large groups, dequantising to bf16 outside the kernel is faster (kn 3-4.6x slower
than bf16 at 16k-65k tokens; the word layouts decode each weight once per 16-row tile, so their cost grows with
the tiles a weight meets).

Pallas backend: the Triton lowering (`pl.pallas_call` + `plgpu.CompilerParams`). Why, by measurement on
the H200 (../shared/design/gpu.md): a Pallas-Triton tiled matmul reached 540 TFLOP/s (87% of XLA's
622-636), so the tile loop itself is not the limit, while the shipped Mosaic-GPU `ragged_dot_mgpu` reached
171 TFLOP/s on the grouped shape; Triton-lowered Pallas also runs on CPU in interpret mode, which is how
CI checks it, and needs no scalar prefetch here (the schedule is read with scalar loads inside the body).
Measured (benchmarks/moe.py, H200, K3 EP16 shard: 56 experts, 3584 -> 3072): bf16 decode (16 tokens)
0.39 ms = 3.4 TB/s of expert weights (80% of the 4.27 TB/s copy ceiling); 1024 tokens 1.09 ms (1.08x
faster than ragged_dot_mgpu); 65536 tokens (1162 rows/expert) 414 TFLOP/s = 60% of the 695 TFLOP/s
jnp.dot peak of the same run, 1.15x ragged_dot_mgpu.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import moe_combine
from pallas_kernels.moe_combine import glu as _glu  # the GLU epilogue's math (fp32)

MXFP4_GROUP = 32  # inputs per E8M0 scale
ACTIVATIONS = ("situ", "silu")


@dataclasses.dataclass(frozen=True)
class MoeGemmConfig:
    """Tile shapes and Triton launch parameters of both kernels (all block sizes powers of two >= 16).

    block_m rows per work item (shared by both kernels: one schedule); glu_block_n output columns of each
    of gate and up; down_block_n output columns of the down GEMM; block_k the contraction step of both.
    The expert-sorted rows are cut into global block_m tiles (a tile straddling two experts is two work items,
    each a full block_m-row MMA). tail_block_m (0 = off, mid-size groups): a work item with at most this many
    rows runs a tail_block_m-row MMA instead of a block_m-row one (both code paths are compiled; the branch is
    per item). down_num_stages: the down kernel's pipeline depth (0 = num_stages, both kernels alike).
    down_split_k: the down kernel's contraction cut into this many slices, one program each (more programs when few
    items are active, e.g. an EP shard at decode: at 16 tokens a K3 EP16 shard's down kernel runs ~5 programs per SM
    at 0.50 instructions issued per cycle, Nsight Compute 2026-12-02); the slices' fp32 partial rows are summed in
    the combine. `default_config` cuts MXFP4 word-layout down GEMMs at decode sizes (`word_down_split`).
    aligned: work items start at their expert's first row (`work_item`): an expert of n rows is cdiv(n, block_m)
    items, only its last one partial, where global tiles cut each expert at both ends (two partial items).
    column_group: the launch order of both kernels' programs (`_item_and_column`): 0, consecutive programs take one
    column tile of consecutive items; G > 0, G column tiles of one item, then of the next.
    """

    block_m: int = 64
    glu_block_n: int = 64
    down_block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    tail_block_m: int = 0
    down_num_stages: int = 0
    down_split_k: int = 1
    aligned: bool = False
    column_group: int = 0

    def __post_init__(self):
        for name in ("block_m", "glu_block_n", "down_block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoeGemmConfig.{name}={v} must be a power of two >= 16")
        t = self.tail_block_m
        if t and (t < 16 or t & (t - 1) or t >= self.block_m):
            raise ValueError(f"MoeGemmConfig.tail_block_m={t} must be 0 (off) or a power of two >= 16 below "
                             f"block_m={self.block_m}")
        if self.num_stages < 1 or self.down_num_stages < 0:
            raise ValueError(f"MoeGemmConfig stages must be >= 1 (down_num_stages 0 = num_stages), got "
                             f"{self.num_stages} / {self.down_num_stages}")
        if self.down_split_k < 1:
            raise ValueError(f"MoeGemmConfig.down_split_k must be >= 1, got {self.down_split_k}")
        if self.column_group < 0:
            raise ValueError(f"MoeGemmConfig.column_group must be >= 0 (0 = items first), got {self.column_group}")

    @property
    def tiling(self) -> str:
        """'bm/gn/dn/bk/warps/stages', then /tail_block_m, /down_num_stages, /down_split_k, /aligned (0 / 1) and
        /column_group as far as set (what `from_tiling` reads)."""
        fields = [self.block_m, self.glu_block_n, self.down_block_n, self.block_k, self.num_warps, self.num_stages,
                  self.tail_block_m, self.down_num_stages, self.down_split_k, int(self.aligned), self.column_group]
        defaults = (0, 0, 1, 0, 0)
        while len(fields) > 6 and fields[-1] == defaults[len(fields) - 7]:
            fields.pop()
        return "/".join(map(str, fields))

    @classmethod
    def from_tiling(cls, tiling: str) -> "MoeGemmConfig":
        """The config a `tiling` string names, e.g. 128/128/256/64/8/3/64, 16/64/64/128/4/4/0/2/2 or
        128/128/256/64/8/3/64/0/1/1."""
        parts = tiling.split("/")
        if len(parts) not in range(6, 12) or (len(parts) >= 10 and parts[9] not in ("0", "1")):
            raise ValueError(f"a tiling has 6 fields bm/gn/dn/bk/warps/stages, then optionally /tail_block_m, "
                             f"/down_num_stages, /down_split_k, /aligned (0 or 1) and /column_group; got {tiling!r}")
        values: list = [int(x) for x in parts]
        if len(values) > 9:
            values[9] = bool(values[9])  # aligned
        return cls(*values)


LARGE_GROUP_WIDE_DOWN = MoeGemmConfig(block_m=128, glu_block_n=128, down_block_n=256, block_k=64, num_warps=8,
                                      num_stages=3)
# The large-group default: the wide-down tiling with expert-aligned work items (`work_item`), 64-row MMAs for
# items of <= 64 rows (an expert's last, partial tile) and column-grouped launch order (`_item_and_column`). H200,
# benchmarks/moe.py --sweep-tokens 16384,65536 (on-device check 4.4e-3): 2026-11-30
# (docs/results/moe_mid_h200_2026-11-30e.json) global tiles with 64-row tails vs without, 294 rows/expert 3.06 vs 3.36 ms, 1172 rows/expert 10.16 vs 10.44 ms; 2026-12-02
# (docs/results/moe_aligned_h200_2026-12-02.json) aligned with tails vs global tiles with tails, same call: 2.84 vs
# 2.96-3.12 ms (54.9 vs 50.1-52.8 % of the jnp.dot peak; MMA rows / rows 1.10 vs 1.21) and 9.54 vs 9.67-9.85 ms
# (65.3 vs 63.2-64.3 %); aligned without tails 2.91 / 9.81 ms. Programs launched in groups of 8 column tiles per item
# (column_group; docs/results/moe_column_groups_h200_2026-12-02.json, four calls): 294 rows/expert 2.49-2.79 ms
# (median 2.75, 56-68 % of each run's peak) vs 2.82-3.01 ms item-first; 1172 rows/expert 8.99-9.06 vs 9.76-9.83 ms;
# groups of 2, 4, 6, 12, 16, 24 were within the run-to-run spread of 8 or slower.
LARGE_GROUP_DEFAULT = dataclasses.replace(LARGE_GROUP_WIDE_DOWN, tail_block_m=64, aligned=True, column_group=8)


# decode-sized groups (<= 16 rows per expert). The down kernel's loop is short (k3-small: 512 inputs, 4 steps of 128):
# a shallower pipeline fits more programs per SM in shared memory (20 KB a stage: 4 stages 2 programs, 2 stages 5).
# H200, 2026-12-02 (docs/results/model_decode_moe_items_h200_2026-12-02.json): k3-small decode B64, down kernels
# 1.14-1.18 ms/step at 2 stages, 1.17-1.21 at 3, 1.22 at 4 (GLU unchanged); K3 EP16 shard at 16 tokens
# (benchmarks/moe.py sweep) 0.253 / 0.261 / 0.263 ms per layer.
DECODE_CONFIG = MoeGemmConfig(block_m=16, glu_block_n=64, down_block_n=64, block_k=128, num_warps=4, num_stages=4,
                              down_num_stages=2)


# MXFP4 word-layout down kernels at decode sizes are issue-bound, and with few active experts they run too few
# programs to hide that: their contraction is cut (down_split_k) until the expected active programs reach this many,
# 20 per SM of the H200. H200, 2026-12-02 (benchmarks/moe.py, K3 EP16 shard, k4r, bf16 ms / MXFP4 ms;
# docs/benchmarks.md): 15 rows on 12 experts (~840 active programs) 1.46 at 1 slice, 1.57 / 1.60 / 1.61 at 2 / 3 / 4;
# 269 rows on 56 experts (~3140) 1.55-1.57 at 1, 1.51-1.54 at 2-4. bf16 weights (memory-bound) are 0.94-0.99x
# with slices at both sizes: never cut.
WORD_DOWN_TARGET_PROGRAMS = 20 * 132
WORD_DOWN_MAX_SPLIT = 4


def word_down_split(num_rows: int, num_experts: int, down_out: int, down_in: int, config: MoeGemmConfig) -> int:
    """down_split_k for an MXFP4 word-layout down GEMM [down_in -> down_out] at `config`'s tiles: the expected active
    programs (at most one work item per row or per expert, times the output column tiles) are cut into slices up
    to WORD_DOWN_TARGET_PROGRAMS, at most WORD_DOWN_MAX_SPLIT and the contraction's steps."""
    programs = min(num_rows, num_experts) * -(-down_out // config.down_block_n)
    steps = -(-down_in // config.block_k)
    return max(1, min(WORD_DOWN_MAX_SPLIT, steps, round(WORD_DOWN_TARGET_PROGRAMS / max(programs, 1))))


def default_config(num_rows: int, num_experts: int, word_down: tuple[int, int] | None = None) -> MoeGemmConfig:
    """Tiles by the mean rows per expert: decode-sized groups take 16-row tiles (the step is a weight
    read, so the MMA shape hardly matters and fewer padded rows are computed), large groups take 128x128
    tiles with 8 warps (best of the H200 sweep in benchmarks/moe.py at 292 rows/expert: 302 TFLOP/s, against
    274 for 128x64 GLU tiles and 280 for 64-row tiles). A 256-wide down GEMM (LARGE_GROUP_WIDE_DOWN) was faster
    in the 2026-11-30 sweep at 65536 tokens, 1170 rows/expert: 10.58 ms = 62.5 % of the jnp.dot peak against
    11.08 ms / 59.7 %, and matched the reference on the H200 (tests/gpu/test_moe_gpu.py, 2026-11-30): it is the
    default from 256 rows per expert (the issue's large-group range), where the down GEMM's 3584-wide output
    gives every 128-row item 14 wide tiles. word_down: (out, in) of an MXFP4 word-layout down weight, whose
    decode-size contraction is then cut in `word_down_split` slices."""
    per_expert = num_rows / max(num_experts, 1)
    if per_expert <= 16:
        if word_down is None:
            return DECODE_CONFIG
        split = word_down_split(num_rows, num_experts, *word_down, DECODE_CONFIG)
        return dataclasses.replace(DECODE_CONFIG, down_split_k=split)
    if per_expert <= 64:
        return MoeGemmConfig(block_m=64, glu_block_n=64, down_block_n=128, block_k=64, num_warps=4, num_stages=3)
    if per_expert >= 256:
        return LARGE_GROUP_DEFAULT
    return MoeGemmConfig(block_m=128, glu_block_n=128, down_block_n=128, block_k=64, num_warps=8, num_stages=3)


# ----------------------------------------------------------------------------------------------------
# schedule


# block_m x N_p2 x K_p2, the column-0 programs' compare in `_ranked_assignments` (decode: 16-row tiles, <= 2048 rows)
RANK_IN_KERNEL_MAX_ELEMENTS = 16 * 2048


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def ranks_in_kernel(num_tokens: int, top_k: int, block_m: int) -> bool:
    """Whether the kernels rank their own rows (`_ranked_tokens`, `_ranked_assignments`) instead of reading a sorted
    `order`: at decode sizes the sort is a ~5 us XLA kernel per MoE layer plus its launch gap (k3-small decode B64 on
    the H200, 24 per step). Measured there (2026-12-02), with every program ranking its rows by a cumulative count
    over all N * K ids and a [16, N * K] compare: the GLU kernels' time rose by about what the sort took, and the
    step got 0.10 ms faster from the 48 kernels fewer. Not timed at larger batches."""
    return block_m * _next_pow2(num_tokens) * _next_pow2(top_k) <= RANK_IN_KERNEL_MAX_ELEMENTS


def num_work_items(num_rows: int, num_experts: int, block_m: int) -> int:
    """Static bound on the (row tile, expert) pairs: every tile boundary inside a non-empty group adds one
    item beyond the tile count, and at most min(E, M) groups are non-empty."""
    return max(pl.cdiv(num_rows, block_m) + min(num_experts, num_rows) - 1, 1)


def bounds_width(num_experts: int) -> int:
    """Length of `row_bounds`: a power of two >= E (Triton vectors are power-of-two long) plus one entry."""
    return (1 << max(num_experts - 1, 0).bit_length()) + 1


def row_bounds(flat_ids: jax.Array, num_experts: int) -> jax.Array:
    """bounds [bounds_width(E)] int32: bounds[e] = number of assignments to experts < e, i.e. the first
    expert-sorted row of expert e (its rows are bounds[e] .. bounds[e+1]-1); entries past E hold the row count.

    One compare-and-count over [P, M] (a single reduction kernel): no bincount scatter and no cumsum; the GLU
    kernel's programs derive their work items from it (`work_item`) and hand them to the down kernel."""
    e = jnp.arange(bounds_width(num_experts), dtype=jnp.int32)
    return (flat_ids.astype(jnp.int32)[None, :] < e[:, None]).sum(1, dtype=jnp.int32)


def work_item(starts: jax.Array, ends: jax.Array, item, block_m: int, aligned: bool = False):
    """(tile row start, expert, first row, end row) of work item `item` (int32 scalars) from the first and one-past-
    last rows of each expert, starts = `row_bounds`[:P] and ends = `row_bounds`[1:] (P a power of two).

    Items are the (row tile, expert) pairs that overlap, ordered by expert, then by tile, so consecutive programs
    reuse one expert's weights; items past the real count have first row == end row == 0 (the kernels skip them).
    aligned: an expert's tiles start at its first row instead (tile start = first row; cdiv(rows, block_m) items,
    never more than the global tiles give, so `num_work_items` bounds both); a tile may then reach block_m - 1
    rows past the last row, which the callers' row buffers cover (`moe_grouped_mlp` pads them by block_m).
    Plain jnp on the two power-of-two vectors, so the same code runs inside the Triton GLU
    kernel (a few P-wide vector ops per program, P = 256 for 192 experts) and in `tile_schedule`. Expert lookups
    are compare-and-count and one-hot sums (no gather, no while loop: Triton has neither)."""
    p = starts.shape[0]
    sizes = ends - starts
    if aligned:
        count = jax.lax.div(sizes + block_m - 1, block_m)  # non-negative: truncation is floor; 0 for an empty one
    else:
        first_tile = jax.lax.div(starts, block_m)  # non-negative: truncation is floor
        count = jnp.where(sizes > 0, jax.lax.div(jnp.maximum(ends - 1, 0), block_m) - first_tile + 1, 0)
    item_end = jnp.cumsum(count)
    num_items = jnp.sum(count)
    expert = jnp.minimum(jnp.sum((item_end <= item).astype(jnp.int32)), p - 1)
    pick = jnp.arange(p, dtype=jnp.int32) == expert

    def at_expert(v):
        return jnp.sum(jnp.where(pick, v, 0))

    local = item - at_expert(item_end - count)  # the item's index among its expert's
    start = at_expert(starts)
    row0 = start + local * block_m if aligned else (at_expert(first_tile) + local) * block_m
    valid = item < num_items
    lo = jnp.where(valid, jnp.maximum(start, row0), 0)
    hi = jnp.where(valid, jnp.minimum(at_expert(ends), row0 + block_m), 0)
    return jnp.where(valid, row0, 0), expert, lo, hi


def tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int, aligned: bool = False) -> jax.Array:
    """All work items [4, W] int32 (tile row start, expert, first row, end row), W = `num_work_items`, for
    expert-sorted rows with group_sizes [E] int32 (summing to <= num_rows): the table the GLU kernel's programs
    compute with `work_item` and hand to the down kernel (here for tests and benchmarks/moe.py's MMA-row count)."""
    e = group_sizes.shape[0]
    p = bounds_width(e) - 1
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    bounds = jnp.concatenate([jnp.zeros(1, jnp.int32), ends, jnp.full(p - e, ends[-1], jnp.int32)])
    items = jnp.arange(num_work_items(num_rows, e, block_m), dtype=jnp.int32)
    row0, expert, lo, hi = jax.vmap(lambda w: work_item(bounds[:p], bounds[1:], w, block_m, aligned))(items)
    return jnp.stack([row0, jnp.minimum(expert, e - 1), lo, hi]).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------
# in-kernel weight tiles


def _e2m1_to_f32(codes: jax.Array) -> jax.Array:
    """E2M1 codes (int32, 0..15) -> float32 values, by bit construction (no table: Triton has no register
    gather). Magnitude m = codes & 7 is exponent e = m >> 1 and mantissa bit m & 1; for e >= 1 the value is
    2^(e-1) * (1 + (m & 1) / 2), which is the float32 with exponent field e + 126 and mantissa bit 22 set
    from m & 1, i.e. bits (m << 22) + (126 << 23). The two subnormal codes m = 0, 1 are 0 and 0.5 = m / 2."""
    mag = codes & 7
    normal = jax.lax.bitcast_convert_type((mag << 22) + (126 << 23), jnp.float32)
    value = jnp.where(mag < 2, mag.astype(jnp.float32) * 0.5, normal)
    return jnp.where((codes & 8) != 0, -value, value)


def _e8m0_to_f32(scale: jax.Array) -> jax.Array:
    """E8M0 exponents (int32) -> 2^(s-127) as the float32 with exponent field s (s = 0 maps to 0, not
    2^-127; 0xFF to inf, not NaN -- neither occurs in trained weights)."""
    return jax.lax.bitcast_convert_type(scale << 23, jnp.float32)


def _dequant_tile(packed: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """packed [n, k/2] uint8, scale [n, k/32] uint8 -> weight tile [n, k] in dtype (in-kernel MXFP4)."""
    n, half = packed.shape
    k = 2 * half
    p = packed.astype(jnp.int32)
    codes = jnp.stack([p & 0x0F, p >> 4], axis=-1).reshape(n, k)  # element 2j is the low nibble
    factors = _e8m0_to_f32(scale.astype(jnp.int32))  # [n, k/32]
    factors = jnp.broadcast_to(factors[:, :, None], (n, k // MXFP4_GROUP, MXFP4_GROUP)).reshape(n, k)
    return (_e2m1_to_f32(codes) * factors).astype(dtype)


PLANE_BLOCK = 2 * MXFP4_GROUP  # inputs per byte block of the kernel layout (one group per nibble plane)
# F16 bit placement decodes E2M1 code m to E2M1(m) * 2^-14 (code 1 = 2^-15 is an f16 subnormal, exact through
# the hardware f16 -> f32 conversion); the 2^14 is folded into the group scale
_PLANE_BIAS = 2.0**14
# benchmark variant name (benchmarks/moe.py --mxfp4-variants) -> the MXFP4 layout it runs on
MXFP4_VARIANTS = {"interleave": "hf", "kmajor": "kn", "k4": "k4", "k4r": "k4r"}
# layout -> its dict keys (packed nibbles, E8M0 scales)
MXFP4_LAYOUT_KEYS = {"hf": ("packed", "scale"), "kn": ("planes_kn", "scales_gn"), "k4": ("planes_k4", "scale_words"),
                     "k4r": ("planes_k4r", "scale_words")}
# the layouts `prepare_mxfp4` makes (cut in PLANE_BLOCK-input blocks)
KERNEL_LAYOUTS = ("kn", "k4", "k4r")


def mxfp4_layout(w) -> str:
    """"float" (an array), "hf" ({"packed", "scale"}: the checkpoint's), "kn" ({"planes_kn", "scales_gn"}:
    `prepare_mxfp4`'s kernel layout) or its word layouts "k4" ({"planes_k4", "scale_words"}) and "k4r"
    ({"planes_k4r", "scale_words"}); ValueError for a dict of other keys."""
    if not isinstance(w, dict):
        return "float"
    for layout, keys in MXFP4_LAYOUT_KEYS.items():
        if set(w) == set(keys):
            return layout
    raise ValueError(f"MXFP4 weight keys {sorted(w)} match no layout of {MXFP4_LAYOUT_KEYS}")


def word_layout_for(scale) -> str:
    """The faster word layout that holds MXFP4 weights with these E8M0 scales exactly (numpy or concrete jax): "k4r"
    when every scale is <= K4R_MAX_SCALE (2^1: weights up to 12 in magnitude), else "k4"."""
    return "k4r" if int(scale.max()) <= K4R_MAX_SCALE else "k4"


def _xp(a):
    """numpy for numpy arrays (host-side repacking at load time), jax.numpy otherwise (also under jit)."""
    return np if isinstance(a, np.ndarray) else jnp


def prepare_mxfp4(w: dict, layout: str = "kn") -> dict:
    """MXFP4 weight in the checkpoint's layout -> a kernel layout, once at load time (exact: a re-packing).

    w: {"packed": [E, out, in/2] uint8 (input 2j in the low nibble of byte j), "scale": [E, out, in/32] uint8}
    (k3jax.quant, HF orientation), numpy (result numpy) or jax arrays; in must be a multiple of PLANE_BLOCK (64).
    Returns {"planes_kn": [E, in/2, out], "scales_gn": [E, in/32, out]} with the nibbles de-interleaved per
    block of 64 inputs: the low nibbles of a block are its first 32 inputs = one scale group, the high nibbles
    the next 32 = the next group, so each nibble plane decodes straight into an MMA operand with a single
    scale per output column. layout="k4" / "k4r": {"planes_k4" | "planes_k4r": [E, in/8, 4 * out], "scale_words":
    [E, ceil(in/128), out] uint32}, the same codes as 32-bit words (`_k4_words`, module docstring) and four groups'
    scales per word as the bf16 exponent fields of their factors (`_scale_words`); "k4r" raises ValueError for E8M0
    scales above K4R_MAX_SCALE (its scale 2^(s-1) must be a finite bf16; needs concrete scales, not traced ones).
    `mxfp4_checkpoint_layout` is the inverse of all three.
    """
    if layout not in KERNEL_LAYOUTS:
        raise ValueError(f"layout must be one of {KERNEL_LAYOUTS}, got {layout!r}")
    if mxfp4_layout(w) != "hf":
        raise ValueError(f"prepare_mxfp4 takes the checkpoint layout {{'packed', 'scale'}}, got {sorted(w)}")
    e, n_in, n_out = expert_weight_dims(w)
    if n_in % PLANE_BLOCK:
        raise ValueError(f"input dim {n_in} must be a multiple of {PLANE_BLOCK} for the kernel layout")
    packed, scale = w["packed"], w["scale"]
    xp = _xp(packed)
    codes = xp.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(e, n_out, n_in)  # input order
    if layout == "k4r" and word_layout_for(scale) != "k4r":
        raise ValueError(f"layout k4r takes E8M0 scales up to {K4R_MAX_SCALE} (2^1), got {int(scale.max())}: use k4")
    if layout in WORD_LAYOUTS:
        return {f"planes_{layout}": _k4_words(codes, layout),
                "scale_words": _scale_words(scale, layout).swapaxes(-1, -2)}
    blocks = codes.reshape(e, n_out, n_in // PLANE_BLOCK, 2, PLANE_BLOCK // 2)
    planes = (blocks[..., 0, :] | (blocks[..., 1, :] << 4)).reshape(e, n_out, n_in // 2)
    return {"planes_kn": planes.swapaxes(-1, -2), "scales_gn": scale.swapaxes(-1, -2)}


def mxfp4_checkpoint_layout(w: dict) -> dict:
    """The inverse of `prepare_mxfp4` (exact): {"planes_kn", "scales_gn"} or {"planes_k4" | "planes_k4r",
    "scale_words"} -> {"packed": [E, out, in/2], "scale": [E, out, in/32]}, numpy or jax arrays; a checkpoint-layout
    dict is returned as it is."""
    layout = mxfp4_layout(w)
    if layout == "hf":
        return w
    if layout not in KERNEL_LAYOUTS:
        raise ValueError("mxfp4_checkpoint_layout takes an MXFP4 dict")
    e, n_in, n_out = expert_weight_dims(w)
    if layout in WORD_LAYOUTS:
        codes = _k4_codes(w[f"planes_{layout}"], layout)  # [E, out, in], input order
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        scale = _scale_bytes(w["scale_words"].swapaxes(-1, -2), layout, n_in // MXFP4_GROUP)
        return {"packed": packed.astype(np.uint8), "scale": scale}
    planes = w["planes_kn"].swapaxes(-1, -2).reshape(e, n_out, n_in // PLANE_BLOCK, PLANE_BLOCK // 2)
    xp = _xp(planes)
    codes = xp.concatenate([planes & 0x0F, planes >> 4], axis=-1).reshape(e, n_out, n_in)  # input order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return {"packed": packed, "scale": w["scales_gn"].swapaxes(-1, -2)}


# a word layout's decoded bf16 weight times 2^(field - 127) is the weight: the scale words hold field = s + bias
_WORD_SCALE_BIAS = {"k4": 0, "k4r": 126}  # k4 decodes E2M1 exactly; k4r as E2M1 * 2^-126
SCALE_WORD_INPUTS = 4 * MXFP4_GROUP  # inputs per scale word: 128


def _scale_words(scale, layout: str):
    """E8M0 scales [..., in/32] uint8 -> the word layout's scale words [..., ceil(in/128)] uint32: byte g of word b the
    bf16 exponent field of the factor of inputs 128b + 32g .. + 31 (s + _WORD_SCALE_BIAS[layout]; missing groups of
    a last, half word are 0). One word per two 64-input blocks and column, not four bytes: the kernel loads one word
    per k-step and a shift and a mask (`_word_factors`) give two groups' factors, one per 16-bit half, which the
    bf16 multiply takes as they are. Offline (K3 EP16, decode tiling) the GLU / down loops' SASS per k-step: a byte
    per group (before) 546 / 288; scale words 505 / 265 (523 / 284 with the split written in jnp, which LLVM narrows
    to a shift and mask per half); 16-bit words of two groups 541 / 299; precomputed bf16 factors in 32-bit pairs
    (twice the scale bytes) 496 / 259."""
    xp = _xp(scale)
    groups = scale.shape[-1]
    fields = scale.astype(xp.uint32) + _WORD_SCALE_BIAS[layout]
    pad = -groups % 4
    if pad:
        fields = xp.concatenate([fields, xp.zeros((*fields.shape[:-1], pad), xp.uint32)], axis=-1)
    fields = fields.reshape(*fields.shape[:-1], -1, 4)
    return fields[..., 0] | (fields[..., 1] << 8) | (fields[..., 2] << 16) | (fields[..., 3] << 24)


def _scale_bytes(words, layout: str, groups: int):
    """The inverse of `_scale_words`: [..., ceil(in/128)] uint32 -> E8M0 scales [..., groups = in/32] uint8."""
    xp = _xp(words)
    fields = xp.stack([(words >> (8 * g)) & 0xFF for g in range(4)], axis=-1).reshape(*words.shape[:-1], -1)
    return (fields[..., :groups] - _WORD_SCALE_BIAS[layout]).astype(xp.uint8)


# scale word ($1) -> groups 0 / 2 (evens) or 1 / 3 (odds) on the exponent bits of the low / high halves ($0). Inline,
# because LLVM narrows the jnp statement of it to a shift and mask per 16-bit half (what the multiply takes), where
# the asm's 32-bit result leaves each half to be selected by the bf16 multiply's operand (.H0_H0 / .H1_H1) for free
_SCALE_FIELDS_ASM = {"evens": "{ shl.b32 $0, $1, 7; and.b32 $0, $0, 0x7F807F80; }",
                     "odds": "{ shr.b32 $0, $1, 1; and.b32 $0, $0, 0x7F807F80; }"}


def _word_factors(words: jax.Array, high: bool, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """Scale words [block_n] uint32 -> the bf16 factors [block_n] of the two planes of the word's first (high=False,
    groups 0 and 1) or second 64-input block (groups 2 and 3): a shift and a mask put groups 0 / 2 (and 1 / 3) on
    the exponent bits of the low / high half, and the half is the bf16 (`_SCALE_FIELDS_ASM` on the GPU)."""
    if interpret:
        evens, odds = (words << 7) & 0x7F807F80, (words >> 1) & 0x7F807F80
    else:
        out = [jax.ShapeDtypeStruct(words.shape, jnp.int32)]  # Triton's asm results are signless
        evens, odds = (plgpu.elementwise_inline_asm(_SCALE_FIELDS_ASM[k], args=[words], constraints="=r,r", pack=1,
                                                    result_shape_dtypes=out)[0] for k in ("evens", "odds"))
    half = (lambda v: v >> 16) if high else (lambda v: v & 0xFFFF)
    return tuple(jax.lax.bitcast_convert_type(half(v).astype(jnp.uint16), jnp.bfloat16) for v in (evens, odds))


# k4 word: bit of the sign of c0 c1 c2 c3 (low plane, inputs 4j + r) and d0 d1 d2 d3 (high plane, 32 + 4j + r); the
# magnitudes sit in nibbles 0-3 (c) and 4-7 (d). Chosen so that one `and 0x7777` (after a 16-bit shift for the
# high plane) gives four PRMT selectors and each sign lands on bit 15 / 31 of its bf16 pair with one shift
_K4_SIGN_BITS = (15, 31, 11, 27, 7, 23, 3, 19)

# k4r word: the same 8 codes as k4's word j, placed for a decode by rotation and mask. A bf16 pair (rows 4j + 2i,
# 4j + 2i + 1 of a plane, in the low / high half) wants each magnitude m = e e f on bits 8..6 / 24..22 (e on the
# exponent's two low bits, f on the mantissa's top bit: the bf16 E2M1(m) * 2^-126, m = 1 the subnormal 2^-127) and
# its sign on bit 15 / 31. Pair (plane, i) stores its magnitudes there rotated left by r and its signs rotated left
# by q, (r, q) = _K4R_ROTATIONS[plane][i]: decoded, a pair is one or two right rotations and masks. Of all tilings of
# the 32 bits by four such pairs, this one needs the fewest instructions (11 per word: plane 0 = 5, plane 1 = 6).
_K4R_ROTATIONS = (((0, 0), (3, 1)), ((6, 6), (11, 5)))
_K4R_MAGNITUDE_MASK, _K4R_SIGN_MASK = 0x01C001C0, 0x80008000
WORD_LAYOUTS = ("k4", "k4r")  # kernel layouts of 32-bit words [E, in/8, 4 * out], 8 codes each
K4R_MAX_SCALE = 128  # k4r folds 2^126 into the scale: 2^(s-1) must be a finite bf16


def _rotl(x, n: int):
    n %= 32
    return x if n == 0 else (x << n) | (x >> (32 - n))


def _word_bits(layout: str, plane: int, r: int) -> tuple[int, int]:
    """Where code r (0..3) of a plane sits in a word of `layout`: (the bit of its magnitude's bit 0 -- bits 1 and 2
    follow, mod 32 --, its sign bit)."""
    if layout == "k4":
        return 16 * plane + 4 * r, _K4_SIGN_BITS[4 * plane + r]
    rot_m, rot_s = _K4R_ROTATIONS[plane][r // 2]
    half = 16 * (r % 2)
    return (6 + half + rot_m) % 32, (15 + half + rot_s) % 32


def _k4_words(codes, layout: str = "k4"):
    """E2M1 codes [E, out, in] (0..15, input order, in a multiple of 64; numpy or jax) -> the words of a word layout
    (k4 / k4r) as bytes [E, in/8, 4 * out] uint8: row 8b + j, columns 4n .. 4n + 3 = word j of block b, column n,
    little-endian."""
    xp = _xp(codes)
    e, n_out, n_in = codes.shape
    blocks = codes.astype(xp.uint32).reshape(e, n_out, n_in // PLANE_BLOCK, 2, 8, 4)  # [.., plane, j, r]
    words = xp.zeros((e, n_out, n_in // PLANE_BLOCK, 8), xp.uint32)
    for plane in (0, 1):
        for r in range(4):
            code = blocks[..., plane, :, r]
            mag_bit, sign_bit = _word_bits(layout, plane, r)
            words = words | _rotl(code & 7, mag_bit) | ((code >> 3) << sign_bit)
    octets = xp.stack([(words >> (8 * i)) & 0xFF for i in range(4)], axis=-1).astype(xp.uint8)  # [E, out, B, 8, 4]
    return octets.transpose(0, 2, 3, 1, 4).reshape(e, n_in // 8, 4 * n_out)


def _k4_codes(planes, layout: str = "k4"):
    """The inverse of `_k4_words`: [E, in/8, 4 * out] uint8 -> codes [E, out, in] uint8 in input order."""
    xp = _xp(planes)
    e, rows, width = planes.shape
    octets = planes.astype(xp.uint32).reshape(e, rows // 8, 8, width // 4, 4)
    words = octets[..., 0] | (octets[..., 1] << 8) | (octets[..., 2] << 16) | (octets[..., 3] << 24)  # [E, B, 8, out]

    def code(p, r):
        mag_bit, sign_bit = _word_bits(layout, p, r)
        return (_rotl(words, -mag_bit) & 7) | (((words >> sign_bit) & 1) << 3)

    codes = xp.stack([xp.stack([code(p, r) for r in range(4)], axis=-1) for p in (0, 1)], axis=-2)
    return codes.transpose(0, 3, 1, 4, 2, 5).reshape(e, width // 4, 8 * rows).astype(xp.uint8)


def _k4r_asm(plane: int) -> str:
    """The k4r decode of one plane of a word ($2) into its two bf16 pairs ($0: rows 4j, 4j+1; $1: 4j+2, 4j+3), as
    E2M1 * 2^-126 (the 2^126 is folded into the group scale): per pair a right rotation by r (and by q when the
    signs sit elsewhere) and masks. ptxas fuses each and / or pair into one LOP3."""
    lines = []
    for out, (r, q) in enumerate(_K4R_ROTATIONS[plane]):
        rot = "$2" if r == 0 else "m"
        if r:
            lines.append(f"shf.r.wrap.b32 m, $2, $2, {r};")
        if r == q:
            lines.append(f"and.b32 ${out}, {rot}, {_K4R_MAGNITUDE_MASK | _K4R_SIGN_MASK:#010x};")
            continue
        lines.append(f"shf.r.wrap.b32 s, $2, $2, {q};" if q else "mov.b32 s, $2;")
        lines.append(f"and.b32 s, s, {_K4R_SIGN_MASK:#010x};")
        lines.append(f"and.b32 m, {rot}, {_K4R_MAGNITUDE_MASK:#010x};")
        lines.append(f"or.b32 ${out}, m, s;")
    return "{\n.reg .b32 m, s;\n" + "\n".join(lines) + "\n}"


def _k4r_bits(words: jax.Array, plane: int) -> tuple[jax.Array, jax.Array]:
    """What `_k4r_asm(plane)` computes, in jnp on uint32 words: ($0, $1), the placed bf16 bits of rows (4j, 4j+1)
    and (4j+2, 4j+3) in the (low, high) halves."""
    out = []
    for r, q in _K4R_ROTATIONS[plane]:
        mags = _rotl(words, -r) & jnp.uint32(_K4R_MAGNITUDE_MASK)
        out.append(mags | (_rotl(words, -q) & jnp.uint32(_K4R_SIGN_MASK)))
    return out[0], out[1]


# The k4 decode, 4 weights of one plane per asm instance ($2: one word, pack=4; $0 / $1: bf16 pairs of rows 4j, 4j+1
# / 4j+2, 4j+3). Byte table T = {00, 3F, 40, 80, C0} (0x80403F00, 0x000000C0) and index table
# T2[m] = hi << 4 | lo (0x14131000, 0x24232220): the bf16 of E2M1 magnitude m is T[hi] T[lo] (0x0000, 0x3F00 = 0.5,
# 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0 = 6). Per plane: mask the magnitudes to selectors, one PRMT to
# table indices, two PRMTs to the bf16 pairs, the signs shifted onto bits 15 / 31 (code 8 gives -0, as E2M1 does).
_K4_INDEX = (0x14131000, 0x24232220)
_K4_BYTES = (0x80403F00, 0x000000C0)
_K4_SIGN_SHIFTS = ((0, 4), (8, 12))  # plane -> left shifts putting the signs of (rows 0, 1) and (2, 3) on 15 / 31
_K4_LUT_ASM = {
    0: """{
.reg .b32 m, i, t;
and.b32 m, $2, 0x7777;
prmt.b32 i, 0x14131000, 0x24232220, m;
prmt.b32 $0, 0x80403F00, 0x000000C0, i;
and.b32 t, $2, 0x80008000; or.b32 $0, $0, t;
shr.b32 i, i, 16;
prmt.b32 $1, 0x80403F00, 0x000000C0, i;
shl.b32 t, $2, 4; and.b32 t, t, 0x80008000; or.b32 $1, $1, t;
}""",
    1: """{
.reg .b32 m, i, t;
shr.b32 m, $2, 16; and.b32 m, m, 0x7777;
prmt.b32 i, 0x14131000, 0x24232220, m;
prmt.b32 $0, 0x80403F00, 0x000000C0, i;
shl.b32 t, $2, 8; and.b32 t, t, 0x80008000; or.b32 $0, $0, t;
shr.b32 i, i, 16;
prmt.b32 $1, 0x80403F00, 0x000000C0, i;
shl.b32 t, $2, 12; and.b32 t, t, 0x80008000; or.b32 $1, $1, t;
}"""}


def _prmt(lo: int, hi: int, selector: jax.Array) -> jax.Array:
    """PTX `prmt.b32 d, lo, hi, selector` (default mode) for constant lo / hi, in jnp on uint32: byte l of d is byte
    (selector nibble l) of the 8 bytes hi:lo. Nibble bit 3 (sign replication) is clear in every use here."""
    out = jnp.zeros_like(selector)
    for lane in range(4):
        n = (selector >> (4 * lane)) & 7
        shift = (n & 3) * 8
        byte = jnp.where(n < 4, jnp.uint32(lo) >> shift, jnp.uint32(hi) >> shift) & 0xFF
        out = out | (byte << (8 * lane))
    return out


def _k4_lut_bits(words: jax.Array, plane: int) -> tuple[jax.Array, jax.Array]:
    """What `_K4_LUT_ASM[plane]` computes, step for step, in jnp on uint32 words ($2): ($0, $1), the bf16 bits of
    rows (4j, 4j+1) and (4j+2, 4j+3) in the (low, high) halves. The interpret-mode decode and the asm's reference."""
    m = (words >> (16 * plane)) & 0x7777
    i = _prmt(*_K4_INDEX, m)
    signs = [(words << s) & jnp.uint32(0x80008000) for s in _K4_SIGN_SHIFTS[plane]]
    return _prmt(*_K4_BYTES, i) | signs[0], _prmt(*_K4_BYTES, i >> 16) | signs[1]


def _word_tile(raw: jax.Array, plane: int, factor: jax.Array, layout: str, interpret: bool) -> jax.Array:
    """One plane of a 64-input block of a word layout (k4 / k4r): bytes [8, 4 * block_n] uint8 and the plane's bf16
    factors [block_n] (`_word_factors`) -> the weight tile [32, block_n] bf16 (row 4j + r = input 4j + r of the
    plane's 32), E2M1 times its scale: exact, the product of a 2-bit significand and a power of two.

    GPU: the bytes viewed as [32, block_n] (row 4j + i = byte i of word j: a free reshape/transpose in Triton's
    linear layouts, each thread's kWidth=4 operand bytes one register), one inline-PTX instance per word
    (pack=4: element i in byte i of $2, output elements 0..3 in the low / high halves of $0, $1), then one bf16
    multiply by the factor: k4 decodes exact E2M1 by `_K4_LUT_ASM` (the factor 2^(s-127)), k4r places E2M1 * 2^-126
    by `_k4r_asm` (the factor 2^(s-1): E8M0 s <= 128, which `prepare_mxfp4` checks). Interpreted: the same word bits
    in jnp (`_k4_lut_bits`, `_k4r_bits`), values in float32 (XLA:CPU flushes the subnormals k4r's placement relies
    on). E8M0 s = 0 scales by 0 (as `_e8m0_to_f32`) except on the GPU in k4r: 2^-127, its true value."""
    block_n = raw.shape[1] // 4
    if not interpret:
        packed = raw.reshape(8, block_n, 4).swapaxes(1, 2).reshape(4 * 8, block_n)
        asm = _K4_LUT_ASM[plane] if layout == "k4" else _k4r_asm(plane)
        tile = plgpu.elementwise_inline_asm(asm, args=[packed], constraints="=r,=r,r", pack=4,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)])[0]
        return tile * factor[None, :]
    octets = raw.reshape(8, block_n, 4).astype(jnp.uint32)
    words = octets[..., 0] | (octets[..., 1] << 8) | (octets[..., 2] << 16) | (octets[..., 3] << 24)  # [8, block_n]
    lo, hi = (_k4_lut_bits if layout == "k4" else _k4r_bits)(words, plane)
    halves = jnp.stack([lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16], axis=1).reshape(32, block_n)
    if layout == "k4":
        values = jax.lax.bitcast_convert_type(halves.astype(jnp.uint16), jnp.bfloat16).astype(jnp.float32)
    else:  # the placed bits back to the code: magnitude on bits 8..6, sign on bit 15
        values = _e2m1_to_f32((((halves >> 6) & 7) | ((halves >> 12) & 8)).astype(jnp.int32))
    field = jax.lax.bitcast_convert_type(factor, jnp.uint16).astype(jnp.int32) >> 7
    s = jnp.maximum(field - _WORD_SCALE_BIAS[layout], 0)  # a padded word's field 0 (zero codes) stays finite
    return (values * _e8m0_to_f32(s)[None, :]).astype(jnp.bfloat16)


def _decode_plane(packed: jax.Array, high: bool) -> jax.Array:
    """One nibble plane of a uint8 tile -> E2M1 * 2^-14 as float16, by bit placement alone: the magnitude
    m = e e f lands on f16 bits 9..11 (exponent field e, mantissa msb f: 2^(e-15)(1 + f/2) = E2M1(m) 2^-14
    for e >= 1, and the f16 subnormal f/2 * 2^-14 for e = 0), the sign on bit 15. ~5 integer ops a weight;
    no select, no arithmetic on a subnormal (XLA:CPU flushes bf16/f32 subnormals in multiplies, which is why
    the bf16 placement E2M1 * 2^-126 was not used)."""
    b = packed.astype(jnp.uint16)
    if high:
        bits = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    else:
        bits = ((b & 0x07) << 9) | ((b & 0x08) << 12)
    return jax.lax.bitcast_convert_type(bits, jnp.float16)


class _WeightRefs:
    """One expert weight operand: float [E, K, N] refs, MXFP4 packed [E, N, K/2] + scale [E, N, K/32] refs
    (checkpoint layout "hf"), or a kernel layout: "kn" (planes [E, K/2, N] + scales [E, K/32, N]) or a word layout
    "k4" / "k4r" (words [E, K/8, 4N] + scale words [E, ceil(K/128), N] uint32). interpret: the kernel runs
    interpreted (word layouts: jnp decodes instead of inline asm)."""

    def __init__(self, refs, layout: str, interpret: bool = False):
        self.refs, self.layout, self.interpret = refs, layout, interpret

    def accumulate(self, acc, a_ref, rows, expert, k0, n0, block_k: int, block_n: int):
        """acc [block_m, block_n] fp32 + a[rows, k0:k0+block_k] @ W[expert, k0:k0+block_k, n0:n0+block_n];
        rows: block_m contiguous rows (pl.ds) or an int32 vector of block_m row ids (a gather of a's rows)."""
        if self.layout == "float":
            (w_ref,) = self.refs
            a = a_ref[rows, pl.ds(k0, block_k)]  # [block_m, block_k]
            w = w_ref[expert, pl.ds(k0, block_k), pl.ds(n0, block_n)].astype(a.dtype)  # [block_k, block_n]
            return acc + jnp.dot(a, w, preferred_element_type=jnp.float32)
        if self.layout == "hf":
            # the whole [block_n, block_k] tile is decoded in registers (nibbles interleaved back into input
            # order, times the broadcast group scales) and fed to the MMA as a transposed operand
            packed_ref, scale_ref = self.refs
            a = a_ref[rows, pl.ds(k0, block_k)]  # [block_m, block_k]
            packed = packed_ref[expert, pl.ds(n0, block_n), pl.ds(k0 // 2, block_k // 2)]  # [block_n, block_k/2]
            scale = scale_ref[expert, pl.ds(n0, block_n), pl.ds(k0 // MXFP4_GROUP, block_k // MXFP4_GROUP)]
            w = _dequant_tile(packed, scale, a.dtype)  # [block_n, block_k]
            return acc + jnp.dot(a, w.T, preferred_element_type=jnp.float32)
        # kernel layouts: per 64-input block one byte tile, two nibble planes = two scale groups
        planes_ref, scales_ref = self.refs
        half = PLANE_BLOCK // 2
        words = self.layout in WORD_LAYOUTS
        for c in range(block_k // PLANE_BLOCK):
            kc = k0 + c * PLANE_BLOCK
            if words:  # 8 words per column, 4 adjacent bytes each: [8, 4 * block_n]
                raw = planes_ref[expert, pl.ds(kc // 8, 8), pl.ds(4 * n0, 4 * block_n)]
                if c % 2 == 0:  # one scale word per 128 inputs: [block_n] uint32
                    scale_words = scales_ref[expert, kc // SCALE_WORD_INPUTS, pl.ds(n0, block_n)]
                if block_k % SCALE_WORD_INPUTS == 0:  # k0 is a multiple of 128: block c is the word's half c % 2
                    factors = _word_factors(scale_words, c % 2 == 1, self.interpret)
                else:  # block_k 64: the block's half of its word is known at run time
                    half_shift = (kc & PLANE_BLOCK).astype(jnp.uint32) >> 2  # 16 for a word's second block, else 0
                    factors = _word_factors(scale_words >> half_shift, False, self.interpret)
            else:
                packed = planes_ref[expert, pl.ds(kc // 2, half), pl.ds(n0, block_n)]  # [32, block_n]
            for plane in (0, 1):
                a = a_ref[rows, pl.ds(kc + plane * half, half)]  # [block_m, 32]
                if words:
                    # the scale on the bf16 weights (exact): no fp32 work per group, and the scale loads feed the
                    # MMA operand, so Triton pipelines them with the weights (on the partial products they were
                    # a synchronous global load each step)
                    w = _word_tile(raw, plane, factors[plane], self.layout, self.interpret)
                    acc = acc + jnp.dot(a, w.astype(a.dtype), preferred_element_type=jnp.float32)
                    continue
                s = scales_ref[expert, kc // MXFP4_GROUP + plane, pl.ds(n0, block_n)]  # [block_n]
                factor = _e8m0_to_f32(s.astype(jnp.int32)) * _PLANE_BIAS  # the kn decode's 2^-14, undone below
                w = _decode_plane(packed, plane == 1).astype(a.dtype)  # E2M1 * 2^-14, exact in f16, bf16, f32
                part = jnp.dot(a, w, preferred_element_type=jnp.float32)  # [block_m, block_n]
                acc = acc + part * factor[None, :]
        return acc


# ----------------------------------------------------------------------------------------------------
# kernels


def _grouped_glu_kernel(bounds_ref, order_ref, x_ref, *rest, gate_layout: str, up_layout: str, config: MoeGemmConfig,
                        top_k: int, in_dim: int, block_n: int, block_k: int, activation: str, beta: float,
                        linear_beta: float | None, ranked: bool, interpret: bool = False):
    # bounds_ref [P + 1] int32 first expert-sorted row of each expert (`row_bounds`)
    # order_ref  [M_pad] int32 assignment (token * top_k + slot) of each expert-sorted row (pad rows: M);
    #            ranked: [N_p2, K_p2] int32 the expert ids instead (-1 padded), the rows ranked here: every program
    #            finds its rows' tokens (`_ranked_tokens`), column 0 their assignments (`_ranked_assignments`)
    # x_ref      [N, >= in_dim] tokens (columns past in_dim unread); rows gathered by token = assignment // top_k
    # rest: gate refs ([E, K_pad, I_pad] | packed [E, I_pad, K_pad/2] u8 + scale [E, I_pad, K_pad/32] u8 |
    #       planes [E, K_pad/2, I_pad] u8 + scales [E, K_pad/32, I_pad] u8 |
    #       words [E, K_pad/8, 4 I_pad] u8 + scale words [E, ceil(K_pad/128), I_pad] u32),
    #       up refs (same layout), h_ref [M_pad, I_pad] output in expert-sorted row order, items_ref [4, W] int32
    #       output: each work item's (tile row start, expert, first row, end row), for the down kernel; ranked: then
    #       order_out_ref [M_pad] int32, each stored row's assignment (rows of no item stay unwritten)
    n_gate = 1 if gate_layout == "float" else 2
    n_up = 1 if up_layout == "float" else 2
    gate = _WeightRefs(rest[:n_gate], gate_layout, interpret)
    up = _WeightRefs(rest[n_gate:n_gate + n_up], up_layout, interpret)
    h_ref, items_ref = rest[n_gate + n_up:n_gate + n_up + 2]
    item, col = _item_and_column(items_ref.shape[1], h_ref.shape[1] // block_n, config.column_group)

    def tile(row_start, rows, expert, lo, hi):  # rows x block_n outputs from row_start; stores rows lo..hi-1
        n0 = col * block_n
        if ranked:
            wanted, before, per_token, mine = _expert_rows(order_ref, bounds_ref, row_start, rows, expert, top_k)
            token = _ranked_tokens(wanted, before, per_token)  # [rows] rows of x

            def hand_on():  # the item's first column program hands its rows' assignments on to the down kernel
                row_ids = row_start + jnp.arange(rows)
                plgpu.store(rest[n_gate + n_up + 2].at[pl.ds(row_start, rows)],
                            _ranked_assignments(wanted, before, mine, top_k), mask=(row_ids >= lo) & (row_ids < hi))

            pl.when(col == 0)(hand_on)
        else:
            last = x_ref.shape[0] * top_k - 1  # pad rows (assignment M) read the last token; never stored
            token = jax.lax.div(jnp.minimum(order_ref[pl.ds(row_start, rows)], last), top_k)  # [rows] rows of x

        def step(kb, carry):
            acc_gate, acc_up = carry
            k0 = kb * block_k
            acc_gate = gate.accumulate(acc_gate, x_ref, token, expert, k0, n0, block_k, block_n)
            acc_up = up.accumulate(acc_up, x_ref, token, expert, k0, n0, block_k, block_n)
            return acc_gate, acc_up

        zeros = jnp.zeros((rows, block_n), jnp.float32)
        acc_gate, acc_up = jax.lax.fori_loop(0, in_dim // block_k, step, (zeros, zeros))
        h = _glu(acc_gate, acc_up, activation, beta, linear_beta).astype(h_ref.dtype)
        row_ids = row_start + jnp.arange(rows)
        keep = jnp.broadcast_to(((row_ids >= lo) & (row_ids < hi))[:, None], (rows, block_n))
        plgpu.store(h_ref.at[pl.ds(row_start, rows), pl.ds(n0, block_n)], h, mask=keep)

    p = bounds_ref.shape[0] - 1
    entry = work_item(bounds_ref[pl.ds(0, p)], bounds_ref[pl.ds(1, p)], item, config.block_m, config.aligned)

    def hand_on_item():  # the down kernel reads its item instead of deriving it again from the bounds
        for i, v in enumerate(entry):
            items_ref[i, item] = v

    pl.when(col == 0)(hand_on_item)
    _for_item_rows(*entry, config, tile)


def _grouped_down_kernel(items_ref, order_ref, routing_ref, h_ref, *rest, layout: str, config: MoeGemmConfig,
                         block_n: int, block_k: int, split_steps: int, interpret: bool = False):
    # items_ref   [4, W] int32 each work item's (tile row start, expert, first row, end row): the GLU kernel's
    # order_ref   [M_pad] int32 assignment of each expert-sorted row (pad rows: M, out of range, never stored);
    #             ranked: the GLU kernel's order_out, written at the stored rows only (the others are not read)
    # routing_ref [M] fp32 routing weight of each assignment (token * top_k + slot)
    # h_ref       [M_pad, I_pad] GLU output rows, expert-sorted
    # rest: down refs ([E, I_pad, D_pad] | packed [E, D_pad, I_pad/2] u8 + scale [E, D_pad, I_pad/32] u8 |
    #       planes [E, I_pad/2, D_pad] u8 + scales [E, I_pad/32, D_pad] u8 |
    #       words [E, I_pad/8, 4 D_pad] u8 + scale words [E, ceil(I_pad/128), D_pad] u32),
    #       y_ref [S * M, D_pad] fp32 (or x's dtype: S = 1, top_k = 1) output: contraction slice s's partial of
    #       assignment a at row s * M + a, each written once, by the item that owns it (S = down_split_k; the combine
    #       sums the slices); a dropped assignment's rows are never written
    # program (item, column tile, slice): slice s runs the contraction steps [s * split_steps, (s + 1) * split_steps)
    down = _WeightRefs(rest[:-1], layout, interpret)
    y_ref = rest[-1]
    item, col = _item_and_column(items_ref.shape[1], y_ref.shape[1] // block_n, config.column_group)
    part = pl.program_id(2 if not config.column_group else 1)

    def tile(row_start, rows, expert, lo, hi):  # rows x block_n outputs from row_start; stores rows lo..hi-1
        n0 = col * block_n
        sorted_rows = pl.ds(row_start, rows)

        def step(kb, acc):
            return down.accumulate(acc, h_ref, sorted_rows, expert, kb * block_k, n0, block_k, block_n)

        steps = h_ref.shape[1] // block_k
        if split_steps >= steps:  # one slice: static bounds, the loop Triton pipelines as before
            first, last = 0, steps
        else:
            first = part * split_steps
            last = jnp.minimum(first + split_steps, steps)
        acc = jax.lax.fori_loop(first, last, step, jnp.zeros((rows, block_n), jnp.float32))
        m = routing_ref.shape[0]
        row_ids = row_start + jnp.arange(rows)
        mine = (row_ids >= lo) & (row_ids < hi)
        # other rows target row M (pad rows hold M; with ranked, the neighbours' rows may hold anything)
        assignment = jnp.where(mine, order_ref[sorted_rows], m)  # [rows]
        scale = routing_ref[jnp.minimum(assignment, m - 1)]  # [rows], pad rows clamped
        # slice `part`'s rows; the masked-off rows target S * M, past the end (not a row of the next slice)
        target = jnp.where(mine, part * m + assignment, y_ref.shape[0])
        keep = jnp.broadcast_to(mine[:, None], (rows, block_n))
        cols = n0 + jnp.arange(block_n)
        # scatter store as a pair of broadcast index arrays (interpret mode's masked store takes no array-and-slice
        # mix); pad rows target row M: masked on the GPU, and dropped (not a duplicate of a real row) when interpreted
        plgpu.store(y_ref.at[target[:, None], cols[None, :]], (acc * scale[:, None]).astype(y_ref.dtype), mask=keep)

    _for_item_rows(*(items_ref[i, item] for i in range(4)), config, tile)


def _item_and_column(num_items: int, num_columns: int, column_group: int):
    """(work item, column tile) of this program. column_group 0: the grid is (items, columns, ...), items varying
    fastest in launch order, so consecutive programs take one column tile of consecutive items (an expert's row tiles
    share each weight tile), and an item's x rows are read again for every column tile. G > 0: the grid's first axis
    is items x columns, walked G columns of one item, then the same G of the next item, ... (the last group may be
    narrower): consecutive programs share the item's x rows, and an expert's items the G weight tiles."""
    if not column_group:
        return pl.program_id(0), pl.program_id(1)
    pid = pl.program_id(0)
    per_group = num_items * column_group
    group = jax.lax.div(pid, per_group)
    rest = pid - group * per_group
    width = jnp.minimum(column_group, num_columns - group * column_group)
    item = jax.lax.div(rest, width)
    return item, group * column_group + rest - item * width


def _programs(num_items: int, num_columns: int, config: MoeGemmConfig, *more: int) -> tuple[int, ...]:
    """The grid of a kernel whose programs `_item_and_column` places (then `more` axes)."""
    if config.column_group:
        return (num_items * num_columns, *more)
    return (num_items, num_columns, *more)


def _expert_rows(ids_ref, bounds_ref, row_start, rows: int, expert, top_k: int):
    """The ranked path's view of expert-sorted rows row_start .. row_start + rows - 1 for a tile whose stored rows
    all belong to `expert`, from the ids [N_p2, K_p2] (-1 padded): (wanted [rows], the rows' ranks among e's
    assignments; before [N_p2], e's assignments in tokens < n; per_token [N_p2]; mine [N_p2, K_p2] int32).
    A stable sort puts expert e's assignments in increasing (token, slot) order at rows bounds[e] ..., so row r is
    e's (r - bounds[e])-th assignment; rows outside 0 .. count - 1 are the neighbours' (never stored)."""
    start = bounds_ref[expert]
    mine = (ids_ref[...] == expert).astype(jnp.int32)  # [N_p2, K_p2]
    per_token = jnp.sum(mine, axis=1)  # [N_p2]
    before = jnp.cumsum(per_token) - per_token
    wanted = row_start + jnp.arange(rows, dtype=jnp.int32) - start
    return wanted, before, per_token, mine


def _ranked_tokens(wanted, before, per_token):
    """[rows] token of each row: the n with before[n] <= wanted < before[n] + per_token[n] (one [rows, N_p2]
    compare); rows of no token (the neighbours') read token 0 and are never stored."""
    inside = (before[None, :] <= wanted[:, None]) & (wanted[:, None] < (before + per_token)[None, :])
    tokens = jnp.arange(before.shape[0], dtype=jnp.int32)
    return jnp.sum(jnp.where(inside, tokens[None, :], 0), axis=1)


def _ranked_assignments(wanted, before, mine, top_k: int):
    """[rows] assignment (token * top_k + slot) of each row: the one of e's assignments whose rank is `wanted`
    (rank = before[token] + e's earlier slots in the token; one [rows, N_p2 * K_p2] compare); other rows get 0."""
    n_p2, k_p2 = mine.shape
    rank = (before[:, None] + jnp.cumsum(mine, axis=1) - mine).reshape(n_p2 * k_p2)
    flat = (jnp.arange(n_p2, dtype=jnp.int32)[:, None] * top_k
            + jnp.arange(k_p2, dtype=jnp.int32)[None, :]).reshape(n_p2 * k_p2)
    hit = (mine.reshape(n_p2 * k_p2) > 0)[None, :] & (rank[None, :] == wanted[:, None])  # at most one per row
    return jnp.sum(jnp.where(hit, flat[None, :], 0), axis=1)


def _for_item_rows(row0, expert, lo, hi, config: MoeGemmConfig, tile):
    """Calls tile(row_start, rows, expert, lo, hi) for work item (row0, expert, lo, hi) (`work_item`) with static
    `rows`: block_m rows from the item's tile start, or -- when tail_block_m is set and the item has at most
    tail_block_m rows -- tail_block_m rows from min(lo, tile start + block_m - tail_block_m), which covers lo..hi-1
    (hi <= tile start + block_m) and stays inside the tile, so inside the padded row buffer. Both branches are
    compiled; empty items run none."""
    block_m, tail_block_m = config.block_m, config.tail_block_m
    if not tail_block_m:
        pl.when(hi > lo)(lambda: tile(row0, block_m, expert, lo, hi))
        return
    is_tail = hi - lo <= tail_block_m
    pl.when((hi > lo) & is_tail)(
        lambda: tile(jnp.minimum(lo, row0 + block_m - tail_block_m), tail_block_m, expert, lo, hi))
    pl.when(hi - lo > tail_block_m)(lambda: tile(row0, block_m, expert, lo, hi))


# ----------------------------------------------------------------------------------------------------
# wrappers


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def expert_weight_dims(w) -> tuple[int, int, int]:
    """(experts, in, out) of a float [E, in, out] weight or an MXFP4 one in either layout (`mxfp4_layout`)."""
    layout = mxfp4_layout(w)
    if layout == "float":
        if w.ndim != 3 or not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(f"expert weight must be float [E, in, out], got {w.dtype}{list(w.shape)}")
        return w.shape
    packed, scale = (w[k] for k in MXFP4_LAYOUT_KEYS[layout])
    scale_dtype = jnp.uint32 if layout in WORD_LAYOUTS else jnp.uint8
    if packed.dtype != jnp.uint8 or scale.dtype != scale_dtype:
        raise ValueError(f"MXFP4 {layout} tensors must be uint8 / {jnp.dtype(scale_dtype).name}, got {packed.dtype} / "
                         f"{scale.dtype}")
    if packed.ndim != 3 or scale.ndim != 3:
        raise ValueError(f"MXFP4 tensors must be 3-d [E, ...], got {packed.shape} / {scale.shape}")
    width_ok = True
    if layout == "hf":
        e, n_out, half = packed.shape
        want, block = (e, n_out, half * 2 // MXFP4_GROUP), MXFP4_GROUP
    elif layout == "kn":
        e, half, n_out = packed.shape
        want, block = (e, half * 2 // MXFP4_GROUP, n_out), PLANE_BLOCK
    else:  # word layouts: [E, in/8, 4 * out]
        e, rows, width = packed.shape
        half, n_out, width_ok = 4 * rows, width // 4, width % 4 == 0
        want, block = (e, -(-half * 2 // SCALE_WORD_INPUTS), n_out), PLANE_BLOCK
    if scale.shape != want or (2 * half) % block or not width_ok:
        raise ValueError(f"MXFP4 {layout} shapes {sorted(w)} = {list(packed.shape)} / {list(scale.shape)} do not match "
                         f"(inputs must be a multiple of {block}; see prepare_mxfp4)")
    return e, 2 * half, n_out


def _pad_weight(w, n_in: int, n_out: int) -> tuple[jax.Array, ...]:
    """Zero-pads a weight to (n_in, n_out) -- a no-op (no copy) when the dims are already tile multiples,
    as all of K3's are. Padded MXFP4 entries are code 0 (= 0.0) with scale 127 (= 1); padding whole 64-input
    blocks keeps the kernel layout's plane structure."""
    layout = mxfp4_layout(w)
    if layout == "float":
        e, i, o = w.shape
        if (i, o) != (n_in, n_out):
            w = jnp.pad(w, ((0, 0), (0, n_in - i), (0, n_out - o)))
        return (w,)
    _, i, o = expert_weight_dims(w)
    packed, scale = (w[k] for k in MXFP4_LAYOUT_KEYS[layout])
    if (i, o) == (n_in, n_out):
        return packed, scale
    d_half, d_group, d_out = (n_in - i) // 2, (n_in - i) // MXFP4_GROUP, n_out - o
    if layout == "hf":
        packed = jnp.pad(packed, ((0, 0), (0, d_out), (0, d_half)))
        scale = jnp.pad(scale, ((0, 0), (0, d_out), (0, d_group)), constant_values=127)
    elif layout in WORD_LAYOUTS:  # zero words are code 0 (+0.0) in both planes, zero scale words factor 0
        packed = jnp.pad(packed, ((0, 0), (0, d_half // 4), (0, 4 * d_out)))
        d_words = -(-n_in // SCALE_WORD_INPUTS) - scale.shape[1]
        scale = jnp.pad(scale, ((0, 0), (0, d_words), (0, d_out)))
    else:
        packed = jnp.pad(packed, ((0, 0), (0, d_half), (0, d_out)))
        scale = jnp.pad(scale, ((0, 0), (0, d_group), (0, d_out)), constant_values=127)
    return packed, scale


def _compiler_params(config: MoeGemmConfig, interpret: bool, down: bool = False):
    if interpret:
        return None
    stages = config.down_num_stages if down and config.down_num_stages else config.num_stages
    return plgpu.CompilerParams(num_warps=config.num_warps, num_stages=stages)


def _block(cap: int, dim: int, minimum: int = 16) -> int:
    """The configured block, shrunk (power of two, >= minimum) for dims smaller than it."""
    return max(min(cap, 1 << max(dim - 1, 1).bit_length()), minimum)


def grouped_glu(x: jax.Array, order: jax.Array, bounds: jax.Array, gate, up, *, top_k: int, config: MoeGemmConfig,
                num_items: int, in_dim: int, out_dim: int, activation: str = "situ", situ_beta: float = 4.0,
                situ_linear_beta: float | None = 25.0, ranked: bool = False, num_rows: int | None = None,
                interpret: bool = False) -> jax.Array:
    """GLU(x_t @ gate_e, x_t @ up_e) per expert-sorted row: h [M_pad, out_dim] in x.dtype, row r of h for token
    t = order[r] // top_k (rows gathered inside the kernel: no sorted copy of x is materialised).

    x [N, >= in_dim]: its first in_dim columns are the experts' input (a wider x, e.g. a fused projection's
    output, is read in place). in_dim and out_dim must be tile multiples (weights are zero-padded up to them;
    `moe_grouped_mlp` picks the sizes); order [M_pad] int32 (M_pad a multiple of block_m); bounds from
    `row_bounds`; num_items the grid's work items (`num_work_items`, >= the real count). ranked: `order` holds
    the expert ids instead ([N_p2, K_p2], -1 padded; `ranks_in_kernel`), each program ranks its own rows;
    num_rows = M_pad must be given. Returns (h, items [4, num_items]: the work items, for `grouped_down`) and,
    ranked, a third entry order [M_pad]: the stored rows' assignments, for `grouped_down`.
    """
    k_pad = in_dim
    m_pad = num_rows if ranked else order.shape[0]
    i_pad = out_dim
    kernel = functools.partial(
        _grouped_glu_kernel, gate_layout=mxfp4_layout(gate), up_layout=mxfp4_layout(up), config=config, top_k=top_k,
        in_dim=in_dim,
        block_n=config.glu_block_n, block_k=config.block_k, activation=activation, beta=situ_beta,
        linear_beta=situ_linear_beta, ranked=ranked, interpret=interpret,
    )
    args = (bounds, order, x, *_pad_weight(gate, k_pad, i_pad), *_pad_weight(up, k_pad, i_pad))
    out_shape = (jax.ShapeDtypeStruct((m_pad, i_pad), x.dtype), jax.ShapeDtypeStruct((4, num_items), jnp.int32))
    if ranked:
        out_shape += (jax.ShapeDtypeStruct((m_pad,), jnp.int32),)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=_programs(num_items, i_pad // config.glu_block_n, config),
        compiler_params=_compiler_params(config, interpret),
        interpret=interpret,
        name="moe_grouped_glu",
    )(*args)


def _down_slices(steps: int, down_split_k: int) -> tuple[int, int]:
    """(contraction steps per slice, slices) of the down kernel: at most down_split_k slices, every one non-empty."""
    split_steps = -(-steps // min(down_split_k, steps))
    return split_steps, -(-steps // split_steps)


def grouped_down(h: jax.Array, order: jax.Array, items: jax.Array, routing: jax.Array, down, *,
                 config: MoeGemmConfig, out_dim: int, out_dtype=jnp.float32, interpret: bool = False) -> jax.Array:
    """routing[a] * (h_r @ down_e) of each expert-sorted row r, stored at its assignment a = order[r]:
    h [M_pad, I_pad] -> y [S, M, out_dim] out_dtype in (token, slot) order, M = routing.shape[0], S the contraction
    slices (config.down_split_k, at most the number of steps): the weighted combine is then a plain sum over the
    slices and each token's top_k rows, no inverse permutation. items [4, W]: `grouped_glu`'s work items (as
    `tile_schedule`'s). order: the sort's, or the ranked `grouped_glu`'s third result (only the rows some item stores
    are read)."""
    m_pad, i_pad = h.shape
    split_steps, splits = _down_slices(i_pad // config.block_k, config.down_split_k)
    kernel = functools.partial(
        _grouped_down_kernel, layout=mxfp4_layout(down), config=config,
        block_n=config.down_block_n, block_k=config.block_k, split_steps=split_steps, interpret=interpret,
    )
    m = routing.shape[0]
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits * m, out_dim), out_dtype),
        grid=_programs(items.shape[1], out_dim // config.down_block_n, config, splits),
        compiler_params=_compiler_params(config, interpret, down=True),
        interpret=interpret,
        name="moe_grouped_down",
    )(items, order, routing, h, *_pad_weight(down, i_pad, out_dim))
    return y.reshape(splits, m, out_dim)


def _check_inputs(x, ids, weights, experts, activation):
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be float [N, K], got {x.dtype}{list(x.shape)}")
    if ids.ndim != 2 or ids.shape[0] != x.shape[0] or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be integer [N, top_k] with N = {x.shape[0]}, got {ids.dtype}{list(ids.shape)}")
    if weights.shape != ids.shape:
        raise ValueError(f"routing weights {list(weights.shape)} must match ids {list(ids.shape)}")
    if set(experts) != {"gate", "up", "down"}:
        raise ValueError(f"experts must hold gate, up and down, got {sorted(experts)}")
    if mxfp4_layout(experts["gate"]) != mxfp4_layout(experts["up"]):
        raise ValueError("gate and up must both be MXFP4-packed or both float, in one layout (they share the "
                         "activation tile and the accumulator orientation)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    eg, kg, ig = expert_weight_dims(experts["gate"])
    eu, ku, iu = expert_weight_dims(experts["up"])
    ed, id_, dd = expert_weight_dims(experts["down"])
    if not (eg == eu == ed and kg == ku == dd <= x.shape[1] and ig == iu == id_):
        raise ValueError(
            f"expert shapes disagree: gate [{eg}, {kg}, {ig}], up [{eu}, {ku}, {iu}], down [{ed}, {id_}, {dd}] "
            f"(as [E, in, out]) for x width {x.shape[1]} (x may be wider than the experts' input, not narrower)"
        )
    return eg, kg, ig


@functools.partial(jax.jit, static_argnames=("activation", "situ_beta", "situ_linear_beta", "config", "expected_rows",
                                             "combine", "interpret"))
def moe_grouped_mlp(x: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict, *, activation: str = "situ",
                    situ_beta: float = 4.0, situ_linear_beta: float | None = 25.0,
                    config: MoeGemmConfig | None = None, expected_rows: int | None = None, combine: str = "auto",
                    interpret: bool = False) -> jax.Array:
    """sum_j weights[n, j] * E_{ids[n, j]}(x[n]) for x [N, K]; result [N, K] in x.dtype (fp32 combine).

    x may be wider, [N, K' >= K]: its first K columns are the experts' input, read in place when K is a multiple
    of the contraction block (a fused projection's output needs no slice copy); the result is still [N, K].

    ids/weights [N, top_k] (expert ids in [0, E); each token's k experts need not be distinct; an id < 0 is a
    dropped assignment: not computed, contributes zero -- an expert-parallel rank's non-local picks). experts:
    gate/up [E, K, I] and down [E, I, K] float, or MXFP4-packed entries (see module docstring). Runs the
    Triton-lowered Pallas kernels on the GPU, or interprets them (`interpret=True`, any backend).

    expected_rows: how many assignments the caller expects to be kept (ids >= 0), for `default_config`'s tiling when
    no config is given (None: all N x top_k). An expert-parallel rank drops most of its received picks: K3's EP16
    rank at 1024 routed tokens keeps 986 of 10,320 assignments, and tiling by the kept rows (64-row tiles instead
    of 128) took 1.11 against 1.24 ms on the H200 (2026-12-04, docs/benchmarks.md). The results do not depend on it.

    combine: how each token's rows are summed -- "xla" (`combine_rows`: elementwise adds that fuse into the
    consumer), "kernel" (pallas_kernels/moe_combine.py: one program per token, masked loads, so a dropped slot's
    row is not read), or "auto": the kernel where `moe_combine.supported` expects it to be the faster for the
    expected kept rows per token. Results agree to the fp32 sum's rounding (same adds, same order).
    """
    if combine not in ("auto", "kernel", "xla"):
        raise ValueError(f"combine must be 'auto', 'kernel' or 'xla', got {combine!r}")
    if combine == "auto" and ids.shape[1] == 1:
        combine = "xla"  # one term a token: the down kernel can store the result itself (nothing to sum)
    y, k_dim = _grouped_rows(x, ids, weights, experts, activation=activation, situ_beta=situ_beta,
                             situ_linear_beta=situ_linear_beta, config=config, expected_rows=expected_rows,
                             single_dtype=x.dtype if combine == "xla" else None, interpret=interpret)
    n, top_k = ids.shape
    kept_per_token = -(-(n * top_k if expected_rows is None else expected_rows) // n)
    use_kernel = combine == "kernel" or (
        combine == "auto" and moe_combine.supported(k_dim, kept_per_token=min(kept_per_token, top_k),
                                                    slices=y.shape[0], interpret=interpret))
    if use_kernel:
        return moe_combine.moe_combine(y, ids, k_dim=k_dim, dtype=x.dtype, interpret=interpret)
    return combine_rows(y, ids, k_dim).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("activation", "situ_beta", "situ_linear_beta", "config", "expected_rows",
                                             "interpret"))
def moe_grouped_rows(x: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict, *, activation: str = "situ",
                     situ_beta: float = 4.0, situ_linear_beta: float | None = 25.0,
                     config: MoeGemmConfig | None = None, expected_rows: int | None = None,
                     interpret: bool = False) -> jax.Array:
    """`moe_grouped_mlp` before its combine: the weighted rows w[n, j] * E_{ids[n, j]}(x[n]), fp32 [S, N * top_k, K']
    in (token, slot) order, S contraction slices of the down GEMM (their sum is the row), K' >= K (columns past K
    are padding). A dropped assignment's rows are never written (garbage): `combine_rows` selects them away by
    ids >= 0, pallas_kernels/moe_combine.py does not read them. Same arguments as `moe_grouped_mlp`."""
    return _grouped_rows(x, ids, weights, experts, activation=activation, situ_beta=situ_beta,
                         situ_linear_beta=situ_linear_beta, config=config, expected_rows=expected_rows,
                         single_dtype=None, interpret=interpret)[0]


def combine_rows(y: jax.Array, ids: jax.Array, k_dim: int) -> jax.Array:
    """sum over slices and each token's top_k rows of `moe_grouped_rows`' output -> [N, k_dim] in y's dtype."""
    n, top_k = ids.shape
    # each token's top_k consecutive rows of every contraction slice, fp32, deterministic; as unrolled adds rather
    # than a reduction so the sum is elementwise and fuses into its consumer (k3jax.moe's latent RMSNorm) instead of
    # being a kernel of its own. A dropped assignment's row was never written: selected away, never added.
    rows = y[..., :k_dim].reshape(y.shape[0], n, top_k, k_dim)
    kept = ids >= 0
    terms = [jnp.where(kept[:, j, None], rows[part, :, j], 0) for part in range(rows.shape[0]) for j in range(top_k)]
    out = terms[0]
    for term in terms[1:]:
        out = out + term
    return out


def _grouped_rows(x, ids, weights, experts, *, activation, situ_beta, situ_linear_beta, config, expected_rows,
                  single_dtype, interpret) -> tuple[jax.Array, int]:
    """(the down kernel's output [S, N * top_k, K'], K). single_dtype: with one term a token (top_k 1, one slice)
    the down kernel stores the result in this dtype (no combine needed); None keeps fp32 rows."""
    num_experts, k_dim, i_dim = _check_inputs(x, ids, weights, experts, activation)
    if expected_rows is not None and (not isinstance(expected_rows, int) or expected_rows < 1):
        raise ValueError(f"expected_rows must be a positive int or None, got {expected_rows!r}")
    n, top_k = ids.shape
    m = n * top_k
    layouts = {mxfp4_layout(w) for w in experts.values()}
    word_down = (k_dim, i_dim) if mxfp4_layout(experts["down"]) in WORD_LAYOUTS else None
    config = config or default_config(m if expected_rows is None else expected_rows, num_experts, word_down)
    packed = layouts != {"float"}
    if packed and config.block_k < MXFP4_GROUP:
        raise ValueError(f"MXFP4 weights need block_k >= {MXFP4_GROUP}, got {config.block_k}")
    # the kernel layout is cut in 64-input blocks: its contraction step is a multiple of 64
    min_block_k = PLANE_BLOCK if layouts & set(KERNEL_LAYOUTS) else MXFP4_GROUP if packed else 16
    block_k = _block(max(config.block_k, min_block_k), max(k_dim, i_dim), min_block_k)
    config = dataclasses.replace(
        config, block_k=block_k,
        glu_block_n=_block(config.glu_block_n, i_dim), down_block_n=_block(config.down_block_n, k_dim),
    )
    # every padded dim is a multiple of each block that tiles it (all blocks are powers of two)
    k_pad = _round_up(k_dim, max(block_k, config.down_block_n))
    i_pad = _round_up(i_dim, max(block_k, config.glu_block_n))
    # aligned items start anywhere: a tile may reach block_m - 1 rows past the last one, so one more tile of rows
    m_pad = _round_up(m, config.block_m) + (config.block_m if config.aligned else 0)

    flat = ids.reshape(-1).astype(jnp.int32)
    # dropped assignments (id < 0) sort after every expert's rows and are counted by no bound: no item covers them
    keys = jnp.where(flat < 0, bounds_width(num_experts), flat)
    # the only XLA ops of the schedule: one compare-and-count (row_bounds) and, past decode sizes, one sort (rows
    # grouped by expert); the GLU kernel derives the work items from the bounds (the down kernel reads them from
    # it), and the kernels gather x rows / routing weights by assignment
    ranked = ranks_in_kernel(n, top_k, config.block_m)
    if ranked:  # decode sizes: each program ranks its own rows from the ids (`_ranked_tokens`), no sort kernel
        order = ids.astype(jnp.int32)
        n_p2, k_p2 = _next_pow2(n), _next_pow2(top_k)
        if (n_p2, k_p2) != (n, top_k):
            order = jnp.pad(order, ((0, n_p2 - n), (0, k_p2 - top_k)), constant_values=-1)
    else:
        order = jnp.argsort(keys, stable=True).astype(jnp.int32)
        if m_pad > m:  # (a zero-width pad would still be an XLA op)
            order = jnp.pad(order, (0, m_pad - m), constant_values=m)
    bounds = row_bounds(keys, num_experts)
    routing = weights.reshape(-1).astype(jnp.float32)
    glu_k = _round_up(k_dim, block_k)  # the GLU's contraction: x's first k_dim columns, zero-padded to glu_k
    xk = x if glu_k == k_dim else jnp.pad(x[:, :k_dim], ((0, 0), (0, glu_k - k_dim)))

    glu_out = grouped_glu(xk, order, bounds, experts["gate"], experts["up"], top_k=top_k, config=config,
                          num_items=num_work_items(m, num_experts, config.block_m), in_dim=glu_k, out_dim=i_pad,
                          activation=activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                          ranked=ranked, num_rows=m_pad, interpret=interpret)
    h, items = glu_out[:2]
    if ranked:
        order = glu_out[2]
    single = top_k == 1 and _down_slices(i_pad // config.block_k, config.down_split_k)[1] == 1  # one term a token
    out_dtype = single_dtype if single and single_dtype is not None else jnp.float32
    y = grouped_down(h, order, items, routing, experts["down"], config=config, out_dim=k_pad, out_dtype=out_dtype,
                     interpret=interpret)
    return y, k_dim


# ----------------------------------------------------------------------------------------------------
# references (plain jnp)


def mxfp4_dequantize_reference(packed: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """packed [..., out, in/2], scale [..., out, in/32] -> [..., in, out] weight (the kernel's layout)."""
    codes = jnp.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(jnp.int32)
    values = _e2m1_to_f32(codes) * jnp.repeat(_e8m0_to_f32(scale.astype(jnp.int32)), MXFP4_GROUP, axis=-1)
    return jnp.swapaxes(values, -1, -2).astype(dtype)


def mxfp4_weight_reference(w: dict, dtype=jnp.float32) -> jax.Array:
    """Either MXFP4 layout (`mxfp4_layout`: checkpoint or `prepare_mxfp4`'s) -> [E, in, out] weight, plain jnp
    (the "kn" layout decoded from its own planes, not through `mxfp4_checkpoint_layout`; the word layouts through
    it, so that the kernels' word decodes, `_k4_lut_bits` / `_k4r_bits`, are checked against an independent path)."""
    layout = mxfp4_layout(w)
    if layout == "float":
        raise ValueError("mxfp4_weight_reference takes an MXFP4 dict")
    if layout in ("hf",) + WORD_LAYOUTS:
        w = mxfp4_checkpoint_layout(w)
        return mxfp4_dequantize_reference(w["packed"], w["scale"], dtype)
    e, n_in, n_out = expert_weight_dims(w)
    planes = jnp.swapaxes(w["planes_kn"], -1, -2)  # [E, out, in/2]
    blocks = planes.reshape(e, n_out, n_in // PLANE_BLOCK, PLANE_BLOCK // 2)
    codes = jnp.stack([blocks & 0x0F, blocks >> 4], axis=-2).reshape(e, n_out, n_in).astype(jnp.int32)
    factors = jnp.repeat(_e8m0_to_f32(jnp.swapaxes(w["scales_gn"], -1, -2).astype(jnp.int32)), MXFP4_GROUP, axis=-1)
    return jnp.swapaxes(_e2m1_to_f32(codes) * factors, -1, -2).astype(dtype)


def moe_grouped_mlp_reference(x: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict, *,
                              activation: str = "situ", situ_beta: float = 4.0,
                              situ_linear_beta: float | None = 25.0) -> jax.Array:
    """The same sum per (token, slot) with each assignment's expert weights gathered (memory O(N k K I):
    for tests), fp32 math throughout, result in x.dtype."""
    _, k_dim, _ = _check_inputs(x, ids, weights, experts, activation)
    x = x[:, :k_dim]  # a wider x: its first K columns are the experts' input
    w = {
        name: mxfp4_weight_reference(v) if isinstance(v, dict) else v.astype(jnp.float32)
        for name, v in experts.items()
    }
    x32 = x.astype(jnp.float32)
    kept = ids >= 0  # dropped assignments (id < 0) contribute zero
    ids = jnp.where(kept, ids, 0)
    gate = jnp.einsum("nk,njki->nji", x32, w["gate"][ids], precision="highest")  # [N, top_k, I]
    up = jnp.einsum("nk,njki->nji", x32, w["up"][ids], precision="highest")
    h = _glu(gate, up, activation, situ_beta, situ_linear_beta)
    y = jnp.einsum("nji,njid->njd", h, w["down"][ids], precision="highest")
    return (y * jnp.where(kept, weights.astype(jnp.float32), 0)[..., None]).sum(axis=1).astype(x.dtype)


def grouped_flops(num_rows: int, k_dim: int, i_dim: int) -> int:
    """FLOPs of the three expert GEMMs for num_rows (token, expert) rows."""
    return 2 * num_rows * k_dim * i_dim * 3


def expert_weight_bytes(num_experts_touched: int, k_dim: int, i_dim: int, packed: bool, itemsize: int = 2) -> float:
    """Bytes of expert weights read once: bf16 (itemsize 2) or MXFP4 (half a byte + 1/32 byte per weight)."""
    per_weight = (0.5 + 1 / MXFP4_GROUP) if packed else itemsize
    return num_experts_touched * 3 * k_dim * i_dim * per_weight


__all__ = [
    "MoeGemmConfig", "default_config", "tile_schedule", "work_item", "row_bounds", "bounds_width", "num_work_items",
    "grouped_glu", "grouped_down",
    "moe_grouped_mlp", "moe_grouped_rows", "combine_rows", "moe_grouped_mlp_reference", "mxfp4_dequantize_reference",
    "grouped_flops",
    "expert_weight_bytes", "prepare_mxfp4", "mxfp4_checkpoint_layout", "mxfp4_layout", "mxfp4_weight_reference",
    "MXFP4_VARIANTS", "MXFP4_LAYOUT_KEYS", "KERNEL_LAYOUTS", "PLANE_BLOCK",
]
