"""Torch side of the parity tests: public reference implementations, run on numpy inputs.

This file imports torch, transformers, einops and fla-core's *naive* files only -- never jax or k3jax -- so
it can run in a different interpreter from the tests (see parity_util.py: the CPU torch wheel is built for
another Python than the project's venv). Each `job_*` function takes a dict of numpy arrays plus keyword
options and returns a dict of numpy arrays. Command line (used by parity_util's subprocess runner):

    python torch_ref_jobs.py JOB in.npz out.npz          (options travel as JSON in in.npz["__opts__"])
    python torch_ref_jobs.py --serve                      (the same for each JSON [JOB, in.npz, out.npz] line of stdin)

References used (versions pinned in the report / test extras):
* transformers 5.24.0 `models/kimi_linear/modeling_kimi_linear.py`: KimiLinearForCausalLM, the torch KDA
  chunk / recurrent functions, KimiLinearAttention (NoPE MLA), KimiLinearForgetGate, KimiLinearTopkRouter,
  KimiLinearRMSNormGated.
* transformers 5.24.0 `models/glm5_next/modeling_glm5_next.py`: Glm5NextTextForgetGate (lower-bound gate) and
  Glm5NextTextLinearAttention (a KDA layer with the lower-bound gate).
* fla-core 0.6.0 `fla/ops/kda/naive.py` (naive_recurrent_kda, naive_chunk_kda), `fla/ops/attnres/naive.py`
  (naive_attnres), loaded by file path so that neither fla's package __init__ nor triton is imported; the two
  gate references of `fla/ops/kda/gate.py` (naive_kda_gate, naive_kda_lowerbound_gate) are taken out of that
  file's syntax tree, because the module itself imports triton at top level.
* SiTU-GLU: the formula of K3's public `SituAndMul` (modeling_kimi_linear.py of moonshotai/Kimi-K3, rev c5d1dd4),
  typed here as the one-line expression it is.

transformers switches its KDA / conv functions to fla's Triton kernels when fla imports; `_kimi_linear()`
and `_glm5_next()` re-point those module globals at the torch functions (`inspect.unwrap`), so the torch path
runs whether or not fla (and triton) are installed.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

torch.set_grad_enabled(False)

_KERNEL_FUNCS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update")


def _torch_path(module):
    for name in _KERNEL_FUNCS:
        setattr(module, name, inspect.unwrap(getattr(module, name)))
    return module


def _kimi_linear():
    from transformers.models.kimi_linear import modeling_kimi_linear

    return _torch_path(modeling_kimi_linear)


def _glm5_next():
    from transformers.models.glm5_next import modeling_glm5_next

    return _torch_path(modeling_glm5_next)


def _fla_file(*parts: str) -> Path:
    spec = importlib.util.find_spec("fla")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla-core is not installed")
    return Path(list(spec.submodule_search_locations)[0], *parts)


def _load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fla_kda_naive():
    return _load_by_path("_fla_kda_naive", _fla_file("ops", "kda", "naive.py"))


def _fla_attnres_naive():
    return _load_by_path("_fla_attnres_naive", _fla_file("ops", "attnres", "naive.py"))


def _fla_gate_refs() -> types.SimpleNamespace:
    """naive_kda_gate / naive_kda_lowerbound_gate compiled from fla/ops/kda/gate.py's source (no triton)."""
    path = _fla_file("ops", "kda", "gate.py")
    tree = ast.parse(path.read_text())
    wanted = {"naive_kda_gate", "naive_kda_lowerbound_gate"}
    funcs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    if {f.name for f in funcs} != wanted:
        raise ImportError(f"{path} lacks {wanted - {f.name for f in funcs}}")
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(path), "exec"), namespace)
    return types.SimpleNamespace(**{name: namespace[name] for name in wanted})


def _t(x) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()


def _set_linear(module: torch.nn.Linear, w_in_out: np.ndarray) -> None:
    """Our weights are [in, out]; torch Linear stores [out, in]."""
    module.weight.copy_(_t(w_in_out).T)


# ==================================================================================================
# 1. whole model: transformers KimiLinearForCausalLM
# ==================================================================================================


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial random values for every parameter and buffer (fp32), so that no part of the model is
    at an identity-like init: norm gains around 1, A_log = log U(1, 16), dt_bias = softplus^-1 of a
    log-uniform dt, a random router correction bias, uniform short-conv taps, 1/sqrt(fan_in) linears."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda shape: torch.randn(shape, generator=g)
    rand = lambda shape: torch.rand(shape, generator=g)
    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("A_log"):
            value = (1.0 + 15.0 * rand(shape)).log()
        elif name.endswith("dt_bias"):
            dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * rand(shape)).clamp_min(1e-4)
            value = dt + torch.log(-torch.expm1(-dt))
        elif p.ndim == 1:  # RMSNorm gains (decoder, q_a/kv_a, o_norm)
            value = 1.0 + 0.3 * randn(shape)
        elif "conv1d" in name:
            value = (rand(shape) - 0.5) * 2.0 / math.sqrt(shape[-1])
        elif name.endswith("embed_tokens.weight"):
            value = randn(shape)
        else:  # Linear [out, in] and stacked experts [E, out, in]
            value = randn(shape) / math.sqrt(shape[-1])
        p.copy_(value)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * randn(b.shape))


def job_kimi_linear_model(arrays: dict, *, config: dict, seed: int, out_dir: str, max_new_tokens: int) -> dict:
    """Builds a random KimiLinearForCausalLM (fp32, eager attention, eager experts), saves it twice
    (out_dir/default: transformers' default save; out_dir/runtime: save_original_format=False), and returns

    logits<suffix> [B, T, V] for every arrays["tokens<suffix>"] (no cache);
    gen_tokens [B, P + N] and gen_logits [N, B, V] of greedy generation from arrays["prompt"] [B, P]
    with the cache (prefill, then one token per step);
    router_gap: the smallest gap, over every routing decision of both runs, between the k-th and (k+1)-th
    biased expert score (a near-tie would make any two correct implementations disagree).
    """
    from transformers import KimiLinearConfig

    m = _kimi_linear()
    cfg = KimiLinearConfig(**config, dtype="float32")
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = m.KimiLinearForCausalLM(cfg).float().eval()
    model.set_experts_implementation("eager")
    _randomize(model, seed)
    model.save_pretrained(Path(out_dir) / "default")
    model.save_pretrained(Path(out_dir) / "runtime", save_original_format=False)

    gaps = []

    def record_gap(router, args):
        x = args[0].reshape(-1, router.hidden_dim).float()
        scores = F.linear(x, router.weight.float()).sigmoid() + router.e_score_correction_bias
        top = scores.topk(router.top_k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    for module in model.modules():
        if isinstance(module, m.KimiLinearTopkRouter):
            module.register_forward_pre_hook(record_gap)

    out = {}
    for key in sorted(k for k in arrays if k.startswith("tokens")):
        out["logits" + key[len("tokens"):]] = _np(model(input_ids=_t(arrays[key]).long(), use_cache=False).logits)
    prompt = _t(arrays["prompt"]).long()
    gen = model.generate(
        prompt, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
        output_logits=True, return_dict_in_generate=True, pad_token_id=cfg.pad_token_id, eos_token_id=None,
    )
    out["gen_tokens"] = _np(gen.sequences)
    out["gen_logits"] = _np(torch.stack(gen.logits))
    out["router_gap"] = np.array(min(gaps))
    return out


def job_kimi_linear_from_pretrained(arrays: dict, *, model_dir: str) -> dict:
    """transformers' own loader on a directory written by someone else (k3jax.weights.save_pretrained):
    logits of arrays["tokens"], plus what from_pretrained reported as missing / unexpected / mismatched."""
    m = _kimi_linear()
    model, info = m.KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True,
                                                          attn_implementation="eager")
    model.set_experts_implementation("eager")
    model.eval()
    problems = sorted(f"{kind}: {key}" for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
                      for key in info.get(kind, ()))
    logits = model(input_ids=_t(arrays["tokens"]).long(), use_cache=False).logits
    return {"logits": _np(logits), "problems": np.array(json.dumps(problems))}


# ==================================================================================================
# 2. KDA, gates, AttnRes, SiTU, gated norm, router, MLA, KDA layer
# ==================================================================================================


def job_kda(arrays: dict) -> dict:
    """KDA core on raw q, k (before L2 norm), v, log-gate g, post-sigmoid beta and a K-first initial state.

    fla naive refs get q, k normalised with transformers' `l2norm` (eps inside the sqrt, as fla's in-kernel
    norm) and scale=None (K^-1/2); naive_chunk_kda needs T % 64 == 0 and runs when that holds.
    """
    m = _kimi_linear()
    naive = _fla_kda_naive()
    q, k, v, g, beta, s0 = (_t(arrays[n]).float() for n in ("q", "k", "v", "g", "beta", "s0"))
    qn, kn = m.l2norm(q, eps=1e-6), m.l2norm(k, eps=1e-6)
    out = {}
    o, s = naive.naive_recurrent_kda(qn, kn, v, g, beta, scale=None, initial_state=s0.clone(), output_final_state=True)
    out["fla_recurrent_o"], out["fla_recurrent_s"] = _np(o), _np(s)
    if q.shape[1] % 64 == 0:
        o, s = naive.naive_chunk_kda(qn, kn, v, g, beta, scale=None, initial_state=s0.clone(), output_final_state=True,
                                     chunk_size=64)
        out["fla_chunk_o"], out["fla_chunk_s"] = _np(o), _np(s)
    o, s = m.chunk_kimi_delta_attention(q, k, v, g, beta, chunk_size=64, initial_state=s0.clone(),
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    out["hf_chunk_o"], out["hf_chunk_s"] = _np(o), _np(s)
    o, s = m.recurrent_kimi_delta_attention(q, k, v, g, beta, initial_state=s0.clone(), output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    out["hf_recurrent_o"], out["hf_recurrent_s"] = _np(o), _np(s)
    return out


def job_kda_gate(arrays: dict, *, lower_bound: float) -> dict:
    """The forget gate from raw z [.., H, K] (fla refs) and from x through f_a/f_b (transformers modules)."""
    refs = _fla_gate_refs()
    z, a_log, dt_bias = (_t(arrays[n]).float() for n in ("z", "A_log", "dt_bias"))
    h, dk = z.shape[-2:]
    out = {
        "fla_softplus": _np(refs.naive_kda_gate(z, a_log, dt_bias)),
        "fla_lower_bound": _np(refs.naive_kda_lowerbound_gate(z, a_log, dt_bias, lower_bound=lower_bound)),
    }
    x = _t(arrays["x"]).float()
    d = x.shape[-1]
    cfg = types.SimpleNamespace(hidden_size=d, linear_num_heads=h, linear_head_dim=dk, linear_lower_bound=lower_bound)
    kimi = _kimi_linear().KimiLinearForgetGate(cfg)
    glm = _glm5_next().Glm5NextTextForgetGate(cfg)
    for mod in (kimi, glm):
        _set_linear(mod.f_a_proj, arrays["f_a"])
        _set_linear(mod.f_b_proj, arrays["f_b"])
        mod.dt_bias.copy_(dt_bias)
    kimi.A_log.copy_(a_log.view(1, 1, h, 1))
    glm.A_log.copy_(a_log)
    out["hf_kimi_linear_gate"] = _np(kimi(x))
    out["hf_glm5_next_gate"] = _np(glm(x))
    return out


def job_attnres(arrays: dict, *, eps: float) -> dict:
    """fla naive_attnres over sources [S, ..., D] with pseudo-query proj [D] and key-norm gain norm [D];
    plus its fused-output-norm form (output_rms_weight), which is what the next pre-norm computes."""
    naive = _fla_attnres_naive()
    sources = [_t(s).float() for s in arrays["sources"]]
    proj, norm, out_norm = (_t(arrays[n]).float() for n in ("proj", "norm", "out_norm"))
    o, p = naive.naive_attnres(proj, sources, norm, rms_eps=eps, scale=1.0, return_weights=True)
    o_normed = naive.naive_attnres(proj, sources, norm, output_rms_weight=out_norm, rms_eps=eps, scale=1.0)
    return {"mix": _np(o), "probs": _np(p), "mix_normed": _np(o_normed)}


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """K3 SituAndMul (public modeling_kimi_linear.py): beta*tanh(gate/beta)*sigmoid(gate) * [linear_beta*tanh(up/linear_beta)], fp32."""
    gate, up = gate.float(), up.float()
    act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return act * up


def job_situ(arrays: dict, *, beta: float, linear_beta: float | None) -> dict:
    """SiTU-GLU activation and a whole dense SiTU MLP: down(situ(gate x, up x))."""
    gate, up, x = (_t(arrays[n]).float() for n in ("gate", "up", "x"))
    wg, wu, wd = (_t(arrays[n]).float() for n in ("w_gate", "w_up", "w_down"))  # [in, out]
    act = situ_and_mul(gate, up, beta, linear_beta)
    mlp = situ_and_mul(x @ wg, x @ wu, beta, linear_beta) @ wd
    return {"act": _np(act), "mlp": _np(mlp)}


def job_gated_norm(arrays: dict, *, eps: float) -> dict:
    norm = _kimi_linear().KimiLinearRMSNormGated(arrays["weight"].shape[0], eps=eps)
    norm.weight.copy_(_t(arrays["weight"]))
    return {"out": _np(norm(_t(arrays["x"]).float(), _t(arrays["gate"]).float()))}


def job_router(arrays: dict, *, top_k: int, n_group: int, topk_group: int, scaling: float, renormalize: bool) -> dict:
    """KimiLinearTopkRouter (DeepSeek-V3 noaux_tc): returns ids sorted ascending per token and their weights."""
    w, bias = _t(arrays["weight"]).float(), _t(arrays["bias"]).float()
    cfg = types.SimpleNamespace(num_experts_per_tok=top_k, num_local_experts=w.shape[1], hidden_size=w.shape[0],
                                routed_scaling_factor=scaling, n_group=n_group, topk_group=topk_group,
                                norm_topk_prob=renormalize)
    router = _kimi_linear().KimiLinearTopkRouter(cfg)
    router.weight.copy_(w.T)
    router.e_score_correction_bias.copy_(bias)
    _, weights, ids = router(_t(arrays["x"]).float())
    order = ids.argsort(dim=-1)
    return {"ids": _np(ids.gather(1, order)), "weights": _np(weights.gather(1, order))}


def job_gated_mla(arrays: dict, *, config: dict, gated: bool) -> dict:
    """transformers KimiLinearAttention (NoPE MLA, eager, explicit causal mask) with q_lora_rank set, and
    K3's output gate added by hand: o_proj's input is multiplied by sigmoid(x W_g) (a forward pre-hook,
    i.e. exactly between the attention and o_proj, as in K3's KimiMLAAttention)."""
    m = _kimi_linear()
    cfg = types.SimpleNamespace(attention_dropout=0.0, attention_bias=False, num_key_value_heads=config["num_attention_heads"],
                                _attn_implementation="eager", **config)
    attn = m.KimiLinearAttention(cfg, layer_idx=0).eval()
    if cfg.q_lora_rank is not None:
        _set_linear(attn.q_a_proj, arrays["q_a"])
        attn.q_a_layernorm.weight.copy_(_t(arrays["q_a_norm"]))
        _set_linear(attn.q_b_proj, arrays["q_b"])
    else:
        _set_linear(attn.q_proj, arrays["q_proj"])
    _set_linear(attn.kv_a_proj_with_mqa, arrays["kv_a"])
    attn.kv_a_layernorm.weight.copy_(_t(arrays["kv_a_norm"]))
    _set_linear(attn.kv_b_proj, arrays["kv_b"])
    _set_linear(attn.o_proj, arrays["o_proj"])
    x = _t(arrays["x"]).float()
    if gated:
        gate = torch.sigmoid(x @ _t(arrays["g_proj"]).float())
        attn.o_proj.register_forward_pre_hook(lambda mod, args: (args[0] * gate,))
    t = x.shape[1]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    y, _ = attn(x, attention_mask=mask)
    return {"y": _np(y), "q_a_norm_eps": np.array(attn.q_a_layernorm.variance_epsilon if cfg.q_lora_rank else np.nan),
            "kv_a_norm_eps": np.array(attn.kv_a_layernorm.variance_epsilon)}


def job_kda_layer(arrays: dict, *, heads: int, head_dim: int, conv: int, eps: float, lower_bound: float | None) -> dict:
    """A whole KDA attention block on pre-normed x [B, T, D].

    lower_bound set: transformers Glm5NextTextLinearAttention (lower-bound gate) with its low-rank output gate
    replaced by K3's full-rank one (g_a_proj := identity, g_b_proj := g_proj). lower_bound None:
    KimiLinearDeltaAttention (softplus gate, low-rank g_a/g_b).
    """
    x = _t(arrays["x"]).float()
    d = x.shape[-1]
    cfg = types.SimpleNamespace(hidden_size=d, linear_num_heads=heads, linear_head_dim=head_dim, linear_conv_kernel_dim=conv,
                                hidden_act="silu", rms_norm_eps=eps, layer_types=["linear_attention"],
                                linear_lower_bound=lower_bound)
    if lower_bound is not None:
        layer = _glm5_next().Glm5NextTextLinearAttention(cfg, 0)
        layer.g_a_proj = torch.nn.Identity()
        layer.g_b_proj = torch.nn.Linear(d, heads * head_dim, bias=False)
        _set_linear(layer.g_b_proj, arrays["g_proj"])
        layer.forget_gate.A_log.copy_(_t(arrays["A_log"]))
    else:
        layer = _kimi_linear().KimiLinearDeltaAttention(cfg, 0)
        _set_linear(layer.g_a_proj, arrays["g_a"])
        _set_linear(layer.g_b_proj, arrays["g_b"])
        layer.forget_gate.A_log.copy_(_t(arrays["A_log"]).view(1, 1, heads, 1))
    for name in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj"):
        _set_linear(getattr(layer, name), arrays[name])
    _set_linear(layer.forget_gate.f_a_proj, arrays["f_a"])
    _set_linear(layer.forget_gate.f_b_proj, arrays["f_b"])
    layer.forget_gate.dt_bias.copy_(_t(arrays["dt_bias"]))
    # our taps are [W, C] (tap W-1 = current token); torch Conv1d weight is [C, 1, W] over [q | k | v]
    taps = np.concatenate([arrays["q_conv"], arrays["k_conv"], arrays["v_conv"]], axis=1)
    layer.conv1d.weight.copy_(_t(taps.T[:, None, :].copy()))
    layer.o_norm.weight.copy_(_t(arrays["o_norm"]))
    return {"y": _np(layer(x))}


# ==================================================================================================
# 3. a whole K3 model, assembled in torch from the public pieces
# ==================================================================================================


class _GatedMLA(torch.nn.Module):
    """transformers KimiLinearAttention + K3's output gate: o_proj(attn * sigmoid(g_proj x))."""

    def __init__(self, attn, g_proj):
        super().__init__()
        self.attn, self.g_proj = attn, g_proj

    def forward(self, x, mask):
        if self.g_proj is None:
            return self.attn(x, attention_mask=mask)[0]
        gate = torch.sigmoid(self.g_proj(x))
        hook = self.attn.o_proj.register_forward_pre_hook(lambda mod, args: (args[0] * gate,))
        try:
            return self.attn(x, attention_mask=mask)[0]
        finally:
            hook.remove()


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    layer.weight.copy_(w)
    return layer


def _situ_mlp(x, w_gate, w_up, w_down, beta, linear_beta):
    return F.linear(situ_and_mul(F.linear(x, w_gate), F.linear(x, w_up), beta, linear_beta).to(x.dtype), w_down)


def job_k3_model(arrays: dict, *, model_dir: str) -> dict:
    """Logits of arrays["tokens"] [B, T] for a K3 checkpoint directory (kimi_k3 config.json with a
    kimi_linear text_config, `language_model.` tensor names, one safetensors file), computed by a K3 text
    model assembled here from public parts, following the structure of K3's public modeling code
    (KimiDecoderLayer._forward_attn_residual, KimiSparseMoeBlock, KimiMLAAttention, KimiDeltaAttention):

    * KDA: transformers Glm5NextTextLinearAttention (lower-bound gate, torch chunk KDA), its low-rank output
      gate replaced by K3's full-rank g_proj; A_log cut to the real heads (K3 pads it to 128).
    * MLA: transformers KimiLinearAttention (NoPE, q_lora) with K3's sigmoid output gate (_GatedMLA).
    * Router: transformers KimiLinearTopkRouter. Latent MoE (down -> SiTU experts, fp32 sum -> RMSNorm -> up)
      plus full-width shared experts, SiTU-GLU from K3's SituAndMul formula.
    * Block AttnRes: fla naive_attnres at every mix point with K3's layer-indexed bookkeeping; norms are
      transformers KimiLinearRMSNorm (K3's KimiRMSNorm).
    """
    from safetensors.torch import load_file

    kl, g5, attnres = _kimi_linear(), _glm5_next(), _fla_attnres_naive()
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    c = config["text_config"]
    lac = c["linear_attn_config"]
    w = {k.removeprefix("language_model."): v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    d, n_layers, eps = c["hidden_size"], c["num_hidden_layers"], c["rms_norm_eps"]
    mla_layers = {i - 1 for i in lac["full_attn_layers"]}
    heads, head_dim = lac["num_heads"], lac["head_dim"]
    beta, linear_beta = c.get("activation_situ_beta") or 1.0, c.get("activation_situ_linear_beta")
    assert c["hidden_act"] == "situ" and lac["use_full_rank_gate"] and c.get("mla_use_output_gate")
    block = c["attn_res_block_size"]

    def norm(name, size, norm_eps=eps):
        module = kl.KimiLinearRMSNorm(size, eps=norm_eps)
        module.weight.copy_(w[name])
        return module

    kda_cfg = types.SimpleNamespace(hidden_size=d, linear_num_heads=heads, linear_head_dim=head_dim,
                                    linear_conv_kernel_dim=lac["short_conv_kernel_size"], hidden_act="silu",
                                    rms_norm_eps=eps, layer_types=["linear_attention"] * n_layers,
                                    linear_lower_bound=lac["gate_lower_bound"])
    mla_cfg = types.SimpleNamespace(attention_dropout=0.0, attention_bias=False, _attn_implementation="eager",
                                    hidden_size=d, num_attention_heads=c["num_attention_heads"],
                                    num_key_value_heads=c["num_attention_heads"], q_lora_rank=c["q_lora_rank"],
                                    kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
                                    qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"])
    router_cfg = types.SimpleNamespace(num_experts_per_tok=c["num_experts_per_token"], num_local_experts=c["num_experts"],
                                       hidden_size=d, routed_scaling_factor=c["routed_scaling_factor"],
                                       n_group=c["num_expert_group"], topk_group=c["topk_group"],
                                       norm_topk_prob=c["moe_renormalize"])
    assert c["num_experts_per_token"] > 1  # K3 renormalises only for top_k > 1; transformers' router always does

    def kda_layer(l):
        a = f"model.layers.{l}.self_attn."
        layer = g5.Glm5NextTextLinearAttention(kda_cfg, l)
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj"):
            getattr(layer, name).weight.copy_(w[a + name + ".weight"])
        layer.conv1d.weight.copy_(torch.cat([w[a + f"{x}_conv1d.weight"] for x in "qkv"], 0))
        layer.forget_gate.f_a_proj.weight.copy_(w[a + "f_a_proj.weight"])
        layer.forget_gate.f_b_proj.weight.copy_(w[a + "f_b_proj.weight"])
        layer.forget_gate.dt_bias.copy_(w[a + "dt_bias"])
        layer.forget_gate.A_log.copy_(w[a + "A_log"][:heads])
        layer.g_a_proj, layer.g_b_proj = torch.nn.Identity(), _linear(w[a + "g_proj.weight"])
        layer.o_norm.weight.copy_(w[a + "o_norm.weight"])
        return lambda x, mask: layer(x)

    def mla_layer(l):
        a = f"model.layers.{l}.self_attn."
        attn = kl.KimiLinearAttention(mla_cfg, l).eval()
        attn.q_a_proj.weight.copy_(w[a + "q_a_proj.weight"])
        attn.q_a_layernorm.weight.copy_(w[a + "q_a_layernorm.weight"])
        attn.q_b_proj.weight.copy_(w[a + "q_b_proj.weight"])
        for name in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            getattr(attn, name).weight.copy_(w[a + name + ".weight"])
        attn.kv_a_layernorm.weight.copy_(w[a + "kv_a_layernorm.weight"])
        return _GatedMLA(attn, _linear(w[a + "g_proj.weight"]))

    def ffn(l):
        m = f"model.layers.{l}.block_sparse_moe."
        if l < c["first_k_dense_replace"] or l % c["moe_layer_freq"]:
            p = f"model.layers.{l}.mlp."
            return lambda x: _situ_mlp(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"],
                                       beta, linear_beta)
        router = kl.KimiLinearTopkRouter(router_cfg)
        router.weight.copy_(w[m + "gate.weight"])
        router.e_score_correction_bias.copy_(w[m + "gate.e_score_correction_bias"])
        latent_norm = norm(m + "routed_expert_norm.weight", c["routed_expert_hidden_size"])
        experts = [tuple(w[f"{m}experts.{e}.{x}.weight"] for x in ("w1", "w3", "w2")) for e in range(c["num_experts"])]

        def moe(x):
            shape = x.shape
            flat = x.reshape(-1, d)
            _, weights, ids = router(flat)
            z = F.linear(flat, w[m + "routed_expert_down_proj.weight"])
            y = torch.zeros_like(z, dtype=torch.float32)
            for e, (w1, w3, w2) in enumerate(experts):
                tok, slot = torch.where(ids == e)
                if len(tok):
                    y.index_add_(0, tok, _situ_mlp(z[tok], w1, w3, w2, beta, linear_beta).float() * weights[tok, slot, None])
            y = F.linear(latent_norm(y.to(x.dtype)), w[m + "routed_expert_up_proj.weight"])
            shared = _situ_mlp(flat, *(w[f"{m}shared_experts.{x}_proj.weight"] for x in ("gate", "up", "down")), beta, linear_beta)
            return (y + shared).reshape(shape)

        return moe

    layers = []
    for l in range(n_layers):
        p = f"model.layers.{l}."
        layers.append(dict(
            mixer=mla_layer(l) if l in mla_layers else kda_layer(l), ffn=ffn(l),
            input_norm=norm(p + "input_layernorm.weight", d), post_norm=norm(p + "post_attention_layernorm.weight", d),
            attn_res=(w[p + "self_attention_res_proj.weight"], w[p + "self_attention_res_norm.weight"]),
            mlp_res=(w[p + "mlp_res_proj.weight"], w[p + "mlp_res_norm.weight"]),
        ))

    def mix(bank, partial, res):
        proj, gain = res
        return attnres.naive_attnres(proj, [*bank, partial], gain, rms_eps=eps, scale=1.0)

    tokens = _t(arrays["tokens"]).long()
    t = tokens.shape[1]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    prefix_sum = F.embedding(tokens, w["model.embed_tokens.weight"])
    bank = []
    for l, layer in enumerate(layers):  # KimiDecoderLayer._forward_attn_residual
        hidden = mix(bank, prefix_sum, layer["attn_res"]) if bank else prefix_sum
        if l % block == 0:
            bank.append(prefix_sum)
            prefix_sum = None
        a = layer["mixer"](layer["input_norm"](hidden), mask)
        prefix_sum = a if prefix_sum is None else prefix_sum + a
        hidden = mix(bank, prefix_sum, layer["mlp_res"])
        prefix_sum = prefix_sum + layer["ffn"](layer["post_norm"](hidden))
    hidden = mix(bank, prefix_sum, (w["model.output_attn_res_proj.weight"], w["model.output_attn_res_norm.weight"]))
    hidden = norm("model.norm.weight", d)(hidden)
    return {"logits": _np(F.linear(hidden, w["lm_head.weight"])), "bank_size": np.array(len(bank))}


# ==================================================================================================
# command line
# ==================================================================================================


def run_job(name: str, arrays: dict, opts: dict) -> dict:
    fn = globals().get(f"job_{name}")
    if fn is None:
        raise KeyError(f"no torch reference job {name!r}")
    return fn(arrays, **opts)


def _serve() -> int:
    """Jobs from stdin, one JSON [job, in.npz, out.npz] a line, until stdin closes. Each is answered on stdout
    by a line starting with parity_util.JOB_DONE: "ok" (out.npz written) or the job's traceback as JSON."""
    import traceback

    for line in sys.stdin:
        try:
            _main(json.loads(line))
            answer = "ok"
        except Exception:
            answer = json.dumps(traceback.format_exc())
        print(f"\n{_JOB_DONE}{answer}", flush=True)  # on a line of its own, whatever the job printed
    return 0


_JOB_DONE = "K3JAX-TORCH-REF-JOB-DONE "  # parity_util.JOB_DONE (this file imports nothing of the tests)


def _main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        return _serve()
    name, src, dst = argv
    with np.load(src, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files if k != "__opts__"}
        opts = json.loads(str(data["__opts__"]))
    np.savez(dst, **run_job(name, arrays, opts))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
