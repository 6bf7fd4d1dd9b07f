"""The model with the MLA kernels (backend "interpret") equals the reference backend.

Run: python -m pytest -q tests/kernels/test_mla_model.py

k3-tiny cut to 4 layers (MLA at 1 and 3, AttnRes blocks of 2: compile time is this test's cost) with latent
widths the Triton tiling takes (kv_lora_rank 32, rope 16; the stock 24 / 8 fall back to the reference) and
16-token pages. The state starts as a random prefix already cached (random latents in every page, random
KDA/conv states: the backends only need the same start). From copies of it both backends prefill a ragged
chunk on top of prefixes of 21 and 17 tokens (the prefix hit: mla_prefill, the chunk starting mid-page),
then decode a token (mla_decode, q_len 1, device-side balanced plan). q_len > 1 decode (the draft's causal
mask) is covered at kernel level in test_mla_decode.py.

Tolerance: the model is fp32 and the kernels then multiply in fp32 (no bf16 rounding), so the backends
differ by summation order only (~1e-6 relative on logits, as tests/model/test_model.py); 1e-5 relative.
"""

import jax
import jax.numpy as jnp
import numpy as np

import k3jax
from k3jax import backend
from k3jax.testing import k3_tiny, shuffled_page_tables, step_meta

PAGE = 16


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_interpret_backend_matches_reference_prefill_with_prefix_hit_and_decode(monkeypatch):
    assert set(backend.implemented("mla_paged_attention")) >= {"reference", "pallas", "interpret"}
    # Only the MLA op takes its "interpret" kernel here (other ops fall back to their references): this test
    # pins the MLA wiring, and the other kernels' interpret compiles would multiply its run time.
    monkeypatch.setattr(backend, "_REGISTRY", {
        key: fn for key, fn in backend._REGISTRY.items() if key[1] != "interpret" or key[0] == "mla_paged_attention"
    })
    cfg = k3_tiny().replace(name="k3-tiny-mla-kernel", num_layers=4, mla_layers=(1, 3), attn_res_block_size=2,
                            kv_lora_rank=32, qk_rope_head_dim=16)
    params = k3jax.init_params(cfg, jax.random.key(3))
    rng = np.random.default_rng(4)
    b, max_pages = 2, 4
    num_pages = b * max_pages + 3
    table = shuffled_page_tables(rng, b, max_pages, num_pages)
    slots = [2, 0]
    state = k3jax.init_state(cfg, num_slots=3, num_pages=num_pages, page_size=PAGE)
    state = state.replace(**{
        name: jnp.asarray(0.5 * rng.standard_normal(getattr(state, name).shape), getattr(state, name).dtype)
        for name in ("kda", "conv", "kv_pages")
    })
    prefix, chunk = np.array([21, 17]), np.array([13, 9])
    chunk_tokens = rng.integers(0, cfg.vocab_size, (b, 13))
    results = {}
    for name in ("reference", "interpret"):
        st = jax.tree.map(jnp.copy, state)
        logits, st = k3jax.prefill(params, cfg, st, jnp.asarray(chunk_tokens), step_meta(slots, table, prefix, chunk),
                                   all_logits=True, backend_name=name)
        prefill_logits = np.asarray(logits)
        logits, st = k3jax.decode(params, cfg, st, jnp.asarray([7, 11]), step_meta(slots, table, prefix + chunk, [1, 1]),
                                  backend_name=name)
        results[name] = prefill_logits, np.asarray(logits)
    ref, ker = results["reference"], results["interpret"]
    for r in range(b):
        assert rel(ker[0][r, : chunk[r]], ref[0][r, : chunk[r]]) < 1e-5, ("prefill", r)
    assert rel(ker[1], ref[1]) < 1e-5, "decode"
