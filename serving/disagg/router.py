"""`k3jax router`: an OpenAI HTTP front for prefill and decode workers (SMG's SGLang PD protocol, over gRPC),
or for several colocated (role "both") workers.

    cfg = RouterConfig(prefill=(("127.0.0.1:50051", 8998),), decode=("127.0.0.1:50052",), page_size=16)
    cfg = RouterConfig(colocated=("127.0.0.1:50051", "127.0.0.1:50052"), page_size=16)
    asyncio.run(run_router(cfg))

Per request: tokenize (the workers' tokenizer), pick a prefill worker by the least estimated
outstanding prefill work and a decode worker by the fewest in-flight requests (then tokens), mint one
bootstrap room, and send the same GenerateRequest to both legs at once (the prefill leg unstreamed, the
decode leg streamed), as SMG does. The decode leg's stream is what the client gets (SSE or one JSON).
No conversation affinity: any prefill worker can serve any turn (the shared cache pool has the history).

Outstanding prefill work is the router's own estimate, not asked of the pool: per worker, the sum
over its in-flight prefill legs of (prompt tokens - tokens the pool probably has). The pool's
content is estimated from what was routed: every prompt's full pages up to its last page boundary
are published to the pool by whichever prefill worker computed them (write-through), so the router
remembers those chained page hashes (a bounded LRU) and counts a new prompt's longest remembered
prefix as cached. Eviction in the pool makes this an overestimate of hits, never of work.

A failed prefill leg cancels the decode leg and fails the request; a decode leg that breaks mid-stream
(its worker died) ends the stream with an error event (HTTP 502 when not streaming).

Colocated workers (the baseline a P/D deployment is compared with): each request goes whole to one worker
(one streamed Generate without bootstrap fields). Policy: among the workers whose in-flight count is within
a slack of the least loaded one (max(2, a quarter of the mean in-flight count), so decode batches stay
balanced), the one with the least estimated prefill work, i.e. its outstanding prefill tokens plus this
prompt's tokens beyond the longest prefix the router has sent to that worker before (its own device and
host caches hold those; a shared pool serves the rest of the history to any worker, but a local hit is
cheaper than a pool fetch). Ties go to fewer in-flight requests, then the lower index. A worker's
outstanding prefill tokens drop when its first token arrives.

Failed workers: a leg that fails with a worker error (not INVALID_ARGUMENT or a cancel) counts a failure
against its worker and marks it failed; failed workers get no requests while any worker of their kind
is not failed. The health probe (serving/disagg/health.py) sends each failed worker a gRPC HealthCheck
every `health_interval_s` and puts it back into rotation after `healthy_after` healthy answers in a row.
Both transitions are logged at INFO.

GET /metrics (Prometheus text; every series carries `model_name`; counts and gauges are read from
`Router.stats()` at scrape time, the same numbers GET /router/stats shows):
- k3jax_router_requests_total{leg,outcome}: legs by how they ended. leg: prefill | decode (one of each per
  P/D request) | colocated. outcome: success | worker_error (counted against the worker) | rejected (the
  worker refused the request: INVALID_ARGUMENT) | cancelled (the client went away, or the other leg of
  the request failed first).
- k3jax_router_prompt_tokens_total, k3jax_router_estimated_cached_tokens_total: prompt tokens routed and
  the router's estimate of how many of them the workers' caches held (the policy's prefix estimate).
- k3jax_router_worker_inflight{leg,worker}: legs in flight per worker (worker: its gRPC target).
- k3jax_router_worker_outstanding_prefill_tokens{leg,worker}: the estimate the policy ranks prefill and
  colocated workers by (prompt tokens still to compute, beyond the estimated cache hits).
- k3jax_router_worker_outstanding_decode_tokens{worker}: max_tokens still to generate per decode worker.
- k3jax_router_worker_failures_total{leg,worker}: worker errors per worker.
- k3jax_router_worker_failed{leg,worker}: 1 while the worker is marked failed, else 0.
- k3jax_router_workers_failed{leg}: workers marked failed now.
- k3jax_router_health_probes_total: HealthChecks sent to failed workers.
- k3jax_router_time_to_first_token_seconds, k3jax_router_e2e_request_latency_seconds: histograms (vLLM's
  buckets) as the router sees a request: from routing (after tokenization) to the first streamed
  response and to the last; e2e observes successful requests only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb, sglang_scheduler_pb2_grpc as pb_grpc

from serving.api.http import DISCONNECT_POLL_S
from serving.api.metrics import CONTENT_TYPE, LATENCY_BUCKETS, TTFT_BUCKETS, StatsCollector
from serving.api.protocol import (APIError, chat_messages, chat_template_args, check_unsupported, completion_prompt,
                                  sampling_params, stream_options)
from serving.api.tokenizer import TextStream, load_tokenizer
from serving.cache.hashing import prefix_hashes
from serving.disagg.health import HealthProbe

log = logging.getLogger("k3jax.router")
MAX_REMEMBERED_PAGES = 1 << 20
LEGS = ("prefill", "decode", "colocated")
OUTCOMES = ("success", "worker_error", "rejected", "cancelled")


@dataclass(frozen=True)
class RouterConfig:
    """prefill: (gRPC target "host:port", bootstrap port) per prefill worker; decode: gRPC targets;
    colocated: gRPC targets of role-"both" workers (instead of prefill + decode)."""

    prefill: tuple[tuple[str, int], ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8080
    model_name: str = "k3-tiny"
    tokenizer: str | None = None  # the workers' tokenizer (None: the bundled byte tokenizer)
    page_size: int = 16
    max_model_len: int = 4096
    request_timeout_s: float = 600.0
    health_interval_s: float = 5.0  # how often failed workers are sent a HealthCheck
    healthy_after: int = 2  # healthy answers in a row that put a failed worker back into rotation

    def __post_init__(self):
        problems = []
        if self.colocated and (self.prefill or self.decode):
            problems.append("a router fronts either colocated workers or prefill + decode workers, not both kinds")
        elif not self.colocated and (not self.prefill or not self.decode):
            problems.append("a router needs at least one prefill and one decode worker (or colocated workers)")
        for target in self.colocated:
            if ":" not in target:
                problems.append(f"colocated worker {target!r} must be host:port")
        for target, bport in self.prefill:
            if ":" not in target or not 0 < int(bport) <= 65535:
                problems.append(f"prefill worker {target!r} needs host:port and a bootstrap port, got {bport!r}")
        for target in self.decode:
            if ":" not in target:
                problems.append(f"decode worker {target!r} must be host:port")
        if self.page_size < 1 or self.max_model_len < 2:
            problems.append("page_size must be >= 1 and max_model_len >= 2")
        if not self.health_interval_s > 0 or self.healthy_after < 1:
            problems.append(f"health_interval_s must be > 0 and healthy_after >= 1, got {self.health_interval_s!r} "
                            f"and {self.healthy_after!r}")
        if problems:
            raise ValueError("invalid RouterConfig: " + "; ".join(problems))


@dataclass
class _Worker:
    target: str
    bootstrap_port: int = 0
    stub: object = None
    inflight: int = 0
    outstanding_tokens: int = 0  # prefill: estimated tokens left to compute; decode: tokens still to generate
    failures: int = 0  # worker errors, ever (a counter)
    failed: bool = False  # out of rotation: set by a worker error, cleared by the health probe only


@dataclass
class _Estimate:
    """The router's model of the shared pool's content: chained page hashes, LRU-bounded."""

    page_size: int
    pages: OrderedDict = field(default_factory=OrderedDict)

    def cached_tokens(self, ids: list[int]) -> int:
        n = 0
        for h in prefix_hashes(ids[: (len(ids) - 1) // self.page_size * self.page_size], self.page_size):
            if h not in self.pages:
                break
            self.pages.move_to_end(h)
            n += self.page_size
        return n

    def published(self, ids: list[int]) -> None:
        for h in prefix_hashes(ids[: (len(ids) - 1) // self.page_size * self.page_size], self.page_size):
            self.pages[h] = None
            self.pages.move_to_end(h)
        while len(self.pages) > MAX_REMEMBERED_PAGES:
            self.pages.popitem(last=False)


class Router:
    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.prefill = [_Worker(t, int(b)) for t, b in cfg.prefill]
        self.decode = [_Worker(t) for t in cfg.decode]
        self.estimate = _Estimate(cfg.page_size)
        self.colocated = [_Worker(t) for t in cfg.colocated]
        # per colocated worker: the prefixes it has computed (its own caches), the affinity half of its policy
        self.local = [_Estimate(cfg.page_size) for _ in cfg.colocated]
        # failed: requests that ended with an error (worker or request), client disconnects not counted
        self.counters = {"requests": 0, "failed": 0, "estimated_cached_tokens": 0, "prompt_tokens": 0}
        self.outcomes = {leg: dict.fromkeys(OUTCOMES, 0) for leg in LEGS}  # legs by how they ended
        self.health = HealthProbe(self.workers, interval_s=cfg.health_interval_s, healthy_after=cfg.healthy_after)
        self.metrics = RouterMetrics(self)
        self._channels = []

    def workers(self) -> list[tuple[str, _Worker]]:
        """(leg, worker) for every worker."""
        return [*(("prefill", w) for w in self.prefill), *(("decode", w) for w in self.decode),
                *(("colocated", w) for w in self.colocated)]

    async def start(self) -> None:
        # gRPC's reconnect backoff grows to 120 s while a worker is down, and a probe on a channel in backoff
        # fails without dialling: capped at the probe interval, a restarted worker is seen within ~one interval
        backoff_ms = max(1000, int(self.cfg.health_interval_s * 1000))
        for _, w in self.workers():
            channel = grpc.aio.insecure_channel(w.target, options=[("grpc.max_receive_message_length", 64 << 20),
                                                                   ("grpc.max_reconnect_backoff_ms", backoff_ms)])
            self._channels.append(channel)
            w.stub = pb_grpc.SglangSchedulerStub(channel)
        self.health.start()

    async def close(self) -> None:
        await self.health.stop()
        for channel in self._channels:
            await channel.close()

    def _leg_ended(self, leg: str, worker: _Worker, outcome: str) -> None:
        self.outcomes[leg][outcome] += 1
        if outcome == "worker_error":
            worker.failures += 1
            if not worker.failed:
                worker.failed = True
                log.info("%s worker %s marked failed (failure %d); out of rotation until it answers healthy "
                         "%d health checks in a row", leg, worker.target, worker.failures, self.cfg.healthy_after)

    # --- policy ------------------------------------------------------------------------------
    def pick(self, ids: list[int], max_tokens: int) -> tuple[_Worker, _Worker, int]:
        """(prefill worker, decode worker, estimated tokens to compute)."""
        cached = self.estimate.cached_tokens(ids)
        work = len(ids) - cached
        # ties go to the lower index (deterministic); a failed worker goes last until it is the only one
        prefill = min(self.prefill, key=lambda w: (w.failed, w.outstanding_tokens, w.inflight))
        decode = min(self.decode, key=lambda w: (w.failed, w.inflight, w.outstanding_tokens))
        self.counters["estimated_cached_tokens"] += cached
        self.counters["prompt_tokens"] += len(ids)
        return prefill, decode, work

    def pick_colocated(self, ids: list[int]) -> tuple[int, int]:
        """(index of the colocated worker, its estimated prefill tokens): see the module docstring."""
        healthy = [i for i, w in enumerate(self.colocated) if not w.failed] or list(range(len(self.colocated)))
        loads = [self.colocated[i].inflight for i in healthy]
        slack = max(2, -(-sum(loads) // (4 * len(loads))))
        eligible = [i for i in healthy if self.colocated[i].inflight <= min(loads) + slack]
        work = {i: len(ids) - self.local[i].cached_tokens(ids) for i in eligible}
        best = min(eligible, key=lambda i: (self.colocated[i].outstanding_tokens + work[i], self.colocated[i].inflight, i))
        self.counters["estimated_cached_tokens"] += len(ids) - work[best]
        self.counters["prompt_tokens"] += len(ids)
        return best, work[best]

    # --- one request -------------------------------------------------------------------------
    async def generate(self, ids: list[int], sp: pb.SamplingParams, max_tokens: int, request_id: str):
        """Yields the decode leg's GenerateResponses; raises APIError (a leg failed). Observes the
        request's latencies as the router sees them (from here: tokenization is done)."""
        start = time.monotonic()
        legs = (self._generate_colocated(ids, sp, request_id) if self.colocated
                else self._generate_pd(ids, sp, max_tokens, request_id))
        first = True
        try:
            async for item in legs:
                if first:
                    self.metrics.ttft.observe(time.monotonic() - start)
                    first = False
                yield item
        except Exception:
            self.counters["failed"] += 1
            raise
        else:
            self.metrics.e2e.observe(time.monotonic() - start)
        finally:
            await legs.aclose()  # the client went away: the legs' accounting runs now, not at GC

    async def _generate_pd(self, ids: list[int], sp: pb.SamplingParams, max_tokens: int, request_id: str):
        prefill, decode, work = self.pick(ids, max_tokens)
        room = random.randrange(0, 2**31 - 1)
        self.counters["requests"] += 1
        boot = pb.DisaggregatedParams(bootstrap_host=prefill.target.rsplit(":", 1)[0],
                                      bootstrap_port=prefill.bootstrap_port, bootstrap_room=room)
        base = dict(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=ids), sampling_params=sp,
                    disaggregated_params=boot)
        timeout = self.cfg.request_timeout_s
        prefill.inflight += 1
        prefill.outstanding_tokens += work
        decode.inflight += 1
        decode.outstanding_tokens += max_tokens

        async def prefill_leg():
            outcome = "cancelled"
            try:
                responses = [r async for r in prefill.stub.Generate(pb.GenerateRequest(**base, stream=False), timeout=timeout)]
                outcome = "success"
                return responses
            except BaseException as e:
                outcome = _outcome(e)
                raise
            finally:
                prefill.inflight -= 1
                prefill.outstanding_tokens -= work
                self._leg_ended("prefill", prefill, outcome)

        prefill_task = asyncio.ensure_future(prefill_leg())
        call = decode.stub.Generate(pb.GenerateRequest(**base, stream=True), timeout=timeout)
        outcome = "cancelled"  # also when the prefill leg fails first (it cancels this one)
        try:
            stream = call.__aiter__()
            while True:
                next_item = asyncio.ensure_future(stream.__anext__())
                while True:
                    done, _ = await asyncio.wait({next_item, prefill_task} if not prefill_task.done() else {next_item},
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if prefill_task in done and prefill_task.exception() is not None:
                        next_item.cancel()
                        call.cancel()
                        raise _api_error(prefill_task.exception(), "prefill")
                    if next_item in done:
                        break
                try:
                    item = next_item.result()
                except StopAsyncIteration:
                    break
                yield item
            outcome = "success"
            self.estimate.published(ids)
            try:
                await prefill_task
            except Exception as e:  # the prefill leg failed after the decode leg finished (its own leg counted it)
                raise _api_error(e, "prefill") from None
        except grpc.RpcError as e:
            outcome = _outcome(e)
            raise _api_error(e, "decode") from None
        finally:
            decode.inflight -= 1
            decode.outstanding_tokens -= max_tokens
            self._leg_ended("decode", decode, outcome)
            if not prefill_task.done():
                prefill_task.cancel()
            call.cancel()

    async def _generate_colocated(self, ids: list[int], sp: pb.SamplingParams, request_id: str):
        index, work = self.pick_colocated(ids)
        worker = self.colocated[index]
        self.counters["requests"] += 1
        worker.inflight += 1
        worker.outstanding_tokens += work
        pending = work  # prefill tokens still counted against the worker (until its first token)
        call = worker.stub.Generate(pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=ids),
                                                       sampling_params=sp, stream=True),
                                    timeout=self.cfg.request_timeout_s)
        outcome = "cancelled"
        try:
            async for item in call:
                if pending:
                    worker.outstanding_tokens -= pending
                    pending = 0
                yield item
            outcome = "success"
            self.local[index].published(ids)
            self.estimate.published(ids)
        except grpc.RpcError as e:
            outcome = _outcome(e)
            raise _api_error(e, "colocated") from None
        finally:
            worker.inflight -= 1
            worker.outstanding_tokens -= pending
            self._leg_ended("colocated", worker, outcome)
            call.cancel()

    def stats(self) -> dict:
        def worker(w):
            return {"target": w.target, "inflight": w.inflight, "outstanding_tokens": w.outstanding_tokens,
                    "failures": w.failures, "failed": w.failed}

        return {**self.counters, "outcomes": {leg: dict(n) for leg, n in self.outcomes.items()},
                "health_probes": self.health.probes,
                "colocated": [worker(w) for w in self.colocated], "prefill": [worker(w) for w in self.prefill],
                "decode": [worker(w) for w in self.decode]}


class RouterMetrics:
    """The router's Prometheus metrics (names in the module docstring): the two latency histograms are
    observed per request; every count and gauge is read from Router.stats() at scrape time."""

    def __init__(self, router: Router):
        self.registry = CollectorRegistry()
        name = router.cfg.model_name
        self.ttft = Histogram("k3jax_router_time_to_first_token_seconds", "Routing to the first streamed response.",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry).labels(name)
        self.e2e = Histogram("k3jax_router_e2e_request_latency_seconds", "Routing to the last response (successful requests).",
                             ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry).labels(name)
        self.registry.register(_RouterCollector(name, router.stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RouterCollector(StatsCollector):
    """The router's counts and gauges, read from Router.stats() at scrape time."""

    def collect(self):
        s = self.stats_source()
        m = [self.model_name]

        def family(kind, name, doc, labels=()):
            return kind(name, doc, labels=["model_name", *labels])

        requests = family(CounterMetricFamily, "k3jax_router_requests", "Request legs by how they ended.", ("leg", "outcome"))
        for leg, by_outcome in s["outcomes"].items():
            if s[leg]:  # only the legs this router has workers for
                for outcome, n in by_outcome.items():
                    requests.add_metric([*m, leg, outcome], float(n))
        yield requests
        for key, doc in (("prompt_tokens", "Prompt tokens routed."),
                         ("estimated_cached_tokens", "Prompt tokens the router estimated the workers' caches held.")):
            c = family(CounterMetricFamily, f"k3jax_router_{key}", doc)
            c.add_metric(m, float(s[key]))
            yield c
        per_worker = ("leg", "worker")
        inflight = family(GaugeMetricFamily, "k3jax_router_worker_inflight", "Legs in flight per worker.", per_worker)
        prefill_tokens = family(GaugeMetricFamily, "k3jax_router_worker_outstanding_prefill_tokens",
                                "Estimated prompt tokens still to compute per worker (the policy's load).", per_worker)
        decode_tokens = family(GaugeMetricFamily, "k3jax_router_worker_outstanding_decode_tokens",
                               "max_tokens still to generate per decode worker.", ("worker",))
        failures = family(CounterMetricFamily, "k3jax_router_worker_failures", "Worker errors per worker.", per_worker)
        failed = family(GaugeMetricFamily, "k3jax_router_worker_failed", "1 while the worker is marked failed.", per_worker)
        failed_count = family(GaugeMetricFamily, "k3jax_router_workers_failed", "Workers marked failed.", ("leg",))
        for leg in LEGS:
            for w in s[leg]:
                labels = [*m, leg, w["target"]]
                inflight.add_metric(labels, float(w["inflight"]))
                if leg == "decode":
                    decode_tokens.add_metric([*m, w["target"]], float(w["outstanding_tokens"]))
                else:
                    prefill_tokens.add_metric(labels, float(w["outstanding_tokens"]))
                failures.add_metric(labels, float(w["failures"]))
                failed.add_metric(labels, float(w["failed"]))
            if s[leg]:
                failed_count.add_metric([*m, leg], float(sum(w["failed"] for w in s[leg])))
        yield from (inflight, prefill_tokens, decode_tokens, failures, failed, failed_count)
        probes = family(CounterMetricFamily, "k3jax_router_health_probes", "HealthChecks sent to failed workers.")
        probes.add_metric(m, float(s["health_probes"]))
        yield probes


def _outcome(e: BaseException) -> str:
    """How a leg that raised `e` ended (see k3jax_router_requests_total)."""
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    if isinstance(e, grpc.RpcError):
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return "rejected"
        if e.code() == grpc.StatusCode.CANCELLED:
            return "cancelled"
    return "worker_error"


def _api_error(e: BaseException, leg: str) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, grpc.RpcError):
        code = e.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return APIError(e.details() or "invalid request")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return APIError(f"{leg} worker overloaded: {e.details()}", status=503, type="server_error")
        return APIError(f"{leg} worker failed: {code.name}: {e.details()}", status=502, type="server_error")
    return APIError(f"{leg} worker failed: {type(e).__name__}: {e}", status=502, type="server_error")


def _proto_sampling(s) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                             max_new_tokens=s.max_tokens, min_new_tokens=s.min_tokens, stop=list(s.stop),
                             stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos)


def build_app(router: Router) -> FastAPI:
    app = FastAPI(title="k3jax router", docs_url=None, redoc_url=None, openapi_url=None)
    cfg, tok = router.cfg, router.tokenizer

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.get("/health")
    async def health():
        return {"status": "ok", "prefill": len(router.prefill), "decode": len(router.decode),
                "colocated": len(router.colocated)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "owned_by": "k3jax",
                                            "max_model_len": cfg.max_model_len}]}

    @app.get("/router/stats")
    async def stats():
        return router.stats()

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError("request body must be a JSON object", code="invalid_json")
        check_unsupported(body)
        stream, include_usage, _ = stream_options(body)

        def tokenize():  # the template and a long encode block: a worker thread, not the loop that streams
            if not chat:
                return completion_prompt(body, tok)[0]
            try:
                text = tok.apply_chat_template(chat_messages(body), **chat_template_args(body))
            except ValueError as e:
                raise APIError(str(e), param="messages") from None
            return tok.encode(text)

        ids = await asyncio.to_thread(tokenize)
        sampling = sampling_params(body, len(ids), cfg.max_model_len, chat=chat, default_max_tokens=None if chat else 16)
        rid = uuid.uuid4().hex[:24]
        kind = "chat.completion" if chat else "text_completion"
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": kind, "created": int(time.time()),
                "model": cfg.model_name}
        text_out = TextStream(tok, sampling.stop)
        usage = {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                 "prompt_tokens_details": {"cached_tokens": 0}}
        responses = router.generate(ids, _proto_sampling(sampling), sampling.max_tokens, rid)

        def choice(piece, reason):
            if chat:
                return {"index": 0, "delta" if stream else "message":
                        ({"content": piece} if piece else {}) if stream else {"role": "assistant", "content": piece},
                        "logprobs": None, "finish_reason": reason}
            return {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}

        def account(r):
            part = r.chunk if r.HasField("chunk") else r.complete
            usage["completion_tokens"] = part.completion_tokens
            usage["total_tokens"] = len(ids) + part.completion_tokens
            usage["prompt_tokens_details"]["cached_tokens"] = part.cached_tokens

        if not stream:
            reason, output_ids = None, []

            async def collect():
                nonlocal reason
                async for r in responses:
                    account(r)
                    # streamed: the chunks carry every id (the GenerateComplete repeats the last step's)
                    ids_now = list(r.chunk.token_ids) if r.HasField("chunk") else []
                    output_ids.extend(ids_now)
                    text_out.push(ids_now)
                    if r.HasField("complete"):
                        reason = r.complete.finish_reason
                return True

            if not await _unless_client_gone(collect(), responses, request):
                return Response(status_code=CLIENT_GONE)
            text_out.push([])
            out = choice(text_out.text + text_out.finish(), reason)
            if body.get("return_token_ids"):  # vLLM's extension: the output ids as well as the text
                out["token_ids"] = output_ids
            return {**base, "choices": [out], "usage": usage}

        first = await _unless_client_gone(_first(responses), responses, request, gone=_GONE)
        if first is _GONE:
            return Response(status_code=CLIENT_GONE)
        # errors before the first token became HTTP errors (raised above); later ones end the stream

        async def events():
            chunk_base = {**base, "object": "chat.completion.chunk"} if chat else base
            try:
                if chat:
                    yield {**chunk_base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]}
                async for r in _chain(first, responses):
                    account(r)
                    if r.HasField("chunk"):
                        piece = text_out.push(list(r.chunk.token_ids))
                        if piece:
                            yield {**chunk_base, "choices": [choice(piece, None)]}
                    else:
                        piece = text_out.push([]) + text_out.finish()
                        yield {**chunk_base, "choices": [choice(piece, r.complete.finish_reason)]}
                if include_usage:
                    yield {**chunk_base, "choices": [], "usage": usage}
                yield "[DONE]"
            except APIError as e:
                yield e.body()

        async def sse():
            async for event in events():
                yield f"data: {event if isinstance(event, str) else json.dumps(event, separators=(',', ':'))}\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


CLIENT_GONE = 499  # nginx's "client closed request": the status of a response nobody reads
_GONE = object()


async def _unless_client_gone(coro, responses, request: Request, gone=None):
    """coro's result, or `gone` once the HTTP client has disconnected. Until a response starts, nothing is
    written to the client, so nothing else notices it left: a request queued behind others' prefill (seconds
    on a busy prefill worker) would stay queued, be prefilled and decoded for nobody, and delay the requests
    behind it. Closing `responses` ends the legs, which cancels the workers' calls (they abort the request)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return gone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            await responses.aclose()


async def _first(responses):
    try:
        return await responses.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(first, responses):
    if first is not None:
        yield first
        async for r in responses:
            yield r


async def run_router(cfg: RouterConfig, *, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Serves until SIGINT/SIGTERM (or `stop`)."""
    import signal

    import uvicorn

    if not logging.getLogger().handlers:  # a bare `k3jax router` process: show the INFO worker transitions
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(cfg)
    await router.start()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    server = uvicorn.Server(uvicorn.Config(build_app(router), host=cfg.host, port=cfg.port, log_level="warning",
                                           access_log=False, lifespan="off", timeout_graceful_shutdown=3))
    server.install_signal_handlers = lambda: None
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        task.result()
    workers = f"{len(cfg.colocated)} colocated" if cfg.colocated else f"{len(cfg.prefill)} prefill, {len(cfg.decode)} decode"
    print(f"k3jax router: ready on http://{cfg.host}:{cfg.port} ({workers})", flush=True)
    if ready is not None:
        ready.set()
    await stop.wait()
    server.should_exit = True
    await task
    await router.close()
    print("k3jax router: stopped", flush=True)


__all__ = ["Router", "RouterConfig", "RouterMetrics", "build_app", "run_router"]
