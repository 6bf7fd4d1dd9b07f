"""AsyncEngine: one background thread owns an `Engine` and loops receive -> step -> dispatch.

    async_engine = AsyncEngine(engine).start()
    handle = await async_engine.submit(prompt_ids, SamplingParams(max_tokens=8))   # ValueError if bad
    async for chunk in handle: ...                     # TokenChunk(token_ids, finished, finish_reason, ...)
    handle.abort()                                     # from any thread, at any time
    tokens = await async_engine.generate(prompt_ids, sampling)
    async for chunk in async_engine.stream(prompt_ids, sampling): ...
    async_engine.stop(drain=True)                      # refuse new requests, finish the running ones

Threads. The engine (and everything it owns: scheduler, KV manager, prefix cache) is touched only by the
engine thread. Other threads talk to it through a command queue: add, abort and `call(fn)` (run
`fn(engine)` between two steps). Results travel back through each request's asyncio queue, filled with
`loop.call_soon_threadsafe` on the loop that submitted it, so any number of event loops can submit.

Errors. A bad request raises ValueError to its caller (validated up front where possible, otherwise by
`Engine.add_request` on the engine thread) and never reaches the loop. An exception inside
`Engine.step` is an engine bug: every live request fails with `EngineError`, the loop keeps serving
and `health()` reports the error.

Timing. Each request records arrival, scheduling (first step it was RUNNING after), every token
chunk, and finish times (time.monotonic); `listeners` get a `RequestRecord` on the engine thread when a
request ends, which is where metrics are observed. `stats()` returns the latest `Engine.stats()`
snapshot taken on the engine thread (never read the engine's state from another thread).

Disaggregated roles (serving.disagg): `context["disaggregation"]` (bootstrap host/port/room, set by the
gRPC front end) pairs a request's legs. A prefill engine keeps stepping while it holds finished
prompts for their decode partners (no request is live then), woken when a partner's pull arrives; a
request whose KV transfer fails ends with EngineError.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from serving.request import RequestStatus, SamplingParams, validate_prompt

log = logging.getLogger("k3jax.serving")

STATS_INTERVAL_S = 0.05  # while busy, refresh the stats snapshot at most this often
ACTIVITY_LOG_S = 30.0  # while steps run, one INFO line this often: step count and times, queue sizes


class StepActivity:
    """Step times since the last activity line, so a slow or stalled engine shows in the log (a step that
    compiled a new shape takes tens of seconds on a GPU; see ModelRunner's new-shape lines)."""

    def __init__(self, every_s: float = ACTIVITY_LOG_S):
        self.every_s = every_s
        self.since = time.monotonic()
        self.steps, self.busy_s, self.longest_s = 0, 0.0, 0.0

    def add(self, seconds: float) -> None:
        self.steps += 1
        self.busy_s += seconds
        self.longest_s = max(self.longest_s, seconds)

    def due(self, now: float) -> bool:
        return self.steps > 0 and now - self.since >= self.every_s

    def summary(self, now: float) -> str:
        """The line's step part; starts the next window."""
        text = (f"{self.steps} steps in {now - self.since:.0f} s (busy {self.busy_s:.1f} s, mean "
                f"{1e3 * self.busy_s / self.steps:.1f} ms, longest {1e3 * self.longest_s:.0f} ms)")
        self.since, self.steps, self.busy_s, self.longest_s = now, 0, 0.0, 0.0
        return text


class EngineOverloaded(RuntimeError):
    """Too many requests in flight (HTTP 503 / gRPC RESOURCE_EXHAUSTED)."""


class EngineStopped(RuntimeError):
    """The engine is draining or stopped and accepts no new requests."""


class EngineError(RuntimeError):
    """The engine failed while serving a request (a bug, not the request's fault)."""


@dataclass
class RequestTiming:
    """time.monotonic() stamps of one request's life."""

    arrival: float
    scheduled: float | None = None  # first step after which the engine had it RUNNING (end of queueing)
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per chunk of new tokens
    finish: float | None = None


@dataclass(frozen=True)
class TokenChunk:
    """New tokens of one request after one engine step; counts are cumulative."""

    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache (0 until the request was admitted)


@dataclass(frozen=True)
class RequestRecord:
    """A finished (or aborted) request, as listeners see it."""

    request_id: str
    prompt_tokens: int
    output_ids: list[int]
    finish_reason: str
    cached_tokens: int
    timing: RequestTiming
    num_preemptions: int = 0


class RequestHandle:
    """One submitted request: an async iterator of TokenChunks, plus `abort()`.

    Created by `AsyncEngine.submit`; iterate it on the event loop that submitted it. The iterator
    ends after the chunk with `finished=True`; it raises `EngineError` if the engine failed.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, prompt_ids: tuple[int, ...], sampling: SamplingParams,
                 session: str | None, loop: asyncio.AbstractEventLoop):
        self._owner = owner
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.session = session
        self.timing = RequestTiming(arrival=time.monotonic())
        self.created = time.time()  # wall clock, for API "created" fields
        self.output_ids: list[int] = []
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.context: dict[str, Any] = {}  # free-form data from the API layer (e.g. disaggregation params)
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._accepted: asyncio.Future = loop.create_future()
        self._done = False  # engine thread: finished, failed or aborted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def abort(self) -> None:
        """Stops the request (thread-safe, idempotent). Its stream then ends with finish_reason 'abort'."""
        self._owner._post(("abort", self.request_id))

    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenChunk]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    # --- engine thread -> event loop ---------------------------------------------------------
    def _send(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the submitting loop is closed: nobody is listening any more
            self._owner._post(("abort", self.request_id))

    def _resolve(self, error: BaseException | None) -> None:
        def settle():
            if not self._accepted.done():
                if error is None:
                    self._accepted.set_result(None)
                else:
                    self._accepted.set_exception(error)
        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass


class AsyncEngine:
    """Runs `engine` on a background thread; see the module docstring.

    max_pending: requests in flight (queued + running) beyond which `submit` raises EngineOverloaded.
    listeners: callables taking a RequestRecord, called on the engine thread as each request ends.
    step_hooks: callables taking (engine, outputs), called on the engine thread after every step
        (also after an idle wake-up, with no outputs); they may read the engine's state.
    """

    def __init__(self, engine, *, max_pending: int = 1024,
                 listeners: Sequence[Callable[[RequestRecord], None]] = (),
                 step_hooks: Sequence[Callable[[Any, list], None]] = ()):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.engine = engine
        self.max_pending = max_pending
        self.listeners = list(listeners)
        self.step_hooks = list(step_hooks)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}  # live requests; guarded by _lock
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stopping = False
        self._idle_calls: list[tuple[Callable, concurrent.futures.Future, float]] = []  # engine thread only
        self._stats: dict = {}
        self._stats_time = 0.0
        self._activity = StepActivity()
        self.last_error: str | None = None
        self.started_at = time.time()
        self.last_receive_time = 0.0
        cfg = engine.cfg
        self.vocab_size = cfg.vocab_size
        self.max_model_len = engine.ecfg.max_model_len

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        disagg = getattr(self.engine, "disagg", None)
        if disagg is not None and hasattr(disagg, "wake"):
            disagg.wake = lambda: self._post(("wake", None))  # a decode partner's pull is waiting
        self._stats = self.engine.stats()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="k3jax-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuses new requests; with `drain`, lets live ones finish (up to `timeout` s, then aborts
        them); then ends the engine thread. Safe to call twice."""
        self._accepting = False
        if self._thread is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        if drain:
            while self.num_live and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.01)
        with self._lock:
            live = list(self._handles)
        for rid in live:
            self._post(("abort", rid))
        self._stopping = True
        self._post(("wake", None))
        self._thread.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()) + 5.0)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def accepting(self) -> bool:
        return self._accepting and self.running

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._handles)

    def prefill_in_hand(self) -> tuple[int, int]:
        """(live requests, prompt tokens of the live requests that have produced no token yet), from any thread:
        what the engine has been handed, as of now rather than as of its last step."""
        with self._lock:
            handles = list(self._handles.values())
        return len(handles), sum(len(h.prompt_ids) for h in handles if h.timing.first_token is None)

    def health(self) -> tuple[bool, str]:
        if not self.running:
            return False, "engine thread is not running"
        if self.last_error is not None:
            return False, f"engine step failed: {self.last_error}"
        return True, "ok"

    def stats(self) -> dict:
        """The latest Engine.stats() snapshot (taken on the engine thread)."""
        return self._stats

    # --- submission --------------------------------------------------------------------------
    async def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, *,
                     request_id: str | None = None, session: str | None = None,
                     context: dict | None = None, cache_boundaries: Sequence[int] = ()) -> RequestHandle:
        """Queues a request and waits until the engine accepted it. Raises ValueError for a bad
        request, EngineOverloaded when `max_pending` requests are in flight, EngineStopped while
        draining."""
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        prompt = validate_prompt(prompt_ids, self.vocab_size, self.max_model_len, sampling.max_tokens)
        sampling.validate(self.vocab_size)
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if not self.accepting:
            raise EngineStopped("the engine is not accepting requests (stopped or draining)")
        with self._lock:
            if len(self._handles) >= self.max_pending:
                raise EngineOverloaded(f"{len(self._handles)} requests in flight (max_pending={self.max_pending})")
            if request_id is None:
                request_id = f"req-{next(self._ids)}-{time.monotonic_ns() % 10**9}"
            if request_id in self._handles:
                raise ValueError(f"duplicate request id {request_id!r}: a request with this id is in flight")
            handle = RequestHandle(self, request_id, prompt, sampling, session, asyncio.get_running_loop())
            if context:
                handle.context.update(context)
            handle.cache_boundaries = tuple(cache_boundaries)
            self._handles[request_id] = handle
        self._post(("add", handle))
        try:
            await handle._accepted  # ValueError etc.: the engine thread already dropped the handle
        except asyncio.CancelledError:
            handle.abort()  # queued after the add, so the engine sees both in order
            raise
        return handle

    async def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, *,
                     request_id: str | None = None, session: str | None = None) -> AsyncIterator[TokenChunk]:
        """Submits and yields its chunks; closing the iterator early aborts the request."""
        handle = await self.submit(prompt_ids, sampling, request_id=request_id, session=session)
        try:
            async for chunk in handle:
                yield chunk
        finally:
            if not handle.finished:
                handle.abort()

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, *,
                       request_id: str | None = None, session: str | None = None) -> list[int]:
        """The request's output token ids (cancelling the awaiting task aborts the request)."""
        out: list[int] = []
        async for chunk in self.stream(prompt_ids, sampling, request_id=request_id, session=session):
            out.extend(chunk.token_ids)
        return out

    def abort(self, request_id: str) -> bool:
        """Aborts a live request by id (thread-safe); False if no such request is in flight."""
        with self._lock:
            known = request_id in self._handles
        if known:
            self._post(("abort", request_id))
        return known

    def call(self, fn: Callable[[Any], Any], *, when_idle: bool = False,
             timeout: float | None = None) -> concurrent.futures.Future:
        """Runs `fn(engine)` on the engine thread between steps; returns a concurrent Future (wrap it
        with asyncio.wrap_future to await). With `when_idle` it waits until no request is in flight;
        if that takes longer than `timeout` s the future fails with TimeoutError and fn never runs."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        self._post(("call", (fn, fut, when_idle, deadline)))
        return fut

    async def run(self, fn: Callable[[Any], Any], *, when_idle: bool = False, timeout: float | None = None):
        """`call`, awaited: the result of fn(engine) run on the engine thread."""
        return await asyncio.wrap_future(self.call(fn, when_idle=when_idle, timeout=timeout))

    def reset_prefix_cache(self, timeout: float | None = 0.0) -> concurrent.futures.Future:
        """Drops every cache-only prefix entry (and host-tier copy) once the engine is idle. The
        future's result is the number of device pages uncached; TimeoutError if requests stay in
        flight past `timeout` s (0: only if idle right now)."""
        return self.call(_clear_prefix_cache, when_idle=True, timeout=timeout)

    def _post(self, command) -> None:
        self._commands.put(command)

    # --- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            if self._live_ids():
                wait = 0.0  # work to do: only pick up what is queued
            elif self._idle_calls or self._background_work():
                wait = 0.05  # nothing to step, but idle calls may time out
            else:
                wait = None  # idle: sleep until a command arrives
            try:
                command = self._commands.get(timeout=wait) if wait != 0.0 else self._commands.get_nowait()
            except queue.Empty:
                command = None
            while command is not None:
                self._handle_command(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._stopping:
                break
            self._run_idle_calls()
            outputs: list = []
            if self._live_ids() or self._background_work():
                try:
                    started = time.perf_counter()
                    outputs = engine.step()
                    self._activity.add(time.perf_counter() - started)
                except Exception as e:  # an engine bug: fail the live requests, keep serving
                    self.last_error = f"{type(e).__name__}: {e}"
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self._fail_all(EngineError(f"engine step failed: {self.last_error}"))
                    continue
                self._dispatch(outputs)
            self._after_step(outputs)
        self._fail_all(EngineStopped("the engine stopped"))
        self._after_step([])

    def _background_work(self) -> bool:
        """P/D: held prefills waiting for their decode partner (expiry, pulls) need step boundaries."""
        disagg = getattr(self.engine, "disagg", None)
        return disagg is not None and disagg.has_work

    def _live_ids(self) -> list[str]:
        with self._lock:
            return [rid for rid, h in self._handles.items() if not h._done and rid in self.engine.requests]

    def _handle_command(self, command) -> None:
        kind, arg = command
        engine = self.engine
        if kind == "add":
            handle: RequestHandle = arg
            self.last_receive_time = time.time()
            try:
                engine.add_request(handle.prompt_ids, handle.sampling, request_id=handle.request_id,
                                   session=handle.session, cache_boundaries=getattr(handle, "cache_boundaries", ()),
                                   bootstrap=_bootstrap(handle.context.get("disaggregation")))
            except Exception as e:  # ValueError for a bad request; anything else is reported the same way
                with self._lock:
                    self._handles.pop(handle.request_id, None)
                handle._done = True
                handle._resolve(e if isinstance(e, ValueError) else EngineError(f"{type(e).__name__}: {e}"))
                return
            handle._resolve(None)
        elif kind == "abort":
            rid = arg
            with self._lock:
                handle = self._handles.get(rid)
            if handle is None or handle._done:
                return
            if rid in engine.requests:
                engine.abort(rid)
            self._finish(handle, "abort")
        elif kind == "call":
            fn, fut, when_idle, deadline = arg
            if when_idle:
                self._idle_calls.append((fn, fut, deadline))
            else:
                _run_call(fn, fut, engine)

    def _run_idle_calls(self) -> None:
        if not self._idle_calls:
            return
        idle = not self._live_ids()
        now = time.monotonic()
        keep = []
        for fn, fut, deadline in self._idle_calls:
            if idle:
                _run_call(fn, fut, self.engine)
            elif now >= deadline:
                fut.set_exception(TimeoutError("requests stayed in flight; the engine never went idle in time"))
            else:
                keep.append((fn, fut, deadline))
        self._idle_calls = keep

    def _dispatch(self, outputs: list) -> None:
        now = time.monotonic()
        engine = self.engine
        for out in outputs:
            with self._lock:
                handle = self._handles.get(out.request_id)
            if handle is None or handle._done:
                continue
            req = engine.requests.get(out.request_id)
            if handle.timing.scheduled is None:
                handle.timing.scheduled = now
            if out.new_tokens:
                handle.output_ids.extend(out.new_tokens)
                handle.timing.token_times.append(now)
                if handle.timing.first_token is None:
                    handle.timing.first_token = now
            if req is not None:
                handle.cached_tokens = req.num_cached_tokens
            if getattr(out, "error", None):
                self._fail_one(handle, EngineError(out.error))
                continue
            if out.finished:
                self._finish(handle, out.finish_reason or "stop", new_tokens=list(out.new_tokens))
            else:
                handle._send(self._chunk(handle, list(out.new_tokens), False, None))
        # queue time ends when a request is first seen running (it may produce no token yet: chunked prefill)
        with self._lock:
            pending = [h for h in self._handles.values() if h.timing.scheduled is None and not h._done]
        for handle in pending:
            req = engine.requests.get(handle.request_id)
            if req is not None and req.status is not RequestStatus.WAITING:
                handle.timing.scheduled = now
                handle.cached_tokens = req.num_cached_tokens

    def _chunk(self, handle: RequestHandle, tokens: list[int], finished: bool, reason: str | None) -> TokenChunk:
        return TokenChunk(tokens, finished, reason, len(handle.prompt_ids), len(handle.output_ids),
                          handle.cached_tokens)

    def _finish(self, handle: RequestHandle, reason: str, new_tokens: list[int] | None = None) -> None:
        now = time.monotonic()
        handle._done = True
        handle.finish_reason = reason
        handle.timing.finish = now
        req = self.engine.requests.pop(handle.request_id, None)
        preemptions = 0
        if req is not None:
            handle.cached_tokens = req.num_cached_tokens
            preemptions = req.num_preemptions
        with self._lock:
            self._handles.pop(handle.request_id, None)
        handle._send(self._chunk(handle, new_tokens or [], True, reason))
        record = RequestRecord(handle.request_id, len(handle.prompt_ids), list(handle.output_ids), reason,
                               handle.cached_tokens, handle.timing, preemptions)
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.error("request listener failed:\n%s", traceback.format_exc())

    def _fail_one(self, handle: RequestHandle, error: BaseException) -> None:
        """One request failed (its KV transfer): its iterator raises `error`; listeners see an abort."""
        handle._done = True
        handle.finish_reason = "abort"
        handle.timing.finish = time.monotonic()
        self.engine.requests.pop(handle.request_id, None)
        with self._lock:
            self._handles.pop(handle.request_id, None)
        handle._resolve(error)
        handle._send(error)
        record = RequestRecord(handle.request_id, len(handle.prompt_ids), list(handle.output_ids), "abort",
                               handle.cached_tokens, handle.timing)
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.error("request listener failed:\n%s", traceback.format_exc())

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
        for handle in handles:
            if handle._done:
                continue
            handle._done = True
            if handle.request_id in self.engine.requests:
                try:
                    self.engine.abort(handle.request_id)
                except Exception:
                    log.error("abort after an engine failure failed:\n%s", traceback.format_exc())
                self.engine.requests.pop(handle.request_id, None)
            handle._resolve(error)  # a submitter still waiting gets the error there ...
            handle._send(error)  # ... an iterating one here
        for _, fut, _ in self._idle_calls:
            fut.set_exception(error)
        self._idle_calls = []

    def _after_step(self, outputs: list) -> None:
        now = time.monotonic()
        if now - self._stats_time >= STATS_INTERVAL_S or not self._live_ids():
            try:
                self._stats = self.engine.stats()
                self._stats_time = now
            except Exception:
                log.error("engine.stats() failed:\n%s", traceback.format_exc())
        if self._activity.due(now):
            log.info("engine: %s; running %s, waiting %s, kv usage %.2f", self._activity.summary(now),
                     self._stats.get("running"), self._stats.get("waiting"), self._stats.get("kv_usage") or 0.0)
        for hook in self.step_hooks:
            try:
                hook(self.engine, outputs)
            except Exception:
                log.error("step hook failed:\n%s", traceback.format_exc())


def _bootstrap(disaggregation):
    """serving.disagg.roles.Bootstrap from the API layer's disaggregation params (None: not paired)."""
    if disaggregation is None:
        return None
    from serving.disagg.roles import Bootstrap

    return Bootstrap(disaggregation.bootstrap_host, disaggregation.bootstrap_port, disaggregation.bootstrap_room)


def _run_call(fn, fut: concurrent.futures.Future, engine) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn(engine))
    except BaseException as e:  # handed to the caller
        fut.set_exception(e)


def _clear_prefix_cache(engine) -> int:
    """reset_prefix_cache on the engine thread, once it is idle."""
    return engine.reset_prefix_cache()


__all__ = ["AsyncEngine", "EngineError", "EngineOverloaded", "EngineStopped", "RequestHandle", "RequestRecord",
           "RequestTiming", "TokenChunk"]
