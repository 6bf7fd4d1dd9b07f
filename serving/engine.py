"""The serving engine: one worker's loop, as named steps: receive -> schedule -> forward -> process.

    engine = k3jax.serve(model="k3-tiny")          # or Engine(EngineConfig(...))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
    for chunk in engine.stream([1, 2, 3], SamplingParams(max_tokens=8)): ...

The engine is single-threaded: `step()` runs one scheduled batch; `generate` / `stream` drive steps
until their requests finish.

Overlap scheduling (EngineConfig.overlap_schedule, on by default; not with speculative decoding): a decode-only
step samples on the device and returns without waiting for its tokens; the next `step()` chooses the following
decode step (Scheduler.continue_decode), dispatches it with those tokens as its input -- gathered on the device
-- and only then reads them back and processes them, so the host's scheduling, batch building, kernel enqueue
and stop checks overlap the device's work instead of leaving it idle between steps. Outputs therefore arrive
one `step()` later. Any other step (an admission, a prefill chunk, a preemption, a P/D arrival) first processes
the step in flight and runs synchronously. A request that stops on a sampled token (eos, stop ids, stop strings)
has been given one more decode row by the time its stop is seen: that row's token is dropped. The row computed
the stop token itself, which belongs to the request's history: it wrote the right KV and KDA state, and only
into the request's own pages and slot (positions the prefix cache may publish only with that token in them).

Requests are validated on entry (ValueError); a bad request never touches the state. Memory lifecycle lives in `KVManager`, policy in `Scheduler`, device work in
`ModelRunner`.

Roles (EngineConfig.role, serving.disagg.roles): "both" serves requests whole. "prefill" stops every
request after its first token; one with a bootstrap room is then held (state on the device) until
its decode partner pulls it. "decode" takes a request with a bootstrap room outside the scheduler,
reserves memory, pulls the state and then decodes it (without a room it serves the request whole).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import jax
import numpy as np

import k3jax
from k3jax.sampling import SamplingTensors, sample
from serving.cache.host_tier import HostStore
from serving.cache.store import CacheStore
from serving.config import EngineConfig
from serving.kv_manager import KVManager
from serving.request import (
    Request,
    RequestStatus,
    SamplingParams,
    StopStringMatcher,
    check_stop,
    validate_prompt,
)
from serving.runner import ModelRunner, Row, fit, pool_sizes
from serving.scheduler import Scheduler, StepPlan


@dataclass
class InflightDecode:
    """A decode step dispatched but not processed yet (overlap scheduling): its rows in order and their sampled
    tokens, still on the device ([B_bucket] int32; row i is reqs[i]'s next token)."""

    reqs: list[Request]
    tokens: jax.Array


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None = None  # the request failed (e.g. its KV transfer): finished, with this message


class Engine:
    def __init__(self, ecfg: EngineConfig | None = None, *, cfg=None, params=None, detokenize=None,
                 drafter: tuple | None = None, store: CacheStore | None = None):
        """`detokenize(ids) -> str` enables stop strings (the API layer passes its tokenizer's).
        `drafter=(DrafterConfig, params)` (or ecfg.drafter, a checkpoint path) with ecfg.speculative_k > 0
        turns on speculative decoding. `store`: the cache tier below the device (e.g. a pool shared with
        other workers); default a private HostStore of ecfg.host_cache_gb, or none."""
        self.ecfg = ecfg = ecfg or EngineConfig()
        self.detokenize = detokenize
        # Ids at or above this are never sampled (None: the whole output layer). The API layer sets its tokenizer's
        # size when the output layer is wider (a vocabulary padded for the GEMMs, or k3-small's random weights with
        # the 263-id byte tokenizer): such ids render as nothing, so a stream of them shows no tokens at all.
        self.sample_vocab_size: int | None = None
        self.matchers: dict[str, StopStringMatcher] = {}
        self.cfg = cfg or k3jax.load_config(ecfg.model)
        if params is None:
            if ecfg.weights:
                self.cfg, params = _load_weights(ecfg.weights)
            else:
                params = k3jax.init_params(self.cfg, jax.random.key(ecfg.seed))
        params = _serving_layout(params, self.cfg)
        if ecfg.max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {ecfg.max_model_len} exceeds the model's {self.cfg.max_position_embeddings}")
        drafter = _resolve_drafter(self.cfg, ecfg, drafter)
        draft_dim = drafter[0].layer_config(self.cfg).latent_cache_dim if drafter else 0
        num_pages, num_slots = pool_sizes(self.cfg, ecfg, jax.devices()[0], draft_dim)
        self.runner = ModelRunner(self.cfg, ecfg, params, num_pages, num_slots, drafter=drafter)
        if store is None and ecfg.cache_pool:
            from serving.cache.tiered import make_cache_store

            store = make_cache_store(ecfg.host_cache_gb, ecfg.cache_pool)  # host L2 in front of the shared pool
        elif store is None and ecfg.host_cache_gb > 0:
            store = HostStore(ecfg.host_cache_gb)
        self.kv = KVManager(self.runner, ecfg.page_size, ecfg.prefix_cache, store=store, session_ttl_s=ecfg.session_ttl_s,
                            write_through=ecfg.store_write_through or ecfg.role != "both")
        self.scheduler = Scheduler(ecfg, self.kv, lookahead=self.runner.k)
        self.disagg = None  # serving.disagg.roles: PrefillHandoff / DecodeIntake by role
        if ecfg.role == "prefill":
            from serving.disagg.roles import PrefillHandoff

            self.disagg = PrefillHandoff(self)
            self.scheduler.admission_gate = self.disagg.can_admit
        elif ecfg.role == "decode":
            from serving.disagg.roles import DecodeIntake

            self.disagg = DecodeIntake(self)
        self.requests: dict[str, Request] = {}
        self.inflight: InflightDecode | None = None  # overlap scheduling: the decode step not yet processed
        self._ids = itertools.count()
        self.timing = {"schedule_s": 0.0, "forward_s": 0.0, "process_s": 0.0}
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "steps": 0,
                         "finished": 0, "aborted": 0, "spec_verifies": 0, "spec_draft_tokens": 0,
                         "spec_accepted_tokens": 0}

    # --- receive -----------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, *,
                    request_id: str | None = None, session: str | None = None,
                    cache_boundaries: Sequence[int] = (), bootstrap=None) -> str:
        """Validates and queues a request; returns its id. Raises ValueError for a bad request.

        cache_boundaries: prompt positions where a prefix other requests will share ends (the end of a
        system prompt, of a tool preamble): the KDA state there (floored to a page boundary) is
        checkpointed and published, so requests sharing only that prefix hit it. The prompt's own last
        page boundary is always checkpointed.

        bootstrap: a serving.disagg.roles.Bootstrap pairing this request's prefill and decode legs
        (used by the prefill and decode roles; a colocated engine ignores it)."""
        sampling = sampling or SamplingParams()
        sampling.validate(self.cfg.vocab_size)
        validate_prompt(prompt_ids, self.cfg.vocab_size, self.ecfg.max_model_len, sampling.max_tokens)
        if sampling.stop and self.detokenize is None:
            raise ValueError("stop strings need a tokenizer: this engine was built without detokenize")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if sampling.stop:
            self.matchers[request_id] = StopStringMatcher(sampling.stop, self.detokenize)
        req = Request(request_id=request_id, prompt_ids=tuple(int(t) for t in prompt_ids), sampling=sampling,
                      session=session)
        if isinstance(cache_boundaries, (str, bytes)) or any(
                not isinstance(b, (int, np.integer)) or not 0 < b <= len(req.prompt_ids) for b in cache_boundaries):
            raise ValueError(f"cache_boundaries must be prompt positions in [1, {len(req.prompt_ids)}]")
        ps = self.ecfg.page_size
        req.cache_boundaries = sorted({int(b) // ps * ps for b in cache_boundaries} - {0})
        self.requests[request_id] = req
        req.bootstrap = bootstrap if self.disagg is not None else None
        if self.ecfg.role == "decode" and bootstrap is not None:
            self.disagg.add(req)  # reserved and pulled at step boundaries
        else:
            self.scheduler.add(req)
        self.counters["prompt_tokens"] += len(req.prompt_ids)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stops a request at any point and frees its memory. False if it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        if self.ecfg.role == "decode" and req.bootstrap is not None and req.status == RequestStatus.WAITING:
            self.disagg.cancel(req)  # awaiting memory or its transfer
        elif req.status == RequestStatus.RUNNING:
            self.kv.release(req, cache=False)
        elif req.swapped is not None:
            self.kv.discard_swapped(req)
        self.scheduler.remove(req)
        self.matchers.pop(request_id, None)
        req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
        self.counters["aborted"] += 1
        return True

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """schedule -> forward (prefill part, decode part) -> process. Device work is dispatched before
        anything waits on it; host-tier prefetches for waiting requests are queued behind the forward.
        With overlap scheduling a decode-only step is processed at the next call (module docstring)."""
        t0 = time.perf_counter()
        arrived = self._service_disagg()
        if self.inflight is not None:
            rows = None if arrived else self.scheduler.continue_decode(self.inflight.reqs)
            if rows:
                return self._overlapped_step(rows, t0)
            arrived = arrived + self._process_inflight()  # this step needs every token on the host first
        plan = self.scheduler.schedule()
        self.counters["preemptions"] += len(plan.preempted)
        if plan.empty:
            if not arrived and self.ecfg.role == "decode":
                self.disagg.wait(0.005)  # only transfers in flight: don't spin
            return arrived
        if self._overlap and plan.decode and not plan.prefill:
            return arrived + self._overlapped_step(plan.decode, t0)
        self.counters["steps"] += 1
        t1 = time.perf_counter()
        prefill_logits = self._forward_prefill(plan) if plan.prefill else None
        decode_logits = self._forward_decode(plan.decode) if plan.decode and not self.runner.k else None
        self._prefetch()
        sampled: dict[str, list[int]] = {}
        if plan.prefill:
            sampled.update(self._finish_prefill(plan, prefill_logits))
        if plan.decode:
            sampled.update(self._speculate(plan) if self.runner.k else self._sample(decode_logits, plan.decode))
        t2 = time.perf_counter()
        outputs = arrived + self._process(sampled)
        t3 = time.perf_counter()
        # host-only phases: the device is idle during scheduling (before anything is dispatched) and
        # during processing (after the sampled tokens came back); the forward phase overlaps host and device
        for name, dt in (("schedule_s", t1 - t0), ("forward_s", t2 - t1), ("process_s", t3 - t2)):
            self.timing[name] += dt
        return outputs

    @property
    def _overlap(self) -> bool:
        return self.ecfg.overlap_schedule and not self.runner.k and self.ecfg.role != "prefill"

    def _overlapped_step(self, reqs: list[Request], t0: float) -> list[StepOutput]:
        """Dispatches a decode step for `reqs` (the newest token of those in the in-flight step taken from it on
        the device), then processes the in-flight step while the new one runs; the new one is left in flight."""
        self.counters["steps"] += 1
        t1 = time.perf_counter()
        previous, self.inflight = self.inflight, None
        tokens, positions = None, [r.num_output for r in reqs]
        if previous is not None:  # continue_decode's rows all have their newest token in `previous`
            index = {id(req): i for i, req in enumerate(previous.reqs)}
            tokens = self.runner.gather_tokens(previous.tokens, [index[id(req)] for req in reqs])
            positions = [pos + 1 for pos in positions]
        logits = self._forward_decode(reqs, tokens)
        self.inflight = InflightDecode(reqs, self._sample_on_device(logits, reqs, positions))
        self.inflight.tokens.copy_to_host_async()
        self._prefetch()
        t2 = time.perf_counter()
        outputs = self._process_inflight(previous) if previous is not None else []
        t3 = time.perf_counter()
        # here "schedule_s" is continue_decode's share, and processing overlaps the step just dispatched
        for name, dt in (("schedule_s", t1 - t0), ("forward_s", t2 - t1), ("process_s", t3 - t2)):
            self.timing[name] += dt
        return outputs

    def sync(self) -> list[StepOutput]:
        """Processes the decode step in flight (overlap scheduling) now: its outputs, or [] when none is."""
        return self._process_inflight() if self.inflight is not None else []

    def _process_inflight(self, step: InflightDecode | None = None) -> list[StepOutput]:
        """Reads back an in-flight decode step's tokens (default: the engine's, which is then done) and emits
        them; rows of requests that finished (or were aborted) meanwhile are dropped."""
        if step is None:
            step, self.inflight = self.inflight, None
        tokens = np.asarray(step.tokens)
        return [self.emit(req, [int(tokens[i])]) for i, req in enumerate(step.reqs) if not req.is_finished]

    def _service_disagg(self) -> list[StepOutput]:
        if self.ecfg.role == "decode":
            return self.disagg.service()
        if self.ecfg.role == "prefill":
            self.disagg.service()
        return []

    @property
    def has_work(self) -> bool:
        """Requests to step, or (P/D roles) held states and transfers to serve."""
        return self.scheduler.has_work or (self.disagg is not None and self.disagg.has_work)

    def _forward_prefill(self, plan: StepPlan) -> jax.Array:
        rows = []
        for req, n in plan.prefill:
            start = req.num_computed_tokens
            rows.append(Row(req.slot, req.pages, start, req.ids_slice(start, start + n)))
            req.num_computed_tokens += n
        logits = self.runner.prefill(rows)
        for req, _ in plan.prefill:
            self.kv.maybe_checkpoint(req)
        return logits

    def _finish_prefill(self, plan: StepPlan, logits: jax.Array) -> dict[str, list[int]]:
        """Samples rows whose prompt is done; when speculating, the drafter catches up on the chunk."""
        done = [i for i, (req, _) in enumerate(plan.prefill) if req.num_computed_tokens == req.num_tokens]
        sampled = self._sample(self.runner.take_rows(logits, done), [plan.prefill[i][0] for i in done]) if done else {}
        if self.runner.k:
            nxt, park = [], []
            for req, n in plan.prefill:
                start = req.num_computed_tokens - n
                finished_prompt = req.request_id in sampled
                # the token after each position; a finished prompt's last one is the sampled token, so that
                # position waits in `pending` for the request's first draft
                nxt.append(req.ids_slice(start + 1, start + n + (0 if finished_prompt else 1)))
                park.append(finished_prompt)
                if finished_prompt:
                    req.spec_pending = list(sampled[req.request_id])
            self.runner.draft_extend(nxt, park)
        return sampled

    def _forward_decode(self, reqs: list[Request], tokens: jax.Array | None = None) -> jax.Array:
        """One decode token per request: each one's newest token, or `tokens` already on the device (overlap)."""
        rows = [Row(r.slot, r.pages, r.num_computed_tokens, [] if tokens is not None else [r.last_token]) for r in reqs]
        logits = self.runner.decode(rows, tokens)
        for req in reqs:
            req.num_computed_tokens += 1
            self.kv.maybe_checkpoint(req)
        return logits

    def _speculate(self, plan: StepPlan) -> dict[str, list[int]]:
        """One draft + verify step for every decode row (serving.spec_decode)."""
        reqs, k, ps = plan.decode, self.runner.k, self.ecfg.page_size
        rows = [Row(r.slot, r.pages, r.num_computed_tokens, [r.last_token]) for r in reqs]
        b = fit(len(rows), self.runner.row_buckets)
        flat = [(r, r.num_output + i) for r in reqs for i in range(k + 1)]
        tensors = SamplingTensors.from_params(
            [r.sampling for r, _ in flat], positions=[pos for _, pos in flat], seeds=[r.seed for r, _ in flat],
            pad_to=b * (k + 1), suppress_eos=[pos < r.sampling.min_tokens for r, pos in flat],
            eos_id=self.cfg.eos_token_id,
        )
        accepted, emitted, handle = self.runner.speculate(rows, [r.spec_pending for r in reqs], tensors,
                                                          self.ecfg.spec_fixed_accepted)
        out, at_end = {}, []
        for i, req in enumerate(reqs):
            a, start = int(accepted[i]), req.num_computed_tokens
            tokens = [int(t) for t in emitted[i, : a + 1]]
            req.num_computed_tokens = end = start + a + 1
            req.spec_pending = tokens
            boundary = end // ps * ps
            if boundary == end:
                at_end.append(req)
            elif boundary > start:  # crossed inside the run: rebuilt from the verify step, before the commit
                self.kv.maybe_checkpoint(req, boundary, copy_into=lambda slot, i=i, j=boundary - start - 1:
                                         self.runner.snapshot_verified(handle, i, j, slot))
            out[req.request_id] = tokens
        self.runner.commit_speculated(handle)
        for req in at_end:  # a copy of the committed slot
            self.kv.maybe_checkpoint(req)
        self.counters["spec_verifies"] += len(reqs)
        self.counters["spec_draft_tokens"] += k * len(reqs)
        self.counters["spec_accepted_tokens"] += int(np.sum(accepted))
        return out

    def _prefetch(self, max_requests: int = 4) -> None:
        if self.kv.store is None:
            return
        for req in itertools.islice(self.scheduler.waiting, max_requests):
            self.kv.prefetch(req)

    def _sample(self, logits: jax.Array, reqs: list[Request]) -> dict[str, list[int]]:
        """One token per request from logits whose first len(reqs) rows are theirs."""
        tokens = np.asarray(self._sample_on_device(logits, reqs, [r.num_output for r in reqs]))
        return {r.request_id: [int(t)] for r, t in zip(reqs, tokens)}

    def _sample_on_device(self, logits: jax.Array, reqs: list[Request], positions: list[int]) -> jax.Array:
        """Sampled tokens [B_bucket] on the device; positions[i]: the output index reqs[i]'s token will have
        (its seeded stream and min_tokens count by it)."""
        tensors = SamplingTensors.from_params(
            [r.sampling for r in reqs], positions=positions, seeds=[r.seed for r in reqs], pad_to=logits.shape[0],
            suppress_eos=[pos < r.sampling.min_tokens for r, pos in zip(reqs, positions)], eos_id=self.cfg.eos_token_id,
        )
        if self.sample_vocab_size is not None and self.sample_vocab_size < logits.shape[-1]:
            logits = logits[:, : self.sample_vocab_size]
        return sample(logits, tensors)

    # --- process -----------------------------------------------------------------------------
    def _process(self, sampled: dict[str, list[int]]) -> list[StepOutput]:
        """Appends each request's new tokens, stopping at the first that finishes it."""
        return [self.emit(self.requests[rid], tokens) for rid, tokens in sampled.items()]

    def emit(self, req: Request, tokens: list[int]) -> StepOutput:
        """Appends req's new tokens, stopping at the first that finishes it. A prefill-role worker stops
        every request after its first token ("length" unless it stopped anyway) and hands a paired one
        to its decode partner instead of freeing its state."""
        kept = []
        for token in tokens:
            req.output_ids.append(token)
            kept.append(token)
            reason = check_stop(req, self.cfg.eos_token_id, self.matchers.get(req.request_id))
            if reason is None and self.ecfg.role == "prefill":
                reason = "length"
            if reason is not None:
                if self.ecfg.role == "prefill" and req.bootstrap is not None:
                    self._finish(req, reason, release=False)
                    self.disagg.hold(req)
                else:
                    self._finish(req, reason)
                break
        self.counters["generation_tokens"] += len(kept)
        return StepOutput(req.request_id, kept, req.is_finished, req.finish_reason)

    def fail_request(self, req: Request, error: str) -> StepOutput:
        """Ends req with an error (its memory already freed by the caller)."""
        self.scheduler.remove(req)
        self.matchers.pop(req.request_id, None)
        req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
        req.finish_time = time.monotonic()
        self.counters["aborted"] += 1
        return StepOutput(req.request_id, [], True, "abort", error=error)

    def _finish(self, req: Request, reason: str, release: bool = True) -> None:
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        if release:
            self.kv.release(req, cache=True)
        self.scheduler.remove(req)
        self.matchers.pop(req.request_id, None)
        req.finish_time = time.monotonic()
        self.counters["finished"] += 1

    # --- drivers -----------------------------------------------------------------------------
    def run_until_done(self, request_ids: Sequence[str]) -> None:
        while not all(self.requests[r].is_finished for r in request_ids):
            if not self.step() and not self.has_work:
                raise RuntimeError("engine idle with unfinished requests")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, sessions: Sequence[str | None] | None = None) -> list[list[int]]:
        """Runs a batch of prompts to completion; returns each one's output token ids."""
        samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        sessions = sessions or [None] * len(prompts)
        ids = [self.add_request(p, s, session=sess) for p, s, sess in zip(prompts, samplings, sessions)]
        self.run_until_done(ids)
        return [list(self.requests.pop(r).output_ids) for r in ids]

    def stream(self, prompt: Sequence[int], sampling: SamplingParams | None = None, *,
               session: str | None = None) -> Iterator[list[int]]:
        """Yields the request's new tokens after every step that produced some."""
        rid = self.add_request(prompt, sampling, session=session)
        try:
            while not self.requests[rid].is_finished:
                for out in self.step():
                    if out.request_id == rid:
                        yield out.new_tokens
        finally:
            if not self.requests[rid].is_finished:
                self.abort(rid)
            self.requests.pop(rid, None)

    def reset_prefix_cache(self) -> int:
        """Drops every cache-only page and checkpoint on the device and empties the host tier (entries
        that running requests hold stay until they finish). Returns the number of device pages uncached."""
        removed = self.kv.prefix.clear() if self.ecfg.prefix_cache else 0
        if self.kv.store is not None:
            self.kv.store.clear()
        return removed

    # --- introspection -----------------------------------------------------------------------
    def stats(self) -> dict:
        prefix = self.kv.prefix.stats() if self.ecfg.prefix_cache else {}
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_usage": self.kv.usage(),
            "num_pages": self.runner.num_pages,
            "num_slots": self.runner.num_slots,
            "prefix_query_tokens": self.kv.query_tokens,
            "prefix_hit_tokens": self.kv.hit_tokens,
            "prefix_hit_tokens_host": self.kv.store_hit_tokens,
            "prefix_hit_tokens_by_tier": self._hits_by_tier(),
            "role": self.ecfg.role,
            "disagg": self._disagg_stats(),
            "swapped_requests": sum(1 for r in self.scheduler.waiting if r.swapped is not None),
            "swapped_bytes": self.kv.swapped_bytes,
            "timing": dict(self.timing),
            "spec_mean_acceptance_length": (
                (self.counters["spec_accepted_tokens"] + self.counters["spec_verifies"]) / self.counters["spec_verifies"]
                if self.counters["spec_verifies"] else None),
            "host_cache": self.kv.store.stats() if self.kv.store is not None else {},
            "prefix_cache": prefix,
            **self.counters,
        }

    def _hits_by_tier(self) -> dict[str, int]:
        """Prefix-hit tokens by the tier they came from: device, or a store tier (KVManager._count_tiers:
        "host" for the host L2, a shared pool's name from a tiered store or a store's `tier` attribute).
        Store tiers count the pages restored from them (a restore can exceed what admission then uses)."""
        return {"device": self.kv.hit_tokens - self.kv.store_hit_tokens, "host": 0, **self.kv.store_tokens_by_tier}

    def _disagg_stats(self) -> dict:
        d = self.disagg
        if d is None:
            return {}
        out = {**d.stats, "written_through_pages": self.kv.written_through_pages}
        if self.ecfg.role == "prefill":
            out.update(held=len(d.held), bootstrap_port=d.port)
        else:
            out.update(awaiting=len(d.awaiting), transferring=len(d.inflight))
        return out

    def close(self) -> None:
        """Stops the P/D transfer listener (if any)."""
        if self.disagg is not None:
            self.disagg.close()

    def check_integrity(self) -> None:
        """Allocator and prefix-cache invariants, plus: every page/slot held by a live request is
        referenced, and no page is owned by two live requests unless it is a shared cached page."""
        self.kv.check_integrity()
        owned: dict[int, str] = {}
        holding = []  # requests whose memory a P/D role holds outside the scheduler
        if self.ecfg.role == "prefill":
            holding = self.disagg.held_requests()
        elif self.ecfg.role == "decode":
            holding = self.disagg.reserved_requests()
        for req in [*self.scheduler.running, *holding]:
            shared = set(req.hit.pages) if req.hit else set()
            for p in req.pages:
                assert self.kv.pages.refcount(p) >= 1, f"{req.request_id} holds free page {p}"
                if p not in shared:
                    assert p not in owned, f"page {p} owned by {owned[p]} and {req.request_id}"
                    owned[p] = req.request_id
            assert self.kv.slots.refcount(req.slot) >= 1


def _resolve_drafter(cfg, ecfg: EngineConfig, drafter: tuple | None) -> tuple | None:
    """(DrafterConfig, params) to speculate with, or None; ValueError if the settings disagree."""
    if ecfg.speculative_k == 0:
        return None
    if drafter is None and ecfg.drafter:
        from k3jax.drafter import load_drafter

        target_cfg, dcfg, dparams = load_drafter(ecfg.drafter)
        if (target_cfg.vocab_size, target_cfg.hidden_size, target_cfg.num_layers) != (cfg.vocab_size, cfg.hidden_size, cfg.num_layers):
            raise ValueError(f"drafter {ecfg.drafter} was trained for a different target model")
        drafter = (dcfg, dparams)
    if drafter is None:
        raise ValueError("speculative_k > 0 needs a drafter: EngineConfig.drafter (a checkpoint) or Engine(drafter=...)")
    drafter[0].resolve(cfg)  # ValueError if it does not fit the target
    return drafter


def _serving_layout(params: dict, cfg) -> dict:
    """params with each layer's input projections fused (k3jax.fuse: fewer GEMM launches per step). The engine
    runs the model on one device (ModelRunner, jax.devices()[0]); params spread over several devices (sharded by
    a caller) keep their layout, as the fused concatenation would re-shard them."""
    from k3jax.fuse import fuse_for_serving

    if any(len(leaf.sharding.device_set) > 1 for leaf in jax.tree.leaves(params) if isinstance(leaf, jax.Array)):
        return params
    return fuse_for_serving(params, cfg)


def _load_weights(path: str):
    from pathlib import Path

    if (Path(path) / "config.json").exists() and any(Path(path).glob("*.safetensors")):
        return k3jax.load_pretrained(path)
    return k3jax.load_checkpoint(path)


def serve(model: str = EngineConfig.model, **engine_options) -> Engine:
    """Builds an engine for `model` (a preset, YAML or HF directory); options are EngineConfig fields."""
    return Engine(EngineConfig(model=model, **engine_options))
