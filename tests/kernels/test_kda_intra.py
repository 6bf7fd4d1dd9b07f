"""KDA stage 1 as one Pallas kernel (`kda_intra`, interpret mode on CPU) against its plain-jnp reference
(pairwise masked decays + triangular solve), against the XLA stage it replaces (`_intra_stage_v2`, whose
outputs the state passes consume), and end to end through `kda_chunk(stage1="pallas")`.

Run: python -m pytest -q tests/kernels/test_kda_intra.py
Tolerances. fp32: every dot IEEE fp32 (interpret mode runs the inverse in IEEE too), so the kernel differs
from the reference only in summation order (factored vs pairwise decays, doubling product vs triangular
solve): ~1e-7 measured, 1e-5 leaves margin while a wrong decay reference, mask or off-by-one row gives
>= 1e-2. bf16: the L / Aqk / W / U operands and the outputs are rounded to bf16 exactly as the v2 stage
rounds them, so against v2 the bound is v2's own against the default stage (4e-3: one bf16 rounding,
2^-9 relative per element, in norm); against the fp32 reference the operand roundings add up (3.5e-3
measured), so 1e-2. End to end as tests/kernels/test_kda_chunk.py (2e-5 fp32).
Small head dims (32/16) and few chunks keep interpret mode inside the CI budget.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda_chunk as kc
from pallas_kernels.kda_intra import kda_intra, kda_intra_reference

LENS = [1, 63, 0, 64, 65, 200]  # the ragged lengths, one empty sequence, several chunks in one


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def packed(seed, lens, h, dk, dv, dtype, a_log_max=2.0):
    """Fresh packed inputs: raw q, k, v, gate input z, beta logits; a = e^a_log up to e^2 makes the bounded
    gate saturate near its bound (g ~ lb = -5 per token: the e^80 diagonal-factor case)."""
    rng = np.random.default_rng(seed)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    t = int(cu[-1])
    arr = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    # keys share a direction per head (k_i . k_j ~ 0.9 after the norm, as real keys correlate): L's entries
    # near 1 make the powers of L grow like binomials, which an unstable inverse (a 64x64 power series)
    # turns into O(1) errors; independent random keys (k_i . k_j ~ K^-1/2) would not show it
    x = dict(q=arr(t, h, dk).astype(dtype), k=(0.3 * arr(t, h, dk) + arr(1, h, dk)).astype(dtype),
             v=arr(t, h, dv).astype(dtype),
             z=(2.0 * arr(t, h, dk)).astype(dtype), beta=arr(t, h))
    a_log = jnp.asarray(rng.uniform(0.0, a_log_max, (h,)).astype(np.float32))
    dt_bias = arr(h, dk)
    n = len(lens)
    _, tok_start, length, _ = kc.chunk_table(cu, jnp.zeros(n, jnp.int32), t // kc.CHUNK + 2 * n, 0)
    return x, cu, a_log, dt_bias, tok_start, length


@functools.lru_cache(maxsize=None)
def _case(dtype_name, h, lower_bound, normalise, inverse):
    dtype = jnp.bfloat16 if dtype_name == "bf16" else jnp.float32
    x, _, a_log, dt_bias, tok_start, length = packed(h, LENS, h, 32, 16, dtype)
    kw = dict(lower_bound=lower_bound, beta_sigmoid=normalise, qk_l2norm=normalise)
    if not normalise:  # the unfused form: q, k already normalised (q scaled), beta in (0, 1)
        f = lambda a: a.astype(jnp.float32)
        x["q"] = (f(x["q"]) * jnp.sum(f(x["q"]) ** 2, -1, keepdims=True) ** -0.5 * 32**-0.5).astype(dtype)
        x["k"] = (f(x["k"]) * jnp.sum(f(x["k"]) ** 2, -1, keepdims=True) ** -0.5).astype(dtype)
        x["beta"] = 1 / (1 + jnp.exp(-x["beta"]))
    args = (tok_start, length, x["q"], x["k"], x["v"], x["z"], x["beta"], a_log, dt_bias)
    got = kda_intra(*args, **kw, inverse_precision=inverse, interpret=True)
    want = kda_intra_reference(*args, **kw)
    stored = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32
    v2 = kc._intra_stage_v2(*args, gate="lower_bound", scale=32**-0.5, bounded=True, stored=stored, **kw)
    return got, want, v2, length


@pytest.mark.parametrize("dtype_name,h,lower_bound,normalise,inverse", [
    ("f32", 2, -5.0, True, "tf32x3"), ("f32", 3, -0.05, False, "blocks"), ("bf16", 1, -5.0, True, "tf32x3"),
    ("bf16", 3, -2.0, True, "blocks")])
def test_matches_reference_and_v2_stage(dtype_name, h, lower_bound, normalise, inverse):
    """All six outputs on ragged chunks (lengths 1, 63, 64, 65, 200 and unused table rows), 1-3 heads, the
    gate / beta / norm fused or precomputed, the steepest allowed bound (-5: within-block factors up to e^80)
    and milder ones; the same shapes, dtypes and (bf16) roundings as the XLA stage the state passes read. Both
    inverses: the masked 64x64 form (IEEE in interpret mode for "tf32x3") and the 16x16-block substitution
    ("blocks", IEEE), the latter on the weak-decay correlated-keys case that broke the one-shot power series."""
    got, want, v2, length = _case(dtype_name, h, lower_bound, normalise, inverse)
    bf16 = dtype_name == "bf16"
    for name, g, w, x in zip(("w", "u", "qg", "kg", "aqk", "gate_last"), got, want, v2):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        g32 = np.asarray(g, np.float32)
        assert np.all(np.isfinite(g32)), name
        assert rel(g32, np.asarray(w, np.float32)) < (1e-2 if bf16 else 1e-5), name
        assert rel(g32, np.asarray(x, np.float32)) < (4e-3 if bf16 else 1e-5), name
    unused = np.asarray(length) == 0  # table rows past the last chunk: zeros, and e^(G_C) = 1
    assert unused.any()
    for g in got[:5]:
        assert not np.any(np.asarray(g, np.float32)[:, unused])
    np.testing.assert_array_equal(np.asarray(got[5])[:, unused], 1.0)


@pytest.mark.parametrize("gate,h", [("lower_bound", 2), ("softplus", 3)])
def test_kda_chunk_pallas_stage_end_to_end(gate, h):
    """kda_chunk(stage1="pallas") = kda_chunk_reference: non-zero initial states, unaligned absolute start
    positions, checkpoints every 128 tokens. The softplus gate is unbounded: stage1="pallas" must route it
    to the XLA stage and still be right."""
    lens = [1, 63, 0, 64, 65, 300]
    x, cu, a_log, dt_bias, _, _ = packed(10 + h, lens, h, 16, 16, jnp.float32, a_log_max=1.0)
    rng = np.random.default_rng(h)
    s0 = jnp.asarray(rng.standard_normal((len(lens), h, 16, 16)).astype(np.float32))
    start = jnp.asarray([0, 5, 9, 64, 100, 37], jnp.int32)
    kw = dict(a_log=a_log, dt_bias=dt_bias.reshape(-1), gate=gate, beta_sigmoid=True, qk_l2norm=True,
              start_positions=start, checkpoint_page_size=128)
    args = (x["q"], x["k"], x["v"], x["z"], x["beta"], s0, cu)
    o, final, ckpt = kc.kda_chunk(*args, stage1="pallas", interpret=True, **kw)
    ro, rfinal, rckpt = kc.kda_chunk_reference(*args, **kw)
    off = np.asarray(kc.checkpoint_offsets(cu, start, 128))
    assert list(np.diff(off)) == [0, 0, 0, 1, 1, 2]
    assert rel(o, ro) < 2e-5
    for i in range(len(lens)):  # per sequence: a wrong short sequence cannot hide in the norm
        assert rel(final[i], rfinal[i]) < 2e-5, i
    for r in range(off[-1]):
        assert rel(ckpt[r], rckpt[r]) < 2e-5, r
    np.testing.assert_array_equal(final[2], s0[2])  # the empty sequence keeps its state exactly


def test_bad_arguments_raise():
    x, _, a_log, dt_bias, tok_start, length = packed(7, [3], 1, 16, 16, jnp.float32)
    args = (tok_start, length, x["q"], x["k"], x["v"], x["z"], x["beta"], a_log, dt_bias)
    with pytest.raises(ValueError, match="gate must be"):
        kda_intra(*args, gate="softplus", interpret=True)
    with pytest.raises(ValueError, match="lower_bound must be"):
        kda_intra(*args, lower_bound=-6.0, interpret=True)
    with pytest.raises(ValueError, match="inverse_precision"):
        kda_intra(*args, inverse_precision="bf16", interpret=True)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_intra(*args[:-1], dt_bias.reshape(-1), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        kda_intra(tok_start, length, *(a[..., :12] for a in (x["q"], x["k"])), x["v"], x["z"][..., :12],
                  x["beta"], a_log, dt_bias[:, :12], interpret=True)
    with pytest.raises(ValueError, match="int32"):
        kda_intra(tok_start.astype(jnp.int16), *args[1:], interpret=True)
    cu = jnp.asarray([0, 3], jnp.int32)
    s0 = jnp.zeros((1, 1, 16, 16), jnp.float32)
    with pytest.raises(ValueError, match="stage1 must be"):
        kc.kda_chunk(x["q"], x["k"], x["v"], x["z"], x["beta"], s0, cu, stage1="pallas3", interpret=True)
    with pytest.raises(ValueError, match="solve must be 'xla'"):
        kc.kda_chunk(x["q"], x["k"], x["v"], x["z"], x["beta"], s0, cu, stage1="pallas", solve="pallas",
                     interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_triton_for_an_h200(dtype):
    """The kernel lowers through Pallas's Triton path for an abstract H200 on this CPU at D128 (both inverse
    precisions): catches unsupported primitives (cumsum, masked packed loads, the tf32x3 dot algorithm) before
    device time; Triton's own compile to PTX only happens on a GPU."""
    import jax
    from jax.sharding import AbstractDevice, AbstractMesh

    spec = jax.ShapeDtypeStruct
    t, h, d, nc = 4096, 4, 128, 66
    args = ((spec((nc,), jnp.int32),) * 2 + (spec((t, h, d), dtype),) * 4
            + (spec((t, h), jnp.float32), spec((h,), jnp.float32), spec((h, d), jnp.float32)))
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    for inverse in ("tf32x3", "ieee", "blocks"):  # "blocks": the model's stage-1 form
        with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
            lowered = jax.jit(lambda *a, i=inverse: kda_intra(*a, inverse_precision=i, num_warps=8)).trace(
                *args).lower(lowering_platforms=("cuda",))
        assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1, inverse


# outputs (w, u, qg, kg, aqk, gate_last) each benchmark-only ablation must leave bit-identical: the parts it
# replaces feed only the others, so this shows each knob cuts what its name says and nothing upstream of it.
# exp, scan and load sit upstream of every output: they run together (each interpret compile costs ~2.5 s)
_UNTOUCHED_BY_SKIP = {("inverse",): {"qg", "kg", "aqk", "gate_last"}, ("wu",): {"qg", "kg", "aqk", "gate_last"},
                      ("lk",): {"qg", "kg", "gate_last"}, ("exp", "scan", "load"): set()}


def test_ablation_skips_run_and_leave_the_default_unchanged():
    """kda_intra's benchmark-only _skip knobs (benchmarks/kda.py "pallas_..._skip-<part>"): the empty set
    traces the default kernel exactly; each part compiles the rest, keeps every output's shape and dtype,
    changes the outputs downstream of it and leaves the others bit-identical; the benchmark's variant names
    parse; unknown parts raise."""
    import jax

    from pallas_kernels import kda_intra as ki

    x, _, a_log, dt_bias, tok_start, length = packed(5, [37], 1, 16, 16, jnp.float32)  # 1 used + 1 unused chunk
    args = (tok_start, length, x["q"], x["k"], x["v"], x["z"], x["beta"], a_log, dt_bias)
    names = ("w", "u", "qg", "kg", "aqk", "gate_last")
    trace = lambda **kw: str(jax.make_jaxpr(lambda *a: kda_intra(*a, interpret=True, **kw))(*args))
    assert trace(_skip=frozenset()) == trace()
    base = kda_intra(*args, interpret=True)
    assert {p for parts in _UNTOUCHED_BY_SKIP for p in parts} == set(ki.SKIPPABLE)
    for parts, untouched in _UNTOUCHED_BY_SKIP.items():
        got = kda_intra(*args, interpret=True, _skip=frozenset(parts))
        for name, g, w in zip(names, got, base):
            assert g.shape == w.shape and g.dtype == w.dtype, (parts, name)
            assert np.array_equal(np.asarray(g), np.asarray(w)) == (name in untouched), (parts, name)
    with pytest.raises(ValueError, match="_skip must be"):
        kda_intra(*args, interpret=True, _skip=frozenset({"dots"}))

    from k3jax.testing import load_benchmark_script

    knobs = load_benchmark_script("kda").pallas_stage1_knobs
    assert knobs("pallas") == dict(num_warps=4, num_stages=1, inverse_precision="tf32x3", _skip=frozenset())
    assert knobs("pallas_w8_s2_tf32_skip-lk+wu") == dict(num_warps=8, num_stages=2, inverse_precision="tf32",
                                                         _skip=frozenset({"lk", "wu"}))
    for bad in ("pallas_x8", "pallas_w4_skip-dots", "pallas_w4_fp16"):
        with pytest.raises(ValueError, match="unknown knob"):
            knobs(bad)


def test_variants_benchmark_smoke():
    """benchmarks/kda_intra_variants.py in interpret mode on a tiny shape (2 sequences x 128 tokens, 1 head, D16):
    the same settings under two names agree exactly, an ablation (skip-inverse) differs from the model's form in W
    and U only, and the table prints."""
    from benchmarks import kda_intra_variants as bench

    names = ["pallas_w8_blocks", "pallas_w4_blocks", "pallas_w8_blocks_skip-inverse"]
    rows = bench.main(["--shape", "2x128x1", "--head-dim", "16", "--variants", ",".join(names), "--trials", "1",
                       "--interpret"])
    assert [r["variant"] for r in rows] == names and all(r["finite"] and r["ms"] > 0 for r in rows)
    assert max(rows[1]["rel_vs_first"].values()) == 0.0  # warps do not exist in interpret mode
    ablated = rows[2]["rel_vs_first"]
    assert ablated["w"] > 1e-3 and ablated["u"] > 1e-3
    assert ablated["qg"] == ablated["kg"] == ablated["aqk"] == ablated["gate_last"] == 0.0
