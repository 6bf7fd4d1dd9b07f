"""Feed-forward blocks (k3-model.md §5): the dense MLP of layer 0 and K3's "Stable LatentMoE".

For a token x (already post_attention_layernorm'd, full width D):
  router (fp32): s = sigmoid(W_r x); select top-k of s + bias; weights = s_sel / sum(s_sel) * scaling
  routed: z = W_down x (latent width); y = sum_i w_i E_i(z) (fp32 accumulation); y = W_up RMSNorm(y)
  shared: gated MLP on the full-width x
The expert computation is grouped: assignments are sorted by expert and each expert multiplies its
contiguous group (`jax.lax.ragged_dot`), never a dense all-experts matmul. The "pallas" and "interpret"
backends of op "moe_experts" run pallas_kernels/moe_gemm.py (fused GLU epilogue, in-kernel MXFP4); with fused
projections, op "moe_out_input" (the experts, their combine, the latent RMSNorm and the shared GLU: the output
GEMM's input) adds pallas_kernels/moe_combine.py.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import backend
from k3jax.config import ModelConfig
from k3jax.layers import dense, glu_activation, mlp, rms_norm
from k3jax.quant import dequantize_experts
from pallas_kernels import moe_combine, moe_gemm, router_topk

# Load-time fused projections (`fuse_moe_weights`); `moe` takes layer params with or without them.
FUSED_IN = "in_proj"  # [D, Dl + 2 I_sh]: latent_down | shared gate | shared up (all read the same x, bf16)
FUSED_OUT = "out_proj"  # [Dl + I_sh, D]: latent_up stacked over shared down (one GEMM on [norm(y_lat) | h_shared])
# Whether the kernel backends build FUSED_OUT's input with pallas_kernels/moe_combine.py (True) or leave the experts'
# combine, the latent RMSNorm and the shared GLU to XLA (False: benchmarks/model_forward.py --moe-combine-kernel 0).
COMBINE_KERNEL = True


def route(router_w: jax.Array, bias: jax.Array, x: jax.Array, cfg: ModelConfig, *,
          backend_name: str = "reference") -> tuple[jax.Array, jax.Array]:
    """Expert ids [N, k] int32 and routing weights [N, k] fp32 for tokens x [N, D]: the fp32 router GEMM, then the
    backend's "moe_route" op (`select_experts`, or pallas_kernels/router_topk.py on the kernel backends)."""
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), router_w.astype(jnp.float32))
    return backend.get("moe_route", backend_name)(logits, bias, cfg)


@backend.register("moe_route", "reference")
def select_experts(logits: jax.Array, bias: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Expert ids [N, k] int32 and routing weights [N, k] fp32 from router logits [N, E] (fp32).

    The correction bias steers *selection* only; weights use the unbiased scores (pitfall 7).
    """
    scores = jax.nn.sigmoid(logits) if cfg.router_score == "sigmoid" else jax.nn.softmax(logits, -1)
    choice = scores + bias.astype(jnp.float32)[None, :]
    if _grouped_routing(cfg):
        n = logits.shape[0]
        grouped = choice.reshape(n, cfg.num_expert_group, -1)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)
        group_mask = jnp.zeros_like(group_score, bool).at[jnp.arange(n)[:, None], keep].set(True)
        choice = jnp.where(group_mask[:, :, None], grouped, -jnp.inf).reshape(n, -1)
    _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.num_experts_per_tok > 1 and cfg.moe_renormalize:
        # the k-term sum as unrolled adds, not a reduction: with them the gather, the sum and the scaling are one
        # elementwise fusion on the GPU (a row reduction would be a kernel of its own in every MoE layer)
        total = weights[:, 0]
        for j in range(1, cfg.num_experts_per_tok):
            total = total + weights[:, j]
        weights = weights / (total[:, None] + 1e-20)
    return ids.astype(jnp.int32), weights * cfg.routed_scaling_factor


def _grouped_routing(cfg: ModelConfig) -> bool:
    return cfg.num_expert_group > 1 and cfg.num_expert_group > cfg.topk_group


def _select_experts_pallas(logits: jax.Array, bias: jax.Array, cfg: ModelConfig, *, interpret: bool):
    """`select_experts` as one kernel (pallas_kernels/router_topk.py); grouped routing stays on the reference."""
    if _grouped_routing(cfg):
        return select_experts(logits, bias, cfg)
    return router_topk.router_topk(logits, bias, top_k=cfg.num_experts_per_tok, score=cfg.router_score,
                                   renormalize=cfg.moe_renormalize, scaling=float(cfg.routed_scaling_factor),
                                   interpret=interpret)


backend.register("moe_route", "pallas")(partial(_select_experts_pallas, interpret=False))
backend.register("moe_route", "interpret")(partial(_select_experts_pallas, interpret=True))


@backend.register("moe_experts", "reference")
def grouped_experts_reference(
    x: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict, cfg: ModelConfig, *,
    expected_rows: int | None = None,
) -> jax.Array:
    """sum_i w_i E_i(x) for tokens x [N, Dx] routed to ids/weights [N, k]; result in x's dtype. An id < 0 is a
    dropped assignment (every "moe_experts" backend): not computed, contributes zero (k3jax.parallel passes its
    ranks' non-local picks so).

    x may be wider than the experts' input Dx (every "moe_experts" backend reads only its first Dx columns: `moe`
    passes the fused projection's output whole, so the Pallas kernels read the latent columns in place).

    experts: {"gate", "up": [E, Dx, I], "down": [E, I, Dx]} in any float dtype, or MXFP4-packed in the
    checkpoint's or the kernel's layout (see k3jax.quant), dequantised here (bit-identically for both).

    expected_rows: the assignments the caller expects to keep (an expert-parallel rank's share), a tiling hint for
    the Pallas backends (moe_gemm.moe_grouped_mlp); no effect on any result, unused here.
    """
    n, k = ids.shape
    experts = dequantize_experts(experts, x.dtype)
    x = x[:, :experts["gate"].shape[1]]
    flat = ids.reshape(-1)
    # assignments grouped by expert; dropped ones (id < 0) last, in no group (ragged_dot gives their rows zeros)
    flat = jnp.where(flat < 0, cfg.num_experts, flat)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)  # drops the value E
    xs = x[token]  # [N*k, Dx]

    def grouped(lhs, w):
        return jax.lax.ragged_dot(lhs, w.astype(lhs.dtype), group_sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)

    h = glu_activation(grouped(xs, experts["gate"]), grouped(xs, experts["up"]), cfg)
    kept = flat[order] < cfg.num_experts
    y = grouped(h, experts["down"]).astype(jnp.float32) * jnp.where(kept, weights.reshape(-1)[order], 0)[:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(y).astype(x.dtype)


def _grouped_experts_pallas(x: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict, cfg: ModelConfig,
                            *, interpret: bool, expected_rows: int | None = None) -> jax.Array:
    """`grouped_experts_reference` on the Pallas grouped GEMM (MXFP4 entries stay packed and are decoded in
    the kernel: fastest in the kernel layout, load_pretrained(experts="kernel"))."""
    return moe_gemm.moe_grouped_mlp(
        x, ids, weights, experts, activation="silu" if cfg.hidden_act == "silu" else "situ",
        situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta, expected_rows=expected_rows,
        combine="auto" if COMBINE_KERNEL else "xla", interpret=interpret,
    )


backend.register("moe_experts", "pallas")(partial(_grouped_experts_pallas, interpret=False))
backend.register("moe_experts", "interpret")(partial(_grouped_experts_pallas, interpret=True))


@backend.register("moe_out_input", "reference")
def out_input_reference(fused: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict,
                        latent_norm: jax.Array | None, cfg: ModelConfig, *, backend_name: str = "reference",
                        expected_rows: int | None = None) -> jax.Array:
    """FUSED_OUT's input [N, Dl + I_sh] = [RMSNorm(sum_i w_i E_i(z)) | GLU(shared gate, shared up)] from FUSED_IN's
    output `fused` [N, Dl + 2 I_sh] (z its first Dl columns, the shared gate and up the next two blocks), the
    experts on `backend_name`'s "moe_experts". latent_norm None: no latent RMSNorm (cfg.moe_latent_norm off)."""
    y = backend.get("moe_experts", backend_name)(fused, ids, weights, experts, cfg, expected_rows=expected_rows)
    return _norm_and_join(y, fused, latent_norm, cfg)


def _norm_and_join(y: jax.Array, fused: jax.Array, latent_norm: jax.Array | None, cfg: ModelConfig) -> jax.Array:
    """[RMSNorm(y) | GLU of `fused`'s shared gate and up columns]: the routed sum y [N, Dl] and FUSED_IN's output."""
    latent, width = cfg.moe_latent_size, cfg.shared_intermediate_size
    if latent_norm is not None:
        y = rms_norm(y, latent_norm, cfg.rms_norm_eps)
    h_shared = glu_activation(fused[:, latent:latent + width], fused[:, latent + width:latent + 2 * width], cfg)
    return jnp.concatenate([y, h_shared], axis=-1)


def _out_input_pallas(fused: jax.Array, ids: jax.Array, weights: jax.Array, experts: dict,
                      latent_norm: jax.Array | None, cfg: ModelConfig, *, interpret: bool,
                      expected_rows: int | None = None) -> jax.Array:
    """`out_input_reference` as two grouped-GEMM kernels and one combine kernel (pallas_kernels/moe_combine.py):
    the experts' weighted rows are summed, normed and joined by the shared GLU in one pass instead of XLA's fusion
    of the same (k3-small decode on the H200, 2026-12-04: 2.96 against 9.09 us a layer). Where the kernel is not
    the faster (`moe_combine.supported`: K3's widths, whose 16 x 3584 values a token one program sums serially) or
    does not tile the widths, and with COMBINE_KERNEL = False, XLA combines the same rows."""
    latent, width = cfg.moe_latent_size, cfg.shared_intermediate_size
    activation = "silu" if cfg.hidden_act == "silu" else "situ"
    rows = moe_gemm.moe_grouped_rows(fused, ids, weights, experts, activation=activation, situ_beta=cfg.situ_beta,
                                     situ_linear_beta=cfg.situ_linear_beta, expected_rows=expected_rows,
                                     interpret=interpret)
    if not COMBINE_KERNEL or not moe_combine.supported(latent, width, kept_per_token=ids.shape[1],
                                                       slices=rows.shape[0], interpret=interpret):
        return _norm_and_join(moe_gemm.combine_rows(rows, ids, latent).astype(fused.dtype), fused, latent_norm, cfg)
    return moe_combine.moe_combine(rows, ids, k_dim=latent, dtype=fused.dtype, norm_weight=latent_norm,
                                   eps=cfg.rms_norm_eps, shared=fused, shared_columns=(latent, latent + width, width),
                                   activation=activation, situ_beta=cfg.situ_beta,
                                   situ_linear_beta=cfg.situ_linear_beta, interpret=interpret)


backend.register("moe_out_input", "pallas")(partial(_out_input_pallas, interpret=False))
backend.register("moe_out_input", "interpret")(partial(_out_input_pallas, interpret=True))


def fuse_moe_weights(layer_params: dict, cfg: ModelConfig) -> dict:
    """One MoE layer's params with its x-side GEMMs fused, for serving (a load-time transform; fewer kernels per
    decode step, each ~8 us of host launch time on the H200). Other layers' params are returned unchanged.

    FUSED_IN: latent_down and the shared expert's gate and up all multiply the same bf16 x -> one GEMM on their
    column concatenation (each output column is the same dot product as before). FUSED_OUT (K3: latent MoE with
    shared experts): latent_up and the shared down are one GEMM on [RMSNorm(y_lat) | GLU(shared)] with the rows
    stacked, so the two branches are summed in the fp32 accumulator instead of as two bf16 results (one rounding
    instead of three). The originals are dropped; `moe` splits by the config's widths (static slices). Training,
    checkpoints and k3jax/parallel keep the unfused structure; `moe` takes both.
    """
    if "router" not in layer_params or FUSED_IN in layer_params:
        return layer_params
    latent, shared = bool(cfg.moe_latent_size), bool(cfg.num_shared_experts)
    p = dict(layer_params)
    pieces = ([p["latent_down"]] if latent else []) + ([p["shared"]["gate"], p["shared"]["up"]] if shared else [])
    if len(pieces) < 2 or any(getattr(w, "ndim", None) != 2 or w.dtype != pieces[0].dtype for w in pieces):
        return layer_params  # nothing to fuse (or non-array weights): the unfused layer is already right
    xp = np if all(isinstance(w, np.ndarray) for w in pieces) else jnp
    p[FUSED_IN] = xp.concatenate(pieces, axis=1)
    p.pop("latent_down", None)
    shared_params = dict(p.pop("shared")) if shared else {}
    shared_params.pop("gate", None)
    shared_params.pop("up", None)
    if latent and shared and p["latent_up"].dtype == shared_params["down"].dtype:
        p[FUSED_OUT] = xp.concatenate([p.pop("latent_up"), shared_params.pop("down")], axis=0)
    if shared_params:
        p["shared"] = shared_params  # {"down"}: the shared expert's down GEMM stays separate
    return p


def _x_projections(params: dict, xf: jax.Array, cfg: ModelConfig, matmul=dense):
    """(z, shared gate, shared up) of tokens xf [N, D]: z the experts' input in its first columns (latent_down x,
    or x itself without a latent), the other two None without shared experts; one GEMM on FUSED_IN when the
    params have it."""
    if FUSED_IN not in params:
        z = matmul(xf, params["latent_down"]) if cfg.moe_latent_size else xf
        if not cfg.num_shared_experts:
            return z, None, None
        return z, matmul(xf, params["shared"]["gate"]), matmul(xf, params["shared"]["up"])
    fused = matmul(xf, params[FUSED_IN])
    latent = cfg.moe_latent_size if cfg.moe_latent_size else 0
    # z is the whole fused output: the experts read its first `latent` columns in place (no slice copy before
    # the Pallas kernels; see grouped_experts_reference)
    z = fused if latent else xf
    if not cfg.num_shared_experts:
        return z, None, None
    width = cfg.shared_intermediate_size
    if fused.shape[1] != latent + 2 * width:
        raise ValueError(f"{FUSED_IN} has {fused.shape[1]} columns; the config's layout needs {latent} + 2 x {width}")
    return z, fused[:, latent:latent + width], fused[:, latent + width:]


def moe(params: dict, x: jax.Array, cfg: ModelConfig, *, backend_name: str = "reference") -> jax.Array:
    """Latent MoE + shared experts on pre-normed x [..., D]; params unfused or from `fuse_moe_weights`."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    ids, weights = route(params["router"], params["router_bias"], xf, cfg, backend_name=backend_name)
    matmul = backend.get("dense", backend_name)
    z, shared_gate, shared_up = _x_projections(params, xf, cfg, matmul)
    if FUSED_OUT in params:  # latent + shared experts, fused: z is FUSED_IN's whole output, whose shared gate and
        # up columns moe_out_input reads itself (the slices above go unused here and vanish under jit)
        norm = params["latent_norm"] if cfg.moe_latent_norm else None
        hidden = backend.get("moe_out_input", backend_name)(z, ids, weights, params["experts"], norm, cfg)
        return matmul(hidden, params[FUSED_OUT]).reshape(shape)
    y = backend.get("moe_experts", backend_name)(z, ids, weights, params["experts"], cfg)
    if cfg.moe_latent_size and cfg.moe_latent_norm:
        y = rms_norm(y, params["latent_norm"], cfg.rms_norm_eps)
    if cfg.moe_latent_size:
        y = matmul(y, params["latent_up"])
    if cfg.num_shared_experts:
        y = y + matmul(glu_activation(shared_gate, shared_up, cfg), params["shared"]["down"])
    return y.reshape(shape)


def ffn(params: dict, x: jax.Array, cfg: ModelConfig, *, backend_name: str = "reference") -> jax.Array:
    """The layer's feed-forward: `moe` if the layer has one, else the dense gated MLP."""
    if "router" in params:
        return moe(params, x, cfg, backend_name=backend_name)
    return mlp(params, x, cfg, matmul=backend.get("dense", backend_name))
