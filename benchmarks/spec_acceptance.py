"""Engine speculative decoding: mean acceptance length of the trained k3-tiny pair at k = 1..4 (CPU).

    PYTHONPATH=. python benchmarks/spec_acceptance.py

The pair is k3jax.train_drafter.tiny_markov_pair() (a k3-tiny target trained on a seeded Markov corpus and
a drafter distilled from it, ~1 min of CPU). Prints a table; outputs are checked equal to plain greedy.
"""

from __future__ import annotations

import sys

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
        if engine.generate(prompts, sp) != plain:
            sys.exit(f"k={k}: speculative outputs differ from plain greedy")
        out[k] = engine.stats()["spec_mean_acceptance_length"]
    print(f"{'k':>3} {'mean acceptance length':>24}")
    for k, a in out.items():
        print(f"{k:>3} {a:>24.3f}")
    return out


if __name__ == "__main__":
    main()
