"""The KDA Pallas kernels compiled for the GPU (Triton lowering) against their references.

Run on a GPU host: K3JAX_TEST_GPU=1 python -m pytest -q -n 0 -m gpu tests/gpu/test_kda_gpu.py
Tolerances: fp32 inputs use IEEE fp32 dots everywhere (Pallas and the XLA stages at HIGHEST precision), so
they meet the CPU bar (2e-5 / 1e-5). bf16 inputs store bf16 intermediates and multiply bf16 operands on the
tensor cores (fp32 accumulation, as fla does): 2e-2. A subset of the gate x dtype x state-pass x solve
combinations keeps the GPU run short; benchmarks/kda.py checks the variants against fla at full size.
The solve="pallas" cases and the per-kernel tests (each Pallas kernel of the chunked prefill alone, at
D128, against its own reference; added with the one-kernel-per-file split) have not run on a GPU yet
(added after the 2026-11-30 device runs); nor have the V-blocked decode cases (block_v < 128), nor the decode
fresh flag (masked-off pool loads: test_decode_fresh_rows_match_reference), nor the model's verify step reading
the stacked pools in place (test_verify_step_reads_stacked_pools_in_place), nor the looped decode's prefetch
and fold_v (test_decode_looped_prefetch_fold_match_reference, added in the eighth session), nor the packed
projection (test_decode_packed_projection_equals_the_sliced_operands, sixteenth session; see docs/benchmarks.md).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax import backend
from k3jax.testing import k3_tiny, shuffled_page_tables, step_meta
from pallas_kernels.kda_chunk import checkpoint_offsets, chunk_table, kda_chunk, kda_chunk_reference
from pallas_kernels.kda_chunk_solve import kda_chunk_solve, kda_chunk_solve_reference
from pallas_kernels.kda_common import CHUNK
from pallas_kernels.kda_decode import kda_decode, kda_decode_reference
from pallas_kernels.kda_intra import kda_intra
from pallas_kernels.kda_state_pass import kda_state_pass, kda_state_pass_reference
from pallas_kernels.kda_state_pass_split import kda_state_pass_split, kda_state_pass_split_reference

pytestmark = pytest.mark.gpu


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def chunk_inputs(seed, lens, h, d, dtype):
    rng = np.random.default_rng(seed)
    t = int(sum(lens))
    arr = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    return dict(q=arr(t, h, d).astype(dtype), k=arr(t, h, d).astype(dtype), v=arr(t, h, d).astype(dtype),
                g=arr(t, h, d).astype(dtype), beta=arr(t, h), initial_state=arr(len(lens), h, d, d) * 0.1,
                cu_seqlens=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)), \
        dict(a_log=arr(h) * 0.5, dt_bias=arr(h * d))


@pytest.mark.parametrize("gate,dtype,tol,state_pass,solve", [
    ("lower_bound", jnp.float32, 2e-5, "split", "xla"), ("softplus", jnp.float32, 2e-5, "fused", "xla"),
    ("lower_bound", jnp.bfloat16, 2e-2, "fused", "xla"), ("lower_bound", jnp.float32, 2e-5, "fused", "pallas"),
    ("lower_bound", jnp.bfloat16, 2e-2, "split", "pallas")])
def test_chunk_matches_reference(gate, dtype, tol, state_pass, solve):
    lens = [1, 63, 64, 65, 1000, 300]
    x, p = chunk_inputs(0, lens, h=4, d=128, dtype=dtype)
    start = jnp.asarray([0, 10, 64, 3, 200, 0], jnp.int32)
    kw = dict(**p, gate=gate, beta_sigmoid=True, qk_l2norm=True, start_positions=start, checkpoint_page_size=256)
    o, final, ckpt = kda_chunk(**x, **kw, state_pass=state_pass, solve=solve)
    ro, rfinal, rckpt = kda_chunk_reference(**x, **kw)
    off = int(checkpoint_offsets(x["cu_seqlens"], start, 256)[-1])
    assert rel(o, ro) < tol and rel(final, rfinal) < tol and rel(ckpt[:off], rckpt[:off]) < tol


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_chunk_solve_matches_reference(dtype, tol):
    """The opt-in solve kernel alone (bounded gate g >= -5, the e^80 diagonal-factor case), D128."""
    rng = np.random.default_rng(2)
    shape = (4, 5, CHUNK, 128)
    q, k = rng.standard_normal(shape), rng.standard_normal(shape)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * 128**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    cum = np.cumsum(-5.0 / (1.0 + np.exp(-rng.standard_normal(shape))), axis=2)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(shape[:3])))
    q, k, cum, beta = (jnp.asarray(x.astype(np.float32)) for x in (q, k, cum, beta))
    got = kda_chunk_solve(q.astype(dtype), k.astype(dtype), cum, beta)
    want = kda_chunk_solve_reference(q.astype(dtype), k.astype(dtype), cum, beta)
    for g, w in zip(got, want):
        assert rel(g, w) < tol


@pytest.mark.parametrize("split,dtype,tol", [(False, jnp.float32, 1e-5), (True, jnp.float32, 1e-5),
                                             (False, jnp.bfloat16, 2e-2), (True, jnp.bfloat16, 2e-2)])
def test_state_passes_match_reference(split, dtype, tol):
    """Each state pass alone on random contractive stage-1 tensors (W, kg scaled 0.03, e^(G_C) in
    (0.13, 1]) over a ragged chunk table with page-256 checkpoints, D128."""
    rng = np.random.default_rng(3)
    lens, starts = [1, 63, 64, 65, 1000, 300], [0, 10, 64, 3, 200, 0]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    t, n, h, d = int(cu[-1]), len(lens), 4, 128
    num_chunks = t // CHUNK + 2 * n
    table = chunk_table(cu, jnp.asarray(starts, jnp.int32), num_chunks, 256)
    arr = lambda scale, *s: jnp.asarray((scale * rng.standard_normal(s)).astype(np.float32))
    stage = (arr(0.03, h, num_chunks, CHUNK, d), arr(1.0, h, num_chunks, CHUNK, d), arr(1.0, h, num_chunks, CHUNK, d),
             arr(0.03, h, num_chunks, CHUNK, d), jnp.tril(arr(1.0, h, num_chunks, CHUNK, CHUNK)))
    gate_last = jnp.asarray(np.exp(-rng.uniform(0.0, 2.0, (h, num_chunks, d))).astype(np.float32))
    args = table + tuple(x.astype(dtype) for x in stage) + (gate_last, arr(1.0, n, h, d, d))
    kernel, reference = (kda_state_pass_split, kda_state_pass_split_reference) if split else \
        (kda_state_pass, kda_state_pass_reference)
    o, final, ckpt = kernel(*args, num_tokens=t, checkpoint_page_size=256)
    ro, rfinal, rckpt = reference(*args, num_tokens=t, checkpoint_page_size=256)
    off = int(checkpoint_offsets(cu, jnp.asarray(starts, jnp.int32), 256)[-1])
    assert rel(o, ro) < tol and rel(final, rfinal) < tol and rel(ckpt[:off], rckpt[:off]) < tol


@pytest.mark.parametrize("t,all_states,block_v,num_warps,loop_v", [
    (1, False, None, None, False), (4, True, None, None, False), (4, False, 16, 2, False), (1, False, 128, None, False),
    (4, True, 128, None, False), (1, False, 32, 4, True), (4, True, 32, 4, True), (4, False, 64, 4, True)])
def test_decode_matches_reference(t, all_states, block_v, num_warps, loop_v):
    """Default V-blocks (32, 4 warps), a small block (16), the whole-state kernel (128 = V) and the looped kernel
    (loop_v: one program per head walking V-blocks), D128."""
    rng = np.random.default_rng(1)
    b, h, d, pool = 5, 4, 128, 9
    arr = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    args = (arr(b, t, 3 * h * d), arr(pool, 3, 3 * h * d), arr(4, 3 * h * d) * 0.5, arr(b, t, h, d), arr(b, t, h),
            arr(b, t, h, d), arr(pool, h, d, d), jnp.asarray([7, 0, 3, 8, 1], jnp.int32),
            jnp.asarray([t, t, 0, 1, t], jnp.int32))
    kw = dict(a_log=arr(h) * 0.5, dt_bias=arr(h * d), o_norm_weight=1 + 0.1 * arr(d), all_states=all_states)
    got = jax.device_get(kda_decode(*args, **kw, block_v=block_v, num_warps=num_warps, loop_v=loop_v))
    want = jax.device_get(kda_decode_reference(*args, **kw))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # verify: y, err, key, decay
        assert rel(g, w) < 1e-5


@pytest.mark.parametrize("t,all_states,loop_v", [(1, False, True), (1, False, False), (4, True, False)])
def test_decode_packed_projection_equals_the_sliced_operands(t, all_states, loop_v):
    """`packed` (the model's fused decode path): q|k|v, the beta logits and the output gate read in place from one
    wider projection with unrelated columns between them, D128, the looped and V-blocked kernels and verify: the
    same results as the sliced operands (the same arithmetic on the same values: 1e-6), both at the reference's bar."""
    rng = np.random.default_rng(3)
    b, h, d, pool = 5, 4, 128, 9
    arr = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    qkv, beta, out_gate, extra = arr(b, t, 3 * h * d), arr(b, t, h), arr(b, t, h, d), arr(b, t, 7)
    whole = jnp.concatenate([qkv, extra, beta, extra, out_gate.reshape(b, t, h * d), extra], axis=-1)
    beta_col = 3 * h * d + 7
    rest = (arr(pool, 3, 3 * h * d), arr(4, 3 * h * d) * 0.5, arr(b, t, h, d))
    pools = (arr(pool, h, d, d), jnp.asarray([7, 0, 3, 8, 1], jnp.int32), jnp.asarray([t, t, 0, 1, t], jnp.int32))
    kw = dict(a_log=arr(h) * 0.5, dt_bias=arr(h * d), o_norm_weight=1 + 0.1 * arr(d), all_states=all_states)
    sliced = jax.device_get(kda_decode(qkv, *rest, beta, out_gate, *pools, **kw, loop_v=loop_v))
    packed = jax.device_get(kda_decode(whole, *rest, None, None, *pools, **kw, loop_v=loop_v,
                                       packed=(beta_col + h + 7, beta_col)))
    want = jax.device_get(kda_decode_reference(qkv, *rest, beta, out_gate, *pools, **kw))
    for got, same, w in zip(*map(jax.tree.leaves, (packed, sliced, want))):
        assert rel(got, same) < 1e-6 and rel(got, w) < 1e-5


@pytest.mark.parametrize("t,all_states,block_v,loop_v", [(1, False, None, False), (4, False, 16, False),
                                                          (4, True, None, False), (1, False, 128, False),
                                                          (1, False, 32, True), (4, True, 32, True)])
def test_decode_fresh_rows_match_reference(t, all_states, block_v, loop_v):
    """The per-row fresh flag compiled for the GPU (masked-off Triton loads of the pool rows): fresh rows whose
    slots hold garbage, inf and NaN give the reference's outputs and states (finite), and rows outside the batch
    stay untouched; the fresh idle row (length 0) leaves zeros in its slot. D128, default and small V-blocks and
    the whole-state kernel."""
    rng = np.random.default_rng(4)
    b, h, d, pool = 5, 4, 128, 9
    arr = lambda *s: rng.standard_normal(s).astype(np.float32)
    conv_pool, state_pool = arr(pool, 3, 3 * h * d), arr(pool, h, d, d)
    conv_pool[8, 1, :4] = [np.nan, np.inf, -np.inf, 1e30]  # slot 8 is a fresh row's
    state_pool[8, 2, 5, :4] = [np.nan, np.inf, -np.inf, 1e30]
    slots, lengths = [7, 0, 3, 8, 1], [t, t, 0, 1, t]
    fresh = jnp.asarray([0, 1, 1, 1, 0], jnp.int32)  # row 2 (slot 3) is fresh and idle
    args = (jnp.asarray(arr(b, t, 3 * h * d)), jnp.asarray(conv_pool), jnp.asarray(arr(4, 3 * h * d) * 0.5),
            jnp.asarray(arr(b, t, h, d)), jnp.asarray(arr(b, t, h)), jnp.asarray(arr(b, t, h, d)),
            jnp.asarray(state_pool), jnp.asarray(slots, jnp.int32), jnp.asarray(lengths, jnp.int32))
    kw = dict(a_log=jnp.asarray(arr(h) * 0.5), dt_bias=jnp.asarray(arr(h * d)),
              o_norm_weight=jnp.asarray(1 + 0.1 * arr(d)), all_states=all_states, fresh=fresh)
    got = jax.device_get(kda_decode(*args, **kw, block_v=block_v, loop_v=loop_v))
    want = jax.device_get(kda_decode_reference(*args, **kw))
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    assert rel(got[0][valid], want[0][valid]) < 1e-5
    live = np.array([0, 1, 3, 4]) if all_states else slice(None)
    for g, w in zip(jax.tree.leaves(got)[1:], jax.tree.leaves(want)[1:]):
        assert np.isfinite(g[live]).all() and rel(g[live], w[live]) < 1e-5
    if not all_states:
        untouched = np.array([2, 4, 5, 6])
        np.testing.assert_array_equal(got[2][untouched], state_pool[untouched])
        np.testing.assert_array_equal(got[1][untouched], conv_pool[untouched])
        assert not got[2][3].any() and not got[1][3].any()


@pytest.mark.parametrize("t,all_states,block_v,num_warps,prefetch,fold_v,loop_v", [
    (1, False, 32, 4, 1, False, True), (1, False, 32, 4, 1, True, True), (1, False, 16, 4, 3, True, True),
    (1, False, 64, 4, 1, False, True), (1, False, 32, 2, 0, True, True), (4, True, 32, 4, 1, False, True),
    (4, True, 64, 4, 1, True, True), (4, False, 32, 4, 1, True, True), (1, False, 128, 8, 0, True, False)])
def test_decode_looped_prefetch_fold_match_reference(t, all_states, block_v, num_warps, prefetch, fold_v, loop_v):
    """The looped kernel's loads issued `prefetch` V-blocks ahead and fold_v (the head's v convolved once, picked
    per block inside the S k reduction), compiled for the GPU: decode T1, in-place multi-token decode T4 and verify
    T4, D128, with a fresh row whose slot holds NaN / inf garbage and an idle row; the whole-state V-blocked kernel
    (128 = V) with fold_v. Outputs and pools / per-position states = reference, rows outside the batch untouched."""
    rng = np.random.default_rng(5)
    b, h, d, pool = 5, 4, 128, 9
    arr = lambda *s: rng.standard_normal(s).astype(np.float32)
    conv_pool, state_pool = arr(pool, 3, 3 * h * d), arr(pool, h, d, d)
    conv_pool[8, 1, 2 * h * d: 2 * h * d + 4] = [np.nan, np.inf, -np.inf, 1e30]  # slot 8 is a fresh row's (v channels)
    state_pool[8, 2, 70, :4] = [np.nan, np.inf, -np.inf, 1e30]
    slots, lengths = [7, 0, 3, 8, 1], [t, t, 0, 1, t]
    fresh = jnp.asarray([0, 0, 0, 1, 0], jnp.int32)
    args = (jnp.asarray(arr(b, t, 3 * h * d)), jnp.asarray(conv_pool), jnp.asarray(arr(4, 3 * h * d) * 0.5),
            jnp.asarray(arr(b, t, h, d)), jnp.asarray(arr(b, t, h)), jnp.asarray(arr(b, t, h, d)),
            jnp.asarray(state_pool), jnp.asarray(slots, jnp.int32), jnp.asarray(lengths, jnp.int32))
    kw = dict(a_log=jnp.asarray(arr(h) * 0.5), dt_bias=jnp.asarray(arr(h * d)),
              o_norm_weight=jnp.asarray(1 + 0.1 * arr(d)), all_states=all_states, fresh=fresh)
    got = jax.device_get(kda_decode(*args, **kw, block_v=block_v, num_warps=num_warps, loop_v=loop_v,
                                    prefetch=prefetch, fold_v=fold_v))
    want = jax.device_get(kda_decode_reference(*args, **kw))
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    assert rel(got[0][valid], want[0][valid]) < 1e-5
    live = np.array([0, 1, 3, 4]) if all_states else slice(None)
    for g, w in zip(jax.tree.leaves(got)[1:], jax.tree.leaves(want)[1:]):
        assert np.isfinite(g[live]).all() and rel(g[live], w[live]) < 1e-5
    if not all_states:
        untouched = np.array([2, 3, 4, 5, 6])  # 3 is the idle row's slot
        np.testing.assert_array_equal(got[2][untouched], state_pool[untouched])
        np.testing.assert_array_equal(got[1][untouched], conv_pool[untouched])


# Two KDA layers (a wrong layer offset into the stacked pool shows) and one MLA layer, at D128 heads so the verify
# kernel runs its default tiling (block_v 64: two V-blocks per head, the norm in the epilogue); fp32.
VERIFY_CFG = k3_tiny().replace(num_layers=3, mla_layers=(2,), attn_res_block_size=2, kda_num_heads=2,
                               kda_head_dim=128, name="k3-tiny-kda2-d128")
KDA_OPS = ("kda_chunked", "kda_chunked_fused", "kda_commit", "kda_decode_fused", "kda_recurrent")
_HLO_ARRAY = re.compile(r"= (\w+)\[([\d,]*)\](?:\{[^}]*\})? ([\w-]+)\(")


def state_copies(hlo_text: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """Instructions of an optimized HLO module (fused computations included) that produce an array of one of
    `shapes` other than by naming a parameter or reinterpreting one (bitcast): copies, gathers, slices, fusions."""
    found = []
    for line in hlo_text.splitlines():
        m = _HLO_ARRAY.search(line)
        if m and tuple(int(x) for x in m.group(2).split(",") if x) in shapes and \
                m.group(3) not in ("parameter", "bitcast", "get-tuple-element"):
            found.append(line.strip()[:160])
    return found


def test_verify_step_reads_stacked_pools_in_place(monkeypatch):
    """k3jax.verify through the compiled KDA kernel (other ops on the reference): the stacked pools go to the
    kernel as they are, so the optimized HLO has no instruction that copies, gathers or slices a pool, a layer
    of one, or the step's rows of one; the returned pools are the given ones; logits, the conv inputs and the
    per-position state updates (valid positions) match the reference, with a fresh row whose reused slot holds
    garbage, inf and NaN and a ragged row. Tolerance: fp32 at HIGHEST precision, kernel vs reference summation
    order ~1e-6 per layer."""
    registry = {key: fn for key, fn in backend._REGISTRY.items() if key[1] == "reference" or key[0] in KDA_OPS}
    monkeypatch.setattr(backend, "_REGISTRY", registry)
    jax.clear_caches()
    cfg, page = VERIFY_CFG, 4
    rng = np.random.default_rng(31)
    batch, num_slots, num_pages, k = 3, 7, 16, 4
    params = k3jax.init_params(cfg, jax.random.key(8))
    state = k3jax.init_state(cfg, num_slots, num_pages, page)
    kda = 0.05 * rng.standard_normal(state.kda.shape)
    conv = rng.standard_normal(state.conv.shape)
    kda[1, 4, 0, 70, :3] = [np.nan, np.inf, -np.inf]  # slot 4 is the fresh row's (second KDA layer, V-block 1)
    conv[0, 4, 2, :3] = [np.inf, np.nan, -1e30]
    state = state.replace(kda=jnp.asarray(kda, jnp.float32), conv=jnp.asarray(conv, state.conv.dtype),
                          kv_pages=jnp.asarray(rng.standard_normal(state.kv_pages.shape), state.kv_pages.dtype))
    lengths = [4, 4, 3]
    meta = step_meta([2, 4, 6], shuffled_page_tables(rng, batch, 4, num_pages), [5, 0, 8], lengths)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, k)), jnp.int32)
    h, d, w1, c = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_kernel - 1, cfg.conv_channels
    layers = cfg.num_kda_layers
    pool_shapes = {(layers, num_slots, h, d, d), (layers * num_slots, h, d, d), (num_slots, h, d, d),
                   (batch, h, d, d), (layers, num_slots, w1, c), (layers * num_slots, w1, c), (num_slots, w1, c),
                   (batch, w1, c)}
    with jax.default_matmul_precision("highest"):
        hlo = k3jax.verify.lower(params, cfg, state, tokens, meta, backend_name="pallas").compile().as_text()
        assert "kda_decode_verify" in hlo or "__gpu$xla.gpu.triton" in hlo  # the kernel is in the step
        assert state_copies(hlo, pool_shapes) == []
        got = jax.device_get(k3jax.verify(params, cfg, jax.tree.map(jnp.copy, state), tokens, meta,
                                          backend_name="pallas"))
        want = jax.device_get(k3jax.verify(params, cfg, jax.tree.map(jnp.copy, state), tokens, meta))
    jax.clear_caches()
    valid = np.arange(k)[None, :] < np.asarray(lengths)[:, None]
    assert rel(got[0][valid], want[0][valid]) < 1e-4
    for g, w in ((got[2].err, want[2].err), (got[2].key, want[2].key), (got[2].decay, want[2].decay),
                 (got[2].inputs, want[2].inputs)):
        assert np.isfinite(g[:, valid]).all() and rel(g[:, valid], w[:, valid]) < 1e-4
    np.testing.assert_array_equal(got[1].kda, np.asarray(state.kda))
    np.testing.assert_array_equal(got[1].conv, np.asarray(state.conv))

    # keeping 3 / 1 / 2 positions: k3jax.commit_verified (jitted, the state donated) through pallas_kernels.kda_commit,
    # the GPU's commit, against the reference commit of the reference's updates
    monkeypatch.setattr(k3jax.kda, "KDA_COMMIT_KERNEL", "kernel")
    slots, accepted = jnp.asarray([2, 4, 6], jnp.int32), jnp.asarray([3, 1, 2], jnp.int32)
    verified = jax.tree.map(jnp.asarray, got[2])
    hlo = k3jax.commit_verified.lower(state, verified, slots, accepted, backend_name="pallas").compile().as_text()
    kda_pool = (layers, num_slots, h, d, d)
    assert [line for line in state_copies(hlo, {kda_pool}) if "custom-call" not in line] == []  # in place
    kept = jax.device_get(k3jax.commit_verified(jax.tree.map(jnp.copy, state), verified, slots, accepted,
                                                backend_name="pallas"))  # (the state is donated)
    want_kept = jax.device_get(k3jax.commit_verified(jax.tree.map(jnp.copy, state), jax.tree.map(jnp.asarray, want[2]),
                                                     slots, accepted))
    jax.clear_caches()
    assert np.isfinite(kept.kda[:, [2, 4, 6]]).all()
    assert rel(kept.kda, want_kept.kda) < 1e-4 and rel(kept.conv, want_kept.conv) < 1e-4
    others = np.array([0, 1, 3, 5])
    np.testing.assert_array_equal(kept.kda[:, others], np.asarray(state.kda)[:, others])


@pytest.mark.parametrize("dtype,stage_tol,tol", [(jnp.float32, 2e-5, 2e-5), (jnp.bfloat16, 1e-2, 2e-2)])
def test_intra_pallas_stage_matches_v2(dtype, stage_tol, tol):
    """stage1="pallas" (`kda_intra`, one Triton kernel) against the XLA stage it replaces (`_intra_stage_v2`)
    at B1 T4096 H4 D128, keys correlated through a shared direction per head (L's entries near beta: the case
    that breaks an unstable inverse), the K3 bounded gate at its steepest bound (-5) and a weak one (-0.05).
    Stage outputs: fp32 IEEE dots except the inverse's tf32x3 (~fp32: 3e-6 emulated on the CPU), so 2e-5;
    bf16 one rounding of each stored value plus the GPUs' exp / accumulation-order differences, 1e-2. End to
    end the file's bars against the reference on test_chunk_matches_reference's case (independent keys,
    1000 tokens at most: on the 3967-token sequence above the chunked form itself, v2 too, drifts 8e-5 from
    the fp32 recurrence, 1.8e-4 with the correlated keys, measured on the CPU: the problem's conditioning)."""
    from pallas_kernels import kda_chunk as kc

    lens = [1, 63, 65, 4096 - 129]
    x, p = chunk_inputs(9, lens, h=4, d=128, dtype=dtype)
    rng = np.random.default_rng(9)
    shared = jnp.asarray(rng.standard_normal((1, 4, 128)).astype(np.float32))
    correlated = (0.3 * x["k"].astype(jnp.float32) + shared).astype(dtype)
    cu = x["cu_seqlens"]
    n = len(lens)
    _, tok_start, length, _ = kc.chunk_table(cu, jnp.zeros(n, jnp.int32), 4096 // CHUNK + 2 * n, 0)
    a, b = p["a_log"], p["dt_bias"].reshape(4, 128)
    stored = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32
    for lower_bound in (-5.0, -0.05):
        kw = dict(lower_bound=lower_bound, beta_sigmoid=True, qk_l2norm=True, scale=128**-0.5)
        args = (tok_start, length, x["q"], correlated, x["v"], x["g"], x["beta"], a, b)
        want = kc._intra_stage_v2(*args, gate="lower_bound", bounded=True, stored=stored, **kw)
        # bf16 outputs also with the one-pass tf32 inverse (the opt-in knob): within the same 1e-2
        for inverse in ("tf32x3", "tf32") if dtype == jnp.bfloat16 else ("tf32x3",):
            got = kda_intra(*args, **kw, inverse_precision=inverse)
            for name, g_, w_ in zip(("w", "u", "qg", "kg", "aqk", "gate_last"), got, want):
                g32 = np.asarray(jnp.asarray(g_, jnp.float32))
                assert g_.dtype == w_.dtype and np.isfinite(g32).all(), name
                assert rel(g32, np.asarray(jnp.asarray(w_, jnp.float32))) < stage_tol, (lower_bound, inverse, name)
    x, p = chunk_inputs(0, [1, 63, 64, 65, 1000, 300], h=4, d=128, dtype=dtype)
    start = jnp.asarray([0, 10, 64, 3, 200, 0], jnp.int32)
    cu = x["cu_seqlens"]
    kw = dict(**p, gate="lower_bound", beta_sigmoid=True, qk_l2norm=True, start_positions=start,
              checkpoint_page_size=256)
    o, final, ckpt = kda_chunk(**x, **kw, stage1="pallas")
    ro, rfinal, rckpt = kda_chunk_reference(**x, **kw)
    off = int(checkpoint_offsets(cu, start, 256)[-1])
    assert rel(o, ro) < tol and rel(final, rfinal) < tol and rel(ckpt[:off], rckpt[:off]) < tol


def test_intra_pallas2_and_block_inverse_match_v2():
    """stage1="pallas2" (`kda_intra_lk` + `kda_intra_wu`, default knobs) and `kda_intra` with the 16x16-block
    inverse at 8 warps (benchmark variant pallas_w8_blocks) against `_intra_stage_v2` at B1 T4096 H4 D128 bf16
    (the model's dtype; one compile per kernel): ragged lengths, keys correlated through a shared direction per
    head, the K3 bound -5 with heads 0-1 at ordinary decay and heads 2-3 at a weak one (dt_bias -8: g ~ -2e-3,
    L's entries near beta: the case that breaks an unstable inverse). Stage bar 1e-2 (bf16 rounding of each
    stored value plus exp / accumulation-order differences, as test_intra_pallas_stage_matches_v2); end to end
    kda_chunk(stage1="pallas2") against the reference at the file's bf16 bar (2e-2) and against v2 (1e-2)."""
    from pallas_kernels import kda_chunk as kc

    lens = [1, 63, 65, 4096 - 129]
    x, p = chunk_inputs(9, lens, h=4, d=128, dtype=jnp.bfloat16)
    rng = np.random.default_rng(9)
    shared = jnp.asarray(rng.standard_normal((1, 4, 128)).astype(np.float32))
    correlated = (0.3 * x["k"].astype(jnp.float32) + shared).astype(jnp.bfloat16)
    n = len(lens)
    _, tok_start, length, _ = kc.chunk_table(x["cu_seqlens"], jnp.zeros(n, jnp.int32), 4096 // CHUNK + 2 * n, 0)
    bias = p["dt_bias"].reshape(4, 128).at[2:].set(-8.0)
    kw = dict(lower_bound=-5.0, beta_sigmoid=True, qk_l2norm=True, scale=128**-0.5, stored=jnp.bfloat16)
    args = (tok_start, length, x["q"], correlated, x["v"], x["g"], x["beta"], p["a_log"], bias)
    want = kc._intra_stage_v2(*args, gate="lower_bound", bounded=True, **kw)
    got = {"pallas2": jax.jit(lambda *a: kc._intra_stage_pallas2(*a, **kw))(*args),
           "pallas_w8_blocks": jax.jit(lambda *a: kda_intra(*a, **kw, num_warps=8, inverse_precision="blocks"))(*args)}
    for variant, outs in got.items():
        for name, g_, w_ in zip(("w", "u", "qg", "kg", "aqk", "gate_last"), outs, want):
            g32 = np.asarray(jnp.asarray(g_, jnp.float32))
            assert g_.dtype == w_.dtype and np.isfinite(g32).all(), (variant, name)
            assert rel(g32, np.asarray(jnp.asarray(w_, jnp.float32))) < 1e-2, (variant, name)
    x, p = chunk_inputs(0, [1, 63, 64, 65, 1000, 300], h=4, d=128, dtype=jnp.bfloat16)
    start = jnp.asarray([0, 10, 64, 3, 200, 0], jnp.int32)
    kw = dict(**p, gate="lower_bound", beta_sigmoid=True, qk_l2norm=True, start_positions=start,
              checkpoint_page_size=256)
    o, final, ckpt = kda_chunk(**x, **kw, stage1="pallas2")
    o2, final2, _ = kda_chunk(**x, **kw, stage1="v2")
    ro, rfinal, rckpt = kda_chunk_reference(**x, **kw)
    off = int(checkpoint_offsets(x["cu_seqlens"], start, 256)[-1])
    assert rel(o, ro) < 2e-2 and rel(final, rfinal) < 2e-2 and rel(ckpt[:off], rckpt[:off]) < 2e-2
    assert rel(jnp.asarray(o, jnp.float32), jnp.asarray(o2, jnp.float32)) < 1e-2 and rel(final, final2) < 1e-2


@pytest.mark.parametrize("t,gate,stages,num_ctas", [(1, "lower_bound", None, None), (1, "softplus", 2, 3),
                                                    (4, "lower_bound", 2, None), (5, "softplus", None, 7)])
def test_decode_mgpu_matches_reference(t, gate, stages, num_ctas):
    """The Mosaic GPU decode kernel (TMA-streamed state; two update warpgroups and a prep one at D128) on the H200:
    shuffled slots, a padded row, an idle row, fresh rows over NaN / inf garbage; few CTAs so each walks many
    items through its ring (stages None: the most slots that fit; fp32 activations fit 2).
    Rows outside the batch stay bit-identical. Tolerances as test_decode_fresh_rows_match_reference."""
    from pallas_kernels.kda_decode_mgpu import kda_decode_mgpu, kda_decode_mgpu_reference

    rng = np.random.default_rng(5)
    b, h, d, pool = 6, 5, 128, 11
    arr = lambda *s: rng.standard_normal(s).astype(np.float32)
    conv_pool, state_pool = arr(pool, 3, 3 * h * d), arr(pool, h, d, d)
    conv_pool[8, 1, :4] = [np.nan, np.inf, -np.inf, 1e30]  # slot 8 is a fresh row's
    state_pool[8, 2, 5, :4] = [np.nan, np.inf, -np.inf, 1e30]
    slots, lengths = [7, 0, 3, 8, 1, 10], [t, max(t - 2, 1), 0, 1, t, t]
    fresh = jnp.asarray([0, 0, 1, 1, 0, 1], jnp.int32)  # row 2 (slot 3) is fresh and idle
    args = (jnp.asarray(arr(b, t, 3 * h * d)), jnp.asarray(conv_pool), jnp.asarray(arr(4, 3 * h * d) * 0.5),
            jnp.asarray(arr(b, t, h, d)), jnp.asarray(arr(b, t, h)), jnp.asarray(arr(b, t, h, d)),
            jnp.asarray(state_pool), jnp.asarray(slots, jnp.int32), jnp.asarray(lengths, jnp.int32))
    kw = dict(a_log=jnp.asarray(arr(h) * 0.5), dt_bias=jnp.asarray(arr(h * d)),
              o_norm_weight=jnp.asarray(1 + 0.1 * arr(d)), gate=gate, fresh=fresh)
    got = jax.device_get(kda_decode_mgpu(*args, **kw, stages=stages, num_ctas=num_ctas))
    want = jax.device_get(kda_decode_mgpu_reference(*args, **kw))
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    assert rel(got[0][valid], want[0][valid]) < 1e-5
    for g, w in zip(got[1:], want[1:]):
        assert np.isfinite(g[np.array(slots)]).all() and rel(g, w) < 1e-5
    untouched = np.array([2, 4, 5, 6, 9])
    np.testing.assert_array_equal(got[2][untouched], state_pool[untouched])
    np.testing.assert_array_equal(got[1][untouched], conv_pool[untouched])
    assert not got[2][3].any() and not got[1][3].any()


@pytest.mark.parametrize("t,all_states,dtype", [(1, False, jnp.float32), (4, True, jnp.float32),
                                                (1, False, jnp.bfloat16), (4, True, jnp.bfloat16),
                                                (8, True, jnp.bfloat16)])
def test_mgpu_packed_projection_equals_the_sliced_operands(t, all_states, dtype):
    """The Mosaic kernel's `packed` (beta and the output gate read from the fused projection in place, the gate's
    rows by TMA at a 16-byte-aligned column) on the H200, decode and verify, fp32 and bf16: bit-identical to the
    sliced operands (the same values reach the same arithmetic), both at the reference's bar (bf16: 2e-2). Verify
    at T = 8 needs bf16 (fp32 does not fit the ring); a tiled prep with two positions a warp was 1.2 relative off
    there on the H200 (2026-12-04), which no GPU test covered."""
    from pallas_kernels.kda_decode_mgpu import kda_decode_mgpu, kda_decode_mgpu_reference

    rng = np.random.default_rng(6)
    b, h, d, pool = 5, 4, 128, 9
    arr = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    qkv, beta, out_gate = (arr(b, t, 3 * h * d).astype(dtype), arr(b, t, h).astype(dtype),
                           arr(b, t, h, d).astype(dtype))
    extra = lambda n: arr(b, t, n).astype(dtype)  # noqa: E731
    # q|k|v [1536], 6 unrelated, beta [4], 14 unrelated (the gate at column 1560: 16-byte aligned in both dtypes)
    whole = jnp.concatenate([qkv, extra(6), beta, extra(14), out_gate.reshape(b, t, h * d), extra(8)], axis=-1)
    beta_col = 3 * h * d + 6
    rest = (arr(pool, 3, 3 * h * d).astype(dtype), arr(4, 3 * h * d) * 0.5, arr(b, t, h, d).astype(dtype))
    pools = (arr(pool, h, d, d), jnp.asarray([7, 0, 3, 8, 1], jnp.int32), jnp.asarray([t, t, 0, 1, t], jnp.int32))
    kw = dict(a_log=arr(h) * 0.5, dt_bias=arr(h * d), o_norm_weight=1 + 0.1 * arr(d), all_states=all_states)
    sliced = jax.device_get(kda_decode_mgpu(qkv, *rest, beta, out_gate, *pools, **kw))
    packed = jax.device_get(kda_decode_mgpu(whole, *rest, None, None, *pools, **kw, packed=(beta_col + h + 14,
                                                                                             beta_col)))
    want = jax.device_get(kda_decode_mgpu_reference(qkv, *rest, beta, out_gate, *pools, **kw))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    valid = np.arange(t)[None, :] < np.asarray(pools[2])[:, None]
    for i, (got, same, w) in enumerate(zip(*map(jax.tree.leaves, (packed, sliced, want)))):
        np.testing.assert_array_equal(got, same)
        if i == 0:  # y: the reference's padded positions are not the kernel's business
            got, w = got[valid], w[valid]
        assert rel(np.asarray(got, np.float32), np.asarray(w, np.float32)) < tol


@pytest.mark.parametrize("t,gate,stages,num_ctas,forms", [
    (4, "lower_bound", None, None, {}), (3, "softplus", 2, 3, {}), (6, "lower_bound", None, 7, {}),
    (4, "softplus", 2, 3, {"tiled_prep": False}), (4, "softplus", None, 2, {"tiled_prep": True}),
    (4, "lower_bound", 2, 3, {"chunk_verify": False}), (4, "softplus", None, 3, {"tiled_norm": False}),
    (4, "lower_bound", 2, 1, {"operand_stages": 2}), (3, "softplus", 2, 2, {"operand_stages": 4}),
    (4, "softplus", None, 3, {"norm_warpgroup": False})])
def test_verify_mgpu_matches_reference(t, gate, stages, num_ctas, forms):
    """The Mosaic GPU kernel in verify mode (all_states: every position's state update written, no conv state) on the
    H200, same rows as the decode test: shuffled slots, padded, idle and fresh rows over NaN / inf garbage; the
    pools are read only. fp32 activations fit a 2-slot ring up to T6 (T8 needs bf16: `supported` says no). T = 4
    runs the prep warpgroup's tiled form by default, with the tiled gated norm and the chunk form (positions on
    warps, custom register layouts: the interpreter ignores layouts, so this is where they are checked), and once
    each without one of the three. The operands' ring runs 3 slots deep by default here (fp32), beside the state's
    2 (each update warpgroup loads and refills its own rows); once with 2 (the rings in step) and once with 4. At
    T = 4 the gated norm has a warpgroup of its own by default; once it runs in prep."""
    from pallas_kernels.kda_decode_mgpu import kda_decode_mgpu, kda_decode_mgpu_reference

    rng = np.random.default_rng(6)
    b, h, d, pool = 6, 5, 128, 11
    arr = lambda *s: rng.standard_normal(s).astype(np.float32)
    conv_pool, state_pool = arr(pool, 3, 3 * h * d), arr(pool, h, d, d)
    conv_pool[8, 1, :4] = [np.nan, np.inf, -np.inf, 1e30]
    state_pool[8, 2, 5, :4] = [np.nan, np.inf, -np.inf, 1e30]
    slots, lengths = [7, 0, 3, 8, 1, 10], [t, max(t - 2, 1), 0, 1, t, t]
    fresh = jnp.asarray([0, 0, 1, 1, 0, 1], jnp.int32)
    args = (jnp.asarray(arr(b, t, 3 * h * d)), jnp.asarray(conv_pool), jnp.asarray(arr(4, 3 * h * d) * 0.5),
            jnp.asarray(arr(b, t, h, d)), jnp.asarray(arr(b, t, h)), jnp.asarray(arr(b, t, h, d)),
            jnp.asarray(state_pool), jnp.asarray(slots, jnp.int32), jnp.asarray(lengths, jnp.int32))
    kw = dict(a_log=jnp.asarray(arr(h) * 0.5), dt_bias=jnp.asarray(arr(h * d)),
              o_norm_weight=jnp.asarray(1 + 0.1 * arr(d)), gate=gate, fresh=fresh, all_states=True)
    got = jax.device_get(kda_decode_mgpu(*args, **kw, stages=stages, num_ctas=num_ctas, **forms))
    want = jax.device_get(kda_decode_mgpu_reference(*args, **kw))
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    assert len(got) == 2 and [u.shape for u in got[1]] == [(b, t, h, d)] * 3
    assert rel(got[0][valid], want[0][valid]) < 1e-5
    for g, w in zip(got[1], want[1]):  # err, key, decay
        assert np.isfinite(g).all() and rel(g, w) < 1e-5


@pytest.mark.parametrize("num_ctas", [None, 3, 1])
def test_verify_mgpu_two_prep_warpgroups(num_ctas):
    """prep_warpgroups=2 on the H200 (verify T = 4 in bf16, 4 operand slots: the even items in one prep warpgroup, the
    odd in another): y and the updates bit for bit the one-prep kernel's, and the reference's within bf16 tolerance,
    over 30 items on 30 / 3 / 1 CTAs (1 and 10 items a CTA, and 30 on one)."""
    from pallas_kernels.kda_decode_mgpu import kda_decode_mgpu, kda_decode_mgpu_reference

    rng = np.random.default_rng(16)
    b, h, d, pool, t = 6, 5, 128, 11, 4
    arr = lambda *s: rng.standard_normal(s).astype(np.float32)
    bf = jnp.bfloat16
    args = (jnp.asarray(arr(b, t, 3 * h * d), bf), jnp.asarray(arr(pool, 3, 3 * h * d), bf),
            jnp.asarray(arr(4, 3 * h * d) * 0.5), jnp.asarray(arr(b, t, h, d), bf), jnp.asarray(arr(b, t, h), bf),
            jnp.asarray(arr(b, t, h, d), bf), jnp.asarray(arr(pool, h, d, d) * 0.05),
            jnp.asarray([7, 0, 3, 8, 1, 10], jnp.int32), jnp.asarray([4, 2, 0, 1, 4, 3], jnp.int32))
    kw = dict(a_log=jnp.asarray(arr(h) * 0.5), dt_bias=jnp.asarray(arr(h * d)),
              o_norm_weight=jnp.asarray(1 + 0.1 * arr(d)), fresh=jnp.asarray([0, 0, 1, 1, 0, 1], jnp.int32),
              all_states=True)
    knobs = dict(num_ctas=num_ctas, stages=2, operand_stages=4, norm_warpgroup=True)
    one = jax.device_get(kda_decode_mgpu(*args, **kw, **knobs, prep_warpgroups=1))
    two = jax.device_get(kda_decode_mgpu(*args, **kw, **knobs, prep_warpgroups=2))
    for got, want in zip(jax.tree.leaves(two), jax.tree.leaves(one)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    ref = jax.device_get(kda_decode_mgpu_reference(*args, **kw))
    valid = np.arange(t)[None, :] < np.asarray([4, 2, 0, 1, 4, 3])[:, None]
    # bf16 inputs and y: the tolerance of the other bf16 verify cases here
    assert rel(np.asarray(two[0], np.float32)[valid], np.asarray(ref[0], np.float32)[valid]) < 2e-2
    for g, w in zip(two[1], ref[1]):
        assert rel(g, w) < 2e-2


@pytest.mark.parametrize("layers,n,t", [(1, 64, 4), (3, 5, 6)])
def test_commit_kernel_matches_reference(layers, n, t):
    """pallas_kernels.kda_commit compiled for the GPU (D128, 4 heads): ragged counts, rows written back in place
    and one to a free (checkpoint) slot, a fresh row over NaN / inf garbage; the reference's states to fp32 rounding
    of the same multiply-adds, every other slot bit-identical, the donated pool updated without a copy."""
    from pallas_kernels.kda_commit import kda_commit, kda_commit_reference

    rng = np.random.default_rng(7 + n)
    h, d, pool = 4, 128, n + 9
    states = rng.standard_normal((layers, pool, h, d, d)).astype(np.float32)
    src = rng.permutation(pool)[:n].astype(np.int32)
    dst = src.copy()
    dst[0] = np.setdiff1d(np.arange(pool), src)[0]
    fresh = np.zeros(n, np.int32)
    fresh[-1] = 1
    states[:, src[-1], 1, 3, :3] = [np.nan, np.inf, -np.inf]
    key = rng.standard_normal((layers, n, t, h, d))
    ups = (0.1 * rng.standard_normal((layers, n, t, h, d)), key / np.linalg.norm(key, axis=-1, keepdims=True),
           rng.uniform(0.5, 1.0, (layers, n, t, h, d)))
    args = (*(jnp.asarray(u, jnp.float32) for u in ups), jnp.asarray(src), jnp.asarray(dst),
            jnp.asarray(1 + np.arange(n) % t, jnp.int32), jnp.asarray(fresh))
    want = jax.device_get(kda_commit_reference(jnp.asarray(states), *args))
    step = jax.jit(kda_commit, donate_argnums=(0,))
    hlo = step.lower(jnp.asarray(states), *args).compile().as_text()
    pool_type = "f32[" + ",".join(map(str, states.shape)) + "]"
    assert [ln for ln in hlo.splitlines() if pool_type in ln and " copy(" in ln] == []  # in place: no pool copy
    got = jax.device_get(step(jnp.asarray(states), *args))
    assert np.isfinite(got[:, dst]).all() and rel(got, want) < 1e-6
    untouched = np.setdiff1d(np.arange(pool), dst)
    np.testing.assert_array_equal(got[:, untouched], states[:, untouched])
