"""Shared fixtures of the engine tests (test_engine.py, test_async_engine.py): the k3-tiny model and an
Engine factory.

`model` is session-scoped: (config, params) of k3-tiny from key 0, built once for every module that uses
it. Sharing is safe because nothing mutates or donates the params (the runner donates only its KV state).
`make_engine(**overrides)` builds an Engine over those params from the calling module's `ENGINE_OPTS`
(each module keeps its own small shape buckets, as every bucket costs a CPU compile) plus the overrides.
"""

import jax
import pytest

import k3jax
from serving.config import EngineConfig
from serving.engine import Engine


@pytest.fixture(scope="session")
def model():
    cfg = k3jax.load_config("k3-tiny")
    return cfg, k3jax.init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def make_engine(model, request):
    cfg, params = model
    base = getattr(request.module, "ENGINE_OPTS", None)
    if base is None:
        raise ValueError(f"{request.module.__name__} must define ENGINE_OPTS to use the make_engine fixture")

    def make(**overrides) -> Engine:
        return Engine(EngineConfig(**{**base, **overrides}), cfg=cfg, params=params)

    return make
