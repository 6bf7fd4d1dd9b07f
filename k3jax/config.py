"""Model configuration: one frozen dataclass for Kimi K3 and Kimi-Linear.

Every architectural difference between K3 and its predecessor Kimi-Linear is a field here, never a code
fork (see ../shared/design/k3-model.md §1):

| field                   | K3                  | Kimi-Linear-48B   |
|-------------------------|---------------------|-------------------|
| kda_gate                | "lower_bound" (-5)  | "softplus"        |
| kda_output_gate_rank    | None (full rank)    | 128 (g_a -> g_b)  |
| mla_output_gate         | True                | False             |
| q_lora_rank             | 1536                | None (direct q)   |
| moe_latent_size / norm  | 3584 / True         | None / False      |
| hidden_act              | "situ"              | "silu" (SwiGLU)   |
| attn_res_block_size     | 12                  | None              |
| routed_scaling_factor   | 1.0                 | 2.446             |
| first_k_dense_replace   | 1                   | 1                 |

Presets live in `configs/models/*.yaml` (field names exactly as below); `ModelConfig.from_hf` reads HF
`config.json` files (see `k3jax/hf_config.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

_GATES = ("lower_bound", "softplus")
_ACTS = ("situ", "silu")
_ROUTER_SCORES = ("sigmoid", "softmax")
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a K3-family model. Layer indices are 0-based."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    mla_layers: tuple[int, ...]  # 0-based indices of gated-MLA layers; every other layer is KDA
    rms_norm_eps: float = 1e-5

    # --- Kimi Delta Attention ------------------------------------------------------------------
    kda_num_heads: int = 96
    kda_head_dim: int = 128  # d_k = d_v
    kda_conv_kernel: int = 4
    kda_gate: str = "lower_bound"  # "lower_bound": g = lb*sigmoid(e^A (z+b)); "softplus": g = -e^A softplus(z+b)
    kda_gate_lower_bound: float = -5.0
    kda_gate_rank: int = 128  # f_a -> f_b bottleneck of the forget gate
    kda_output_gate_rank: int | None = None  # None = full-rank g_proj; else low-rank g_a -> g_b

    # --- gated MLA (NoPE) ----------------------------------------------------------------------
    mla_num_heads: int = 96
    q_lora_rank: int | None = 1536  # None = direct q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # kept as an extra content channel, never rotated
    v_head_dim: int = 128
    mla_output_gate: bool = True
    mla_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm use KimiRMSNorm's default eps

    # --- feed-forward ----------------------------------------------------------------------------
    hidden_act: str = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float | None = 25.0
    intermediate_size: int = 33792  # dense MLP of layers < first_k_dense_replace
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int = 896
    num_experts_per_tok: int = 16
    num_shared_experts: int = 2  # fused into one MLP of width num_shared_experts * moe_intermediate_size
    moe_intermediate_size: int = 3072
    moe_latent_size: int | None = 3584  # None = experts run on the full hidden width
    moe_latent_norm: bool = True
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    router_score: str = "sigmoid"

    # --- Block Attention Residuals ---------------------------------------------------------------
    attn_res_block_size: int | None = 12  # in decoder layers; None = plain residual stream

    # --- embedding / misc ------------------------------------------------------------------------
    tie_word_embeddings: bool = False
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    max_position_embeddings: int = 1_048_576
    dtype: str = "bfloat16"  # parameter / activation dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "mla_layers", tuple(int(i) for i in self.mla_layers))
        problems = []
        if self.kda_gate not in _GATES:
            problems.append(f"kda_gate must be one of {_GATES}, got {self.kda_gate!r}")
        if self.hidden_act not in _ACTS:
            problems.append(f"hidden_act must be one of {_ACTS}, got {self.hidden_act!r}")
        if self.router_score not in _ROUTER_SCORES:
            problems.append(f"router_score must be one of {_ROUTER_SCORES}, got {self.router_score!r}")
        if self.dtype not in _DTYPES:
            problems.append(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for field in ("vocab_size", "hidden_size", "num_layers", "kda_num_heads", "kda_head_dim",
                      "kda_conv_kernel", "mla_num_heads", "kv_lora_rank", "qk_nope_head_dim",
                      "v_head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if getattr(self, field) <= 0:
                problems.append(f"{field} must be positive, got {getattr(self, field)}")
        if self.qk_rope_head_dim < 0:
            problems.append("qk_rope_head_dim must be >= 0")
        if any(not 0 <= i < self.num_layers for i in self.mla_layers):
            problems.append(f"mla_layers {self.mla_layers} out of range for {self.num_layers} layers")
        if len(set(self.mla_layers)) != len(self.mla_layers):
            problems.append("mla_layers has duplicates")
        if self.num_experts_per_tok > self.num_experts:
            problems.append("num_experts_per_tok exceeds num_experts")
        if self.num_experts % self.num_expert_group:
            problems.append("num_experts must divide into num_expert_group groups")
        if not 1 <= self.topk_group <= self.num_expert_group:
            problems.append("topk_group must be in [1, num_expert_group]")
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            problems.append("attn_res_block_size must be positive or null")
        if self.moe_latent_size is None and self.moe_latent_norm:
            problems.append("moe_latent_norm requires moe_latent_size")
        for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, tok) < self.vocab_size:
                problems.append(f"{tok}={getattr(self, tok)} outside vocab of {self.vocab_size}")
        if problems:
            raise ValueError(f"invalid ModelConfig {self.name!r}: " + "; ".join(problems))

    # --- layer bookkeeping ---------------------------------------------------------------------
    def is_mla(self, layer: int) -> bool:
        return layer in self._mla_set

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @cached_property
    def _mla_set(self) -> frozenset[int]:
        return frozenset(self.mla_layers)

    @cached_property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self._mla_set)

    @cached_property
    def mixer_slot(self) -> tuple[int, ...]:
        """For each layer, its index among the layers of its own kind (row in the stacked caches)."""
        kda = {l: i for i, l in enumerate(self.kda_layers)}
        mla = {l: i for i, l in enumerate(sorted(self.mla_layers))}
        return tuple(mla[l] if l in mla else kda[l] for l in range(self.num_layers))

    @property
    def num_kda_layers(self) -> int:
        return self.num_layers - len(self.mla_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.mla_layers)

    @property
    def kda_proj_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the KDA short-conv state: q | k | v, concatenated."""
        return 3 * self.kda_proj_size

    @property
    def mla_q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_cache_dim(self) -> int:
        """Width of one cached MLA token: normalised latent c (kv_lora_rank) | k_pe (rope dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def expert_width(self) -> int:
        """Input/output width of one routed expert (the latent width for latent MoE)."""
        return self.moe_latent_size or self.hidden_size

    # --- loading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {unknown}")
        return cls(**values)

    @classmethod
    def from_hf(cls, config: str | os.PathLike | dict[str, Any], name: str | None = None) -> "ModelConfig":
        """Reads an HF `config.json` (path, directory or parsed dict) of type kimi_linear or kimi_k3."""
        from k3jax.hf_config import model_config_from_hf

        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            with open(path) as f:
                config = json.load(f)
            name = name or path.parent.name
        return model_config_from_hf(config, name=name or "hf-model")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def configs_dir() -> Path:
    """The `configs/` folder of the checkout (override with K3JAX_CONFIG_DIR)."""
    env = os.environ.get("K3JAX_CONFIG_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "configs"


def available_models() -> list[str]:
    return sorted(p.stem for p in (configs_dir() / "models").glob("*.yaml"))


def load_config(name_or_path: str | os.PathLike) -> ModelConfig:
    """Loads a preset by name (`k3`, `k3-tiny`, ...), a YAML file, or an HF config.json / model dir."""
    text = str(name_or_path)
    preset = configs_dir() / "models" / f"{text}.yaml"
    path = Path(text)
    if preset.is_file():
        path = preset
    elif not path.exists():
        raise ValueError(
            f"unknown model {text!r}: not a preset ({', '.join(available_models())}) nor an existing path"
        )
    if path.is_dir() or path.suffix == ".json":
        return ModelConfig.from_hf(path)
    with open(path) as f:
        values = yaml.safe_load(f)
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of ModelConfig fields")
    values.setdefault("name", path.stem)
    return ModelConfig.from_dict(values)
