"""Whole-model parity with transformers' KimiLinearForCausalLM (torch, fp32, CPU).

A random 9-layer Kimi-Linear model (KDA everywhere but MLA at 1-based layers 4, 8, 9; dense layer 0, then
MoE with 7 experts, top 3, 2 shared; odd sizes) is built and randomised in torch, saved by transformers'
own `save_pretrained`, read back with `k3jax.weights.load_pretrained`, and both models run the same tokens:
forward logits at T = 70 and 130, and our prefill + decode against transformers' cached greedy generate().
The other direction too: our `save_pretrained` (transformers and hub layouts) read by transformers.

Tolerance: both sides compute in fp32 (unit roundoff 6e-8). What differs is summation order and the
algebraically equal forms of the same maths: the chunked KDA (transformers inverts the 64x64 UT block by
forward substitution, we use a triangular solve), expanded vs latent-space MLA, and the MoE scatter order.
Measured: 2.4e-6 relative on the logits, forward and decode. Changing the decoder-norm eps, the routed
scaling or the renormalisation moves them by 0.1..1, so 1e-4 sits well between. (Effects that random O(1)
activations hide, such as the 1e-6 vs 1e-5 eps of the MLA latent norms, are pinned in test_k3_components.py
with small-RMS inputs.)

Run: K3JAX_TORCH_PYTHON=... python -m pytest tests/parity/test_kimi_linear_model.py -q   (parity_util.py)
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax.testing import shuffled_page_tables, step_meta
from parity_util import rel, torch_refs

pytestmark = pytest.mark.slow

NUM_LAYERS = 9
MLA_1BASED = (4, 8, 9)
CONFIG = dict(
    vocab_size=263,
    hidden_size=45,
    intermediate_size=37,
    moe_intermediate_size=19,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=3,
    num_key_value_heads=3,
    n_shared_experts=2,
    routed_scaling_factor=2.446,
    kv_lora_rank=23,
    q_lora_rank=None,
    qk_rope_head_dim=7,
    v_head_dim=11,
    qk_nope_head_dim=13,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=3,
    num_local_experts=7,
    linear_head_dim=15,
    linear_num_heads=3,
    linear_conv_kernel_dim=4,
    layer_types=["full_attention" if l + 1 in MLA_1BASED else "linear_attention" for l in range(NUM_LAYERS)],
    mlp_layer_types=["dense"] + ["sparse"] * (NUM_LAYERS - 1),
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
)
LENGTHS = (70, 130)  # neither a multiple of the 64-token KDA chunk
PROMPT, NEW = 11, 6
TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = torch_refs()
    rng = np.random.default_rng(2024)
    arrays = {f"tokens_{t}": rng.integers(0, CONFIG["vocab_size"], (2, t)) for t in LENGTHS}
    arrays["prompt"] = rng.integers(0, CONFIG["vocab_size"], (2, PROMPT))
    out_dir = tmp_path_factory.mktemp("kimi_linear_hf")
    out = run("kimi_linear_model", arrays, config=CONFIG, seed=1234, out_dir=str(out_dir), max_new_tokens=NEW)
    # a near-tie in expert selection would let two correct implementations pick different experts
    assert float(out["router_gap"]) > 1e-5, f"seed gives a routing near-tie ({float(out['router_gap']):.2e}); change it"
    return out_dir, arrays, out


@pytest.fixture(scope="module")
def loaded(reference):
    out_dir, _, _ = reference
    return k3jax.load_pretrained(out_dir / "runtime", dtype="float32")


def test_config_is_read_as_kimi_linear(loaded):
    cfg, _ = loaded
    assert cfg.mla_layers == tuple(i - 1 for i in MLA_1BASED)
    assert (cfg.kda_gate, cfg.kda_output_gate_rank, cfg.q_lora_rank, cfg.mla_output_gate) == ("softplus", 15, None, False)
    assert (cfg.hidden_act, cfg.moe_latent_size, cfg.attn_res_block_size) == ("silu", None, None)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_shared_experts, cfg.first_k_dense_replace) == (7, 3, 2, 1)
    assert cfg.routed_scaling_factor == pytest.approx(2.446)
    assert (cfg.rms_norm_eps, cfg.mla_norm_eps) == (1e-5, 1e-6)


@pytest.mark.parametrize("t", LENGTHS)
def test_forward_logits_match_transformers(reference, loaded, t):
    _, arrays, out = reference
    cfg, params = loaded
    ours = np.asarray(k3jax.forward(params, cfg, jnp.asarray(arrays[f"tokens_{t}"], jnp.int32)))
    want = out[f"logits_{t}"]
    assert ours.shape == want.shape
    err = rel(ours, want)
    assert err < TOL, f"T={t}: relative logits error {err:.2e}"
    assert (ours.argmax(-1) == want.argmax(-1)).mean() > 0.99


def test_cached_greedy_decode_matches_transformers_generate(reference, loaded):
    """prefill(prompt) then decode() one token at a time vs transformers' generate() with its cache."""
    _, arrays, out = reference
    cfg, params = loaded
    prompt = arrays["prompt"]
    b = prompt.shape[0]
    want_tokens, want_logits = out["gen_tokens"], out["gen_logits"]  # [B, P+N], [N, B, V]
    page = 4
    rng = np.random.default_rng(5)
    max_pages = -(-(PROMPT + NEW) // page)
    table = shuffled_page_tables(rng, b, max_pages, b * max_pages + 3)
    state = k3jax.init_state(cfg, num_slots=3, num_pages=b * max_pages + 3, page_size=page)
    slots = [2, 0]
    logits, state = k3jax.prefill(params, cfg, state, jnp.asarray(prompt, jnp.int32),
                                  step_meta(slots, table, [0] * b, [PROMPT] * b))
    for i in range(NEW):
        logits = np.asarray(logits)
        err = rel(logits, want_logits[i])
        assert err < TOL, f"step {i}: relative logits error {err:.2e}"
        np.testing.assert_array_equal(logits.argmax(-1), want_tokens[:, PROMPT + i], err_msg=f"greedy token, step {i}")
        if i + 1 < NEW:
            tok = jnp.asarray(want_tokens[:, PROMPT + i], jnp.int32)
            logits, state = k3jax.decode(params, cfg, state, tok, step_meta(slots, table, [PROMPT + i] * b, [1] * b))


def _rename_dense_mlp(src, dst) -> list[str]:
    """Copy of a default transformers save with layer 0's `block_sparse_moe.{gate,up,down}_proj` renamed
    to the hub's `mlp.` names (see test_default_transformers_save_loads)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    renamed = [n for n in tensors if ".block_sparse_moe." in n and ".block_sparse_moe.experts." not in n
               and ".block_sparse_moe.gate." not in n and ".block_sparse_moe.shared_experts." not in n]
    for n in renamed:
        tensors[n.replace(".block_sparse_moe.", ".mlp.")] = tensors.pop(n)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return renamed


def test_hub_layout_names_load_to_the_same_params(reference, loaded, tmp_path):
    """transformers' default save uses the hub names (separate q/k/v convs, A_log [1,1,H,1], experts
    w1/w2/w3, block_sparse_moe.*); once its dense-MLP quirk is undone, they load to exactly the params of the
    runtime-name save."""
    out_dir, _, _ = reference
    renamed = _rename_dense_mlp(out_dir / "default", tmp_path / "hub")
    assert sorted(renamed) == [f"model.layers.0.block_sparse_moe.{p}_proj.weight" for p in ("down", "gate", "up")]
    cfg_hub, params_hub = k3jax.load_pretrained(tmp_path / "hub", dtype="float32")
    cfg, params = loaded
    assert cfg_hub.replace(name=cfg.name) == cfg
    for a, b in zip(jax.tree.leaves(params_hub), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_default_transformers_save_loads(reference, loaded):
    """transformers 5.24.0's default save_pretrained reverts its '.block_sparse_moe.' -> '.mlp.' rename on
    every '.mlp.' tensor, so the dense layer-0 MLP is written as block_sparse_moe.{gate,up,down}_proj;
    load_pretrained accepts that spelling and yields the same parameters."""
    out_dir, _, _ = reference
    cfg_default, params_default = k3jax.load_pretrained(out_dir / "default", dtype="float32")
    cfg, params = loaded
    assert cfg_default.replace(name=cfg.name) == cfg
    for a, b in zip(jax.tree.leaves(params_default), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("layout", ["transformers", "kimi_linear"])
def test_transformers_loads_our_save_pretrained(tmp_path, layout):
    """The other direction: k3jax.weights.save_pretrained writes a Kimi-Linear directory (transformers-5.x
    runtime names, or the hub layout Kimi-Linear-48B ships), transformers' from_pretrained reads it with
    nothing missing or left over, and its logits equal ours."""
    run = torch_refs()
    from k3jax.testing import kimi_linear_tiny
    from k3jax.weights import save_pretrained

    cfg = kimi_linear_tiny().replace(kda_output_gate_rank=16)  # HF ties the output-gate rank to the head dim
    params = _nontrivial(k3jax.init_params(cfg, jax.random.key(8)), seed=8)
    save_pretrained(tmp_path, cfg, params, layout=layout)
    tokens = np.random.default_rng(9).integers(0, cfg.vocab_size, (2, 70))
    ref = run("kimi_linear_from_pretrained", {"tokens": tokens}, model_dir=str(tmp_path))
    import json

    assert json.loads(str(ref["problems"])) == []
    ours = np.asarray(k3jax.forward(params, cfg, jnp.asarray(tokens, jnp.int32)))
    err = rel(ours, ref["logits"])
    assert err < TOL, f"{layout}: relative logits error {err:.2e}"


def _nontrivial(params, seed):
    """Randomised gains, A_log, router bias, 1/sqrt(fan_in) projections (init_params is too tame for parity)."""
    rng = np.random.default_rng(seed)

    def leaf(path, x):
        name = jax.tree_util.keystr(path)
        if name.endswith(("['dt_bias']", "_conv']", "['A_log']")):
            return x  # fla init: A_log = log U(1, 16) for the softplus gate
        if name.endswith("['router_bias']"):
            v = 0.05 * rng.standard_normal(x.shape)
        elif name.endswith("['embed']"):
            v = rng.standard_normal(x.shape)
        elif x.ndim == 1:
            v = 1 + 0.3 * rng.standard_normal(x.shape)
        else:
            v = rng.standard_normal(x.shape) / np.sqrt(x.shape[-2])
        return jnp.asarray(v, x.dtype)

    return jax.tree_util.tree_map_with_path(leaf, params)
