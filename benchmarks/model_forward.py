"""Model forward speed on one device, reference path: prefill tokens/s, batched decode and its roofline.

    PYTHONPATH=. python benchmarks/model_forward.py --out .bench_out/model_forward.json   # k3-small, H200
    python benchmarks/model_forward.py --model k3-tiny --tokens 64 --batch 4            # CPU smoke run

Measures, for a random-init model (jitted init, so the weights are created on the device):
  (a) prefill: `k3jax.prefill` of --tokens tokens for one request (B=1) into a paged state: median
      tokens/s over --iters runs after a warm-up (compile) run.
  (b) decode: `k3jax.decode` with --batch rows, each with a --context-token history, one token per row
      per step: median ms/step over --steps synchronised steps after warm-up; tokens/s = batch / step.
      The history is synthetic (random latents and KDA states written straight into the pools, no
      prefill): the reference path's cost does not depend on the values, only on the lengths.
  (c) the decode memory roofline: bytes one step must move -- every non-expert weight (only the batch's
      rows of the embedding), the experts the batch activates (expected distinct experts under uniform
      routing, E * (1 - (1 - k/E)^B) per MoE layer), the MLA latents of every row's history, and the KDA
      recurrent + conv states read and written -- divided by a device copy bandwidth measured in the same
      run (a large elementwise jnp op, bytes read + written). ratio = measured step / floor (>= 1).
  Peak device memory comes from `memory_stats()` (absent on CPU).
Prints a table and writes the JSON to --out; the numbers go to docs/benchmarks.md with the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import k3jax
from k3jax import StepMeta


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="k3-small", help="preset name or config path (default k3-small)")
    p.add_argument("--tokens", type=int, default=8192, help="prefill tokens, one request (default 8192)")
    p.add_argument("--batch", type=int, default=64, help="decode rows (default 64)")
    p.add_argument("--context", type=int, default=8192,
                   help="history tokens per decode row (default 8192: ~4.2 GB of MLA latents + 1.2 GB of KDA "
                        "state for k3-small at batch 64, beside its 17 GB of weights -- fits one H200)")
    p.add_argument("--page-size", type=int, default=64, help="MLA page size (default 64)")
    p.add_argument("--iters", type=int, default=5, help="timed prefill runs (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps (default 20)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs/steps first (default 2)")
    p.add_argument("--backend", default="reference", help="k3jax backend for the hot ops (default reference)")
    p.add_argument("--init", choices=("auto", "jit", "eager"), default="auto",
                   help="parameter init: jit (one program) or eager (op by op, still on the device); auto = "
                        "eager: compiling the whole init took 247 s for k3-small on the H200 (2026-11-29)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="size of the bandwidth probe (default 4096 MiB on accelerators, 256 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    for name in ("tokens", "batch", "page_size", "iters", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.context < 0 or args.warmup < 1:
        p.error("--context must be >= 0 and --warmup >= 1")
    return args


def _sync(x):
    return jax.block_until_ready(x)


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def init_params(cfg, seed: int, mode: str):
    if mode == "auto":
        mode = "eager"
    t = time.perf_counter()
    if mode == "jit":
        params = jax.jit(k3jax.init_params, static_argnums=0)(cfg, jax.random.key(seed))
    else:
        params = k3jax.init_params(cfg, jax.random.key(seed))
    _sync(params)
    return params, mode, time.perf_counter() - t


def copy_bandwidth(mib: int, reps: int = 10) -> float:
    """Bytes/s of a large elementwise op (read + write), median of `reps`."""
    n = mib * 2**20 // 4
    x = _sync(jnp.ones((n,), jnp.float32))
    f = jax.jit(lambda v: v * 1.0001 + 1.0)
    _sync(f(x))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        _sync(f(x))
        times.append(time.perf_counter() - t)
    return 2 * n * 4 / statistics.median(times)


def bench_prefill(params, cfg, args) -> dict:
    n, ps = args.tokens, args.page_size
    num_pages = -(-n // ps)
    state = k3jax.init_state(cfg, num_slots=1, num_pages=num_pages, page_size=ps)
    rng = np.random.default_rng(args.seed)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, n), dtype=np.int32))
    meta = StepMeta(
        slots=jnp.zeros((1,), jnp.int32),
        page_table=jnp.arange(num_pages, dtype=jnp.int32)[None],
        context_lens=jnp.zeros((1,), jnp.int32),
        lengths=jnp.full((1,), n, jnp.int32),
    )
    times = []
    for i in range(args.warmup + args.iters):  # every run rewrites the same pages from position 0
        t = time.perf_counter()
        logits, state = k3jax.prefill(params, cfg, state, tokens, meta, backend_name=args.backend)
        _sync(logits)
        if i == 0:
            first = time.perf_counter() - t
        elif i >= args.warmup:
            times.append(time.perf_counter() - t)
    finite = bool(jnp.isfinite(logits).all())
    del state
    ms = _median_ms(times)
    return {"tokens": n, "first_call_s": first, "median_ms": ms, "tokens_per_s": n / (ms / 1e3),
            "all_ms": [x * 1e3 for x in times], "logits_finite": finite}


def synthetic_history(cfg, batch: int, pages_per_row: int, page_size: int, seed: int):
    """A decode state whose pools hold random latents and small random KDA/conv states."""

    @jax.jit
    def build(key):
        k1, k2, k3 = jax.random.split(key, 3)
        act = jnp.dtype(cfg.dtype)
        kv = jax.random.normal(k1, (cfg.num_mla_layers, batch * pages_per_row, page_size, cfg.latent_cache_dim), act)
        kda = 0.01 * jax.random.normal(
            k2, (cfg.num_kda_layers, batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32)
        conv = jax.random.normal(k3, (cfg.num_kda_layers, batch, cfg.kda_conv_kernel - 1, cfg.conv_channels), act)
        return k3jax.DecodeState(kda=kda, conv=conv, kv_pages=kv)

    like = jax.eval_shape(lambda: k3jax.init_state(cfg, batch, batch * pages_per_row, page_size))
    state = _sync(build(jax.random.key(seed)))
    same = jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), state, like)
    if not all(jax.tree.leaves(same)):
        raise RuntimeError("synthetic_history no longer matches k3jax.init_state's layout")
    return state


def bench_decode(params, cfg, args) -> dict:
    b, ctx, ps = args.batch, args.context, args.page_size
    total_steps = args.warmup + args.steps
    pages_per_row = -(-(ctx + total_steps) // ps)
    state = synthetic_history(cfg, b, pages_per_row, ps, args.seed)
    page_table = jnp.arange(b * pages_per_row, dtype=jnp.int32).reshape(b, pages_per_row)
    slots = jnp.arange(b, dtype=jnp.int32)
    ones = jnp.ones((b,), jnp.int32)
    next_token = jax.jit(lambda logits: jnp.argmax(logits, -1).astype(jnp.int32))
    tokens = jnp.asarray(np.random.default_rng(args.seed).integers(0, cfg.vocab_size, (b,), dtype=np.int32))
    _sync(next_token(jnp.zeros((b, cfg.vocab_size), jnp.float32)))
    times = []
    for i in range(total_steps):
        meta = StepMeta(slots, page_table, jnp.full((b,), ctx + i, jnp.int32), ones)
        t = time.perf_counter()
        logits, state = k3jax.decode(params, cfg, state, tokens, meta, backend_name=args.backend)
        tokens = _sync(next_token(logits))
        if i == 0:
            first = time.perf_counter() - t
        elif i >= args.warmup:
            times.append(time.perf_counter() - t)
    finite = bool(jnp.isfinite(logits).all())
    del state
    ms = _median_ms(times)
    return {"batch": b, "context": ctx, "first_call_s": first, "median_ms_per_step": ms,
            "mean_ms_per_step": statistics.mean(times) * 1e3, "tokens_per_s": b / (ms / 1e3),
            "logits_finite": finite}


def _nbytes(tree) -> int:
    """Bytes of a pytree of arrays or ShapeDtypeStructs."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def decode_bytes(params, cfg, batch: int, context: int) -> dict:
    """Bytes one decode step must move at the least (see the module docstring). params may be shapes."""
    expert_bytes = activated = 0.0
    for lp in params["layers"]:
        mlp = lp["mlp"]
        if "experts" not in mlp:
            continue
        layer_bytes = _nbytes(mlp["experts"])
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        distinct = e * (1 - (1 - k / e) ** batch)
        expert_bytes += layer_bytes
        activated += layer_bytes * distinct / e
    total_weights = _nbytes(params)
    embed = params["embed"]
    embed_rows = batch * embed.shape[1] * jnp.dtype(embed.dtype).itemsize if not cfg.tie_word_embeddings else 0
    dense_weights = total_weights - expert_bytes - (_nbytes(embed) if not cfg.tie_word_embeddings else 0) + embed_rows
    act = jnp.dtype(cfg.dtype).itemsize
    kv = cfg.num_mla_layers * batch * (context + 1) * cfg.latent_cache_dim * act  # read history (+ write one)
    kda = 2 * cfg.num_kda_layers * batch * cfg.kda_num_heads * cfg.kda_head_dim**2 * 4  # fp32, read + write
    conv = 2 * cfg.num_kda_layers * batch * (cfg.kda_conv_kernel - 1) * cfg.conv_channels * act
    parts = {"dense_weights": dense_weights, "activated_experts": activated, "mla_latents": kv,
             "kda_state": kda, "conv_state": conv}
    parts["total"] = sum(parts.values())
    parts["all_weights"] = total_weights
    return parts


def peak_memory() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return stats.get("peak_bytes_in_use") if stats else None


def _gb(x) -> str:
    if x is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = jax.devices()[0]
    cfg = k3jax.load_config(args.model)
    copy_mib = args.copy_mib or (256 if device.platform == "cpu" else 4096)
    print(f"model_forward: {cfg.name} ({cfg.dtype}) on {device.device_kind} [{device.platform}], "
          f"jax {jax.__version__}, backend={args.backend}", file=sys.stderr, flush=True)

    weights = _nbytes(k3jax.param_shapes(cfg))
    pages_per_row = -(-(args.context + args.warmup + args.steps) // args.page_size)
    decode_state = _nbytes(jax.eval_shape(
        lambda: k3jax.init_state(cfg, args.batch, args.batch * pages_per_row, args.page_size)))
    scores = cfg.mla_num_heads * args.tokens**2 * 4  # one layer's fp32 prefill scores (reference attention)
    print(f"memory estimate: weights {_gb(weights)}, decode state {_gb(decode_state)}, prefill attention scores "
          f"{_gb(scores)} per MLA layer (x2 with the softmax)", file=sys.stderr, flush=True)

    params, init_mode, init_s = init_params(cfg, args.seed, args.init)
    n_params = k3jax.count_params(params)
    weights_in_use = (device.memory_stats() or {}).get("bytes_in_use")
    bandwidth = copy_bandwidth(copy_mib)
    prefill = bench_prefill(params, cfg, args)
    peak_after_prefill = peak_memory()
    decode = bench_decode(params, cfg, args)
    moved = decode_bytes(params, cfg, args.batch, args.context)
    floor_ms = moved["total"] / bandwidth * 1e3
    roofline = {"bytes_per_step": moved, "copy_bandwidth_gbps": bandwidth / 1e9, "copy_probe_mib": copy_mib,
                "floor_ms_per_step": floor_ms, "ratio": decode["median_ms_per_step"] / floor_ms,
                "attained_gbps": moved["total"] / (decode["median_ms_per_step"] / 1e3) / 1e9}

    result = {
        "benchmark": "model_forward",
        "command": "python benchmarks/model_forward.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"device": device.device_kind, "platform": device.platform, "num_devices": jax.device_count(),
                    "host": platform.node(), "jax": jax.__version__, "python": platform.python_version()},
        "model": {"name": cfg.name, "dtype": cfg.dtype, "params": n_params,
                  "weight_bytes": moved["all_weights"], "init": init_mode, "init_s": init_s},
        "args": vars(args),
        "prefill": prefill,
        "decode": decode,
        "decode_roofline": roofline,
        "memory": {"weights_bytes_in_use": weights_in_use, "peak_after_prefill": peak_after_prefill,
                   "peak_bytes_in_use": peak_memory()},
    }

    rows = [
        ("model", f"{cfg.name}, {n_params / 1e9:.4g} B params, {_gb(moved['all_weights'])} ({init_mode} init {init_s:.1f} s)"),
        ("prefill", f"B=1 T={prefill['tokens']} page {args.page_size}: {prefill['median_ms']:.1f} ms, "
                    f"{prefill['tokens_per_s']:,.0f} tokens/s (first call {prefill['first_call_s']:.1f} s)"),
        ("decode", f"B={decode['batch']} context {decode['context']}: {decode['median_ms_per_step']:.2f} ms/step, "
                   f"{decode['tokens_per_s']:,.0f} tokens/s (first call {decode['first_call_s']:.1f} s)"),
        ("decode bytes/step", f"{_gb(moved['total'])} = dense weights {_gb(moved['dense_weights'])} + experts "
                              f"{_gb(moved['activated_experts'])} + MLA {_gb(moved['mla_latents'])} + KDA "
                              f"{_gb(moved['kda_state'] + moved['conv_state'])}"),
        ("copy bandwidth", f"{bandwidth / 1e9:,.1f} GB/s (read + write, {copy_mib} MiB)"),
        ("decode roofline", f"floor {floor_ms:.3f} ms/step; measured / floor = {roofline['ratio']:.1f}x "
                            f"({roofline['attained_gbps']:,.1f} GB/s attained)"),
        ("peak memory", f"{_gb(result['memory']['peak_bytes_in_use'])} (after prefill {_gb(peak_after_prefill)})"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"\n{'metric':<{width}} | value\n{'-' * width}-|-{'-' * 60}")
    for k, v in rows:
        print(f"{k:<{width}} | {v}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
