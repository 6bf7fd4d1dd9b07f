"""TEP and DEP on 8 host CPU devices: equal to the single-device model (k3-tiny, fp32) for the MoE block,
forward, prefill and decode (ragged per-rank batches for DEP), and HLO communication equal to the
published closed forms.

Tolerance 1e-5 relative to the largest |logit|: the strategies only reorder fp32 sums (partial o_proj /
expert / shared sums added across ranks), which moves results by a few ulps per layer (measured ~1.5e-6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import model
from k3jax.moe import ffn as model_ffn
from k3jax.params import init_params
from k3jax.parallel import comm, dep, tep
from k3jax.parallel.common import make_mesh
from k3jax.testing import k3_tiny, step_meta

RTOL = 1e-5
RANKS = 8


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def setup():
    cfg = k3_tiny()
    params = init_params(cfg, jax.random.key(11))
    mesh = make_mesh(RANKS)
    return cfg, params, mesh, tep.shard_params(params, cfg, mesh), dep.shard_params(params, cfg, mesh)


def test_padding_fits_tiny_config(setup):
    cfg, *_ = setup
    # k3-tiny's 3 heads and 7 experts do not divide by 8 ranks: the zero-padding path is what runs here
    assert cfg.kda_num_heads % RANKS and cfg.mla_num_heads % RANKS and cfg.num_experts % RANKS


def test_moe_block_equals_single_device(setup):
    """One DEP MoE layer alone, also with skewed routing: every token picks experts 0..2 (ranks 0..2 at one
    expert per rank), so a destination needs all B of a rank's rows, several rounds of the default
    capacity; results stay exact (no token is dropped)."""
    cfg, params, mesh, _, dep_params = setup
    layer = 5
    reference = jax.jit(model_ffn, static_argnums=2)
    x = jax.random.normal(jax.random.key(3), (RANKS * 3, 5, cfg.hidden_size), jnp.float32)
    want = reference(params["layers"][layer]["mlp"], x, cfg)
    assert rel_err(dep.moe_block(dep_params, cfg, layer, x, mesh), want) <= RTOL
    # (tep.moe_block is exercised by every TEP test below; one more 8-device program would overrun CI's budget)

    skew = jnp.full((cfg.num_experts,), -10.0).at[:3].set(10.0)
    layers = list(dep_params["layers"])
    layers[layer] = dict(layers[layer], mlp=dict(layers[layer]["mlp"], router_bias=skew))
    want = reference(dict(params["layers"][layer]["mlp"], router_bias=skew), x, cfg)
    assert rel_err(dep.moe_block(dict(dep_params, layers=layers), cfg, layer, x, mesh), want) <= RTOL


def test_dep_tiles_its_experts_by_its_even_share(setup, monkeypatch):
    """Each DEP rank hands the experts op its expected kept rows (its tokens x top_k: its even share of the picks)
    as the kernels' tiling hint, not the ranks * capacity * top_k assignments it receives (most of them dropped);
    the result is unchanged."""
    from k3jax import backend

    cfg, params, mesh, _, dep_params = setup
    layer = 5
    hints, real = [], backend.get("moe_experts", "reference")
    monkeypatch.setitem(backend._REGISTRY, ("moe_experts", "reference"),
                        lambda *a, expected_rows=None, **k: (hints.append(expected_rows), real(*a, **k))[1])
    x = jax.random.normal(jax.random.key(4), (RANKS * 2, 7, cfg.hidden_size), jnp.float32)
    want = jax.jit(model_ffn, static_argnums=2)(params["layers"][layer]["mlp"], x, cfg)
    hints.clear()
    jax.clear_caches()  # the spy sees the op at trace time: no trace of an earlier test may be reused
    assert rel_err(dep.moe_block(dep_params, cfg, layer, x, mesh), want) <= RTOL
    assert hints == [2 * 7 * cfg.num_experts_per_tok]  # 14 tokens per rank (traced once)


def test_forward_equals_single_device(setup):
    """`forward` (cache-free attention) under both strategies, on k3-tiny cut to its first two layers (KDA +
    dense MLP, then MLA + MoE: every layer kind; the full depth runs in the serving tests below, and
    whole-model forwards would overrun CI's CPU budget on 8 devices)."""
    _, full_params, mesh, *_ = setup
    cfg = k3_tiny().replace(num_layers=2, mla_layers=(1,))
    params = dict(full_params, layers=[full_params["layers"][0], full_params["layers"][7]])  # 7: an MLA + MoE layer
    tokens = jax.random.randint(jax.random.key(5), (RANKS * 2, 6), 0, cfg.vocab_size, jnp.int32)
    want = model.forward(params, cfg, tokens)
    assert rel_err(tep.forward(tep.shard_params(params, cfg, mesh), cfg, tokens, mesh), want) <= RTOL
    assert rel_err(dep.forward(dep.shard_params(params, cfg, mesh), cfg, tokens, mesh), want) <= RTOL


# --- serving steps: prefill then decode, with ragged per-rank batches ---------------------------------

SLOTS, MAX_PAGES, PAGE = 3, 3, 4  # per rank: 2 rows, 3 slots, 2 * 3 pages of 4 tokens
ROWS, PREFILL = 2, 4  # 8 token slots per rank: B*k = 24 is a multiple of 8 ranks (DEP buffers meet B*k exactly)


@pytest.fixture(scope="module")
def serving_case(setup):
    """Per rank up to ROWS requests of ragged prefill lengths (some ranks with one or none: length-0
    rows), local slot / page ids; the single-device reference sees all ranks' rows with global ids."""
    cfg, params, *_ = setup
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, PREFILL + 1, (RANKS, ROWS))
    lengths[1, 1] = lengths[4, 0] = 0
    lengths[6] = 0  # a rank with no request at all
    slots = np.stack([rng.permutation(SLOTS)[:ROWS] for _ in range(RANKS)])
    pages_per_rank = ROWS * MAX_PAGES
    tables = np.stack([rng.permutation(pages_per_rank).reshape(ROWS, MAX_PAGES) for _ in range(RANKS)])
    flat = lambda a: a.reshape(RANKS * ROWS, *a.shape[2:])
    offsets = np.arange(RANKS)[:, None]
    lengths = flat(lengths)
    metas = {}
    for name, sl, tb in (("local", flat(slots), flat(tables)),
                         ("global", flat(slots + offsets * SLOTS), flat(tables + offsets[:, :, None] * pages_per_rank))):
        metas[name] = (step_meta(sl, tb, np.zeros_like(lengths), lengths),
                       step_meta(sl, tb, lengths, (lengths > 0).astype(np.int32)))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (RANKS * ROWS, PREFILL)), jnp.int32)
    next_tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (RANKS * ROWS,)), jnp.int32)
    state0 = model.init_state(cfg, RANKS * SLOTS, RANKS * pages_per_rank, PAGE)
    # a random (never zero) starting state, so every step reads real history
    state0 = state0.replace(kda=0.1 * jax.random.normal(jax.random.key(8), state0.kda.shape),
                            conv=0.1 * jax.random.normal(jax.random.key(9), state0.conv.shape))
    meta_p, meta_d = metas["global"]
    logits_p, state = model.prefill(params, cfg, jax.tree.map(jnp.copy, state0), tokens, meta_p)
    logits_d, state = model.decode(params, cfg, state, next_tokens, meta_d)
    valid = lengths > 0
    return dict(tokens=tokens, next_tokens=next_tokens, metas=metas, state0=state0, valid=valid,
                logits_p=np.asarray(logits_p)[valid], logits_d=np.asarray(logits_d)[valid], state=state)


def _run(strategy, params, cfg, mesh, state, case, metas):
    """prefill (compiled explicitly, so its HLO is at hand) then decode; returns logits, state, HLO text."""
    meta_p, meta_d = metas
    prefill = strategy.prefill.lower(params, cfg, state, case["tokens"], meta_p, mesh).compile()
    logits_p, state = prefill(params, state, case["tokens"], meta_p)
    logits_d, state = strategy.decode(params, cfg, state, case["next_tokens"], meta_d, mesh)
    return dict(logits_p=np.asarray(logits_p)[case["valid"]], logits_d=np.asarray(logits_d)[case["valid"]],
                state=state, hlo=prefill.as_text())


@pytest.fixture(scope="module")
def tep_run(setup, serving_case):
    cfg, _, mesh, tep_params, _ = setup
    state = tep.shard_state(jax.tree.map(jnp.copy, serving_case["state0"]), cfg, mesh)  # may alias; steps donate
    return _run(tep, tep_params, cfg, mesh, state, serving_case, serving_case["metas"]["global"])


@pytest.fixture(scope="module")
def dep_run(setup, serving_case):
    cfg, _, mesh, _, dep_params = setup
    state = dep.shard_state(jax.tree.map(jnp.copy, serving_case["state0"]), mesh)
    return _run(dep, dep_params, cfg, mesh, state, serving_case, serving_case["metas"]["local"])


def test_tep_prefill_decode_equal_single_device(setup, serving_case, tep_run):
    cfg = setup[0]
    assert rel_err(tep_run["logits_p"], serving_case["logits_p"]) <= RTOL
    assert rel_err(tep_run["logits_d"], serving_case["logits_d"]) <= RTOL
    back, want = tep.unshard_state(tep_run["state"], cfg), serving_case["state"]
    for name in ("kda", "conv", "kv_pages"):
        assert rel_err(getattr(back, name), getattr(want, name)) <= RTOL, name


def test_dep_prefill_decode_ragged_equal_single_device(serving_case, dep_run):
    assert rel_err(dep_run["logits_p"], serving_case["logits_p"]) <= RTOL
    assert rel_err(dep_run["logits_d"], serving_case["logits_d"]) <= RTOL
    # rank r's slots r*SLOTS.. and pages are the global pool's: the sharded state is the single-device state
    for name in ("kda", "conv", "kv_pages"):
        assert rel_err(getattr(dep_run["state"], name), getattr(serving_case["state"], name)) <= RTOL, name


def test_tep_hlo_all_reduces_match_closed_form(setup, serving_case, tep_run):
    """TEP prefill: every rank holds all N*B token slots (B = 8 per rank); each layer all-reduces the
    attention output (width D), and a MoE layer also the routed latent sum (Dl) and the shared experts
    (D) -- layer 0's dense MLP one of width D. Per rank and all-reduce: 2(N-1)/N x N*B token payloads,
    ~ 2BN. Nothing else is communicated."""
    cfg = setup[0]
    report = comm.collectives(tep_run["hlo"])
    assert {c.kind for c in report} == {"all-reduce"}
    global_tokens = serving_case["tokens"].size
    widths = [cfg.hidden_size] * cfg.num_layers  # after attention
    widths += [cfg.moe_latent_size + cfg.hidden_size if cfg.is_moe(l) else cfg.hidden_size for l in range(cfg.num_layers)]
    payload = 4 * global_tokens * sum(widths)
    total = comm.summary(report)["all-reduce"]
    assert total["payload_bytes"] == payload
    assert total["wire_bytes"] == pytest.approx(2 * (RANKS - 1) / RANKS * payload)
    for c in report:  # each buffer (a tuple when XLA combines two all-reduces) is whole tokens x widths
        assert c.group_size == RANKS and not c.in_loop
        assert all(np.prod(dims[:-1]) == global_tokens for _, dims in c.shapes)


def test_dep_hlo_all_to_all_within_2bk(setup, serving_case, dep_run):
    """DEP prefill: per MoE layer a dispatch (the latent row, and 2k int32 words of expert ids + weights)
    and a combine (latent) of n * capacity rows each, n * capacity = B*k here (B = 8 token slots per rank,
    k = 3): 2BK latent token payloads per rank and layer per round, plus the routing words, plus one
    scalar pmax (the round count). Attention is local: nothing else is communicated."""
    cfg = setup[0]
    report = comm.collectives(dep_run["hlo"])
    per_rank_tokens = serving_case["tokens"].size // RANKS
    k, latent = cfg.num_experts_per_tok, cfg.moe_latent_size
    moe_layers = sum(cfg.is_moe(l) for l in range(cfg.num_layers))
    a2a = [c for c in report if c.kind == "all-to-all"]
    assert a2a and all(c.in_loop and c.group_size == RANKS for c in a2a)
    rows = per_rank_tokens * k
    assert comm.summary(a2a)["all-to-all"]["payload_bytes"] == moe_layers * 4 * rows * (2 * latent + 2 * k)
    latent_elements = sum(int(np.prod(dims)) for c in a2a for dtype, dims in c.shapes
                          if dtype == "f32" and dims[-1] == latent)
    assert latent_elements == moe_layers * 2 * per_rank_tokens * k * latent  # 2BK token payloads per layer
    small = [c for c in report if c.kind != "all-to-all"]
    assert len(small) == moe_layers and all(c.kind == "all-reduce" and c.payload_bytes == 4 for c in small)


def test_dep_capacity_within_2bk_when_bk_not_multiple_of_ranks(setup):
    """B = 5 local tokens, k = 3: B*k = 15 is not a multiple of 8 ranks. A dispatch round carries
    capacity = floor(15/8) = 1 row per rank pair (8 <= 15 rows; ceil would give 16 > BK), so one round's
    dispatch + combine latent buffers are <= 2BK token payloads; routing that needs more rows takes more
    rounds and stays exact."""
    cfg, params, mesh, _, dep_params = setup
    layer, per_rank = 5, 5
    k, width = cfg.num_experts_per_tok, cfg.moe_latent_size
    assert (per_rank * k) % RANKS
    x = jax.random.normal(jax.random.key(4), (RANKS, per_rank, cfg.hidden_size), jnp.float32)
    compiled = dep.moe_block.lower(dep_params, cfg, layer, x, mesh).compile()
    want = jax.jit(model_ffn, static_argnums=2)(params["layers"][layer]["mlp"], x, cfg)
    assert rel_err(compiled(dep_params, x), want) <= RTOL
    latent_a2a = [c for c in comm.collectives(compiled.as_text()) if c.kind == "all-to-all" and c.shapes[0][1][-1] == width]
    assert len(latent_a2a) == 2  # dispatch and combine of one round (XLA:CPU spells each as one tuple per peer)
    rows = sum(int(np.prod(dims[:-1])) for c in latent_a2a for _, dims in c.shapes)
    assert rows == 2 * RANKS * dep.default_capacity(per_rank, cfg, RANKS) and rows <= 2 * per_rank * k
