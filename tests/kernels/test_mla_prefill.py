"""MLA prefill kernel (Pallas interpret mode) against the plain-jnp reference.

Run: python -m pytest -q tests/kernels/test_mla_prefill.py

A chunk of new tokens attends causally to [cached prefix + itself], all read through shuffled pages.
Prefixes are the issue's ragged set 1, 63, 513, 4097 (prefix-cache hits of any length: none of them is
page aligned, so the chunk starts mid-page) plus 0 (a fresh prompt); chunk lengths are ragged too (the
batch's T is padded and padding rows carry positions past the valid ones, as the model passes them).
Small heads and widths (H = 3, C = 32, R = 16): the point is sequence length and paging.

Tolerance: as tests/kernels/test_mla_decode.py -- fp32 reference on the same bf16 queries and the same
(dequantised) cache values; the kernel rounds the probabilities to bf16 before P @ C (<= 2 * 2^-9 relative
per query row when a few keys dominate). Asserted per request < 5e-3; a mask or page error is O(1e-1).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.testing import eager_ops_on_argument, shuffled_page_tables
from pallas_kernels import mla_decode as md
from pallas_kernels import mla_prefill as mp

HEADS, C, R, PAGE = 3, 32, 16, 16
PREFIXES = np.array([0, 1, 63, 513, 4097])
CHUNK = np.array([29, 7, 29, 1, 18])  # valid new tokens per request; T = 29
SCALE = (C + R) ** -0.5
TOL = 5e-3


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_prefill_after_prefix_hits_matches_reference(kv_dtype):
    rng = np.random.default_rng(5)
    b, t = len(PREFIXES), CHUNK.max()
    max_pages = -(-(PREFIXES + t).max() // PAGE)
    num_pages = b * max_pages + 3
    table = jnp.asarray(shuffled_page_tables(rng, b, max_pages, num_pages))
    latents = rng.standard_normal((num_pages, PAGE, C + R)).astype(np.float32)
    latents[..., C:] *= 3.0
    if kv_dtype == jnp.float8_e4m3fn:
        kv, scales = md.quantize_latents_fp8(jnp.asarray(latents))
    else:
        kv, scales = jnp.asarray(latents, kv_dtype), None
    q_latent = jnp.asarray(rng.standard_normal((b, t, HEADS, C)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((b, t, HEADS, R)), jnp.bfloat16)
    positions = jnp.asarray(PREFIXES[:, None] + np.arange(t)[None], jnp.int32)
    want = mp.mla_prefill_reference(q_latent, q_pe, kv, table, positions, kv_lora_rank=C, scale=SCALE,
                                    kv_scales=scales)
    got = mp.mla_prefill(q_latent, q_pe, kv, table, positions, kv_lora_rank=C, scale=SCALE, kv_scales=scales,
                         block_rows=32, interpret=True)
    assert got.shape == (b, t, HEADS, C) and got.dtype == jnp.float32
    for r in range(b):
        valid = CHUNK[r]
        assert rel(got[r, :valid], want[r, :valid]) < TOL, r
        # the first new token of a fresh prompt sees only itself: its output is its own latent c
        if PREFIXES[r] == 0:
            own_c = md.dequantize_pages(kv, scales)[table[r, 0], 0, :C]
            np.testing.assert_allclose(got[r, 0], np.broadcast_to(own_c, (HEADS, C)), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_eager_call_hands_the_pool_to_jit_untouched(kv_dtype):
    """As the decode kernel: the pool and its scales reach the jitted call without an eager copy."""
    rng = np.random.default_rng(8)
    table = jnp.asarray(shuffled_page_tables(rng, 2, 4, 11))
    kv, scales = md.quantize_latents_fp8(jnp.asarray(rng.standard_normal((11, PAGE, C + R)), jnp.float32))
    if kv_dtype == jnp.bfloat16:
        kv, scales = kv.astype(jnp.bfloat16), None
    q_latent = jnp.asarray(rng.standard_normal((2, 5, HEADS, C)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((2, 5, HEADS, R)), jnp.bfloat16)
    positions = jnp.asarray(np.array([[3], [40]]) + np.arange(5)[None], jnp.int32)
    call = lambda pool, pool_scales: mp.mla_prefill(q_latent, q_pe, pool, table, positions, kv_lora_rank=C,
                                                    scale=SCALE, kv_scales=pool_scales, interpret=True)
    assert eager_ops_on_argument(call, (kv, scales), 0) == []
    if scales is not None:
        assert eager_ops_on_argument(call, (kv, scales), 1) == []


def test_prefill_rejects_bad_inputs():
    q = jnp.ones((1, 4, 2, C), jnp.bfloat16)
    q_pe = jnp.ones((1, 4, 2, R), jnp.bfloat16)
    kv = jnp.ones((4, PAGE, C + R), jnp.bfloat16)
    table = jnp.zeros((1, 2), jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    with pytest.raises(ValueError, match="page_table"):
        mp.mla_prefill(q, q_pe, kv, table[0], positions, kv_lora_rank=C, scale=SCALE, interpret=True)
    with pytest.raises(ValueError, match="block_kv"):
        mp.mla_prefill(q, q_pe, kv, table, positions, kv_lora_rank=C, scale=SCALE, block_kv=8, interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        mp.mla_prefill(q, q_pe, kv.astype(jnp.int8), table, positions, kv_lora_rank=C, scale=SCALE, interpret=True)
