"""K3 building blocks vs independent public references (torch, fp32, CPU).

* KDA core: kda_recurrent_reference / kda_chunked_reference vs fla-core's naive_recurrent_kda /
  naive_chunk_kda and transformers' torch chunk / recurrent KDA. fla and transformers keep the state K-first
  [B, H, K, V]; ours is V-first [B, H, V, K] (K3's state_v_first) -- d_v != d_k here, so a transposition
  slip cannot hide. fla's naive refs take q, k already L2-normalised and beta post-sigmoid and apply
  scale = K^-1/2 themselves; ours take q pre-scaled.
* kda_gate, both forms (K3 lower bound, Kimi-Linear softplus) vs fla's naive gates and transformers'
  Glm5NextTextForgetGate / KimiLinearForgetGate; K3's zero-padded A_log [128] included.
* attn_res_mix vs fla naive_attnres (and its fused output-norm form).
* SiTU-GLU vs K3's public SituAndMul formula; the sigmoid-gated o_norm vs KimiLinearRMSNormGated.
* route vs KimiLinearTopkRouter (noaux_tc; plain and grouped top-k).
* Gated MLA (q_lora path + K3 output gate), naive and absorbed/paged, vs transformers KimiLinearAttention
  with sigmoid(x W_g) applied to o_proj's input.
* A whole KDA block (kda_mixer, chunked and recurrent) vs transformers' Glm5NextTextLinearAttention
  (lower-bound gate; output gate swapped for K3's full-rank one) and KimiLinearDeltaAttention.

Tolerances: both sides fp32; errors come from summation order only. Measured: KDA core 4e-7..1.9e-6, KDA
block 5e-7..1e-6, MLA 2e-7..3e-7, gates <=3e-8, AttnRes / SiTU / gated norm <=3e-7. So 2e-5 (1e-6 for the
elementwise pieces) leaves >=10x margin, while a formula difference moves results by >=1e-3 (e.g. the MLA
latent-norm eps 1e-5 instead of 1e-6: 3e-2 here, thanks to latents with RMS^2 ~ eps).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import kda, mla
from k3jax.attnres import attn_res_mix
from k3jax.layers import gated_rms_norm, glu_activation, l2_normalize, mlp, rms_norm
from k3jax.moe import route
from k3jax.testing import k3_tiny, shuffled_page_tables
from parity_util import rel, torch_refs

pytestmark = pytest.mark.slow

TOL = 2e-5
F32 = np.float32


@pytest.fixture(scope="module")
def run():
    return torch_refs()


def _rng(seed):
    return np.random.default_rng(seed)


def _randn(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(F32)


# ---------------------------------------------------------------------------------------------------------------
# KDA core
# ---------------------------------------------------------------------------------------------------------------

B, H, DK, DV = 2, 3, 15, 13


def _kda_inputs(seed, t, gate):
    rng = _rng(seed)
    cfg = k3_tiny().replace(kda_gate=gate, kda_num_heads=H, kda_head_dim=DK)
    z = _randn(rng, B, t, H, DK, scale=2.0)
    a_log = (np.log(rng.uniform(1, 16, H)) if gate == "softplus" else _randn(rng, H, scale=0.5)).astype(F32)
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), H * DK))
    dt_bias = (dt + np.log(-np.expm1(-dt))).astype(F32)
    g = np.asarray(kda.kda_gate(jnp.asarray(z), jnp.asarray(a_log), jnp.asarray(dt_bias), cfg))
    return {
        "q": _randn(rng, B, t, H, DK), "k": _randn(rng, B, t, H, DK), "v": _randn(rng, B, t, H, DV),
        "g": g.astype(F32), "beta": (1 / (1 + np.exp(-_randn(rng, B, t, H)))).astype(F32),
        "s0": _randn(rng, B, H, DK, DV, scale=0.3),
    }


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("t", [70, 128])
def test_kda_core_matches_fla_and_transformers(run, gate, t):
    x = _kda_inputs(3 if gate == "softplus" else 4, t, gate)
    ref = run("kda", x)
    q = l2_normalize(jnp.asarray(x["q"])) * DK**-0.5
    k = l2_normalize(jnp.asarray(x["k"]))
    args = (q, k, jnp.asarray(x["v"]), jnp.asarray(x["g"]), jnp.asarray(x["beta"]), jnp.asarray(x["s0"]).swapaxes(-1, -2))
    ours = {
        "recurrent": kda.kda_recurrent_reference(*args),
        "chunked": kda.kda_chunked_reference(*args),
    }
    names = ["fla_recurrent", "hf_chunk", "hf_recurrent"] + (["fla_chunk"] if t % 64 == 0 else [])
    for mode, (o, s) in ours.items():
        o, s_kfirst = np.asarray(o), np.asarray(s).swapaxes(-1, -2)
        for name in names:
            eo, es = rel(o, ref[f"{name}_o"]), rel(s_kfirst, ref[f"{name}_s"])
            assert eo < TOL and es < TOL, f"ours {mode} vs {name}: output {eo:.2e}, final state {es:.2e}"


# ---------------------------------------------------------------------------------------------------------------
# forget gate
# ---------------------------------------------------------------------------------------------------------------


def test_kda_gate_both_forms(run):
    rng = _rng(5)
    d, t = 45, 9
    z = _randn(rng, B, t, H, DK, scale=4.0)
    z[0, 0, 0, :4] = [21.0, 25.0, 40.0, -30.0]  # transformers' softplus switches to identity above 20
    a_log = (np.log(rng.uniform(1, 16, H))).astype(F32)
    dt_bias = _randn(rng, H * DK)
    x = _randn(rng, B, t, d)
    f_a, f_b = _randn(rng, d, DK, scale=d**-0.5), _randn(rng, DK, H * DK, scale=2 * DK**-0.5)
    ref = run("kda_gate", {"z": z, "A_log": a_log, "dt_bias": dt_bias, "x": x, "f_a": f_a, "f_b": f_b}, lower_bound=-5.0)
    padded = np.zeros(128, F32)  # K3 ships A_log as [128], zero past the real heads
    padded[:H] = a_log
    z_x = np.asarray(x @ f_a @ f_b).reshape(B, t, H, DK)
    for gate, fla_name, hf_name in (("lower_bound", "fla_lower_bound", "hf_glm5_next_gate"),
                                    ("softplus", "fla_softplus", "hf_kimi_linear_gate")):
        cfg = k3_tiny().replace(kda_gate=gate, kda_gate_lower_bound=-5.0)
        for a in (a_log, padded):
            ours = np.asarray(kda.kda_gate(jnp.asarray(z), jnp.asarray(a), jnp.asarray(dt_bias), cfg))
            assert rel(ours, ref[fla_name]) < 1e-6, (gate, a.shape)
        ours = np.asarray(kda.kda_gate(jnp.asarray(z_x), jnp.asarray(a_log), jnp.asarray(dt_bias), cfg))
        assert rel(ours, ref[hf_name]) < 1e-6, gate
    assert ref["fla_lower_bound"].min() >= -5.0 and ref["fla_lower_bound"].max() <= 0.0


# ---------------------------------------------------------------------------------------------------------------
# AttnRes
# ---------------------------------------------------------------------------------------------------------------


def test_attn_res_mix_matches_fla_naive_attnres(run):
    rng = _rng(6)
    d, eps = 45, 1e-5
    scales = np.array([1.0, 7.0, 0.05, 3.0], F32)[:, None, None, None]  # RMS norm inside the scores matters
    sources = _randn(rng, 4, 2, 5, d) * scales
    proj, norm, out_norm = _randn(rng, d, scale=0.5), 1 + _randn(rng, d, scale=0.3), 1 + _randn(rng, d, scale=0.3)
    ref = run("attnres", {"sources": sources, "proj": proj, "norm": norm, "out_norm": out_norm}, eps=eps)
    srcs = [jnp.asarray(s) for s in sources]
    mix = attn_res_mix(srcs, jnp.asarray(proj), jnp.asarray(norm), eps)
    assert rel(mix, ref["mix"]) < 1e-6
    assert rel(rms_norm(mix, jnp.asarray(out_norm), eps), ref["mix_normed"]) < 1e-6
    assert ref["probs"].max(0).min() < 0.9  # the softmax over depth is not degenerate


# ---------------------------------------------------------------------------------------------------------------
# SiTU, gated RMSNorm, router
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_glu_matches_k3_situ_and_mul(run, linear_beta):
    rng = _rng(7)
    d, i = 45, 37
    gate, up = _randn(rng, 4, 64, scale=20.0), _randn(rng, 4, 64, scale=20.0)  # well into both soft caps
    x = _randn(rng, 3, d, scale=3.0)
    p = {"gate": _randn(rng, d, i, scale=3 * d**-0.5), "up": _randn(rng, d, i, scale=3 * d**-0.5), "down": _randn(rng, i, d)}
    ref = run("situ", {"gate": gate, "up": up, "x": x, "w_gate": p["gate"], "w_up": p["up"], "w_down": p["down"]},
              beta=4.0, linear_beta=linear_beta)
    cfg = k3_tiny().replace(hidden_act="situ", situ_beta=4.0, situ_linear_beta=linear_beta)
    assert rel(glu_activation(jnp.asarray(gate), jnp.asarray(up), cfg), ref["act"]) < 1e-6
    assert rel(mlp({k: jnp.asarray(v) for k, v in p.items()}, jnp.asarray(x), cfg), ref["mlp"]) < 1e-5


def test_gated_rms_norm_matches_kimi_linear(run):
    rng = _rng(8)
    x, gate, w = _randn(rng, 2, 7, H, DK, scale=0.01), _randn(rng, 2, 7, H, DK, scale=3.0), 1 + _randn(rng, DK, scale=0.3)
    ref = run("gated_norm", {"x": x, "gate": gate, "weight": w}, eps=1e-5)  # x's RMS^2 ~ eps: the eps matters
    assert rel(gated_rms_norm(jnp.asarray(x), jnp.asarray(gate), jnp.asarray(w), 1e-5), ref["out"]) < 1e-6


@pytest.mark.parametrize("experts,top_k,groups,topk_group,scaling,renorm", [
    (7, 3, 1, 1, 2.446, True),
    (16, 4, 4, 2, 1.0, True),
    (12, 3, 1, 1, 2.5, False),
], ids=["kimi-linear", "grouped", "no-renorm"])
def test_router_matches_kimi_linear_topk_router(run, experts, top_k, groups, topk_group, scaling, renorm):
    rng = _rng(9)
    d, n = 45, 40
    x, w, bias = _randn(rng, n, d), _randn(rng, d, experts, scale=d**-0.5), _randn(rng, experts, scale=0.1)
    ref = run("router", {"x": x, "weight": w, "bias": bias}, top_k=top_k, n_group=groups, topk_group=topk_group,
              scaling=scaling, renormalize=renorm)
    cfg = k3_tiny().replace(num_experts=experts, num_experts_per_tok=top_k, num_expert_group=groups, topk_group=topk_group,
                            routed_scaling_factor=scaling, moe_renormalize=renorm)
    ids, weights = (np.asarray(a) for a in route(jnp.asarray(w), jnp.asarray(bias), jnp.asarray(x), cfg))
    order = ids.argsort(-1)
    np.testing.assert_array_equal(np.take_along_axis(ids, order, -1), ref["ids"])
    assert rel(np.take_along_axis(weights, order, -1), ref["weights"]) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# gated MLA
# ---------------------------------------------------------------------------------------------------------------


def _mla_case(seed, q_lora, gated, t=23):
    rng = _rng(seed)
    cfg = k3_tiny().replace(hidden_size=45, mla_num_heads=3, q_lora_rank=q_lora, kv_lora_rank=23, qk_nope_head_dim=13,
                            qk_rope_head_dim=7, v_head_dim=11, mla_output_gate=gated)
    d, h, qd = cfg.hidden_size, cfg.mla_num_heads, cfg.mla_q_head_dim
    small = 2e-3  # latents with RMS^2 ~ 1e-5: the q_a / kv_a norm eps (1e-6 in every Kimi release) is visible
    p = {
        "kv_a": _randn(rng, d, cfg.latent_cache_dim, scale=small),
        "kv_a_norm": 1 + _randn(rng, cfg.kv_lora_rank, scale=0.3),
        "kv_b": _randn(rng, cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), scale=cfg.kv_lora_rank**-0.5),
        "o_proj": _randn(rng, h * cfg.v_head_dim, d, scale=(h * cfg.v_head_dim) ** -0.5),
    }
    p["kv_a"][:, cfg.kv_lora_rank:] *= 1 / small  # k_pe: not normalised, keep it O(1)
    if q_lora is not None:
        p["q_a"] = _randn(rng, d, q_lora, scale=small)
        p["q_a_norm"] = 1 + _randn(rng, q_lora, scale=0.3)
        p["q_b"] = _randn(rng, q_lora, h * qd, scale=2 * q_lora**-0.5)
    else:
        p["q_proj"] = _randn(rng, d, h * qd, scale=2 * d**-0.5)
    if gated:
        p["g_proj"] = _randn(rng, d, h * cfg.v_head_dim, scale=2 * d**-0.5)
    x = _randn(rng, 2, t, d)
    hf = dict(hidden_size=d, num_attention_heads=h, q_lora_rank=q_lora, kv_lora_rank=cfg.kv_lora_rank,
              qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim)
    return cfg, p, x, hf


@pytest.mark.parametrize("q_lora,gated", [(17, True), (None, False)], ids=["k3-q_lora-gated", "kimi-linear"])
def test_mla_matches_kimi_linear_attention(run, q_lora, gated):
    cfg, p, x, hf = _mla_case(10, q_lora, gated)
    ref = run("gated_mla", {"x": x, **p}, config=hf, gated=gated)
    assert float(ref["kv_a_norm_eps"]) == cfg.mla_norm_eps
    if q_lora is not None:
        assert float(ref["q_a_norm_eps"]) == cfg.mla_norm_eps
    params = {k: jnp.asarray(v) for k, v in p.items()}
    naive = mla.naive_attention(params, jnp.asarray(x), cfg)
    assert rel(naive, ref["y"]) < TOL, "naive MLA"
    # absorbed form over a shuffled paged latent cache, all tokens written at once
    b, t = x.shape[:2]
    page = 4
    max_pages = -(-t // page)
    table = jnp.asarray(shuffled_page_tables(_rng(11), b, max_pages, b * max_pages + 2))
    pages = jnp.zeros((1, b * max_pages + 2, page, cfg.latent_cache_dim), jnp.float32)
    zeros, lengths = jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32)
    absorbed, _ = mla.paged_attention(params, jnp.asarray(x), pages, 0, table, zeros, lengths, cfg)
    assert rel(absorbed, ref["y"]) < TOL, "absorbed (paged) MLA"


# ---------------------------------------------------------------------------------------------------------------
# whole KDA block
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["k3", "kimi-linear"])
def test_kda_block_matches_transformers_layer(run, flavour):
    rng = _rng(12)
    d, t, w = 45, 70, 4
    k3 = flavour == "k3"
    cfg = k3_tiny().replace(hidden_size=d, kda_num_heads=H, kda_head_dim=DK, kda_gate_rank=DK, kda_conv_kernel=w,
                            kda_gate="lower_bound" if k3 else "softplus", kda_output_gate_rank=None if k3 else DK)
    hk = H * DK
    lin = lambda i, o, s=1.0: _randn(rng, i, o, scale=s * i**-0.5)
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), hk))
    p = {
        "q_proj": lin(d, hk), "k_proj": lin(d, hk), "v_proj": lin(d, hk),
        "q_conv": (rng.uniform(-1, 1, (w, hk)) / np.sqrt(w)).astype(F32),
        "k_conv": (rng.uniform(-1, 1, (w, hk)) / np.sqrt(w)).astype(F32),
        "v_conv": (rng.uniform(-1, 1, (w, hk)) / np.sqrt(w)).astype(F32),
        "f_a": lin(d, DK), "f_b": lin(DK, hk, 2.0),
        "dt_bias": (dt + np.log(-np.expm1(-dt))).astype(F32),
        "A_log": (_randn(rng, H, scale=0.5) if k3 else np.log(rng.uniform(1, 16, H))).astype(F32),
        "b_proj": lin(d, H, 2.0), "o_norm": 1 + _randn(rng, DK, scale=0.3), "o_proj": lin(hk, d),
    }
    if k3:
        p["g_proj"] = lin(d, hk, 2.0)
    else:
        p["g_a"], p["g_b"] = lin(d, DK), lin(DK, hk, 2.0)
    x = _randn(rng, B, t, d)
    ref = run("kda_layer", {"x": x, **p}, heads=H, head_dim=DK, conv=w, eps=cfg.rms_norm_eps,
              lower_bound=cfg.kda_gate_lower_bound if k3 else None)
    params = {k: jnp.asarray(v) for k, v in p.items()}
    conv0 = jnp.zeros((B, w - 1, cfg.conv_channels), jnp.float32)
    rec0 = jnp.zeros((B, H, DK, DK), jnp.float32)
    for mode in ("chunked", "recurrent"):
        y, _, _ = kda.kda_mixer(params, jnp.asarray(x), conv0, rec0, cfg, mode=mode)
        err = rel(y, ref["y"])
        assert err < TOL, f"{flavour} KDA block ({mode}): {err:.2e}"
