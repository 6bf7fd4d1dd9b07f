"""AIPerf's AgentX scenario and our replay client on the same trace, server and concurrency: do they agree?

    bash scripts/extras/aiperf.sh                      # once: .venv-aiperf with aiperf==0.13.0
    PYTHONPATH=. python benchmarks/aiperf_agree.py     # k3-tiny on CPU, ~15 min on a 2-core machine
    PYTHONPATH=. python benchmarks/aiperf_agree.py --url http://127.0.0.1:8000 --model k3-small ...

Generates a short-preset trace, starts `k3jax serve` (k3-tiny, CPU) unless --url is given, then runs
AIPerf (`--scenario inferencex-agentx-mvp --custom-dataset-type weka_trace`) and our replay in
alternating pairs (the first pair unscored: it compiles the shapes both clients hit), prints a table and
writes JSON (docs/results/aiperf_agree_cpu_aligned_2026-11-30.json holds the concurrency 1 and 2 runs of
`--duration-s 60 --repeats 4 --raw-export`). The trace uses 64-token blocks (AIPerf's weka block size); the
server compiles its shapes at start-up and logs XLA compilations, counted per run.
What is compared and why the windows are aligned: serving/workload/aiperf_agree.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from serving.workload.aiperf_agree import (
    AIPERF_WEKA_BLOCK_SIZE,
    TINY_CPU_SERVE_ARGS,
    AgreeConfig,
    aiperf_available,
    compare_clients,
    format_table,
    run_ours,
)
from serving.workload.sweep import ServerProcess
from serving.workload.traces import generate, load_preset

ROOT = Path(__file__).resolve().parents[1]
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start k3-tiny on CPU)")
    p.add_argument("--model", default="k3-tiny")
    p.add_argument("--preset", default="short")
    p.add_argument("--num-sessions", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--duration-s", type=float, default=90.0)
    p.add_argument("--grace-s", type=float, default=60.0)
    p.add_argument("--warmup-s", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3, help="scored AIPerf/ours pairs, alternating")
    p.add_argument("--warmup-pairs", type=int, default=1, help="unscored pairs first (both clients' shapes compile)")
    p.add_argument("--prime-s", type=float, default=0.0,
                   help="replay this long before the pairs (0: none; the warm-up pairs prime the server)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--simultaneous", action=argparse.BooleanOptionalAction, default=False,
                   help="run the two clients of a scored pair at the same time (each at --concurrency), so the "
                        "machine's other load affects both alike; --no-simultaneous: one after the other")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="the started server's prefix cache (the clients' prompt lengths differ, so their hits differ "
                        "session by session; --no-prefix-cache takes that out)")
    p.add_argument("--chat-turn-role", choices=("aiperf", "user", "assistant"), default="aiperf",
                   help="our replay's chat prompts: aiperf (AIPerf 0.13.0's weka layout: the same roles, token counts "
                        "and cache-bust marker position, turn by turn), or our layout with later turns as one user / "
                        "assistant message")
    p.add_argument("--raw-export", action="store_true",
                   help="AIPerf --export-level raw, and check every request it sent, rendered with the server's chat "
                        "template and tokenizer, against the prompt tokens the server reported for our replay's "
                        "request of the same (conversation, turn)")
    p.add_argument("--work", help="directory for the trace and both clients' artifacts (default: a temp dir)")
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "aiperf_agree_cpu.json"))
    a = p.parse_args(argv)
    if not aiperf_available():
        print("AIPerf is not installed (.venv-aiperf): run bash scripts/extras/aiperf.sh", file=sys.stderr)
        return 2
    cfg = AgreeConfig(concurrency=a.concurrency, duration_s=a.duration_s, grace_s=a.grace_s, warmup_s=a.warmup_s,
                      seed=a.seed, model=a.model, chat_turn_role=a.chat_turn_role)
    # AIPerf reads weka_trace files with 64-token blocks whatever they declare (AIPERF_WEKA_BLOCK_SIZE)
    sessions = generate(load_preset(a.preset, num_sessions=a.num_sessions, block_size=AIPERF_WEKA_BLOCK_SIZE))
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="aiperf_agree_"))
    work.mkdir(parents=True, exist_ok=True)
    server = None
    if a.url is None:
        serve_args = [x for x in TINY_CPU_SERVE_ARGS if not (a.prefix_cache and x == "--no-prefix-cache")]
        # JAX_LOG_COMPILES: every XLA compilation in the log, so compare_clients counts those inside each run
        server = ServerProcess(serve_args, log_path=work / "server.log",
                               env={"JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1"}).start()
    url = a.url or server.url
    try:
        if a.prime_s > 0:
            run_ours(sessions, url, AgreeConfig(concurrency=a.concurrency, duration_s=a.prime_s, grace_s=a.grace_s,
                                                warmup_s=0.0, seed=a.seed + 1000, model=a.model,
                                                chat_turn_role=a.chat_turn_role))
        load = [os.getloadavg()]
        result = compare_clients(sessions, url, work, cfg, repeats=a.repeats, warmup_pairs=a.warmup_pairs,
                                 simultaneous=a.simultaneous, server_log=None if a.url else work / "server.log",
                                 aiperf_export_level="raw" if a.raw_export else None)
        load.append(os.getloadavg())
    finally:
        if server is not None:
            server.stop()
    result["machine"] = f"{platform.node()} ({platform.machine()}, CPU)"
    result["date_utc"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    result["command"] = ["python", "benchmarks/aiperf_agree.py", *(sys.argv[1:] if argv is None else argv)]
    result["serve_args"] = None if a.url else serve_args
    result["preset"] = {"name": a.preset, "num_sessions": a.num_sessions, "prime_s": a.prime_s,
                        "block_size": AIPERF_WEKA_BLOCK_SIZE}
    result["load_average_1_5_15"] = {"start": load[0], "end": load[1]}
    print(format_table(result))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out} (artifacts in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
