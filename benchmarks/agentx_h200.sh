#!/usr/bin/env bash
# AgentX sweep of one deployment, start to tarball, in one command (issue 9's H200 acceptance runs):
#
#   benchmarks/agentx_h200.sh configs/deploy/h200x2-colocated.yaml OUTDIR [LABEL]
#   benchmarks/agentx_h200.sh configs/deploy/h200x2-pd-1p1d.yaml OUTDIR [LABEL]
#   AGENTX_TINY=1 benchmarks/agentx_h200.sh configs/deploy/h200x2-pd-1p1d.yaml OUTDIR   # CPU check
#
# 1. installs the wheels of .whl/serve if the machine lacks the serving packages (the GPU image has no
#    fastapi, uvicorn, smg-grpc-proto, ...), starts `python3 -m k3jax serve --deployment DEPLOYMENT`
#    (pool, workers, router) and waits until it is ready;
# 2. primes it: an unscored replay at the top concurrency for PRIME_S seconds (its own prompt namespace;
#    kept as prime/ in the tarball, not in the sweep). The ramp from 1 to LEVELS[0] lanes passes through
#    every row bucket, so the jit compiles (~30-45 s per k3-small program on the H200) land here;
# 3. runs `python3 -m k3jax bench sweep --append` once per level, highest first. Each level has a fresh
#    prompt namespace: its sessions (random start turns in the first START_MAX_RATIO of each chain) are
#    prefilled cold in an unscored warm-up of WARMUP_PER_LANE_S per lane (at least WARMUP_MIN_S), then
#    DURATION_S are scored and in-flight requests drain for up to GRACE_S;
# 4. stops the deployment (SIGINT: the router, the workers, the pool drain) and writes
#    OUTDIR/LABEL.tar.gz (sweep.json, sweep.csv, pareto.png, throughput_over_time.png, c<N>/ and prime/
#    reports, server.log with every worker's output, bench.log) and OUTDIR/LABEL.sweep.json beside it.
#
# Runs from the repo root with the machine's python3 (PYTHON to override) and PYTHONPATH=<repo>; nothing
# is installed from the repo. Every phase prints a UTC timestamp. Knobs (environment), GPU defaults:
#   LEVELS=40,12,4  PRIME_S=100  WARMUP_PER_LANE_S=2  WARMUP_MIN_S=15  DURATION_S=30  GRACE_S=10
#   START_MAX_RATIO=0.1  PRESET=small  READY_TIMEOUT_S=300  NUM_GPUS=<distinct devices>  TIMELINE_BIN_S=15
#   DEADLINE_S=540: a level that would end later than this many seconds after the script started is
#   skipped (and the prime shortened), so the tarball is always written inside the device's 600 s limit.
# Measured 2026-11-30 on the H200 x2 (docs/benchmarks.md, "AgentX replay on two H200s"): colocated, start to tarball
# 462 s (deployment ready after 136 s: weights + a warm-up compiling the 4 programs per worker in 88 s), with
# PRIME_S=60; 1P+1D 346 s with PRIME_S=45 and a JAX compilation cache carried from the colocated run (ready after
# 38 s). `k3jax serve` keeps compiled programs in ~/.cache/k3jax/xla (K3JAX_COMPILE_CACHE), which a fresh device
# machine lacks: export JAX_COMPILATION_CACHE_DIR (it takes precedence; workers inherit it) under an ignored path
# such as .bench_out/jax_cache, and carry it to the next call: the 4 programs are the same in both deployment files.
# Before that: powers-of-4 shape buckets (~120 programs per worker, ~30 s each) let no request reach its first token
# in 5 minutes; the h200x2 files now fix 4 programs per worker and `warmup: true`.
# AGENTX_TINY=1: the same path on this CPU with k3-tiny: the deployment's model, devices and engine sizes
# are swapped (k3-tiny, "cpu", the CPU tests' few shape buckets, free ports), the short preset, levels
# 4,2,1 and a long prime (CPU compiles are slow).
set -euo pipefail

if [[ $# -lt 2 || $# -gt 3 ]]; then
    echo "usage: $0 DEPLOYMENT.yaml OUTDIR [LABEL]" >&2
    exit 2
fi
DEPLOYMENT=$1
OUTDIR=$2
LABEL=${3:-$(basename "$DEPLOYMENT" .yaml)}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
TINY=${AGENTX_TINY:-0}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"

T0=$(date +%s)
log() { echo "[$(date -u +%H:%M:%S) +$(($(date +%s) - T0))s] agentx_h200: $*"; }
left() { echo $((DEADLINE_S - ($(date +%s) - T0))); }  # seconds before the deadline

# The serving stack's packages the GPU image lacks (fastapi, uvicorn, smg-grpc-proto, ...) travel as wheels
# in .whl/serve (carry ".whl"); they go to a private target dir, after the repo on PYTHONPATH.
if ! "$PY" -c "import fastapi, uvicorn, smg_grpc_proto, grpc_health" 2>/dev/null; then
    if ! compgen -G "$ROOT/.whl/serve/*.whl" >/dev/null; then
        log "fastapi/uvicorn/smg-grpc-proto are missing and there are no wheels in .whl/serve"
        exit 1
    fi
    SITE=${AGENTX_SITE:-/tmp/k3jax-serve-site}
    log "installing the wheels of .whl/serve into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$ROOT"/.whl/serve/*.whl
    export PYTHONPATH="$PYTHONPATH:$SITE"
fi

if [[ "$TINY" == 1 ]]; then
    : "${LEVELS:=4,2,1}" "${PRIME_S:=150}" "${WARMUP_PER_LANE_S:=3}" "${WARMUP_MIN_S:=5}" "${DURATION_S:=20}"
    : "${GRACE_S:=20}" "${START_MAX_RATIO:=0.25}" "${PRESET:=short}" "${READY_TIMEOUT_S:=600}" "${TIMELINE_BIN_S:=5}" "${DEADLINE_S:=1500}"
else
    : "${LEVELS:=40,12,4}" "${PRIME_S:=100}" "${WARMUP_PER_LANE_S:=2}" "${WARMUP_MIN_S:=15}" "${DURATION_S:=30}"
    : "${GRACE_S:=10}" "${START_MAX_RATIO:=0.1}" "${PRESET:=small}" "${READY_TIMEOUT_S:=300}" "${TIMELINE_BIN_S:=15}" "${DEADLINE_S:=540}"
fi

mkdir -p "$OUTDIR"
WORK=$(mktemp -d)
RUN="$WORK/$LABEL"
mkdir -p "$RUN"

# The deployment actually served (the tiny swap writes a rewritten copy), its URL and GPU count.
read -r DEPLOY_FILE URL GPUS < <("$PY" - "$DEPLOYMENT" "$RUN" "$TINY" <<'EOF'
import socket, sys
from pathlib import Path

import yaml

from serving.disagg.deploy import load_deployment

src, run, tiny = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1"
raw = yaml.safe_load(Path(src).read_text())
if tiny:
    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    raw["model"] = "k3-tiny"
    raw["warmup"] = False  # compiling every k3-tiny bucket up front is slower on a CPU than compiling on demand
    # k3-tiny sizes (the short preset's histories reach 3.6k tokens) with the CPU tests' few shape buckets
    # (rows 1,4 x tokens 16,128 x pages 1,256): each compile takes tens of seconds on a loaded 2-core CPU
    raw["engine"] = {"page_size": 16, "max_model_len": 4096, "max_running": 4, "max_prefill_tokens": 128,
                     "bucket_growth": 256, "host_cache_gb": 0.5, "num_pages": 1200, "num_slots": 64,
                     "store_write_through": True}
    for w in raw["workers"]:
        w["devices"] = "cpu"
        for key in ("grpc_port", "bootstrap_port", "http_port"):
            if w.get(key):
                w[key] = free_port()
    if raw.get("router"):
        raw["router"]["port"] = free_port()
    if raw.get("pool"):
        raw["pool"] = {"port": free_port(), "capacity_gb": 1}
dep_file = run / "deployment.yaml"
dep_file.write_text(yaml.safe_dump(raw, sort_keys=False))
dep = load_deployment(dep_file)
if dep.router is not None:
    url = f"http://{dep.router.host}:{dep.router.port}"
else:
    ports = [w.http_port for w in dep.workers if w.http_port]
    if len(ports) != 1:
        sys.exit("a deployment without a router needs exactly one worker with an http_port")
    url = f"http://{dep.host}:{ports[0]}"
devices = {d for w in dep.workers if w.devices != "cpu" for d in w.devices.split(",")}
gpus = len(devices) or len(dep.workers)  # CPU runs: one nominal "GPU" per worker
print(dep_file, url, gpus)
EOF
)
if [[ -z "${URL:-}" ]]; then
    log "could not read the deployment $DEPLOYMENT (see the error above)"
    exit 1
fi
GPUS=${NUM_GPUS:-$GPUS}
log "deployment $DEPLOYMENT (tiny=$TINY) -> $URL, $GPUS GPU(s); levels $LEVELS; preset $PRESET; out $OUTDIR/$LABEL.tar.gz"

SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        log "stopping the deployment (SIGINT)"
        kill -INT "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 90); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 1
        done
        if kill -0 "$SERVER_PID" 2>/dev/null; then
            log "deployment still running after 90 s: SIGKILL to its process group"
            kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        fi
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
package() {
    stop_server
    tar -czf "$OUTDIR/$LABEL.tar.gz" -C "$WORK" "$LABEL"
    if [[ -f "$RUN/sweep.json" ]]; then
        cp "$RUN/sweep.json" "$OUTDIR/$LABEL.sweep.json"
    fi
    log "wrote $OUTDIR/$LABEL.tar.gz ($(du -h "$OUTDIR/$LABEL.tar.gz" | cut -f1))"
    rm -rf "$WORK"
}
trap package EXIT

log "starting the deployment"
: >"$RUN/server.log"
setsid "$PY" -m k3jax serve --deployment "$DEPLOY_FILE" >"$RUN/server.log" 2>&1 &
SERVER_PID=$!
START=$(date +%s)
until grep -q "k3jax serve: deployment ready" "$RUN/server.log" 2>/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        log "the deployment exited before it was ready; its log:"
        tail -n 60 "$RUN/server.log"
        exit 1
    fi
    if (($(date +%s) - START > READY_TIMEOUT_S)); then
        log "the deployment was not ready within ${READY_TIMEOUT_S} s; its log:"
        tail -n 60 "$RUN/server.log"
        exit 1
    fi
    sleep 2
done
log "deployment ready after $(($(date +%s) - START)) s"

IFS=, read -r -a LEVEL_LIST <<<"$LEVELS"
check_alive() {
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        log "the deployment died during $1; its log's tail:"
        tail -n 60 "$RUN/server.log"
        exit 1
    fi
}
# the replay client needs no accelerator: JAX_PLATFORMS=cpu keeps it off the GPUs the workers use
BENCH=(env JAX_PLATFORMS=cpu "$PY" -m k3jax bench)
COMMON=(--url "$URL" --preset "$PRESET" --grace-s "$GRACE_S" --start-max-ratio "$START_MAX_RATIO" --num-gpus "$GPUS"
        --no-progress)
STOP_RESERVE_S=30  # stopping the deployment + writing the tarball
LAST_LEVEL=${LEVEL_LIST[${#LEVEL_LIST[@]}-1]}
# keep time for at least the smallest level after the prime
MIN_LEVEL_S=$("$PY" -c "print(int(max($WARMUP_MIN_S, $LAST_LEVEL * $WARMUP_PER_LANE_S) + $DURATION_S + $GRACE_S + 15))")
PRIME_MAX=$(($(left) - STOP_RESERVE_S - MIN_LEVEL_S - GRACE_S - 15))
if ((PRIME_MAX < ${PRIME_S%.*})); then
    log "prime shortened from ${PRIME_S} s to ${PRIME_MAX} s to fit DEADLINE_S=${DEADLINE_S}"
    PRIME_S=$((PRIME_MAX > 0 ? PRIME_MAX : 0))
fi
if [[ "$PRIME_S" != 0 ]]; then
    log "prime: c=${LEVEL_LIST[0]} for ${PRIME_S} s, unscored (absorbs the jit compiles)"
    "${BENCH[@]}" agentx "${COMMON[@]}" --concurrency "${LEVEL_LIST[0]}" --warmup-s 0 --duration-s "$PRIME_S" \
        --out "$RUN/prime" >>"$RUN/bench.log" 2>&1 || log "the prime replay failed (see bench.log); going on"
    check_alive "the prime"
    log "prime done"
fi
for C in "${LEVEL_LIST[@]}"; do
    WARMUP=$("$PY" -c "print(max($WARMUP_MIN_S, round($C * $WARMUP_PER_LANE_S, 1)))")
    NEED=$("$PY" -c "print(int($WARMUP + $DURATION_S + $GRACE_S + 15 + $STOP_RESERVE_S))")  # +15: trace + start
    if (($(left) < NEED)); then
        log "level c=$C skipped: it needs ~${NEED} s and $(left) s are left before DEADLINE_S=${DEADLINE_S}"
        continue
    fi
    log "level c=$C: warm-up ${WARMUP} s (unscored), scored ${DURATION_S} s, drain <= ${GRACE_S} s"
    "${BENCH[@]}" sweep "${COMMON[@]}" --concurrency "$C" --append --out "$RUN" --label "$LABEL" \
        --warmup-s "$WARMUP" --duration-s "$DURATION_S" --timeline-bin-s "$TIMELINE_BIN_S" 2>&1 | tee -a "$RUN/bench.log"
    check_alive "level c=$C"
    log "level c=$C done"
done
log "sweep done"
