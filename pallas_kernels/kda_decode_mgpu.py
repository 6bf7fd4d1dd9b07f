"""Fused KDA decode / verify on Mosaic GPU: the recurrent state streamed through shared memory by TMA.

The same job as `kda_decode.kda_decode`, decode and verify (all_states: every position's state update written): per
sequence b (state slot slots[b]) and head h, for each of the T <= 8 new tokens, the short conv (conv state in and out,
in place), SiLU, q / k L2 norm, the gate, beta, the delta rule on the V-first fp32 state S [V, K], the output and the
gated RMSNorm -- one launch per layer, k3-model.md §3:

    S <- S * e^g[None, :];   S <- S + beta (v - S k) k^T;   o = S q;   y = RMSNorm(o) * w * sigmoid(gate)

Why a second kernel: the Triton one (loads into registers, one program per (sequence, head)) moves the state at
73-77 % of the measured copy bandwidth at B64 / B256 H96, and nothing in its tiling, cache hints or a streamed
scf.for got past that (kda_decode's docstring). The state is the whole memory floor (read once, written once), so
this kernel is built around moving it. A persistent grid of one CTA per SM walks (sequence, head) items cta,
cta + G, cta + 2G, ... (heads fastest, so neighbouring CTAs stream neighbouring memory). Each item's [V, K] state
(64 KB at 128 x 128) and its few KB of operands (q|k|v inputs, conv windows, z, output gate) arrive by TMA into a
ring of `stages` shared-memory slots, issued ahead. The CTA's warpgroups are specialised:
- V / 64 *update* warpgroups each own 64 rows of every state (the delta rule is row-separable over V): they wait for
  the item's prepared vectors, update their [64, K] tile in registers in the WGMMA layout (K along a row spread over
  4 lanes, so S k and S q are in-register sums plus two shuffles), write it back into the slot, write o, and arrive;
- one *prep* warpgroup issues the TMA ring, does the item's vector work one item ahead of the updates (short convs +
  SiLU, q / k L2 norms, gate, beta; vectors in the strided layout, K / 128 elements a thread) into two-deep operand
  buffers (q^, k^, beta k^, e^g, beta v), then, once the updates are done, stores the state back with one TMA copy,
  applies the gated RMSNorm and refills the slot (only after the store has read it).
(In verify, which only reads the state, the update warpgroups load and refill their own rows of each state, the
operands have a deeper ring of their own, and at T = 4 a fourth warpgroup applies the gated norm: see the
twenty-ninth session's entry below.)
The update warpgroups read K-vectors in the WGMMA layout's column form (`reduce(0)`: broadcast down a tile's rows)
and V-rows in its row form (`reduce(1)`).
Hazard kept out by design: Mosaic GPU lowers a full reduction (jnp.sum to a scalar) through one shared-memory
scratch buffer for the whole CTA, so two warpgroups must never run one at the same time. Only the prep warpgroup
does (L2 norms, the RMSNorm's mean square); the updates reduce within warps only. (A version with the RMSNorm in the
update warpgroups ran its reductions against the prep's and gave wrong y on the H200; the interpreter does not
model that scratch.)

Measured on the H200 (2026-12-02, benchmarks/kda.py --decode-variants mgpu,mgpu_s2, raw JSON
docs/results/kda_decode_mgpu_h200_2026-12-02.json; torch copy 4.15 TB/s), decode T1 H96:
B64 0.2535 ms = 3.18 TB/s of state = 76.5 % of copy (Triton kernel 0.2658 in the same run: 1.05x; fla 0.2835:
1.12x); B256 0.9488 ms = 3.40 TB/s = **81.8 % of copy** (Triton 1.0273: 1.08x; fla 1.1953: 1.26x). 2 ring slots
instead of 3: 0.266 / 0.982 ms. State equal to the Triton kernel's to 9e-6 / 1.3e-5 relative (MUFU math), y to
bf16 rounding (5e-5); in place (no pool copy in the optimized HLO). The way there, same benchmark at B64: one
warpgroup doing everything with operands from global memory 0.61 ms (ablation: its TMA streaming alone 0.228 ms =
84 % of copy, with the state update 0.236); operands by TMA 0.47; two warpgroups sharing the vector work 0.37; prep
specialised (vectors in the WGMMA column form, 32 replicated values a thread) 0.46; prep in the strided layout 0.25.
The model's GPU decode kernel since 2026-12-04 (k3jax.kda.KDA_DECODE_KERNEL = "mosaic"; see there), reading the
serving layout's fused input projection in place (`packed`: beta and the output gate at their columns, the gate's
rows by TMA), so the step slices nothing for it.

2026-12-03 (twentieth session; benchmarks/kda.py --decode-variants mgpu, raw JSON
docs/results/kda_decode_verify_mgpu_h200_2026-12-03.json; torch copy 4.19-4.20 TB/s). Two changes to decode and
verify mode. (1) The state has its own TMA barrier (`state_bars`): the prep warpgroup waits only for the item's few
KB of operands, not for its 64 KB state. Patched A/B in one run: B64 0.2503 against 0.2572 ms, B256 0.9095 against
0.9399. (2) Verify: the update warpgroups keep the state in registers across the positions and stage each
position's rows through their slice of the slot, one TMA store each (the store reads shared memory while the next
position's math runs; the wait comes before the next write). Storing the rows straight from registers to global
memory instead was 13-15 % slower (B64 T4 0.722 against 0.627 ms). Final figures, H96: decode B64 **0.236 ms =
3.41 TB/s of state = 81 % of copy**, B256 0.898 ms = 86 % (Triton 0.259 / 1.001; fla pooled 0.270 / 1.180);
verify T4 B64 0.619 ms = 77 %, B256 2.432 ms = 79 % (Triton 0.649 / 2.564; fla pooled, the same job, 0.759 /
3.003). The benchmark now passes the step's small per-row operands as arguments. Closed over, the equal-valued ones
(lengths, norm weight, fresh zeros) became three broadcast kernels per step; that was ~10 us of the old B64 figure.
Ablations (B64 / B256 T1, patched copies): without the prep warpgroup's vector work 0.240 / 0.898 ms; without any
vector work 0.238 / 0.892. In a profile (before both changes) the kernel alone took 0.236 / 0.914 ms of the 0.257 /
0.940 ms steps. 128 CTAs (48 / 192 items each, no tail) instead of 132: 0.238 / 0.923 ms against 0.240 / 0.904 ms,
so the grid stays one CTA per SM.

2026-12-03 (twenty-first session; docs/results/kda_verify_fanout_h200_2026-12-03b.json, _ablations_): verify's own
traffic mix (read one state, write T) copies at 89-90 % of the plain copy's rate on the H200 (a 1:4 fan-out copy,
3.73-3.76 TB/s); verify T4 reaches 87-88 % of it. Without its state stores the kernel still takes 64 % of its time
(0.40 of 0.63 ms at B64): the update warpgroups' per-position chain, not the stores' staging wait (removing that
wait: no change), is what overlaps the store stream only in part.

2026-12-03 (twenty-second session; docs/results/kda_verify_ncu_h200_2026-12-03.json, kda_verify_updates_*): Nsight
Compute on verify B64 T4 showed the update warpgroups waiting 40 % of their samples for their own TMA stores to have
read the staging rows (before each next position's rows, and at the item's end) and 15 % for the prep warpgroup:
the state stores, ~64 KB in flight per SM behind the one staging buffer, set the pace (DRAM 73 % of peak). Two A/Bs
that did not move it (patched copies): both of a position's reductions from the pre-update state (0.625 vs 0.627
ms), and the prep warpgroup's conv states and y stored by TMA with its GMEM reads issued early (0.613 vs 0.617 ms at
B64 T4; decode B256 1.6 % slower). So verify stopped writing states: it writes each position's update (err rows
from the update warpgroups through e_smem, k^ and e^g from prep_smem, one TMA copy each per item) and
k3jax.commit_verified rebuilds the kept state from the pool. Verify T4 H96: B64 **0.368 ms** (was 0.618), B256
**1.341 ms** (was 2.434); Triton kernel 0.410 / 1.587; fla public API 0.573 / 2.163 (1.56x / 1.61x); decode
unchanged (0.243 / 0.904 ms in the same call). The kernel now reads ~0.4 / 1.6 GB and writes ~1 % of that: 29-31 %
of the copy bandwidth, no longer bound by HBM.

2026-12-03 (twenty-third session; docs/results/kda_commit_verify_h200_2026-12-03b.json): what bounds verify now is
the prep warpgroup, not the update chain. Ablated copies, verify B64 / B256 T4: the whole kernel 0.355 / 1.353 ms;
without the update warpgroups' tile math 0.296 / 1.132; without prep's vector work (short convs, L2 norms, gate)
0.185 / 0.690 (T8 B64: 0.641 against 0.320). Prep's vectors hold one element a thread (K / 128) and each of its
full reductions is a shared-memory round trip with a barrier, so its T positions are a latency chain; spreading
that work (more prep threads, positions in parallel) is the next step for verify. Decode T1 is unaffected (0.238
against 0.230 without prep's work). Single ablations of prep's parts at B64 T4: without verify's per-position conv
states (3 x (W-1) x T vector stores to GMEM per item) 0.311 ms, without the two L2-norm reductions 0.324, without its
GMEM scalar reads 0.343, without the gate 0.343, without the conv taps 0.349; hoisting the taps 0.355 (no gain).
Verify's conv states first went out by TMA (the ring slot holds each segment's window and inputs contiguously,
seq_smem; position t's conv state is rows t+1 .. t+W-1 of it, one bulk copy each). Patched A/B in one call: verify
B64 T4 0.340 against 0.354 ms, B256 1.292 against 1.348 (1.04x); decode T1 0.239 against 0.241 (`11a9e5a`). Then
verify stopped writing conv states at all: a kept window is the last W-1 rows of [the pool's window; the step's
inputs], which the commit rebuilds (k3jax.kda.conv_window_after), as it rebuilds the recurrent state. That removes
all of the ablated stores (bound: the 0.311 ms case above). Measured: 0.315 / 1.232 ms against 0.340 / 1.293
(1.08x / 1.05x, 2026-12-03).

2026-12-04 (twenty-seventh session; docs/results/kda_verify_tiled_prep_h200_2026-12-04.json): verify at T = 4 does
the prep warpgroup's vector work on [4, K] tiles, one position per warp (positions_layout, prep_tiled): the four
positions' convs, SiLUs, gates and products run side by side, and the q / k L2 norms reduce within a warp (no
shared-memory round trips and barriers). Interleaved A/B against the per-position form (devscripts/kdav.py, 3
rounds, bf16 H96): verify B64 T4 **0.215 against 0.315 ms** (1.46x), B256 **0.812 against 1.241** (1.53x); decode
T1 unchanged (0.238 / 0.239). benchmarks/kda.py in the same call: verify B64 / B256 T4 0.219 / 0.814 ms, 48 / 52 % of
copy on its state reads, 2.71x / 2.74x fla's public call, 3.58x / 3.73x fla pooled. At T = 8 the same layout with
two positions a warp gave wrong results on the H200 (the interpreter ignores layouts), so T != 4 keeps the
per-position form.

2026-12-04 (twenty-eighth session; docs/results/kda_verify_chunk_norm_h200_2026-12-04.json). Ablated copies of the
kernel as it then stood (tiled prep, the chunk form below, a slot's state refilled ahead of the norm), verify B64 /
B256 T4: whole 0.220 / 0.834 ms; without the gated norm 0.179 / 0.644; without the update warpgroups' math 0.203 /
0.762; without prep's vector work 0.164 / 0.609. Two changes at T = 4 verify:
(1) the gated RMSNorm on [4, V] tiles, one position a warp, as the tiled prep (TILED_VERIFY_NORM: no shared-memory
reductions); (2) the chunk form (CHUNK_VERIFY, `chunk_operands`): the update warpgroups take S_0's rows times 2T
prepared vectors (cumulatively decayed keys and queries), independent products, then T x T scalar corrections per
row, instead of carrying S through the positions; prep computes the vectors and the T x T coefficients after one
barrier of its own (its warps exchange g and k^ rows). Interleaved A/B, 3 rounds: both 0.180 / 0.669 ms against
0.215 / 0.808 with neither (1.20x / 1.21x); the norm alone 0.190 / 0.738; the chunk form alone 0.213 / 0.802 (it pays
only once the norm is out of the way). Outputs equal the position-by-position form's to 3e-5 (y; err, k^, e^g to
fp32 rounding). Refilling a verify slot's state ahead of the gated norm (no state store to wait for) was slower
(0.834 against 0.794 ms at B256) and was not kept.

2026-12-04 (twenty-ninth session; docs/results/kda_verify_rings_h200_2026-12-04.json). Verify has two rings: the
update warpgroups load their own rows of each state (it is only read) and refill them once their math is done,
while the operands (a few KB an item) run in a deeper ring of their own (VERIFY_OPERAND_STAGES, 4 in bf16 at T = 4).
Interleaved A/B, 3 rounds, verify B64 / B256 T4: 0.1728 / 0.6426 ms against 0.1754 / 0.6576 with one ring refilled
by prep after the item's norm (1.5 / 2.3 %); 3 operand slots 0.1743 / 0.6514; the rows refilled right after they
are loaded into registers (a warpgroup barrier before the math) 0.1845 / 0.6893, slower; prep refilling the state
as before beside the deeper operand ring 0.1757 / 0.6523. What is left to gain by streaming: the kernel with prep's
vector work, the update math and the norm all cut out (the TMA ring and barriers alone) takes 0.121 / 0.472 ms, while
XLA reads the same bytes (a reduction) in 0.094 / 0.355 ms (4.30 / 4.53 TB/s) and copies them at 4.10-4.17 TB/s.
Then the tiled gated norm and the err stores moved out of prep into a warpgroup of their own (norm_warpgroup; no
cross-warp reductions, so no clash over Mosaic's reduction scratch): prep's loop is its vector work alone, and an
item's operand slot is refilled once the norm of the item two back is done (so it needs 3 operand slots or more).
Interleaved A/B of patched copies (docs/results/kda_verify_normwg_h200_2026-12-04.json): 0.1700 / 0.6253 ms
against 0.1726 / 0.6412 (1.5 / 2.5 %), outputs bit-identical; with 3 operand slots 0.1729 / 0.643; setmaxnreg caps
(update / other warpgroups 160 / 96, 176 / 80 registers) 0.1702 / 0.6365 and 0.1712 / 0.6335, so the launch's
even split (128 each) stays.

2026-12-04 (thirtieth session; docs/results/kda_verify_two_preps_h200_2026-12-04.json). Verify at T = 4 runs two
prep warpgroups (PREP_WARPGROUPS, prep_warpgroups=): the first takes the even items, a fifth warpgroup the odd ones,
so each has two items' time for one item's vector work. Everything per item that prep touches is then one prep's
own (item-parity buffers and barriers, state slots modulo 2, operand slots modulo 4), and each prep waits for the
norm of its item two back before it rewrites that item's buffers. Five warpgroups launch at 96 registers a thread,
where the update math spills: setmaxnreg gives the update warpgroups 144 and the other three 64
(SPLIT_PREP_REGISTER_CAPS). Interleaved A/B, 3 rounds, bf16 H96, outputs bit-identical: verify B64 / B256 T4
0.1612 / 0.5956 ms against 0.1675 / 0.6234 with one prep (1.04x / 1.05x); without the caps 0.1819 / 0.6899 (slower
than one prep); caps 160 / 48 0.1619 / 0.5964.

2026-12-05 (thirty-second session; docs/results/kda_verify_mma_h200_2026-12-05.json). Tried, not kept: the update
warpgroups' 2T row products of S_0 on the tensor cores (the state tile split into three bf16 pieces in registers,
prep's 8 vectors as three bf16 pieces in a swizzled [24, K] buffer, three register-A WGMMAs with N = 24; right to
2.4e-5 of y): 0.1841 / 0.6784 ms against 0.1615 / 0.5894 (the splits cost more than the products); two pieces
0.1624 / 0.5946. Refilling the state rows right after they are loaded: 0.1584 / 0.5883 (1.9 / 0.2 %), not worth a
barrier per item.

Fresh rows (fresh[b] != 0) start from zero states: the slot's state is loaded, then overwritten with zeros in
shared memory before use (a select, exact over NaN/inf garbage); the conv window is replaced by zeros the same way.
Tokens t >= lengths[b] are padding: g = 0 and beta = 0 there (S unchanged), and the conv state keeps the last
W-1 *valid* inputs, as in kda_decode. The numerics follow the reference where it rounds (the conv output and o to
the activation dtype). softplus's log1p has no Mosaic GPU lowering; it is computed as log(w) * u / (w - 1) with
w = 1 + u (exact to fp32 rounding, the classic identity), u itself where w rounds to 1.

In interpret mode (CPU CI) the same kernel runs under Mosaic GPU's interpreter (plgpu.InterpretGPUParams),
TMA, barriers and layouts included.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda_decode import GATES, MAX_TOKENS, _check, kda_decode_reference

ROWS = 64  # a WGMMA-layout register tile has 64 rows: each item's state is updated in [64, K] tiles
H200_SM_COUNT = 132
SMEM_LIMIT = 227 * 1024  # Hopper's opt-in shared memory per block (Mosaic GPU checks it when it lowers)
SMEM_ALIGNMENT = 1024  # Mosaic GPU starts every scratch buffer on a 1 KiB boundary
# Mosaic GPU's scratch for cross-warp reductions (only prep's full reductions use it), set rather than left to the
# installed jax's default, so that smem_bytes can count it
REDUCTION_SCRATCH_BYTES = 2048
_L2_EPS = 1e-6
_COL = plgpu.Layout.WGMMA.reduce(0)  # a [K] vector as a tile's columns (broadcast down the rows)
_ROW = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector as a tile's rows (one value per row)
_TILE = plgpu.Layout.WGMMA
OPERAND_COPIES_PER_ITEM = 8  # q|k|v inputs and conv windows (3 x 2); z; output gate (the state has its own barrier)
TILED_VERIFY_PREP = True  # verify at T = 4: prep's vector work on [4, K] tiles (positions_layout, prep_tiled)
TILED_VERIFY_NORM = True  # with the tiled prep: the gated RMSNorm on [4, V] tiles too (gated_norm)
CHUNK_VERIFY = True  # with the tiled prep: the update warpgroups apply the state once, in the chunk form (see there)
# verify: operand slots beside its state slots (2 at T = 4; bf16 has room for 4, fp32 activations for 3): the prep
# warpgroup finds an item's few KB of operands landed well ahead (the docstring's twenty-ninth session entry)
VERIFY_OPERAND_STAGES = 4
# verify with the tiled norm: the gated norm and the err stores in a warpgroup of their own, beside prep (needs 3
# operand slots or more)
NORM_WARPGROUP = True
# verify with the norm warpgroup: prep warpgroups (2: one takes the even items, one the odd; see _item_kernel and the
# docstring's thirtieth session entry)
PREP_WARPGROUPS = 2
# with 2 prep warpgroups, setmaxnreg caps (update warpgroups, the other three): 5 warpgroups launch at 96 registers a
# thread (64K / 640), where the update math spills; 2 x 144 + 3 x 64 = 5 x 96
SPLIT_PREP_REGISTER_CAPS = (144, 64)
APPROX_MATH = True  # MUFU exp / log / reciprocal / rsqrt: shorter latency chains in the prep warpgroup's vector code

# kda_decode_mgpu's reference: kda_decode's (same arguments, same results, decode and verify)
kda_decode_mgpu_reference = kda_decode_reference


def positions_layout(width: int):
    """[4, width] tiles of verify's prep at T = 4 positions: one position per warp, its width over the warp's 32
    lanes, width // 32 contiguous elements a lane. A reduction along a row stays inside its warp (shuffles: no
    shared-memory scratch, no barrier), and the 4 positions' vector work runs side by side instead of one after
    another. (The same idea at T = 8, two rows a warp by the tiling ((8, w), (4, w), (w // 32,)), gave wrong results
    on the H200 -- y 1.2 relative off -- where the interpreter, which ignores register layouts, passed it; so T = 8
    keeps the per-position form.)"""
    if width % 32:
        raise ValueError(f"positions_layout takes width % 32 == 0, got {width}")
    return plgpu.Layout.TILED(fa.Tiling(((4, width), (width // 32,))), warp_dims=(-3,), lane_dims=(-2,),
                              vector_dim=-1)


def _cols(ref):
    return plgpu.load(ref, layout=_COL, optimized=False).astype(jnp.float32)


def _vec(ref):  # a [K] vector, K / 128 elements a thread (the prep warpgroup's layout)
    return plgpu.load(ref, layout=plgpu.Layout.WG_STRIDED(ref.shape, vec_size=ref.shape[-1] // 128)).astype(
        jnp.float32)


def _rows(ref):
    return plgpu.load(ref, layout=_ROW, optimized=False).astype(jnp.float32)


def _down_rows(vec, shape):  # [K] column vector -> [rows, K] tile, every row equal
    return lax.broadcast_in_dim(vec, shape, [1])


def _across_cols(vec, shape):  # [rows] row vector -> [rows, K] tile, every column equal
    return lax.broadcast_in_dim(vec, shape, [0])


def _select(pred, on_true, on_false):
    """jnp.where with a scalar predicate (Mosaic GPU has no implicit broadcast)."""
    return lax.select(lax.broadcast(pred, on_true.shape), on_true, on_false)


def _log1p(u):
    w = 1.0 + u
    exact = w == 1.0
    return lax.select(exact, u, jnp.log(w) * u / lax.select(exact, jnp.ones_like(w), w - 1.0))


def _gate(z, a, dt_bias, gate, lower_bound):
    """g [K] from the raw gate input z (fp32; a = e^A_log, a scalar): k3-model.md §3's two forms."""
    x = z + dt_bias
    if gate == "lower_bound":
        return lower_bound * jax.nn.sigmoid(a * x)
    return -a * lax.select(x > 20.0, x, _log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _conv_positions(tap, window, x_at, valids, act_dtype, store):
    """Causal short conv + SiLU of one channel segment over its T positions (vectors in one layout), loading each
    tap (`tap(j)`, fp32, oldest tap first) and input (`x_at(t)`) where it is used, to keep few vectors live.

    window: the W-1 previous inputs (activation dtype); valids: T scalar bools. Calls store(t, act) with each
    position's SiLU output (fp32, rounded to the activation dtype as the reference rounds it). Returns the last W-1
    valid inputs (the new conv state)."""
    f32 = jnp.float32
    kept = list(window)
    for t, valid in enumerate(valids):
        x_t = x_at(t)
        acc = tap(len(window)) * x_t.astype(f32)
        for i, w_prev in enumerate(window):
            acc = acc + tap(i) * w_prev.astype(f32)
        window = window[1:] + [x_t.astype(act_dtype)]
        kept = [_select(valid, new, old) for new, old in zip(window, kept)]
        store(t, jax.nn.silu(acc).astype(act_dtype).astype(f32))
    return kept


def _item_kernel(slots_ref, lens_ref, fresh_ref, x_ref, convw_ref, z_ref, beta_ref, og_ref, alog_ref, dtb_ref,
                 onw_ref, conv_ref, state_ref, y_ref, *refs, num_items, num_heads, num_tokens, stages, operand_stages,
                 gate, lower_bound, eps, act_dtype, all_states, packed, tiled_prep=False, tiled_norm=False,
                 chunk=False, norm_warpgroup=False, prep_warpgroups=1, register_caps=None):
    # GMEM: slots_ref, lens_ref, fresh_ref: [B] int32; x_ref: [B, T, 3*H*K] raw q|k|v (pre-conv), activation dtype
    #   convw_ref: [W, 3*H*K]; z_ref: [B, T, H, K]; beta_ref: [B, T, H] logits; og_ref: [B, T, H, V] output gate
    #   packed = (og_col, beta_col): x_ref is the whole projection [B, T, C] and holds both at those columns
    #   (beta_ref and og_ref are x_ref again, unread)
    #   alog_ref: [H] fp32; dtb_ref: [H, K] fp32; onw_ref: [V] o_norm weight
    #   conv_ref: [P, W-1, 3*H*K] conv-state pool, read by TMA (decode: and written in place, a mutable ref)
    #   state_ref: [P, H, V, K] fp32 state pool, read by TMA (decode: and written in place by TMA, a mutable ref)
    #   y_ref: [B, T, H, V] activation dtype, the gated-normed output
    #   verify only (all_states), refs[:3]: err_ref [B, T, H, V], key_ref / decay_ref [B, T, H, K] fp32, each
    #   position's rank-one state update
    #   (S_t = S_{t-1} * decay_t + err_t key_t^T; k3jax.kda.apply_verify_updates). The pools are only read.
    # SMEM, two rings, one slot per item in flight. The state ring (S = stages slots): st_smem [S, V, K] fp32 (tiled
    #   8 x 32, 128-byte swizzle); state_bars: its state has landed ([S]; verify: [S * V / 64], one per slot and
    #   update warpgroup, each of which loads its own rows). The operand ring (O = operand_stages slots; decode: O = S,
    #   the same slot numbers): seq_smem [O, 3, W-1+T, K] per q|k|v segment its conv window (rows < W-1) then the
    #   item's T inputs; z_smem [O, T, K]; og_smem [O, T, V]; bars [O]: the slot's OPERAND_COPIES_PER_ITEM copies
    #   (see `issue`) have landed (the prep warpgroup needs only the operands, so it never waits for the state).
    #   Verify reads the state once into the update warpgroups' registers, and each of them refills its rows of
    #   the slot once its math is done (not after prep's norm of the item); so its operand ring can run deeper
    #   than its state ring (the operands are a few KB, the state 64 KB)
    # SMEM, the head's conv taps for prep, two buffers (item parity): cw_smem [2, 3, W, K]; taps_bars [2] (3 copies)
    # SMEM, the prepared operands, two buffers (item parity: prep runs one item ahead of the update): prep_smem
    #   [2, 4, T, K] fp32 (q^, k^, beta k^, e^g; verify stores k^ and e^g from here by TMA); vb_smem [2, T, V] fp32
    #   (beta v)
    # o_smem [2, T, V] fp32: the update warpgroups' o rows, for the gated RMSNorm (item parity)
    # verify only, e_smem [2, T, V] fp32: the update warpgroups' err rows, stored with the norm (item parity)
    # chunk form only (item parity): xg_smem [2, T, K] fp32 each position's g, for the other warps of prep;
    #   ab_smem [2, T, K] fp32, row t: columns i < T the solve's beta_t (Gamma_t / Gamma_i k_i) . k_t, columns T + i
    #   the output's (Gamma_t / Gamma_i k_i) . q_t; sync_bar [1]: the prep warpgroup's own barrier (all 128 threads)
    # prep_bars [S]: the item's prepared operands are written; done_bars [S]: every update warpgroup is done with the
    #   item (V / 64 arrivals): its state can be stored (decode) and its slot refilled, its o (and err) rows written
    # norm_warpgroup only, norm_bars [2] (item parity): the item is normed and its err rows stored (their buffers and
    #   its operand slot are free)
    # Warpgroups: wg < V / 64 update state rows [64 wg, 64 wg + 64) of every item (the delta rule is row-separable
    # over V); the last one ("prep") issues the TMA ring, runs the vector work of item j + 1 (short convs, SiLU, L2
    # norms, gate, beta) while the others update item j's state, then stores item j's state back and applies its
    # gated RMSNorm. In verify the update warpgroups keep the state in registers across the T positions and write
    # only each position's err rows; the prep warpgroup stores k^ and e^g, the norm's warpgroup the err rows (a few
    # KB per item). With norm_warpgroup (verify's tiled norm) a fourth warpgroup does the norm, not prep.
    # prep_warpgroups = 2 (with the norm warpgroup, 2 state slots and an even number of operand slots): a second prep
    # warpgroup, the last, takes the odd items and the first the even ones. Every per-item resource prep touches is
    # then one prep's own: the item-parity buffers and barriers (taps, prepared operands, sync_bar [2], norm_bars) and
    # the slots numbered by item modulo 2 (state) or 4 (operands). Each prep waits for the norm of its item two back
    # before it rewrites that item's buffers (the norm warpgroup waited for the updates' done_bars first), so prep
    # waits on no done_bars. register_caps = (update, other): setmaxnreg per warpgroup.
    err_ref, key_ref, decay_ref = refs[:3] if all_states else (None,) * 3
    scratch = refs[3:] if all_states else refs
    (st_smem, seq_smem, z_smem, og_smem, cw_smem, prep_smem, vb_smem, o_smem, bars, taps_bars, prep_bars,
     done_bars, state_bars) = scratch[:13]
    e_smem = scratch[13] if all_states else None
    xg_smem, ab_smem, sync_bar = scratch[14:17] if chunk else (None,) * 3
    norm_bars = scratch[-1] if norm_warpgroup else None
    split_prep = prep_warpgroups == 2
    f32 = jnp.float32
    cta, num_ctas = lax.axis_index("cta"), lax.axis_size("cta")
    wg = lax.axis_index("wg")
    num_steps = (num_items - 1 - cta) // num_ctas + 1  # items cta, cta + G, ...: the grid never exceeds num_items
    dv, dk = st_smem.shape[1], st_smem.shape[2]
    num_update = dv // ROWS
    width = convw_ref.shape[0]
    tile = (ROWS, dk)

    def item_of(step):
        item = cta + step * num_ctas
        return item // num_heads, item % num_heads

    def segs_of(h):  # the head's q, k and v channels
        return [pl.ds((i * num_heads + h) * dk, dk) for i in range(3)]

    def beta_logit(b, t, h):
        return beta_ref[b, t, h] if packed is None else x_ref[b, t, packed[1] + h]

    def out_gate_rows(b, h):  # [T, V]
        return og_ref.at[b, :, h, :] if packed is None else x_ref.at[b, :, pl.ds(packed[0] + h * dv, dv)]

    def norm_weight():  # the same for every item
        if tiled_norm:
            return plgpu.load(onw_ref, (), layout=positions_layout(dv).reduce(0), optimized=False).astype(f32)
        return _vec(onw_ref)

    def gated_norm(step, norm_w):
        # the item's gated RMSNorm over all V, once every update warpgroup has written its o rows (done_bars),
        # before its operand slot (the output gate) is refilled. In the prep warpgroup, or with the tiled
        # norm in a warpgroup of its own (norm_warpgroup): Mosaic's full reductions share one shared-memory scratch,
        # so they must not run in two warpgroups at once (only prep does them; the update warpgroups, and the tiled
        # forms' warps, reduce within warps).
        b, h = item_of(step)
        oslot, buf = lax.rem(step, operand_stages), lax.rem(step, 2)
        if tiled_norm:  # verify at T = 4: the positions side by side, one a warp, each reduced within its warp
            lay = positions_layout(dv)
            o = plgpu.load(o_smem.at[buf], (), layout=lay, optimized=False)
            og = plgpu.load(og_smem.at[oslot], (), layout=lay, optimized=False).astype(f32)
            inv_rms = _across_cols(lax.rsqrt(jnp.sum(o * o, axis=1) / dv + eps), o.shape)
            y = o * inv_rms * _down_rows(norm_w, o.shape) * jax.nn.sigmoid(og)
            y_ref.at[b, :, h][...] = y.astype(y_ref.dtype)
        else:  # position by position, [V] strided vectors
            for t in range(num_tokens):
                o = _vec(o_smem.at[buf, t])
                y = o * lax.rsqrt(jnp.sum(o * o) / dv + eps) * norm_w * jax.nn.sigmoid(_vec(og_smem.at[oslot, t]))
                y_ref.at[b, t, h][...] = y.astype(y_ref.dtype)
        if all_states:  # the update warpgroups' err rows (committed before they arrived on done_bars)
            plgpu.copy_smem_to_gmem(e_smem.at[buf], err_ref.at[b, :, h, :])

    last_wg = num_update + norm_warpgroup + prep_warpgroups - 1
    prep_index = jnp.where(wg == num_update, 0, 1) if split_prep else 0  # which items: those of this parity

    @pl.when((wg == num_update) | (wg == last_wg) if split_prep else wg == num_update)
    def _prep_warpgroup():
        if register_caps is not None:
            plgpu.set_max_registers(register_caps[1], action="decrease")

        def issue(step):  # the item's operands (decode: and its state; verify's update warpgroups load their own)
            b, h = item_of(step)
            oslot, sl = lax.rem(step, operand_stages), slots_ref[b]
            bar = bars.at[oslot]
            for i, seg in enumerate(segs_of(h)):
                plgpu.copy_gmem_to_smem(x_ref.at[b, :, seg], seq_smem.at[oslot, i, pl.ds(width - 1, num_tokens)], bar)
                plgpu.copy_gmem_to_smem(conv_ref.at[sl, :, seg], seq_smem.at[oslot, i, pl.ds(0, width - 1)], bar)
            plgpu.copy_gmem_to_smem(z_ref.at[b, :, h, :], z_smem.at[oslot], bar)
            plgpu.copy_gmem_to_smem(out_gate_rows(b, h), og_smem.at[oslot], bar)
            if not all_states:
                slot = lax.rem(step, stages)
                plgpu.copy_gmem_to_smem(state_ref.at[sl, h], st_smem.at[slot], state_bars.at[slot])

        def store(step):  # item `step`'s state back to the pool once every update warpgroup is done with it
            b, h = item_of(step)
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(done_bars.at[slot])
            if not all_states:  # (verify leaves the pool alone: it writes each position's update instead)
                plgpu.copy_smem_to_gmem(st_smem.at[slot], state_ref.at[slots_ref[b], h])

        def issue_taps(step):  # the head's conv taps into their own two-deep ring (prep is their only reader)
            _, h = item_of(step)
            buf = lax.rem(step, 2)
            for i, seg in enumerate(segs_of(h)):
                plgpu.copy_gmem_to_smem(convw_ref.at[:, seg], cw_smem.at[buf, i], taps_bars.at[buf])

        def publish(step, b, h, slot, buf):
            # the item's prepared operands to the update warpgroups (and, in verify, its k^ and e^g to GMEM)
            plgpu.commit_smem()
            if all_states:
                # the update rows' buffer (e_smem) and this buffer parity's operands are rewritten for the item
                # after next: their stores (issued an item ago) must have read them before the updates start
                if norm_warpgroup and not split_prep:  # (that of e_smem, and the norm's reads of o_smem, in the
                    # norm warpgroup; a split prep waited before it wrote this item's buffers)
                    pl.when(step >= 2)(lambda: plgpu.barrier_wait(norm_bars.at[buf]))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(prep_bars.at[slot])
            if all_states:  # the item's k^ and e^g for every position, [T, K] each
                plgpu.copy_smem_to_gmem(prep_smem.at[buf, 1], key_ref.at[b, :, h, :], commit_group=False)
                plgpu.copy_smem_to_gmem(prep_smem.at[buf, 3], decay_ref.at[b, :, h, :])

        def prep_tiled(step):
            # verify at T = 4: the same work as `prep` on [T, K] tiles, one position per warp
            # (positions_layout): the convs of all positions at once (tap j times seq rows j .. j + T - 1, the
            # current input's tap first, as `_conv_positions` sums), the L2 norms and later the update operands
            # without a shared-memory reduction; no conv states (verify writes none)
            b, h = item_of(step)
            slot, oslot, buf = lax.rem(step, stages), lax.rem(step, operand_stages), lax.rem(step, 2)
            length, fresh = lens_ref[b], fresh_ref[b] != 0
            lay = positions_layout(dk)
            tile_t = (num_tokens, dk)
            position = plgpu.broadcasted_iota(jnp.int32, tile_t, 0, layout=lay)
            valid = position < lax.broadcast(length, tile_t)
            load = lambda ref: plgpu.load(ref, (), layout=lay, optimized=False).astype(f32)  # noqa: E731
            load_col = lambda ref: _down_rows(  # noqa: E731
                plgpu.load(ref, (), layout=lay.reduce(0), optimized=False).astype(f32), tile_t)
            a = jnp.exp(alog_ref[h])
            beta = jnp.zeros(tile_t, f32)
            for t in range(num_tokens):
                beta_t = jnp.where(t < length, jax.nn.sigmoid(beta_logit(b, t, h).astype(f32)), 0.0)
                beta = jnp.where(position == t, lax.broadcast(beta_t, tile_t), beta)
            plgpu.barrier_wait(taps_bars.at[buf])
            plgpu.barrier_wait(bars.at[oslot])
            acts = []
            for i in range(3):
                def tap_times_rows(j, i=i):
                    x = load(seq_smem.at[oslot, i, pl.ds(j, num_tokens)])
                    if j < width - 1:  # rows t + j < W - 1 are the conv window: zeros for a fresh row
                        in_window = (position + j < width - 1) & lax.broadcast(fresh, tile_t)
                        x = jnp.where(in_window, jnp.zeros_like(x), x)
                    return load_col(cw_smem.at[buf, i, j]) * x
                acc = tap_times_rows(width - 1)
                for j in range(width - 1):
                    acc = acc + tap_times_rows(j)
                acts.append(jax.nn.silu(acc).astype(act_dtype).astype(f32))
            q, k, v = acts
            q = q * _across_cols(lax.rsqrt(jnp.sum(q * q, axis=1) + _L2_EPS), tile_t) * dk ** -0.5
            k = k * _across_cols(lax.rsqrt(jnp.sum(k * k, axis=1) + _L2_EPS), tile_t)
            g = _gate(load(z_smem.at[oslot]), a, load_col(dtb_ref.at[h]), gate, lower_bound)
            g = jnp.where(valid, g, jnp.zeros_like(g))  # a padded position leaves the state as it is
            prep_smem.at[buf, 1][...] = k
            prep_smem.at[buf, 3][...] = jnp.exp(g)
            vb_smem.at[buf][...] = beta * v
            if chunk:
                chunk_operands(buf, position, q, k, g, beta, load_col)
            else:
                prep_smem.at[buf, 0][...] = q
                prep_smem.at[buf, 2][...] = beta * k
            publish(step, b, h, slot, buf)

        def chunk_operands(buf, position, q, k, g, beta, load_col):
            # The chunk form's operands (one warp a position t, as prep_tiled). With Gamma_t = exp(G_t),
            # G_t = g_1 + .. + g_t (per channel), the state after t positions is S_0 Gamma_t + sum_{i <= t} err_i
            # (Gamma_t / Gamma_i k_i)^T, so
            #   err_t = beta_t v_t - S_0 (beta_t Gamma_t k_t) - sum_{i < t} A[t, i] err_i,
            #   A[t, i] = beta_t (Gamma_t / Gamma_i k_i) . k_t;
            #   o_t = S_0 (Gamma_t q_t) + sum_{i <= t} B[t, i] err_i,   B[t, i] = (Gamma_t / Gamma_i k_i) . q_t.
            # The update warpgroups then read the state once for 2T independent products (no chain through S).
            # Gamma_t / Gamma_i is exp(G_t - G_i) <= 1, never a quotient: no overflow however fast the decay.
            tile_t = q.shape
            xg_smem.at[buf][...] = g
            plgpu.commit_smem()
            plgpu.barrier_arrive(sync_bar.at[prep_index])  # every warp's g and k^ rows are in shared memory
            plgpu.barrier_wait(sync_bar.at[prep_index])
            g_rows = [load_col(xg_smem.at[buf, j]) for j in range(num_tokens)]  # g_j, down every row
            zeros = jnp.zeros(tile_t, jnp.float32)
            cum_g, cum_g_rows = zeros, []  # G (row t: G_t); G_i down every row
            for j, g_j in enumerate(g_rows):
                cum_g = cum_g + jnp.where(position >= j, g_j, zeros)
                cum_g_rows.append(g_j if j == 0 else cum_g_rows[-1] + g_j)
            decay = jnp.exp(cum_g)
            prep_smem.at[buf, 0][...] = decay * q
            prep_smem.at[buf, 2][...] = beta * decay * k
            column = plgpu.broadcasted_iota(jnp.int32, tile_t, 1, layout=positions_layout(tile_t[1]))
            ab = zeros
            for i in range(num_tokens):
                key_i = load_col(prep_smem.at[buf, 1, i]) * jnp.exp(
                    jnp.where(position >= i, cum_g - cum_g_rows[i], zeros))  # row t: Gamma_t / Gamma_i k_i
                ab = jnp.where(column == i, _across_cols(jnp.sum(beta * k * key_i, axis=1), tile_t), ab)
                ab = jnp.where(column == num_tokens + i, _across_cols(jnp.sum(q * key_i, axis=1), tile_t), ab)
            ab_smem.at[buf][...] = ab

        def split_prep_loop():
            # this prep's items: steps prep_index, prep_index + 2, ... (see the comment at the top)
            for first in range(0, operand_stages, 2):
                pl.when(first + prep_index < num_steps)(lambda first=first: issue(first + prep_index))
            pl.when(prep_index < num_steps)(lambda: issue_taps(prep_index))

            @pl.loop(prep_index, num_steps, step=2)
            def _prep_step(step):
                @pl.when(step >= 2)
                def _():  # the item two back is normed (so updated) and its k^ / e^g stores have read the buffers
                    plgpu.barrier_wait(norm_bars.at[lax.rem(step, 2)])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                prep(step)
                pl.when(step + 2 < num_steps)(lambda: issue_taps(step + 2))  # prep(step) has read its buffer
                refill = step - 2 + operand_stages  # into the operand slot of the item two back, normed above
                pl.when((step >= 2) & (refill < num_steps))(lambda: issue(refill))

            # this prep's last item's norm, which no step above waited for (every phase is observed before exit)
            pl.when(prep_index < num_steps)(lambda: plgpu.barrier_wait(norm_bars.at[prep_index]))
            plgpu.wait_smem_to_gmem(0)

        def prep(step):
            if tiled_prep:
                return prep_tiled(step)
            # [K] vectors in the strided layout (K / 128 elements a thread; loads and stores vectorised): the
            # update warpgroups' WGMMA column form holds 32 replicated values a thread, 32x the work for this code.
            # Two passes through shared memory: (1) per channel segment, the short conv + SiLU of every position
            # into the operand buffers, the new conv state to the pool; (2) per position, the norms, gate and beta
            # applied in place
            b, h = item_of(step)
            slot, oslot, buf = lax.rem(step, stages), lax.rem(step, operand_stages), lax.rem(step, 2)
            sl, length = slots_ref[b], lens_ref[b]
            fresh = fresh_ref[b] != 0
            valids = [t < length for t in range(num_tokens)]
            a = jnp.exp(alog_ref[h])
            betas = [jnp.where(valids[t], jax.nn.sigmoid(beta_logit(b, t, h).astype(f32)), 0.0)
                     for t in range(num_tokens)]
            plgpu.barrier_wait(taps_bars.at[buf])
            plgpu.barrier_wait(bars.at[oslot])
            acts_out = [lambda t: prep_smem.at[buf, 0, t], lambda t: prep_smem.at[buf, 1, t],
                        lambda t: vb_smem.at[buf, t]]  # where each segment's raw activations go (q, k, v)

            def put(ref, value):
                ref[...] = value

            for i, seg in enumerate(segs_of(h)):
                window = [_vec(seq_smem.at[oslot, i, r]).astype(act_dtype) for r in range(width - 1)]
                window = [_select(fresh, jnp.zeros_like(w), w) for w in window]  # zeros, not a fresh slot's bytes
                kept = _conv_positions(lambda j, i=i: _vec(cw_smem.at[buf, i, j]), window,
                                       lambda t, i=i: _vec(seq_smem.at[oslot, i, width - 1 + t]), valids, act_dtype,
                                       store=lambda t, act, i=i: put(acts_out[i](t), act))
                if not all_states:
                    for r in range(width - 1):
                        conv_ref.at[sl, r, seg][...] = kept[r].astype(conv_ref.dtype)
            dtb = _vec(dtb_ref.at[h])
            plgpu.commit_smem()
            for t in range(num_tokens):
                op = lambda j, t=t: prep_smem.at[buf, j, t]  # noqa: E731
                q, k = _vec(op(0)), _vec(op(1))
                q = q * lax.rsqrt(jnp.sum(q * q) + _L2_EPS) * dk ** -0.5
                k = k * lax.rsqrt(jnp.sum(k * k) + _L2_EPS)
                g = _gate(_vec(z_smem.at[oslot, t]), a, dtb, gate, lower_bound)
                op(0)[...] = q
                op(1)[...] = k
                op(2)[...] = betas[t] * k
                op(3)[...] = jnp.exp(_select(valids[t], g, jnp.zeros_like(g)))
                vb_smem.at[buf, t][...] = betas[t] * _vec(vb_smem.at[buf, t])
            publish(step, b, h, slot, buf)

        if split_prep:
            split_prep_loop()
            return
        for first in range(operand_stages):
            pl.when(first < num_steps)(functools.partial(issue, first))
        issue_taps(0)

        norm_w = None if norm_warpgroup else norm_weight()

        @pl.loop(0, num_steps)
        def _prep_step(step):
            pl.when(step + 1 < num_steps)(lambda: issue_taps(step + 1))  # its buffer's reader, prep(step - 1), is done
            prep(step)
            if norm_warpgroup:  # publish waited for the norm of the item two back: its operand slot takes a new item
                refill = step - 2 + operand_stages
                pl.when((step >= 2) & (refill < num_steps))(lambda: issue(refill))

            @pl.when(step >= 1)
            def _():  # the previous item's state goes back, and its slots are refilled once the store has read it
                store(step - 1)
                if not norm_warpgroup:
                    gated_norm(step - 1, norm_w)
                    if not all_states:
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    pl.when(step - 1 + operand_stages < num_steps)(lambda: issue(step - 1 + operand_stages))

        store(num_steps - 1)
        if not norm_warpgroup:
            gated_norm(num_steps - 1, norm_w)
        else:  # the last two items' norms, which no publish waited for (every phase is observed before exit)
            for back in (2, 1):
                pl.when(num_steps >= back)(
                    lambda back=back: plgpu.barrier_wait(norm_bars.at[lax.rem(num_steps - back, 2)]))
        plgpu.wait_smem_to_gmem(0)

    if norm_warpgroup:
        @pl.when(wg == num_update + 1)
        def _norm_warpgroup():
            if register_caps is not None:
                plgpu.set_max_registers(register_caps[1], action="decrease")
            # verify's tiled gated norm and err stores, item by item, beside prep (which runs an item ahead); an item's
            # operand slot (its output gate) and its o / err parity buffers are free once it arrives on norm_bars
            norm_w = norm_weight()

            @pl.loop(0, num_steps)
            def _norm_step(step):
                slot, oslot = lax.rem(step, stages), lax.rem(step, operand_stages)
                plgpu.barrier_wait(bars.at[oslot])  # the output gate has landed (prep waited for it too)
                plgpu.barrier_wait(done_bars.at[slot])  # the update warpgroups' o and err rows are written
                gated_norm(step, norm_w)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the err store has read e_smem
                plgpu.barrier_arrive(norm_bars.at[lax.rem(step, 2)])

            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg < num_update)
    def _update_warpgroup():
        if register_caps is not None:
            plgpu.set_max_registers(register_caps[0], action="increase")
        blk = pl.ds(pl.multiple_of(wg * ROWS, ROWS), ROWS)  # this warpgroup's state rows / v channels / o rows

        def chunk_rows(s, buf):
            # verify in the chunk form (chunk_operands has the algebra): S_0's rows times the 2T prepared vectors,
            # independent products with no chain through the state, then T x T scalar corrections per row
            errs = []
            for t in range(num_tokens):
                op = lambda j, t=t: prep_smem.at[buf, j, t]  # noqa: E731
                err = _rows(vb_smem.at[buf, t, blk]) - jnp.sum(s * _down_rows(_cols(op(2)), tile), axis=1)
                for i, err_i in enumerate(errs):
                    err = err - ab_smem[buf, t, i] * err_i
                errs.append(err)
                e_smem.at[buf, t, blk][...] = err
                o = jnp.sum(s * _down_rows(_cols(op(0)), tile), axis=1)
                for i, err_i in enumerate(errs):
                    o = o + ab_smem[buf, t, num_tokens + i] * err_i
                o_smem.at[buf, t, blk][...] = o.astype(act_dtype).astype(f32)

        def sequential_rows(s, rows, buf):
            # decode, and verify outside the chunk form: the delta rule position by position
            for t in range(num_tokens):
                op = lambda j, t=t: prep_smem.at[buf, j, t]  # noqa: E731
                if not all_states:  # decode: the state lives in its slot between positions (fewer registers)
                    s = plgpu.load(rows, layout=_TILE)
                s = s * _down_rows(_cols(op(3)), tile)
                err = _rows(vb_smem.at[buf, t, blk]) - jnp.sum(s * _down_rows(_cols(op(2)), tile), axis=1)
                s = s + _across_cols(err, tile) * _down_rows(_cols(op(1)), tile)
                if all_states:  # verify writes no state: err is this position's update of these rows
                    e_smem.at[buf, t, blk][...] = err
                else:
                    rows[...] = s
                o_smem.at[buf, t, blk][...] = jnp.sum(s * _down_rows(_cols(op(0)), tile), axis=1).astype(
                    act_dtype).astype(f32)

        def state_bar(slot):
            return state_bars.at[slot * num_update + wg] if all_states else state_bars.at[slot]

        def issue_rows(step):  # verify: this warpgroup's rows of the item's state into its state slot
            b, h = item_of(step)
            slot = lax.rem(step, stages)
            plgpu.copy_gmem_to_smem(state_ref.at[slots_ref[b], h, blk], st_smem.at[slot, blk], state_bar(slot))

        if all_states:
            for first in range(stages):
                pl.when(first < num_steps)(functools.partial(issue_rows, first))

        @pl.loop(0, num_steps)
        def _update_step(step):
            b, h = item_of(step)
            slot, buf = lax.rem(step, stages), lax.rem(step, 2)
            rows = st_smem.at[slot, blk]
            plgpu.barrier_wait(state_bar(slot))
            plgpu.barrier_wait(prep_bars.at[slot])

            @pl.when(fresh_ref[b] != 0)
            def _():  # a fresh row starts from zeros, whatever its slot held (a select: exact over NaN / inf)
                rows[...] = plgpu.layout_cast(jnp.zeros(tile, f32), _TILE)

            s = plgpu.load(rows, layout=_TILE) if all_states else None
            if chunk:
                chunk_rows(s, buf)
            else:
                sequential_rows(s, rows, buf)
            # the new state rows, o (and err) are visible to the TMA engine and the prep warpgroup; in verify every
            # thread's reads of the rows are done, so the slot takes the item after next
            plgpu.commit_smem()
            if all_states:
                pl.when(step + stages < num_steps)(lambda: issue_rows(step + stages))
            plgpu.barrier_arrive(done_bars.at[slot])


def scratch_types(dv: int, dk: int, stages: int, num_tokens: int, width: int, act, taps_dtype, all_states: bool = True,
                  chunk: bool = False, z_dtype=None, gate_dtype=None, operand_stages: int | None = None,
                  norm_warpgroup: bool = False, prep_warpgroups: int = 1) -> list:
    """The kernel's scratch, in `_item_kernel`'s order (its comment says what each holds): `stages` slots of the fp32
    state, `operand_stages` (default: stages) of the item's operands (q|k|v and the conv window in the activation
    dtype `act`, z in z_dtype and the output gate in gate_dtype, both act unless given); two buffers (item parity)
    of the conv taps, the prepared vectors, the o rows, (verify) the err rows and (chunk form) prep's g rows and its
    A | B coefficients; barriers (with norm_warpgroup, last, its two)."""
    t, ops = num_tokens, operand_stages or stages
    ring = lambda *shape, dtype=act: plgpu.SMEM((ops, *shape), dtype)  # noqa: E731
    state_swizzle = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    return [
        plgpu.SMEM((stages, dv, dk), jnp.float32, transforms=state_swizzle),
        ring(3, width - 1 + t, dk), ring(t, dk, dtype=z_dtype or act), ring(t, dv, dtype=gate_dtype or act),
        plgpu.SMEM((2, 3, width, dk), taps_dtype),
        plgpu.SMEM((2, 4, t, dk), jnp.float32), plgpu.SMEM((2, t, dv), jnp.float32),
        plgpu.SMEM((2, t, dv), jnp.float32),
        plgpu.Barrier(num_arrivals=OPERAND_COPIES_PER_ITEM, num_barriers=ops),
        plgpu.Barrier(num_arrivals=3, num_barriers=2),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=dv // ROWS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages * (dv // ROWS if all_states else 1)),
    ] + ([plgpu.SMEM((2, t, dv), jnp.float32)] if all_states else []) + ([
        plgpu.SMEM((2, t, dk), jnp.float32), plgpu.SMEM((2, t, dk), jnp.float32),
        plgpu.Barrier(num_arrivals=1, num_barriers=prep_warpgroups)] if chunk else []) + (
        [plgpu.Barrier(num_arrivals=1, num_barriers=2)] if norm_warpgroup else [])


def split_prep_register_caps(num_update: int):
    """SPLIT_PREP_REGISTER_CAPS for a two-prep kernel with `num_update` update warpgroups (and a norm warpgroup), or
    None where they do not fit what the launch gives its warpgroups (64K registers over all threads, in steps of 8 a
    thread): setmaxnreg can only move registers between warpgroups, and an increase past the pool never returns.
    K3's V = 128 (2 update warpgroups, 5 in all, 96 a thread): 2 x 144 + 3 x 64 = 480 fits; V = 192 or 256 do not."""
    if SPLIT_PREP_REGISTER_CAPS is None:
        return None
    update, other = SPLIT_PREP_REGISTER_CAPS
    warpgroups = num_update + 3
    launch = 65536 // (128 * warpgroups) // 8 * 8
    return SPLIT_PREP_REGISTER_CAPS if num_update * update + 3 * other <= warpgroups * launch else None


def smem_bytes(scratch: list) -> int:
    """Shared memory of a scratch list as Mosaic GPU allocates it: each buffer rounded up to SMEM_ALIGNMENT, 8 bytes
    a barrier, the reduction scratch."""
    total = REDUCTION_SCRATCH_BYTES
    for ref in scratch:
        if isinstance(ref, plgpu.Barrier):
            total += 8 * math.prod(ref.num_barriers)
        else:
            total += -(-math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize // SMEM_ALIGNMENT) * SMEM_ALIGNMENT
    return total


def default_stages(**args) -> int:
    """The most state slots (<= 3) whose ring fits the shared memory with as many operand slots (3 at T = 1, K = V =
    128; 2 for long verify-size T); args: `scratch_types`' but the two depths."""
    fitting = [s for s in (3, 2) if smem_bytes(scratch_types(stages=s, **args)) <= SMEM_LIMIT]
    return fitting[0] if fitting else 2


def default_operand_stages(stages: int, **args) -> int:
    """Decode: `stages` (one ring). Verify: the most operand slots up to VERIFY_OPERAND_STAGES (and no fewer than
    `stages`) that fit beside `stages` state slots; args: `scratch_types`' but the two depths."""
    if not args.get("all_states", True):
        return stages
    fitting = [o for o in range(max(VERIFY_OPERAND_STAGES, stages), stages, -1)
               if smem_bytes(scratch_types(stages=stages, operand_stages=o, **args)) <= SMEM_LIMIT]
    return fitting[0] if fitting else stages


def _scratch_args(qkv, conv_weight, z, out_gate, state, packed) -> dict:
    """`scratch_types`' size and dtype arguments for these operands (the conv pool is in the activation dtype)."""
    dv, dk = state.shape[2:]
    gate = qkv if packed is not None else out_gate  # packed: the output gate is qkv's columns
    return dict(dv=dv, dk=dk, num_tokens=qkv.shape[1], width=conv_weight.shape[0], act=qkv.dtype,
                taps_dtype=conv_weight.dtype, z_dtype=z.dtype, gate_dtype=gate.dtype)


def _unsupported(qkv, conv_state, conv_weight, z, out_gate, state, packed=None) -> str | None:
    """Why kda_decode_mgpu cannot take these (kda_decode-valid) operands, or None; the ring's depth apart."""
    dv, dk = state.shape[2:]
    if packed is not None:
        # TMA reads the output gate's rows at column packed[0] of rows C wide: both must fall on 16 bytes
        row_bytes, col_bytes = qkv.shape[2] * qkv.dtype.itemsize, packed[0] * qkv.dtype.itemsize
        if row_bytes % 16 or col_bytes % 16:
            return (f"with packed, the projection's rows ({row_bytes} B) and the output gate's column offset "
                    f"({col_bytes} B) must be multiples of 16 bytes for TMA")
    if dv != dk or dv % ROWS or dv > 4 * ROWS or dk % 128:
        return (f"the Mosaic GPU decode kernel needs V == K, V % {ROWS} == 0, V <= {4 * ROWS} (a warpgroup per {ROWS} "
                f"rows) and K % 128 == 0 (a warpgroup's strided vector); got V={dv}, K={dk}")
    if state.dtype != jnp.float32:
        return f"the state pool must be fp32; got {state.dtype}"
    if conv_state.dtype != qkv.dtype:
        return f"conv_state must be in the activation dtype {qkv.dtype}; got {conv_state.dtype}"
    if smem_bytes(scratch_types(stages=2, **_scratch_args(qkv, conv_weight, z, out_gate, state, packed))) > SMEM_LIMIT:
        return f"a ring of 2 slots exceeds {SMEM_LIMIT} bytes of shared memory at T={qkv.shape[1]}"
    return None


def supported(qkv, conv_state, conv_weight, z, beta, out_gate, state, *_, packed=None) -> bool:
    """Whether kda_decode_mgpu takes these operands (kda_decode's argument order): V == K, K a multiple of 128 up
    to 256, an fp32 state, the conv pool in the activation dtype, a ring of 2 slots fitting shared memory, and
    with `packed` a projection whose rows and output-gate column TMA can address."""
    if state.ndim != 4 or qkv.ndim != 3:
        return False
    return _unsupported(qkv, conv_state, conv_weight, z, out_gate, state, packed) is None


@functools.partial(jax.jit, static_argnames=("gate", "lower_bound", "eps", "interpret", "num_ctas", "stages",
                                             "operand_stages", "all_states", "packed", "tiled_prep", "tiled_norm",
                                             "chunk_verify", "norm_warpgroup", "prep_warpgroups"))
def kda_decode_mgpu(qkv, conv_state, conv_weight, z, beta, out_gate, state, slots, lengths, *, a_log, dt_bias,
                    o_norm_weight, gate="lower_bound", lower_bound=-5.0, eps=1e-5, fresh=None, all_states=False,
                    packed=None, interpret=False, num_ctas=None, stages=None, operand_stages=None, tiled_prep=None,
                    tiled_norm=None, chunk_verify=None, norm_warpgroup=None, prep_warpgroups=None):
    """Fused KDA decode (T = 1..8 new tokens) or verify (all_states) for B sequences living in pooled states.

    Arguments and results as `kda_decode.kda_decode`: decode, (y [B, T, H, V], new conv pool, new state pool), the
    pools updated in place at `slots` when the caller donates them; verify (all_states=True), (y, (err [B, T, H, V],
    key [B, T, H, K], decay [B, T, H, K]) every position's state update), the pools only read (no conv states:
    k3jax.kda.conv_window_after rebuilds a kept window from the pool and the step's inputs).

    packed = (out-gate column, beta column), as kda_decode's: qkv is the whole input projection [B, T, C] (q|k|v
    its leading 3HK columns), beta and out_gate are None, and the kernel reads both from qkv's columns in place
    (the serving layout's fused GEMM output; no slices per step). C and the out-gate column must fall on 16 bytes.

    Extra knobs: num_ctas, the persistent grid (None: min(132, B * H), one CTA per H200 SM); stages, the number of
    state slots, each an item's [V, K] fp32 state (None: `default_stages`, 3 at T = 1 and K = V = 128);
    operand_stages, the number of slots for the items' operands (decode: stages, one ring; verify, None:
    `default_operand_stages`, 4 beside 2 state slots at T = 4 in bf16).
    tiled_prep: verify's vector work on [4, K] tiles (verify at T = 4 only; None: TILED_VERIFY_PREP there).
    tiled_norm, chunk_verify: with the tiled prep, the gated RMSNorm on [4, V] tiles too (None: TILED_VERIFY_NORM),
    and the state applied once in the chunk form (`chunk_operands`) instead of position by position (None:
    CHUNK_VERIFY).
    norm_warpgroup: verify's tiled gated norm in a warpgroup of its own (None: NORM_WARPGROUP where it fits);
    prep_warpgroups: 1 or 2 prep warpgroups, 2 taking alternate items (needs the norm warpgroup, 2 state slots and an
    even number of operand slots; None: PREP_WARPGROUPS where that holds and split_prep_register_caps has caps).
    Sizes: V a multiple of 64 up to 256, K of 128; conv_state in the activation dtype.
    """
    _check(qkv, conv_state, conv_weight, z, beta, out_gate, state, slots, lengths, fresh, a_log, dt_bias,
           o_norm_weight, gate, packed)
    bsz, t, c = qkv.shape
    p, h, dv, dk = state.shape
    reason = _unsupported(qkv, conv_state, conv_weight, z, out_gate, state, packed)
    if reason is not None:
        raise ValueError(reason)
    tiles_fit = all_states and t == 4
    if tiled_prep and not tiles_fit:
        raise ValueError(f"tiled_prep is for verify (all_states) at T = 4, got T={t}, all_states={all_states}")
    tiled_prep = (TILED_VERIFY_PREP if tiled_prep is None else tiled_prep) and tiles_fit
    for knob, value in (("tiled_norm", tiled_norm), ("chunk_verify", chunk_verify)):
        if value and not tiled_prep:
            raise ValueError(f"{knob} needs the tiled prep (verify at T = 4, tiled_prep not False)")
    tiled_norm = (TILED_VERIFY_NORM if tiled_norm is None else tiled_norm) and tiled_prep
    chunk = (CHUNK_VERIFY if chunk_verify is None else chunk_verify) and tiled_prep
    if norm_warpgroup and not tiled_norm:
        raise ValueError("norm_warpgroup needs the tiled norm (verify at T = 4, tiled_prep and tiled_norm not False)")
    asked_norm_warpgroup = norm_warpgroup
    norm_warpgroup = NORM_WARPGROUP and tiled_norm if norm_warpgroup is None else norm_warpgroup
    args = dict(_scratch_args(qkv, conv_weight, z, out_gate, state, packed), all_states=all_states, chunk=chunk,
                norm_warpgroup=norm_warpgroup)
    stages = default_stages(**args) if stages is None else stages
    if not isinstance(stages, int) or stages < 2 or smem_bytes(scratch_types(stages=stages, **args)) > SMEM_LIMIT:
        raise ValueError(f"stages must be >= 2 with the ring ({smem_bytes(scratch_types(stages=2, **args))} bytes per "
                         f"2 slots) within {SMEM_LIMIT} bytes of shared memory; got {stages!r}")
    if operand_stages is None:
        operand_stages = default_operand_stages(stages, **args)
    elif not all_states and operand_stages != stages:
        raise ValueError(f"decode has one ring: operand_stages must be None or stages ({stages}); got "
                         f"{operand_stages!r}")
    elif (not isinstance(operand_stages, int) or operand_stages < stages
          or smem_bytes(scratch_types(stages=stages, operand_stages=operand_stages, **args)) > SMEM_LIMIT):
        raise ValueError(f"operand_stages must be an int >= stages ({stages}) whose slots fit beside the state's in "
                         f"{SMEM_LIMIT} bytes of shared memory; got {operand_stages!r}")
    if norm_warpgroup and operand_stages < 3:
        # prep issues an item's operands once the norm of the item two back is done: into a third slot at least
        if asked_norm_warpgroup:
            raise ValueError(f"norm_warpgroup needs operand_stages >= 3; got {operand_stages}")
        norm_warpgroup = False
        args["norm_warpgroup"] = False
    split_fits = norm_warpgroup and stages == 2 and operand_stages % 2 == 0
    caps = split_prep_register_caps(dv // ROWS)
    if prep_warpgroups not in (None, 1, 2):
        raise ValueError(f"prep_warpgroups must be 1 or 2, got {prep_warpgroups!r}")
    if prep_warpgroups == 2 and not split_fits:
        raise ValueError(f"prep_warpgroups=2 needs the norm warpgroup, stages == 2 and an even operand_stages; got "
                         f"norm_warpgroup={norm_warpgroup}, stages={stages}, operand_stages={operand_stages}")
    if prep_warpgroups is None:  # two by default only with their register caps (measured at V = 128; without the
        # caps the update math spills and two preps were slower than one)
        prep_warpgroups = PREP_WARPGROUPS if split_fits and caps is not None else 1
    args["prep_warpgroups"] = prep_warpgroups
    num_items = bsz * h
    num_ctas = min(H200_SM_COUNT, num_items) if num_ctas is None else num_ctas
    if not isinstance(num_ctas, int) or not 1 <= num_ctas <= num_items:
        raise ValueError(f"num_ctas must be in 1..B*H = {num_items}; got {num_ctas!r}")
    fresh = jnp.zeros((bsz,), jnp.int32) if fresh is None else fresh.astype(jnp.int32)
    act = qkv.dtype
    y_type = jax.ShapeDtypeStruct((bsz, t, h, dv), act)
    kernel = plgpu.kernel(
        functools.partial(_item_kernel, num_items=num_items, num_heads=h, num_tokens=t, stages=stages,
                          operand_stages=operand_stages, gate=gate,
                          lower_bound=lower_bound, eps=eps, act_dtype=act, all_states=all_states, packed=packed,
                          tiled_prep=tiled_prep, tiled_norm=tiled_norm, chunk=chunk, norm_warpgroup=norm_warpgroup,
                          prep_warpgroups=prep_warpgroups,
                          register_caps=caps if prep_warpgroups == 2 else None),
        out_type=(y_type, jax.ShapeDtypeStruct((bsz, t, h, dv), jnp.float32),
                  jax.ShapeDtypeStruct((bsz, t, h, dk), jnp.float32),
                  jax.ShapeDtypeStruct((bsz, t, h, dk), jnp.float32)) if all_states else y_type,
        scratch_types=scratch_types(stages=stages, operand_stages=operand_stages, **args),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=dv // ROWS + prep_warpgroups + norm_warpgroup,  # the update warpgroups, prep (and the norm's)
        thread_name="wg",
        kernel_name="kda_decode_verify_mgpu" if all_states else "kda_decode_mgpu",  # (profiles group by "kda_decode")
        compiler_params=plgpu.CompilerParams(approx_math=APPROX_MATH, reduction_scratch_bytes=REDUCTION_SCRATCH_BYTES),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    if packed is not None:  # beta and the output gate are qkv's columns: qkv again in their places (never read)
        beta = out_gate = qkv
    operands = (slots.astype(jnp.int32), lengths.astype(jnp.int32), fresh, qkv, conv_weight, z, beta, out_gate,
                a_log[:h].astype(jnp.float32), dt_bias.astype(jnp.float32).reshape(h, dk), o_norm_weight)
    if all_states:  # the pools are only read
        y, *updates = kernel(*operands, conv_state, state)
        return y, tuple(updates)
    # the pools as mutable refs: the kernel's writes become in-place updates (input/output aliasing)
    conv_ref, state_ref = jax.new_ref(conv_state), jax.new_ref(state)
    y = kernel(*operands, conv_ref, state_ref)
    return y, conv_ref[...], state_ref[...]


__all__ = ["kda_decode_mgpu", "kda_decode_mgpu_reference", "GATES", "MAX_TOKENS"]
