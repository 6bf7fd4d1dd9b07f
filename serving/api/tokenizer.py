"""Tokenizers for the API layer: an HF tokenizer directory (tokenizer.json, via `tokenizers`), a tiktoken
BPE file by path, or the bundled byte-level tokenizer of k3-tiny. Plus chat templates (jinja2) and
incremental detokenisation with stop strings for streaming.

    tok = load_tokenizer(None)                 # configs/tokenizers/k3-byte: 256 bytes + 7 specials = 263
    tok = load_tokenizer("/path/to/hf_dir")    # tokenizer.json (+ tokenizer_config.json: specials, template)
    tok = load_tokenizer("/path/to/x.tiktoken")  # "<base64 token> <rank>" lines (+ sibling tokenizer_config.json)
    ids = tok.encode("hi"); text = tok.decode(ids)
    ids, (n,) = tok.encode_with_prefix_counts(prompt, [len(system_part)])  # n == len(tok.encode(system_part))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    stream = TextStream(tok, stop=("\\n\\n",)); stream.push([104, 105]) -> "hi"; stream.finish() -> ""

The byte tokenizer is generated offline by `build_byte_tokenizer` (the checked-in files are exactly its
output; a test regenerates and compares): ids 0..255 are the raw bytes (byte-level BPE without merges),
256.. the special tokens. Its eos `<|im_end|>` (257) is k3-tiny's eos_token_id, so a chat turn ends
where the model stops.

Encoding releases the GIL (HF `encode_batch_fast`, tiktoken's native encode), so a server can tokenize a
100k-token prompt on a worker thread while its event loop keeps streaming other requests.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
import jinja2.sandbox

BYTE_TOKENIZER_NAME = "k3-byte"
# id 256 + i; eos (257) and pad (258) match configs/models/k3-tiny.yaml
BYTE_SPECIAL_TOKENS = ("<s>", "<|im_end|>", "<pad>", "<|im_start|>", "<|reserved_0|>", "<|reserved_1|>",
                       "<|reserved_2|>")
BYTE_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# The pre-tokenisation split of cl100k-style BPE files (used when a tiktoken file comes without one).
TIKTOKEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
# Text around a special token in the probes that decide whether a tokenizer splits exactly at that token's
# edges: letters, spaces and newlines (what lstrip/rstrip absorb, what a prefix space or a Metaspace
# "first" scheme changes), digits and a non-ASCII character (normalizers, byte fallback).
_EDGE_PROBE_LEFT = ("a", "x ", "word \n", " \n\n", "é1")
_EDGE_PROBE_RIGHT = ("b", " y", "\n word", "\n\n ", "1é")


def default_tokenizer_dir() -> Path:
    from k3jax.config import configs_dir

    return configs_dir() / "tokenizers" / BYTE_TOKENIZER_NAME


class Tokenizer:
    """Text <-> token ids, special tokens, chat template. Thread-safe for encode/decode."""

    def __init__(self, path: str, *, encode, decode, vocab_size: int, special_ids: dict[str, int],
                 config: dict | None = None, added_tokens: Sequence[str] | None = None):
        self.path = path
        self._encode = encode
        self._decode = decode
        self.vocab_size = vocab_size
        self.special_ids = dict(special_ids)
        self._special_set = frozenset(special_ids.values())
        # (special token, "after" | "before") -> whether encoding splits exactly at that edge (probed once)
        self._exact_edges: dict[tuple[str, str], bool] = {}
        # every string the tokenizer splits out of the text before merges (special or not)
        self._added_tokens = tuple(t for t in {*special_ids, *(added_tokens or ())} if t)
        config = config or {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_ids = tuple(i for i in [self.special_ids.get(self.eos_token)] if i is not None)
        self.bos_token_id = self.special_ids.get(self.bos_token)
        self.pad_token_id = self.special_ids.get(_token_text(config.get("pad_token")))
        self.chat_template: str | None = config.get("chat_template")
        if isinstance(self.chat_template, list):  # HF's named-templates form
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self._template = None
        if self.chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        ids = self._encode(text)
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_with_prefix_counts(self, text: str, prefix_ends: Sequence[int]) -> tuple[list[int], list[int]]:
        """(`encode(text)`, [len(encode(text[:end])) for end in prefix_ends]), tokenizing each character once
        where it can: an `end` right after or right before a special token (a chat template's end-of-message
        or start-of-message token) cuts the text into pieces that are encoded once each and concatenated.
        That is exact because a tokenizer splits special tokens out of the text before pre-tokenisation and
        merges, so no token spans such an edge; each tokenizer proves it for each special token it meets
        here once, on probe strings (a special token that absorbs neighbouring whitespace (lstrip/rstrip), a
        pre-tokenizer that treats the text's start differently, ... fail the probe), and every cut is checked
        again on the ids (the special token's id must sit at the edge of its piece). Any other `end` costs a
        separate `encode(text[:end])`, as counting it always did. ValueError for an end outside [0, len(text)]."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        ends = [int(e) for e in prefix_ends]
        for end in ends:
            if not 0 <= end <= len(text):
                raise ValueError(f"prefix end {end} is outside the text [0, {len(text)}]")
        cuts: dict[int, tuple[str, int]] = {}  # inner end -> (side of its special token, that token's id)
        for end in sorted(set(ends)):
            if 0 < end < len(text) and (edge := self._exact_special_edge(text, end)) is not None:
                cuts[end] = edge
        bounds = [0, *cuts, len(text)]
        pieces = [self._encode(text[a:b]) for a, b in zip(bounds, bounds[1:])]
        ids: list[int] = []
        for piece in pieces:
            ids.extend(piece)
        counts_at = {0: 0, len(text): len(ids)}
        count = 0
        for i, (end, (side, special_id)) in enumerate(cuts.items()):
            # the ids must show the cut at its special token: the left piece ends with it, or the right one starts
            edge_id = pieces[i][-1:] if side == "after" else pieces[i + 1][:1]
            if edge_id != [special_id]:  # not tokenized as that special token here: encode the whole text
                ids = self._encode(text)
                counts_at = {0: 0, len(text): len(ids)}
                break
            count += len(pieces[i])
            counts_at[end] = count
        return ids, [counts_at[e] if e in counts_at else len(self._encode(text[:e])) for e in ends]

    def _exact_special_edge(self, text: str, end: int) -> tuple[str, int] | None:
        """("after" | "before", the special token's id) when `end` falls right after or right before a special
        token at whose edge this tokenizer splits exactly; None otherwise."""
        if self._added_token_spans(text, end):
            return None
        for token, token_id in self.special_ids.items():
            if text.endswith(token, 0, end) and self._splits_exactly_at(token, "after"):
                return "after", token_id
            if text.startswith(token, end) and self._splits_exactly_at(token, "before"):
                return "before", token_id
        return None

    def _added_token_spans(self, text: str, end: int) -> bool:
        """Whether an occurrence of an added token contains both text[end - 1] and text[end] (the whole text
        would match it where the pieces cannot)."""
        for token in self._added_tokens:
            n = len(token)
            start = text.find(token, max(0, end - n + 1), end + n - 1)  # the first occurrence that could span
            if 0 <= start < end:
                return True
        return False

    def _splits_exactly_at(self, token: str, side: str) -> bool:
        """Whether encode(a) + encode(b) == encode(a + b) for every probe cut right `side` of `token` (cached:
        one small probe per special token and side for the tokenizer's life)."""
        key = (token, side)
        exact = self._exact_edges.get(key)
        if exact is None:
            exact = self._encode(token) == [self.special_ids[token]]
            for left in _EDGE_PROBE_LEFT:
                for right in _EDGE_PROBE_RIGHT:
                    if not exact:
                        break
                    cut = len(left) + (len(token) if side == "after" else 0)
                    whole = left + token + right
                    exact = self._encode(whole[:cut]) + self._encode(whole[cut:]) == self._encode(whole)
            self._exact_edges[key] = exact
        return exact

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the tokenizer's vocabulary [0, {self.vocab_size})")
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_set]
        return self._decode(ids)

    def decode_generated(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """`decode` for ids the model generated: an id the tokenizer does not have renders as nothing
        instead of raising. A model's output layer can be wider than its tokenizer (a vocabulary padded
        for the GEMMs; k3-small's random weights with the bundled 263-id byte tokenizer), and one such
        token must not fail the stream or the engine's stop-string check. `decode` stays strict: it
        serves ids a client sent (/v1/detokenize answers 400 for them)."""
        return self.decode([i for i in map(int, ids) if 0 <= i < self.vocab_size], skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None,
                            **extra) -> str:
        """The prompt text for `messages` (each {"role", "content": str}); ValueError without a template
        or when the template rejects the conversation."""
        if self._template is None:
            raise ValueError(f"the tokenizer at {self.path} has no chat template: use /v1/completions")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from None


def _raise_template_error(message: str):
    raise jinja2.TemplateError(message)


def _token_text(token) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} in some tokenizer_config.json files
        return token.get("content")
    return token


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """An HF tokenizer directory, a tiktoken BPE file, or (None) the bundled byte tokenizer."""
    p = Path(path) if path is not None else default_tokenizer_dir()
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            tik = sorted(p.glob("*.tiktoken"))
            if tik:
                return _load_tiktoken(tik[0])
            raise ValueError(f"tokenizer directory {p} has no tokenizer.json (nor a *.tiktoken file)")
        return _load_hf(p)
    if p.is_file():
        if p.name == "tokenizer.json":
            return _load_hf(p.parent)
        return _load_tiktoken(p)
    raise ValueError(f"tokenizer {p}: no such file or directory")


def _read_config(directory: Path) -> dict:
    f = directory / "tokenizer_config.json"
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from None


def _load_hf(directory: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        hf = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as e:  # the tokenizers library raises its own Exception type
        raise ValueError(f"{directory / 'tokenizer.json'}: cannot load ({e})") from None
    added = hf.get_added_tokens_decoder()
    specials = {t.content: i for i, t in added.items() if t.special}
    # the batch entry points release the GIL (`encode` holds it for the whole call: a 120k-token prompt held
    # every other Python thread for 0.3-0.5 s on a 2-core CPU); `_fast` skips the offsets nobody reads
    encode_batch = getattr(hf, "encode_batch_fast", hf.encode_batch)
    return Tokenizer(
        str(directory),
        encode=lambda text: encode_batch([text], add_special_tokens=False)[0].ids,
        decode=lambda ids: hf.decode(ids, skip_special_tokens=False),
        vocab_size=hf.get_vocab_size(with_added_tokens=True),
        special_ids=specials,
        config=_read_config(directory),
        added_tokens=[t.content for t in added.values()],
    )


def _load_tiktoken(file: Path) -> Tokenizer:
    import tiktoken

    ranks: dict[bytes, int] = {}
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:
            raise ValueError(f"{file}:{n}: expected '<base64 token> <rank>'") from None
    config = _read_config(file.parent)
    specials: dict[str, int] = {}
    for i, tok in (config.get("added_tokens_decoder") or {}).items():
        if tok.get("special", True):
            specials[tok["content"]] = int(i)
    enc = tiktoken.Encoding(name=file.stem, pat_str=config.get("pat_str", TIKTOKEN_PATTERN), mergeable_ranks=ranks,
                            special_tokens=specials)
    return Tokenizer(
        str(file),
        # special tokens in the text are the special ids (as HF tokenizers and Kimi's tiktoken tokenizer do): a
        # chat template's <|im_end|> is one token, not its characters
        encode=lambda text: enc.encode(text, allowed_special="all"),
        decode=lambda ids: enc.decode(ids, errors="replace"),
        vocab_size=max([*ranks.values(), *specials.values()]) + 1,
        special_ids=specials,
        config=config,
    )


def build_byte_tokenizer(out_dir: str | Path) -> Path:
    """Writes the bundled byte-level tokenizer (tokenizer.json + tokenizer_config.json) to `out_dir`."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of ByteLevel
    vocab = {_byte_char(b): b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIAL_TOKENS])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BYTE_SPECIAL_TOKENS[0],
        "eos_token": BYTE_SPECIAL_TOKENS[1],
        "pad_token": BYTE_SPECIAL_TOKENS[2],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 65536,
        "chat_template": BYTE_CHAT_TEMPLATE,
        "added_tokens_decoder": {str(256 + i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                                "normalized": False, "single_word": False}
                                 for i, t in enumerate(BYTE_SPECIAL_TOKENS)},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _byte_char(b: int) -> str:
    """GPT-2's byte -> printable character map (what ByteLevel pre-tokenisation produces)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


class TextStream:
    """Incremental detokenisation of one request's output with stop strings, for streaming.

    `push(new_ids)` returns the text that is safe to send now: complete characters only (a multi-byte
    character split across tokens waits for its last byte) and never a possible beginning of a stop
    string (up to len(longest stop) - 1 characters are held back). `finish()` returns the rest, cut
    before the first stop string, as OpenAI servers do. Special tokens are skipped.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] were decoded already (context for the next)
        self._read_offset = 0
        self._text = ""  # all decoded text
        self._sent = 0  # chars of _text already returned
        self._cut: int | None = None  # where a stop string starts, once one appeared

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return self._text[: self._sent]

    def _decode_new(self, final: bool) -> None:
        decode = lambda ids: self.tokenizer.decode_generated(ids, self.skip_special_tokens)  # noqa: E731
        prefix = decode(self._ids[self._prefix_offset:self._read_offset])
        full = decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self._text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._cut is None and self.stop:
            start = max(self._sent - self._holdback, 0)
            hits = [i for s in self.stop if (i := self._text.find(s, start)) >= 0]
            if hits:
                self._cut = min(hits)

    def push(self, new_ids: Sequence[int]) -> str:
        self._ids.extend(int(t) for t in new_ids)
        self._decode_new(final=False)
        end = self._cut if self._cut is not None else len(self._text) - self._holdback
        return self._take(end)

    def finish(self) -> str:
        self._decode_new(final=True)
        return self._take(self._cut if self._cut is not None else len(self._text))

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out = self._text[self._sent:end]
        self._sent = end
        return out


__all__ = ["BYTE_SPECIAL_TOKENS", "TextStream", "Tokenizer", "build_byte_tokenizer", "default_tokenizer_dir",
           "load_tokenizer"]
