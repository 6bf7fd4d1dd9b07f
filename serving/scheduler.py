"""Scheduling policy (colocated mode), stated in one place:

1. Decode first: every running request whose prompt is fully computed decodes, up to `max_running`
   rows. Each needs room for one more token (1 + k when speculating: verify writes k draft positions).
   If pages run out even after evicting cache-only pages, the most recently admitted running request
   is preempted and returns to the front of the queue, by `preemption` policy:
   "recompute" drops its private state (its full pages are published to the prefix cache first, so it
   usually resumes from a prefix hit); "swap" parks its whole state on the host and writes it back on
   re-admission (no recompute, host memory instead).
2. Then prefill under a token budget (`max_prefill_tokens` per step): first the unfinished chunks of
   requests already admitted (oldest first), then new requests in arrival order while the budget, a
   slot and a running place remain. A chunk that does not finish its prompt ends on a page boundary,
   so the KDA state there can be checkpointed for the prefix cache; chunks also stop at the request's
   declared shared-prefix ends and at its prompt's last page boundary, which are always checkpointed.
Decode and prefill of one step run back to back on the same state; neither starves the other.
A swapped request at the head of the queue is re-admitted before new ones, without prefill budget.
3. Disaggregated prefill (serving.disagg.roles): `admission_gate(req)` must allow a new request
   (backpressure when finished prompts wait for their decode partners; decode-first admission).
4. Overlap scheduling (`continue_decode`): while a decode step's sampled tokens are still on the device, the
   next decode step may be chosen without them, but only when a full `schedule()` would choose the same rows:
   every running request is decoding in that step (no prefill chunk pending), no admission is due (nothing
   waits, or the running batch is full), and pages for one more token come without preemption. A request
   whose in-flight token is certainly its last (max_tokens) is left out; one that stops on a sampled token
   (eos, stop ids or strings) is found one step later, and its extra row's output is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serving.config import EngineConfig
from serving.kv_manager import KVManager
from serving.request import Request, RequestStatus


@dataclass
class StepPlan:
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, prompt tokens to compute)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, ecfg: EngineConfig, kv: KVManager, lookahead: int = 0):
        """lookahead: positions past its newest token that a decode step writes (k when speculating)."""
        self.ecfg, self.kv, self.lookahead = ecfg, kv, lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.admission_gate = lambda req: True  # a prefill worker's handoff bound (serving.disagg.roles)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        self.running.remove(victim)
        if self.ecfg.preemption == "swap":
            self.kv.swap_out(victim)
        else:
            self.kv.release(victim, cache=True)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        plan.preempted.append(victim)
        if victim in plan.decode:
            plan.decode.remove(victim)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        ps = self.ecfg.page_size
        # 1. decode
        for req in list(self.running):
            if req not in self.running or req.num_tokens - req.num_computed_tokens != 1:
                continue
            while not self.kv.ensure_pages(req, req.num_tokens + self.lookahead):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is req:
                    break
            else:
                plan.decode.append(req)
        # 2. prefill: continue admitted requests, then admit new ones
        budget = self.ecfg.max_prefill_tokens
        max_rows = self.ecfg.prefill_rows_limit
        for req in self.running:
            if budget <= 0 or len(plan.prefill) >= max_rows:
                break
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining > 1:
                n = self._chunk(req, remaining, budget, ps)
                if n:
                    plan.prefill.append((req, n))
                    budget -= n
        while self.waiting and budget > 0 and len(plan.prefill) < max_rows and len(self.running) < self.ecfg.max_running:
            req = self.waiting[0]
            if req.swapped is not None:
                if not self.kv.swap_in(req):
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                continue
            if not self.kv.can_admit() or not self.admission_gate(req):
                break
            self.waiting.popleft()
            self.kv.admit(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            n = self._chunk(req, req.num_tokens - req.num_computed_tokens, budget, ps)
            if n == 0:  # no pages even for one chunk: put it back and stop admitting
                self.running.remove(req)
                self.kv.release(req, cache=False)
                req.status = RequestStatus.WAITING
                self.waiting.appendleft(req)
                break
            plan.prefill.append((req, n))
            budget -= n
        return plan

    def continue_decode(self, inflight: list[Request]) -> list[Request] | None:
        """The rows of the next decode step while `inflight`'s newest tokens are not yet on the host (each of
        those requests has one sampled token in flight), or None when this step needs a full `schedule()`
        (after the in-flight step is processed). Policy 4 of the module docstring."""
        if self.waiting and len(self.running) < self.ecfg.max_running:
            return None  # an admission (or a swap-in) is due: schedule() decides it
        members = set(map(id, inflight))
        if any(id(req) not in members for req in self.running):
            return None  # a request with a prefill chunk to run, or one that joined since (a P/D transfer)
        rows = [req for req in self.running if req.num_output + 1 < req.sampling.max_tokens]
        for req in rows:
            # the step writes the in-flight token's position (num_computed_tokens); no preemption here
            if not self.kv.ensure_pages(req, req.num_computed_tokens + 1 + self.lookahead):
                return None
        return rows or None

    def _chunk(self, req: Request, remaining: int, budget: int, ps: int) -> int:
        """How many of req's `remaining` uncomputed tokens to prefill now (0 if pages are short).

        A chunk that reaches the last token yields the logits of the next one; a shorter chunk ends on a
        page boundary when it can, so the KDA state there can be checkpointed."""
        start = req.num_computed_tokens
        n = min(remaining, budget)
        if n < remaining:  # a partial chunk ends on a page boundary (checkpointable)
            end = (start + n) // ps * ps
            n = end - start if end > start else n
        if self.ecfg.prefix_cache:  # stop at the next boundary to be checkpointed (shared-prefix ends, the prompt's)
            stop = next((b for b in (*req.cache_boundaries, req.prompt_boundary) if start < b < start + n), None)
            if stop is not None:
                n = stop - start
        if not self.kv.ensure_pages(req, req.num_computed_tokens + n):
            return 0
        return n
