"""Tokenizers of the API layer: the bundled byte tokenizer is exactly what `build_byte_tokenizer` writes and
fits k3-tiny; tiktoken files load by path; streaming detokenisation holds back split characters and stop
strings. No model, no compile.

Run: python -m pytest -q tests/api/test_tokenizer.py
"""

import base64

import pytest

import k3jax
from serving.api.tokenizer import TextStream, build_byte_tokenizer, default_tokenizer_dir, load_tokenizer


def test_bundled_byte_tokenizer_is_the_generated_one_and_fits_k3_tiny(tmp_path):
    built = build_byte_tokenizer(tmp_path / "k3-byte")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (built / name).read_text() == (default_tokenizer_dir() / name).read_text(), name
    tok = load_tokenizer(None)
    cfg = k3jax.load_config("k3-tiny")
    assert tok.vocab_size == cfg.vocab_size == 263
    assert tok.eos_token_ids == (cfg.eos_token_id,) and tok.bos_token_id == cfg.bos_token_id
    assert tok.pad_token_id == cfg.pad_token_id
    text = "naïve café ✓ 🦊"
    ids = tok.encode(text)
    assert ids == list(text.encode()) and tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(prompt)[0] == 259 and tok.decode(tok.encode(prompt)) == "system\nBe brief.\nuser\nhi\nassistant\n"
    with pytest.raises(ValueError, match="vocabulary"):
        tok.decode([263])


def test_tiktoken_file_by_path(tmp_path):
    ranks = [bytes([b]) for b in range(256)] + [b"ab", b"abc"]
    f = tmp_path / "tiny.tiktoken"
    f.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    tok = load_tokenizer(f)
    assert tok.vocab_size == 258
    assert tok.encode("abcab") == [257, 256]
    assert tok.decode([257, 256, 33]) == "abcab!"
    (tmp_path / "broken.tiktoken").write_text("not base64\n")
    with pytest.raises(ValueError, match="broken.tiktoken:1"):
        load_tokenizer(tmp_path / "broken.tiktoken")
    with pytest.raises(ValueError, match="no such file"):
        load_tokenizer(tmp_path / "missing")


def test_text_stream_holds_back_split_characters_and_stop_strings():
    tok = load_tokenizer(None)
    ids = tok.encode("ok 🦊 then STOP here")
    stream = TextStream(tok, stop=("STOP",))
    pieces = [stream.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)  # the fox's 4 bytes come out as one character
    assert "".join(pieces) + stream.finish() == "ok 🦊 then "
    # without a stop string everything comes out, the held-back tail at finish
    plain = TextStream(tok)
    assert "".join(plain.push([i]) for i in ids) + plain.finish() == "ok 🦊 then STOP here"
    # an incomplete character at the very end is flushed as a replacement character
    cut = TextStream(tok)
    assert cut.push(list("é".encode())[:1]) == "" and cut.finish() == "\ufffd"


def test_generated_ids_beyond_the_tokenizer_render_as_nothing_but_client_ids_are_refused():
    """A model whose output layer is wider than its tokenizer (k3-small's 163,840 logits with the bundled
    263-id byte tokenizer) can emit ids the tokenizer lacks: the stream and the engine's stop-string check
    skip them (H200, 2026-11-30: one such id failed every routed request); ids a client sends are refused."""
    tok = load_tokenizer(None)
    ids = tok.encode("fox then STOP")
    beyond = [tok.vocab_size, tok.vocab_size + 92_660]
    mixed = [ids[0], beyond[0], *ids[1:5], beyond[1], *ids[5:]]
    assert tok.decode_generated(mixed) == "fox then STOP"
    stream = TextStream(tok, stop=("STOP",))
    assert "".join(stream.push([i]) for i in mixed) + stream.finish() == "fox then "
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        tok.decode(mixed)
