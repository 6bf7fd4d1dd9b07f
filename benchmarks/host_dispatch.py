"""Host cost of launching a kernel: how long the host takes to enqueue a jitted chain of N calls of one kernel,
against the GPU time of the same chain (one GPU).

    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/host_dispatch.py --out $OUT/dispatch.json
    python benchmarks/host_dispatch.py --smoke                                       # CPU, tiny, interpret

Why: in the k3-small decode step the Mosaic GPU MLA kernel summed to fewer kernel-microseconds than the Triton
one, yet the step got slower, with the GPU idle in short gaps between kernels (docs/benchmarks.md, 2026-11-30):
the host looked too slow to keep the queue full. A jitted function returns once the host has enqueued every
kernel (asynchronous dispatch), so the time until it returns is the host's part. Each chain is one jit of
--chain calls that depend on each other (the next call's query is scaled by the last output's first element),
as the MLA layers of a step are:
  triton / mosaic   mla_decode at k3-small's decode shape (16 heads, latent 512 + 64, 64-token pages,
                    B64 x 8192-token histories, stacked 7-layer pool), plan built on device as the model does;
  xla               a small elementwise op of the same output size (the floor: XLA's own thunk);
For each: host ms per call (median over --reps of the call's return time / chain), GPU ms per call (wall time
to completion / chain, after warm-up), and their ratio (>= 1: the host sets the pace when kernels run back to
back). Prints a table; JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import mla_decode as md


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chain", type=int, default=32, help="dependent calls per jitted chain (default 32)")
    p.add_argument("--reps", type=int, default=20, help="timed chain runs (default 20)")
    p.add_argument("--kernels", default="xla,triton,mosaic", help="comma list of xla, triton, mosaic")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, Pallas interpreter, Triton only")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.context, args.heads, args.chain, args.reps = 2, 256, 16, 3, 2
        args.kernels = ",".join(k for k in args.kernels.split(",") if k != "mosaic")
    args.kernel_list = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not args.kernel_list or any(k not in ("xla", "triton", "mosaic") for k in args.kernel_list):
        p.error(f"--kernels takes xla, triton, mosaic; got {args.kernels!r}")
    if args.chain < 1 or args.reps < 1:
        p.error("--chain and --reps must be >= 1")
    return args


def mla_inputs(args, rng):
    c_dim, r_dim, page, layers = 512, 64, 64, 7
    pages_per_row = -(-args.context // page)
    b, h = args.batch, args.heads
    bf = jnp.bfloat16
    q_latent = jnp.asarray(rng.standard_normal((b, 1, h, c_dim)), bf)
    q_pe = jnp.asarray(rng.standard_normal((b, 1, h, r_dim)), bf)
    kv = jnp.asarray(rng.standard_normal((layers, b * pages_per_row, page, c_dim + r_dim)) * 0.5, bf)
    page_table = jnp.arange(b * pages_per_row, dtype=jnp.int32).reshape(b, pages_per_row)
    positions = jnp.full((b, 1), args.context - 1, jnp.int32)
    return q_latent, q_pe, kv, page_table, positions


def chain_fn(kernel: str, args):
    """The jitted chain of args.chain dependent calls of `kernel`."""
    interpret = args.smoke

    def mla_step(q_latent, q_pe, kv, page_table, positions, layer):
        return md.mla_decode(q_latent, q_pe, kv, page_table, positions, kv_lora_rank=512, scale=0.07, layer=layer,
                             backend=kernel, interpret=interpret)

    @jax.jit
    def chain(q_latent, q_pe, kv, page_table, positions):
        out = None
        for i in range(args.chain):
            if kernel == "xla":
                q_latent = (q_latent * 1.0001 + 0.5).astype(q_latent.dtype)
                out = q_latent
                continue
            out = mla_step(q_latent, q_pe, kv, page_table, positions, i % kv.shape[0])
            q_latent = (q_latent * (1 + 1e-6 * out[0, 0, 0, 0])).astype(q_latent.dtype)  # the next call depends
        return out

    return chain


def time_chain(fn, inputs, reps: int) -> dict:
    jax.block_until_ready(fn(*inputs))  # compile
    jax.block_until_ready(fn(*inputs))
    host, total = [], []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn(*inputs)
        host.append(time.perf_counter() - t)
        jax.block_until_ready(out)
        total.append(time.perf_counter() - t)
    return {"host_ms": statistics.median(host) * 1e3, "total_ms": statistics.median(total) * 1e3}


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    inputs = mla_inputs(args, rng)
    result = {"benchmark": "host_dispatch", "command": "python benchmarks/host_dispatch.py " + " ".join(argv or sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"device": device.device_kind, "host": platform.node(), "jax": jax.__version__},
              "args": {k: v for k, v in vars(args).items() if k != "kernel_list"}, "kernels": {}}
    rows = [["kernel", "host ms/call", "GPU ms/call", "host / GPU"]]
    for kernel in args.kernel_list:
        try:
            t = time_chain(chain_fn(kernel, args), inputs, args.reps)
        except Exception as e:  # one kernel failing (e.g. Mosaic on an unsupported GPU) must not hide the others
            result["kernels"][kernel] = {"error": f"{type(e).__name__}: {e}"[:500]}
            rows.append([kernel, "error", "", ""])
            continue
        per = {"host_ms_per_call": t["host_ms"] / args.chain, "gpu_ms_per_call": t["total_ms"] / args.chain}
        per["host_over_gpu"] = per["host_ms_per_call"] / per["gpu_ms_per_call"]
        result["kernels"][kernel] = {**t, **per}
        rows.append([kernel, f"{per['host_ms_per_call']:.4f}", f"{per['gpu_ms_per_call']:.4f}",
                     f"{per['host_over_gpu']:.2f}"])
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    for r in rows:
        print(" | ".join(f"{c:>14}" for c in r))
    return result


if __name__ == "__main__":
    main()
