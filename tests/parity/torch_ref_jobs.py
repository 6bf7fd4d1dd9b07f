"""Torch side of the parity tests: public reference implementations, run on numpy inputs.

This file imports torch, transformers, einops and fla-core's *naive* files only -- never jax or k3jax -- so
it can run in a different interpreter from the tests (see parity_util.py: the CPU torch wheel is built for
another Python than the project's venv). Each `job_*` function takes a dict of numpy arrays plus keyword
options and returns a dict of numpy arrays. Command line (used by parity_util's subprocess runner):

    python torch_ref_jobs.py JOB in.npz out.npz          (options travel as JSON in in.npz["__opts__"])

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
# command line
# ==================================================================================================


def run_job(name: str, arrays: dict, opts: dict) -> dict:
    fn = globals().get(f"job_{name}")
    if fn is None:
        raise KeyError(f"no torch reference job {name!r}")
    return fn(arrays, **opts)


def _main(argv: list[str]) -> int:
    name, src, dst = argv
    with np.load(src, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files if k != "__opts__"}
        opts = json.loads(str(data["__opts__"]))
    np.savez(dst, **run_job(name, arrays, opts))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
