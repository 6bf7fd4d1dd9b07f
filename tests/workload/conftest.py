"""One `k3jax serve` worker (k3-tiny on CPU) shared by the replay and sweep tests of this package.

The worker keeps shape buckets few (1 running request, 128-token prefill chunks, bucket growth 256):
compilation dominates on a 2-core machine, so the fixture compiles the replay's programs before any
replay starts and the scored windows see compiled shapes.
"""

from __future__ import annotations

import pytest

from serving.workload.sweep import ServerProcess

ENGINE_FLAGS = ["--model", "k3-tiny", "--max-running", "1", "--max-prefill-tokens", "128", "--page-size", "16",
                "--max-model-len", "4096", "--num-pages", "1200", "--num-slots", "64", "--bucket-growth", "256",
                "--no-warmup", "--grpc-port", "none"]


def _compile_shapes(url: str) -> None:
    """Compiles the programs a replay uses before it starts (on a loaded 2-core machine that takes about a
    minute, longer than any warm-up period worth scoring after): a 300-token prompt (128-token chunks), the
    same prompt extended by 10 tokens (a prefix hit, a 16-token chunk, checkpoint copies), and decode."""
    import httpx

    prompt = [(7 * i + 3) % 251 for i in range(300)]
    for ids in (prompt, prompt + [5] * 10):
        r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 4, "ignore_eos": True},
                       timeout=300)
        assert r.status_code == 200, r.text


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    env = {"K3JAX_COMPILE_CACHE": str(tmp_path_factory.mktemp("xla_cache")), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    proc = ServerProcess(ENGINE_FLAGS, env=env, ready_timeout_s=300)
    try:
        proc.start()
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        _compile_shapes(proc.url)
        yield proc.url
    finally:
        proc.stop()
