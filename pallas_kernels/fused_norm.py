"""Fused norms: Block-AttnRes depth mix + the following RMSNorm in one pass, and gated RMSNorm with an
optional fp8 output.

attn_res_mix_norm (k3-model.md §6, then the layer's pre-norm):
    logit_s = <v_s, norm * proj> / sqrt(mean(v_s^2) + eps)     per source s, fp32
    mix     = cast(sum_s softmax(logit)_s v_s)                  raw sources, fp32 sum, cast to the dtype
    out     = out_weight * cast(mix * rsqrt(mean(mix^2) + eps))  Kimi RMSNorm of the cast mix
  Each program owns `rows` rows and holds their fp32 mix in registers while it streams the sources once,
  with an online softmax (running max and denominator, the accumulator rescaled when the max moves), so
  HBM traffic is the memory floor: S source rows read, the normed row (and the mix, when asked) written.
  The unfused XLA form stacks the sources and reads them again for the mix and the norm.

gated_rms_norm (fla FusedRMSNormGated, sigmoid): out = rmsnorm(x) * w * sigmoid(g), fp32 math. With
  fp8=True the output is float8_e4m3fn with one float32 scale per row (amax / 448; a row is one head of
  head_dim channels in KDA, the usual 1x128 activation tile of fp8 GEMMs): out ~= q * scale[:, None].

Pallas backend: the Triton lowering (`pl.pallas_call`, grid over row blocks). Both kernels are row-local
and memory-bound with no matrix work, so Mosaic GPU's TMA/wgmma machinery buys nothing here, while the
Triton lowering also runs on CPU in interpret mode (CI). Measured on the H200 (benchmarks/moe.py, 8192
tokens, bf16; copy ceiling 4.27 TB/s in the same run): AttnRes mix + norm at 7168 wide, 5 sources 0.40 ms
vs 1.40 ms unfused XLA (3.5x), 9 sources 0.63 ms vs 2.35 ms (3.7x), still 2.3-2.4x the byte floor;
gated RMSNorm [8192 x 96, 128] 0.167 ms = XLA's own fusion (1.0x, 3.6 TB/s), with fp8 output 0.154 ms vs
0.527 ms (3.4x).
Rows are split into blocks that divide N and D into power-of-two chunks that divide D (Triton tensors
are power-of-two shaped; exact tiling keeps every access in bounds, also in interpret mode), so no input
is padded or copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

FP8_MAX = 448.0  # largest finite float8_e4m3fn
_REGISTER_BUDGET = 8192  # fp32 values per program in each of the accumulator and the streamed tile
# H200, 8192 x 7168 bf16 (benchmarks/moe.py): 4 warps 0.40 / 0.63 ms for 5 / 9 sources, 8 warps 0.48 / 1.37,
# 16 warps 0.72 / 1.18 -- wider programs spill the unrolled source tiles
ATTN_RES_WARPS = 4
# Programs wanted before rows per program may grow (two per SM of the H200's 132). A decode batch has few rows: at
# 64 rows x 2048 (k3-small) the register budget alone gave 4 rows per program, 16 programs on 132 SMs, and the
# AttnRes kernels took 0.55 ms of the 8.65 ms k3-small decode step (5-20 us per call, H200 profile of 2026-12-01).
MIN_PROGRAMS = 264


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def _tiling(n: int, d: int, interpret: bool, rows: int | None = None) -> tuple[int, int]:
    """(rows per program, chunk width): power-of-two chunks dividing d; rows dividing n, rows * d within
    the register budget, and no more rows than keep MIN_PROGRAMS programs when n allows (small n: one row
    per program). Interpret mode has no power-of-two rule, so there the chunk is the largest divisor of d up
    to 1024 (fewer unrolled chunks compile faster on CPU; d > 1024 still tests the multi-chunk path).
    A given `rows` is kept (it must divide n)."""
    chunk = max(c for c in range(1, min(d, 1024) + 1) if d % c == 0) if interpret else _pow2_divisor(d, 1024)
    if rows is None:
        rows = _pow2_divisor(n, max(1, min(64, _REGISTER_BUDGET // d, n // MIN_PROGRAMS)))
    elif not isinstance(rows, int) or rows < 1 or n % rows:
        raise ValueError(f"block_rows must be a positive divisor of the {n} rows; got {rows!r}")
    return rows, chunk


def _num_warps(rows: int, d: int) -> int:
    return 8 if rows * d >= 4096 else 4


def _compiler_params(rows: int, d: int, interpret: bool):
    return None if interpret else plgpu.CompilerParams(num_warps=_num_warps(rows, d), num_stages=1)


# ----------------------------------------------------------------------------------------------------
# AttnRes mix + RMSNorm


def _attn_res_mix_norm_kernel(*refs, num_sources: int, rows: int, chunk: int, eps: float, out_eps: float,
                              with_mix: bool, with_addend: bool):
    # refs[:S]   source refs, each [N, D] (the bank's completed blocks, then the partial sum)
    # (with_addend: then addend_ref [N, D]; the last source is refs[S-1] + addend, rounded to the sources' dtype,
    #  and is also written to summed_ref [N, D], the last output)
    # refs[S]    proj_ref [D] (AttnRes pseudo-query)
    # refs[S+1]  norm_ref [D] (its RMSNorm gain; the query is norm * proj in fp32, formed here: as an XLA op it
    #            was a kernel of its own per mix point, 50 per k3-small decode step)
    # refs[S+2]  out_weight_ref [D] (the pre-norm's weight)
    # then       mix_ref [N, D] (only with_mix), normed_ref [N, D]
    src_refs, addend_ref = refs[:num_sources], (refs[num_sources] if with_addend else None)
    proj_ref, norm_ref, out_weight_ref = refs[num_sources + with_addend:num_sources + with_addend + 3]
    outs = refs[num_sources + with_addend + 3:]  # [mix_ref], normed_ref, [summed_ref]
    summed_ref = outs[-1] if with_addend else None
    normed_ref = outs[-2] if with_addend else outs[-1]
    d = proj_ref.shape[0]
    chunks = [pl.ds(c * chunk, chunk) for c in range(d // chunk)]
    row_slice = pl.ds(pl.program_id(0) * rows, rows)
    query = [norm_ref[c].astype(jnp.float32) * proj_ref[c].astype(jnp.float32) for c in chunks]  # [chunk] each

    running_max = jnp.full((rows,), -jnp.inf, jnp.float32)
    denominator = jnp.zeros((rows,), jnp.float32)
    acc = [jnp.zeros((rows, chunk), jnp.float32) for _ in chunks]
    for i, src_ref in enumerate(src_refs):
        v = [src_ref[row_slice, c].astype(jnp.float32) for c in chunks]  # [rows, chunk] each
        if with_addend and i == num_sources - 1:  # the partial sum's pending add, as XLA's add in the dtype rounds it
            v = [(vc + addend_ref[row_slice, c].astype(jnp.float32)).astype(src_ref.dtype) for vc, c in zip(v, chunks)]
            for c, vc in zip(chunks, v):
                summed_ref[row_slice, c] = vc
            v = [vc.astype(jnp.float32) for vc in v]
        sum_sq = sum(jnp.sum(vc * vc, axis=1) for vc in v)
        dot = sum(jnp.sum(vc * qc[None, :], axis=1) for vc, qc in zip(v, query))
        logit = dot * jax.lax.rsqrt(sum_sq / d + eps)
        new_max = jnp.maximum(running_max, logit)
        rescale, weight = jnp.exp(running_max - new_max), jnp.exp(logit - new_max)
        denominator = denominator * rescale + weight
        acc = [a * rescale[:, None] + weight[:, None] * vc for a, vc in zip(acc, v)]
        running_max = new_max

    dtype = src_refs[0].dtype
    mix = [(a / denominator[:, None]).astype(dtype) for a in acc]
    if with_mix:
        mix_ref = outs[0]
        for c, mc in zip(chunks, mix):
            mix_ref[row_slice, c] = mc
    mix32 = [mc.astype(jnp.float32) for mc in mix]
    inv_rms = jax.lax.rsqrt(sum(jnp.sum(mc * mc, axis=1) for mc in mix32) / d + out_eps)
    out_dtype = normed_ref.dtype
    for c, mc in zip(chunks, mix32):
        normed = (mc * inv_rms[:, None]).astype(dtype).astype(out_dtype)
        normed_ref[row_slice, c] = out_weight_ref[c].astype(out_dtype)[None, :] * normed


def _check_sources(sources, proj, norm, out_weight):
    if not sources:
        raise ValueError("attn_res_mix_norm needs at least one source")
    shape, dtype = sources[0].shape, sources[0].dtype
    if any(s.shape != shape or s.dtype != dtype for s in sources):
        raise ValueError(f"sources must share shape and dtype, got {[(s.dtype, s.shape) for s in sources]}")
    if not jnp.issubdtype(dtype, jnp.floating) or len(shape) < 1:
        raise ValueError(f"sources must be float [..., D], got {dtype}{list(shape)}")
    for name, w in (("proj", proj), ("norm", norm), ("out_weight", out_weight)):
        if w.shape != (shape[-1],):
            raise ValueError(f"{name} must be [{shape[-1]}], got {list(w.shape)}")


@functools.partial(jax.jit, static_argnames=("eps", "out_eps", "with_mix", "interpret", "num_warps", "block_rows"))
def attn_res_mix_norm(sources: list[jax.Array], proj: jax.Array, norm: jax.Array, out_weight: jax.Array,
                      eps: float, out_eps: float | None = None, *, with_mix: bool = False,
                      addend: jax.Array | None = None, interpret: bool = False, num_warps: int | None = None,
                      block_rows: int | None = None) -> tuple[jax.Array | None, ...]:
    """(mix or None, rms_norm(mix, out_weight, out_eps)) for sources, each [..., D], in one pass.

    addend (like the sources): the last source is sources[-1] + addend (rounded to the sources' dtype, as the
    unfused add), and the result gains that sum as a third entry -- the residual add before a mix point done in
    the kernel instead of as an XLA kernel of its own (44 per k3-small decode step on the H200, 2026-12-02).

    proj, norm: the mix point's pseudo-query and its RMSNorm gain [D]; out_weight [D]: the pre-norm that
    follows. out_eps defaults to eps. The normed output has the dtype of out_weight * sources (as
    k3jax.layers.rms_norm); mix, with with_mix=True, has the sources' dtype. num_warps overrides the
    Triton launch width (GPU only); block_rows the rows per program (default `_tiling`'s rule).
    """
    _check_sources(sources, proj, norm, out_weight)
    if addend is not None and (addend.shape != sources[-1].shape or addend.dtype != sources[-1].dtype):
        raise ValueError(f"addend must match the sources: {sources[-1].dtype}{list(sources[-1].shape)}; got "
                         f"{addend.dtype}{list(addend.shape)}")
    out_eps = eps if out_eps is None else out_eps
    lead, d = sources[0].shape[:-1], sources[0].shape[-1]
    flat = [s.reshape(-1, d) for s in sources] + ([] if addend is None else [addend.reshape(-1, d)])
    n = flat[0].shape[0]
    rows, chunk = _tiling(n, d, interpret, block_rows)
    dtype = sources[0].dtype
    out_dtype = jnp.result_type(out_weight.dtype, dtype)
    out_shape = [jax.ShapeDtypeStruct((n, d), out_dtype)]
    if with_mix:
        out_shape.insert(0, jax.ShapeDtypeStruct((n, d), dtype))
    if addend is not None:
        out_shape.append(jax.ShapeDtypeStruct((n, d), dtype))
    kernel = functools.partial(_attn_res_mix_norm_kernel, num_sources=len(sources), rows=rows, chunk=chunk,
                               eps=float(eps), out_eps=float(out_eps), with_mix=with_mix,
                               with_addend=addend is not None)
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(n // rows,), interpret=interpret, name="attn_res_mix_norm",
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps or ATTN_RES_WARPS, num_stages=1),
    )(*flat, proj, norm, out_weight)
    mix = outs[0].reshape(*lead, d) if with_mix else None
    if addend is None:
        return mix, outs[-1].reshape(*lead, d)
    return mix, outs[-2].reshape(*lead, d), outs[-1].reshape(*lead, d)


def attn_res_mix_norm_reference(sources: list[jax.Array], proj: jax.Array, norm: jax.Array,
                                out_weight: jax.Array, eps: float, out_eps: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Plain jnp: the mix (k3jax.attnres.attn_res_mix) and its Kimi RMSNorm (k3jax.layers.rms_norm)."""
    _check_sources(sources, proj, norm, out_weight)
    out_eps = eps if out_eps is None else out_eps
    v = jnp.stack(sources, axis=-2).astype(jnp.float32)  # [..., S, D]
    keys = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    probs = jax.nn.softmax(jnp.einsum("...sd,d->...s", keys, norm.astype(jnp.float32) * proj.astype(jnp.float32)), axis=-1)
    mix = jnp.einsum("...s,...sd->...d", probs, v).astype(sources[-1].dtype)
    m32 = mix.astype(jnp.float32)
    normed = (m32 * jax.lax.rsqrt(jnp.mean(m32 * m32, axis=-1, keepdims=True) + out_eps)).astype(mix.dtype)
    return mix, out_weight * normed


# ----------------------------------------------------------------------------------------------------
# gated RMSNorm


def _gated_rms_norm_kernel(x_ref, gate_ref, weight_ref, *out_refs, rows: int, chunk: int, eps: float, fp8: bool):
    # x_ref, gate_ref [N, D]; weight_ref [D]
    # out_refs: out_ref [N, D] (x dtype, or float8_e4m3fn with fp8) and, with fp8, scale_ref [N] fp32
    d = weight_ref.shape[0]
    chunks = [pl.ds(c * chunk, chunk) for c in range(d // chunk)]
    row_slice = pl.ds(pl.program_id(0) * rows, rows)
    x = [x_ref[row_slice, c].astype(jnp.float32) for c in chunks]  # [rows, chunk] each
    inv_rms = jax.lax.rsqrt(sum(jnp.sum(xc * xc, axis=1) for xc in x) / d + eps)
    y = [
        xc * inv_rms[:, None] * weight_ref[c].astype(jnp.float32)[None, :] * jax.nn.sigmoid(gate_ref[row_slice, c].astype(jnp.float32))
        for xc, c in zip(x, chunks)
    ]
    out_ref = out_refs[0]
    if not fp8:
        for c, yc in zip(chunks, y):
            out_ref[row_slice, c] = yc.astype(out_ref.dtype)
        return
    scale_ref = out_refs[1]
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(yc), axis=1) for yc in y])
    scale = jnp.maximum(amax / FP8_MAX, jnp.finfo(jnp.float32).tiny)  # an all-zero row keeps a finite scale
    for c, yc in zip(chunks, y):
        out_ref[row_slice, c] = (yc / scale[:, None]).astype(out_ref.dtype)
    scale_ref[row_slice] = scale


def _check_gated(x, gate, weight):
    if x.shape != gate.shape or x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x and gate must be float arrays of one shape [..., D], got {x.dtype}{list(x.shape)} / {list(gate.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}], got {list(weight.shape)}")


@functools.partial(jax.jit, static_argnames=("eps", "fp8", "interpret"))
def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float, *, fp8: bool = False,
                   interpret: bool = False):
    """rmsnorm(x) * weight * sigmoid(gate) for x, gate [..., D]: out [..., D] in x.dtype, or with fp8=True
    (q float8_e4m3fn [..., D], scale float32 [...]) with out ~= q * scale[..., None]."""
    _check_gated(x, gate, weight)
    lead, d = x.shape[:-1], x.shape[-1]
    x2, g2 = x.reshape(-1, d), gate.reshape(-1, d)
    n = x2.shape[0]
    rows, chunk = _tiling(n, d, interpret)
    out_shape = [jax.ShapeDtypeStruct((n, d), jnp.float8_e4m3fn if fp8 else x.dtype)]
    if fp8:
        out_shape.append(jax.ShapeDtypeStruct((n,), jnp.float32))
    kernel = functools.partial(_gated_rms_norm_kernel, rows=rows, chunk=chunk, eps=float(eps), fp8=fp8)
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(n // rows,), compiler_params=_compiler_params(rows, d, interpret),
        interpret=interpret, name="gated_rms_norm",
    )(x2, g2, weight)
    if fp8:
        return outs[0].reshape(*lead, d), outs[1].reshape(lead)
    return outs[0].reshape(*lead, d)


def gated_rms_norm_reference(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float, *, fp8: bool = False):
    """Plain jnp (k3jax.layers.gated_rms_norm, plus the same per-row fp8 quantisation)."""
    _check_gated(x, gate, weight)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = y * weight.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
    if not fp8:
        return y.astype(x.dtype)
    scale = jnp.maximum(jnp.max(jnp.abs(y), axis=-1) / FP8_MAX, jnp.finfo(jnp.float32).tiny)
    return (y / scale[..., None]).astype(jnp.float8_e4m3fn), scale
