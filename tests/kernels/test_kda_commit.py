"""KDA verify commit kernel (interpret mode on CPU) against its plain-jnp reference and against decoding step by step.

Run: python -m pytest -q tests/kernels/test_kda_commit.py
Tolerances: fp32; the kernel and the reference apply the same multiply-adds in the same order, so they agree to a
few ulp (1e-6 relative); against the recurrence run token by token (which computes the updates itself) 1e-5.
Slots the commit must not touch are compared exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.kda import kda_recurrent_reference
from pallas_kernels.kda_commit import kda_commit, kda_commit_reference


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def verify_case(seed, layers, pool, n, t, h, dk):
    """A pool of states and, per layer, the updates of a T-token verify step of n rows (from the recurrence)."""
    rng = np.random.default_rng(seed)
    states = jnp.asarray(0.3 * rng.standard_normal((layers, pool, h, dk, dk)), jnp.float32)
    src = rng.permutation(pool)[:n]
    q, k = (rng.standard_normal((layers, n, t, h, dk)) for _ in range(2))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((layers, n, t, h, dk))
    g = -rng.uniform(0.0, 2.0, (layers, n, t, h, dk))
    beta = rng.uniform(0.1, 0.9, (layers, n, t, h))
    ups = [kda_recurrent_reference(*map(jnp.asarray, (q[l], k[l], v[l], g[l], beta[l])), states[l, src],
                                   all_states=True)[1] for l in range(layers)]
    err, key, decay = (jnp.stack([u[i] for u in ups]) for i in range(3))
    return states, (err, key, decay), src, (q, k, v, g, beta)


@pytest.mark.parametrize("layers,n,t,h,dk,block_v", [(2, 3, 4, 2, 32, 16), (1, 5, 3, 3, 16, None), (3, 1, 1, 1, 64, 64)])
def test_commit_matches_reference_and_stepwise_decode(layers, n, t, h, dk, block_v):
    """Ragged counts (1..T), shuffled source slots written back in place, one row written to another (free) slot
    as a checkpoint is; every other slot bit-identical; the kept states equal the recurrence over the prefix."""
    pool = 2 * n + 3
    states, ups, src, (q, k, v, g, beta) = verify_case(n + t, layers, pool, n, t, h, dk)
    free = np.setdiff1d(np.arange(pool), src)
    dst = src.copy()
    dst[0] = free[0]  # row 0 goes to a checkpoint slot
    count = np.array([1 + (i * 2) % t for i in range(n)])
    fresh = np.zeros(n, np.int32)
    args = (*ups, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32), jnp.asarray(count, jnp.int32),
            jnp.asarray(fresh))
    got = kda_commit(jnp.copy(states), *args, block_v=block_v, interpret=True)
    want = kda_commit_reference(states, *args)
    assert rel(got, want) < 1e-6
    for l in range(layers):
        for r in range(n):
            c = int(count[r])
            prefix = [jnp.asarray(x[l, r : r + 1, :c]) for x in (q, k, v, g, beta)]
            _, direct = kda_recurrent_reference(*prefix, states[l, src[r] : src[r] + 1])
            assert rel(got[l, dst[r]], direct[0]) < 1e-5, (l, r)
    untouched = np.setdiff1d(np.arange(pool), dst)  # includes row 0's source slot: a checkpoint leaves it
    np.testing.assert_array_equal(np.asarray(got)[:, untouched], np.asarray(states)[:, untouched])


def test_fresh_rows_start_from_zeros_and_bad_shapes_raise():
    """A fresh row's slot holds NaN / inf: its kept state is the one from zeros (finite); wrong shapes raise."""
    states, ups, src, _ = verify_case(3, 1, 6, 2, 3, 2, 16)
    garbage = np.array(states)
    garbage[0, src[1], 1, 2, :3] = [np.nan, np.inf, -np.inf]
    args = lambda fresh: (*ups, jnp.asarray(src, jnp.int32), jnp.asarray(src, jnp.int32), jnp.asarray([3, 2], jnp.int32),
                          jnp.asarray(fresh, jnp.int32))
    got = kda_commit(jnp.asarray(garbage), *args([0, 1]), interpret=True)
    zeroed = jnp.asarray(garbage).at[0, src[1]].set(0.0)
    want = kda_commit_reference(zeroed, *args([0, 0]))
    assert np.isfinite(np.asarray(got)).all() and rel(got, want) < 1e-6
    with pytest.raises(ValueError, match="updates must be"):
        kda_commit(states, ups[0][..., :8], *ups[1:], *args([0, 0])[3:], interpret=True)
    with pytest.raises(ValueError, match="count must be"):
        kda_commit(states, *ups, jnp.asarray(src, jnp.int32), jnp.asarray(src, jnp.int32), jnp.ones((3,), jnp.int32),
                   jnp.zeros((2,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="block_v must be"):
        kda_commit(states, *args([0, 0]), block_v=12, interpret=True)


def test_commit_verified_on_the_kernel_backend_equals_reference():
    """k3jax.commit_verified through op "kda_commit" ("interpret") and the reference give the same pools; the kept
    conv window is the last W-1 rows of [the slot's window before the step (zeros for the fresh row); the step's
    inputs up to the kept position], written over the row's slot (numpy's own concatenation as the oracle)."""
    import k3jax
    from k3jax.model import VerifiedStates
    from k3jax.testing import k3_tiny

    rng = np.random.default_rng(1)
    states, (err, key, decay), src, _ = verify_case(5, 2, 7, 3, 4, 2, 16)
    conv = rng.standard_normal((2, 7, 3, 40)).astype(np.float32)
    inputs = rng.standard_normal((2, 3, 4, 40)).astype(np.float32)  # [L, n, T, C]
    state = k3jax.init_state(k3_tiny(), 1, 1, 4).replace(kda=states, conv=jnp.asarray(conv))
    fresh, accepted = np.array([False, True, False]), np.array([4, 1, 2])
    verified = VerifiedStates(err=err, key=key, decay=decay, inputs=jnp.asarray(inputs),
                              slots=jnp.asarray(src, jnp.int32), fresh=jnp.asarray(fresh))
    kw = dict(slots=jnp.asarray(src, jnp.int32), num_accepted=jnp.asarray(accepted, jnp.int32))
    ref = k3jax.commit_verified(jax.tree.map(jnp.copy, state), verified, **kw)
    got = k3jax.commit_verified(jax.tree.map(jnp.copy, state), verified, **kw, backend_name="interpret")
    assert rel(got.kda, ref.kda) < 1e-6
    np.testing.assert_array_equal(got.conv, ref.conv)
    for r, slot in enumerate(src):
        window = np.zeros_like(conv[:, slot]) if fresh[r] else conv[:, slot]
        seq = np.concatenate([window, inputs[:, r]], axis=1)  # [L, W-1+T, C]
        np.testing.assert_array_equal(got.conv[:, slot], seq[:, accepted[r] : accepted[r] + 3])
    others = np.setdiff1d(np.arange(7), src)
    np.testing.assert_array_equal(got.conv[:, others], conv[:, others])


def test_module_imports_before_k3jax():
    """pallas_kernels.kda_commit imported first, in a fresh interpreter (as benchmarks/kda.py may do on the GPU):
    k3jax.kda registers its functions while loading, so a module-level import of k3jax here would be a cycle."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import pallas_kernels.kda_commit, k3jax.kda"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
