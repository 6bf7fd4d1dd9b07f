"""Servers for the API tests: real `k3jax serve` processes on 127.0.0.1 with free ports.

One worker (HTTP + gRPC) serves the whole session; the SMG test adds a second gRPC worker. The workers
share one XLA compilation cache for the whole run (both pytest-xdist processes), so a later one loads what
the first compiled. The engine configuration keeps shape buckets few (one running request, 16-token prefill
chunks, prompts longer than a page): compilation dominates the run time on a 2-core CPU machine.
Every process is stopped (SIGINT: drain, then exit; SIGKILL after a grace period) at the end, by the
deployment launcher's child wrapper (serving.disagg.deploy.ChildProcess).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from serving.disagg.deploy import ChildProcess
from serving.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
ENGINE_FLAGS = ["--model", "k3-tiny", "--max-running", "1", "--max-prefill-tokens", "16", "--page-size", "16",
                "--max-model-len", "256", "--num-pages", "96", "--num-slots", "24", "--bucket-growth", "64",
                "--no-warmup"]
START_TIMEOUT_S = 420


def Process(argv: list[str], env: dict, name: str) -> ChildProcess:
    """A child in the repository root whose output is kept (not echoed) for failure messages."""
    return ChildProcess(name, argv, env, echo=False, cwd=ROOT)


def child_env(compile_cache: Path) -> dict:
    env = dict(os.environ)
    env["K3JAX_COMPILE_CACHE"] = str(compile_cache)
    env["JAX_PLATFORMS"] = "cpu"
    # one host device is enough for a worker; LLVM at -O0 as in the test processes (tests/conftest.py): a worker's
    # time here is mostly compiling its step programs (HLO passes, and so the arithmetic, are the same at every
    # level). tests/api alone, -n 0: 89.5 -> 68.6 s
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_worker(compile_cache: Path, *, http_port: int | None, grpc_port: int | None, extra=(), name="worker"):
    argv = [sys.executable, "-m", "k3jax", "serve", *ENGINE_FLAGS,
            "--http-port", str(http_port) if http_port else "none",
            "--grpc-port", str(grpc_port) if grpc_port else "none", *extra]
    proc = Process(argv, child_env(compile_cache), name)
    try:
        proc.wait_for("k3jax serve: ready", START_TIMEOUT_S)
    except BaseException:
        proc.stop(5)
        raise
    return proc


class Worker:
    def __init__(self, proc: Process, http_port: int | None, grpc_port: int | None, api_key: str | None = None):
        self.proc, self.http_port, self.grpc_port, self.api_key = proc, http_port, grpc_port, api_key
        self.url = f"http://127.0.0.1:{http_port}" if http_port else None
        self.grpc_target = f"127.0.0.1:{grpc_port}" if grpc_port else None


@pytest.fixture(scope="session")
def launch():
    """The helpers above, for test modules (importing a conftest by name is ambiguous)."""
    import types

    return types.SimpleNamespace(ROOT=ROOT, Process=Process, free_port=free_port, start_worker=start_worker)


@pytest.fixture(scope="session")
def compile_cache(serve_compile_cache) -> Path:
    """The workers' K3JAX_COMPILE_CACHE: shared by both pytest-xdist processes (tests/conftest.py), so when the
    files of this directory run on both, the second worker A loads the programs the first compiled."""
    return serve_compile_cache


@pytest.fixture(scope="session")
def worker(compile_cache):
    """The session's main worker: HTTP (with an API key, 20 kB bodies, 4 requests in flight) + gRPC."""
    http_port, grpc_port = free_port(), free_port()
    proc = start_worker(compile_cache, http_port=http_port, grpc_port=grpc_port, name="worker A",
                        extra=["--api-key", API_KEY, "--max-body-bytes", "20000", "--max-pending", "4"])
    yield Worker(proc, http_port, grpc_port, API_KEY)
    code = proc.stop()
    assert code == 0, f"worker A did not exit cleanly ({code}):\n{proc.log}"
    assert any("k3jax serve: stopped" in line for line in proc.lines), proc.log
