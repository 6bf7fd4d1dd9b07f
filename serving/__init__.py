"""Serving: requests, scheduling, cache memory and tiers, the runner and the engine loop.

    from serving import serve, SamplingParams
    engine = serve(model="k3-tiny")
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
"""

from serving.config import EngineConfig
from serving.engine import Engine, serve
from serving.request import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "serve"]
