"""Request state: sampling parameters, the mutable per-request record, prompt validation and stop checks.

    SamplingParams        frozen, validated at construction (ValueError names the field, value and range)
    Request               one request's ids, lengths and status; the engine owns slot / pages
    validate_prompt       ValueError for prompts the model cannot take
    StopStringMatcher     incremental detokenisation + stop-string search over the growing output
    check_stop            the finish reason after a token was appended, or None

Lengths of a Request (prefixes of all_ids = prompt_ids + output_ids), as in vLLM:

    0 <= num_cached_tokens <= num_computed_tokens <= num_tokens
    num_cached_tokens:   found on device at admission (prefix-cache hit); reported as cached tokens
    num_computed_tokens: KV / recurrent state on device: the hit plus what the model has computed
    (overlap scheduling, serving.engine: while a decode step is dispatched before the previous one's token is
    read back, num_computed_tokens leads num_tokens by that one token in flight)
"""

from __future__ import annotations

import enum
import hashlib
import math
import numbers
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3jax.sampling import fold_seed

FINISH_REASONS = ("stop", "length", "abort")


def _fail(name: str, value, allowed: str) -> None:
    raise ValueError(f"{name}={value!r} is invalid: must be {allowed}")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. top_k -1 is normalised to 0 (off); a str `stop` becomes a 1-tuple.

    min_tokens: eos and stop_token_ids are neither sampled (the sampler bans them) nor honoured
    until this many tokens were generated. Stop strings are matched on text by StopStringMatcher.
    seed None: derived from the request id (Request.seed).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            _fail("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        set_("temperature", float(self.temperature))
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", self.top_k, "an int >= 0, or -1 (0 and -1 disable top-k)")
        set_("top_k", max(int(self.top_k), 0))
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "a number in (0, 1] (1 disables top-p)")
        set_("top_p", float(self.top_p))
        if not _is_real(self.min_p) or not 0.0 <= self.min_p < 1.0:
            _fail("min_p", self.min_p, "a number in [0, 1) (0 disables min-p)")
        set_("min_p", float(self.min_p))
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", self.seed, "an int or None")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "an int >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"an int in [0, max_tokens={self.max_tokens}]")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            _fail("stop_token_ids", self.stop_token_ids, "a sequence of ints >= 0")
        ids = tuple(self.stop_token_ids)
        for t in ids:
            if not _is_int(t) or t < 0:
                _fail("stop_token_ids", ids, f"a sequence of ints >= 0 (bad entry {t!r})")
        set_("stop_token_ids", tuple(int(t) for t in ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Iterable):
            _fail("stop", self.stop, "a str or a sequence of non-empty str")
        stop = tuple(stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                _fail("stop", stop, f"a sequence of non-empty str (bad entry {s!r})")
        set_("stop", stop)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "a bool")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Checks that depend on the model: stop_token_ids must be in [0, vocab_size)."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                _fail("stop_token_ids", self.stop_token_ids, f"ids in [0, vocab_size={vocab_size}) (bad entry {t})")


def validate_prompt(
    prompt_ids: Sequence[int], vocab_size: int, max_model_len: int, max_tokens: int = 0
) -> tuple[int, ...]:
    """The prompt as a tuple of ints; ValueError if it is empty, has non-int ids or ids outside
    [0, vocab_size), or if len(prompt_ids) + max_tokens exceeds max_model_len."""
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Iterable):
        raise ValueError(f"prompt_ids must be a sequence of ints, got {type(prompt_ids).__name__}")
    ids = tuple(prompt_ids)
    if not ids:
        raise ValueError("prompt_ids is empty: a prompt needs at least one token")
    # Plain ints (what tokenizers and JSON give) are checked at C speed: this runs on the server's event loop,
    # where the per-id loop below took ~0.18 s for a 120k-token agent history; anything else takes that loop.
    plain = set(map(type, ids)) == {int}
    if not plain or min(ids) < 0 or max(ids) >= vocab_size:
        for i, t in enumerate(ids):
            if not _is_int(t):
                raise ValueError(f"prompt_ids[{i}]={t!r} is invalid: must be an int")
            if not 0 <= t < vocab_size:
                raise ValueError(f"prompt_ids[{i}]={t} is invalid: must be in [0, vocab_size={vocab_size})")
    if len(ids) + max_tokens > max_model_len:
        raise ValueError(
            f"prompt length {len(ids)} + max_tokens {max_tokens} = {len(ids) + max_tokens} "
            f"exceeds max_model_len={max_model_len}"
        )
    return ids if plain else tuple(int(t) for t in ids)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


def derive_seed(request_id: str) -> int:
    """A uint32 seed from the request id (stable across processes, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")


@dataclass(eq=False)
class Request:
    """One request. The scheduler/engine mutate the state fields; `slot` and `pages` are engine-owned."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session: str | None = None  # agent session id, for cache policy
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    finish_time: float | None = None
    # Engine-owned placement (serving.kv_manager): KDA slot, MLA pages, prefix hit, KDA checkpoint.
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    hit: Any = None
    # KDA checkpoints as (computed length, slot): at most two -- the prompt's last page boundary and
    # the latest page boundary reached while decoding (overwritten as decoding moves on)
    checkpoints: list = field(default_factory=list)
    prompt_boundary: int = 0
    cache_boundaries: list[int] = field(default_factory=list)  # page-aligned shared-prefix ends (checkpointed)
    num_preemptions: int = 0
    # Speculative decoding (serving.spec_decode): the tokens after the positions the drafter has not yet
    # caught up on (their target features wait in the runner's pending buffer at this request's slot)
    spec_pending: list[int] = field(default_factory=list)
    # Swap preemption (serving.kv_manager.SwappedState): the request's state while it sits on the host
    swapped: Any = None
    # Host-tier prefetch while waiting: (device hit tokens before it, hit tokens after it), for attribution
    host_prefetch: tuple[int, int] | None = None
    # Disaggregated prefill/decode (serving.disagg.roles.Bootstrap): the room pairing its two legs, or None
    bootstrap: Any = None

    def __post_init__(self):
        self.prompt_ids = tuple(self.prompt_ids)
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        assert 0 <= self.num_cached_tokens <= self.num_computed_tokens <= self.num_tokens, (
            self.num_cached_tokens, self.num_computed_tokens, self.num_tokens)

    def validate(self, vocab_size: int, max_model_len: int) -> None:
        """validate_prompt with this request's max_tokens, and SamplingParams.validate."""
        validate_prompt(self.prompt_ids, vocab_size, max_model_len, self.sampling.max_tokens)
        self.sampling.validate(vocab_size)

    @property
    def seed(self) -> int:
        """uint32 seed of the sampler: sampling.seed folded to 32 bits, or derived from request_id."""
        s = self.sampling.seed
        return derive_seed(self.request_id) if s is None else fold_seed(s)

    @property
    def all_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def ids_slice(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (long histories, every step)."""
        n = len(self.prompt_ids)
        if stop <= n:
            return list(self.prompt_ids[start:stop])
        return list(self.prompt_ids[start:]) + self.output_ids[max(start - n, 0) : stop - n]

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_prompt(self) -> int:
        """Prompt tokens not computed yet (what prefill still has to do)."""
        return max(len(self.prompt_ids) - self.num_computed_tokens, 0)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason {reason!r} is invalid: must be one of {FINISH_REASONS}")
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.monotonic()


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    offset: int  # char offset of the match in the output text; the text is cut there


class StopStringMatcher:
    """Incremental detokenisation of one request's output, searching for stop strings.

    `update(output_ids)` takes the whole growing output each time (only new ids are decoded, with vLLM's
    prefix/read offsets so multi-token characters and leading spaces come out right) and returns a
    StopMatch the first time a stop string appears. `text` is then cut before the stop string, as vLLM
    does; output ids are not truncated. The detokenizer must be deterministic on id lists.
    """

    def __init__(self, stop: Sequence[str], detokenize: Callable[[list[int]], str]):
        if isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={tuple(stop)!r} is invalid: must be non-empty str")
        self.stop = tuple(stop)
        self._detokenize = detokenize
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] is context already emitted as text
        self._read_offset = 0
        self._text = ""
        self._searched = 0  # matches ending at or before this char offset were ruled out
        self.match: StopMatch | None = None

    @property
    def text(self) -> str:
        return self._text if self.match is None else self._text[: self.match.offset]

    def final_text(self) -> str:
        """`text`, plus any tail held back as an incomplete character (for the last response)."""
        if self.match is not None:
            return self.text
        prefix = self._detokenize(self._ids[self._prefix_offset:self._read_offset])
        full = self._detokenize(self._ids[self._prefix_offset:])
        return self._text + full[len(prefix):]

    def update(self, output_ids: Sequence[int], check: bool = True) -> StopMatch | None:
        """Feed the output so far; returns a new StopMatch or None. check=False (e.g. under min_tokens)
        advances the text but ignores stop strings that end within it."""
        if self.match is not None:
            return None
        n = len(self._ids)
        if len(output_ids) < n or (n and output_ids[n - 1] != self._ids[-1]):  # O(1): a cheap sanity check
            raise ValueError("update: output_ids must extend the ids given before")
        self._ids.extend(int(t) for t in output_ids[len(self._ids):])
        prefix = self._detokenize(self._ids[self._prefix_offset:self._read_offset])
        full = self._detokenize(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):  # else wait: incomplete character
            self._text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if not check:
            self._searched = len(self._text)
            return None
        # A match must end past _searched; starting each search there keeps earlier (ruled out) hits away.
        hits = [(i, s) for s in self.stop if (i := self._text.find(s, max(self._searched - len(s) + 1, 0))) >= 0]
        self._searched = len(self._text)
        if not hits:
            return None
        offset, stop = min(hits)
        self.match = StopMatch(stop, offset)
        return self.match


def check_stop(
    request: Request, eos_id: int | Iterable[int] | None, matcher: StopStringMatcher | None = None
) -> str | None:
    """Finish reason after request.output_ids[-1] was appended, or None; does not change the request.

    Precedence: eos (unless ignore_eos), stop_token_ids, stop strings ("stop"), then max_tokens
    ("length"). eos, stop ids and stop strings count only once num_output >= min_tokens (vLLM). Pass
    the request's matcher on every call when it has stop strings, so its text keeps up.
    """
    sp = request.sampling
    n = request.num_output
    if n == 0:
        return None
    can_stop = n >= sp.min_tokens
    last = request.output_ids[-1]
    eos = () if eos_id is None else ((eos_id,) if _is_int(eos_id) else tuple(eos_id))
    if can_stop and not sp.ignore_eos and last in eos:
        return "stop"
    if can_stop and last in sp.stop_token_ids:
        return "stop"
    if sp.stop:
        if matcher is None:
            raise ValueError(f"request {request.request_id!r} has stop strings {sp.stop}: check_stop needs its matcher")
        if matcher.match is not None or matcher.update(request.output_ids, check=can_stop) is not None:
            return "stop"
    if n >= sp.max_tokens:
        return "length"
    return None
