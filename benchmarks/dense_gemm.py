"""Decode-size dense GEMMs: the skinny Pallas kernel (pallas_kernels/skinny_gemm.py) vs XLA's `layers.dense`.

Claim: at decode row counts (M = 16-128) the model's dense projections are weight streaming; one kernel that
reads each weight once at copy bandwidth beats XLA's split-K GEMM + reduce. The shapes are k3-small's fused
serving weights (`fuse.fuse_for_serving`), each timed as a chain of distinct weight copies in one jit (so the
weights come from HBM, not L2, and one host dispatch covers several kernels), with the step's count of each
shape to project the per-step time. The physical limit printed beside them: weight bytes / torch's
device-to-device copy bandwidth in the same run (XLA's own copy when torch is absent).

    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/dense_gemm.py --rows 64 \
        --sweep --out $OUT/dense_gemm.json

Prints one row per shape: XLA us, ours (default tiling) us, best swept tiling, GB/s, % of copy, and the
per-step totals (count x time). `--interpret` runs a small smoke check on CPU (tiny shapes, no timing claims).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.moe import copy_bandwidth, timed, torch_copy_bandwidth  # noqa: E402
from k3jax.layers import dense  # noqa: E402
from pallas_kernels.skinny_gemm import SkinnyGemmConfig, default_config, skinny_matmul  # noqa: E402

# k3-small's dense serving weights (K, N) and how many of each one decode step reads
K3_SMALL = (
    ("kda in_proj", 2048, 8336, 18), ("kda f_b", 128, 2048, 18), ("mla in_proj", 2048, 3392, 7),
    ("o_proj", 2048, 2048, 25), ("mla q_b", 768, 3072, 7), ("moe in_proj", 2048, 3072, 24),
    ("moe out_proj", 2048, 2048, 24), ("router", 2048, 192, 24), ("mlp gate/up", 2048, 8192, 2),
    ("mlp down", 8192, 2048, 1), ("lm_head", 2048, 163840, 1),
)
TINY = (("tiny a", 256, 200, 1), ("tiny b", 128, 64, 1))
CHAIN_BYTES = 256 << 20  # weights per timed chain: well past the H200's 50 MB L2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64, help="M: tokens in the decode step (default 64)")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tilings per shape")
    p.add_argument("--only", default="", help="comma-separated shape names (default all)")
    p.add_argument("--interpret", action="store_true", help="CPU smoke run: tiny shapes, Pallas interpret mode")
    p.add_argument("--out", type=Path, default=None, help="write raw numbers as JSON here")
    return p.parse_args(argv)


def chain_len(k: int, n: int) -> int:
    return int(min(8, max(2, CHAIN_BYTES // (2 * k * n))))


def sweep_configs(m: int, k: int, n: int):
    for block_n, block_k, split, stages, warps in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8),
                                                                    (4,), (4,)):
        if k % (block_k * split) or k // split < block_k or (block_n > 64 and m > 64):
            continue
        tiles = -(-n // block_n)
        if tiles * split > 8 * 132 or (split > 1 and tiles >= 264):  # far past the SMs' count: no gain from splitting
            continue
        yield SkinnyGemmConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=warps, num_stages=stages)


def main(argv=None) -> int:
    args = parse_args(argv)
    interpret = args.interpret
    shapes = TINY if interpret else K3_SMALL
    if args.only:
        keep = {s.strip() for s in args.only.split(",")}
        shapes = tuple(s for s in shapes if s[0] in keep)
    m = args.rows
    rng = np.random.default_rng(0)
    copy_gbs = None if interpret else (torch_copy_bandwidth(1 << 30) or copy_bandwidth(1 << 30))
    print(f"# dense GEMMs at M={m}, device {jax.devices()[0].device_kind}, copy {copy_gbs or 0:.0f} GB/s")
    rows, t_start = [], time.perf_counter()
    for name, k, n, count in shapes:
        c = 1 if interpret else chain_len(k, n)
        xs = [jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16) for _ in range(c)]
        ws = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for _ in range(c)]

        def chained(fn):
            return jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)])

        want = chained(dense)(xs, ws)
        record = {"name": name, "k": k, "n": n, "count": count, "chain": c, "weight_mb": 2 * k * n / 1e6}
        cfg0 = default_config(m, k, n)
        ours = chained(lambda x, w: skinny_matmul(x, w, config=cfg0, interpret=interpret))
        got = ours(xs, ws)
        err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)))
                        / (float(jnp.max(jnp.abs(r.astype(jnp.float32)))) + 1e-6)) for g, r in zip(got, want))
        record.update(default=cfg0.__dict__, max_rel_err=err)
        if err > 2e-2:
            raise SystemExit(f"{name}: skinny_matmul differs from layers.dense by {err:.3g} (bf16 bar 2e-2)")
        if not interpret:
            record["xla_us"] = timed(chained(dense), xs, ws) / c * 1e6
            record["ours_us"] = timed(ours, xs, ws) / c * 1e6
            best = (record["ours_us"], cfg0)
            if args.sweep:
                for cfg in sweep_configs(m, k, n):
                    try:
                        t = timed(chained(lambda x, w, cfg=cfg: skinny_matmul(x, w, config=cfg)), xs, ws,
                                  trials=3) / c * 1e6
                    except Exception as e:  # a tiling Triton cannot compile (shared memory): skip it
                        print(f"  {name} {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    if t < best[0]:
                        best = (t, cfg)
            record["best_us"], record["best"] = best[0], best[1].__dict__
            nbytes = 2 * k * n
            record["copy_us"] = nbytes / (copy_gbs * 1e9) * 1e6
            print(f"{name:14s} K{k:5d} N{n:6d} x{count:2d}  xla {record['xla_us']:7.1f} us  ours {record['ours_us']:7.1f}"
                  f"  best {best[0]:7.1f} ({best[1].block_n}/{best[1].block_k}/s{best[1].split_k}/st{best[1].num_stages})"
                  f"  {nbytes / best[0] / 1e3:6.0f} GB/s = {record['copy_us'] / best[0]:4.0%} of copy"
                  f"  xla/best {record['xla_us'] / best[0]:.2f}x   [{time.perf_counter() - t_start:5.0f} s]", flush=True)
        rows.append(record)
    summary = {}
    if not interpret:
        for key in ("xla_us", "ours_us", "best_us", "copy_us"):
            summary[key.replace("_us", "_ms_per_step")] = sum(r[key] * r["count"] for r in rows) / 1e3
        print("per decode step (count x time): " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": platform.node(),
              "device": str(jax.devices()[0].device_kind), "rows": m, "copy_gbs": copy_gbs, "shapes": rows,
              "summary": summary, "argv": sys.argv[1:]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
