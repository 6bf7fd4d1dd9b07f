"""Block Attention Residuals (k3-model.md §6).

The residual stream is replaced by a softmax over depth: each mix point attends over the bank of
completed block sums (the embedding first) plus the current block's partial sum P, with a learned,
input-independent pseudo-query. Sources are RMS-normalised only inside the scores; the mixture uses the
raw sources, in fp32, cast back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attn_res_mix(sources: list[jax.Array], proj: jax.Array, norm: jax.Array, eps: float) -> jax.Array:
    """softmax_i(<rmsnorm(v_i), norm * proj>)-weighted sum of sources (each [..., D])."""
    v = jnp.stack(sources, axis=-2).astype(jnp.float32)  # [..., S, D]
    keys = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    query = norm.astype(jnp.float32) * proj.astype(jnp.float32)  # RMSNorm gain folded into the query
    probs = jax.nn.softmax(jnp.einsum("...sd,d->...s", keys, query), axis=-1)
    return jnp.einsum("...s,...sd->...d", probs, v).astype(sources[-1].dtype)
