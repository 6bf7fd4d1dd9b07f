"""Independent vs decode-first admission of a P/D pair: mean prefill queue time on a bursty workload.

Claim (issue 7): when prefill admits independently of decode memory (it computes, then holds finished
prompts until the decode worker has room), the prefill queue time drops versus "decode-first"
admission (a prefill starts only once its decode partner has reserved memory and connected).

Setup: one prefill and one decode Engine (k3-tiny by default) in this process, each stepped by its own
thread (they run concurrently, as on two devices), the in-process KV transport. Bursts of requests
arrive at fixed times; decode memory is the bottleneck (decode max_running < burst size). Both modes
run the same seeded workload after a warm-up that compiles every shape. Prefill queue time = arrival
at the prefill worker to its admission; makespan and output throughput come from the same run.

    python benchmarks/pd_admission.py [--model k3-tiny] [--bursts 3] [--burst-size 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time

import jax
import numpy as np

import k3jax
from serving.config import EngineConfig
from serving.disagg.roles import Bootstrap
from serving.engine import Engine
from serving.request import RequestStatus, SamplingParams

_rooms = itertools.count(1)


def workload(seed: int, bursts: int, burst_size: int, gap_s: float, lo: int, hi: int, vocab: int):
    rng = np.random.default_rng(seed)
    return [(b * gap_s, rng.integers(0, vocab, int(rng.integers(lo, hi))).tolist())
            for b in range(bursts) for _ in range(burst_size)]


def run(mode: str, cfg, params, sizes: dict, decode_running: int, arrivals, max_tokens: int) -> dict:
    prefill = Engine(EngineConfig(**sizes, role="prefill", disagg_transport="inprocess", pd_admission=mode,
                                  handoff_max_held=64, handoff_timeout_s=3600.0), cfg=cfg, params=params)
    decode = Engine(EngineConfig(**{**sizes, "max_running": decode_running}, role="decode",
                                 disagg_transport="inprocess"), cfg=cfg, params=params)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    jobs = [(t, ids, f"r{i}", Bootstrap("local", prefill.disagg.port, next(_rooms))) for i, (t, ids) in enumerate(arrivals)]
    admitted: dict[str, float] = {}
    arrived: dict[str, float] = {}
    finished: dict[str, float] = {}
    start = time.monotonic()
    done = threading.Event()

    def loop(engine, is_prefill):
        pending = list(jobs)
        while not done.is_set():
            now = time.monotonic() - start
            while pending and pending[0][0] <= now:
                t, ids, rid, boot = pending.pop(0)
                engine.add_request(ids, sampling, request_id=rid, bootstrap=boot)
                if is_prefill:
                    arrived[rid] = time.monotonic()
            outs = engine.step()
            now_abs = time.monotonic()
            if is_prefill:
                for rid, req in engine.requests.items():
                    if rid not in admitted and req.status is not RequestStatus.WAITING:
                        admitted[rid] = now_abs
            else:
                for out in outs:
                    if out.finished:
                        finished[out.request_id] = now_abs
                if len(finished) == len(jobs):
                    done.set()
            if not outs and not engine.has_work:
                time.sleep(0.001)

    threads = [threading.Thread(target=loop, args=(prefill, True)), threading.Thread(target=loop, args=(decode, False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    makespan = max(finished.values()) - start
    queue = [admitted[r] - arrived[r] for r in arrived]
    tokens = sum(decode.requests[r].num_output for r in finished)
    failed = [r for r in finished if decode.requests[r].finish_reason == "abort"]
    assert not failed, f"{len(failed)} requests failed their KV transfer"
    prefill.check_integrity()
    decode.check_integrity()
    prefill.close()
    return {"mode": mode, "requests": len(jobs), "mean_prefill_queue_s": float(np.mean(queue)),
            "p90_prefill_queue_s": float(np.percentile(queue, 90)), "makespan_s": makespan,
            "output_tokens_per_s": tokens / makespan}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="k3-tiny")
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--burst-size", type=int, default=8)
    p.add_argument("--gap-s", type=float, default=1.5, help="seconds between bursts")
    p.add_argument("--decode-running", type=int, default=2, help="decode worker's max_running (its memory bound)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2, help="runs per mode (alternating); the table shows the mean")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cfg = k3jax.load_config(args.model)
    params = k3jax.init_params(cfg, jax.random.key(0))
    sizes = dict(page_size=16, num_pages=256, num_slots=48, max_running=4, max_prefill_tokens=64, max_model_len=256,
                 bucket_growth=64)
    arrivals = workload(0, args.bursts, args.burst_size, args.gap_s, 20, 120, min(cfg.vocab_size, 256))
    # warm-up: every shape the runs use (prefill chunks and batches, decode batches), in both modes
    for mode in ("independent", "decode_first"):
        run(mode, cfg, params, sizes, args.decode_running, workload(1, 1, args.burst_size, 0.0, 20, 120, 256), 3)
    results = {"independent": [], "decode_first": []}
    for _ in range(args.repeats):
        for mode in results:
            results[mode].append(run(mode, cfg, params, sizes, args.decode_running, arrivals, args.max_tokens))
    rows = []
    for mode, runs in results.items():
        rows.append({k: (float(np.mean([r[k] for r in runs])) if isinstance(runs[0][k], float) else runs[0][k])
                     for k in runs[0]})
    base = rows[1]
    print(f"P/D admission, {args.model}, {len(arrivals)} requests in {args.bursts} bursts, decode max_running "
          f"{args.decode_running}, {args.max_tokens} output tokens, mean of {args.repeats} runs ({jax.devices()[0].platform})")
    print(f"{'mode':<14}{'mean queue s':>14}{'p90 queue s':>13}{'makespan s':>12}{'out tok/s':>11}{'queue vs decode-first':>24}")
    for r in rows:
        print(f"{r['mode']:<14}{r['mean_prefill_queue_s']:>14.3f}{r['p90_prefill_queue_s']:>13.3f}{r['makespan_s']:>12.2f}"
              f"{r['output_tokens_per_s']:>11.1f}{(r['mean_prefill_queue_s'] / base['mean_prefill_queue_s'] - 1) * 100:>+23.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
