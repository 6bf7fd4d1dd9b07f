"""Fused KDA decode / verify Pallas kernel (interpret mode on CPU) against its plain-jnp reference.

Run: python -m pytest -q tests/kernels/test_kda_decode.py
Tolerances: fp32 throughout; kernel and reference differ only in summation order of K/V-length dot
products (~1e-7 relative per step, a few steps), so 1e-5 relative is loose for fp32 and tight for any real
error (a wrong slot, a missed conv tap or decay is O(1)). Rows and slots the step must not touch are
compared exactly. bf16 activations: the conv output and o are rounded to bf16 at the same points in both,
but summation order can flip a rounding: 1e-2.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.kda import conv_window_after, states_from_updates
from pallas_kernels.kda_decode import kda_decode, kda_decode_reference


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def decode_inputs(seed, bsz, t, h, dk, pool, width=4, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    c = 3 * h * dk
    arr = lambda *shape, s=1.0: jnp.asarray((rng.standard_normal(shape) * s).astype(np.float32))
    step = dict(qkv=arr(bsz, t, c).astype(dtype), z=arr(bsz, t, h, dk), beta=arr(bsz, t, h),
                out_gate=arr(bsz, t, h, dk).astype(dtype))
    pools = dict(conv_state=arr(pool, width - 1, c).astype(dtype), state=arr(pool, h, dk, dk))
    params = dict(conv_weight=arr(width, c, s=0.5), a_log=arr(h, s=0.5), dt_bias=arr(h * dk),
                  o_norm_weight=1.0 + arr(dk, s=0.1))
    return step, pools, params


def call(fn, step, pools, params, slots, lengths, raw=False, **kw):
    """fn's results; in verify (all_states) (y, the per-position states [B, T, H, V, K]) rebuilt from the returned
    updates and the pooled states before the step (zeros for fresh rows), as the model's commit does, unless raw.
    (Verify returns no conv states: the commit rebuilds a kept window from the inputs; test_kda_commit.py.)"""
    out = fn(step["qkv"], pools["conv_state"], params["conv_weight"], step["z"], step["beta"], step["out_gate"],
             pools["state"], jnp.asarray(slots, jnp.int32), jnp.asarray(lengths, jnp.int32),
             a_log=params["a_log"], dt_bias=params["dt_bias"], o_norm_weight=params["o_norm_weight"], **kw)
    if not kw.get("all_states") or raw:
        return out
    y, updates = out
    return y, verify_states(pools["state"], slots, kw.get("fresh"), updates)


def verify_states(pool, slots, fresh, updates):
    """The state after every verify position, [B, T, H, V, K], from the rows' pooled states (zeros where fresh)."""
    base = pool[jnp.asarray(slots)]
    if fresh is not None:
        base = jnp.where((jnp.asarray(fresh) != 0)[:, None, None, None], 0.0, base)
    return states_from_updates(base, *updates)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_decode_in_place_through_slots(gate):
    """T = 1, shuffled slots in a larger pool, one idle row (length 0): y and both pools match the reference;
    slots not in the batch and the idle row's slot are bit-identical to before."""
    step, pools, params = decode_inputs(0, bsz=3, t=1, h=3, dk=16, pool=7)
    slots, lengths = [5, 0, 3], [1, 0, 1]
    y, conv, state = call(kda_decode, step, pools, params, slots, lengths, gate=gate, interpret=True)
    ry, rconv, rstate = call(kda_decode_reference, step, pools, params, slots, lengths, gate=gate)
    assert rel(y[np.array([0, 2])], ry[np.array([0, 2])]) < 1e-5
    assert rel(state, rstate) < 1e-5 and rel(conv, rconv) < 1e-5
    untouched = [0, 1, 2, 4, 6]  # slot 0 is the idle row: its state must come back unchanged
    np.testing.assert_array_equal(state[np.array(untouched)], pools["state"][np.array(untouched)])
    np.testing.assert_array_equal(conv[np.array(untouched)], pools["conv_state"][np.array(untouched)])
    assert rel(state[5], pools["state"][5]) > 1e-3  # and the live rows did move


@pytest.mark.parametrize("block_v", [16, 32])
def test_verify_states_equal_sequential_decode(block_v):
    """T = 4 verify (2 heads, K = 32, a short row of 2 valid tokens): the state after every position equals
    four sequential single-token decodes, and the outputs match too; the pools are left alone; the conv window
    rebuilt from the step's inputs (k3jax.kda.conv_window_after, the commit's) equals decode's at every position.
    block_v 16: two V-blocks per head (norm in the epilogue, q|k conv state scattered); 32 = V: the whole-state
    kernel."""
    t = 4
    step, pools, params = decode_inputs(1, bsz=2, t=t, h=2, dk=32, pool=4)
    slots, lengths = [2, 1], [4, 2]
    y, states = call(kda_decode, step, pools, params, slots, lengths, all_states=True, interpret=True,
                                  block_v=block_v)
    ry, rstates = call(kda_decode_reference, step, pools, params, slots, lengths, all_states=True)
    assert rel(y, ry) < 1e-5 and rel(states, rstates) < 1e-5
    # what the kernel writes: per position a [V] and two [K] vectors per head, no state
    _, updates = call(kda_decode, step, pools, params, slots, lengths, all_states=True, interpret=True,
                      block_v=block_v, raw=True)
    _, rupdates = call(kda_decode_reference, step, pools, params, slots, lengths, all_states=True, raw=True)
    assert [u.shape for u in updates] == [(2, t, 2, 32)] * 3 and all(u.dtype == jnp.float32 for u in updates)
    assert all(rel(u, r) < 1e-5 for u, r in zip(updates, rupdates))
    assert not np.asarray(updates[0][1, 2:]).any() and (np.asarray(updates[2][1, 2:]) == 1).all()  # padding: no-ops
    seq = dict(pools)
    for i in range(t):
        one = {name: a[:, i : i + 1] for name, a in step.items()}
        live = [int(i < n) for n in lengths]
        y1, conv1, state1 = call(kda_decode, one, seq, params, slots, live, interpret=True, block_v=block_v)
        seq = dict(conv_state=conv1, state=state1)
        for r, slot in enumerate(slots):
            if live[r]:
                assert rel(y[r, i], y1[r, 0]) < 1e-5, (r, i)
                # the conv window a commit keeping i + 1 positions rebuilds from the inputs = decode's, exactly
                kept = conv_window_after(pools["conv_state"][slot], step["qkv"][r], i + 1)
                np.testing.assert_array_equal(kept, conv1[slot])
            # a padded position leaves the recurrent state where the last valid token put it
            assert rel(states[r, i], state1[slot]) < 1e-5, (r, i)


BLOCKED_CASES = [  # (block_v, T, verify, gate, loop_v): every block_v x T, each gate at every T and for two of
    # the three block sizes (the gate is computed by one shared helper, before the V-blocks split the work),
    # plus multi-token in-place decode
    (bv, t, t > 1, gate, False) for bv, t, gate in [
        (16, 1, "lower_bound"), (16, 4, "softplus"), (32, 1, "softplus"), (32, 4, "lower_bound"),
        (64, 1, "lower_bound"), (64, 4, "softplus")]
] + [(bv, 4, False, "lower_bound", False) for bv in (16, 32, 64)] + [  # the looped kernel: V-blocks in one program
    (16, 1, False, "lower_bound", True), (32, 4, True, "softplus", True), (16, 4, False, "lower_bound", True)]


@pytest.mark.parametrize("block_v,t,verify,gate,loop_v", BLOCKED_CASES)
def test_v_blocked_matches_reference(block_v, t, verify, gate, loop_v):
    """V-blocked programs (V = K = 64: 4, 2 or 1 blocks per head; or, loop_v, one program per head walking its
    blocks), 3 heads, shuffled slots into a pool of 9, non-zero initial states, ragged lengths with an idle row and
    T-padding: y at the valid positions and both pools / per-position states match the reference; in decode, rows
    outside the batch and the idle row's slot are bit-identical to before (the q|k conv scatter and the in-place v
    rows touch nothing else)."""
    step, pools, params = decode_inputs(10 + block_v + t, bsz=4, t=t, h=3, dk=64, pool=9)
    slots = [6, 2, 8, 0]
    lengths = [1, 0, 1, 1] if t == 1 else [4, 0, 2, 3]
    got = call(kda_decode, step, pools, params, slots, lengths, gate=gate, all_states=verify, interpret=True,
               block_v=block_v, loop_v=loop_v)
    want = call(kda_decode_reference, step, pools, params, slots, lengths, gate=gate, all_states=verify)
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    assert rel(np.asarray(got[0])[valid], np.asarray(want[0])[valid]) < 1e-5
    assert all(rel(g, w) < 1e-5 for g, w in zip(got[1:], want[1:]))  # pools; or (verify) per-position states
    if not verify:
        untouched = np.array([1, 2, 3, 4, 5, 7])  # 2 is the idle row's slot
        np.testing.assert_array_equal(got[2][untouched], pools["state"][untouched])
        np.testing.assert_array_equal(got[1][untouched], pools["conv_state"][untouched])
        assert rel(got[1][6], pools["conv_state"][6]) > 1e-3  # the live rows' conv states did move


FRESH_CASES = [(16, 1, False, False), (32, 1, False, False), (16, 3, False, False), (16, 3, True, False),
               (16, 1, False, True), (16, 3, True, True)]  # (block_v, T, verify, loop_v); V = 32


@pytest.mark.parametrize("block_v,t,verify,loop_v", FRESH_CASES)
def test_fresh_rows_ignore_their_slots(block_v, t, verify, loop_v):
    """Rows flagged fresh start from zero conv and recurrent states whatever their (reused) slots hold: random
    garbage in one, inf / NaN in another (masked-off loads, not a multiply by zero). Against the same call on a
    pool whose fresh slots are zeroed (flags all 0), y and the pools / per-position states agree to 1e-6 (the same
    arithmetic on the same zeros: in interpret mode XLA on the CPU still lands 1 ulp apart in a few elements
    when only the flag data differ), and both match the reference given the flag. Non-fresh rows read their
    slots as usual; slots outside the batch stay untouched. A fresh idle row (length 0) leaves zeros in its slot,
    as zeroing it in the pool before the kernel did. Blocked (16 < V), looped (16, loop_v) and whole-state (32)
    kernels, multi-token in-place decode (T 3) and verify."""
    step, pools, params = decode_inputs(20 + block_v + t, bsz=4, t=t, h=2, dk=32, pool=7)
    slots, lengths, fresh = [5, 2, 0, 6], [t, t, 0, max(t - 1, 1)], [1, 0, 1, 1]
    fresh_slots = np.array([5, 0, 6])
    conv, state = np.array(pools["conv_state"]), np.array(pools["state"])
    state[6, 1, 3, :5] = [np.inf, -np.inf, np.nan, 1e30, -1e30]
    conv[6, 0, :3] = [np.nan, np.inf, -np.inf]
    dirty = dict(conv_state=jnp.asarray(conv), state=jnp.asarray(state))
    conv[fresh_slots], state[fresh_slots] = 0, 0
    zeroed = dict(conv_state=jnp.asarray(conv), state=jnp.asarray(state))
    kw = dict(all_states=verify, interpret=True, block_v=block_v, loop_v=loop_v)
    got = call(kda_decode, step, dirty, params, slots, lengths, fresh=jnp.asarray(fresh, jnp.int32), **kw)
    # all-zero flags, not None: the same compiled program (a constant flag would let XLA fuse differently)
    from_zeros = call(kda_decode, step, zeroed, params, slots, lengths, fresh=jnp.zeros((4,), jnp.int32), **kw)
    want = call(kda_decode_reference, step, dirty, params, slots, lengths, fresh=jnp.asarray(fresh, jnp.int32),
                all_states=verify)
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    assert rel(np.asarray(got[0])[valid], np.asarray(from_zeros[0])[valid]) < 1e-6
    assert rel(np.asarray(got[0])[valid], np.asarray(want[0])[valid]) < 1e-5
    live = np.array([0, 1, 3]) if verify else slice(None)  # verify: per-row states of rows with tokens
    for g, z, w in zip(got[1:], from_zeros[1:], want[1:]):
        assert rel(g[live], z[live]) < 1e-6
        assert np.isfinite(np.asarray(g[live])).all() and rel(g[live], w[live]) < 1e-5
    if not verify:
        untouched = np.array([1, 3, 4])
        np.testing.assert_array_equal(got[2][untouched], pools["state"][untouched])
        np.testing.assert_array_equal(got[1][untouched], pools["conv_state"][untouched])
        assert not np.asarray(got[2][0]).any() and not np.asarray(got[1][0]).any()  # the fresh idle row's slot
        assert rel(got[2][2], pools["state"][2]) > 1e-3  # the non-fresh row moved on from its own state


PREFETCH_CASES = [  # (block_v, prefetch, T, verify, gate, fold_v); V = 64: 4, 2 or 1 looped V-blocks per program
    (16, 1, 1, False, "lower_bound", True), (16, 3, 2, False, "softplus", False),
    (32, True, 4, True, "lower_bound", False), (32, 0, 4, True, "softplus", True), (64, 1, 1, False, "softplus", True)]


@pytest.mark.parametrize("block_v,prefetch,t,verify,gate,fold_v", PREFETCH_CASES)
def test_looped_prefetch_matches_reference(block_v, prefetch, t, verify, gate, fold_v):
    """The looped kernel with its state / v-conv loads issued `prefetch` V-blocks ahead (1; 3 = every block in
    flight; True = 1; 64 = V: one block, nothing to prefetch), with or without fold_v (the head's v convolved once
    and picked per block inside the S k reduction), decode (T 1, in-place multi-token T 2) and verify (T 4), one
    head: shuffled slots in a pool of 7, ragged lengths with an idle row, a fresh row whose slot holds inf /
    NaN garbage, non-zero states. y at the valid positions and the pools / per-position states match the
    reference; in decode, slots outside the batch and the idle row's are bit-identical to before."""
    step, pools, params = decode_inputs(40 + block_v + t, bsz=4, t=t, h=1, dk=64, pool=7)
    slots, lengths, fresh = [6, 2, 0, 4], ([1, 0, 1, 1] if t == 1 else [t, 0, 2, t - 1]), [0, 0, 1, 0]
    conv, state = np.array(pools["conv_state"]), np.array(pools["state"])
    state[0, 0, 7, :3], conv[0, 2, :3] = [np.nan, np.inf, -1e30], [np.inf, np.nan, -np.inf]  # the fresh row's slot
    pools = dict(conv_state=jnp.asarray(conv), state=jnp.asarray(state))
    kw = dict(gate=gate, all_states=verify, fresh=jnp.asarray(fresh, jnp.int32))
    got = call(kda_decode, step, pools, params, slots, lengths, interpret=True, block_v=block_v, loop_v=True,
               prefetch=prefetch, fold_v=fold_v, **kw)
    want = call(kda_decode_reference, step, pools, params, slots, lengths, **kw)
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    assert rel(np.asarray(got[0])[valid], np.asarray(want[0])[valid]) < 1e-5
    live = np.array([0, 2, 3]) if verify else slice(None)  # verify: per-row states of rows with tokens
    for g, w in zip(got[1:], want[1:]):
        assert np.isfinite(np.asarray(g[live])).all() and rel(g[live], w[live]) < 1e-5
    if not verify:
        untouched = np.array([1, 2, 3, 5])  # 2 is the idle row's slot
        np.testing.assert_array_equal(got[2][untouched], pools["state"][untouched])
        np.testing.assert_array_equal(got[1][untouched], pools["conv_state"][untouched])


@pytest.mark.parametrize("block_v", [8, 16])
def test_bf16_activations(block_v):
    """bf16 activations, whole-state (16 = V) and blocked (8): the blocked kernel writes o rounded to bf16
    and the epilogue norms it, as the reference does."""
    step, pools, params = decode_inputs(2, bsz=2, t=2, h=1, dk=16, pool=3, dtype=jnp.bfloat16)
    slots, lengths = [1, 2], [2, 1]
    y, conv, state = call(kda_decode, step, pools, params, slots, lengths, interpret=True, block_v=block_v)
    ry, rconv, rstate = call(kda_decode_reference, step, pools, params, slots, lengths)
    assert y.dtype == jnp.bfloat16 and conv.dtype == jnp.bfloat16
    assert rel(y, ry) < 1e-2 and rel(state, rstate) < 1e-2
    np.testing.assert_array_equal(conv, rconv)  # the conv state is a copy of inputs: exact


def test_bad_arguments_raise():
    step, pools, params = decode_inputs(3, bsz=1, t=1, h=1, dk=16, pool=2)
    with pytest.raises(ValueError, match="1..8 tokens"):
        many = {name: jnp.repeat(a, 9, axis=1) for name, a in step.items()}
        call(kda_decode, many, pools, params, [0], [1], interpret=True)
    with pytest.raises(ValueError, match="slots and lengths"):
        call(kda_decode, step, pools, params, [0, 1], [1], interpret=True)
    with pytest.raises(ValueError, match="fresh must be"):
        call(kda_decode, step, pools, params, [0], [1], fresh=jnp.zeros((2,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="fresh must be"):
        call(kda_decode_reference, step, pools, params, [0], [1], fresh=jnp.zeros((1,), jnp.float32))
    with pytest.raises(ValueError, match="gate must be"):
        call(kda_decode, step, pools, params, [0], [1], gate="sigmoid", interpret=True)
    for block_v in (12, 32, 0):  # not a power of two; larger than V = 16; empty
        with pytest.raises(ValueError, match="block_v must be"):
            call(kda_decode, step, pools, params, [0], [1], block_v=block_v, interpret=True)
    with pytest.raises(ValueError, match="num_warps must be"):
        call(kda_decode, step, pools, params, [0], [1], num_warps=3, interpret=True)
    for prefetch in (-1, 1.5):
        with pytest.raises(ValueError, match="prefetch must be"):
            call(kda_decode, step, pools, params, [0], [1], prefetch=prefetch, loop_v=True, interpret=True)
    with pytest.raises(ValueError, match="fold_v needs one program per head"):
        call(kda_decode, step, pools, params, [0], [1], fold_v=True, loop_v=False, block_v=8, interpret=True)


@pytest.mark.parametrize("block_v,loop_v,verify", [(16, True, False), (16, False, False), (32, False, True)])
def test_packed_projection_equals_the_sliced_operands(block_v, loop_v, verify):
    """`packed`: q|k|v, the beta logits and the output gate read in place from one wider projection (the serving
    layout's fused GEMM output, with other columns between and after them) give exactly the results of the sliced
    operands, for the looped and V-blocked kernels and verify; the reference takes `packed` the same way."""
    bsz, t, h, dk = 3, 2 if verify else 1, 2, 32
    step, pools, params = decode_inputs(7, bsz=bsz, t=t, h=h, dk=dk, pool=5)
    rng = np.random.default_rng(8)
    extra = jnp.asarray(rng.standard_normal((bsz, t, 5)).astype(np.float32))
    # columns: q|k|v, 5 unrelated, beta [H], 5 unrelated, out gate [H*V], 5 unrelated
    whole = jnp.concatenate([step["qkv"], extra, step["beta"], extra, step["out_gate"].reshape(bsz, t, h * dk),
                             extra], axis=-1)
    beta_col = 3 * h * dk + 5
    packed = (beta_col + h + 5, beta_col)
    slots, lengths = [4, 0, 2], [t, 1, 0]
    kw = dict(all_states=verify, interpret=True, block_v=block_v, loop_v=loop_v and not verify)
    want = call(kda_decode, step, pools, params, slots, lengths, **kw)
    got = call(kda_decode, dict(step, qkv=whole, beta=None, out_gate=None), pools, params, slots, lengths,
               packed=packed, **kw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    ref = call(kda_decode_reference, dict(step, qkv=whole, beta=None, out_gate=None), pools, params, slots, lengths,
               packed=packed, all_states=verify)
    assert all(rel(r, w) < 1e-5 for r, w in zip(ref, want))
    with pytest.raises(ValueError, match="packed"):
        call(kda_decode, dict(step, qkv=whole, beta=None, out_gate=None), pools, params, slots, lengths,
             packed=(3 * h * dk - 1, beta_col), **kw)
