"""DWDP in both forms on host CPU devices: prefill then decode equal to the single-device model (k3-tiny,
fp32, ragged per-rank batches), with no token-path collective.

The model is k3-tiny cut to two layers (KDA + MoE, MLA + MoE): both attention kinds and two MoE layers, so
the double buffer really alternates (layer 1's experts are gathered / copied while layer 0 runs). The
dense layer-0 MLP is replicated under every strategy here and runs in test_tep_dep.py. Tolerance as
in test_tep_dep.py: 1e-5 relative to the largest |logit| (only fp32 summation order differs; every rank
runs the full model on its own rows, so measured errors are ~1e-7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import model
from k3jax.params import init_params
from k3jax.parallel import comm, dwdp
from k3jax.parallel.common import make_mesh
from k3jax.testing import k3_tiny, step_meta

RTOL = 1e-5
RANKS = 8
SLOTS, ROWS, MAX_PAGES, PAGE, PREFILL = 3, 2, 3, 4, 5


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def cut_model():
    """k3-tiny cut to two layers: KDA + MoE, then MLA + MoE (k3-tiny's sizes, no dense layer)."""
    cfg = k3_tiny().replace(num_layers=2, mla_layers=(1,), first_k_dense_replace=0)
    return cfg, init_params(cfg, jax.random.key(21))


def serving_case(cfg, params, ranks, rows, seed):
    """Per rank `rows` requests of ragged prefill lengths (one rank idle), local slot / page ids; the
    single-device reference runs all ranks' rows against one pool with global ids."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, PREFILL + 1, (ranks, rows))
    lengths[1, 0] = 0
    lengths[ranks - 2] = 0  # a rank with no request
    pages = rows * MAX_PAGES
    slots = np.stack([rng.permutation(SLOTS)[:rows] for _ in range(ranks)])
    tables = np.stack([rng.permutation(pages).reshape(rows, MAX_PAGES) for _ in range(ranks)])
    tokens = rng.integers(0, cfg.vocab_size, (ranks, rows, PREFILL)).astype(np.int32)
    next_tokens = rng.integers(0, cfg.vocab_size, (ranks, rows)).astype(np.int32)
    state0 = model.init_state(cfg, ranks * SLOTS, ranks * pages, PAGE)
    state0 = state0.replace(kda=0.1 * jax.random.normal(jax.random.key(seed), state0.kda.shape),
                            conv=0.1 * jax.random.normal(jax.random.key(seed + 1), state0.conv.shape))
    flat = lambda a: a.reshape(ranks * rows, *a.shape[2:])  # noqa: E731
    gslots, gtables = flat(slots + np.arange(ranks)[:, None] * SLOTS), flat(tables + np.arange(ranks)[:, None, None] * pages)
    lp = flat(lengths)
    logits_p, state = model.prefill(params, cfg, jax.tree.map(jnp.copy, state0), jnp.asarray(flat(tokens)),
                                    step_meta(gslots, gtables, np.zeros_like(lp), lp))
    logits_d, state = model.decode(params, cfg, state, jnp.asarray(flat(next_tokens)),
                                   step_meta(gslots, gtables, lp, (lp > 0).astype(np.int32)))
    return dict(lengths=lengths, slots=slots, tables=tables, tokens=tokens, next_tokens=next_tokens, state0=state0,
                pages=pages, valid=lp > 0, logits_p=np.asarray(logits_p), logits_d=np.asarray(logits_d), state=state)


@pytest.fixture(scope="module")
def case():
    cfg, params = cut_model()
    return cfg, params, serving_case(cfg, params, RANKS, ROWS, 31)


def test_spmd_prefill_decode_equal_single_device_and_gather_only_weights(case):
    cfg, params, c = case
    mesh = make_mesh(RANKS)
    sharded = dwdp.shard_params(params, cfg, mesh)
    flat = lambda a: a.reshape(RANKS * ROWS, *a.shape[2:])  # noqa: E731
    lp = flat(c["lengths"])
    meta_p = step_meta(flat(c["slots"]), flat(c["tables"]), np.zeros_like(lp), lp)
    meta_d = step_meta(flat(c["slots"]), flat(c["tables"]), lp, (lp > 0).astype(np.int32))
    state = dwdp.shard_state(jax.tree.map(jnp.copy, c["state0"]), mesh)
    tokens = jnp.asarray(flat(c["tokens"]))
    prefill = dwdp.prefill.lower(sharded, cfg, state, tokens, meta_p, mesh).compile()
    logits_p, state = prefill(sharded, state, tokens, meta_p)
    logits_d, state = dwdp.decode(sharded, cfg, state, jnp.asarray(flat(c["next_tokens"])), meta_d, mesh)
    valid = c["valid"]
    assert rel_err(np.asarray(logits_p)[valid], c["logits_p"][valid]) <= RTOL
    assert rel_err(np.asarray(logits_d)[valid], c["logits_d"][valid]) <= RTOL
    for name in ("kda", "conv", "kv_pages"):
        assert rel_err(getattr(state, name), getattr(c["state"], name)) <= RTOL, name

    # the only collectives: one all-gather per routed-expert tensor of each MoE layer (3 tensors x 2 layers),
    # each the whole padded [E, ...] stack; nothing on the token path (no all-to-all, no all-reduce)
    report = comm.collectives(prefill.as_text())
    assert {c.kind for c in report} == {"all-gather"}
    e_pad = -(-cfg.num_experts // RANKS) * RANKS
    expert_shapes = sorted((e_pad, *w.shape[1:]) for w in params["layers"][1]["mlp"]["experts"].values())
    gathered = sorted(dims for c in report for _, dims in c.shapes)
    assert gathered == sorted(expert_shapes * 2)


def test_independent_prefill_decode_equal_single_device_without_collectives(case):
    """Two devices, one program each, running ranks 0 and 1 of the 8-rank case (rank 1 with a ragged,
    partly idle batch), each with its own state pool (local ids); experts split over the two devices. The
    per-device programs contain no collective."""
    cfg, params, c = case
    ranks = 2
    runner = dwdp.IndependentDWDP(params, cfg, jax.devices()[:ranks])
    per_rank_state = lambda st, r: jax.tree.map(  # noqa: E731
        lambda x, per: x[:, r * per:(r + 1) * per], st, model.DecodeState(kda=SLOTS, conv=SLOTS, kv_pages=c["pages"]))
    logits_p, logits_d, states = [], [], []
    for r in range(ranks):  # dispatch every device's prefill before reading any result: they run concurrently
        lp = c["lengths"][r]
        out, st = runner.prefill(r, per_rank_state(c["state0"], r), jnp.asarray(c["tokens"][r]),
                                 step_meta(c["slots"][r], c["tables"][r], np.zeros_like(lp), lp))
        logits_p.append(out)
        states.append(st)
    for r in range(ranks):
        lp = c["lengths"][r]
        out, states[r] = runner.decode(r, states[r], jnp.asarray(c["next_tokens"][r]),
                                       step_meta(c["slots"][r], c["tables"][r], lp, (lp > 0).astype(np.int32)))
        assert out.devices() == {jax.devices()[r]}
        logits_d.append(out)
    valid = c["valid"][: ranks * ROWS]
    assert rel_err(np.concatenate(logits_p)[valid], c["logits_p"][: ranks * ROWS][valid]) <= RTOL
    assert rel_err(np.concatenate(logits_d)[valid], c["logits_d"][: ranks * ROWS][valid]) <= RTOL
    for name in ("kda", "conv", "kv_pages"):
        got = np.concatenate([np.asarray(getattr(s, name)) for s in states], axis=1)
        want = np.asarray(getattr(c["state"], name))[:, : got.shape[1]]
        assert rel_err(got, want) <= RTOL, name
    hlo = dwdp._moe_step.lower(runner.params[0]["layers"][0]["mlp"], jnp.zeros((4, cfg.hidden_size)),
                               runner._fetch(0, 0), cfg, "reference").compile().as_text()
    assert comm.collectives(hlo) == []


def test_dcp_decode_ragged_equal_single_device():
    """DCP decode on 8 ranks, page size 2: three replicated requests with ragged contexts 13 / 4 / 9 spread
    round-robin over the ranks' pages, so ranks hold 0, 1 or 2 pages of a request and rank 7 none (its
    partial attention is empty: weight e^-inf = 0 in the merge). The history is prefilled by the
    single-device model into the pool whose page ids are the DCP layout's (`global_page_table`: rank r's
    pages r*Pl..), so the same pool, sharded, is the DCP state. (dcp.prefill runs the same mixer with T > 1;
    one more 8-device compile is left out of CI's budget.)"""
    from k3jax.parallel import dcp

    cfg, params = cut_model()
    mesh = make_mesh(RANKS)
    rng = np.random.default_rng(51)
    page, per_rank_pages, rows = 2, 2, 3
    pool = rows * per_rank_pages  # pages per rank
    local = jnp.asarray(np.stack([rng.permutation(pool).reshape(rows, per_rank_pages) for _ in range(RANKS)]), jnp.int32)
    table = dcp.global_page_table(local, pool)
    lengths = np.array([13, 4, 9], np.int32)
    slots = np.array([2, 0, 1], np.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, 13)), jnp.int32)
    next_tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows,)), jnp.int32)
    state0 = model.init_state(cfg, SLOTS, RANKS * pool, page)
    state0 = state0.replace(kda=0.1 * jax.random.normal(jax.random.key(52), state0.kda.shape),
                            conv=0.1 * jax.random.normal(jax.random.key(53), state0.conv.shape))
    _, history = model.prefill(params, cfg, state0, tokens, step_meta(slots, table, np.zeros(rows), lengths))
    meta_d = step_meta(slots, table, lengths, np.ones(rows))
    state = dcp.shard_state(jax.tree.map(jnp.copy, history), mesh)
    want_d, want_state = model.decode(params, cfg, history, next_tokens, meta_d)

    decode = dcp.decode.lower(params, cfg, state, next_tokens, meta_d, local, mesh).compile()
    got_d, state = decode(params, state, next_tokens, meta_d, local)
    assert rel_err(got_d, want_d) <= RTOL
    for name in ("kda", "conv", "kv_pages"):
        assert rel_err(getattr(state, name), getattr(want_state, name)) <= RTOL, name
    # one MLA layer: the merge all-reduces o [B, 1, H, C] and l [B, 1, H] (fp32) and the max; no token moves
    report = comm.collectives(decode.as_text())
    assert {c.kind for c in report} == {"all-reduce"}
    assert sum(c.payload_bytes for c in report) == 4 * rows * cfg.mla_num_heads * (cfg.kv_lora_rank + 2)


# --- TP subgroups -------------------------------------------------------------------------------------

_TP_TABLE = '''
import json, sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from k3jax.parallel import comm, tp_subgroup
ranks, t, tokens, h = (int(a) for a in sys.argv[1:5])
mesh = tp_subgroup.make_mesh(ranks, t)
x = jax.random.normal(jax.random.key(1), (ranks * tokens, h), jnp.float32)
w = jax.random.normal(jax.random.key(2), (h, h), jnp.float32) / h**0.5
w_sharded = jax.device_put(w, NamedSharding(mesh, P(None, tp_subgroup.TP)))
compiled = tp_subgroup.column_parallel_block.lower(x, w_sharded, mesh).compile()
got = np.asarray(compiled(x, w_sharded), np.float64)
want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
wire = {}
for c in comm.collectives(compiled.as_text()):
    wire[c.kind] = wire.get(c.kind, 0) + c.wire_bytes
print(json.dumps({"err": float(np.max(np.abs(got - want)) / np.max(np.abs(want))), "wire": wire,
                  "weight_bytes": w_sharded.addressable_shards[0].data.nbytes}))
'''


def _tp_row(ranks, t, tokens, h, devices=None):
    """Runs the TP table program (in this process, or in a subprocess with `devices` host devices)."""
    import json
    import os
    import subprocess
    import sys

    if devices is None:
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            old = sys.argv
            sys.argv = ["tp", str(ranks), str(t), str(tokens), str(h)]
            try:
                exec(_TP_TABLE, {"__name__": "tp_table"})
            finally:
                sys.argv = old
        return json.loads(out.getvalue())
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", _TP_TABLE, str(ranks), str(t), str(tokens), str(h)], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _check_tp_row(row, t, tokens, h):
    """The published TP-subgroup table per local token (s_a = s_w = 4 bytes here, fp32): all-gather
    (T-1)*H*s_a, all-to-all back (T-1)/T*H*s_a, weights H^2*s_w/T per rank; nothing at T = 1."""
    assert row["err"] <= 1e-5
    assert row["wire"].get("all-gather", 0) / tokens == pytest.approx((t - 1) * h * 4)
    assert row["wire"].get("all-to-all", 0) / tokens == pytest.approx((t - 1) / t * h * 4)
    assert set(row["wire"]) <= {"all-gather", "all-to-all"}
    assert row["weight_bytes"] == h * h * 4 // t


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tp_table_row(t):
    """One row of the table on 8 host devices: groups of T, 5 tokens per rank, H = 72."""
    _check_tp_row(_tp_row(RANKS, t, 5, 72), t, 5, 72)


def test_tp_table_row_16():
    """T = 16 needs 16 devices: a subprocess with 16 host CPU devices (one group of 16), H = 80."""
    _check_tp_row(_tp_row(16, 16, 3, 80, devices=16), 16, 3, 80)


def _tp_layers(report, layers):
    """The TP-group collectives of a step program, per decoder layer: all but DEP's (its dispatch / combine
    all-to-alls sit in the capacity-round loop, its round count is an all-reduce). Each layer's first TP
    collective is its attention all-gather, and all of a layer's collectives precede the next layer's (they
    feed its input), so with two all-gathers per layer (attention, shared experts) a layer starts at every
    other all-gather of the program order."""
    tp = [x for x in report if not x.in_loop and x.kind in ("all-gather", "all-to-all")]
    starts = [i for i, x in enumerate(tp) if x.kind == "all-gather"][::2] + [len(tp)]
    assert len(starts) in (1, layers + 1)  # none at T = 1
    return [tp[a:b] for a, b in zip(starts, starts[1:])] or [[] for _ in range(layers)]


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tp_subgroup_prefill_decode_equal_single_device(case, t):
    """DEP with TP subgroups of T (mesh 8/T x T) on the cut model (a KDA + MoE and an MLA + MoE layer): the
    TP-selected attention projections (k3jax.plan's list: KDA q/k/v/g_proj and o_proj, MLA g_proj and
    o_proj) and the shared experts split over each group, routed experts over all 8 ranks; ragged per-rank
    batches as in the DWDP test. Prefill then decode equal the single-device model; the compiled programs'
    TP collectives per layer equal the closed form from the config (per local token: the attention
    projections' `tp_subgroup.closed_form_bytes_per_token` + the shared experts' (T-1)*D*s_a each way);
    each rank holds 1/T of every selected weight (rounded up to whole columns / rows)."""
    from k3jax.parallel import tp_subgroup
    from k3jax.plan import TP_COLUMN_PROJECTIONS, TP_ROW_PROJECTIONS

    cfg, params, c = case
    mesh = tp_subgroup.make_mesh(RANKS, t)
    sharded = tp_subgroup.shard_params(params, cfg, mesh)
    for l, kind in enumerate(("kda", "mla")):
        assert cfg.is_mla(l) == (kind == "mla")
        for axis, names in ((1, TP_COLUMN_PROJECTIONS[kind]), (0, TP_ROW_PROJECTIONS[kind])):
            for name in (n for n in names if n in params["layers"][l]["attn"]):
                full, split = params["layers"][l]["attn"][name], sharded["layers"][l]["attn"][name]
                shard = split.addressable_shards[0].data
                # 1/T of the split axis, rounded up to whole columns / rows (MLA's 36 at T = 8: 5 of 40 padded)
                assert shard.shape[axis] == -(-full.shape[axis] // t), (kind, name)
                assert shard.shape[1 - axis] == full.shape[1 - axis]
                if full.shape[axis] % t == 0:
                    assert shard.nbytes * t == full.nbytes

    flat = lambda a: a.reshape(RANKS * ROWS, *a.shape[2:])  # noqa: E731
    lp = flat(c["lengths"])
    meta_p = step_meta(flat(c["slots"]), flat(c["tables"]), np.zeros_like(lp), lp)
    meta_d = step_meta(flat(c["slots"]), flat(c["tables"]), lp, (lp > 0).astype(np.int32))
    state = tp_subgroup.shard_state(jax.tree.map(jnp.copy, c["state0"]), mesh)
    tokens, next_tokens = jnp.asarray(flat(c["tokens"])), jnp.asarray(flat(c["next_tokens"]))
    prefill = tp_subgroup.prefill.lower(sharded, cfg, state, tokens, meta_p, mesh).compile()
    logits_p, state = prefill(sharded, state, tokens, meta_p)
    decode = tp_subgroup.decode.lower(sharded, cfg, state, next_tokens, meta_d, mesh).compile()
    logits_d, state = decode(sharded, state, next_tokens, meta_d)
    valid = c["valid"]
    assert rel_err(np.asarray(logits_p)[valid], c["logits_p"][valid]) <= RTOL
    assert rel_err(np.asarray(logits_d)[valid], c["logits_d"][valid]) <= RTOL
    for name in ("kda", "conv", "kv_pages"):
        assert rel_err(getattr(state, name), getattr(c["state"], name)) <= RTOL, name

    attention = tp_subgroup.closed_form_bytes_per_token(cfg, t, 4)  # fp32 activations
    shared = (t - 1) * cfg.hidden_size * 4
    for program, tokens_per_rank in ((prefill, ROWS * PREFILL), (decode, ROWS)):
        layers = _tp_layers(comm.collectives(program.as_text()), 2)
        for layer, (kind, collectives) in enumerate(zip(("kda", "mla"), layers)):
            assert all(x.group_size == t for x in collectives)
            for op in ("all-gather", "all-to-all"):
                measured = sum(x.wire_bytes for x in collectives if x.kind == op) / tokens_per_rank
                assert measured == pytest.approx(attention[kind][op] + shared), (layer, op)
