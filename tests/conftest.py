"""Test-session setup. Runs before any test module imports jax, so the environment below takes effect.

- XLA_FLAGS gets --xla_force_host_platform_device_count=8 (unless the flag is already there): the
  parallel strategies are tested on 8 host CPU devices.
- CPU runs also get --xla_backend_optimization_level=0 (unless set): CPU test time is mostly XLA compiling
  programs that run once or twice, and LLVM's optimisation passes are most of that (HLO passes, and so the
  programs' arithmetic, are the same at every level). Measured serially on the 2-core machine, fresh compile
  cache (2026-12-02): tests/model/test_model.py -k "prefill_then_decode or chunked" 82.7 -> 54.3 s,
  tests/kernels/test_moe_gemm.py 113.9 -> 79.7 s, tests/kernels/test_kda_decode.py -k "packed or in_place"
  19.4 -> 16.6 s. GPU runs keep XLA's default (the level also applies to the GPU kernels' LLVM).
- JAX_PLATFORMS=cpu unless it is set already or this is a GPU run (K3JAX_TEST_GPU=1).
- Tests marked `gpu` are skipped when no GPU is visible.
- The CLI's persistent compilation cache is off (K3JAX_COMPILE_CACHE=off) unless set: tests stay hermetic.
- The test processes themselves share one persistent XLA compilation cache per pytest run: a fresh temporary
  directory (K3JAX_TEST_XLA_CACHE names it, so pytest-xdist workers inherit the same one; removed at the end).
  Modules compile the same k3-tiny programs (test_engine.py / test_overlap.py share their shapes, the model
  tests share forward passes) and `_release_compiled_programs` below drops the in-memory jit caches after
  every module, so without it each module compiled them again. Set K3JAX_TEST_XLA_CACHE=off to compile
  everything afresh, or to a directory to keep and reuse one across runs.

Run: `python -m pytest -q` (CPU, as CI does); `K3JAX_TEST_GPU=1 python -m pytest -q -n 0 -m gpu` on a GPU host
(one process: each xdist worker would take its own share of the GPU).
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
_GPU_RUN = os.environ.get("K3JAX_TEST_GPU", "").lower() in ("1", "true", "yes")

_CPU_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def _add_xla_flag(flag: str) -> None:
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


_add_xla_flag(_DEVICE_FLAG)
if not _GPU_RUN:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _add_xla_flag(_CPU_COMPILE_FLAG)
os.environ.setdefault("K3JAX_COMPILE_CACHE", "off")
# tests/parity run public torch references in this Python 3.11 environment (scripts/extras/torchref.sh, via scripts/setup.sh --with-test-extras)
_TORCH_REF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-torchref", "bin", "python")
if os.path.exists(_TORCH_REF):
    os.environ.setdefault("K3JAX_TORCH_PYTHON", _TORCH_REF)


_XLA_CACHE_ENV = "K3JAX_TEST_XLA_CACHE"
_XLA_CACHE_OWNED = _XLA_CACHE_ENV not in os.environ  # this process made the directory (the xdist controller)
if _XLA_CACHE_OWNED:
    os.environ[_XLA_CACHE_ENV] = tempfile.mkdtemp(prefix="k3jax-test-xla-")


def _xla_cache_dir() -> str | None:
    where = os.environ.get(_XLA_CACHE_ENV, "")
    return None if where.strip().lower() in ("", "off", "0", "false", "none") else where


def pytest_configure(config):
    where = _xla_cache_dir()
    if where is not None:
        import jax

        jax.config.update("jax_compilation_cache_dir", where)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@pytest.fixture(scope="session")
def serve_compile_cache(tmp_path_factory):
    """K3JAX_COMPILE_CACHE for the `k3jax serve` processes the tests start: a folder of the run's shared XLA cache,
    so a worker that the other pytest-xdist process already started with the same flags and shapes loads its
    programs instead of compiling them again (keys include the XLA flags and the programs). A fresh temporary
    directory when the shared cache is off."""
    where = _xla_cache_dir()
    if where is None:
        return tmp_path_factory.mktemp("xla_cache_serve")
    path = Path(where) / "serve"
    path.mkdir(exist_ok=True)
    return path


def pytest_unconfigure(config):
    where = _xla_cache_dir()
    if _XLA_CACHE_OWNED and where is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(where, ignore_errors=True)


# pytest-xdist (pyproject's addopts run `-n 2 --dist loadfile`; `-n 0` runs in one process): whole files
# go to the two workers. Files that share a process-level memo run on the same worker: the trained pair
# of k3jax.train_drafter.tiny_markov_pair (about a minute of training) serves test_drafter.py, then
# test_speculative.py, then test_engine_spec.py (its trained-drafter test trained the pair again on the
# other worker: the three files alone, -n 0, 215.7 s as two units, 164.9 s as one). So do the files of
# tests/workload that use its session-scoped `k3jax serve` worker (about 35 s to start and compile under
# load; on both workers it started twice), and the files of tests/parity (one torch interpreter per process
# serves their reference jobs, parity_util.py: alone, -n 0, 26.9 + 32.9 s in two processes, 49.9 s in one).
# Files start heaviest first (seconds measured serially on the 2-core CPU), so no long file begins when the
# other worker is nearly done; the rest follow in collection order.
_XDIST_SAME_WORKER = {
    "tests/model/test_speculative.py": "tests/model/test_drafter.py",
    "tests/serving/test_engine_spec.py": "tests/model/test_drafter.py",
    "tests/workload/test_replay.py": "tests/workload/test_aiperf_agree.py",
    "tests/workload/test_sweep.py": "tests/workload/test_aiperf_agree.py",
    "tests/parity/test_k3_model.py": "tests/parity/test_k3_components.py",
    "tests/parity/test_kimi_linear_model.py": "tests/parity/test_k3_components.py",
}
_XDIST_HEAVY_FIRST = (  # the slowest files of a -n 2 run on 2026-12-01 (seconds of test time, before the shared XLA cache)
    "tests/model/test_model.py",  # 1062
    "tests/serving/test_engine.py",  # 756
    "tests/model/test_drafter.py",  # with test_speculative.py and test_engine_spec.py: 165 (2026-12-04)
    "tests/kernels/test_kda_decode.py",  # 464
    "tests/test_cli.py",  # 435
    "tests/test_benchmark_smoke.py",  # 231
    "tests/parallel/test_strategies.py",  # 184
    "tests/parallel/test_tep_dep.py",  # 162
    "tests/serving/test_overlap.py",  # 173 (test_engine.py's programs: after it, from the XLA cache)
    "tests/kernels/test_kda_intra.py",  # 137
    "tests/kernels/test_moe_gemm.py",  # 129
    "tests/serving/test_buckets.py",  # 111
    "tests/workload/test_aiperf_agree.py",  # with test_replay.py and test_sweep.py: 155 (2026-12-04)
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # the rest in collection order (xdist's default: most tests first)

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return _XDIST_SAME_WORKER.get(path, path)

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_heavy_first_done", False):  # the first assignment: order the work queue
                self._heavy_first_done = True
                for path in reversed(_XDIST_HEAVY_FIRST):
                    if path in self.workqueue:
                        self.workqueue.move_to_end(path, last=False)
            super()._assign_work_unit(node)

    return Scheduling(config, log)


def _gpu_visible() -> bool:
    import jax

    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:  # no backend for the requested platforms
        return False


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _gpu_visible():
        skip = pytest.mark.skip(reason="needs a GPU (none visible; GPU runs set K3JAX_TEST_GPU=1)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop jit caches after each test module. A single pytest process otherwise keeps every compiled
    XLA:CPU executable of the suite alive; their memory mappings accumulate towards the kernel's
    vm.max_map_count (65530), and one CI run crashed inside XLA compilation late in the suite."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    if os.environ.get("K3JAX_REPORT_MAPS"):
        with open("/proc/self/maps") as f:
            print(f"\n[maps after module: {sum(1 for _ in f)}]")
