"""Checkpoint I/O (k3jax.weights): orbax round trips, HF safetensors directories in K3 / Kimi-Linear /
transformers-5.x layouts, MXFP4 experts against an independent numpy decoder, and loud failures.

Run: python -m pytest tests/model/test_weights.py -q
"""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from k3jax import forward, load_config, param_shapes
from k3jax.weights import load_checkpoint, load_pretrained, save_checkpoint, save_pretrained

# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # magnitudes of codes 0..7; bit 3 is the sign


def numpy_mxfp4_decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Independent MXFP4 decoder: packed [..., out, in/2], scale [..., out, in/32] -> float32 [..., out, in]."""
    packed = np.asarray(packed, np.uint8)
    n_in = packed.shape[-1] * 2
    codes = np.empty((*packed.shape[:-1], n_in), np.uint8)
    codes[..., 0::2] = packed & 0x0F  # element 2j: low nibble
    codes[..., 1::2] = packed >> 4  # element 2j+1: high nibble
    magnitude = np.asarray(E2M1, np.float32)[codes & 0x7]
    value = np.where(codes & 0x8, -magnitude, magnitude)
    exponent = np.repeat(np.asarray(scale, np.int32) - 127, 32, axis=-1)
    return (value * np.exp2(exponent.astype(np.float64))).astype(np.float32)


def leaves_with_paths(tree):
    return {jax.tree_util.keystr(p): l for p, l in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_trees_bitexact(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    la, lb = leaves_with_paths(a), leaves_with_paths(b)
    for k in la:
        x, y = np.asarray(la[k]), np.asarray(lb[k])
        assert x.dtype == y.dtype, (k, x.dtype, y.dtype)
        assert x.shape == y.shape, (k, x.shape, y.shape)
        assert x.tobytes() == y.tobytes(), k


def random_params(cfg, seed):
    """Fresh random parameters with param_shapes(cfg)'s structure, shapes and dtypes (numpy, fast)."""
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        name = jax.tree_util.keystr(path[-1:])
        if "norm" in name:
            x = 1.0 + 0.1 * rng.standard_normal(s.shape)
        elif "A_log" in name:
            x = rng.uniform(-1.0, 2.0, s.shape)
        elif "conv" in name:
            x = rng.uniform(-0.5, 0.5, s.shape)
        elif "dt_bias" in name or "router_bias" in name:
            x = rng.standard_normal(s.shape)
        else:
            x = 0.02 * rng.standard_normal(s.shape)
        return jnp.asarray(x.astype(np.float32).astype(s.dtype))

    return jax.tree_util.tree_map_with_path(leaf, param_shapes(cfg))


def tokens(cfg, seed, b=2, t=13):
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (b, t)), jnp.int32)


def k3_mxfp4_cfg():
    # MXFP4 groups 32 inputs: expert widths (latent 64 and intermediate 32) must be multiples of 32
    return load_config("k3-tiny").replace(moe_latent_size=64, moe_intermediate_size=32)


def kimi_linear_tiny_cfg():
    return load_config("kimi-linear-48b").replace(
        name="kimi-linear-tiny", vocab_size=263, hidden_size=72, num_layers=7, mla_layers=(3, 6),
        kda_num_heads=3, kda_head_dim=16, kda_gate_rank=16, kda_output_gate_rank=16, mla_num_heads=3,
        kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, intermediate_size=88,
        num_experts=7, num_experts_per_tok=3, moe_intermediate_size=20, bos_token_id=256, eos_token_id=257,
        pad_token_id=258, max_position_embeddings=4096, dtype="float32",
    )


def all_tensors(model_dir):
    """name -> (shard file, array) over every shard of an HF directory."""
    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        for name, arr in load_file(str(file)).items():
            out[name] = (file.name, arr)
    return out


def rewrite_single_file(model_dir, edit):
    """Applies edit(dict name -> array) to a single-file checkpoint."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------
# orbax
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip_bitexact(tmp_path, dtype):
    cfg = load_config("k3-tiny").replace(dtype=dtype)
    params = random_params(cfg, 11)
    save_checkpoint(tmp_path / "ckpt", cfg, params)
    cfg2, params2 = load_checkpoint(tmp_path / "ckpt")
    assert cfg2 == cfg
    assert_trees_bitexact(params, params2)
    if dtype == "bfloat16":
        attn = params2["layers"][0]["attn"]
        assert attn["q_proj"].dtype == jnp.bfloat16 and attn["A_log"].dtype == jnp.float32
    with pytest.raises(ValueError, match="not empty"):
        save_checkpoint(tmp_path / "ckpt", cfg, params)
    save_checkpoint(tmp_path / "ckpt", cfg, params, overwrite=True)


def test_orbax_round_trip_packed_experts(tmp_path):
    cfg = k3_mxfp4_cfg().replace(dtype="bfloat16")
    params = random_params(cfg, 5)
    save_pretrained(tmp_path / "hf", cfg, params, layout="k3", experts="mxfp4")
    cfg_hf, packed = load_pretrained(tmp_path / "hf", experts="packed")
    assert packed["layers"][1]["mlp"]["experts"]["gate"]["packed"].dtype == jnp.uint8
    save_checkpoint(tmp_path / "ckpt", cfg_hf, packed)
    cfg2, packed2 = load_checkpoint(tmp_path / "ckpt")
    assert cfg2 == cfg_hf
    assert_trees_bitexact(packed, packed2)


def test_load_checkpoint_rejects_other_dirs(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path)


# ----------------------------------------------------------------------------------------------
# HF directories: K3 layout with MXFP4 experts
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k3_mxfp4(tmp_path_factory):
    """k3-tiny (MXFP4-able expert widths) saved in K3's layout with MXFP4 experts, sharded."""
    cfg = k3_mxfp4_cfg()
    params = random_params(cfg, 7)
    hf = tmp_path_factory.mktemp("k3_mxfp4")
    save_pretrained(hf, cfg, params, layout="k3", experts="mxfp4", shard_size_bytes=150_000)
    return cfg, params, hf


def test_k3_mxfp4_round_trip_reproduces_logits(k3_mxfp4):
    cfg, params, hf = k3_mxfp4

    # the directory looks like K3's: kimi_k3 config, sharded, language_model.* names, padded A_log,
    # per-expert uint8 weight_packed [out, in/2] + weight_scale [out, in/32]
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["text_config"]["model_type"] == "kimi_linear"
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    tensors = all_tensors(hf)
    assert set(tensors) == set(index["weight_map"])
    assert all(index["weight_map"][n] == f for n, (f, _) in tensors.items())
    P = "language_model.model.layers."
    a_log = tensors[P + "0.self_attn.A_log"][1]
    assert a_log.shape == (128,) and a_log.dtype == np.float32 and not a_log[cfg.kda_num_heads:].any()
    np.testing.assert_array_equal(a_log[: cfg.kda_num_heads], np.asarray(params["layers"][0]["attn"]["A_log"]))
    assert tensors[P + "0.self_attn.q_conv1d.weight"][1].shape == (cfg.kda_proj_size, 1, cfg.kda_conv_kernel)
    assert tensors[P + "2.self_attention_res_proj.weight"][1].shape == (1, cfg.hidden_size)
    w1p = tensors[P + "1.block_sparse_moe.experts.4.w1.weight_packed"][1]
    w2s = tensors[P + "1.block_sparse_moe.experts.4.w2.weight_scale"][1]
    assert w1p.dtype == np.uint8 and w1p.shape == (32, 64 // 2)
    assert w2s.dtype == np.uint8 and w2s.shape == (64, 32 // 32)
    assert "language_model.lm_head.weight" in tensors

    # expected params: the originals with every expert replaced by the numpy decoding of the file's bytes
    expected = jax.tree.map(lambda x: x, params)
    for l, layer in enumerate(expected["layers"]):
        if not cfg.is_moe(l):
            continue
        for ours, hf_name in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            stack = []
            for e in range(cfg.num_experts):
                base = f"{P}{l}.block_sparse_moe.experts.{e}.{hf_name}."
                w = numpy_mxfp4_decode(tensors[base + "weight_packed"][1], tensors[base + "weight_scale"][1])
                stack.append(w.T)
            dense = np.stack(stack)
            orig = np.asarray(layer["mlp"]["experts"][ours])
            assert np.linalg.norm(dense - orig) < 0.2 * np.linalg.norm(orig)  # a real quantisation, right layout
            layer["mlp"]["experts"][ours] = jnp.asarray(dense)

    cfg_d, deq = load_pretrained(hf)
    assert cfg_d == cfg.replace(name=cfg_d.name)
    assert_trees_bitexact(deq, expected)  # non-expert leaves exact, experts bit-equal to the numpy decoder

    toks = tokens(cfg, 1)
    ref = np.asarray(forward(expected, cfg, toks))
    got = np.asarray(forward(deq, cfg, toks))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_k3_mxfp4_packed_matches_dequantized(k3_mxfp4, tmp_path):
    # experts="packed": HF-orientation uint8 stacks equal to the file bytes; same logits as dequantised
    cfg, _, hf = k3_mxfp4
    tensors = all_tensors(hf)
    w1p = tensors["language_model.model.layers.1.block_sparse_moe.experts.4.w1.weight_packed"][1]
    _, deq = load_pretrained(hf)
    toks = tokens(cfg, 1)
    got = np.asarray(forward(deq, cfg, toks))
    _, packed = load_pretrained(hf, experts="packed")
    gate = packed["layers"][1]["mlp"]["experts"]["gate"]
    assert set(gate) == {"packed", "scale"} and gate["packed"].dtype == jnp.uint8
    assert gate["packed"].shape == (cfg.num_experts, 32, 32) and gate["scale"].shape == (cfg.num_experts, 32, 2)
    np.testing.assert_array_equal(np.asarray(gate["packed"][4]), w1p)
    np.testing.assert_array_equal(
        np.swapaxes(numpy_mxfp4_decode(gate["packed"], gate["scale"]), 1, 2),
        np.asarray(deq["layers"][1]["mlp"]["experts"]["gate"]),
    )
    got_packed = np.asarray(forward(packed, cfg, toks))
    np.testing.assert_allclose(got_packed, got, rtol=1e-6, atol=1e-6)

    # writing packed params back gives the same bytes
    save_pretrained(tmp_path / "again", cfg, packed, layout="k3", experts="mxfp4", shard_size_bytes=150_000)
    again = all_tensors(tmp_path / "again")
    assert set(again) == set(tensors)
    for name, (_, arr) in tensors.items():
        assert again[name][1].tobytes() == arr.tobytes(), name


def numpy_kernel_layout_decode(planes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Independent reading of the MoE kernel's MXFP4 layout: planes [E, in/2, out], scales [E, in/32, out] ->
    float32 [E, in, out]. Row 32b + j of the planes holds input 64b + j (low nibble) and 64b + 32 + j (high)."""
    e, half, n_out = planes.shape
    codes = np.empty((e, 2 * half, n_out), np.uint8)
    for b in range(half // 32):
        rows = np.asarray(planes[:, 32 * b:32 * b + 32], np.uint8)
        codes[:, 64 * b:64 * b + 32] = rows & 0x0F
        codes[:, 64 * b + 32:64 * b + 64] = rows >> 4
    magnitude = np.asarray(E2M1, np.float32)[codes & 0x7]
    value = np.where(codes & 0x8, -magnitude, magnitude)
    exponent = np.repeat(np.asarray(scales, np.int32) - 127, 32, axis=1)
    return (value * np.exp2(exponent.astype(np.float64))).astype(np.float32)


def test_k3_mxfp4_kernel_layout_load(k3_mxfp4, tmp_path):
    """experts="kernel": every MoE layer's experts in a MoE kernel word layout, exact: "k4r" for these trained-like
    weights (scales <= 2^1), "k4" for a tensor whose scales exceed it (one expert's weights scaled up in the file);
    re-packed to the checkpoint's layout they are the packed load's bytes (= the file's), decoded
    (moe_gemm.mxfp4_weight_reference) and dequantised (quant.dequantize_experts) they equal the dequantised load bit
    for bit, and they are prepare_mxfp4(.., layout) of the packed load byte for byte; the logits equal the
    dequantised load's; writing kernel-layout params gives the checkpoint's bytes back (mxfp4) or the dequantised
    experts (bf16); orbax keeps them bit-exact. The older "kn" layout stays an accepted input: its planes read independently equal the same
    weights and save_pretrained writes the same bytes from it. Expert widths that are not multiples of 64
    (k3_mxfp4's intermediate 32) are refused."""
    from k3jax.quant import dequantize_experts
    from pallas_kernels.moe_gemm import mxfp4_checkpoint_layout, mxfp4_layout, mxfp4_weight_reference, prepare_mxfp4

    cfg = k3_mxfp4_cfg().replace(moe_intermediate_size=64)  # latent 64, intermediate 64: kernel-layout widths
    params = random_params(cfg, 9)
    big = next(l for l in range(cfg.num_layers) if cfg.is_moe(l))
    gate = params["layers"][big]["mlp"]["experts"]["gate"]
    params["layers"][big]["mlp"]["experts"]["gate"] = gate.at[1].multiply(2.0**12)  # scales past 2^1: k4
    save_pretrained(tmp_path / "hf", cfg, params, layout="k3", experts="mxfp4")
    _, deq = load_pretrained(tmp_path / "hf")
    _, packed = load_pretrained(tmp_path / "hf", experts="packed")
    cfg_k, kernel = load_pretrained(tmp_path / "hf", experts="kernel")
    moe_layers = [l for l in range(cfg.num_layers) if cfg.is_moe(l)]
    assert moe_layers
    kn_params = jax.tree.map(lambda x: x, kernel)  # same leaves, experts swapped to "kn" below
    layouts = {}
    for l in moe_layers:
        experts_kernel = kernel["layers"][l]["mlp"]["experts"]
        dequantised = dequantize_experts(experts_kernel, jnp.float32)
        for name in ("gate", "up", "down"):
            words = experts_kernel[name]
            hf = packed["layers"][l]["mlp"]["experts"][name]
            want = np.asarray(deq["layers"][l]["mlp"]["experts"][name])  # [E, in, out]
            e, n_in, n_out = want.shape
            layout = layouts[l, name] = mxfp4_layout(words)
            assert layout == ("k4" if int(np.asarray(hf["scale"]).max()) > 128 else "k4r"), (l, name)
            key = f"planes_{layout}"
            assert set(words) == {key, "scale_words"}
            assert words[key].dtype == jnp.uint8 and words["scale_words"].dtype == jnp.uint32
            assert words[key].shape == (e, n_in // 8, 4 * n_out)
            assert words["scale_words"].shape == (e, -(-n_in // 128), n_out)
            back = mxfp4_checkpoint_layout({k: np.asarray(v) for k, v in words.items()})
            for k in ("packed", "scale"):
                assert back[k].dtype == np.uint8 and back[k].tobytes() == np.asarray(hf[k]).tobytes(), (l, name, k)
            np.testing.assert_array_equal(np.asarray(mxfp4_weight_reference(words)), want)
            np.testing.assert_array_equal(np.asarray(dequantised[name]), want)
            repacked = prepare_mxfp4(hf, layout=layout)
            for k in (key, "scale_words"):
                assert np.asarray(words[k]).tobytes() == np.asarray(repacked[k]).tobytes(), (l, name, k)
            kn = prepare_mxfp4({k: np.asarray(v) for k, v in hf.items()})
            np.testing.assert_array_equal(numpy_kernel_layout_decode(kn["planes_kn"], kn["scales_gn"]), want)
            kn_params["layers"][l]["mlp"]["experts"][name] = kn
    assert layouts[big, "gate"] == "k4" and set(layouts.values()) == {"k4", "k4r"}
    assert_trees_bitexact(jax.tree.map(np.asarray, kernel["layers"][0]), jax.tree.map(np.asarray, deq["layers"][0]))
    toks = tokens(cfg, 1)
    np.testing.assert_allclose(np.asarray(forward(kernel, cfg_k, toks)), np.asarray(forward(deq, cfg, toks)),
                               rtol=1e-6, atol=1e-6)

    tensors = all_tensors(tmp_path / "hf")
    for params, out in ((kernel, "again"), (kn_params, "again_kn")):
        save_pretrained(tmp_path / out, cfg_k, params, layout="k3", experts="mxfp4")
        again = all_tensors(tmp_path / out)
        assert set(again) == set(tensors)
        for name, (_, arr) in tensors.items():
            assert again[name][1].tobytes() == arr.tobytes(), (out, name)
    save_pretrained(tmp_path / "dense", cfg_k, kernel, layout="k3", experts="bf16")
    w1 = all_tensors(tmp_path / "dense")["language_model.model.layers.1.block_sparse_moe.experts.4.w1.weight"][1]
    np.testing.assert_array_equal(w1, np.asarray(deq["layers"][1]["mlp"]["experts"]["gate"][4]).T)

    save_checkpoint(tmp_path / "ckpt", cfg_k, kernel)
    assert_trees_bitexact(kernel, load_checkpoint(tmp_path / "ckpt")[1])

    # mis-shaped packed leaves are refused in each layout
    l = moe_layers[0]
    for params, key in ((kernel, f"planes_{layouts[l, 'gate']}"), (kn_params, "planes_kn"), (packed, "packed")):
        bad = jax.tree.map(lambda x: x, params)
        gate = dict(bad["layers"][l]["mlp"]["experts"]["gate"])
        gate[key] = gate[key][:, :-1]
        bad["layers"][l]["mlp"]["experts"]["gate"] = gate
        with pytest.raises(ValueError, match="packed experts do not match"):
            save_pretrained(tmp_path / f"bad_{key}", cfg_k, bad, layout="k3", experts="mxfp4")

    with pytest.raises(ValueError, match="multiples of 64"):
        load_pretrained(k3_mxfp4[2], experts="kernel")
    with pytest.raises(ValueError, match="experts must be one of"):
        load_pretrained(tmp_path / "hf", experts="planes")


def test_numpy_decoder_bit_level():
    # hand-made bytes: low nibble is element 2j, high nibble element 2j+1; sign bit 3; scale 2^(s-127)
    packed = np.zeros((1, 16), np.uint8)
    packed[0, 0] = 0x2F  # element 0: code 0xF = -6, element 1: code 0x2 = 1.0
    packed[0, 1] = 0x91  # element 2: code 0x1 = 0.5, element 3: code 0x9 = -0.5
    scale = np.array([[129]], np.uint8)  # x4
    w = numpy_mxfp4_decode(packed, scale)
    np.testing.assert_array_equal(w[0, :4], [-24.0, 4.0, 2.0, -2.0])
    assert not w[0, 4:].any()
    from k3jax.quant import mxfp4_dequantize

    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (5, 3, 48), dtype=np.uint8)
    scale = rng.integers(110, 140, (5, 3, 3), dtype=np.uint8)
    np.testing.assert_array_equal(
        np.asarray(mxfp4_dequantize(jnp.asarray(packed), jnp.asarray(scale), jnp.float32)),
        numpy_mxfp4_decode(packed, scale),
    )


def test_k3_bf16_round_trip_skips_vision_tensors(tmp_path):
    cfg = load_config("k3-tiny").replace(dtype="bfloat16")
    params = random_params(cfg, 2)
    hf = tmp_path / "k3"
    save_pretrained(hf, cfg, params, layout="k3", experts="bf16", shard_size_bytes=100_000)
    # K3 ships a vision tower and projector next to the text model: they are skipped
    save_file({"vision_tower.encoder.blocks.0.wqkv.weight": np.ones((6, 4), ml_dtypes.bfloat16),
               "mm_projector.proj.0.weight": np.ones((4, 4), ml_dtypes.bfloat16)},
              str(hf / "model-vision.safetensors"), metadata={"format": "pt"})
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["vision_tower.encoder.blocks.0.wqkv.weight"] = "model-vision.safetensors"
    index["weight_map"]["mm_projector.proj.0.weight"] = "model-vision.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg2, params2 = load_pretrained(hf)
    assert cfg2 == cfg.replace(name=cfg2.name)
    assert_trees_bitexact(params, params2)
    assert params2["layers"][1]["mlp"]["router_bias"].dtype == jnp.float32
    assert params2["layers"][0]["attn"]["dt_bias"].dtype == jnp.float32
    assert params2["layers"][1]["mlp"]["experts"]["up"].dtype == jnp.bfloat16

    # dtype override: float32 everywhere, cfg follows
    cfg3, params3 = load_pretrained(hf, dtype="float32")
    assert cfg3.dtype == "float32"
    assert all(l.dtype == jnp.float32 for l in jax.tree.leaves(params3))
    np.testing.assert_array_equal(np.asarray(params3["embed"]), np.asarray(params["embed"], np.float32))


# ----------------------------------------------------------------------------------------------
# HF directories: Kimi-Linear layouts
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["kimi_linear", "transformers"])
def test_kimi_linear_round_trip(tmp_path, layout):
    cfg = kimi_linear_tiny_cfg()
    params = random_params(cfg, 13)
    hf = tmp_path / layout
    save_pretrained(hf, cfg, params, layout=layout, shard_size_bytes=120_000)
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "kimi_linear"
    tensors = all_tensors(hf)
    assert all(n.startswith(("model.", "lm_head.")) for n in tensors)
    h, c, w = cfg.kda_num_heads, cfg.kda_proj_size, cfg.kda_conv_kernel
    if layout == "kimi_linear":
        assert "linear_attn_config" in config
        assert tensors["model.layers.0.self_attn.A_log"][1].shape == (1, 1, h, 1)
        assert tensors["model.layers.0.self_attn.g_a_proj.weight"][1].shape == (cfg.kda_head_dim, cfg.hidden_size)
        assert tensors["model.layers.2.block_sparse_moe.experts.6.w2.weight"][1].shape == (72, 20)
    else:
        assert "layer_types" in config and "linear_attn_config" not in config
        assert tensors["model.layers.0.self_attn.forget_gate.A_log"][1].shape == (1, 1, h, 1)
        assert tensors["model.layers.0.self_attn.conv1d.weight"][1].shape == (3 * c, 1, w)
        assert tensors["model.layers.2.mlp.experts.gate_up_proj"][1].shape == (7, 40, 72)
        assert tensors["model.layers.2.mlp.experts.down_proj"][1].shape == (7, 72, 20)
        assert "model.layers.2.mlp.gate.e_score_correction_bias" in tensors
    cfg2, params2 = load_pretrained(hf)
    assert cfg2 == cfg.replace(name=cfg2.name)
    assert_trees_bitexact(params, params2)
    toks = tokens(cfg, 5, b=3, t=9)
    np.testing.assert_array_equal(np.asarray(forward(params2, cfg, toks)), np.asarray(forward(params, cfg, toks)))


def test_transformers_names_map_like_hub_names(tmp_path):
    # the fused runtime tensors hold the same numbers as the per-expert / per-conv hub tensors
    cfg = kimi_linear_tiny_cfg()
    params = random_params(cfg, 17)
    save_pretrained(tmp_path / "hub", cfg, params, layout="kimi_linear", shard_size_bytes=1 << 30)
    save_pretrained(tmp_path / "tf", cfg, params, layout="transformers", shard_size_bytes=1 << 30)
    hub = load_file(str(tmp_path / "hub" / "model.safetensors"))
    tf = load_file(str(tmp_path / "tf" / "model.safetensors"))
    conv = np.concatenate([hub[f"model.layers.1.self_attn.{x}_conv1d.weight"] for x in "qkv"])
    np.testing.assert_array_equal(tf["model.layers.1.self_attn.conv1d.weight"], conv)
    gate_up = tf["model.layers.4.mlp.experts.gate_up_proj"]
    for e in range(cfg.num_experts):
        i = cfg.moe_intermediate_size
        np.testing.assert_array_equal(gate_up[e, :i], hub[f"model.layers.4.block_sparse_moe.experts.{e}.w1.weight"])
        np.testing.assert_array_equal(gate_up[e, i:], hub[f"model.layers.4.block_sparse_moe.experts.{e}.w3.weight"])
        np.testing.assert_array_equal(tf["model.layers.4.mlp.experts.down_proj"][e],
                                      hub[f"model.layers.4.block_sparse_moe.experts.{e}.w2.weight"])
    np.testing.assert_array_equal(tf["model.layers.0.self_attn.forget_gate.dt_bias"], hub["model.layers.0.self_attn.dt_bias"])


# ----------------------------------------------------------------------------------------------
# loud failures
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    cfg = kimi_linear_tiny_cfg()
    d = tmp_path_factory.mktemp("kimi")
    save_pretrained(d, cfg, random_params(cfg, 19), layout="kimi_linear", shard_size_bytes=1 << 30)
    return d


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _pop(name):
    return lambda t: t.pop(name)


def _add(name, shape):
    return lambda t: t.__setitem__(name, np.zeros(shape, np.float32))


def _transpose(name):
    return lambda t: t.__setitem__(name, np.ascontiguousarray(t[name].T))


def _pad_a_log(name):
    def edit(t):
        a = t[name].reshape(-1)
        t[name] = np.concatenate([a, np.array([0.0, 0.5], np.float32)])
    return edit


FAILURES = [
    ("missing", _pop("model.layers.2.self_attn.b_proj.weight"), "model.layers.2.self_attn.b_proj.weight"),
    ("missing expert", _pop("model.layers.5.block_sparse_moe.experts.6.w2.weight"),
     "model.layers.5.block_sparse_moe.experts.6.w2.weight"),
    ("missing head", _pop("lm_head.weight"), "lm_head.weight"),
    ("unexpected", _add("model.layers.0.self_attn.extra.weight", (3,)), "model.layers.0.self_attn.extra.weight"),
    ("unexpected expert", _add("model.layers.1.block_sparse_moe.experts.7.w1.weight", (20, 72)),
     "model.layers.1.block_sparse_moe.experts.7.w1.weight"),
    ("mis-shaped", _transpose("model.layers.3.self_attn.kv_b_proj.weight"), "model.layers.3.self_attn.kv_b_proj.weight"),
    ("mis-shaped expert", _transpose("model.layers.1.block_sparse_moe.experts.0.w1.weight"),
     "model.layers.1.block_sparse_moe.experts.0.w1.weight"),
    ("mis-shaped conv", lambda t: t.__setitem__("model.layers.0.self_attn.q_conv1d.weight",
                                                t["model.layers.0.self_attn.q_conv1d.weight"][:, :, :3].copy()),
     "model.layers.0.self_attn.q_conv1d.weight"),
    ("A_log with nonzero padding", _pad_a_log("model.layers.1.self_attn.A_log"), "model.layers.1.self_attn.A_log"),
]


@pytest.mark.parametrize("what,edit,name", FAILURES, ids=[f[0] for f in FAILURES])
def test_bad_tensor_raises_naming_it(tmp_path, kimi_dir, what, edit, name):
    d = _copy(kimi_dir, tmp_path / "bad")
    rewrite_single_file(d, edit)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_pretrained(d)


def test_missing_shard_and_empty_dir(tmp_path):
    cfg = kimi_linear_tiny_cfg()
    d = tmp_path / "sharded"
    save_pretrained(d, cfg, random_params(cfg, 23), layout="kimi_linear", shard_size_bytes=100_000)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    with safe_open(str(shard), framework="np") as f:
        first = sorted(f.keys())[0]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        load_pretrained(d)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(ValueError, match="model.safetensors"):
        load_pretrained(tmp_path / "empty")
    assert first  # the shard held tensors


def test_writer_argument_checks(tmp_path):
    cfg = load_config("k3-tiny")  # expert widths 36 / 20 are not MXFP4-able
    params = random_params(cfg, 0)
    with pytest.raises(ValueError, match="multiple"):
        save_pretrained(tmp_path / "a", cfg, params, experts="mxfp4")
    with pytest.raises(ValueError, match="layout"):
        save_pretrained(tmp_path / "b", cfg, params, layout="gguf")
    with pytest.raises(ValueError, match="kda_gate"):
        save_pretrained(tmp_path / "c", cfg, params, layout="transformers")
    bad = jax.tree.map(lambda x: x, params)
    bad["layers"][0]["attn"]["q_proj"] = bad["layers"][0]["attn"]["q_proj"][:, :-1]
    with pytest.raises(ValueError, match="q_proj"):
        save_pretrained(tmp_path / "d", cfg, bad)
    with pytest.raises(ValueError, match="experts"):
        load_pretrained(tmp_path, experts="fp8")
