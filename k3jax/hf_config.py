"""HF `config.json` <-> ModelConfig for Kimi K3 (`kimi_k3`) and Kimi-Linear (`kimi_linear`).

Two layouts of the Kimi-Linear text config exist (both are read; a config may mix them):

(a) the original hub layout, written by Moonshot's remote code (`moonshotai/Kimi-Linear-48B-A3B-Instruct`
    `config.json`, and K3's nested `text_config`, see k3-model.md §1):
      linear_attn_config {full_attn_layers, kda_layers (both 1-based), num_heads, head_dim,
                          short_conv_kernel_size, gate_lower_bound?, use_full_rank_gate?}
      num_attention_heads, q_lora_rank, kv_lora_rank, qk_{nope,rope}_head_dim, v_head_dim, mla_use_nope,
      mla_use_output_gate?, num_experts, num_experts_per_token, num_shared_experts, moe_intermediate_size,
      routed_expert_hidden_size?, latent_moe_use_norm?, moe_renormalize, moe_router_activation_func,
      num_expert_group, topk_group, routed_scaling_factor, first_k_dense_replace, moe_layer_freq,
      intermediate_size, hidden_act, activation_situ_beta?, activation_situ_linear_beta?,
      attn_res_block_size?, model_max_length or max_position_embeddings, ...
(b) the layout the built-in transformers model writes. Read from transformers **5.24.0**
    (`transformers/models/kimi_linear/configuration_kimi_linear.py`; the class is absent from 5.6.2):
      layer_types ["linear_attention" | "full_attention"] per layer, mlp_layer_types ["dense" | "sparse"],
      linear_num_heads, linear_head_dim, linear_conv_kernel_dim, and the `attribute_map` aliases
      n_group -> num_expert_group, num_local_experts -> num_experts, num_experts_per_tok ->
      num_experts_per_token, n_shared_experts -> num_shared_experts, norm_topk_prob -> moe_renormalize,
      max_position_embeddings -> model_max_length. The serialised config holds the right-hand names;
      the left-hand ones are accepted too. That model has no RoPE in MLA (NoPE), no K3 features, a
      softplus gate, a low-rank output gate and a sigmoid router, so mla_use_nope defaults to true
      there. transformers' precedence is followed: linear_attn_config values override linear_*, and
      layer_types overrides linear_attn_config's lists (a disagreement between them is an error).

Mapping notes: K3's forget-gate rank and low-rank output-gate rank are the KDA head_dim (f_a / g_a
output width). `moe_layer_freq` is ignored by transformers 5.x (it reads mlp_layer_types); when both are
present they must agree. Unknown model types, missing required fields and values ModelConfig cannot
express raise ValueError naming the field. `model_config_to_hf` writes a config back in either layout.
"""

from __future__ import annotations

from typing import Any

from k3jax.config import ModelConfig

_MISSING = object()
_DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
                "float": "float32", "float16": "float16", "fp16": "float16", "half": "float16"}
MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm are built without eps in every Kimi implementation


def _get(c: dict, *keys: str, default: Any = _MISSING, where: str = "") -> Any:
    """First present key among `keys` (the canonical name first, then aliases)."""
    for k in keys:
        if k in c:
            return c[k]
    if default is _MISSING:
        raise ValueError(f"HF config{where}: missing required field {keys[0]!r}")
    return default


def _int(value: Any, field: str, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"HF config: field {field!r} must be an integer, got {value!r}")
    return value


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"HF config: field {field!r} must be a boolean, got {value!r}")
    return value


def _token(value: Any, field: str) -> int:
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"HF config: field {field!r} is an empty list")
        value = value[0]
    return _int(value, field)


def _dtype(value: Any) -> str:
    text = str(value).removeprefix("torch.")
    if text not in _DTYPE_NAMES:
        raise ValueError(f"HF config: field 'dtype' has unsupported value {value!r}")
    return _DTYPE_NAMES[text]


def _mla_layers(c: dict, lac: dict | None, num_layers: int) -> tuple[int, ...]:
    from_lac = None
    if lac is not None and ("full_attn_layers" in lac or "kda_layers" in lac or c.get("layer_types") is None):
        full = [_int(i, "linear_attn_config.full_attn_layers") for i in _get(lac, "full_attn_layers", where=".linear_attn_config")]
        kda = [_int(i, "linear_attn_config.kda_layers") for i in _get(lac, "kda_layers", where=".linear_attn_config")]
        for field, ids in (("full_attn_layers", full), ("kda_layers", kda)):
            bad = [i for i in ids if not 1 <= i <= num_layers]
            if bad or len(set(ids)) != len(ids):
                raise ValueError(f"HF config: linear_attn_config.{field} has out-of-range (1-based) or repeated "
                                 f"layers for num_hidden_layers={num_layers}: {ids}")
        overlap = set(full) & set(kda)
        uncovered = set(range(1, num_layers + 1)) - set(full) - set(kda)
        if overlap or uncovered:
            raise ValueError("HF config: linear_attn_config.full_attn_layers / kda_layers must partition layers "
                             f"1..{num_layers}: overlap {sorted(overlap)}, uncovered {sorted(uncovered)}")
        from_lac = tuple(sorted(i - 1 for i in full))
    layer_types = c.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ValueError(f"HF config: field 'layer_types' must list {num_layers} layer types, got {layer_types!r}")
        bad = sorted({t for t in layer_types if t not in ("full_attention", "linear_attention")})
        if bad:
            raise ValueError(f"HF config: field 'layer_types' has unsupported entries {bad}")
        mla = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
        if from_lac is not None and from_lac != mla:
            raise ValueError("HF config: field 'layer_types' disagrees with linear_attn_config.full_attn_layers")
        return mla
    if from_lac is None:
        raise ValueError("HF config: missing required field 'linear_attn_config' (or 'layer_types')")
    return from_lac


def _moe_pattern(c: dict, num_layers: int) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq) from mlp_layer_types and/or the hub fields."""
    fkdr = c.get("first_k_dense_replace")
    freq = c.get("moe_layer_freq")
    fkdr = None if fkdr is None else _int(fkdr, "first_k_dense_replace")
    freq = None if freq is None else _int(freq, "moe_layer_freq")
    if freq is not None and freq <= 0:
        raise ValueError(f"HF config: field 'moe_layer_freq' must be positive, got {freq}")
    types = c.get("mlp_layer_types")
    if types is None:
        return (0 if fkdr is None else fkdr), (1 if freq is None else freq)
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(f"HF config: field 'mlp_layer_types' must list {num_layers} entries, got {types!r}")
    bad = sorted({t for t in types if t not in ("dense", "sparse")})
    if bad:
        raise ValueError(f"HF config: field 'mlp_layer_types' has unsupported entries {bad}")
    sparse = {i for i, t in enumerate(types) if t == "sparse"}
    pattern = lambda k, f: {i for i in range(num_layers) if i >= k and i % f == 0}
    if not sparse:
        derived = (num_layers, 1)
    else:
        k = min(sparse)
        found = [f for f in range(1, num_layers + 1) if pattern(k, f) == sparse]
        if not found:
            raise ValueError("HF config: field 'mlp_layer_types' is not expressible as first_k_dense_replace / "
                             f"moe_layer_freq (MoE at layers {sorted(sparse)})")
        derived = (k, found[0])
    given = (derived[0] if fkdr is None else fkdr, derived[1] if freq is None else freq)
    if pattern(*given) != sparse:
        raise ValueError(f"HF config: field 'mlp_layer_types' disagrees with first_k_dense_replace={fkdr} / "
                         f"moe_layer_freq={freq}")
    return derived


def _text_config(config: dict) -> dict:
    if not isinstance(config, dict):
        raise ValueError(f"HF config must be a mapping, got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type == "kimi_linear":
        return config
    if model_type == "kimi_k3":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("HF config (kimi_k3): missing required field 'text_config'")
        if text.get("model_type", "kimi_linear") != "kimi_linear":
            raise ValueError(f"HF config (kimi_k3): text_config has unsupported field 'model_type' "
                             f"{text.get('model_type')!r}")
        text = dict(text)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "dtype", "torch_dtype"):
            if text.get(key) is None and config.get(key) is not None:
                text[key] = config[key]
        return text
    raise ValueError(f"HF config: unsupported field 'model_type' {model_type!r} (expected 'kimi_linear' or 'kimi_k3')")


def model_config_from_hf(config: dict[str, Any], name: str) -> ModelConfig:
    """ModelConfig of an HF config dict (model_type kimi_linear, or kimi_k3 with a nested text_config)."""
    c = _text_config(config)
    lac = c.get("linear_attn_config")
    if lac is not None and not isinstance(lac, dict):
        raise ValueError(f"HF config: field 'linear_attn_config' must be a mapping, got {lac!r}")
    hub = lac is not None  # layout (a); transformers 5.x defaults apply otherwise
    lac_ = lac or {}

    num_layers = _int(_get(c, "num_hidden_layers"), "num_hidden_layers")
    if num_layers <= 0:
        raise ValueError(f"HF config: field 'num_hidden_layers' must be positive, got {num_layers}")
    mla_layers = _mla_layers(c, lac, num_layers)

    # KDA: linear_attn_config values take precedence over the flat transformers-5.x names.
    def kda_field(lac_key: str, *flat_keys: str) -> int:
        if lac_key in lac_:
            return _int(lac_[lac_key], f"linear_attn_config.{lac_key}")
        for k in flat_keys:
            if k in c:
                return _int(c[k], k)
        missing = f"linear_attn_config.{lac_key}" if hub else flat_keys[0]
        raise ValueError(f"HF config: missing required field {missing!r}")

    kda_heads = kda_field("num_heads", "linear_num_heads")
    head_dim = kda_field("head_dim", "linear_head_dim")
    conv = kda_field("short_conv_kernel_size", "linear_conv_kernel_dim", "linear_conv_kernel_size")
    lower_bound = lac_.get("gate_lower_bound")
    full_rank = lac_.get("use_full_rank_gate") or False
    gate = {"kda_gate": "softplus"}
    if lower_bound is not None:
        if not isinstance(lower_bound, (int, float)) or isinstance(lower_bound, bool) or lower_bound >= 0:
            raise ValueError(f"HF config: field 'linear_attn_config.gate_lower_bound' must be a negative number, "
                             f"got {lower_bound!r}")
        gate = {"kda_gate": "lower_bound", "kda_gate_lower_bound": float(lower_bound)}

    # MLA
    use_nope = _get(c, "mla_use_nope", default=None)
    if use_nope is None and hub:  # Moonshot's remote code defaults to RoPE MLA
        raise ValueError("HF config: field 'mla_use_nope' is missing, and the hub code's default (false) means "
                         "RoPE MLA, which is not supported")
    if use_nope is not None and use_nope is not True:  # transformers 5.x has no field: its MLA is NoPE
        raise ValueError("HF config: field 'mla_use_nope' must be true (RoPE MLA is not supported), "
                         f"got {use_nope!r}")
    mla_heads = _int(_get(c, "num_attention_heads"), "num_attention_heads")
    kv_heads = c.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != mla_heads:
        raise ValueError(f"HF config: field 'num_key_value_heads' ({kv_heads}) must equal num_attention_heads "
                         f"({mla_heads}) for MLA")

    if c.get("attention_bias"):
        raise ValueError("HF config: field 'attention_bias' must be false (biased MLA projections are not supported)")

    # FFN
    act = _get(c, "hidden_act")
    if act not in ("situ", "silu"):
        raise ValueError(f"HF config: field 'hidden_act' must be 'situ' or 'silu', got {act!r}")
    if act == "situ":
        beta = c.get("activation_situ_beta")
        act_fields = {"situ_beta": 1.0 if beta is None else float(beta),
                      "situ_linear_beta": None if c.get("activation_situ_linear_beta") is None
                      else float(c["activation_situ_linear_beta"])}
    else:
        act_fields = {"situ_linear_beta": None}
    fkdr, freq = _moe_pattern(c, num_layers)
    latent = _int(c.get("routed_expert_hidden_size"), "routed_expert_hidden_size", allow_none=True)
    latent_norm = _bool(c.get("latent_moe_use_norm", False), "latent_moe_use_norm")
    if latent_norm and latent is None:
        raise ValueError("HF config: field 'latent_moe_use_norm' is true but 'routed_expert_hidden_size' is missing")
    router = c.get("moe_router_activation_func", "sigmoid")
    if router not in ("sigmoid", "softmax"):
        raise ValueError(f"HF config: field 'moe_router_activation_func' must be 'sigmoid' or 'softmax', got {router!r}")
    attn_res = _int(c.get("attn_res_block_size"), "attn_res_block_size", allow_none=True)

    values: dict[str, Any] = dict(
        name=name,
        vocab_size=_int(_get(c, "vocab_size"), "vocab_size"),
        hidden_size=_int(_get(c, "hidden_size"), "hidden_size"),
        num_layers=num_layers,
        mla_layers=mla_layers,
        rms_norm_eps=float(_get(c, "rms_norm_eps")),
        kda_num_heads=kda_heads,
        kda_head_dim=head_dim,
        kda_conv_kernel=conv,
        **gate,
        kda_gate_rank=head_dim,
        kda_output_gate_rank=None if _bool(full_rank, "linear_attn_config.use_full_rank_gate") else head_dim,
        mla_num_heads=mla_heads,
        q_lora_rank=_int(c.get("q_lora_rank"), "q_lora_rank", allow_none=True),
        kv_lora_rank=_int(_get(c, "kv_lora_rank"), "kv_lora_rank"),
        qk_nope_head_dim=_int(_get(c, "qk_nope_head_dim"), "qk_nope_head_dim"),
        qk_rope_head_dim=_int(_get(c, "qk_rope_head_dim"), "qk_rope_head_dim"),
        v_head_dim=_int(_get(c, "v_head_dim"), "v_head_dim"),
        mla_output_gate=_bool(c.get("mla_use_output_gate", False), "mla_use_output_gate"),
        mla_norm_eps=MLA_NORM_EPS,
        hidden_act=act,
        **act_fields,
        intermediate_size=_int(_get(c, "intermediate_size"), "intermediate_size"),
        first_k_dense_replace=fkdr,
        moe_layer_freq=freq,
        num_experts=_int(_get(c, "num_experts", "num_local_experts", "n_routed_experts"), "num_experts"),
        num_experts_per_tok=_int(_get(c, "num_experts_per_token", "num_experts_per_tok"), "num_experts_per_token"),
        num_shared_experts=_int(_get(c, "num_shared_experts", "n_shared_experts", default=0), "num_shared_experts"),
        moe_intermediate_size=_int(_get(c, "moe_intermediate_size"), "moe_intermediate_size"),
        moe_latent_size=latent,
        moe_latent_norm=latent_norm,
        moe_renormalize=_bool(_get(c, "moe_renormalize", "norm_topk_prob", default=True), "moe_renormalize"),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        num_expert_group=_int(_get(c, "num_expert_group", "n_group", default=1), "num_expert_group"),
        topk_group=_int(c.get("topk_group") or 1, "topk_group"),
        router_score=router,
        attn_res_block_size=attn_res,
        tie_word_embeddings=_bool(c.get("tie_word_embeddings", False), "tie_word_embeddings"),
    )
    for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if c.get(tok) is not None:
            values[tok] = _token(c[tok], tok)
    max_pos = _get(c, "max_position_embeddings", "model_max_length", default=None)
    if max_pos is not None:
        values["max_position_embeddings"] = _int(max_pos, "max_position_embeddings")
    dtype = _get(c, "dtype", "torch_dtype", default=None)
    if dtype is not None:
        values["dtype"] = _dtype(dtype)
    return ModelConfig(**values)


# --------------------------------------------------------------------------------------------------
# ModelConfig -> HF config.json
# --------------------------------------------------------------------------------------------------


def _check_expressible(cfg: ModelConfig, layout: str) -> None:
    problems = []
    if cfg.kda_gate_rank != cfg.kda_head_dim:
        problems.append(f"kda_gate_rank={cfg.kda_gate_rank} must equal kda_head_dim={cfg.kda_head_dim}")
    if cfg.kda_output_gate_rank not in (None, cfg.kda_head_dim):
        problems.append(f"kda_output_gate_rank={cfg.kda_output_gate_rank} must be null or kda_head_dim")
    if cfg.mla_norm_eps != MLA_NORM_EPS:
        problems.append(f"mla_norm_eps={cfg.mla_norm_eps} is fixed at {MLA_NORM_EPS} in HF configs")
    if layout == "transformers":
        k3_only = {
            "kda_gate": cfg.kda_gate != "softplus",
            "kda_output_gate_rank": cfg.kda_output_gate_rank is None,
            "mla_output_gate": cfg.mla_output_gate,
            "hidden_act": cfg.hidden_act != "silu",
            "moe_latent_size": cfg.moe_latent_size is not None,
            "attn_res_block_size": cfg.attn_res_block_size is not None,
            "router_score": cfg.router_score != "sigmoid",
        }
        problems += [f"{k} (K3 feature) has no transformers-5.x kimi_linear field" for k, bad in k3_only.items() if bad]
    if problems:
        raise ValueError(f"ModelConfig {cfg.name!r} cannot be written as an HF {layout} config: " + "; ".join(problems))


def _hub_text_config(cfg: ModelConfig) -> dict[str, Any]:
    full = [l + 1 for l in sorted(cfg.mla_layers)]
    lac: dict[str, Any] = {
        "full_attn_layers": full,
        "head_dim": cfg.kda_head_dim,
        "kda_layers": [l + 1 for l in cfg.kda_layers],
        "num_heads": cfg.kda_num_heads,
        "short_conv_kernel_size": cfg.kda_conv_kernel,
    }
    if cfg.kda_gate == "lower_bound":
        lac["gate_lower_bound"] = cfg.kda_gate_lower_bound
    if cfg.kda_output_gate_rank is None:
        lac["use_full_rank_gate"] = True
    c: dict[str, Any] = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.mla_num_heads,
        "num_key_value_heads": cfg.mla_num_heads,
        "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "linear_attn_config": lac,
        "hidden_act": cfg.hidden_act,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": cfg.mla_output_gate,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_tok,
        "num_shared_experts": cfg.num_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "moe_router_activation_func": cfg.router_score,
        "moe_renormalize": cfg.moe_renormalize,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": cfg.moe_layer_freq,
        "use_grouped_topk": True,
        "num_expert_group": cfg.num_expert_group,
        "topk_group": cfg.topk_group,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": cfg.dtype,
    }
    if cfg.hidden_act == "situ":
        c["activation_situ_beta"] = cfg.situ_beta
        c["activation_situ_linear_beta"] = cfg.situ_linear_beta
    if cfg.moe_latent_size is not None:
        c["routed_expert_hidden_size"] = cfg.moe_latent_size
        c["latent_moe_use_norm"] = cfg.moe_latent_norm
    if cfg.attn_res_block_size is not None:
        c["attn_res_block_size"] = cfg.attn_res_block_size
    return c


def _transformers_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.mla_num_heads,
        "num_key_value_heads": cfg.mla_num_heads,
        "layer_types": ["full_attention" if cfg.is_mla(l) else "linear_attention" for l in range(cfg.num_layers)],
        "mlp_layer_types": ["sparse" if cfg.is_moe(l) else "dense" for l in range(cfg.num_layers)],
        "linear_num_heads": cfg.kda_num_heads,
        "linear_head_dim": cfg.kda_head_dim,
        "linear_conv_kernel_dim": cfg.kda_conv_kernel,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_head_dim": cfg.mla_q_head_dim,
        "head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_tok,
        "num_shared_experts": cfg.num_shared_experts,
        "moe_renormalize": cfg.moe_renormalize,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "num_expert_group": cfg.num_expert_group,
        "topk_group": cfg.topk_group,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "model_max_length": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": cfg.dtype,
    }


def model_config_to_hf(cfg: ModelConfig, layout: str = "k3") -> dict[str, Any]:
    """HF config.json dict for `cfg`, inverse of `model_config_from_hf` (the name is not stored).

    layout: "k3" (top-level kimi_k3 with a hub-layout text_config), "kimi_linear" (flat hub layout, as
    Kimi-Linear-48B), or "transformers" (transformers-5.x kimi_linear fields; Kimi-Linear features only).
    """
    if layout not in ("k3", "kimi_linear", "transformers"):
        raise ValueError(f"unknown HF config layout {layout!r}")
    _check_expressible(cfg, layout)
    if layout == "transformers":
        return _transformers_config(cfg)
    text = _hub_text_config(cfg)
    if layout == "kimi_linear":
        return text
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype": cfg.dtype,
        "text_config": text,
    }
