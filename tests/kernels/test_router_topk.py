"""The router selection kernel (pallas_kernels/router_topk.py) in Pallas interpret mode against its plain-JAX
reference, and the model's "moe_route" op on it.

Selection is exact (ids equal: the kernel computes the same fp32 scores and picks the max of each round, the
reference's sort-based top_k orders them the same way); weights differ only in the order of the renormalising
sum's adds, so 1e-6 relative (a few fp32 ulps) is the bar.

Run: python -m pytest -q tests/kernels/test_router_topk.py
"""

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import backend, moe
from k3jax.testing import k3_tiny
from pallas_kernels.router_topk import router_topk, router_topk_reference


@pytest.mark.parametrize("n,e,k,score,renormalize,scaling", [
    (64, 192, 8, "sigmoid", True, 2.446),   # k3-small's router at decode B64
    (37, 9, 3, "softmax", False, 1.0),      # ragged rows, odd expert count, softmax, no renormalisation
    (5, 896, 16, "sigmoid", True, 2.446),   # K3's router
    (1, 6, 1, "sigmoid", True, 1.0),        # one row, one expert each
])
def test_kernel_matches_reference(n, e, k, score, renormalize, scaling):
    rng = np.random.default_rng(n + e + k)
    logits = jnp.asarray(rng.standard_normal((n, e)) * 3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(e) * 0.5, jnp.float32)
    kw = dict(top_k=k, score=score, renormalize=renormalize, scaling=scaling)
    ids, weights = router_topk(logits, bias, interpret=True, **kw)
    want_ids, want_weights = router_topk_reference(logits, bias, **kw)
    assert ids.dtype == jnp.int32 and ids.shape == (n, k) and weights.shape == (n, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-6, atol=1e-7)
    assert len({tuple(sorted(r)) for r in np.asarray(ids).tolist()}) >= 1 and all(
        len(set(r)) == k for r in np.asarray(ids).tolist())  # k distinct experts per row
    if renormalize and k > 1:
        np.testing.assert_allclose(np.asarray(weights).sum(-1), scaling, rtol=1e-5)


def test_bias_steers_selection_not_weights_and_ties_go_to_the_lower_id():
    logits = jnp.zeros((3, 8), jnp.float32)  # every score 0.5: selection by bias, then by id
    bias = jnp.asarray([0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0], jnp.float32)
    ids, weights = router_topk(logits, bias, top_k=3, renormalize=False, interpret=True)
    assert np.asarray(ids).tolist() == [[2, 4, 0]] * 3  # biased pair first (lower id first), then the lowest id
    np.testing.assert_allclose(np.asarray(weights), 0.5)  # the unbiased scores
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(router_topk_reference(logits, bias, top_k=3)[0]))


def test_rejects_bad_arguments():
    logits, bias = jnp.ones((4, 6), jnp.float32), jnp.zeros(6, jnp.float32)
    with pytest.raises(ValueError, match="top_k"):
        router_topk(logits, bias, top_k=7, interpret=True)
    with pytest.raises(ValueError, match="bias"):
        router_topk(logits, bias[:5], top_k=2, interpret=True)
    with pytest.raises(ValueError, match="score"):
        router_topk(logits, bias, top_k=2, score="relu", interpret=True)
    with pytest.raises(ValueError, match="float"):
        router_topk(logits.astype(jnp.int32), bias, top_k=2, interpret=True)
    with pytest.raises(ValueError, match="block_rows"):
        router_topk(logits, bias, top_k=2, block_rows=3, interpret=True)


@pytest.mark.parametrize("block_rows", [1, 16])
def test_any_rows_per_program_gives_the_same_selection(block_rows):
    rng = np.random.default_rng(block_rows)
    logits = jnp.asarray(rng.standard_normal((21, 40)) * 2, jnp.float32)  # 21 rows: a ragged last block
    bias = jnp.asarray(rng.standard_normal(40) * 0.3, jnp.float32)
    ids, weights = router_topk(logits, bias, top_k=5, block_rows=block_rows, interpret=True)
    want_ids, want_weights = router_topk_reference(logits, bias, top_k=5)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-6, atol=1e-7)


def test_model_route_op_on_the_kernel_equals_the_reference():
    cfg = k3_tiny()
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((13, cfg.hidden_size)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((cfg.hidden_size, cfg.num_experts)) * 0.2, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(cfg.num_experts) * 0.1, jnp.float32)
    assert "interpret" in backend.implemented("moe_route")
    ref = moe.route(w, bias, x, cfg)
    ker = moe.route(w, bias, x, cfg, backend_name="interpret")
    np.testing.assert_array_equal(np.asarray(ker[0]), np.asarray(ref[0]))
    np.testing.assert_allclose(np.asarray(ker[1]), np.asarray(ref[1]), rtol=1e-6, atol=1e-7)
    # grouped routing (8 experts in 2 groups, 1 kept): the kernel op keeps the reference
    grouped = cfg.replace(num_experts=8, num_expert_group=2, topk_group=1)
    w8 = jnp.asarray(rng.standard_normal((cfg.hidden_size, 8)) * 0.2, jnp.float32)
    bias8 = jnp.asarray(rng.standard_normal(8) * 0.1, jnp.float32)
    got = moe.route(w8, bias8, x, grouped, backend_name="interpret")
    want = moe.route(w8, bias8, x, grouped)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert (np.asarray(got[0]) // 4 == np.asarray(got[0])[:, :1] // 4).all()  # one group per token
