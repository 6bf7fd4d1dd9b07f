"""gRPC worker mode (the SGLang scheduler service of smg-grpc-proto) with a grpc client, and the SMG gateway
(`smg launch`) in front of two `k3jax serve --grpc-port` workers: chat requests routed and streamed back,
and the gateway's cache-aware policy indexing the KV events our workers publish.

Run: python -m pytest -q tests/api/test_grpc_smg.py
"""

import os
import shutil
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2 as pb, sglang_scheduler_pb2_grpc as pb_grpc

from serving.api.kv_events import block_hash
from serving.cache.hashing import prefix_hashes

PROMPT = list(range(100, 140))  # 40 tokens: 2 full 16-token pages before the last token


@pytest.fixture(scope="module")
def stub(worker):
    channel = grpc.insecure_channel(worker.grpc_target)
    grpc.channel_ready_future(channel).result(timeout=30)
    yield pb_grpc.SglangSchedulerStub(channel)
    channel.close()


def generate(stub, ids, max_new_tokens=4, stream=True, request_id=None, **sampling):
    req = pb.GenerateRequest(request_id=request_id or f"t-{time.monotonic_ns()}", stream=stream,
                             tokenized=pb.TokenizedInput(input_ids=ids),
                             sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                                               ignore_eos=True, **sampling))
    return list(stub.Generate(req, timeout=120))


def test_grpc_worker_rpcs(stub):
    health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
    assert health.healthy
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.max_context_length == 256 and info.vocab_size == 263 and list(info.eos_token_ids) == [257]
    server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert server.server_type == "grpc" and server.server_args["page_size"] == 16
    assert server.server_args["disaggregation_mode"] == "null"
    loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
    assert loads.dp_rank_count == 1 and loads.loads[0].max_running_requests == 1

    streamed = generate(stub, PROMPT, max_new_tokens=5, stream=True)
    chunks, complete = streamed[:-1], streamed[-1]
    assert [c.chunk.completion_tokens for c in chunks] == [1, 2, 3, 4, 5]
    assert complete.complete.finish_reason == "length" and complete.complete.prompt_tokens == 40
    tokens = [t for c in chunks for t in c.chunk.token_ids]
    # not streamed: one GenerateComplete with every id; greedy, so the same tokens (now from the cache)
    [whole] = generate(stub, PROMPT, max_new_tokens=5, stream=False)
    assert list(whole.complete.output_ids) == tokens and whole.complete.cached_tokens == 32

    for bad, needle in (([1, 2, 999], "vocab_size"), ([], "empty"), (list(range(250)), "max_model_len")):
        with pytest.raises(grpc.RpcError) as e:
            generate(stub, bad, max_new_tokens=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, PROMPT, regex="a+")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # bootstrap fields are checked and kept for P/D; a colocated worker still serves the request
    req = pb.GenerateRequest(request_id="pd-1", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                             sampling_params=pb.SamplingParams(max_new_tokens=2, ignore_eos=True),
                             disaggregated_params=pb.DisaggregatedParams(bootstrap_host="127.0.0.1",
                                                                         bootstrap_port=8998, bootstrap_room=7))
    assert list(stub.Generate(req, timeout=60))[-1].complete.completion_tokens == 2
    bad_pd = pb.GenerateRequest(request_id="pd-2", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                disaggregated_params=pb.DisaggregatedParams(bootstrap_room=7))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad_pd, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bootstrap_host" in e.value.details()

    # Abort a long request mid-stream: its stream ends with finish_reason "abort"
    long = stub.Generate(pb.GenerateRequest(request_id="long-1", stream=True, tokenized=pb.TokenizedInput(
        input_ids=PROMPT), sampling_params=pb.SamplingParams(max_new_tokens=150, ignore_eos=True)), timeout=120)
    first = next(long)
    assert first.chunk.completion_tokens >= 1
    assert stub.Abort(pb.AbortRequest(request_id="long-1"), timeout=10).success
    rest = list(long)
    assert rest[-1].complete.finish_reason == "abort" and rest[-1].complete.completion_tokens < 150


def test_kv_events_report_the_prefix_cache(stub):
    ids = list(range(200, 250))  # 50 tokens: pages [0,16), [16,32), [32,48) get cached
    generate(stub, ids, max_new_tokens=2)
    events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0), timeout=60)
    snapshot = next(events)
    assert snapshot.events[0].WhichOneof("data") == "cleared"  # a snapshot: the whole state follows
    expected = [block_hash(h) for h in prefix_hashes(ids[:48], 16)]  # the chained page hashes
    stored, parents, batch, seq = {}, {}, snapshot, snapshot.sequence_number
    deadline = time.monotonic() + 20
    while True:  # the last pages may arrive in the batch after the snapshot
        for e in batch.events:
            if e.WhichOneof("data") == "stored":
                parent = e.stored.parent_block_hash if e.stored.HasField("parent_block_hash") else None
                for b in e.stored.blocks:
                    assert b.block_size == 16
                    stored[b.block_hash] = list(b.token_ids)
                    parents[b.block_hash], parent = parent, b.block_hash
        if set(expected) <= stored.keys() or time.monotonic() > deadline:
            break
        batch = next(events)
        assert batch.sequence_number >= seq
        seq = batch.sequence_number
    for i, h in enumerate(expected):
        assert stored.get(h) == ids[16 * i:16 * (i + 1)], i
        assert parents[h] == (expected[i - 1] if i else None)
    # a flush is reported as the cache emptying
    assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=30).success
    deadline = time.monotonic() + 20
    seen_clear = False
    for batch in events:
        if any(e.WhichOneof("data") in ("cleared", "removed") for e in batch.events):
            seen_clear = True
            break
        assert time.monotonic() < deadline
    events.cancel()
    assert seen_clear


@pytest.fixture(scope="module")
def gateway(worker, compile_cache, launch):
    """worker A (the session's) + worker B (gRPC only) behind `smg launch` with the cache-aware policy."""
    smg = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
    if not Path(smg).exists():
        pytest.skip("the smg gateway is not installed (pip install smg)")
    grpc_b = launch.free_port()
    worker_b = launch.start_worker(compile_cache, http_port=None, grpc_port=grpc_b, name="worker B")
    port, metrics_port = launch.free_port(), launch.free_port()
    argv = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
            f"grpc://{worker.grpc_target}", f"grpc://127.0.0.1:{grpc_b}", "--policy", "cache_aware",
            "--tokenizer-path", str(launch.ROOT / "configs/tokenizers/k3-byte"), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port), "--log-level", "warn"]
    router = launch.Process(argv, dict(os.environ, NO_COLOR="1"), "smg")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                workers = httpx.get(f"{url}/workers", timeout=5).json()
                if workers.get("total") == 2 and all(w.get("status") == "ready" for w in workers["workers"]):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if router.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"smg did not register both workers:\n{router.log}")
            time.sleep(0.25)
        yield url, f"http://127.0.0.1:{metrics_port}"
    finally:
        router.stop(10)
        assert worker_b.stop() == 0, worker_b.log


def test_smg_routes_chat_to_two_grpc_workers(gateway):
    url, metrics_url = gateway
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)

    def samples(name):
        text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
        return {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)}

    def indexed_blocks():
        return sum(samples("smg_kv_index_blocks{").values())

    def chat(messages):
        chunks = list(client.chat.completions.create(model="k3-tiny", stream=True, max_tokens=4, messages=messages,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
        assert chunks[-1].usage.completion_tokens == 4
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks[-1].usage

    blocks_before = indexed_blocks()
    system = "You are a careful assistant who answers in one short sentence. " * 2
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "What is a prefix cache?"}]
    answer, usage1 = chat(turn1)
    assert usage1.prompt_tokens > 160
    # the worker's KV events reach the gateway's index: the first turn's full pages appear there
    deadline = time.monotonic() + 20
    while indexed_blocks() < blocks_before + usage1.prompt_tokens // 16 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert indexed_blocks() >= blocks_before + usage1.prompt_tokens // 16, samples("smg_kv_")
    applied = {k: v for k, v in samples("smg_kv_event_batches_total").items() if 'disposition="applied"' in k}
    assert sum(applied.values()) >= 1 and len(samples("smg_kv_event_subscriptions_total")) == 2
    # the next turn extends the conversation: cache-aware routing sends it to the worker holding it,
    # which resumes from its cached prefix (the KDA checkpoint at the first prompt's last page boundary)
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And a KV event?"}]
    _, usage2 = chat(turn2)
    assert usage2.prompt_tokens_details.cached_tokens == (usage1.prompt_tokens - 1) // 16 * 16
    done = client.chat.completions.create(model="k3-tiny", max_tokens=3, messages=[{"role": "user", "content": "Hi!"}],
                                          extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 3
