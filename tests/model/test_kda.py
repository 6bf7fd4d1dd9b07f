"""KDA reference math: recurrence vs an independent float64 oracle, chunked vs recurrent, gates, conv.

Run: python -m pytest tests/model/test_kda.py -q
Tolerances: fp32 with values O(1) over <= ~1000 steps of a contractive recurrence accumulates relative
error ~1e-6; the issue's bar is 1e-5 relative, which a swapped operand or a wrong decay misses by orders
of magnitude.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import load_config
from k3jax.kda import (apply_verify_updates, conv_window_after, kda_chunked_reference, kda_gate, kda_mixer,
                       kda_recurrent_reference, states_from_updates)
from k3jax.layers import causal_conv_with_state, l2_normalize
from k3jax.params import init_params


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_inputs(seed, b, t, h, dk, dv, gate="lower_bound"):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, dk)).astype(np.float32)
    k = rng.standard_normal((b, t, h, dk)).astype(np.float32)
    q = np.asarray(l2_normalize(jnp.asarray(q))) * dk**-0.5
    k = np.asarray(l2_normalize(jnp.asarray(k)))
    v = rng.standard_normal((b, t, h, dv)).astype(np.float32)
    if gate == "lower_bound":
        g = (-5.0 / (1 + np.exp(-rng.standard_normal((b, t, h, dk)) * 3))).astype(np.float32)  # (-5, 0)
    else:
        g = (-np.exp(rng.uniform(0, 2.7, (h, 1))) * np.log1p(np.exp(rng.standard_normal((b, t, h, dk)) - 4))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((b, t, h))))).astype(np.float32)
    s0 = rng.standard_normal((b, h, dv, dk)).astype(np.float32)
    return q, k, v, g, beta, s0


def oracle_recurrence(q, k, v, g, beta, s0_vfirst):
    """float64, K-first state, written from the spec: S_t = (I - b k k^T) Diag(e^g) S + b k v^T; o = S^T q."""
    b, t, h, dk = q.shape
    o = np.zeros(v.shape, np.float64)
    s = np.swapaxes(s0_vfirst.astype(np.float64), -1, -2).copy()  # [B, H, K, V]
    for bi in range(b):
        for hi in range(h):
            st = s[bi, hi]
            for ti in range(t):
                kt = k[bi, ti, hi].astype(np.float64)
                decay = np.diag(np.exp(g[bi, ti, hi].astype(np.float64)))
                st = (np.eye(dk) - beta[bi, ti, hi] * np.outer(kt, kt)) @ decay @ st + beta[bi, ti, hi] * np.outer(kt, v[bi, ti, hi])
                o[bi, ti, hi] = st.T @ q[bi, ti, hi]
            s[bi, hi] = st
    return o, np.swapaxes(s, -1, -2)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_recurrent_matches_float64_oracle(gate):
    q, k, v, g, beta, s0 = random_inputs(0, 2, 19, 3, 8, 5, gate)
    o, s = kda_recurrent_reference(*map(jnp.asarray, (q, k, v, g, beta, s0)))
    o_ref, s_ref = oracle_recurrence(q, k, v, g, beta, s0)
    assert rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("t,h,dk,dv", [(1, 2, 16, 16), (63, 3, 16, 12), (64, 1, 32, 32), (65, 4, 16, 16), (200, 2, 24, 20)])
def test_chunked_equals_recurrent(gate, t, h, dk, dv):
    q, k, v, g, beta, s0 = random_inputs(t * 7 + h, 2, t, h, dk, dv, gate)
    args = tuple(map(jnp.asarray, (q, k, v, g, beta, s0)))
    o_r, s_r = kda_recurrent_reference(*args)
    o_c, s_c = kda_chunked_reference(*args)
    assert rel(o_c, o_r) < 1e-5
    assert rel(s_c, s_r) < 1e-5


@pytest.mark.slow
def test_chunked_equals_recurrent_long():
    q, k, v, g, beta, s0 = random_inputs(5, 1, 1000, 2, 16, 16)
    args = tuple(map(jnp.asarray, (q, k, v, g, beta, s0)))
    (o_r, s_r), (o_c, s_c) = kda_recurrent_reference(*args), kda_chunked_reference(*args)
    assert rel(o_c, o_r) < 1e-5 and rel(s_c, s_r) < 1e-5


def test_padding_tokens_leave_state_unchanged():
    q, k, v, g, beta, s0 = random_inputs(3, 1, 70, 2, 16, 16)
    g[:, 50:] = 0.0
    beta[:, 50:] = 0.0
    full = tuple(map(jnp.asarray, (q, k, v, g, beta, s0)))
    head = tuple(map(jnp.asarray, (q[:, :50], k[:, :50], v[:, :50], g[:, :50], beta[:, :50], s0)))
    for fn in (kda_recurrent_reference, kda_chunked_reference):
        assert rel(fn(*full)[1], fn(*head)[1]) < 1e-6


def test_all_states_updates_rebuild_every_prefix_state():
    """all_states returns every token's rank-one update; from the initial state they rebuild the state after each
    prefix (per row counts, one row at 0 = the initial state) to fp32 rounding of the same operations."""
    q, k, v, g, beta, s0 = random_inputs(4, 2, 6, 2, 16, 16)
    args = tuple(map(jnp.asarray, (q, k, v, g, beta, s0)))
    o_all, updates = kda_recurrent_reference(*args, all_states=True)
    assert [u.shape for u in updates] == [(2, 6, 2, 16)] * 3
    assert rel(o_all, kda_recurrent_reference(*args)[0]) == 0.0  # the outputs do not change with the flag
    every = states_from_updates(args[-1], *updates)
    assert every.shape == (2, 6, 2, 16, 16)
    for i in range(6):
        prefix = tuple(jnp.asarray(x[:, : i + 1]) for x in (q, k, v, g, beta)) + (args[-1],)
        rebuilt = apply_verify_updates(args[-1], *updates, jnp.full((2,), i + 1))
        assert rel(rebuilt, kda_recurrent_reference(*prefix)[1]) < 1e-6
        assert rel(every[:, i], rebuilt) < 1e-6  # (the same operations, scanned)
    mixed = apply_verify_updates(args[-1], *updates, jnp.asarray([0, 4]))
    np.testing.assert_array_equal(mixed[0], s0[0])
    assert rel(mixed[1], kda_recurrent_reference(*(tuple(jnp.asarray(x[:, :4]) for x in (q, k, v, g, beta))
                                                  + (args[-1],)))[1][1]) < 1e-6
    with pytest.raises(ValueError, match="apply_verify_updates"):
        apply_verify_updates(args[-1], updates[0], updates[1][..., :8], updates[2], jnp.ones((2,), jnp.int32))


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_gate_formulas(gate):
    cfg = load_config("k3-tiny").replace(kda_gate=gate)
    rng = np.random.default_rng(1)
    h, dk = cfg.kda_num_heads, cfg.kda_head_dim
    z = rng.standard_normal((4, h, dk)) * 3
    a_log = np.concatenate([rng.uniform(0, 2.7, h), np.zeros(5)])  # padded like K3's A_log[128]
    dt = rng.standard_normal(h * dk)
    x = z + dt.reshape(h, dk)
    a = np.exp(a_log[:h])[:, None]
    if gate == "lower_bound":
        want = -5.0 / (1 + np.exp(-a * x))
    else:
        want = -a * np.log1p(np.exp(x))
    got = kda_gate(jnp.asarray(z, jnp.float32), jnp.asarray(a_log, jnp.float32), jnp.asarray(dt, jnp.float32), cfg)
    assert rel(got, want) < 1e-6
    if gate == "lower_bound":
        assert float(got.min()) >= -5.0 and float(got.max()) <= 0.0  # open interval, up to fp32 saturation


def test_conv_state_continuation_and_padding():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 11, 7)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 7)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((2, 3, 7)), jnp.float32)
    y_all, s_all = causal_conv_with_state(x, s0, w)
    y1, s1 = causal_conv_with_state(x[:, :5], s0, w)
    y2, s2 = causal_conv_with_state(x[:, 5:], s1, w)
    np.testing.assert_allclose(jnp.concatenate([y1, y2], 1), y_all, rtol=1e-6)
    np.testing.assert_allclose(s2, s_all, rtol=0)
    # explicit formula: c_t = sum_i w[i] z_{t-3+i}, zero-free because the state supplies the left context
    full = np.concatenate([np.asarray(s0), np.asarray(x)], 1)
    conv = sum(full[:, i : i + 11] * np.asarray(w)[i] for i in range(4))
    np.testing.assert_allclose(y_all, conv / (1 + np.exp(-conv)), rtol=1e-5, atol=1e-6)
    # ragged rows: the new state is the last 3 *valid* inputs
    _, s_rag = causal_conv_with_state(x, s0, w, lengths=jnp.array([2, 11]))
    np.testing.assert_array_equal(s_rag[0], full[0, 2:5])
    np.testing.assert_array_equal(s_rag[1], full[1, 11:14])


@pytest.mark.parametrize("name", ["lower_bound", "softplus"])
def test_mixer_verify_states_equal_sequential_decode(name):
    cfg = load_config("k3-tiny").replace(kda_gate=name, kda_output_gate_rank=None if name == "lower_bound" else 5)
    params = init_params(cfg, jax.random.key(3))["layers"][0]["attn"]
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 5, cfg.hidden_size)), jnp.float32)
    conv0 = jnp.asarray(rng.standard_normal((2, 3, cfg.conv_channels)), jnp.float32)
    rec0 = jnp.asarray(rng.standard_normal((2, cfg.kda_num_heads, 16, 16)) * 0.3, jnp.float32)
    y_all, inputs, recs = kda_mixer(params, x, conv0, rec0, cfg, mode="recurrent", all_states=True)
    assert inputs.shape == (2, 5, cfg.conv_channels)  # the conv's inputs, not per-position windows
    conv, rec = conv0, rec0
    for i in range(5):
        y, conv, rec = kda_mixer(params, x[:, i : i + 1], conv, rec, cfg, mode="recurrent")
        assert rel(y[:, 0], y_all[:, i]) < 1e-5
        np.testing.assert_array_equal(conv_window_after(conv0, inputs, jnp.full((2,), i + 1)), conv)
        assert rel(apply_verify_updates(rec0, *recs, jnp.full((2,), i + 1)), rec) < 1e-6
    y_chunk, conv_c, rec_c = kda_mixer(params, x, conv0, rec0, cfg, mode="chunked")
    assert rel(y_chunk, y_all) < 1e-5 and rel(rec_c, rec) < 1e-5
    np.testing.assert_array_equal(conv_c, conv)
