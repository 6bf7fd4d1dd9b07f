"""Pytest side of the parity tests: where the torch references run, and comparison helpers.

The references (torch_ref_jobs.py) need torch, transformers, einops and fla-core. They run

* in this process, when those import here (pytest.importorskip: the tests skip when they are absent), or
* in another interpreter named by K3JAX_TORCH_PYTHON (one per test process, serving every job), exchanging
  .npz files. This is the usual CPU setup: PyPI has no CPU-only torch for Linux, and pip installs the CPU
  wheel only from the wheel on disk, which is built for the system Python 3.11, while the project's venv is
  Python 3.12 (jax 0.11.2 has no 3.11 wheels). So:

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
JOB_DONE = "K3JAX-TORCH-REF-JOB-DONE "  # torch_ref_jobs.py --serve: the answer line of each job
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
    """Runs the jobs in one long-lived interpreter (torch_ref_jobs.py --serve; started on first use, it exits
    when this process closes its stdin): each of the directory's 20 jobs started its own interpreter and paid
    the imports of torch, transformers and fla (~3-4 s a job; tests/parity alone, -n 0: 109.8 -> 43.3 s).
    The jobs set every seed they use, as they do for the in-process runner above."""

    def __init__(self, python: str):
        self.python = python
        self.proc: subprocess.Popen | None = None
        self.stderr = None

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([self.python, str(JOBS_FILE), "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-6000:]

    def __call__(self, job: str, arrays: dict, **opts) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory(prefix="k3jax-torchref-") as tmp:
            src, dst = Path(tmp, "in.npz"), Path(tmp, "out.npz")
            np.savez(src, __opts__=np.array(json.dumps(opts)), **{k: np.asarray(v) for k, v in arrays.items()})
            try:
                self.proc.stdin.write(json.dumps([job, str(src), str(dst)]) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass  # the interpreter has exited: the read below reports it
            while True:  # a job's own prints come first; the answer line starts with the marker
                line = self.proc.stdout.readline()
                if not line:
                    code = self.proc.wait()
                    raise RuntimeError(f"torch reference job {job!r} failed ({self.python}): the interpreter exited "
                                       f"({code}):\n{self._stderr_tail()}")
                if line.startswith(JOB_DONE):
                    break
            answer = line[len(JOB_DONE):].strip()
            if answer != "ok":
                raise RuntimeError(f"torch reference job {job!r} failed ({self.python}):\n{json.loads(answer)[-6000:]}")
            with np.load(dst) as data:
                return {k: data[k] for k in data.files}


@functools.cache
def _subprocess_runner(python: str) -> _Subprocess:
    return _Subprocess(python)


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
        return _subprocess_runner(python)
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
