"""The serving layout (k3jax.fuse): fused input projections give the unfused model's numbers with fewer GEMMs.

Run: python -m pytest -q tests/model/test_fuse.py

Equivalence, layer by layer (cheap to compile): one KDA layer's prefill (chunked), decode and verify on pooled
states with ragged lengths and a fresh row, backends reference and interpret (the fused Pallas kernels); one MLA
layer's paged prefill / decode and naive form; then the whole k3-tiny model (forward, prefill, decode), which only
passes the params through. Tolerance: fp32; a fused GEMM computes every output column as the same dot product over
D as the separate one, only the blocking (accumulation order) may differ, so outputs and states agree to ~1e-7
relative (measured: 4e-7 max abs on logits of magnitude 0.6); 1e-5 catches a wrong column offset or a swapped
projection by orders of magnitude.
Structure: one KDA and one MLA layer at k3-small's real sizes, traced (jax.make_jaxpr on ShapeDtypeStructs, nothing
compiled or allocated): the fused KDA decode layer has 3 GEMMs (in_proj, f_b, o_proj; 8 unfused) and no
concatenate (2 unfused: q|k|v outputs and the conv weights); the fused MLA decode layer 5 GEMMs (7 unfused) and no
per-step slice or convert of its absorbed-form weights.
"""

import collections
import functools

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax import fuse, kda, mla
from k3jax.layers import dense_each
from k3jax.testing import k3_tiny, kimi_linear_tiny, shuffled_page_tables, step_meta

PAGE = 4
TOL = 1e-5


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _cut(cfg):
    """cfg at 3 layers: KDA 0 (dense MLP), KDA 1 (MoE), MLA 2 (MoE): each kind of layer once, and the init and
    compile times of 3 layers, not 9."""
    block = 2 if cfg.attn_res_block_size is not None else None
    return cfg.replace(num_layers=3, mla_layers=(2,), attn_res_block_size=block, name=cfg.name + "-3")


K3, KIMI = _cut(k3_tiny()), _cut(kimi_linear_tiny())
CONFIGS = [K3, KIMI]


@functools.cache
def params_pair(cfg):
    params = k3jax.init_params(cfg, jax.random.key(3))
    return params, fuse.fuse_for_serving(params, cfg)


def _close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel(a, b) < TOL


KDA_MODES = [("chunked", 7, False), ("recurrent", 1, False), ("recurrent", 3, True)]  # prefill, decode, verify


@pytest.mark.parametrize("cfg,backend_name", [(K3, "reference"), (KIMI, "reference"), (K3, "interpret")],
                         ids=["k3-reference", "kimi-linear-reference", "k3-interpret"])
def test_kda_layer_fused_equals_unfused(cfg, backend_name):
    """Prefill (chunked), decode and verify of one KDA layer on pooled states at ragged lengths with a fresh row
    (its slot holds garbage), the pools' other rows random: output and every state agree. Kimi-Linear's variant
    (low-rank output gate g_a inside in_proj, softplus gate) runs on the reference only: the kernels see the same
    inputs either way."""
    params, fused = params_pair(cfg)
    plain, fast = params["layers"][1]["attn"], fused["layers"][1]["attn"]
    rng = np.random.default_rng(5)
    b, pool = 3, 5
    conv = jnp.asarray(rng.standard_normal((pool, cfg.kda_conv_kernel - 1, cfg.conv_channels)), jnp.float32)
    rec = jnp.asarray(rng.standard_normal((pool, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)) * 0.3,
                      jnp.float32)
    slots = jnp.asarray([4, 0, 2], jnp.int32)
    fresh = jnp.asarray([False, True, False])
    for mode, t, all_states in KDA_MODES:
        x = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), jnp.float32)
        lengths = jnp.asarray([t, max(t - 2, 0), 1 if t > 1 else 0], jnp.int32)
        run = lambda p, x, lengths: kda.kda_mixer(p, x, conv, rec, cfg, lengths=lengths, mode=mode,  # noqa: E731
                                                  all_states=all_states, backend_name=backend_name, slots=slots,
                                                  fresh=fresh)
        if backend_name == "reference":  # one compile beats the reference scans' op-by-op dispatch; not so interpret
            run = jax.jit(run)
        _close(run(fast, x, lengths), run(plain, x, lengths))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_mla_layer_fused_equals_unfused(cfg):
    """Paged prefill (ragged) and decode of one MLA layer, and the cache-free naive form: outputs and pages agree."""
    params, fused = params_pair(cfg)
    l = next(l for l in range(cfg.num_layers) if cfg.is_mla(l))
    plain, fast = params["layers"][l]["attn"], fused["layers"][l]["attn"]
    rng = np.random.default_rng(6)
    b, max_pages = 2, 3
    table = jnp.asarray(shuffled_page_tables(rng, b, max_pages, 9))
    pages = jnp.asarray(rng.standard_normal((1, 9, PAGE, cfg.latent_cache_dim)), jnp.float32)
    for t, ctx, lengths in ((6, [0, 0], [6, 3]), (1, [6, 3], [1, 1])):
        x = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), jnp.float32)
        ctx, lengths = jnp.asarray(ctx), jnp.asarray(lengths)
        _close(mla.paged_attention(fast, x, pages, 0, table, ctx, lengths, cfg),
               mla.paged_attention(plain, x, pages, 0, table, ctx, lengths, cfg))
    x = jnp.asarray(rng.standard_normal((b, 5, cfg.hidden_size)), jnp.float32)
    _close(mla.naive_attention(fast, x, cfg), mla.naive_attention(plain, x, cfg))


def test_model_decode_fused_equals_unfused():
    """The whole model's decode step through the serving layout (k3-tiny, 3 layers), on random pools: row 0 is
    fresh (context 0), row 1 continues 5 cached tokens, row 2 is idle."""
    cfg = K3
    params, fused = params_pair(cfg)
    rng = np.random.default_rng(8)
    zero = k3jax.init_state(cfg, num_slots=4, num_pages=8, page_size=PAGE)
    dirty = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.3, x.dtype), zero)
    meta = step_meta([2, 0, 3], shuffled_page_tables(rng, 3, 2, 8), [0, 5, 2], [1, 1, 0])
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3,)))
    want = k3jax.decode(params, cfg, jax.tree.map(jnp.copy, dirty), tokens, meta)
    got = k3jax.decode(fused, cfg, dirty, tokens, meta)
    _close(got, want)


def test_layout_replaces_the_parts():
    cfg = K3
    params, fused = params_pair(cfg)
    assert k3jax.count_params(fused) == k3jax.count_params(params)  # nothing held twice (A_log is not padded here)
    assert "kv_b" in params["layers"][2]["attn"]  # the input tree is not modified
    for l, (lp, fp) in enumerate(zip(params["layers"], fused["layers"])):
        attn, fattn = lp["attn"], fp["attn"]
        columns = fuse.mla_input_columns(cfg) if cfg.is_mla(l) else fuse.kda_input_columns(cfg)
        assert not {name for name, _ in columns} & set(fattn)
        start = 0
        for name, width in columns:  # each part sits at its static offset, bit for bit
            np.testing.assert_array_equal(fattn["in_proj"][:, start : start + width], attn[name])
            start += width
        assert fattn["in_proj"].shape == (cfg.hidden_size, start)
        if cfg.is_mla(l):  # kv_b split into the absorbed form's head-major weights, W_UV in fp32 (exact)
            assert "kv_b" not in fattn
            w_uk, w_uv = mla.split_kv_b(attn, cfg)
            np.testing.assert_array_equal(fattn["w_uk"], np.transpose(w_uk, (1, 2, 0)))
            np.testing.assert_array_equal(fattn["w_uv"], np.transpose(w_uv, (1, 0, 2)).astype(np.float32))
            assert fattn["w_uv"].dtype == jnp.float32
        else:
            assert not {"q_conv", "k_conv", "v_conv"} & set(fattn)
            np.testing.assert_array_equal(fattn["qkv_conv"],
                                          np.concatenate([attn["q_conv"], attn["k_conv"], attn["v_conv"]], -1))
        assert fattn["o_proj"] is attn["o_proj"]  # untouched leaves are shared, not copied
    assert fused["embed"] is params["embed"]
    again = fuse.fuse_for_serving(fused, cfg)  # idempotent
    assert all(a is b for a, b in zip(jax.tree.leaves(again["layers"][1]["attn"]),
                                      jax.tree.leaves(fused["layers"][1]["attn"])))


def test_padded_a_log_is_cut_at_load():
    cfg = K3
    params, _ = params_pair(cfg)
    lp = params["layers"][0]
    padded = {**lp["attn"], "A_log": jnp.concatenate([lp["attn"]["A_log"], jnp.full((125,), 7.0)])}  # K3 pads to 128
    fused = fuse.fuse_for_serving({**params, "layers": [{**lp, "attn": padded}]}, cfg.replace(num_layers=1,
                                                                                            mla_layers=()))
    np.testing.assert_array_equal(fused["layers"][0]["attn"]["A_log"], lp["attn"]["A_log"])


def test_fused_params_refuse_a_custom_linear():
    cfg = K3
    _, fused = params_pair(cfg)
    x = jnp.ones((1, 2, cfg.hidden_size))
    conv = jnp.zeros((1, cfg.kda_conv_kernel - 1, cfg.conv_channels))
    rec = jnp.zeros((1, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim))
    with pytest.raises(ValueError, match="fused serving layout"):
        kda.kda_mixer(fused["layers"][0]["attn"], x, conv, rec, cfg, linear=dense_each)
    with pytest.raises(ValueError, match="fused serving layout"):
        mla.naive_attention(fused["layers"][2]["attn"], x, cfg, linear=dense_each)


_VIEWS = ("reshape", "transpose", "squeeze", "expand_dims")


def _counts(closed, num_weights: int) -> collections.Counter:
    """Primitive counts of a jaxpr (whose first `num_weights` inputs are weights) and its sub-jaxprs, outside Pallas
    kernel bodies; plus "float_concatenate" and "weight_slice" / "weight_convert": slices and converts of a weight
    (or a view of one, followed through nested jits) -- per-step work the serving layout does once at load."""
    counts = collections.Counter()
    is_var = lambda v: isinstance(v, jex.core.Var)  # noqa: E731

    def walk(jaxpr, weights: set):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            counts[name] += 1
            on_weight = bool(eqn.invars) and is_var(eqn.invars[0]) and eqn.invars[0] in weights
            if name == "concatenate" and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
                counts["float_concatenate"] += 1  # not the kernel wrapper's int32 scatter indices
            if on_weight and name in ("slice", "convert_element_type"):
                counts["weight_" + name.split("_")[0]] += 1
            if on_weight and name in (*_VIEWS, "slice"):  # still weight-derived: a later convert counts too
                weights.add(eqn.outvars[0])
            if name == "jit":
                inner = eqn.params["jaxpr"].jaxpr
                walk(inner, {iv for iv, ov in zip(inner.invars, eqn.invars) if is_var(ov) and ov in weights})
            elif name != "pallas_call":
                for sub in jex.core.jaxprs_in_params(eqn.params):
                    walk(sub, set())

    walk(closed.jaxpr, set(closed.jaxpr.invars[:num_weights]))
    return counts


@functools.cache
def _k3_small_layers():
    cfg = k3jax.load_config("k3-small")
    shapes = k3jax.param_shapes(cfg)
    kda_l, mla_l = cfg.kda_layers[1], next(l for l in range(cfg.num_layers) if cfg.is_mla(l))
    pick = lambda p: {"layers": [p["layers"][kda_l], p["layers"][mla_l]]}  # noqa: E731
    one = cfg.replace(num_layers=2, mla_layers=(1,))
    fused = jax.eval_shape(lambda p: fuse.fuse_for_serving(p, one), pick(shapes))
    return cfg, pick(shapes)["layers"], fused["layers"]


def _decode_layer_counts(layers, kind: str) -> collections.Counter:
    """Primitive counts of one decode layer of k3-small at batch 64 (8k context), backend "pallas", traced."""
    cfg, _, _ = _k3_small_layers()
    b, pages = 64, 128
    sd = jax.ShapeDtypeStruct
    x = sd((b, 1, cfg.hidden_size), jnp.dtype(cfg.dtype))
    slots, lens = sd((b,), jnp.int32), sd((b,), jnp.int32)
    if kind == "kda":
        attn = layers[0]["attn"]
        conv = sd((2 * b, cfg.kda_conv_kernel - 1, cfg.conv_channels), jnp.dtype(cfg.dtype))
        rec = sd((2 * b, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32)
        fn = lambda p, x, c, r, s, n: kda.kda_mixer(p, x, c, r, cfg, lengths=n, mode="recurrent", slots=s,  # noqa: E731
                                                     backend_name="pallas")
        return _counts(jax.make_jaxpr(fn)(attn, x, conv, rec, slots, lens), len(attn))
    attn = layers[1]["attn"]
    kv = sd((1, b * pages, 64, cfg.latent_cache_dim), jnp.dtype(cfg.dtype))
    table = sd((b, pages), jnp.int32)
    fn = lambda p, x, kv, t, c, n: mla.paged_attention(p, x, kv, 0, t, c, n, cfg, backend_name="pallas")  # noqa: E731
    return _counts(jax.make_jaxpr(fn)(attn, x, kv, table, lens, lens), len(attn))


def test_k3_small_kda_decode_layer_has_one_input_gemm():
    _, plain, fused = _k3_small_layers()
    before, after = _decode_layer_counts(plain, "kda"), _decode_layer_counts(fused, "kda")
    assert (before["dot_general"], before["float_concatenate"]) == (8, 2)  # q k v f_a b g, f_b, o_proj; qkv and conv w
    assert (after["dot_general"], after["float_concatenate"]) == (3, 0)  # in_proj, f_b, o_proj
    assert after["weight_slice"] == after["weight_convert"] == 0


def test_k3_small_mla_decode_layer_has_one_input_gemm():
    _, plain, fused = _k3_small_layers()
    before, after = _decode_layer_counts(plain, "mla"), _decode_layer_counts(fused, "mla")
    assert before["dot_general"] == 7  # q_a kv_a, q_b, W_UK, W_UV, g_proj, o_proj
    assert after["dot_general"] == 5  # in_proj, q_b, W_UK, W_UV, o_proj
    assert before["weight_slice"] == 2 and before["weight_convert"] == 1  # kv_b -> W_UK | W_UV, W_UV to fp32
    assert after["weight_slice"] == after["weight_convert"] == 0


@pytest.mark.parametrize("kernel", ["mosaic", "triton"])
def test_k3_small_kda_decode_kernel_reads_the_projection_in_place(kernel, monkeypatch):
    """Serving layout, backend "pallas", either decode kernel (k3jax.kda.KDA_DECODE_KERNEL): the fused decode kernel
    gets the input GEMM's whole output [B, 1, C] (q|k|v, beta logits and output gate read at their columns, the
    kernels' `packed`) instead of three slices, which XLA copied out as three kernels per layer on the H200
    (2026-12-02 profile for Triton, 2026-12-04 for Mosaic). (A Pallas Triton kernel traces as `pallas_call`, a
    Mosaic GPU one as `mpmd_map`.)"""
    monkeypatch.setattr(kda, "KDA_DECODE_KERNEL", kernel)
    cfg, _, fused = _k3_small_layers()
    attn = fused[0]["attn"]
    b, sd = 64, jax.ShapeDtypeStruct
    args = (attn, sd((b, 1, cfg.hidden_size), jnp.dtype(cfg.dtype)),
            sd((2 * b, cfg.kda_conv_kernel - 1, cfg.conv_channels), jnp.dtype(cfg.dtype)),
            sd((2 * b, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32),
            sd((b,), jnp.int32), sd((b,), jnp.int32))
    fn = lambda p, x, c, r, s, n: kda.kda_mixer(p, x, c, r, cfg, lengths=n, mode="recurrent", slots=s,  # noqa: E731
                                                 backend_name="pallas")
    width = attn[fuse.FUSED_INPUT].shape[1]
    shapes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("pallas_call", "mpmd_map"):
                shapes.append([tuple(v.aval.shape) for v in eqn.invars])
                continue  # (the kernel's body holds no other kernel)
            for sub in jex.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    assert len(shapes) == 1
    hk = cfg.kda_num_heads * cfg.kda_head_dim
    assert (b, 1, width) in shapes[0] and (b, 1, 3 * hk) not in shapes[0] and (b, 1, cfg.kda_num_heads) not in shapes[0]
