"""The router in front of colocated (role "both") workers, and deployment files that use it.

The workers are fake gRPC stubs (no engine, no processes): each records the requests it got and streams
back a scripted answer, so the policy (prefix affinity inside a balance slack on in-flight requests),
the accounting (in-flight and outstanding prefill tokens return to zero, also on failure) and the HTTP
answer are checked exactly. The real colocated worker path (gRPC Generate without bootstrap fields) is
the colocated reference of tests/disagg/test_deployment.py.

Run: python -m pytest -q tests/disagg/test_router_colocated.py
"""

import asyncio
import sys

import grpc
import httpx
import numpy as np
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from serving.disagg.deploy import load_deployment, worker_argv
from serving.disagg.router import Router, RouterConfig, build_app

PAGE = 16


class FakeCall:
    """An async stream of GenerateResponses; `gate` (an asyncio.Event) holds it before its first item."""

    def __init__(self, request, gate=None, fail=None):
        self.request, self.gate, self.fail, self.cancelled = request, gate, fail, False
        n = request.sampling_params.max_new_tokens
        ids = [int(i) % 200 + 1 for i in request.tokenized.input_ids[:n]] + [7] * max(0, n - len(request.tokenized.input_ids))
        self.items = [pb.GenerateResponse(request_id=request.request_id, chunk=pb.GenerateStreamChunk(
            token_ids=[t], prompt_tokens=len(request.tokenized.input_ids), completion_tokens=i + 1, cached_tokens=3))
            for i, t in enumerate(ids)]
        self.items.append(pb.GenerateResponse(request_id=request.request_id, complete=pb.GenerateComplete(
            output_ids=ids[-1:], finish_reason="length", prompt_tokens=len(request.tokenized.input_ids),
            completion_tokens=n, cached_tokens=3)))

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        for item in self.items:
            yield item

    def cancel(self):
        self.cancelled = True


class FakeStub:
    def __init__(self):
        self.calls: list[FakeCall] = []
        self.gate = None
        self.fail = None

    def Generate(self, request, timeout=None):  # noqa: N802 - the gRPC method's name
        assert not request.HasField("disaggregated_params"), "a colocated worker gets no bootstrap fields"
        call = FakeCall(request, self.gate, self.fail)
        self.calls.append(call)
        return call


class FakeRpcError(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "worker gone"


def make_router(n=2):
    router = Router(RouterConfig(colocated=tuple(f"127.0.0.1:{50000 + i}" for i in range(n)), page_size=PAGE))
    for w in router.colocated:
        w.stub = FakeStub()
    return router


async def run(router, ids, max_tokens=3, rid="r"):
    sp = pb.SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    return [r async for r in router.generate(ids, sp, max_tokens, rid)]


def history(rng, n):
    return rng.integers(1, 256, n).tolist()


def test_config_needs_one_kind_of_workers():
    with pytest.raises(ValueError, match="not both kinds"):
        RouterConfig(prefill=(("127.0.0.1:1", 2),), decode=("127.0.0.1:3",), colocated=("127.0.0.1:4",))
    with pytest.raises(ValueError, match="at least one prefill"):
        RouterConfig()
    with pytest.raises(ValueError, match="host:port"):
        RouterConfig(colocated=("nohost",))


def test_turns_of_a_session_stay_on_its_worker_and_new_sessions_spread():
    rng = np.random.default_rng(3)
    router = make_router(2)
    a, b = history(rng, 5 * PAGE + 3), history(rng, 7 * PAGE + 9)

    async def scenario():
        await run(router, a, rid="a1")  # both idle and cold: the lower index
        await run(router, b, rid="b1")  # idle again: cold on both, ties go to index 0 as well
        # b's second turn: worker 0 holds b's pages, worker 1 holds nothing
        await run(router, b + history(rng, 40), rid="b2")
        # hold worker 0 busy with a long prefill: a cold session goes to worker 1 (less outstanding work)
        router.colocated[0].stub.gate = asyncio.Event()
        busy = asyncio.ensure_future(run(router, history(rng, 30 * PAGE), rid="busy"))
        await asyncio.sleep(0.01)
        assert router.colocated[0].inflight == 1 and router.colocated[0].outstanding_tokens == 30 * PAGE
        await run(router, history(rng, 4 * PAGE), rid="cold")
        # a's next turn: worker 0 holds a's 5 pages but has 480 tokens queued (480 + 43 to do there) while
        # worker 1 would compute all 123 tokens: the session moves to worker 1
        moved = asyncio.ensure_future(run(router, a + history(rng, 40), rid="a2"))
        await asyncio.sleep(0.01)
        router.colocated[0].stub.gate.set()
        await asyncio.gather(busy, moved)

    asyncio.run(scenario())
    got = {call.request.request_id: i for i, w in enumerate(router.colocated) for call in w.stub.calls}
    assert got == {"a1": 0, "b1": 0, "b2": 0, "busy": 0, "cold": 1, "a2": 1}
    assert all(w.inflight == 0 and w.outstanding_tokens == 0 for w in router.colocated)
    # the router's hit estimate: b2 reused b1's 7 full pages; a2 on worker 1 reused nothing
    assert router.counters["estimated_cached_tokens"] == 7 * PAGE
    assert router.counters["requests"] == 6


def test_affinity_yields_to_balance_slack():
    """A worker more than max(2, ceil(mean in-flight / 4)) requests busier than the least loaded one is
    skipped even when it holds the session's prefix."""
    rng = np.random.default_rng(5)
    router = make_router(2)
    s = history(rng, 6 * PAGE)
    asyncio.run(run(router, s, rid="s1"))  # worker 0 now holds s's 5 full pages
    turn = s + history(rng, 8)
    w0, w1 = router.colocated
    for busy, idle, want in [(2, 0, 0), (3, 0, 1), (11, 8, 0), (12, 8, 1)]:  # slack 2, 2, 3, 3
        w0.inflight, w1.inflight = busy, idle
        assert router.pick_colocated(turn)[0] == want, (busy, idle)
    w0.inflight = w1.inflight = 0
    assert router.pick_colocated(turn) == (0, len(turn) - 5 * PAGE)


def test_failed_worker_is_avoided_and_accounting_returns_to_zero():
    rng = np.random.default_rng(7)
    router = make_router(2)
    router.colocated[0].stub.fail = FakeRpcError()

    async def scenario():
        with pytest.raises(Exception, match="colocated worker failed: UNAVAILABLE"):
            await run(router, history(rng, 3 * PAGE), rid="x")
        await run(router, history(rng, 3 * PAGE), rid="y")

    asyncio.run(scenario())
    assert router.colocated[0].failures == 1 and [c.request.request_id for c in router.colocated[1].stub.calls] == ["y"]
    assert all(w.inflight == 0 and w.outstanding_tokens == 0 for w in router.colocated)


def test_http_completion_through_colocated_workers():
    rng = np.random.default_rng(9)
    router = make_router(2)
    app = build_app(router)
    ids = history(rng, 37)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "ignore_eos": True,
                                                            "return_token_ids": True})
            health = await client.get("/health")
            stats = await client.get("/router/stats")
        return r, health, stats

    r, health, stats = asyncio.run(scenario())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["token_ids"] == [i % 200 + 1 for i in ids[:5]]
    assert body["usage"] == {"prompt_tokens": 37, "completion_tokens": 5, "total_tokens": 42,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    assert health.json()["colocated"] == 2
    assert [w["inflight"] for w in stats.json()["colocated"]] == [0, 0]


def test_h200x2_deployments_share_everything_but_the_split():
    co = load_deployment("configs/deploy/h200x2-colocated.yaml")
    pd = load_deployment("configs/deploy/h200x2-pd-1p1d.yaml")
    assert co.engine == pd.engine and co.pool == pd.pool and co.model == pd.model == "k3-small"
    assert [w.role for w in co.workers] == ["both", "both"] and [w.role for w in pd.workers] == ["prefill", "decode"]
    assert [w.devices for w in co.workers] == [w.devices for w in pd.workers] == ["0", "1"]
    rcfg = co.router_config()
    assert rcfg.colocated == ("127.0.0.1:50061", "127.0.0.1:50062") and not rcfg.prefill and not rcfg.decode
    argv = worker_argv(co, co.workers[1])
    assert argv[:3] == [sys.executable, "-m", "k3jax"] and "--store-write-through" in argv
    assert argv[argv.index("--cache-pool") + 1] == "pool://127.0.0.1:7790"
    assert argv[argv.index("--http-port") + 1] == "none"
    # every root turn of the small preset fits the engine's max_model_len with its output
    from serving.workload.traces import generate, load_preset, prefix_reuse

    preset = load_preset("small")
    assert preset.max_context + preset.output_tokens[1] <= co.engine["max_model_len"]
    assert prefix_reuse(generate(load_preset("small", num_sessions=16))) >= 0.96


def test_colocated_workers_behind_a_router_must_not_serve_http(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("model: k3-tiny\nworkers:\n  - {role: both, grpc_port: 50061, http_port: 8081}\n"
                    "  - {role: both, grpc_port: 50062}\nrouter: {port: 8080}\n")
    with pytest.raises(ValueError, match="drop their http_port"):
        load_deployment(path)
