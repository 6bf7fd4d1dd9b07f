"""Explicit shape buckets (EngineConfig.row_buckets / token_buckets / page_buckets) and the deployment's warmup.

Every (rows, tokens, pages) bucket is one jit program; on an H200 one k3-small program takes ~30-45 s to
compile, so large models serve from a few explicit buckets instead of powers of bucket_growth."""

import sys

import pytest

from serving.config import EngineConfig, explicit_buckets
from serving.disagg.deploy import load_deployment, worker_argv
from serving.runner import ModelRunner


def test_explicit_buckets_parse_and_end_at_the_limit():
    assert explicit_buckets(None, 64) is None
    assert explicit_buckets("8,64", 64) == (8, 64)
    assert explicit_buckets("3, 17", 64) == (3, 17, 64)  # the limit is added, odd sizes are fine
    assert explicit_buckets(1024, 1024) == (1024,)  # YAML reads a lone size as an int
    for bad, why in (("8,8", "increasing"), ("16,8", "increasing"), ("0,8", "increasing"), ("a,8", "ints"),
                     ("", "increasing"), ("8,128", "exceeds the limit 64")):
        with pytest.raises(ValueError, match=why):
            explicit_buckets(bad, 64)


def test_engine_config_refuses_bad_buckets_and_the_runner_uses_given_ones():
    with pytest.raises(ValueError, match="page_buckets: 600 exceeds the limit 256"):
        EngineConfig(page_size=16, max_model_len=4096, page_buckets="600")
    ecfg = EngineConfig(page_size=16, max_model_len=4096, max_running=8, max_prefill_tokens=256,
                        row_buckets="3", token_buckets="256", page_buckets="32,256")
    runner = ModelRunner.__new__(ModelRunner)  # the bucket tables only (what __init__ calls): no params, no state
    ModelRunner._set_buckets(runner, ecfg)
    assert runner.row_buckets == (3, 8) and runner.token_buckets == (256,) and runner.page_buckets == (32, 256)
    default = ModelRunner.__new__(ModelRunner)
    ModelRunner._set_buckets(default, EngineConfig(page_size=16, max_model_len=4096, max_running=8,
                                                   max_prefill_tokens=256, bucket_growth=4))
    assert default.row_buckets == (1, 4, 8) and default.token_buckets == (16, 64, 256)
    assert default.page_buckets == (1, 4, 16, 64, 256)


def test_h200x2_deployments_fix_four_programs_and_warm_up_before_ready():
    for path in ("configs/deploy/h200x2-colocated.yaml", "configs/deploy/h200x2-pd-1p1d.yaml"):
        dep = load_deployment(path)
        assert dep.warmup
        ecfg = EngineConfig(model=dep.model, **dep.engine)
        rows = explicit_buckets(ecfg.row_buckets, ecfg.max_running)
        tokens = explicit_buckets(ecfg.token_buckets, ecfg.max_prefill_tokens)
        pages = explicit_buckets(ecfg.page_buckets, ecfg.max_pages_per_request)
        assert len(rows) * len(pages) * (len(tokens) + 1) == 4  # prefill + decode programs per worker
        argv = worker_argv(dep, dep.workers[0])
        assert argv[:3] == [sys.executable, "-m", "k3jax"] and "--warmup" in argv
        assert argv[argv.index("--row-buckets") + 1] == "8,64"
