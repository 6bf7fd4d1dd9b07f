"""Engine speculative decoding: mean acceptance length of the trained k3-tiny pair at k = 1..4 (CPU).

    PYTHONPATH=. python benchmarks/spec_acceptance.py

The pair is k3jax.train_drafter.tiny_markov_pair() (a k3-tiny target trained on a seeded Markov corpus and
a drafter distilled from it, ~1 min of CPU). Prints a table with, per k, how many prompts' outputs equal
plain greedy decoding. Verify scores k+1 positions in one step where decode scores one: the float results
differ in the last bits, so a position whose top-2 logits are within that noise can pick the other token
(the trained tiny target has near-uniform successor choices, where such ties occur); the gap at the first
divergence is printed.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import k3jax

from k3jax.train_drafter import tiny_markov_pair
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams


def main(ks=(1, 2, 3, 4)) -> dict[int, float]:
    pair = tiny_markov_pair()
    opts = dict(page_size=4, num_pages=120, num_slots=24, max_running=4, max_prefill_tokens=32, max_model_len=128,
                bucket_growth=64)
    prompts = [[int(t) for t in p] for p in pair.held_out]
    sp = SamplingParams(max_tokens=pair.max_tokens, ignore_eos=True)
    plain = Engine(EngineConfig(**opts), cfg=pair.cfg, params=pair.params).generate(prompts, sp)
    out = {}
    for k in ks:
        engine = Engine(EngineConfig(**opts, speculative_k=k), cfg=pair.cfg, params=pair.params,
                        drafter=(pair.dcfg, pair.drafter_params))
        outs = engine.generate(prompts, sp)
        gaps = []
        for p, o, b in zip(prompts, outs, plain):
            if o != b:
                i = _first_diff(o, b)
                gap, best = top2_gap(pair, p + o[:i])
                gaps.append(f"{gap:.1e} (forward picks {'speculative' if best == o[i] else 'plain' if best == b[i] else 'neither'})")
        out[k] = (engine.stats()["spec_mean_acceptance_length"], len(prompts) - len(gaps), gaps)
    print(f"{'k':>3} {'mean acceptance length':>24} {'== plain greedy':>16}  top-2 logit gap at divergences")
    for k, (a, same, gaps) in out.items():
        print(f"{k:>3} {a:>24.3f} {same:>9} of {len(prompts):<4}  {'; '.join(gaps) or '-'}")
    return out


def _first_diff(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def top2_gap(pair, ids: list[int]) -> tuple[float, int]:
    """The target's top-2 logit gap and argmax for the token after `ids` (cache-free forward)."""
    logits = np.asarray(k3jax.forward(pair.params, pair.cfg, jnp.asarray([ids], jnp.int32))[0, -1])
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0]), int(np.argmax(logits))


if __name__ == "__main__":
    main()
