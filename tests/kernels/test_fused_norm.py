"""Fused norms (pallas_kernels/fused_norm.py) in interpret mode: AttnRes mix + RMSNorm against a float64
numpy oracle and the model's unfused code; gated RMSNorm (and its fp8 output) against the layer code.

Run: python -m pytest -q tests/kernels/test_fused_norm.py

Tolerances: float32 differs from the oracle by rounding order only (online softmax vs softmax-then-sum;
sums of <= 2048 terms), ~1e-6 relative, bound 1e-5. In bf16 the mix and the normed output are each
rounded once to bf16 (2^-9 relative), so elementwise agreement with the unfused bf16 code is within one
bf16 ulp of the result (an fp32 difference at a rounding boundary flips at most one ulp).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import backend
from k3jax.attnres import attn_res_mix, attn_res_mix_norm
from k3jax.layers import gated_rms_norm as gated_rms_norm_layer
from k3jax.layers import rms_norm
from pallas_kernels import fused_norm

EPS = 1e-5


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def numpy_mix_norm(sources, proj, norm, out_weight, eps=EPS):
    v = np.stack([np.asarray(s, np.float64) for s in sources], axis=-2)  # [..., S, D]
    keys = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
    logits = keys @ (np.asarray(norm, np.float64) * np.asarray(proj, np.float64))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    mix = np.einsum("...s,...sd->...d", p, v)
    normed = mix / np.sqrt(np.mean(mix * mix, axis=-1, keepdims=True) + eps) * np.asarray(out_weight, np.float64)
    return mix, normed


def make_sources(rng, shape, num_sources, dtype):
    d = shape[-1]
    # sources of different scales, as the bank's block sums grow with depth
    sources = [jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.3, 4.0), dtype) for _ in range(num_sources)]
    proj = jnp.asarray(rng.standard_normal(d) * 0.2, dtype)
    norm = jnp.asarray(1 + 0.2 * rng.standard_normal(d), dtype)
    out_weight = jnp.asarray(1 + 0.2 * rng.standard_normal(d), dtype)
    return sources, proj, norm, out_weight


@pytest.mark.parametrize("shape,num_sources", [((3, 5, 72), 4), ((7, 2048), 9), ((1, 40), 1)])
def test_attn_res_mix_norm_fp32_matches_float64(shape, num_sources):
    """Odd row counts, a non-power-of-two width, K3's final 9-source mix over two 1024-wide chunks, and the
    single-source case (softmax weight exactly 1)."""
    rng = np.random.default_rng(num_sources)
    sources, proj, norm, out_weight = make_sources(rng, shape, num_sources, jnp.float32)
    mix, normed = fused_norm.attn_res_mix_norm(sources, proj, norm, out_weight, EPS, with_mix=True, interpret=True)
    want_mix, want_normed = numpy_mix_norm(sources, proj, norm, out_weight)
    assert mix.shape == normed.shape == shape
    assert rel(mix, want_mix) < 1e-5 and rel(normed, want_normed) < 1e-5
    ref_mix, ref_normed = fused_norm.attn_res_mix_norm_reference(sources, proj, norm, out_weight, EPS)
    assert rel(ref_mix, want_mix) < 1e-5 and rel(ref_normed, want_normed) < 1e-5


def test_attn_res_mix_norm_bf16_within_one_ulp_of_unfused_code():
    rng = np.random.default_rng(7)
    sources, proj, norm, out_weight = make_sources(rng, (2, 9, 256), 5, jnp.bfloat16)
    mix, normed = fused_norm.attn_res_mix_norm(sources, proj, norm, out_weight, EPS, with_mix=True, interpret=True)
    want_mix = attn_res_mix(sources, proj, norm, EPS)
    want_normed = rms_norm(want_mix, out_weight, EPS)
    assert mix.dtype == normed.dtype == jnp.bfloat16
    for got, want in ((mix, want_mix), (normed, want_normed)):
        g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
        ulp = np.abs(np.spacing(w.astype(jnp.bfloat16).astype(np.float32), dtype=np.float32)) * 2.0**16  # bf16 ulp
        assert (np.abs(g - w) <= ulp + 1e-30).all()
        assert (g == w).mean() > 0.95  # most elements are bit-identical
    no_mix, normed_only = fused_norm.attn_res_mix_norm(sources, proj, norm, out_weight, EPS, interpret=True)
    assert no_mix is None
    np.testing.assert_array_equal(np.asarray(normed_only, np.float32), np.asarray(normed, np.float32))


def test_registered_op_backends():
    rng = np.random.default_rng(8)
    sources, proj, norm, out_weight = make_sources(rng, (5, 48), 3, jnp.float32)
    ref_mix, ref_normed = attn_res_mix_norm(sources, proj, norm, out_weight, EPS)
    # the reference registration is the unfused model code, bit for bit
    np.testing.assert_array_equal(ref_mix, attn_res_mix(sources, proj, norm, EPS))
    np.testing.assert_array_equal(ref_normed, rms_norm(ref_mix, out_weight, EPS))
    mix, normed = attn_res_mix_norm(sources, proj, norm, out_weight, EPS, with_mix=True, backend_name="interpret")
    assert rel(mix, ref_mix) < 1e-5 and rel(normed, ref_normed) < 1e-5
    x, g = sources[0].reshape(5, 3, 16), sources[1].reshape(5, 3, 16)
    got = backend.get("gated_rms_norm", "interpret")(x, g, proj[:16], EPS)
    assert rel(got, backend.get("gated_rms_norm", "reference")(x, g, proj[:16], EPS)) < 1e-6


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gated_rms_norm_matches_layer_code(dtype):
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((7, 3, 128)) * 3, dtype)  # 21 rows: odd, so one row per program
    gate = jnp.asarray(rng.standard_normal((7, 3, 128)) * 2, dtype)
    weight = jnp.asarray(1 + 0.3 * rng.standard_normal(128), dtype)
    got = fused_norm.gated_rms_norm(x, gate, weight, EPS, interpret=True)
    want = gated_rms_norm_layer(x, gate, weight, EPS)
    assert got.dtype == dtype
    # fp32 math in both; only the final cast can differ, by one ulp at a rounding boundary
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-6 if dtype == jnp.float32 else 2**-8, atol=1e-6)
    np.testing.assert_array_equal(fused_norm.gated_rms_norm_reference(x, gate, weight, EPS), want)


def test_gated_rms_norm_fp8_output():
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((12, 64)) * rng.uniform(0.01, 50, (12, 1)), jnp.float32)  # rows of very different scale
    gate = jnp.asarray(rng.standard_normal((12, 64)), jnp.float32)
    weight = jnp.asarray(1 + 0.3 * rng.standard_normal(64), jnp.float32)
    q, scale = fused_norm.gated_rms_norm(x, gate, weight, EPS, fp8=True, interpret=True)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (12,)
    y = np.asarray(gated_rms_norm_layer(x, gate, weight, EPS), np.float64)
    np.testing.assert_allclose(scale, np.abs(y).max(-1) / fused_norm.FP8_MAX, rtol=1e-6)
    deq = np.asarray(q, np.float64) * np.asarray(scale, np.float64)[:, None]
    # e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative for normal values, and within
    # half the smallest subnormal step (2^-10 * scale) below 2^-6 * scale
    assert (np.abs(deq - y) <= np.maximum(np.abs(y) * 2.0**-4, 2.0**-10 * np.asarray(scale)[:, None]) * 1.0001).all()
    assert np.abs(np.asarray(q, np.float32)).max() == fused_norm.FP8_MAX  # each row's amax maps to 448
    q_ref, scale_ref = fused_norm.gated_rms_norm_reference(x, gate, weight, EPS, fp8=True)
    np.testing.assert_allclose(scale, scale_ref, rtol=1e-6)
    assert (np.asarray(q, np.float32) == np.asarray(q_ref, np.float32)).mean() > 0.99


def test_bad_inputs_raise():
    x = jnp.ones((4, 16))
    with pytest.raises(ValueError, match="weight must be"):
        fused_norm.gated_rms_norm(x, x, jnp.ones(8), EPS, interpret=True)
    with pytest.raises(ValueError, match="one shape"):
        fused_norm.gated_rms_norm(x, x[:, :8], jnp.ones(16), EPS, interpret=True)
    with pytest.raises(ValueError, match="share shape"):
        fused_norm.attn_res_mix_norm([x, x[:2]], jnp.ones(16), jnp.ones(16), jnp.ones(16), EPS, interpret=True)
    with pytest.raises(ValueError, match="at least one"):
        fused_norm.attn_res_mix_norm([], jnp.ones(16), jnp.ones(16), jnp.ones(16), EPS, interpret=True)
    with pytest.raises(ValueError, match="block_rows"):
        fused_norm.attn_res_mix_norm([x, x], jnp.ones(16), jnp.ones(16), jnp.ones(16), EPS, block_rows=3,
                                     interpret=True)


def test_tiling_rule():
    """Rows per program: the register budget caps them (8192 fp32 values), and small row counts (decode
    batches) keep at least MIN_PROGRAMS programs where they can -- one row each below that."""
    tiling = lambda n, d: fused_norm._tiling(n, d, interpret=False)[0]
    assert tiling(64, 2048) == 1  # k3-small decode, B64: 64 programs, not 16
    assert tiling(64, 7168) == 1  # K3 decode
    assert tiling(8192, 2048) == 4  # prefill: the register budget, as before
    assert tiling(8192, 7168) == 1
    assert tiling(64 * 16, 128) == 2  # gated norm over 16 heads of a decode batch: 512 programs
    assert tiling(8192 * 96, 128) == 64
    assert tiling(6, 40) == 1


@pytest.mark.parametrize("block_rows", [1, 2, 6])
def test_attn_res_mix_norm_block_rows_agree(block_rows):
    """Every rows-per-program split of 12 odd-width rows gives the default's result bit for bit (rows are
    independent; the per-row arithmetic is the same)."""
    rng = np.random.default_rng(11)
    sources, proj, norm, out_weight = make_sources(rng, (12, 72), 3, jnp.float32)
    want = fused_norm.attn_res_mix_norm(sources, proj, norm, out_weight, EPS, with_mix=True, interpret=True)
    got = fused_norm.attn_res_mix_norm(sources, proj, norm, out_weight, EPS, with_mix=True, interpret=True,
                                       block_rows=block_rows)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    want_mix, want_normed = numpy_mix_norm(sources, proj, norm, out_weight)
    assert rel(got[0], want_mix) < 1e-5 and rel(got[1], want_normed) < 1e-5


@pytest.mark.parametrize("dtype,with_mix", [(jnp.bfloat16, False), (jnp.float32, True)])
def test_attn_res_mix_norm_with_addend_equals_adding_first(dtype, with_mix):
    """addend (the decoder's pending residual add): the kernel's sum is bit-identical to the unfused add in the
    sources' dtype, and mix / normed are exactly what the kernel gives for the pre-added sources; a wrong addend
    shape is refused."""
    rng = np.random.default_rng(3)
    sources, proj, norm, out_weight = make_sources(rng, (5, 3, 2048), 4, dtype)
    addend = jnp.asarray(rng.standard_normal((5, 3, 2048)) * 2.0, dtype)
    mix, normed, summed = fused_norm.attn_res_mix_norm(sources, proj, norm, out_weight, EPS, with_mix=with_mix,
                                                       addend=addend, interpret=True)
    want_sum = sources[-1] + addend
    np.testing.assert_array_equal(np.asarray(summed, np.float32), np.asarray(want_sum, np.float32))
    want_mix, want_normed = fused_norm.attn_res_mix_norm(sources[:-1] + [want_sum], proj, norm, out_weight, EPS,
                                                         with_mix=with_mix, interpret=True)
    np.testing.assert_array_equal(np.asarray(normed, np.float32), np.asarray(want_normed, np.float32))
    assert (mix is None) == (not with_mix)
    if with_mix:
        np.testing.assert_array_equal(np.asarray(mix), np.asarray(want_mix))
    with pytest.raises(ValueError, match="addend"):
        fused_norm.attn_res_mix_norm(sources, proj, norm, out_weight, EPS, addend=addend[:, :2], interpret=True)
