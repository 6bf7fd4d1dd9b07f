"""What the decode step does around its kernels: the KDA state pools are not gathered or scattered per layer.

Run: python -m pytest -q tests/test_decode_step_ops.py

With a backend that has the fused KDA decode kernel ("pallas" on the GPU, "interpret" on CPU), the model hands
each layer's kernel the whole stacked pools (viewed as [L_kda * num_slots, ...]) and the rows of the step, and
the kernel updates them in place. Gathering the B rows before the kernel and scattering them back after cost
4 x B x H x V x K x 4 bytes of extra traffic per KDA layer (k3-small at B 64: 268 MB per layer, 4.8 GB per
step: ~1.2 ms at the 4.1 TB/s copy rate measured on the H200) -- the jaxpr test below fails on that layout.
Fresh rows (context_lens 0, a reused slot) are the kernel's business too (its per-row fresh flag): the step
has no scatter zeroing them in the pools (it cost 0.36 ms per k3-small step, every row dropped or not).

Config: k3-tiny cut to 3 layers (KDA at 0, 1 and MLA at 2): two KDA layers so a wrong layer offset into the
stacked pool shows, one MLA layer for the rest of the wiring; fp32 (every KDA layer adds to the
interpret-mode compile, the bulk of this file's ~25 s).
Tolerance of the interpret-vs-reference check: fp32 logits and states, fused vs unfused summation orders give
~1e-6 relative (tests/kernels/test_kda_model.py), so 1e-5 catches any wrong row, layer or fresh-state mask;
rows the step does not own must stay bit-identical.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax import backend
from k3jax.model import StepMeta
from k3jax.testing import k3_tiny, shuffled_page_tables, step_meta

CFG = k3_tiny().replace(num_layers=3, mla_layers=(2,), attn_res_block_size=2, name="k3-tiny-kda2")
PAGE = 4
KDA_OPS = ("kda_chunked", "kda_chunked_fused", "kda_decode_fused", "kda_recurrent")


@functools.cache
def model_params(seed: int) -> dict:
    """init_params(CFG) once per seed for the whole file (eager init costs seconds of CI time per call)."""
    return k3jax.init_params(CFG, jax.random.key(seed))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def step_jaxpr(step_fn, backend_name: str, batch: int, num_slots: int, num_pages: int, max_pages: int,
               tokens_shape: tuple[int, ...]):
    """The closed jaxpr of a serving step (its function under jit, so nothing is compiled) on abstract inputs."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    params = jax.eval_shape(lambda: k3jax.init_params(CFG, jax.random.key(0)))
    state = jax.eval_shape(lambda: k3jax.init_state(CFG, num_slots, num_pages, PAGE))
    meta = StepMeta(i32(batch), i32(batch, max_pages), i32(batch), i32(batch))
    step = lambda p, s, t, m: step_fn.__wrapped__(p, CFG, s, t, m, backend_name=backend_name)  # noqa: E731
    return jax.make_jaxpr(step)(params, state, i32(*tokens_shape), meta)


def decode_jaxpr(backend_name: str, batch: int, num_slots: int, num_pages: int, max_pages: int):
    return step_jaxpr(k3jax.decode, backend_name, batch, num_slots, num_pages, max_pages, (batch,)).jaxpr


def equations(jaxpr):
    """Every equation, descending into nested jaxprs (jit, custom_jvp, ...) but not into kernel bodies."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
            continue
        subs = [v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
        if subs:
            for sub in subs:
                yield from equations(sub if hasattr(sub, "eqns") else sub.jaxpr)
        else:
            yield eqn


def test_decode_step_leaves_kda_pools_to_the_kernel():
    batch, num_slots = 3, 7
    jaxpr = decode_jaxpr("pallas", batch, num_slots, num_pages=16, max_pages=4)
    h, d = CFG.kda_num_heads, CFG.kda_head_dim
    rows_shape = (batch, h, d, d)  # the step's rows of one layer's recurrent states
    layer_shape = (1, num_slots, h, d, d)  # one layer sliced out of the stacked pool
    eqns = list(equations(jaxpr))
    reads = {"gather", "slice", "dynamic_slice", "select_n", "copy", "copy_p", "concatenate", "transpose"}
    moved = [(e.primitive.name, tuple(v.aval.shape)) for e in eqns for v in e.outvars
             if e.primitive.name in reads and tuple(v.aval.shape) in (rows_shape, layer_shape)]
    assert moved == [], f"KDA state rows copied outside the kernel: {moved}"
    # per KDA layer: one kernel call, and no scatter into the pools but the blocked kernel's q|k conv write
    kernels = [e for e in eqns if e.primitive.name == "pallas_call" and "kda_decode" in str(e.params.get("name", ""))
               + str(e.params.get("name_and_src_info", ""))]
    assert len(kernels) == CFG.num_kda_layers
    pool_rows = CFG.num_kda_layers * num_slots
    scatters = [(e.primitive.name, tuple(e.invars[0].aval.shape), tuple(e.invars[2].aval.shape)) for e in eqns
                if e.primitive.name.startswith("scatter") and e.outvars[0].aval.shape[:1] == (pool_rows,)]
    qk_conv_write = (batch, CFG.kda_conv_kernel - 1, 2 * h * d)  # updates of the V-blocked kernel's conv write
    assert all(updates == qk_conv_write for _, _, updates in scatters), f"pool scatters besides the kernel's: {scatters}"
    assert len(scatters) <= CFG.num_kda_layers


def test_verify_step_reads_kda_pools_in_the_kernel():
    """Verify (k = 4): each KDA layer's kernel is handed the whole stacked pools and the step's rows, as in
    decode; nothing gathers, slices or copies state rows or a layer of the pools outside the kernel, nothing
    scatters into them, the verify kernel aliases no input to an output (so XLA has no reason to copy a pool it
    does not write), and the step returns the pools it was given, untouched (the same jaxpr variables)."""
    batch, num_slots, k = 3, 7, 4  # k != W-1, so the [B, k, 3HK] projections never look like conv rows
    closed = step_jaxpr(k3jax.verify, "pallas", batch, num_slots, num_pages=16, max_pages=4, tokens_shape=(batch, k))
    jaxpr = closed.jaxpr
    h, d = CFG.kda_num_heads, CFG.kda_head_dim
    w1, c = CFG.kda_conv_kernel - 1, CFG.conv_channels
    pool_rows = CFG.num_kda_layers * num_slots
    row_shapes = {(batch, h, d, d), (batch, w1, c)}  # the step's rows of one layer's recurrent / conv states
    layer_shapes = {(1, num_slots, h, d, d), (num_slots, h, d, d), (1, num_slots, w1, c), (num_slots, w1, c)}
    eqns = list(equations(jaxpr))
    reads = {"gather", "slice", "dynamic_slice", "select_n", "copy", "copy_p", "concatenate", "transpose", "squeeze"}
    moved = [(e.primitive.name, tuple(v.aval.shape)) for e in eqns for v in e.outvars
             if e.primitive.name in reads and tuple(v.aval.shape) in row_shapes | layer_shapes]
    assert moved == [], f"KDA state rows or pool layers copied outside the kernel: {moved}"
    kernels = [e for e in eqns if e.primitive.name == "pallas_call" and "kda_decode_verify" in
               str(e.params.get("name", "")) + str(e.params.get("name_and_src_info", ""))]
    assert len(kernels) == CFG.num_kda_layers
    for e in kernels:
        in_shapes = [tuple(v.aval.shape) for v in e.invars]
        assert (pool_rows, h, d, d) in in_shapes and (pool_rows, w1, c) in in_shapes, in_shapes
        assert not e.params["input_output_aliases"], e.params["input_output_aliases"]
        out_shapes = [tuple(v.aval.shape) for v in e.outvars]
        # per-position state updates (err [V], key and decay [K]) only: no per-position state, no conv state
        assert sorted(out_shapes[1:]) == [(batch, k, h, d)] * 3, out_shapes
    scatters = [e.primitive.name for e in eqns if e.primitive.name.startswith("scatter")
                and e.outvars[0].aval.shape[:1] in ((pool_rows,), (CFG.num_kda_layers,))]
    assert scatters == [], f"scatters into the KDA pools: {scatters}"
    # inputs: params' leaves, then DecodeState(kda, conv, kv_pages), tokens, meta; outputs: logits, DecodeState,
    # VerifiedStates -- the step hands back the very pools it was given
    num_params = len(jax.tree.leaves(jax.eval_shape(lambda: k3jax.init_params(CFG, jax.random.key(0)))))
    kda_in, conv_in = jaxpr.invars[num_params], jaxpr.invars[num_params + 1]
    assert tuple(kda_in.aval.shape) == (CFG.num_kda_layers, num_slots, h, d, d)
    assert jaxpr.outvars[1] is kda_in and jaxpr.outvars[2] is conv_in


@pytest.fixture
def kda_kernels_only(monkeypatch):
    """The interpret backend keeps only its KDA kernels (the others fall back to the reference): interpret-mode
    compiles of every kernel would not fit the CI budget, and the KDA wiring is what this file checks."""
    registry = {key: fn for key, fn in backend._REGISTRY.items() if key[1] == "reference" or key[0] in KDA_OPS}
    monkeypatch.setattr(backend, "_REGISTRY", registry)
    jax.clear_caches()
    yield
    jax.clear_caches()


def test_pooled_decode_interpret_equals_reference(kda_kernels_only):
    """Shuffled slots in a pool larger than the batch, a fresh row whose reused slot holds garbage, an idle row:
    the in-place kernel path gives the reference's logits and pools, and leaves every other slot alone."""
    rng = np.random.default_rng(11)
    params = model_params(3)
    batch, num_slots = 3, 7
    table = shuffled_page_tables(rng, batch, 4, 16)
    state = k3jax.init_state(CFG, num_slots, 16, PAGE)
    state = state.replace(  # random histories in every slot and page (the fresh row must ignore its slot's)
        kda=jnp.asarray(0.1 * rng.standard_normal(state.kda.shape), jnp.float32),
        conv=jnp.asarray(rng.standard_normal(state.conv.shape), state.conv.dtype),
        kv_pages=jnp.asarray(rng.standard_normal(state.kv_pages.shape), state.kv_pages.dtype),
    )
    slots = [5, 1, 3]
    meta = step_meta(slots, table, [6, 0, 9], [1, 1, 0])  # row 1 fresh, row 2 idle
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, batch), jnp.int32)
    out = {name: k3jax.decode(params, CFG, jax.tree.map(jnp.copy, state), tokens, meta, backend_name=name)
           for name in ("reference", "interpret")}
    (ref_logits, ref_state), (int_logits, int_state) = out["reference"], out["interpret"]
    assert rel(int_logits[:2], ref_logits[:2]) < 1e-5
    assert rel(int_state.kda, ref_state.kda) < 1e-5
    assert rel(int_state.conv, ref_state.conv) < 1e-5
    others = [s for s in range(num_slots) if s not in slots]
    for new in (int_state, ref_state):
        np.testing.assert_array_equal(new.kda[:, others], state.kda[:, others])
        np.testing.assert_array_equal(new.conv[:, others], state.conv[:, others])
        np.testing.assert_array_equal(new.kda[:, 3], state.kda[:, 3])  # the idle row's slot
    # the fresh row ran from zero states: the same as decoding it from a pool whose slot 1 is zero
    zeroed = state.replace(kda=state.kda.at[:, 1].set(0), conv=state.conv.at[:, 1].set(0))
    logits0, state0 = k3jax.decode(params, CFG, zeroed, tokens, meta, backend_name="reference")
    np.testing.assert_allclose(np.asarray(ref_logits), np.asarray(logits0), rtol=0, atol=0)
    np.testing.assert_array_equal(ref_state.kda, state0.kda)


def test_decode_into_a_reused_slot_equals_forward(kda_kernels_only):
    """Serving order on the in-place kernel path (interpret): row 0 decodes request A from nothing into slot 1
    of a pool full of random garbage, then request B takes over slot 1 (and A's pages) at context 0, while row
    1 decodes request C throughout in slot 4. B's and C's logits equal the cache-free forward at every step, so
    B's first step started from zero states although its slot held A's (and the slot-1 garbage before A's
    first step); C's rows (never fresh) carried their own states across the switch."""
    rng = np.random.default_rng(17)
    params = model_params(3)
    len_a, len_b = 3, 5
    steps = len_a + len_b
    req_a, req_b, req_c = (rng.integers(0, CFG.vocab_size, n) for n in (len_a, len_b, steps))
    want = k3jax.forward(params, CFG, jnp.asarray(np.stack([np.resize(req_b, steps), req_c])))  # B: first len_b
    num_slots, num_pages = 6, 12
    table = shuffled_page_tables(rng, 2, -(-steps // PAGE), num_pages)
    state = k3jax.init_state(CFG, num_slots, num_pages, PAGE)
    state = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), state)
    slots = [1, 4]
    for i in range(steps):
        on_a = i < len_a
        pos0 = i if on_a else i - len_a  # row 0's context: A's, then B's from 0 again
        tokens = jnp.asarray([req_a[pos0] if on_a else req_b[pos0], req_c[i]], jnp.int32)
        logits, state = k3jax.decode(params, CFG, state, tokens, step_meta(slots, table, [pos0, i], [1, 1]),
                                     backend_name="interpret")
        assert rel(logits[1], want[1, i]) < 1e-5, i
        if not on_a:
            assert rel(logits[0], want[0, pos0]) < 1e-5, i


def test_pooled_verify_interpret_equals_reference(kda_kernels_only):
    """Verify (k = 3) on the kernel path that reads the stacked pools in place (interpret) against the reference
    (which gathers the rows): shuffled slots in a pool larger than the batch; row 1 is fresh (context 0) in a
    reused slot holding garbage with inf / NaN; row 2 has 2 of 3 tokens. Logits and every per-position state
    agree (rows of valid positions); both return the pools bit-identical to what they were given; the fresh
    row's results equal verifying it from a pool whose slot is zeroed."""
    rng = np.random.default_rng(23)
    params = model_params(3)
    batch, num_slots, k = 3, 7, 3
    table = shuffled_page_tables(rng, batch, 4, 16)
    state = k3jax.init_state(CFG, num_slots, 16, PAGE)
    kda = 0.1 * rng.standard_normal(state.kda.shape)
    conv = rng.standard_normal(state.conv.shape)
    kda[1, 4, 0, 2, :3] = [np.nan, np.inf, -np.inf]  # slot 4 is the fresh row's, in the second KDA layer
    conv[0, 4, 1, :3] = [np.inf, np.nan, -1e30]
    state = state.replace(kda=jnp.asarray(kda, jnp.float32), conv=jnp.asarray(conv, state.conv.dtype),
                          kv_pages=jnp.asarray(rng.standard_normal(state.kv_pages.shape), state.kv_pages.dtype))
    slots, lengths = [2, 4, 6], [3, 3, 2]
    meta = step_meta(slots, table, [5, 0, 8], lengths)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (batch, k)), jnp.int32)
    out = {name: k3jax.verify(params, CFG, jax.tree.map(jnp.copy, state), tokens, meta, backend_name=name)
           for name in ("reference", "interpret")}
    valid = np.arange(k)[None, :] < np.asarray(lengths)[:, None]
    (ref_logits, ref_state, ref_ver), (int_logits, int_state, int_ver) = out["reference"], out["interpret"]
    assert rel(np.asarray(int_logits)[valid], np.asarray(ref_logits)[valid]) < 1e-5
    for got, want in ((int_ver.err, ref_ver.err), (int_ver.key, ref_ver.key), (int_ver.decay, ref_ver.decay),
                      (int_ver.inputs, ref_ver.inputs)):
        got, want = np.asarray(got)[:, valid], np.asarray(want)[:, valid]  # [L_kda, valid positions, ...]
        assert np.isfinite(got).all() and rel(got, want) < 1e-5
    for new in (int_state, ref_state):
        np.testing.assert_array_equal(new.kda, state.kda)
        np.testing.assert_array_equal(new.conv, state.conv)
    zeroed = state.replace(kda=state.kda.at[:, 4].set(0), conv=state.conv.at[:, 4].set(0))
    logits0, _, ver0 = k3jax.verify(params, CFG, zeroed, tokens, meta, backend_name="reference")
    np.testing.assert_array_equal(np.asarray(ref_logits), np.asarray(logits0))
    for name in ("err", "key", "decay", "inputs"):
        np.testing.assert_array_equal(np.asarray(getattr(ref_ver, name)), np.asarray(getattr(ver0, name)))


def test_pooled_verify_mixer_on_the_reference_path_gathers_the_same_rows():
    """kda_mixer(slots=, all_states=True) off the kernel path gathers the rows and returns exactly what the
    unpooled call on those rows returns (the pool is not written); all_states outside recurrent mode and slots
    of the wrong shape raise."""
    from k3jax.kda import kda_mixer

    rng = np.random.default_rng(29)
    params = model_params(3)["layers"][0]["attn"]
    h, d, w1, c = CFG.kda_num_heads, CFG.kda_head_dim, CFG.kda_conv_kernel - 1, CFG.conv_channels
    conv_pool = jnp.asarray(rng.standard_normal((9, w1, c)), jnp.float32)
    rec_pool = jnp.asarray(0.2 * rng.standard_normal((9, h, d, d)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, CFG.hidden_size)), jnp.float32)
    slots, fresh, lengths = jnp.asarray([7, 2], jnp.int32), jnp.asarray([False, True]), jnp.asarray([3, 2], jnp.int32)
    kw = dict(lengths=lengths, mode="recurrent", all_states=True, fresh=fresh)
    pooled = jax.jit(lambda *a: kda_mixer(*a, CFG, slots=slots, **kw))(params, x, conv_pool, rec_pool)
    gathered = jax.jit(lambda *a: kda_mixer(*a, CFG, **kw))(params, x, conv_pool[slots], rec_pool[slots])
    for got, want in zip(jax.tree.leaves(pooled), jax.tree.leaves(gathered)):
        np.testing.assert_array_equal(got, want)
    assert [u.shape for u in pooled[2]] == [(2, 3, h, d)] * 3 and pooled[1].shape == (2, 3, c)
    with pytest.raises(ValueError, match="all_states needs mode='recurrent'"):
        kda_mixer(params, x, conv_pool, rec_pool, CFG, slots=slots, lengths=lengths, mode="chunked", all_states=True)
    with pytest.raises(ValueError, match="slots must be"):
        kda_mixer(params, x, conv_pool, rec_pool, CFG, slots=slots[:1], **kw)
