"""GPU-only check of the decode-size dense GEMM (pallas_kernels/skinny_gemm.py) compiled through the Triton
lowering, at k3-small's serving shapes and decode row counts (skipped without a GPU).

Run on a GPU host: K3JAX_TEST_GPU=1 python -m pytest -q -n 0 -m gpu tests/gpu/test_skinny_gemm_gpu.py

Compared with layers.dense (XLA) on the same device: both accumulate in fp32 and round once to bf16, so they
differ by bf16 rounding (~4e-3 relative); bar 1e-2 relative (gpu.md's bf16 band).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers import dense
from pallas_kernels.skinny_gemm import default_config, skinny_matmul

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m", [1, 16, 64, 128])
@pytest.mark.parametrize("k,n", [(2048, 8336), (128, 2048), (2048, 2048), (768, 3072), (2048, 192),
                                 (8192, 2048), (2048, 163840)])
def test_default_tiling_matches_xla(m, k, n):
    kx, kw = jax.random.split(jax.random.key(m + k + n))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n)) * k**-0.5).astype(jnp.bfloat16)
    got = np.asarray(jax.jit(skinny_matmul)(x, w), np.float64)
    want = np.asarray(jax.jit(dense)(x, w), np.float64)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-2, (default_config(m, k, n), err)
