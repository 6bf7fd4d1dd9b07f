"""Whole-model equivalences on tiny K3 and Kimi-Linear configs (fp32, CPU).

Run: python -m pytest tests/model/test_model.py -q
Cached decode = full forward, chunked prefill = prefill at once, verify = k decodes, paged = contiguous.
Tolerance: fp32 logits of a 9-layer model differ by summation order only (~1e-6 relative); 1e-5 relative
catches any real bookkeeping error (a wrong position, a missed state update) by orders of magnitude.

CPU time is compilation: every (function, config, shape, static flag) is its own XLA program. So the tests
of one config share shapes where the length does not matter: one pool of MAX_PAGES pages per row (one
decode program), prefills of 11 tokens (with and without all_logits) and of 7, forwards of 11 tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax.testing import k3_tiny, kimi_linear_tiny, shuffled_page_tables, step_meta

CONFIGS = [k3_tiny(), kimi_linear_tiny()]
PAGE = 4
MAX_PAGES = 6  # per row: 24 tokens, the longest sequence below (21); every test's pool has this shape


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c.name)
def model(request):
    cfg = request.param
    return cfg, k3jax.init_params(cfg, jax.random.key(11))


def fresh(cfg, rng, batch, max_pages=MAX_PAGES, slots=5):
    num_pages = batch * max_pages + 7
    table = shuffled_page_tables(rng, batch, max_pages, num_pages)
    return k3jax.init_state(cfg, num_slots=slots, num_pages=num_pages, page_size=PAGE), table


def test_prefill_then_decode_equals_forward(model):
    cfg, params = model
    rng = np.random.default_rng(0)
    b, t = 2, 21
    tokens = rng.integers(0, cfg.vocab_size, (b, t))
    want = k3jax.forward(params, cfg, jnp.asarray(tokens))
    state, table = fresh(cfg, rng, b)
    slots = [4, 1]
    prompt = np.array([9, 11])  # ragged prompts: row 0 is padded in the prefill batch
    padded = np.where(np.arange(11)[None] < prompt[:, None], tokens[:, :11], cfg.pad_token_id)
    logits, state = k3jax.prefill(params, cfg, state, jnp.asarray(padded), step_meta(slots, table, [0, 0], prompt), all_logits=True)
    for r in range(b):
        assert rel(logits[r, : prompt[r]], want[r, : prompt[r]]) < 1e-5
    pos = prompt.copy()
    while (pos < t).any():
        live = pos < t
        tok = np.where(live, tokens[np.arange(b), np.minimum(pos, t - 1)], 0)
        logits, state = k3jax.decode(params, cfg, state, jnp.asarray(tok), step_meta(slots, table, pos, live.astype(int)))
        for r in np.flatnonzero(live):
            assert rel(logits[r], want[r, pos[r]]) < 1e-5, (r, pos[r])
        pos = pos + live


def test_prefill_from_zero_ignores_what_a_reused_slot_and_pages_hold(model):
    """Slots and pages are reused without being cleared: a row with context_lens 0 must start from the
    zero KDA/conv state (a stale slot once made a fresh request continue its predecessor's state)."""
    cfg, params = model
    rng = np.random.default_rng(5)
    b, t = 2, 11
    tokens = rng.integers(0, cfg.vocab_size, (b, t))
    want = k3jax.forward(params, cfg, jnp.asarray(tokens))
    clean, table = fresh(cfg, rng, b)
    dirty = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), clean)  # a used pool
    meta = step_meta([3, 0], table, [0, 0], [t, t])
    logits, state = k3jax.prefill(params, cfg, dirty, jnp.asarray(tokens), meta, all_logits=True)
    assert rel(logits, want) < 1e-5
    _, ref = k3jax.prefill(params, cfg, clean, jnp.asarray(tokens), meta)
    assert rel(state.kda[:, [3, 0]], ref.kda[:, [3, 0]]) < 1e-5
    assert rel(state.conv[:, [3, 0]], ref.conv[:, [3, 0]]) < 1e-5


def test_chunked_prefill_equals_prefill_at_once(model):
    cfg, params = model
    rng = np.random.default_rng(1)
    b, t = 2, 19
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)))
    state_a, table = fresh(cfg, rng, b)
    logits_a, state_a = k3jax.prefill(params, cfg, state_a, tokens, step_meta([0, 2], table, [0, 0], [t, t]))
    state_b = k3jax.init_state(cfg, 5, state_a.kv_pages.shape[1], PAGE)
    ctx = 0
    for n in (7, 11, 1):  # uneven chunks ending at 7 and 18, not aligned to pages (and lengths other tests compile)
        logits_b, state_b = k3jax.prefill(params, cfg, state_b, tokens[:, ctx : ctx + n], step_meta([0, 2], table, [ctx, ctx], [n, n]))
        ctx += n
    assert rel(logits_b, logits_a) < 1e-5
    for a, bb in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
        assert rel(bb, a) < 1e-5


def test_verify_equals_sequential_decode(model):
    cfg, params = model
    rng = np.random.default_rng(2)
    b, prompt, k = 2, 7, 4
    tokens = rng.integers(0, cfg.vocab_size, (b, prompt + k))
    state, table = fresh(cfg, rng, b)
    slots = [3, 0]
    _, state = k3jax.prefill(params, cfg, state, jnp.asarray(tokens[:, :prompt]), step_meta(slots, table, [0, 0], [prompt] * b))
    base = jax.tree.map(jnp.copy, state)
    vlogits, state_v, verified = k3jax.verify(params, cfg, state, jnp.asarray(tokens[:, prompt:]), step_meta(slots, table, [prompt] * b, [k] * b))
    np.testing.assert_array_equal(state_v.kda, base.kda)  # verify leaves the pooled KDA states alone
    seq = jax.tree.map(jnp.copy, base)
    per_step = []
    for i in range(k):
        logits, seq = k3jax.decode(params, cfg, seq, jnp.asarray(tokens[:, prompt + i]), step_meta(slots, table, [prompt + i] * b, [1, 1]))
        assert rel(vlogits[:, i], logits) < 1e-5
        per_step.append(jax.tree.map(jnp.copy, seq))
        # the state after position i, rebuilt from the pool's state before verify and the updates
        kept = k3jax.commit_verified(jax.tree.map(jnp.copy, state_v), verified, jnp.asarray(slots), jnp.full((b,), i + 1))
        assert rel(kept.kda[:, np.array(slots)], seq.kda[:, np.array(slots)]) < 1e-5
        assert rel(kept.conv[:, np.array(slots)], seq.conv[:, np.array(slots)]) < 1e-5  # (GEMM shapes differ)
    # verify hands back a [V] and two [K] vectors per layer, row, position and head, not states
    h, dv, dk = base.kda.shape[2:]
    assert verified.err.shape == (cfg.num_kda_layers, b, k, h, dv)
    assert verified.key.shape == verified.decay.shape == (cfg.num_kda_layers, b, k, h, dk)
    # keep 2 positions of row 0 and 3 of row 1: the pool then equals the matching decode states
    committed = k3jax.commit_verified(state_v, verified, jnp.asarray(slots), jnp.asarray([2, 3]))
    assert rel(committed.kda[:, 3], per_step[1].kda[:, 3]) < 1e-5
    assert rel(committed.kda[:, 0], per_step[2].kda[:, 0]) < 1e-5
    assert rel(committed.conv[:, 3], per_step[1].conv[:, 3]) < 1e-5
    assert rel(committed.conv[:, 0], per_step[2].conv[:, 0]) < 1e-5
    # and decoding on from the committed state continues the row-0 sequence correctly
    nxt = np.array([tokens[0, prompt + 2], tokens[1, prompt + 3]])
    logits_c, _ = k3jax.decode(params, cfg, committed, jnp.asarray(nxt), step_meta(slots, table, [prompt + 2, prompt + 3], [1, 1]))
    full = k3jax.forward(params, cfg, jnp.asarray(tokens))
    assert rel(logits_c[0], full[0, prompt + 2]) < 1e-5
    assert rel(logits_c[1], full[1, prompt + 3]) < 1e-5


def test_every_parameter_is_used(model):
    """A layer silently skipped shows up as a parameter with zero gradient. Exactly two kinds must have
    none: the router correction bias (it steers selection only) and layer 0's attention-side AttnRes
    query/norm (the bank is empty there, so there is nothing to mix; K3 still ships the tensors)."""
    cfg, params = model
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 33)))
    probe = jax.random.normal(jax.random.key(4), (2, 33, cfg.vocab_size))
    grads = jax.grad(lambda p: jnp.sum(k3jax.forward(p, cfg, tokens) * probe))(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    assert len(flat) == len(jax.tree.leaves(params))
    for path, g in flat:
        name = jax.tree_util.keystr(path)
        if name.endswith("['router_bias']") or name.startswith("['layers'][0]['self_attention_res_"):
            assert float(jnp.abs(g).max()) == 0.0, name
        elif "['experts']" in name:  # every expert that was routed to gets gradient; most are
            per_expert = jnp.abs(g).reshape(g.shape[0], -1).max(1)
            assert int((per_expert > 0).sum()) >= cfg.num_experts - 1, name
        else:
            assert float(jnp.abs(g).max()) > 0.0, name


# Each variant compiles its own model (init, forward, prefill, decode: ~50 s on the 2-core CPU at 9 layers), so
# orthogonal features share a config: tied embeddings with two dense layers, grouped routing with AttnRes
# on every layer, softmax routing without renormalisation with SiTU without the linear up-cap. Each
# feature still departs from the base alone in its own dimension (vocabulary head, layer kind, router,
# residual mixing, activation), and every one of them is compared with the cache-free forward pass.
# The base is k3-tiny's first 5 layers with MLA on the last two (compile time grows with depth; every
# feature acts per layer): it keeps every k3-tiny layer kind -- dense layer 0, KDA, MLA, two MLA in a row
# (k3-tiny's 7, 8), MoE -- and a second AttnRes block (bank at layers 0 and 4).
VARIANT_BASE = dict(num_layers=5, mla_layers=(3, 4))
@pytest.mark.parametrize(
    "changes",
    [
        dict(tie_word_embeddings=True, first_k_dense_replace=2, moe_layer_freq=1),
        dict(num_experts=8, num_expert_group=4, topk_group=2, num_experts_per_tok=2, attn_res_block_size=1),
        dict(moe_renormalize=False, routed_scaling_factor=2.5, router_score="softmax", situ_linear_beta=None),
    ],
    ids=["tied+two-dense", "grouped-routing+attnres-every-layer", "no-renorm-softmax+situ-no-up-cap"],
)
def test_config_variants_decode_equals_forward(changes):
    cfg = k3_tiny().replace(**VARIANT_BASE, **changes)
    params = k3jax.init_params(cfg, jax.random.key(5))
    if cfg.tie_word_embeddings:
        assert "lm_head" not in params
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, cfg.vocab_size, (1, 10))
    want = k3jax.forward(params, cfg, jnp.asarray(tokens))
    state, table = fresh(cfg, rng, 1, 3)
    _, state = k3jax.prefill(params, cfg, state, jnp.asarray(tokens[:, :9]), step_meta([0], table, [0], [9]))
    logits, _ = k3jax.decode(params, cfg, state, jnp.asarray(tokens[:, 9]), step_meta([0], table, [9], [1]))
    assert rel(logits, want[:, 9]) < 1e-5
    assert np.isfinite(np.asarray(want)).all()


def test_bf16_tracks_fp32():
    cfg32 = k3_tiny()
    cfg16 = cfg32.replace(dtype="bfloat16")
    params = k3jax.init_params(cfg32, jax.random.key(7))
    params16 = jax.tree.map(lambda x: x if x.dtype == jnp.float32 and x.ndim <= 1 and False else x, params)
    params16 = jax.tree_util.tree_map_with_path(
        lambda path, x: x if jax.tree_util.keystr(path).endswith(("['A_log']", "['dt_bias']", "_conv']", "['router_bias']")) else x.astype(jnp.bfloat16),
        params,
    )
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, cfg32.vocab_size, (2, 21)))  # forward's k3-tiny shape above
    lo32 = k3jax.forward(params, cfg32, tokens)
    lo16 = k3jax.forward(params16, cfg16, tokens)
    # bf16 has an 8-bit mantissa (rel. rounding 4e-3 per op); over 9 layers errors grow to a few 1e-2
    assert rel(lo16, lo32) < 5e-2


@pytest.mark.slow
def test_k3_depth_stays_finite():
    """K3's 93-layer pattern (24 MLA, AttnRes blocks of 12) at tiny width: random init gives finite,
    non-degenerate logits."""
    k3 = k3jax.load_config("k3")
    cfg = k3_tiny().replace(num_layers=93, mla_layers=k3.mla_layers, attn_res_block_size=12, name="k3-depth")
    params = k3jax.init_params(cfg, jax.random.key(9))
    tokens = jnp.asarray(np.random.default_rng(10).integers(0, cfg.vocab_size, (1, 70)))
    # op by op: the same arithmetic as the jitted forward, without compiling 93 unrolled layers into one XLA program
    # (CPU: ~18 s instead of ~100 s)
    with jax.disable_jit():
        logits = np.asarray(k3jax.forward(params, cfg, tokens))
    assert np.isfinite(logits).all()
    assert logits.std(-1).min() > 1e-3  # distinct tokens are not collapsed to one distribution


def test_bad_tokens_raise():
    cfg = CONFIGS[0]
    with pytest.raises(ValueError):
        k3jax.forward(k3jax.init_params(cfg, jax.random.key(0)), cfg, jnp.zeros((3,), jnp.int32))


def test_forward_with_features_captures_layer_inputs(model):
    cfg, params = model
    tokens = jnp.asarray(np.random.default_rng(12).integers(0, cfg.vocab_size, (2, 11)))  # forward's shape above
    layers = k3jax.model.eagle_capture_layers(cfg)
    assert layers == (2, cfg.num_layers // 2, cfg.num_layers - 3)
    logits, feats = k3jax.model.forward_with_features(params, cfg, tokens, layers)
    np.testing.assert_array_equal(logits, k3jax.forward(params, cfg, tokens))
    assert feats.shape == (2, 11, 3, cfg.hidden_size) and np.isfinite(np.asarray(feats)).all()
    # distinct layers see distinct states, and causality holds: position 4 ignores later tokens
    assert float(jnp.abs(feats[:, :, 0] - feats[:, :, 2]).max()) > 1e-3
    _, feats_short = k3jax.model.forward_with_features(params, cfg, tokens[:, :5], layers)
    assert rel(feats_short[:, 4], feats[:, 4]) < 1e-5
