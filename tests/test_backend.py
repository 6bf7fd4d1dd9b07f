"""The backend registry: fallback to the reference, restriction to some ops (bisection), twins of fused ops."""

import pytest

import k3jax  # noqa: F401 -- registers the model's ops
from k3jax import backend


def test_restricted_hides_the_other_ops_and_restores_them():
    before = {op: set(backend.implemented(op)) for op in ("moe_experts", "kda_decode_fused", "attn_res_mix_norm")}
    assert all("pallas" in impls for impls in before.values())
    with backend.restricted("pallas", ("moe_experts",)):
        assert "pallas" in backend.implemented("moe_experts")
        assert "pallas" not in backend.implemented("kda_decode_fused")
        assert backend.get("attn_res_mix_norm", "pallas") is backend.get("attn_res_mix_norm", "reference")
        assert "interpret" in backend.implemented("kda_decode_fused")  # other backends untouched
    assert {op: set(backend.implemented(op)) for op in before} == before


def test_restricted_rejects_ops_the_backend_lacks():
    with pytest.raises(ValueError, match="no implementation"):
        with backend.restricted("pallas", ("kda_recurrent",)):
            pass
    with pytest.raises(ValueError, match="unknown backend"):
        with backend.restricted("cuda", ()):
            pass


def test_twin_of_fused_ops_and_of_plain_ops():
    from pallas_kernels.kda_decode import kda_decode_reference

    assert backend.twin("kda_decode_fused") is kda_decode_reference
    assert backend.twin("moe_experts") is backend.get("moe_experts", "reference")
    assert "reference" not in backend.implemented("kda_chunked_fused")  # a twin does not change the reference path
    with pytest.raises(KeyError):
        backend.twin("no_such_op")


def test_unregister_falls_back_to_the_reference(monkeypatch):
    monkeypatch.setattr(backend, "_REGISTRY", dict(backend._REGISTRY))  # restored after the test
    kernel = backend.get("moe_experts", "pallas")
    assert kernel is not backend.get("moe_experts", "reference")
    backend.unregister("moe_experts", "pallas")
    assert backend.get("moe_experts", "pallas") is backend.get("moe_experts", "reference")
    assert "pallas" not in backend.implemented("moe_experts") and "interpret" in backend.implemented("moe_experts")
    backend.unregister("moe_experts", "pallas")  # absent: nothing to do
    backend.register("moe_experts", "pallas")(kernel)
    assert backend.get("moe_experts", "pallas") is kernel
    with pytest.raises(ValueError, match="unknown backend"):
        backend.unregister("moe_experts", "cuda")
