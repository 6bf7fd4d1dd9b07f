"""Router invariants and the grouped (sort-by-expert) MoE against a per-token numpy loop.

Run: python -m pytest tests/model/test_moe.py -q
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers import glu_activation
from k3jax.moe import grouped_experts_reference, moe, route
from k3jax.params import init_params
from k3jax.testing import k3_tiny, kimi_linear_tiny


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_router_bias_selects_but_does_not_weigh():
    cfg = k3_tiny().replace(num_experts=9, num_experts_per_tok=3, routed_scaling_factor=1.7)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((40, cfg.hidden_size)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((cfg.hidden_size, 9)) * 0.3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(9) * 0.5, jnp.float32)
    ids, weights = route(w, bias, x, cfg)
    scores = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(w, np.float64))))
    biased = scores + np.asarray(bias)
    for n in range(40):
        chosen = set(np.asarray(ids[n]).tolist())
        assert chosen == set(np.argsort(-biased[n])[:3].tolist())
        sel = scores[n, np.asarray(ids[n])]
        np.testing.assert_allclose(weights[n], sel / sel.sum() * 1.7, rtol=1e-5)
    # the bias changes which experts win somewhere in this batch (else the test proves nothing)
    ids_nobias, _ = route(w, jnp.zeros(9), x, cfg)
    assert (np.sort(ids, 1) != np.sort(ids_nobias, 1)).any()


def test_router_without_renormalisation_and_softmax():
    cfg = k3_tiny().replace(moe_renormalize=False, routed_scaling_factor=2.0, router_score="softmax")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((5, cfg.hidden_size)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((cfg.hidden_size, cfg.num_experts)), jnp.float32)
    ids, weights = route(w, jnp.zeros(cfg.num_experts), x, cfg)
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    np.testing.assert_allclose(weights, np.take_along_axis(probs, np.asarray(ids), 1) * 2.0, rtol=1e-5)


def test_group_limited_routing_stays_in_top_groups():
    cfg = k3_tiny().replace(num_experts=12, num_experts_per_tok=4, num_expert_group=4, topk_group=2)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((30, cfg.hidden_size)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((cfg.hidden_size, 12)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(12) * 0.1, jnp.float32)
    ids, _ = route(w, bias, x, cfg)
    biased = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(w, np.float64)))) + np.asarray(bias)
    for n in range(30):
        g = biased[n].reshape(4, 3)
        top_groups = np.argsort(-np.sort(g, 1)[:, -2:].sum(1))[:2]
        allowed = np.concatenate([np.arange(3 * i, 3 * i + 3) for i in top_groups])
        masked = np.full(12, -np.inf)
        masked[allowed] = biased[n, allowed]
        assert set(np.asarray(ids[n]).tolist()) == set(np.argsort(-masked)[:4].tolist())


def loop_experts(x, ids, weights, experts, cfg):
    """Per token, per selected expert, in float64: sum_i w_i * down(act(gate z, up z))."""
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    e = {k: np.asarray(v, np.float64) for k, v in experts.items()}
    for n in range(x.shape[0]):
        for j, ex in enumerate(np.asarray(ids[n])):
            h = np.asarray(glu_activation(jnp.asarray(x[n] @ e["gate"][ex]), jnp.asarray(x[n] @ e["up"][ex]), cfg), np.float64)
            out[n] += float(weights[n, j]) * (h @ e["down"][ex])
    return out


@pytest.mark.parametrize("cfg", [k3_tiny(), kimi_linear_tiny()], ids=lambda c: c.name)
@pytest.mark.parametrize("pattern", ["random", "one_hot_expert", "empty_experts"])
def test_grouped_experts_equal_token_loop(cfg, pattern):
    rng = np.random.default_rng(3)
    n, k, e = 23, cfg.num_experts_per_tok, cfg.num_experts
    experts = init_params(cfg, jax.random.key(4))["layers"][1]["mlp"]["experts"]
    x = jnp.asarray(rng.standard_normal((n, cfg.expert_width)), jnp.float32)
    if pattern == "random":
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    elif pattern == "one_hot_expert":  # every token's first choice is expert 2
        ids = np.stack([np.concatenate([[2], rng.choice([i for i in range(e) if i != 2], k - 1, replace=False)]) for _ in range(n)])
    else:  # only experts 0..k are ever used; the rest have empty groups
        ids = np.stack([rng.permutation(k + 1)[:k] for _ in range(n)])
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (n, k)), jnp.float32)
    got = grouped_experts_reference(x, jnp.asarray(ids, jnp.int32), weights, experts, cfg)
    assert rel(got, loop_experts(x, ids, weights, experts, cfg)) < 1e-5


@pytest.mark.parametrize("cfg", [k3_tiny(), kimi_linear_tiny()], ids=lambda c: c.name)
def test_latent_moe_block_wiring(cfg):
    """moe() = up(RMSNorm(sum_i w_i E_i(down x))) + shared(x): router and shared see the full width."""
    p = init_params(cfg, jax.random.key(5))["layers"][2]["mlp"]
    x = jax.random.normal(jax.random.key(6), (3, 5, cfg.hidden_size))
    got = moe(p, x, cfg)
    xf = np.asarray(x, np.float64).reshape(15, -1)
    ids, weights = route(p["router"], p["router_bias"], jnp.asarray(xf, jnp.float32), cfg)
    z = xf @ np.asarray(p["latent_down"], np.float64) if cfg.moe_latent_size else xf
    y = loop_experts(z, ids, weights, p["experts"], cfg)
    if cfg.moe_latent_size:
        y = y / np.sqrt((y * y).mean(-1, keepdims=True) + cfg.rms_norm_eps) * np.asarray(p["latent_norm"])
        y = y @ np.asarray(p["latent_up"], np.float64)
    sh = {k: np.asarray(v, np.float64) for k, v in p["shared"].items()}
    act = np.asarray(glu_activation(jnp.asarray(xf @ sh["gate"]), jnp.asarray(xf @ sh["up"]), cfg), np.float64)
    y = y + act @ sh["down"]
    assert rel(got.reshape(15, -1), y) < 1e-5


def test_situ_and_swiglu():
    rng = np.random.default_rng(7)
    g, u = rng.standard_normal(50) * 10, rng.standard_normal(50) * 40
    situ = (4 * np.tanh(g / 4) / (1 + np.exp(-g))) * (25 * np.tanh(u / 25))
    np.testing.assert_allclose(glu_activation(jnp.asarray(g), jnp.asarray(u), k3_tiny()), situ, rtol=1e-5)
    swiglu = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(glu_activation(jnp.asarray(g), jnp.asarray(u), kimi_linear_tiny()), swiglu, rtol=1e-5)
