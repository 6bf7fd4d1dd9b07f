"""Router expert selection: scores, biased top-k, gathered and renormalised weights in one launch.

    s = sigmoid(logits)  (or softmax over experts)
    ids = top_k(s + bias)            (the correction bias steers selection only, k3-model.md pitfall 7)
    w = s[ids] / sum_j s[ids_j] * scaling   (renormalisation optional)

Why a kernel: XLA lowers `jax.lax.top_k` over a [64, 192] router output to a full sort plus a slice, and the
gather, sum and divide around it to two more fusions: ~11 us of device time and five launches per MoE layer in
the k3-small decode step (H200 profile, 2026-12-02), against one small launch here. The logits GEMM stays in XLA
(its weight read wants the whole GPU; this kernel's work is a few KB per row).

Program r owns block_rows router rows; the expert axis is padded to a power of two in registers (masked loads,
-inf selection scores past the last expert). Selection is k rounds of row max + first index reaching it (ties go
to the lower expert id, as `jax.lax.top_k`), each round masking its winner. Ungrouped routing only: the model
keeps the reference for grouped (num_expert_group > 1) configs.

Pallas backend: Triton lowering (interpret mode on CPU for CI): a row-block reduction kernel, no MMA.
Measured on the H200 (2026-12-02, docs/benchmarks.md "Decode step: router selection kernel"): in the k3-small decode
step (benchmarks/model_forward.py --profile) 4.9 us per layer at the default 8 rows x 4 warps (11.9 us at 16 rows per
program: too few programs), where XLA's sort, slice, gather and divide took ~11 us in four launches; the step's kernels
sum to 8.25 ms instead of 8.45 (746 kernels instead of 817), back to back 8.28 ms instead of 8.43; --shadow-check
against the reference selection: ids equal, weights within 1e-7. Chained 24 per jit at [64, 192] top-8 (launch gaps
included): 8.7-12.5 us per call at 1-8 rows per program, 18-41 us at 16, the XLA reference 22.5 us.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SCORES = ("sigmoid", "softmax")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _scores(logits: jax.Array, valid: jax.Array, score: str) -> jax.Array:
    if score == "sigmoid":
        return jax.nn.sigmoid(logits)
    z = jnp.where(valid, logits, -jnp.inf)
    p = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
    return p / jnp.sum(p, axis=-1, keepdims=True)


def _router_topk_kernel(logits_ref, bias_ref, ids_ref, weights_ref, *, num_rows: int, num_experts: int, top_k: int,
                        block_rows: int, score: str, renormalize: bool, scaling: float):
    # logits_ref:  [N, E] fp32 router logits (whole; this program reads rows r0 .. r0 + block_rows)
    # bias_ref:    [E] fp32 selection bias
    # ids_ref:     [N, top_k] int32 out: selected experts, best first
    # weights_ref: [N, top_k] fp32 out: their routing weights
    e_pad, k_pad = _next_pow2(num_experts), _next_pow2(top_k)
    r0 = pl.program_id(0) * block_rows
    row_ok = r0 + jnp.arange(block_rows) < num_rows  # [block_rows]
    experts = jnp.arange(e_pad)  # [e_pad]
    valid = experts < num_experts
    logits = plgpu.load(logits_ref.at[pl.ds(r0, block_rows), pl.ds(0, e_pad)],
                        mask=row_ok[:, None] & valid[None, :], other=0.0)  # [block_rows, e_pad]
    bias = plgpu.load(bias_ref.at[pl.ds(0, e_pad)], mask=valid, other=0.0)  # [e_pad]
    scores = jnp.where(valid[None, :], _scores(logits, valid[None, :], score), 0.0)
    choice = jnp.where(valid[None, :], scores + bias[None, :], -jnp.inf)
    slots = jnp.arange(k_pad)  # [k_pad]
    ids = jnp.zeros((block_rows, k_pad), jnp.int32)
    weights = jnp.zeros((block_rows, k_pad), jnp.float32)
    for j in range(top_k):
        best = jnp.max(choice, axis=1)  # [block_rows]
        first = jnp.min(jnp.where(choice == best[:, None], experts[None, :], e_pad), axis=1)
        first = jnp.minimum(first, num_experts - 1)  # a NaN row matches nothing: keep the id in range
        won = experts[None, :] == first[:, None]  # [block_rows, e_pad]
        picked = jnp.sum(jnp.where(won, scores, 0.0), axis=1)
        ids = jnp.where(slots[None, :] == j, first[:, None], ids)
        weights = jnp.where(slots[None, :] == j, picked[:, None], weights)
        choice = jnp.where(won, -jnp.inf, choice)
    if renormalize and top_k > 1:
        weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20)  # slots >= top_k hold 0
    keep = row_ok[:, None] & (slots[None, :] < top_k)
    plgpu.store(ids_ref.at[pl.ds(r0, block_rows), pl.ds(0, k_pad)], ids, mask=keep)
    plgpu.store(weights_ref.at[pl.ds(r0, block_rows), pl.ds(0, k_pad)], weights * scaling, mask=keep)


def _check(logits, bias, top_k, score):
    if logits.ndim != 2 or bias.ndim != 1 or bias.shape[0] != logits.shape[1]:
        raise ValueError(f"logits must be [N, E] and bias [E], got {list(logits.shape)} and {list(bias.shape)}")
    if not (jnp.issubdtype(logits.dtype, jnp.floating) and jnp.issubdtype(bias.dtype, jnp.floating)):
        raise ValueError(f"logits and bias must be float, got {logits.dtype} and {bias.dtype}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[1]}] (the expert count), got {top_k}")
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")


@functools.partial(jax.jit, static_argnames=("top_k", "score", "renormalize", "scaling", "block_rows", "num_warps",
                                             "interpret"))
def router_topk(logits: jax.Array, bias: jax.Array, *, top_k: int, score: str = "sigmoid", renormalize: bool = True,
                scaling: float = 1.0, block_rows: int = 8, num_warps: int = 4,
                interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(ids [N, top_k] int32, weights [N, top_k] fp32) for router logits [N, E] and selection bias [E].

    Scores are `score` (sigmoid or softmax over E) of the fp32 logits; experts are chosen by score + bias, best
    first (ties to the lower id); weights are the chosen experts' unbiased scores, divided by their sum when
    `renormalize` (and top_k > 1), times `scaling`. Raises ValueError for mismatched shapes, non-float inputs, a
    top_k outside [1, E] or an unknown score. block_rows (a power of two) rows per program.
    """
    _check(logits, bias, top_k, score)
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    n, e = logits.shape
    kernel = functools.partial(_router_topk_kernel, num_rows=n, num_experts=e, top_k=top_k, block_rows=block_rows,
                               score=score, renormalize=renormalize, scaling=scaling)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n, top_k), jnp.int32), jax.ShapeDtypeStruct((n, top_k), jnp.float32)),
        grid=(pl.cdiv(n, block_rows),),
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="router_topk",
    )(logits.astype(jnp.float32), bias.astype(jnp.float32))


def router_topk_reference(logits: jax.Array, bias: jax.Array, *, top_k: int, score: str = "sigmoid",
                          renormalize: bool = True, scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """The same selection in plain jnp (`jax.lax.top_k` and a gather): k3jax.moe's ungrouped routing."""
    _check(logits, bias, top_k, score)
    logits = logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if score == "sigmoid" else jax.nn.softmax(logits, -1)
    _, ids = jax.lax.top_k(scores + bias.astype(jnp.float32)[None, :], top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize and top_k > 1:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * scaling


__all__ = ["SCORES", "router_topk", "router_topk_reference"]
