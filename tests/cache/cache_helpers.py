"""Helpers for the cache-tier tests (tests/cache): random page blobs of odd shapes, bit-exact comparison,
hash chains, a pool server in its own process, a mooncake_master, a free TCP port. A uniquely named module (not conftest) so
that `from cache_helpers import ...` cannot pick up another directory's conftest in a full-suite run."""

import os
import signal
import socket
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

from serving.cache.hashing import prefix_hashes
from serving.cache.mooncake_store import mooncake_env, mooncake_master_command
from serving.cache.store import PageBlob
from serving.ports import free_port

POOL_SERVER_PY = os.path.join(os.path.dirname(__file__), "..", "..", "serving", "cache", "pool_server.py")


def random_blob(rng: np.random.Generator, *, checkpoint: bool, layers: int = 3, page: int = 5, width: int = 7,
                bf16: str = "uint16") -> PageBlob:
    """A page of random latents [layers, page, width] (bf16 as uint16 bits, or ml_dtypes bfloat16) and,
    with `checkpoint`, random fp32 KDA [2, 3, 4, 6] and conv [2, 3, 11] states (odd sizes throughout)."""
    values = rng.standard_normal((layers, page, width)).astype(ml_dtypes.bfloat16)
    latents = values.view(np.uint16) if bf16 == "uint16" else values
    if not checkpoint:
        return PageBlob(latents=latents)
    return PageBlob(latents=latents, kda=rng.standard_normal((2, 3, 4, 6)).astype(np.float32),
                    conv=rng.standard_normal((2, 3, 11)).astype(np.float32))


def assert_same_blob(got: PageBlob | None, want: PageBlob) -> None:
    """Bit-exact equality (a cache must return exactly the bytes it was given), dtypes and shapes too."""
    assert got is not None
    for name in ("latents", "kda", "conv"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name


def hash_chain(rng: np.random.Generator, pages: int, page_size: int = 4) -> list[str]:
    """Chained page keys of a random token history of `pages` full pages plus a partial one."""
    tokens = rng.integers(0, 50_000, pages * page_size + 3).tolist()
    return prefix_hashes(tokens, page_size)


class PoolProcess:
    """`python serving/cache/pool_server.py` as a child process (killable like a real deployment's)."""

    def __init__(self, port: int = 0, capacity_gb: float = 0.001):
        self.proc = subprocess.Popen([sys.executable, POOL_SERVER_PY, "--port", str(port), "--capacity-gb", str(capacity_gb)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()  # "pool-server listening on 127.0.0.1:PORT ..."
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"pool server did not start: {line!r}")
        self.port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP, then wait until every thread of the server is stopped (Linux /proc state "T"). kill() returns
        before a thread that is running user code at that moment has taken the stop; a request sent in that window
        can still be answered (one CI-load run of test_hung_server_times_out_into_misses got its reply)."""
        self.proc.send_signal(signal.SIGSTOP)

        def stopped() -> bool:
            task_dir = f"/proc/{self.proc.pid}/task"
            for tid in os.listdir(task_dir):
                with open(f"{task_dir}/{tid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                        return False
            return True

        if not wait_until(stopped, timeout_s, interval_s=0.005):
            raise RuntimeError(f"pool server {self.proc.pid} did not stop within {timeout_s} s of SIGSTOP")


def wait_until(predicate, timeout_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


class Master:
    """A mooncake_master on free loopback ports; `kill()` ends it."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        cmd = mooncake_master_command() + [
            "-rpc_address=127.0.0.1", f"-rpc_port={self.port}", "-metrics_host=127.0.0.1",
            f"-metrics_port={free_port()}", "-default_kv_lease_ttl=50", "-rpc_thread_num=2"]
        self.proc = subprocess.Popen(cmd, env=mooncake_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:  # ready once the RPC port accepts
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mooncake_master did not start")
                time.sleep(0.05)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
