"""Whole KDA chunked prefill (`kda_chunk`, Pallas stage 1) by fused state-pass tiling (and stage-1 knobs), at
several shapes.

The claim it backs: `kda_common.pick_state_tiling` (V-block, warps, pipeline stages, state layout of the fused
state pass) picks the fastest measured setting per shape. Every variant is timed on the same inputs as the
"default" (the rule's pick) and checked against it (relative L2 error of the output; the variants reorder dots
and transpose the state, so bf16 results agree to rounding, ~1e-7 in practice).

Variant names: "default" (every knob picked by the rule) or knobs joined by "_" in any order:
    bv<n> block_v   w<n> num_warps   s<n> num_stages   kf / vf state_layout k_first / v_first
    first / between / last output_order   br checkpoint_branch
    and stage 1's (`kda_intra`) warps: sw<n> stage1_num_warps
e.g. "bv32_w4_s3_kf", "bv64_w4", "bv32_w4_s3_kf_last". With --page P every call also emits state checkpoints every P
tokens (the prefix cache's prefill), e.g. to time "bv128_w4_s2_kf_br" (transposes only on page-ending chunks).

    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/kda_state_tiling.py \\
        --shapes 1x32768x32,8x4096x32,1x32768x96,8x4096x96 --variants default,bv32_w4,bv32_w4_s3_kf,bv64_w4
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import re
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.kda import LB, prefill_inputs, time_jax
from pallas_kernels import kda_chunk as kc

_KNOBS = {"bv": "block_v", "w": "num_warps", "s": "num_stages", "sw": "stage1_num_warps"}
_WORDS = {"kf": ("state_layout", "k_first"), "vf": ("state_layout", "v_first"), "br": ("checkpoint_branch", True),
          "first": ("output_order", "first"), "between": ("output_order", "between"), "last": ("output_order", "last")}


def variant_keywords(name: str) -> dict:
    """kda_chunk keywords of a variant name (module docstring)."""
    if name == "default":
        return {}
    kw = {}
    for knob in name.split("_"):
        m = re.fullmatch(r"(bv|w|s|sw)(\d+)", knob)
        if m:
            kw[_KNOBS[m.group(1)]] = int(m.group(2))
        elif knob in _WORDS:
            kw[_WORDS[knob][0]] = _WORDS[knob][1]
        else:
            raise ValueError(f"unknown knob {knob!r} in variant {name!r} (see benchmarks/kda_state_tiling.py)")
    return kw


def run(shapes, variants, trials, interpret, out=None, page=0):
    rows = []
    for b, t, h in shapes:
        x = prefill_inputs(b, t, h)
        kw = dict(a_log=x["a_log"], dt_bias=x["dt_bias"], gate="lower_bound", lower_bound=LB, beta_sigmoid=True,
                  qk_l2norm=True, stage1="pallas", interpret=interpret, checkpoint_page_size=page or None)
        call = lambda **extra: kc.kda_chunk(x["q"], x["k"], x["v"], x["z"], x["beta"], x["s0"], x["cu"], **kw, **extra)
        reference = call()[0].astype(jnp.float32)
        row = dict(B=b, T=t, H=h, page=page)
        # compile every variant at once in threads (each whole prefill compiles for ~15-30 s; the runs it also makes
        # only warm the GPU), so the timed loop below finds them compiled; a failing one fails again there.
        # Interpret mode gains nothing from it (the runs are the cost)
        if not interpret:
            with concurrent.futures.ThreadPoolExecutor(max(1, len(variants))) as pool:
                for future in [pool.submit(lambda e=variant_keywords(name): jax.block_until_ready(call(**e)))
                               for name in variants]:
                    future.exception()
        rows.append(row)
        for name in variants:
            extra = variant_keywords(name)
            t0 = time.monotonic()
            try:
                o = call(**extra)[0].astype(jnp.float32)
                row[f"{name}_ms"] = 1e3 * time_jax(lambda: call(**extra), trials)
                row[f"{name}_rel"] = float(jnp.linalg.norm(o - reference) / jnp.linalg.norm(reference))
            except Exception as e:  # noqa: BLE001 -- an unsupported tiling (shared memory, ...): keep the others
                row[f"{name}_error"] = repr(e)[:300]
            print(f"B{b} T{t} H{h} {name}: {row.get(f'{name}_ms', float('nan')):.3f} ms "
                  f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
            if out:
                with open(out, "w") as fh:
                    json.dump(dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                                   jax=jax.__version__, argv=sys.argv[1:], rows=rows), fh, indent=1)
    return rows


def print_table(rows, variants):
    heads = [f"B{r['B']} T{r['T']} H{r['H']}" for r in rows]
    print(f"{'ms (x default)':<24}" + "".join(f"{h:>22}" for h in heads))
    for name in variants:
        cells = []
        for r in rows:
            ms, base = r.get(f"{name}_ms"), r.get("default_ms")
            cells.append("error" if ms is None else f"{ms:.3f}" + (f" ({base / ms:.2f}x)" if base else ""))
        print(f"{name:<24}" + "".join(f"{c:>22}" for c in cells))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x32768x32,8x4096x32,1x32768x96,8x4096x96", help="BxTxH list (D = 128)")
    p.add_argument("--variants", default="default,bv16_w4,bv32_w4,bv64_w4,bv32_w4_s3_kf,bv16_w4_s3_kf",
                   help="comma list (module docstring); 'default' first gives the ratios")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--interpret", action="store_true", help="CPU smoke run (Pallas interpret mode; use tiny shapes)")
    p.add_argument("--out", default=None, help="raw JSON, rewritten after every variant")
    p.add_argument("--page", type=int, default=0,
                   help="checkpoint page size (0: none); with checkpoints 'default' is the rule's checkpoint pick")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    for name in variants:
        variant_keywords(name)  # unknown knobs fail before anything runs
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    rows = run(shapes, variants, args.trials, args.interpret, args.out, args.page)
    print_table(rows, variants)
    return rows


if __name__ == "__main__":
    main()
