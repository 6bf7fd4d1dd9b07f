"""MoE combine: the experts' weighted rows summed per token, the latent RMSNorm, and the shared experts' GLU, in one
pass -- the input of the latent MoE's fused output GEMM (k3-model.md §5; k3jax.moe.fuse_moe_weights, FUSED_OUT):

    y   = sum_{s, j: ids[n, j] >= 0} rows[s, n * top_k + j, :K]      fp32, slices s outer, slots j inner
    y   = norm_weight * cast(cast(y) * rsqrt(mean(cast(y)^2) + eps))  Kimi RMSNorm of the cast sum (k3jax.layers)
    h   = GLU(shared[:, gate columns], shared[:, up columns])         SiTU-GLU or SwiGLU in fp32, cast
    out = [y | h]                                                     [N, K + W]

rows is pallas_kernels/moe_gemm.moe_grouped_rows' output: each (token, slot)'s routing-weighted expert output, one
row per assignment in (token, slot) order, per contraction slice of the down GEMM; a dropped assignment's rows were
never written and are selected away, never added. shared is the fused x-side projection's output, read in place at
its columns.

Why a kernel: XLA fused these ops (the combine's unrolled adds, the norm, the GLU, the concatenate) into one Triton
fusion that took 9.2 us per MoE layer in the k3-small decode step on the H200 (B64: 2 MB of fp32 rows; 24 calls,
0.22 ms of a 7.9 ms step, the largest XLA fusion of the step, profile of 2026-12-04): 2 x 512 output tiles, so each
program of the norm's half summed its rows' whole [top_k, K] twice over. Here one program owns `rows` whole tokens:
it reads each row once, keeps the sum in registers, and writes both halves: 2.96 against 9.09 us at that shape.
A dropped slot's row is not read at all (a masked load), which is what an expert-parallel rank needs: of a received
token's 16 slots it keeps ~1.5, and XLA's select still reads all 16. Without a norm or a GLU this is also
`moe_gemm.moe_grouped_mlp`'s combine where combine="auto" expects it to be the faster (K3 EP16 DEP rank, H200,
2026-12-04: the rank's whole MoE 1.075 against 1.119 ms at 1,024 routed tokens, 2.824 against 3.227 ms at 16,384).

Pallas backend: the Triton lowering (row-local, memory-bound, no matrix work; runs in interpret mode on CPU for CI).
K and W are walked in power-of-two chunks that divide them (Triton tensors are power-of-two shaped; exact tiling
keeps every access in bounds): `supported` says whether a shape has chunks of at least MIN_CHUNK.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fused_norm import _pow2_divisor

ACTIVATIONS = ("situ", "silu")
MIN_CHUNK = 16  # narrower power-of-two chunks would unroll hundreds of loads (an odd K has chunk 1)
_MAX_CHUNK = 1024
_REGISTER_BUDGET = 4096  # fp32 sums held per program (rows x K)
MIN_PROGRAMS = 264  # two per SM of the H200 before a program takes more than one token
# One program sums a token's kept rows x slices: at K3's widths with all 16 kept (16 x 3584 = 57,344 values a token)
# that serial work lost to XLA, which splits the sum and the norm into two wide kernels: 15.0 against 9.0 us at 64
# tokens (best tiling, H200, 2026-12-04; measured before the masked loads). At k3-small's (8 x 1024 = 8,192) the
# kernel took 2.96 against 9.09 us, and a DEP rank's ~2 x 3584 kept won by 1.04-1.14x on its whole MoE. The cut sits
# at twice the measured win at k3-small; the range between was not measured.
MAX_ROW_VALUES = 16384


def _chunk(d: int, interpret: bool) -> int:
    """Power-of-two chunk dividing d (up to 1024); interpret mode has no power-of-two rule: the largest divisor."""
    if interpret:
        return max(c for c in range(1, min(d, _MAX_CHUNK) + 1) if d % c == 0)
    return _pow2_divisor(d, _MAX_CHUNK)


def supported(k_dim: int, shared_width: int = 0, *, kept_per_token: int = 1, slices: int = 1,
              interpret: bool = False) -> bool:
    """Whether the kernel takes a latent width K and a shared GLU width W (0: none) without tiny chunks, and a
    token's kept rows (kept_per_token x slices x K values, summed by one program; a dropped slot is not read) are
    few enough for it to beat XLA's fusion."""
    return _chunks_ok(k_dim, shared_width, interpret) and kept_per_token * slices * k_dim <= MAX_ROW_VALUES


def _chunks_ok(k_dim: int, shared_width: int, interpret: bool) -> bool:
    return all(_chunk(d, interpret) >= min(MIN_CHUNK, d) for d in (k_dim, shared_width) if d)


def glu(gate: jax.Array, up: jax.Array, activation: str, beta: float, linear_beta: float | None) -> jax.Array:
    """SiTU-GLU / SwiGLU on fp32 values (k3jax.layers.glu_activation without the bf16 round trip); also the grouped
    GLU GEMM's epilogue (moe_gemm)."""
    if activation == "silu":
        return gate * jax.nn.sigmoid(gate) * up
    act = beta * jnp.tanh(gate / beta) * jax.nn.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * jnp.tanh(up / linear_beta)
    return act * up


def _combine_kernel(rows_ref, ids_ref, *refs, top_k: int, k_dim: int, rows: int, k_chunk: int, has_norm: bool,
                    eps: float, shared_cols: tuple[int, int, int] | None, w_chunk: int, activation: str,
                    beta: float, linear_beta: float | None, dtype, glu_programs: int):
    # rows_ref:   [S, N, top_k, K'] fp32 (K' >= K; columns past K never read; a dropped slot's rows are garbage)
    # ids_ref:    [N, top_k] int32 (< 0: dropped)
    # norm_ref:   [K] (has_norm)
    # shared_ref: [N, C] (shared_cols = (gate column, up column, W)): the GLU's inputs at their columns
    # out_ref:    [N, K + W] (the norm's result dtype; dtype: the activations', which the sum and the GLU round to)
    # grid (token blocks, 1 + glu_programs): column 0 sums, norms and stores the first K columns; columns 1.. each
    # the GLU of W / glu_programs shared columns (glu_programs 0: column 0 does the GLU as well)
    refs = list(refs)
    norm_ref = refs.pop(0) if has_norm else None
    shared_ref = refs.pop(0) if shared_cols is not None else None
    (out_ref,) = refs
    out_dtype = out_ref.dtype
    token = pl.ds(pl.program_id(0) * rows, rows)

    @pl.when(pl.program_id(1) == 0)
    def _combine_and_norm():
        k_chunks = [pl.ds(c * k_chunk, k_chunk) for c in range(k_dim // k_chunk)]
        kept = [ids_ref[token, j] >= 0 for j in range(top_k)]  # [rows] each
        acc = None
        for s in range(rows_ref.shape[0]):
            for j in range(top_k):
                # a masked load: a dropped slot's row is never read (an expert-parallel rank keeps ~1 of 16)
                # (the int32 scalars: interpret mode's masked load takes array indices, not Python ints)
                term = [plgpu.load(rows_ref.at[jnp.int32(s), token, jnp.int32(j), c], mask=kept[j][:, None],
                                   other=0.0) for c in k_chunks]  # [rows, k_chunk]
                acc = term if acc is None else [a + t for a, t in zip(acc, term)]
        y = [a.astype(dtype) for a in acc]
        if has_norm:
            y32 = [v.astype(jnp.float32) for v in y]
            inv_rms = jax.lax.rsqrt(sum(jnp.sum(v * v, axis=1) for v in y32) / k_dim + eps)  # [rows]
            y = [(norm_ref[c].astype(jnp.float32)[None, :] * (v * inv_rms[:, None]).astype(dtype).astype(jnp.float32))
                 .astype(out_dtype) for v, c in zip(y32, k_chunks)]
        for c, v in zip(k_chunks, y):
            out_ref[token, c] = v.astype(out_dtype)

    if shared_cols is None:
        return
    gate_col, up_col, width = shared_cols
    per_program = width // max(glu_programs, 1)

    def glu_part(first: int):
        for c0 in range(first, first + per_program, w_chunk):
            gate = shared_ref[token, pl.ds(gate_col + c0, w_chunk)].astype(jnp.float32)  # [rows, w_chunk]
            up = shared_ref[token, pl.ds(up_col + c0, w_chunk)].astype(jnp.float32)
            h = glu(gate, up, activation, beta, linear_beta).astype(dtype)
            out_ref[token, pl.ds(k_dim + c0, w_chunk)] = h.astype(out_dtype)

    if glu_programs == 0:  # not split: the combine's program does the GLU too
        pl.when(pl.program_id(1) == 0)(functools.partial(glu_part, 0))
    for g in range(glu_programs):
        pl.when(pl.program_id(1) == 1 + g)(functools.partial(glu_part, g * per_program))


def _out_dtype(dtype, norm_weight):
    """The output's dtype: the RMSNorm's (weight x activations, as k3jax.layers.rms_norm), else the activations'."""
    return jnp.dtype(dtype) if norm_weight is None else jnp.result_type(norm_weight.dtype, dtype)


def _check(rows, ids, k_dim, norm_weight, shared, shared_columns, activation, dtype):
    if rows.ndim != 3 or rows.dtype != jnp.float32:
        raise ValueError(f"rows must be fp32 [S, N * top_k, K'], got {rows.dtype}{list(rows.shape)}")
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape[0] * ids.shape[1] != rows.shape[1]:
        raise ValueError(f"ids must be integer [N, top_k] with N * top_k = {rows.shape[1]} rows, got "
                         f"{ids.dtype}{list(ids.shape)}")
    if not isinstance(k_dim, int) or not 1 <= k_dim <= rows.shape[2]:
        raise ValueError(f"k_dim must be an int in [1, {rows.shape[2]}], got {k_dim!r}")
    if norm_weight is not None and norm_weight.shape != (k_dim,):
        raise ValueError(f"norm_weight must be [{k_dim}], got {list(norm_weight.shape)}")
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"dtype must be a float dtype, got {dtype}")
    if (shared is None) != (shared_columns is None):
        raise ValueError("shared and shared_columns come together")
    if shared is not None:
        if shared.ndim != 2 or shared.shape[0] != ids.shape[0]:
            raise ValueError(f"shared must be [N = {ids.shape[0]}, C], got {list(shared.shape)}")
        gate_col, up_col, width = shared_columns
        if width < 1 or min(gate_col, up_col) < 0 or max(gate_col, up_col) + width > shared.shape[1]:
            raise ValueError(f"shared_columns {shared_columns} (gate column, up column, width) fall outside shared's "
                             f"{shared.shape[1]} columns")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


@functools.partial(jax.jit, static_argnames=("k_dim", "eps", "shared_columns", "activation", "situ_beta",
                                             "situ_linear_beta", "dtype", "block_rows", "split", "num_warps",
                                             "interpret"))
def moe_combine(rows: jax.Array, ids: jax.Array, *, k_dim: int, dtype, norm_weight: jax.Array | None = None,
                eps: float = 1e-5, shared: jax.Array | None = None, shared_columns: tuple[int, int, int] | None = None,
                activation: str = "situ", situ_beta: float = 4.0, situ_linear_beta: float | None = 25.0,
                block_rows: int | None = None, split: bool = True, num_warps: int | None = None,
                interpret: bool = False) -> jax.Array:
    """[sum of each token's kept rows, RMSNormed | shared GLU] -> [N, k_dim + W] (module docstring).

    dtype: the activations' dtype, which the sum and the GLU are rounded to; the output has the norm's result dtype
    (norm_weight's and dtype's promotion, as k3jax.layers.rms_norm), dtype without a norm.

    rows: fp32 [S, N * top_k, K' >= k_dim] (moe_gemm.moe_grouped_rows); ids [N, top_k] (< 0: dropped, not added).
    norm_weight [k_dim] or None (no norm: the cast sum). shared [N, C] with shared_columns = (gate column, up column,
    W): the shared experts' GLU of those column blocks fills the last W output columns (None: output [N, k_dim]).
    activation "situ" (situ_beta, situ_linear_beta) or "silu". block_rows: tokens per program (default: one while
    that keeps fewer than MIN_PROGRAMS programs, more up to the register budget). split: the GLU's chunks run in
    programs of their own, beside each token block's combine (False: the combine's program does them after the
    norm). num_warps: the Triton launch width (GPU only; default 8 while the token blocks are fewer than MIN_PROGRAMS,
    else 4).
    """
    _check(rows, ids, k_dim, norm_weight, shared, shared_columns, activation, dtype)
    n, top_k = ids.shape
    width = shared_columns[2] if shared_columns is not None else 0
    if not _chunks_ok(k_dim, width, interpret):  # (supported's row-size cut is a speed rule: the caller's choice)
        raise ValueError(f"K {k_dim} / W {width} split into power-of-two chunks narrower than {MIN_CHUNK}; "
                         "check moe_combine.supported first")
    if block_rows is None:
        block_rows = _pow2_divisor(n, max(1, min(64, _REGISTER_BUDGET // k_dim, n // MIN_PROGRAMS)))
    elif not isinstance(block_rows, int) or block_rows < 1 or n % block_rows:
        raise ValueError(f"block_rows must be a positive divisor of the {n} tokens, got {block_rows!r}")
    if num_warps is None:
        # H200 (2026-12-04), device us per call, split: k3-small decode (64 token blocks) 2 / 4 / 8 warps 5.45 / 3.90 /
        # 2.96; its 8192-token prefill (2048 blocks of 4) 100.5 / 94.3 / 108.1
        num_warps = 8 if n // block_rows < MIN_PROGRAMS else 4
    w_chunk = _chunk(width, interpret) if width else 0
    glu_programs = width // w_chunk if split and width else 0
    kernel = functools.partial(
        _combine_kernel, top_k=top_k, k_dim=k_dim, rows=block_rows, k_chunk=_chunk(k_dim, interpret),
        has_norm=norm_weight is not None, eps=float(eps), shared_cols=shared_columns,
        w_chunk=w_chunk, activation=activation, beta=float(situ_beta),
        linear_beta=None if situ_linear_beta is None else float(situ_linear_beta), dtype=jnp.dtype(dtype),
        glu_programs=glu_programs,
    )
    operands = [rows.reshape(rows.shape[0], n, top_k, rows.shape[2]), ids.astype(jnp.int32)]
    operands += [norm_weight] if norm_weight is not None else []
    operands += [shared] if shared is not None else []
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((n, k_dim + width), _out_dtype(dtype, norm_weight)),
        grid=(n // block_rows, 1 + glu_programs),
        interpret=interpret, name="moe_combine",
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
    )(*operands)


def moe_combine_reference(rows: jax.Array, ids: jax.Array, *, k_dim: int, dtype, norm_weight: jax.Array | None = None,
                          eps: float = 1e-5, shared: jax.Array | None = None,
                          shared_columns: tuple[int, int, int] | None = None, activation: str = "situ",
                          situ_beta: float = 4.0, situ_linear_beta: float | None = 25.0) -> jax.Array:
    """Plain jnp, the same sum order (slices outer, slots inner) and roundings as the kernel."""
    _check(rows, ids, k_dim, norm_weight, shared, shared_columns, activation, dtype)
    n, top_k = ids.shape
    per_slot = rows[..., :k_dim].reshape(rows.shape[0], n, top_k, k_dim)
    y = None
    for s in range(rows.shape[0]):
        for j in range(top_k):
            term = jnp.where(ids[:, j, None] >= 0, per_slot[s, :, j], 0.0)
            y = term if y is None else y + term
    out_dtype = _out_dtype(dtype, norm_weight)
    y = y.astype(dtype)
    if norm_weight is not None:
        y32 = y.astype(jnp.float32)
        normed = (y32 * jax.lax.rsqrt(jnp.mean(y32 * y32, axis=-1, keepdims=True) + eps)).astype(dtype)
        y = (norm_weight.astype(jnp.float32) * normed.astype(jnp.float32)).astype(out_dtype)
    y = y.astype(out_dtype)
    if shared is None:
        return y
    gate_col, up_col, width = shared_columns
    gate = shared[:, gate_col:gate_col + width].astype(jnp.float32)
    up = shared[:, up_col:up_col + width].astype(jnp.float32)
    h = glu(gate, up, activation, situ_beta, situ_linear_beta).astype(dtype)
    return jnp.concatenate([y, h.astype(out_dtype)], axis=-1)


__all__ = ["moe_combine", "moe_combine_reference", "supported", "glu", "MIN_CHUNK", "MAX_ROW_VALUES"]
