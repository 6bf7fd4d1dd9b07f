"""The model's prefill / decode / verify with backend="interpret" (the KDA Pallas kernels through the
registry, in interpret mode) against backend="reference".

Run: python -m pytest -q tests/kernels/test_kda_model.py
A 2-layer config (one KDA, one MLA layer) keeps interpret-mode compilation inside the CI budget; depth
adds nothing to what the wiring can get wrong. K3's lower-bound gate only: the softplus form and the
low-rank output gate are the same call with other static arguments (covered by the kernel tests), and a
second config would double this file's share of the CI budget.
Only the KDA ops keep their interpret kernels here (the other ops' kernels fall back to the reference),
so this checks the KDA wiring alone and does not pay for compiling the other kernels in interpret mode.
Tolerance: fp32 logits; the chunked WY form vs the token recurrence and fused vs unfused summation
orders give ~1e-6 relative, so 1e-5 (the model tests' bar) catches any wrong state, slot or mask.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax import backend
from k3jax.testing import k3_tiny, shuffled_page_tables, step_meta

PAGE = 4
CONFIGS = [k3_tiny().replace(num_layers=2, mla_layers=(1,), attn_res_block_size=2, name="k3-tiny-kda1")]


KDA_OPS = ("kda_chunked", "kda_chunked_fused", "kda_decode_fused", "kda_recurrent")


@pytest.fixture(autouse=True)
def kda_kernels_only(monkeypatch):
    registry = {key: fn for key, fn in backend._REGISTRY.items() if key[1] == "reference" or key[0] in KDA_OPS}
    monkeypatch.setattr(backend, "_REGISTRY", registry)
    jax.clear_caches()  # traces made with the full registry must not be reused
    yield
    jax.clear_caches()


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_prefill_decode_verify_interpret_equals_reference(cfg):
    params = k3jax.init_params(cfg, jax.random.key(5))
    rng = np.random.default_rng(0)
    b, prompt, k = 2, np.array([70, 9]), 3  # row 0 crosses a 64-token chunk; row 1 is padded
    t = int(prompt.max())
    tokens = rng.integers(0, cfg.vocab_size, (b, t + k))
    table = shuffled_page_tables(rng, b, -(-(t + k) // PAGE), b * (-(-(t + k) // PAGE)) + 3)
    slots = [2, 0]
    padded = np.where(np.arange(t)[None] < prompt[:, None], tokens[:, :t], cfg.pad_token_id)
    meta = step_meta(slots, table, [0, 0], prompt)
    states = {}
    for name in ("reference", "interpret"):
        state = k3jax.init_state(cfg, num_slots=3, num_pages=table.size + 3, page_size=PAGE)
        logits, state = k3jax.prefill(params, cfg, state, jnp.asarray(padded), meta, all_logits=True, backend_name=name)
        states[name] = (logits, state)
    (ref_logits, ref_state), (int_logits, int_state) = states["reference"], states["interpret"]
    for r in range(b):
        assert rel(int_logits[r, : prompt[r]], ref_logits[r, : prompt[r]]) < 1e-5, r
    assert rel(int_state.kda, ref_state.kda) < 1e-5
    np.testing.assert_array_equal(int_state.conv, ref_state.conv)  # the conv stays in XLA on this path

    pos = prompt.copy()
    nxt = tokens[np.arange(b), pos]
    dec = {}
    for name, state in (("reference", ref_state), ("interpret", int_state)):
        state = jax.tree.map(jnp.copy, state)
        dec[name] = k3jax.decode(params, cfg, state, jnp.asarray(nxt), step_meta(slots, table, pos, [1, 0]),
                                 backend_name=name)
    assert rel(dec["interpret"][0][0], dec["reference"][0][0]) < 1e-5  # row 1 idles (length 0)
    assert rel(dec["interpret"][1].kda, dec["reference"][1].kda) < 1e-5
    assert rel(dec["interpret"][1].conv, dec["reference"][1].conv) < 1e-5
    np.testing.assert_array_equal(dec["interpret"][1].kda[:, 0], int_state.kda[:, 0])  # idle slot untouched

    drafts = np.stack([tokens[r, pos[r] : pos[r] + k] for r in range(b)])
    ver = {}
    for name, state in (("reference", ref_state), ("interpret", int_state)):
        ver[name] = k3jax.verify(params, cfg, jax.tree.map(jnp.copy, state), jnp.asarray(drafts),
                                 step_meta(slots, table, pos, [k, k]), backend_name=name)
    assert rel(ver["interpret"][0], ver["reference"][0]) < 1e-5
    for name in ("err", "key", "decay", "inputs"):  # every position's state update and conv input
        assert rel(getattr(ver["interpret"][2], name), getattr(ver["reference"][2], name)) < 1e-5, name
    np.testing.assert_array_equal(ver["interpret"][1].kda, int_state.kda)  # verify leaves the pool alone


@pytest.mark.parametrize("gate_rank", [14, 16])
def test_decode_through_the_mosaic_kernel_equals_reference(monkeypatch, gate_rank):
    """KDA_DECODE_KERNEL = "mosaic" (the GPU default; here KDA_DECODE_KERNEL_INTERPRET, as the interpret backend
    keeps Triton): the model's decode and verify steps run kda_decode_mgpu (interpreted; K = 128, the size it
    takes) and match the reference path's logits and pools. Two rows in shuffled slots; in decode one idles (its
    slot untouched), in verify one is padded. In the serving layout (k3jax.fuse, what the engine runs) the kernel
    reads beta and the output gate from the fused projection in place (`packed`) when TMA can address the gate's
    column: at gate rank 14 it starts at column 784 (3136 B, on 16 bytes); at 16, column 786 (3144 B) is not, and
    the step hands the kernel the slices instead (the checkpoint layout's path: the kernel gets separate operands;
    the reference runs on the checkpoint-layout params)."""
    from k3jax import fuse
    from k3jax import kda as kda_mod
    from pallas_kernels import kda_decode_mgpu

    calls = []
    real = kda_decode_mgpu.kda_decode_mgpu
    monkeypatch.setattr(kda_decode_mgpu, "kda_decode_mgpu",
                        lambda *a, **k: (calls.append(k.get("packed")), real(*a, **k))[1])
    monkeypatch.setattr(kda_mod, "KDA_DECODE_KERNEL_INTERPRET", "mosaic")
    cfg = CONFIGS[0].replace(kda_head_dim=128, kda_num_heads=2, kda_gate_rank=gate_rank, name="k3-tiny-kda1-d128")
    params = k3jax.init_params(cfg, jax.random.key(6))
    serving = fuse.fuse_for_serving(params, cfg)
    in_place = gate_rank == 14
    rng = np.random.default_rng(1)
    b, prompt = 2, np.array([5, 3])
    tokens = rng.integers(0, cfg.vocab_size, (b, 8))
    table = shuffled_page_tables(rng, b, 2, 2 * b + 3)
    slots = [2, 0]
    padded = np.where(np.arange(5)[None] < prompt[:, None], tokens[:, :5], cfg.pad_token_id)
    state = k3jax.init_state(cfg, num_slots=3, num_pages=table.size + 3, page_size=PAGE)
    _, state = k3jax.prefill(params, cfg, state, jnp.asarray(padded), step_meta(slots, table, [0, 0], prompt),
                             backend_name="reference")
    nxt = tokens[np.arange(b), prompt]
    dec = {}
    for name in ("reference", "interpret"):
        dec[name] = k3jax.decode(serving if name == "interpret" else params, cfg, jax.tree.map(jnp.copy, state),
                                 jnp.asarray(nxt), step_meta(slots, table, prompt, [1, 0]), backend_name=name)
    assert calls, "the decode step did not reach kda_decode_mgpu"
    assert all((packed is not None) == in_place for packed in calls), calls
    assert rel(dec["interpret"][0][0], dec["reference"][0][0]) < 1e-5  # row 1 idles (length 0)
    assert rel(dec["interpret"][1].kda, dec["reference"][1].kda) < 1e-5
    assert rel(dec["interpret"][1].conv, dec["reference"][1].conv) < 1e-5
    np.testing.assert_array_equal(dec["interpret"][1].kda[:, 0], state.kda[:, 0])  # idle slot untouched

    calls.clear()
    drafts = np.stack([tokens[r, prompt[r] : prompt[r] + 3] for r in range(b)])
    ver = {}
    for name in ("reference", "interpret"):
        ver[name] = k3jax.verify(serving if name == "interpret" else params, cfg, jax.tree.map(jnp.copy, state),
                                 jnp.asarray(drafts), step_meta(slots, table, prompt, [3, 2]), backend_name=name)
    assert calls, "the verify step did not reach kda_decode_mgpu"
    assert all((packed is not None) == in_place for packed in calls), calls
    assert rel(ver["interpret"][0][0], ver["reference"][0][0]) < 1e-5
    assert rel(ver["interpret"][0][1, :2], ver["reference"][0][1, :2]) < 1e-5  # row 1's 2 valid drafts
    for name in ("err", "key", "decay", "inputs"):  # every position's state update and conv input
        assert rel(getattr(ver["interpret"][2], name), getattr(ver["reference"][2], name)) < 1e-5, name
