"""The serving steps compile with k3jax.compile_options.STEP_COMPILER_OPTIONS (XLA command buffers off: the H200
decode step was 16.8-17.7 ms/step with XLA's default FUSION command buffers and 13.8-14.0 ms without)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import model, speculative
from k3jax.compile_options import STEP_COMPILER_OPTIONS
from k3jax.parallel import dep, dwdp

STEPS = {
    "model.prefill": model.prefill, "model.decode": model.decode, "model.verify": model.verify,
    "speculative.target_step": speculative.target_step,
    "dep.prefill": dep.prefill, "dep.decode": dep.decode, "dwdp.prefill": dwdp.prefill, "dwdp.decode": dwdp.decode,
}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_serving_steps_carry_the_step_options(name):
    # PjitInfo is jax-internal (pinned 0.11.2): a jax upgrade that renames it fails here loudly, not silently
    kvs = dict(STEPS[name]._jit_info.compiler_options_kvs)
    assert kvs == STEP_COMPILER_OPTIONS, (name, kvs)


def test_step_options_are_known_to_this_xla_and_a_misspelt_one_is_refused():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32)
    step = jax.jit(lambda a: jnp.tanh(a) * 2, compiler_options=STEP_COMPILER_OPTIONS)
    np.testing.assert_allclose(np.asarray(step(x)), np.tanh(np.asarray(x)) * 2, rtol=1e-6)
    misspelt = {k.replace("command_buffer", "command_bufer"): v for k, v in STEP_COMPILER_OPTIONS.items()}
    with pytest.raises(Exception, match="No such compile option"):
        jax.jit(lambda a: a + 1, compiler_options=misspelt)(x)
