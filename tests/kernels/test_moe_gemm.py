"""Pallas MoE grouped GEMM (pallas_kernels/moe_gemm.py) in interpret mode against float64 numpy oracles,
the plain-jnp reference and the model's ragged_dot reference; the schedule; MXFP4 against a numpy
dequantiser; the whole model with backend="interpret" against "reference".

Run: python -m pytest -q tests/kernels/test_moe_gemm.py

Tolerances (relative Frobenius error against float64):
- float32 activations and weights: the kernel's only difference from the oracle is fp32 rounding order
  (K <= 128 terms per dot), ~1e-7 per op; 2e-6 leaves room for the tanh/sigmoid epilogue.
- bf16 activations: the GLU output h is rounded to bf16 before the down GEMM (2^-9 relative) and the
  result is rounded to bf16 (2^-9 again), so ~3e-3 is expected; 1e-2 is the bound (gpu.md's bf16 band).
"""

from collections import Counter
import dataclasses
import functools
from unittest import mock

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import backend
from k3jax.moe import grouped_experts_reference
from k3jax.quant import mxfp4_quantize
from k3jax.testing import k3_tiny
from pallas_kernels import moe_gemm
from pallas_kernels.moe_gemm import MoeGemmConfig, moe_grouped_mlp, moe_grouped_mlp_reference, tile_schedule

E2M1_TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def numpy_dequantize(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """[E, out, in/2] nibbles + [E, out, in/32] E8M0 -> float64 [E, in, out], by table lookup."""
    packed = np.asarray(packed)
    codes = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    w = E2M1_TABLE[codes] * np.ldexp(1.0, np.repeat(np.asarray(scale, np.int64) - 127, 32, axis=-1))
    return np.swapaxes(w, -1, -2)


def numpy_moe(x, ids, weights, experts, act: str, beta=4.0, linear_beta=25.0) -> np.ndarray:
    """Per token and slot, float64: sum_j w_j * down(act(gate x, up x)); experts as float64 [E, in, out]."""
    x = np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], experts["down"].shape[-1]))
    for n in range(x.shape[0]):
        for j, e in enumerate(np.asarray(ids[n])):
            g, u = x[n] @ experts["gate"][e], x[n] @ experts["up"][e]
            if act == "silu":
                h = g / (1 + np.exp(-g)) * u
            else:
                h = beta * np.tanh(g / beta) / (1 + np.exp(-g)) * linear_beta * np.tanh(u / linear_beta)
            out[n] += float(weights[n, j]) * (h @ experts["down"][e])
    return out


def make_case(rng, n, top_k, e, k_dim, i_dim, dtype, *, empty=(), hot=None):
    """Random inputs; experts in `empty` get no token, `hot` takes every token's first slot."""
    allowed = np.array([i for i in range(e) if i not in empty])
    ids = np.stack([rng.choice(allowed, top_k, replace=False) for _ in range(n)]).astype(np.int32)
    if hot is not None:
        for row in ids:
            if hot in row:
                row[list(row).index(hot)] = row[0]
            row[0] = hot
    x = rng.standard_normal((n, k_dim)).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, (n, top_k)).astype(np.float32)
    experts = {
        "gate": rng.standard_normal((e, k_dim, i_dim)) / np.sqrt(k_dim),
        "up": rng.standard_normal((e, k_dim, i_dim)) / np.sqrt(k_dim) * 2,
        "down": rng.standard_normal((e, i_dim, k_dim)) / np.sqrt(i_dim),
    }
    cast = lambda a: jnp.asarray(a, dtype)
    return cast(x), jnp.asarray(ids), jnp.asarray(weights), {k: cast(v) for k, v in experts.items()}


def as_f64(experts):
    return {k: np.asarray(v, np.float64) for k, v in experts.items()}


@pytest.mark.parametrize("aligned", [False, True], ids=["global_tiles", "aligned"])
@pytest.mark.parametrize("num_rows,block_m", [(1, 16), (37, 16), (100, 32), (500, 32)])
def test_schedule_covers_each_row_once_inside_its_expert(num_rows, block_m, aligned):
    """Every row in exactly one item of its own expert, inside the item's tile; global tiles start at multiples of
    block_m, aligned ones at their expert's first row (so only an expert's last item is partial) and never need
    more items than global tiles (the grid's bound, `num_work_items`)."""
    rng = np.random.default_rng(num_rows)
    e = 9
    sizes = rng.multinomial(num_rows, rng.dirichlet(np.full(e, 0.3)))
    sizes[0] += sizes[3]
    sizes[3] = 0  # an empty expert (and the Dirichlet draw empties more)
    sched = np.asarray(tile_schedule(jnp.asarray(sizes, jnp.int32), num_rows, block_m, aligned))
    assert sched.shape == (4, moe_gemm.num_work_items(num_rows, e, block_m))
    owner = np.repeat(np.arange(e), sizes)
    first_row = np.cumsum(sizes) - sizes
    seen = np.zeros(num_rows, int)
    for row0, expert, lo, hi in sched.T:
        if hi <= lo:
            continue
        assert row0 <= lo < hi <= row0 + block_m
        if aligned:
            assert row0 == lo and (lo - first_row[expert]) % block_m == 0
            assert hi - lo == block_m or hi == first_row[expert] + sizes[expert]  # only the last item partial
        else:
            assert row0 % block_m == 0
        assert (owner[lo:hi] == expert).all()
        seen[lo:hi] += 1
    assert (seen == 1).all()
    used = int((sched[3] > sched[2]).sum())
    assert used == (-(-sizes // block_m)).sum() if aligned else used >= (-(-sizes // block_m)).sum()


def _primitives(jaxpr) -> Counter:
    """Primitive counts of a jaxpr, nested jaxprs (jit, pallas bodies, loops) included."""
    counts = Counter()
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for sub in jax_core.jaxprs_in_params(eqn.params):
            counts += _primitives(sub)
    return counts


def test_routing_bookkeeping_has_no_loop_and_at_most_one_sort():
    """The schedule's expert lookup is a compare-and-count and the inverse permutation a scatter: jnp.searchsorted
    (a while loop) and a second argsort cost ~400 small kernels per decode step on the H200 (2026-11-30). At decode
    sizes the kernels rank their own rows (no sort kernel at all); past them, one sort."""
    sizes = jnp.asarray([3, 0, 5, 1, 0, 7], jnp.int32)
    assert "while" not in _primitives(jax.make_jaxpr(lambda s: tile_schedule(s, 16, 4))(sizes).jaxpr)
    experts = {k: jnp.ones((6, 32, 16) if k != "down" else (6, 16, 32), jnp.float32) for k in ("gate", "up", "down")}
    for tokens, config, sorts in ((5, None, 0), (600, MoeGemmConfig(block_m=64), 1)):
        x = jnp.ones((tokens, 32), jnp.float32)
        ids = (jnp.arange(2 * tokens, dtype=jnp.int32) * 5 % 6).reshape(tokens, 2)
        w = jnp.full((tokens, 2), 0.5, jnp.float32)
        assert moe_gemm.ranks_in_kernel(tokens, 2, (config or moe_gemm.default_config(2 * tokens, 6)).block_m) == (
            sorts == 0)
        jaxpr = jax.make_jaxpr(lambda *a: moe_grouped_mlp(*a, config=config, interpret=True))(x, ids, w, experts).jaxpr
        prims = _primitives(jaxpr)
        assert prims["while"] == 0 and prims["sort"] == sorts, tokens


@pytest.mark.parametrize("block_m,tail", [(16, 0), (32, 16)])
def test_rows_ranked_in_kernel_equal_the_sorted_order(block_m, tail):
    """The decode path (`ranks_in_kernel`: no sort, each program ranks its rows from the ids) gives exactly the
    sorted path's result: ragged groups with empty experts, one hot expert holding most rows (its rows span
    several tiles, tiles straddle experts), a row count that is neither a tile nor a power-of-two multiple."""
    rng = np.random.default_rng(11)
    n, top_k, e = 37, 3, 9
    x, _, w, experts = make_case(rng, n, top_k, e, 40, 24, jnp.float32)
    ids = np.where(rng.random((n, top_k)) < 0.6, 4, rng.choice([0, 2, 3, 7, 8], (n, top_k))).astype(np.int32)
    ids = jnp.asarray(ids)
    config = MoeGemmConfig(block_m=block_m, tail_block_m=tail, block_k=16, glu_block_n=16, down_block_n=16)
    assert moe_gemm.ranks_in_kernel(n, top_k, block_m)
    got = moe_grouped_mlp(x, ids, w, experts, config=config, interpret=True)
    with mock.patch.object(moe_gemm, "RANK_IN_KERNEL_MAX_ELEMENTS", 0):
        assert not moe_gemm.ranks_in_kernel(n, top_k, block_m)
        sorted_path = moe_grouped_mlp(x, ids, w, experts, config=config, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(sorted_path))
    assert rel(got, numpy_moe(x, ids, w, as_f64(experts), "situ")) < 2e-6


def drop_some(rng, ids, fraction):
    """ids with about `fraction` of the assignments dropped (-1), and token 0's all of them."""
    ids = np.asarray(ids).copy()
    ids[rng.random(ids.shape) < fraction] = -1
    ids[0] = -1
    return jnp.asarray(ids)


@pytest.mark.parametrize("ranked", [True, False], ids=["ranked", "sorted"])
def test_dropped_assignments_add_zero_and_take_no_rows(ranked):
    """ids < 0 (an expert-parallel rank's non-local picks): the result is the float64 sum over the kept ones only
    (token 0 keeps none: exactly zero; all dropped: all zero), for the ranked (decode) and the sorted path; the
    schedule counts only kept rows (row_bounds' last entry), so dropped ones cost no MMA rows; their y rows are never
    written (interpret mode fills unwritten memory with NaN, so a combine that added them would fail here); the
    references agree on them."""
    rng = np.random.default_rng(17)
    n, top_k, e = 37, 3, 6
    x, ids, w, experts = make_case(rng, n, top_k, e, 40, 24, jnp.float32, empty=(2,))
    ids = drop_some(rng, ids, 0.5)
    kept = np.asarray(ids) >= 0
    want = numpy_moe(x, np.where(kept, ids, 0), np.where(kept, w, 0), as_f64(experts), "situ")
    config = MoeGemmConfig(block_m=16, block_k=16, glu_block_n=16, down_block_n=16)
    bounds, row_bounds = [], moe_gemm.row_bounds
    spy = lambda flat, num_experts: bounds.append(row_bounds(flat, num_experts)) or bounds[-1]
    limit = moe_gemm.RANK_IN_KERNEL_MAX_ELEMENTS if ranked else 0
    with mock.patch.object(moe_gemm, "RANK_IN_KERNEL_MAX_ELEMENTS", limit), \
            mock.patch.object(moe_gemm, "row_bounds", spy):
        assert moe_gemm.ranks_in_kernel(n, top_k, config.block_m) == ranked
        got = moe_grouped_mlp.__wrapped__(x, ids, w, experts, config=config, interpret=True)
        nothing = moe_grouped_mlp.__wrapped__(x, jnp.full_like(ids, -1), w, experts, config=config, interpret=True)
    assert int(bounds[0][-1]) == kept.sum() < ids.size and int(bounds[1][-1]) == 0
    np.testing.assert_array_equal(np.asarray(nothing), 0.0)  # a rank that received no local pick
    assert rel(got, want) < 2e-6
    np.testing.assert_array_equal(np.asarray(got[0]), 0.0)
    assert rel(moe_grouped_mlp_reference(x, ids, w, experts), want) < 2e-6
    cfg = dataclasses.replace(k3_tiny(), num_experts=e, num_experts_per_tok=top_k, moe_intermediate_size=24)
    assert rel(grouped_experts_reference(x, ids, w, experts, cfg), want) < 2e-6


def test_expected_rows_chooses_the_tiling_not_the_result():
    """expected_rows (an expert-parallel rank's kept share): default_config tiles by it instead of all N x top_k
    assignments -- here 16-row decode tiles (ranked rows) instead of 128-row ones (sorted) -- and the result is the
    float64 sum either way; a bad value raises."""
    rng = np.random.default_rng(19)
    n, top_k, e = 101, 4, 4  # 101 assignments per expert: the 128-row tiling; 40 kept rows would take decode tiles
    x, ids, w, experts = make_case(rng, n, top_k, e, 40, 24, jnp.float32)
    ids = drop_some(rng, ids, 0.9)
    kept = np.asarray(ids) >= 0
    want = numpy_moe(x, np.where(kept, ids, 0), np.where(kept, w, 0), as_f64(experts), "situ")
    chosen, default_config = [], moe_gemm.default_config
    spy = lambda rows, *a: chosen.append(default_config(rows, *a)) or chosen[-1]  # noqa: E731
    with mock.patch.object(moe_gemm, "default_config", spy):
        tiled_by_all = moe_grouped_mlp.__wrapped__(x, ids, w, experts, interpret=True)
        tiled_by_kept = moe_grouped_mlp.__wrapped__(x, ids, w, experts, expected_rows=int(kept.sum()), interpret=True)
    assert [c.block_m for c in chosen] == [128, moe_gemm.DECODE_CONFIG.block_m]
    assert rel(tiled_by_all, want) < 2e-6 and rel(tiled_by_kept, want) < 2e-6
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match="expected_rows"):
            moe_grouped_mlp.__wrapped__(x, ids, w, experts, expected_rows=bad, interpret=True)


def test_single_term_rows_are_stored_in_x_dtype_bit_exactly():
    """top_k = 1 and one contraction slice: the down kernel stores the rows in x's dtype (no fp32 y, no cast pass),
    bit-equal to storing fp32 and casting after (one rounding either way), with dropped assignments among them; two
    slices keep the fp32 partials."""
    rng = np.random.default_rng(18)
    x, ids, w, experts = make_case(rng, 45, 1, 5, 64, 48, jnp.bfloat16, hot=3)
    ids = drop_some(rng, ids, 0.3)
    config = MoeGemmConfig(block_m=16, block_k=16, glu_block_n=16, down_block_n=32)
    stored = []
    down = moe_gemm.grouped_down

    def spy(*args, out_dtype, force=None, **kwargs):
        y = down(*args, out_dtype=force or out_dtype, **kwargs)
        stored.append(y.dtype)
        return y

    run = moe_grouped_mlp.__wrapped__
    with mock.patch.object(moe_gemm, "grouped_down", spy):
        got = run(x, ids, w, experts, config=config, interpret=True)
        two_slices = run(x, ids, w, experts, config=dataclasses.replace(config, down_split_k=2), interpret=True)
    with mock.patch.object(moe_gemm, "grouped_down", functools.partial(spy, force=jnp.float32)):
        via_fp32 = run(x, ids, w, experts, config=config, interpret=True)
    assert stored == [jnp.bfloat16, jnp.float32, jnp.float32]
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(via_fp32, np.float32))
    kept = np.asarray(ids) >= 0
    want = numpy_moe(x, np.where(kept, ids, 0), np.where(kept, w, 0), as_f64(experts), "situ")
    assert rel(got, want) < 1e-2 and rel(two_slices, want) < 1e-2


def test_fp32_situ_with_empty_experts_and_odd_tokens_matches_float64():
    rng = np.random.default_rng(0)
    x, ids, w, experts = make_case(rng, 13, 3, 7, 40, 24, jnp.float32, empty=(1, 5))
    want = numpy_moe(x, ids, w, as_f64(experts), "situ")
    got = moe_grouped_mlp(x, ids, w, experts, config=MoeGemmConfig(block_m=16), interpret=True)
    assert rel(got, want) < 2e-6
    assert rel(moe_grouped_mlp_reference(x, ids, w, experts), want) < 2e-6


def test_wider_x_is_read_in_place_and_fewer_rows_than_a_tile():
    """x wider than the experts' input (a fused projection's output: moe passes it whole) gives exactly the result
    of its first K columns, with the trailing columns large and finite (they must not be read); 3 tokens x top-2 =
    6 rows in one 16-row tile, so the pad rows' out-of-range assignment (never stored) is exercised; a narrower x
    raises."""
    rng = np.random.default_rng(12)
    x, ids, w, experts = make_case(rng, 3, 2, 4, 64, 32, jnp.float32, empty=(2,))
    wide = jnp.concatenate([x, jnp.full((3, 48), 1e30, jnp.float32)], axis=1)
    config = MoeGemmConfig(block_m=16, block_k=64)
    got = moe_grouped_mlp(wide, ids, w, experts, config=config, interpret=True)
    assert got.shape == x.shape
    np.testing.assert_array_equal(got, moe_grouped_mlp(x, ids, w, experts, config=config, interpret=True))
    assert rel(got, numpy_moe(x, ids, w, as_f64(experts), "situ")) < 2e-6
    assert rel(moe_grouped_mlp_reference(wide, ids, w, experts), numpy_moe(x, ids, w, as_f64(experts), "situ")) < 2e-6
    with pytest.raises(ValueError, match="not narrower"):
        moe_grouped_mlp(x[:, :32], ids, w, experts, interpret=True)


def test_wide_down_tiling_over_several_row_and_column_tiles_matches_float64():
    """LARGE_GROUP_WIDE_DOWN (128-row items, 256-wide down tiles) at a width that needs two down tiles and
    groups spanning row tiles: the tiling logic in interpret mode (the GPU test checks its compiled form)."""
    rng = np.random.default_rng(3)
    x, ids, w, experts = make_case(rng, 150, 2, 3, 384, 80, jnp.float32)
    want = numpy_moe(x, ids, w, as_f64(experts), "situ")
    got = moe_grouped_mlp(x, ids, w, experts, config=moe_gemm.LARGE_GROUP_WIDE_DOWN, interpret=True)
    assert rel(got, want) < 2e-6


def test_bf16_swiglu_one_hot_expert_across_tiles():
    """Every token's first slot goes to expert 2: its group spans several 16-row tiles and shares tiles
    with its neighbours' groups (masked stores)."""
    rng = np.random.default_rng(1)
    x, ids, w, experts = make_case(rng, 37, 2, 5, 64, 48, jnp.bfloat16, hot=2)
    want = numpy_moe(x, ids, w, as_f64(experts), "silu")
    got = moe_grouped_mlp(x, ids, w, experts, activation="silu", config=MoeGemmConfig(block_m=16), interpret=True)
    assert got.dtype == jnp.bfloat16
    assert rel(got, want) < 1e-2


def test_mxfp4_dequantised_in_kernel_matches_numpy_dequantiser():
    rng = np.random.default_rng(2)
    x, ids, w, experts = make_case(rng, 11, 2, 4, 64, 96, jnp.float32, empty=(0,))
    packed = {}
    for name, v in experts.items():
        p, s = mxfp4_quantize(np.swapaxes(np.asarray(v), -1, -2))  # HF orientation [E, out, in]
        s = s + rng.integers(-2, 3, s.shape).astype(np.uint8)  # spread the exponents beyond the quantiser's
        packed[name] = {"packed": jnp.asarray(p), "scale": jnp.asarray(s)}
    dequant = {k: numpy_dequantize(v["packed"], v["scale"]) for k, v in packed.items()}
    np.testing.assert_array_equal(
        moe_gemm.mxfp4_dequantize_reference(packed["gate"]["packed"], packed["gate"]["scale"]), dequant["gate"])
    want = numpy_moe(x, ids, w, dequant, "situ")
    # fp32 activations: the dequantised tile is exact, so this checks the in-kernel decoder bit for bit
    got = moe_grouped_mlp(x, ids, w, packed, config=MoeGemmConfig(block_m=16, block_k=32), interpret=True)
    assert rel(got, want) < 2e-6
    got16 = moe_grouped_mlp(x.astype(jnp.bfloat16), ids, w, packed, interpret=True)
    assert rel(got16, numpy_moe(x.astype(jnp.bfloat16), ids, w, dequant, "situ")) < 1e-2


def test_registered_backends_agree_with_ragged_dot_reference():
    cfg = k3_tiny()
    rng = np.random.default_rng(3)
    x, ids, w, experts = make_case(rng, 9, cfg.num_experts_per_tok, cfg.num_experts, cfg.expert_width,
                                   cfg.moe_intermediate_size, jnp.float32, empty=(4,))
    assert backend.get("moe_experts", "interpret") is not grouped_experts_reference
    ref = grouped_experts_reference(x, ids, w, experts, cfg)
    got = backend.get("moe_experts", "interpret")(x, ids, w, experts, cfg)
    assert rel(got, ref) < 2e-6


def test_bad_inputs_raise():
    rng = np.random.default_rng(4)
    x, ids, w, experts = make_case(rng, 4, 2, 3, 32, 16, jnp.float32)
    with pytest.raises(ValueError, match="routing weights"):
        moe_grouped_mlp(x, ids, w[:, :1], experts, interpret=True)
    with pytest.raises(ValueError, match="expert shapes"):
        moe_grouped_mlp(x, ids, w, {**experts, "down": experts["down"][:, :8]}, interpret=True)
    with pytest.raises(ValueError, match="activation"):
        moe_grouped_mlp(x, ids, w, experts, activation="gelu", interpret=True)
    with pytest.raises(ValueError, match="both be MXFP4"):
        p, sc = mxfp4_quantize(np.swapaxes(np.asarray(experts["gate"]), -1, -2))
        moe_grouped_mlp(x, ids, w, {**experts, "gate": {"packed": jnp.asarray(p), "scale": jnp.asarray(sc)}}, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        MoeGemmConfig(block_m=24)


def test_model_forward_interpret_equals_reference(monkeypatch):
    """k3-tiny cut to 3 layers (dense, KDA+MoE, MLA+MoE; AttnRes blocks of 2 so the bank, partial sums and
    final mix all occur; fp32, SiTU) with every "interpret" kernel against the reference path. fp32
    summation-order differences only, so the 1e-5 bound of tests/model applies. (3 layers, not 9: each
    interpreted kernel call site compiles separately, and 9 layers cost ~50 s of CI.)

    Only this file's kernels (moe_experts, attn_res_mix_norm, gated_rms_norm) run interpreted: other
    ops' "interpret" registrations are hidden for the test, so it measures these kernels in the model
    and stays within its CI time whatever else lands (those kernels have their own model tests)."""
    import k3jax

    for op, name in list(backend._REGISTRY):
        if name == "interpret" and op not in ("moe_experts", "attn_res_mix_norm", "gated_rms_norm"):
            monkeypatch.delitem(backend._REGISTRY, (op, name))

    cfg = k3_tiny().replace(num_layers=3, mla_layers=(2,), attn_res_block_size=2)
    params = k3jax.init_params(cfg, jax.random.key(3))
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 7)))
    want = k3jax.forward(params, cfg, tokens)
    got = k3jax.forward(params, cfg, tokens, backend_name="interpret")
    assert rel(got, want) < 1e-5


def test_model_with_kernel_layout_experts_equals_checkpoint_layout(monkeypatch):
    """k3-tiny (2 layers: dense, then MLA + MoE; expert widths 64 for the kernel layout) with its routed experts
    MXFP4-quantised, held in the checkpoint's layout and in the kernel layouts (`prepare_mxfp4`: "k4", what
    load_pretrained(experts="kernel") gives, and "kn"). Reference backend: the kernel layout is re-packed back to the
    same bytes before dequantising, so the logits are bit-identical. Interpret backend (only moe_experts
    interpreted, as above): the two in-kernel decodes give the same exact weights and differ only in fp32
    summation order (32-input partial products vs block_k-wide dots): each is ~3e-7 from a float64 oracle at
    the op, so the fp32 kernel band 2e-6 (measured 3.7e-7 on the logits); and the 1e-5 reference band of
    tests/model."""
    import k3jax
    import k3jax.params

    for op, name in list(backend._REGISTRY):
        if name == "interpret" and op != "moe_experts":
            monkeypatch.delitem(backend._REGISTRY, (op, name))
    cfg = k3_tiny().replace(num_layers=2, mla_layers=(1,), moe_latent_size=64, moe_intermediate_size=64)
    rng = np.random.default_rng(7)

    def leaf(path, s):  # numpy draws: init_params' first call costs ~10 s of compiles on a CI core
        name = jax.tree_util.keystr(path[-1:])
        x = rng.standard_normal(s.shape)
        x = 1 + 0.1 * x if "norm" in name else x if ("A_log" in name or "bias" in name) else 0.05 * x
        return jnp.asarray(x.astype(np.float32).astype(s.dtype))

    params = jax.tree_util.tree_map_with_path(leaf, k3jax.params.param_shapes(cfg))
    layer = params["layers"][1]["mlp"]
    checkpoint = {}
    for name, v in layer["experts"].items():
        p, s = mxfp4_quantize(np.swapaxes(np.asarray(v, np.float32), -1, -2))  # HF orientation [E, out, in]
        checkpoint[name] = {"packed": jnp.asarray(p), "scale": jnp.asarray(s)}
    with_experts = lambda experts: {**params, "layers": [params["layers"][0],
                                                         {**params["layers"][1], "mlp": {**layer, "experts": experts}}]}
    hf_params = with_experts(checkpoint)
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, cfg.vocab_size, (2, 7)))
    ref_hf = k3jax.forward(hf_params, cfg, tokens)
    got_hf = k3jax.forward(hf_params, cfg, tokens, backend_name="interpret")
    for layout in ("k4", "kn"):
        kernel_params = with_experts({k: moe_gemm.prepare_mxfp4(v, layout) for k, v in checkpoint.items()})
        np.testing.assert_array_equal(np.asarray(k3jax.forward(kernel_params, cfg, tokens)), np.asarray(ref_hf))
        got = k3jax.forward(kernel_params, cfg, tokens, backend_name="interpret")
        assert rel(got, got_hf) < 2e-6, layout
        assert rel(got, ref_hf) < 1e-5, layout


# ----------------------------------------------------------------------------------------------------
# MXFP4 kernel layouts (prepare_mxfp4) and decode variants


def random_mxfp4(rng, e, n_out, n_in, lo=117, hi=137):
    """Checkpoint-layout MXFP4 with uniform random bytes (all 16 codes, incl. the subnormal +-0.5) and E8M0
    scales spanning 2^(lo-127)..2^(hi-127)."""
    return {"packed": jnp.asarray(rng.integers(0, 256, (e, n_out, n_in // 2)).astype(np.uint8)),
            "scale": jnp.asarray(rng.integers(lo, hi + 1, (e, n_out, n_in // 32)).astype(np.uint8))}


def test_plane_decode_is_exact_for_every_byte():
    """Both nibble planes of all 256 bytes decode to E2M1 * 2^-14 exactly (f16 bit placement; code 1 is an f16
    subnormal, exact through the conversion -- unlike a bf16 subnormal, which XLA:CPU flushes in a multiply)."""
    b = jnp.arange(256, dtype=jnp.uint8)
    for high, codes in ((False, np.arange(256) & 15), (True, np.arange(256) >> 4)):
        got = np.asarray(moe_gemm._decode_plane(b, high).astype(jnp.float32), np.float64) * 2.0**14
        np.testing.assert_array_equal(got, E2M1_TABLE[codes])
        assert (np.signbit(got) == (codes >= 8)).all()


def test_prepare_mxfp4_is_an_exact_repacking():
    """The kernel layout holds the checkpoint's bytes re-packed: it decodes to the same weights, byte 5 of block 1
    is where the layout says, the inverse gives the checkpoint's bytes back, and numpy in (the loader's path)
    gives the same bytes as jax in."""
    rng = np.random.default_rng(10)
    w = random_mxfp4(rng, 3, 40, 192)
    prepared = moe_gemm.prepare_mxfp4(w)
    assert moe_gemm.mxfp4_layout(prepared) == "kn"
    assert prepared["planes_kn"].shape == (3, 96, 40) and prepared["scales_gn"].shape == (3, 6, 40)
    want = numpy_dequantize(w["packed"], w["scale"])  # [E, in, out]
    np.testing.assert_array_equal(np.asarray(moe_gemm.mxfp4_weight_reference(prepared), np.float64), want)
    # block 1's byte 5 holds input 64 + 5 (low nibble) and input 64 + 32 + 5 (high nibble)
    planes = np.swapaxes(np.asarray(prepared["planes_kn"]), -1, -2)
    codes = np.asarray(w["packed"])
    lo, hi = (codes[0, 7, 69 // 2] >> (4 * (69 % 2))) & 15, (codes[0, 7, 101 // 2] >> (4 * (101 % 2))) & 15
    assert planes[0, 7, 32 + 5] == lo | (hi << 4)
    back = moe_gemm.mxfp4_checkpoint_layout(prepared)
    for k in ("packed", "scale"):
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(w[k]))
    on_host = moe_gemm.prepare_mxfp4({k: np.asarray(v) for k, v in w.items()})
    assert all(isinstance(v, np.ndarray) for v in on_host.values())
    for k in ("planes_kn", "scales_gn"):
        np.testing.assert_array_equal(on_host[k], np.asarray(prepared[k]))
    with pytest.raises(ValueError, match="multiple of 64"):
        moe_gemm.prepare_mxfp4(random_mxfp4(rng, 1, 8, 96))


@pytest.mark.parametrize("config,variants", [
    (MoeGemmConfig(block_m=16, glu_block_n=64, down_block_n=128, block_k=128), tuple(moe_gemm.MXFP4_VARIANTS)),
    (MoeGemmConfig(block_m=32, glu_block_n=32, down_block_n=64, block_k=64), ("kmajor", "k4", "k4r")),
], ids=["bk128", "bk64"])
def test_mxfp4_variants_match_float64(config, variants):
    """Every layout (MXFP4_VARIANTS) on ragged groups with an empty and a hot expert, scales 2^-10..2^1, dims
    that need padding (K 192 -> 256 with 128-wide tiles); a second tiling (one 64-input block per step, 32-row
    tiles, 32/64-wide columns) for the kernel layout. fp32 activations: the decoded weights are exact, so both
    differ from the float64 oracle by fp32 rounding only (2e-6, as above)."""
    rng = np.random.default_rng(11)
    e, k_dim, i_dim = 5, 192, 128
    x, ids, w, _ = make_case(rng, 21, 2, e, k_dim, i_dim, jnp.float32, empty=(3,), hot=1)
    hf = {"gate": random_mxfp4(rng, e, i_dim, k_dim, hi=128), "up": random_mxfp4(rng, e, i_dim, k_dim, hi=128),
          "down": random_mxfp4(rng, e, k_dim, i_dim, hi=128)}  # up to 2^1: every kernel layout takes them
    dequant = {k: numpy_dequantize(v["packed"], v["scale"]) for k, v in hf.items()}
    x = x * 2.0**-2  # scales up to 2^1 times E2M1 6: keep SiTU out of its saturated range
    want = numpy_moe(x, ids, w, dequant, "situ")
    by_layout = {"hf": hf, **{lay: {k: moe_gemm.prepare_mxfp4(v, layout=lay) for k, v in hf.items()}
                              for lay in moe_gemm.KERNEL_LAYOUTS}}
    for layout in moe_gemm.KERNEL_LAYOUTS:
        assert rel(moe_grouped_mlp_reference(x, ids, w, by_layout[layout]), want) < 2e-6, layout
    for name in variants:
        experts = by_layout[moe_gemm.MXFP4_VARIANTS[name]]
        got = moe_grouped_mlp(x, ids, w, experts, config=config, interpret=True)
        assert rel(got, want) < 2e-6, name


@pytest.mark.parametrize("tokens", [21, 400], ids=["ranked", "sorted"])
def test_down_split_k_equals_one_slice_and_float64(tokens):
    """The down GEMM's contraction cut into slices (down_split_k 2, 3 and 7 of 3 steps: at most one slice a step,
    the last one shorter for 2), each slice's fp32 partials in rows of its own, summed in the combine: equal to the
    float64 oracle and to one slice up to fp32 summation order, on fp32 experts and on k4r experts, with rows ranked
    in the kernel (21 tokens) and sorted (400 tokens x top 3)."""
    rng = np.random.default_rng(24)
    e, k_dim, i_dim = 5, 192, 320  # I 320 -> 384 at block_k 128: 3 contraction steps
    x, ids, w, dense = make_case(rng, tokens, 3, e, k_dim, i_dim, jnp.float32, empty=(3,), hot=1)
    hf = {"gate": random_mxfp4(rng, e, i_dim, k_dim, hi=128), "up": random_mxfp4(rng, e, i_dim, k_dim, hi=128),
          "down": random_mxfp4(rng, e, k_dim, i_dim, hi=128)}
    packed = {k: moe_gemm.prepare_mxfp4(v, layout="k4r") for k, v in hf.items()}
    xq = x * 2.0**-2
    cases = ((x, dense, {k: np.asarray(v, np.float64) for k, v in dense.items()}),
             (xq, packed, {k: numpy_dequantize(v["packed"], v["scale"]) for k, v in hf.items()}))
    for inputs, experts, oracle in cases:
        want = numpy_moe(inputs, ids, w, oracle, "situ")
        one = moe_grouped_mlp(inputs, ids, w, experts, interpret=True,
                              config=MoeGemmConfig(block_m=16, glu_block_n=64, down_block_n=64, block_k=128))
        for parts in (2, 3, 7):
            config = MoeGemmConfig(block_m=16, glu_block_n=64, down_block_n=64, block_k=128, down_split_k=parts)
            got = moe_grouped_mlp(inputs, ids, w, experts, config=config, interpret=True)
            assert rel(got, want) < 2e-6, parts
            assert rel(got, one) < 1e-6, parts


def test_mxfp4_layout_errors():
    rng = np.random.default_rng(12)
    x, ids, w, experts = make_case(rng, 4, 2, 3, 64, 64, jnp.float32)
    hf = random_mxfp4(rng, 3, 64, 64)
    with pytest.raises(ValueError, match="both be MXFP4"):
        moe_grouped_mlp(x, ids, w, {**experts, "gate": moe_gemm.prepare_mxfp4(hf), "up": hf}, interpret=True)
    with pytest.raises(ValueError, match="match no layout"):
        moe_gemm.mxfp4_layout({"planes_nk": hf["packed"], "scales_gn": hf["scale"]})  # the removed "nk" layout
    with pytest.raises(ValueError, match="do not match"):
        moe_gemm.mxfp4_checkpoint_layout({"planes_kn": hf["packed"], "scales_gn": hf["scale"]})
    with pytest.raises(ValueError, match="MXFP4 dict"):
        moe_gemm.mxfp4_checkpoint_layout(experts["gate"])
    scale_words = moe_gemm.prepare_mxfp4(hf, layout="k4")["scale_words"]  # [3, 1, 64] uint32
    with pytest.raises(ValueError, match="do not match"):  # k4 words are [E, in/8, 4 out]
        moe_gemm.mxfp4_checkpoint_layout({"planes_k4": hf["packed"][:, :, :30], "scale_words": scale_words})
    with pytest.raises(ValueError, match="uint8 / uint32"):  # the word layouts' scales are 32-bit words
        moe_gemm.mxfp4_checkpoint_layout({"planes_k4": hf["packed"][:, :8],
                                          "scale_words": scale_words.astype(jnp.uint8)})
    with pytest.raises(ValueError, match="match no layout"):  # word planes with the kn layout's scale groups
        moe_gemm.mxfp4_layout({"planes_k4r": hf["packed"][:, :8], "scales_gn": hf["scale"]})
    with pytest.raises(ValueError, match="layout must be one of"):
        moe_gemm.prepare_mxfp4(hf, layout="nk")


# ----------------------------------------------------------------------------------------------------
# the opt-in "k4" layout (prepare_mxfp4(w, layout="k4")) and its decode; on the GPU the decode is inline PTX,
# interpreted it is `_k4_lut_bits`, the jnp statement of the same bit operations: these tests check those bits


def k4_word(c, d) -> int:
    """The documented k4 word of low-plane codes c[0..3] and high-plane codes d[0..3] (module docstring)."""
    word = 0
    for r in range(4):
        word |= (c[r] & 7) << (4 * r) | (d[r] & 7) << (16 + 4 * r)
    for code, bit in zip([*c, *d], (15, 31, 11, 27, 7, 23, 3, 19)):
        word |= (code >> 3) << bit
    return word


def exact_word_repacking(w, layout):
    """prepare_mxfp4(w, layout) of a [3, 40, 192] checkpoint-layout weight is an exact re-packing: named and shaped
    as documented, the inverse gives the checkpoint's bytes back, the reference weights are the checkpoint's, and
    numpy in (the loader's path) gives the same bytes as jax in. Returns (the words' bytes, the codes [E, out, in]
    in input order) for the layout's own bit checks."""
    words = moe_gemm.prepare_mxfp4(w, layout=layout)
    key = f"planes_{layout}"
    assert moe_gemm.mxfp4_layout(words) == layout
    assert words[key].shape == (3, 24, 160) and words["scale_words"].shape == (3, 2, 40)  # 192 inputs: 1.5 words
    assert words[key].dtype == jnp.uint8 and words["scale_words"].dtype == jnp.uint32
    # byte g of word b: group 4b + g's bf16 exponent field (E8M0 + the layout's bias); the half word's bytes 2, 3 zero
    fields = np.asarray(w["scale"]).astype(np.uint64) + {"k4": 0, "k4r": 126}[layout]  # [3, 40, 6]
    fields = np.concatenate([fields, np.zeros((3, 40, 2), np.uint64)], axis=-1).reshape(3, 40, 2, 4)
    np.testing.assert_array_equal(np.asarray(words["scale_words"]).swapaxes(1, 2),
                                  (fields << np.arange(0, 32, 8, dtype=np.uint64)).sum(-1))
    back = moe_gemm.mxfp4_checkpoint_layout(words)
    for k in ("packed", "scale"):
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(w[k]))
    np.testing.assert_array_equal(np.asarray(moe_gemm.mxfp4_weight_reference(words), np.float64),
                                  numpy_dequantize(w["packed"], w["scale"]))
    on_host = moe_gemm.prepare_mxfp4({k: np.asarray(v) for k, v in w.items()}, layout=layout)
    assert all(isinstance(v, np.ndarray) for v in on_host.values())
    for k in (key, "scale_words"):
        np.testing.assert_array_equal(on_host[k], np.asarray(words[k]))
    packed = np.asarray(w["packed"])
    return np.asarray(words[key]), np.stack([packed & 15, packed >> 4], axis=-1).reshape(3, 40, 192)


def test_k4_layout_is_an_exact_repacking():
    """prepare_mxfp4(layout="k4") re-packs the checkpoint's codes exactly (`exact_word_repacking`), word j of block 1
    for column 7 holds the documented bits, and inputs not a multiple of 64 are refused."""
    rng = np.random.default_rng(20)
    planes, codes = exact_word_repacking(random_mxfp4(rng, 3, 40, 192), "k4")
    for j in (0, 5):
        c, d = codes[2, 7, 64 + 4 * j: 68 + 4 * j], codes[2, 7, 96 + 4 * j: 100 + 4 * j]
        word = planes[2, 8 + j, 28:32].astype(np.uint32) << np.arange(0, 32, 8, dtype=np.uint32)
        assert int(word.sum()) == k4_word([int(v) for v in c], [int(v) for v in d])
    with pytest.raises(ValueError, match="multiple of 64"):
        moe_gemm.prepare_mxfp4(random_mxfp4(rng, 1, 8, 96), layout="k4")


def test_k4_lut_bits_are_exact_bf16_for_every_code_tuple():
    """`_k4_lut_bits` (the asm's steps in jnp) over all 65536 4-code tuples of each plane (the other plane holding
    the reversed tuple): the bf16 bits of E2M1 exactly, -0 for code 8, in the documented halves."""
    c = np.stack(np.meshgrid(*[np.arange(16)] * 4, indexing="ij"), axis=-1).reshape(-1, 4)
    words = np.array([k4_word(t, t[::-1]) for t in c.tolist()], np.uint32)
    bits = (E2M1_TABLE.astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)  # bf16 of each code
    for plane, codes in ((0, c), (1, c[:, ::-1])):
        lo, hi = (np.asarray(v) for v in moe_gemm._k4_lut_bits(jnp.asarray(words), plane))
        got = np.stack([lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16], axis=-1)
        np.testing.assert_array_equal(got, bits[codes])


@pytest.mark.parametrize("layout", ["k4", "k4r"])
def test_word_layout_interpret_tiles_match_reference_weights(layout):
    """The interpret-mode tile decode (`_word_tile`: the word bits, times the plane's group scales) of every 64-input
    block equals `mxfp4_weight_reference` (through the checkpoint layout: an independent path) bit for bit: all 16
    codes in both planes at every row position (code = column + input mod 16), scales 2^-20, 1, 2^-7, 2^1 (k4r
    takes scales up to 2^1)."""
    n_out, n_in = 16, 128
    codes = (np.arange(n_out)[:, None] + np.arange(n_in)[None, :] * np.array([[1], [3]]).repeat(8, 0)) % 16
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)[None]
    scale = np.array([107, 127, 120, 128])[(np.arange(n_out)[:, None] + np.arange(n_in // 32)) % 4][None]
    w = {"packed": jnp.asarray(packed), "scale": jnp.asarray(scale.astype(np.uint8))}
    want = np.asarray(moe_gemm.mxfp4_weight_reference(w), np.float64)[0]  # [in, out]
    words = moe_gemm.prepare_mxfp4(w, layout=layout)
    for b in range(n_in // 64):
        for plane in (0, 1):
            factors = moe_gemm._word_factors(words["scale_words"][0, b // 2], b % 2 == 1, interpret=True)
            tile = moe_gemm._word_tile(words[f"planes_{layout}"][0, 8 * b: 8 * b + 8], plane, factors[plane], layout,
                                       interpret=True)
            assert tile.dtype == jnp.bfloat16 and tile.shape == (32, n_out)
            got = np.asarray(tile, np.float64)
            rows = slice(64 * b + 32 * plane, 64 * b + 32 * plane + 32)
            np.testing.assert_array_equal(got, want[rows])
            assert (np.signbit(got) == np.signbit(want[rows])).all()


# the "k4r" word layout: the same codes as k4's words, placed so that each bf16 pair is one or two rotations and masks
# away (`_K4R_ROTATIONS`); the GPU multiplies the placed E2M1 * 2^-126 by 2^(s-1)


def test_k4r_words_tile_the_bits_and_repack_exactly():
    """Every bit of a k4r word holds exactly one bit of one code; prepare_mxfp4(layout="k4r") re-packs exactly
    (`exact_word_repacking`), word j of block 1 for column 7 holds the documented bits (each pair's magnitudes and
    signs rotated right by its (r, q) land on bf16 bits 8..6 / 24..22 and 15 / 31), and scales above 2^1 are
    refused."""
    bits = []
    for plane in (0, 1):
        for r in range(4):
            magnitude, sign = moe_gemm._word_bits("k4r", plane, r)
            bits += [(magnitude + b) % 32 for b in range(3)] + [sign]
    assert sorted(bits) == list(range(32))
    rng = np.random.default_rng(22)
    planes, codes = exact_word_repacking(random_mxfp4(rng, 3, 40, 192, lo=100, hi=128), "k4r")
    rotations = {(0, 0): (0, 0), (0, 1): (3, 1), (1, 0): (6, 6), (1, 1): (11, 5)}  # (plane, pair) -> (r, q)
    for j in (0, 5):
        word = int((planes[2, 8 + j, 28:32].astype(np.uint32) << np.arange(0, 32, 8, dtype=np.uint32)).sum())
        for plane in (0, 1):
            for i in range(4):
                code = int(codes[2, 7, 64 + 32 * plane + 4 * j + i])
                r, q = rotations[plane, i // 2]
                rotated = ((word >> r) | (word << (32 - r))) & 0xFFFFFFFF if r else word
                signed = ((word >> q) | (word << (32 - q))) & 0xFFFFFFFF if q else word
                assert (rotated >> (6 + 16 * (i % 2))) & 7 == code & 7
                assert (signed >> (15 + 16 * (i % 2))) & 1 == code >> 3
    with pytest.raises(ValueError, match="up to 128"):
        moe_gemm.prepare_mxfp4(random_mxfp4(rng, 1, 8, 64, lo=120, hi=129), layout="k4r")


def test_k4r_bits_place_e2m1_for_every_code_tuple():
    """`_k4r_bits` (the asm's steps in jnp) over all 65536 4-code tuples of each plane (the other plane holding the
    reversed tuple): each half is sign << 15 | magnitude << 6, the bf16 bits of E2M1 * 2^-126 (codes 1 / 9: the
    subnormal +-2^-127), in the documented halves."""
    c = np.stack(np.meshgrid(*[np.arange(16)] * 4, indexing="ij"), axis=-1).reshape(-1, 4).astype(np.uint8)
    for plane, tuples in ((0, c), (1, c[:, ::-1])):
        block = np.zeros((len(c), 64), np.uint8)  # one 64-input block per tuple: word 0 holds it (+ the other plane)
        block[:, 32 * plane: 32 * plane + 4] = tuples
        block[:, 32 * (1 - plane): 32 * (1 - plane) + 4] = tuples[:, ::-1]
        octets = moe_gemm._k4_words(block[:, None, :], "k4r")[:, 0, :4].astype(np.uint32)  # word 0 of each tuple
        words = (octets << np.arange(0, 32, 8, dtype=np.uint32)).sum(-1).astype(np.uint32)
        lo, hi = (np.asarray(v) for v in moe_gemm._k4r_bits(jnp.asarray(words), plane))
        got = np.stack([lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16], axis=-1)
        sign, magnitude = (tuples >> 3).astype(np.uint32), (tuples & 7).astype(np.uint32)
        np.testing.assert_array_equal(got, (sign << 15) | (magnitude << 6))
        placed = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(got.astype(np.uint16)), jnp.bfloat16)
                            .astype(jnp.float32), np.float64)  # exact conversion (no multiply)
        np.testing.assert_array_equal(np.ldexp(placed, 126), E2M1_TABLE[tuples])


def _run_ptx(text: str, word: int, source: str = "$2", results=("$0", "$1")) -> list[int]:
    """A tiny interpreter for the instructions `_k4r_asm` and `_SCALE_FIELDS_ASM` emit (shf.r.wrap, shl, shr, and,
    or, mov on .b32), source = word."""
    regs, out = {source: word}, {}
    for line in text.replace("{", ";").replace("}", ";").replace("\n", ";").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        val = [regs[a] if a in regs else int(a, 0) for a in src]
        if op == "shf.r.wrap.b32":
            assert val[0] == val[1]
            n = val[2] % 32
            result = ((val[0] >> n) | (val[0] << (32 - n))) & 0xFFFFFFFF if n else val[0]
        elif op == "shl.b32":
            result = (val[0] << val[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            result = val[0] >> val[1]
        elif op == "and.b32":
            result = val[0] & val[1]
        elif op == "or.b32":
            result = val[0] | val[1]
        elif op == "mov.b32":
            result = val[0]
        else:
            raise AssertionError(f"unexpected instruction {op}")
        regs[dst] = result
        if dst in results:
            out[dst] = result
    return [out[r] for r in results]


def test_k4r_asm_computes_its_jnp_twin():
    """The inline PTX the GPU runs (`_k4r_asm`, read by a small interpreter of its five instructions) computes what
    its interpret-mode twin `_k4r_bits` computes, on 4096 random words and both planes: the GPU decode is the
    one the CPU tests check (the H200 test `test_k4_decode_sizes_match_kn_and_dequantised_reference` runs it)."""
    words = np.random.default_rng(23).integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    for plane in (0, 1):
        text = moe_gemm._k4r_asm(plane)
        want = [np.asarray(v) for v in moe_gemm._k4r_bits(jnp.asarray(words), plane)]
        got = np.array([_run_ptx(text, int(w)) for w in words], np.uint64).T
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_scale_fields_asm_computes_the_interpret_factors():
    """The inline PTX that splits a scale word into its groups' bf16 factors on the GPU (`_SCALE_FIELDS_ASM`, read by
    the interpreter above) gives, per half, the bits of `_word_factors`' interpret-mode factors: 4096 random words
    (every byte value) and both blocks of a word."""
    words = np.random.default_rng(24).integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    asm = moe_gemm._SCALE_FIELDS_ASM
    got = {k: np.array([_run_ptx(asm[k], int(w), "$1", ("$0",))[0] for w in words], np.uint32) for k in asm}
    for high in (False, True):
        factors = moe_gemm._word_factors(jnp.asarray(words), high, interpret=True)
        for k, factor in zip(("evens", "odds"), factors):
            want = got[k] >> 16 if high else got[k] & 0xFFFF
            np.testing.assert_array_equal(np.asarray(factor).view(np.uint16), want.astype(np.uint16))


@pytest.mark.parametrize("block_k", [128, 64])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)], ids=["f32", "bf16"])
def test_word_layout_experts_match_kn_and_float64(dtype, tol, block_k):
    """moe_grouped_mlp on k4 and k4r experts (interpreted: the jnp decodes) equals the same on "kn" experts and the
    float64 oracle: ragged groups with an empty expert (2) and a hot one (0), 13 tokens (odd), top_k 3, K 128 / I 64
    (the down GEMM's 64 inputs: half a scale word), scales 2^-10..2^1 (k4r's range); block_k 128 (a step = one scale
    word) and 64 (a step = half a word, which half known at run time). fp32: the decoded weights are exact in every
    layout, so they differ by fp32 rounding only; bf16: the band of the module docstring."""
    rng = np.random.default_rng(21)
    e, k_dim, i_dim = 4, 128, 64
    x, ids, w, _ = make_case(rng, 13, 3, e, k_dim, i_dim, dtype, empty=(2,), hot=0)
    hf = {"gate": random_mxfp4(rng, e, i_dim, k_dim, hi=128), "up": random_mxfp4(rng, e, i_dim, k_dim, hi=128),
          "down": random_mxfp4(rng, e, k_dim, i_dim, hi=128)}
    x = (x * 2.0**-8).astype(dtype)
    want = numpy_moe(x, ids, w, {k: numpy_dequantize(v["packed"], v["scale"]) for k, v in hf.items()}, "situ")
    config = MoeGemmConfig(block_m=16, glu_block_n=64, down_block_n=64, block_k=block_k)
    got = {lay: moe_grouped_mlp(x, ids, w, {k: moe_gemm.prepare_mxfp4(v, layout=lay) for k, v in hf.items()},
                                config=config, interpret=True) for lay in ("kn", "k4", "k4r")}
    for lay in ("k4", "k4r"):
        assert got[lay].dtype == dtype
        assert rel(got[lay], want) < tol, lay
        assert rel(got[lay], got["kn"]) < (1e-6 if dtype == jnp.float32 else 1e-2), lay


def test_default_config_cuts_word_layout_down_kernels_with_few_active_programs():
    """`default_config` cuts the down contraction of MXFP4 word-layout experts at decode sizes (`word_down_split`), by
    the H200 figures in its comment: a K3 EP16 shard at 16 tokens (15 rows on 56 experts, 56 output tiles: ~840
    programs) in 3, at 256 tokens (269 rows) not at all; bf16 / other layouts (word_down None) and groups past decode
    size never; never more slices than contraction steps. moe_grouped_mlp passes the down weight's dims when it is a
    word layout, and its default on such experts (cut in 2: 3 rows, 2 steps) equals the float64 oracle."""
    dc = moe_gemm.DECODE_CONFIG
    assert moe_gemm.default_config(15, 56, (3584, 3072)) == dataclasses.replace(dc, down_split_k=3)
    assert moe_gemm.default_config(269, 56, (3584, 3072)) == dc
    assert moe_gemm.default_config(15, 56) == dc
    assert moe_gemm.default_config(4096, 56, (3584, 3072)) == moe_gemm.default_config(4096, 56)  # 73 rows/expert
    assert moe_gemm.default_config(512, 192, (1024, 512)).down_split_k == 1  # k3-small decode B64: 3072 programs
    assert moe_gemm.default_config(3, 8, (128, 256)).down_split_k == 2  # 6 programs, but 2 steps of 128
    rng = np.random.default_rng(25)
    x, ids, w, _ = make_case(rng, 3, 1, 6, 128, 256, jnp.float32)
    hf = {"gate": random_mxfp4(rng, 6, 256, 128, hi=128), "up": random_mxfp4(rng, 6, 256, 128, hi=128),
          "down": random_mxfp4(rng, 6, 128, 256, hi=128)}
    want = numpy_moe(x, ids, w, {k: numpy_dequantize(v["packed"], v["scale"]) for k, v in hf.items()}, "situ")
    experts = {k: moe_gemm.prepare_mxfp4(v, layout="k4r") for k, v in hf.items()}
    with mock.patch.object(moe_gemm, "default_config", wraps=moe_gemm.default_config) as picked:
        got = moe_grouped_mlp(x, ids, w, experts, interpret=True)
    picked.assert_called_once_with(3, 6, (128, 256))
    assert rel(got, want) < 2e-6  # exact weights, fp32 rounding only (as the word-layout test above)


def test_mxfp4_layouts_lower_to_triton_for_an_h200():
    """Both kernels lower through Pallas's Triton path for an abstract H200 on this CPU with MXFP4 experts in every
    layout at the decode tiling (uint8 refs, the f16 bit-placement decode, the per-group scale), and the word layouts
    also at block_k 64 (a step reads half a scale word, which half computed at run time: a `%` there once failed to
    lower): catches lowering errors before device time (Triton's own compile to PTX only happens on a GPU)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    e, k, i, n, top_k = 5, 256, 128, 7, 4
    spec, u8 = jax.ShapeDtypeStruct, jnp.uint8
    layouts = {  # [E, in, out] weight -> its MXFP4 dict of abstract uint8 arrays
        "kn": lambda n_in, n_out: {"planes_kn": spec((e, n_in // 2, n_out), u8),
                                   "scales_gn": spec((e, n_in // 32, n_out), u8)},
        "hf": lambda n_in, n_out: {"packed": spec((e, n_out, n_in // 2), u8),
                                   "scale": spec((e, n_out, n_in // 32), u8)},
        "k4": lambda n_in, n_out: {"planes_k4": spec((e, n_in // 8, 4 * n_out), u8),  # the inline-asm decode
                                   "scale_words": spec((e, n_in // 128, n_out), jnp.uint32)},
        "k4r": lambda n_in, n_out: {"planes_k4r": spec((e, n_in // 8, 4 * n_out), u8),
                                    "scale_words": spec((e, n_in // 128, n_out), jnp.uint32)},
    }
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    k64 = MoeGemmConfig(block_m=64, glu_block_n=64, down_block_n=128, block_k=64)
    for (name, weight), config in [*((kv, None) for kv in layouts.items()), *((kv, k64) for kv in layouts.items()
                                                                           if kv[0] in moe_gemm.WORD_LAYOUTS)]:
        args = (spec((n, k), jnp.bfloat16), spec((n, top_k), jnp.int32), spec((n, top_k), jnp.float32),
                {"gate": weight(k, i), "up": weight(k, i), "down": weight(i, k)})
        with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
            lowered = jax.jit(functools.partial(moe_grouped_mlp, config=config)).trace(*args).lower(
                lowering_platforms=("cuda",))
        # grouped_glu, grouped_down and (combine="auto" at these widths and kept rows) moe_combine
        assert lowered.as_text().count("__gpu$xla.gpu.triton") == 3, name


@pytest.mark.parametrize("config", [
    MoeGemmConfig(block_m=32, tail_block_m=16),
    MoeGemmConfig(block_m=64, glu_block_n=32, down_block_n=32, block_k=32, tail_block_m=16),
    MoeGemmConfig(block_m=32, tail_block_m=16, aligned=True),
    MoeGemmConfig(block_m=32, aligned=True),
], ids=["tail16", "64x32_tail16", "aligned_tail16", "aligned"])
def test_mid_size_modes_match_float64(config):
    """The opt-in tail tiles and expert-aligned items for mid-size groups on ragged groups with an empty expert (1), a
    hot expert (2) spanning several tiles and odd sizes: fp32, so the 2e-6 band of the default path. The routing has
    items on both sides of tail_block_m, so both compiled branches of the kernels run; aligned, the last expert's
    tile reaches past the last row (the padded row buffers)."""
    rng = np.random.default_rng(5)
    x, ids, w, experts = make_case(rng, 75, 2, 5, 40, 24, jnp.float32, empty=(1,), hot=2)
    sizes = jnp.bincount(ids.reshape(-1), length=5).astype(jnp.int32)
    sched = tile_schedule(sizes, ids.size, config.block_m, config.aligned)
    counts = np.asarray(sched[3] - sched[2])
    if config.aligned:
        assert (sched[0] + config.block_m > ids.size).any()
    if config.tail_block_m:
        assert ((counts > 0) & (counts <= config.tail_block_m)).any() and (counts > config.tail_block_m).any()
    want = numpy_moe(x, ids, w, as_f64(experts), "situ")
    got = moe_grouped_mlp(x, ids, w, experts, config=config, interpret=True)
    assert rel(got, want) < 2e-6
    assert rel(moe_grouped_mlp_reference(x, ids, w, experts), want) < 2e-6


@pytest.mark.parametrize("config", [
    MoeGemmConfig(block_m=32, glu_block_n=32, down_block_n=32, block_k=32, column_group=2),
    MoeGemmConfig(block_m=32, glu_block_n=32, down_block_n=32, block_k=32, column_group=3, aligned=True,
                  tail_block_m=16, down_split_k=2),
    MoeGemmConfig(block_m=16, glu_block_n=32, down_block_n=32, block_k=32, column_group=4),
], ids=["groups_of_2", "one_group_aligned_split", "wider_than_the_columns"])
def test_column_groups_match_float64(config):
    """The column-grouped launch order (`_item_and_column`): 3 column tiles in groups of 2 (a narrower last group),
    of 3, and of 4 (wider than the columns), fp32 (the 2e-6 band above), with the other modes on top: every
    (item, column) program runs exactly once, or a tile of h / y would be missing or doubled. 75 tokens of top 2:
    every config ranks its rows in the kernel (`ranks_in_kernel`)."""
    rng = np.random.default_rng(26)
    x, ids, w, experts = make_case(rng, 75, 2, 5, 96, 80, jnp.float32, empty=(1,), hot=2)
    want = numpy_moe(x, ids, w, as_f64(experts), "situ")
    assert rel(moe_grouped_mlp(x, ids, w, experts, config=config, interpret=True), want) < 2e-6
    seen = Counter()
    num_items, columns = 7, 3
    for pid in range(num_items * columns):
        with mock.patch.object(moe_gemm.pl, "program_id", lambda axis, pid=pid: pid):
            item, col = moe_gemm._item_and_column(num_items, columns, config.column_group)
        seen[int(item), int(col)] += 1
    assert seen == Counter({(i, c): 1 for i in range(num_items) for c in range(columns)})


def test_mid_size_modes_bf16_and_config_errors():
    """bf16 activations with a tail tile (1e-2: the bf16 band above), and tail_block_m's ValueErrors."""
    rng = np.random.default_rng(6)
    x, ids, w, experts = make_case(rng, 41, 3, 6, 64, 48, jnp.bfloat16, empty=(4,), hot=0)
    want = numpy_moe(x, ids, w, as_f64(experts), "situ")
    got = moe_grouped_mlp(x, ids, w, experts, config=MoeGemmConfig(block_m=32, tail_block_m=16),
                          interpret=True)
    assert got.dtype == jnp.bfloat16 and rel(got, want) < 1e-2
    with pytest.raises(ValueError, match="tail_block_m"):
        MoeGemmConfig(block_m=64, tail_block_m=64)
    with pytest.raises(ValueError, match="tail_block_m"):
        MoeGemmConfig(block_m=64, tail_block_m=24)


def test_mid_size_modes_lower_to_triton_for_an_h200():
    """Both kernels of each mid-size mode (the configs tests/gpu/test_moe_gpu.py compiles) lower through Pallas's
    Triton path for an abstract H200 on this CPU: catches lowering errors of the two-branch kernels (static shapes,
    dynamic tail start) before device time; Triton's own compile to PTX only happens on a GPU."""
    from jax.sharding import AbstractDevice, AbstractMesh

    e, k, i, n, top_k = 5, 256, 128, 40, 2
    spec = jax.ShapeDtypeStruct
    args = (spec((n, k), jnp.bfloat16), spec((n, top_k), jnp.int32), spec((n, top_k), jnp.float32),
            {"gate": spec((e, k, i), jnp.bfloat16), "up": spec((e, k, i), jnp.bfloat16),
             "down": spec((e, i, k), jnp.bfloat16)})
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    wide = moe_gemm.LARGE_GROUP_WIDE_DOWN
    for config in (MoeGemmConfig(**{**wide.__dict__, "tail_block_m": 64}), MoeGemmConfig(64, 256, 256, 64, 8, 3),
                   dataclasses.replace(wide, tail_block_m=64, aligned=True, column_group=4)):
        with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h200)):
            lowered = jax.jit(lambda *a, c=config: moe_grouped_mlp(*a, config=c)).trace(*args).lower(
                lowering_platforms=("cuda",))
        # grouped_glu, grouped_down and (combine="auto" at these widths and kept rows) moe_combine
        assert lowered.as_text().count("__gpu$xla.gpu.triton") == 3, config
