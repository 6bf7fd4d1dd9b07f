"""KDA chunk solve kernel (`kda_chunk_solve`: L / Aqk + block inverse) in interpret mode against its
plain-jnp reference (pairwise masked decays + triangular solve), on fresh random chunks.

Run: python -m pytest -q tests/kernels/test_kda_chunk_solve.py
Inputs as stage 1 makes them: L2-normalised k, q normalised and scaled by K^-1/2, beta = sigmoid(logits),
per-token log decay g = -5 sigmoid(z) (K3's bounded gate at its lowest bound, so diagonal-block factors
reach up to e^80), G its in-chunk cumsum; the last chunk is ragged (rows past its length are padding:
q = k = beta = g = 0, G constant).
Tolerances: fp32 -> IEEE fp32 on both sides; they differ only in how e^(G_i - G_j) is rounded (two
factors vs one exp of a difference) and in the inverse's summation order: measured <= 1.3e-7 relative
per chunk, so 1e-5; a wrong mask, sub-block reference or inverse block gives O(1e-1) or more. bf16: the
factored operands are rounded to bf16 (4e-3 per operand) before the dots, as in the XLA stage: measured
3.3e-3, so 2e-2 (the bar of the bf16 kda_chunk tests).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda_chunk_solve import kda_chunk_solve, kda_chunk_solve_reference
from pallas_kernels.kda_common import CHUNK


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def chunk_inputs(seed, h, num_chunks, dk, last_len, dtype):
    rng = np.random.default_rng(seed)
    shape = (h, num_chunks, CHUNK, dk)
    q, k, z = (rng.standard_normal(shape) for _ in range(3))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    g = -5.0 / (1.0 + np.exp(-z))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(shape[:3])))
    pad = np.arange(CHUNK) >= last_len  # padding rows of the last chunk
    for x in (q, k, g):
        x[:, -1, pad] = 0.0
    beta[:, -1, pad] = 0.0
    f32 = lambda x: jnp.asarray(x.astype(np.float32))
    return f32(q).astype(dtype), f32(k).astype(dtype), f32(np.cumsum(g, axis=2)), f32(beta)


@pytest.mark.parametrize("dtype,dk,block_k,tol", [(jnp.float32, 32, 16, 1e-5), (jnp.bfloat16, 16, 32, 2e-2)])
def test_solve_matches_reference(dtype, dk, block_k, tol):
    """Odd chunk count, a ragged last chunk, K accumulated over two slices (fp32 case) or one (bf16)."""
    q, k, cum, beta = chunk_inputs(21, h=2, num_chunks=3, dk=dk, last_len=37, dtype=dtype)
    a_beta, aqk = kda_chunk_solve(q, k, cum, beta, block_k=block_k, interpret=True)
    ra_beta, raqk = kda_chunk_solve_reference(q, k, cum, beta)
    assert a_beta.dtype == dtype and aqk.dtype == dtype and a_beta.shape == (2, 3, CHUNK, CHUNK)
    above = np.triu(np.ones((CHUNK, CHUNK), bool), 1)
    for out in (a_beta, aqk):  # strictly upper blocks and in-block entries are stored as exact zeros
        assert not np.any(np.asarray(out, np.float32)[..., above])
    for hh in range(2):  # per head and chunk, so a wrong block in one chunk cannot hide
        for c in range(3):
            assert rel(a_beta[hh, c], ra_beta[hh, c]) < tol, (hh, c)
            assert rel(aqk[hh, c], raqk[hh, c]) < tol, (hh, c)
    # padding rows / columns of the ragged chunk: beta = 0 there, so A diag(beta) has zero columns
    assert not np.any(np.asarray(a_beta, np.float32)[:, -1][:, :, 37:])
    if dtype == jnp.float32:  # the kernel's A = A diag(beta) / beta is the inverse of I + L (fp64 L)
        kk, g, b = (np.asarray(x, np.float64)[0, 0] for x in (k, cum, beta))
        rows = np.arange(CHUNK)
        diff = np.where((rows[:, None] > rows[None, :])[..., None], g[:, None, :] - g[None, :, :], -np.inf)
        lower = b[:, None] * np.einsum("ik,jk,ijk->ij", kk, kk, np.exp(diff))
        a = np.asarray(a_beta, np.float64)[0, 0] / b[None, :]
        np.testing.assert_allclose(a @ (np.eye(CHUNK) + lower), np.eye(CHUNK), atol=1e-5)


def test_solve_bad_arguments_raise():
    q, k, cum, beta = chunk_inputs(23, h=1, num_chunks=1, dk=16, last_len=5, dtype=jnp.float32)
    with pytest.raises(ValueError, match="chunk layout"):
        kda_chunk_solve(q[:, :, :32], k[:, :, :32], cum[:, :, :32], beta[:, :, :32], interpret=True)
    with pytest.raises(ValueError, match="share a stored dtype"):
        kda_chunk_solve(q, k.astype(jnp.bfloat16), cum, beta, interpret=True)
    with pytest.raises(ValueError, match="float32"):
        kda_chunk_solve(q, k, cum.astype(jnp.bfloat16), beta, interpret=True)
    with pytest.raises(ValueError, match="beta must be"):
        kda_chunk_solve(q, k, cum, beta[..., :8], interpret=True)
    with pytest.raises(ValueError, match="block_k"):
        kda_chunk_solve(q, k, cum, beta, block_k=24, interpret=True)
