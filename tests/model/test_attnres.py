"""Block AttnRes: the mix formula and K3's layer bookkeeping against an independent sub-layer form.

Run: python -m pytest tests/model/test_attnres.py -q
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax.model as model
from k3jax.attnres import attn_res_mix
from k3jax.config import load_config


def rms(x, w, eps=1e-5):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def np_mix(sources, proj, norm, eps=1e-5):
    v = np.stack(sources, -2)
    scores = (v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * (norm * proj)).sum(-1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p[..., None] * v).sum(-2)


def test_mix_formula():
    rng = np.random.default_rng(0)
    srcs = [rng.standard_normal((3, 4, 17)) * s for s in (1, 5, 0.1, 2)]
    proj, norm = rng.standard_normal(17), rng.uniform(0.5, 2, 17)
    got = attn_res_mix([jnp.asarray(s, jnp.float32) for s in srcs], jnp.asarray(proj), jnp.asarray(norm), 1e-5)
    np.testing.assert_allclose(got, np_mix(srcs, proj, norm), rtol=1e-5, atol=1e-6)
    # one source: the mix is that source exactly
    one = attn_res_mix([jnp.asarray(srcs[1], jnp.float32)], jnp.asarray(proj), jnp.asarray(norm), 1e-5)
    np.testing.assert_allclose(one, srcs[1], rtol=1e-6)


def fake_stack(cfg, d, rng):
    """Params with random norms, pseudo-queries and one random matrix per sub-layer (mixer and FFN)."""
    lay = lambda: {
        "input_layernorm": rng.uniform(0.5, 1.5, d), "post_attention_layernorm": rng.uniform(0.5, 1.5, d),
        "self_attention_res_norm": rng.uniform(0.5, 1.5, d), "self_attention_res_proj": rng.standard_normal(d),
        "mlp_res_norm": rng.uniform(0.5, 1.5, d), "mlp_res_proj": rng.standard_normal(d),
        "attn": {"w": rng.standard_normal((d, d)) / np.sqrt(d)}, "mlp": {"w": rng.standard_normal((d, d)) / np.sqrt(d)},
    }
    return {"layers": [lay() for _ in range(cfg.num_layers)], "norm": rng.uniform(0.5, 1.5, d),
            "output_attn_res_norm": rng.uniform(0.5, 1.5, d), "output_attn_res_proj": rng.standard_normal(d)}


def sublayer_oracle(params, cfg, h):
    """fla-style bookkeeping over 2L sub-layers with block size S = 2B sub-layers (k3-model.md §6)."""
    s_block = 2 * cfg.attn_res_block_size
    sources, partial = [h], None
    for i in range(2 * cfg.num_layers):
        lp = params["layers"][i // 2]
        kind = "self_attention_res" if i % 2 == 0 else "mlp_res"
        inp = np_mix(sources + ([partial] if partial is not None else []), lp[f"{kind}_proj"], lp[f"{kind}_norm"])
        if i % s_block == 0 and i > 0:
            sources.append(partial)
            partial = None
        norm = lp["input_layernorm"] if i % 2 == 0 else lp["post_attention_layernorm"]
        out = np.tanh(rms(inp, norm) @ (lp["attn"] if i % 2 == 0 else lp["mlp"])["w"])
        partial = out if partial is None else partial + out
    final = np_mix(sources + [partial], params["output_attn_res_proj"], params["output_attn_res_norm"])
    return rms(final, params["norm"]), len(sources) + 1


@pytest.mark.parametrize("preset,layers,block", [("k3-tiny", None, None), ("k3-tiny", 13, 3), ("k3", None, None)])
def test_bookkeeping_matches_sublayer_form(monkeypatch, preset, layers, block):
    cfg = load_config(preset)
    if layers:
        cfg = cfg.replace(num_layers=layers, attn_res_block_size=block, mla_layers=(3, 7, 11, 12))
    d = 8
    rng = np.random.default_rng(1)
    params = fake_stack(cfg, d, rng)
    h = rng.standard_normal((2, 3, d))
    mix_sizes = []
    real_mix = model.attn_res_mix_norm  # the decoder's mix points (mix + the following pre-norm)

    def counting_mix(sources, *args, **kwargs):
        mix_sizes.append(len(sources))
        return real_mix(sources, *args, **kwargs)

    monkeypatch.setattr(model, "attn_res_mix_norm", counting_mix)
    monkeypatch.setattr(model, "ffn", lambda p, x, cfg, backend_name: jnp.tanh(x @ p["w"]))
    to_j = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t)
    got = model.decoder(to_j(params), cfg, jnp.asarray(h, jnp.float32), lambda l, p, x: jnp.tanh(x @ p["w"]), "reference")[0]
    want, final_sources = sublayer_oracle(params, cfg, h)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert mix_sizes[-1] == final_sources
    if preset == "k3":  # bank: embedding + 7 full blocks; final mix over those 8 + the partial block
        assert final_sources == 9
        assert len(mix_sizes) == 2 * 93 - 1 + 1  # no attention-side mix at layer 0 (empty bank)
    if preset == "k3-tiny" and layers is None:  # bank at layers 0, 4, 8 -> 3 entries + partial
        assert final_sources == 4
