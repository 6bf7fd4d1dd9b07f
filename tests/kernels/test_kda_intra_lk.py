"""KDA stage 1 as two Pallas kernels (`kda_intra_lk` by 16-row blocks, then `kda_intra_wu`; interpret mode on
CPU) against their plain-jnp references, against the XLA stage they replace (`_intra_stage_v2`, whose outputs
the state passes consume), and end to end through `kda_chunk(stage1="pallas2")`.

Run: python -m pytest -q tests/kernels/test_kda_intra_lk.py
Tolerances. fp32: every dot IEEE fp32, so the kernels differ from the references only in summation order
(factored vs pairwise decays, the split factor e^(P_b - P_j) e^(P_j - G_s) vs one exp, block substitution vs
triangular solve): ~1e-7 measured (2e-6 for W in the weak-decay case: A's entries grow with correlated
keys), 1e-5 leaves margin while a wrong decay reference, mask or off-by-one row gives >= 1e-2. bf16: the L /
Aqk / W / U operands and the outputs are rounded to bf16 as v2 rounds them, so against v2 the bar is 4e-3
(one bf16 rounding, 2^-9 relative per element, in norm; the earlier blocks' column operands are rounded
twice with keep="stored"); against the fp32 reference the operand roundings add up (3.5e-3 measured for
Aqk), so 1e-2. End to end as tests/kernels/test_kda_chunk.py (2e-5 fp32).
Small head dims (32/16), K slices of 16 (two per row) and one compile per case keep interpret mode inside
the CI budget.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda_chunk as kc
from pallas_kernels.kda_intra_lk import kda_intra_lk, kda_intra_lk_reference
from pallas_kernels.kda_intra_wu import kda_intra_wu, kda_intra_wu_reference
from test_kda_intra import packed, rel  # same inputs (tests/kernels is on sys.path under pytest)

LENS = [1, 63, 0, 64, 65, 200]  # the ragged lengths, one empty sequence, several chunks in one


@functools.lru_cache(maxsize=None)
def _case(dtype_name, h, lower_bound, block_k, keep):
    dtype = jnp.bfloat16 if dtype_name == "bf16" else jnp.float32
    x, _, a_log, dt_bias, tok_start, length = packed(h, LENS, h, 32, 16, dtype)
    kw = dict(lower_bound=lower_bound, beta_sigmoid=True, qk_l2norm=True)
    stored = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32
    args = (tok_start, length, x["q"], x["k"], x["z"], x["beta"], a_log, dt_bias)
    lk = kda_intra_lk(*args, **kw, stored=stored, block_k=block_k, keep=keep, interpret=True)
    lk_want = kda_intra_lk_reference(*args, **kw, stored=stored)
    wu = kda_intra_wu(tok_start, length, x["v"], lk[0], lk[1], interpret=True)
    wu_want = kda_intra_wu_reference(tok_start, length, x["v"], lk[0], lk[1])
    v2 = kc._intra_stage_v2(tok_start, length, x["q"], x["k"], x["v"], x["z"], x["beta"], a_log, dt_bias,
                            gate="lower_bound", scale=32**-0.5, bounded=True, stored=stored, **kw)
    return lk, lk_want, wu, wu_want, v2, length


# interpret mode compiles the unrolled kernel once per call (~9 s per K slice of the body): one two-slice case
@pytest.mark.parametrize("dtype_name,h,lower_bound,block_k,keep", [
    ("f32", 2, -5.0, 32, "stored"), ("bf16", 3, -0.05, 16, "stored")])
def test_matches_reference_and_v2_stage(dtype_name, h, lower_bound, block_k, keep):
    """Each kernel's outputs against its reference, and the pair's six stage outputs against v2's, on ragged
    chunks (lengths 1, 63, 64, 65, 200 and unused table rows), 2-3 heads, keys correlated through a shared
    direction (L near beta: what breaks an unstable inverse), the steepest allowed bound (-5: within-block
    factors up to e^80) and a weak decay (-0.05), K in one slice or two (bf16 keys kept in bf16)."""
    lk, lk_want, wu, wu_want, v2, length = _case(dtype_name, h, lower_bound, block_k, keep)
    bf16 = dtype_name == "bf16"
    lk_names = ("a_beta", "kw", "qg", "kg", "aqk", "gate_last")
    for name, g, w in zip(lk_names + ("w", "u"), lk + wu, lk_want + wu_want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        g32 = np.asarray(g, np.float32)
        assert np.all(np.isfinite(g32)), name
        bar = 1e-5 if not bf16 else (1e-2 if name in lk_names else 4e-3)  # wu: same bf16 operands, fp32 sum
        assert rel(g32, np.asarray(w, np.float32)) < bar, name
    stage = (wu[0], wu[1]) + lk[2:]
    for name, g, w in zip(("w", "u", "qg", "kg", "aqk", "gate_last"), stage, v2):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert rel(np.asarray(g, np.float32), np.asarray(w, np.float32)) < (4e-3 if bf16 else 1e-5), name
    unused = np.asarray(length) == 0  # table rows past the last chunk: zeros, and e^(G_C) = 1
    assert unused.any()
    for g in stage[:5] + (lk[0],):
        assert not np.any(np.asarray(g, np.float32)[:, unused])
    np.testing.assert_array_equal(np.asarray(stage[5])[:, unused], 1.0)


def test_kda_chunk_pallas2_stage_end_to_end():
    """kda_chunk(stage1="pallas2") = kda_chunk_reference: ragged lengths with an empty sequence, non-zero
    initial states, unaligned absolute start positions, checkpoints every 128 tokens, 2 heads."""
    lens = [1, 63, 0, 64, 65, 300]  # 1000 tokens run in test_kda_chunk's ragged case (same state pass)
    x, cu, a_log, dt_bias, _, _ = packed(12, lens, 2, 16, 16, jnp.float32, a_log_max=1.0)
    rng = np.random.default_rng(2)
    s0 = jnp.asarray(rng.standard_normal((len(lens), 2, 16, 16)).astype(np.float32))
    start = jnp.asarray([0, 5, 9, 64, 100, 37], jnp.int32)
    kw = dict(a_log=a_log, dt_bias=dt_bias.reshape(-1), gate="lower_bound", beta_sigmoid=True, qk_l2norm=True,
              start_positions=start, checkpoint_page_size=128)
    args = (x["q"], x["k"], x["v"], x["z"], x["beta"], s0, cu)
    o, final, ckpt = kc.kda_chunk(*args, stage1="pallas2", interpret=True, **kw)
    ro, rfinal, rckpt = kc.kda_chunk_reference(*args, **kw)
    off = np.asarray(kc.checkpoint_offsets(cu, start, 128))
    assert rel(o, ro) < 2e-5
    for i in range(len(lens)):  # per sequence: a wrong short sequence cannot hide in the norm
        assert rel(final[i], rfinal[i]) < 2e-5, i
    for r in range(off[-1]):
        assert rel(ckpt[r], rckpt[r]) < 2e-5, r
    np.testing.assert_array_equal(final[2], s0[2])  # the empty sequence keeps its state exactly


def test_bad_arguments_raise():
    x, _, a_log, dt_bias, tok_start, length = packed(7, [3], 1, 16, 16, jnp.float32)
    args = (tok_start, length, x["q"], x["k"], x["z"], x["beta"], a_log, dt_bias)
    with pytest.raises(ValueError, match="gate must be"):
        kda_intra_lk(*args, gate="softplus", interpret=True)
    with pytest.raises(ValueError, match="lower_bound must be"):
        kda_intra_lk(*args, lower_bound=-6.0, interpret=True)
    with pytest.raises(ValueError, match="inverse_precision"):
        kda_intra_lk(*args, inverse_precision="tf32", interpret=True)
    with pytest.raises(ValueError, match="block_k"):
        kda_intra_lk(*args, block_k=24, interpret=True)
    with pytest.raises(ValueError, match="keep"):
        kda_intra_lk(*args, keep="bf16", interpret=True)
    ab = jnp.zeros((1, 3, 64, 64), jnp.float32)
    kw_ = jnp.zeros((1, 3, 64, 16), jnp.float32)
    with pytest.raises(ValueError, match="a_beta must be"):
        kda_intra_wu(tok_start, length, x["v"], ab.astype(jnp.bfloat16), kw_, interpret=True)
    with pytest.raises(ValueError, match="token_start"):
        kda_intra_wu(tok_start[:2], length, x["v"], ab, kw_, interpret=True)

    from k3jax.testing import load_benchmark_script  # the benchmark's variant names for this stage parse

    bench = load_benchmark_script("kda")
    assert bench.pallas2_stage1_knobs("pallas2") == dict(num_warps=8, block_k=128, wu_num_warps=4,
                                                         inverse_precision="ieee", keep="stored")
    assert bench.pallas2_stage1_knobs("pallas2_wu8_k32_tf32x3_w4_f32keep") == dict(
        num_warps=4, block_k=32, wu_num_warps=8, inverse_precision="tf32x3", keep="f32")
    assert bench.pallas_stage1_knobs("pallas_w8_blocks")["inverse_precision"] == "blocks"
    for bad in ("pallas2_x8", "pallas2_tf32", "pallas2_blocks"):
        with pytest.raises(ValueError, match="unknown knob"):
            bench.pallas2_stage1_knobs(bad)


def test_lowers_to_triton_for_an_h200():
    """Both kernels lower through Pallas's Triton path for an abstract H200 on this CPU at D128 (bf16, the
    benchmark's knobs): catches unsupported primitives before device time (Triton's own compile to PTX only
    happens on a GPU; docs/results/kda_intra2_ptxas_sm90a_2026-11-30g.json has an offline one)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    spec = jax.ShapeDtypeStruct
    t, h, d, nc = 4096, 4, 128, 66
    i32 = (spec((nc,), jnp.int32),) * 2
    lk_args = i32 + (spec((t, h, d), jnp.bfloat16),) * 3 + (
        spec((t, h), jnp.float32), spec((h,), jnp.float32), spec((h, d), jnp.float32))
    wu_args = i32 + (spec((t, h, d), jnp.bfloat16), spec((h, nc, 64, 64), jnp.bfloat16),
                     spec((h, nc, 64, d), jnp.bfloat16))
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
        for fn, args in ((lambda *a: kda_intra_lk(*a, num_warps=8, block_k=64, inverse_precision="tf32x3"), lk_args),
                         (lambda *a: kda_intra_wu(*a, num_warps=4), wu_args)):
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1
