"""Block Attention Residuals (k3-model.md §6).

The residual stream is replaced by a softmax over depth: each mix point attends over the bank of
completed block sums (the embedding first) plus the current block's partial sum P, with a learned,
input-independent pseudo-query. Sources are RMS-normalised only inside the scores; the mixture uses the
raw sources, in fp32, cast back.

Op "attn_res_mix_norm" (the mix followed by the layer's pre-norm) has this unfused code as its
"reference" and pallas_kernels/fused_norm.py (one pass over the sources) as "pallas" / "interpret".
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from k3jax import backend
from k3jax.layers import rms_norm
from pallas_kernels import fused_norm


def attn_res_mix(sources: list[jax.Array], proj: jax.Array, norm: jax.Array, eps: float) -> jax.Array:
    """softmax_i(<rmsnorm(v_i), norm * proj>)-weighted sum of sources (each [..., D])."""
    v = jnp.stack(sources, axis=-2).astype(jnp.float32)  # [..., S, D]
    keys = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    query = norm.astype(jnp.float32) * proj.astype(jnp.float32)  # RMSNorm gain folded into the query
    probs = jax.nn.softmax(jnp.einsum("...sd,d->...s", keys, query), axis=-1)
    return jnp.einsum("...s,...sd->...d", probs, v).astype(sources[-1].dtype)


@backend.register("attn_res_mix_norm", "reference")
def attn_res_mix_norm_unfused(sources: list[jax.Array], proj: jax.Array, norm: jax.Array, out_weight: jax.Array,
                              eps: float, with_mix: bool = False, addend: jax.Array | None = None) -> tuple:
    """(mix, rms_norm(mix, out_weight, eps)): `attn_res_mix`, then the Kimi RMSNorm, as separate ops. With an
    addend the last source is sources[-1] + addend, returned as a third entry."""
    if addend is not None:
        summed = sources[-1] + addend
        return *attn_res_mix_norm_unfused([*sources[:-1], summed], proj, norm, out_weight, eps), summed
    mix = attn_res_mix(sources, proj, norm, eps)
    return mix, rms_norm(mix, out_weight, eps)


def _attn_res_mix_norm_pallas(sources, proj, norm, out_weight, eps, with_mix=False, addend=None, *, interpret: bool):
    return fused_norm.attn_res_mix_norm(sources, proj, norm, out_weight, eps, with_mix=with_mix, addend=addend,
                                        interpret=interpret)


backend.register("attn_res_mix_norm", "pallas")(partial(_attn_res_mix_norm_pallas, interpret=False))
backend.register("attn_res_mix_norm", "interpret")(partial(_attn_res_mix_norm_pallas, interpret=True))


def attn_res_mix_norm(sources: list[jax.Array], proj: jax.Array, norm: jax.Array, out_weight: jax.Array, eps: float,
                      *, with_mix: bool = False, addend: jax.Array | None = None,
                      backend_name: str = "reference") -> tuple[jax.Array | None, ...]:
    """(mix, pre-norm of the mix) at one AttnRes point; the mix may be None unless with_mix=True. addend: the
    partial sum's pending residual add, sources[-1] + addend, done by the op (in the kernel on "pallas") and
    returned as a third entry."""
    return backend.get("attn_res_mix_norm", backend_name)(sources, proj, norm, out_weight, eps, with_mix, addend)
