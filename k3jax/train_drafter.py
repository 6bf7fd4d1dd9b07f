"""Distil an EAGLE-3 drafter from the target's own generations (k3-model.md §7).

    python -m k3jax.train_drafter --model k3-tiny --steps 500 --out /tmp/drafter

1. Data: random prompts continued by the target (greedy rows and temperature-sampled rows), generated
   with k3jax.prefill + k3jax.decode at fixed shapes (no recompiles).
2. Targets: k3jax.model.forward_with_features over each whole sequence gives the captured features and
   the target's logits at every position (one fixed [batch, length] shape).
3. Draft vocab: the most frequent generated ids (build_vocab_map).
4. Training-time test: the drafter is unrolled `ttt_steps` steps on its own hidden outputs
   (drafter.unrolled_logits); the loss is the cross-entropy against the target's softmax restricted to
   the draft vocab, at positions whose target argmax is in the draft vocab, step j weighted 0.8^j.
   optax adamw with warmup + cosine decay.
5. Evaluation: mean acceptance length of greedy speculative decoding (k3jax.speculative) on held-out
   prompts.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from k3jax.config import ModelConfig, load_config
from k3jax.drafter import DrafterConfig, build_vocab_map, init_drafter, save_drafter, target_ids, unrolled_logits
from k3jax.model import decode, forward_with_features, init_state, prefill
from k3jax.params import init_params
from k3jax.testing import step_meta

try:
    from tqdm import tqdm
except ImportError:  # optional
    tqdm = None


@dataclass(frozen=True)
class TrainConfig:
    num_seqs: int = 384  # training sequences (half greedy, half sampled)
    prompt_len: int = 16
    gen_len: int = 48
    gen_batch: int = 64
    sample_temperature: float = 1.0  # for the sampled half
    draft_vocab_size: int | None = None  # None: the whole target vocab, capped at 32768
    intermediate_size: int | None = None  # drafter MLP width (None: the target's)
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


def generate(params: dict, cfg: ModelConfig, prompts: np.ndarray, gen_len: int, temperatures: np.ndarray,
             key: jax.Array, page_size: int = 16) -> np.ndarray:
    """Continues prompts [B, P] by gen_len tokens with the target (row b at temperatures[b]; 0 = greedy),
    via k3jax.prefill + k3jax.decode. Returns [B, P + gen_len]."""
    b, p = prompts.shape
    pages = math.ceil((p + gen_len) / page_size)
    state = init_state(cfg, num_slots=b, num_pages=b * pages, page_size=page_size)
    table = np.arange(b * pages).reshape(b, pages)
    slots = np.arange(b)
    temps = jnp.asarray(temperatures, jnp.float32)
    logits, state = prefill(params, cfg, state, jnp.asarray(prompts), step_meta(slots, table, [0] * b, [p] * b))
    out = [prompts]
    for i in range(gen_len):
        tok = _pick(logits, temps, jax.random.fold_in(key, i))
        out.append(np.asarray(tok)[:, None])
        if i + 1 < gen_len:
            logits, state = decode(params, cfg, state, tok, step_meta(slots, table, [p + i] * b, [1] * b))
    return np.concatenate(out, axis=1)


def build_dataset(params: dict, cfg: ModelConfig, tcfg: TrainConfig, capture: tuple[int, ...], seed: int,
                  log=print) -> dict:
    """Generated sequences with the target's features and logits: tokens [N, T], features
    [N, T, n_capture, D], logits [N, T, V] (float32, on the host)."""
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    n = math.ceil(tcfg.num_seqs / tcfg.gen_batch) * tcfg.gen_batch
    toks, feats, logits = [], [], []
    for i in range(n // tcfg.gen_batch):
        prompts = random_prompts(rng, cfg, tcfg.gen_batch, tcfg.prompt_len)
        temps = np.where(np.arange(tcfg.gen_batch) % 2 == 0, 0.0, tcfg.sample_temperature)
        seqs = generate(params, cfg, prompts, tcfg.gen_len, temps, jax.random.fold_in(key, i))
        lo, fe = forward_with_features(params, cfg, jnp.asarray(seqs), capture)
        toks.append(seqs)
        feats.append(np.asarray(fe))
        logits.append(np.asarray(lo))
        log(f"  data batch {i + 1}/{n // tcfg.gen_batch}")
    return {"tokens": np.concatenate(toks)[: tcfg.num_seqs], "features": np.concatenate(feats)[: tcfg.num_seqs],
            "logits": np.concatenate(logits)[: tcfg.num_seqs], "prompt_len": tcfg.prompt_len}


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
    """adamw on ttt_loss over random batches of `data`. Returns (drafter params, history)."""
    d2t = drafter_params["d2t"]
    trainable = {k: v for k, v in drafter_params.items() if k != "d2t"}
    opt = make_optimizer(tcfg)
    opt_state = opt.init(trainable)
    embed = params["embed"]

    @jax.jit
    def step(trainable, opt_state, feats, toks, tlogits):
        (loss, agree), grads = jax.value_and_grad(ttt_loss, has_aux=True)(
            trainable, d2t, cfg, dcfg, embed, feats, toks, tlogits, tcfg.ttt_steps, tcfg.step_decay,
            tcfg.target_temperature)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss, agree

    rng = np.random.default_rng(tcfg.seed + 1)
    n = data["tokens"].shape[0]
    history = []
    bar = tqdm(range(tcfg.steps), desc="drafter", file=sys.stdout) if tqdm else range(tcfg.steps)
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
    return {**trainable, "d2t": d2t}, history


def evaluate_acceptance(params: dict, cfg: ModelConfig, drafter_params: dict, dcfg: DrafterConfig,
                        prompts, max_tokens: int = 32, k: int = 3) -> float:
    """Mean acceptance length (accepted + 1 per round) of greedy speculative decoding on `prompts`."""
    from k3jax.speculative import speculative_generate

    return speculative_generate(params, cfg, drafter_params, dcfg, prompts, max_tokens, k).mean_acceptance_length


def distil(params: dict, cfg: ModelConfig, tcfg: TrainConfig, log=print) -> tuple[DrafterConfig, dict, dict]:
    """The whole recipe: data, vocab, init, training. Returns (dcfg, drafter params, info)."""
    t0 = time.time()
    vd = tcfg.draft_vocab_size or min(cfg.vocab_size, 32768)
    dcfg = DrafterConfig(draft_vocab_size=vd, intermediate_size=tcfg.intermediate_size)
    capture = dcfg.resolve(cfg).capture_layers
    log(f"generating {tcfg.num_seqs} sequences of {tcfg.prompt_len}+{tcfg.gen_len} tokens")
    data = build_dataset(params, cfg, tcfg, capture, tcfg.seed, log=log)
    t_data = time.time() - t0
    d2t, t2d = build_vocab_map(token_counts(data, cfg.vocab_size), vd)
    counts = token_counts(data, cfg.vocab_size)
    coverage = float(counts[t2d].sum() / max(counts.sum(), 1))
    dp = init_drafter(cfg, dcfg, jax.random.key(tcfg.seed), d2t=d2t, target_params=params)
    log(f"data {t_data:.1f}s; draft vocab {vd} covers {coverage:.3f} of generated tokens; training {tcfg.steps} steps")
    t1 = time.time()
    dp, history = train(params, cfg, dcfg, data, tcfg, dp, log=log)
    info = {"data_seconds": t_data, "train_seconds": time.time() - t1, "vocab_coverage": coverage,
            "history": history}
    return dcfg, dp, info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3jax.train_drafter", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="k3-tiny", help="preset name or config path of the target")
    ap.add_argument("--target-seed", type=int, default=0, help="random-init target: init_params(cfg, key(seed))")
    ap.add_argument("--checkpoint", default=None, help="load the target from a k3jax orbax checkpoint instead")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--out", required=True, help="output directory (orbax params + drafter.json)")
    ap.add_argument("--num-seqs", type=int, default=TrainConfig.num_seqs)
    ap.add_argument("--prompt-len", type=int, default=TrainConfig.prompt_len)
    ap.add_argument("--gen-len", type=int, default=TrainConfig.gen_len)
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--gen-batch", type=int, default=TrainConfig.gen_batch, help="rows per generation batch")
    ap.add_argument("--intermediate-size", type=int, default=None)
    ap.add_argument("--target-temperature", type=float, default=TrainConfig.target_temperature,
                    help="distil against softmax(target logits / this); < 1 sharpens towards the argmax")
    ap.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--ttt-steps", type=int, default=TrainConfig.ttt_steps)
    ap.add_argument("--seed", type=int, default=TrainConfig.seed)
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for the acceptance eval (0: skip)")
    ap.add_argument("--eval-k", type=int, default=3)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")

    if args.checkpoint:
        from k3jax.weights import load_checkpoint

        cfg, params = load_checkpoint(args.checkpoint)
    else:
        cfg = load_config(args.model)
        params = init_params(cfg, jax.random.key(args.target_seed))
    tcfg = TrainConfig(num_seqs=args.num_seqs, prompt_len=args.prompt_len, gen_len=args.gen_len, gen_batch=args.gen_batch,
                       target_temperature=args.target_temperature,
                       draft_vocab_size=args.draft_vocab, intermediate_size=args.intermediate_size,
                       steps=args.steps, batch_size=args.batch_size, lr=args.lr, ttt_steps=args.ttt_steps,
                       seed=args.seed)
    dcfg, dp, info = distil(params, cfg, tcfg)
    extra = {"train": {k: v for k, v in info.items() if k != "history"}}
    if args.eval_prompts:
        held_out = random_prompts(np.random.default_rng(args.seed + 10_000), cfg, args.eval_prompts, args.prompt_len)
        acc = evaluate_acceptance(params, cfg, dp, dcfg, held_out, max_tokens=args.gen_len, k=args.eval_k)
        extra["eval"] = {"k": args.eval_k, "prompts": args.eval_prompts, "mean_acceptance_length": acc}
        print(f"held-out mean acceptance length (k={args.eval_k}, greedy): {acc:.3f}")
    save_drafter(args.out, cfg, dcfg, dp, overwrite=args.overwrite, extra=extra)
    print(f"saved drafter to {args.out} (train {info['train_seconds']:.1f}s, data {info['data_seconds']:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
