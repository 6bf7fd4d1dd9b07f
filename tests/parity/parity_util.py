"""Pytest side of the parity tests: where the torch references run, and comparison helpers.

The references (torch_ref_jobs.py) need torch, transformers, einops and fla-core. They run

* in this process, when those import here (pytest.importorskip: the tests skip when they are absent), or
* in another interpreter named by K3JAX_TORCH_PYTHON, a subprocess per job exchanging .npz files. This is
  the usual CPU setup: PyPI has no CPU-only torch for Linux, and pip installs the CPU wheel only from the
  wheel on disk, which is built for the system Python 3.11, while the project's venv is Python 3.12
  (jax 0.11.2 has no 3.11 wheels). So:

      python3.11 -m venv .venv-torchref
      .venv-torchref/bin/pip install torch==2.13.0 transformers==5.24.0 einops==0.8.2 fla-core==0.6.0
      K3JAX_TORCH_PYTHON=.venv-torchref/bin/python python -m pytest tests/parity -q

When K3JAX_TORCH_PYTHON is set it is used (and a broken one fails the tests rather than skipping them).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

JOBS_FILE = Path(__file__).with_name("torch_ref_jobs.py")
ENV = "K3JAX_TORCH_PYTHON"
_PROBE = "import torch, transformers, einops, importlib.util as u; assert u.find_spec('fla'), 'fla-core missing'"


class _InProcess:
    def __call__(self, job: str, arrays: dict, **opts) -> dict:
        sys.path.insert(0, str(JOBS_FILE.parent))
        try:
            import torch_ref_jobs
        finally:
            sys.path.remove(str(JOBS_FILE.parent))
        out = torch_ref_jobs.run_job(job, {k: np.asarray(v) for k, v in arrays.items()}, opts)
        return {k: np.asarray(v) for k, v in out.items()}


class _Subprocess:
    def __init__(self, python: str):
        self.python = python

    def __call__(self, job: str, arrays: dict, **opts) -> dict:
        with tempfile.TemporaryDirectory(prefix="k3jax-torchref-") as tmp:
            src, dst = Path(tmp, "in.npz"), Path(tmp, "out.npz")
            np.savez(src, __opts__=np.array(json.dumps(opts)), **{k: np.asarray(v) for k, v in arrays.items()})
            env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
            proc = subprocess.run([self.python, str(JOBS_FILE), job, str(src), str(dst)], capture_output=True, text=True,
                                  env=env)
            if proc.returncode != 0:
                raise RuntimeError(f"torch reference job {job!r} failed ({self.python}):\n{proc.stderr[-6000:]}")
            with np.load(dst) as data:
                return {k: data[k] for k in data.files}


@functools.cache
def _probe(python: str) -> str | None:
    proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True)
    return None if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1:]


def torch_refs():
    """The job runner, or a skip when no interpreter has the references."""
    python = os.environ.get(ENV)
    if python:
        problem = _probe(python)
        if problem:
            raise RuntimeError(f"{ENV}={python} cannot import the torch references: {problem}")
        return _Subprocess(python)
    pytest.importorskip("torch", reason=f"torch not importable here and {ENV} is not set (see tests/parity/parity_util.py)")
    pytest.importorskip("transformers")
    pytest.importorskip("einops")
    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core not installed")
    return _InProcess()


def rel(a, b) -> float:
    """Relative error |a - b| / |b| (Frobenius), in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def max_rel(a, b) -> float:
    """Worst elementwise error relative to the largest magnitude of b."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())
