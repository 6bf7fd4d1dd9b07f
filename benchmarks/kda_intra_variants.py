"""KDA prefill stage 1 (`kda_intra`) alone, by named variant, at one packed shape.

The claim it backs: `kda_intra`'s form and the model's settings (8 warps, inverse_precision="blocks") are the
fastest measured; its docstring lists the variants that lost. Every variant is compiled first, all at once in
threads (XLA compiles each ~6,600-instruction kernel in ~15-30 s; in parallel the whole set takes about one), then
timed one after another on the same inputs with benchmarks/kda.py's `time_jax` (median of `trials`, each ~25 ms of
back-to-back calls; the 2026-12-01 figures in docs/benchmarks.md were taken before that as the best of 3 x 20 calls),
and its six outputs compared with the first variant's (relative L2 error; equal settings must give 0).

Variant names: benchmarks/kda.py's stage-1 names (`pallas_stage1_knobs`), e.g. "pallas_w8_blocks" (the model's),
"pallas_w4_blocks", "pallas_w8_tf32x3", "pallas_w8_blocks_skip-inverse" (ablation: wrong outputs, cost by difference).

    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/kda_intra_variants.py --shape 1x32768x32 \\
        --variants pallas_w8_blocks,pallas_w4_blocks,pallas_w8_blocks_skip-inverse --out kda_intra_variants.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kda import pallas_stage1_knobs, time_jax
from pallas_kernels.kda_common import CHUNK
from pallas_kernels.kda_intra import kda_intra

OUTPUTS = ("w", "u", "qg", "kg", "aqk", "gate_last")


def stage1_inputs(b, t, h, d, seed=0):
    """Packed bf16 inputs of b sequences of t tokens (t a multiple of the chunk), keys sharing a direction per head
    (k_i . k_j ~ 0.9 after the norm, as real keys correlate) and the chunk table of full chunks."""
    ks = jax.random.split(jax.random.key(seed), 8)
    n = b * t
    q, v, z = (jax.random.normal(ks[i], (n, h, d), jnp.bfloat16) for i in range(3))
    k = (0.3 * jax.random.normal(ks[3], (n, h, d)) + jax.random.normal(ks[4], (1, h, d))).astype(jnp.bfloat16)
    beta = jax.random.normal(ks[5], (n, h), jnp.float32)
    a_log = 0.5 * jax.random.normal(ks[6], (h,), jnp.float32)
    dt_bias = jax.random.normal(ks[7], (h, d), jnp.float32)
    num_chunks = n // CHUNK
    return (jnp.arange(num_chunks, dtype=jnp.int32) * CHUNK, jnp.full((num_chunks,), CHUNK, jnp.int32),
            q, k, v, z, beta, a_log, dt_bias)


def run(shape, variants, trials=3, interpret=False):
    b, t, h, d = shape
    if t % CHUNK:
        raise ValueError(f"t must be a multiple of {CHUNK}; got {t}")
    args = stage1_inputs(b, t, h, d)

    def build(name):
        knobs = pallas_stage1_knobs(name)
        return jax.jit(lambda *a: kda_intra(*a, interpret=interpret, **knobs)).lower(*args).compile()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, len(variants))) as pool:
        compiled = dict(zip(variants, pool.map(build, variants)))
    print(f"compiled {len(variants)} variants in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    rows, first = [], None
    for name in variants:
        fn = compiled[name]
        out = jax.block_until_ready(fn(*args))
        row = dict(variant=name, B=b, T=t, H=h, D=d, ms=1e3 * time_jax(lambda: fn(*args), trials),
                   finite=bool(all(np.isfinite(np.asarray(x, np.float32)).all() for x in out)))
        out = [np.asarray(x, np.float32) for x in out]
        if first is None:
            first = out
        else:
            row["rel_vs_first"] = {n: float(np.linalg.norm(x - y) / np.linalg.norm(y))
                                   for n, x, y in zip(OUTPUTS, out, first)}
        rows.append(row)
    return rows


def print_table(rows):
    base = rows[0]["ms"]
    print(f"{'variant':<36}{'ms':>9}{'x first':>9}{'worst rel':>11}")
    for r in rows:
        worst = max(r.get("rel_vs_first", {"-": 0.0}).values())
        print(f"{r['variant']:<36}{r['ms']:>9.3f}{r['ms'] / base:>9.2f}{worst:>11.1e}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1x32768x32", help="BxTxH (D 128; T a multiple of 64)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--variants", default="pallas_w8_blocks,pallas_w4_blocks")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--interpret", action="store_true", help="CPU smoke run (Pallas interpret mode; tiny shapes)")
    args = p.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split("x")) + (args.head_dim,)
    variants = [v for v in args.variants.split(",") if v]
    rows = run(shape, variants, args.trials, args.interpret)
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                           jax=jax.__version__, argv=sys.argv[1:] if argv is None else argv, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
