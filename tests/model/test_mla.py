"""Gated MLA: absorbed over a shuffled paged cache = naive = a float64 numpy oracle.

Run: python -m pytest tests/model/test_mla.py -q
fp32 tolerance 1e-5 relative: the forms differ only in summation order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import mla
from k3jax.params import init_params
from k3jax.testing import k3_tiny, kimi_linear_tiny, shuffled_page_tables


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def mla_params(cfg, seed):
    return init_params(cfg, jax.random.key(seed))["layers"][cfg.mla_layers[0]]["attn"]


def numpy_oracle(p, x, cfg):
    """float64 naive gated MLA straight from k3-model.md §4."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    def rms(z, w, eps):
        return w * z / np.sqrt((z * z).mean(-1, keepdims=True) + eps)
    h, n, r, vd, c = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q = rms(x @ p["q_a"], p["q_a_norm"], 1e-6) @ p["q_b"] if cfg.q_lora_rank else x @ p["q_proj"]
    b, t, _ = x.shape
    q = q.reshape(b, t, h, n + r)
    kv = x @ p["kv_a"]
    lat = rms(kv[..., :c], p["kv_a_norm"], 1e-6)
    kvb = (lat @ p["kv_b"]).reshape(b, t, h, n + vd)
    k = np.concatenate([kvb[..., :n], np.broadcast_to(kv[..., None, c:], (b, t, h, r))], -1)
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(n + r)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshd->bthd", pr, kvb[..., n:]).reshape(b, t, h * vd)
    if cfg.mla_output_gate:
        o = o / (1 + np.exp(-(x @ p["g_proj"])))
    return o @ p["o_proj"]


@pytest.mark.parametrize("cfg", [k3_tiny(), kimi_linear_tiny()], ids=lambda c: c.name)
def test_naive_matches_float64_oracle(cfg):
    p = mla_params(cfg, 0)
    x = jax.random.normal(jax.random.key(1), (2, 13, cfg.hidden_size))
    assert rel(mla.naive_attention(p, x, cfg), numpy_oracle(p, x, cfg)) < 1e-5


@pytest.mark.parametrize("cfg", [k3_tiny(), kimi_linear_tiny()], ids=lambda c: c.name)
@pytest.mark.parametrize("page_size", [1, 4, 5])
def test_absorbed_paged_equals_naive(cfg, page_size):
    """Prefill a prefix into shuffled pages, then the rest in ragged steps: outputs equal naive MLA."""
    rng = np.random.default_rng(page_size)
    p = mla_params(cfg, 2)
    b, t = 2, 17
    x = jax.random.normal(jax.random.key(3), (b, t, cfg.hidden_size))
    want = mla.naive_attention(p, x, cfg)
    max_pages = -(-t // page_size)
    pages = jnp.zeros((2, b * max_pages + 3, page_size, cfg.latent_cache_dim))  # 2 layers: write layer 1
    table = jnp.asarray(shuffled_page_tables(rng, b, max_pages, b * max_pages + 3))
    got, ctx = [], jnp.zeros(b, jnp.int32)
    for n in (6, 1, 7, 3):  # chunks of the sequence, same for both rows
        y, pages = mla.paged_attention(p, x[:, ctx[0] : ctx[0] + n], pages, 1, table, ctx, jnp.full(b, n), cfg)
        got.append(y)
        ctx = ctx + n
    assert rel(jnp.concatenate(got, 1), want) < 1e-5
    assert float(jnp.abs(pages[0]).max()) == 0.0  # the other layer's pages are untouched


def test_padding_rows_do_not_write_pages():
    cfg = k3_tiny()
    p = mla_params(cfg, 4)
    x = jax.random.normal(jax.random.key(5), (2, 6, cfg.hidden_size))
    pages = jnp.zeros((1, 8, 4, cfg.latent_cache_dim))
    table = jnp.array([[5, 2], [7, 1]], jnp.int32)
    _, pages = mla.paged_attention(p, x, pages, 0, table, jnp.array([0, 0]), jnp.array([6, 2]), cfg)
    written = np.abs(np.asarray(pages[0])).sum(-1) > 0  # [pages, slot]
    assert written[5].all() and written[2, :2].all() and not written[2, 2:].any()
    assert written[7, :2].all() and not written[7, 2:].any() and not written[1].any()
