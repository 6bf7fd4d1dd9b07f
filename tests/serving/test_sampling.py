"""The batched sampler: greedy exactness, filters against a numpy reference, empirical distributions,
per-row reproducibility and no recompilation across parameter values.

Run: python -m pytest tests/serving/test_sampling.py -q
"""

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.sampling import (
    SamplingTensors,
    fold_seed,
    greedy,
    mask_tokens,
    process_logits,
    sample,
    suppress_ids,
)
from serving.request import SamplingParams

N = 20_000  # rows of the statistical tests: one sample per row, seeds 0..N-1
LOGITS7 = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2], np.float32)
# chi-square with <= 6 degrees of freedom exceeds 30 with probability < 1e-4; the seeds are fixed, so
# the test is deterministic, and the power checks below show that a wrong distribution scores > 300.
CHI2_BOUND = 30.0


def rows(n, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, position=0, banned=None):
    """SamplingTensors with each field broadcast to n rows (seed defaults to 0..n-1)."""
    full = lambda v, dt: jnp.asarray(np.broadcast_to(np.asarray(v, dt), (n,)).copy())
    return SamplingTensors(
        temperature=full(temperature, np.float32),
        top_k=full(top_k, np.int32),
        top_p=full(top_p, np.float32),
        min_p=full(min_p, np.float32),
        seed=full(np.arange(n) if seed is None else seed, np.uint32),
        position=full(position, np.int32),
        banned_ids=jnp.asarray(np.full((n, 8), -1, np.int32) if banned is None else banned),
    )


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def counts(tokens, v=7):
    return np.bincount(np.asarray(tokens), minlength=v)


def chi2(observed, probs):
    """Pearson statistic over the tokens with probs > 0; tokens with probs == 0 must never appear."""
    probs = np.asarray(probs, np.float64)
    assert observed[probs == 0].sum() == 0, (observed, probs)
    expected = probs * observed.sum()
    keep = probs > 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def draw7(**kw):
    logits = jnp.broadcast_to(jnp.asarray(LOGITS7), (N, 7))
    return counts(sample(logits, rows(N, **kw)))


def reference_keep(logits, t, k, p, min_p):
    """vLLM's filters in numpy (ascending sort, cumsum <= 1 - p dropped): bool [V] of kept tokens."""
    x = logits.astype(np.float64) / t
    v = x.shape[0]
    keep = np.ones(v, bool)
    order = np.argsort(x)  # ascending
    if 0 < k < v:
        keep[order[: v - k]] = False
    if p < 1:
        xs = np.where(keep[order], x[order], -np.inf)
        probs = softmax(xs)
        drop = np.cumsum(probs) <= 1 - p
        drop[-1] = False
        keep[order[drop]] = False
    probs = softmax(np.where(keep, x, -np.inf))
    return keep & (probs >= min_p * probs.max())


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_rows_equal_argmax_whatever_the_other_knobs():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, 50)).astype(np.float32) * 3
    params = rows(16, temperature=0.0, top_k=rng.integers(0, 5, 16), top_p=rng.uniform(0.1, 1, 16),
                  min_p=rng.uniform(0, 0.9, 16), position=rng.integers(0, 100, 16))
    np.testing.assert_array_equal(np.asarray(sample(jnp.asarray(logits), params)), logits.argmax(-1))
    np.testing.assert_array_equal(np.asarray(greedy(jnp.asarray(logits))), logits.argmax(-1))
    # below SAMPLING_EPS is greedy too (dividing by it would overflow)
    np.testing.assert_array_equal(np.asarray(sample(jnp.asarray(logits), rows(16, temperature=1e-7))), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_is_greedy(temperature):
    logits = np.random.default_rng(1).standard_normal((16, 50)).astype(np.float32)
    out = sample(jnp.asarray(logits), rows(16, temperature=temperature, top_k=1, position=np.arange(16)))
    np.testing.assert_array_equal(np.asarray(out), logits.argmax(-1))


def test_tiny_top_p_is_greedy():
    logits = np.random.default_rng(2).standard_normal((16, 50)).astype(np.float32)
    out = sample(jnp.asarray(logits), rows(16, temperature=2.0, top_p=1e-6))
    np.testing.assert_array_equal(np.asarray(out), logits.argmax(-1))


# --- filters against the numpy reference ---------------------------------------------------------


def test_filters_match_vllm_reference():
    rng = np.random.default_rng(3)
    b, v = 16, 50
    logits = (rng.standard_normal((b, v)) * 2).astype(np.float32)
    t = rng.uniform(0.2, 2.0, b)
    k = rng.choice([0, 1, 3, 10, 49, 50, 80], b)
    p = rng.choice([1.0, 0.9, 0.5, 0.1], b)
    mp = rng.choice([0.0, 0.05, 0.3], b)
    out = np.asarray(process_logits(jnp.asarray(logits), rows(b, temperature=t, top_k=k, top_p=p, min_p=mp)))
    for i in range(b):
        expected = reference_keep(logits[i], t[i], k[i], p[i], mp[i])
        np.testing.assert_array_equal(np.isfinite(out[i]), expected, err_msg=f"row {i}")
        np.testing.assert_allclose(out[i][expected], logits[i][expected] / t[i], rtol=1e-5)


def test_banned_ids_are_never_picked():
    logits = np.random.default_rng(4).standard_normal((16, 50)).astype(np.float32)
    top2 = np.argsort(-logits, -1)[:, :2]
    banned = np.full((16, 8), -1, np.int32)
    banned[:, 0] = top2[:, 0]
    banned[:, 1] = 1000  # out of vocab: ignored
    out = sample(jnp.asarray(logits), rows(16, banned=banned))
    np.testing.assert_array_equal(np.asarray(out), top2[:, 1])
    masked = mask_tokens(jnp.asarray(logits), jnp.arange(50)[None, :] == jnp.asarray(top2[:, :1]))
    np.testing.assert_array_equal(np.asarray(greedy(masked)), top2[:, 1])
    sup = np.asarray(suppress_ids(jnp.asarray(logits), jnp.asarray(banned)))
    assert np.isneginf(sup[np.arange(16), top2[:, 0]]).all() and np.isfinite(sup).sum() == 16 * 49


# --- empirical distributions ---------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_distribution_matches_softmax(temperature):
    observed = draw7(temperature=temperature)
    assert chi2(observed, softmax(LOGITS7 / temperature)) < CHI2_BOUND
    other = 0.5 if temperature == 1.0 else 1.0  # power: the other temperature's softmax is far off
    assert chi2(observed, softmax(LOGITS7 / other)) > 10 * CHI2_BOUND


def test_min_p_drops_tokens_below_min_p_times_max():
    probs = softmax(LOGITS7)
    observed = draw7(temperature=1.0, min_p=0.2)
    kept = probs >= 0.2 * probs.max()
    assert 2 <= kept.sum() < 7  # the test has tokens on both sides of the cut
    assert observed[~kept].sum() == 0
    assert chi2(observed, np.where(kept, probs, 0) / probs[kept].sum()) < CHI2_BOUND
    assert chi2(draw7(temperature=1.0), probs) < CHI2_BOUND  # min_p=0: nothing dropped


@pytest.mark.parametrize("top_k, top_p, num_kept", [(2, 1.0, 2), (0, 0.8, 4), (6, 0.95, 5)])
def test_top_k_top_p_distribution(top_k, top_p, num_kept):
    keep = reference_keep(LOGITS7, 1.0, top_k, top_p, 0.0)
    assert keep.sum() == num_kept
    target = np.where(keep, softmax(LOGITS7), 0)
    observed = draw7(temperature=1.0, top_k=top_k, top_p=top_p)
    assert chi2(observed, target / target.sum()) < CHI2_BOUND


# --- reproducibility and batching ----------------------------------------------------------------


def test_same_seed_and_position_same_token_whatever_the_batch():
    rng = np.random.default_rng(5)
    b, v = 8, 50
    logits = rng.standard_normal((b, v)).astype(np.float32)
    seed = rng.integers(0, 2**32, b, dtype=np.uint64)
    pos = rng.integers(0, 1000, b)
    kw = dict(temperature=rng.uniform(0.5, 2, b), top_k=[0, 5, 0, 0, 20, 0, 3, 0],
              top_p=[1, 1, 0.9, 1, 0.8, 1, 1, 0.95], min_p=[0, 0, 0, 0.05, 0, 0, 0, 0.01])
    base = np.asarray(sample(jnp.asarray(logits), rows(b, seed=seed, position=pos, **kw)))

    perm = rng.permutation(b)
    permuted = {k: np.asarray(x)[perm] for k, x in kw.items()}
    shuffled = np.asarray(sample(jnp.asarray(logits[perm]), rows(b, seed=seed[perm], position=pos[perm], **permuted)))
    np.testing.assert_array_equal(shuffled, base[perm])

    # the same rows after 8 other (greedy and sampled) rows, in a bigger batch
    extra = dict(temperature=[0, 1.0, 0, 3.0, 0, 0.7, 0, 1.0], top_k=[0, 2, 0, 0, 0, 0, 1, 0], top_p=0.5, min_p=0.1)
    cat = lambda a, b: np.concatenate([np.broadcast_to(np.asarray(a, np.float64), (8,)), np.asarray(b, np.float64)])
    big = sample(jnp.asarray(np.concatenate([rng.standard_normal((8, v)).astype(np.float32), logits])),
                 rows(16, seed=np.r_[np.arange(8), seed], position=np.r_[np.arange(8), pos],
                      **{k: cat(extra[k], kw[k]) for k in kw}))
    np.testing.assert_array_equal(np.asarray(big)[8:], base)

    # a row alone
    for i in (0, 4):
        alone = sample(jnp.asarray(logits[i:i + 1]), rows(1, seed=seed[i:i + 1], position=pos[i:i + 1],
                                                          **{k: np.asarray(x)[i:i + 1] for k, x in kw.items()}))
        assert int(alone[0]) == base[i]


def test_position_and_seed_change_the_draw():
    logits = jnp.zeros((N, 7))  # uniform: every row is a fresh draw
    by_seed = np.asarray(sample(logits, rows(N, temperature=1.0, seed=7, position=np.arange(N) % 7919)))
    same = np.asarray(sample(logits, rows(N, temperature=1.0, seed=7, position=np.arange(N) % 7919)))
    np.testing.assert_array_equal(by_seed, same)
    assert chi2(counts(by_seed), np.full(7, 1 / 7)) < CHI2_BOUND  # positions decorrelate draws
    other_seed = np.asarray(sample(logits, rows(N, temperature=1.0, seed=8, position=np.arange(N) % 7919)))
    assert 0.1 < (other_seed == by_seed).mean() < 0.2  # ~1/7 agree by chance


def test_mixed_greedy_and_sampled_rows():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((16, 50)).astype(np.float32)
    temperature = np.where(np.arange(16) % 2 == 0, 0.0, 1.5)
    mixed = np.asarray(sample(jnp.asarray(logits), rows(16, temperature=temperature)))
    np.testing.assert_array_equal(mixed[::2], logits[::2].argmax(-1))
    all_sampled = np.asarray(sample(jnp.asarray(logits), rows(16, temperature=1.5)))
    np.testing.assert_array_equal(mixed[1::2], all_sampled[1::2])
    assert (all_sampled != logits.argmax(-1)).any()  # the sampled rows really sample


def test_changing_parameter_values_never_recompiles():
    logits = jnp.asarray(np.random.default_rng(7).standard_normal((16, 50)), jnp.float32)
    sample(logits, rows(16))
    size = sample._cache_size()
    variants = [
        rows(16, temperature=1.0),
        rows(16, temperature=np.linspace(0, 2, 16), top_k=np.arange(16), top_p=0.9, min_p=0.1, position=5),
        rows(16, temperature=0.7, top_p=0.3, seed=2**32 - 1),
        SamplingTensors.from_params([SamplingParams(temperature=0.8, top_k=3, seed=1, min_tokens=2)] * 3,
                                    [0, 1, 2], 16, eos_id=3),
        SamplingTensors.greedy(16),
    ]
    for params in variants[:3]:  # built without the host flags: one program, the branches on the device
        sample(logits, params).block_until_ready()
    assert sample._cache_size() == size
    # from_params sets the static flags (all greedy / top-k-top-p sort needed): one program per combination
    # that can occur -- greedy; sampled without the sort; sampled with it -- and no more, whatever the values
    flagged = [SamplingTensors.from_params([SamplingParams(temperature=t, top_k=k, top_p=p, seed=1)] * 5, [0] * 5, 16)
               for t, k, p in ((0.0, 0, 1.0), (0.9, 0, 1.0), (0.9, 3, 1.0), (1.3, 0, 0.5), (0.0, 7, 0.2))]
    assert [(f.all_greedy, f.needs_sort) for f in flagged] == [(True, False), (False, False), (False, True),
                                                               (False, True), (True, False)]
    for params in flagged + variants[3:]:
        sample(logits, params).block_until_ready()
    assert sample._cache_size() == size + 3


def test_host_flags_give_the_device_branches_results():
    """Tensors from from_params (static flags) and the same values without flags (lax.cond on the device)
    sample the same tokens: the flags only choose the branch ahead of time."""
    logits = jnp.asarray(np.random.default_rng(8).standard_normal((16, 50)), jnp.float32)
    cases = [[SamplingParams(temperature=0.0, seed=1)] * 9,
             [SamplingParams(temperature=1.1, seed=i) for i in range(9)],
             [SamplingParams(temperature=0.0, seed=1)] * 4 + [SamplingParams(temperature=0.8, top_k=4, top_p=0.7, seed=3)] * 5]
    for params in cases:
        flagged = SamplingTensors.from_params(params, list(range(9)), 16)
        device_branches = flagged.replace(all_greedy=None, needs_sort=None)
        np.testing.assert_array_equal(np.asarray(sample(logits, flagged)), np.asarray(sample(logits, device_branches)))


# --- host-side build -----------------------------------------------------------------------------


def test_from_params_pads_with_greedy_rows_and_bans_under_min_tokens():
    ps = [
        SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.05, seed=11, min_tokens=3, stop_token_ids=(5, 6)),
        SamplingParams(temperature=1.0, seed=2**40, min_tokens=3, ignore_eos=True, stop_token_ids=(9,)),
        SamplingParams(seed=1, min_tokens=1),
    ]
    t = SamplingTensors.from_params(ps, [2, 0, 1], pad_to=4, eos_id=[1, 2])
    np.testing.assert_allclose(np.asarray(t.temperature), [0.7, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(t.top_k), [0, 0, 0, 0])
    np.testing.assert_allclose(np.asarray(t.top_p), [0.9, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(np.asarray(t.min_p), [0.05, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(t.seed), [11, fold_seed(2**40), 1, 0])
    np.testing.assert_array_equal(np.asarray(t.position), [2, 0, 1, 0])
    assert t.banned_ids.shape == (4, 8)
    bans = [sorted(int(x) for x in r if x >= 0) for r in np.asarray(t.banned_ids)]
    assert bans == [[1, 2, 5, 6], [9], [], []]  # row 1 ignores eos; row 2 reached min_tokens
    assert t.seed.dtype == jnp.uint32 and t.position.dtype == jnp.int32 and t.top_k.dtype == jnp.int32

    logits = jnp.zeros((4, 12)).at[:, 1].set(10.0).at[:, 5].set(9.0)
    out = np.asarray(sample(logits, t.replace(temperature=jnp.zeros(4))))
    assert out[0] not in (1, 2, 5, 6) and out[2] == 1 and out[3] == 1


def test_from_params_ban_width_grows_in_powers_of_two():
    p = SamplingParams(seed=0, min_tokens=1, stop_token_ids=tuple(range(10, 19)))
    assert SamplingTensors.from_params([p], [0], 2, eos_id=0).banned_ids.shape == (2, 16)
    assert SamplingTensors.from_params([p], [1], 2, eos_id=0).banned_ids.shape == (2, 8)


def test_from_params_suppress_eos_overrides_min_tokens():
    ps = [SamplingParams(seed=0, min_tokens=5, stop_token_ids=(7,)), SamplingParams(seed=0)]
    t = SamplingTensors.from_params(ps, [0, 9], 2, eos_id=np.int64(3), suppress_eos=[False, True])
    assert [sorted(int(x) for x in r if x >= 0) for r in np.asarray(t.banned_ids)] == [[], [3]]


def test_from_params_errors():
    p = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match="seed is None"):
        SamplingTensors.from_params([p], [0], 1)
    t = SamplingTensors.from_params([p], [0], 1, seeds=[123])
    assert int(t.seed[0]) == 123
    with pytest.raises(ValueError, match="pad_to"):
        SamplingTensors.from_params([p, p], [0, 0], 1, seeds=[1, 2])
    with pytest.raises(ValueError, match="positions"):
        SamplingTensors.from_params([p], [0, 1], 2, seeds=[1])
    with pytest.raises(ValueError, match="seeds"):
        SamplingTensors.from_params([p], [0], 2, seeds=[1, 2])
    with pytest.raises(ValueError, match="suppress_eos"):
        SamplingTensors.from_params([p], [0], 2, seeds=[1], suppress_eos=[])
    with pytest.raises(ValueError, match="position must be >= 0"):
        SamplingTensors.from_params([p], [-1], 2, seeds=[1])


def test_fold_seed():
    assert fold_seed(0) == 0 and fold_seed(2**32 - 1) == 2**32 - 1
    for s in (2**32, -1, 2**63):
        assert 0 <= fold_seed(s) < 2**32 and fold_seed(s) == fold_seed(s)
    assert fold_seed(2**32) != fold_seed(2**32 + 1)


def test_sample_rejects_bad_shapes():
    with pytest.raises(ValueError, match="rows"):
        sample(jnp.zeros((3, 7)), rows(4))
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        sample(jnp.zeros((4,)), rows(4))
