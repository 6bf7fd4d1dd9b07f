"""k3jax: Kimi K3 (and Kimi-Linear) in JAX -- pure functions over parameter pytrees.

Public API:
    load_config(name_or_path) -> ModelConfig
    init_params(cfg, key) -> params
    forward(params, cfg, tokens) -> logits
    init_state / prefill / decode / verify / commit_verified   (explicit-state serving steps)
    save_checkpoint / load_checkpoint (orbax), load_pretrained / save_pretrained (HF safetensors)
    serve(model=..., **engine_options) -> serving.engine.Engine   (imports serving lazily)
"""

from k3jax.config import ModelConfig, available_models, load_config
from k3jax.model import (
    DecodeState,
    StepMeta,
    VerifiedStates,
    commit_verified,
    decode,
    forward,
    init_state,
    prefill,
    verify,
)
from k3jax.params import count_params, init_params, param_shapes

__all__ = [
    "ModelConfig", "available_models", "load_config",
    "DecodeState", "StepMeta", "VerifiedStates", "commit_verified", "decode", "forward", "init_state",
    "prefill", "verify",
    "count_params", "init_params", "param_shapes",
]


def __getattr__(name):  # weights pull in orbax/safetensors: import them only when asked for
    if name in ("save_checkpoint", "load_checkpoint", "load_pretrained", "save_pretrained"):
        from k3jax import weights

        return getattr(weights, name)
    if name == "serve":  # the one entry point into serving/; no k3jax module imports serving itself
        from serving.engine import serve

        return serve
    raise AttributeError(f"module 'k3jax' has no attribute {name!r}")
