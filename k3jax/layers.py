"""Primitives shared by every K3 layer (k3-model.md §2). Pure functions over arrays.

Dtype policy, following the public K3 code: activations stay in the parameter dtype between layers;
norms, gates, the router and the recurrent state compute in float32 and cast back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from k3jax import backend
from k3jax.config import ModelConfig
from pallas_kernels import fused_norm


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Kimi RMSNorm: normalise in fp32, cast back to the input dtype, *then* multiply by the weight."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


@backend.register("gated_rms_norm", "reference")
def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """fla FusedRMSNormGated(activation="sigmoid"): rmsnorm(x) * w * sigmoid(gate), all in fp32.

    Op "gated_rms_norm": this is its reference; pallas_kernels/fused_norm.py is "pallas" / "interpret"."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    out = normed * weight.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
    return out.astype(x.dtype)


def _gated_rms_norm_pallas(x, gate, weight, eps, *, interpret: bool):
    return fused_norm.gated_rms_norm(x, gate, weight, eps, interpret=interpret)


backend.register("gated_rms_norm", "pallas")(partial(_gated_rms_norm_pallas, interpret=False))
backend.register("gated_rms_norm", "interpret")(partial(_gated_rms_norm_pallas, interpret=True))


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(|x|^2 + eps) in fp32 (eps inside the sqrt, as fla's in-kernel l2norm)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def glu_activation(gate: jax.Array, up: jax.Array, cfg: ModelConfig) -> jax.Array:
    """SiTU-GLU (K3) or SwiGLU (Kimi-Linear) of the gate and up projections, in the input dtype.

    SiTU: [beta*tanh(gate/beta)*sigmoid(gate)] * [lb*tanh(up/lb)], computed in fp32 (K3 SituAndMul).
    """
    if cfg.hidden_act == "silu":
        return jax.nn.silu(gate) * up
    g32, u32 = gate.astype(jnp.float32), up.astype(jnp.float32)
    act = cfg.situ_beta * jnp.tanh(g32 / cfg.situ_beta) * jax.nn.sigmoid(g32)
    if cfg.situ_linear_beta is not None:
        u32 = cfg.situ_linear_beta * jnp.tanh(u32 / cfg.situ_linear_beta)
    return (act * u32).astype(gate.dtype)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w with w stored [in, out]; fp32 accumulation, result in x's dtype."""
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


# The attention blocks' GEMMs on the hidden-state boundary go through a `linear` hook:
# linear(x [..., I], {name: w [I, O_name]}) -> {name: x @ w [..., O_name]}, all weights reading the same x.
# The default is `dense` each; k3jax.parallel.tp_subgroup passes GEMMs over weights split 1/T per rank.
Linear = Callable[[jax.Array, dict[str, jax.Array]], dict[str, jax.Array]]


def dense_each_with(matmul: Callable[[jax.Array, jax.Array], jax.Array]) -> Linear:
    """A `Linear` that runs x @ w for each named weight through `matmul` (a backend's "dense" op)."""
    return lambda x, weights: {name: matmul(x, w) for name, w in weights.items()}


# The default `Linear`: x @ w for each named weight (`dense`: fp32 accumulation, x's dtype).
dense_each: Linear = dense_each_with(dense)


# Decode-size dense GEMMs under the "pallas" / "interpret" backends (the "dense" op): "xla" (the default: the op is
# not registered for them, so they use the reference `dense`) or "skinny" (pallas_kernels/skinny_gemm.py, a
# weight-streaming GEMM with its own decode tiling, for at most its MAX_ROWS rows and input widths that are multiples
# of 64; other calls stay on `dense`), selected by `use_dense_kernel` before a step is traced. H200, k3-small decode
# B64 x 8k (benchmarks/model_forward.py --dense-kernel, 2026-12-02, docs/benchmarks.md): the skinny kernels' 0.98
# ms/step did not beat the XLA GEMMs they replace (1.05 ms) and the step was unchanged (8.44 vs 8.43 ms back to back),
# so the default stays "xla".
DENSE_KERNELS = ("xla", "skinny")
DENSE_DECODE_KERNEL = "xla"  # what `use_dense_kernel` last selected (read-only; call the function to change it)

backend.register("dense", "reference")(dense)


def _skinny_dense(interpret: bool):
    def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
        from pallas_kernels import skinny_gemm  # imported on use, as the other kernels

        if x.shape[-1] % 64 or not 1 <= math.prod(x.shape[:-1]) <= skinny_gemm.MAX_ROWS:
            return dense(x, w)
        return skinny_gemm.skinny_matmul(x, w, interpret=interpret)

    return matmul


_SKINNY_DENSE = {"pallas": _skinny_dense(interpret=False), "interpret": _skinny_dense(interpret=True)}


def use_dense_kernel(kind: str) -> None:
    """Selects the kernel backends' "dense" op: "skinny" registers the skinny GEMM for "pallas" and "interpret",
    "xla" unregisters it (they fall back to the reference `dense`), so `backend.implemented("dense")` says what
    runs. Takes effect for steps traced afterwards (clear jax's caches to retrace a jitted step)."""
    global DENSE_DECODE_KERNEL
    if kind not in DENSE_KERNELS:
        raise ValueError(f"dense kernel must be one of {DENSE_KERNELS}, got {kind!r}")
    for name, fn in _SKINNY_DENSE.items():
        backend.unregister("dense", name)
        if kind == "skinny":
            backend.register("dense", name)(fn)
    DENSE_DECODE_KERNEL = kind


def mlp(params: dict, x: jax.Array, cfg: ModelConfig, *, matmul=dense) -> jax.Array:
    """Gated MLP (dense layer-0 MLP and the shared experts): down(act(gate x, up x)); `matmul`: a backend's
    "dense" op (default `dense`)."""
    return matmul(glu_activation(matmul(x, params["gate"]), matmul(x, params["up"]), cfg), params["down"])


def causal_conv_with_state(
    x: jax.Array, conv_state: jax.Array, weight: jax.Array, lengths: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal short conv + SiLU, continuing from a state of the previous W-1 inputs.

    Args:
      x: [B, T, C] new inputs (pre-conv projections).
      conv_state: [B, W-1, C] the W-1 inputs before x (zeros for a fresh sequence).
      weight: [W, C]; tap W-1 multiplies the current token.
      lengths: [B] number of valid tokens of x per row (the rest is padding); None = all T.

    Returns:
      y: [B, T, C] SiLU(conv) in x's dtype (computed in fp32).
      new_state: [B, W-1, C] the last W-1 *valid* inputs, for the next call.
    """
    b, t, c = x.shape
    w = weight.shape[0]
    full = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    full32 = full.astype(jnp.float32)
    w32 = weight.astype(jnp.float32)
    acc = jnp.zeros((b, t, c), jnp.float32)
    for i in range(w):
        acc = acc + full32[:, i : i + t, :] * w32[i]
    y = jax.nn.silu(acc).astype(x.dtype)
    if lengths is None:
        new_state = full[:, t:, :]
    else:
        idx = lengths[:, None] + jnp.arange(w - 1)[None, :]  # [B, W-1] positions in `full`
        new_state = jnp.take_along_axis(full, idx[:, :, None], axis=1)
    return y, new_state.astype(conv_state.dtype)
