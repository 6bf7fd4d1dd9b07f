"""gRPC worker mode: the SGLang scheduler service of `smg-grpc-proto` (sglang.grpc.scheduler.SglangScheduler),
so the SMG gateway drives this worker as an SGLang one (it tokenizes; we take and return token ids).

Implemented: Generate (server-streaming; `stream` true: one GenerateStreamChunk per engine step, then
a GenerateComplete carrying the last step's ids as SGLang does; false: one GenerateComplete with every
output id), HealthCheck, Abort, GetModelInfo, GetServerInfo, GetLoads, FlushCache, SubscribeKvEvents
(serving.api.kv_events), GetTokenizer (the tokenizer directory as a zip). Others answer UNIMPLEMENTED.

Errors are status codes: INVALID_ARGUMENT for a bad request (the message names the field),
RESOURCE_EXHAUSTED when the engine is full, UNAVAILABLE while draining, INTERNAL for engine failures.
proto3 zeros are not semantic defaults: top_p 0 means 1, top_k 0 or -1 means off, repetition_penalty 0
means 1, an unset max_new_tokens means the rest of the context.

DisaggregatedParams (SMG's SGLang PD mode sends the same GenerateRequest to both legs): bootstrap
host/port/room are validated and passed to the engine (`handle.context["disaggregation"]`). A
`prefill` worker computes the prompt, answers with the first token (finish_reason "length" unless it
stopped) and holds the KV for the decode worker that pulls the room from its bootstrap port
(serving.disagg); a `decode` worker pulls it and streams the output, the first token included. Without
bootstrap fields a decode worker serves the request whole and a prefill worker stops after one token.
max_new_tokens is validated as asked on both legs.
"""

from __future__ import annotations

import hashlib
import io
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf import struct_pb2
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2 as pb, sglang_scheduler_pb2_grpc as pb_grpc

from serving.async_engine import EngineError, EngineOverloaded, EngineStopped
from serving.request import SamplingParams

TOKENIZER_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Disaggregation:
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int


class _Invalid(Exception):
    pass


def sampling_from_proto(sp, prompt_len: int, max_model_len: int, *, role: str) -> SamplingParams:
    """SamplingParams of a GenerateRequest (ValueError for what we cannot honour)."""
    if sp.n not in (0, 1):
        raise ValueError(f"sampling_params.n={sp.n} is not supported (one sample per request)")
    constraint = sp.WhichOneof("constraint")
    if constraint is not None:
        raise ValueError(f"sampling_params.{constraint} (constrained decoding) is not supported")
    if sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty not in (0.0, 1.0):
        raise ValueError("frequency/presence/repetition penalties are not supported")
    if sp.logit_bias:
        raise ValueError("sampling_params.logit_bias is not supported")
    if sp.HasField("max_new_tokens"):
        max_tokens = sp.max_new_tokens
    else:
        max_tokens = max_model_len - prompt_len
        if max_tokens < 1:
            raise ValueError(f"the prompt ({prompt_len} tokens) fills the maximum context length {max_model_len}")
    if max_tokens < 1:
        raise ValueError(f"sampling_params.max_new_tokens={max_tokens} is invalid: must be >= 1")
    return SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p if sp.top_p != 0.0 else 1.0, top_k=max(sp.top_k, 0),
        min_p=sp.min_p, max_tokens=max_tokens, min_tokens=min(sp.min_new_tokens, max_tokens),
        stop=tuple(s for s in sp.stop if s), stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
    )


def disaggregation_from_proto(request) -> Disaggregation | None:
    if not request.HasField("disaggregated_params"):
        return None
    d = request.disaggregated_params
    if not d.bootstrap_host and not d.bootstrap_port and not d.bootstrap_room:
        return None
    if not d.bootstrap_host:
        raise ValueError("disaggregated_params.bootstrap_host is empty while bootstrap_port/room are set")
    if not 0 < d.bootstrap_port <= 65535:
        raise ValueError(f"disaggregated_params.bootstrap_port={d.bootstrap_port} is not a port")
    return Disaggregation(d.bootstrap_host, d.bootstrap_port, d.bootstrap_room)


class SchedulerServicer(pb_grpc.SglangSchedulerServicer):
    def __init__(self, state):
        self.state = state
        self.engine = state.engine

    async def Generate(self, request, context):
        state = self.state
        if request.mm_inputs.ByteSize() or request.input_embeds:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "multimodal inputs and input_embeds are not supported")
        if request.return_logprob or request.return_hidden_states:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "logprobs and hidden states are not supported")
        prompt = list(request.tokenized.input_ids)
        try:
            sampling = sampling_from_proto(request.sampling_params, len(prompt), self.engine.max_model_len,
                                           role=state.config.role)
            disagg = disaggregation_from_proto(request)
            handle = await self.engine.submit(prompt, sampling, request_id=request.request_id or None,
                                              context={"disaggregation": disagg} if disagg else None)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineOverloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EngineStopped as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        rid = handle.request_id
        try:
            async for chunk in handle:
                if request.stream:
                    yield pb.GenerateResponse(request_id=rid, chunk=pb.GenerateStreamChunk(
                        token_ids=chunk.token_ids, prompt_tokens=chunk.prompt_tokens,
                        completion_tokens=chunk.completion_tokens, cached_tokens=chunk.cached_tokens))
                if chunk.finished:
                    ids = chunk.token_ids if request.stream else handle.output_ids
                    complete = pb.GenerateComplete(
                        output_ids=ids, finish_reason=chunk.finish_reason, prompt_tokens=chunk.prompt_tokens,
                        completion_tokens=chunk.completion_tokens, cached_tokens=chunk.cached_tokens)
                    last = handle.output_ids[-1] if handle.output_ids else None
                    if chunk.finish_reason == "stop" and last is not None and (
                            last in sampling.stop_token_ids or last in state.tokenizer.eos_token_ids):
                        complete.matched_token_id = last
                    yield pb.GenerateResponse(request_id=rid, complete=complete)
        except EngineError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            if not handle.finished:  # the client cancelled the call
                handle.abort()

    async def HealthCheck(self, request, context):
        ok, message = self.engine.health()
        return pb.HealthCheckResponse(healthy=ok and self.engine.accepting, message=message)

    async def Abort(self, request, context):
        found = self.engine.abort(request.request_id)
        return pb.AbortResponse(success=found, message="aborted" if found else "no such request in flight")

    async def GetModelInfo(self, request, context):
        state, cfg = self.state, self.engine.engine.cfg
        tok = state.tokenizer
        max_len = self.engine.max_model_len
        return pb.GetModelInfoResponse(
            model_path=state.model_path, tokenizer_path=tok.path, is_generation=True,
            served_model_name=state.model_name, max_context_length=max_len, vocab_size=cfg.vocab_size,
            model_type="kimi_k3", eos_token_ids=[cfg.eos_token_id], pad_token_id=cfg.pad_token_id,
            bos_token_id=cfg.bos_token_id, max_req_input_len=max_len - 1, architectures=["KimiK3ForCausalLM"],
            weight_version="default")

    async def GetServerInfo(self, request, context):
        state, ecfg = self.state, self.engine.engine.ecfg
        stats = self.engine.stats()
        server_args = struct_pb2.Struct()
        server_args.update({
            "model_path": state.model_path, "served_model_name": state.model_name, "tokenizer_path": state.tokenizer.path,
            "tp_size": 1, "dp_size": 1, "page_size": ecfg.page_size, "max_running_requests": ecfg.max_running,
            "context_length": ecfg.max_model_len, "chunked_prefill_size": ecfg.max_prefill_tokens,
            "disaggregation_mode": "null" if ecfg.role == "both" else ecfg.role,
            "disaggregation_bootstrap_port": (self.engine.stats().get("disagg") or {}).get("bootstrap_port", 0),
            "enable_cache_report": True, "kv_events": True,
        })
        scheduler_info = struct_pb2.Struct()
        scheduler_info.update({"num_pages": stats.get("num_pages", 0), "num_slots": stats.get("num_slots", 0)})
        return pb.GetServerInfoResponse(
            server_args=server_args, scheduler_info=scheduler_info, active_requests=self.engine.num_live,
            is_paused=not self.engine.accepting, last_receive_timestamp=self.engine.last_receive_time,
            uptime_seconds=time.time() - state.start_time, sglang_version=state.version, server_type="grpc",
            max_total_num_tokens=int(stats.get("num_pages", 0)) * ecfg.page_size)

    async def GetLoads(self, request, context):
        stats = self.engine.stats()
        ecfg = self.engine.engine.ecfg
        capacity = int(stats.get("num_pages", 0)) * ecfg.page_size
        usage = float(stats.get("kv_usage", 0.0))
        prefix = stats.get("prefix_cache") or {}
        load = pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=stats.get("running", 0), num_waiting_reqs=stats.get("waiting", 0),
            num_total_reqs=stats.get("running", 0) + stats.get("waiting", 0), num_used_tokens=int(usage * capacity),
            max_total_num_tokens=capacity, token_usage=usage, cache_hit_rate=float(prefix.get("hit_rate", 0.0)),
            max_running_requests=ecfg.max_running)
        aggregate = pb.AggregateMetrics(total_running_reqs=load.num_running_reqs, total_waiting_reqs=load.num_waiting_reqs,
                                        total_reqs=load.num_total_reqs, avg_token_usage=usage)
        return pb.GetLoadsResponse(timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), version=self.state.version,
                                   dp_rank_count=1, loads=[load], aggregate=aggregate)

    async def FlushCache(self, request, context):
        import asyncio

        try:
            pages = await asyncio.wrap_future(self.engine.reset_prefix_cache(timeout=max(request.timeout_s, 0.0)))
        except TimeoutError as e:
            return common_pb2.FlushCacheResponse(success=False, message=f"KV prefix cache reset refused: {e}")
        return common_pb2.FlushCacheResponse(success=True, message=f"Cache flushed successfully ({pages} pages)")

    async def SubscribeKvEvents(self, request, context):
        async for batch in self.state.kv_events.subscribe(request.start_sequence_number):
            yield batch

    async def GetTokenizer(self, request, context):
        data = _zip_tokenizer(Path(self.state.tokenizer.path))
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            last = start + TOKENIZER_CHUNK_BYTES >= len(data)
            yield common_pb2.GetTokenizerChunk(data=data[start:start + TOKENIZER_CHUNK_BYTES],
                                               sha256=digest if last else "")


def _zip_tokenizer(path: Path) -> bytes:
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            z.write(f, f.name)
    return buf.getvalue()


async def start_grpc_server(state, host: str, port: int):
    """Starts the service on host:port (0: any free port); returns (server, bound port)."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    pb_grpc.add_SglangSchedulerServicer_to_server(SchedulerServicer(state), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the gRPC server to {host}:{port}")
    await server.start()
    return server, bound


__all__ = ["Disaggregation", "SchedulerServicer", "disaggregation_from_proto", "sampling_from_proto",
           "start_grpc_server"]
