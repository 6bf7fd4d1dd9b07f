"""GPU-only checks of the MoE grouped GEMM and the fused norms, compiled through the Triton lowering
(skipped without a GPU).

Run on a GPU host: K3JAX_TEST_GPU=1 python -m pytest -q -n 0 -m gpu tests/gpu/test_moe_gpu.py

Each compiled kernel is compared with the model's reference op on the same device at K3-like widths
(3584 latent, 3072 intermediate; fewer experts to stay quick). Tolerance 1e-2 relative (bf16 band of
gpu.md: the kernels round h and the output to bf16 once each, ~3e-3 expected).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.attnres import attn_res_mix_norm_unfused
from k3jax.config import load_config
from k3jax.moe import grouped_experts_reference
from k3jax.layers import gated_rms_norm
from pallas_kernels import fused_norm, moe_gemm

pytestmark = pytest.mark.gpu


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _experts(e, k, i, seed):
    keys = jax.random.split(jax.random.key(seed), 3)
    return {
        "gate": (jax.random.normal(keys[0], (e, k, i)) * k**-0.5).astype(jnp.bfloat16),
        "up": (jax.random.normal(keys[1], (e, k, i)) * k**-0.5 * 2).astype(jnp.bfloat16),
        "down": (jax.random.normal(keys[2], (e, i, k)) * i**-0.5).astype(jnp.bfloat16),
    }


@pytest.mark.parametrize("tokens,top_k", [(7, 4), (600, 2)])
def test_grouped_mlp_bf16_and_mxfp4_match_reference(tokens, top_k):
    e, k, i = 6, 3584, 3072
    rng = np.random.default_rng(tokens)
    ids = np.stack([rng.choice(e - 1, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)  # expert 5 empty
    ids[:, 0] = 2  # expert 2 is hot (a token may then name it twice: allowed, both slots count)
    ids = jnp.asarray(ids)
    w = jnp.asarray(rng.uniform(0.1, 1, ids.shape), jnp.float32)
    x = jax.random.normal(jax.random.key(tokens), (tokens, k)).astype(jnp.bfloat16)
    experts = _experts(e, k, i, 0)
    cfg = load_config("k3").replace(num_experts=e, num_experts_per_tok=top_k)
    got = moe_gemm.moe_grouped_mlp(x, ids, w, experts)
    want = grouped_experts_reference(x, ids, w, experts, cfg)  # ragged_dot: slow but exact in layout
    assert rel(got, want) < 1e-2
    packed = {}
    for name, v in experts.items():
        p, s = moe_gemm_quantize(v)
        packed[name] = {"packed": p, "scale": s}
    got = moe_gemm.moe_grouped_mlp(x, ids, w, packed)
    want = grouped_experts_reference(x, ids, w, packed, cfg)
    assert rel(got, want) < 1e-2


@pytest.mark.parametrize("tokens", [64, 203])
def test_rows_ranked_in_kernel_equal_the_sorted_path_at_k3_small_decode(tokens, monkeypatch):
    """k3-small's decode MoE (192 experts, 1024 -> 512, top 8): the kernels ranking their own rows (the default at
    these sizes, no sort kernel) give bit-identical results to the sorted-order path, both equal to the reference."""
    e, k, i, top_k = 192, 1024, 512, 8
    rng = np.random.default_rng(tokens)
    ids = jnp.asarray(np.argsort(rng.random((tokens, e)), axis=1)[:, :top_k].astype(np.int32))
    w = jnp.asarray(rng.uniform(0.1, 1, ids.shape), jnp.float32)
    x = jax.random.normal(jax.random.key(tokens), (tokens, k)).astype(jnp.bfloat16)
    experts = _experts(e, k, i, 1)
    assert moe_gemm.ranks_in_kernel(tokens, top_k, moe_gemm.default_config(tokens * top_k, e).block_m)
    ranked = moe_gemm.moe_grouped_mlp(x, ids, w, experts)
    monkeypatch.setattr(moe_gemm, "RANK_IN_KERNEL_MAX_ELEMENTS", 0)
    jax.clear_caches()
    sorted_path = moe_gemm.moe_grouped_mlp(x, ids, w, experts)
    np.testing.assert_array_equal(np.asarray(ranked.astype(jnp.float32)), np.asarray(sorted_path.astype(jnp.float32)))
    cfg = load_config("k3-small")
    assert rel(ranked, grouped_experts_reference(x, ids, w, experts, cfg)) < 1e-2


NARROW_DOWN = moe_gemm.MoeGemmConfig(block_m=128, glu_block_n=128, down_block_n=128, block_k=64, num_warps=8,
                                     num_stages=3)


@pytest.mark.parametrize("config", [None, NARROW_DOWN], ids=["default_wide_down", "narrow_down"])
def test_large_groups_match_reference(config):
    """~700 rows per expert: the default large-group tiling (the 256-wide down GEMM) and the 128-wide one."""
    e, k, i, tokens, top_k = 6, 3584, 3072, 2100, 2
    rng = np.random.default_rng(7)
    ids = jnp.asarray(np.stack([rng.choice(e, top_k, replace=False) for _ in range(tokens)]).astype(np.int32))
    w = jnp.asarray(rng.uniform(0.1, 1, ids.shape), jnp.float32)
    x = jax.random.normal(jax.random.key(3), (tokens, k)).astype(jnp.bfloat16)
    experts = _experts(e, k, i, 1)
    cfg = load_config("k3").replace(num_experts=e, num_experts_per_tok=top_k)
    got = moe_gemm.moe_grouped_mlp(x, ids, w, experts, config=config)
    want = grouped_experts_reference(x, ids, w, experts, cfg)
    assert rel(got, want) < 1e-2


@pytest.mark.parametrize("tokens,top_k", [(7, 4), (64, 16), (900, 16), (2100, 1)],
                         ids=["ranked", "dep_decode", "dep_prefill", "single_term"])
def test_dropped_assignments_match_reference(tokens, top_k):
    """ids < 0 (an expert-parallel rank's non-local picks, k3jax.parallel): compiled, at K3 widths, against the
    reference with those assignments dropped -- the ranked decode path, DEP-shaped rows (top 16, ~1 kept per token,
    token 0 keeps none: exactly zero), and top_k = 1 at the large-group tiling, where the down kernel stores bf16.
    Unwritten y rows are whatever the allocator left: the combine must select them away (XLA's) or not read them
    (pallas_kernels/moe_combine.py)."""
    e, k, i = 6, 3584, 3072
    rng = np.random.default_rng(tokens + top_k)
    ids = np.stack([rng.choice(e, top_k, replace=top_k > e) for _ in range(tokens)]).astype(np.int32)
    ids[rng.random(ids.shape) > (1.5 / top_k if top_k > 4 else 0.6)] = -1
    ids[0] = -1
    ids = jnp.asarray(ids)
    w = jnp.asarray(rng.uniform(0.1, 1, ids.shape), jnp.float32)
    x = jax.random.normal(jax.random.key(tokens), (tokens, k)).astype(jnp.bfloat16)
    experts = _experts(e, k, i, 4)
    cfg = load_config("k3").replace(num_experts=e, num_experts_per_tok=min(top_k, e))  # the reference reads E only
    want = grouped_experts_reference(x, ids, w, experts, cfg)
    # the combine both ways (top_k > 1): XLA's, and the kernel's masked loads that skip the dropped slots' rows
    for combine in ("xla", "kernel") if top_k > 1 else ("auto",):
        got = moe_gemm.moe_grouped_mlp(x, ids, w, experts, combine=combine)
        assert np.isfinite(np.asarray(got, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(got[0], np.float32), 0.0)
        assert rel(got, want) < 1e-2


MID_SIZE_MODES = {  # tail tiles and expert-aligned items for mid-size groups (benchmarks/moe.py --sweep-configs tilings)
    "packed_tail64": dataclasses.replace(moe_gemm.LARGE_GROUP_WIDE_DOWN, tail_block_m=64),
    "64x256": moe_gemm.MoeGemmConfig(block_m=64, glu_block_n=256, down_block_n=256, block_k=64, num_warps=8,
                                     num_stages=3),
    "aligned_tail64": dataclasses.replace(moe_gemm.LARGE_GROUP_WIDE_DOWN, tail_block_m=64, aligned=True),
    "aligned_tail64_groups8": dataclasses.replace(moe_gemm.LARGE_GROUP_WIDE_DOWN, tail_block_m=64, aligned=True,
                                                  column_group=8),
    "groups3_split2": dataclasses.replace(moe_gemm.LARGE_GROUP_WIDE_DOWN, column_group=3, down_split_k=2),
}


@pytest.mark.parametrize("mode", list(MID_SIZE_MODES))
def test_mid_size_modes_match_reference(mode):
    """~300 rows per expert (the issue's failing 292-row range) at K3 widths, compiled: ragged groups, expert 5
    empty, expert 2 hot (every token's first slot, ~900 rows), so items of both sizes around tail_block_m occur."""
    e, k, i, tokens, top_k = 6, 3584, 3072, 900, 2
    rng = np.random.default_rng(11)
    ids = np.stack([rng.choice(e - 1, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    ids[:, 0] = 2
    ids = jnp.asarray(ids)
    w = jnp.asarray(rng.uniform(0.1, 1, ids.shape), jnp.float32)
    x = jax.random.normal(jax.random.key(5), (tokens, k)).astype(jnp.bfloat16)
    experts = _experts(e, k, i, 2)
    cfg = load_config("k3").replace(num_experts=e, num_experts_per_tok=top_k)
    got = moe_gemm.moe_grouped_mlp(x, ids, w, experts, config=MID_SIZE_MODES[mode])
    want = grouped_experts_reference(x, ids, w, experts, cfg)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert rel(got, want) < 1e-2, mode


@pytest.mark.parametrize("variant", list(moe_gemm.MXFP4_VARIANTS))
@pytest.mark.parametrize("tokens,top_k", [(7, 4), (600, 2)])
def test_mxfp4_variants_match_dequantised_reference(variant, tokens, top_k):
    """Every MXFP4 layout ("interleave" on the checkpoint's, "kmajor" on the kernel's, "k4" on the opt-in word layout
    with the inline-PTX decode), compiled, at K3 widths
    (3584 -> 3072) and the decode tiling (block_m 16) for 7 tokens / the 64-row tiling for 600: random bytes
    cover all 16 codes (incl. the f16-subnormal +-0.5 of the plane decode) and scales span 2^-10..2^10 around a
    2^-9 base. Against the model's ragged_dot reference on the same weights dequantised (exact in bf16): 1e-2
    as above (bf16 activations)."""
    e, k, i = 6, 3584, 3072
    rng = np.random.default_rng(tokens + 1)
    ids = np.stack([rng.choice(e - 1, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)  # 5 empty
    ids[:, 0] = 2  # hot expert
    ids, w = jnp.asarray(ids), jnp.asarray(rng.uniform(0.1, 1, ids.shape), jnp.float32)
    x = jax.random.normal(jax.random.key(tokens), (tokens, k)).astype(jnp.bfloat16)

    def hf(n_out, n_in, base):  # base 2^-9 (so |w| ~ E2M1 * 2^-9 ~ 1/sqrt(fan-in)), +-10 octaves on a few groups
        scale = rng.integers(base - 1, base + 2, (e, n_out, n_in // 32))
        scale[:, :4, :4] = rng.integers(base - 10, base + 11, (e, 4, 4))
        return {"packed": jnp.asarray(rng.integers(0, 256, (e, n_out, n_in // 2)).astype(np.uint8)),
                "scale": jnp.asarray(scale.astype(np.uint8))}

    checkpoint = {"gate": hf(i, k, 118), "up": hf(i, k, 118), "down": hf(k, i, 118)}
    layout = moe_gemm.MXFP4_VARIANTS[variant]
    experts = checkpoint if layout == "hf" else {n: moe_gemm.prepare_mxfp4(v, layout=layout)
                                                 for n, v in checkpoint.items()}
    got = moe_gemm.moe_grouped_mlp(x, ids, w, experts)
    cfg = load_config("k3").replace(num_experts=e, num_experts_per_tok=top_k)
    want = grouped_experts_reference(x, ids, w, checkpoint, cfg)  # ragged_dot over the dequantised weights
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert rel(got, want) < 1e-2, variant


@pytest.mark.parametrize("shape", ["k3-small", "k3-ep16"])
def test_k4_decode_sizes_match_kn_and_dequantised_reference(shape):
    """The word layouts' inline-PTX decodes ("k4": table lookup, "k4r": rotations, masks and a bf16 multiply by a
    subnormal-placed E2M1, codes +-0.5 included) on the device at decode sizes, default tiling: k3-small (192 experts,
    1024 -> 512, top 8 of 64 tokens) and one K3 EP16 shard (56 experts, 3584 -> 3072, 16 tokens, top 16 of 896 kept
    where local). Against the dense einsum over the dequantised weights (each expert's rows, bf16 weights exact) at
    the bf16 band (1e-2), and against "kn" on the same codes: both decodes are exact and the scale is a power of two,
    so the two agree to fp32 reordering (1e-3 leaves room for h's bf16 rounding); a wrong byte or half order in
    the asm (the pack=4 assumption) would permute weights inside each group and fail both by ~1."""
    e, k, i, tokens, top_k, total = {"k3-small": (192, 1024, 512, 64, 8, 192),
                                     "k3-ep16": (56, 3584, 3072, 16, 16, 896)}[shape]
    rng = np.random.default_rng(7)
    picks = np.stack([rng.choice(total, top_k, replace=False) for _ in range(tokens)])
    ids = np.where(picks < e, picks, picks[:, :1] % e).astype(np.int32)  # non-local picks folded onto a local expert
    ids, w = jnp.asarray(ids), jnp.asarray(rng.uniform(0.1, 1, ids.shape), jnp.float32)
    x = jax.random.normal(jax.random.key(11), (tokens, k)).astype(jnp.bfloat16)

    def hf(n_out, n_in):  # all 16 codes; scales 2^-10 +- 1 (|w| ~ 1/sqrt(fan-in)), a few groups +-8 octaves
        scale = rng.integers(116, 119, (e, n_out, n_in // 32))
        scale[:, :4, :4] = rng.integers(109, 126, (e, 4, 4))
        return {"packed": jnp.asarray(rng.integers(0, 256, (e, n_out, n_in // 2), dtype=np.uint8)),
                "scale": jnp.asarray(scale.astype(np.uint8))}

    checkpoint = {"gate": hf(i, k), "up": hf(i, k), "down": hf(k, i)}
    got = {lay: moe_gemm.moe_grouped_mlp(x, ids, w, {n: moe_gemm.prepare_mxfp4(v, layout=lay)
                                                     for n, v in checkpoint.items()}) for lay in ("kn", "k4", "k4r")}
    dense = {n: moe_gemm.mxfp4_weight_reference(v, jnp.bfloat16) for n, v in checkpoint.items()}  # [E, in, out]
    want = jnp.zeros((tokens, k), jnp.float32)
    for j in range(top_k):  # per slot, dense einsum over each token's expert weights (gathered one slot at a time)
        g = jnp.einsum("nk,nki->ni", x, dense["gate"][ids[:, j]], preferred_element_type=jnp.float32)
        u = jnp.einsum("nk,nki->ni", x, dense["up"][ids[:, j]], preferred_element_type=jnp.float32)
        h = moe_gemm._glu(g, u, "situ", 4.0, 25.0).astype(jnp.bfloat16)
        y = jnp.einsum("ni,nid->nd", h, dense["down"][ids[:, j]], preferred_element_type=jnp.float32)
        want = want + y * w[:, j:j + 1]
    for lay in ("k4", "k4r"):
        assert np.isfinite(np.asarray(got[lay], np.float32)).all(), lay
        assert rel(got[lay], want) < 1e-2, (shape, lay)
        assert rel(got[lay], got["kn"]) < 1e-3, (shape, lay)


@pytest.mark.parametrize("split", [2, 3])
def test_down_split_k_equals_one_slice(split):
    """The down kernel's contraction cut into slices (MoeGemmConfig.down_split_k, and 5: four slices of K3's 24
    steps of 5 and a last of 4) on the device, bf16 and k4r experts at K3 widths and a K3 EP16 shard's decode
    occupancy (16 tokens, top 16 of 16 x 14 experts kept where local: ~1 row per active expert; 14 rather than 56
    experts so the host-side quantisation takes seconds, not minutes): equal to one slice up to the fp32 summation
    order, after which an output may round to the neighbouring bf16 (1e-3 norm-wise) -- a slice that ran the wrong
    steps, or stored into another slice's rows, would differ by ~1."""
    e, k, i, tokens, top_k = 14, 3584, 3072, 16, 16
    rng = np.random.default_rng(8)
    picks = np.stack([rng.choice(16 * e, top_k, replace=False) for _ in range(tokens)])
    ids = jnp.asarray(np.where(picks < e, picks, picks[:, :1] % e).astype(np.int32))
    w = jnp.asarray(rng.uniform(0.1, 1, ids.shape), jnp.float32)
    x = jax.random.normal(jax.random.key(12), (tokens, k)).astype(jnp.bfloat16)
    bf16 = _experts(e, k, i, 5)
    packed = {}
    for name, v in bf16.items():
        p, s = moe_gemm_quantize(v)
        packed[name] = moe_gemm.prepare_mxfp4({"packed": p, "scale": s}, layout="k4r")
    for experts in (bf16, packed):
        one = moe_gemm.moe_grouped_mlp(x, ids, w, experts, config=moe_gemm.DECODE_CONFIG)
        for parts in (split, 5):
            config = dataclasses.replace(moe_gemm.DECODE_CONFIG, down_split_k=parts)
            got = moe_gemm.moe_grouped_mlp(x, ids, w, experts, config=config)
            assert np.isfinite(np.asarray(got, np.float32)).all()
            assert rel(got, one) < 1e-3, parts


def test_model_moe_op_on_kernel_layout_experts():
    """The model's registered "pallas" moe_experts op (what k3jax.moe.moe calls) on quantised experts in the kernel
    layout, as load_pretrained(experts="kernel") holds them, at K3 widths and 7 decode tokens: equal (1e-2, the
    bf16 band above) to the reference op on the same experts (which re-packs them to the checkpoint's layout and
    dequantises) and to the reference op on the checkpoint layout."""
    from k3jax import backend

    e, k, i, tokens, top_k = 6, 3584, 3072, 7, 4
    rng = np.random.default_rng(3)
    ids = jnp.asarray(np.stack([rng.choice(e, top_k, replace=False) for _ in range(tokens)]).astype(np.int32))
    w = jnp.asarray(rng.uniform(0.1, 1, ids.shape), jnp.float32)
    x = jax.random.normal(jax.random.key(3), (tokens, k)).astype(jnp.bfloat16)
    checkpoint = {}
    for name, v in _experts(e, k, i, 4).items():
        p, s = moe_gemm_quantize(v)
        checkpoint[name] = {"packed": p, "scale": s}
    cfg = load_config("k3").replace(num_experts=e, num_experts_per_tok=top_k)
    want = grouped_experts_reference(x, ids, w, checkpoint, cfg)
    for layout in ("k4", "kn"):  # k4: what load_pretrained(experts="kernel") holds
        kernel = {n: moe_gemm.prepare_mxfp4(v, layout) for n, v in checkpoint.items()}
        got = backend.get("moe_experts", "pallas")(x, ids, w, kernel, cfg)
        assert np.isfinite(np.asarray(got, np.float32)).all(), layout
        assert rel(got, want) < 1e-2, layout
        np.testing.assert_array_equal(np.asarray(grouped_experts_reference(x, ids, w, kernel, cfg), np.float32),
                                      np.asarray(want, np.float32))


def moe_gemm_quantize(w):
    from k3jax.quant import mxfp4_quantize

    p, s = mxfp4_quantize(np.swapaxes(np.asarray(w, np.float32), -1, -2))
    return jnp.asarray(p), jnp.asarray(s)


def test_fused_norms_match_xla():
    keys = jax.random.split(jax.random.key(1), 12)
    sources = [(jax.random.normal(keys[j], (300, 7168)) * (1 + j)).astype(jnp.bfloat16) for j in range(9)]
    proj, norm, ow = ((1 + 0.1 * jax.random.normal(keys[9 + j], (7168,))).astype(jnp.bfloat16) for j in range(3))
    mix, normed = fused_norm.attn_res_mix_norm(sources, proj, norm, ow, 1e-5, with_mix=True)
    ref_mix, ref_normed = attn_res_mix_norm_unfused(sources, proj, norm, ow, 1e-5)
    assert rel(mix, ref_mix) < 1e-2 and rel(normed, ref_normed) < 1e-2
    small = [(s[:64, :2048] * (1 + 0.5 * j)).astype(jnp.bfloat16) for j, s in enumerate(sources[:6])]  # decode batch
    for rows in (None, 2, 4):  # default: one row per program at 64 rows; 4 was the budget-only rule's
        _, got = fused_norm.attn_res_mix_norm(small, proj[:2048], norm[:2048], ow[:2048], 1e-5, block_rows=rows)
        assert rel(got, attn_res_mix_norm_unfused(small, proj[:2048], norm[:2048], ow[:2048], 1e-5)[1]) < 1e-2
    x = jax.random.normal(keys[0], (77, 96, 128)).astype(jnp.bfloat16)
    g = jax.random.normal(keys[1], (77, 96, 128)).astype(jnp.bfloat16)
    got = fused_norm.gated_rms_norm(x, g, proj[:128], 1e-5)
    want = gated_rms_norm(x, g, proj[:128], 1e-5)
    assert rel(got, want) < 1e-2
    q, scale = fused_norm.gated_rms_norm(x, g, proj[:128], 1e-5, fp8=True)
    assert rel(q.astype(jnp.float32) * scale[..., None], want) < 5e-2  # e4m3: 3 mantissa bits


def test_k3_small_decode_layer_fused_pallas_matches_unfused_reference():
    """One k3-small MoE layer on a 64-token decode batch (192 experts, top-8: 512 rows, most experts 0-6 rows, the
    in-kernel work items over 256-wide bounds vectors), with fused projections (the experts read the latent
    columns of the fused GEMM's output in place) on the Pallas experts, against the unfused layer on the reference
    op: 1e-2 (the bf16 band above; FUSED_OUT also rounds once instead of three times)."""
    from k3jax.moe import fuse_moe_weights, moe
    from k3jax.params import init_params

    cfg = load_config("k3-small")
    small = cfg.replace(num_layers=2, mla_layers=())  # layer 1 is an MoE layer with k3-small's shapes
    layer = init_params(small, jax.random.key(5))["layers"][1]["mlp"]
    x = jax.random.normal(jax.random.key(6), (64, 1, cfg.hidden_size)).astype(jnp.bfloat16)
    want = jax.jit(lambda p, x: moe(p, x, cfg))(layer, x)
    got = jax.jit(lambda p, x: moe(p, x, cfg, backend_name="pallas"))(fuse_moe_weights(layer, cfg), x)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert rel(got, want) < 1e-2


@pytest.mark.parametrize("tokens,top_k,k_dim,width,slices", [(64, 8, 1024, 1024, 1), (40, 16, 3584, 6144, 2)])
def test_moe_combine_compiled_equals_reference(tokens, top_k, k_dim, width, slices):
    """pallas_kernels/moe_combine.py compiled: k3-small's decode shape (64 tokens, top-8, latent 1024, shared 1024) and
    K3's widths (latent 3584 and shared 6144: seven and six power-of-two chunks; top-16, two down slices), dropped
    slots holding NaN, against its jnp reference on the same device. The sums are the same fp32 adds in the same
    order; the outputs are bf16, so 1e-2 (one rounding step where the norm's reduction order tips it)."""
    from pallas_kernels import moe_combine

    keys = jax.random.split(jax.random.key(tokens), 4)
    rows = jax.random.normal(keys[0], (slices, tokens * top_k, k_dim), jnp.float32)
    ids = jax.random.randint(keys[1], (tokens, top_k), -3, 50).astype(jnp.int32)  # ~6 % dropped
    rows = jnp.where((ids.reshape(-1) < 0)[None, :, None], jnp.nan, rows)
    shared = (jax.random.normal(keys[2], (tokens, k_dim + 2 * width)) * 2).astype(jnp.bfloat16)
    norm = (1 + 0.1 * jax.random.normal(keys[3], (k_dim,))).astype(jnp.bfloat16)
    kw = dict(k_dim=k_dim, dtype=jnp.bfloat16, norm_weight=norm, eps=1e-5, shared=shared,
              shared_columns=(k_dim, k_dim + width, width))
    got = moe_combine.moe_combine(rows, ids, **kw)
    want = jax.jit(lambda r, i: moe_combine.moe_combine_reference(r, i, **kw))(rows, ids)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert rel(got, want) < 1e-2
    assert rel(got[:, :k_dim], want[:, :k_dim]) < 1e-2 and rel(got[:, k_dim:], want[:, k_dim:]) < 1e-2
