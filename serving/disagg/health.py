"""Brings failed workers back: the router's background health probe.

The router marks a worker failed when one of its legs fails with a worker error (serving/disagg/router.py)
and then routes around it. Every `interval_s` this probe sends each failed worker the SGLang scheduler
service's HealthCheck (what SMG asks; our workers answer healthy while their engine runs and accepts
requests, serving/api/grpc_server.py). A worker that answers healthy `healthy_after` probes in a row is
re-promoted (back into rotation); any unhealthy answer, RPC error or timeout starts its count again.
Workers that are not marked failed are not probed: their own requests are the check.

    probe = HealthProbe(lambda: [("decode", w) for w in router.decode], interval_s=5.0, healthy_after=2)
    task = probe.start()      # or: await probe.probe_once() to drive it step by step
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

log = logging.getLogger("k3jax.router")


class HealthProbe:
    """Re-promotes failed workers after `healthy_after` healthy HealthCheck answers in a row.

    workers: returns (leg, worker) pairs; a worker has `.target`, `.stub` (with HealthCheck), a mutable
    `.failed` flag, which only this probe clears (the router sets it), and a `.failures` count (a new
    failure while a streak is running, e.g. when every worker is failed and one still gets requests,
    starts the streak again)."""

    def __init__(self, workers: Callable[[], Iterable[tuple[str, object]]], *, interval_s: float, healthy_after: int,
                 timeout_s: float | None = None):
        if not interval_s > 0:
            raise ValueError(f"health interval_s must be > 0, got {interval_s!r}")
        if healthy_after < 1:
            raise ValueError(f"healthy_after must be >= 1, got {healthy_after!r}")
        self.workers = workers
        self.interval_s = interval_s
        self.healthy_after = healthy_after
        # a probe that outlives its interval would overlap the next round: it counts as unhealthy
        self.timeout_s = min(interval_s, 10.0) if timeout_s is None else timeout_s
        # id(worker) -> (its failures count when the streak began, healthy answers in a row since)
        self.streaks: dict[int, tuple[int, int]] = {}
        self.probes = 0  # HealthChecks sent (for tests and /router/stats)
        self._task: asyncio.Task | None = None

    async def _healthy(self, worker) -> tuple[bool, str]:
        try:
            answer = await worker.stub.HealthCheck(pb.HealthCheckRequest(), timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - an unreachable, hung or broken worker is simply unhealthy
            detail = e.details() if isinstance(e, grpc.RpcError) and hasattr(e, "details") else e
            return False, f"{type(e).__name__}: {detail}"
        return bool(answer.healthy), answer.message

    async def probe_once(self) -> list[str]:
        """One round over the failed workers (concurrently); returns the targets re-promoted in it."""
        failed = [(leg, w) for leg, w in self.workers() if w.failed]
        live = {id(w) for _, w in failed}
        self.streaks = {k: v for k, v in self.streaks.items() if k in live}  # promoted or gone: forget
        before = [w.failures for _, w in failed]
        answers = await asyncio.gather(*(self._healthy(w) for _, w in failed))
        self.probes += len(failed)
        promoted = []
        for (leg, w), (ok, message), failures in zip(failed, answers, before):
            ok = ok and w.failures == failures  # a leg that failed meanwhile outweighs a healthy answer
            since, streak = self.streaks.get(id(w), (failures, 0))
            streak = streak + 1 if ok and since == failures else int(ok)
            if not ok:
                log.debug("health: %s worker %s still unhealthy (%s)", leg, w.target, message)
            if ok and streak >= self.healthy_after and w.failed:
                w.failed = False
                self.streaks.pop(id(w), None)
                promoted.append(w.target)
                log.info("health: %s worker %s re-promoted after %d healthy checks in a row", leg, w.target, streak)
            else:
                self.streaks[id(w)] = (w.failures, streak)
        return promoted

    async def run(self) -> None:
        """Probes every interval_s until cancelled; an unexpected error in one round is logged, not fatal."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.probe_once()
            except Exception:  # noqa: BLE001 - the probe must outlive one bad round
                log.exception("health: probe round failed")

    def start(self) -> asyncio.Task:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self.run())
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None


__all__ = ["HealthProbe"]
