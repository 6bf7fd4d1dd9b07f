"""Chunked KDA Pallas kernel (interpret mode on CPU) against its plain-jnp reference.

Run: python -m pytest -q tests/kernels/test_kda_chunk.py
Tolerances: fp32 end to end (inputs, stored intermediates, IEEE dots). The kernel and the reference differ
only in summation order (chunked WY form vs the token recurrence) over <= 1000 steps of a contractive
recurrence: ~1e-6 relative, so 2e-5 leaves margin while a wrong decay, a missed mask or an off-by-one
chunk boundary gives >= 1e-2. bf16 inputs store bf16 intermediates (as fla does), so that case gets 2e-2:
bf16 rounding is 4e-3 per operand and the state carries it over many chunks.
Small head dims (16/32) keep interpret mode within the CI time budget; the lengths are the issue's.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda_chunk import checkpoint_offsets, kda_chunk, kda_chunk_reference


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def packed_inputs(seed, lens, h, dk, dv, dtype=np.float32):
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1])
    n = len(lens)
    x = dict(
        q=rng.standard_normal((t, h, dk)), k=rng.standard_normal((t, h, dk)), v=rng.standard_normal((t, h, dv)),
        g=rng.standard_normal((t, h, dk)), beta=rng.standard_normal((t, h)),
    )
    x = {name: jnp.asarray(a.astype(np.float32)).astype(dtype) for name, a in x.items()}
    x["beta"] = x["beta"].astype(jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((n, h, dv, dk)).astype(np.float32))
    a_log = jnp.asarray(rng.uniform(0.0, 2.0, (h,)).astype(np.float32))
    dt_bias = jnp.asarray(rng.standard_normal(h * dk).astype(np.float32))
    return x, s0, jnp.asarray(cu), a_log, dt_bias


@functools.lru_cache(maxsize=None)
def _ragged_case(gate):
    """Inputs and the recurrence's results for the ragged test, once per gate (shared by its stage cases)."""
    lens = [1, 63, 0, 64, 65, 1000]
    x, s0, cu, a_log, dt_bias = packed_inputs(1, lens, h=2, dk=16, dv=16)
    start = jnp.asarray([0, 5, 9, 64, 100, 37], jnp.int32)  # absolute positions: pages are absolute too
    kw = dict(a_log=a_log, dt_bias=dt_bias, gate=gate, beta_sigmoid=True, qk_l2norm=True, start_positions=start,
              checkpoint_page_size=128)
    want = kda_chunk_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], s0, cu, **kw)
    return lens, x, s0, cu, start, kw, want


@pytest.mark.parametrize("gate,state_pass,solve,stage1", [
    ("lower_bound", "fused", "pallas", "default"), ("softplus", "split", "xla", "default"),
    ("lower_bound", "fused", "xla", "v2")])
def test_ragged_lengths_fused_gate_checkpoints(gate, state_pass, solve, stage1):
    """Issue lengths 1, 63, 64, 65, 1000 in one packed batch (one empty row too), non-zero initial states,
    the gate, beta sigmoid and L2 norm fused, checkpoints every 128 tokens from unaligned start positions.
    Both state passes (fused output / split output einsum), both L / Aqk / inverse stages (the Pallas
    kernel takes bounded gates only; the XLA one's bounded path is covered by the bf16 test and
    test_kda_model) and both stage-1 variants (v2 with K3's bounded gate here; its softplus / precomputed
    paths equal the default stage's in test_stage1_v2_matches_default_stage); the bounded gate takes the
    factored diagonal blocks, softplus the pairwise ones."""
    lens, x, s0, cu, start, kw, (ro, rfinal, rckpt) = _ragged_case(gate)
    o, final, ckpt = kda_chunk(x["q"], x["k"], x["v"], x["g"], x["beta"], s0, cu, interpret=True,
                               state_pass=state_pass, solve=solve, stage1=stage1, **kw)
    assert rel(o, ro) < 2e-5
    for i in range(len(lens)):  # per sequence, so a wrong state in a short one cannot hide
        assert rel(final[i], rfinal[i]) < 2e-5, i
        seg = slice(int(cu[i]), int(cu[i + 1]))
        if lens[i]:
            assert rel(o[seg], ro[seg]) < 2e-5, i
    np.testing.assert_array_equal(final[2], s0[2])  # an empty sequence keeps its state exactly
    off = np.asarray(checkpoint_offsets(cu, start, 128))
    # boundaries in (start, start + len]: 128 (seq 3: 64..128; seq 4: 100..165), 128..1024 step 128 (seq 5: 37..1037)
    assert list(np.diff(off)) == [0, 0, 0, 1, 1, 8]
    assert rel(ckpt[: off[-1]], rckpt[: off[-1]]) < 2e-5
    for r in range(off[-1]):
        assert rel(ckpt[r], rckpt[r]) < 2e-5, r


def test_precomputed_gate_head_counts_and_page_size():
    """The unfused form (g, beta, q, k given, as the model's kda_chunked op passes them) at another head
    count and head dims, page size 64 (a checkpoint after every chunk)."""
    lens = [70, 64, 130]
    x, s0, cu, _, _ = packed_inputs(2, lens, h=3, dk=32, dv=16)
    q = x["q"] * jnp.sum(x["q"] ** 2, -1, keepdims=True) ** -0.5 * 32**-0.5
    k = x["k"] * jnp.sum(x["k"] ** 2, -1, keepdims=True) ** -0.5
    g = -jnp.exp(x["g"] - 1.0)  # an unbounded negative log decay: pairwise diagonal blocks
    beta = 1 / (1 + jnp.exp(-x["beta"]))
    kw = dict(checkpoint_page_size=64)
    o, final, ckpt = kda_chunk(q, k, x["v"], g, beta, s0, cu, interpret=True, **kw)
    ro, rfinal, rckpt = kda_chunk_reference(q, k, x["v"], g, beta, s0, cu, **kw)
    assert rel(o, ro) < 2e-5 and rel(final, rfinal) < 2e-5
    off = np.asarray(checkpoint_offsets(cu, jnp.zeros(3, jnp.int32), 64))
    assert off[-1] == 1 + 1 + 2
    assert rel(ckpt[: off[-1]], rckpt[: off[-1]]) < 2e-5
    np.testing.assert_allclose(rckpt[1], rfinal[1], rtol=0, atol=0)  # seq 1 ends on its page boundary


def test_single_head_bf16_split_padded():
    """bf16 inputs (the model's activation dtype): bf16 intermediates and matmul operands (the XLA stage's
    bounded-gate path); the split state pass on a padded batch (seq_lens), whose padding rows come back as
    zeros. (The fused pass in bf16 is covered by tests/kernels/test_kda_state_pass.py.)"""
    lens = [200, 65]
    x, s0, cu, a_log, dt_bias = packed_inputs(3, lens, h=1, dk=16, dv=32, dtype=jnp.bfloat16)
    kw = dict(a_log=a_log, dt_bias=dt_bias, gate="lower_bound", beta_sigmoid=True, qk_l2norm=True)
    pad_cu = jnp.asarray([0, 200, 400], jnp.int32)  # row 1: 65 valid tokens, then 135 of padding
    padded = {n: jnp.concatenate([a, a[200:][:135]]) for n, a in x.items()}
    po, pfinal, ckpt = kda_chunk(padded["q"], padded["k"], padded["v"], padded["g"], padded["beta"], s0, pad_cu,
                                 seq_lens=jnp.asarray(lens, jnp.int32), state_pass="split", interpret=True, **kw)
    assert po.dtype == jnp.bfloat16 and ckpt is None
    ro, rfinal, _ = kda_chunk_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], s0, cu, **kw)
    assert rel(po[:265], ro) < 2e-2 and rel(pfinal, rfinal) < 2e-2
    assert not np.any(np.asarray(po[265:], np.float32))


def test_bad_arguments_raise():
    x, s0, cu, a_log, dt_bias = packed_inputs(4, [3], h=1, dk=16, dv=16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="V-first"):
        kda_chunk(*args, s0.transpose(0, 1, 3, 2)[:, :, :8], cu, interpret=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        kda_chunk(*args, s0, cu, checkpoint_page_size=100, interpret=True)
    with pytest.raises(ValueError, match="solve must be"):
        kda_chunk(*args, s0, cu, solve="triton", interpret=True)
    with pytest.raises(ValueError, match="needs a_log"):
        kda_chunk(*args, s0, cu, gate="softplus", interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        kda_chunk(x["q"][..., :12], x["k"][..., :12], x["v"], x["g"][..., :12], x["beta"], s0[..., :12], cu, interpret=True)


def _stage1(fn, x, cu, a_log, dt_bias, gate, h, dk, stored):
    """Stage 1 alone (`_intra_stage` or `_intra_stage_v2`) on the chunk table of cu, as kda_chunk calls it."""
    from pallas_kernels import kda_chunk as kc

    n = cu.shape[0] - 1
    first, tok_start, length, _ = kc.chunk_table(cu, jnp.zeros(n, jnp.int32), int(cu[-1]) // 64 + 2 * n, 0)
    a = jnp.zeros(h) if a_log is None else a_log[:h]
    b = jnp.zeros((h, dk)) if dt_bias is None else dt_bias.reshape(h, dk)
    return fn(tok_start, length, x["q"], x["k"], x["v"], x["g"], x["beta"], a, b, gate=gate, lower_bound=-5.0,
              beta_sigmoid=gate != "none", qk_l2norm=gate != "none", scale=dk**-0.5,
              bounded=gate == "lower_bound", stored=stored)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "none"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_stage1_v2_matches_default_stage(gate, dtype):
    """stage1="v2" (row-block L / Aqk, inverse by halves, norms as packed scalars) gives the default stage's
    six outputs on the issue's ragged lengths. fp32: the two differ only in summation order (the inverse's
    block formula, the norm's reduction), ~1e-7 measured, so 1e-5. bf16: the same values rounded once to
    bf16 (2^-9 relative at most per element), so 4e-3 in norm. Steep gates included: softplus with
    a = e^a_log up to e^2 gives log decays down to ~-20 per token (e^(P - G) across a 16-row block would
    overflow fp32), and gate "none" takes g = -e^z unbounded; every output must stay finite."""
    from pallas_kernels import kda_chunk as kc

    lens = [1, 63, 0, 64, 65, 1000]
    x, _, cu, a_log, dt_bias = packed_inputs(5, lens, h=2, dk=32, dv=16, dtype=dtype)
    if gate == "none":  # precomputed: normalised q, k, beta in (0, 1), unbounded log decay
        x["q"] = (x["q"] * jnp.sum(x["q"].astype(jnp.float32) ** 2, -1, keepdims=True) ** -0.5 * 32**-0.5).astype(dtype)
        x["k"] = (x["k"] * jnp.sum(x["k"].astype(jnp.float32) ** 2, -1, keepdims=True) ** -0.5).astype(dtype)
        x["g"] = (-jnp.exp(x["g"].astype(jnp.float32) + 1.0)).astype(dtype)
        x["beta"] = 1 / (1 + jnp.exp(-x["beta"]))
    stored = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32
    want = _stage1(kc._intra_stage, x, cu, a_log, dt_bias, gate, 2, 32, stored)
    got = _stage1(kc._intra_stage_v2, x, cu, a_log, dt_bias, gate, 2, 32, stored)
    tol = 4e-3 if dtype == jnp.bfloat16 else 1e-5
    for name, g_, w_ in zip(("w", "u", "qg", "kg", "aqk", "gate_last"), got, want):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype, name
        assert np.all(np.isfinite(np.asarray(g_, np.float32))), name
        assert rel(np.asarray(g_, np.float32), np.asarray(w_, np.float32)) < tol, name


def test_stage1_v2_bad_arguments_raise():
    x, s0, cu, _, _ = packed_inputs(4, [3], h=1, dk=16, dv=16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], s0, cu)
    with pytest.raises(ValueError, match="stage1 must be"):
        kda_chunk(*args, stage1="v3", interpret=True)
    with pytest.raises(ValueError, match="solve must be 'xla'"):
        kda_chunk(*args, stage1="v2", solve="pallas", interpret=True)
