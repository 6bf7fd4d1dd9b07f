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
        prefill_rows = [b for b in rows if b <= ecfg.max_prefill_rows]
        assert len(rows) * len(pages) + len(prefill_rows) * len(tokens) * len(pages) == 4  # decode + prefill programs
        argv = worker_argv(dep, dep.workers[0])
        assert argv[:3] == [sys.executable, "-m", "k3jax"] and "--warmup" in argv
        assert argv[argv.index("--row-buckets") + 1] == "1,8,64"
        assert argv[argv.index("--max-prefill-rows") + 1] == "1"


def test_step_activity_summarises_a_window_and_starts_the_next():
    from serving.async_engine import StepActivity

    act = StepActivity(every_s=30.0)
    act.since = 100.0
    assert not act.due(200.0)  # no steps: nothing to say
    for s in (0.010, 0.030, 12.0):
        act.add(s)
    assert not act.due(129.0) and act.due(130.0)
    assert act.summary(130.0) == "3 steps in 30 s (busy 12.0 s, mean 4013.3 ms, longest 12000 ms)"
    assert act.steps == 0 and act.since == 130.0 and not act.due(200.0)


def test_the_runner_logs_each_new_step_shape_once(caplog):
    from serving.engine import Engine
    from serving.request import SamplingParams

    engine = Engine(EngineConfig(page_size=4, num_pages=48, num_slots=8, max_running=4, max_model_len=64,
                                 max_prefill_tokens=48, row_buckets="4", token_buckets="48", page_buckets="16"))
    with caplog.at_level("INFO", logger="k3jax.serving"):
        engine.generate([[5, 9, 11, 200, 7], [3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0))
        first = [r.getMessage() for r in caplog.records if "new step shape" in r.getMessage()]
        caplog.clear()
        engine.generate([[8, 1, 2]], SamplingParams(max_tokens=3, temperature=0.0))
        again = [r.getMessage() for r in caplog.records if "new step shape" in r.getMessage()]
    assert [m.split(":")[0] for m in first] == ["new step shape prefill rows=4 tokens=48 pages=16",
                                               "new step shape decode rows=4 tokens=1 pages=16"]
    assert again == []  # same buckets: no new program


def test_prefill_rows_cap_limits_each_step_and_the_warmup():
    """max_prefill_rows: a step prefills at most that many requests (the rest wait their turn), the greedy tokens
    do not change, and the warm-up compiles prefill programs only up to the cap's row bucket."""
    from serving.engine import Engine
    from serving.request import SamplingParams

    opts = dict(page_size=4, num_pages=64, num_slots=12, max_running=4, max_model_len=64, max_prefill_tokens=48,
                row_buckets="1,4", token_buckets="48", page_buckets="16")
    prompts = [[5, 9, 11, 200, 7], [3, 4, 5, 6], [8, 1, 2, 9, 9, 4, 17], [21, 22]]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    base = Engine(EngineConfig(**opts)).generate(prompts, greedy)
    capped = Engine(EngineConfig(**opts, max_prefill_rows=1))
    seen = []
    step = capped.scheduler.schedule
    capped.scheduler.schedule = lambda *a, **k: (plan := step(*a, **k), seen.append(len(plan.prefill)))[0]
    assert capped.generate(prompts, greedy) == base
    assert max(seen) == 1 and seen.count(1) >= len(prompts)  # one request per prefill step, each prefilled
    assert capped.runner.warmup() == 3  # decode at rows 1 and 4, prefill at rows 1 only
    with pytest.raises(ValueError, match="max_prefill_rows"):
        EngineConfig(**opts, max_prefill_rows=5)
