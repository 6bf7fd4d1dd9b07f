"""OpenAI-compatible HTTP server (FastAPI on uvicorn) over an AsyncEngine.

Routes: POST /v1/completions, /v1/chat/completions (JSON or SSE streams with an optional final usage
chunk), GET /v1/models, /health, /version, /metrics, POST /v1/tokenize, /v1/detokenize,
/reset_prefix_cache (alias /flush_cache). Errors are OpenAI-style bodies: 400 for bad input (malformed
JSON, unknown model, bad fields, context overflow with "maximum context length", oversize bodies),
401 for a wrong API key, 503 when the engine is full or draining. A streaming client that disconnects
has its request aborted (Starlette cancels the response, whose `finally` aborts); so does a
non-streaming one (watched with `request.is_disconnected`).

Chat rendering and tokenization run on a small thread pool, not on the event loop that streams every
request's tokens: a coding agent's 100k-token history takes a BPE tokenizer about half a second to encode
(on a 2-core CPU), which on the loop was an inter-token-latency spike for every live stream. Encoding
releases the GIL (serving/api/tokenizer.py), and a chat prompt is tokenized once: its cache boundaries are
counted on the way (`Tokenizer.encode_with_prefix_counts`) instead of encoding the prompt's prefixes again.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api.metrics import CONTENT_TYPE
from serving.api.protocol import (
    APIError,
    chat_messages,
    chat_template_args,
    check_unsupported,
    completion_prompt,
    sampling_params,
    stream_options,
)
from serving.api.tokenizer import TextStream
from serving.async_engine import EngineError, EngineOverloaded, EngineStopped, RequestHandle

# Endpoints a configured API key protects (vLLM protects /v1; we add the admin routes).
PROTECTED_PREFIXES = ("/v1/", "/reset_prefix_cache", "/flush_cache")
DISCONNECT_POLL_S = 0.25
# Threads that render and tokenize prompts. Encoding releases the GIL, so each runs on its own core; more
# would compete with the engine thread for the host's cores and gain nothing for one request (a prompt is
# tokenized by one thread), while queued requests wait their turn instead of all slowing down at once.
TOKENIZE_THREADS = 4


def build_app(state) -> FastAPI:
    """state: serving.api.server.ServerState (engine, tokenizer, metrics, config)."""
    app = FastAPI(title="k3jax", docs_url=None, redoc_url=None, openapi_url=None)
    cfg = state.config
    # idle workers end with the interpreter (concurrent.futures joins them at exit); none start before a request
    app.state.tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="k3jax-tokenize")

    async def off_loop(fn, *args):
        """fn(*args) on the tokenize pool; its APIError reaches the handler below as if raised here."""
        return await asyncio.get_running_loop().run_in_executor(app.state.tokenize_pool, fn, *args)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        if cfg.api_key and path.startswith(PROTECTED_PREFIXES):
            if request.headers.get("authorization", "") != f"Bearer {cfg.api_key}":
                return _error(APIError("invalid or missing API key (send 'Authorization: Bearer <key>')",
                                       status=401, type="authentication_error", code="invalid_api_key"))
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
            return _error(_too_large(cfg.max_body_bytes))
        response = await call_next(request)
        route = request.scope.get("route")
        handler = getattr(route, "path", "unmatched")
        state.metrics.http_requests.labels(handler, request.method, str(response.status_code)).inc()
        return response

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(APIError(str(exc.detail), status=exc.status_code, type=kind))

    # --- info --------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        ok, message = state.engine.health()
        return JSONResponse({"status": "ok" if ok else "unhealthy", "message": message}, status_code=200 if ok else 503)

    @app.get("/version")
    async def version():
        return {"version": state.version}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(state.engine.started_at),
            # "vllm": SMG and other routers then read our vLLM-named /metrics for load
            "owned_by": "vllm", "root": state.model_path, "parent": None,
            "max_model_len": state.engine.max_model_len,
        }]}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    # --- tokenizer ---------------------------------------------------------------------------
    @app.post("/v1/tokenize")
    async def tokenize(request: Request):
        body = await _read_json(request, cfg.max_body_bytes)
        _check_model(state, body)
        add_special = body.get("add_special_tokens", "messages" not in body)
        if "messages" not in body and not isinstance(body.get("prompt"), str):
            raise APIError("give 'prompt' (a string) or 'messages'", param="prompt")

        def tokenize_body():
            text = _render_chat(state, body) if "messages" in body else body["prompt"]
            return state.tokenizer.encode(text, add_special_tokens=bool(add_special))

        ids = await off_loop(tokenize_body)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len}

    @app.post("/v1/detokenize")
    async def detokenize(request: Request):
        body = await _read_json(request, cfg.max_body_bytes)
        _check_model(state, body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise APIError("'tokens' must be a list of integers", param="tokens")
        try:
            return {"prompt": state.tokenizer.decode(tokens)}
        except ValueError as e:
            raise APIError(str(e), param="tokens") from None

    # --- admin -------------------------------------------------------------------------------
    async def reset_prefix_cache():
        try:
            pages = await asyncio.wrap_future(state.engine.reset_prefix_cache(timeout=cfg.reset_timeout_s))
        except TimeoutError as e:
            raise APIError(f"prefix cache not reset: {e}", status=503, type="server_error") from None
        return {"success": True, "pages_freed": pages}

    app.post("/reset_prefix_cache")(reset_prefix_cache)
    app.post("/flush_cache")(reset_prefix_cache)

    # --- generation --------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _read_json(request, cfg.max_body_bytes)
        _check_model(state, body)
        check_unsupported(body)
        stream, include_usage, continuous = stream_options(body)
        prompt_ids, _ = await off_loop(completion_prompt, body, state.tokenizer)
        sampling = sampling_params(body, len(prompt_ids), state.engine.max_model_len, chat=False)
        handle = await _submit(state, prompt_ids, sampling, request, "cmpl", cache_boundaries=_cache_boundaries(body))
        rid = f"cmpl-{handle.request_id}"
        base = {"id": rid, "object": "text_completion", "created": int(handle.created), "model": state.model_name}

        def choice(text, reason):
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

        if stream:
            return _sse(_stream_events(state, handle, request, base, choice, include_usage, continuous, None))
        text, reason = await _collect(state, handle, request)
        return {**base, "choices": [choice(text, reason)], "usage": _usage(handle)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _read_json(request, cfg.max_body_bytes)
        _check_model(state, body)
        check_unsupported(body)
        stream, include_usage, continuous = stream_options(body)
        prompt_ids, cache_boundaries = await off_loop(_tokenize_chat, state, body)
        sampling = sampling_params(body, len(prompt_ids), state.engine.max_model_len, chat=True,
                                   default_max_tokens=None)
        handle = await _submit(state, prompt_ids, sampling, request, "chatcmpl", cache_boundaries=cache_boundaries)
        base = {"id": f"chatcmpl-{handle.request_id}", "object": "chat.completion", "created": int(handle.created),
                "model": state.model_name}
        if stream:
            chunk_base = {**base, "object": "chat.completion.chunk"}

            def delta(text, reason):
                return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": reason}

            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            return _sse(_stream_events(state, handle, request, chunk_base, delta, include_usage, continuous, first))
        text, reason = await _collect(state, handle, request)
        message = {"role": "assistant", "content": text}
        return {**base, "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
                "usage": _usage(handle)}

    return app


# ------------------------------------------------------------------------------------------------ helpers


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _too_large(limit: int) -> APIError:
    # the acceptance asks for a 400 (not 413) with an OpenAI-style body for oversize requests
    return APIError(f"request body exceeds the limit of {limit} bytes", code="request_too_large")


async def _read_json(request: Request, limit: int) -> dict:
    size, parts = 0, []
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        parts.append(part)
    try:
        body = json.loads(b"".join(parts))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object", code="invalid_json")
    return body


def _check_model(state, body: dict) -> None:
    model = body.get("model")
    if model is not None and model not in state.model_aliases:
        raise APIError(f"The model '{model}' does not exist (this server serves '{state.model_name}')",
                       param="model", code="model_not_found")


def _render_chat(state, body: dict) -> str:
    messages = chat_messages(body)
    try:
        return state.tokenizer.apply_chat_template(messages, **chat_template_args(body))
    except ValueError as e:
        raise APIError(str(e), param="messages") from None


def _cache_boundaries(body: dict) -> tuple[int, ...]:
    """k3jax extension `cache_boundaries`: prompt token positions where a prefix that other requests share
    ends (e.g. a system prompt); the engine checkpoints there so they can resume from it."""
    value = body.get("cache_boundaries", [])
    if not isinstance(value, list) or any(not isinstance(b, int) or isinstance(b, bool) for b in value):
        raise APIError("'cache_boundaries' must be a list of token positions (ints)", param="cache_boundaries")
    return tuple(value)


def _tokenize_chat(state, body: dict) -> tuple[list[int], tuple[int, ...]]:
    """A chat request's prompt ids and cache boundaries (the token counts of `_chat_cache_prefix_ends`'
    prefixes), tokenizing the rendered prompt once: those prefixes end at special tokens (the template's
    end-of-message or start-of-message token), where `encode_with_prefix_counts` cuts the text into pieces
    and counts their tokens on the way. Blocking (the template and a long encode): the handler runs it on
    the tokenize pool."""
    text = _render_chat(state, body)
    prompt_ids, counts = state.tokenizer.encode_with_prefix_counts(text, _chat_cache_prefix_ends(state, body, text))
    return prompt_ids, tuple(sorted(set(counts)))


def _chat_cache_prefix_ends(state, body: dict, text: str) -> list[int]:
    """Where the rendered prompt `text`'s shareable prefixes end (character offsets; their token counts are
    the request's cache boundaries), for the engine to checkpoint there (a hybrid model resumes only at a KDA
    checkpoint, so a prefix needs one at its end):
    - the leading system/developer messages: conversations sharing the system prompt (subagents, new
      sessions of one agent) reuse it, not only continuations of the same conversation;
    - the conversation before the generation prompt: a next request that renders this history the same
      way but continues it differently (its next turn as a user message, as AIPerf's weka replay sends it,
      or a template that re-renders the last assistant turn) still resumes there, not at an older
      checkpoint. A continuation of the whole prompt resumes at the prompt's own end as before;
    - the conversation before its last message: a next request that rewrites that message (an agent that
      trims a long tool result or its own last turn; AIPerf's weka replay, which replaces a turn's partial
      last block) resumes there instead of falling back to the system prompt.
    Each counts only when the full prompt starts with that rendering."""
    messages = chat_messages(body)
    kwargs = {**chat_template_args(body), "add_generation_prompt": False}
    n = 0
    while n < len(messages) and messages[n].get("role") in ("system", "developer"):
        n += 1
    out = []
    before_last = messages[:-1] if len(messages) - 1 > n else None
    for head_messages in ((messages[:n] if 0 < n < len(messages) else None), before_last, messages):
        if not head_messages:
            continue
        try:
            head = state.tokenizer.apply_chat_template(head_messages, **kwargs)
        except ValueError:
            continue
        if head and text.startswith(head) and len(head) < len(text):
            out.append(len(head))
    return out


async def _submit(state, prompt_ids, sampling, request: Request, kind: str,
                  cache_boundaries: tuple[int, ...] = ()) -> RequestHandle:
    session = request.headers.get("x-session-id") or request.headers.get("x-correlation-id")
    try:
        handle = await state.engine.submit(prompt_ids, sampling, request_id=f"{uuid.uuid4().hex[:24]}",
                                           session=session, cache_boundaries=cache_boundaries)
    except ValueError as e:
        message = str(e)
        if "max_model_len" in message:
            message = f"This model's maximum context length is {state.engine.max_model_len} tokens: {message}"
            raise APIError(message, code="context_length_exceeded") from None
        raise APIError(message) from None
    except EngineOverloaded as e:
        raise APIError(f"server overloaded: {e}", status=503, type="server_error", code="overloaded",
                       headers={"Retry-After": "1"}) from None
    except EngineStopped as e:
        raise APIError(str(e), status=503, type="server_error", code="unavailable") from None
    handle.context["stop"] = sampling.stop
    return handle


def _usage(handle: RequestHandle) -> dict:
    prompt, completion = len(handle.prompt_ids), len(handle.output_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": handle.cached_tokens}}


async def _collect(state, handle: RequestHandle, request: Request) -> tuple[str, str]:
    """Runs a non-streaming request to the end (aborting it if the client goes away)."""
    text = TextStream(state.tokenizer, handle.context.get("stop", ()))

    async def consume():
        async for chunk in handle:
            text.push(chunk.token_ids)

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                handle.abort()
        await task
    except EngineError as e:
        raise APIError(str(e), status=500, type="server_error") from None
    finally:
        if not handle.finished:
            handle.abort()
        task.cancel()
    text.push([])
    return text.text + text.finish(), handle.finish_reason


def _sse(events: AsyncIterator[dict | str]) -> StreamingResponse:
    async def body():
        async for event in events:
            data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
            yield f"data: {data}\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream_events(state, handle: RequestHandle, request: Request, base: dict, choice, include_usage: bool,
                         continuous: bool, first: dict | None):
    """SSE payloads of one streamed request; closing the stream early (client gone) aborts it."""
    text = TextStream(state.tokenizer, handle.context.get("stop", ()))
    try:
        if first is not None:
            yield {**base, "choices": [first], **({"usage": _usage(handle)} if continuous else {})}
        async for chunk in handle:
            if chunk.finished:
                piece = text.push(chunk.token_ids) + text.finish()
                event = {**base, "choices": [choice(piece, chunk.finish_reason)]}
            else:
                piece = text.push(chunk.token_ids)
                if not piece:
                    continue
                event = {**base, "choices": [choice(piece, None)]}
            if continuous:
                event["usage"] = _usage(handle)
            yield event
        if include_usage:
            yield {**base, "choices": [], "usage": _usage(handle)}
        yield "[DONE]"
    except EngineError as e:
        yield {"error": {"message": str(e), "type": "server_error", "param": None, "code": None}}
    finally:
        if not handle.finished:
            handle.abort()


__all__ = ["build_app"]
