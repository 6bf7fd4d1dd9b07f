"""Fused KDA decode on Mosaic GPU: the recurrent state streamed through shared memory by TMA.

The same job as `kda_decode.kda_decode` in decode mode (all_states=False; verify stays on the Triton kernel): per
sequence b (state slot slots[b]) and head h, for each of the T <= 8 new tokens, the short conv (conv state in and out,
in place), SiLU, q / k L2 norm, the gate, beta, the delta rule on the V-first fp32 state S [V, K], the output and the
gated RMSNorm -- one launch per layer, k3-model.md §3:

    S <- S * e^g[None, :];   S <- S + beta (v - S k) k^T;   o = S q;   y = RMSNorm(o) * w * sigmoid(gate)

Why a second kernel: the Triton one (loads into registers, one program per (sequence, head)) moves the state at
73-77 % of the measured copy bandwidth at B64 / B256 H96, and nothing in its tiling, cache hints or a streamed
scf.for got past that (kda_decode's docstring). The state is the whole memory floor (read once, written once), so
this kernel is built around moving it: a persistent grid of one CTA per SM walks (sequence, head) items cta,
cta + G, cta + 2G, ... (heads fastest, so neighbouring CTAs stream neighbouring memory). Each item's [V, K] state
(64 KB at 128 x 128) and its few KB of operands (q|k|v inputs, conv windows and taps, z, output gate) arrive by TMA
into a ring of `stages` shared-memory slots, issued `stages - 1` items ahead. V / 64 warpgroups split each state's
rows (the delta rule is row-separable over V); each updates its [64, K] tile in registers in the WGMMA layout (K
along a row spread over 4 lanes, so S k and S q are in-register sums plus two shuffles), writes it back into the
slot, and warpgroup 0 returns the slot to the pool with one TMA store once all are done (a barrier). A slot is
refilled only after its store has read it (`wait_smem_to_gmem(0, wait_read_only=True)` at the top of the next
item). K-vectors (q, k, e^g) live in the WGMMA layout's column form (`reduce(0)`: broadcast down a tile's rows),
V-rows (v, o, y) in its row form (`reduce(1)`); the output norm's mean square is shared through shared memory.

Measured on the H200 (2026-12-02, benchmarks/kda.py --decode-variants mgpu,mgpu_s2, raw JSON
docs/results/kda_decode_mgpu_h200_2026-12-02.json; torch copy 4.15 TB/s): correct (state equal to the Triton
kernel's to 9e-6, y to bf16 rounding; tests/gpu/test_kda_gpu.py -k mgpu), in place (no pool copy in the HLO), but
**slower than the Triton kernel, so it is not wired into the model**: B64 T1 H96 0.370 ms (Triton 0.263, fla 0.286),
B256 1.372 ms (Triton 1.014). Where the time goes (an ablation of the first version at B64: parts replaced by
constants): TMA streaming alone, state read and written, 0.228 ms = 3.53 TB/s = 84 % of copy; with the state
update 0.236 ms (3.42 TB/s, 81 %), i.e. the streaming design itself clears the issue's 80 % bar. The rest is the
per-item vector work (two short convs + SiLU, two L2 norms, the gate, the output norm): with one warpgroup per SM
it is latency-bound (a single warp per scheduler hides nothing) and ran ~10 us per item against ~5 us of memory
time. Loading the operands by TMA instead of from global memory took B64 from 0.61 to 0.47 ms; two warpgroups per
CTA and MUFU math (APPROX_MATH) to 0.37. Next (not done): keep the vector work off the critical path -- compute item
i + 1's q / k / gate while item i's state streams (software pipelining in registers), or a third warpgroup doing
only that work for the others, or precompute q / k / e^g / beta in the projection epilogue so the kernel only
streams the state.

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

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda_decode import GATES, MAX_TOKENS, _check, kda_decode_reference

ROWS = 64  # a WGMMA-layout register tile has 64 rows: each item's state is updated in [64, K] tiles
H200_SM_COUNT = 132
SMEM_LIMIT = 227 * 1024 - 4096  # Hopper's shared memory per block, less slack: barriers, alignment, reduction scratch
_L2_EPS = 1e-6
_COL = plgpu.Layout.WGMMA.reduce(0)  # a [K] vector as a tile's columns (broadcast down the rows)
_ROW = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector as a tile's rows (one value per row)
_TILE = plgpu.Layout.WGMMA
APPROX_MATH = True  # MUFU exp / reciprocal / rsqrt: the vector code is latency-bound (see the module docstring)

# kda_decode_mgpu's reference: the decode path of kda_decode's (same arguments, same results)
kda_decode_mgpu_reference = functools.partial(kda_decode_reference, all_states=False)


def _cols(ref):
    return plgpu.load(ref, layout=_COL, optimized=False).astype(jnp.float32)


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
    return _select_vec(exact, u, jnp.log(w) * u / _select_vec(exact, jnp.ones_like(w), w - 1.0))


def _select_vec(mask, on_true, on_false):
    return lax.select(mask, on_true, on_false)


def _gate(z, a, dt_bias, gate, lower_bound):
    """g [K] from the raw gate input z (fp32; a = e^A_log, a scalar): k3-model.md §3's two forms."""
    x = z + dt_bias
    if gate == "lower_bound":
        return lower_bound * jax.nn.sigmoid(a * x)
    return -a * _select_vec(x > 20.0, x, _log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _conv_positions(weights, window, inputs, valids, act_dtype):
    """Causal short conv + SiLU of one channel segment over its T positions (vectors in one layout).

    weights: W tap vectors (fp32, oldest tap first); window: the W-1 previous inputs (activation dtype); inputs: T
    vectors; valids: T scalar bools. Returns (acts [T] fp32, each rounded to the activation dtype as the reference
    rounds it; kept: the last W-1 valid inputs, the new conv state)."""
    f32 = jnp.float32
    acts, kept = [], list(window)
    for x_t, valid in zip(inputs, valids):
        acc = weights[-1] * x_t.astype(f32)
        for i, w_prev in enumerate(window):
            acc = acc + weights[i] * w_prev.astype(f32)
        window = window[1:] + [x_t.astype(act_dtype)]
        kept = [_select(valid, new, old) for new, old in zip(window, kept)]
        acts.append(jax.nn.silu(acc).astype(act_dtype).astype(f32))
    return acts, kept


def _item_kernel(slots_ref, lens_ref, fresh_ref, x_ref, convw_ref, z_ref, beta_ref, og_ref, alog_ref, dtb_ref,
                 onw_ref, conv_ref, state_ref, y_ref, st_smem, x_smem, win_smem, cw_smem, z_smem, og_smem, o_smem,
                 bars, done_bars, *, num_items, num_heads, num_tokens, stages, gate, lower_bound, eps,
                 act_dtype):
    # GMEM: slots_ref, lens_ref, fresh_ref: [B] int32; x_ref: [B, T, 3*H*K] raw q|k|v (pre-conv), activation dtype
    #   convw_ref: [W, 3*H*K]; z_ref: [B, T, H, K]; beta_ref: [B, T, H] logits; og_ref: [B, T, H, V] output gate
    #   alog_ref: [H] fp32; dtb_ref: [H, K] fp32; onw_ref: [V] o_norm weight
    #   conv_ref: [P, W-1, 3*H*K] conv-state pool, read by TMA and written in place (a mutable ref)
    #   state_ref: [P, H, V, K] fp32 state pool, read and written in place by TMA (a mutable ref)
    #   y_ref: [B, T, H, V] activation dtype, the gated-normed output
    # SMEM, one slot per item in flight: st_smem [S, V, K] fp32 (tiled 8 x 32, 128-byte swizzle) the state;
    #   x_smem [S, 3, T, K] the item's q|k|v inputs; win_smem [S, 3, W-1, K] its conv windows; cw_smem [S, 3, W, K]
    #   the head's conv taps; z_smem [S, T, K]; og_smem [S, T, V]; bars [S]: one barrier per slot, 12 TMA
    #   arrivals (state, 3 x (inputs, window, taps), z, output gate)
    # o_smem [2, T, V] fp32: each warpgroup's o rows, for the others' RMSNorm (two buffers: step parity)
    # done_bars [S]: every warpgroup is done with the slot's state (V / 64 arrivals) before warpgroup 0 stores it
    # Warpgroup wg owns state rows [64 wg, 64 wg + 64) of every item (the delta rule is row-separable over V) and
    # redoes the head's q / k / gate work (latency-bound vector code: V / 64 warpgroups hide each other's latency).
    f32 = jnp.float32
    cta, num_ctas = lax.axis_index("cta"), lax.axis_size("cta")
    wg = lax.axis_index("wg")
    num_steps = (num_items - 1 - cta) // num_ctas + 1  # items cta, cta + G, ...: the grid never exceeds num_items
    dv, dk = st_smem.shape[1], st_smem.shape[2]
    width = cw_smem.shape[2]
    tile = (ROWS, dk)
    blk = pl.ds(pl.multiple_of(wg * ROWS, ROWS), ROWS)  # this warpgroup's state rows / v channels / o rows
    row_blocks = [pl.ds(j * ROWS, ROWS) for j in range(dv // ROWS)]
    norm_w = _rows(onw_ref.at[blk])  # the same for every item

    def item_of(step):
        item = cta + step * num_ctas
        return item // num_heads, item % num_heads

    def segs_of(h):  # the head's q, k and v channels
        return [pl.ds((i * num_heads + h) * dk, dk) for i in range(3)]

    def issue(step):
        b, h = item_of(step)
        slot, sl = lax.rem(step, stages), slots_ref[b]
        bar = bars.at[slot]
        plgpu.copy_gmem_to_smem(state_ref.at[sl, h], st_smem.at[slot], bar)
        for i, seg in enumerate(segs_of(h)):
            plgpu.copy_gmem_to_smem(x_ref.at[b, :, seg], x_smem.at[slot, i], bar)
            plgpu.copy_gmem_to_smem(conv_ref.at[sl, :, seg], win_smem.at[slot, i], bar)
            plgpu.copy_gmem_to_smem(convw_ref.at[:, seg], cw_smem.at[slot, i], bar)
        plgpu.copy_gmem_to_smem(z_ref.at[b, :, h, :], z_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(og_ref.at[b, :, h, :], og_smem.at[slot], bar)

    @pl.when(wg == 0)
    def _():
        for first in range(stages - 1):
            pl.when(first < num_steps)(functools.partial(issue, first))

    @pl.loop(0, num_steps)
    def _step(step):
        @pl.when(wg == 0)
        def _():  # the slot of item step - 1 is refilled (with item step + stages - 1) once its store has read it
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            pl.when(step + stages - 1 < num_steps)(lambda: issue(step + stages - 1))

        b, h = item_of(step)
        slot = lax.rem(step, stages)
        state = st_smem.at[slot]
        sl, length = slots_ref[b], lens_ref[b]
        fresh = fresh_ref[b] != 0
        a = jnp.exp(alog_ref[h])
        betas = [beta_ref[b, t, h] for t in range(num_tokens)]
        valids = [t < length for t in range(num_tokens)]
        segs = segs_of(h)
        dtb = _cols(dtb_ref.at[h])  # (from global memory: its latency overlaps the wait)
        plgpu.barrier_wait(bars.at[slot])

        def window_of(load, i, cols=slice(None)):  # the last W-1 inputs, or zeros for a fresh row (not their bytes)
            rows = [load(win_smem.at[slot, i, r, cols]).astype(act_dtype) for r in range(width - 1)]
            return [_select(fresh, jnp.zeros_like(w), w) for w in rows]

        # q and k: conv + SiLU per position (column vectors); warpgroup 0 writes their new conv state to the pool
        qk = []
        for i in range(2):
            acts, kept = _conv_positions([_cols(cw_smem.at[slot, i, j]) for j in range(width)], window_of(_cols, i),
                                         [_cols(x_smem.at[slot, i, t]) for t in range(num_tokens)], valids, act_dtype)
            qk.append(acts)

            @pl.when(wg == 0)
            def _(kept=kept, i=i):
                for r in range(width - 1):
                    conv_ref.at[sl, r, segs[i]][...] = kept[r].astype(conv_ref.dtype)
        # v: this warpgroup's 64 channels (row vectors), conv + SiLU per position; their new conv state
        vs, kept = _conv_positions([_rows(cw_smem.at[slot, 2, w, blk]) for w in range(width)], window_of(_rows, 2, blk),
                                   [_rows(x_smem.at[slot, 2, t, blk]) for t in range(num_tokens)], valids, act_dtype)
        v_seg = pl.ds(pl.multiple_of((2 * num_heads + h) * dk + wg * ROWS, ROWS), ROWS)
        for r in range(width - 1):
            conv_ref.at[sl, r, v_seg][...] = kept[r].astype(conv_ref.dtype)
        rows = state.at[blk]

        @pl.when(fresh)
        def _():
            rows[...] = plgpu.layout_cast(jnp.zeros(tile, f32), _TILE)

        outs = []
        parity = lax.rem(step, 2)
        for t in range(num_tokens):
            q, k = qk[0][t], qk[1][t]
            q = q * lax.rsqrt(jnp.sum(q * q) + _L2_EPS) * dk ** -0.5
            k = k * lax.rsqrt(jnp.sum(k * k) + _L2_EPS)
            g = _gate(_cols(z_smem.at[slot, t]), a, dtb, gate, lower_bound)
            decay = jnp.exp(_select(valids[t], g, jnp.zeros_like(g)))
            beta = jnp.where(valids[t], jax.nn.sigmoid(betas[t].astype(f32)), 0.0)
            k_t = _down_rows(k, tile)
            s = plgpu.load(rows, layout=_TILE) * _down_rows(decay, tile)
            err = beta * (vs[t] - jnp.sum(s * k_t, axis=1))
            s = s + _across_cols(err, tile) * k_t
            o = jnp.sum(s * _down_rows(q, tile), axis=1).astype(act_dtype).astype(f32)
            rows[...] = s
            o_smem.at[parity, t, blk][...] = o
            outs.append(o)
        plgpu.commit_smem()  # this warpgroup's new state rows and o are visible to TMA and the other warpgroups
        plgpu.barrier_arrive(done_bars.at[slot])
        plgpu.barrier_wait(done_bars.at[slot])

        @pl.when(wg == 0)
        def _():
            plgpu.copy_smem_to_gmem(state, state_ref.at[sl, h])

        # gated RMSNorm over all V: the mean square from every warpgroup's o rows, then this warpgroup's rows
        for t in range(num_tokens):
            sum_sq = None
            for other in row_blocks:
                o_other = _rows(o_smem.at[parity, t, other])
                sum_sq = jnp.sum(o_other * o_other) if sum_sq is None else sum_sq + jnp.sum(o_other * o_other)
            inv_rms = lax.rsqrt(sum_sq / dv + eps)
            y = outs[t] * inv_rms * norm_w * jax.nn.sigmoid(_rows(og_smem.at[slot, t, blk]))
            y_ref.at[b, t, h, blk][...] = y.astype(y_ref.dtype)

    @pl.when(wg == 0)
    def _():
        plgpu.wait_smem_to_gmem(0)


def smem_bytes(dv: int, dk: int, stages: int, num_tokens: int, width: int, act_bytes: int, conv_bytes: int,
               taps_bytes: int) -> int:
    """Shared memory of the kernel's ring (barriers not counted): per slot the fp32 state and the item's operands."""
    operands = (3 * num_tokens * dk * act_bytes + 3 * (width - 1) * dk * conv_bytes + 3 * width * dk * taps_bytes
                + num_tokens * dk * act_bytes + num_tokens * dv * act_bytes)
    return stages * (dv * dk * 4 + operands) + 2 * num_tokens * dv * 4  # + o_smem


def default_stages(**sizes) -> int:
    """The most slots (<= 3) whose ring fits the shared memory (3 at T = 1, K = V = 128; 2 for long verify-size T)."""
    fitting = [s for s in (3, 2) if smem_bytes(stages=s, **sizes) <= SMEM_LIMIT]
    return fitting[0] if fitting else 2


@functools.partial(jax.jit, static_argnames=("gate", "lower_bound", "eps", "interpret", "num_ctas", "stages"))
def kda_decode_mgpu(qkv, conv_state, conv_weight, z, beta, out_gate, state, slots, lengths, *, a_log, dt_bias,
                    o_norm_weight, gate="lower_bound", lower_bound=-5.0, eps=1e-5, fresh=None, interpret=False,
                    num_ctas=None, stages=None):
    """Fused KDA decode (T = 1..8 new tokens, final state only) for B sequences living in pooled states.

    Arguments and results as `kda_decode.kda_decode` with all_states=False: (y [B, T, H, V], new conv pool, new
    state pool), the pools updated in place at `slots` when the caller donates them.

    Extra knobs: num_ctas, the persistent grid (None: min(132, B * H), one CTA per H200 SM); stages, the number of
    ring slots, each an item's [V, K] fp32 state and operands (None: `default_stages`, 3 at T = 1 and K = V = 128).
    Sizes: V a multiple of 64, K of 32; conv_state in the activation dtype.
    """
    _check(qkv, conv_state, conv_weight, z, beta, out_gate, state, slots, lengths, fresh, a_log, dt_bias,
           o_norm_weight, gate)
    bsz, t, c = qkv.shape
    p, h, dv, dk = state.shape
    width = conv_weight.shape[0]
    if dv % ROWS or dv > 4 * ROWS or dk % 32:
        raise ValueError(f"the Mosaic GPU decode kernel needs V % {ROWS} == 0, V <= {4 * ROWS} (a warpgroup per "
                         f"{ROWS} rows) and K % 32 == 0; got V={dv}, K={dk}")
    if state.dtype != jnp.float32:
        raise ValueError(f"the state pool must be fp32; got {state.dtype}")
    if conv_state.dtype != qkv.dtype:
        raise ValueError(f"conv_state must be in the activation dtype {qkv.dtype}; got {conv_state.dtype}")
    sizes = dict(dv=dv, dk=dk, num_tokens=t, width=width, act_bytes=qkv.dtype.itemsize,
                 conv_bytes=conv_state.dtype.itemsize, taps_bytes=conv_weight.dtype.itemsize)
    stages = default_stages(**sizes) if stages is None else stages
    if not isinstance(stages, int) or stages < 2 or smem_bytes(stages=stages, **sizes) > SMEM_LIMIT:
        raise ValueError(f"stages must be >= 2 with the ring ({smem_bytes(stages=2, **sizes)} bytes per 2 slots) "
                         f"within {SMEM_LIMIT} bytes of shared memory; got {stages!r}")
    num_items = bsz * h
    num_ctas = min(H200_SM_COUNT, num_items) if num_ctas is None else num_ctas
    if not isinstance(num_ctas, int) or not 1 <= num_ctas <= num_items:
        raise ValueError(f"num_ctas must be in 1..B*H = {num_items}; got {num_ctas!r}")
    fresh = jnp.zeros((bsz,), jnp.int32) if fresh is None else fresh.astype(jnp.int32)
    act = qkv.dtype
    ring = lambda *shape, dtype=act, **kw: plgpu.SMEM((stages, *shape), dtype, **kw)
    scratch = [
        ring(dv, dk, dtype=jnp.float32, transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),
        ring(3, t, dk), ring(3, width - 1, dk, dtype=conv_state.dtype), ring(3, width, dk, dtype=conv_weight.dtype),
        ring(t, dk, dtype=z.dtype), ring(t, dv, dtype=out_gate.dtype),
        plgpu.SMEM((2, t, dv), jnp.float32),
        plgpu.Barrier(num_arrivals=12, num_barriers=stages),
        plgpu.Barrier(num_arrivals=dv // ROWS, num_barriers=stages),
    ]
    kernel = plgpu.kernel(
        functools.partial(_item_kernel, num_items=num_items, num_heads=h, num_tokens=t, stages=stages, gate=gate,
                          lower_bound=lower_bound, eps=eps, act_dtype=act),
        out_type=jax.ShapeDtypeStruct((bsz, t, h, dv), act),
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=dv // ROWS,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=APPROX_MATH),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    # the pools as mutable refs: the kernel's writes become in-place updates (input/output aliasing)
    conv_ref, state_ref = jax.new_ref(conv_state), jax.new_ref(state)
    y = kernel(slots.astype(jnp.int32), lengths.astype(jnp.int32), fresh, qkv, conv_weight, z, beta, out_gate,
               a_log[:h].astype(jnp.float32), dt_bias.astype(jnp.float32).reshape(h, dk), o_norm_weight,
               conv_ref, state_ref)
    return y, conv_ref[...], state_ref[...]


__all__ = ["kda_decode_mgpu", "kda_decode_mgpu_reference", "GATES", "MAX_TOKENS"]
