"""The serving layout of the parameters: weights that multiply the same input, concatenated once at load time.

A decode step launches one GPU kernel per GEMM, and at k3-small's batch sizes the host's ~8 us per launch is the
step's bottleneck (docs/benchmarks.md, 2026-11-30). So for single-device serving `fuse_for_serving` rewrites
each attention block's input projections into one [D, sum N] matrix, multiplied once per step and sliced:

    KDA: in_proj = q_proj | k_proj | v_proj | f_a | b_proj | (g_proj or g_a)    qkv_conv = q_conv | k_conv | v_conv
    MLA: in_proj = (q_a or q_proj) | kv_a | g_proj (gated only)
         kv_b -> w_uk [H, N, C], w_uv [H, C, Vd] fp32 (the absorbed form's weights, split and laid out once)

and drops the originals (the weights are not held twice). MoE layers go through `k3jax.moe.fuse_moe_weights` when
that exists. `kda.kda_mixer` and the MLA steps read "in_proj" when it is there. The column order and widths come
from the config (`kda_input_columns` / `mla_input_columns`), never from the arrays, so the slices are static.

Only the plain single-device path knows this layout: checkpoints (orbax and HF), training and the parallel
strategies (which pass their own `linear` hook) keep the unfused structure, and a mixer given fused params
together with a custom `linear` raises. The results equal the unfused model's up to the GEMMs' accumulation
order (each output column is still the same dot product over D).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig

FUSED_INPUT = "in_proj"  # the fused input-projection weight of a KDA or MLA block
FUSED_CONV = "qkv_conv"  # KDA's q|k|v short-conv weights [W, 3*H*K]
ABSORB_UK, ABSORB_UV = "w_uk", "w_uv"  # MLA's kv_b split: W_UK [H, N, C] and W_UV [H, C, Vd] fp32
_KDA_CONVS = ("q_conv", "k_conv", "v_conv")


def kda_input_columns(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """(name, width) of the KDA weights fused into "in_proj", in column order."""
    hk = cfg.kda_num_heads * cfg.kda_head_dim
    gate = ("g_proj", hk) if cfg.kda_output_gate_rank is None else ("g_a", cfg.kda_output_gate_rank)
    return (("q_proj", hk), ("k_proj", hk), ("v_proj", hk), ("f_a", cfg.kda_gate_rank),
            ("b_proj", cfg.kda_num_heads), gate)


def mla_input_columns(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """(name, width) of the MLA weights fused into "in_proj", in column order."""
    q = ("q_a", cfg.q_lora_rank) if cfg.q_lora_rank is not None else ("q_proj", cfg.mla_num_heads * cfg.mla_q_head_dim)
    cols = (q, ("kv_a", cfg.latent_cache_dim))
    if cfg.mla_output_gate:
        cols += (("g_proj", cfg.mla_num_heads * cfg.v_head_dim),)
    return cols


def column_starts(columns: tuple[tuple[str, int], ...]) -> dict[str, int]:
    """{name: first column} of a fused layout's (name, width) columns, in order."""
    starts, start = {}, 0
    for name, width in columns:
        starts[name] = start
        start += width
    return starts


def split_columns(y: jax.Array, columns: tuple[tuple[str, int], ...]) -> dict[str, jax.Array]:
    """The fused GEMM's output y [..., sum widths] as {name: y[..., offset : offset + width]} (static slices)."""
    total = sum(width for _, width in columns)
    if total != y.shape[-1]:
        raise ValueError(f"fused projection has {y.shape[-1]} columns; the config's layout needs {total}")
    starts = column_starts(columns)
    return {name: y[..., starts[name] : starts[name] + width] for name, width in columns}


def is_fused(attn_params: dict) -> bool:
    """Whether an attention block's params are in the serving layout (see the module docstring)."""
    return FUSED_INPUT in attn_params


def _concat_columns(attn: dict, columns: tuple[tuple[str, int], ...], cfg_dtype, where: str) -> jax.Array:
    ws = [attn[name] for name, _ in columns]
    for (name, width), w in zip(columns, ws):
        if w.ndim != 2 or w.shape[1] != width:
            raise ValueError(f"{where}: {name} is {w.shape}; the config says [D, {width}]")
    if len({w.dtype for w in ws}) > 1:  # dense() casts each weight to the activation dtype (cfg.dtype) per step
        ws = [w.astype(cfg_dtype) for w in ws]
    return jnp.concatenate(ws, axis=1)


def _fuse_kda(attn: dict, cfg: ModelConfig, where: str) -> dict:
    columns = kda_input_columns(cfg)
    out = {k: v for k, v in attn.items() if k not in dict(columns) and k not in _KDA_CONVS}
    out[FUSED_INPUT] = _concat_columns(attn, columns, jnp.dtype(cfg.dtype), where)
    out[FUSED_CONV] = jnp.concatenate([attn[name] for name in _KDA_CONVS], axis=-1)
    # K3 pads A_log to 128 entries; the mixers read the first H each step (a slice kernel per layer): cut it here
    out["A_log"] = attn["A_log"][: cfg.kda_num_heads]
    return out


def _fuse_mla(attn: dict, cfg: ModelConfig, where: str) -> dict:
    columns = mla_input_columns(cfg)
    out = {k: v for k, v in attn.items() if k not in dict(columns) and k != "kv_b"}
    out[FUSED_INPUT] = _concat_columns(attn, columns, jnp.dtype(cfg.dtype), where)
    # kv_b [C, H*(N+Vd)] split once into the absorbed form's two per-head weights, head-major as the batched GEMMs
    # read them (the step sliced both halves out of kv_b, cast W_UV to fp32 and moved H ahead of C, every step)
    c, h, n = cfg.kv_lora_rank, cfg.mla_num_heads, cfg.qk_nope_head_dim
    kv_b = attn["kv_b"].reshape(c, h, n + cfg.v_head_dim)
    out[ABSORB_UK] = jnp.transpose(kv_b[..., :n], (1, 2, 0))  # [H, N, C]
    out[ABSORB_UV] = jnp.transpose(kv_b[..., n:], (1, 0, 2)).astype(jnp.float32)  # [H, C, Vd] fp32 (exact)
    return out


def fuse_for_serving(params: dict, cfg: ModelConfig) -> dict:
    """params (the `init_params` / `load_pretrained` structure) in the serving layout: a new pytree that shares
    every untouched leaf with `params` and holds the fused weights instead of their parts. Idempotent.

    Drop the unfused tree after the call (params = fuse_for_serving(params, cfg)): until then both layouts'
    attention input projections are in memory. Single device only: the parallel strategies expect the unfused
    names (their sharding specs are per projection).
    """
    from k3jax import moe  # imported on use: moe imports the Pallas grouped GEMM

    fuse_moe = getattr(moe, "fuse_moe_weights", None)
    layers = []
    for l, lp in enumerate(params["layers"]):
        lp = dict(lp)
        where = f"fuse_for_serving: layer {l}"
        if not is_fused(lp["attn"]):
            lp["attn"] = _fuse_mla(lp["attn"], cfg, where) if cfg.is_mla(l) else _fuse_kda(lp["attn"], cfg, where)
        if fuse_moe is not None and "router" in lp["mlp"]:
            lp["mlp"] = fuse_moe(lp["mlp"], cfg)
        layers.append(lp)
    return {**params, "layers": layers}
