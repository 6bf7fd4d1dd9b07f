"""GPU-only check of the router selection kernel (pallas_kernels/router_topk.py) compiled through the Triton
lowering, against its jnp reference on the same device (skipped without a GPU).

Run on a GPU host: K3JAX_TEST_GPU=1 python -m pytest -q -n 0 -m gpu tests/gpu/test_router_topk_gpu.py

Ids must match except where two biased scores are within float rounding of each other (Triton's and XLA's sigmoid
may differ by an ulp): the test draws well-separated logits so that no such near-tie exists; weights to 1e-5
relative (the renormalising sum's order and the sigmoid's last bit).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.router_topk import router_topk, router_topk_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,e,k,score", [(64, 192, 8, "sigmoid"), (1, 192, 8, "sigmoid"), (100, 896, 16, "sigmoid"),
                                         (33, 56, 4, "softmax")])
def test_kernel_matches_reference_on_gpu(n, e, k, score):
    rng = np.random.default_rng(n * e + k)
    # distinct logits on a coarse grid, zero bias: the selection order has gaps far above float rounding
    logits = np.stack([rng.permutation(e) for _ in range(n)]).astype(np.float32) * (8.0 / e) - 4.0
    bias = np.zeros(e, np.float32)
    kw = dict(top_k=k, score=score, renormalize=True, scaling=2.446)
    ids, weights = jax.jit(lambda a, b: router_topk(a, b, **kw))(jnp.asarray(logits), jnp.asarray(bias))
    want_ids, want_w = jax.jit(lambda a, b: router_topk_reference(a, b, **kw))(jnp.asarray(logits), jnp.asarray(bias))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-5, atol=1e-6)
