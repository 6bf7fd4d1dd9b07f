"""The decode-size dense GEMM kernel (pallas_kernels/skinny_gemm.py) in Pallas interpret mode against its plain-JAX
reference: odd row counts (padded to the MMA's 16), ragged column counts (masked last tile), split-K partial sums,
leading batch dims, and its argument checks.

Tolerance: both sides accumulate in fp32 and round once to bf16; split-K only reorders fp32 sums, so results agree
within two bf16 ulps of the output's scale (2 * 2^-8 relative).

The model wiring (k3jax.layers.use_dense_kernel("skinny"), the "dense" op of the "interpret" backend): a k3-tiny
variant whose GEMM inputs are multiples of 64 prefills and decodes through the kernel (fp32: the backends differ by
summation order only, 1e-5 relative on logits, as tests/kernels/test_mla_model.py).

Run: python -m pytest -q tests/kernels/test_skinny_gemm.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax import backend, layers
from k3jax.testing import k3_tiny, shuffled_page_tables, step_meta
from pallas_kernels import skinny_gemm
from pallas_kernels.skinny_gemm import MAX_ROWS, SkinnyGemmConfig, default_config, skinny_matmul, skinny_matmul_reference


def operands(seed, lead, k, n, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((*lead, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    return x, w


def assert_close(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    scale = np.abs(want).max()
    assert scale > 0.1  # a real product, not zeros
    np.testing.assert_allclose(got, want, atol=2 * 2**-8 * scale, rtol=0)


@pytest.mark.parametrize("lead, k, n, config", [
    ((5,), 256, 200, SkinnyGemmConfig(block_n=64, block_k=64, split_k=2)),     # ragged N, split K
    ((3, 7), 384, 48, SkinnyGemmConfig(block_n=16, block_k=128, split_k=3)),   # leading dims, 3 slices
    ((64,), 512, 521, None),                                                   # decode rows, default tiling
    ((1,), 128, 100, SkinnyGemmConfig(block_n=32, block_k=128, split_k=1)),   # one row, bf16 store in-kernel
    ((MAX_ROWS,), 192, 80, SkinnyGemmConfig(block_n=32, block_k=64, split_k=1)),
])
def test_matches_reference(lead, k, n, config):
    x, w = operands(sum(lead) + k + n, lead, k, n)
    got = skinny_matmul(x, w, config=config, interpret=True)
    assert got.dtype == x.dtype and got.shape == (*lead, n)
    assert_close(got, skinny_matmul_reference(x, w))


def test_fp32_weights_are_cast_to_the_activation_dtype_as_layers_dense_does():
    x, _ = operands(1, (9,), 128, 72)
    _, w = operands(2, (9,), 128, 72, jnp.float32)
    assert_close(skinny_matmul(x, w, config=SkinnyGemmConfig(block_n=32, block_k=64, split_k=2), interpret=True),
                 skinny_matmul_reference(x, w))


def test_default_config_splits_k_only_while_the_grid_has_fewer_programs_than_sms():
    wide = default_config(64, 2048, 8336)
    assert (wide.block_n, wide.split_k) == (64, 2)  # 131 column tiles
    assert default_config(64, 2048, 163840).split_k == 1  # 2560 tiles: plenty
    small = default_config(64, 2048, 2048)
    assert small.split_k == 8 and 2048 // small.split_k >= 2 * small.block_k  # 32 tiles x 8 slices
    assert default_config(64, 128, 2048).split_k == 1  # K too short to slice
    for m, k, n in ((64, 2048, 8336), (16, 768, 3072), (64, 8192, 2048)):
        cfg = default_config(m, k, n)
        assert k % (cfg.block_k * cfg.split_k) == 0


def test_rejects_bad_arguments():
    x, w = operands(3, (4,), 128, 32)
    with pytest.raises(ValueError, match="last dim"):
        skinny_matmul(x[:, :64], w, interpret=True)
    with pytest.raises(ValueError, match="rows"):
        skinny_matmul(jnp.ones((MAX_ROWS + 1, 128), jnp.bfloat16), w, interpret=True)
    with pytest.raises(ValueError, match="multiple of split_k"):
        skinny_matmul(x, w, config=SkinnyGemmConfig(block_k=64, split_k=4), interpret=True)
    with pytest.raises(ValueError, match="float"):
        skinny_matmul(x.astype(jnp.int32), w, interpret=True)
    with pytest.raises(ValueError, match=r"\[K, N\]"):
        skinny_matmul(x, w[None], interpret=True)


def test_model_decode_through_the_skinny_kernel_equals_the_reference_backend(monkeypatch):
    calls = []

    def counted(x, w, **kw):
        calls.append((x.shape[:-1], w.shape))
        return skinny_matmul(x, w, **kw)

    monkeypatch.setattr(skinny_gemm, "skinny_matmul", counted)
    # no other interpret kernel (their compiles); use_dense_kernel registers into this copy, restored afterwards
    monkeypatch.setattr(backend, "_REGISTRY", {key: fn for key, fn in backend._REGISTRY.items() if key[1] != "interpret"})
    monkeypatch.setattr(layers, "DENSE_DECODE_KERNEL", layers.DENSE_DECODE_KERNEL)
    probe = jnp.ones((3, 64), jnp.float32)
    assert layers.DENSE_DECODE_KERNEL == "xla"  # the default: no kernel registered, the op is plain `dense`
    assert backend.implemented("dense") == ["reference"]
    backend.get("dense", "interpret")(probe, jnp.ones((64, 8), jnp.float32))
    assert calls == []
    with pytest.raises(ValueError, match="dense kernel"):
        layers.use_dense_kernel("cublas")
    layers.use_dense_kernel("skinny")
    assert sorted(backend.implemented("dense")) == ["interpret", "pallas", "reference"]
    layers.use_dense_kernel("xla")
    assert backend.implemented("dense") == ["reference"] and layers.DENSE_DECODE_KERNEL == "xla"
    layers.use_dense_kernel("skinny")
    # every GEMM input width a multiple of 64 (the kernel's K step; narrower or ragged widths stay on `dense`)
    cfg = k3_tiny().replace(name="k3-tiny-skinny-dense", num_layers=4, mla_layers=(1, 3), attn_res_block_size=2,
                            hidden_size=64, kda_num_heads=4, kda_gate_rank=64, q_lora_rank=64, mla_num_heads=4,
                            v_head_dim=16, moe_latent_size=64, moe_intermediate_size=32, intermediate_size=128)
    params = k3jax.init_params(cfg, jax.random.key(5))
    rng = np.random.default_rng(6)
    b, max_pages, page = 2, 4, 16
    num_pages = b * max_pages + 1
    table = shuffled_page_tables(rng, b, max_pages, num_pages)
    slots = [1, 0]
    state = k3jax.init_state(cfg, num_slots=2, num_pages=num_pages, page_size=page)
    chunk = np.array([11, 7])
    tokens = rng.integers(0, cfg.vocab_size, (b, 11))
    results = {}
    for name in ("reference", "interpret"):
        calls.clear()
        st = jax.tree.map(jnp.copy, state)
        logits, st = k3jax.prefill(params, cfg, st, jnp.asarray(tokens), step_meta(slots, table, [0, 0], chunk),
                                   all_logits=True, backend_name=name)
        prefill_calls = len(calls)
        logits_d, st = k3jax.decode(params, cfg, st, jnp.asarray([5, 9]), step_meta(slots, table, chunk, [1, 1]),
                                    backend_name=name)
        results[name] = np.asarray(logits), np.asarray(logits_d), prefill_calls, len(calls) - prefill_calls
    ref, ker = results["reference"], results["interpret"]
    assert ref[2] == ref[3] == 0
    # traced once each: KDA 6 input GEMMs + f_b + o_proj, MLA q_a, kv_a, q_b, g_proj, o_proj, MoE latent/shared
    # and out, the dense MLP's three: well over 20 per program, all on the kernel
    assert ker[2] > 20 and ker[3] > 20, (ker[2], ker[3])
    for r in range(b):
        np.testing.assert_allclose(ker[0][r, : chunk[r]], ref[0][r, : chunk[r]], rtol=0,
                                   atol=1e-5 * np.abs(ref[0]).max())
    np.testing.assert_allclose(ker[1], ref[1], rtol=0, atol=1e-5 * np.abs(ref[1]).max())
