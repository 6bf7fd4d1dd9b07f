"""`k3jax generate`, run in-process on k3-tiny: output shape, determinism, greedy == forward's argmax
chain, and usage errors (exit code 2, one line on stderr, no traceback).

Run: python -m pytest -q tests/test_cli.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax.cli import generate, main

TINY = "k3-tiny"


def run(argv, capsys):
    """main(argv) -> (exit code, stdout, stderr); argparse's own errors arrive as SystemExit."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def gen_args(prompt="1,2,3", max_tokens=16, *extra):
    return ["generate", "--model", TINY, "--prompt-tokens", prompt, "--max-tokens", str(max_tokens), *extra]


def parse_ids(out: str) -> list[int]:
    lines = out.strip().splitlines()
    assert len(lines) == 1, f"expected one line of token ids, got {out!r}"
    return [int(t) for t in lines[0].split(",")]


@pytest.fixture(scope="module")
def cfg():
    return k3jax.load_config(TINY)


@pytest.fixture(scope="module")
def params(cfg):
    return k3jax.init_params(cfg, jax.random.key(0))  # what the CLI builds for --seed 0


CHAIN_LEN = 32  # forward_argmax_chain's one padded length: every chain below fits, and one compile serves all


def forward_argmax_chain(params, cfg, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation computed with `forward` alone: the growing sequence is padded to one fixed
    length, CHAIN_LEN (forward is causal, so the padding after the last real token changes nothing) and the
    argmax at the last real position is appended, n times. Also returns each step's top-1 minus top-2 margin."""
    length = CHAIN_LEN
    assert len(prompt) + n <= length, (len(prompt), n)
    seq, margins = list(prompt), []
    for _ in range(n):
        tokens = np.full((1, length), cfg.pad_token_id, np.int32)
        tokens[0, : len(seq)] = seq
        logits = np.asarray(k3jax.forward(params, cfg, jnp.asarray(tokens))[0, len(seq) - 1])
        top2 = np.sort(logits)[-2:]
        margins.append(float(top2[1] - top2[0]))
        seq.append(int(np.argmax(logits)))
    return seq[len(prompt):], margins


def test_generate_prints_max_tokens_in_vocab(capsys, cfg):
    code, out, err = run(gen_args(), capsys)
    assert code == 0, err
    ids = parse_ids(out)
    assert all(0 <= t < cfg.vocab_size for t in ids)
    # 16 tokens, unless the model chose eos earlier (then eos ends the line)
    assert len(ids) == 16 or (ids[-1] == cfg.eos_token_id and len(ids) < 16), ids
    assert "prefill" in err and "tokens/s" in err and "Traceback" not in err


def test_same_seed_same_output(capsys):
    sampled = gen_args("5,6,7,8", 16, "--temperature", "1.0", "--seed", "3")
    first = run(sampled, capsys)
    again = run(sampled, capsys)
    assert first[0] == again[0] == 0, first[2] + again[2]
    assert parse_ids(first[1]) == parse_ids(again[1])
    other = run(gen_args("5,6,7,8", 16, "--temperature", "1.0", "--seed", "4"), capsys)
    assert parse_ids(other[1]) != parse_ids(first[1]), "the seed has no effect"


@pytest.mark.parametrize(
    "prompt, max_tokens, page_size",
    [
        ([1, 2, 3], 16, 16),  # the README's command
        ([256, 17, 42, 5, 99, 3, 200, 150, 7, 11, 64, 128, 9], 12, 4),  # many pages, ragged page ends
    ],
)
def test_greedy_equals_forward_argmax_chain(capsys, cfg, params, prompt, max_tokens, page_size):
    code, out, err = run(gen_args(",".join(map(str, prompt)), max_tokens, "--page-size", str(page_size)), capsys)
    assert code == 0, err
    got = parse_ids(out)
    want, margins = forward_argmax_chain(params, cfg, prompt, len(got))
    if got != want:
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        pytest.fail(
            f"prefill+decode diverges from forward's argmax chain at generated token {i}: {got[i]} vs {want[i]} "
            f"(forward's top-2 margin there: {margins[i]:.3g})\n  generate: {got}\n  forward:  {want}"
        )


def test_generate_stops_at_eos(cfg, params):
    full = generate(params, cfg, [1, 2, 3], 16)  # the shapes of the README command: no new compile
    i = next(i for i in range(2, 8) if full.tokens[i] not in full.tokens[:i])  # its first appearance
    stopped = generate(params, cfg.replace(eos_token_id=full.tokens[i]), [1, 2, 3], 16)
    assert stopped.tokens == full.tokens[: i + 1] and stopped.stop == "eos"
    assert full.stop == "max_tokens" or full.tokens[-1] == cfg.eos_token_id


@pytest.mark.parametrize("fmt", ["orbax", "hf"])
def test_weights_round_trip(tmp_path, capsys, cfg, params, fmt):
    """--weights with the seed-0 parameters saved to disk generates what random init with seed 0 does."""
    from k3jax.weights import save_checkpoint, save_pretrained

    path = tmp_path / fmt
    if fmt == "orbax":
        save_checkpoint(path, cfg, params)
        extra = []  # the checkpoint's own config
    else:
        save_pretrained(path, cfg, params)
        extra = ["--model", TINY]  # checked against the directory's config.json
    want = run(gen_args(), capsys)
    argv = ["generate", "--prompt-tokens", "1,2,3", "--max-tokens", "16", "--weights", str(path), *extra]
    got = run(argv, capsys)
    assert got[0] == 0, got[2]
    assert parse_ids(got[1]) == parse_ids(want[1])
    mismatch = run(argv[:-2] + ["--model", "k3-small"] if extra else argv + ["--model", "k3-small"], capsys)
    assert mismatch[0] == 2 and "does not match the config stored with --weights" in mismatch[2]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--model", "no-such-model", "--prompt-tokens", "1"], "unknown model 'no-such-model'"),
        (gen_args("1,a,3"), "token 1 is 'a', not an integer"),
        (gen_args("1,2.5"), "token 1 is '2.5', not an integer"),
        (gen_args("1,,3"), "token 1 is '', not an integer"),
        (gen_args(""), "empty prompt"),
        (gen_args("1,263"), "prompt token 1 is 263: out of vocabulary for k3-tiny (must be 0 <= id < 263)"),
        (["generate", "--model", TINY, "--prompt-tokens=-1,2"], "prompt token 0 is -1: out of vocabulary"),
        (gen_args("1,2", 0), "--max-tokens must be >= 1, got 0"),
        (gen_args("1,2", -3), "--max-tokens must be >= 1, got -3"),
        (gen_args("1,2", 4, "--temperature", "-1"), "--temperature must be a finite number >= 0"),
        (gen_args("1,2", 4, "--page-size", "0"), "--page-size must be >= 1"),
        (gen_args("1", 4, "--weights", "/no/such/dir"), "--weights /no/such/dir: no such file or directory"),
        (gen_args("1", 4, "--weights", "/"), "--weights /: not a k3jax checkpoint nor an HF model directory"),
        (["generate", "--model", TINY], "the following arguments are required: --prompt-tokens"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--role", "router"], "role must be one of ('both', 'prefill', 'decode')"),
        (["serve", "--http-port", "none"], "give an HTTP port, a gRPC port or both"),
        (["serve", "--http-port", "70000"], "http_port must be in [0, 65535]"),
        (["serve", "--max-running", "0"], "max_running must be >= 1"),
        (["serve", "--api-key", ""], "api_key must be non-empty"),
        (["serve", "--tokenizer", "/no/such/tokenizer"], "no such file or directory"),
        (["serve", "--page-size", "x"], "invalid int value: 'x'"),
    ],
)
def test_serve_usage_errors_exit_2(capsys, argv, message):
    """`k3jax serve` checks its EngineConfig / ServerConfig flags before building anything."""
    code, out, err = run(argv, capsys)
    assert code == 2 and message in err, err
    assert "Traceback" not in err


def test_serve_flags_default_to_the_config_dataclasses():
    from k3jax.cli import build_parser
    from serving.api.server import ServerConfig
    from serving.config import EngineConfig

    ns = build_parser().parse_args(["serve"])
    assert ns.host == ServerConfig.host == "127.0.0.1" and ns.http_port == ServerConfig.http_port
    assert ns.grpc_port is None and ns.role == "both" and ns.api_key is None
    assert ns.max_running == EngineConfig.max_running and ns.prefix_cache is EngineConfig.prefix_cache
    ns = build_parser().parse_args(["serve", "--grpc-port", "50051", "--http-port", "none", "--no-prefix-cache"])
    assert (ns.grpc_port, ns.http_port, ns.prefix_cache) == (50051, None, False)


def test_bench_agentx_hands_its_arguments_to_the_replay_client(monkeypatch):
    from serving.workload import replay

    seen = []
    monkeypatch.setattr(replay, "main", lambda argv: seen.append(argv) or 0)
    assert main(["bench", "agentx", "--preset", "short", "--url", "http://127.0.0.1:1"]) == 0
    assert seen == [["--preset", "short", "--url", "http://127.0.0.1:1"]]
