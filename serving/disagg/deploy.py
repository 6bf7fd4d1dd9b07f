"""One-command deployments: `k3jax serve --deployment configs/deploy/pd-1p1d.yaml`.

A deployment file (YAML) names the model, the engine options every worker shares, the workers (role,
ports, devices) and the router. The launcher starts an optional pool-server command, then every worker
as a `k3jax serve` process (gRPC; a prefill worker's KV bootstrap listener on its bootstrap port),
waits until all are ready, and runs the router in its own process (the embedded default whenever there
are prefill and decode workers). Ctrl-C / SIGTERM stops the router, then the workers (SIGINT: they
drain), then the pool. A worker that dies is reported and the rest keep serving (the router routes
around it) while at least one prefill and one decode worker (or one colocated worker) remain.

    model: k3-tiny
    engine: {page_size: 16, max_model_len: 4096}       # EngineConfig fields, for every worker
    workers:
      - {role: prefill, grpc_port: 50061, bootstrap_port: 8998, devices: "0"}
      - {role: decode, grpc_port: 50062, devices: "1"}
    router: {port: 8080}
    pool: {port: 7790, capacity_gb: 4}      # optional: the embedded pool server, started first;
                                            # every worker gets cache_pool: pool://127.0.0.1:7790
    warmup: true                            # optional: every worker compiles all its shape buckets before
                                            # it reports ready (`k3jax serve --warmup`)

`devices` becomes CUDA_VISIBLE_DEVICES (a GPU list per worker); "cpu" (the default) runs on the CPU.
A deployment of one `both` worker (colocated.yaml) has no router: the worker serves OpenAI HTTP itself.
Several `both` workers with a router section: the router spreads requests over them (each request whole
on one worker; serving/disagg/router.py), the colocated baseline of a P/D deployment on the same GPUs.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from serving.config import ROLES, EngineConfig


@dataclass(frozen=True)
class WorkerSpec:
    role: str
    grpc_port: int
    bootstrap_port: int | None = None  # prefill workers: where decode workers pull KV
    http_port: int | None = None  # colocated workers may serve OpenAI HTTP directly
    devices: str = "cpu"  # "cpu", or a CUDA device list such as "0" or "0,1"
    engine: dict = field(default_factory=dict)  # EngineConfig overrides for this worker

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {self.role!r}")
        if self.role == "prefill" and not self.bootstrap_port:
            raise ValueError("a prefill worker needs a bootstrap_port (decode workers pull its KV there)")
        if not isinstance(self.devices, str) or not self.devices:
            raise ValueError(f"devices must be 'cpu' or a CUDA device list like '0,1', got {self.devices!r}")


@dataclass(frozen=True)
class RouterSpec:
    host: str = "127.0.0.1"
    port: int = 8080


@dataclass(frozen=True)
class PoolSpec:
    """The embedded shared cache pool (serving.cache.pool_server) every worker of the deployment uses."""

    port: int
    capacity_gb: float

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "serving.cache.pool_server", "--host", "127.0.0.1", "--port", str(self.port),
                "--capacity-gb", str(self.capacity_gb)]

    ready = "pool-server listening"


@dataclass(frozen=True)
class DeploymentConfig:
    model: str
    workers: tuple[WorkerSpec, ...]
    engine: dict = field(default_factory=dict)
    router: RouterSpec | None = None
    pool: PoolSpec | None = None
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    warmup: bool = False

    def __post_init__(self):
        if not isinstance(self.warmup, bool):
            raise ValueError(f"warmup must be true or false, got {self.warmup!r}")
        roles = [w.role for w in self.workers]
        if not roles:
            raise ValueError("a deployment needs at least one worker")
        disaggregated = "prefill" in roles or "decode" in roles
        if disaggregated and ("prefill" not in roles or "decode" not in roles or "both" in roles):
            raise ValueError(f"a P/D deployment needs prefill and decode workers (and no 'both'), got {roles}")
        if disaggregated and self.router is None:
            raise ValueError("a P/D deployment needs a router section")
        if self.router is not None and not disaggregated and any(w.http_port for w in self.workers):
            raise ValueError("colocated workers behind a router serve gRPC only: drop their http_port")
        ports = [p for w in self.workers for p in (w.grpc_port, w.bootstrap_port, w.http_port) if p]
        if self.router is not None:
            ports.append(self.router.port)
        if self.pool is not None:
            ports.append(self.pool.port)
        if len(ports) != len(set(ports)):
            raise ValueError(f"ports must be distinct, got {ports}")
        engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
        for options in [self.engine, *(w.engine for w in self.workers)]:
            unknown = set(options) - engine_fields
            if unknown:
                raise ValueError(f"unknown engine options {sorted(unknown)} (EngineConfig fields only)")
        EngineConfig(model=self.model, **self.engine)  # ValueError for bad shared values

    @property
    def disaggregated(self) -> bool:
        return any(w.role != "both" for w in self.workers)

    @property
    def routed(self) -> bool:
        """A router process fronts the workers (always for P/D; for colocated workers when configured)."""
        return self.router is not None

    def router_config(self):
        from serving.disagg.router import RouterConfig

        ecfg = EngineConfig(model=self.model, **self.engine)
        return RouterConfig(colocated=tuple(f"{self.host}:{w.grpc_port}" for w in self.workers if w.role == "both"),
                            prefill=tuple((f"{self.host}:{w.grpc_port}", w.bootstrap_port) for w in self.workers
                                          if w.role == "prefill"),
                            decode=tuple(f"{self.host}:{w.grpc_port}" for w in self.workers if w.role == "decode"),
                            host=self.router.host, port=self.router.port, model_name=self.model,
                            tokenizer=self.tokenizer, page_size=ecfg.page_size, max_model_len=ecfg.max_model_len)


def load_deployment(path: str | Path) -> DeploymentConfig:
    """A DeploymentConfig from YAML; ValueError naming the file for anything malformed."""
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"deployment {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"deployment {path}: expected a mapping at the top level")
    try:
        known = {"model", "engine", "workers", "router", "pool", "tokenizer", "host", "warmup"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} (known: {sorted(known)})")
        workers = tuple(WorkerSpec(**w) for w in raw.get("workers") or [])
        router = RouterSpec(**raw["router"]) if raw.get("router") is not None else None
        pool = PoolSpec(**raw["pool"]) if raw.get("pool") else None
        return DeploymentConfig(model=raw.get("model", "k3-tiny"), workers=workers, engine=dict(raw.get("engine") or {}),
                                router=router, pool=pool, tokenizer=raw.get("tokenizer"), host=raw.get("host", "127.0.0.1"),
                                warmup=raw.get("warmup", False))
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"deployment {path}: {e}") from None


def worker_argv(dep: DeploymentConfig, w: WorkerSpec) -> list[str]:
    argv = [sys.executable, "-m", "k3jax", "serve", "--model", dep.model, "--role", w.role,
            "--host", dep.host, "--grpc-port", str(w.grpc_port),
            "--http-port", str(w.http_port) if w.http_port else "none"]
    if w.bootstrap_port:
        argv += ["--bootstrap-port", str(w.bootstrap_port)]
    if dep.tokenizer:
        argv += ["--tokenizer", dep.tokenizer]
    if dep.warmup:
        argv.append("--warmup")
    options = {**dep.engine, **w.engine}
    if dep.pool is not None:
        options.setdefault("cache_pool", f"pool://127.0.0.1:{dep.pool.port}")
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            argv += [flag, "none" if value is None else str(value)]
    return argv


def worker_env(w: WorkerSpec) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if w.devices == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env["CUDA_VISIBLE_DEVICES"] = w.devices
    return env


class ChildProcess:
    """A child process in its own session (SIGKILL takes its group) whose output is read on a thread;
    `wait_for(text)` blocks until a line contains `text`. echo: print each line with a name prefix (the
    deployment's console); otherwise (the API tests) a failure message carries the last lines instead."""

    def __init__(self, name: str, argv: list[str], env: dict, *, echo: bool = True, cwd: str | Path | None = None):
        self.name, self.echo, self.lines = name, echo, []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=cwd, start_new_session=True)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self):
        for line in self.proc.stdout:
            if self.echo:
                print(f"[{self.name}] {line}", end="", flush=True)
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def log(self) -> str:
        return "\n".join(self.lines[-60:])

    def _tail(self) -> str:  # an echoing child's output is on the console already
        return "" if self.echo else f":\n{self.log}"

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(text in line for line in self.lines):
                # exited and all its output read: the line cannot come any more
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before {text!r}{self._tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: no {text!r} within {timeout:.0f} s{self._tail()}")
                self._cond.wait(min(left, 1.0))

    def stop(self, grace: float = 30.0) -> int:
        """SIGINT (the child drains and exits), SIGKILL to its group after `grace` s; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._reader.join(5)
        return self.proc.returncode


def run_deployment(dep: DeploymentConfig, *, ready_timeout_s: float = 900.0, grace_s: float = 30.0) -> int:
    """Starts everything, serves until Ctrl-C / SIGTERM (or a child dies), stops everything; exit code."""
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    children: list[ChildProcess] = []
    code = 0
    try:
        if dep.pool is not None:
            pool = ChildProcess("pool", dep.pool.argv, dict(os.environ, PYTHONUNBUFFERED="1"))
            children.append(pool)
            pool.wait_for(dep.pool.ready, ready_timeout_s)
        workers = [ChildProcess(f"{w.role}{i}", worker_argv(dep, w), worker_env(w))
                   for i, w in enumerate(dep.workers)]
        children += workers
        for child in workers:
            child.wait_for("k3jax serve: ready", ready_timeout_s)
        if dep.routed:
            rcfg = dep.router_config()
            argv = [sys.executable, "-m", "k3jax", "router", "--port", str(rcfg.port), "--host", rcfg.host,
                    "--page-size", str(rcfg.page_size), "--max-model-len", str(rcfg.max_model_len),
                    "--model-name", rcfg.model_name]
            argv += [a for t, b in rcfg.prefill for a in ("--prefill", t, str(b))]
            argv += [a for t in rcfg.decode for a in ("--decode", t)]
            argv += [a for t in rcfg.colocated for a in ("--colocated", t)]
            if rcfg.tokenizer:
                argv += ["--tokenizer", rcfg.tokenizer]
            router = ChildProcess("router", argv, dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu"))
            children.append(router)
            router.wait_for("k3jax router: ready", 120)
        print(f"k3jax serve: deployment ready ({len(dep.workers)} workers)", flush=True)
        alive = dict(zip(workers, dep.workers))
        while not stopping.is_set():
            for child in [c for c in alive if c.proc.poll() is not None]:
                print(f"k3jax serve: worker {child.name} exited ({child.proc.returncode}); the others keep serving",
                      flush=True)
                del alive[child]
            roles = {w.role for w in alive.values()}
            others_dead = [c for c in children if c not in workers and c.proc.poll() is not None]
            if others_dead or not (roles >= {"prefill", "decode"} or "both" in roles):
                print("k3jax serve: the deployment cannot serve any more; stopping it", flush=True)
                code = 1
                break
            stopping.wait(0.5)
    except (RuntimeError, TimeoutError) as e:
        print(f"k3jax serve: {e}; stopping the deployment", flush=True)
        code = 1
    finally:
        for child in reversed(children):  # router first, then workers, then the pool
            child.stop(grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("k3jax serve: deployment stopped", flush=True)
    return code


__all__ = ["ChildProcess", "DeploymentConfig", "PoolSpec", "RouterSpec", "WorkerSpec", "load_deployment",
           "run_deployment", "worker_argv"]
