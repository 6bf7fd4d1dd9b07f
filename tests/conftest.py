"""Test-session setup. Runs before any test module imports jax, so the environment below takes effect.

- XLA_FLAGS gets --xla_force_host_platform_device_count=8 (unless the flag is already there): the
  parallel strategies are tested on 8 host CPU devices.
- JAX_PLATFORMS=cpu unless it is set already or this is a GPU run (K3JAX_TEST_GPU=1).
- Tests marked `gpu` are skipped when no GPU is visible.
- The CLI's persistent compilation cache is off (K3JAX_COMPILE_CACHE=off) unless set: tests stay hermetic.

Run: `python -m pytest -q` (CPU, as CI does); `K3JAX_TEST_GPU=1 python -m pytest -q -m gpu` on a GPU host.
"""

import os

import pytest

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
_GPU_RUN = os.environ.get("K3JAX_TEST_GPU", "").lower() in ("1", "true", "yes")

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()
if not _GPU_RUN:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("K3JAX_COMPILE_CACHE", "off")
# tests/parity run public torch references in this Python 3.11 environment (scripts/extras/torchref.sh, via scripts/setup.sh --with-test-extras)
_TORCH_REF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-torchref", "bin", "python")
if os.path.exists(_TORCH_REF):
    os.environ.setdefault("K3JAX_TORCH_PYTHON", _TORCH_REF)


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
