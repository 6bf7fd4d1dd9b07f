"""Small helpers shared by tests and benchmarks: tiny configs and paged layouts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig, load_config
from k3jax.model import StepMeta


def k3_tiny() -> ModelConfig:
    return load_config("k3-tiny")


def kimi_linear_tiny() -> ModelConfig:
    """Kimi-Linear's feature set (softplus gate, low-rank output gate, direct q, no MLA gate, SwiGLU,
    full-width experts, routed scaling, no AttnRes) at k3-tiny's sizes."""
    return k3_tiny().replace(
        name="kimi-linear-tiny",
        kda_gate="softplus",
        kda_output_gate_rank=5,
        q_lora_rank=None,
        mla_output_gate=False,
        hidden_act="silu",
        situ_linear_beta=None,
        moe_latent_size=None,
        moe_latent_norm=False,
        num_shared_experts=1,
        routed_scaling_factor=2.446,
        attn_res_block_size=None,
        mla_layers=(3, 7, 8),
    )


def tiny_configs() -> list[ModelConfig]:
    return [k3_tiny(), kimi_linear_tiny()]


def shuffled_page_tables(rng: np.random.Generator, batch: int, max_pages: int, num_pages: int) -> np.ndarray:
    """[batch, max_pages] distinct page ids drawn from a shuffled pool (never in order)."""
    if batch * max_pages > num_pages:
        raise ValueError("not enough pages")
    return rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)


def eager_ops_on_argument(fn, args, argnum: int) -> list[str]:
    """The primitives that `fn(*args)`, called eagerly, applies to args[argnum] outside any jitted call.

    A public kernel wrapper that reshapes, indexes or casts a pool before its jitted call makes XLA copy
    the whole pool on every eager call (a bitcast only inside jit): the benchmarks call the wrappers
    eagerly, and a 5.8 GB page pool copied per call (~2.7 ms) sat in benchmarks/mla.py's MLA times
    from 2026-11-29 to 2026-12-03."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    leaves = jax.tree_util.tree_leaves(args[:argnum])
    pool_var = jaxpr.jaxpr.invars[len(leaves)]
    return [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns
            if eqn.primitive.name not in ("pjit", "jit") and any(v is pool_var for v in eqn.invars)]


def step_meta(slots, page_table, context_lens, lengths) -> StepMeta:
    as_i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)
    return StepMeta(as_i32(slots), as_i32(page_table), as_i32(context_lens), as_i32(lengths))


def load_benchmark_script(name: str):
    """benchmarks/<name>.py imported as a module (the benchmarks are scripts, not a package), for their smoke tests."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
