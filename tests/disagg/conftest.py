"""Helpers for the P/D tests: the API tests' process launcher (tests/api/conftest.py), shared by name."""

import importlib.util
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
    each program compiles once per session, whichever engine needs it first. Restored afterwards."""
    import jax
    from jax._src import compilation_cache

    path = tmp_path_factory.mktemp("xla_cache_disagg")
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()  # re-read the settings (the cache initialises once per process)
    yield path
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    compilation_cache.reset_cache()
