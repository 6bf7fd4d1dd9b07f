"""Fixtures for the cache-tier tests: a seeded rng per test, a pool server in a thread, pool server
processes (killed after the test). Helpers live in cache_helpers.py."""

import zlib

import numpy as np
import pytest

from cache_helpers import PoolProcess
from serving.cache.pool_server import PoolServer


@pytest.fixture
def rng(request):
    # fresh inputs per test, reproducible from the test's name
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.fixture
def pool_server():
    """A pool server (1 MiB) serving from a thread; stopped after the test."""
    server = PoolServer("127.0.0.1", 0, capacity_bytes=1 << 20)
    server.start_in_thread()
    yield server
    server.stop()


@pytest.fixture
def pool_process():
    started = []

    def start(port: int = 0) -> PoolProcess:
        started.append(PoolProcess(port))
        return started[-1]

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.kill()
