"""k3jax.mla.MLA_DECODE_KERNEL routes the model's MLA decode (registry op "pallas" / "interpret") to the Triton or
the Mosaic GPU kernel of pallas_kernels/mla_decode.py, falling back to Triton where the Mosaic kernel does not take
the sizes. The kernels themselves are checked in test_mla_decode.py; here mla_decode is replaced by a recorder.

Run: python -m pytest -q tests/kernels/test_mla_switch.py
"""

import jax.numpy as jnp
import pytest

from k3jax import backend
from k3jax import mla as k3_mla
from pallas_kernels import mla_decode as md


def route(monkeypatch, kernel: str, *, c_dim=512, r_dim=64, page=64, kv_dtype=jnp.bfloat16, q_len=1):
    """The backend mla_decode is called with by the registry op for these sizes, with MLA_DECODE_KERNEL = kernel."""
    calls = []

    def recorder(q_latent, q_pe, kv_pages, page_table, query_positions, **kw):
        calls.append(kw)
        return jnp.zeros(q_latent.shape, jnp.float32)

    monkeypatch.setattr(md, "mla_decode", recorder)
    monkeypatch.setattr(k3_mla, "MLA_DECODE_KERNEL", kernel)
    b, heads = 2, 16
    op = backend.get("mla_paged_attention", "pallas")
    out = op(jnp.ones((b, q_len, heads, c_dim), jnp.bfloat16), jnp.ones((b, q_len, heads, r_dim), jnp.bfloat16),
             jnp.ones((3, 5, page, c_dim + r_dim), kv_dtype), jnp.zeros((b, 4), jnp.int32),
             jnp.zeros((b, q_len), jnp.int32), kv_lora_rank=c_dim, scale=0.1, layer=1)
    assert out.shape == (b, q_len, heads, c_dim) and len(calls) == 1
    assert calls[0]["layer"] == 1 and calls[0]["interpret"] is False
    return calls[0]["backend"]


def test_default_is_mosaic_on_gpu_triton_in_interpret_and_both_selectable(monkeypatch):
    assert k3_mla.MLA_DECODE_KERNEL == "mosaic" and k3_mla.MLA_INTERPRET_KERNEL == "triton"
    assert route(monkeypatch, "triton") == "triton"
    assert route(monkeypatch, "mosaic") == "mosaic"  # k3-small: 16 heads, 512 + 64 latent, 64-token pages, bf16
    assert route(monkeypatch, "mosaic", page=16, q_len=4) == "mosaic"


def test_mosaic_falls_back_to_triton_where_unsupported(monkeypatch):
    assert route(monkeypatch, "mosaic", kv_dtype=jnp.float32) == "triton"  # bf16 pages only
    assert route(monkeypatch, "mosaic", c_dim=256) == "triton"  # kv_lora_rank 512 only
    assert route(monkeypatch, "mosaic", r_dim=32) == "triton"  # rope a multiple of 64


def test_unknown_kernel_name_is_rejected(monkeypatch):
    with pytest.raises(ValueError, match="MLA_DECODE_KERNEL"):
        route(monkeypatch, "cuda")


def test_interpret_op_follows_its_own_switch(monkeypatch):
    calls = []

    def recorder(q_latent, q_pe, kv_pages, page_table, query_positions, **kw):
        calls.append(kw)
        return jnp.zeros(q_latent.shape, jnp.float32)

    monkeypatch.setattr(md, "mla_decode", recorder)
    op = backend.get("mla_paged_attention", "interpret")
    args = (jnp.ones((2, 1, 16, 512), jnp.bfloat16), jnp.ones((2, 1, 16, 64), jnp.bfloat16),
            jnp.ones((3, 5, 64, 576), jnp.bfloat16), jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 1), jnp.int32))
    op(*args, kv_lora_rank=512, scale=0.1, layer=1)
    monkeypatch.setattr(k3_mla, "MLA_INTERPRET_KERNEL", "mosaic")
    op(*args, kv_lora_rank=512, scale=0.1, layer=1)
    assert [(c["backend"], c["interpret"]) for c in calls] == [("triton", True), ("mosaic", True)]
    monkeypatch.setattr(k3_mla, "MLA_INTERPRET_KERNEL", "cuda")
    with pytest.raises(ValueError, match="MLA_INTERPRET_KERNEL"):
        op(*args, kv_lora_rank=512, scale=0.1, layer=1)
