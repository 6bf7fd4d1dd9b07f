"""MLA decode / prefill kernels on one GPU at K3's MLA shapes, against the memory limit measured in the same run.

    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/mla.py --out $OUT/mla.json   # H200
    python benchmarks/mla.py --smoke                                                              # CPU, tiny

K3 MLA: 96 heads, latent 512 + rope 64 (one 576-wide cached token, 1152 B in bf16, 576 B + a 4 B scale
in fp8), 16-token pages (the serving default) in one shuffled pool. Sections, each timed as the median of
--reps runs of --inner back-to-back calls after a compile + warm-up call:
  copy:     the limit -- a device-to-device copy (torch, when importable, and an XLA elementwise op), bytes
            read + written / time; the larger is the "copy bandwidth".
  sweep:    kernel tilings (block_rows, block_kv, warps, stages) and planner part counts at B64 x 32k, q_len 1.
  decode:   mla_decode with the best tiling and a host-side balanced plan over batch x context x q_len x
            {bf16, fp8}: achieved bandwidth = KV bytes (sum of histories x 576 x itemsize, + scales) / time,
            and its ratio to the copy bandwidth; the XLA reference path (k3jax.mla.paged_attention_reference)
            at a few shapes with the kernel's error against it.
  shipped:  jax's Pallas `decode_attention.mqa` (uniform splits; not paged, head_dim must be a power of two)
            on the same batch and history with 512-wide K = V (one buffer): its bandwidth on those bytes.
  mixed:    12 batches of 32 requests with histories log-uniform in 4k..200k: balanced plan vs uniform
            splits (same total work items, and 16 splits), aggregate time ratio; and equal-length controls
            (the same batches with every history at the batch mean).
  prefill:  mla_prefill of a 2k-token chunk after a 16k prefix hit, TFLOP/s of its absorbed-form FLOPs.
Sections stop starting once --budget-s has passed (the rest is reported as skipped). Prints a table last
and writes the raw numbers as JSON to --out after every section.
"""

from __future__ import annotations

import argparse
import datetime
import functools
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from k3jax.mla import paged_attention_reference  # noqa: E402
from pallas_kernels import mla_decode as md  # noqa: E402
from pallas_kernels import mla_plan  # noqa: E402
from pallas_kernels import mla_prefill as mp  # noqa: E402

HEADS, C, R, PAGE = 96, 512, 64, 16
SCALE = 192**-0.5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--budget-s", type=float, default=200.0, help="start no section after this many seconds")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--pool-tokens", type=int, default=5_000_000, help="tokens in the shared page pool")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    p.add_argument("--quick", action="store_true",
                   help="no tiling sweep (the defaults), bf16 decode at 4 shapes, no reference path, one shipped variant")
    return p.parse_args(argv)


class Bench:
    def __init__(self, args):
        self.args = args
        self.t0 = time.time()
        self.interpret = args.smoke
        self.result = {
            "date": datetime.date.today().isoformat(),
            "machine": {"platform": platform.platform(), "devices": [str(d) for d in jax.devices()],
                        "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__},
            "command": " ".join(sys.argv),
            "shapes": {"heads": HEADS, "kv_lora_rank": C, "rope": R, "page_size": PAGE},
            "skipped": [],
        }
        self.rng = np.random.default_rng(0)

    def over_budget(self, what: str) -> bool:
        if time.time() - self.t0 > self.args.budget_s:
            self.result["skipped"].append(what)
            print(f"[skip] {what}: past --budget-s", flush=True)
            return True
        return False

    def save(self):
        if self.args.out:
            Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.args.out).write_text(json.dumps(self.result, indent=1, default=str))

    def time_ms(self, fn) -> float:
        jax.block_until_ready(fn())  # compile
        jax.block_until_ready(fn())
        times = []
        for _ in range(self.args.reps):
            t = time.perf_counter()
            for _ in range(self.args.inner):
                out = fn()
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t) / self.args.inner * 1e3)
        return statistics.median(times)


# ------------------------------------------------------------------------------------------- copy limit
def copy_bandwidth(bench: Bench, mib: int) -> dict:
    out = {}
    n = mib * 2**20 // 2
    try:
        import torch

        if torch.cuda.is_available():
            x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            y = torch.empty_like(x)
            for _ in range(3):
                y.copy_(x)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(10):
                start.record()
                y.copy_(x)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            out["torch_copy_gbps"] = 2 * x.numel() * 2 / (statistics.median(times) * 1e-3) / 1e9
            del x, y
            torch.cuda.empty_cache()
    except ImportError:
        pass
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    step = jax.jit(lambda v: v + 1)
    ms = bench.time_ms(lambda: step(x))
    out["xla_elementwise_gbps"] = 2 * n * 2 / (ms * 1e-3) / 1e9
    del x
    out["copy_gbps"] = max(out.values())
    return out


# ------------------------------------------------------------------------------------------- inputs
class Pool:
    """One shuffled page pool per cache dtype, shared by every case (pages drawn without replacement while
    they last, so a batch never re-reads a page out of L2)."""

    def __init__(self, bench: Bench, tokens: int):
        self.num_pages = tokens // PAGE
        key = jax.random.key(1)
        make = jax.jit(lambda k: jax.random.normal(k, (self.num_pages, PAGE, C + R), jnp.bfloat16))
        self.bf16 = make(key)
        # fp8 pool below 2^31 elements: 2^31..2^32 one-byte elements overflow the Triton lowering's 32-bit
        # offsets (mla_decode._check_inputs); cases needing more pages draw them with replacement
        self.fp8_pages = min(self.num_pages, (2**31 - 1) // (PAGE * (C + R)))
        quant = jax.jit(md.quantize_latents_fp8)
        self.fp8, self.scales = quant(self.bf16[: self.fp8_pages])
        self.rng = bench.rng

    def table(self, lens, kv_dtype: str = "bf16") -> np.ndarray:
        pages = -(-np.asarray(lens) // PAGE)
        width = int(pages.max())
        num_pages = self.fp8_pages if kv_dtype == "fp8" else self.num_pages
        ids = self.rng.permutation(num_pages)
        if pages.sum() > num_pages:
            ids = self.rng.integers(0, num_pages, int(pages.sum()))
        table = np.zeros((len(lens), width), np.int32)
        offset = 0
        for b, n in enumerate(pages):
            table[b, :n] = ids[offset: offset + n]
            offset += n
        return table

    def cache(self, kv_dtype):
        return (self.fp8, self.scales) if kv_dtype == "fp8" else (self.bf16, None)


def decode_case(pool: Pool, rng, lens, q_len: int, kv_dtype: str = "bf16"):
    b = len(lens)
    table = jnp.asarray(pool.table(lens, kv_dtype))
    q_latent = jnp.asarray(rng.standard_normal((b, q_len, HEADS, C)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((b, q_len, HEADS, R)), jnp.bfloat16)
    positions = jnp.asarray(np.asarray(lens)[:, None] - q_len + np.arange(q_len)[None], jnp.int32)
    return q_latent, q_pe, table, positions


def kv_bytes(lens, kv_dtype: str) -> int:
    per_token = (C + R) * (1 if kv_dtype == "fp8" else 2) + (4 if kv_dtype == "fp8" else 0)
    return int(np.sum(lens)) * per_token


def run_decode(bench, pool, lens, q_len, kv_dtype, cfg, plan_fn, case=None):
    q_latent, q_pe, table, positions = case or decode_case(pool, bench.rng, lens, q_len)
    kv, scales = pool.cache(kv_dtype)
    t = time.perf_counter()
    plan = plan_fn(np.asarray(lens, np.int32))
    plan_us = (time.perf_counter() - t) * 1e6
    plan_dev = mla_plan.plan_to_device(plan)
    kw = dict(kv_lora_rank=C, scale=SCALE, kv_scales=scales, block_kv=cfg["block_kv"], block_rows=cfg["block_rows"],
              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], interpret=bench.interpret)
    fn = lambda: md.mla_decode(q_latent, q_pe, kv, table, positions, plan_dev, **kw)
    ms = bench.time_ms(fn)
    return {"ms": ms, "plan_host_us": plan_us, "work_items": int((plan.work_request >= 0).sum()),
            "max_splits": int(plan.request_num_work.max())}, fn


# ------------------------------------------------------------------------------------------- sections
def run_mixed(bench, pool, cfg, plan_fn, num_parts, n_batches, mb, lo, hi, mixed):
    """Appends one entry per mixed batch: balanced plan and uniform splits on the batch and its control."""
    uniform_splits = sorted({max(1, -(-num_parts // mb)), 16 if not bench.args.smoke else 2})
    for i in range(n_batches):
        if bench.over_budget(f"mixed batch {i}"):
            break
        lens = np.exp(bench.rng.uniform(np.log(lo), np.log(hi), mb)).astype(np.int64)
        lens[0] = hi  # every batch has one full-length history: same page-table width, one compile per mode
        control = np.full(mb, int(lens.mean()))
        entry = {"lens": lens.tolist(), "kv_bytes": kv_bytes(lens, "bf16")}
        for label, these in (("mixed", lens), ("control", control)):
            case = decode_case(pool, bench.rng, these, 1)
            if label == "control":  # same table width as the mixed batch: pad the page table
                q_latent, q_pe, table, positions = case
                table = jnp.pad(table, ((0, 0), (0, -(-hi // PAGE) - table.shape[1])))
                case = (q_latent, q_pe, table, positions)
            r, _ = run_decode(bench, pool, these, 1, "bf16", cfg, plan_fn, case)
            entry[f"{label}_balanced_ms"] = r["ms"]
            entry[f"{label}_balanced_max_splits"] = r["max_splits"]
            for s in uniform_splits:
                u, _ = run_decode(bench, pool, these, 1, "bf16", cfg,
                                  lambda l: mla_plan.plan_uniform(l, block_kv=cfg["block_kv"], splits=s), case)
                entry[f"{label}_uniform{s}_ms"] = u["ms"]
        print("mixed", {k: v for k, v in entry.items() if k != "lens"}, flush=True)
        mixed.append(entry)
        bench.save()


def run_prefill(bench, pool) -> dict:
    prefix, chunk = (300, 64) if bench.args.smoke else (16384, 2048)
    lens = np.array([prefix + chunk])
    table = jnp.asarray(pool.table(lens))
    q_latent = jnp.asarray(bench.rng.standard_normal((1, chunk, HEADS, C)), jnp.bfloat16)
    q_pe = jnp.asarray(bench.rng.standard_normal((1, chunk, HEADS, R)), jnp.bfloat16)
    positions = jnp.asarray(prefix + np.arange(chunk)[None], jnp.int32)
    fn = lambda: mp.mla_prefill(q_latent, q_pe, pool.bf16, table, positions, kv_lora_rank=C, scale=SCALE,
                                interpret=bench.interpret)
    ms = bench.time_ms(fn)
    keys = prefix * chunk + chunk * (chunk + 1) // 2
    flops = 2 * HEADS * keys * (C + R + C)
    return {"prefix": prefix, "chunk": chunk, "ms": ms, "tflops_absorbed": flops / (ms * 1e-3) / 1e12}


def main(argv=None) -> dict:
    args = parse_args(argv)
    bench = Bench(args)
    res = bench.result
    smoke = args.smoke
    copy_mib = 16 if smoke else 4096
    res["copy"] = copy_bandwidth(bench, copy_mib)
    copy_gbps = res["copy"]["copy_gbps"]
    print(f"copy bandwidth {copy_gbps:.0f} GB/s {res['copy']}", flush=True)
    bench.save()
    pool = Pool(bench, 40_000 if smoke else args.pool_tokens)
    bw = lambda nbytes, ms: nbytes / (ms * 1e-3) / 1e9

    # --- sweep
    base_b, base_ctx = (4, 2048) if smoke else (64, 32768)
    configs = [dict(block_rows=64, block_kv=64, num_warps=8, num_stages=2)]
    if not smoke and not args.quick:  # run 1 (2026-11-29) measured 32/64/4/2 8.1 ms, 64/64/4/2 6.8, 64/64/8/2 3.30, 32/32/4/3 8.0,
        # 16/64/4/2 10.3, 64/32/4/3 11.6 at B64 x 32k; num_parts 66 / 132 / 264 / 528: 3.28 / 3.25 / 3.36 / 3.44
        configs += [dict(block_rows=64, block_kv=64, num_warps=16, num_stages=2),
                    dict(block_rows=128, block_kv=64, num_warps=16, num_stages=1),
                    dict(block_rows=64, block_kv=32, num_warps=8, num_stages=2)]
    lens = np.full(base_b, base_ctx)
    case = decode_case(pool, bench.rng, lens, 1)
    sweep = []
    for cfg in configs:
        if bench.over_budget(f"sweep {cfg}"):
            break
        try:
            r, _ = run_decode(bench, pool, lens, 1, "bf16", cfg,
                              lambda l: mla_plan.plan_balanced(l, block_kv=cfg["block_kv"], num_parts=132), case)
            r.update(cfg, num_parts=132, tbps=bw(kv_bytes(lens, "bf16"), r["ms"]) / 1e3)
        except Exception as e:  # a tiling Triton rejects: record and go on
            r = dict(cfg, error=f"{type(e).__name__}: {str(e)[:300]}")
        print("sweep", r, flush=True)
        sweep.append(r)
    ok = [s for s in sweep if "ms" in s]
    best = min(ok, key=lambda s: s["ms"]) if ok else configs[0]
    cfg = {k: best[k] for k in ("block_rows", "block_kv", "num_warps", "num_stages")}
    parts_results = []
    for parts in []:  # flat in run 1 (see above); not repeated
        if bench.over_budget(f"num_parts {parts}"):
            break
        r, _ = run_decode(bench, pool, lens, 1, "bf16", cfg,
                          lambda l: mla_plan.plan_balanced(l, block_kv=cfg["block_kv"], num_parts=parts), case)
        r.update(num_parts=parts, tbps=bw(kv_bytes(lens, "bf16"), r["ms"]) / 1e3)
        print("parts", r, flush=True)
        parts_results.append(r)
    all_parts = [dict(best, num_parts=132)] + parts_results if ok else []
    num_parts = min(all_parts, key=lambda s: s["ms"])["num_parts"] if all_parts else 132
    res["sweep"] = {"shape": f"B{base_b} x {base_ctx}, q_len 1, bf16", "configs": sweep, "num_parts": parts_results,
                    "chosen": dict(cfg, num_parts=num_parts)}
    bench.save()
    plan_fn = lambda l: mla_plan.plan_balanced(l, block_kv=cfg["block_kv"], num_parts=num_parts)

    # --- decode table (+ reference path at a few shapes)
    shapes = [(4, 2048, 1, "bf16"), (4, 2048, 4, "fp8")] if smoke else [
        (64, 32768, 1, "bf16"), (64, 32768, 1, "fp8"), (64, 32768, 4, "bf16"), (64, 32768, 4, "fp8"),
        (1, 131072, 1, "bf16"), (8, 131072, 1, "bf16"), (128, 4096, 1, "bf16"), (128, 32768, 1, "bf16"),
    ]
    if args.quick and not smoke:
        shapes = [(64, 32768, 1, "bf16"), (64, 32768, 4, "bf16"), (128, 4096, 1, "bf16"), (8, 131072, 1, "bf16")]
    reference_at = set() if args.quick else {(4, 2048, 1, "bf16")} if smoke else {(64, 32768, 1, "bf16"), (128, 4096, 1, "bf16")}
    rows = []
    for b, ctx, q_len, kv_dtype in shapes:
        if bench.over_budget(f"decode B{b} {ctx} q{q_len} {kv_dtype}"):
            continue
        lens = np.full(b, ctx)
        case = decode_case(pool, bench.rng, lens, q_len, kv_dtype)
        try:
            r, fn = run_decode(bench, pool, lens, q_len, kv_dtype, cfg, plan_fn, case)
        except Exception as e:  # e.g. shared memory: retry one stage deep, then record
            try:
                r, fn = run_decode(bench, pool, lens, q_len, kv_dtype, dict(cfg, num_stages=1), plan_fn, case)
                r["num_stages"] = 1
            except Exception as e2:
                rows.append(dict(batch=b, context=ctx, q_len=q_len, kv_dtype=kv_dtype, error=f"{e}; {e2}"[:400]))
                print("decode error", rows[-1], flush=True)
                continue
        nbytes = kv_bytes(lens, kv_dtype)
        flops = 2 * b * q_len * HEADS * ctx * (C + R + C)
        r.update(batch=b, context=ctx, q_len=q_len, kv_dtype=kv_dtype, kv_bytes=nbytes,
                 gbps=bw(nbytes, r["ms"]), ratio_to_copy=bw(nbytes, r["ms"]) / copy_gbps,
                 tflops=flops / (r["ms"] * 1e-3) / 1e12)
        if (b, ctx, q_len, kv_dtype) in reference_at:
            q_latent, q_pe, table, positions = case
            kv, scales = pool.cache(kv_dtype)
            ref = jax.jit(functools.partial(paged_attention_reference, kv_lora_rank=C, scale=SCALE))
            ref_call = lambda: ref(q_latent, q_pe, kv, table, positions)  # arrays as arguments, not constants
            r["reference_ms"] = bench.time_ms(ref_call)
            r["speedup_vs_reference"] = r["reference_ms"] / r["ms"]
            got, want = fn(), ref_call()
            r["rel_err_vs_reference"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        print("decode", r, flush=True)
        rows.append(r)
        bench.save()
    res["decode"] = rows
    bench.save()

    # --- mixed batches: balanced plan vs uniform splits, and equal-length controls
    n_batches, mb = (2, 4) if smoke else (12, 32)
    lo, hi = (256, 4096) if smoke else (4096, 200_000)
    uniform_splits = sorted({max(1, -(-num_parts // mb)), 16 if not smoke else 2})  # as run_mixed
    mixed = []
    try:
        run_mixed(bench, pool, cfg, plan_fn, num_parts, n_batches, mb, lo, hi, mixed)
    except Exception as e:
        res["mixed_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        print("mixed error", res["mixed_error"], flush=True)
    if mixed:
        agg = {"batches": len(mixed), "batch_size": mb, "history_range": [lo, hi], "uniform_splits": uniform_splits}
        for label in ("mixed", "control"):
            bal = sum(e[f"{label}_balanced_ms"] for e in mixed)
            agg[f"{label}_balanced_ms_total"] = bal
            for s in uniform_splits:
                uni = sum(e[f"{label}_uniform{s}_ms"] for e in mixed)
                agg[f"{label}_uniform{s}_ms_total"] = uni
                agg[f"{label}_speedup_vs_uniform{s}"] = uni / bal
        agg["mixed_gbps_balanced"] = bw(sum(e["kv_bytes"] for e in mixed), agg["mixed_balanced_ms_total"])
        res["mixed"] = {"aggregate": agg, "batches": mixed}
    bench.save()

    # --- shipped Pallas decode_attention (uniform splits) on the same batch and history
    if not smoke and not bench.over_budget("shipped decode_attention"):
        try:
            from jax.experimental.pallas.ops.gpu import decode_attention

            b, ctx = 64, 32768
            k = jax.jit(lambda key: jax.random.normal(key, (b, ctx, C), jnp.bfloat16))(jax.random.key(5))
            q = jax.random.normal(jax.random.key(6), (b, HEADS, C), jnp.bfloat16)
            shipped = []
            variants = (dict(), dict(block_h=32, block_k=64, k_splits=16), dict(block_h=64, block_k=32, k_splits=8))
            for kw in variants[: 1 if bench.args.quick else 3]:
                try:
                    f = jax.jit(lambda q, k: decode_attention.mqa(q, k, k, sm_scale=SCALE, **kw))
                    ms = bench.time_ms(lambda: f(q, k))
                    shipped.append(dict(kw, ms=ms, gbps=bw(b * ctx * C * 2, ms)))
                except Exception as e:
                    shipped.append(dict(kw, error=f"{type(e).__name__}: {str(e)[:300]}"))
                print("shipped", shipped[-1], flush=True)
            del k
            res["shipped_decode_attention"] = {"batch": b, "context": ctx, "head_dim": C, "kv_bytes": b * ctx * C * 2,
                                               "runs": shipped}
        except ImportError as e:
            res["shipped_decode_attention"] = {"error": str(e)}
        bench.save()

    # --- prefill after a prefix hit
    if not bench.over_budget("prefill"):
        try:
            res["prefill"] = run_prefill(bench, pool)
        except Exception as e:
            res["prefill"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print("prefill", res["prefill"], flush=True)
    res["elapsed_s"] = time.time() - bench.t0
    bench.save()
    print_table(res)
    return res


def print_table(res):
    copy = res["copy"]["copy_gbps"]
    print(f"\nMLA decode, {res['machine']['device_kind']}, copy bandwidth {copy:.0f} GB/s "
          f"(torch {res['copy'].get('torch_copy_gbps', float('nan')):.0f}, XLA {res['copy']['xla_elementwise_gbps']:.0f})")
    print(f"tiling chosen: {res['sweep']['chosen']}")
    print(f"{'B':>4} {'ctx':>7} {'q':>2} {'kv':>5} {'ms':>8} {'GB/s':>7} {'/copy':>6} {'TFLOP/s':>8} {'ref ms':>8} {'x ref':>6}")
    for r in res.get("decode", []):
        if "error" in r:
            print(r)
            continue
        print(f"{r['batch']:>4} {r['context']:>7} {r['q_len']:>2} {r['kv_dtype']:>5} {r['ms']:>8.3f} {r['gbps']:>7.0f} "
              f"{r['ratio_to_copy']:>6.2f} {r['tflops']:>8.0f} {r.get('reference_ms', float('nan')):>8.2f} "
              f"{r.get('speedup_vs_reference', float('nan')):>6.1f}")
    shipped = res.get("shipped_decode_attention", {})
    for s in shipped.get("runs", []):
        print(f"shipped decode_attention.mqa B{shipped['batch']} {shipped['context']} D{shipped['head_dim']} {s}")
    if "mixed" in res:
        agg = res["mixed"]["aggregate"]
        print("mixed batches:", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in agg.items()})
    if "prefill" in res:
        print("prefill:", res["prefill"])
    if "mixed_error" in res:
        print("mixed error:", res["mixed_error"])
    if res["skipped"]:
        print("skipped (time budget):", res["skipped"])


if __name__ == "__main__":
    main()
