"""The serving engine: one worker's loop, as named steps: receive -> schedule -> forward -> process.

    engine = k3jax.serve(model="k3-tiny")          # or Engine(EngineConfig(...))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
    for chunk in engine.stream([1, 2, 3], SamplingParams(max_tokens=8)): ...

The engine is single-threaded: `step()` runs one scheduled batch; `generate` / `stream` drive steps
until their requests finish. Requests are validated on entry (ValueError); a bad request never
touches the state. Memory lifecycle lives in `KVManager`, policy in `Scheduler`, device work in
`ModelRunner`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import k3jax
from k3jax.sampling import SamplingTensors, sample
from serving.cache.host_tier import HostStore
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
from serving.runner import ModelRunner, Row, pool_sizes
from serving.scheduler import Scheduler, StepPlan


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None


class Engine:
    def __init__(self, ecfg: EngineConfig | None = None, *, cfg=None, params=None, detokenize=None):
        """`detokenize(ids) -> str` enables stop strings (the API layer passes its tokenizer's)."""
        self.ecfg = ecfg = ecfg or EngineConfig()
        self.detokenize = detokenize
        self.matchers: dict[str, StopStringMatcher] = {}
        self.cfg = cfg or k3jax.load_config(ecfg.model)
        if params is None:
            if ecfg.weights:
                self.cfg, params = _load_weights(ecfg.weights)
            else:
                params = k3jax.init_params(self.cfg, jax.random.key(ecfg.seed))
        if ecfg.max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {ecfg.max_model_len} exceeds the model's {self.cfg.max_position_embeddings}")
        num_pages, num_slots = pool_sizes(self.cfg, ecfg, jax.devices()[0])
        self.runner = ModelRunner(self.cfg, ecfg, params, num_pages, num_slots)
        store = HostStore(ecfg.host_cache_gb) if ecfg.host_cache_gb > 0 else None
        self.kv = KVManager(self.runner, ecfg.page_size, ecfg.prefix_cache, store=store, session_ttl_s=ecfg.session_ttl_s)
        self.scheduler = Scheduler(ecfg, self.kv)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "steps": 0,
                         "finished": 0, "aborted": 0}

    # --- receive -----------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, *,
                    request_id: str | None = None, session: str | None = None) -> str:
        """Validates and queues a request; returns its id. Raises ValueError for a bad request."""
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
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.counters["prompt_tokens"] += len(req.prompt_ids)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stops a request at any point and frees its memory. False if it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        if req.status == RequestStatus.RUNNING:
            self.kv.release(req, cache=False)
        self.scheduler.remove(req)
        self.matchers.pop(request_id, None)
        req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
        self.counters["aborted"] += 1
        return True

    # --- one step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        self.counters["preemptions"] += len(plan.preempted)
        if plan.empty:
            return []
        self.counters["steps"] += 1
        sampled: dict[str, int] = {}
        if plan.prefill:
            sampled.update(self._forward_prefill(plan))
        if plan.decode:
            sampled.update(self._forward_decode(plan))
        return self._process(plan, sampled)

    def _forward_prefill(self, plan: StepPlan) -> dict[str, int]:
        rows, done = [], []
        for req, n in plan.prefill:
            start = req.num_computed_tokens
            rows.append(Row(req.slot, req.pages, start, list(req.all_ids[start : start + n])))
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                done.append(len(rows) - 1)
        logits = self.runner.prefill(rows)
        for req, _ in plan.prefill:
            self.kv.maybe_checkpoint(req)
        reqs = [plan.prefill[i][0] for i in done]
        return self._sample(logits, done, reqs)

    def _forward_decode(self, plan: StepPlan) -> dict[str, int]:
        rows = [Row(r.slot, r.pages, r.num_computed_tokens, [r.all_ids[-1]]) for r in plan.decode]
        logits = self.runner.decode(rows)
        for req in plan.decode:
            req.num_computed_tokens += 1
            self.kv.maybe_checkpoint(req)
        return self._sample(logits, list(range(len(rows))), plan.decode)

    def _sample(self, logits: jax.Array, row_ids: list[int], reqs: list[Request]) -> dict[str, int]:
        if not reqs:
            return {}
        picked = logits[jnp.asarray(row_ids)]
        tensors = SamplingTensors.from_params(
            [r.sampling for r in reqs], positions=[r.num_output for r in reqs],
            seeds=[r.seed for r in reqs], pad_to=picked.shape[0],
            suppress_eos=[r.num_output < r.sampling.min_tokens for r in reqs], eos_id=self.cfg.eos_token_id,
        )
        tokens = np.asarray(sample(picked, tensors))
        return {r.request_id: int(t) for r, t in zip(reqs, tokens)}

    # --- process -----------------------------------------------------------------------------
    def _process(self, plan: StepPlan, sampled: dict[str, int]) -> list[StepOutput]:
        outputs = []
        for rid, token in sampled.items():
            req = self.requests[rid]
            req.output_ids.append(token)
            self.counters["generation_tokens"] += 1
            reason = check_stop(req, self.cfg.eos_token_id, self.matchers.get(rid))
            if reason is not None:
                self._finish(req, reason)
            outputs.append(StepOutput(rid, [token], req.is_finished, req.finish_reason))
        return outputs

    def _finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        self.kv.release(req, cache=True)
        self.scheduler.remove(req)
        self.matchers.pop(req.request_id, None)
        req.finish_time = time.monotonic()
        self.counters["finished"] += 1

    # --- drivers -----------------------------------------------------------------------------
    def run_until_done(self, request_ids: Sequence[str]) -> None:
        while not all(self.requests[r].is_finished for r in request_ids):
            if not self.step() and not self.scheduler.has_work:
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
            "host_cache": self.kv.store.stats() if self.kv.store is not None else {},
            "prefix_cache": prefix,
            **self.counters,
        }

    def check_integrity(self) -> None:
        """Allocator and prefix-cache invariants, plus: every page/slot held by a live request is
        referenced, and no page is owned by two live requests unless it is a shared cached page."""
        self.kv.check_integrity()
        owned: dict[int, str] = {}
        for req in self.scheduler.running:
            shared = set(req.hit.pages) if req.hit else set()
            for p in req.pages:
                assert self.kv.pages.refcount(p) >= 1, f"{req.request_id} holds free page {p}"
                if p not in shared:
                    assert p not in owned, f"page {p} owned by {owned[p]} and {req.request_id}"
                    owned[p] = req.request_id
            assert self.kv.slots.refcount(req.slot) >= 1


def _load_weights(path: str):
    from pathlib import Path

    if (Path(path) / "config.json").exists() and any(Path(path).glob("*.safetensors")):
        return k3jax.load_pretrained(path)
    return k3jax.load_checkpoint(path)


def serve(model: str = EngineConfig.model, **engine_options) -> Engine:
    """Builds an engine for `model` (a preset, YAML or HF directory); options are EngineConfig fields."""
    return Engine(EngineConfig(model=model, **engine_options))
