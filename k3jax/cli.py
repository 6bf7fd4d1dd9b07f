"""The `k3jax` command line: `k3jax generate` and `k3jax serve`; `bench` and `plan` slot in as subcommands.

    k3jax generate --model k3-tiny --prompt-tokens 1,2,3 --max-tokens 16
    k3jax serve --model k3-tiny [--http-port 8000] [--grpc-port 50051] [--role both] [--api-key KEY]
    k3jax serve --deployment configs/deploy/pd-1p1d.yaml     # workers + router, one command
    k3jax router --prefill 127.0.0.1:50061 8998 --decode 127.0.0.1:50062 [--port 8080]

`serve` runs the OpenAI-compatible HTTP server and/or the SGLang-scheduler gRPC worker (for the SMG
gateway) on 127.0.0.1 by default, until Ctrl-C, which drains running requests and exits. Its flags are
the fields of `serving.config.EngineConfig` and `serving.api.server.ServerConfig` (defaults included).

prints the generated token ids (one comma-separated line) on stdout and a timing line on stderr.
Usage errors (unknown model, bad token ids, empty prompt, max-tokens < 1, ...) exit with code 2 and a
one-line message, never a traceback. Defaults live once, in the frozen `GenerateArgs` dataclass.

Generation is the serving path on one request: `prefill` of the prompt into a one-slot `DecodeState`,
then one `decode` step per token, sampling on the host (greedy at temperature 0, else Gumbel-max with
the seed), stopping at `max_tokens` or at the model's eos token (which is printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import k3jax
from k3jax.fuse import fuse_for_serving
from k3jax.model import StepMeta

PROG = "k3jax"
DEFAULT_MODEL = "k3-tiny"
COMPILE_CACHE_ENV = "K3JAX_COMPILE_CACHE"  # directory of the persistent XLA cache; "off" disables it
DEFAULT_COMPILE_CACHE = Path.home() / ".cache" / "k3jax" / "xla"


class UsageError(Exception):
    """A problem with what the user asked for: reported as one line on stderr, exit code 2."""


# ---------------------------------------------------------------------------------------------------
# generate


@dataclass(frozen=True)
class GenerateArgs:
    """Arguments of `k3jax generate`; the CLI's defaults are these field defaults."""

    model: str | None = None  # preset name, YAML file or HF config; None: DEFAULT_MODEL, or --weights' own
    prompt_tokens: tuple[int, ...] = ()  # required; 0 <= id < vocab_size
    max_tokens: int = 16  # tokens to generate (the first comes from prefill)
    seed: int = 0  # random-init key and sampling seed
    temperature: float = 0.0  # 0 = greedy
    page_size: int = 16  # MLA page size of the decode state
    weights: str | None = None  # orbax checkpoint, or HF safetensors directory; None = random init

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise UsageError("--prompt-tokens is empty: give at least one token id")
        if self.max_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.page_size < 1:
            raise UsageError(f"--page-size must be >= 1, got {self.page_size}")
        if not self.temperature >= 0.0 or math.isinf(self.temperature):
            raise UsageError(f"--temperature must be a finite number >= 0, got {self.temperature}")


@dataclass(frozen=True)
class GenerateResult:
    tokens: list[int]  # generated ids, eos included when it stopped there
    stop: str  # "eos" or "max_tokens"
    setup_s: float  # parameter init / load plus compilation
    prefill_s: float  # the prefill step alone (compiled)
    decode_s: float  # all decode steps (compiled)

    @property
    def decode_steps(self) -> int:
        return len(self.tokens) - 1


def parse_token_ids(text: str) -> tuple[int, ...]:
    """'1,2, 3' -> (1, 2, 3). Raises argparse.ArgumentTypeError with a readable message."""
    parts = [p.strip() for p in text.split(",")]
    if parts == [""]:
        raise argparse.ArgumentTypeError("empty prompt: give at least one token id, e.g. 1,2,3")
    ids = []
    for i, p in enumerate(parts):
        try:
            ids.append(int(p))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"token {i} is {p!r}, not an integer (expected comma-separated ids like 1,2,3)"
            ) from None
    return tuple(ids)


def check_prompt(prompt: Sequence[int], max_tokens: int, cfg) -> None:
    """Token ids inside the vocabulary, and the whole sequence within the model's positions."""
    for i, t in enumerate(prompt):
        if not 0 <= t < cfg.vocab_size:
            raise UsageError(
                f"prompt token {i} is {t}: out of vocabulary for {cfg.name} "
                f"(must be 0 <= id < {cfg.vocab_size})"
            )
    if len(prompt) + max_tokens > cfg.max_position_embeddings:
        raise UsageError(
            f"prompt ({len(prompt)}) + max tokens ({max_tokens}) exceeds {cfg.name}'s "
            f"max_position_embeddings ({cfg.max_position_embeddings})"
        )


def _prefill_len(n: int) -> int:
    """Prompt length padded to a power of two (>= 16), so nearby prompt lengths share one compile."""
    return max(16, 1 << (n - 1).bit_length())


def load_weights(path: str):
    """(cfg, params) from a k3jax orbax checkpoint (`save_checkpoint`) or an HF safetensors directory."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"--weights {path}: no such file or directory")
    config_file = p / "config.json"
    if not config_file.is_file():
        raise UsageError(f"--weights {path}: not a k3jax checkpoint nor an HF model directory (no config.json)")
    try:
        is_orbax = json.loads(config_file.read_text()).get("format") == "k3jax-orbax"
        return k3jax.load_checkpoint(p) if is_orbax else k3jax.load_pretrained(p)
    except (ValueError, OSError) as e:  # a malformed or incomplete checkpoint: the user's input
        raise UsageError(f"--weights {path}: {e}") from None


def generate(
    params,
    cfg,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    temperature: float = GenerateArgs.temperature,
    seed: int = GenerateArgs.seed,
    page_size: int = GenerateArgs.page_size,
    warm: Callable[[], None] | None = None,
) -> GenerateResult:
    """Generates up to `max_tokens` ids after `prompt` with prefill + decode on a one-slot state.

    `warm`, if given, is waited for before the first step (e.g. background compilation).
    """
    t0 = time.perf_counter()
    n = len(prompt)
    num_pages = -(-(n + max_tokens) // page_size)
    state = k3jax.init_state(cfg, num_slots=1, num_pages=num_pages, page_size=page_size)
    # Step inputs are host (numpy) arrays: jit moves them, with no per-step eager jnp ops.
    page_table = np.arange(num_pages, dtype=np.int32)[None]
    slots = np.zeros((1,), np.int32)
    tokens = np.zeros((1, _prefill_len(n)), np.int32)
    tokens[0, :n] = prompt
    rng = np.random.default_rng(seed)

    def sample(logits) -> int:
        x = np.asarray(logits[0], np.float64)
        if temperature > 0:
            x = x / temperature + rng.gumbel(size=x.shape)
        return int(np.argmax(x))

    if warm is not None:
        warm()
    setup = time.perf_counter() - t0

    t = time.perf_counter()
    meta = StepMeta(slots, page_table, np.zeros((1,), np.int32), np.full((1,), n, np.int32))
    logits, state = k3jax.prefill(params, cfg, state, tokens, meta)
    out = [sample(logits)]
    prefill_s = time.perf_counter() - t

    t = time.perf_counter()
    one = np.ones((1,), np.int32)
    while len(out) < max_tokens and out[-1] != cfg.eos_token_id:
        meta = StepMeta(slots, page_table, np.full((1,), n + len(out) - 1, np.int32), one)
        logits, state = k3jax.decode(params, cfg, state, np.asarray([out[-1]], np.int32), meta)
        out.append(sample(logits))
    decode_s = time.perf_counter() - t
    jax.block_until_ready(state)
    stop = "eos" if out[-1] == cfg.eos_token_id else "max_tokens"
    return GenerateResult(out, stop, setup, prefill_s, decode_s)


def _compile_steps(cfg, params_shape, prompt_len: int, max_tokens: int, page_size: int) -> list[Callable]:
    """Jobs that compile prefill and decode for these shapes (filling the jit caches `generate` hits)."""
    num_pages = -(-(prompt_len + max_tokens) // page_size)
    state = jax.eval_shape(lambda: k3jax.init_state(cfg, num_slots=1, num_pages=num_pages, page_size=page_size))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    meta = StepMeta(i32(1), i32(1, num_pages), i32(1), i32(1))
    prefill = lambda: k3jax.prefill.trace(params_shape, cfg, state, i32(1, _prefill_len(prompt_len)), meta).lower().compile()
    decode = lambda: k3jax.decode.trace(params_shape, cfg, state, i32(1), meta).lower().compile()
    return [prefill, decode] if max_tokens > 1 else [prefill]


def run_generate(args: GenerateArgs) -> int:
    t_start = time.perf_counter()
    enable_compile_cache()  # before anything compiles
    weights = None
    if args.weights is not None:
        cfg, weights = load_weights(args.weights)  # the checkpoint carries its config
    if args.model is not None or weights is None:
        try:
            named = k3jax.load_config(args.model or DEFAULT_MODEL)
        except (ValueError, OSError) as e:
            raise UsageError(str(e)) from None
        if weights is not None and named.replace(name=cfg.name) != cfg:
            raise UsageError(f"--model {args.model} does not match the config stored with --weights {args.weights}")
        cfg = named
    check_prompt(args.prompt_tokens, args.max_tokens, cfg)

    with ThreadPoolExecutor(max_workers=2) as pool:
        shapes = k3jax.param_shapes(cfg) if weights is None else jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), weights)
        # one device: the serving layout (k3jax.fuse: each layer's input projections as one GEMM)
        shapes = jax.eval_shape(lambda p: fuse_for_serving(p, cfg), shapes)
        # Compile both steps in the background while the parameters are being initialised.
        jobs = [pool.submit(job) for job in _compile_steps(cfg, shapes, len(args.prompt_tokens), args.max_tokens,
                                                           args.page_size)]
        params = k3jax.init_params(cfg, jax.random.key(args.seed)) if weights is None else weights
        weights = None  # the unfused tree is not kept beside the fused one
        params = fuse_for_serving(params, cfg)
        jax.block_until_ready(params)
        result = generate(
            params, cfg, args.prompt_tokens, args.max_tokens, temperature=args.temperature, seed=args.seed,
            page_size=args.page_size, warm=lambda: [j.result() for j in jobs],
        )
    setup_s = time.perf_counter() - t_start - result.prefill_s - result.decode_s

    print(",".join(map(str, result.tokens)), flush=True)
    rate = f"{result.decode_steps / result.decode_s:.1f} tokens/s" if result.decode_steps else "n/a"
    print(
        f"{PROG} generate: {cfg.name}, {len(args.prompt_tokens)} prompt tokens -> {len(result.tokens)} tokens "
        f"(stop: {result.stop}) | prefill {result.prefill_s * 1e3:.1f} ms | decode {result.decode_steps} steps, "
        f"{rate} | setup {setup_s:.1f} s (import, init, compile) | total {time.perf_counter() - t_start:.1f} s",
        file=sys.stderr,
    )
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    d = GenerateArgs
    p = sub.add_parser("generate", help="generate token ids from a prompt of token ids",
                       description="Prefill a prompt of token ids, then decode; prints the generated ids.")
    p.add_argument("--model", default=d.model, help=f"preset name, YAML file or HF config dir (default "
                                                    f"{DEFAULT_MODEL}, or the config stored with --weights)")
    p.add_argument("--prompt-tokens", type=parse_token_ids, required=True, metavar="IDS",
                   help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"tokens to generate (default {d.max_tokens})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"init and sampling seed (default {d.seed})")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help=f"sampling temperature, 0 = greedy (default {d.temperature})")
    p.add_argument("--page-size", type=int, default=d.page_size, help=f"MLA page size (default {d.page_size})")
    p.add_argument("--weights", default=d.weights, metavar="DIR_OR_CKPT",
                   help="orbax checkpoint or HF safetensors directory (default: random init)")
    p.set_defaults(_run=lambda ns: run_generate(_to_dataclass(GenerateArgs, ns)))


# ---------------------------------------------------------------------------------------------------
# serve

# EngineConfig fields that are not plain CLI values (set them from Python: k3jax.serve / Engine(...))
_SERVE_SKIP = {"spec_fixed_accepted"}
_NONE_WORDS = ("none", "off")


def _optional(kind):
    def parse(text: str):
        return None if text.strip().lower() in _NONE_WORDS else kind(text)
    parse.__name__ = kind.__name__
    return parse


def _dataclass_flags(parser: argparse.ArgumentParser, cls, skip=()) -> list[str]:
    """One flag per field of a frozen config dataclass, default and type taken from the field."""
    import typing

    hints = typing.get_type_hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        hint = hints[f.name]
        args = set(typing.get_args(hint))
        optional = type(None) in args
        kind = (args - {type(None)}).pop() if optional else hint
        if kind not in (int, float, str, bool):
            continue
        flag = "--" + f.name.replace("_", "-")
        shown = "none" if f.default is None else f.default
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f"(default {shown})")
        else:
            parser.add_argument(flag, dest=f.name, type=_optional(kind) if optional else kind, default=f.default,
                                metavar=kind.__name__.upper(), help=f"(default {shown})")
        names.append(f.name)
    return names


def run_serve(ns: argparse.Namespace) -> int:
    import asyncio
    import logging

    from serving.api.server import ServerConfig, ServerState, serve
    from serving.config import EngineConfig

    if ns.deployment is not None:  # a whole P/D (or colocated) deployment: serving.disagg.deploy
        from serving.disagg.deploy import load_deployment, run_deployment

        try:
            dep = load_deployment(ns.deployment)
        except ValueError as e:
            raise UsageError(str(e)) from None
        return run_deployment(dep)

    try:
        ecfg = EngineConfig(**{name: getattr(ns, name) for name in ns._engine_fields})
        scfg = ServerConfig(**{name: getattr(ns, name) for name in ns._server_fields})
    except ValueError as e:
        raise UsageError(str(e)) from None
    logging.basicConfig(level=scfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    enable_compile_cache()
    try:
        state = ServerState.create(ecfg, scfg)
    except (ValueError, OSError) as e:  # unknown model, bad tokenizer path, tokenizer/model mismatch
        raise UsageError(str(e)) from None
    # Everything allocated so far (jax, the model, compiled programs) lives as long as this process: out of the
    # collector's view, a full collection no longer walks it (k3-tiny: 95 ms -> 1.3 ms; 157 ms pauses measured on
    # the request path's event loop with jax loaded, 2026-11-30), as SGLang and vLLM freeze their startup heap.
    # Here and not in ServerState.create: a test process that builds many servers would keep their cycles alive.
    gc.collect()
    gc.freeze()
    try:
        asyncio.run(serve(state))
    except OSError as e:  # port in use
        state.engine.stop(drain=False, timeout=5)
        raise UsageError(str(e)) from None
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from serving.api.server import ServerConfig
    from serving.config import EngineConfig

    p = sub.add_parser("serve", help="serve a model over OpenAI HTTP and/or SGLang-scheduler gRPC",
                       description="Serve a model: OpenAI-compatible HTTP (--http-port), the SGLang scheduler gRPC "
                                   "service for the SMG gateway (--grpc-port), Prometheus /metrics. Ctrl-C drains "
                                   "running requests and exits. Ports take 'none' to turn a server off.")
    p.add_argument("--deployment", default=None, metavar="YAML",
                   help="start a whole deployment instead (workers, pool, router; configs/deploy/*.yaml)")
    engine_fields = _dataclass_flags(p.add_argument_group("engine (EngineConfig)"), EngineConfig, _SERVE_SKIP)
    # the P/D role is EngineConfig.role (--role); ServerConfig.role follows it
    server_fields = _dataclass_flags(p.add_argument_group("server (ServerConfig)"), ServerConfig, {"role"})
    p.set_defaults(_run=run_serve, _engine_fields=engine_fields, _server_fields=server_fields)


def _add_router(sub: argparse._SubParsersAction) -> None:
    from serving.disagg.router import RouterConfig

    d = RouterConfig
    p = sub.add_parser("router", help="OpenAI HTTP router in front of prefill and decode gRPC workers",
                       description="Routes each request to a prefill worker (least estimated outstanding prefill "
                                   "work) and a decode worker (least load) with one bootstrap room; streams the "
                                   "decode leg back.")
    p.add_argument("--prefill", nargs=2, action="append", default=[], metavar=("HOST:PORT", "BOOTSTRAP_PORT"),
                   help="a prefill worker's gRPC address and KV bootstrap port (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="HOST:PORT",
                   help="a decode worker's gRPC address (repeatable)")
    p.add_argument("--colocated", action="append", default=[], metavar="HOST:PORT",
                   help="a colocated (role both) worker's gRPC address, instead of --prefill/--decode (repeatable)")
    p.add_argument("--host", default=d.host, help=f"(default {d.host})")
    p.add_argument("--port", type=int, default=d.port, help=f"(default {d.port})")
    p.add_argument("--model-name", default=d.model_name, help=f"(default {d.model_name})")
    p.add_argument("--tokenizer", default=d.tokenizer, help="the workers' tokenizer (default: the bundled one)")
    p.add_argument("--page-size", type=int, default=d.page_size, help=f"the workers' page size (default {d.page_size})")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help=f"(default {d.max_model_len})")
    p.add_argument("--health-interval-s", type=float, default=d.health_interval_s,
                   help=f"how often a worker marked failed is sent a HealthCheck (default {d.health_interval_s})")
    p.add_argument("--healthy-after", type=int, default=d.healthy_after,
                   help=f"healthy answers in a row that put it back into rotation (default {d.healthy_after})")
    p.set_defaults(_run=run_router)


def run_router(ns: argparse.Namespace) -> int:
    import asyncio

    from serving.disagg.router import RouterConfig, run_router as serve_router

    try:
        prefill = tuple((t, int(b)) for t, b in ns.prefill)
        cfg = RouterConfig(prefill=prefill, decode=tuple(ns.decode), colocated=tuple(ns.colocated), host=ns.host, port=ns.port,
                           model_name=ns.model_name, tokenizer=ns.tokenizer, page_size=ns.page_size,
                           max_model_len=ns.max_model_len, health_interval_s=ns.health_interval_s,
                           healthy_after=ns.healthy_after)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        asyncio.run(serve_router(cfg))
    except OSError as e:  # port in use
        raise UsageError(str(e)) from None
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks against a running server",
                       description="Benchmarks that drive a running k3jax (or any OpenAI-compatible) server.")
    kinds = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    agentx = kinds.add_parser("agentx", add_help=False,
                              help="replay AgentX-like agent sessions (python -m serving.workload.replay; "
                                   "`k3jax bench agentx --help` lists its options)")
    agentx.add_argument("replay_args", nargs=argparse.REMAINDER)
    agentx.set_defaults(_run=run_bench_agentx)
    sweep = kinds.add_parser("sweep", add_help=False,
                             help="the AgentX replay at several concurrency levels (--concurrency 1,2,4): "
                                  "per-level reports, sweep.json/csv, Pareto and throughput-over-time PNGs")
    sweep.add_argument("replay_args", nargs=argparse.REMAINDER)
    sweep.set_defaults(_run=run_bench_sweep)
    compare = kinds.add_parser("compare", add_help=False,
                               help="throughput ratio of two saved sweeps at matched P90 interactivity")
    compare.add_argument("replay_args", nargs=argparse.REMAINDER)
    compare.set_defaults(_run=run_bench_compare)


def run_bench_agentx(ns: argparse.Namespace) -> int:
    from serving.workload import replay

    return replay.main(ns.replay_args)


def run_bench_sweep(ns: argparse.Namespace) -> int:
    from serving.workload import sweep

    return sweep.main(ns.replay_args)


def run_bench_compare(ns: argparse.Namespace) -> int:
    from serving.workload import sweep

    return sweep.compare_main(ns.replay_args)


_BENCH_RUNNERS = {"agentx": run_bench_agentx, "sweep": run_bench_sweep, "compare": run_bench_compare}


# ---------------------------------------------------------------------------------------------------
# entry point


def enable_compile_cache() -> Path | None:
    """Turns on JAX's persistent compilation cache (a second `generate` skips most compilation).

    Uses $K3JAX_COMPILE_CACHE, else ~/.cache/k3jax/xla; "off" (or "") disables it. A cache directory
    the user already configured for JAX (JAX_COMPILATION_CACHE_DIR) is left as it is.
    """
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    where = os.environ.get(COMPILE_CACHE_ENV, str(DEFAULT_COMPILE_CACHE))
    if where.strip().lower() in ("", "off", "0", "false", "none"):
        return None
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return Path(where)


def _to_dataclass(cls, ns: argparse.Namespace):
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Kimi K3 in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    _add_router(sub)
    _add_bench(sub)  # later: plan -- one _add_<name>(sub) each
    from k3jax.plan import add_parser as _add_plan  # the capacity planner owns its flags

    _add_plan(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (argparse's own usage errors raise SystemExit(2))."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in _BENCH_RUNNERS:
        # each bench has its own parser for every option (argparse's REMAINDER cannot lead with one)
        return _BENCH_RUNNERS[argv[1]](argparse.Namespace(replay_args=argv[2:]))
    ns = build_parser().parse_args(argv)
    try:
        return ns._run(ns)
    except UsageError as e:
        print(f"{PROG} {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
