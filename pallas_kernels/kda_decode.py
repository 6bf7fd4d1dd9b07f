"""Fused KDA decode / verify: one Pallas launch per layer for 1..8 new tokens per sequence.

Per sequence b (state slot slots[b]) and head h, for each new token t < T (k3-model.md §3):

    conv:   c = SiLU(sum_i w_i x_{t-W+1+i})  over the last W-1 inputs (conv state) and x_t, for q|k|v
    norm:   q = c_q / sqrt(|c_q|^2 + 1e-6) * K^-1/2,   k = c_k / sqrt(|c_k|^2 + 1e-6),   v = c_v
    gate:   g = lb * sigmoid(e^A_log (z + dt_bias))  (K3)  or  -e^A_log softplus(z + dt_bias);  beta = sigmoid(b)
    delta:  S <- S * e^g[None, :];  S <- S + beta (v - S k) k^T;  o = S q          (S: V-first [V, K] fp32)
    output: y = RMSNorm(o) * w * sigmoid(gate)

Tokens t >= lengths[b] are padding: g = 0 and beta = 0 there, so they leave S unchanged, and the decode
conv state keeps the last W-1 *valid* inputs. A row with fresh[b] != 0 starts from the zero recurrent state
and zero conv window, whatever its (reused) slot holds: its pool loads are masked off (no memory read, zeros
exact even over NaN/inf garbage, unlike multiplying by zero), and decode writes its new states over the slot
as for any other row -- so the model needs no scatter zeroing fresh rows before the kernel. Decode mode reads and writes the pooled conv / recurrent
states in place (input_output_aliases) at rows slots[b]. Verify mode (all_states=True) leaves the pools
alone and writes, per position, the recurrent state's rank-one update (e = beta (v - S' k) [V], k [K], e^g [K];
k3jax.kda's module docstring): the state after any accepted prefix is rebuilt from the pooled state before the
step (k3jax.kda.apply_verify_updates), so verify reads each state once and writes none. It writes no conv state
either: the window after a kept prefix is the last W-1 rows of [pooled window; the step's inputs], which the
caller has (k3jax.kda.conv_window_after).

The numerics follow the reference path exactly where it rounds: the conv output is cast to the
activation dtype before the norms, and o to the activation dtype before the gated RMSNorm.

Backend: Pallas Triton lowering, grid (V / block_v, H, B). Each program owns the state rows [block_v, K]
of one (sequence, head) -- a contiguous slice of the V-first state -- in registers across the T positions;
the state is read once and written once (decode) or only read (verify), which is the whole memory floor.
The delta rule is row-separable over V (err_v = v_v - S_v k, S_v += beta err_v k^T, o_v = S_v q), so
V-blocks are independent except for three things, handled as follows. (1) Each program recomputes the
head's q and k (conv + SiLU + L2 norm, 2K channels) and convolves only its own v channels. (2) The gated
RMSNorm needs the mean square over all V: with block_v == V it is fused (the one-program-per-head kernel,
kept as an exact escape hatch); otherwise the kernel writes o rounded to the activation dtype (where the
reference rounds it) and a jnp epilogue over [B, T, H, V] applies the norm -- the same operations, a few
MB of traffic against the state's hundreds. (3) Conv state: each channel is written by one program (q|k
by V-block 0, v by its block); in blocked decode the q|k channels go to a [B, W-1, 2HK] side output that
an XLA scatter puts into the aliased pool, because the other V-blocks of the head may still be reading
the pool's old q|k rows (an in-place write would race). Slot indices are ordinary int32 inputs (Triton
has no scalar prefetch) used in the kernel's own pointer arithmetic; the pools are aliased to the outputs.
The products S k and S q are vector-matrix, so they are broadcast-multiply-reduce on CUDA cores, not
tensor-core dots.
Measured on the H200 (benchmarks/kda.py, docs/results/kda_decode_h200_2026-11-30d.json, H96, fp32 state;
in one run with fla-core 0.6.0 `fused_recurrent_kda`, which does less: no conv, no output norm, final state
only; copy bandwidth 4.17 TB/s), V-blocked, 4 warps: decode B64 0.274 ms at block_v 32 (fla 0.274 ms:
1.00x; best tiling 0.266 ms at 16 x 2 warps), B256 1.023 ms (fla 1.178: 1.15x); 3.0-3.15 TB/s of state
traffic = 73-76% of the copy bandwidth (fla 2.7-2.9 TB/s). Verify T4 (all states written): block_v 64 is
best, B64 0.675 ms, B256 2.635 ms, 71-73% of copy (0.84-0.85x fla's time, which writes one state, not 4).
The whole-state kernel (block_v == V, 8 warps) took 0.389 / 1.508 / 1.124 ms in the same run: the
hypothesis (64 KB of registers per program, few loads in flight) held. 8 warps are slower at every block
size; 2 warps tie 4 at blocks <= 32. Hence the defaults: block_v 32 for decode, 64 for verify, 4 warps.
Mosaic GPU was not tried.
Decode's default since 2026-11-30 (seventh session) is the looped form (`loop_v`): grid (H, B), each program walks
its head's state in 64-row blocks one after another (registers hold one block), computes q / k once, writes the
whole conv state in place (it is the only reader of the head's channels) and fuses the gated RMSNorm (the blocks'
o are kept, [T, V] in all): one launch per layer instead of three, and 0.262 / 1.010 ms at B64 / B256 (V-blocked 32:
0.269 / 1.014; fla 0.286 / 1.166; 74 / 77 % of copy). Verify keeps the V-blocked grid until its looped form is timed.

Code layout (2026-11-30, eighth session): both kernels run one body, `_kda_rows` (a program's rows of one head walked
in V-blocks), built from one copy of the per-segment pieces (`_conv_operands` / `_short_conv`, `_qk_norm`,
`_decay_beta`, `_delta_step`, `_gated_rms_norm`); `_blocked_kernel` and `_looped_kernel` differ only in their grid
walk (bit-identical results to the two earlier kernels in interpret mode). Two looped-kernel options, timed on the H200
without a gain (DEFAULT_PREFETCH's comment):
`prefetch` issues each V-block's loads (state rows, v conv inputs) that many blocks ahead of its compute, since
Triton keeps program order and the aliased pool stops any hoisting of block j+1's load above block j's store; and
`fold_v` convolves the head's v once with q and k and picks each block's v inside its S k reduction. Why fold_v:
ptxas (offline proxy, docs/results/kda_decode_ptxas_sm90a_2026-11-30g.json) showed the registers were not the state
tile (32 per thread for 32 rows at 4 warps) but the v conv: Triton computes a block's v in the state's row layout,
each thread holding block_v / num_warps rows replicated across its warp, with scalar loads. So each block's v conv
is emitted at its turn, position by position next to the step that uses it (as are q / k, at the first block), its
loads after the q / k conv. T1, 4 warps: looped 64 rows (decode's default) 255 registers + 96 B spills before -> 168
now; looped 32: 255 + 116 B spills -> 128, 255 (no spill) with prefetch 1, 200 with prefetch 1 and fold_v;
V-blocked 32: 158 -> 128; verify T4 V-blocked 64 (its default): 168, unchanged. Looped verify (T4) sits at 255
with small spills: it keeps every position's o of every block for the fused norm (a looped verify would want the
norm in the epilogue). See the JSON for the full table.
Loop-carried num_stages pipelining does not apply: the V walk is unrolled (a few blocks), not an scf.for.
Two more attempts at the state traffic (73 / 77 % of the copy bandwidth at B64 / B256 T1 H96), timed on the H200 on
2026-12-01 (eleventh session, benchmarks/kda.py --decode-variants; docs/results/kda_decode_stream_h200_2026-12-01d.json)
and removed: evict-first cache hints on the state's loads and stores (looped 64: 0.266 / 1.036 ms against 0.264 /
1.002); and a streamed form, an scf.for over heads x V-blocks per program (so Triton's pipeliner could issue the next
blocks' state loads through shared memory, num_stages 2-4), best at 2 heads x 64-row blocks x 2 stages: 0.276 / 1.052
ms against the looped default's 0.263 / 1.005 in the same run (eleven tilings, every one slower).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MAX_TOKENS = 8
GATES = ("lower_bound", "softplus")
# Defaults for block_v=None / num_warps=None, from the H200 sweep of 2026-11-30 (module docstring): decode 32, verify
# 64 (its T state writes per program favour fewer, longer programs), 4 warps when blocked.
DEFAULT_BLOCK_V = 32
DEFAULT_VERIFY_BLOCK_V = 64
DEFAULT_BLOCKED_WARPS = 4
# loop_v=None's choice for decode (read at trace time): one program per head walking its V-blocks (True: one launch
# per layer instead of three) or the V-blocked grid. Verify keeps the V-blocked grid (its looped form: 3x slower, below).
# H200, 2026-11-30 (benchmarks/kda.py --decode-loop-v, docs/results/kda_decode_h200_2026-11-30f.json), H96, 4 warps:
# looped 64-row blocks 0.262 ms at B64 (V-blocked 32: 0.269, fla 0.286) and 1.010 ms at B256 (1.014, fla 1.166);
# looped 16- and 32-row blocks were slower (0.36 / 0.30 ms at B64).
DEFAULT_LOOP_V = True
DEFAULT_LOOP_BLOCK_V = 64
# prefetch=None / fold_v=None's choices. H200, 2026-11-30, eighth session (benchmarks/kda.py --decode-variants,
# docs/results/kda_decode_h200_2026-11-30g.json), T1 H96, B64 / B256 ms: default (looped 64, 4 warps) 0.265 / 1.021;
# looped 32 0.323 / 1.236, with fold_v 0.271 / 1.043, prefetch 1 0.281 / 1.078, both 0.273 / 1.044; looped 16 with
# prefetch 1 and fold_v 0.268 / 1.015; looped 64 at 8 warps 0.279 / 1.083. fold_v repairs the small blocks but nothing
# beats the default by more than noise, so both stay off. Looped verify (T4, B64): 2.0-2.4 ms against 0.67 for the
# V-blocked default (fla 0.567).
DEFAULT_PREFETCH = 0
DEFAULT_FOLD_V = False
_L2_EPS = 1e-6


def _gate(z, a_log, dt_bias, gate, lower_bound):
    x = z + dt_bias
    a = jnp.exp(a_log)
    if gate == "lower_bound":
        return lower_bound * jax.nn.sigmoid(a * x)
    return -a * jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


# ---- the per-segment pieces both kernels use (one copy; the kernels differ only in their grid walk) ----

def _pool_load(ref, from_pool):
    """ref's block, or zeros (of its dtype) without reading memory when `from_pool` (a scalar bool) is false."""
    return plt.load(ref, mask=jnp.full(ref.shape, from_pool), other=jnp.zeros((), ref.dtype))


def _conv_operands(conv_ref, convw_ref, x_ref, slot, b, seg, from_pool, num_tokens, act_dtype):
    """The loads of one channel segment's short conv for sequence b: (W tap weights fp32, the slot's last W-1
    inputs -- zeros for a fresh row, not read -- in the activation dtype, the T new inputs). Issued apart from
    `_short_conv` so that a V-block's loads can go out ahead of its compute (see `prefetch`)."""
    width = convw_ref.shape[0]
    weights = [convw_ref[i, seg].astype(jnp.float32) for i in range(width)]
    # oldest first, in the activation dtype (the reference concatenates the state with x in x's dtype)
    # (the row index as an int32 scalar, not a Python int: interpret mode's masked-load discharge needs .shape)
    window = [_pool_load(conv_ref.at[slot, jnp.int32(r), seg], from_pool).astype(act_dtype) for r in range(width - 1)]
    return weights, window, [x_ref[b, t, seg] for t in range(num_tokens)]


def _short_conv_steps(operands, valids, act_dtype):
    """Causal short conv + SiLU of one channel segment over its T new positions, from `_conv_operands`, yielded
    position by position (a generator, so a caller can emit each position's ops next to their use: Triton keeps
    program order, and ptxas keeps values live from their definition).

    Yields (act, window, kept) per position t: the SiLU output (rounded to the activation dtype where the reference
    rounds it, then fp32); the last W-1 inputs after t (verify's per-position conv state, oldest first); the last
    W-1 *valid* inputs so far (after the last position: decode's new conv state).
    """
    f32 = jnp.float32
    weights, window, xs = operands
    kept = list(window)
    for x_t, valid in zip(xs, valids):
        acc = weights[-1] * x_t.astype(f32)
        for i in range(len(window)):
            acc = acc + weights[i] * window[i].astype(f32)
        window = window[1:] + [x_t.astype(act_dtype)]
        kept = [jnp.where(valid, new, old) for new, old in zip(window, kept)]
        yield jax.nn.silu(acc).astype(act_dtype).astype(f32), window, kept


def _qk_norm(q, k):
    """L2-normalised q (times K^-1/2) and k, fp32, eps inside the sqrt (k3-model.md §3 step 2)."""
    q = q * lax.rsqrt(jnp.sum(q * q) + _L2_EPS) * q.shape[0] ** -0.5
    k = k * lax.rsqrt(jnp.sum(k * k) + _L2_EPS)
    return q, k


def _decay_beta(z, beta_logit, alog, dtb, valid, gate, lower_bound):
    """(e^g [K], beta) of one position; a padding position (valid false) gets e^0 = 1 and beta 0: S unchanged."""
    g = jnp.where(valid, _gate(z, alog, dtb, gate, lower_bound), 0.0)
    return jnp.exp(g), jnp.where(valid, jax.nn.sigmoid(beta_logit), 0.0)


def _delta_step(s, decay, k, beta, v, q, act_dtype, v_select=None):
    """One delta-rule step on state rows s [rows, K] (row-separable over V): decay, correct, read out.
    v: the rows' v [rows]; or, with v_select ([rows, K] bool, row i's v channel == column c), the head's v [V == K],
    folded into the S k reduction: err_i = sum_c (v_select[i, c] v_c - S_ic k_c) (the same terms as v_i - S_i k,
    summed in another order).
    Returns the new rows, o [rows] rounded to the activation dtype as the reference rounds it (then fp32), and the
    rows' update beta * err [rows] (verify's output: the new rows are s * decay + (beta err) k^T)."""
    s = s * decay[None, :]
    if v_select is None:
        err = v - jnp.sum(s * k[None, :], axis=1)  # [rows]
    else:
        err = jnp.sum(jnp.where(v_select, v[None, :], 0.0) - s * k[None, :], axis=1)
    update = beta * err
    s = s + update[:, None] * k[None, :]
    return s, jnp.sum(s * q[None, :], axis=1).astype(act_dtype).astype(jnp.float32), update


def _gated_rms_norm(o_blocks, weight_blocks, gate_blocks, eps):
    """RMSNorm over all V of o (given in V-blocks), times the weight and sigmoid(gate), block by block."""
    sum_sq = jnp.sum(o_blocks[0] * o_blocks[0])
    for o in o_blocks[1:]:
        sum_sq = sum_sq + jnp.sum(o * o)
    inv_rms = lax.rsqrt(sum_sq / sum(o.shape[0] for o in o_blocks) + eps)
    return [o * inv_rms * w * jax.nn.sigmoid(g) for o, w, g in zip(o_blocks, weight_blocks, gate_blocks)]


def _kda_rows(slots_ref, lens_ref, fresh_ref, x_ref, conv_ref, convw_ref, z_ref, b_ref, og_ref, alog_ref, dtb_ref,
              onw_ref, state_ref, y_ref, conv_out_ref, state_out_ref, qk_conv_out_ref, *, b, h, part, rows, block_v,
              prefetch, fold_v, num_tokens, gate, lower_bound, eps, all_states, act_dtype, packed=None):
    # slots_ref, lens_ref, fresh_ref: [B] int32 (fresh != 0: start from zero states); x_ref: [B, T, 3*H*K] raw q|k|v
    #   projections (pre-conv); conv_ref: [P, W-1, 3*H*K] conv-state pool; convw_ref: [W, 3*H*K]
    # z_ref: [B, T, H, K] raw gate input; b_ref: [B, T, H] beta logits; og_ref: [B, T, H, V] output gate
    #   packed = (out-gate column, beta column): x_ref is the layer's whole input projection [B, T, C] and the beta
    #   logits and output gate are read from it at those columns (b_ref / og_ref unused): no slice copies
    # alog_ref: [H]; dtb_ref: [H, K]; onw_ref: [V] o_norm weight; state_ref: [P, H, V, K] fp32 pool
    # y_ref: [B, T, H, V] (activation dtype): gated-normed output when rows == V, else raw o (normed outside)
    # decode:  conv_out_ref: [P, W-1, 3*H*K] (aliases conv_ref); state_out_ref: [P, H, V, K] (aliases state_ref)
    # verify:  conv_out_ref: None (no conv state is written); state_out_ref: (err_ref [B, T, H, V],
    #          key_ref [B, T, H, K], decay_ref [B, T, H, K]) fp32, each position's rank-one state update (a tuple)
    # qk_conv_out_ref (decode with rows < V only, else None): [B, W-1, 2*H*K] the new q|k conv state, scattered into
    #   the pool outside: every program of the head reads the head's q|k conv state, so none may overwrite it in place.
    # The body of both kernels: sequence b, head h, state rows [part*rows, (part+1)*rows) walked in V-blocks of block_v
    # rows one after another (registers hold 1 + prefetch blocks). The delta rule is row-separable over V, so
    # programs owning different rows of one (sequence, head) exchange nothing but the output norm's mean square.
    f32 = jnp.float32
    slot, length = slots_ref[b], lens_ref[b]
    from_pool = fresh_ref[b] == 0  # a fresh row's loads are masked off: zeros, and its slot is not read
    num_heads, dk, dv = alog_ref.shape[0], dtb_ref.shape[1], onw_ref.shape[0]
    width = convw_ref.shape[0]
    whole_head = rows == dv  # the only program of the head: conv state written in place, gated RMSNorm fused
    num_blocks = rows // block_v
    blocks = [pl.ds(part * rows + j * block_v, block_v) for j in range(num_blocks)]  # rows within the head
    # this head's q and k channels (every program of the head computes them: 2*K channels, cheap), then its v
    # channels block by block (v channel i of the head is state row i), or (fold_v) all of them as one segment
    v_segs = [pl.ds((2 * num_heads + h) * dk, dv)] if fold_v else [
        pl.ds((2 * num_heads + h) * dk + part * rows + j * block_v, block_v) for j in range(num_blocks)]
    segs = [pl.ds(h * dk, dk), pl.ds((num_heads + h) * dk, dk)] + v_segs

    # Each V-block's loads (its state rows and its v channels' conv operands) are issued `prefetch` blocks ahead of
    # its compute: manual double buffering. Triton keeps program order, and the state pool is aliased to the output,
    # so nothing would hoist block j+1's loads above block j's store by itself. The first 1 + prefetch blocks' state
    # loads go out first, so their latency overlaps the q / k conv; their v conv operands after the q / k loads. A
    # block's v conv is computed only when its turn comes: Triton computes it in the row layout of the [block_v, K]
    # state (each thread holds block_v / num_warps rows, replicated across its warp, with scalar loads), so every
    # block's up front held them all in registers, and even one block's operands issued before the q / k conv stayed
    # live across it (ptxas, T1 4 warps: looped 32 rows 255 registers + spills -> 128, V-blocked 32 158 -> 128).
    # fold_v instead convolves the head's v channels once, with q and k, in the column layout (a few registers), and
    # each block picks its rows' v inside the S k reduction (`_delta_step`).
    pending, pending_conv = {}, {}  # V-block -> its state rows / its v conv operands, issued ahead of its turn

    def issue_block_loads(j, conv_too=True):
        if j < num_blocks and j not in pending:
            pending[j] = _pool_load(state_ref.at[slot, h, blocks[j], :], from_pool).astype(f32)  # [block_v, K]
        if conv_too and j < num_blocks and j not in pending_conv:
            pending_conv[j] = None if fold_v else _conv_operands(conv_ref, convw_ref, x_ref, slot, b, segs[2 + j],
                                                                 from_pool, num_tokens, act_dtype)

    for j in range(prefetch + 1):
        issue_block_loads(j, conv_too=False)

    valids = [t < length for t in range(num_tokens)]

    def write_conv_kept(i, kept):  # decode: segment i's last W-1 valid inputs, the new conv state
        for r in range(width - 1):
            if i >= 2 or whole_head:  # in place: this program is the only reader of these channels, and has read them
                conv_out_ref[slot, r, segs[i]] = kept[r].astype(conv_out_ref.dtype)
            else:  # other programs of this head may still be reading the pool's q|k channels
                qk_conv_out_ref[b, r, pl.ds((i * num_heads + h) * dk, dk)] = kept[r].astype(conv_out_ref.dtype)

    def by_one_program(write):  # the q|k conv channels are written by one program of the head only
        if whole_head:
            write()
        else:
            pl.when(part == 0)(write)

    alog, dtb = alog_ref[h].astype(f32), dtb_ref[h, :].astype(f32)
    qk_steps = [_short_conv_steps(_conv_operands(conv_ref, convw_ref, x_ref, slot, b, segs[i], from_pool, num_tokens,
                                                 act_dtype), valids, act_dtype) for i in range(2)]
    if fold_v:  # the head's v channels, all positions, with q and k
        head_v = list(_short_conv_steps(_conv_operands(conv_ref, convw_ref, x_ref, slot, b, segs[2], from_pool,
                                                       num_tokens, act_dtype), valids, act_dtype))
        if not all_states:
            write_conv_kept(2, head_v[-1][2])
    positions = []  # per position: q, k, e^g, beta, the q|k kept inputs -- made at first use (see position)

    def position(t):
        # q, k, decay and beta of position t, emitted where the first V-block's step t needs them: with one block
        # per program the whole step is then emitted position by position, as the reference computes it
        while len(positions) <= t:
            u = len(positions)
            (q, _, q_kept), (k, _, k_kept) = next(qk_steps[0]), next(qk_steps[1])
            q, k = _qk_norm(q, k)
            beta_logit = b_ref[b, u, h] if packed is None else x_ref[b, u, packed[1] + h]
            decay, beta = _decay_beta(z_ref[b, u, h, :].astype(f32), beta_logit.astype(f32), alog, dtb,
                                      valids[u], gate, lower_bound)
            positions.append((q, k, decay, beta, (q_kept, k_kept)))
        return positions[t]

    outs = [[None] * num_blocks for _ in range(num_tokens)]  # o per position and V-block
    for j in range(prefetch + 1):
        issue_block_loads(j)
    for j in range(num_blocks):
        issue_block_loads(j + prefetch)  # before block j's compute and store: `prefetch` blocks stay in flight
        s, v_operands = pending.pop(j), pending_conv.pop(j)
        if fold_v:  # which of the head's v channels are this block's rows
            v_select = (jnp.arange(block_v) + j * block_v)[:, None] == jnp.arange(dk)[None, :]
        else:
            v_steps, v_select = _short_conv_steps(v_operands, valids, act_dtype), None
        for t in range(num_tokens):
            q, k, decay, beta, _ = position(t)
            if fold_v:
                v = head_v[t][0]
            else:
                v, _, v_kept = next(v_steps)
            s, outs[t][j], update = _delta_step(s, decay, k, beta, v, q, act_dtype, v_select)
            if all_states:
                err_ref, key_ref, decay_ref = state_out_ref
                err_ref[b, t, h, blocks[j]] = update
                if j == 0:
                    def write_key_decay(t=t, k=k, decay=decay):  # the head's, once
                        key_ref[b, t, h, :] = k
                        decay_ref[b, t, h, :] = decay
                    by_one_program(write_key_decay)
            if not whole_head:  # raw o (already rounded as the reference rounds it): the norm is applied outside
                y_ref[b, t, h, blocks[j]] = outs[t][j].astype(y_ref.dtype)
        if not all_states:
            state_out_ref[slot, h, blocks[j], :] = s
            if not fold_v:
                write_conv_kept(2 + j, v_kept)
    if not all_states:
        def write_qk_kept(q_kept=positions[-1][4][0], k_kept=positions[-1][4][1]):
            write_conv_kept(0, q_kept)
            write_conv_kept(1, k_kept)
        by_one_program(write_qk_kept)
    def out_gate(t, blk):
        if packed is None:
            return og_ref[b, t, h, blk]
        return x_ref[b, t, pl.ds(packed[0] + h * dv + blk.start, blk.size)]

    if whole_head:  # gated RMSNorm over all V: the mean square from every block, then each block
        for t in range(num_tokens):
            ys = _gated_rms_norm(outs[t], [onw_ref[blk].astype(f32) for blk in blocks],
                                 [out_gate(t, blk).astype(f32) for blk in blocks], eps)
            for blk, y in zip(blocks, ys):
                y_ref[b, t, h, blk] = y.astype(y_ref.dtype)


def _grouped_refs(refs, all_states):
    """The kernel's flat refs -> _kda_rows' positional refs up to state_out_ref (verify: its three update refs as
    one tuple), and what follows (the q|k side output, if any)."""
    if all_states:  # (no conv_out_ref: verify writes no conv state)
        return (*refs[:14], None, tuple(refs[14:17])), refs[17:]
    return refs[:16], refs[16:]


def _blocked_kernel(*refs, block_v, **kw):
    # Refs as in _kda_rows (the q|k side output present only in decode with block_v < V). Grid (V / block_v, H, B):
    # program (vb, h, b) owns state rows [vb*block_v, (vb+1)*block_v) of head h of sequence b, one block.
    rows_refs, qk_side = _grouped_refs(refs, kw["all_states"])
    _kda_rows(*rows_refs, qk_side[0] if qk_side else None, b=pl.program_id(2), h=pl.program_id(1),
              part=pl.program_id(0), rows=block_v, block_v=block_v, **kw)


def _looped_kernel(*refs, **kw):
    # Refs as in _kda_rows (no q|k side output). Grid (H, B): program (h, b) owns ALL the state rows of head h of
    # sequence b and walks them in V-blocks: q and k computed once per head, the conv state written in place by its
    # only reader, the gated RMSNorm (which needs all of V) fused.
    rows_refs, _ = _grouped_refs(refs, kw["all_states"])
    _kda_rows(*rows_refs, None, b=pl.program_id(1), h=pl.program_id(0), part=0, rows=refs[11].shape[0], **kw)


def _tiling(block_v, num_warps, dv, all_states, loop_v=False, prefetch=None):
    """(block_v, num_warps, prefetch) with the defaults filled in and checked (see `kda_decode`)."""
    if block_v is None:
        block_v = min(DEFAULT_LOOP_BLOCK_V if loop_v else DEFAULT_VERIFY_BLOCK_V if all_states else DEFAULT_BLOCK_V, dv)
    if not isinstance(block_v, int) or block_v < 1 or block_v & (block_v - 1) or block_v > dv:
        raise ValueError(f"block_v must be a power of two <= V = {dv} (it then divides V); got {block_v!r}")
    if num_warps is None:
        num_warps = 8 if block_v == dv and not loop_v else DEFAULT_BLOCKED_WARPS
    if not isinstance(num_warps, int) or num_warps < 1 or num_warps & (num_warps - 1) or num_warps > 32:
        raise ValueError(f"num_warps must be a power of two in 1..32; got {num_warps!r}")
    if prefetch is None:
        prefetch = DEFAULT_PREFETCH
    if not isinstance(prefetch, int) or prefetch < 0:  # (a bool is an int: True = 1 block ahead)
        raise ValueError(f"prefetch must be a number of V-blocks >= 0 (or a bool); got {prefetch!r}")
    # a program holds V // block_v blocks (looped) or one: loads further ahead than its last block do not exist
    return block_v, num_warps, min(int(prefetch), (dv // block_v if loop_v else 1) - 1)


def unpack_projection(qkv, packed, h: int, dv: int):
    """(q|k|v [B, T, 3HK], beta logits [B, T, H], out gate [B, T, H, V]) from a packed projection (see kda_decode's
    `packed`): the separate operands, for the paths that take them (references, the Mosaic kernel)."""
    og_col, beta_col = packed
    bsz, t, _ = qkv.shape
    return (qkv[..., : 3 * h * dv], qkv[..., beta_col: beta_col + h],
            qkv[..., og_col: og_col + h * dv].reshape(bsz, t, h, dv))


def _check(qkv, conv_state, conv_weight, z, beta, out_gate, state, slots, lengths, fresh, a_log, dt_bias,
           o_norm_weight, gate, packed=None):
    if qkv.ndim != 3:
        raise ValueError(f"qkv must be [B, T, 3*H*K]; got {qkv.shape}")
    if state.ndim != 4 or state.shape[2] != state.shape[3]:
        raise ValueError(f"state must be a V-first pool [P, H, V, K] with V == K; got {state.shape}")
    p, h, dv, dk = state.shape
    if packed is not None:
        if beta is not None or out_gate is not None:
            raise ValueError("with packed, beta and out_gate come from qkv's columns: pass None for both")
        if (not isinstance(packed, tuple) or len(packed) != 2 or not all(isinstance(x, int) for x in packed)
                or min(packed) < 3 * h * dk or packed[0] + h * dv > qkv.shape[2] or packed[1] + h > qkv.shape[2]):
            raise ValueError(f"packed must be (out-gate column, beta column) past q|k|v's {3 * h * dk} columns and "
                             f"within qkv's {qkv.shape[2]}; got {packed!r}")
        qkv, beta, out_gate = unpack_projection(qkv, packed, h, dv)  # (abstract here: only the shapes are checked)
    bsz, t, c = qkv.shape
    if c != 3 * h * dk:
        raise ValueError(f"qkv channels {c} != 3 * H * K = {3 * h * dk}")
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"decode/verify takes 1..{MAX_TOKENS} tokens per sequence; got T={t}")
    if dk < 16 or dk & (dk - 1):
        raise ValueError(f"head dim {dk} must be a power of two >= 16 (Triton block shapes)")
    if conv_state.ndim != 3 or conv_state.shape[0] != p or conv_state.shape[2] != c:
        raise ValueError(f"conv_state must be a pool [P={p}, W-1, {c}]; got {conv_state.shape}")
    if conv_weight.shape != (conv_state.shape[1] + 1, c):
        raise ValueError(f"conv_weight must be [W, {c}] with W-1 = {conv_state.shape[1]}; got {conv_weight.shape}")
    if z.shape != (bsz, t, h, dk) or out_gate.shape != (bsz, t, h, dv) or beta.shape != (bsz, t, h):
        raise ValueError(f"z / out_gate must be [B, T, H, K] = {(bsz, t, h, dk)} and beta [B, T, H]; got "
                         f"{z.shape}, {out_gate.shape}, {beta.shape}")
    if slots.shape != (bsz,) or lengths.shape != (bsz,):
        raise ValueError(f"slots and lengths must be [B={bsz}]; got {slots.shape}, {lengths.shape}")
    if fresh is not None and (fresh.shape != (bsz,) or not (jnp.issubdtype(fresh.dtype, jnp.integer)
                                                           or fresh.dtype == jnp.bool_)):
        raise ValueError(f"fresh must be an integer or bool [B={bsz}] flag per row; got {fresh.dtype}{list(fresh.shape)}")
    if a_log.shape[0] < h or dt_bias.size != h * dk or o_norm_weight.shape != (dv,):
        raise ValueError(f"a_log [>= {h}], dt_bias [{h * dk}], o_norm_weight [{dv}]; got "
                         f"{a_log.shape}, {dt_bias.shape}, {o_norm_weight.shape}")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}; got {gate!r}")


@functools.partial(jax.jit, static_argnames=("gate", "lower_bound", "eps", "all_states", "interpret", "block_v",
                                             "num_warps", "loop_v", "prefetch", "fold_v", "packed"))
def kda_decode(qkv, conv_state, conv_weight, z, beta, out_gate, state, slots, lengths, *, a_log, dt_bias,
               o_norm_weight, gate="lower_bound", lower_bound=-5.0, eps=1e-5, all_states=False, fresh=None,
               interpret=False, block_v=None, num_warps=None, loop_v=None, prefetch=None, fold_v=None, packed=None):
    """Fused KDA decode (T = 1) or verify (T <= 8) for B sequences living in pooled states.

    Args:
      qkv: [B, T, 3*H*K] q|k|v projections before the short conv (activation dtype).
      conv_state: [P, W-1, 3*H*K] pool of the last W-1 inputs per slot; conv_weight: [W, 3*H*K].
      z: [B, T, H, K] raw forget-gate input (f_b output); beta: [B, T, H] logits; out_gate: [B, T, H, V].
      state: [P, H, V, K] fp32 pool of V-first recurrent states (V == K).
      slots: [B] int32 pool rows (distinct); lengths: [B] int32 valid tokens per row (0 = idle row).
      a_log: [>= H]; dt_bias: [H*K]; o_norm_weight: [V]; gate / lower_bound: the gate form; eps: RMSNorm eps.
      all_states: verify mode (see Returns).
      fresh: [B] int32 (or bool), non-zero for a row that starts from the zero conv and recurrent state whatever
        its slot holds (a new request in a reused slot; the kernel skips reading that slot and, in decode,
        overwrites it). None: no fresh rows.
      block_v: state rows per program (per inner step with loop_v), a power of two <= V. None: min(32, V), verify
        min(64, V), looped min(64, V). V is the
        one-program-per-head kernel with the gated RMSNorm fused; smaller blocks write the rounded o and
        finish the norm (which needs all V) in a jnp epilogue over [B, T, H, V] -- the same numbers.
      num_warps: Triton warps per program. None: 8 when block_v == V (the whole-state kernel's value), else 4.
      loop_v: one program per (sequence, head) that walks its state in V-blocks of block_v rows one after another
        (grid H x B): q / k computed once per head, the conv state written in place and the gated RMSNorm fused
        -- one launch per layer instead of the blocked kernel's three (kernel, q|k conv scatter, norm epilogue).
        None: DEFAULT_LOOP_V for decode (with block_v None: DEFAULT_LOOP_BLOCK_V rows, 4 warps), False for verify.
      prefetch: with loop_v, how many V-blocks ahead of the one being computed the program issues its loads (the
        block's state rows and its v channels' conv inputs): 0 = each block's loads wait for the previous block's
        compute and store; 1 (or True) = double buffering, 2 blocks in registers. Capped at V / block_v - 1; no
        effect with one block per program (V-blocked grid, or block_v == V). None: DEFAULT_PREFETCH. Same results.
      fold_v: one program per head only (loop_v, or block_v == V): convolve the head's v channels once with q and
        k, and fold each V-block's v into its S k reduction (err = sum_c (onehot_ic v_c - S_ic k_c)) instead of
        convolving each block's v in the state's row layout (replicated across a warp: many registers). The
        same terms as the reference's v - S k, summed in another order (fp32 rounding only). None: DEFAULT_FOLD_V.
      packed: (out-gate column, beta column) -- qkv is then the layer's whole input projection [B, T, C] (q|k|v in
        its first 3HK columns, the beta logits and the output gate at those columns; k3jax.fuse's serving layout)
        and beta / out_gate are None: the kernel reads them in place, so no slice of the projection is copied
        (three XLA kernels per layer otherwise). Same results.

    Returns:
      decode: (y [B, T, H, V], new conv pool, new state pool) -- the pools updated in place at `slots`
        when the caller donates them (they are aliased to the outputs).
      verify: (y, (err [B, T, H, V], key [B, T, H, K], decay [B, T, H, K]) fp32: every position's state update,
        for k3jax.kda.apply_verify_updates); the pools untouched.
    """
    _check(qkv, conv_state, conv_weight, z, beta, out_gate, state, slots, lengths, fresh, a_log, dt_bias,
           o_norm_weight, gate, packed)
    bsz, t, _ = qkv.shape
    p, h, dv, dk = state.shape
    if packed is not None:  # the kernel reads beta and the gate from qkv; these stand in for their refs, unread
        beta, out_gate = qkv, qkv
    fresh = jnp.zeros((bsz,), jnp.int32) if fresh is None else fresh.astype(jnp.int32)
    loop_v = (DEFAULT_LOOP_V and not all_states) if loop_v is None else loop_v
    block_v, num_warps, prefetch = _tiling(block_v, num_warps, dv, all_states, loop_v, prefetch)
    fold_v = DEFAULT_FOLD_V if fold_v is None else fold_v
    if fold_v and not (loop_v or block_v == dv):
        raise ValueError("fold_v needs one program per head (loop_v=True or block_v == V): with V-blocked programs "
                         "every program would read the head's v conv state that another one rewrites in place")
    w1 = conv_state.shape[1]
    act = qkv.dtype
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    ins = [slots.astype(jnp.int32), lengths.astype(jnp.int32), fresh, qkv, conv_state, conv_weight, z, beta, out_gate,
           a_log[:h].astype(jnp.float32), dt_bias.astype(jnp.float32).reshape(h, dk), o_norm_weight, state]
    y_shape = jax.ShapeDtypeStruct((bsz, t, h, dv), act)
    if all_states:
        out_shape = [y_shape, jax.ShapeDtypeStruct((bsz, t, h, dv), jnp.float32),
                     jax.ShapeDtypeStruct((bsz, t, h, dk), jnp.float32),
                     jax.ShapeDtypeStruct((bsz, t, h, dk), jnp.float32)]
        aliases = {}
    else:
        out_shape = [y_shape, jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                     jax.ShapeDtypeStruct(state.shape, jnp.float32)]
        aliases = {4: 1, 12: 2}  # conv pool -> conv out, state pool -> state out
        if block_v < dv:
            out_shape.append(jax.ShapeDtypeStruct((bsz, w1, 2 * h * dk), conv_state.dtype))
    params = {} if interpret else dict(compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1))
    body = dict(num_tokens=t, gate=gate, lower_bound=lower_bound, eps=eps, all_states=all_states, act_dtype=act,
                block_v=block_v, prefetch=prefetch, fold_v=bool(fold_v), packed=packed)
    if loop_v:
        looped_outs = out_shape if all_states else out_shape[:3]  # (decode: no q|k side output)
        y, *rest = pl.pallas_call(
            functools.partial(_looped_kernel, **body),
            grid=(h, bsz),
            in_specs=[full(x) for x in ins],
            out_specs=[pl.BlockSpec(s.shape, lambda *_, n=len(s.shape): (0,) * n) for s in looped_outs],
            out_shape=looped_outs,
            input_output_aliases=aliases,
            interpret=interpret, name="kda_decode_verify" if all_states else "kda_decode", **params,
        )(*ins)
        return (y, tuple(rest)) if all_states else (y, *rest)
    # Grid (V-blocks, H, B): program_id(0) varies fastest (CUDA x), so neighbouring programs stream
    # neighbouring rows of one (slot, head) state -- fla's order (V-block fastest, then head, then sequence).
    y, *rest = pl.pallas_call(
        functools.partial(_blocked_kernel, **body),
        grid=(dv // block_v, h, bsz),
        in_specs=[full(x) for x in ins],
        out_specs=[pl.BlockSpec(s.shape, lambda *_, n=len(s.shape): (0,) * n) for s in out_shape],
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret, name="kda_decode_verify" if all_states else "kda_decode", **params,
    )(*ins)
    if block_v < dv:  # the norm needs all of V: the reference's own op, the same operations in the same order
        from k3jax.layers import gated_rms_norm

        y = gated_rms_norm(y, out_gate if packed is None else unpack_projection(qkv, packed, h, dv)[2],
                           o_norm_weight, eps)
    if all_states:
        return y, tuple(rest)
    conv_out, state_out, *qk_conv = rest
    if qk_conv:  # B * (W-1) * 2HK elements into the (aliased, so donated-in-place) pool; slots are distinct
        conv_out = conv_out.at[slots, :, : 2 * h * dk].set(qk_conv[0], unique_indices=True)
    return y, conv_out, state_out


def kda_decode_reference(qkv, conv_state, conv_weight, z, beta, out_gate, state, slots, lengths, *, a_log, dt_bias,
                         o_norm_weight, gate="lower_bound", lower_bound=-5.0, eps=1e-5, all_states=False, fresh=None,
                         packed=None):
    """Plain-jnp twin of `kda_decode` (same arguments and results), built from the model's reference layers:
    gather the pools at `slots` (zeros for fresh rows), short conv + SiLU, L2 norm, gate, recurrence, gated
    RMSNorm, scatter back."""
    from k3jax.kda import kda_recurrent_reference
    from k3jax.layers import causal_conv_with_state, gated_rms_norm, l2_normalize

    _check(qkv, conv_state, conv_weight, z, beta, out_gate, state, slots, lengths, fresh, a_log, dt_bias,
           o_norm_weight, gate, packed)
    p, h, dv, dk = state.shape
    if packed is not None:
        qkv, beta, out_gate = unpack_projection(qkv, packed, h, dv)
    bsz, t, c = qkv.shape
    conv0, s0 = conv_state[slots], state[slots]
    if fresh is not None:  # a select, not a multiply: exact zeros whatever the slot holds
        conv0 = jnp.where((fresh != 0)[:, None, None], jnp.zeros_like(conv0), conv0)
        s0 = jnp.where((fresh != 0)[:, None, None, None], jnp.zeros_like(s0), s0)
    y, new_conv = causal_conv_with_state(qkv, conv0, conv_weight, lengths)
    q, k, v = (y[..., i * h * dk : (i + 1) * h * dk].reshape(bsz, t, h, dk) for i in range(3))
    q = l2_normalize(q) * dk**-0.5
    k = l2_normalize(k)
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    g = _gate(z.astype(jnp.float32), a_log[:h].astype(jnp.float32)[:, None], dt_bias.astype(jnp.float32).reshape(h, dk),
              gate, lower_bound)
    g = jnp.where(valid[..., None, None], g, 0.0)
    b = jnp.where(valid[..., None], jax.nn.sigmoid(beta.astype(jnp.float32)), 0.0)
    o, new_rec = kda_recurrent_reference(q, k, v, g, b, s0, all_states=all_states)
    out = gated_rms_norm(o.astype(qkv.dtype), out_gate, o_norm_weight, eps)
    if all_states:
        return out, new_rec
    return out, conv_state.at[slots].set(new_conv), state.at[slots].set(new_rec)
