"""The MoE layer's load-time fused projections (k3jax.moe.fuse_moe_weights) and its kernel count per decode step.

Run: python -m pytest -q tests/model/test_moe_fuse.py

Tolerances: FUSED_IN computes each output column as the same dot product as the separate GEMMs, so it only
reorders nothing; FUSED_OUT sums the routed and shared branches inside one fp32 accumulator instead of rounding
each to the activation dtype and adding. In float32 that is summation order alone (~1e-7 relative, 1e-5 bound);
in bf16 the unfused side rounds three times (2^-9 each) where the fused one rounds once, so ~3e-3 relative, with
1e-2 the bound (gpu.md's bf16 band).
"""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

import k3jax
from k3jax import moe as moe_mod
from k3jax.moe import FUSED_IN, FUSED_OUT, fuse_moe_weights, moe
from k3jax.params import param_shapes
from k3jax.testing import k3_tiny, kimi_linear_tiny


# one compiled layer per (structure, shapes, cfg, backend): the routing cases of a dtype share it
moe_jit = jax.jit(moe, static_argnames=("cfg", "backend_name"))


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def moe_layer(params: dict) -> dict:
    return next(layer["mlp"] for layer in params["layers"] if "router" in layer["mlp"])


def moe_layer_params(cfg, seed: int) -> dict:
    """One MoE layer's params (k3jax.params layout) from numpy draws: init_params builds every layer of the model
    with one compiled draw per weight shape (~20 s on the CI machine), this is milliseconds."""
    rng = np.random.default_rng(seed)
    d, e, i, dtype = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, jnp.dtype(cfg.dtype)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape) * shape[-2] ** -0.5, dtype)

    w = cfg.expert_width
    p = {"router": normal(d, e), "router_bias": jnp.asarray(rng.standard_normal(e) * 0.01, jnp.float32),
         "experts": {"gate": normal(e, w, i), "up": normal(e, w, i), "down": normal(e, i, w)}}
    if cfg.moe_latent_size:
        p["latent_down"] = normal(d, cfg.moe_latent_size)
        p["latent_norm"] = jnp.asarray(1 + 0.1 * rng.standard_normal(cfg.moe_latent_size), dtype)
        p["latent_up"] = normal(cfg.moe_latent_size, d)
    if cfg.num_shared_experts:
        s = cfg.shared_intermediate_size
        p["shared"] = {"gate": normal(d, s), "up": normal(d, s), "down": normal(s, d)}
    return p


def _case(cfg, seed: int, tokens: tuple[int, ...]):
    layer = moe_layer_params(cfg, seed)
    x = jnp.asarray(np.random.default_rng(seed + 100).standard_normal((*tokens, cfg.hidden_size)), cfg.dtype)
    return layer, x


@pytest.mark.parametrize("dtype,bound", [("float32", 1e-5), ("bfloat16", 1e-2)])
@pytest.mark.parametrize("routing", ["random", "one_hot_expert"])
def test_fused_layer_equals_unfused(dtype, bound, routing):
    """k3-tiny (latent MoE + shared experts), 7 experts top-3 over 2 x 5 ragged tokens (10 tokens: most experts get
    a few rows, some none); one_hot_expert: a huge router bias makes every token pick expert 4 (selection only, so
    its weights stay the unbiased scores), the other picks spread over the rest, several experts empty."""
    cfg = k3_tiny().replace(dtype=dtype)
    layer, x = _case(cfg, 1, (2, 5))
    if routing == "one_hot_expert":
        layer = {**layer, "router_bias": layer["router_bias"].at[4].set(50.0)}
    fused = fuse_moe_weights(layer, cfg)
    want = moe_jit(layer, x, cfg=cfg)
    for name in ("reference", "interpret"):
        got = moe_jit(fused, x, cfg=cfg, backend_name=name)
        assert got.shape == x.shape and got.dtype == x.dtype
        assert rel(got, want) < bound, (name, rel(got, want))
    if routing == "one_hot_expert":
        route = jax.jit(moe_mod.route, static_argnames="cfg")
        ids, _ = route(layer["router"], layer["router_bias"], x.reshape(-1, cfg.hidden_size), cfg=cfg)
        assert (np.asarray(ids) == 4).any(1).all()


def test_fused_layer_runs_the_combine_kernel_or_falls_back(monkeypatch):
    """With fused projections the kernel backends build FUSED_OUT's input with pallas_kernels/moe_combine.py (a spy
    counts its calls); where it is not used (supported() False: widths it does not tile, rows past its size cut)
    XLA combines the same rows. Both equal the unfused reference layer (float32: summation order, the 1e-5 bound
    above). A fresh jit each: the spy counts traces."""
    from pallas_kernels import moe_combine

    cfg = k3_tiny().replace(dtype="float32")
    layer, x = _case(cfg, 4, (3, 3))
    fused = fuse_moe_weights(layer, cfg)
    want = moe_jit(layer, x, cfg=cfg)
    calls = []
    real = moe_combine.moe_combine
    monkeypatch.setattr(moe_combine, "moe_combine", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = jax.jit(moe, static_argnames=("cfg", "backend_name"))(fused, x, cfg=cfg, backend_name="interpret")
    assert len(calls) == 1 and rel(got, want) < 1e-5
    monkeypatch.setattr(moe_combine, "supported", lambda *a, **k: False)
    got = jax.jit(moe, static_argnames=("cfg", "backend_name"))(fused, x, cfg=cfg, backend_name="interpret")
    assert len(calls) == 1 and rel(got, want) < 1e-5


def test_fused_params_structure_and_other_layouts():
    """The fused weights replace the originals (same bytes), fusing twice is a no-op, dense layers pass through,
    numpy stays numpy; a config without a latent (kimi-linear-tiny) fuses only the shared gate and up and matches."""
    cfg = k3_tiny()
    layer = moe_layer_params(cfg, 2)
    fused = fuse_moe_weights(layer, cfg)
    d, latent, width = cfg.hidden_size, cfg.moe_latent_size, cfg.shared_intermediate_size
    assert fused[FUSED_IN].shape == (d, latent + 2 * width) and fused[FUSED_OUT].shape == (latent + width, d)
    assert not {"latent_down", "latent_up", "shared"} & set(fused)
    np.testing.assert_array_equal(fused[FUSED_IN][:, latent + width:], layer["shared"]["up"])
    np.testing.assert_array_equal(fused[FUSED_OUT][latent:], layer["shared"]["down"])
    assert fuse_moe_weights(fused, cfg) is fused
    dense_layer = {"gate": layer["shared"]["gate"], "up": layer["shared"]["up"], "down": layer["shared"]["down"]}
    assert fuse_moe_weights(dense_layer, cfg) is dense_layer  # a dense MLP layer (no router) passes through
    as_numpy = fuse_moe_weights(jax.tree.map(np.asarray, layer), cfg)
    assert isinstance(as_numpy[FUSED_IN], np.ndarray)

    kimi = kimi_linear_tiny()
    layer, x = _case(kimi, 3, (7,))
    fused = fuse_moe_weights(layer, kimi)
    assert FUSED_OUT not in fused and set(fused["shared"]) == {"down"}
    got = moe_jit(fused, x, cfg=kimi, backend_name="interpret")
    assert rel(got, moe_jit(layer, x, cfg=kimi)) < 1e-5


# ----------------------------------------------------------------------------------------------------
# kernel count proxy: primitives of one MoE layer's decode step at k3-small's shapes


def _primitives(jaxpr) -> Counter:
    """Primitive counts outside kernels: jit / custom_jvp bodies are inlined, pallas_call bodies are one kernel."""
    counts = Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            counts["pallas_call"] += 1
            continue
        subs = list(jax_core.jaxprs_in_params(eqn.params))
        if subs and eqn.primitive.name in ("pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call"):
            for sub in subs:
                counts += _primitives(sub)
            continue
        counts[eqn.primitive.name] += 1
    return counts


def decode_layer_primitives(fused: bool) -> Counter:
    """One k3-small MoE layer on a decode batch of 64 tokens with the Pallas experts, traced on shapes only."""
    cfg = k3jax.load_config("k3-small")
    layer = moe_layer(param_shapes(cfg))
    if fused:
        layer = jax.eval_shape(lambda p: fuse_moe_weights(p, cfg), layer)
    x = jax.ShapeDtypeStruct((64, 1, cfg.hidden_size), jnp.bfloat16)
    return _primitives(jax.make_jaxpr(lambda p, x: moe(p, x, cfg, backend_name="pallas"))(layer, x).jaxpr)


# Ops that are kernels of their own on the GPU (or start one): GEMMs, sorts, scatters, scans, gathers, reductions,
# data movement. Slices feeding elementwise ops fuse into them (the unrolled routing-weight sum, the shared GLU
# reading FUSED_IN's columns) and are not counted. Before this change (HEAD 34a154c) one layer had 6 dot_general,
# 8 gather, 2 cumsum, 1 scatter, 1 scatter-add, 4 reduce_sum, 1 sort, 1 top_k, 2 pallas_call, 1 stack, 1 pad
# (28 such ops; the H200 profile: ~21 GPU kernels per layer + the sort).
HEAVY = ("dot_general", "gather", "cumsum", "scatter", "scatter-add", "reduce_sum", "sort", "top_k", "pallas_call",
         "concatenate", "stack", "pad", "dynamic_slice", "dynamic_update_slice", "while")


def test_decode_layer_kernel_count_proxy():
    """The fused layer's decode step: 3 GEMMs (router, FUSED_IN, FUSED_OUT), the expert selection as one kernel
    (pallas_kernels/router_topk.py: no top_k sort, no take_along_axis gather), one compare-and-count for the
    schedule and no sort at decode sizes (the grouped GEMMs rank their own rows; no scatter, no cumsum), and the
    combine, the latent RMSNorm and the shared GLU as one kernel (pallas_kernels/moe_combine.py: no concatenate, no
    reduction left outside kernels but the schedule's count). The unfused layer keeps its 6 GEMMs and the latent
    RMSNorm in XLA (its mean the other reduction); its combine is the same kernel (moe_grouped_mlp's "auto")."""
    fused = decode_layer_primitives(fused=True)
    unfused = decode_layer_primitives(fused=False)
    assert fused["dot_general"] == 3 and unfused["dot_general"] == 6
    assert fused["pallas_call"] == unfused["pallas_call"] == 4
    assert fused["concatenate"] == 0 and fused["reduce_sum"] == 1
    for counts in (fused, unfused):
        assert counts["sort"] == 0 and counts["top_k"] == 0
        assert counts["scatter"] == counts["scatter-add"] == counts["cumsum"] == counts["while"] == 0
        assert counts["gather"] == 0 and counts["reduce_sum"] <= 2
    heavy = {k: v for k, v in fused.items() if k in HEAVY}
    assert sum(heavy.values()) <= 8, heavy  # 28 such ops at 34a154c, 11 before the selection kernel, 10 before
    # ranking, 9 before the combine kernel
