"""MXFP4 weight-only quantisation (K3's routed experts, compressed-tensors `mxfp4-pack-quantized`).

A weight [out, in] is stored as
  packed [out, in/2] uint8: two E2M1 codes per byte, element 2j in the low nibble, 2j+1 in the high one;
  scale  [out, in/32] uint8: one E8M0 exponent per 32 consecutive inputs,
and w[o, i] = e2m1(code[o, i]) * 2^(scale[o, i // 32] - 127).
E2M1 codes: bit 3 is the sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}.

Stacked expert weights come in four layouts (pallas_kernels.moe_gemm.mxfp4_layout), all exact re-packings of
the same bytes: the checkpoint's {"packed": [E, out, in/2], "scale": [E, out, in/32]} and the MoE kernel's three
(`moe_gemm.prepare_mxfp4`): the word layouts "k4r" {"planes_k4r": [E, in/8, 4 * out], "scale_words": uint32 [E,
ceil(in/128), out]} (E8M0 scales <= 2^1; four groups' scales per word) and "k4" {"planes_k4", "scale_words"},
made at load time by `k3jax.weights.load_pretrained(experts="kernel")` (k4r where the scales allow) because the
"pallas" MoE op decodes them fastest (H200, K3 EP16 shard, decode sizes: 1.57x / 1.36-1.38x faster than bf16
weights; docs/benchmarks.md), and the older "kn" {"planes_kn": [E, in/2, out], "scales_gn": [E, in/32, out]}, still
accepted everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe_gemm import MXFP4_LAYOUT_KEYS, mxfp4_checkpoint_layout

GROUP_SIZE = 32
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# E8M0 scale s -> 2^(s - 127), exact (jnp.exp2 is approximate on XLA:CPU: 222 of the 256 powers are off by ulps);
# 0xFF is NaN (OCP MX)
E8M0_VALUES = np.append(np.ldexp(1.0, np.arange(255) - 127), np.nan).astype(np.float32)


def is_packed(w) -> bool:
    """Whether w is an MXFP4 expert weight (a dict in any layout: checkpoint, kn, k4, k4r) rather than an array or
    another subtree."""
    return isinstance(w, dict) and any(set(w) == set(keys) for keys in MXFP4_LAYOUT_KEYS.values())


def mxfp4_dequantize(packed: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """packed [..., out, in/2] uint8, scale [..., out, in/32] uint8 -> weight [..., out, in] in dtype."""
    if packed.dtype != jnp.uint8 or scale.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got {packed.dtype} / {scale.dtype}")
    n_in = packed.shape[-1] * 2
    if scale.shape[-1] * GROUP_SIZE != n_in or scale.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"MXFP4 scale shape {scale.shape} does not match packed shape {packed.shape}")
    codes = jnp.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], n_in)
    values = jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]
    factors = jnp.repeat(jnp.asarray(E8M0_VALUES)[scale.astype(jnp.int32)], GROUP_SIZE, axis=-1)
    return (values * factors).astype(dtype)


def mxfp4_quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest MXFP4 of weight [..., out, in] (numpy): returns (packed, scale) uint8 arrays.

    The group scale is the power of two that maps the group's max |w| to at most 6 (E2M1's largest value).
    """
    w = np.asarray(weight, np.float32)
    if w.shape[-1] % GROUP_SIZE:
        raise ValueError(f"input dim {w.shape[-1]} is not a multiple of {GROUP_SIZE}")
    groups = w.reshape(*w.shape[:-1], -1, GROUP_SIZE)
    amax = np.abs(groups).max(-1, keepdims=True)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127.0)
    exp = np.clip(exp, -127, 127)
    scaled = groups / np.exp2(exp)
    magnitudes = E2M1_VALUES[:8]
    idx = np.abs(np.abs(scaled)[..., None] - magnitudes).argmin(-1)
    codes = (idx | np.where(scaled < 0, 8, 0)).astype(np.uint8).reshape(w.shape)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, (exp[..., 0] + 127).astype(np.uint8)


def dequantize_experts(experts: dict, dtype) -> dict:
    """Expert weights as {"gate", "up": [E, in, out], "down": [E, in, out]}, dequantising MXFP4 entries.

    Packed entries in any layout; the kernel layouts (kn, k4, k4r) are first re-packed into the checkpoint's
    (exact), so all give bit-identical weights.
    """
    out = {}
    for name, w in experts.items():
        if is_packed(w):
            hf = mxfp4_checkpoint_layout(w)
            out[name] = jnp.swapaxes(mxfp4_dequantize(hf["packed"], hf["scale"], dtype), -1, -2)
        else:
            out[name] = w
    return out
