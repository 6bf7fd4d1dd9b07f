"""OpenAI request bodies -> (prompt ids, SamplingParams); OpenAI-style errors.

Everything a client can get wrong raises `APIError` (HTTP 400 unless said otherwise) with a message
naming the field, so the HTTP layer answers `{"error": {"message", "type", "param", "code"}}`.
Supported: the OpenAI fields that change what a single sample looks like (max_tokens /
max_completion_tokens, temperature, top_p, seed, stop, stream, stream_options) plus the vLLM/SGLang
extensions ignore_eos, min_tokens, top_k, min_p, stop_token_ids. Fields we cannot honour (n > 1, logprobs,
penalties, response_format other than text, echo) are refused with a clear message, never ignored.
"""

from __future__ import annotations

import math
import numbers

from serving.request import SamplingParams


class APIError(Exception):
    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _int(body: dict, name: str, lo: int | None = None, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, numbers.Integral) or isinstance(v, bool):
        raise APIError(f"'{name}' must be an integer, got {v!r}", param=name)
    if lo is not None and v < lo:
        raise APIError(f"'{name}' must be >= {lo}, got {v}", param=name)
    return int(v)


def _float(body: dict, name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
        raise APIError(f"'{name}' must be a finite number, got {v!r}", param=name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(f"'{name}' must be a boolean, got {v!r}", param=name)
    return v


def check_unsupported(body: dict) -> None:
    n = _int(body, "n", 1, 1)
    if n != 1:
        raise APIError(f"'n'={n} is not supported: this server returns one choice per request", param="n")
    for name in ("logprobs", "top_logprobs", "echo"):
        v = body.get(name)
        if v not in (None, False, 0):
            raise APIError(f"'{name}' is not supported by this server", param=name)
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if _float(body, name, neutral) != neutral:
            raise APIError(f"'{name}' is not supported by this server (only its neutral value {neutral})", param=name)
    if body.get("logit_bias"):
        raise APIError("'logit_bias' is not supported by this server", param="logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
        raise APIError("'response_format' other than {'type': 'text'} is not supported", param="response_format")


def stream_options(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False, False
    if not isinstance(opts, dict):
        raise APIError("'stream_options' must be an object", param="stream_options")
    if not stream:
        raise APIError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    return stream, _bool(opts, "include_usage"), _bool(opts, "continuous_usage_stats")


def sampling_params(body: dict, prompt_len: int, max_model_len: int, *, chat: bool,
                    default_max_tokens: int | None = 16) -> SamplingParams:
    """SamplingParams from a request body. `default_max_tokens` None means "the rest of the context"."""
    if chat:
        max_tokens = _int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", 1)
    else:
        max_tokens = _int(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else max_model_len - prompt_len
    if prompt_len + max(max_tokens, 1) > max_model_len or prompt_len >= max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the length of the prompt or the completion.",
            param="messages" if chat else "prompt", code="context_length_exceeded")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(s for s in stop if s)
    else:
        raise APIError(f"'stop' must be a string or a list of strings, got {stop!r}", param="stop")
    stop_ids = body.get("stop_token_ids") or ()
    if not isinstance(stop_ids, (list, tuple)):
        raise APIError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    top_k = _int(body, "top_k", -1, 0)
    try:
        return SamplingParams(
            temperature=_float(body, "temperature", 1.0),
            top_p=_float(body, "top_p", 1.0),
            top_k=top_k,
            min_p=_float(body, "min_p", 0.0),
            seed=_int(body, "seed"),
            max_tokens=max_tokens,
            min_tokens=_int(body, "min_tokens", 0, 0),
            stop=stop,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=_bool(body, "ignore_eos"),
        )
    except ValueError as e:  # SamplingParams names the field and its allowed range
        raise APIError(str(e)) from None


def chat_messages(body: dict) -> list[dict]:
    """Messages normalised for the template: content parts of type text are joined to one string."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(f"messages[{i}]: only text content parts are supported", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise APIError(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({**m, "content": content})
    return out


RESERVED_TEMPLATE_ARGS = ("messages", "bos_token", "eos_token")  # the renderer sets these itself


def chat_template_args(body: dict) -> dict:
    """Keyword arguments of the chat template for a request: add_generation_prompt (default true) and tools
    from the body, then `chat_template_kwargs` on top (vLLM's precedence: a client may set either name there
    too, e.g. a model's `thinking` switch). The renderer's own variables cannot be overridden."""
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise APIError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    clash = sorted(set(extra) & set(RESERVED_TEMPLATE_ARGS))
    if clash:
        raise APIError(f"'chat_template_kwargs' cannot set {clash}: the server renders those itself",
                       param="chat_template_kwargs")
    return {"add_generation_prompt": body.get("add_generation_prompt", True), "tools": body.get("tools"), **extra}


def completion_prompt(body: dict, tokenizer) -> tuple[list[int], str | None]:
    """(prompt ids, prompt text or None) of /v1/completions: a string, token ids, or a one-element list."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("'prompt' is empty", param="prompt")
        return tokenizer.encode(prompt), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        for t in prompt:
            if not 0 <= t < tokenizer.vocab_size:
                raise APIError(f"prompt token id {t} is outside the vocabulary [0, {tokenizer.vocab_size})",
                               param="prompt")
        return list(prompt), None
    if isinstance(prompt, list) and len(prompt) > 1:
        raise APIError("batched prompts are not supported: send one prompt per request", param="prompt")
    raise APIError("'prompt' must be a non-empty string or a list of token ids", param="prompt")


__all__ = ["APIError", "chat_messages", "check_unsupported", "completion_prompt", "sampling_params", "stream_options"]
