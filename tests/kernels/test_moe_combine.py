"""pallas_kernels/moe_combine.py in interpret mode: the experts' rows summed per token, the latent RMSNorm and the
shared GLU against the plain-jnp reference and against an independent float64 computation.

Run: python -m pytest -q tests/kernels/test_moe_combine.py

Tolerances: kernel and reference add the same fp32 terms in the same order (slices outer, slots inner) and round
at the same points, so only the norm's mean-of-squares reduction order differs: fp32 2e-6 relative, bf16 one
rounding step of the output (2^-8 relative). Against float64 numpy: fp32 rounding of ~10 sums, the rsqrt and the
GLU's tanh / sigmoid, 2e-5 relative; in bf16 the inputs of the norm and the GLU are rounded to 8 bits, 2e-2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels import moe_combine as mc


def _case(seed, slices, tokens, top_k, k_dim, k_pad, shared_width, cols, dropped):
    """fp32 rows [S, N k, K'] with NaN in the padding columns and in every dropped slot's rows (never written by the
    down kernel: the combine must select them away, not multiply by zero); ids with the given (token, slot)s < 0."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((slices, tokens, top_k, k_pad)).astype(np.float32)
    rows[..., k_dim:] = np.nan
    ids = rng.integers(0, 11, (tokens, top_k)).astype(np.int32)
    for n, j in dropped:
        ids[n, j] = -1
        rows[:, n, j] = np.nan
    norm = (1 + 0.2 * rng.standard_normal(k_dim)).astype(np.float32)
    shared = None
    if shared_width:
        shared = (2.5 * rng.standard_normal((tokens, max(cols) + shared_width + 3))).astype(np.float32)
    return rows.reshape(slices, tokens * top_k, k_pad), ids, norm, shared


def _float64_expected(rows, ids, k_dim, norm, eps, shared, cols, width, activation):
    s, m, _ = rows.shape
    n, k = ids.shape
    r = rows.astype(np.float64).reshape(s, n, k, -1)[..., :k_dim]
    kept = (ids >= 0)[None, :, :, None]
    y = np.where(kept, r, 0.0).sum(axis=(0, 2))
    if norm is not None:
        y = norm * y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)
    if shared is None:
        return y
    gate = shared[:, cols[0]:cols[0] + width].astype(np.float64)
    up = shared[:, cols[1]:cols[1] + width].astype(np.float64)
    sig = 1 / (1 + np.exp(-gate))
    if activation == "silu":
        h = gate * sig * up
    else:
        h = 4.0 * np.tanh(gate / 4.0) * sig * 25.0 * np.tanh(up / 25.0)
    return np.concatenate([y, h], axis=-1)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# (slices, tokens, top_k, K, K', W, (gate column, up column), dropped (token, slot)s, block_rows)
CASES = {
    # two contraction slices, padded rows, the shared columns out of order and unaligned, two dropped slots
    "slices_padded_shared": (2, 5, 3, 48, 64, 24, (70, 9), ((1, 2), (3, 0)), None),
    # k3-small's top-8 at a small width, one token with every slot dropped (its sum is zero: the norm gives 0)
    "top8_all_dropped_token": (1, 7, 8, 36, 36, 40, (36, 76), tuple((4, j) for j in range(8)), None),
    # two tokens per program
    "two_rows_per_program": (1, 6, 2, 40, 40, 20, (40, 60), ((5, 1),), 2),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_reference_and_float64(name, dtype):
    slices, tokens, top_k, k_dim, k_pad, width, cols, dropped, block_rows = CASES[name]
    rows, ids, norm, shared = _case(len(name), slices, tokens, top_k, k_dim, k_pad, width, cols, dropped)
    dt = jnp.dtype(dtype)
    kw = dict(k_dim=k_dim, dtype=dt, norm_weight=jnp.asarray(norm, dt), eps=1e-5,
              shared=jnp.asarray(shared, dt), shared_columns=(*cols, width))
    got = mc.moe_combine(jnp.asarray(rows), jnp.asarray(ids), block_rows=block_rows, interpret=True, **kw)
    want = mc.moe_combine_reference(jnp.asarray(rows), jnp.asarray(ids), **kw)
    assert got.shape == (tokens, k_dim + width) and got.dtype == dt
    unsplit = mc.moe_combine(jnp.asarray(rows), jnp.asarray(ids), block_rows=block_rows, split=False, interpret=True,
                             **kw)
    np.testing.assert_array_equal(np.asarray(unsplit, np.float32), np.asarray(got, np.float32))  # same math
    got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got32).all()
    step = 2e-6 if dtype == "float32" else 2.0 ** -8
    np.testing.assert_allclose(got32, want32, rtol=step, atol=step * np.abs(want32).max())
    expected = _float64_expected(rows, ids, k_dim, np.asarray(jnp.asarray(norm, dt), np.float64), 1e-5,
                                 np.asarray(jnp.asarray(shared, dt), np.float64), cols, width, "situ")
    assert rel(got32, expected) < (2e-5 if dtype == "float32" else 2e-2)
    if any(n == 4 for n, _ in dropped) and top_k == 8:  # the all-dropped token: zero sum, zero normed half
        assert not got32[4, :k_dim].any()


def test_without_norm_or_shared_and_silu():
    """No latent norm (the cast sum itself), no shared block ([N, K] out), and the SwiGLU activation."""
    rows, ids, _, shared = _case(7, 1, 9, 4, 32, 48, 16, (32, 5), ((0, 3), (8, 0)))
    r, i = jnp.asarray(rows), jnp.asarray(ids)
    plain = mc.moe_combine(r, i, k_dim=32, dtype=jnp.float32, interpret=True)
    assert plain.shape == (9, 32)
    np.testing.assert_allclose(plain, _float64_expected(rows, ids, 32, None, 0, None, None, 0, ""), rtol=1e-5,
                               atol=1e-5)
    silu = mc.moe_combine(r, i, k_dim=32, dtype=jnp.float32, shared=jnp.asarray(shared), shared_columns=(32, 5, 16),
                          activation="silu", interpret=True)
    expected = _float64_expected(rows, ids, 32, None, 0, shared, (32, 5), 16, "silu")
    assert rel(silu, expected) < 2e-5


def test_bad_inputs_raise_and_supported_widths():
    rows, ids, norm, shared = _case(3, 1, 4, 2, 16, 16, 8, (16, 24), ())
    r, i = jnp.asarray(rows), jnp.asarray(ids)
    ok = dict(k_dim=16, dtype=jnp.float32, interpret=True)
    bad = [
        (dict(rows=r.astype(jnp.bfloat16)), "fp32"),
        (dict(ids=i[:3]), "ids must be"),
        (dict(k_dim=17), "k_dim"),
        (dict(norm_weight=jnp.ones(8)), "norm_weight"),
        (dict(shared=jnp.asarray(shared)), "come together"),
        (dict(shared=jnp.asarray(shared), shared_columns=(16, 30, 8)), "fall outside"),
        (dict(shared=jnp.asarray(shared), shared_columns=(16, 24, 8), activation="gelu"), "activation"),
        (dict(block_rows=3), "block_rows"),
    ]
    for change, message in bad:
        args = {"rows": r, "ids": i, **ok, **change}
        with pytest.raises(ValueError, match=message):
            mc.moe_combine(args.pop("rows"), args.pop("ids"), **args)
    # compiled (not interpret): widths must split into power-of-two chunks of at least 16
    assert mc.supported(1024, 1024, kept_per_token=8) and mc.supported(3584, 6144)  # k3-small decode; K3's widths
    assert not mc.supported(36) and not mc.supported(1024, 40) and mc.supported(36, 40, interpret=True)
    # ... but a K3 token's 16 x 3584 summed values are past the row-size cut (XLA's fusion is faster there), while
    # an expert-parallel rank's ~2 kept of 16 are not
    assert not mc.supported(3584, 6144, kept_per_token=16) and not mc.supported(1024, kept_per_token=8, slices=4)
    assert mc.supported(3584, kept_per_token=2)
    with pytest.raises(ValueError, match="power-of-two"):
        mc.moe_combine(jnp.zeros((1, 4, 36), jnp.float32), i[:2], k_dim=36, dtype=jnp.float32)


def test_grouped_mlp_combine_modes_agree_and_auto_follows_the_kept_rows(monkeypatch):
    """moe_gemm.moe_grouped_mlp's combine: "kernel" (masked loads: a dropped slot is not read) and "xla" add the same
    fp32 terms in the same order, so they agree to rounding (2e-6; float32 experts), and both match the gathered
    float64-accumulated reference (1e-5). Most slots are dropped, as on an expert-parallel rank. "auto" takes the
    kernel while the expected kept rows per token fit the size cut (MAX_ROW_VALUES, lowered here), XLA beyond it:
    a spy counts the kernel's traces (each expected_rows is a new trace of the jitted function)."""
    from pallas_kernels import moe_gemm

    rng = np.random.default_rng(11)
    n, top_k, e, k_dim, i_dim = 7, 6, 5, 48, 32
    x = jnp.asarray(rng.standard_normal((n, k_dim)), jnp.float32)
    ids = np.where(rng.random((n, top_k)) < 0.7, -1, rng.integers(0, e, (n, top_k))).astype(np.int32)
    ids[0, 0], ids[3] = 2, -1  # some token keeps a pick; token 3 keeps none
    weights = jnp.asarray(rng.uniform(0.1, 0.5, (n, top_k)), jnp.float32)
    experts = {name: jnp.asarray(rng.standard_normal(shape) * shape[1] ** -0.5, jnp.float32)
               for name, shape in (("gate", (e, k_dim, i_dim)), ("up", (e, k_dim, i_dim)), ("down", (e, i_dim, k_dim)))}
    ids = jnp.asarray(ids)
    run = lambda **kw: moe_gemm.moe_grouped_mlp(x, ids, weights, experts, interpret=True, **kw)  # noqa: E731
    by_kernel, by_xla = run(combine="kernel"), run(combine="xla")
    np.testing.assert_allclose(by_kernel, by_xla, rtol=2e-6, atol=2e-6)
    assert rel(by_kernel, moe_gemm.moe_grouped_mlp_reference(x, ids, weights, experts)) < 1e-5
    assert not np.asarray(by_kernel)[3].any()

    calls = []
    real = mc.moe_combine
    monkeypatch.setattr(mc, "moe_combine", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(mc, "MAX_ROW_VALUES", 2 * k_dim)
    run(combine="auto", expected_rows=n * top_k)  # 6 kept rows a token expected: past the lowered cut
    assert not calls
    auto = run(combine="auto", expected_rows=n)  # one a token
    assert calls and rel(auto, by_xla) < 2e-6
    with pytest.raises(ValueError, match="combine"):
        run(combine="triton")


def test_lowers_to_triton_for_an_h200():
    """The compiled kernel (not interpret mode) lowers through Pallas's Triton path for an abstract H200 on this CPU:
    k3-small's decode (norm, shared GLU in programs of their own, 8 warps), its prefill tiling (4 tokens a program),
    and a DEP rank's combine at K3's latent width (masked loads, 7 chunks, no norm). Catches lowering errors before
    device time; Triton's own compile to PTX happens only on a GPU."""
    spec = jax.ShapeDtypeStruct
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    for tokens, top_k, k_dim, with_shared in [(64, 8, 1024, True), (8192, 8, 1024, True), (645, 16, 3584, False)]:
        arrays = {"norm_weight": spec((k_dim,), jnp.bfloat16), "shared": spec((tokens, 3 * k_dim), jnp.bfloat16)}
        static = {"shared_columns": (k_dim, 2 * k_dim, k_dim)} if with_shared else {}

        def fn(rows, ids, arrays, k_dim=k_dim, static=static):
            return mc.moe_combine(rows, ids, k_dim=k_dim, dtype=jnp.bfloat16, **arrays, **static)

        args = (spec((1, tokens * top_k, k_dim), jnp.float32), spec((tokens, top_k), jnp.int32),
                arrays if with_shared else {})
        with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1, (tokens, top_k, k_dim)
