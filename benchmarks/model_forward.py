"""Model forward speed on one device, per compute backend: prefill tokens/s, batched decode and its roofline,
and how far each backend's results are from the first one's.

    PYTHONPATH=. python benchmarks/model_forward.py --out .bench_out/model_forward.json   # k3-small, H200
    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/model_forward.py --backends reference,pallas \
        --warmup 1 --iters 3 --budget-s 240 --out $OUT/model_backends_h200.json             # kernels vs reference
    python benchmarks/model_forward.py --model k3-tiny --backends reference,interpret \
        --tokens 64 --batch 4 --context 100 --page-size 16                                 # CPU smoke run
    python benchmarks/model_forward.py --dispatch-only --backends reference,pallas        # k3-small ops, any machine

One process, one random-init parameter set, and for every backend of --backends (a comma list; --backend is
the one-element form) the same inputs:
  (a) decode: `k3jax.decode` with --batch rows, each with a --context-token history, one token per row per
      step: median ms/step over --steps synchronised steps after warm-up; tokens/s = batch / step. The
      history is synthetic (random latents and KDA states written straight into the pools, no prefill),
      rebuilt from the same key for each backend (the step donates its state). Step i feeds every backend
      the same random tokens (teacher forcing, not the argmax), so every step's logits are comparable.
  (b) prefill: `k3jax.prefill` of --tokens tokens for one request (B=1) into a fresh paged state per
      backend: median tokens/s over --iters runs after the warm-up (compile) runs. Every run rewrites the
      same pages and slot from position 0, so the state after the last run is the state one prefill writes.
  (c) the decode memory roofline: bytes one step must move -- every non-expert weight (only the batch's
      rows of the embedding), the experts the batch activates (expected distinct experts under uniform
      routing, E * (1 - (1 - k/E)^B) per MoE layer), the MLA latents of every row's history, and the KDA
      recurrent + conv states read and written -- divided by a device copy bandwidth measured in the same
      run (a large elementwise jnp op, bytes read + written). ratio = measured step / floor (>= 1), per
      backend (the bytes do not depend on the backend).
  (d) cross-backend checks against the FIRST backend of the list, relative error ||a - b|| / ||b|| in fp32:
      decode logits of the first and the last step run, prefill logits (last token), and the state the
      prefill wrote (KDA recurrent and conv states of the request's slot, MLA latents of its tokens; per
      layer too). Pass when every error is finite and below its phase's bar (--decode-tol 5e-2, --prefill-tol
      0.2 for bf16: CHECK_TOL says why).
      A failed check is reported beside the timings, never instead of them.
  (e) dispatch: which implementation each registered op (k3jax/backend.py) ran under each backend, recorded
      while the step is traced (its first call), including the MLA kernels' own shape fallback to the
      reference inside the "pallas" implementation (k3jax/mla.py: Triton tiles need C, R powers of two).
      --dispatch-only reports just this, from shapes (no weights, nothing runs), on any machine.
Phases run decode first (the issues' decode roofline is the number most wanted), then prefill, each for all
backends in order. A phase that raises is recorded with its error and the run goes on. --budget-s bounds the
wall time from the start of main() (the imports before it take ~2 s): once spent, remaining phases are
recorded as skipped and a running timed loop stops after its first timed iteration (a compile that is under
way cannot be cut). The JSON is rewritten after every phase, so a killed run still leaves what it measured.
Peak device memory comes from `memory_stats()` (absent on CPU; it is the process peak so far).
Prints a table per backend and phase, then (several backends) a speed-up table: each phase's time per backend,
decode with its roofline ratio, and each later backend's tokens/s over the first's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import k3jax
from k3jax import StepMeta, backend
from k3jax import kda as k3_kda
from k3jax import layers as k3_layers
from k3jax import mla as k3_mla
from k3jax import moe as k3_moe

PHASES = ("decode", "prefill")
# Cross-backend pass bars (relative L2 error) for bf16 models, per phase. Each kernel matches its reference within
# ~3-5e-3 in bf16 on the GPU (tests/gpu: KDA 4e-3, MLA <= 2 * 2^-9, MoE ~3e-3), but a bf16 model compounds rounding
# over depth, and the reference path is no closer to exact than the kernels. Measured on CPU (2026-11-30) with
# k3-small's layer pattern at tiny widths (25 layers, MLA at 3, 7, ..., 23, 24, AttnRes blocks of 6, MLA latent
# 32 + 16 so the MLA kernels run; bf16):
#   prefill (256 tokens): "interpret" kernels vs the reference 9.8e-2 on logits, 8.0e-2 KDA states, 5.3e-2 conv
#     states, 7.0e-2 MLA latents, growing smoothly with depth (KDA 6e-3 at layer 1 to 0.14 at the last); the bf16
#     reference alone is as far (5.5-7.5e-2) from the same weights in fp32, at 256 and at 2048 tokens alike;
#   decode (B8, 300-token history): 6.4e-3 on the first step's logits, 9.9e-3 after 3 steps.
# A wiring error (wrong page, slot, layout or gate) moves results by O(1) (0.5 and more) and shows as a jump in
# the per-layer errors, not a smooth growth. Bars: prefill 0.2 (2x the measured band), decode 5e-2 (5x).
# fp32 models (k3-tiny) differ by summation order only (~1e-6): the CPU test passes 1e-4.
CHECK_TOL = {"decode": 5e-2, "prefill": 2e-1}
# On k3-small with random weights on the H200 (2026-11-30) those end-to-end checks cannot tell a kernel from rounding:
# swapping in ANY one Pallas op -- even the elementwise gated RMSNorm -- moved the last layers' states and the logits
# by O(1) (0.65-1.3 relative), from 1e-4 where the op first acts: a perturbation that flips a near-tie in the top-8
# of 192 random router scores swaps whole experts, and the next layers' routing amplifies it. --shadow-check compares
# each kernel call with its plain-JAX twin on the very same inputs instead, so nothing compounds. Its bar is the
# loosest per-kernel bf16 bar of the GPU tests (tests/gpu: KDA 2e-2; MLA, MoE and the norms 1e-2).
SHADOW_TOL = 2e-2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="k3-small", help="preset name or config path (default k3-small)")
    p.add_argument("--dtype", default=None, help="override the config's activation/weight dtype (e.g. bfloat16)")
    p.add_argument("--tokens", type=int, default=8192, help="prefill tokens, one request (default 8192)")
    p.add_argument("--batch", type=int, default=64, help="decode rows (default 64)")
    p.add_argument("--context", type=int, default=8192,
                   help="history tokens per decode row (default 8192: ~4.2 GB of MLA latents + 1.2 GB of KDA "
                        "state for k3-small at batch 64, beside its 17 GB of weights -- fits one H200)")
    p.add_argument("--page-size", type=int, default=64, help="MLA page size (default 64)")
    p.add_argument("--iters", type=int, default=5, help="timed prefill runs (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps (default 20)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs/steps first (default 2)")
    p.add_argument("--backends", default=None,
                   help=f"comma list of k3jax backends ({', '.join(backend.BACKENDS)}); the first is the "
                        "reference of the cross-backend checks (default: --backend)")
    p.add_argument("--backend", default=None, help="one backend, same as --backends NAME (default reference)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {PHASES}, run in this order")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds from the start (of main) after which remaining phases are skipped and running timed "
                        "loops stop; a compile under way is not cut")
    for phase in PHASES:
        p.add_argument(f"--{phase}-tol", type=float, default=CHECK_TOL[phase],
                       help=f"pass bar of the {phase} cross-backend relative errors (default {CHECK_TOL[phase]}, "
                            "see CHECK_TOL)")
    p.add_argument("--dispatch-only", action="store_true",
                   help="trace each backend's steps at these shapes (no weights, nothing runs; any machine) and "
                        "report which implementation every op dispatches to")
    p.add_argument("--init", choices=("auto", "jit", "eager"), default="auto",
                   help="parameter init: jit (one program) or eager (op by op, still on the device); auto = "
                        "eager: compiling the whole init took 247 s for k3-small on the H200 (2026-11-29)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="size of the bandwidth probe (default 4096 MiB on accelerators, 256 on CPU)")
    p.add_argument("--profile", action="store_true",
                   help="after each backend's timed decode steps, trace --profile-steps more under jax.profiler and "
                        "record the device time per kernel name (where the step's time goes)")
    p.add_argument("--profile-steps", type=int, default=3, help="decode steps traced by --profile (default 3)")
    p.add_argument("--shadow-check", action="store_true",
                   help="per backend other than the reference, one more untimed prefill and decode step in which every kernel call also "
                        "runs its plain-JAX twin on the same inputs: relative error per op (the model-level check that "
                        "does not compound through depth; bar --shadow-tol)")
    p.add_argument("--shadow-tol", type=float, default=SHADOW_TOL,
                   help=f"pass bar of --shadow-check's per-call relative errors (default {SHADOW_TOL:g})")
    p.add_argument("--shadow-tokens", type=int, default=1024,
                   help="prefill tokens of --shadow-check (default 1024: the KDA twin keeps every position's state, "
                        "1 MB per token and layer at k3-small; 8192 ran out of the H200's memory)")
    p.add_argument("--shadow-batch", type=int, default=16,
                   help="decode rows of --shadow-check (default 16): with the KDA pools updated in place, each layer's "
                        "twin needs its own copy of the whole stacked pool, and at 64 rows of k3-small the shadowed "
                        "step asked the H200 for 57 GiB")
    p.add_argument("--shadow-context", type=int, default=2048, help="history per decode row of --shadow-check")
    p.add_argument("--mla-kernel", choices=("triton", "mosaic"), default=k3_mla.MLA_DECODE_KERNEL,
                   help="the MLA decode kernel of the pallas backend (k3jax.mla.MLA_DECODE_KERNEL; default "
                        f"{k3_mla.MLA_DECODE_KERNEL})")
    p.add_argument("--kda-decode-kernel", choices=("triton", "mosaic"), default=k3_kda.KDA_DECODE_KERNEL,
                   help="the KDA fused decode kernel of the pallas backend (k3jax.kda.KDA_DECODE_KERNEL; default "
                        f"{k3_kda.KDA_DECODE_KERNEL}); mosaic: pallas_kernels/kda_decode_mgpu.py (decode and verify)")
    p.add_argument("--moe-rank-in-kernel", type=int, choices=(0, 1), default=1,
                   help="1 (default): the MoE kernels rank their own rows at decode sizes "
                        "(pallas_kernels.moe_gemm.ranks_in_kernel); 0: one XLA sort per MoE layer, as before")
    p.add_argument("--moe-decode-tiling", default=None,
                   help="pallas_kernels.moe_gemm.DECODE_CONFIG for this run, as bm/gn/dn/bk/warps/stages"
                        "[/tail_block_m[/down_stages[/down_split_k[/aligned[/column_group]]]]] (the grouped GEMMs' "
                        "tiling at <= 16 rows per expert; MoeGemmConfig.from_tiling)")
    p.add_argument("--moe-combine-kernel", type=int, choices=(0, 1), default=int(k3_moe.COMBINE_KERNEL),
                   help="1 (default): the MoE experts' combine, latent RMSNorm and shared GLU as one kernel "
                        "(pallas_kernels/moe_combine.py; k3jax.moe.COMBINE_KERNEL); 0: as XLA fuses them")
    p.add_argument("--dense-kernel", choices=k3_layers.DENSE_KERNELS, default=k3_layers.DENSE_DECODE_KERNEL,
                   help="the pallas backend's dense GEMMs at decode sizes (k3jax.layers.DENSE_DECODE_KERNEL; default "
                        f"{k3_layers.DENSE_DECODE_KERNEL}): xla, or skinny (pallas_kernels/skinny_gemm.py)")
    p.add_argument("--fuse", type=int, choices=(0, 1), default=1,
                   help="1 (default): run on the serving layout (k3jax.fuse.fuse_for_serving: each layer's input "
                        "projections as one weight, as the engine loads them on one device); 0: the checkpoint layout")
    p.add_argument("--kda-loop-v", type=int, choices=(0, 1), default=None,
                   help="pallas_kernels.kda_decode.DEFAULT_LOOP_V for this run (1: one program per head walking its "
                        "V-blocks; default: the module's)")
    p.add_argument("--dump-hlo", default=None,
                   help="write the decode step's compiled (optimised) HLO text here, after its timed steps (compiles "
                        "the step once more)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON result here (rewritten after every phase)")
    args = p.parse_args(argv)
    for name in ("tokens", "batch", "page_size", "iters", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.context < 0 or args.warmup < 1:
        p.error("--context must be >= 0 and --warmup >= 1")
    if args.backends is not None and args.backend is not None:
        p.error("give --backends or --backend, not both")
    args.backend_list = [b.strip() for b in (args.backends or args.backend or "reference").split(",") if b.strip()]
    bases = [split_backend(b) for b in args.backend_list]
    unknown = [b for b, (base, ops) in zip(args.backend_list, bases) if base not in backend.BACKENDS or ops == ()]
    if not args.backend_list or unknown or len(set(args.backend_list)) != len(args.backend_list):
        p.error(f"--backends must name distinct backends of {backend.BACKENDS} (or BACKEND:OP+OP); got "
                f"{args.backend_list}")
    if args.profile and jax.default_backend() == "cpu" and args.model == "k3-small":
        p.error("--profile of k3-small on CPU would take hours; pass a small --model")
    args.phase_list = [x.strip() for x in args.phases.split(",") if x.strip()]
    if not args.phase_list or any(x not in PHASES for x in args.phase_list) or len(set(args.phase_list)) != len(args.phase_list):
        p.error(f"--phases must name distinct phases of {PHASES}; got {args.phases!r}")
    if args.budget_s is not None and args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    return args


class Budget:
    """Wall-clock budget: seconds left until `budget_s` after `start` (perf_counter), or no limit."""

    def __init__(self, budget_s: float | None, start: float):
        self.budget_s, self.start = budget_s, start

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self) -> bool:
        return self.budget_s is not None and self.elapsed() >= self.budget_s


def split_backend(spec: str) -> tuple[str, tuple[str, ...] | None]:
    """'pallas' -> ('pallas', None); 'pallas:moe_experts+kda_decode_fused' -> ('pallas', (those ops)): the
    backend with its own implementations of the named ops only, every other op on the reference (a bisection:
    which kernel moves the model's outputs, and what each saves)."""
    base, sep, ops = spec.partition(":")
    return base, (tuple(o for o in ops.split("+") if o) if sep else None)


@contextlib.contextmanager
def backend_scope(spec: str):
    """Yields the backend name to pass to the model for `spec`; a restricted spec hides the backend's other ops
    for the block and clears jax's caches on entry and exit (steps are jitted on the backend's name)."""
    base, ops = split_backend(spec)
    if ops is None:
        yield base
        return
    jax.clear_caches()
    try:
        with backend.restricted(base, ops):
            yield base
    finally:
        jax.clear_caches()


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


def copy_probes(mib: int) -> dict[str, float]:
    """Copy bandwidth in bytes/s (read + write) by every probe this machine has: XLA's elementwise op, and torch's
    device-to-device copy where torch sees a GPU (benchmarks/moe.py's probe). The floor divides by the highest: XLA's
    probe read 3.2-3.7 TB/s across one session's calls on the H200 where torch's read 4.26 (2026-12-02)."""
    probes = {"xla": copy_bandwidth(mib)}
    if jax.devices()[0].platform == "gpu":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from benchmarks.moe import torch_copy_bandwidth

        torch_gbps = torch_copy_bandwidth(mib * 2**20)
        if torch_gbps:
            probes["torch"] = torch_gbps * 1e9
    return probes


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


# ------------------------------------------------------------------------------------------------------------
# dispatch: which implementation each op ran


@contextlib.contextmanager
def record_dispatch(backend_name: str):
    """Within the block, counts the ops the model looks up in the registry (`backend.get`) and which
    implementation each resolved to, plus the MLA kernel choice inside the "pallas" / "interpret"
    implementation (mla_decode, mla_prefill, or its shape fallback to the reference). Works while a step
    is traced: wrap a jitted step's first call (or `jax.eval_shape` of its `__wrapped__`)."""
    from k3jax import mla

    calls: Counter = Counter()
    mla_paths: Counter = Counter()
    get = backend.get

    def recording_get(op, name="reference"):
        calls[(op, name if name in backend.implemented(op) else "reference")] += 1
        return get(op, name)

    def counted(path, fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            mla_paths[path] += 1
            return fn(*a, **kw)
        return wrapper

    patches = [(backend, "get", recording_get),
               (mla, "paged_attention_reference", counted("reference (shape fallback)", mla.paged_attention_reference))]
    try:  # the kernels' modules import Pallas (k3jax imports them on use only)
        from pallas_kernels import mla_decode, mla_prefill
    except ImportError:
        pass
    else:
        patches += [(mla_decode, "mla_decode", counted("mla_decode", mla_decode.mla_decode)),
                    (mla_prefill, "mla_prefill", counted("mla_prefill", mla_prefill.mla_prefill))]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in patches]
    record = {"ops": {}, "traced": False}
    try:
        for mod, attr, fn in patches:
            setattr(mod, attr, fn)
        yield record
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)
        record["traced"] = bool(calls)
        for (op, impl), n in sorted(calls.items()):
            entry = {"impl": impl, "calls": n}
            if op == "mla_paged_attention" and impl != "reference":
                entry["kernels"] = dict(mla_paths)
            record["ops"][op] = entry


def traced_dispatch(step, cfg, args: tuple, backend_name: str, record: dict) -> dict:
    """`record` from the first call, or (when that call hit jax's trace cache and recorded nothing) from
    tracing the step's unjitted body once more under `jax.eval_shape` (nothing runs)."""
    if record["traced"]:
        return record
    with record_dispatch(backend_name) as again:
        params, state, tokens, meta = args
        jax.eval_shape(lambda p, s, t, m: step.__wrapped__(p, cfg, s, t, m, backend_name=backend_name),
                       params, state, tokens, meta)
    return again


def non_reference_ops(dispatch: dict) -> list[str]:
    """'op' (or 'op (kernel)' for MLA) for every op that ran an implementation other than the reference; an MLA
    op whose implementation only fell back to the reference (unsupported latent widths) is left out."""
    out = []
    for op, entry in dispatch["ops"].items():
        if entry["impl"] == "reference":
            continue
        kernels = entry.get("kernels", {})
        if kernels and set(kernels) == {"reference (shape fallback)"}:
            continue
        out.append(op + (f" ({', '.join(sorted(kernels))})" if kernels else ""))
    return out


def step_shapes(cfg, args, phase: str) -> tuple:
    """(params, state, tokens, meta) shapes of the phase's step as the benchmark calls it."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    if phase == "decode":
        b, pages = args.batch, -(-(args.context + decode_steps(args)) // args.page_size)
        tokens = i32(b)
    else:
        b, pages = 1, -(-args.tokens // args.page_size)
        tokens = i32(1, args.tokens)
    state = jax.eval_shape(lambda: k3jax.init_state(cfg, b, b * pages, args.page_size))
    params = k3jax.param_shapes(cfg)
    if args.fuse:  # the layout the timed phases run (the MoE op differs: moe_out_input on fused params)
        from k3jax.fuse import fuse_for_serving

        params = jax.eval_shape(lambda p: fuse_for_serving(p, cfg), params)
    return params, state, tokens, StepMeta(i32(b), i32(b, pages), i32(b), i32(b))


def dispatch_report(cfg, args) -> dict:
    """--dispatch-only: per backend and phase, the dispatch found by tracing the step at the run's shapes."""
    steps = {"decode": k3jax.decode, "prefill": k3jax.prefill}
    report = {}
    for name in args.backend_list:
        for phase in args.phase_list:
            with backend_scope(name) as base:
                dispatch = traced_dispatch(steps[phase], cfg, step_shapes(cfg, args, phase), base,
                                           {"ops": {}, "traced": False})
            report.setdefault(name, {})[phase] = {"dispatch": dispatch, "non_reference_ops": non_reference_ops(dispatch)}
            ops = ", ".join(f"{op} -> {e['impl']}" + (f" {e['kernels']}" if "kernels" in e else "") + f" x{e['calls']}"
                            for op, e in dispatch["ops"].items())
            print(f"{phase} [{name}]: {ops}")
    return report


# ------------------------------------------------------------------------------------------------------------
# phases


@functools.lru_cache(maxsize=None)
def _history_builder(cfg, batch: int, pages_per_row: int, page_size: int):
    @jax.jit
    def build(key):
        k1, k2, k3 = jax.random.split(key, 3)
        act = jnp.dtype(cfg.dtype)
        kv = jax.random.normal(k1, (cfg.num_mla_layers, batch * pages_per_row, page_size, cfg.latent_cache_dim), act)
        kda = 0.01 * jax.random.normal(
            k2, (cfg.num_kda_layers, batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32)
        conv = jax.random.normal(k3, (cfg.num_kda_layers, batch, cfg.kda_conv_kernel - 1, cfg.conv_channels), act)
        return k3jax.DecodeState(kda=kda, conv=conv, kv_pages=kv)

    return build


def synthetic_history(cfg, batch: int, pages_per_row: int, page_size: int, seed: int):
    """A decode state whose pools hold random latents and small random KDA/conv states (same seed, same
    values: each backend gets its own, equal copy)."""
    like = jax.eval_shape(lambda: k3jax.init_state(cfg, batch, batch * pages_per_row, page_size))
    state = _sync(_history_builder(cfg, batch, pages_per_row, page_size)(jax.random.key(seed)))
    same = jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), state, like)
    if not all(jax.tree.leaves(same)):
        raise RuntimeError("synthetic_history no longer matches k3jax.init_state's layout")
    return state


def _timed_loop(run, warmup: int, count: int, budget: Budget) -> dict:
    """Calls run(i) for i = 0 .. warmup + count - 1 (run syncs), timing those from i = warmup on. Once the
    budget is spent, warm-up stops and the loop ends after its first timed call."""
    times, first, cut = [], None, False
    for i in range(warmup + count):
        timed = i >= warmup or (i > 0 and budget.spent())
        t = time.perf_counter()
        run(i)
        dt = time.perf_counter() - t
        if i == 0:
            first = dt
        if timed and i > 0:
            times.append(dt)
        if times and budget.spent() and i < warmup + count - 1:
            cut = True
            break
    return {"first_call_s": first, "times": times, "cut_by_budget": cut}


@contextlib.contextmanager
def shadowed(backend_name: str, record: list):
    """Within the block every op the model looks up for `backend_name` that the backend implements itself runs
    twice on the same inputs, as that implementation and as its twin (backend.twin); the model goes on with the
    implementation's result, and (op, [relative error per output leaf]) lands in `record` from the device.
    Clears jax's caches on entry and exit (steps are jitted on the backend's name)."""
    get = backend.get

    def rel(a, b):
        a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
        return jnp.linalg.norm((a32 - b32).ravel()) / jnp.maximum(jnp.linalg.norm(b32.ravel()), 1e-30)

    def shadow_get(op, name="reference"):
        fn = get(op, name)
        if name != backend_name or name not in backend.implemented(op):
            return fn
        twin = backend.twin(op)

        def both(*a, **kw):
            got = fn(*a, **kw)
            want = twin(*a, **kw)
            none = lambda x: x is None  # noqa: E731 -- a kernel may skip an output its caller did not ask for
            got_leaves, want_leaves = jax.tree.leaves(got, is_leaf=none), jax.tree.leaves(want, is_leaf=none)
            if len(got_leaves) != len(want_leaves):
                raise ValueError(f"{op}: {name} returned {len(got_leaves)} outputs, its twin {len(want_leaves)}")
            errors = [rel(x, y) for x, y in zip(got_leaves, want_leaves) if x is not None and y is not None]
            jax.debug.callback(lambda *e: record.append((op, [float(x) for x in e])), *errors)
            return got

        return both

    jax.clear_caches()
    backend.get = shadow_get
    try:
        yield
    finally:
        backend.get = get
        jax.effects_barrier()
        jax.clear_caches()


def shadow_check(params, cfg, args, spec: str) -> dict:
    """--shadow-check for one backend: one prefill (args.tokens) and one decode step, every kernel call against
    its twin; per op the calls and the largest and median relative error over calls and output leaves."""
    small = argparse.Namespace(**{**vars(args), "warmup": 1, "steps": 1, "iters": 1, "profile": False,
                                  "tokens": min(args.tokens, args.shadow_tokens),
                                  "batch": min(args.batch, args.shadow_batch),
                                  "context": min(args.context, args.shadow_context)})
    result = {"prefill_tokens": small.tokens, "decode_batch": small.batch, "decode_context": small.context}
    for phase, bench in (("prefill", bench_prefill), ("decode", bench_decode)):
        if phase not in args.phase_list:
            continue
        record: list = []
        base, ops = split_backend(spec)
        with backend_scope(spec), shadowed(base, record):
            bench(params, cfg, small, base, Budget(None, time.perf_counter()))
        per_op: dict = {}  # op -> one list of output-leaf errors per call
        for op, errors in record:
            per_op.setdefault(op, []).append(errors)
        result[phase] = {}
        for op, calls in per_op.items():
            errs = [e for call in calls for e in call]
            result[phase][op] = {"calls": len(calls), "max_rel_error": max(errs),
                                 "median_rel_error": statistics.median(errs),
                                 "passed": all(math.isfinite(e) for e in errs) and max(errs) < args.shadow_tol}
    result["passed"] = bool(all(e["passed"] for ph in ("prefill", "decode") for e in result.get(ph, {}).values()))
    return result


def decode_steps(args) -> int:
    """Decode steps one backend runs: warm-up, timed (synchronous, then back to back), and --profile's traced ones."""
    return args.warmup + 2 * args.steps + (args.profile_steps if args.profile else 0)


# kernel-name substrings -> the part of the step they belong to (first match wins; names lower-cased)
KERNEL_GROUPS = (
    ("kda_decode", "KDA decode kernel"), ("kda_chunk", "KDA prefill kernels"), ("mla_decode", "MLA decode kernel"),
    ("mgpu_decode", "MLA decode kernel"), ("mosaic", "Mosaic GPU kernels"),
    ("mla_prefill", "MLA prefill kernel"), ("moe_grouped", "MoE grouped GEMM kernels"),
    ("moe_combine", "MoE combine kernel"),
    ("attn_res", "AttnRes mix+norm kernel"), ("gated_rms", "gated RMSNorm kernel"),
    ("skinny_matmul", "dense GEMMs (Pallas skinny)"), ("router_topk", "MoE router selection kernel"),
    ("gemm", "dense GEMMs (cuBLAS/XLA)"), ("xmma", "dense GEMMs (cuBLAS/XLA)"), ("nvjet", "dense GEMMs (cuBLAS/XLA)"),
    ("cutlass", "dense GEMMs (cuBLAS/XLA)"), ("triton", "XLA Triton fusions"), ("memcpy", "copies"),
    ("memset", "copies"),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((group for key, group in KERNEL_GROUPS if key in low), "XLA fusions / other")


def idle_gaps(intervals: list[tuple[float, float]], long_us: float = 100.0) -> dict:
    """Device idle time within the union of kernel intervals (start, end) in us: the span from the first start to
    the last end, and the uncovered time in it split into gaps shorter / not shorter than `long_us`."""
    span = short = long = 0.0
    long_count = 0
    if intervals:
        intervals = sorted(intervals)
        span = max(end for _, end in intervals) - intervals[0][0]
        covered_to = intervals[0][1]
        for start, end in intervals[1:]:
            if start > covered_to:
                gap = start - covered_to
                if gap < long_us:
                    short += gap
                else:
                    long += gap
                    long_count += 1
            covered_to = max(covered_to, end)
    return {"span_us": span, "short_us": short, "long_us": long, "long_count": long_count}


def profile_kernel_times(trace_dir: str, steps: int) -> dict:
    """Device time per kernel name from the perfetto trace jax.profiler wrote under `trace_dir`, per step.

    Device events are those of processes named like a device ("/device:GPU:0 ..."); on a CPU run there are none
    and the host's op events are summed instead (so the breakdown still says where time went)."""
    import gzip

    files = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    events = json.loads(gzip.decompress(files[-1].read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, n in names.items() if "gpu" in n.lower() or "/device:" in n.lower()}
    source = "device" if device_pids else "host"
    pids = device_pids or set(names)
    total_us: Counter = Counter()
    count: Counter = Counter()
    host_us: Counter = Counter()
    host_count: Counter = Counter()
    intervals = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or e["name"].startswith("$"):  # $: Python frames
            continue
        if e.get("pid") in pids:
            total_us[e["name"]] += float(e["dur"])
            count[e["name"]] += 1
            intervals.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
        elif device_pids:  # the host's side of a device trace: XLA's thunks, CUDA API calls (launches, syncs, allocs)
            host_us[e["name"]] += float(e["dur"])
            host_count[e["name"]] += 1
    gaps = idle_gaps(intervals)
    by_group: Counter = Counter()
    for name, us in total_us.items():
        by_group[kernel_group(name)] += us
    per_step = lambda us: us / 1e3 / steps  # noqa: E731
    return {
        "source": source, "steps": steps, "ms_per_step": per_step(sum(total_us.values())),
        "kernels_per_step": sum(count.values()) / steps,
        # first kernel start to last kernel end over the traced steps: span - ms_per_step is the device idle
        # time between kernels (launch gaps, host waits between synchronous steps)
        "span_ms_per_step": per_step(gaps["span_us"]),
        # idle split by gap length: short gaps are launch latency between kernels, long ones (>= 100 us) are mostly
        # the host between two synchronous steps (dispatch, sync) or a host-side wait inside one
        "idle_short_ms_per_step": per_step(gaps["short_us"]), "idle_long_ms_per_step": per_step(gaps["long_us"]),
        "idle_long_gaps_per_step": gaps["long_count"] / steps,
        "by_group_ms_per_step": {g: per_step(us) for g, us in by_group.most_common()},
        "by_kernel": [{"name": n, "ms_per_step": per_step(us), "calls_per_step": count[n] / steps,
                       "group": kernel_group(n)} for n, us in total_us.most_common(80)],
        # host events by name (nested events each count their own duration): where the host's time goes while it
        # enqueues the step -- e.g. cuLaunchKernel* per kernel, or a stream synchronize / allocation inside a step
        "host_by_name": [{"name": n[:160], "ms_per_step": per_step(us), "calls_per_step": host_count[n] / steps}
                         for n, us in host_us.most_common(60)],
    }


def bench_decode(params, cfg, args, backend_name: str, budget: Budget) -> tuple[dict, dict, dict]:
    """Timings, dispatch and the outputs the checks compare (logits of the first and last step run)."""
    b, ctx, ps = args.batch, args.context, args.page_size
    total_steps = decode_steps(args)
    pages_per_row = -(-(ctx + total_steps) // ps)
    t_build = time.perf_counter()
    state = synthetic_history(cfg, b, pages_per_row, ps, args.seed)
    build_s = time.perf_counter() - t_build
    page_table = jnp.arange(b * pages_per_row, dtype=jnp.int32).reshape(b, pages_per_row)
    slots = jnp.arange(b, dtype=jnp.int32)
    ones = jnp.ones((b,), jnp.int32)
    # every step's inputs are on the device before the timed loop (no host-to-device work inside a step's time)
    rng = np.random.default_rng(args.seed)
    step_tokens = [jnp.asarray(rng.integers(0, cfg.vocab_size, (b,), dtype=np.int32)) for _ in range(total_steps)]
    metas = [StepMeta(slots, page_table, jnp.full((b,), ctx + i, jnp.int32), ones) for i in range(total_steps)]
    box = {"state": state}
    outputs = {}
    host_s: list[float] = []
    del state

    def run(i):
        with record_dispatch(backend_name) if i == 0 else contextlib.nullcontext() as rec:
            if i == 0:  # shapes only: the dispatch fallback may retrace with these
                outputs["trace_args"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                     (params, box["state"], step_tokens[0], metas[0]))
            t = time.perf_counter()
            logits, box["state"] = k3jax.decode(params, cfg, box["state"], step_tokens[i], metas[i],
                                                backend_name=backend_name)
            host_s.append(time.perf_counter() - t)  # until the call returns: tracing/lookup + enqueueing kernels
            _sync(logits)
        if i == 0:
            outputs["record"] = rec
            outputs["first_logits"] = logits
        outputs["last_logits"], outputs["last_step"] = logits, i

    loop = _timed_loop(run, args.warmup, args.steps, budget)
    host_timed = host_s[len(host_s) - len(loop["times"]):] if loop["times"] else []
    back_to_back = None
    if not loop["cut_by_budget"]:
        # the same steps enqueued back to back, one sync at the end: what the GPU sustains when the host keeps ahead
        # (an engine that feeds sampled tokens on the device, as overlap schedulers do); the synchronous loop above
        # also pays the host's turnaround between steps
        first = args.warmup + args.steps
        t = time.perf_counter()
        for i in range(first, first + args.steps):
            logits, box["state"] = k3jax.decode(params, cfg, box["state"], step_tokens[i], metas[i],
                                                backend_name=backend_name)
        _sync(logits)
        back_to_back = (time.perf_counter() - t) / args.steps * 1e3
        outputs["last_logits"], outputs["last_step"] = logits, first + args.steps - 1
    profile = None
    if args.profile and not loop["cut_by_budget"]:
        import tempfile

        first_traced = args.warmup + 2 * args.steps
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for i in range(first_traced, first_traced + args.profile_steps):
                    run(i)
            profile = profile_kernel_times(trace_dir, args.profile_steps)
    box.clear()
    trace_args = outputs.pop("trace_args")
    if args.dump_hlo:  # the compiled step as XLA optimised it for this device (what each fusion in the profile is)
        p, s_, t_, m_ = trace_args
        text = k3jax.decode.lower(p, cfg, s_, t_, m_, backend_name=backend_name).compile().as_text()
        Path(args.dump_hlo).write_text(text)
    dispatch = traced_dispatch(k3jax.decode, cfg, trace_args, backend_name, outputs.pop("record"))
    times = loop["times"]
    ms = _median_ms(times)
    result = {"batch": b, "context": ctx, "history_build_s": build_s, "first_call_s": loop["first_call_s"],
              "median_ms_per_step": ms, "mean_ms_per_step": statistics.mean(times) * 1e3,
              "tokens_per_s": b / (ms / 1e3), "timed_steps": len(times), "cut_by_budget": loop["cut_by_budget"],
              "all_ms": [x * 1e3 for x in times],
              "back_to_back_ms_per_step": back_to_back,
              # host time until each timed step's call returned (async dispatch): close to the step's time means
              # the host, not the GPU, sets the pace
              "host_dispatch_median_ms": _median_ms(host_timed) if host_timed else None,
              "logits_finite": bool(jnp.isfinite(outputs["first_logits"]).all() & jnp.isfinite(outputs["last_logits"]).all())}
    if profile is not None:
        result["profile"] = profile
    return result, dispatch, outputs


def bench_prefill(params, cfg, args, backend_name: str, budget: Budget) -> tuple[dict, dict, dict]:
    """Timings, dispatch and the outputs the checks compare (logits and the request's state after a run)."""
    n, ps = args.tokens, args.page_size
    num_pages = -(-n // ps)
    box = {"state": k3jax.init_state(cfg, num_slots=1, num_pages=num_pages, page_size=ps)}
    tokens = jnp.asarray(np.random.default_rng(args.seed).integers(0, cfg.vocab_size, (1, n), dtype=np.int32))
    meta = StepMeta(
        slots=jnp.zeros((1,), jnp.int32),
        page_table=jnp.arange(num_pages, dtype=jnp.int32)[None],
        context_lens=jnp.zeros((1,), jnp.int32),
        lengths=jnp.full((1,), n, jnp.int32),
    )
    outputs = {}

    def run(i):  # every run rewrites the same pages and slot from position 0
        with record_dispatch(backend_name) if i == 0 else contextlib.nullcontext() as rec:
            if i == 0:
                outputs["trace_args"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                     (params, box["state"], tokens, meta))
            logits, box["state"] = k3jax.prefill(params, cfg, box["state"], tokens, meta, backend_name=backend_name)
            _sync(logits)
        if i == 0:
            outputs["record"] = rec
        outputs["logits"] = logits

    loop = _timed_loop(run, args.warmup, args.iters, budget)
    state = box.pop("state")
    mla_tokens = state.kv_pages.reshape(state.kv_pages.shape[0], -1, state.kv_pages.shape[-1])[:, :n]
    outputs.update(kda_state=state.kda[:, 0], conv_state=state.conv[:, 0], mla_latents=mla_tokens)
    del state
    dispatch = traced_dispatch(k3jax.prefill, cfg, outputs.pop("trace_args"), backend_name,
                               outputs.pop("record"))
    times = loop["times"]
    ms = _median_ms(times)
    result = {"tokens": n, "first_call_s": loop["first_call_s"], "median_ms": ms, "tokens_per_s": n / (ms / 1e3),
              "timed_runs": len(times), "cut_by_budget": loop["cut_by_budget"], "all_ms": [x * 1e3 for x in times],
              "logits_finite": bool(jnp.isfinite(outputs["logits"]).all())}
    return result, dispatch, outputs


# ------------------------------------------------------------------------------------------------------------
# cross-backend checks


def rel_error(a: jax.Array, b: jax.Array, layer_axis: int | None = None):
    """||a - b|| / ||b|| in fp32 (None if not finite); with layer_axis, also per index of that axis."""
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    if a32.shape != b32.shape:
        raise ValueError(f"shapes differ: {a32.shape} vs {b32.shape}")
    sq = lambda x, axes=None: jnp.sum(jnp.square(x), axis=axes)  # noqa: E731
    finite = lambda x: float(x) if math.isfinite(float(x)) else None  # noqa: E731
    d = a32 - b32
    total = finite(jnp.sqrt(sq(d)) / jnp.sqrt(sq(b32)))
    if layer_axis is None:
        return total, None
    others = tuple(i for i in range(d.ndim) if i != layer_axis)
    per_layer = jnp.sqrt(sq(d, others)) / jnp.sqrt(sq(b32, others))
    return total, [finite(x) for x in np.asarray(per_layer)]


# what each phase compares, and the axis that holds the layer (None: no per-layer breakdown)
CHECKS = {
    "decode": {"logits_first_step": None, "logits_last_step": None},
    "prefill": {"logits": None, "kda_state": 0, "conv_state": 0, "mla_latents": 0},
}
_OUTPUT_OF = {"logits_first_step": "first_logits", "logits_last_step": "last_logits"}


def compare(phase: str, got: dict, want: dict, tol: float) -> dict:
    """The phase's checks of `got` against `want` (the first backend's outputs)."""
    out = {}
    for name, layer_axis in CHECKS[phase].items():
        if name == "logits_last_step" and got["last_step"] != want["last_step"]:
            out[name] = {"skipped": f"last steps differ ({got['last_step']} vs {want['last_step']}: budget cut)"}
            continue
        key = _OUTPUT_OF.get(name, name)
        total, per_layer = rel_error(got[key], want[key], layer_axis)
        entry = {"rel_error": total, "passed": total is not None and total < tol}
        if per_layer is not None:
            entry["per_layer"] = per_layer
        out[name] = entry
    return out


# ------------------------------------------------------------------------------------------------------------
# roofline, memory, report


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


def _fmt_err(x) -> str:
    return "non-finite" if x is None else f"{x:.2e}"


def _recorded_args(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("backend_list", "phase_list")}


def _write(result: dict, out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
        tmp.replace(out)  # a kill mid-write leaves the previous complete file


def report_rows(result: dict) -> list[tuple[str, str]]:
    """The printed table: per backend and phase, then speed-ups and checks against the first backend."""
    model, roof = result["model"], result["decode_roofline"]
    moved = roof["bytes_per_step"]
    rows = [
        ("model", f"{model['name']} ({model['dtype']}), {model['params'] / 1e9:.4g} B params, "
                  f"{_gb(moved['all_weights'])} ({model['init']} init {model['init_s']:.1f} s)"),
        ("decode bytes/step", f"{_gb(moved['total'])} = dense weights {_gb(moved['dense_weights'])} + experts "
                              f"{_gb(moved['activated_experts'])} + MLA {_gb(moved['mla_latents'])} + KDA "
                              f"{_gb(moved['kda_state'] + moved['conv_state'])}"),
        ("copy bandwidth", f"{roof['copy_bandwidth_gbps']:,.1f} GB/s (read + write, {roof['copy_probe_mib']} MiB; best of "
                           + ", ".join(f"{k} {v:,.0f}" for k, v in roof.get("copy_probes_gbps", {}).items())
                           + f"); decode floor {roof['floor_ms_per_step']:.3f} ms/step"),
    ]
    names = list(result["backends"])
    for name in names:
        r = result["backends"][name]
        for phase in PHASES:
            p = r.get(phase)
            if p is None:
                continue
            if "skipped" in p or "error" in p:
                rows.append((f"{phase} [{name}]", p.get("skipped") or f"FAILED: {p['error']}"))
            elif phase == "prefill":
                rows.append((f"prefill [{name}]", f"B=1 T={p['tokens']}: {p['median_ms']:.1f} ms, {p['tokens_per_s']:,.0f} "
                                                  f"tokens/s ({p['timed_runs']} runs; first call {p['first_call_s']:.1f} s)"))
            else:
                rr = r["decode_roofline"]
                rows.append((f"decode [{name}]", f"B={p['batch']} context {p['context']}: {p['median_ms_per_step']:.2f} "
                                                 f"ms/step, {p['tokens_per_s']:,.0f} tokens/s; roofline {rr['ratio']:.2f}x "
                                                 f"floor ({rr['attained_gbps']:,.0f} GB/s) ({p['timed_steps']} steps; "
                                                 f"first call {p['first_call_s']:.1f} s)"))
                if p.get("back_to_back_ms_per_step"):
                    rows.append((f"decode [{name}], back to back", f"{p['back_to_back_ms_per_step']:.2f} ms/step; roofline "
                                                                   f"{rr['back_to_back_ratio']:.2f}x floor (steps enqueued "
                                                                   "without a sync between them)"))
        ops = r.get("non_reference_ops")
        if ops is not None and name != "reference":
            rows.append((f"kernels [{name}]", "; ".join(f"{ph}: {', '.join(v) or 'none'}" for ph, v in ops.items())))
    for name in names[1:]:
        for phase, checks in result["checks"].get(name, {}).items():
            text = ", ".join(f"{k} {v['skipped']}" if "skipped" in v else
                             f"{k} {_fmt_err(v['rel_error'])}{'' if v['passed'] else ' FAIL'}" for k, v in checks.items())
            rows.append((f"{phase} vs {names[0]}", f"[{name}] {text}"))
    if len(names) > 1:
        verdict = {True: "PASS", False: "FAIL", None: "NONE RAN"}[result["checks_passed"]]
        bars = ", ".join(f"{phase} {tol:g}" for phase, tol in result["check_tol"].items())
        rows.append(("end-to-end checks", f"{verdict} (relative error below the bar on every compared output: {bars}; "
                                          "on a random-weight MoE model routing flips make these O(1) for any "
                                          "rounding change -- see CHECK_TOL; --shadow-check judges kernels)"))
    for name, check in result.get("shadow_check", {}).items():
        if "passed" in check:
            worst = max((e["max_rel_error"] for ph in ("prefill", "decode") for e in check.get(ph, {}).values()),
                        default=float("nan"))
            rows.append((f"shadow check [{name}]", f"{'PASS' if check['passed'] else 'FAIL'}: every kernel call vs its "
                                                   f"twin on the same inputs, worst {worst:.2e} (bar "
                                                   f"{result['args']['shadow_tol']:g})"))
        else:
            rows.append((f"shadow check [{name}]", f"FAIL: {check.get('error', check.get('skipped', '?'))[:200]}"))
    mem = result["memory"]
    rows.append(("peak memory", f"{_gb(mem['peak_bytes_in_use'])} (weights {_gb(mem['weights_bytes_in_use'])})"))
    return rows


def speedup_table(result: dict) -> list[list[str]]:
    """Rows of: phase | each backend's time (decode: with its roofline ratio) | each later backend's speed-up
    over the first (tokens/s ratio, > 1 = faster)."""
    names = list(result["backends"])
    header = ["phase"] + names + [f"{name} / {names[0]}" for name in names[1:]]
    rows = [header]
    for phase in PHASES:
        cells = [phase]
        for name in names:
            r = result["backends"][name]
            p = r.get(phase)
            if p is None or "median_ms" not in p and "median_ms_per_step" not in p:
                cells.append("n/a" if p is None else ("skipped" if "skipped" in p else "failed"))
            elif phase == "decode":
                cells.append(f"{p['median_ms_per_step']:.2f} ms/step ({r['decode_roofline']['ratio']:.2f}x roofline)")
            else:
                cells.append(f"{p['median_ms']:.1f} ms ({p['tokens_per_s']:,.0f} tokens/s)")
        for name in names[1:]:
            speedup = result["speedup"].get(name, {}).get(phase)
            cells.append("n/a" if speedup is None else f"{speedup:.2f}x")
        if any(c not in ("n/a",) for c in cells[1:]):
            rows.append(cells)
    return rows


def shadow_table(result: dict) -> list[list[str]]:
    """--shadow-check: per backend, phase and op, the calls and the largest / median relative error vs the twin."""
    rows = [["shadow check", "op", "calls", "max rel error", "median", f"< {result['args']['shadow_tol']:g}"]]
    for name, check in result["shadow_check"].items():
        if "passed" not in check:
            rows.append([name, check.get("error", check.get("skipped", "?"))[:80], "", "", "", "FAIL"])
            continue
        for phase in ("prefill", "decode"):
            for op, e in check.get(phase, {}).items():
                rows.append([f"{name} {phase}", op, str(e["calls"]), f"{e['max_rel_error']:.2e}",
                             f"{e['median_rel_error']:.2e}", "pass" if e["passed"] else "FAIL"])
    return rows


def profile_tables(result: dict) -> list[list[list[str]]]:
    """--profile: per backend, the decode step's time by part (group) and its ten costliest kernels."""
    tables = []
    for name, r in result["backends"].items():
        prof = r.get("decode", {}).get("profile")
        if not prof:
            continue
        step_ms = prof["ms_per_step"]
        rows = [[f"decode [{name}], {prof['source']} time", "ms/step", "share"]]
        rows += [[g, f"{ms:.3f}", f"{100 * ms / step_ms:.1f} %"] for g, ms in prof["by_group_ms_per_step"].items()]
        rows.append([f"total (sum of {prof.get('kernels_per_step', 0):g} kernels)", f"{step_ms:.3f}", "100 %"])
        if prof.get("span_ms_per_step"):
            rows.append(["device idle, gaps < 100 us (launches)", f"{prof['idle_short_ms_per_step']:.3f}", ""])
            rows.append([f"device idle, gaps >= 100 us ({prof['idle_long_gaps_per_step']:g} per step)",
                         f"{prof['idle_long_ms_per_step']:.3f}", ""])
        rows += [[f"  {k['name'][:70]} (x{k['calls_per_step']:g})", f"{k['ms_per_step']:.3f}",
                  f"{100 * k['ms_per_step'] / step_ms:.1f} %"] for k in prof["by_kernel"][:10]]
        tables.append(rows)
    return tables


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: " | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    print(line(rows[0]))
    print("-|-".join("-" * w for w in widths))
    for r in rows[1:]:
        print(line(r))


def run_phase(phase: str, name: str, result: dict, params, cfg, args, budget: Budget, first_outputs: dict,
              floor_ms: float, bytes_per_step: float) -> None:
    """Runs (or skips, once the budget is spent) one phase for one backend and records it in `result`: timings,
    dispatch, roofline ratio, and -- for a later backend -- the checks against and speed-up over the first
    backend, whose outputs it keeps in `first_outputs`. An exception is recorded, not raised."""
    names = result["backends_run"]
    entry = result["backends"][name]
    if budget.spent():
        entry[phase] = {"skipped": f"budget of {args.budget_s} s spent at {budget.elapsed():.1f} s"}
        print(f"{phase} [{name}]: skipped (budget)", file=sys.stderr, flush=True)
        return
    t = time.perf_counter()
    try:
        bench = bench_decode if phase == "decode" else bench_prefill
        with backend_scope(name) as base:
            timing, dispatch, outputs = bench(params, cfg, args, base, budget)
    except Exception as e:  # noqa: BLE001 -- one failing backend must not lose the others' results
        entry[phase] = {"error": f"{type(e).__name__}: {str(e)[:2000]}", "traceback": traceback.format_exc()[-4000:],
                        "phase_s": time.perf_counter() - t, "peak_bytes_after": peak_memory()}
        print(f"{phase} [{name}]: FAILED {type(e).__name__}: {str(e)[:500]}", file=sys.stderr, flush=True)
        return
    timing["phase_s"] = time.perf_counter() - t
    timing["peak_bytes_after"] = peak_memory()
    entry[phase] = timing
    entry.setdefault("dispatch", {})[phase] = dispatch
    entry.setdefault("non_reference_ops", {})[phase] = non_reference_ops(dispatch)
    if phase == "decode":
        ms = timing["median_ms_per_step"]
        entry["decode_roofline"] = {"ratio": ms / floor_ms, "attained_gbps": bytes_per_step / (ms / 1e3) / 1e9}
        if timing.get("back_to_back_ms_per_step"):
            entry["decode_roofline"]["back_to_back_ratio"] = timing["back_to_back_ms_per_step"] / floor_ms
        speed = f"{ms:.2f} ms/step, roofline {entry['decode_roofline']['ratio']:.2f}x"
    else:
        speed = f"{timing['median_ms']:.1f} ms, {timing['tokens_per_s']:,.0f} tokens/s"
    versus = ""
    if name == names[0]:
        first_outputs[phase] = outputs
    elif phase in first_outputs:
        checks = compare(phase, outputs, first_outputs[phase], getattr(args, f"{phase}_tol"))
        result["checks"].setdefault(name, {})[phase] = checks
        base = result["backends"][names[0]][phase]
        result["speedup"].setdefault(name, {})[phase] = timing["tokens_per_s"] / base["tokens_per_s"]
        verdicts = [c["passed"] for per in result["checks"].values() for ph in per.values() for c in ph.values()
                    if "passed" in c]
        result["checks_passed"] = all(verdicts) if verdicts else None
        errors = [c["rel_error"] for c in checks.values() if "rel_error" in c]
        versus = f", max rel error vs {names[0]} {'non-finite' if None in errors else f'{max(errors):.2e}'}"
    print(f"{phase} [{name}]: {speed}{versus}; done in {timing['phase_s']:.1f} s (first call "
          f"{timing['first_call_s']:.1f} s; at {budget.elapsed():.1f} s)", file=sys.stderr, flush=True)


def main(argv=None) -> dict:
    started = time.perf_counter()
    args = parse_args(argv)
    budget = Budget(args.budget_s, started)
    k3_mla.MLA_DECODE_KERNEL = args.mla_kernel
    k3_kda.KDA_DECODE_KERNEL = args.kda_decode_kernel
    k3_moe.COMBINE_KERNEL = bool(args.moe_combine_kernel)
    k3_layers.use_dense_kernel(args.dense_kernel)
    if not args.moe_rank_in_kernel or args.moe_decode_tiling:
        from pallas_kernels import moe_gemm

        if not args.moe_rank_in_kernel:
            moe_gemm.RANK_IN_KERNEL_MAX_ELEMENTS = 0
        if args.moe_decode_tiling:
            moe_gemm.DECODE_CONFIG = moe_gemm.MoeGemmConfig.from_tiling(args.moe_decode_tiling)
    if args.kda_loop_v is not None:
        from pallas_kernels import kda_decode

        kda_decode.DEFAULT_LOOP_V = bool(args.kda_loop_v)
    out = Path(args.out) if args.out else None
    device = jax.devices()[0]
    cfg = k3jax.load_config(args.model)
    if args.dtype:
        cfg = cfg.replace(dtype=jnp.dtype(args.dtype).name)
    if args.dispatch_only:
        result = {"benchmark": "model_forward --dispatch-only", "model": cfg.name, "args": _recorded_args(args),
                  "backends": dispatch_report(cfg, args)}
        _write(result, out)
        return result
    copy_mib = args.copy_mib or (256 if device.platform == "cpu" else 4096)
    names = args.backend_list
    print(f"model_forward: {cfg.name} ({cfg.dtype}) on {device.device_kind} [{device.platform}], "
          f"jax {jax.__version__}, backends={','.join(names)}, phases={','.join(args.phase_list)}, "
          f"budget {args.budget_s} s", file=sys.stderr, flush=True)

    weights = _nbytes(k3jax.param_shapes(cfg))
    pages_per_row = -(-(args.context + decode_steps(args)) // args.page_size)
    decode_state = _nbytes(jax.eval_shape(
        lambda: k3jax.init_state(cfg, args.batch, args.batch * pages_per_row, args.page_size)))
    scores = cfg.mla_num_heads * args.tokens**2 * 4  # one layer's fp32 prefill scores (reference attention)
    print(f"memory estimate: weights {_gb(weights)}, decode state {_gb(decode_state)}, prefill attention scores "
          f"{_gb(scores)} per MLA layer (x2 with the softmax)", file=sys.stderr, flush=True)

    params, init_mode, init_s = init_params(cfg, args.seed, args.init)
    if args.fuse:  # the serving layout, as serving/engine.py and `k3jax generate` load it on one device
        from k3jax.fuse import fuse_for_serving

        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):  # shapes only (tests)
            params = jax.eval_shape(lambda p: fuse_for_serving(p, cfg), params)
        else:
            params = jax.block_until_ready(fuse_for_serving(params, cfg))
    n_params = k3jax.count_params(params)
    weights_in_use = (device.memory_stats() or {}).get("bytes_in_use")
    probes = copy_probes(copy_mib)
    bandwidth = max(probes.values())
    moved = decode_bytes(params, cfg, args.batch, args.context)
    floor_ms = moved["total"] / bandwidth * 1e3
    print(f"init {init_s:.1f} s, copy bandwidth {bandwidth / 1e9:,.1f} GB/s, at {budget.elapsed():.1f} s",
          file=sys.stderr, flush=True)

    result = {
        "benchmark": "model_forward",
        "command": "python benchmarks/model_forward.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"device": device.device_kind, "platform": device.platform, "num_devices": jax.device_count(),
                    "host": platform.node(), "jax": jax.__version__, "python": platform.python_version()},
        "model": {"name": cfg.name, "dtype": cfg.dtype, "params": n_params,
                  "weight_bytes": moved["all_weights"], "init": init_mode, "init_s": init_s},
        "args": _recorded_args(args),
        "backends_run": names,
        "decode_roofline": {"bytes_per_step": moved, "copy_bandwidth_gbps": bandwidth / 1e9, "copy_probe_mib": copy_mib,
                            "copy_probes_gbps": {name: bw / 1e9 for name, bw in probes.items()},
                            "floor_ms_per_step": floor_ms},
        "backends": {name: {} for name in names},
        "speedup": {},
        "checks": {},
        "check_tol": {phase: getattr(args, f"{phase}_tol") for phase in PHASES},
        "checks_passed": None,
        "memory": {"weights_bytes_in_use": weights_in_use, "peak_bytes_in_use": peak_memory()},
        "complete": False,  # True once every phase has run or been skipped (a killed run leaves False)
    }
    _write(result, out)

    first_outputs: dict[str, dict] = {}  # the first backend's outputs of the phase under way
    for phase in args.phase_list:
        for name in names:
            run_phase(phase, name, result, params, cfg, args, budget, first_outputs, floor_ms, moved["total"])
            result["memory"]["peak_bytes_in_use"] = peak_memory()
            result["elapsed_s"] = budget.elapsed()
            _write(result, out)
        first_outputs.pop(phase, None)
    if names[0] in result["backends"]:  # the single-backend layout of earlier runs: the first backend's numbers
        first = result["backends"][names[0]]
        for phase in PHASES:
            if phase in first:
                result[phase] = first[phase]
        if "decode_roofline" in first:
            result["decode_roofline"].update(first["decode_roofline"])
    if args.shadow_check:  # every backend but the reference (whose ops are their own twins)
        for name in [n for n in names if split_backend(n)[0] != "reference"]:
            if budget.spent():
                result["shadow_check"] = {name: {"skipped": "budget"}}
                break
            t = time.perf_counter()
            try:
                check = shadow_check(params, cfg, args, name)
            except Exception as e:  # noqa: BLE001 -- recorded beside the timings, never instead of them
                check = {"error": f"{type(e).__name__}: {str(e)[:2000]}", "traceback": traceback.format_exc()[-4000:]}
            check["seconds"] = time.perf_counter() - t
            result.setdefault("shadow_check", {})[name] = check
            print(f"shadow check [{name}]: {'PASS' if check.get('passed') else 'FAIL'} in {check['seconds']:.1f} s",
                  file=sys.stderr, flush=True)
            _write(result, out)
    result["complete"] = True
    result["elapsed_s"] = budget.elapsed()
    _write(result, out)

    print()
    _print_table([["metric", "value"]] + [list(r) for r in report_rows(result)])
    if len(names) > 1:
        print()
        _print_table(speedup_table(result))
    if "shadow_check" in result:
        print()
        _print_table(shadow_table(result))
    for rows in profile_tables(result):
        print()
        _print_table(rows)
    if out is not None:
        print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
