"""Speculative decoding (k3jax/speculative.py) over the serving steps, k3-tiny fp32 CPU.

Run: python -m pytest tests/model/test_speculative.py -q   (-m "not slow" skips the training test)

Backbone equivalence: greedy speculative output == the target's plain greedy chain (prefill + decode),
for k = 1, 2, 3, 5, with a random drafter and with a trained one. The random-init target is a very
context-sensitive function (its top-2 logits are close), so any wrong KDA rollback or MLA position
flips tokens. The fixed-acceptance benchmark mode forces every acceptance count 0..k and checks each
bonus token against a cache-free forward, which exercises multi-token commits that a weak drafter
rarely triggers. Rejection sampling is checked statistically (chi-square, p > 1e-3).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import k3jax
from k3jax import drafter as dr
from k3jax import speculative as sp
from k3jax import train_drafter as td
from k3jax.model import forward_with_features
from k3jax.testing import k3_tiny, shuffled_page_tables, step_meta

P_MIN = 1e-3  # chi-square tests fail below this p-value


def chi2_pvalue(observed, probs):
    """Pearson chi-square p-value of counts `observed` against the distribution `probs` (cells > 0)."""
    observed, probs = np.asarray(observed, np.float64), np.asarray(probs, np.float64)
    keep = probs > 0
    assert observed[~keep].sum() == 0, "a token with zero probability was drawn"
    expected = probs[keep] / probs[keep].sum() * observed[keep].sum()
    return stats.chisquare(observed[keep], expected).pvalue


@pytest.fixture(scope="module")
def target():
    cfg = k3_tiny()
    return cfg, k3jax.init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def random_drafter(target):
    cfg, params = target
    dcfg = dr.DrafterConfig(draft_vocab_size=220)
    d2t, _ = dr.build_vocab_map(np.arange(cfg.vocab_size)[::-1], 220)
    return dcfg, dr.init_drafter(cfg, dcfg, jax.random.key(1), d2t=d2t, target_params=params)


def plain_greedy(params, cfg, prompts, n):
    """The target's greedy continuation by k3jax.prefill + k3jax.decode, one row at a time."""
    out = []
    for p in prompts:
        state = k3jax.init_state(cfg, 1, 8, 16)
        table = np.arange(8)[None]
        logits, state = k3jax.prefill(params, cfg, state, jnp.asarray([p]), step_meta([0], table, [0], [len(p)]))
        toks = []
        for i in range(n):
            toks.append(int(jnp.argmax(logits[0])))
            if i + 1 < n:
                logits, state = k3jax.decode(params, cfg, state, jnp.asarray(toks[-1:]), step_meta([0], table, [len(p) + i], [1]))
        out.append(toks)
    return out


@pytest.fixture(scope="module")
def prompts_and_greedy(target):
    cfg, params = target
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in (6, 11, 9)]
    want = plain_greedy(params, cfg, prompts, 16)
    # the serving steps' chain equals the cache-free forward's argmax chain
    seq = prompts[0] + want[0]
    logits = k3jax.forward(params, cfg, jnp.asarray([seq]))
    np.testing.assert_array_equal(np.asarray(logits[0, len(prompts[0]) - 1 : -1].argmax(-1)), want[0])
    return prompts, want


@pytest.mark.slow
def test_target_step_matches_serving_steps(target):
    """target_step is k3jax.prefill / k3jax.verify plus features: same logits, states and verified states."""
    cfg, params = target
    rng = np.random.default_rng(0)
    b, t, k = 2, 9, 4
    toks = rng.integers(0, cfg.vocab_size, (b, t + k))
    table = shuffled_page_tables(rng, b, 5, 12)
    fresh = lambda: k3jax.init_state(cfg, num_slots=3, num_pages=12, page_size=4)
    slots, lens = [2, 0], [t, t - 3]
    meta = step_meta(slots, table, [0, 0], lens)
    want_logits, want_state = k3jax.prefill(params, cfg, fresh(), jnp.asarray(toks[:, :t]), meta)
    logits, state, none, feats = sp.target_step(params, cfg, fresh(), jnp.asarray(toks[:, :t]), meta, (2, 4, 6), False)
    assert none is None
    np.testing.assert_allclose(logits, want_logits, rtol=1e-6, atol=1e-6)
    for a, w in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
        np.testing.assert_allclose(a, w, rtol=1e-6, atol=1e-6)
    ref = forward_with_features(params, cfg, jnp.asarray(toks[:, :t]), (2, 4, 6))[1]
    np.testing.assert_allclose(feats[0], ref[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(feats[1, : t - 3], ref[1, : t - 3], rtol=1e-4, atol=1e-5)

    vmeta = step_meta(slots, table, lens, [k, k])
    base = jax.tree.map(jnp.copy, state)
    wl, ws, wv = k3jax.verify(params, cfg, jax.tree.map(jnp.copy, base), jnp.asarray(toks[:, t:]), vmeta)
    vl, vs, vv, vf = sp.target_step(params, cfg, base, jnp.asarray(toks[:, t:]), vmeta, (2, 4, 6), True)
    for a, w in zip(jax.tree.leaves((vl, vs, vv)), jax.tree.leaves((wl, ws, wv))):
        np.testing.assert_allclose(a, w, rtol=1e-6, atol=1e-6)
    full = forward_with_features(params, cfg, jnp.asarray(toks), (2, 4, 6))[1]
    np.testing.assert_allclose(vf[0], full[0, t:], rtol=1e-4, atol=1e-5)
    assert vf.shape == (b, k, 3, cfg.hidden_size)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_greedy_equals_plain_greedy_random_drafter(target, random_drafter, prompts_and_greedy, k):
    cfg, params = target
    dcfg, dp = random_drafter
    prompts, want = prompts_and_greedy
    res = sp.speculative_generate(params, cfg, dp, dcfg, prompts, 16, k, page_size=4)
    assert res.tokens == want
    assert res.accepted.shape[1] == 3 and res.accepted.max() <= k
    assert res.mean_acceptance_length >= 1.0


@pytest.mark.parametrize("accept", [0, 1, 2, 3])
def test_fixed_acceptance_mode_commits_any_prefix(target, random_drafter, accept):
    """Benchmark mode accepts exactly `accept` of k=3 drafts per round. Outputs are not the target's, but
    every bonus token must still be the target's argmax after the emitted prefix: this checks the KDA
    rollback / MLA advance for each acceptance count against a cache-free forward."""
    cfg, params = target
    dcfg, dp = random_drafter
    prompts = [[5, 9, 17, 2, 77], [1, 2, 3]]
    with pytest.raises(ValueError, match="benchmark"):
        sp.speculative_generate(params, cfg, dp, dcfg, prompts, 12, 3, fixed_accepted=accept)
    res = sp.speculative_generate(params, cfg, dp, dcfg, prompts, 12, 3, fixed_accepted=accept, benchmark_only=True,
                                  page_size=4)
    assert (res.accepted[res.accepted >= 0] == accept).all()
    assert res.mean_acceptance_length == accept + 1
    for p, out in zip(prompts, res.tokens):
        logits = k3jax.forward(params, cfg, jnp.asarray([p + out]))[0]
        best = np.asarray(logits.argmax(-1))
        bonus_positions = [i for i in range(len(out)) if i == 0 or i % (accept + 1) == 0]  # 0: from prefill
        for i in bonus_positions:
            assert out[i] == best[len(p) + i - 1], (accept, i)


def test_bad_inputs(target, random_drafter):
    cfg, params = target
    dcfg, dp = random_drafter
    ok = [[1, 2, 3]]
    for kwargs in (dict(prompts=[]), dict(prompts=[[]]), dict(prompts=[[cfg.vocab_size]]), dict(max_tokens=0),
                   dict(k=0), dict(sampling="beam"), dict(sampling="rejection", temperature=0.0),
                   dict(draft_sampling="nope"), dict(fixed_accepted=4, benchmark_only=True)):
        args = dict(prompts=ok, max_tokens=4, k=3) | kwargs
        with pytest.raises(ValueError):
            sp.speculative_generate(params, cfg, dp, dcfg, args.pop("prompts"), args.pop("max_tokens"), args.pop("k"), **args)


def test_greedy_accept():
    v = 7
    logits = jax.nn.one_hot(jnp.asarray([[3, 1, 4, 5], [2, 2, 2, 2]]), v)  # argmax per position
    drafts = jnp.asarray([[3, 1, 6], [0, 2, 2]])
    acc, nxt = sp.greedy_accept(logits, drafts)
    np.testing.assert_array_equal(acc, [2, 0])
    np.testing.assert_array_equal(nxt, [4, 2])
    acc, nxt = sp.greedy_accept(logits, jnp.asarray([[3, 1, 4], [2, 2, 2]]))
    np.testing.assert_array_equal(acc, [3, 3])
    np.testing.assert_array_equal(nxt, [5, 2])


@pytest.mark.parametrize("greedy_draft", [False, True], ids=["sampled-q", "one-hot-q"])
def test_rejection_accept_preserves_distribution(greedy_draft):
    """V = 5, k = 2, fixed p_0, p_1, p_2 and q_0, q_1: the first emitted token ~ p_0, and given the first
    draft was accepted, the second emitted token ~ p_1 (chi-square over 40000 draws)."""
    rng = np.random.default_rng(0)
    v, k, n = 5, 2, 40000
    p = rng.dirichlet(np.ones(v), k + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(v) * 0.5, k).astype(np.float32)
    if greedy_draft:
        q = np.eye(v, dtype=np.float32)[np.argsort(p[:k], -1)[:, -2]]  # a greedy draft of a likely token
    keys = jax.random.split(jax.random.key(1), n)

    def one(key):
        kd, ka = jax.random.split(key)
        drafts = jax.random.categorical(kd, jnp.log(jnp.asarray(q)), axis=-1)[None].astype(jnp.int32)
        acc, nxt = sp.rejection_accept(jnp.asarray(p)[None], jnp.asarray(q)[None], drafts, ka)
        return drafts[0], acc[0], nxt[0]

    drafts, acc, nxt = map(np.asarray, jax.vmap(one)(keys))
    first = np.where(acc >= 1, drafts[:, 0], nxt)
    assert 0.05 < (acc >= 1).mean() < 0.95  # both branches are exercised
    assert chi2_pvalue(np.bincount(first, minlength=v), p[0]) > P_MIN
    sel = acc >= 1
    second = np.where(acc[sel] >= 2, drafts[sel, 1], nxt[sel])
    assert chi2_pvalue(np.bincount(second, minlength=v), p[1]) > P_MIN


@pytest.mark.slow
def test_rejection_sampling_end_to_end(target):
    """The second generated token (the first one that goes through draft + verify + rejection) has the
    target's marginal distribution sum_t1 p(t1) p(t2 | t1). A peaked target (lm_head x 25) and a drafter
    whose q differs from p; 2000 rows of one prompt in one batch."""
    cfg, params = target
    params = dict(params, lm_head=params["lm_head"] * 25.0)
    dcfg = dr.DrafterConfig(draft_vocab_size=240)
    dp = dr.init_drafter(cfg, dcfg, jax.random.key(7), target_params=params)
    dp = dict(dp, lm_head=dp["lm_head"] * 0.7)
    prompt = [11, 42, 7, 99, 3]
    n = 2000
    res = sp.speculative_generate(params, cfg, dp, dcfg, [prompt] * n, 3, 2, sampling="rejection", temperature=1.0,
                                  seed=3, page_size=8)
    toks = np.asarray(res.tokens)
    first_round = res.accepted[0]
    assert 0.05 < (first_round >= 1).mean() < 0.95
    p1 = np.asarray(jax.nn.softmax(k3jax.forward(params, cfg, jnp.asarray([prompt]))[0, -1]))
    cand = np.arange(cfg.vocab_size)
    seqs = np.concatenate([np.tile(prompt, (cfg.vocab_size, 1)), cand[:, None]], 1)
    p2_given = np.asarray(jax.nn.softmax(k3jax.forward(params, cfg, jnp.asarray(seqs))[:, -1]))
    for pos, expected in ((0, p1), (1, p1 @ p2_given)):
        observed = np.bincount(toks[:, pos], minlength=cfg.vocab_size)
        big = expected * n >= 5  # pool the rare tokens into one cell
        obs = np.append(observed[big], observed[~big].sum())
        exp = np.append(expected[big], expected[~big].sum()) * n
        assert chi2_pvalue(obs, exp) > P_MIN, pos


def _distil(params, cfg, **train):
    t0 = time.time()
    dcfg, dp, info = td.distil(params, cfg, td.TrainConfig(**train), log=lambda *a: None)
    return dcfg, dp, info, time.time() - t0


HELD_OUT = dict(n=32, length=16, max_tokens=32)  # held-out random prompts (seed 12345), never trained on


def _held_out_acceptance(params, cfg, dcfg, dp, k=3):
    prompts = td.random_prompts(np.random.default_rng(12345), cfg, HELD_OUT["n"], HELD_OUT["length"])
    return td.evaluate_acceptance(params, cfg, dp, dcfg, prompts, max_tokens=HELD_OUT["max_tokens"], k=k)


# CPU distillation budget: 192 generated sequences (16-token random prompts + 48 target tokens, half
# greedy, half sampled at T=1), 200 adamw steps of batch 32, 4 training-time-test steps, distilled against
# softmax(logits / 0.05) (a random-init target's own softmax is nearly uniform: logit std ~0.17).
TRAIN = dict(num_seqs=192, steps=200, target_temperature=0.05)


@pytest.mark.slow
def test_trained_drafter_on_random_target(target, prompts_and_greedy):
    """The default random-init k3-tiny target (init_params(cfg, key(0))). Its next token is a nearly
    hash-like function of the context: argmax agreement of a linear probe on (f_t, x_{t+1}) is 2.4%,
    and even an H200 run (32768 sequences, 3000 steps of batch 256) reached only 3.3% held-out top-1
    agreement, mean acceptance length 1.038 at k=3. So the > 1.5 target is out of reach here; the test
    records the number and checks that training beats the untrained drafter."""
    cfg, params = target
    dcfg, dp, info, seconds = _distil(params, cfg, **TRAIN)
    prompts, want = prompts_and_greedy
    for k in (1, 2, 3, 5):
        assert sp.speculative_generate(params, cfg, dp, dcfg, prompts, 16, k, page_size=4).tokens == want, k
    acc = _held_out_acceptance(params, cfg, dcfg, dp)
    untrained = _held_out_acceptance(params, cfg, dcfg, dr.init_drafter(cfg, dcfg, jax.random.key(0), d2t=dp["d2t"],
                                                                        target_params=params))
    print(f"\nrandom-init target: held-out mean acceptance length (k=3, greedy) {acc:.4f} "
          f"(untrained drafter {untrained:.4f}) after {seconds:.0f}s "
          f"(data {info['data_seconds']:.0f}s, train {info['train_seconds']:.0f}s)")
    assert acc > RANDOM_TARGET_FLOOR and acc > untrained


RANDOM_TARGET_FLOOR = 1.006  # reached 1.0122 (untrained drafter: 1.0040)


def _bigram_target(params):
    """The same K3 target with its embedding x30: the residual stream then carries the current token
    strongly, so the next token is mostly (65% mode agreement) a function of the current one."""
    return dict(params, embed=params["embed"] * 30.0)


@pytest.mark.slow
def test_trained_drafter_on_predictable_target(target):
    """Pipeline check on a learnable target: distillation reaches acceptance length > 1.5 at k=3, and greedy
    speculative output (now with many multi-token accepts) equals the target's plain greedy chain."""
    cfg, base = target
    params = _bigram_target(base)
    dcfg, dp, info, seconds = _distil(params, cfg, **TRAIN)
    acc = _held_out_acceptance(params, cfg, dcfg, dp)
    print(f"\npredictable target: held-out mean acceptance length (k=3, greedy) {acc:.3f} after {seconds:.0f}s")
    assert acc > PREDICTABLE_FLOOR
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 256, n).tolist() for n in (7, 12)]
    want = plain_greedy(params, cfg, prompts, 24)
    for k in (1, 2, 3, 5):
        res = sp.speculative_generate(params, cfg, dp, dcfg, prompts, 24, k, page_size=4)
        assert res.tokens == want, k
        if k > 1:
            assert (res.accepted >= 2).any()  # multi-token commits happened


PREDICTABLE_FLOOR = 1.8  # reached 2.319; the goal is > 1.5
