"""Smoke run of benchmarks/cache_pool.py (host + pool stores, a 3-page chain): it runs end to end, reads
back the bytes it wrote, and its JSON is sane.

Run: python -m pytest -q tests/cache/test_cache_pool_benchmark.py
"""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cache_pool.py"


def test_cache_pool_benchmark_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("cache_pool_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "cache_pool.json"
    result = module.main(["--pages", "3", "--layers", "2", "--width", "9", "--iters", "1", "--stores", "host,pool",
                          "--ckpt-mib", "0.01", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["page_bytes"] == 2 * 16 * 9 * 2
    assert result["limits"]["memcpy_gbps"] > 0 and result["limits"]["loopback_tcp_gbps"] > 0
    pool = result["stores"]["pool (pool_server process, TCP)"]
    assert pool["chain_bytes"] > 3 * result["page_bytes"]  # the last page carries a checkpoint
    assert pool["get_many_gbps"] > 0 and len(pool["samples"]["get_many_s"]) == 1
    assert "pool (pool_server process, TCP)" in capsys.readouterr().out
