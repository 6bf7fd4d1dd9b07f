"""EAGLE-3 drafter (k3jax/drafter.py) on k3-tiny, fp32 CPU.

Run: python -m pytest tests/model/test_drafter.py -q
The key equivalence: the training-time-test unroll (one cache-free pass) gives exactly the logits a
cached `draft_tokens` chain gives from the same position, so training optimises what serving runs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax import drafter as dr
from k3jax import train_drafter as td
from k3jax.model import forward_with_features
from k3jax.testing import k3_tiny


@pytest.fixture(scope="module")
def setup():
    cfg = k3_tiny()
    params = k3jax.init_params(cfg, jax.random.key(0))
    counts = np.random.default_rng(0).integers(0, 50, cfg.vocab_size)
    dcfg = dr.DrafterConfig(draft_vocab_size=200)
    d2t, t2d = dr.build_vocab_map(counts, 200)
    dp = dr.init_drafter(cfg, dcfg, jax.random.key(1), d2t=d2t, target_params=params)
    return cfg, params, dcfg, dp, t2d


def test_build_vocab_map():
    counts = np.array([5, 0, 9, 9, 1, 7, 0])
    d2t, t2d = dr.build_vocab_map(counts, 4)
    ids = np.arange(4) + d2t
    np.testing.assert_array_equal(ids, [0, 2, 3, 5])  # the 4 most frequent, ascending
    np.testing.assert_array_equal(np.flatnonzero(t2d), ids)
    assert d2t.dtype == np.int32 and t2d.dtype == bool
    d2t, t2d = dr.build_vocab_map(np.array([1, 1, 1, 1]), 2)  # ties: lower ids first
    np.testing.assert_array_equal(np.arange(2) + d2t, [0, 1])
    d2t, t2d = dr.build_vocab_map(counts, 7)  # full vocab: identity
    np.testing.assert_array_equal(d2t, 0)
    assert t2d.all()
    for bad in [(counts, 0), (counts, 8), (np.array([-1, 2]), 1), (np.zeros((2, 2)), 1)]:
        with pytest.raises(ValueError):
            dr.build_vocab_map(*bad)


def test_config_resolves_from_target(setup):
    cfg, *_ = setup
    d = dr.DrafterConfig(draft_vocab_size=100).resolve(cfg)
    assert d.capture_layers == k3jax.model.eagle_capture_layers(cfg) == (2, 4, 6)
    assert (d.num_heads, d.q_lora_rank, d.kv_lora_rank) == (cfg.mla_num_heads, cfg.q_lora_rank, cfg.kv_lora_rank)
    assert d.intermediate_size == cfg.intermediate_size
    assert dr.DrafterConfig(draft_vocab_size=5, capture_layers=[1, 2]).capture_layers == (1, 2)  # hashable
    assert dr.DrafterConfig.from_dict(d.to_dict()) == d
    for bad in (dict(draft_vocab_size=0), dict(draft_vocab_size=cfg.vocab_size + 1),
                dict(draft_vocab_size=10, capture_layers=(0, 9)), dict(draft_vocab_size=10, num_heads=0)):
        with pytest.raises(ValueError):
            dr.DrafterConfig(**bad).resolve(cfg)


def test_param_shapes(setup):
    cfg, params, dcfg, dp, t2d = setup
    d, dim = cfg.hidden_size, cfg.hidden_size
    assert dp["fc"].shape == (3 * d, d)
    assert dp["attn"]["q_a"].shape == (2 * d, cfg.q_lora_rank)
    assert dp["attn"]["kv_a"].shape == (2 * d, cfg.latent_cache_dim)
    assert dp["attn"]["g_proj"].shape == (2 * d, cfg.mla_num_heads * cfg.v_head_dim)
    assert dp["attn"]["o_proj"].shape == (cfg.mla_num_heads * cfg.v_head_dim, dim)
    assert dp["mlp"]["gate"].shape == (d, cfg.intermediate_size)
    assert dp["lm_head"].shape == (d, 200) and dp["d2t"].shape == (200,)
    assert "embed" not in dp  # the target's embedding is passed in, never copied
    ids = np.asarray(dr.target_ids(dp))
    np.testing.assert_array_equal(np.flatnonzero(t2d), ids)
    np.testing.assert_array_equal(dp["lm_head"], np.asarray(params["lm_head"])[:, ids])  # warm start
    with pytest.raises(ValueError):
        dr.init_drafter(cfg, dcfg, jax.random.key(0), d2t=np.zeros(5, np.int32))
    with pytest.raises(ValueError):
        dr.init_drafter(cfg, dcfg, jax.random.key(0), d2t=np.full(200, 100, np.int32))  # ids out of range


def _features(params, cfg, tokens):
    return forward_with_features(params, cfg, jnp.asarray(tokens), (2, 4, 6))[1]


def test_draft_tokens_shapes_and_jit(setup):
    cfg, params, dcfg, dp, t2d = setup
    rng = np.random.default_rng(1)
    b, t, k = 3, 6, 4
    toks = rng.integers(0, cfg.vocab_size, (b, t + 1))
    feats = _features(params, cfg, toks[:, :t])
    state = dr.init_drafter_state(cfg, dcfg, b, 16)
    assert state.kv.shape == (b, 16, cfg.latent_cache_dim) and state.max_len == 16
    lengths = jnp.asarray([6, 4, 0])
    drafts, logits, new = dr.draft_tokens(dp, cfg, dcfg, params["embed"], state, feats, jnp.asarray(toks[:, 1:]), lengths, k)
    assert drafts.shape == (b, k) and drafts.dtype == jnp.int32
    assert logits.shape == (b, k, 200) and logits.dtype == jnp.float32
    np.testing.assert_array_equal(new.length, [6, 4, 0])
    assert t2d[np.asarray(drafts)].all()  # drafts are target ids from the draft vocab
    np.testing.assert_array_equal(drafts, np.asarray(dr.target_ids(dp))[np.asarray(logits.argmax(-1))])
    # a second call of the same shapes reuses the compiled function
    before = dr.draft_tokens._cache_size()
    dr.draft_tokens(dp, cfg, dcfg, params["embed"], new, feats, jnp.asarray(toks[:, 1:]), lengths, k)
    assert dr.draft_tokens._cache_size() == before
    # sampled drafts: still in the draft vocab, reproducible per key
    s1 = dr.draft_tokens(dp, cfg, dcfg, params["embed"], state, feats, jnp.asarray(toks[:, 1:]), lengths, k, 1.0, jax.random.key(3))[0]
    s2 = dr.draft_tokens(dp, cfg, dcfg, params["embed"], state, feats, jnp.asarray(toks[:, 1:]), lengths, k, 1.0, jax.random.key(3))[0]
    np.testing.assert_array_equal(s1, s2)
    assert t2d[np.asarray(s1)].all()
    with pytest.raises(ValueError):
        dr.draft_tokens(dp, cfg, dcfg, params["embed"], state, feats[:, :, :2], jnp.asarray(toks[:, 1:]), lengths, k)
    with pytest.raises(ValueError):
        dr.draft_tokens(dp, cfg, dcfg, params["embed"], state, feats, jnp.asarray(toks[:, 2:]), lengths, k)


def test_unrolled_training_pass_equals_cached_chain(setup):
    """unrolled_logits step j at position t == draft_tokens' j-th logits when drafting from t, given the
    same tokens (the chain's own drafts); and catching up in pieces == catching up at once."""
    cfg, params, dcfg, dp, _ = setup
    rng = np.random.default_rng(2)
    b, t0, k = 2, 7, 4
    toks = rng.integers(0, cfg.vocab_size, (b, t0 + 2))  # positions 0..t0 and the token after t0
    feats = _features(params, cfg, toks[:, : t0 + 1])
    state = dr.init_drafter_state(cfg, dcfg, b, 32)
    emb = params["embed"]
    drafts, logits, st_once = dr.draft_tokens(dp, cfg, dcfg, emb, state, feats, jnp.asarray(toks[:, 1:]), jnp.full((b,), t0 + 1), k)
    seq = np.concatenate([toks, np.asarray(drafts)], axis=1)
    seq_feats = _features(params, cfg, seq)  # positions past t0 are never attended from t0
    nxt = jnp.asarray(np.concatenate([seq[:, 1:], np.zeros((b, 1), seq.dtype)], 1))
    unrolled = dr.unrolled_logits(dp, cfg, dcfg, emb, seq_feats, nxt, k)
    for j in range(k):
        np.testing.assert_allclose(unrolled[j, :, t0], logits[:, j], rtol=1e-5, atol=1e-5)
    # the same catch-up in two pieces (3 positions, then the rest)
    _, _, st = dr.draft_tokens(dp, cfg, dcfg, emb, state, feats[:, :3], jnp.asarray(toks[:, 1:4]), jnp.full((b,), 3), k)
    d2, l2, st2 = dr.draft_tokens(dp, cfg, dcfg, emb, st, feats[:, 3:], jnp.asarray(toks[:, 4:]), jnp.full((b,), t0 - 2), k)
    np.testing.assert_array_equal(d2, drafts)
    np.testing.assert_allclose(l2, logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(st2.kv[:, : t0 + 1], st_once.kv[:, : t0 + 1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_ttt_loss_trains(setup):
    """A few adamw steps on generated data lower the training-time-test loss; gradients reach every
    trainable parameter."""
    cfg, params, dcfg, dp, _ = setup
    tcfg = td.TrainConfig(num_seqs=8, prompt_len=6, gen_len=10, gen_batch=8, steps=12, batch_size=8, lr=3e-3,
                          ttt_steps=3, target_temperature=0.1)
    data = td.build_dataset(params, cfg, tcfg, (2, 4, 6), seed=0, log=lambda *a: None)
    assert data["tokens"].shape == (8, 16) and data["features"].shape == (8, 16, 3, cfg.hidden_size)
    args = (cfg, dcfg, params["embed"], jnp.asarray(data["features"]), jnp.asarray(data["tokens"]),
            jnp.asarray(data["logits"]), 3)
    trainable = {k: v for k, v in dp.items() if k != "d2t"}
    grads = jax.grad(lambda p: td.ttt_loss(p, dp["d2t"], *args)[0])(trainable)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        assert float(jnp.abs(g).max()) > 0, jax.tree_util.keystr(path)
    loss0 = float(td.ttt_loss(trainable, dp["d2t"], *args, target_temperature=0.1)[0])
    trained, hist = td.train(params, cfg, dcfg, data, tcfg, dp, log=lambda *a: None)
    loss1 = float(td.ttt_loss({k: v for k, v in trained.items() if k != "d2t"}, dp["d2t"], *args, target_temperature=0.1)[0])
    assert loss1 < loss0
    np.testing.assert_array_equal(trained["d2t"], dp["d2t"])


def test_save_load_roundtrip(setup, tmp_path):
    cfg, params, dcfg, dp, _ = setup
    dr.save_drafter(tmp_path / "d", cfg, dcfg, dp)
    cfg2, dcfg2, dp2 = dr.load_drafter(tmp_path / "d")
    assert cfg2 == cfg and dcfg2 == dcfg.resolve(cfg)
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(dp2)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError):
        dr.save_drafter(tmp_path / "d", cfg, dcfg, dp)  # not empty
    with pytest.raises(ValueError):
        dr.load_drafter(tmp_path)
