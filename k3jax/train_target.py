"""Train a small K3-family target on a deterministic synthetic corpus, so that a drafter has something
learnable to imitate.

    python -m k3jax.train_target --model k3-tiny --steps 300 --out /tmp/k3-tiny-markov

Why: a random-init target's greedy continuation is a nearly hash-like function of its context (logit
std ~0.17 over 263 ids, top-2 gaps down to 1e-7), so no drafter generalises to it. Distilled from
random-init k3-tiny (192 generated sequences, 200 steps), the EAGLE-3 drafter matched the target's
argmax on 11.8% of its training positions but 1.3% of held-out ones (chance: 0.4%), for a held-out
mean acceptance length of 1.010 at k=3; capturing the last layers (6, 7, 8) instead of EAGLE-3's
(2, 4, 6) changed nothing (10.9% / 1.5% / 1.016), and a 100x larger run on an H200 reached 1.038.
Real targets are smooth functions of text with structure; this module gives k3-tiny such structure.

Corpus (`MarkovCorpus`): seeded second-order Markov text over `num_symbols` token ids (a seeded subset
of the vocab, specials excluded). Every symbol a has `branching` distinct successors succ[a, 0..b-1];
the rank probabilities are fixed and decreasing (`rank_probs`), and which successor gets which rank is
rotated by the previous symbol: P(next = succ[a, (r + prev) % b]) = rank_probs[r]. So the most likely
next token depends on the last two tokens (the target has to use its short convolution / attention, not
just a bigram table), and sampled text is varied while greedy text is determined.

Training: next-token cross-entropy over fresh corpus batches (a new sample every step, so the target
learns the distribution, not a fixed set of strings), optax adamw with warmup + cosine decay, through
`forward_recurrent` (k3jax's forward with KDA in its recurrent form; see there why). The result is saved
with k3jax.save_checkpoint plus `corpus.json` (the corpus parameters), which
`python -m k3jax.train_drafter --checkpoint DIR` reads to draw its prompts from the same distribution.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from k3jax import kda, mla
from k3jax.config import ModelConfig, load_config
from k3jax.model import decoder, embed, lm_head
from k3jax.params import init_params

try:
    from tqdm import tqdm
except ImportError:  # optional: plain progress lines without it
    tqdm = None

CORPUS_FILE = "corpus.json"


# ----------------------------------------------------------------------------------------------------
# corpus
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusConfig:
    """A seeded second-order Markov language (see the module docstring)."""

    num_symbols: int = 64  # distinct token ids used (a seeded subset of the ordinary, non-special ids)
    branching: int = 3  # successors per symbol
    rank_probs: tuple[float, ...] = (0.6, 0.25, 0.15)  # P(rank r), non-increasing; len == branching
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank_probs", tuple(float(p) for p in self.rank_probs))
        problems = []
        if self.num_symbols < 2:
            problems.append(f"num_symbols must be >= 2, got {self.num_symbols}")
        if not 1 <= self.branching < max(self.num_symbols, 2):
            problems.append(f"branching must be in [1, num_symbols - 1], got {self.branching}")
        p = np.asarray(self.rank_probs)
        if len(p) != self.branching or (p <= 0).any() or abs(p.sum() - 1) > 1e-6 or (np.diff(p) > 0).any():
            problems.append(f"rank_probs must be {self.branching} positive, non-increasing probabilities summing "
                            f"to 1, got {self.rank_probs}")
        if problems:
            raise ValueError("invalid CorpusConfig: " + "; ".join(problems))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "rank_probs": list(self.rank_probs)}

    @classmethod
    def from_dict(cls, values: dict) -> CorpusConfig:
        return cls(**{**values, "rank_probs": tuple(values["rank_probs"])})


class MarkovCorpus:
    """Samples of the language of `CorpusConfig` for the vocabulary of `cfg` (deterministic given the
    config and the caller's rng).

    symbols [S]: the token ids in use, ascending (scattered over the vocab, so a draft vocabulary built
    from them is a non-trivial map); succ [S, b]: successor symbol indices (never the symbol itself).
    """

    def __init__(self, ccfg: CorpusConfig, cfg: ModelConfig):
        special = {cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id}
        ordinary = np.array([i for i in range(cfg.vocab_size) if i not in special])
        if ccfg.num_symbols > len(ordinary):
            raise ValueError(f"num_symbols {ccfg.num_symbols} exceeds the {len(ordinary)} ordinary ids of {cfg.name}")
        self.ccfg = ccfg
        rng = np.random.default_rng(ccfg.seed)
        n, b = ccfg.num_symbols, ccfg.branching
        self.symbols = np.sort(rng.choice(ordinary, n, replace=False)).astype(np.int32)
        self.succ = np.stack([rng.choice(np.setdiff1d(np.arange(n), [a]), b, replace=False)
                              for a in range(n)]).astype(np.int32)
        self.rank_probs = np.asarray(ccfg.rank_probs)

    def next_distribution(self, prev: int, cur: int) -> dict[int, float]:
        """P(next id | previous id, current id) as {token id: probability} (symbols only)."""
        index = {int(t): i for i, t in enumerate(self.symbols)}
        p_idx, c_idx = index[int(prev)], index[int(cur)]
        out: dict[int, float] = {}
        for r, pr in enumerate(self.rank_probs):
            t = int(self.symbols[self.succ[c_idx, (r + p_idx) % self.ccfg.branching]])
            out[t] = out.get(t, 0.0) + float(pr)
        return out

    def sample(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
        """[n, length] int32 token ids; the first two symbols are uniform, then the Markov rule."""
        if n < 1 or length < 2:
            raise ValueError(f"sample: need n >= 1 and length >= 2, got {n}, {length}")
        b = self.ccfg.branching
        idx = np.empty((n, length), np.int32)
        idx[:, :2] = rng.integers(0, self.ccfg.num_symbols, (n, 2))
        ranks = rng.choice(b, size=(n, length), p=self.rank_probs)
        for t in range(2, length):
            prev, cur = idx[:, t - 2], idx[:, t - 1]
            idx[:, t] = self.succ[cur, (ranks[:, t] + prev) % b]
        return self.symbols[idx]


# ----------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetTrainConfig:
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 32  # the corpus is order 2: short windows teach it as well as long ones
    lr: float = 1e-2
    warmup: int = 30
    weight_decay: float = 0.01
    init_seed: int = 0  # init_params(cfg, key(init_seed))
    data_seed: int = 1  # the stream of training batches


def forward_recurrent(params: dict, cfg: ModelConfig, tokens: jax.Array,
                      capture: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array | None]:
    """k3jax.forward_with_features with KDA in its token-by-token form (kda_mixer mode="recurrent", the
    form decode / verify use; the same maths as the chunked form): (logits [B, T, V] float32, features
    [B, T, len(capture), D] or None).

    Why not k3jax.forward: on XLA:CPU the chunked reference's 64x64 triangular solves cost ~100x the
    recurrent scan at these sizes (k3-tiny, B=16, T=48: ~1 s vs ~10 ms per KDA layer, forward and
    gradient alike), which would dominate training and CI time.
    """
    b = tokens.shape[0]
    act = jnp.dtype(cfg.dtype)

    def mixer(l, p, x):
        if cfg.is_mla(l):
            return mla.naive_attention(p, x, cfg)
        conv0 = jnp.zeros((b, cfg.kda_conv_kernel - 1, cfg.conv_channels), act)
        rec0 = jnp.zeros((b, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32)
        return kda.kda_mixer(p, x, conv0, rec0, cfg, mode="recurrent")[0]

    hidden, feats = decoder(params, cfg, embed(params, tokens), mixer, "reference", capture)
    return lm_head(params, cfg, hidden), (jnp.stack(feats, axis=2) if capture else None)


def lm_loss(params: dict, cfg: ModelConfig, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean next-token cross-entropy of tokens [B, T] (positions 0..T-2 predict 1..T-1) and the argmax
    accuracy."""
    logits = forward_recurrent(params, cfg, tokens[:, :-1])[0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return nll.mean(), (jnp.argmax(logits, -1) == tokens[:, 1:]).mean()


def _optimizer(steps: int, lr: float, warmup: int, weight_decay: float) -> optax.GradientTransformation:
    warmup = min(warmup, max(steps // 10, 1))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay))


def cpu_compile_options(level: int) -> dict | None:
    """XLA options for one-off training programs: on CPU, LLVM optimisation level `level` (default 2).

    Short CPU runs (CI) are dominated by XLA:CPU compilation: for k3-tiny's gradient step level 1
    compiles ~20% faster at the same step time, and the optimizer update (element-wise over ~200
    leaves, negligible run time) compiles ~35% faster at level 0. Other backends keep their defaults.
    """
    return {"xla_backend_optimization_level": level} if jax.default_backend() == "cpu" else None


def optimizer_step(opt: optax.GradientTransformation):
    """jit of (params, opt_state, grads) -> (new params, new opt_state), compiled apart from the gradient
    (see cpu_compile_options)."""

    def update(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(update, compiler_options=cpu_compile_options(0))


def progress(total: int, desc: str):
    """A tqdm bar over range(total) when tqdm is installed, else the plain range."""
    return tqdm(range(total), desc=desc, file=sys.stdout, mininterval=1.0) if tqdm else range(total)


def train_target(cfg: ModelConfig, corpus: MarkovCorpus, tcfg: TargetTrainConfig, *, params: dict | None = None,
                 log=print) -> tuple[dict, dict]:
    """Trains `cfg` (from init_params(cfg, key(tcfg.init_seed)) unless `params` is given) on fresh corpus
    batches. Returns (params, info with the loss / accuracy history and seconds)."""
    if tcfg.steps < 1 or tcfg.batch_size < 1 or tcfg.seq_len < 3:
        raise ValueError(f"train_target: need steps >= 1, batch_size >= 1, seq_len >= 3, got {tcfg}")
    t0 = time.time()
    if params is None:
        params = init_params(cfg, jax.random.key(tcfg.init_seed))
    opt = _optimizer(tcfg.steps, tcfg.lr, tcfg.warmup, tcfg.weight_decay)
    opt_state = opt.init(params)
    grad_fn = jax.jit(jax.value_and_grad(lm_loss, has_aux=True), static_argnums=1,
                      compiler_options=cpu_compile_options(1))
    update = optimizer_step(opt)

    def step(params, opt_state, tokens):
        (loss, acc), grads = grad_fn(params, cfg, tokens)
        params, opt_state = update(params, opt_state, grads)
        return params, opt_state, loss, acc

    rng = np.random.default_rng(tcfg.data_seed)
    history = []
    bar = progress(tcfg.steps, "target")
    every = max(tcfg.steps // 10, 1)
    for i in bar:
        tokens = jnp.asarray(corpus.sample(rng, tcfg.batch_size, tcfg.seq_len))
        params, opt_state, loss, acc = step(params, opt_state, tokens)
        if (i + 1) % every == 0 or i == tcfg.steps - 1:
            rec = {"step": i + 1, "loss": round(float(loss), 4), "accuracy": round(float(acc), 4)}
            history.append(rec)
            if tqdm:
                bar.set_postfix(loss=rec["loss"], acc=rec["accuracy"])
            else:
                log(f"  target step {rec['step']}/{tcfg.steps} loss {rec['loss']:.4f} "
                    f"next-token accuracy {rec['accuracy']:.3f}")
    return params, {"seconds": time.time() - t0, "history": history}


def corpus_entropy(corpus: MarkovCorpus) -> float:
    """The corpus's next-token entropy in nats (a perfectly trained target's loss)."""
    p = corpus.rank_probs
    return float(-(p * np.log(p)).sum())


# ----------------------------------------------------------------------------------------------------
# checkpoints and CLI
# ----------------------------------------------------------------------------------------------------


def save_target(path, cfg: ModelConfig, params: dict, ccfg: CorpusConfig, *, overwrite: bool = False,
                extra: dict | None = None) -> None:
    """k3jax.save_checkpoint(path, cfg, params) plus path/corpus.json (the corpus it was trained on)."""
    from k3jax.weights import save_checkpoint

    save_checkpoint(path, cfg, params, overwrite=overwrite)
    (Path(path) / CORPUS_FILE).write_text(json.dumps({"corpus": ccfg.to_dict(), **(extra or {})}, indent=1))


def load_corpus_config(path) -> CorpusConfig | None:
    """The CorpusConfig saved beside a target checkpoint by `save_target`, or None if there is none."""
    f = Path(path) / CORPUS_FILE
    return CorpusConfig.from_dict(json.loads(f.read_text())["corpus"]) if f.exists() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3jax.train_target", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="k3-tiny", help="preset name or config path")
    ap.add_argument("--out", required=True, help="checkpoint directory (k3jax.save_checkpoint + corpus.json)")
    d, c = TargetTrainConfig(), CorpusConfig()
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--seed", type=int, default=d.init_seed, help="parameter init seed")
    ap.add_argument("--symbols", type=int, default=c.num_symbols)
    ap.add_argument("--branching", type=int, default=c.branching)
    ap.add_argument("--rank-probs", type=float, nargs="+", default=list(c.rank_probs))
    ap.add_argument("--corpus-seed", type=int, default=c.seed)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    cfg = load_config(args.model)
    try:
        ccfg = CorpusConfig(num_symbols=args.symbols, branching=args.branching, rank_probs=tuple(args.rank_probs),
                            seed=args.corpus_seed)
        tcfg = TargetTrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                                 init_seed=args.seed)
        corpus = MarkovCorpus(ccfg, cfg)
    except ValueError as e:
        ap.error(str(e))
    print(f"training {cfg.name} on a {ccfg.num_symbols}-symbol order-2 Markov corpus "
          f"(entropy floor {corpus_entropy(corpus):.3f} nats) for {tcfg.steps} steps")
    params, info = train_target(cfg, corpus, tcfg)
    held = jnp.asarray(corpus.sample(np.random.default_rng(args.corpus_seed + 12_345), 64, tcfg.seq_len))
    loss, acc = jax.jit(lm_loss, static_argnums=1)(params, cfg, held)
    print(f"held-out corpus text: loss {float(loss):.4f} nats (corpus entropy {corpus_entropy(corpus):.3f}, "
          f"uniform {np.log(ccfg.num_symbols):.3f}), next-token accuracy {float(acc):.3f} "
          f"(best possible {max(ccfg.rank_probs):.2f})")
    info["held_out"] = {"loss": float(loss), "accuracy": float(acc)}
    last = info["history"][-1]
    save_target(args.out, cfg, params, ccfg, overwrite=args.overwrite,
                extra={"train": dataclasses.asdict(tcfg), "final": last, "held_out": info["held_out"],
                       "seconds": info["seconds"]})
    print(f"saved {args.out}: loss {last['loss']:.4f} accuracy {last['accuracy']:.3f} in {info['seconds']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
