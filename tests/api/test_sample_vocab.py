"""A server whose model has more logits than its tokenizer has ids samples only ids the tokenizer can render.

Run: python -m pytest -q tests/api/test_sample_vocab.py
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import k3jax
from serving.api.server import ServerConfig, ServerState
from serving.api.tokenizer import load_tokenizer
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams



def test_a_server_never_samples_ids_its_tokenizer_cannot_render():
    """With an output layer wider than the tokenizer, the server limits sampling to the tokenizer's ids (H200,
    2026-11-30: k3-small's random weights emitted almost only ids the byte tokenizer lacks, so streams carried
    no text until their end and the replay measured an ITL of 0). Greedy tokens equal the argmax over the
    kept ids."""
    tok = load_tokenizer(None)
    cfg = dataclasses.replace(k3jax.load_config("k3-tiny"), vocab_size=tok.vocab_size + 701)
    ecfg = EngineConfig(page_size=4, num_pages=32, num_slots=8, max_running=2, max_model_len=64, max_prefill_tokens=32)
    params = k3jax.init_params(cfg, jax.random.key(3))
    state = ServerState.create(ecfg, ServerConfig(grpc_port=None),
                               engine=Engine(ecfg, cfg=cfg, params=params))
    try:
        engine = state.engine.engine
        assert engine.sample_vocab_size == tok.vocab_size
        logits = jax.random.normal(jax.random.key(5), (3, cfg.vocab_size))
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        reqs = [type("R", (), {"sampling": greedy, "num_output": 0, "seed": 0, "request_id": str(i)})() for i in range(3)]
        got = engine._sample(logits, reqs)
        want = np.asarray(jnp.argmax(logits[:, : tok.vocab_size], axis=-1))
        assert [got[str(i)][0] for i in range(3)] == want.tolist()
        assert np.asarray(jnp.argmax(logits, axis=-1)).max() >= tok.vocab_size  # the limit changed something
    finally:
        state.engine.stop()
