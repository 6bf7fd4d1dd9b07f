"""Router operability: its Prometheus /metrics and the health probe that re-promotes failed workers.

Fake gRPC workers as in tests/disagg/test_router_colocated.py (scripted streams, no engines, no
processes), plus a scripted HealthCheck, so every counter, gauge and histogram count is checked exactly
and the probe is driven one round at a time (and once through its background loop).

Run: python -m pytest -q tests/disagg/test_router_ops.py
"""

import asyncio
import importlib.util
import logging
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from serving.disagg.health import HealthProbe
from serving.disagg.router import Router, RouterConfig, build_app

# the colocated tests' fakes, shared by path (tests/ is not a package)
_spec = importlib.util.spec_from_file_location("_router_fakes", Path(__file__).with_name("test_router_colocated.py"))
_fakes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fakes)
FakeCall, FakeRpcError, FakeStub = _fakes.FakeCall, _fakes.FakeRpcError, _fakes.FakeStub

PAGE = 16
MODEL = "k3-tiny"


class RpcError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return self._code.name.lower()


class OpsStub(FakeStub):
    """A worker for either mode (bootstrap fields allowed) that also answers HealthCheck from a script:
    True / False (healthy or not), or an exception to raise; the last answer repeats."""

    def __init__(self, health=(True,)):
        super().__init__()
        self.health = list(health)
        self.health_checks = 0

    def Generate(self, request, timeout=None):  # noqa: N802 - the gRPC method's name
        call = FakeCall(request, self.gate, self.fail)
        self.calls.append(call)
        return call

    async def HealthCheck(self, request, timeout=None):  # noqa: N802
        assert isinstance(request, pb.HealthCheckRequest) and timeout is not None and timeout > 0
        answer = self.health.pop(0) if len(self.health) > 1 else self.health[0]
        self.health_checks += 1
        if isinstance(answer, BaseException):
            raise answer
        return pb.HealthCheckResponse(healthy=answer, message="ok" if answer else "draining")


def colocated_router(n, **kw):
    router = Router(RouterConfig(colocated=tuple(f"127.0.0.1:{50100 + i}" for i in range(n)), page_size=PAGE,
                                 model_name=MODEL, **kw))
    for w in router.colocated:
        w.stub = OpsStub()
    return router


def pd_router(n_prefill, n_decode, **kw):
    router = Router(RouterConfig(prefill=tuple((f"127.0.0.1:{50200 + i}", 8900 + i) for i in range(n_prefill)),
                                 decode=tuple(f"127.0.0.1:{50300 + i}" for i in range(n_decode)), page_size=PAGE,
                                 model_name=MODEL, **kw))
    for w in router.prefill + router.decode:
        w.stub = OpsStub()
    return router


async def run(router, ids, max_tokens=3, rid="r"):
    sp = pb.SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    return [r async for r in router.generate(ids, sp, max_tokens, rid)]


def prompt(rng, n):
    return rng.integers(1, 256, n).tolist()


def scrape(router) -> dict:
    """{(name, frozenset of labels other than model_name): value} from GET /metrics."""

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router)), base_url="http://r") as c:
            return await c.get("/metrics")

    r = asyncio.run(get())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def parse(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.pop("model_name") == MODEL, s
            out[s.name, frozenset(s.labels.items())] = s.value
    return out


def value(metrics, name, **labels):
    return metrics[name, frozenset(labels.items())]


def test_metrics_count_colocated_requests_latencies_and_failures():
    rng = np.random.default_rng(11)
    router = colocated_router(2)
    w0, w1 = router.colocated
    held_prompt = prompt(rng, 3 * PAGE + 5)

    async def scenario():
        await run(router, prompt(rng, 2 * PAGE + 1), rid="a")  # both idle and cold: worker 0
        # hold worker 0's stream 50 ms: a gauge scrape meanwhile, and a TTFT above the 40 ms bucket
        w0.stub.gate = asyncio.Event()
        held = asyncio.ensure_future(run(router, held_prompt, rid="held"))
        await asyncio.sleep(0.05)
        during = parse(router.metrics.render().decode())
        w0.stub.gate.set()
        await held
        w0.stub.gate = None
        # a request the worker refuses (INVALID_ARGUMENT): the request's fault, not the worker's
        w0.stub.fail = RpcError(grpc.StatusCode.INVALID_ARGUMENT)
        with pytest.raises(Exception, match="invalid_argument"):
            await run(router, prompt(rng, 20), rid="bad")
        # the client goes away after the first token: the leg ends cancelled, accounting back to zero
        w0.stub.fail = None
        sp = pb.SamplingParams(max_new_tokens=5, ignore_eos=True)
        stream = router.generate(prompt(rng, 30), sp, 5, "gone")
        await stream.__anext__()
        await stream.aclose()
        # worker 0 dies: a worker error, then worker 1 serves
        w0.stub.fail = FakeRpcError()
        with pytest.raises(Exception, match="colocated worker failed: UNAVAILABLE"):
            await run(router, prompt(rng, 20), rid="x")
        await run(router, prompt(rng, 20), rid="y")
        return during

    during = asyncio.run(scenario())
    assert value(during, "k3jax_router_worker_inflight", leg="colocated", worker=w0.target) == 1
    assert value(during, "k3jax_router_worker_outstanding_prefill_tokens", leg="colocated", worker=w0.target) == 3 * PAGE + 5
    assert value(during, "k3jax_router_worker_inflight", leg="colocated", worker=w1.target) == 0
    assert [c.request.request_id for c in w1.stub.calls] == ["y"]

    m = scrape(router)
    assert {o: value(m, "k3jax_router_requests_total", leg="colocated", outcome=o)
            for o in ("success", "worker_error", "rejected", "cancelled")} == {
        "success": 3, "worker_error": 1, "rejected": 1, "cancelled": 1}
    assert not any(k[0] == "k3jax_router_requests_total" and ("leg", "prefill") in k[1] for k in m)  # no P/D legs here
    assert value(m, "k3jax_router_worker_failures_total", leg="colocated", worker=w0.target) == 1
    assert value(m, "k3jax_router_worker_failures_total", leg="colocated", worker=w1.target) == 0
    assert value(m, "k3jax_router_worker_failed", leg="colocated", worker=w0.target) == 1
    assert value(m, "k3jax_router_workers_failed", leg="colocated") == 1
    for w in (w0, w1):  # nothing in flight or outstanding once every request ended, whichever way
        assert value(m, "k3jax_router_worker_inflight", leg="colocated", worker=w.target) == 0
        assert value(m, "k3jax_router_worker_outstanding_prefill_tokens", leg="colocated", worker=w.target) == 0
    assert value(m, "k3jax_router_prompt_tokens_total") == router.counters["prompt_tokens"] == 2 * PAGE + 1 + 3 * PAGE + 5 + 20 + 30 + 20 + 20
    # TTFT: every request that got a first token (a, held, gone, y); e2e: the three that finished
    assert value(m, "k3jax_router_time_to_first_token_seconds_count") == 4
    assert value(m, "k3jax_router_e2e_request_latency_seconds_count") == 3
    # the held request's 50 ms wait lands above the 40 ms bucket; the other three are far below it
    assert value(m, "k3jax_router_time_to_first_token_seconds_bucket", le="0.04") == 3
    assert value(m, "k3jax_router_time_to_first_token_seconds_bucket", le="+Inf") == 4
    assert 0.05 <= value(m, "k3jax_router_e2e_request_latency_seconds_sum") < 5.0
    # the same numbers on /router/stats; "failed" counts requests that ended in an error (bad + x)
    stats = router.stats()
    assert stats["failed"] == 2 and stats["requests"] == 6
    assert stats["colocated"][0]["failed"] is True and stats["colocated"][0]["failures"] == 1


def test_metrics_count_pd_legs_and_outstanding_prefill_estimate():
    rng = np.random.default_rng(13)
    router = pd_router(2, 1)
    p0, p1 = router.prefill
    (d0,) = router.decode
    first = prompt(rng, 4 * PAGE + 7)

    async def scenario():
        await run(router, first, max_tokens=4, rid="a")  # prefill 0 computes all 71 tokens
        # the second turn of the same history: the router estimates 4 pages cached, 7 + 9 tokens to compute
        p0.stub.gate = asyncio.Event()
        d0.stub.gate = asyncio.Event()
        held = asyncio.ensure_future(run(router, first + prompt(rng, 9), max_tokens=4, rid="b"))
        await asyncio.sleep(0.01)
        during = parse(router.metrics.render().decode())
        p0.stub.gate.set()
        d0.stub.gate.set()
        await held
        p0.stub.gate = d0.stub.gate = None
        # a prefill failure fails the request and cancels its decode leg
        p0.stub.fail = FakeRpcError()
        d0.stub.gate = asyncio.Event()  # never set: the decode leg waits for its KV until cancelled
        with pytest.raises(Exception, match="prefill worker failed: UNAVAILABLE"):
            await run(router, prompt(rng, 25), rid="x")
        d0.stub.gate = None
        # the next one goes to prefill worker 1; then the decode worker fails mid-request
        await run(router, prompt(rng, 25), rid="y")
        d0.stub.fail = FakeRpcError()
        with pytest.raises(Exception, match="decode worker failed: UNAVAILABLE"):
            await run(router, prompt(rng, 25), rid="z")
        return during

    during = asyncio.run(scenario())
    assert value(during, "k3jax_router_worker_outstanding_prefill_tokens", leg="prefill", worker=p0.target) == 7 + 9
    assert value(during, "k3jax_router_worker_inflight", leg="prefill", worker=p0.target) == 1
    assert value(during, "k3jax_router_worker_outstanding_decode_tokens", worker=d0.target) == 4
    assert value(during, "k3jax_router_worker_inflight", leg="decode", worker=d0.target) == 1

    m = scrape(router)
    outcomes = {(leg, o): value(m, "k3jax_router_requests_total", leg=leg, outcome=o)
                for leg in ("prefill", "decode") for o in ("success", "worker_error", "cancelled")}
    # z: the decode leg fails; its prefill leg (unstreamed, already answered by the fake) still succeeded
    assert outcomes == {("prefill", "success"): 4, ("prefill", "worker_error"): 1, ("prefill", "cancelled"): 0,
                        ("decode", "success"): 3, ("decode", "worker_error"): 1, ("decode", "cancelled"): 1}
    assert value(m, "k3jax_router_estimated_cached_tokens_total") == 4 * PAGE
    assert value(m, "k3jax_router_worker_failures_total", leg="prefill", worker=p0.target) == 1
    assert value(m, "k3jax_router_worker_failures_total", leg="decode", worker=d0.target) == 1
    assert value(m, "k3jax_router_workers_failed", leg="prefill") == 1
    assert value(m, "k3jax_router_workers_failed", leg="decode") == 1
    assert [c.request.request_id for c in p1.stub.calls] == ["y", "z"]
    assert all(w.inflight == 0 and w.outstanding_tokens == 0 for w in router.prefill + router.decode)
    assert value(m, "k3jax_router_time_to_first_token_seconds_count") == 3
    assert value(m, "k3jax_router_e2e_request_latency_seconds_count") == 3


def test_failed_worker_is_repromoted_after_healthy_checks_and_one_that_stays_down_stays_out(caplog):
    rng = np.random.default_rng(17)
    router = colocated_router(3, healthy_after=2)
    w0, w1, w2 = router.colocated
    unavailable = RpcError(grpc.StatusCode.UNAVAILABLE)
    w0.stub.health = [unavailable, True, False, True, True]  # recovers: healthy twice in a row at probes 4, 5
    w2.stub.health = [unavailable]  # stays down
    caplog.set_level(logging.INFO, logger="k3jax.router")

    async def scenario():
        for w in (w0, w2):
            w.stub.fail = FakeRpcError()
            w1.inflight = 10  # beyond the balance slack: worker 2 gets the second failing request
            with pytest.raises(Exception, match="UNAVAILABLE"):
                await run(router, prompt(rng, 20), rid=f"fail-{w.target}")
            w1.inflight = 0
            w.stub.fail = None
        assert [w.failed for w in router.colocated] == [True, False, True]
        await run(router, prompt(rng, 20), rid="while-down")  # only worker 1 is in rotation
        promoted = [await router.health.probe_once() for _ in range(5)]
        await run(router, prompt(rng, 20), rid="after")  # all idle and cold: the lowest index, worker 0 again
        return promoted

    promoted = asyncio.run(scenario())
    assert promoted == [[], [], [], [], [w0.target]]
    assert not w0.failed and w2.failed and not w1.failed
    assert w0.stub.health_checks == w2.stub.health_checks == 5 and w1.stub.health_checks == 0  # healthy: not probed
    assert [[c.request.request_id for c in w.stub.calls] for w in router.colocated] == [
        ["fail-" + w0.target, "after"], ["while-down"], ["fail-" + w2.target]]
    assert w0.failures == 1 and router.stats()["health_probes"] == 10
    m = scrape(router)
    assert value(m, "k3jax_router_workers_failed", leg="colocated") == 1
    assert value(m, "k3jax_router_worker_failed", leg="colocated", worker=w0.target) == 0
    assert value(m, "k3jax_router_health_probes_total") == 10
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("marked failed" in msg for msg in messages) == 2
    assert [msg for msg in messages if "re-promoted" in msg] == [
        f"health: colocated worker {w0.target} re-promoted after 2 healthy checks in a row"]


def test_background_probe_repromotes_a_pd_decode_worker_and_a_new_failure_restarts_the_count():
    router = pd_router(1, 2, health_interval_s=0.01, healthy_after=3)
    d0, d1 = router.decode
    d0.failed, d0.failures = True, 1

    async def scenario():
        task = router.health.start()
        assert router.health.start() is task  # one loop per router
        for _ in range(500):
            await asyncio.sleep(0.01)
            if not d0.failed:
                break
        await router.health.stop()
        return task

    task = asyncio.run(scenario())
    assert task.cancelled() and not d0.failed and d0.stub.health_checks == 3 and d1.stub.health_checks == 0
    assert router.prefill[0].stub.health_checks == 0

    # driven by hand: a new failure in the middle of a streak (every worker down, so it still got a request)
    probe = HealthProbe(router.workers, interval_s=1.0, healthy_after=2)
    d1.failed, d1.failures = True, 1

    async def streak():
        first = await probe.probe_once()
        d1.failures += 1
        return first, await probe.probe_once(), await probe.probe_once()

    assert asyncio.run(streak()) == ([], [], [d1.target])


def test_health_settings_are_validated():
    with pytest.raises(ValueError, match="health_interval_s must be > 0"):
        RouterConfig(colocated=("127.0.0.1:1",), health_interval_s=0)
    with pytest.raises(ValueError, match="healthy_after >= 1"):
        RouterConfig(colocated=("127.0.0.1:1",), healthy_after=0)
    with pytest.raises(ValueError, match="healthy_after must be >= 1"):
        HealthProbe(list, interval_s=1.0, healthy_after=0)


async def _post_then_leave(app, path: str, body: dict, leave_after_s: float) -> list[dict]:
    """Drives the ASGI app as uvicorn would: the request body, then (after leave_after_s) the client's
    disconnect; returns what the app sent."""
    import json

    sent, pending = [], [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    gone = asyncio.Event()

    async def receive():
        if pending:
            return pending.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "client": ("127.0.0.1", 9),
             "server": ("r", 80), "headers": [(b"content-type", b"application/json")]}
    app_task = asyncio.ensure_future(app(scope, receive, send))
    await asyncio.sleep(leave_after_s)
    gone.set()
    await asyncio.wait_for(app_task, 5.0)
    return sent


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_before_its_first_token_cancels_both_legs(stream):
    """H200, 2026-11-30: in a 1P+1D AgentX run, requests whose clients had gone (the replay's drain cancels
    them) stayed queued on the saturated prefill worker (waiting 73 at concurrency 40), because nothing is
    written to a client before its first token, so nothing noticed it left. The router now watches the
    connection until then: both legs end cancelled, the decode call is cancelled, accounting returns to zero."""
    router = pd_router(1, 1)
    p0, d0 = router.prefill[0], router.decode[0]
    p0.stub.gate, d0.stub.gate = asyncio.Event(), asyncio.Event()  # never set: a long prefill queue
    body = {"model": MODEL, "prompt": list(range(1, 40)), "max_tokens": 4, "stream": stream}
    sent = asyncio.run(_post_then_leave(build_app(router), "/v1/completions", body, leave_after_s=0.6))
    assert sent[0]["status"] == 499
    assert len(p0.stub.calls) == len(d0.stub.calls) == 1 and d0.stub.calls[0].cancelled
    assert (p0.inflight, p0.outstanding_tokens, d0.inflight, d0.outstanding_tokens) == (0, 0, 0, 0)
    m = scrape(router)
    for leg in ("prefill", "decode"):
        assert value(m, "k3jax_router_requests_total", leg=leg, outcome="cancelled") == 1
        assert value(m, "k3jax_router_requests_total", leg=leg, outcome="success") == 0
    assert not p0.failed and not d0.failed
