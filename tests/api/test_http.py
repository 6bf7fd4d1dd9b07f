"""The OpenAI-compatible HTTP server of `k3jax serve`, driven by the official `openai` client and raw httpx:
chat + completions (streamed and not), cached tokens on a repeated prompt, OpenAI-style 400s that leave
the server serving, API key, client disconnect aborting the request, full queue -> 503, tokenize /
detokenize / reset_prefix_cache, and the vLLM-named Prometheus metrics.

Run: python -m pytest -q tests/api/test_http.py
"""

import asyncio
import json
import time

import httpx
import openai
import pytest

API_KEY = "test-key-123"  # what tests/api/conftest.py starts the worker with
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# prompts longer than one 16-token page (the byte tokenizer: one token per ASCII character)
LONG_PROMPT = "The quick brown fox jumps over the lazy dog, then naps under a tree at dusk."  # 76 tokens


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key=API_KEY, timeout=120, max_retries=0)


def metric(worker, name: str, labels: str = "", default: float | None = None) -> float:
    """The value of the first /metrics sample named `name` whose labels contain `labels`."""
    for line in httpx.get(f"{worker.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if labels in line:
                return float(line.rsplit(" ", 1)[1])
    assert default is not None, f"{name}{{{labels}}} not in /metrics"
    return default


def test_openai_client_chat_and_completions(client):
    chat = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "Hello, who are you?"}],
                                          max_tokens=5, extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.model == "k3-tiny"
    assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 5 and chat.usage.prompt_tokens > 16
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 5

    chunks = list(client.chat.completions.create(
        model="k3-tiny", messages=[{"role": "user", "content": "Stream me a story, please."}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "min_tokens": 6}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0

    done = client.completions.create(model="k3-tiny", prompt=LONG_PROMPT, max_tokens=4, temperature=0.7, seed=3,
                                     extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.01})
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == len(LONG_PROMPT) and done.usage.completion_tokens == 4
    again = client.completions.create(model="k3-tiny", prompt=LONG_PROMPT, max_tokens=4, temperature=0.7, seed=3,
                                      extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.01})
    assert again.choices[0].text == done.choices[0].text  # seeded sampling is reproducible

    streamed = list(client.completions.create(model="k3-tiny", prompt=LONG_PROMPT[::-1], max_tokens=5, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert streamed[-1].usage.completion_tokens == 5 and streamed[-1].choices == []
    assert streamed[-2].choices[0].finish_reason == "length"


def test_usage_reports_cached_tokens_on_repeated_prompt(client):
    prompt = "Agents repeat long system prompts; a prefix cache serves them. " * 2  # 126 tokens
    first = client.completions.create(model="k3-tiny", prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True})
    second = list(client.completions.create(model="k3-tiny", prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert first.usage.prompt_tokens == len(prompt) == 126
    # the first run cached every full page before the prompt's last token: (126 - 1) // 16 = 7 pages
    assert second[-1].usage.prompt_tokens_details.cached_tokens == 7 * 16


def test_chats_sharing_a_system_prompt_reuse_it(client):
    """Two different conversations with one system prompt: the second reports the system prompt's full
    pages as cached (the server declares the system prompt's end as a cache boundary)."""
    system = {"role": "system", "content": "You are a careful coding agent. Follow the repository's style guide."}
    usage = []
    for question in ("List the files.", "Run the tests now, please!"):
        chat = client.chat.completions.create(model="k3-tiny", messages=[system, {"role": "user", "content": question}],
                                              max_tokens=2, extra_body={"ignore_eos": True})
        usage.append(chat.usage)
    assert usage[1].prompt_tokens_details.cached_tokens >= 4 * 16  # the system turn renders to > 64 tokens


def test_a_chat_continued_by_a_user_turn_resumes_at_the_end_of_its_history(client):
    """The next request renders the same conversation but continues it with a user message (as AIPerf's weka
    replay sends agent turns), so it leaves the previous prompt at the previous generation prompt's role. The
    server checkpoints the end of the conversation before the generation prompt too, so the hit reaches that
    page, not the system prompt's (the previous prompt's own end lies past the divergence here)."""
    from serving.api.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    system = {"role": "system", "content": "You are a careful coding agent."}
    first_turn = {"role": "user", "content": "Read the failing test and the module it covers, then explain why. ok ok"}
    history = [system, first_turn]
    history_end = len(tok.encode(tok.apply_chat_template(history, add_generation_prompt=False)))
    prompt_end = len(tok.encode(tok.apply_chat_template(history, add_generation_prompt=True)))
    assert prompt_end // 16 > history_end // 16  # the previous prompt's last page ends past the divergence
    client.chat.completions.create(model="k3-tiny", messages=history, max_tokens=2, extra_body={"ignore_eos": True})
    nxt = client.chat.completions.create(model="k3-tiny", messages=[*history, {"role": "user", "content": "Go on."}],
                                         max_tokens=2, extra_body={"ignore_eos": True})
    assert nxt.usage.prompt_tokens_details.cached_tokens == history_end // 16 * 16


def test_a_chat_that_rewrites_its_last_message_resumes_before_that_message(client):
    """The next request keeps the conversation but rewrites the previous prompt's last message (an agent trimming
    a tool result; AIPerf's weka replay replacing a turn's partial block). The server checkpoints the end of the
    conversation before the last message, so the hit reaches that page instead of the system prompt's."""
    from serving.api.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    system = {"role": "system", "content": "You are a careful coding agent."}
    task = {"role": "user", "content": "Find why test_parser fails on empty input, then fix the parser module."}
    tool = {"role": "user", "content": "tool output: 3 failed, 41 passed in 2.31s; first failure at parse_line"}
    before_last = len(tok.encode(tok.apply_chat_template([system, task], add_generation_prompt=False)))
    system_end = len(tok.encode(tok.apply_chat_template([system], add_generation_prompt=False)))
    assert before_last // 16 > system_end // 16 + 1
    client.chat.completions.create(model="k3-tiny", messages=[system, task, tool], max_tokens=2,
                                   extra_body={"ignore_eos": True})
    trimmed = {"role": "user", "content": "tool output: 3 failed (trimmed)"}
    nxt = client.chat.completions.create(model="k3-tiny", messages=[system, task, trimmed], max_tokens=2,
                                         extra_body={"ignore_eos": True})
    assert nxt.usage.prompt_tokens_details.cached_tokens == before_last // 16 * 16


def test_completions_declare_a_shared_prefix(client):
    shared = "Shared tool preamble for every subagent of this run. " * 2  # 108 tokens
    client.completions.create(model="k3-tiny", prompt=shared + "First task.", max_tokens=2,
                              extra_body={"ignore_eos": True, "cache_boundaries": [len(shared)]})
    other = client.completions.create(model="k3-tiny", prompt=shared + "A different task!", max_tokens=2,
                                      extra_body={"ignore_eos": True})
    assert other.usage.prompt_tokens_details.cached_tokens == len(shared) // 16 * 16
    with pytest.raises(openai.BadRequestError, match="cache_boundaries"):
        client.completions.create(model="k3-tiny", prompt=shared, max_tokens=2, extra_body={"cache_boundaries": "x"})
    with pytest.raises(openai.BadRequestError, match="cache_boundaries"):
        client.completions.create(model="k3-tiny", prompt=shared, max_tokens=2, extra_body={"cache_boundaries": [10**6]})


def test_bad_input_gets_openai_400_and_server_keeps_serving(worker, client):
    url = f"{worker.url}/v1/chat/completions"
    ok = {"model": "k3-tiny", "messages": [{"role": "user", "content": "hi there, anyone home?"}], "max_tokens": 2}
    cases = {
        "malformed json": (b'{"model": "k3-tiny", "messages": [', None),
        "unknown model": ({**ok, "model": "gpt-17"}, "does not exist"),
        "max_tokens 0": ({**ok, "max_tokens": 0}, "max_tokens"),
        "max_tokens -3": ({**ok, "max_tokens": -3}, "max_tokens"),
        "context overflow": ({**ok, "messages": [{"role": "user", "content": "x" * 300}]}, "maximum context length"),
        "oversize body": ({**ok, "messages": [{"role": "user", "content": "y" * 30000}]}, "exceeds the limit"),
        "n=2": ({**ok, "n": 2}, "not supported"),
        "bad temperature": ({**ok, "temperature": -1}, "temperature"),
        "no messages": ({"model": "k3-tiny"}, "messages"),
        "template kwargs not an object": ({**ok, "chat_template_kwargs": [1]}, "must be an object"),
        "template kwargs set the renderer's own": ({**ok, "chat_template_kwargs": {"messages": []}}, "cannot set"),
    }
    for name, (body, needle) in cases.items():
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(url, content=content, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "code"} and err["type"] == "invalid_request_error", (name, err)
        if needle:
            assert needle in err["message"], (name, err)
    # prompt token ids outside the vocabulary, on /v1/completions
    r = httpx.post(f"{worker.url}/v1/completions", json={"model": "k3-tiny", "prompt": [1, 2, 300], "max_tokens": 2},
                   headers=AUTH, timeout=30)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="k3-tiny", prompt="z" * 250, max_tokens=10)
    assert httpx.get(f"{worker.url}/v1/nope", headers=AUTH, timeout=10).status_code == 404
    # still serving; chat_template_kwargs may set the body's own template switches (was a 500: a duplicate keyword)
    r = httpx.post(url, json=ok, headers=AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    plain = httpx.post(f"{worker.url}/v1/tokenize", json={"model": "k3-tiny", "messages": ok["messages"]},
                       headers=AUTH, timeout=30).json()["count"]
    r = httpx.post(url, json={**ok, "chat_template_kwargs": {"add_generation_prompt": False, "tools": None}},
                   headers=AUTH, timeout=120)
    assert r.status_code == 200 and 0 < r.json()["usage"]["prompt_tokens"] < plain  # no generation prompt


def test_api_key_is_required(worker):
    r = httpx.get(f"{worker.url}/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{worker.url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    models = httpx.get(f"{worker.url}/v1/models", headers=AUTH, timeout=10).json()
    assert models["data"][0]["id"] == "k3-tiny" and models["data"][0]["max_model_len"] == 256
    assert httpx.get(f"{worker.url}/health", timeout=10).status_code == 200  # health and metrics stay open


def test_client_disconnect_aborts_request_and_frees_pages(worker):
    def idle():
        return metric(worker, "vllm:num_requests_running") == 0 and metric(worker, "vllm:num_requests_waiting") == 0

    # a finished request of its own leaves pages in the prefix cache (run alone, nothing else has)
    done = httpx.post(f"{worker.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "k3-tiny", "prompt": LONG_PROMPT + " Twice?", "max_tokens": 2})
    assert done.status_code == 200
    deadline = time.monotonic() + 60
    while not idle() and time.monotonic() < deadline:
        time.sleep(0.1)
    usage_before = metric(worker, "vllm:kv_cache_usage_perc")
    finished = lambda reason: metric(worker, "vllm:request_success_total", f'finished_reason="{reason}"', default=0.0)
    body = {"model": "k3-tiny", "prompt": LONG_PROMPT + " And then?", "max_tokens": 150, "stream": True,
            "ignore_eos": True}
    # On a loaded 2-core machine the server can write all 150 tokens before it sees the hang-up (the request then
    # ends "length", not "abort"): up to three tries; a broken abort path fails all three.
    for _ in range(3):
        aborts_before, lengths_before = finished("abort"), finished("length")
        with httpx.stream("POST", f"{worker.url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one event, then hang up
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if (finished("abort") > aborts_before or finished("length") > lengths_before) and idle():
                break
            time.sleep(0.1)
        if finished("abort") > aborts_before:
            break
    assert (finished("abort"), finished("length")) == (aborts_before + 1, lengths_before)
    assert idle()
    # no request holds pages any more: once the prefix cache is dropped too, every page is free
    assert httpx.post(f"{worker.url}/reset_prefix_cache", headers=AUTH, timeout=30).json()["success"]
    deadline = time.monotonic() + 10  # /metrics reads the engine's stats snapshot, refreshed right after
    while metric(worker, "vllm:kv_cache_usage_perc") != 0.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(worker, "vllm:kv_cache_usage_perc") == 0.0 < usage_before
    generated = metric(worker, "vllm:request_generation_tokens_sum")
    assert generated > 0


def test_full_queue_answers_503(worker):
    body = {"model": "k3-tiny", "prompt": LONG_PROMPT, "max_tokens": 40, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(headers=AUTH, timeout=180) as c:
            return await asyncio.gather(*(c.post(f"{worker.url}/v1/completions", json=body) for _ in range(8)))

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    # --max-pending 4: four are served, the rest are told to come back later instead of hanging
    assert codes.count(200) >= 4 and codes.count(503) >= 1 and set(codes) <= {200, 503}, codes
    busy = next(r for r in responses if r.status_code == 503)
    assert busy.json()["error"]["code"] == "overloaded" and busy.headers.get("retry-after") == "1"


def test_tokenize_detokenize_reset_and_metrics(worker, client):
    # its own finished requests (length-capped, the second a prefix hit), so the metrics below do not depend on
    # which tests ran before in this worker
    for _ in range(2):
        client.completions.create(model="k3-tiny", prompt=LONG_PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    r = httpx.post(f"{worker.url}/v1/tokenize", json={"model": "k3-tiny", "prompt": "héllo"}, headers=AUTH)
    assert r.json()["tokens"] == [256, 104, 195, 169, 108, 108, 111]  # <s> + UTF-8 bytes
    r = httpx.post(f"{worker.url}/v1/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=AUTH)
    assert r.json()["tokens"][:2] == [259, 117] and r.json()["max_model_len"] == 256  # <|im_start|> u...
    r = httpx.post(f"{worker.url}/v1/detokenize", json={"tokens": [104, 195, 169, 257]}, headers=AUTH)
    assert r.json()["prompt"] == "hé"
    r = httpx.post(f"{worker.url}/reset_prefix_cache", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["success"] is True
    text = httpx.get(f"{worker.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:external_prefix_cache_hits_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", 'vllm:request_success_total{finished_reason="length"',
                 "http_requests_total"):
        assert name in text, name
    assert 'model_name="k3-tiny"' in text
    assert metric(worker, "vllm:prefix_cache_hits_total") > 0  # the repeated prompt at the top
    assert metric(worker, "vllm:prefix_cache_queries_total") >= metric(worker, "vllm:prefix_cache_hits_total")
