"""KDA kernels on one GPU: ours (pallas_kernels/kda_chunk.py, kda_decode.py) vs fla-core 0.6.0 on identical inputs.

    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/kda.py --out $OUT/kda.json

Shapes (issue 3), bf16 activations, fp32 V-first states, D = 128, K3's gate (lower bound -5), gate / beta
sigmoid / q-k L2 norm fused on both sides:
  prefill  B1 T32768 and B8 T4096 (packed, cu_seqlens) at H32 and H96: ours `kda_chunk` vs fla `chunk_kda`
           (safe_gate, state_v_first); throughput = tokens / time; plus ours with page-256 checkpoints.
  decode   B64 / B256 at T1 (decode) and T4 (verify), H96: ours `kda_decode` (conv + norms + gate + delta rule +
           gated RMSNorm, pools in place; verify writes every position's state) vs fla `fused_recurrent_kda`
           (no conv, no output norm; final state only). State traffic = fp32 state bytes read + written.
  copy     torch and XLA device copies (bytes read + written) measured in the same run: the bandwidth limit.
Timing: warm-up, then the median over --trials of (--reps back-to-back calls, synchronised) / reps.
Prints the table last; writes the raw numbers as JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda_chunk import kda_chunk
from pallas_kernels.kda_decode import kda_decode

D = 128
LB = -5.0


def time_jax(fn, reps, trials):
    out = fn()
    jax.block_until_ready(out)
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def time_torch(fn, reps, trials):
    import torch

    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def to_torch(x):
    import torch

    return torch.from_dlpack(x)


def copy_bandwidth(results, trials):
    n = 1 << 29  # 2 GiB of fp32
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0)
    t = time_jax(lambda: f(x), 10, trials)
    results["copy_xla_TBps"] = 2 * 4 * n / t / 1e12
    del x
    try:
        import torch

        a = torch.ones(n, device="cuda")
        b = torch.empty_like(a)
        t = time_torch(lambda: b.copy_(a), 10, trials)
        results["copy_torch_TBps"] = 2 * 4 * n / t / 1e12
        del a, b
    except Exception as e:  # noqa: BLE001 -- torch is optional
        results["copy_torch_error"] = repr(e)


def prefill_case(b, t, h, args, fla):
    key = jax.random.key(b * 7 + h)
    ks = jax.random.split(key, 8)
    total = b * t
    q, k, v, z = (jax.random.normal(ks[i], (total, h, D), jnp.bfloat16) for i in range(4))
    beta = jax.random.normal(ks[4], (total, h), jnp.float32)
    s0 = 0.1 * jax.random.normal(ks[5], (b, h, D, D), jnp.float32)
    a_log = 0.5 * jax.random.normal(ks[6], (h,), jnp.float32)
    dt_bias = jax.random.normal(ks[7], (h * D,), jnp.float32)
    cu = jnp.arange(b + 1, dtype=jnp.int32) * t
    kw = dict(a_log=a_log, dt_bias=dt_bias, gate="lower_bound", lower_bound=LB, beta_sigmoid=True, qk_l2norm=True)
    row = dict(kind="prefill", B=b, T=t, H=h, tokens=total)
    o, final, _ = kda_chunk(q, k, v, z, beta, s0, cu, **kw)
    row["ours_ms"] = 1e3 * time_jax(lambda: kda_chunk(q, k, v, z, beta, s0, cu, **kw), args.reps, args.trials)
    sweep = (b, t, h) == (1, 32768, 96)  # checkpoints and launch variants: on K3's long-prompt shape only
    if sweep:
        row["ours_ckpt256_ms"] = 1e3 * time_jax(
            lambda: kda_chunk(q, k, v, z, beta, s0, cu, checkpoint_page_size=256, **kw), args.reps, args.trials)
        row["ckpt_overhead"] = row["ours_ckpt256_ms"] / row["ours_ms"] - 1
    for nw in args.intra_warps if sweep else []:
        try:
            row[f"ours_w{nw}_ms"] = 1e3 * time_jax(lambda: kda_chunk(q, k, v, z, beta, s0, cu, num_warps=nw, **kw),
                                                   args.reps, args.trials)
        except Exception as e:  # noqa: BLE001
            row[f"ours_w{nw}_error"] = repr(e)[:300]
    for bv in args.block_v if sweep else []:
        try:
            row[f"ours_bv{bv}_ms"] = 1e3 * time_jax(lambda: kda_chunk(q, k, v, z, beta, s0, cu, block_v=bv, **kw),
                                                    args.reps, args.trials)
        except Exception as e:  # noqa: BLE001
            row[f"ours_bv{bv}_error"] = repr(e)[:300]
    if fla is not None:
        import torch

        tq, tk, tv, tz = (to_torch(a).unsqueeze(0) for a in (q, k, v, z))
        tb, ts0 = to_torch(beta).unsqueeze(0), to_torch(s0).clone()
        tcu = to_torch(cu).long()
        call = lambda: fla.chunk_kda(
            tq, tk, tv, tz, tb, A_log=to_torch(a_log), dt_bias=to_torch(dt_bias), initial_state=ts0,
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB, state_v_first=True, cu_seqlens=tcu)
        with torch.no_grad():
            fo, ff = call()
            row["fla_ms"] = 1e3 * time_torch(call, args.reps, args.trials)
        row["rel_o_vs_fla"] = rel(jnp.asarray(o, jnp.float32), np.asarray(fo[0].float().cpu()))
        row["rel_state_vs_fla"] = rel(final, np.asarray(ff.float().cpu()))
        row["ratio"] = row["fla_ms"] / row["ours_ms"]
    row["ours_Mtok_s"] = total / row["ours_ms"] / 1e3
    return row


def decode_case(b, t, h, args, fla, copy_tbps):
    ks = jax.random.split(jax.random.key(b + t), 10)
    c = 3 * h * D
    qkv = jax.random.normal(ks[0], (b, t, c), jnp.bfloat16)
    conv = jax.random.normal(ks[1], (b, 3, c), jnp.bfloat16)
    conv_w = 0.5 * jax.random.normal(ks[2], (4, c), jnp.float32)
    z = jax.random.normal(ks[3], (b, t, h, D), jnp.bfloat16)
    beta = jax.random.normal(ks[4], (b, t, h), jnp.float32)
    og = jax.random.normal(ks[5], (b, t, h, D), jnp.bfloat16)
    state = 0.1 * jax.random.normal(ks[6], (b, h, D, D), jnp.float32)
    slots = jax.random.permutation(ks[7], b).astype(jnp.int32)
    lens = jnp.full((b,), t, jnp.int32)
    a_log = 0.5 * jax.random.normal(ks[8], (h,), jnp.float32)
    dt_bias = jax.random.normal(ks[9], (h * D,), jnp.float32)
    onw = jnp.ones((D,), jnp.float32)
    kw = dict(a_log=a_log, dt_bias=dt_bias, o_norm_weight=onw, gate="lower_bound", lower_bound=LB)
    verify = t > 1
    row = dict(kind="verify" if verify else "decode", B=b, T=t, H=h)
    state_bytes = b * h * D * D * 4
    if verify:
        f = jax.jit(lambda cv, st: kda_decode(qkv, cv, conv_w, z, beta, og, st, slots, lens, all_states=True, **kw))
        row["ours_ms"] = 1e3 * time_jax(lambda: f(conv, state), args.reps, args.trials)
        ours_bytes = state_bytes * (1 + t)
    else:
        step = jax.jit(lambda cv, st: kda_decode(qkv, cv, conv_w, z, beta, og, st, slots, lens, **kw)[1:],
                       donate_argnums=(0, 1))
        pools = [conv, state]

        def run():
            pools[:] = step(*pools)
            return pools[1]

        row["ours_ms"] = 1e3 * time_jax(run, args.reps, args.trials)
        ours_bytes = state_bytes * 2
    row["ours_state_TBps"] = ours_bytes / (row["ours_ms"] * 1e-3) / 1e12
    row["ours_frac_of_copy"] = row["ours_state_TBps"] / copy_tbps
    if fla is not None:
        import torch

        kk = jax.random.split(ks[0], 3)
        q, k, v = (to_torch(jax.random.normal(kk[i], (b, t, h, D), jnp.bfloat16)) for i in range(3))
        tz, tb = to_torch(z), to_torch(beta)
        ts0 = to_torch(0.1 * jax.random.normal(ks[6], (b, h, D, D), jnp.float32)).clone()
        call = lambda: fla.fused_recurrent_kda(
            q, k, v, tz, tb, A_log=to_torch(a_log), dt_bias=to_torch(dt_bias), initial_state=ts0,
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=LB, state_v_first=True)
        with torch.no_grad():
            row["fla_ms"] = 1e3 * time_torch(call, args.reps, args.trials)
        row["fla_state_TBps"] = 2 * state_bytes / (row["fla_ms"] * 1e-3) / 1e12
        row["ratio"] = row["fla_ms"] / row["ours_ms"]
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--prefill", default="1x32768x32,8x4096x32,1x32768x96,8x4096x96", help="BxTxH list")
    p.add_argument("--decode", default="64x1x96,256x1x96,64x4x96,256x4x96", help="BxTxH list")
    p.add_argument("--intra-warps", type=lambda s: [int(x) for x in s.split(",") if x], default=[8])
    p.add_argument("--block-v", type=lambda s: [int(x) for x in s.split(",") if x], default=[])
    p.add_argument("--no-fla", action="store_true")
    args = p.parse_args(argv)
    fla = None
    if not args.no_fla:
        try:
            import fla.ops.kda as fla  # noqa: PLC0415
        except Exception as e:  # noqa: BLE001
            print(f"fla unavailable: {e!r}", file=sys.stderr)
    results = dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                   jax=jax.__version__, rows=[])
    copy_bandwidth(results, args.trials)
    copy_tbps = results.get("copy_torch_TBps", results["copy_xla_TBps"])
    cases = [("prefill", tuple(int(x) for x in s.split("x"))) for s in args.prefill.split(",") if s]
    cases += [("decode", tuple(int(x) for x in s.split("x"))) for s in args.decode.split(",") if s]
    for kind, (b, t, h) in cases:
        try:
            row = prefill_case(b, t, h, args, fla) if kind == "prefill" else decode_case(b, t, h, args, fla, copy_tbps)
        except Exception as e:  # noqa: BLE001 -- keep the other cases' numbers
            traceback.print_exc()
            row = dict(kind=kind, B=b, T=t, H=h, error=repr(e)[:500])
        results["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=1)
    print(f"\ncopy bandwidth: torch {results.get('copy_torch_TBps', float('nan')):.2f} TB/s, "
          f"XLA {results['copy_xla_TBps']:.2f} TB/s ({results['device']}, jax {results['jax']})")
    print(f"{'case':<22}{'ours ms':>10}{'fla ms':>10}{'fla/ours':>10}{'extra':>44}")
    for r in results["rows"]:
        name = f"{r['kind']} B{r['B']} T{r['T']} H{r['H']}"
        if "error" in r:
            print(f"{name:<22} error: {r['error'][:100]}")
            continue
        if r["kind"] == "prefill":
            extra = f"{r['ours_Mtok_s']:.2f} Mtok/s"
            if "ckpt_overhead" in r:
                extra += f", ckpt256 +{100 * r['ckpt_overhead']:.1f}%"
        else:
            extra = f"state {r['ours_state_TBps']:.2f} TB/s = {100 * r['ours_frac_of_copy']:.0f}% copy"
            if "fla_state_TBps" in r:
                extra += f" (fla {r['fla_state_TBps']:.2f})"
        print(f"{name:<22}{r['ours_ms']:>10.3f}{r.get('fla_ms', float('nan')):>10.3f}"
              f"{r.get('ratio', float('nan')):>10.2f}{extra:>44}")


if __name__ == "__main__":
    main()
