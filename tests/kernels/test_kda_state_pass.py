"""KDA state passes (fused `kda_state_pass`, split `kda_state_pass_split`) in interpret mode against their
plain-jnp reference, on fresh random stage-1 tensors over a real chunk table.

Run: python -m pytest -q tests/kernels/test_kda_state_pass.py
Inputs: W and kg = e^(G_C - G) K scaled by 0.1 and e^(G_C) in (0.13, 1], so the linear part of the
chunk step S -> S (diag(e^(G_C)) - W^T kg) + U^T kg has norm below 1 and the state stays O(1) over the
~6 chunks of the longest sequence (as real stage-1 tensors keep it); U, e^G Q and Aqk are O(1).
Tolerances: fp32 stored dtype -> IEEE fp32 dots on both sides (HIGHEST), which differ only in summation
order: measured <= 1.3e-7 relative, so 1e-5 leaves margin while a wrong chunk, V-block, mask or
checkpoint row gives O(1). bf16 stored dtype: the kernels round the state and V' to bf16 for each dot
(4e-3 relative per rounding) and the reference does not: measured 2.9e-3, so 2e-2.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda_chunk import checkpoint_offsets, chunk_table, kda_chunk
from pallas_kernels.kda_common import CHUNK, pick_state_tiling
from pallas_kernels.kda_state_pass import kda_state_pass, kda_state_pass_reference
from pallas_kernels.kda_state_pass_split import kda_state_pass_split, kda_state_pass_split_reference

PASSES = {"fused": (kda_state_pass, kda_state_pass_reference),
          "split": (kda_state_pass_split, kda_state_pass_split_reference)}


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def stage_inputs(seed, lens, starts, page, h, dk, dv, dtype):
    """Chunk table of a packed batch plus random stage-1 tensors [H, NC, C, ...] in the stored dtype."""
    rng = np.random.default_rng(seed)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    t, n = int(cu[-1]), len(lens)
    num_chunks = t // CHUNK + 2 * n  # kda_chunk's bound
    table = chunk_table(cu, jnp.asarray(starts, jnp.int32), num_chunks, page)
    arr = lambda scale, *s: jnp.asarray((scale * rng.standard_normal(s)).astype(np.float32))
    aqk = jnp.tril(arr(1.0, h, num_chunks, CHUNK, CHUNK))
    stage = (arr(0.1, h, num_chunks, CHUNK, dk), arr(1.0, h, num_chunks, CHUNK, dv),
             arr(1.0, h, num_chunks, CHUNK, dk), arr(0.1, h, num_chunks, CHUNK, dk), aqk)
    stage = tuple(x.astype(dtype) for x in stage)
    gate_last = jnp.asarray(np.exp(-rng.uniform(0.0, 2.0, (h, num_chunks, dk))).astype(np.float32))
    s0 = arr(1.0, n, h, dv, dk)
    return table + stage + (gate_last, s0), cu, t


@pytest.mark.parametrize("name", ["fused", "split"])
def test_state_pass_ragged_checkpoints(name):
    """Ragged lengths (one empty sequence), unaligned absolute starts, page-128 checkpoints, two V-blocks
    per head: output rows, every final state and every checkpoint row against the reference."""
    lens, starts = [1, 0, 64, 65, 300], [5, 9, 64, 100, 37]
    args, cu, t = stage_inputs(11, lens, starts, 128, h=2, dk=16, dv=32, dtype=jnp.float32)
    kernel, reference = PASSES[name]
    kw = dict(num_tokens=t, checkpoint_page_size=128)
    o, final, ckpt = jax.jit(functools.partial(kernel, block_v=16, interpret=True, **kw))(*args)
    ro, rfinal, rckpt = reference(*args, **kw)
    assert o.shape == (t, 2, 32) and o.dtype == jnp.float32
    for i in range(len(lens)):  # per sequence, so a wrong state in a short one cannot hide
        assert rel(final[i], rfinal[i]) < 1e-5, i
        if lens[i]:
            seg = slice(int(cu[i]), int(cu[i + 1]))
            assert rel(o[seg], ro[seg]) < 1e-5, i
    np.testing.assert_array_equal(final[1], args[-1][1])  # the empty sequence keeps its state exactly
    off = np.asarray(checkpoint_offsets(cu, jnp.asarray(starts, jnp.int32), 128))
    assert list(np.diff(off)) == [0, 0, 1, 1, 2]  # pages 128 | 128 | 128, 256 in (start, start + len]
    for r in range(off[-1]):
        assert rel(ckpt[r], rckpt[r]) < 1e-5, r


def test_state_pass_bf16_no_checkpoints():
    """bf16 stored dtype, odd chunk counts, the default V-block, no checkpoints; both passes agree with the
    reference and (fused vs split differ only in where O is formed) with each other."""
    lens, starts = [130, 7, 200], [0, 3, 64]
    args, cu, t = stage_inputs(12, lens, starts, 0, h=3, dk=32, dv=16, dtype=jnp.bfloat16)
    outs = {}
    for name, (kernel, _) in PASSES.items():
        o, final, ckpt = jax.jit(functools.partial(kernel, num_tokens=t, interpret=True))(*args)
        assert ckpt is None and o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
        outs[name] = o, final
    ro, rfinal, _ = kda_state_pass_reference(*args, num_tokens=t)
    for o, final in outs.values():
        assert rel(o, ro) < 2e-2 and rel(final, rfinal) < 2e-2
    assert rel(outs["fused"][0], outs["split"][0]) < 2e-2


def test_checkpoint_branch_default(monkeypatch):
    """checkpoint_branch=None resolves to the branch exactly when the state is K-first and a page is asked for
    (bf16's default layout with checkpoints; not fp32's V-first, not without a page), and a given value stays."""
    import pallas_kernels.kda_state_pass as state_pass_module

    seen = []
    monkeypatch.setattr(state_pass_module, "_state_call", lambda *a, **kw: seen.append(kw["checkpoint_branch"]))
    for dtype, page, given, want in [(jnp.bfloat16, 64, None, True), (jnp.bfloat16, 0, None, False),
                                     (jnp.float32, 64, None, False), (jnp.bfloat16, 64, False, False)]:
        args, _, t = stage_inputs(13, [70, 9], [0, 5], page, h=1, dk=16, dv=16, dtype=dtype)
        kda_state_pass(*args, num_tokens=t, checkpoint_page_size=page, checkpoint_branch=given, interpret=True)
        assert seen[-1] is want, (dtype, page, given)


# The fused pass's opt-in variants (kda_state_pass keywords), each with the dtype and page it is checked at.
# num_stages only changes Triton's pipelining (ignored in interpret mode): it rides along to show it is accepted.
VARIANTS = [
    (dict(state_layout="k_first"), jnp.float32, 128),
    (dict(state_layout="k_first", output_order="last", checkpoint_branch=True, num_stages=3), jnp.bfloat16, 64),
    (dict(output_order="first", checkpoint_branch=True), jnp.float32, 64),
    (dict(output_order="last", num_stages=3), jnp.bfloat16, 128),
    (dict(state_layout="k_first", block_v=32), jnp.bfloat16, 64),  # the whole V in one program (bf16 rule at 128)
]


@pytest.mark.parametrize("variant,dtype,page", VARIANTS,
                         ids=["k_first-f32", "k_first_last_branch_s3-bf16", "first_branch-f32", "last_s3-bf16",
                              "k_first_whole_v-bf16"])
def test_state_pass_variants(variant, dtype, page):
    """Each opt-in variant of the fused pass against the reference: ragged lengths around the chunk size
    (1, 63, 64, 65, 300), non-zero initial states, checkpoints; tolerances as the module doc (fp32 1e-5,
    bf16 2e-2: the variants reorder dots and transpose the state, they round the same values to bf16)."""
    lens, starts = [1, 63, 64, 65, 300], [0, 70, 64, 100, 37]
    args, cu, t = stage_inputs(21, lens, starts, page, h=2, dk=16, dv=32, dtype=dtype)
    kw = dict(num_tokens=t, checkpoint_page_size=page)
    o, final, ckpt = jax.jit(functools.partial(kda_state_pass, interpret=True, **kw, **{"block_v": 16, **variant}))(
        *args)
    ro, rfinal, rckpt = kda_state_pass_reference(*args, **kw)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert o.dtype == dtype and float(jnp.linalg.norm(args[-1].astype(jnp.float32))) > 0
    for i in range(len(lens)):
        seg = slice(int(cu[i]), int(cu[i + 1]))
        assert rel(o[seg], ro[seg]) < tol, i
        assert rel(final[i], rfinal[i]) < tol, i
    off = np.asarray(checkpoint_offsets(cu, jnp.asarray(starts, jnp.int32), page))
    assert off[-1] >= 4  # several checkpoint rows, from several sequences
    for r in range(off[-1]):
        assert rel(ckpt[r], rckpt[r]) < tol, r


def test_state_pass_bad_arguments_raise():
    args, _, t = stage_inputs(13, [70], [0], 0, h=1, dk=16, dv=16, dtype=jnp.float32)
    first, tok, length, ckpt_idx, w, u, qg, kg, aqk, gate_last, s0 = args
    for kernel in (kda_state_pass, kda_state_pass_split):
        with pytest.raises(ValueError, match="V-first"):
            kernel(*args[:-1], s0.transpose(0, 1, 3, 2)[..., :8], num_tokens=t, interpret=True)
        with pytest.raises(ValueError, match="multiple of 64"):
            kernel(*args, num_tokens=t, checkpoint_page_size=100, interpret=True)
        with pytest.raises(ValueError, match="stored dtype"):
            kernel(first, tok, length, ckpt_idx, w.astype(jnp.bfloat16), u, qg, kg, aqk, gate_last, s0,
                   num_tokens=t, interpret=True)
        with pytest.raises(ValueError, match="gate_last"):
            kernel(*args[:9], gate_last[..., :8], s0, num_tokens=t, interpret=True)
        with pytest.raises(ValueError, match="block_v"):
            kernel(*args, num_tokens=t, block_v=12, interpret=True)
    for bad in (dict(state_layout="kv"), dict(output_order="late"), dict(num_stages=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            kda_state_pass(*args, num_tokens=t, interpret=True, **bad)


def test_kda_chunk_passes_the_variant_keywords(monkeypatch):
    """kda_chunk hands the fused pass's variant keywords to kda_state_pass (caught at trace time: the variants'
    numerics are the tests above) and refuses them with the split pass, which has no such variants."""
    import pallas_kernels.kda_chunk as kda_chunk_module

    class Seen(Exception):
        pass

    def spy(*args, **kw):
        raise Seen(kw)

    monkeypatch.setattr(kda_chunk_module, "kda_state_pass", spy)
    rng = np.random.default_rng(22)
    t, h, d = 70, 1, 16
    q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)).astype(np.float32)) for _ in range(3))
    g = -jnp.abs(jnp.asarray(rng.standard_normal((t, h, d)).astype(np.float32)))  # gate="none": log decay <= 0
    beta = jnp.full((t, h), 0.5, jnp.float32)
    s0 = jnp.ones((1, h, d, d), jnp.float32)
    cu = jnp.asarray([0, t], jnp.int32)
    variant = dict(num_stages=3, state_layout="k_first", output_order="last", checkpoint_branch=True)
    with pytest.raises(Seen) as seen:
        kda_chunk(q, k, v, g, beta, s0, cu, interpret=True, **variant)
    assert {name: seen.value.args[0][name] for name in variant} == variant
    with pytest.raises(ValueError, match="fused state pass"):
        kda_chunk(q, k, v, g, beta, s0, cu, interpret=True, state_pass="split", state_layout="k_first")


def test_state_tiling_rule():
    """pick_state_tiling reproduces the H200 sweeps' choices (kda_common's docstring) and keeps given values."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert pick_state_tiling(8, 32, 128, bf16) == (128, 4, 2, "k_first")  # B8 H32: 256 programs at 128
    assert pick_state_tiling(8, 96, 128, bf16) == (128, 4, 2, "k_first")
    assert pick_state_tiling(1, 96, 128, bf16) == (128, 4, 2, "k_first")  # 96 programs: the threshold
    assert pick_state_tiling(2, 32, 128, bf16) == (64, 4, 3, "k_first")  # 64 at 128 is too few
    assert pick_state_tiling(1, 32, 128, bf16) == (32, 4, 3, "k_first")  # B1 H32: 128 programs at 32
    assert pick_state_tiling(1, 16, 128, bf16) == (16, 4, 3, "k_first")  # k3-small: 64 programs at 32
    assert pick_state_tiling(1, 32, 128, f32) == (32, 4, 2, "v_first")  # 3 fp32 stages overflow shared memory
    assert pick_state_tiling(8, 32, 128, f32) == (64, 4, 2, "v_first")
    assert pick_state_tiling(8, 32, 128, bf16, block_v=32) == (32, 4, 3, "k_first")
    assert pick_state_tiling(1, 32, 128, bf16, num_stages=2, state_layout="v_first", num_warps=8) == (
        32, 8, 2, "v_first")
    assert pick_state_tiling(1, 2, 16, bf16) == (16, 4, 3, "k_first")  # head dims below 64 / 32
    assert pick_state_tiling(64, 2, 32, bf16) == (32, 4, 3, "k_first")  # never wider than V
    # with checkpoints, the eleventh session's rule: the widest V-block up to 64 with >= 96 programs (K-first
    # transposes the state for every checkpoint store; 128 paid +44 % for it at B1 H96)
    assert pick_state_tiling(1, 96, 128, bf16, checkpoints=True) == (64, 4, 3, "k_first")  # 192 programs at 64
    assert pick_state_tiling(8, 96, 128, bf16, checkpoints=True) == (64, 4, 3, "k_first")
    assert pick_state_tiling(1, 32, 128, bf16, checkpoints=True) == (32, 4, 3, "k_first")  # 64 at 64 is too few
    assert pick_state_tiling(1, 16, 128, bf16, checkpoints=True) == (16, 4, 3, "k_first")
    assert pick_state_tiling(8, 32, 128, bf16, block_v=128, checkpoints=True) == (128, 4, 2, "k_first")
    assert pick_state_tiling(8, 32, 128, f32, checkpoints=True) == (64, 4, 2, "v_first")
    with pytest.raises(ValueError, match="block_v"):
        pick_state_tiling(1, 2, 48, bf16, block_v=32)


def test_state_tiling_benchmark_smoke(capsys):
    """benchmarks/kda_state_tiling.py in interpret mode: a named variant agrees with the rule's pick and the
    table prints; unknown knobs are refused before anything runs."""
    from benchmarks import kda_state_tiling as bench

    assert bench.variant_keywords("bv32_w8_s3_kf_last_br") == dict(
        block_v=32, num_warps=8, num_stages=3, state_layout="k_first", output_order="last", checkpoint_branch=True)
    assert bench.variant_keywords("sw4_bv16") == dict(stage1_num_warps=4, block_v=16)
    with pytest.raises(ValueError, match="unknown knob"):
        bench.main(["--variants", "default,bv32_x2", "--interpret"])
    (row,) = bench.main(["--shapes", "1x65x1", "--variants", "default,bv16_w4_vf", "--trials", "1", "--interpret"])
    assert row["bv16_w4_vf_rel"] < 1e-2 and row["default_ms"] > 0  # bf16 outputs, reordered fp32 dots
    assert "bv16_w4_vf" in capsys.readouterr().out
    (row,) = bench.main(["--shapes", "1x65x1", "--variants", "bv16_w4_kf_br", "--page", "64", "--trials", "1",
                         "--interpret"])  # with checkpoints every 64 tokens, transposed on page-ending chunks only
    assert row["page"] == 64 and row["bv16_w4_kf_br_rel"] < 1e-2 and row["bv16_w4_kf_br_ms"] > 0
