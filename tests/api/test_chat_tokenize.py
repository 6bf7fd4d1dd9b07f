"""A chat prompt is tokenized once, off the event loop: the ids and cache boundaries of
`serving.api.http._tokenize_chat` (the prompt encoded in pieces cut at the template's special tokens) equal
the old full encodes (the whole prompt, then each prefix) for random conversations, with a byte-level BPE
tokenizer trained here (32k vocabulary, seeded, offline), the same vocabulary as a tiktoken file, and the
bundled byte tokenizer; a special token that absorbs whitespace makes the tokenizer fall back to full
encodes, still exact; and the HTTP server keeps its event loop running while it tokenizes a ~100k-token
chat request. No model, no compile.

Run: python -m pytest -q tests/api/test_chat_tokenize.py
"""

from __future__ import annotations

import asyncio
import base64
import functools
import gc
import json
import random
import time
from types import SimpleNamespace

import httpx
import pytest

from serving.api.http import _tokenize_chat, build_app
from serving.api.protocol import chat_messages
from serving.api.tokenizer import BYTE_CHAT_TEMPLATE, BYTE_SPECIAL_TOKENS, _byte_char, load_tokenizer
from serving.async_engine import EngineOverloaded

BPE_VOCAB = 32000
SYLLABLES = ("ka", "lo", "mi", "ne", "tor", "ex", "pa", "ri", "sun", "vel", "dra", "qu", "ix", "om", "be", "ch", "st",
             "ng", "ae", "ou", "th", "sh")
UNICODE = ("naïve café ✓", "🦊 λ→∞", "日本語のテキスト", "Ωmega ß", "Ünïcödé…")


class TextGen:
    """Seeded text like a coding agent's history: prose, code lines, JSON tool output, some non-ASCII."""

    def __init__(self, seed: int, n_words: int = 20000):
        self.rng = random.Random(seed)
        self.words = ["".join(self.rng.choice(SYLLABLES) for _ in range(self.rng.randint(1, 4)))
                      for _ in range(n_words)]

    def line(self) -> str:
        r, w = self.rng, self.rng.choice
        kind = r.random()
        if kind < 0.4:
            return " ".join(w(self.words) for _ in range(r.randint(3, 14))) + w(".,?!:")
        if kind < 0.7:
            return (" " * w((0, 4, 8, 12)) + f"{w(('def', 'return', 'if', 'for', 'self.'))} "
                    f"{w(self.words)}_{w(self.words)}({w(self.words)}, {r.randint(0, 9999)}):")
        if kind < 0.85:
            return json.dumps({w(self.words): w(self.words), "n": r.randint(0, 10**6), "ok": r.random() < 0.5})
        return f"{w(UNICODE)} {w(self.words)}"

    def text(self, n_lines: int) -> str:
        return "\n".join(self.line() for _ in range(n_lines))


def _write_config(directory, specials: dict[str, int]) -> None:
    config = {"bos_token": BYTE_SPECIAL_TOKENS[0], "eos_token": BYTE_SPECIAL_TOKENS[1],
              "pad_token": BYTE_SPECIAL_TOKENS[2], "chat_template": BYTE_CHAT_TEMPLATE,
              "added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in specials.items()}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@functools.cache
def bpe_json() -> str:
    """tokenizer.json of a byte-level BPE (GPT-2 pre-tokenisation) trained on generated text to 32k tokens,
    with the byte tokenizer's chat specials as added tokens (about 2 s)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    gen = TextGen(seed=11, n_words=40000)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((gen.text(20) for _ in range(1500)), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIAL_TOKENS])
    return tok.to_str()


def save_bpe(directory, lstrip: tuple[str, ...] = ()):
    """The BPE with its chat specials into `directory`; the `lstrip` ones absorb the whitespace before them."""
    spec = json.loads(bpe_json())
    for added in spec["added_tokens"]:
        added["lstrip"] = added["content"] in lstrip
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    _write_config(directory, {a["content"]: a["id"] for a in spec["added_tokens"]})
    return load_tokenizer(directory)


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    tok = save_bpe(tmp_path_factory.mktemp("bpe32k"))
    assert tok.vocab_size == BPE_VOCAB + len(BYTE_SPECIAL_TOKENS) and tok.special_ids["<|im_end|>"] >= BPE_VOCAB
    return tok


@pytest.fixture(scope="module")
def tiktoken_tokenizer(bpe_tokenizer, tmp_path_factory):
    """The BPE's vocabulary as a tiktoken file (rank = id: the trainer numbers merges in order)."""
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(f"{bpe_tokenizer.path}/tokenizer.json")
    byte_of = {_byte_char(b): b for b in range(256)}
    ranks = {bytes(byte_of[c] for c in token): i for token, i in hf.get_vocab(with_added_tokens=False).items()}
    directory = tmp_path_factory.mktemp("tiktoken32k")
    lines = sorted(ranks.items(), key=lambda kv: kv[1])
    (directory / "bpe32k.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for t, i in lines))
    _write_config(directory, {t: len(ranks) + i for i, t in enumerate(BYTE_SPECIAL_TOKENS)})
    return load_tokenizer(directory / "bpe32k.tiktoken")


def old_tokenize_chat(tok, body: dict) -> tuple[list[int], tuple[int, ...]]:
    """The server's boundaries computed the slow way (serving/api/http.py at e2088fa, plus the end of the
    conversation before its last message, 2026-11-30): encode the whole prompt, then encode each shareable
    prefix's rendering again to count its tokens."""
    messages = chat_messages(body)
    agp = body.get("add_generation_prompt", True)
    text = tok.apply_chat_template(messages, add_generation_prompt=agp)
    n = 0
    while n < len(messages) and messages[n]["role"] in ("system", "developer"):
        n += 1
    out = []
    before_last = messages[:-1] if len(messages) - 1 > n else None
    for head_messages in ((messages[:n] if 0 < n < len(messages) else None), before_last, messages):
        if head_messages:
            head = tok.apply_chat_template(head_messages, add_generation_prompt=False)
            if head and text.startswith(head) and len(head) < len(text):
                out.append(len(tok.encode(head)))
    return tok.encode(text), tuple(sorted(set(out)))


def random_chat(rng: random.Random, gen: TextGen) -> dict:
    """System (or developer, or none), a few turns of odd lengths (empty, whitespace-edged, unicode, a
    literal special token in the content), sometimes no generation prompt or an assistant turn last."""
    def content():
        kind = rng.random()
        if kind < 0.1:
            return ""
        text = gen.text(rng.randint(1, 9))[: rng.randint(1, 900)]
        if kind < 0.3:
            text = rng.choice((" ", "\n", "\n\n ", "\t")) + text + rng.choice((" ", "\n", " \n", "  "))
        if kind > 0.92:
            text += rng.choice(BYTE_SPECIAL_TOKENS) + rng.choice(("", "x", " y", "\n"))
        return text

    messages = []
    if rng.random() < 0.8:
        messages.append({"role": rng.choice(("system", "system", "developer")), "content": content()})
        if rng.random() < 0.2:
            messages.append({"role": "system", "content": content()})
    for turn in range(rng.randint(1, 5)):
        messages.append({"role": "user", "content": content()})
        if turn < 4 or rng.random() < 0.5:
            messages.append({"role": "assistant", "content": content()})
    body = {"messages": messages}
    if rng.random() < 0.25:
        body["add_generation_prompt"] = False
    return body


@pytest.mark.parametrize("kind", ["bpe", "tiktoken", "byte"])
def test_single_pass_ids_and_boundaries_equal_the_full_encodes(kind, request):
    tok = load_tokenizer(None) if kind == "byte" else request.getfixturevalue(f"{kind}_tokenizer")
    state = SimpleNamespace(tokenizer=tok)
    rng, gen = random.Random(hash(kind) % 1000 + 5), TextGen(seed=23, n_words=3000)
    cut_at_special = 0
    for _ in range(60):
        body = random_chat(rng, gen)
        ids, boundaries = _tokenize_chat(state, body)
        old_ids, old_boundaries = old_tokenize_chat(tok, body)
        assert ids == old_ids and boundaries == old_boundaries, body
        cut_at_special += len(boundaries)
    # the cuts came at the template's special tokens, which each of these tokenizers splits exactly at
    assert cut_at_special >= 60
    assert tok._exact_edges.get(("<|im_start|>", "before")) is True
    # the property the single pass relies on, for these tokenizers: no token spans a special token's edge
    text = tok.apply_chat_template(random_chat(rng, gen)["messages"])
    cut = text.rindex("<|im_start|>")
    assert tok.encode(text) == tok.encode(text[:cut]) + tok.encode(text[cut:])


@pytest.mark.parametrize("kind", ["bpe", "tiktoken"])
def test_prefix_counts_at_any_offset_equal_encoding_the_prefix(kind, request):
    tok = request.getfixturevalue(f"{kind}_tokenizer")
    rng, gen = random.Random(7), TextGen(seed=29, n_words=3000)
    body = random_chat(rng, gen)
    body["messages"].append({"role": "user", "content": gen.text(30)})
    text = tok.apply_chat_template(body["messages"])
    specials = [i + len(t) for t in ("<|im_end|>", "<|im_start|>") for i in range(len(text)) if text.startswith(t, i)]
    ends = [0, len(text), *rng.sample(range(1, len(text)), 25), *specials]  # most inside words and lines
    ids, counts = tok.encode_with_prefix_counts(text, ends)
    assert ids == tok.encode(text)
    assert counts == [len(tok.encode(text[:e])) for e in ends]
    with pytest.raises(ValueError, match="outside the text"):
        tok.encode_with_prefix_counts(text, [len(text) + 1])


def test_a_special_token_that_absorbs_whitespace_falls_back_to_full_encodes(tmp_path):
    """<|im_start|> with lstrip: the "\\n" before it belongs to it in the whole text but not in a piece cut
    right before it. The probe sees that and the boundaries are counted by encoding the prefixes."""
    tok = save_bpe(tmp_path, lstrip=("<|im_start|>",))
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    cut = text.index("<|im_start|>user")
    assert tok.encode(text) != tok.encode(text[:cut]) + tok.encode(text[cut:])  # the naive split is wrong here
    rng, gen = random.Random(3), TextGen(seed=31, n_words=2000)
    state = SimpleNamespace(tokenizer=tok)
    for _ in range(15):
        body = random_chat(rng, gen)
        assert _tokenize_chat(state, body) == old_tokenize_chat(tok, body)
    assert tok._exact_edges[("<|im_start|>", "before")] is False


def long_agent_chat(target_chars: int) -> dict:
    """A coding agent's history: a system prompt, then user/assistant turns until `target_chars`."""
    gen, rng = TextGen(seed=41), random.Random(43)
    messages = [{"role": "system", "content": gen.text(60)}]
    while sum(len(m["content"]) for m in messages) < target_chars:
        messages.append({"role": "user", "content": gen.text(rng.randint(5, 40))})
        messages.append({"role": "assistant", "content": gen.text(rng.randint(20, 200))})
    messages.append({"role": "user", "content": "Now run the tests."})
    return {"model": "m", "messages": messages, "max_tokens": 8}


class StubEngine:
    """Records what the server submits, then answers 'overloaded' (HTTP 503): no model needed."""

    max_model_len = 10**6

    def __init__(self):
        self.submitted = []

    async def submit(self, prompt_ids, sampling, **kwargs):
        self.submitted.append((time.perf_counter(), list(prompt_ids), kwargs["cache_boundaries"]))
        raise EngineOverloaded("stub")


def stub_state(tokenizer):
    counter = SimpleNamespace(labels=lambda *a: SimpleNamespace(inc=lambda: None))
    return SimpleNamespace(tokenizer=tokenizer, engine=StubEngine(), model_name="m", model_aliases={"m"},
                           metrics=SimpleNamespace(http_requests=counter),
                           config=SimpleNamespace(api_key=None, max_body_bytes=64 << 20))


def loop_gaps_during_request(app, path: str, body: dict):
    """POSTs `body` to `app` (in-process ASGI) while a ticker coroutine, standing in for the token streams of
    other requests, wakes every millisecond: (response, each tick's delay beyond its 1 ms sleep)."""
    content = json.dumps(body).encode()  # encoded here: the client's own work is not the server's

    async def main():
        gaps, done = [], asyncio.Event()

        async def ticker():
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                gaps.append(time.perf_counter() - t - 0.001)

        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            response = await c.post(path, content=content, headers={"Content-Type": "application/json"})
        done.set()
        await ticking
        return response, gaps

    # A full garbage collection stops every thread of the process (157 ms measured here with jax's objects on
    # the heap) whenever the allocation counts say so: a pause of the whole process, not the server's code,
    # and not what this measures. Collected before, off during the request.
    gc.collect()
    gc.disable()
    try:
        return asyncio.run(main())
    finally:
        gc.enable()


def timed_encode(tok, text: str) -> tuple[list[int], float]:
    start = time.perf_counter()
    ids = tok.encode(text)
    return ids, time.perf_counter() - start


# Bound on the longest loop stall, as a share of one encode of the whole prompt measured in the same test.
# Before, the loop encoded the prompt and (the server) its pre-generation-prompt history, each as long as
# the prompt: a stall of at least one encode (router) or two (server). Now the loop still parses the
# ~0.4 MB JSON body (2 ms) and waits for the GIL while the worker thread runs Python (the template, the
# ids list; 5 ms switch interval), 10-20 ms measured against a 200-400 ms encode on a loaded 2-core
# machine. Half an encode leaves room for a busy CI runner and still fails any encode on the loop.
MAX_STALL_PER_ENCODE = 0.5


def test_a_long_chat_request_does_not_stall_the_servers_event_loop(bpe_tokenizer):
    body = long_agent_chat(target_chars=400_000)
    expected_ids, encode_s = timed_encode(bpe_tokenizer, bpe_tokenizer.apply_chat_template(body["messages"]))
    assert len(expected_ids) > 100_000
    state = stub_state(bpe_tokenizer)
    response, gaps = loop_gaps_during_request(build_app(state), "/v1/chat/completions", body)
    assert response.status_code == 503 and response.json()["error"]["code"] == "overloaded"
    (_, ids, boundaries), = state.engine.submitted
    assert ids == expected_ids
    heads = (body["messages"][:1], body["messages"][:-1], body["messages"])  # system, before the last, history
    assert boundaries == tuple(len(bpe_tokenizer.encode(bpe_tokenizer.apply_chat_template(h, add_generation_prompt=False)))
                               for h in heads)
    print(f"encode {encode_s * 1e3:.0f} ms, {len(gaps)} ticks, max loop gap {max(gaps) * 1e3:.1f} ms")
    assert len(gaps) > 20 and max(gaps) < MAX_STALL_PER_ENCODE * encode_s, (max(gaps), encode_s)
    # a template error still answers 400 from the worker thread
    response, _ = loop_gaps_during_request(build_app(state), "/v1/chat/completions", {"messages": "hi"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_a_long_chat_request_does_not_stall_the_routers_event_loop(bpe_tokenizer, monkeypatch):
    from serving.api.protocol import APIError
    from serving.disagg.router import Router, RouterConfig
    from serving.disagg.router import build_app as build_router_app

    router = Router(RouterConfig(colocated=("127.0.0.1:50999",), page_size=16, tokenizer=bpe_tokenizer.path,
                                 max_model_len=10**6))
    generated = []

    def generate(ids, *args):  # the workers are not needed: record what the router would send, then fail
        generated.append(list(ids))

        async def fail():
            raise APIError("no workers in this test", status=503, type="server_error")
            yield

        return fail()

    monkeypatch.setattr(router, "generate", generate)
    body = long_agent_chat(target_chars=400_000)
    expected_ids, encode_s = timed_encode(bpe_tokenizer, bpe_tokenizer.apply_chat_template(body["messages"]))
    response, gaps = loop_gaps_during_request(build_router_app(router), "/v1/chat/completions", body)
    assert response.status_code == 503 and generated == [expected_ids]
    print(f"encode {encode_s * 1e3:.0f} ms, {len(gaps)} ticks, max loop gap {max(gaps) * 1e3:.1f} ms")
    assert len(gaps) > 20 and max(gaps) < MAX_STALL_PER_ENCODE * encode_s, (max(gaps), encode_s)
