"""Helpers for the P/D tests: the API tests' process launcher (tests/api/conftest.py), shared by name."""

import importlib.util
import os
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("_api_conftest", Path(__file__).parents[1] / "api" / "conftest.py")
_api = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_api)


@pytest.fixture(scope="session")
def launch():
    import types

    return types.SimpleNamespace(ROOT=_api.ROOT, Process=_api.Process, free_port=_api.free_port)


@pytest.fixture(scope="session")
def shared_compile_cache(tmp_path_factory):
    """One persistent XLA cache for this directory's in-process engines and worker processes (which run
    with this process's XLA_FLAGS, part of the cache key): every engine here has the same shapes, so
    each program compiles once, whichever engine needs it first. That is the run's shared cache when
    tests/conftest.py set one (K3JAX_TEST_XLA_CACHE, both pytest-xdist processes): the workers then also
    load what other modules compiled -- k3-tiny's init programs, and the engine programs of
    tests/cache/test_shared_pool_engine.py (the same sizes). Otherwise a fresh directory, restored afterwards."""
    import jax
    from jax._src import compilation_cache

    run_cache = os.environ.get("K3JAX_TEST_XLA_CACHE")
    if run_cache and jax.config.jax_compilation_cache_dir == run_cache:
        yield Path(run_cache)
        return
    path = tmp_path_factory.mktemp("xla_cache_disagg")
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()  # re-read the settings (the cache initialises once per process)
    yield path
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    compilation_cache.reset_cache()
