"""Distil an EAGLE-3 drafter from the target's own generations (k3-model.md §7).

    python -m k3jax.train_target --out /tmp/k3-tiny-markov            # a target with learnable structure
    python -m k3jax.train_drafter --checkpoint /tmp/k3-tiny-markov --out /tmp/drafter \
        --eval-k 1 2 3 4 5 --eval-rejection                          # drafter + held-out acceptance

API for the serving engine: `distil(params, cfg, TrainConfig(...), prompts=...) -> (dcfg, drafter params,
info)`; drafter checkpoints: k3jax.drafter.save_drafter / load_drafter.

1. Data: prompts (from the target's own input distribution when known -- a train_target corpus --
   else uniformly random ids) continued by the target, greedy rows and temperature-sampled rows. Every
   position goes through one compiled serving decode step with the EAGLE-3 capture
   (`decode_with_features`), which yields the tokens, the captured features and the target's logits.
2. Draft vocab: the most frequent generated ids (build_vocab_map).
3. Training-time test: the drafter is unrolled `ttt_steps` steps on its own hidden outputs
   (drafter.unrolled_logits); the loss is the cross-entropy against the target's softmax restricted to
   the draft vocab, at positions whose target argmax is in the draft vocab, step j weighted 0.8^j.
   optax adamw with warmup + cosine decay.
4. Evaluation: mean acceptance length of speculative decoding (k3jax.speculative) on held-out prompts,
   whose greedy output must equal plain greedy decoding; first-draft agreement on the training data.

Why a trained target: against a random-init target the drafter cannot generalise (its greedy
continuation is a hash-like function of the context; k3jax/train_target.py has the numbers).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from k3jax.config import ModelConfig, load_config
from k3jax.drafter import DrafterConfig, build_vocab_map, init_drafter, save_drafter, target_ids, unrolled_logits
from k3jax.model import DecodeState, StepMeta, init_state, lm_head, step_body
from k3jax.params import init_params
from k3jax.testing import step_meta
from k3jax.train_target import cpu_compile_options, optimizer_step, progress, tqdm


@dataclass(frozen=True)
class TrainConfig:
    num_seqs: int = 384  # training sequences (half greedy, half sampled)
    prompt_len: int = 16
    gen_len: int = 48
    gen_batch: int = 64
    sample_temperature: float = 1.0  # for the sampled half
    draft_vocab_size: int | None = None  # None: the whole target vocab, capped at 32768
    intermediate_size: int | None = None  # drafter MLP width (None: the target's)
    capture_layers: tuple[int, ...] | None = None  # None: EAGLE-3's low/mid/high (eagle_capture_layers)
    steps: int = 500
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    ttt_steps: int = 4
    step_decay: float = 0.8
    target_temperature: float = 1.0
    seed: int = 0


# ----------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------


def random_prompts(rng: np.random.Generator, cfg: ModelConfig, n: int, length: int) -> np.ndarray:
    """[n, length] uniformly random ids, avoiding the special (bos/eos/pad) tokens."""
    special = {cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id}
    allowed = np.array([i for i in range(cfg.vocab_size) if i not in special])
    return allowed[rng.integers(0, len(allowed), (n, length))].astype(np.int32)


@jax.jit
def _pick(logits: jax.Array, temperature: jax.Array, key: jax.Array) -> jax.Array:
    """Per row: argmax where temperature == 0, else a sample of softmax(logits / temperature)."""
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    drawn = jax.random.categorical(key, logits / t, axis=-1)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, -1)).astype(jnp.int32)


@partial(jax.jit, static_argnames=("cfg", "capture"), donate_argnames=("state",))
def decode_with_features(params: dict, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta,
                         capture: tuple[int, ...]):
    """k3jax.decode (one token per row, recurrent KDA) that also returns the EAGLE-3 features of that
    position: (logits [B, V], new state, features [B, len(capture), D])."""
    hidden, state, _, feats = step_body(params, cfg, state, tokens[:, None], meta, kda_mode="recurrent",
                                        all_states=False, backend_name="reference", capture=capture)
    if capture:
        feats = jnp.stack(feats, axis=2)[:, 0]
    else:
        feats = jnp.zeros((tokens.shape[0], 0, cfg.hidden_size), hidden.dtype)
    return lm_head(params, cfg, hidden[:, 0]), state, feats


def _as_rows(prompts, vocab_size: int) -> list[np.ndarray]:
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    rows = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    if not rows or any(r.size == 0 for r in rows):
        raise ValueError("prompts: expected a non-empty batch of non-empty token sequences")
    if min(int(r.min()) for r in rows) < 0 or max(int(r.max()) for r in rows) >= vocab_size:
        raise ValueError(f"prompts: token ids must be in [0, {vocab_size})")
    return rows


def generate_with_features(params: dict, cfg: ModelConfig, prompts, gen_len: int, temperatures,
                           key: jax.Array, capture: tuple[int, ...], page_size: int = 16,
                           max_len: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Continues each prompt by gen_len tokens (row b at temperatures[b]; 0 = greedy) and records the
    target's view of every position.

    prompts: [B, P] ids or a list of B (ragged) token lists. Returns (tokens [B, L], features
    [B, L, n_capture, D], logits [B, L, V]) with L = max prompt length + gen_len: row b holds its prompt
    and then its gen_len tokens, so it is valid up to len_b + gen_len (padding after that); logits[:, t]
    scores the token after position t. max_len: size the cache for this many positions (>= L) rather than
    L, so that calls of different lengths share one compiled step.

    Every position, prompt included, goes through one compiled serving decode step (k3jax's decode step
    body with the EAGLE-3 capture; no prefill, whose chunked KDA is the expensive path on CPU), so the
    data are the target's own token-by-token computation and greedy rows are plain greedy decoding.
    """
    rows = _as_rows(prompts, cfg.vocab_size)
    b = len(rows)
    lens = np.array([r.size for r in rows])
    total = int(lens.max()) + gen_len
    if max_len is not None and max_len < total:
        raise ValueError(f"generate_with_features: max_len {max_len} < longest prompt + gen_len = {total}")
    pages = math.ceil((max_len or total) / page_size)
    state = init_state(cfg, num_slots=b, num_pages=b * pages, page_size=page_size)
    table = np.arange(b * pages).reshape(b, pages)
    slots = np.arange(b)
    temps = jnp.asarray(np.broadcast_to(np.asarray(temperatures, np.float32), (b,)))
    tokens = np.zeros((b, total), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : r.size] = r
    feats, logits = [], []
    for i in range(total):
        lo, state, fe = decode_with_features(params, cfg, state, jnp.asarray(tokens[:, i]),
                                             step_meta(slots, table, [i] * b, [1] * b), capture)
        feats.append(fe)
        logits.append(lo)
        emit = (lens - 1 <= i) & (i < lens - 1 + gen_len)  # rows whose token i+1 is generated now
        if emit.any():
            tokens[emit, i + 1] = np.asarray(_pick(lo, temps, jax.random.fold_in(key, i)))[emit]
    return tokens, np.asarray(jnp.stack(feats, axis=1)), np.asarray(jnp.stack(logits, axis=1))


def greedy_continuations(params: dict, cfg: ModelConfig, prompts, max_tokens: int,
                         capture: tuple[int, ...] = ()) -> list[list[int]]:
    """Plain greedy decoding (k3jax's serving decode step, token by token) of each (ragged) prompt:
    the max_tokens generated ids per row. `capture` only selects which compiled step is used (pass the
    drafter's capture layers to share the program with data generation)."""
    rows = _as_rows(prompts, cfg.vocab_size)
    toks = generate_with_features(params, cfg, rows, max_tokens, 0.0, jax.random.key(0), capture)[0]
    return [toks[i, r.size : r.size + max_tokens].tolist() for i, r in enumerate(rows)]


def build_dataset(params: dict, cfg: ModelConfig, tcfg: TrainConfig, capture: tuple[int, ...], seed: int,
                  prompts: np.ndarray | None = None, log=print) -> dict:
    """The target's continuations of prompts with its features and logits: tokens [N, T], features
    [N, T, n_capture, D], logits [N, T, V] (float32, on the host), N = tcfg.num_seqs.

    prompts: [>= N, prompt_len] (e.g. samples of the target's training distribution); default uniformly
    random ids. Even rows are continued greedily, odd rows sampled at tcfg.sample_temperature.
    """
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    batches = math.ceil(tcfg.num_seqs / tcfg.gen_batch)
    if prompts is not None:
        prompts = np.asarray(prompts, np.int32)
        if prompts.ndim != 2 or prompts.shape[0] < tcfg.num_seqs or prompts.shape[1] < 1:
            raise ValueError(f"build_dataset: prompts must be [>= {tcfg.num_seqs}, P], got {prompts.shape}")
        if prompts.min() < 0 or prompts.max() >= cfg.vocab_size:
            raise ValueError("build_dataset: prompt ids out of the target vocab")
        pad = batches * tcfg.gen_batch - prompts.shape[0]  # whole batches: one compiled shape
        prompts = np.concatenate([prompts, prompts[: max(pad, 0)]])[: batches * tcfg.gen_batch]
    toks, feats, logits = [], [], []
    bar = progress(batches, "drafter data")
    for i in bar:
        if prompts is None:
            batch = random_prompts(rng, cfg, tcfg.gen_batch, tcfg.prompt_len)
        else:
            batch = prompts[i * tcfg.gen_batch : (i + 1) * tcfg.gen_batch]
        temps = np.where(np.arange(tcfg.gen_batch) % 2 == 0, 0.0, tcfg.sample_temperature)
        seqs, fe, lo = generate_with_features(params, cfg, batch, tcfg.gen_len, temps, jax.random.fold_in(key, i),
                                              capture)
        toks.append(seqs)
        feats.append(fe)
        logits.append(lo)
        if not tqdm:
            log(f"  data batch {i + 1}/{batches}")
    prompt_len = tcfg.prompt_len if prompts is None else prompts.shape[1]
    return {"tokens": np.concatenate(toks)[: tcfg.num_seqs], "features": np.concatenate(feats)[: tcfg.num_seqs],
            "logits": np.concatenate(logits)[: tcfg.num_seqs], "prompt_len": prompt_len}


def token_counts(data: dict, vocab_size: int) -> np.ndarray:
    """Frequencies of the generated (non-prompt) tokens."""
    return np.bincount(data["tokens"][:, data["prompt_len"]:].reshape(-1), minlength=vocab_size)


# ----------------------------------------------------------------------------------------------------
# loss and training
# ----------------------------------------------------------------------------------------------------


def ttt_loss(trainable: dict, d2t: jax.Array, cfg: ModelConfig, dcfg: DrafterConfig, embed: jax.Array,
             features: jax.Array, tokens: jax.Array, target_logits: jax.Array, ttt_steps: int,
             step_decay: float = 0.8, target_temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Training-time-test loss of one batch of whole sequences.

    features [B, T, n, D], tokens [B, T] (x_0..x_{T-1}), target_logits [B, T, V]. Step j at position t
    predicts x_{t+2+j}, scored against softmax(target_logits[t+1+j]) over the draft vocab; positions past
    the end, or whose target argmax lies outside the draft vocab, are masked. target_temperature < 1
    sharpens the target softmax towards its argmax (what greedy verification accepts).
    Returns (loss, top-1 agreement with the target's argmax per step [ttt_steps]).
    """
    params = {**trainable, "d2t": d2t}
    b, t = tokens.shape
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)  # x_{t+1}
    logits = unrolled_logits(params, cfg, dcfg, embed, features, nxt, ttt_steps)  # [S, B, T, Vd]
    ids = target_ids(params)
    in_draft = jnp.zeros((cfg.vocab_size,), bool).at[ids].set(True)  # t2d
    total, weight, agree = 0.0, 0.0, []
    for j in range(ttt_steps):
        tgt = jnp.pad(target_logits[:, 1 + j :], ((0, 0), (0, 1 + j), (0, 0)))  # position t -> t+1+j
        valid = (jnp.arange(t) + 1 + j < t)[None, :] & in_draft[jnp.argmax(tgt, -1)]
        p = jax.nn.softmax(tgt[..., ids] / target_temperature, axis=-1)
        logq = jax.nn.log_softmax(logits[j], axis=-1)
        ce = -jnp.sum(p * logq, axis=-1)
        n = jnp.maximum(valid.sum(), 1)
        total = total + step_decay**j * jnp.sum(jnp.where(valid, ce, 0.0)) / n
        weight = weight + step_decay**j
        hit = ids[jnp.argmax(logits[j], -1)] == jnp.argmax(tgt, -1)
        agree.append(jnp.sum(jnp.where(valid, hit, False)) / n)
    return total / weight, jnp.stack(agree)


def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    warmup = min(tcfg.warmup, max(tcfg.steps // 10, 1))
    schedule = optax.warmup_cosine_decay_schedule(0.0, tcfg.lr, warmup, max(tcfg.steps, warmup + 1), tcfg.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=tcfg.weight_decay))


def train(params: dict, cfg: ModelConfig, dcfg: DrafterConfig, data: dict, tcfg: TrainConfig,
          drafter_params: dict, log=print) -> tuple[dict, list[dict]]:
    """adamw on ttt_loss over random batches of `data` (the optimisation loop of `distil`).
    Returns (drafter params, history of {step, loss, agree: top-1 agreement per unroll step}); the last
    record also lists `params_without_gradient` (trainable leaves that never got a gradient; normally [])."""
    d2t = drafter_params["d2t"]
    trainable = {k: v for k, v in drafter_params.items() if k != "d2t"}
    opt = make_optimizer(tcfg)
    opt_state = opt.init(trainable)
    embed = params["embed"]
    grad_fn = jax.jit(jax.value_and_grad(ttt_loss, has_aux=True), static_argnums=(2, 3, 8, 9, 10),
                      compiler_options=cpu_compile_options(1))
    update = optimizer_step(opt)

    def step(trainable, opt_state, feats, toks, tlogits):
        (loss, agree), grads = grad_fn(trainable, d2t, cfg, dcfg, embed, feats, toks, tlogits, tcfg.ttt_steps,
                                       tcfg.step_decay, tcfg.target_temperature)
        trainable, opt_state = update(trainable, opt_state, grads)
        return trainable, opt_state, loss, agree

    rng = np.random.default_rng(tcfg.seed + 1)
    n = data["tokens"].shape[0]
    history = []
    bar = progress(tcfg.steps, "drafter")
    every = max(tcfg.steps // 20, 1)
    for i in bar:
        idx = rng.choice(n, size=min(tcfg.batch_size, n), replace=False)
        trainable, opt_state, loss, agree = step(
            trainable, opt_state, jnp.asarray(data["features"][idx]), jnp.asarray(data["tokens"][idx]),
            jnp.asarray(data["logits"][idx]))
        if (i + 1) % every == 0 or i == tcfg.steps - 1:
            rec = {"step": i + 1, "loss": float(loss), "agree": [round(float(a), 3) for a in agree]}
            history.append(rec)
            if tqdm:
                bar.set_postfix(loss=f"{rec['loss']:.3f}", top1=rec["agree"][0])
            else:
                log(f"  step {rec['step']}/{tcfg.steps} loss {rec['loss']:.4f} top-1 agreement per step {rec['agree']}")
    # parameters whose gradient was zero at every step (adam's second moment is still all zero): a
    # wiring bug (an unused projection, a detached path) would show up here
    nu = optax.tree_utils.tree_get(opt_state, "nu")
    dead = [jax.tree_util.keystr(path) for path, v in jax.tree_util.tree_flatten_with_path(nu)[0]
            if not bool(jnp.any(v > 0))]
    if history:
        history[-1]["params_without_gradient"] = dead
    return {**trainable, "d2t": d2t}, history


def agreement(params: dict, cfg: ModelConfig, dcfg: DrafterConfig, drafter_params: dict, data: dict,
              ttt_steps: int, batch_size: int = 32) -> np.ndarray:
    """Top-1 agreement of the drafter with the target's argmax per unroll step [ttt_steps] over all of
    `data` (as in training: step j at t, fed the data's own tokens, predicts the token after t+1+j;
    positions whose target argmax is outside the draft vocab are skipped, see ttt_loss).
    Step 0 is the first draft token's accuracy; compare it on training vs held-out data."""
    trainable = {k: v for k, v in drafter_params.items() if k != "d2t"}
    fn = jax.jit(lambda f, t, lo: ttt_loss(trainable, drafter_params["d2t"], cfg, dcfg, params["embed"], f, t, lo,
                                          ttt_steps)[1])
    n = data["tokens"].shape[0]
    total = np.zeros(ttt_steps)
    for i in range(0, n - batch_size + 1, batch_size):  # whole batches only: one compiled shape
        sl = slice(i, i + batch_size)
        total += np.asarray(fn(jnp.asarray(data["features"][sl]), jnp.asarray(data["tokens"][sl]),
                               jnp.asarray(data["logits"][sl])))
    return total / max(n // batch_size, 1)


def evaluate_acceptance(params: dict, cfg: ModelConfig, drafter_params: dict, dcfg: DrafterConfig,
                        prompts, max_tokens: int = 32, k: int = 3, sampling: str = "greedy",
                        temperature: float = 1.0, seed: int = 0):
    """Speculative decoding (k3jax.speculative.speculative_generate) of `prompts`; returns its
    SpeculativeResult (.mean_acceptance_length = accepted + 1 per round, .tokens)."""
    from k3jax.speculative import speculative_generate

    return speculative_generate(params, cfg, drafter_params, dcfg, prompts, max_tokens, k, sampling,
                                temperature=temperature, seed=seed)


def distil(params: dict, cfg: ModelConfig, tcfg: TrainConfig, *, prompts: np.ndarray | None = None,
           log=print) -> tuple[DrafterConfig, dict, dict]:
    """Trains an EAGLE-3 drafter for the target (params, cfg): data, vocab, init, training.

    prompts: [>= tcfg.num_seqs, P] prompts to continue with the target (use the target's own input
    distribution; default: uniformly random ids). Returns (dcfg, drafter params, info) where info has
    data/train seconds, draft-vocab coverage, the training history and `data` (the dataset).
    """
    t0 = time.time()
    vd = tcfg.draft_vocab_size or min(cfg.vocab_size, 32768)
    dcfg = DrafterConfig(draft_vocab_size=vd, intermediate_size=tcfg.intermediate_size,
                         capture_layers=tcfg.capture_layers)
    capture = dcfg.resolve(cfg).capture_layers
    log(f"generating {tcfg.num_seqs} target continuations of {tcfg.gen_len} tokens (capture layers {capture})")
    data = build_dataset(params, cfg, tcfg, capture, tcfg.seed, prompts=prompts, log=log)
    t_data = time.time() - t0
    counts = token_counts(data, cfg.vocab_size)
    d2t, t2d = build_vocab_map(counts, vd)
    coverage = float(counts[t2d].sum() / max(counts.sum(), 1))
    dp = init_drafter(cfg, dcfg, jax.random.key(tcfg.seed), d2t=d2t, target_params=params)
    log(f"data {t_data:.1f}s; draft vocab {vd} covers {coverage:.3f} of generated tokens; training {tcfg.steps} steps")
    t1 = time.time()
    dp, history = train(params, cfg, dcfg, data, tcfg, dp, log=log)
    info = {"data_seconds": t_data, "train_seconds": time.time() - t1, "vocab_coverage": coverage,
            "history": history, "data": data}
    return dcfg, dp, info


@dataclass(frozen=True)
class MarkovPair:
    """A k3-family target trained on a synthetic Markov corpus and a drafter distilled from it."""

    cfg: ModelConfig
    corpus: Any  # k3jax.train_target.MarkovCorpus
    params: dict  # the trained target
    target_info: dict  # train_target's history and seconds
    dcfg: DrafterConfig
    drafter_params: dict
    info: dict  # distil's info (history, seconds, coverage, the dataset under "data")
    train_prompts: np.ndarray  # [num_seqs, prompt_len] the drafter's training prompts
    held_out: list  # ragged held-out prompts from the same corpus, none equal to a training prompt's start
    max_tokens: int  # tokens to generate per held-out prompt in evaluations (= the drafter data's gen_len,
    #                  so plain greedy references reuse the data-generation program)


@functools.lru_cache(maxsize=2)
def markov_pair(model: str = "k3-tiny", corpus=None, target=None, drafter: TrainConfig | None = None,
                held_out: int = 16) -> MarkovPair:
    """Trains a target on a Markov corpus (k3jax.train_target) and distils a drafter from it, end to end.

    corpus / target / drafter: CorpusConfig / TargetTrainConfig / TrainConfig (None: defaults).
    Deterministic given its arguments, and memoised (the arguments are frozen dataclasses), so tests
    and benchmarks in one process share one training run; treat the result as read-only.
    """
    from k3jax.train_target import CorpusConfig, MarkovCorpus, TargetTrainConfig, train_target

    cfg = load_config(model)
    mc = MarkovCorpus(corpus or CorpusConfig(), cfg)
    params, target_info = train_target(cfg, mc, target or TargetTrainConfig(), log=lambda *a: None)
    tcfg = drafter or TrainConfig()
    train_prompts, held = split_prompts(cfg, mc, tcfg.num_seqs, held_out, tcfg.prompt_len, tcfg.seed)
    dcfg, dp, info = distil(params, cfg, tcfg, prompts=train_prompts, log=lambda *a: None)
    return MarkovPair(cfg, mc, params, target_info, dcfg, dp, info, train_prompts, held, tcfg.gen_len)


def tiny_markov_pair() -> MarkovPair:
    """The CI-sized recipe on k3-tiny (about a minute of CPU): a 48-symbol corpus, 50 target steps of
    16 x 24 tokens, 64 drafter sequences of 10 + 22 tokens and 60 drafter steps; 16 held-out prompts.
    Held-out greedy acceptance at k=3 is ~3.5 (tests/model/test_drafter.py); the full-size numbers come
    from the CLI recipe in the module docstring."""
    from k3jax.train_target import CorpusConfig, TargetTrainConfig

    return markov_pair(
        "k3-tiny", CorpusConfig(num_symbols=48),
        TargetTrainConfig(steps=50, batch_size=16, seq_len=24, lr=1.5e-2, warmup=5),
        TrainConfig(num_seqs=64, gen_batch=16, prompt_len=10, gen_len=22, steps=60, batch_size=16, lr=5e-3,
                    warmup=6, draft_vocab_size=64, ttt_steps=3),
        held_out=16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3jax.train_drafter", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="k3-tiny", help="preset name or config path of a random-init target")
    ap.add_argument("--target-seed", type=int, default=0, help="random-init target: init_params(cfg, key(seed))")
    ap.add_argument("--checkpoint", default=None,
                    help="load the target from a k3jax orbax checkpoint instead (with corpus.json from "
                         "python -m k3jax.train_target, prompts are drawn from that corpus)")
    ap.add_argument("--out", required=True, help="output directory (orbax params + drafter.json)")
    d = TrainConfig()
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--num-seqs", type=int, default=d.num_seqs)
    ap.add_argument("--prompt-len", type=int, default=d.prompt_len)
    ap.add_argument("--gen-len", type=int, default=d.gen_len)
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--gen-batch", type=int, default=d.gen_batch, help="rows per generation batch")
    ap.add_argument("--intermediate-size", type=int, default=None)
    ap.add_argument("--capture-layers", type=int, nargs="+", default=None,
                    help="target layers whose inputs feed the drafter (default: EAGLE-3's low/mid/high)")
    ap.add_argument("--target-temperature", type=float, default=d.target_temperature,
                    help="distil against softmax(target logits / this); < 1 sharpens towards the argmax")
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--ttt-steps", type=int, default=d.ttt_steps)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for the acceptance eval (0: skip)")
    ap.add_argument("--eval-tokens", type=int, default=32, help="tokens generated per held-out prompt")
    ap.add_argument("--eval-k", type=int, nargs="+", default=[3], help="draft lengths to evaluate")
    ap.add_argument("--eval-rejection", action="store_true",
                    help="also evaluate rejection-sampling acceptance at temperature 1")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")

    corpus = None
    if args.checkpoint:
        from k3jax.train_target import MarkovCorpus, load_corpus_config
        from k3jax.weights import load_checkpoint

        cfg, params = load_checkpoint(args.checkpoint)
        ccfg = load_corpus_config(args.checkpoint)
        corpus = MarkovCorpus(ccfg, cfg) if ccfg is not None else None
    else:
        cfg = load_config(args.model)
        params = init_params(cfg, jax.random.key(args.target_seed))
    try:
        tcfg = TrainConfig(num_seqs=args.num_seqs, prompt_len=args.prompt_len, gen_len=args.gen_len,
                           gen_batch=args.gen_batch, target_temperature=args.target_temperature,
                           draft_vocab_size=args.draft_vocab, intermediate_size=args.intermediate_size,
                           capture_layers=tuple(args.capture_layers) if args.capture_layers else None,
                           steps=args.steps, batch_size=args.batch_size, lr=args.lr, ttt_steps=args.ttt_steps,
                           seed=args.seed)
        DrafterConfig(draft_vocab_size=tcfg.draft_vocab_size or min(cfg.vocab_size, 32768),
                      capture_layers=tcfg.capture_layers).resolve(cfg)
    except ValueError as e:
        ap.error(str(e))
    train_prompts, held_out = split_prompts(cfg, corpus, tcfg.num_seqs, args.eval_prompts, tcfg.prompt_len, args.seed)
    t0 = time.time()
    dcfg, dp, info = distil(params, cfg, tcfg, prompts=train_prompts)
    data = info.pop("data")
    extra = {"train": {k: v for k, v in info.items() if k != "history"}, "train_config": dataclasses.asdict(tcfg)}
    train_agree = [round(float(a), 4) for a in agreement(params, cfg, dcfg, dp, data, tcfg.ttt_steps,
                                                         batch_size=min(32, tcfg.num_seqs))]
    extra["train_agreement"] = train_agree
    print(f"top-1 agreement with the target's argmax on the training data, per draft step: {train_agree}")
    if args.eval_prompts:
        report = evaluate(params, cfg, dcfg, dp, held_out, args.eval_tokens, args.eval_k, args.eval_rejection,
                          tcfg, log=print)
        extra["eval"] = report
        if not report["greedy_equals_plain_greedy"]:
            print("ERROR: greedy speculative output differs from plain greedy decoding", file=sys.stderr)
            return 1
    save_drafter(args.out, cfg, dcfg, dp, overwrite=args.overwrite, extra=extra)
    print(f"saved drafter to {args.out} (total {time.time() - t0:.1f}s: data {info['data_seconds']:.1f}s, "
          f"train {info['train_seconds']:.1f}s)")
    return 0


def split_prompts(cfg: ModelConfig, corpus, n_train: int, n_held_out: int, length: int,
                  seed: int) -> tuple[np.ndarray | None, list[list[int]]]:
    """(training prompts [n_train, length] or None, held-out prompts: n_held_out ragged token lists).

    Held-out row i has length - (i % 3) tokens (ragged, as a serving batch is). With a corpus
    (k3jax.train_target.MarkovCorpus) both sets come from it, from separate seeded streams, and a
    held-out prompt equal to the start of any training prompt is redrawn: same distribution, unseen.
    Without one (a random-init target has no distribution of its own) both are uniformly random ids
    (training prompts None: build_dataset draws them).
    """
    if length < 3:
        raise ValueError(f"split_prompts: length must be >= 3, got {length}")
    lengths = [length - i % 3 for i in range(n_held_out)]
    if corpus is None:
        rows = random_prompts(np.random.default_rng(seed + 10_000), cfg, max(n_held_out, 1), length)
        return None, [rows[i, :n].tolist() for i, n in enumerate(lengths)]
    train_prompts = corpus.sample(np.random.default_rng(seed + 20_000), n_train, length)
    seen = {row[:n].tobytes() for row in train_prompts for n in set(lengths)}
    rng = np.random.default_rng(seed + 30_000)
    held: list[list[int]] = []
    while len(held) < n_held_out:
        n = lengths[len(held)]
        row = corpus.sample(rng, 1, length)[0, :n]
        if row.tobytes() not in seen:
            held.append(row.tolist())
            seen.add(row.tobytes())
    return train_prompts, held


def evaluate(params: dict, cfg: ModelConfig, dcfg: DrafterConfig, drafter_params: dict, prompts: np.ndarray,
             max_tokens: int, ks, rejection: bool, tcfg: TrainConfig | None = None, log=print) -> dict:
    """Held-out evaluation: for each k, greedy speculative decoding's mean acceptance length (and whether
    its output equals plain greedy decoding), optionally rejection sampling's at temperature 1; with
    tcfg, also the drafter's top-1 agreement per draft step on continuations of the held-out prompts
    (generated as the training data are), to compare with the training data's."""
    t0 = time.time()
    plain = greedy_continuations(params, cfg, prompts, max_tokens, dcfg.resolve(cfg).capture_layers)
    report: dict = {"prompts": len(prompts), "max_tokens": max_tokens, "greedy": {}, "rejection_t1": {},
                    "greedy_equals_plain_greedy": True}
    for k in ks:
        res = evaluate_acceptance(params, cfg, drafter_params, dcfg, prompts, max_tokens, k)
        same = res.tokens == plain
        report["greedy"][k] = res.mean_acceptance_length
        report["greedy_equals_plain_greedy"] &= same
        line = f"k={k}: greedy mean acceptance length {res.mean_acceptance_length:.3f} (output == plain greedy: {same})"
        if rejection:
            rej = evaluate_acceptance(params, cfg, drafter_params, dcfg, prompts, max_tokens, k, "rejection", 1.0)
            report["rejection_t1"][k] = rej.mean_acceptance_length
            line += f"; rejection sampling at T=1: {rej.mean_acceptance_length:.3f}"
        log(line)
    if tcfg is not None:  # how well the drafter generalises: agreement on held-out continuations
        n = min(len(p) for p in prompts)
        rows = np.array([list(p)[:n] for p in prompts], np.int32)
        hcfg = dataclasses.replace(tcfg, num_seqs=len(rows), gen_batch=len(rows))
        hdata = build_dataset(params, cfg, hcfg, dcfg.resolve(cfg).capture_layers, tcfg.seed + 1, prompts=rows,
                              log=lambda *a: None)
        agree = agreement(params, cfg, dcfg, drafter_params, hdata, tcfg.ttt_steps, batch_size=min(32, len(rows)))
        report["held_out_agreement"] = [round(float(a), 4) for a in agree]
        log(f"top-1 agreement with the target's argmax on held-out continuations, per draft step: "
            f"{report['held_out_agreement']}")
    report["seconds"] = time.time() - t0
    return report


if __name__ == "__main__":
    sys.exit(main())
