"""The two halves of a disaggregated request, attached to an Engine by its role (EngineConfig.role).

Prefill worker (`PrefillHandoff`): computes the prompt like a colocated worker, samples the first
token, then *holds* the request's device state (pages + KDA/conv row stay allocated) keyed by its
bootstrap room until the decode partner pulls it. A pull arrives on the transfer listener's thread and
waits; the engine thread, at its next step boundary, reads the state off the device (the swap-out
path, ModelRunner.read_request), releases the request (publishing its prefix to the cache and the
store, as on any finish) and hands the payload to the waiting pull. Bounded: with `max_held`
requests held, admission of new prefills stops (backpressure). A held request nobody pulls within
`handoff_timeout_s` is released (its pages freed). Admission mode "decode_first" (the control in
benchmarks/pd_admission.py) admits a prefill only once its decode partner has connected.

Decode worker (`DecodeIntake`): a request with bootstrap info waits outside the scheduler until the
worker has room for it (a slot and the prompt's pages, within max_running: admission independent of
the prefill worker's); then pages/slot are reserved and the pull runs on a background thread, so a
long transfer never stalls the decode loop. When it lands, the engine thread writes the state into
the reserved slot/pages (ModelRunner.write_request, the swap-in path) at a step boundary and the
request joins the running batch with its first token already emitted. A failed or timed-out pull
frees the reservation and ends the request with an error.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from serving.disagg.transfer import KVPayload, TransferError, make_transport
from serving.request import Request, RequestStatus

log = logging.getLogger("k3jax.disagg")


@dataclass(frozen=True)
class Bootstrap:
    """SGLang-style pairing of the two legs of one request (the gateway mints the room)."""

    host: str
    port: int
    room: int


class _Pull:
    """One decode worker's pull, waiting on a listener thread for the engine thread to fill it."""

    def __init__(self, room: int, deadline: float):
        self.room, self.deadline = room, deadline
        self.event = threading.Event()
        self.payload: KVPayload | None = None
        self.error: str | None = None


class PrefillHandoff:
    def __init__(self, engine):
        ecfg = engine.ecfg
        self.engine = engine
        self.max_held = ecfg.handoff_max_held
        self.timeout_s = ecfg.handoff_timeout_s
        self.decode_first = ecfg.pd_admission == "decode_first"
        self.held: dict[int, tuple[Request, float]] = {}  # room -> (request, time its prompt finished)
        self._pulls: list[_Pull] = []  # guarded by _lock
        self._expired: OrderedDict[int, None] = OrderedDict()  # rooms freed unpulled (recent ones); guarded by _lock
        self._lock = threading.Lock()
        self.wake = lambda: None  # AsyncEngine sets this: a pull arrived, run a step boundary soon
        self.transport = make_transport(ecfg.disagg_transport, ecfg.transfer_timeout_s)
        self.listener = self.transport.listen(ecfg.bootstrap_port or 0, self._on_pull)
        self.stats = {"handoff_sent": 0, "handoff_expired": 0, "kv_transfer_bytes_sent": 0}

    @property
    def port(self) -> int:
        return self.listener.port

    # --- listener thread ----------------------------------------------------------------------
    def _on_pull(self, room: int, deadline: float) -> KVPayload:
        pull = _Pull(room, deadline)
        with self._lock:
            if room in self._expired:
                raise TransferError(f"room {room}: its prefill finished but nobody pulled it within "
                                    f"{self.timeout_s:.0f} s; its state was freed")
            self._pulls.append(pull)
        self.wake()
        pull.event.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if pull.payload is None and pull.error is None:  # timed out: the engine will not fill it now
                self._pulls.remove(pull)
                raise TransferError(f"room {room}: no finished prefill to hand over before the deadline")
        if pull.error is not None:
            raise TransferError(pull.error)
        return pull.payload

    # --- engine thread ------------------------------------------------------------------------
    def can_admit(self, req: Request) -> bool:
        """Scheduler gate: backpressure on held requests; in decode-first mode, a partner must be waiting."""
        if len(self.held) >= self.max_held:
            return False
        room = getattr(req, "bootstrap", None)
        if not self.decode_first or room is None:
            return True
        with self._lock:
            return any(p.room == room.room for p in self._pulls)

    def hold(self, req: Request) -> None:
        """req's prompt is done and its first token sampled: keep its state until the partner pulls it."""
        room = req.bootstrap.room
        if room in self.held:  # a duplicate room: the older one can never be paired reliably
            self._release(self.held.pop(room)[0])
        self.held[room] = (req, time.monotonic())
        self.service()

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self.held or self._pulls)

    def service(self) -> None:
        """At a step boundary: serve waiting pulls whose room is held; release expired held requests."""
        with self._lock:
            ready = [p for p in self._pulls if p.room in self.held]
            for p in ready:
                self._pulls.remove(p)
        for pull in ready:
            req, _ = self.held.pop(pull.room)
            payload = KVPayload(room=pull.room, request_id=req.request_id, first_tokens=list(req.output_ids),
                                num_computed=req.num_computed_tokens, cached_tokens=req.num_cached_tokens,
                                arrays=self.engine.kv.export(req), spec_pending=list(req.spec_pending))
            self._release(req)
            self.stats["handoff_sent"] += 1
            self.stats["kv_transfer_bytes_sent"] += payload.nbytes
            with self._lock:
                pull.payload = payload
            pull.event.set()
        now = time.monotonic()
        for room, (req, since) in list(self.held.items()):
            if now - since > self.timeout_s:
                log.warning("room %d (%s): no decode partner within %.1f s; freeing its state", room, req.request_id,
                            self.timeout_s)
                del self.held[room]
                self._release(req)
                self.stats["handoff_expired"] += 1
                with self._lock:
                    self._expired[room] = None
                    while len(self._expired) > 4096:
                        self._expired.popitem(last=False)

    def _release(self, req: Request) -> None:
        self.engine.kv.release(req, cache=True)

    def held_requests(self) -> list[Request]:
        return [req for req, _ in self.held.values()]

    def close(self) -> None:
        self.listener.close()


class _Transfer:
    def __init__(self, req: Request):
        self.req, self.started = req, time.monotonic()
        self.cancelled = False


class DecodeIntake:
    def __init__(self, engine):
        ecfg = engine.ecfg
        self.engine = engine
        self.timeout_s = ecfg.transfer_timeout_s
        self.transport = make_transport(ecfg.disagg_transport, ecfg.transfer_timeout_s)
        self.awaiting: deque[Request] = deque()  # arrived, nothing reserved yet (arrival order)
        self.inflight: dict[str, _Transfer] = {}  # reserved, pull running
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (transfer, payload | error message)
        self.stats = {"kv_transfers": 0, "kv_transfer_failures": 0, "kv_transfer_bytes_received": 0,
                      "kv_transfer_seconds_sum": 0.0, "decode_queue_seconds_sum": 0.0, "decode_queue_count": 0}

    def add(self, req: Request) -> None:
        self.awaiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.awaiting or self.inflight)

    def reserved_requests(self) -> list[Request]:
        return [t.req for t in self.inflight.values()]

    def cancel(self, req: Request) -> None:
        """Abort: forget req; a reservation is freed now, a pull still running is ignored when it lands."""
        if req in self.awaiting:
            self.awaiting.remove(req)
        transfer = self.inflight.pop(req.request_id, None)
        if transfer is not None:
            transfer.cancelled = True
            self.engine.kv.release(req, cache=False)

    def wait(self, timeout_s: float) -> None:
        """Idle engine with pulls in flight: block briefly for one to land instead of spinning."""
        if self.inflight:
            try:
                item = self._done.get(timeout=timeout_s)
            except queue.Empty:
                return
            self._done.put(item)

    def service(self):
        """At a step boundary: install landed transfers, then reserve for waiting requests while room
        remains. Returns StepOutputs for requests that started (first token) or failed."""
        from serving.engine import StepOutput

        outputs = []
        while True:
            try:
                transfer, result = self._done.get_nowait()
            except queue.Empty:
                break
            if transfer.cancelled:
                continue
            req = transfer.req
            self.inflight.pop(req.request_id, None)
            error = result if isinstance(result, str) else self._check(req, result)
            if error is not None:
                self.stats["kv_transfer_failures"] += 1
                self.engine.kv.release(req, cache=False)
                outputs.append(self.engine.fail_request(req, error))
                continue
            outputs.append(self._install(req, result, transfer))
        self._reserve()
        return outputs

    def _check(self, req: Request, payload: KVPayload) -> str | None:
        if payload.num_computed != req.num_prompt or not payload.first_tokens:
            return (f"KV transfer for {req.request_id} does not match the request: {payload.num_computed} tokens "
                    f"computed for a {req.num_prompt}-token prompt")
        if payload.num_pages < len(req.pages):
            return f"KV transfer for {req.request_id} carries {payload.num_pages} pages, {len(req.pages)} needed"
        return None

    def _install(self, req: Request, payload: KVPayload, transfer: _Transfer):
        engine = self.engine
        engine.kv.install(req, payload.arrays, payload.spec_pending)
        req.num_computed_tokens = payload.num_computed
        req.num_cached_tokens = min(payload.cached_tokens, payload.num_computed)
        req.status = RequestStatus.RUNNING
        engine.scheduler.running.append(req)
        self.stats["kv_transfers"] += 1
        self.stats["kv_transfer_bytes_received"] += payload.nbytes
        self.stats["kv_transfer_seconds_sum"] += time.monotonic() - transfer.started
        return engine.emit(req, list(payload.first_tokens))

    def _reserve(self) -> None:
        engine = self.engine
        limit = engine.ecfg.max_running
        while self.awaiting and len(engine.scheduler.running) + len(self.inflight) < limit:
            req = self.awaiting[0]
            if not engine.kv.reserve(req, req.num_prompt):
                break  # no room: it waits (the prefill worker holds its state meanwhile)
            self.awaiting.popleft()
            transfer = _Transfer(req)
            self.inflight[req.request_id] = transfer
            self.stats["decode_queue_seconds_sum"] += transfer.started - req.arrival_time
            self.stats["decode_queue_count"] += 1
            threading.Thread(target=self._pull, args=(transfer,), name=f"kv-pull-{req.request_id}", daemon=True).start()

    def _pull(self, transfer: _Transfer) -> None:
        b = transfer.req.bootstrap
        try:
            result = self.transport.pull(b.host, b.port, b.room, self.timeout_s)
        except TransferError as e:
            result = str(e)
        except Exception as e:  # a bug in the transport: still fail the request cleanly
            result = f"KV transfer failed: {type(e).__name__}: {e}"
        self._done.put((transfer, result))

    def close(self) -> None:
        pass


__all__ = ["Bootstrap", "DecodeIntake", "PrefillHandoff"]
