"""Serving-engine throughput: decode tokens/s at batch 1..256, the engine's host overhead per step, and
the speculative-decoding speed-up.

    PYTHONPATH=. python benchmarks/engine.py --model k3-small --out /tmp/engine.json          # H200
    PYTHONPATH=. python benchmarks/engine.py --model k3-tiny --batches 1,4 --prefix 64 --smoke  # CPU check

Workload (agentic): every request shares a `--prefix`-token history (served from the prefix cache after
the first request) plus `--suffix` unique tokens, then decodes with ignore_eos. Batches are measured from
the largest down: all requests decode together, then requests are aborted down to the next batch size, so
each batch size compiles once (its row bucket) and contexts stay ~prefix + suffix + a few hundred tokens.

Per batch size: median wall time of Engine.step() (everything a served step does: schedule, host batch
building, the jitted decode, sampling, stop checks) and, at the same shapes, of the bare jitted decode call
on prebuilt device arrays (k3jax.decode + block_until_ready): host overhead = 1 - bare / step; and, from
the engine's own timers, the fraction of step time spent in host-only phases (scheduling before the
forward is dispatched, processing after the sampled tokens are back), when the device has nothing queued.

Overlap scheduling (`--overlap 1,0`): each batch size is timed with EngineConfig.overlap_schedule on and off on
the same engine (the in-flight step is processed between them); `--roofline` adds the decode floor per batch
(benchmarks/model_forward.py's byte count: weights, activated experts, latents, KDA and conv state, over the copy
bandwidth measured in the same run) and each mode's step / floor.

Speculation: a random-init drafter (acceptance as measured: ~1 for a random target) and the
BENCHMARK-ONLY fixed-acceptance mode (`spec_fixed_accepted`: exactly a drafts kept per step, outputs NOT
the model's), which prices a step at a given acceptance length the way the published AgentX runs do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import k3jax
from k3jax.drafter import DrafterConfig, init_drafter
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="k3-small")
    p.add_argument("--batches", default="256,128,32,8,1", help="decode batch sizes, measured largest first")
    p.add_argument("--prefix", type=int, default=1024, help="shared history tokens (prefix-cache hit)")
    p.add_argument("--suffix", type=int, default=16, help="unique tokens per request")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=6, help="timed steps per batch size (after 2 untimed)")
    p.add_argument("--spec-k", type=int, default=3)
    p.add_argument("--spec-batches", default="32,1")
    p.add_argument("--spec-fixed", default="2", help="benchmark-only accepted drafts per step, comma-separated "
                   "(e.g. 2,3 brackets a measured mean acceptance length of 3.62 tokens/step at k=3)")
    p.add_argument("--spec-deadline-s", type=float, default=330.0, help="skip speculation past this run time")
    p.add_argument("--backend", default=EngineConfig.backend, help="kernel backend (pallas on a GPU)")
    p.add_argument("--overlap", default="1", help="overlap_schedule settings to time per batch, e.g. 1,0")
    p.add_argument("--roofline", action="store_true", help="add the decode floor (weights + history + state bytes "
                   "over the measured copy bandwidth) and step / floor")
    p.add_argument("--copy-mib", default="1024,2048,4096", help="--roofline's copy-bandwidth probe sizes (MiB)")
    p.add_argument("--smoke", action="store_true", help="CPU-sized run (the test suite's smoke test)")
    p.add_argument("--out", default=None, help="write raw results as JSON here")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_prompts(cfg, n: int, prefix: int, suffix: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    high = min(cfg.vocab_size, 100_000)
    shared = rng.integers(1000 % high, high, prefix).tolist()
    return [shared + rng.integers(1000 % high, high, suffix).tolist() for _ in range(n)]


def engine_config(args, max_running: int, **kw) -> EngineConfig:
    return EngineConfig(
        model=args.model, page_size=args.page_size, max_running=max_running,
        max_prefill_tokens=max(args.prefix, args.page_size), max_model_len=args.prefix + args.suffix + 512,
        bucket_growth=2, num_slots=3 * max_running + 8, backend=args.backend, **kw)


def _median_ms(times) -> float:
    return statistics.median(times) * 1e3


def fill(engine: Engine, prompts, max_tokens: int) -> list[str]:
    """Admits every prompt and steps until all of them are decoding."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [engine.add_request(prompts[0], sp)]
    while engine.requests[ids[0]].num_computed_tokens < len(prompts[0]):  # its prompt checkpoint is published
        engine.step()
    ids += [engine.add_request(p, sp) for p in prompts[1:]]
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt for r in engine.scheduler.running):
        engine.step()
    log(f"  admitted {len(ids)} requests in {time.perf_counter() - t0:.1f} s "
        f"(prefix hits {engine.kv.hit_tokens} of {engine.kv.query_tokens} prompt tokens)")
    return ids


def bare_decode_ms(engine: Engine, reps: int) -> float:
    """The jitted decode at the engine's current decode shapes, arguments prebuilt on the device."""
    from serving.runner import Row, fit

    engine.sync()  # overlap scheduling: the step in flight first, so every row's newest token is known
    reqs = [r for r in engine.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
    rows = [Row(r.slot, r.pages, r.num_computed_tokens, [r.last_token]) for r in reqs]
    run = engine.runner
    b = fit(len(rows), run.row_buckets)
    p = fit(max(len(r.pages) for r in rows), run.page_buckets)
    meta = run._meta(rows, b, p, [1] * len(rows))
    tokens = jnp.zeros(b, jnp.int32).at[: len(rows)].set(jnp.asarray([r.tokens[0] for r in rows]))
    times = []
    for i in range(reps + 2):  # rewrites the same positions with the same tokens: state stays valid
        t0 = time.perf_counter()
        logits, run.state = k3jax.decode(run.params, run.cfg, run.state, tokens, meta, backend_name=run.ecfg.backend)
        logits.block_until_ready()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return _median_ms(times)


def timed_steps(engine: Engine, steps: int) -> tuple[float, int]:
    """(median ms per step, tokens emitted per step) over `steps` steps after two untimed ones."""
    times, tokens = [], []
    for i in range(steps + 2):
        if i == 2:
            before = dict(engine.timing)
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(o.new_tokens) for o in outs))
    host = sum(engine.timing[k] - before[k] for k in ("schedule_s", "process_s"))
    engine.last_host_fraction = host / sum(times[2:])  # schedule + process: phases with an idle device
    return _median_ms(times[2:]), int(np.median(tokens[2:]))


def set_overlap(engine: Engine, on: bool) -> None:
    """Switches overlap scheduling on a running engine (benchmark only): the step in flight is processed first."""
    engine.sync()
    engine.ecfg = dataclasses.replace(engine.ecfg, overlap_schedule=on)


def bench_batches(engine: Engine, batches: list[int], args, bare: bool = True, floor=None) -> list[dict]:
    """Per batch size (and per --overlap mode): the median Engine.step() time; `floor(batch, context)`, if given,
    is the decode floor in ms."""
    rows = []
    live = [r.request_id for r in engine.scheduler.running]
    modes = [bool(int(x)) for x in args.overlap.split(",")] if not engine.runner.k else [False]
    for b in batches:
        engine.sync()
        for rid in live[b:]:
            engine.abort(rid)
        live = live[:b]
        for overlap in modes:
            set_overlap(engine, overlap)
            step_ms, per_step = timed_steps(engine, args.steps)
            row = {"batch": b, "overlap": overlap, "step_ms": step_ms, "tokens_per_step": per_step,
                   "tok_s": per_step / step_ms * 1e3,
                   "context": int(np.mean([engine.requests[r].num_computed_tokens for r in live])),
                   "host_only_fraction": engine.last_host_fraction}
            if floor is not None:
                row["floor_ms"] = floor(b, row["context"])
                row["step_over_floor"] = step_ms / row["floor_ms"]
            rows.append(row)
        if bare:
            bare_ms = bare_decode_ms(engine, args.steps)
            for row in rows[-len(modes):]:
                row["bare_decode_ms"] = bare_ms
                row["host_overhead"] = 1 - bare_ms / row["step_ms"]
        for row in rows[-len(modes):]:
            log(f"  batch {b}: {row}")
    return rows


def roofline(params, cfg, sizes_mib=(1024, 2048, 4096), repeats: int = 2):
    """(floor(batch, context) in ms, bandwidth, probes): model_forward's decode byte count over the best copy
    bandwidth measured now. The probe (median of 10 elementwise passes) has read 2.95-4.1 TB/s on the same H200
    across runs, so it runs at several sizes, twice each, and the floor uses the highest: the strictest floor."""
    from k3jax.testing import load_benchmark_script

    mf = load_benchmark_script("model_forward")
    probes = {f"{mib}MiB_{i}": mf.copy_bandwidth(mib) for mib in sizes_mib for i in range(repeats)}
    bandwidth = max(probes.values())
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (best of {', '.join(f'{v / 1e12:.2f}' for v in probes.values())})")
    return (lambda batch, context: 1e3 * mf.decode_bytes(params, cfg, batch, context)["total"] / bandwidth,
            bandwidth, probes)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.smoke:
        args.batches, args.spec_batches, args.steps = "4,1", "2", 2
    batches = [int(x) for x in args.batches.split(",")]
    spec_batches = [int(x) for x in args.spec_batches.split(",")]
    t_start = time.perf_counter()
    cfg = k3jax.load_config(args.model)
    t0 = time.perf_counter()
    params = k3jax.init_params(cfg, jax.random.key(0))  # eager: a jitted init of k3-small compiles for minutes
    jax.block_until_ready(params)
    log(f"{cfg.name}: params in {time.perf_counter() - t0:.1f} s on {jax.devices()[0].device_kind}")
    max_tokens = 500
    result = {"model": cfg.name, "device": jax.devices()[0].device_kind, "args": vars(args), "date": time.strftime("%Y-%m-%d")}

    engine = Engine(engine_config(args, max(batches)), cfg=cfg, params=params)
    result["pools"] = {"num_pages": engine.runner.num_pages, "num_slots": engine.runner.num_slots,
                       "memory_stats": {k: v for k, v in (jax.devices()[0].memory_stats() or {}).items()
                                        if k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")}}
    log(f"engine pools: {result['pools']}")
    fill(engine, make_prompts(cfg, max(batches), args.prefix, args.suffix), max_tokens)
    floor = None
    if args.roofline:
        floor, result["copy_bandwidth_Bps"], result["copy_probes_Bps"] = roofline(
            engine.runner.params, cfg, [int(x) for x in args.copy_mib.split(",")])
    result["decode"] = bench_batches(engine, batches, args, floor=floor)
    del engine
    _save(result, args.out)

    result["speculative"] = []
    if time.perf_counter() - t_start > args.spec_deadline_s:
        log("skipping speculation: past --spec-deadline-s")
    else:
        dcfg = DrafterConfig(draft_vocab_size=min(cfg.vocab_size, 32768))
        drafter = (dcfg, init_drafter(cfg, dcfg, jax.random.key(1), target_params=params))
        for fixed in (None, *(int(x) for x in args.spec_fixed.split(",") if x)):
            ecfg = engine_config(args, max(spec_batches), speculative_k=args.spec_k, spec_fixed_accepted=fixed)
            engine = Engine(ecfg, cfg=cfg, params=params, drafter=drafter)
            fill(engine, make_prompts(cfg, max(spec_batches), args.prefix, args.suffix, seed=1), max_tokens)
            for row in bench_batches(engine, spec_batches, args, bare=False):
                row.update(k=args.spec_k, fixed_accepted=fixed,
                           mean_acceptance_length=engine.stats()["spec_mean_acceptance_length"])
                base = next((d for d in result["decode"] if d["batch"] == row["batch"]), None)
                row["speedup_vs_plain"] = row["tok_s"] / base["tok_s"] if base else None
                result["speculative"].append(row)
            del engine
    result["wall_s"] = time.perf_counter() - t_start
    print_table(result)
    _save(result, args.out)
    return result


def _save(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def print_table(result: dict) -> None:
    print(f"\nengine decode, {result['model']} on {result['device']}")
    print(f"{'batch':>6} {'overlap':>8} {'context':>8} {'step ms':>9} {'bare ms':>9} {'tok/s':>10} {'1-bare/step':>12} "
          f"{'host-only':>10} {'floor ms':>9} {'step/floor':>11}")
    for r in result["decode"]:
        print(f"{r['batch']:>6} {str(r.get('overlap', '-')):>8} {r['context']:>8} {r['step_ms']:>9.2f} "
              f"{r['bare_decode_ms']:>9.2f} {r['tok_s']:>10.1f} {100 * r['host_overhead']:>11.1f}% "
              f"{100 * r.get('host_only_fraction', float('nan')):>9.1f}% {r.get('floor_ms', float('nan')):>9.2f} "
              f"{r.get('step_over_floor', float('nan')):>10.2f}x")
    if result["speculative"]:
        print("\nspeculative decoding (fixed = BENCHMARK-ONLY forced acceptance; outputs are not the model's)")
        print(f"{'batch':>6} {'k':>3} {'fixed':>6} {'accept len':>11} {'step ms':>9} {'tok/s':>10} {'vs plain':>9}")
        for r in result["speculative"]:
            sp = f"{r['speedup_vs_plain']:.2f}x" if r["speedup_vs_plain"] else "-"
            print(f"{r['batch']:>6} {r['k']:>3} {str(r['fixed_accepted']):>6} {r['mean_acceptance_length']:>11.2f} "
                  f"{r['step_ms']:>9.2f} {r['tok_s']:>10.1f} {sp:>9}")


if __name__ == "__main__":
    main()
