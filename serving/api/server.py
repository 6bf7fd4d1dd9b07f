"""`k3jax serve`: one worker process serving OpenAI HTTP and/or the SGLang scheduler gRPC service.

    cfg = ServerConfig(http_port=8000, grpc_port=50051)
    state = ServerState.create(EngineConfig(model="k3-tiny"), cfg)
    asyncio.run(serve(state))           # until SIGINT/SIGTERM: then drain and exit

Both servers run on one asyncio loop; the engine runs on its own thread (AsyncEngine). Shutdown
(Ctrl-C / SIGTERM): stop accepting (new requests get 503 / UNAVAILABLE), let running requests finish
for up to `drain_timeout_s`, then stop the servers and the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from dataclasses import dataclass

from serving.api.tokenizer import Tokenizer, load_tokenizer
from serving.async_engine import AsyncEngine
from serving.config import EngineConfig

log = logging.getLogger("k3jax.serve")

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class ServerConfig:
    """How the worker is reached. The CLI's defaults are these field defaults."""

    host: str = "127.0.0.1"
    http_port: int | None = 8000  # None: no HTTP server
    grpc_port: int | None = None  # None: no gRPC server
    role: str = "both"  # P/D role; EngineConfig.role (`k3jax serve --role`) is the one that counts (they must agree)
    api_key: str | None = None  # HTTP: require "Authorization: Bearer <key>" on /v1 and admin routes
    served_model_name: str | None = None  # default: the model argument
    tokenizer: str | None = None  # HF tokenizer dir or tiktoken file; None: the bundled byte tokenizer
    max_body_bytes: int = 8 << 20
    max_pending: int = 512  # requests in flight before 503 / RESOURCE_EXHAUSTED
    warmup: bool = False  # compile every shape bucket before serving (GPU: steady latency; CPU: very slow)
    drain_timeout_s: float = 30.0
    reset_timeout_s: float = 10.0  # /reset_prefix_cache waits this long for the engine to go idle
    log_level: str = "info"

    def __post_init__(self):
        problems = []
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                problems.append(f"{name} must be in [0, 65535], got {port}")
        if self.http_port is None and self.grpc_port is None:
            problems.append("give an HTTP port, a gRPC port or both")
        if self.role not in ROLES:
            problems.append(f"role must be one of {ROLES}, got {self.role!r}")
        if self.max_body_bytes < 1024:
            problems.append("max_body_bytes must be >= 1024")
        if self.max_pending < 1:
            problems.append("max_pending must be >= 1")
        if self.api_key is not None and not self.api_key:
            problems.append("api_key must be non-empty when given")
        if problems:
            raise ValueError("invalid ServerConfig: " + "; ".join(problems))

    def replace(self, **changes) -> ServerConfig:
        return dataclasses.replace(self, **changes)


class ServerState:
    """What the HTTP and gRPC front ends share: engine, tokenizer, metrics, KV-event publisher."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, config: ServerConfig, ecfg: EngineConfig):
        from serving.api.kv_events import KvEventPublisher
        from serving.api.metrics import Metrics

        import k3jax

        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.ecfg = ecfg
        self.model_path = ecfg.model
        self.model_name = config.served_model_name or ecfg.model
        self.model_aliases = {self.model_name, ecfg.model}
        self.version = f"k3jax-{getattr(k3jax, '__version__', '0.1.0')}"
        self.start_time = time.time()
        self.metrics = Metrics(self.model_name, engine.stats)
        engine.listeners.append(self.metrics.observe)
        self.kv_events = KvEventPublisher(ecfg.page_size, in_hand=engine.prefill_in_hand)
        engine.step_hooks.append(self.kv_events.on_step)

    @classmethod
    def create(cls, ecfg: EngineConfig, config: ServerConfig, *, engine=None) -> ServerState:
        """Loads the tokenizer, builds (or takes) the Engine, checks they agree, starts the engine thread."""
        from serving.engine import Engine

        # the P/D role lives in EngineConfig.role; ServerConfig.role (older callers) must agree with it
        role = engine.ecfg.role if engine is not None else ecfg.role
        if config.role != role:
            if role == "both" and engine is None:
                ecfg = ecfg.replace(role=config.role)
            elif config.role == "both":
                config = config.replace(role=role)
            else:
                raise ValueError(f"ServerConfig.role {config.role!r} disagrees with EngineConfig.role {role!r}")
        tokenizer = load_tokenizer(config.tokenizer)
        if engine is None:
            engine = Engine(ecfg, detokenize=tokenizer.decode_generated)
        elif engine.detokenize is None:
            engine.detokenize = tokenizer.decode_generated
        if tokenizer.vocab_size > engine.cfg.vocab_size:
            raise ValueError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but {engine.cfg.name} only "
                             f"{engine.cfg.vocab_size}: its ids would not fit the model")
        if tokenizer.vocab_size < engine.cfg.vocab_size:  # ids the tokenizer cannot render are never sampled
            engine.sample_vocab_size = tokenizer.vocab_size
            log.info("sampling ids below %d (the tokenizer's size) of %s's %d logits", tokenizer.vocab_size,
                     engine.cfg.name, engine.cfg.vocab_size)
        if config.warmup:
            t = time.perf_counter()
            engine.runner.warmup()
            log.info("warm-up compiled every shape bucket in %.1f s", time.perf_counter() - t)
        async_engine = AsyncEngine(engine, max_pending=config.max_pending)
        state = cls(async_engine, tokenizer, config, engine.ecfg)
        async_engine.start()
        return state


async def serve(state: ServerState, *, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Runs the configured servers until SIGINT/SIGTERM (or `stop` is set), then drains and exits."""
    import uvicorn

    from serving.api.http import build_app

    cfg = state.config
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    http_server = grpc_server = http_task = None
    if cfg.grpc_port is not None:
        from serving.api.grpc_server import start_grpc_server

        grpc_server, port = await start_grpc_server(state, cfg.host, cfg.grpc_port)
        log.info("gRPC (SGLang scheduler service) on %s:%d", cfg.host, port)
        print(f"k3jax serve: gRPC listening on {cfg.host}:{port}", flush=True)
    if cfg.http_port is not None:
        uv_cfg = uvicorn.Config(build_app(state), host=cfg.host, port=cfg.http_port, log_level=cfg.log_level,
                                access_log=False, lifespan="off", timeout_graceful_shutdown=5)
        http_server = uvicorn.Server(uv_cfg)
        http_server.install_signal_handlers = lambda: None  # ours above drain first
        http_task = asyncio.create_task(http_server.serve())
        while not http_server.started and not http_task.done():
            await asyncio.sleep(0.02)
        if http_task.done():
            http_task.result()  # raises the bind error
        print(f"k3jax serve: HTTP listening on http://{cfg.host}:{cfg.http_port}", flush=True)
    disagg = state.engine.stats().get("disagg") or {}
    if "bootstrap_port" in disagg:
        print(f"k3jax serve: KV bootstrap listening on 127.0.0.1:{disagg['bootstrap_port']}", flush=True)
    print(f"k3jax serve: ready ({state.model_name}, role {cfg.role})", flush=True)
    if ready is not None:
        ready.set()
    await stop.wait()
    print("k3jax serve: draining (new requests get 503)", flush=True)
    await asyncio.to_thread(state.engine.stop, True, cfg.drain_timeout_s)
    if http_server is not None:
        http_server.should_exit = True
        await http_task
    if grpc_server is not None:
        await grpc_server.stop(grace=1.0)
    state.engine.engine.close()
    print("k3jax serve: stopped", flush=True)


__all__ = ["ROLES", "ServerConfig", "ServerState", "serve"]
