"""Capacity planner: per-GPU memory and per-layer communication of a config under a parallel strategy.

    budget = plan(load_config("k3"), Deployment(strategy="dep", gpus=16, tp=4))
    budget.weights_gb, budget.cache_per_request_gb, budget.requests_per_gpu, budget.comm_per_layer

    k3jax plan --model k3 --strategy dep --gpus 16 --tp 4 --context 200000      (the CLI, same numbers)

Weights are counted from the model's own parameter tree (`jax.eval_shape` of `k3jax.params.init_params`,
so every tensor the model has is counted and nothing else), each tensor assigned to a class and a storage
format. Units: GB = 1e9 bytes (the published tables use decimal GB / TB).

Assumptions the published K3 DEP16 budget needs (reproduced in tests/parallel/test_plan.py):
  - formats: routed experts NVFP4; the attention projection matrices (KDA q/k/v/g/o/b/f_a/f_b, MLA
    q_a/q_b/kv_a/kv_b/g/o) FP8; everything else BF16 -- shared experts, the latent down/up projections,
    the router, layer 0's dense MLP, embedding and lm_head, norms and small vectors.
  - NVFP4 = 4-bit E2M1 values + one FP8 E4M3 scale per 16 values (0.5625 B/param; the per-tensor fp32
    scale is negligible). MXFP4 = 4-bit values + one E8M0 scale per 32 (0.53125 B/param). FP8 = 1 B/param
    with one fp32 scale per 128x128 block (DeepSeek-style block scaling; 0.02% extra).
  - TP subgroups of T ranks inside DEP shard by 1/T the attention projections between the hidden state
    and the heads -- those that read the all-gathered hidden state x with a per-head output (KDA q/k/v/g,
    MLA g, and q when there is no q LoRA) and the o_proj back to it -- and the shared experts. The low-rank
    / small projections (KDA b/f_a/f_b, MLA q_a/kv_a and the latent-side q_b/kv_b), latent down/up, router
    and embeddings stay replicated. This gives 128.84 GB for the published 128.53 GB (+0.26%); adding
    q_b/kv_b would give 128.10 GB (-0.3%) and 37 instead of the published 36 requests.
  - cache per request: MLA latents (kv_lora_rank + qk_rope_head_dim per token and MLA layer) in FP8 for the
    target and for the drafter (the K3 drafter is one K3 MLA layer: one more layer of latents), plus
    `kda_checkpoints` copies of the KDA state (recurrent H*K*K and conv (W-1)*3*H*K per KDA layer) in BF16.
    200k tokens = 200,000 tokens.
  - the drafter's weights (6.03 GB published) and the workspace (40 GB) are inputs, not derived.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from functools import lru_cache

import jax
import numpy as np

from k3jax.config import ModelConfig, load_config

GB = 1e9

# bytes per parameter of each storage format (see the module docstring for the scale layouts)
FORMAT_BYTES = {
    "nvfp4": 0.5 + 1 / 16,
    "mxfp4": 0.5 + 1 / 32,
    "fp8": 1 + 4 / (128 * 128),
    "bf16": 2.0,
    "fp32": 4.0,
}
KV_FORMAT_BYTES = {"fp8": 1.0, "bf16": 2.0, "fp32": 4.0}

WEIGHT_CLASSES = ("routed_experts", "attention", "shared_experts", "latent_proj", "router", "dense_mlp",
                  "embeddings", "other")
STRATEGIES = ("tep", "dep", "dwdp", "dcp")
# The published TP selection: per mixer kind, the attention projections that TP subgroups split 1/T (see the
# module docstring). Defined once: the planner counts these, k3jax.parallel.tp_subgroup shards and runs them.
# "column": GEMMs reading the hidden state, output columns split (all-gather, column GEMM, all-to-all back);
# "row": GEMMs writing it, input rows split (all-to-all of the input columns, GEMM, partial sums back).
TP_COLUMN_PROJECTIONS = {"kda": ("q_proj", "k_proj", "v_proj", "g_proj"), "mla": ("q_proj", "g_proj")}
TP_ROW_PROJECTIONS = {"kda": ("o_proj",), "mla": ("o_proj",)}


@dataclass(frozen=True)
class Formats:
    """Storage format of each weight class (keys of FORMAT_BYTES). Default: the published K3 deployment."""

    routed_experts: str = "nvfp4"
    attention: str = "fp8"
    shared_experts: str = "bf16"
    latent_proj: str = "bf16"
    router: str = "bf16"
    dense_mlp: str = "bf16"
    embeddings: str = "bf16"
    other: str = "bf16"

    def __post_init__(self) -> None:
        for name in WEIGHT_CLASSES:
            if getattr(self, name) not in FORMAT_BYTES:
                raise ValueError(f"format of {name}: {getattr(self, name)!r} is not one of {sorted(FORMAT_BYTES)}")


@dataclass(frozen=True)
class Deployment:
    """A strategy on a GPU count, and the per-GPU memory it must fit in.

    strategy: tep | dep | dwdp | dcp (see k3jax/parallel); tp: TP-subgroup size inside DEP (1 = none);
    hbm_gb: memory per GPU; workspace_gb: activations / compiler scratch reserved; drafter_gb: drafter
    weights (replicated); context: tokens per request; kv_format: MLA latent cache format; kda_checkpoints:
    KDA state copies per request (live + speculative rollback); kda_state_format; drafter_kv_layers: MLA
    layers of the drafter; tokens_per_rank: tokens a rank holds in one step (communication estimate);
    act_bytes: activation bytes on the wire.
    """

    strategy: str = "dep"
    gpus: int = 16
    tp: int = 1
    hbm_gb: float = 298.01
    workspace_gb: float = 40.0
    drafter_gb: float = 6.03
    context: int = 200_000
    kv_format: str = "fp8"
    kda_checkpoints: int = 2
    kda_state_format: str = "bf16"
    drafter_kv_layers: int = 1
    tokens_per_rank: int = 1
    act_bytes: int = 2
    formats: Formats = field(default_factory=Formats)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r} is not one of {STRATEGIES}")
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if self.tp < 1 or self.gpus % self.tp:
            raise ValueError(f"tp={self.tp} must be >= 1 and divide gpus={self.gpus}")
        if self.tp > 1 and self.strategy != "dep":
            raise ValueError("TP subgroups are a DEP option (strategy='dep')")
        if self.kv_format not in KV_FORMAT_BYTES or self.kda_state_format not in KV_FORMAT_BYTES:
            raise ValueError(f"kv_format / kda_state_format must be one of {sorted(KV_FORMAT_BYTES)}")
        if self.context < 0 or self.kda_checkpoints < 0 or self.drafter_kv_layers < 0 or self.tokens_per_rank < 1:
            raise ValueError("context, kda_checkpoints, drafter_kv_layers must be >= 0 and tokens_per_rank >= 1")


@dataclass(frozen=True)
class Budget:
    """Per-GPU memory (GB) and per-layer communication (bytes per rank) of a deployment."""

    weights_by_class_gb: dict
    weights_gb: float
    drafter_gb: float
    workspace_gb: float
    free_gb: float
    cache_per_request_gb: float  # whole request (all ranks holding a piece of it together)
    cache_per_request_per_gpu_gb: float
    requests_per_gpu: int
    comm_per_layer: dict  # {collective: bytes one rank sends per layer}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _classify(path: tuple[str, ...], layer: int | None, cfg: ModelConfig) -> tuple[str, bool]:
    """(weight class, sharded by TP subgroups) of one parameter."""
    if layer is None:
        return ("embeddings" if path[0] in ("embed", "lm_head") else "other"), False
    top, name = path[0], path[-1]
    if top == "attn":
        if len(path) == 2 and name in ("A_log", "dt_bias", "o_norm", "q_a_norm", "kv_a_norm") or "conv" in name:
            return "other", False
        kind = "mla" if cfg.is_mla(layer) else "kda"
        return "attention", name in TP_COLUMN_PROJECTIONS[kind] + TP_ROW_PROJECTIONS[kind]
    if top == "mlp":
        if not cfg.is_moe(layer):
            return "dense_mlp", False
        if path[1] == "experts":
            return "routed_experts", False
        if path[1] == "shared":
            return "shared_experts", True
        if path[1] in ("latent_down", "latent_up"):
            return "latent_proj", False
        if path[1] in ("router", "router_bias"):
            return "router", False
    return "other", False


@lru_cache(maxsize=16)
def param_counts(cfg: ModelConfig) -> dict[tuple[str, bool], int]:
    """{(class, TP-sharded): parameter count} of the model's parameter tree (shapes only, nothing built)."""
    from k3jax.params import init_params

    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    counts: dict[tuple[str, bool], int] = {}

    def add(key, leaf):
        counts[key] = counts.get(key, 0) + int(np.prod(leaf.shape))

    for name, value in shapes.items():
        if name != "layers":
            for _, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
                add(_classify((name,), None, cfg), leaf)
    for l, lp in enumerate(shapes["layers"]):
        for path, leaf in jax.tree_util.tree_flatten_with_path(lp)[0]:
            add(_classify(tuple(str(getattr(p, "key", p)) for p in path), l, cfg), leaf)
    return counts


def routed_expert_bytes_per_layer(cfg: ModelConfig, formats: Formats) -> float:
    """Bytes of one MoE layer's routed experts (all E of them)."""
    return cfg.num_experts * 3 * cfg.expert_width * cfg.moe_intermediate_size * FORMAT_BYTES[formats.routed_experts]


def weights_per_gpu(cfg: ModelConfig, dep: Deployment) -> dict[str, float]:
    """Bytes per GPU of each weight class. Routed experts are split over all GPUs (every strategy stores
    1/n of them; DWDP adds two prefetch buffers of one layer's remote experts); TEP also splits attention,
    shared experts and the dense MLP by n; DEP with TP subgroups splits the TP-selected tensors by T."""
    n = dep.gpus
    out = {c: 0.0 for c in WEIGHT_CLASSES}
    for (cls, tp_sharded), count in param_counts(cfg).items():
        nbytes = count * FORMAT_BYTES[getattr(dep.formats, cls)]
        if cls == "routed_experts":
            nbytes /= n
        elif dep.strategy == "tep" and cls in ("attention", "shared_experts", "dense_mlp"):
            nbytes /= n
        elif tp_sharded:
            nbytes /= dep.tp
        out[cls] += nbytes
    if dep.strategy == "dwdp":  # two alternating buffers, each one MoE layer's experts owned by the peers
        out["routed_experts"] += 2 * (n - 1) / n * routed_expert_bytes_per_layer(cfg, dep.formats)
    return out


def cache_parts_per_request(cfg: ModelConfig, dep: Deployment) -> tuple[float, float]:
    """(MLA latent bytes, KDA state bytes) of one request at `dep.context` tokens: target + drafter latents,
    and `kda_checkpoints` copies of the recurrent + conv states."""
    latent = (cfg.num_mla_layers + dep.drafter_kv_layers) * cfg.latent_cache_dim * KV_FORMAT_BYTES[dep.kv_format]
    kda_state = cfg.num_kda_layers * (cfg.kda_num_heads * cfg.kda_head_dim**2 + (cfg.kda_conv_kernel - 1) * cfg.conv_channels)
    return dep.context * latent, dep.kda_checkpoints * kda_state * KV_FORMAT_BYTES[dep.kda_state_format]


def cache_bytes_per_request(cfg: ModelConfig, dep: Deployment) -> float:
    """Cache of one request at `dep.context` tokens: target + drafter MLA latents and the KDA checkpoints."""
    return sum(cache_parts_per_request(cfg, dep))


def cache_bytes_per_request_per_gpu(cfg: ModelConfig, dep: Deployment) -> float:
    """What one GPU holds of a request, as k3jax.parallel lays it out: DEP / DWDP keep a request on its
    rank; DCP splits its MLA pages over the n ranks (KDA states replicated); TEP splits the KDA states by
    head (MLA latents replicated: every rank writes the shared latent)."""
    latent, state = cache_parts_per_request(cfg, dep)
    if dep.strategy == "dcp":
        return latent / dep.gpus + state
    if dep.strategy == "tep":
        return latent + state / dep.gpus
    return latent + state


def comm_per_layer(cfg: ModelConfig, dep: Deployment) -> dict[str, float]:
    """Closed-form bytes one rank sends per MoE layer (bandwidth-optimal algorithms, as k3jax.parallel.comm
    counts wire bytes), B = tokens_per_rank, s = act_bytes, n = gpus, T = tp:

      tep   all-reduce of the n*B tokens after attention (D), routed (latent) and shared experts (D):
            2(n-1)/n * n*B * (2D + Dl) * s
      dep   dispatch + combine all-to-all, deduplicated: <= 2 * B*min(k, n) latent rows (the 2BK bound),
            routing 2k int32 words per dispatched row; with TP subgroups per TP'd GEMM input
            (T-1)*B*D*s all-gather + (T-1)/T*B*D*s all-to-all back (the published per-token table:
            "tp-all-gather" / "tp-all-to-all"), and what a whole layer of the model path sends for its
            TP-selected projections and shared experts ("tp-kda-layer" / "tp-mla-layer": the attention
            projections as k3jax.parallel.tp_subgroup.closed_form_bytes_per_token counts them, plus the
            shared experts' (T-1)*B*D*s gathered in and (T-1)*B*D*s of partial sums back)
      dwdp  all-gather of the next layer's remote expert shards: (n-1)/n * one layer's routed experts;
            no token traffic
      dcp   per MLA layer: the partial latent outputs and log-sum-exps of B queries, merged by all-reduce:
            2(n-1)/n * B * H_mla * (C + 1) * 4 bytes
    """
    n, b, s, t = dep.gpus, dep.tokens_per_rank, dep.act_bytes, dep.tp
    d, dl, k = cfg.hidden_size, cfg.moe_latent_size or cfg.hidden_size, cfg.num_experts_per_tok
    if dep.strategy == "tep":
        return {"all-reduce": 2 * (n - 1) / n * n * b * (2 * d + dl) * s}
    if dep.strategy == "dwdp":
        return {"all-gather": (n - 1) / n * routed_expert_bytes_per_layer(cfg, dep.formats)}
    if dep.strategy == "dcp":
        return {"all-reduce": 2 * (n - 1) / n * b * cfg.mla_num_heads * (cfg.kv_lora_rank + 1) * 4}
    rows = b * min(k, n)
    out = {"all-to-all": 2 * (n - 1) / n * rows * dl * s + (n - 1) / n * rows * 2 * k * 4}
    if t > 1:
        out["tp-all-gather"] = (t - 1) * b * d * s
        out["tp-all-to-all"] = (t - 1) / t * b * d * s
        from k3jax.parallel.tp_subgroup import closed_form_bytes_per_token  # it imports this module's TP lists

        shared = 2 * (t - 1) * b * d * s if cfg.num_shared_experts else 0.0
        for kind, parts in closed_form_bytes_per_token(cfg, t, s).items():
            out[f"tp-{kind}-layer"] = b * (parts["all-gather"] + parts["all-to-all"]) + shared
    return out


def plan(cfg: ModelConfig, dep: Deployment) -> Budget:
    """The per-GPU budget of `cfg` deployed as `dep` (see the module docstring for the assumptions)."""
    by_class = weights_per_gpu(cfg, dep)
    weights = sum(by_class.values())
    free = dep.hbm_gb * GB - weights - dep.drafter_gb * GB - dep.workspace_gb * GB
    per_request = cache_bytes_per_request(cfg, dep)
    per_gpu = cache_bytes_per_request_per_gpu(cfg, dep)
    return Budget(
        weights_by_class_gb={c: v / GB for c, v in by_class.items()},
        weights_gb=weights / GB,
        drafter_gb=dep.drafter_gb,
        workspace_gb=dep.workspace_gb,
        free_gb=free / GB,
        cache_per_request_gb=per_request / GB,
        cache_per_request_per_gpu_gb=per_gpu / GB,
        requests_per_gpu=max(0, math.floor(free / per_gpu)) if per_gpu > 0 else 0,
        comm_per_layer=comm_per_layer(cfg, dep),
    )


def histories_in_pool(cfg: ModelConfig, dep: Deployment, pool_tb: float) -> int:
    """Whole request histories (at dep.context tokens) a shared cache pool of `pool_tb` TB holds."""
    if pool_tb < 0:
        raise ValueError(f"pool_tb must be >= 0, got {pool_tb}")
    return math.floor(pool_tb * 1e12 / cache_bytes_per_request(cfg, dep))


# --- CLI: `k3jax plan` ----------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the `plan` subcommand to the k3jax CLI."""
    p = sub.add_parser("plan", help="per-GPU memory and per-layer communication of a config x strategy x GPUs",
                       description="Capacity planner (k3jax/plan.py). Defaults: the published K3 DEP16 deployment.")
    d = Deployment()
    p.add_argument("--model", default="k3", help="preset name, YAML file or HF config (default k3)")
    p.add_argument("--strategy", default=d.strategy, choices=STRATEGIES)
    p.add_argument("--gpus", type=int, default=d.gpus)
    p.add_argument("--tp", type=int, default=d.tp, help="TP-subgroup size inside DEP")
    for name in ("hbm_gb", "workspace_gb", "drafter_gb"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    for name in ("context", "kda_checkpoints", "drafter_kv_layers", "tokens_per_rank", "act_bytes"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--kv-format", default=d.kv_format, choices=sorted(KV_FORMAT_BYTES))
    p.add_argument("--kda-state-format", default=d.kda_state_format, choices=sorted(KV_FORMAT_BYTES))
    for name in WEIGHT_CLASSES:
        p.add_argument(f"--{name.replace('_', '-')}-format", dest=f"fmt_{name}", default=getattr(d.formats, name),
                       choices=sorted(FORMAT_BYTES))
    p.add_argument("--pool-tb", type=float, default=None, help="also count histories in a shared pool of this size")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(_run=run_plan)


def run_plan(ns: argparse.Namespace) -> int:
    formats = Formats(**{c: getattr(ns, f"fmt_{c}") for c in WEIGHT_CLASSES})
    try:
        dep = Deployment(strategy=ns.strategy, gpus=ns.gpus, tp=ns.tp, hbm_gb=ns.hbm_gb, workspace_gb=ns.workspace_gb,
                         drafter_gb=ns.drafter_gb, context=ns.context, kv_format=ns.kv_format,
                         kda_checkpoints=ns.kda_checkpoints, kda_state_format=ns.kda_state_format,
                         drafter_kv_layers=ns.drafter_kv_layers, tokens_per_rank=ns.tokens_per_rank,
                         act_bytes=ns.act_bytes, formats=formats)
        cfg = load_config(ns.model)
    except ValueError as e:
        print(f"k3jax plan: error: {e}", file=sys.stderr)
        return 2
    budget = plan(cfg, dep)
    result = budget.to_dict()
    if ns.pool_tb is not None:
        result["pool_tb"] = ns.pool_tb
        result["histories_in_pool"] = histories_in_pool(cfg, dep, ns.pool_tb)
    if ns.json:
        print(json.dumps(result, indent=1))
        return 0
    tp = f" TP{dep.tp}" if dep.tp > 1 else ""
    print(f"{cfg.name}: {dep.strategy.upper()}{dep.gpus}{tp}, {dep.hbm_gb:.2f} GB per GPU, context {dep.context:,}")
    print("weights per GPU (GB):")
    for c, v in budget.weights_by_class_gb.items():
        if v:
            print(f"  {c:<16} {getattr(formats, c):<6} {v:9.2f}")
    print(f"  {'total':<23} {budget.weights_gb:9.2f}")
    print(f"drafter {budget.drafter_gb:.2f} GB, workspace {budget.workspace_gb:.2f} GB, free {budget.free_gb:.2f} GB")
    print(f"cache per request {budget.cache_per_request_gb:.3f} GB ({budget.cache_per_request_per_gpu_gb:.3f} GB per GPU)"
          f" -> {budget.requests_per_gpu} requests per GPU")
    print(f"communication per layer and rank ({dep.tokens_per_rank} tokens per rank):")
    for kind, nbytes in budget.comm_per_layer.items():
        print(f"  {kind:<16} {nbytes / 1e6:12.3f} MB")
    if ns.pool_tb is not None:
        print(f"shared pool {ns.pool_tb} TB holds {result['histories_in_pool']:,} histories")
    return 0
