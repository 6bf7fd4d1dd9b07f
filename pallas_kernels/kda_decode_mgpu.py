"""Fused KDA decode on Mosaic GPU: the recurrent state streamed through shared memory by TMA.

The same job as `kda_decode.kda_decode` in decode mode (all_states=False; verify stays on the Triton kernel): per
sequence b (state slot slots[b]) and head h, for each of the T <= 8 new tokens, the short conv (conv state in and out,
in place), SiLU, q / k L2 norm, the gate, beta, the delta rule on the V-first fp32 state S [V, K], the output and the
gated RMSNorm -- one launch per layer, k3-model.md §3:

    S <- S * e^g[None, :];   S <- S + beta (v - S k) k^T;   o = S q;   y = RMSNorm(o) * w * sigmoid(gate)

Why a second kernel: the Triton one (loads into registers, one program per (sequence, head)) moves the state at
73-77 % of the measured copy bandwidth at B64 / B256 H96, and nothing in its tiling, cache hints or a streamed
scf.for got past that (kda_decode's docstring). The state is the whole memory floor (read once, written once), so
this kernel is built around moving it: a persistent grid of one CTA (one warpgroup) per SM walks (sequence, head)
items cta, cta + G, cta + 2G, ... (heads fastest, so neighbouring CTAs stream neighbouring memory), and each
item's [V, K] state (64 KB at 128 x 128) arrives by one TMA copy into a ring of `stages` shared-memory slots
issued `stages - 1` items ahead; the update runs on [64, K] register tiles in the WGMMA layout (K along a row
spread over 4 lanes, so S k and S q are in-register sums plus two shuffles), the new state is written back into
the same slot, and one TMA store returns it to the pool. A slot is refilled only after its store has read it
(`wait_smem_to_gmem(0, wait_read_only=True)` at the top of the next item). Everything else per item -- the q|k|v
inputs, the conv windows and weights, z, beta, the output gate -- is a few KB, loaded straight from global memory
into the layouts that use them: K-vectors (q, k, e^g) in the WGMMA layout's column form (`reduce(0)`: broadcast
down a tile's rows), V-rows (v, o, y) in its row form (`reduce(1)`).

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
                 onw_ref, conv_ref, state_ref, y_ref, st_smem, x_smem, win_smem, cw_smem, z_smem, og_smem, dtb_smem,
                 bars, *, num_items, num_heads, num_tokens, stages, gate, lower_bound, eps, act_dtype):
    # GMEM: slots_ref, lens_ref, fresh_ref: [B] int32; x_ref: [B, T, 3*H*K] raw q|k|v (pre-conv), activation dtype
    #   convw_ref: [W, 3*H*K]; z_ref: [B, T, H, K]; beta_ref: [B, T, H] logits; og_ref: [B, T, H, V] output gate
    #   alog_ref: [H] fp32; dtb_ref: [H, K] fp32; onw_ref: [V] o_norm weight
    #   conv_ref: [P, W-1, 3*H*K] conv-state pool, read by TMA and written in place (a mutable ref)
    #   state_ref: [P, H, V, K] fp32 state pool, read and written in place by TMA (a mutable ref)
    #   y_ref: [B, T, H, V] activation dtype, the gated-normed output
    # SMEM, one slot per item in flight: st_smem [S, V, K] fp32 (tiled 8 x 32, 128-byte swizzle) the state;
    #   x_smem [S, 3, T, K] the item's q|k|v inputs; win_smem [S, 3, W-1, K] its conv windows; cw_smem [S, 3, W, K]
    #   the head's conv taps; z_smem [S, T, K]; og_smem [S, T, V]; dtb_smem [S, K] fp32; bars [S]: one barrier per
    #   slot, 13 TMA arrivals (state, 3 x (inputs, window, taps), z, output gate, dt_bias)
    f32 = jnp.float32
    cta, num_ctas = lax.axis_index("cta"), lax.axis_size("cta")
    num_steps = (num_items - 1 - cta) // num_ctas + 1  # items cta, cta + G, ...: the grid never exceeds num_items
    dv, dk = st_smem.shape[1], st_smem.shape[2]
    width = cw_smem.shape[2]
    tile = (ROWS, dk)
    row_blocks = [pl.ds(j * ROWS, ROWS) for j in range(dv // ROWS)]
    norm_w = [_rows(onw_ref.at[blk]) for blk in row_blocks]  # the same for every item

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
        plgpu.copy_gmem_to_smem(dtb_ref.at[h], dtb_smem.at[slot], bar)

    for first in range(stages - 1):
        pl.when(first < num_steps)(functools.partial(issue, first))

    @pl.loop(0, num_steps)
    def _step(step):
        # the slot of item step - 1 is refilled (with item step + stages - 1) once its store has read it
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
        plgpu.barrier_wait(bars.at[slot])

        def window_of(load, i, cols=slice(None)):  # the last W-1 inputs, or zeros for a fresh row (not their bytes)
            rows = [load(win_smem.at[slot, i, r, cols]).astype(act_dtype) for r in range(width - 1)]
            return [_select(fresh, jnp.zeros_like(w), w) for w in rows]

        # q and k: conv + SiLU per position (column vectors); the new conv state straight to the pool
        qk = []
        for i in range(2):
            acts, kept = _conv_positions([_cols(cw_smem.at[slot, i, j]) for j in range(width)], window_of(_cols, i),
                                         [_cols(x_smem.at[slot, i, t]) for t in range(num_tokens)], valids, act_dtype)
            qk.append(acts)
            for r in range(width - 1):
                conv_ref.at[sl, r, segs[i]][...] = kept[r].astype(conv_ref.dtype)
        # v: conv + SiLU per position and 64-row block (row vectors)
        vs = []
        for j, blk in enumerate(row_blocks):
            acts, kept = _conv_positions([_rows(cw_smem.at[slot, 2, w, blk]) for w in range(width)],
                                         window_of(_rows, 2, blk),
                                         [_rows(x_smem.at[slot, 2, t, blk]) for t in range(num_tokens)], valids,
                                         act_dtype)
            vs.append(acts)
            for r in range(width - 1):
                conv_ref.at[sl, r, pl.ds((2 * num_heads + h) * dk + j * ROWS, ROWS)][...] = kept[r].astype(
                    conv_ref.dtype)
        dtb = _cols(dtb_smem.at[slot])

        @pl.when(fresh)
        def _():
            for blk in row_blocks:
                state.at[blk][...] = plgpu.layout_cast(jnp.zeros(tile, f32), _TILE)

        outs = [[None] * len(row_blocks) for _ in range(num_tokens)]
        for t in range(num_tokens):
            q, k = qk[0][t], qk[1][t]
            q = q * lax.rsqrt(jnp.sum(q * q) + _L2_EPS) * dk ** -0.5
            k = k * lax.rsqrt(jnp.sum(k * k) + _L2_EPS)
            g = _gate(_cols(z_smem.at[slot, t]), a, dtb, gate, lower_bound)
            decay = jnp.exp(_select(valids[t], g, jnp.zeros_like(g)))
            beta = jnp.where(valids[t], jax.nn.sigmoid(betas[t].astype(f32)), 0.0)
            q_t, k_t, decay_t = _down_rows(q, tile), _down_rows(k, tile), _down_rows(decay, tile)
            for j, blk in enumerate(row_blocks):
                s = plgpu.load(state.at[blk], layout=_TILE) * decay_t
                err = beta * (vs[j][t] - jnp.sum(s * k_t, axis=1))
                s = s + _across_cols(err, tile) * k_t
                outs[t][j] = jnp.sum(s * q_t, axis=1).astype(act_dtype).astype(f32)
                state.at[blk][...] = s
        plgpu.commit_smem()  # the new state is visible to the TMA engine
        plgpu.copy_smem_to_gmem(state, state_ref.at[sl, h])

        # gated RMSNorm over all V, row block by row block
        for t in range(num_tokens):
            sum_sq = jnp.sum(outs[t][0] * outs[t][0])
            for o in outs[t][1:]:
                sum_sq = sum_sq + jnp.sum(o * o)
            inv_rms = lax.rsqrt(sum_sq / dv + eps)
            for j, blk in enumerate(row_blocks):
                y = outs[t][j] * inv_rms * norm_w[j] * jax.nn.sigmoid(_rows(og_smem.at[slot, t, blk]))
                y_ref.at[b, t, h, blk][...] = y.astype(y_ref.dtype)

    plgpu.wait_smem_to_gmem(0)


def smem_bytes(dv: int, dk: int, stages: int, num_tokens: int, width: int, act_bytes: int, conv_bytes: int,
               taps_bytes: int) -> int:
    """Shared memory of the kernel's ring (barriers not counted): per slot the fp32 state and the item's operands."""
    operands = (3 * num_tokens * dk * act_bytes + 3 * (width - 1) * dk * conv_bytes + 3 * width * dk * taps_bytes
                + num_tokens * dk * act_bytes + num_tokens * dv * act_bytes + dk * 4)
    return stages * (dv * dk * 4 + operands)


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
    if dv % ROWS or dk % 32:
        raise ValueError(f"the Mosaic GPU decode kernel needs V % {ROWS} == 0 and K % 32 == 0; got V={dv}, K={dk}")
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
        ring(t, dk, dtype=z.dtype), ring(t, dv, dtype=out_gate.dtype), ring(dk, dtype=jnp.float32),
        plgpu.Barrier(num_arrivals=13, num_barriers=stages),
    ]
    kernel = plgpu.kernel(
        functools.partial(_item_kernel, num_items=num_items, num_heads=h, num_tokens=t, stages=stages, gate=gate,
                          lower_bound=lower_bound, eps=eps, act_dtype=act),
        out_type=jax.ShapeDtypeStruct((bsz, t, h, dv), act),
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    # the pools as mutable refs: the kernel's writes become in-place updates (input/output aliasing)
    conv_ref, state_ref = jax.new_ref(conv_state), jax.new_ref(state)
    y = kernel(slots.astype(jnp.int32), lengths.astype(jnp.int32), fresh, qkv, conv_weight, z, beta, out_gate,
               a_log[:h].astype(jnp.float32), dt_bias.astype(jnp.float32).reshape(h, dk), o_norm_weight,
               conv_ref, state_ref)
    return y, conv_ref[...], state_ref[...]


__all__ = ["kda_decode_mgpu", "kda_decode_mgpu_reference", "GATES", "MAX_TOKENS"]
