"""Checkpoints: orbax save/load of our parameter pytree, and HF safetensors directories in and out.

* `save_checkpoint(path, cfg, params)` / `load_checkpoint(path)`: orbax (path/params) + path/config.json.
  Bit-exact, any leaf dtype (bf16, uint8 MXFP4 tensors included).
* `load_pretrained(model_dir)`: an HF directory (config.json + model.safetensors or sharded with
  model.safetensors.index.json), streamed shard by shard (`safe_open`, numpy), validated against
  `k3jax.params.param_shapes(cfg)`. `save_pretrained` writes the exact inverse.

HF tensor names understood (prefix P = `language_model.model.` with head `language_model.lm_head.weight`
for K3, whose `vision_tower.*` / `mm_projector.*` tensors are skipped; P = `model.` with `lm_head.weight`
for Kimi-Linear):

    P.embed_tokens.weight [V, D] -> embed           P.norm.weight -> norm
    P.output_attn_res_{norm,proj}.weight ([D], [1, D]) -> output_attn_res_{norm,proj} [D]
    lm_head.weight [V, D] -> lm_head [D, V]
    P.layers.{l}.{input_layernorm,post_attention_layernorm,{self_attention,mlp}_res_{norm,proj}}.weight
    P.layers.{l}.self_attn. (KDA)  {q,k,v}_proj, b_proj, o_proj, f_a_proj -> f_a, f_b_proj -> f_b,
        g_proj | g_a_proj + g_b_proj -> g_proj | g_a + g_b, o_norm, dt_bias,
        A_log ([H], [1, 1, H, 1], or K3's zero-padded [128]) -> A_log [H],
        {q,k,v}_conv1d.weight [C, 1, W] -> {q,k,v}_conv [W, C]
    P.layers.{l}.self_attn. (MLA)  q_a_proj -> q_a, q_a_layernorm -> q_a_norm, q_b_proj -> q_b | q_proj,
        kv_a_proj_with_mqa -> kv_a, kv_a_layernorm -> kv_a_norm, kv_b_proj -> kv_b, g_proj, o_proj
    P.layers.{l}.mlp.{gate,up,down}_proj -> mlp.{gate,up,down} (dense layers)
    P.layers.{l}.block_sparse_moe. gate.weight [E, D] -> router [D, E],
        gate.e_score_correction_bias -> router_bias, routed_expert_{down_proj,norm,up_proj} ->
        latent_{down,norm,up}, shared_experts.{gate,up,down}_proj -> shared.{gate,up,down},
        experts.{e}.{w1,w3,w2}.weight -> experts.{gate,up,down}[e] (stacked [E, in, out]), or MXFP4
        (compressed-tensors) experts.{e}.{w1,w3,w2}.weight_packed [out, in/2] + .weight_scale [out, in/32]
        (dequantised, or kept packed in the checkpoint's or a MoE kernel word layout, "k4r" / "k4":
        `load_pretrained` experts=)

Torch Linear weights are [out, in] and are transposed to our [in, out]. transformers >= 5 (read from
5.24.0 `conversion_mapping.py`, `mapping["kimi_linear"]`) normally saves the names above (it reverts its
renames on save), but a model saved with `save_original_format=False` holds its runtime names, also read:
`self_attn.forget_gate.{f_a_proj,f_b_proj,dt_bias,A_log}`, `self_attn.conv1d.weight` [3C, 1, W]
(q | k | v concatenated), `mlp.` instead of `block_sparse_moe.`, and `mlp.experts.gate_up_proj`
[E, 2I, D] (gate | up) + `mlp.experts.down_proj` [E, D, I].

A_log, dt_bias, the short-conv weights and the router correction bias stay float32 (as in the checkpoint
and in `param_shapes`); every other tensor is cast to `dtype` (default cfg.dtype).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.hf_config import model_config_to_hf
from k3jax.params import param_shapes
from k3jax.quant import GROUP_SIZE, is_packed, mxfp4_dequantize, mxfp4_quantize
from pallas_kernels.moe_gemm import (PLANE_BLOCK, expert_weight_dims, mxfp4_checkpoint_layout, prepare_mxfp4,
                                     word_layout_for)

SKIP_PREFIXES = ("vision_tower.", "mm_projector.")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
K3_A_LOG_PAD = 128  # K3 stores A_log as [128], zero past the real heads
_EXPERT_HF = {"gate": "w1", "up": "w3", "down": "w2"}
_DEQUANT_CHUNK = 1 << 24  # elements dequantised / re-packed per call (bounds the temporaries)
EXPERT_MODES = ("dequantize", "packed", "kernel")
_dequantize = jax.jit(mxfp4_dequantize, static_argnums=2)


# ==================================================================================================
# orbax checkpoints
# ==================================================================================================


def write_orbax_tree(path: str | os.PathLike, params: Any, meta_file: str, meta: dict, *, overwrite: bool,
                     what: str = "checkpoint") -> None:
    """Orbax params under path/params plus a JSON metadata file beside them (model and drafter checkpoints)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise ValueError(f"{what} directory {path} is not empty (pass overwrite=True)")
    if overwrite and (path / "params").exists():
        shutil.rmtree(path / "params")
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", params)
        ckptr.wait_until_finished()
    (path / meta_file).write_text(json.dumps(meta, indent=2) + "\n")


def save_checkpoint(path: str | os.PathLike, cfg: ModelConfig, params: Any, *, overwrite: bool = False) -> None:
    """Writes params with orbax to path/params and the config to path/config.json."""
    meta = {"format": "k3jax-orbax", "version": 1, "config": {**cfg.to_dict(), "mla_layers": list(cfg.mla_layers)}}
    write_orbax_tree(path, params, "config.json", meta, overwrite=overwrite)


def read_orbax_tree(path: str | os.PathLike, meta_file: str, fmt: str, what: str = "k3jax checkpoint", *,
                    sharding: jax.sharding.Sharding | None = None) -> tuple[dict, Any]:
    """(metadata, params) written by `write_orbax_tree` with metadata format `fmt`; every leaf is placed
    with `sharding` (default: the first device)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta_path = path / meta_file
    if not meta_path.is_file():
        raise ValueError(f"{path} is not a {what}: {meta_path} is missing")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != fmt:
        raise ValueError(f"{meta_path}: not a {what} ({fmt})")
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.metadata(path / "params").item_metadata.tree
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding), tree)
        params = ckptr.restore(path / "params", target)
    return meta, params


def load_checkpoint(path: str | os.PathLike, *, sharding: jax.sharding.Sharding | None = None) -> tuple[ModelConfig, Any]:
    """(cfg, params) saved by `save_checkpoint`; every leaf is placed with `sharding` (default: first device)."""
    meta, params = read_orbax_tree(path, "config.json", "k3jax-orbax", sharding=sharding)
    return ModelConfig.from_dict(meta["config"]), params


# ==================================================================================================
# HF tensor-name mapping
# ==================================================================================================


@dataclasses.dataclass(frozen=True)
class _Style:
    prefix: str  # "language_model.model." or "model."
    head: str  # lm_head tensor name
    moe: str  # "block_sparse_moe." (hub) or "mlp." (transformers runtime names)
    fused_kda: bool  # transformers runtime KDA names (forget_gate.*, fused conv1d)
    experts: str  # "dense" (w1/w3/w2.weight), "mxfp4" (weight_packed/scale), "fused" (gate_up_proj/down_proj)
    # transformers 5.x save_pretrained reverts its block_sparse_moe -> mlp rename on *every* `.mlp.`
    # tensor, so its files name the dense layer-0 MLP `block_sparse_moe.{gate,up,down}_proj`
    dense_mlp: str = "mlp."


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One HF tensor: where it goes in our tree and how it is laid out."""

    kind: str  # copy | linear | row | conv | a_log | expert | packed | scale | conv_fused | gate_up | down_fused
    path: tuple  # leaf path in our params (for conv_fused: the q_conv path; for gate_up: the gate path)
    expert: int | None = None


def _styles_for(layout: str, experts: str) -> _Style:
    if layout == "k3":
        return _Style("language_model.model.", "language_model.lm_head.weight", "block_sparse_moe.", False, experts)
    if layout == "kimi_linear":
        return _Style("model.", "lm_head.weight", "block_sparse_moe.", False, experts)
    return _Style("model.", "lm_head.weight", "mlp.", True, "fused")


def _detect_style(names: set[str]) -> _Style:
    k3 = any(n.startswith("language_model.") for n in names)
    prefix, head = ("language_model.model.", "language_model.lm_head.weight") if k3 else ("model.", "lm_head.weight")
    moe = "mlp." if any(".mlp.gate.weight" in n or ".mlp.experts." in n for n in names) else "block_sparse_moe."
    fused_kda = any(".self_attn.forget_gate." in n or n.endswith(".self_attn.conv1d.weight") for n in names)
    if any(n.endswith(".experts.gate_up_proj") or n.endswith(".experts.down_proj") for n in names):
        experts = "fused"
    elif any(n.endswith(".weight_packed") for n in names):
        experts = "mxfp4"
    else:
        experts = "dense"
    dense_mlp = "block_sparse_moe." if any(n.endswith(".block_sparse_moe.gate_proj.weight") for n in names) else "mlp."
    return _Style(prefix, head, moe, fused_kda, experts, dense_mlp)


def _hf_entries(cfg: ModelConfig, st: _Style) -> dict[str, _Entry]:
    """Every HF tensor name a checkpoint of `cfg` in style `st` holds -> its entry."""
    out: dict[str, _Entry] = {}
    P = st.prefix

    def add(name: str, kind: str, *path, expert: int | None = None) -> None:
        out[name] = _Entry(kind, tuple(path), expert)

    add(P + "embed_tokens.weight", "copy", "embed")
    add(P + "norm.weight", "copy", "norm")
    if cfg.attn_res_block_size is not None:
        add(P + "output_attn_res_norm.weight", "copy", "output_attn_res_norm")
        add(P + "output_attn_res_proj.weight", "row", "output_attn_res_proj")
    if not cfg.tie_word_embeddings:
        add(st.head, "linear", "lm_head")
    for l in range(cfg.num_layers):
        L = f"{P}layers.{l}."
        add(L + "input_layernorm.weight", "copy", "layers", l, "input_layernorm")
        add(L + "post_attention_layernorm.weight", "copy", "layers", l, "post_attention_layernorm")
        if cfg.attn_res_block_size is not None:
            for part in ("self_attention_res", "mlp_res"):
                add(L + f"{part}_norm.weight", "copy", "layers", l, f"{part}_norm")
                add(L + f"{part}_proj.weight", "row", "layers", l, f"{part}_proj")
        A = L + "self_attn."
        attn = ("layers", l, "attn")
        if cfg.is_mla(l):
            if cfg.q_lora_rank is not None:
                add(A + "q_a_proj.weight", "linear", *attn, "q_a")
                add(A + "q_a_layernorm.weight", "copy", *attn, "q_a_norm")
                add(A + "q_b_proj.weight", "linear", *attn, "q_b")
            else:
                add(A + "q_proj.weight", "linear", *attn, "q_proj")
            add(A + "kv_a_proj_with_mqa.weight", "linear", *attn, "kv_a")
            add(A + "kv_a_layernorm.weight", "copy", *attn, "kv_a_norm")
            add(A + "kv_b_proj.weight", "linear", *attn, "kv_b")
            if cfg.mla_output_gate:
                add(A + "g_proj.weight", "linear", *attn, "g_proj")
            add(A + "o_proj.weight", "linear", *attn, "o_proj")
        else:
            for x in "qkv":
                add(A + f"{x}_proj.weight", "linear", *attn, f"{x}_proj")
            fg = A + ("forget_gate." if st.fused_kda else "")
            if st.fused_kda:
                add(A + "conv1d.weight", "conv_fused", *attn, "q_conv")
            else:
                for x in "qkv":
                    add(A + f"{x}_conv1d.weight", "conv", *attn, f"{x}_conv")
            add(fg + "f_a_proj.weight", "linear", *attn, "f_a")
            add(fg + "f_b_proj.weight", "linear", *attn, "f_b")
            add(fg + "dt_bias", "copy", *attn, "dt_bias")
            add(fg + "A_log", "a_log", *attn, "A_log")
            add(A + "b_proj.weight", "linear", *attn, "b_proj")
            if cfg.kda_output_gate_rank is None:
                add(A + "g_proj.weight", "linear", *attn, "g_proj")
            else:
                add(A + "g_a_proj.weight", "linear", *attn, "g_a")
                add(A + "g_b_proj.weight", "linear", *attn, "g_b")
            add(A + "o_norm.weight", "copy", *attn, "o_norm")
            add(A + "o_proj.weight", "linear", *attn, "o_proj")
        mlp = ("layers", l, "mlp")
        if not cfg.is_moe(l):
            for ours in ("gate", "up", "down"):
                add(L + f"{st.dense_mlp}{ours}_proj.weight", "linear", *mlp, ours)
            continue
        M = L + st.moe
        add(M + "gate.weight", "linear", *mlp, "router")
        add(M + "gate.e_score_correction_bias", "copy", *mlp, "router_bias")
        if cfg.moe_latent_size:
            add(M + "routed_expert_down_proj.weight", "linear", *mlp, "latent_down")
            if cfg.moe_latent_norm:
                add(M + "routed_expert_norm.weight", "copy", *mlp, "latent_norm")
            add(M + "routed_expert_up_proj.weight", "linear", *mlp, "latent_up")
        if st.experts == "fused":
            add(M + "experts.gate_up_proj", "gate_up", *mlp, "experts", "gate")
            add(M + "experts.down_proj", "down_fused", *mlp, "experts", "down")
        else:
            for e in range(cfg.num_experts):
                for ours, hf in _EXPERT_HF.items():
                    base = f"{M}experts.{e}.{hf}."
                    if st.experts == "mxfp4":
                        add(base + "weight_packed", "packed", *mlp, "experts", ours, expert=e)
                        add(base + "weight_scale", "scale", *mlp, "experts", ours, expert=e)
                    else:
                        add(base + "weight", "expert", *mlp, "experts", ours, expert=e)
        if cfg.num_shared_experts:
            for ours in ("gate", "up", "down"):
                add(M + f"shared_experts.{ours}_proj.weight", "linear", *mlp, "shared", ours)
    return out


def _hf_shape(entry: _Entry, ours: tuple[int, ...]) -> tuple[int, ...] | None:
    """Expected HF shape of an entry whose target leaf has shape `ours` (None: checked by the converter)."""
    k = entry.kind
    if k == "copy":
        return ours
    if k == "linear":
        return ours[::-1]
    if k == "row":
        return (1, *ours)
    if k == "conv":
        return (ours[1], 1, ours[0])
    if k == "conv_fused":
        return (3 * ours[1], 1, ours[0])
    if k == "expert":
        return (ours[2], ours[1])
    if k in ("packed", "scale"):
        e, n_in, n_out = ours
        if n_in % GROUP_SIZE:
            raise ValueError(f"MXFP4 experts need the expert input width ({n_in}) to be a multiple of {GROUP_SIZE}")
        return (n_out, n_in // 2) if k == "packed" else (n_out, n_in // GROUP_SIZE)
    if k == "gate_up":
        return (ours[0], 2 * ours[2], ours[1])
    if k == "down_fused":
        return (ours[0], ours[2], ours[1])
    return None  # a_log


# ==================================================================================================
# load_pretrained
# ==================================================================================================


def _flat_shapes(tree, prefix=()) -> dict[tuple, jax.ShapeDtypeStruct]:
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out = {}
    for k, v in items:
        out.update(_flat_shapes(v, (*prefix, k)))
    return out


def _set(tree: dict, path: tuple, value) -> None:
    node = tree
    for k in path[:-1]:
        node = node.setdefault(k, {})
    node[path[-1]] = value


def _shard_map(model_dir: Path) -> dict[str, str]:
    """HF tensor name -> shard file name."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map")
        return dict(weight_map)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="np") as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise ValueError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _a_log(name: str, w: np.ndarray, heads: int) -> np.ndarray:
    flat = w.reshape(-1)
    squeezable = sum(d != 1 for d in w.shape) <= 1
    if squeezable and flat.size == heads:
        return flat
    if w.ndim == 1 and flat.size > heads and not np.any(flat[heads:]):
        return flat[:heads]  # K3: [128] with zero padding past the real heads
    raise ValueError(f"tensor {name!r}: shape {list(w.shape)} does not hold A_log for {heads} heads "
                     f"(expected [{heads}], [1, 1, {heads}, 1] or a zero-padded 1-D vector)")


class _Assembler:
    """Builds the numpy parameter tree from HF tensors, one tensor at a time."""

    def __init__(self, cfg: ModelConfig, shapes: dict[tuple, jax.ShapeDtypeStruct], experts: str):
        self.cfg, self.shapes, self.experts = cfg, shapes, experts
        self.leaves: dict[tuple, Any] = {}
        self.stash: dict[tuple, dict[str, np.ndarray]] = {}  # packed experts awaiting dequantisation / re-packing
        self.filled: dict[tuple, int] = defaultdict(int)

    def _dtype(self, path) -> np.dtype:
        return np.dtype(self.shapes[path].dtype)

    def _stack(self, path, shape, dtype) -> np.ndarray:
        if path not in self.leaves:
            self.leaves[path] = np.empty(shape, dtype)
        return self.leaves[path]

    def put(self, name: str, entry: _Entry, w: np.ndarray) -> None:
        k, path = entry.kind, entry.path
        if k in ("packed", "scale"):
            if w.dtype != np.uint8:
                raise ValueError(f"tensor {name!r}: MXFP4 {k} must be uint8, got {w.dtype}")
            e = self.shapes[path].shape[0]
            which = "packed" if k == "packed" else "scale"
            if self.experts == "packed":
                stack = self.leaves.setdefault(path, {})
                if which not in stack:
                    stack[which] = np.empty((e, *w.shape), np.uint8)
                stack[which][entry.expert] = w
            else:
                stash = self.stash.setdefault(path, {})
                if which not in stash:
                    stash[which] = np.empty((e, *w.shape), np.uint8)
                stash[which][entry.expert] = w
                self.filled[path] += 1
                if self.filled[path] == 2 * e:
                    if self.experts == "kernel":
                        self._repack_stack(path)
                    else:
                        self._dequantize_stack(path)
            return
        if k == "expert":
            stack = self._stack(path, self.shapes[path].shape, self._dtype(path))
            stack[entry.expert] = w.T
            return
        if k == "conv_fused":
            c = w.shape[0] // 3
            for i, x in enumerate("qkv"):
                p = (*path[:-1], f"{x}_conv")
                self.leaves[p] = np.ascontiguousarray(w[i * c:(i + 1) * c, 0, :].T).astype(self._dtype(p))
            return
        if k == "gate_up":
            i = w.shape[1] // 2
            for j, part in enumerate(("gate", "up")):
                p = (*path[:-1], part)
                self.leaves[p] = np.ascontiguousarray(np.swapaxes(w[:, j * i:(j + 1) * i, :], 1, 2)).astype(self._dtype(p))
            return
        dtype = self._dtype(path)
        if k == "copy":
            out = w
        elif k == "linear":
            out = w.T
        elif k == "row":
            out = w[0]
        elif k == "conv":
            out = w[:, 0, :].T
        elif k == "down_fused":
            out = np.swapaxes(w, 1, 2)
        elif k == "a_log":
            out = _a_log(name, w, self.shapes[path].shape[0])
        else:  # pragma: no cover
            raise AssertionError(k)
        self.leaves[path] = np.ascontiguousarray(out).astype(dtype, copy=False)

    def _dequantize_stack(self, path) -> None:
        stash = self.stash.pop(path)
        packed, scale = stash["packed"], stash["scale"]
        e, n_out, half = packed.shape
        dtype = self._dtype(path)
        out = np.empty(self.shapes[path].shape, dtype)  # [E, in, out]
        step = max(1, _DEQUANT_CHUNK // (n_out * half * 2))
        for s in range(0, e, step):
            w = _dequantize(jnp.asarray(packed[s:s + step]), jnp.asarray(scale[s:s + step]), jnp.dtype(dtype))
            out[s:s + step] = np.swapaxes(np.asarray(w), 1, 2)
        self.leaves[path] = out

    def _repack_stack(self, path) -> None:
        """The complete checkpoint-layout stack -> the MoE kernel's fastest word layout that holds it exactly
        (`word_layout_for` its scales: "k4r", else "k4"; `prepare_mxfp4`, exact), in numpy, a chunk of experts at a
        time (the packing holds uint32 codes: 4 bytes per weight)."""
        stash = self.stash.pop(path)
        packed, scale = stash["packed"], stash["scale"]
        layout = word_layout_for(scale)
        e, n_out, half = packed.shape
        planes = np.empty((e, half // 4, 4 * n_out), np.uint8)  # [E, in/8, 4 * out]
        scales = np.empty((e, -(-scale.shape[2] // 4), n_out), np.uint32)  # one scale word per 128 inputs
        step = max(1, _DEQUANT_CHUNK // (n_out * half * 2))
        for s in range(0, e, step):
            chunk = prepare_mxfp4({"packed": packed[s:s + step], "scale": scale[s:s + step]}, layout=layout)
            planes[s:s + step], scales[s:s + step] = chunk[f"planes_{layout}"], chunk["scale_words"]
        self.leaves[path] = {f"planes_{layout}": planes, "scale_words": scales}

    def finish(self) -> dict:
        if self.stash:  # cannot happen after the missing-name check; kept as a guard
            raise ValueError(f"incomplete MXFP4 experts at {sorted(self.stash)}")
        tree: dict = {}
        for path in list(self.leaves):
            leaf = self.leaves.pop(path)
            if isinstance(leaf, dict):
                value = {k: jnp.asarray(v) for k, v in leaf.items()}
            else:
                value = jnp.asarray(leaf)
            _set(tree, path, value)
        n = self.cfg.num_layers
        tree["layers"] = [tree["layers"][l] for l in range(n)]
        return tree


def load_pretrained(
    model_dir: str | os.PathLike, *, dtype: str | None = None, experts: str = "dequantize"
) -> tuple[ModelConfig, dict]:
    """(cfg, params) of an HF-format K3 / Kimi-Linear directory.

    dtype: dtype of every tensor but A_log / dt_bias / convs / router_bias (float32); default cfg.dtype. The
        returned cfg carries it (cfg.dtype is also the activation dtype).
    experts: "dequantize" -> MXFP4 routed experts become dtype arrays [E, in, out]; "packed" -> they stay
        {"packed": uint8 [E, out, in/2], "scale": uint8 [E, out, in/32]} (the checkpoint's bytes, HF
        orientation); "kernel" -> they stay packed in a MoE kernel word layout, per tensor the fastest that holds
        its scales (`moe_gemm.word_layout_for`): "k4r" {"planes_k4r": [E, in/8, 4 * out], "scale_words": uint32
        [E, ceil(in/128), out]} when every E8M0 scale is <= 2^1 (trained weights: |w| <= 12), else "k4" {"planes_k4",
        "scale_words"} (pallas_kernels.moe_gemm.prepare_mxfp4, exact re-packings; expert input widths must be
        multiples of 64).
        On the H200 (benchmarks/moe.py, K3 EP16 shard, decode sizes; docs/benchmarks.md) bf16 ms / MXFP4 ms is
        1.57 / 1.57 with k4r and 1.38 / 1.36 with k4 at 16 / 256 tokens. Every consumer (the MoE ops,
        save_pretrained, orbax, quant.dequantize_experts) takes any packed layout (checkpoint, kn, k4, k4r).
        Unquantised checkpoints give dense experts whatever the mode.
    Raises ValueError naming the tensor on a missing, unexpected or mis-shaped tensor.
    """
    from safetensors import safe_open

    if experts not in EXPERT_MODES:
        raise ValueError(f"experts must be one of {EXPERT_MODES}, got {experts!r}")
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_hf(model_dir)
    if dtype is not None:
        cfg = cfg.replace(dtype=jnp.dtype(dtype).name)
    shapes = _flat_shapes(param_shapes(cfg))

    shard_of = _shard_map(model_dir)
    names = {n for n in shard_of if not n.startswith(SKIP_PREFIXES)}
    style = _detect_style(names)
    entries = _hf_entries(cfg, style)
    unexpected = sorted(names - entries.keys())
    if unexpected:
        raise ValueError(f"unexpected tensor {unexpected[0]!r} in {model_dir} ({len(unexpected)} unexpected in all; "
                         f"first ones: {unexpected[:5]})")
    missing = sorted(entries.keys() - names, key=lambda n: (len(n), n))
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} in {model_dir} ({len(missing)} missing in all; "
                         f"first ones: {missing[:5]})")

    if experts == "kernel":
        for entry in entries.values():
            n_in = shapes[entry.path].shape[1] if entry.kind == "packed" else 0
            if n_in % PLANE_BLOCK:
                raise ValueError(f"experts='kernel' needs expert input widths that are multiples of {PLANE_BLOCK} "
                                 f"(the kernel layout's 64-input blocks); {entry.path} has {n_in}: use 'packed'")
    asm = _Assembler(cfg, shapes, experts)
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name in sorted(entries):
        by_shard[shard_of[name]].append(name)
    for shard in sorted(by_shard):
        file = model_dir / shard
        if not file.is_file():
            raise ValueError(f"shard {shard!r} (holding tensor {by_shard[shard][0]!r}) not found in {model_dir}")
        with safe_open(str(file), framework="np") as f:
            present = set(f.keys())
            for name in by_shard[shard]:
                if name not in present:
                    raise ValueError(f"missing tensor {name!r}: the index maps it to {shard}, which lacks it")
                entry = entries[name]
                got = tuple(f.get_slice(name).get_shape())
                want = _hf_shape(entry, shapes[entry.path].shape)
                if want is not None and got != want:
                    raise ValueError(f"tensor {name!r} has shape {list(got)}, expected {list(want)}")
                asm.put(name, entry, f.get_tensor(name))
    return cfg, asm.finish()


# ==================================================================================================
# save_pretrained
# ==================================================================================================


def _to_hf(entry: _Entry, leaf, layout: str) -> Iterator[np.ndarray]:
    """The HF tensor of `entry` from our leaf (inverse of _Assembler.put); packed experts are dicts."""
    k = entry.kind
    if k == "copy":
        yield np.asarray(leaf)
    elif k == "linear":
        yield np.ascontiguousarray(np.asarray(leaf).T)
    elif k == "row":
        yield np.asarray(leaf)[None, :]
    elif k == "conv":
        yield np.ascontiguousarray(np.asarray(leaf).T[:, None, :])
    elif k == "a_log":
        a = np.asarray(leaf)
        if layout == "k3":
            pad = np.zeros((max(K3_A_LOG_PAD, a.shape[0]),), a.dtype)
            pad[: a.shape[0]] = a
            yield pad
        else:
            yield a.reshape(1, 1, -1, 1)
    else:  # pragma: no cover
        raise AssertionError(k)


def _hf_packed(leaf, experts: slice = slice(None)) -> dict[str, np.ndarray]:
    """The checkpoint-layout numpy bytes {"packed", "scale"} of a packed leaf in any layout (checkpoint, kn, k4, k4r:
    `mxfp4_checkpoint_layout`, exact), experts sliced."""
    sliced = {k: np.asarray(v[experts]) for k, v in leaf.items()}
    return mxfp4_checkpoint_layout(sliced)


def _expert_hf(leaf, e: int, quantize: bool) -> tuple[np.ndarray, ...]:
    """HF tensors of expert e ([out, in], or (packed, scale)) from a dense [E, in, out] or packed leaf."""
    if is_packed(leaf):
        hf = _hf_packed(leaf, slice(e, e + 1))
        packed, scale = np.ascontiguousarray(hf["packed"][0]), np.ascontiguousarray(hf["scale"][0])
        if quantize:
            return packed, scale
        w = _dequantize(jnp.asarray(packed), jnp.asarray(scale), jnp.dtype(jnp.float32))
        return (np.asarray(w),)
    w = np.ascontiguousarray(np.asarray(leaf[e]).T)
    return mxfp4_quantize(w) if quantize else (w,)


def _hf_tensors(cfg: ModelConfig, params: dict, layout: str, experts: str) -> Iterator[tuple[str, np.ndarray]]:
    style = _styles_for(layout, "mxfp4" if experts == "mxfp4" else "dense")
    flat = _flat_params(params)
    quantize = experts == "mxfp4"
    for name, entry in _hf_entries(cfg, style).items():
        k, path = entry.kind, entry.path
        if k in ("expert", "packed"):
            parts = _expert_hf(flat[path], entry.expert, quantize)
            if k == "expert":
                yield name, parts[0].astype(_dense_dtype(flat[path], cfg))
            else:
                yield name, parts[0]
                yield name[: -len("weight_packed")] + "weight_scale", parts[1]
        elif k == "scale":
            continue  # written with its packed tensor
        elif k == "conv_fused":
            convs = [np.asarray(flat[(*path[:-1], f"{x}_conv")]) for x in "qkv"]
            yield name, np.ascontiguousarray(np.concatenate(convs, axis=1).T[:, None, :])
        elif k == "gate_up":
            g, u = (_dense_experts(flat[(*path[:-1], part)], cfg) for part in ("gate", "up"))
            yield name, np.ascontiguousarray(np.concatenate([np.swapaxes(g, 1, 2), np.swapaxes(u, 1, 2)], axis=1))
        elif k == "down_fused":
            yield name, np.ascontiguousarray(np.swapaxes(_dense_experts(flat[path], cfg), 1, 2))
        else:
            (tensor,) = _to_hf(entry, flat[path], layout)
            yield name, tensor


def _dense_dtype(leaf, cfg: ModelConfig) -> np.dtype:
    return np.dtype(jnp.dtype(cfg.dtype)) if is_packed(leaf) else np.dtype(leaf.dtype)


def _dense_experts(leaf, cfg: ModelConfig) -> np.ndarray:
    if is_packed(leaf):
        hf = _hf_packed(leaf)
        w = _dequantize(jnp.asarray(hf["packed"]), jnp.asarray(hf["scale"]), jnp.dtype(cfg.dtype))
        return np.swapaxes(np.asarray(w), 1, 2)
    return np.asarray(leaf)


def _flat_params(params: dict) -> dict[tuple, Any]:
    """Leaf path -> leaf, keeping packed-expert dicts whole."""
    out = {}

    def walk(node, prefix):
        if is_packed(node) or not isinstance(node, (dict, list, tuple)):
            out[prefix] = node
            return
        for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
            walk(v, (*prefix, k))

    walk(params, ())
    return out


def _check_params(cfg: ModelConfig, params: dict) -> None:
    want = _flat_shapes(param_shapes(cfg))
    got = _flat_params(params)
    for path, leaf in got.items():
        if path not in want:
            raise ValueError(f"params has unexpected leaf {path} for config {cfg.name!r}")
        shape = want[path].shape
        if is_packed(leaf):  # any MXFP4 layout: its (E, in, out) as the kernels derive and check them
            try:
                dims = expert_weight_dims(leaf)
            except ValueError as e:
                raise ValueError(f"params leaf {path}: packed experts do not match expert shape {shape}: {e}") from e
            if tuple(dims) != tuple(shape):
                raise ValueError(f"params leaf {path}: packed experts {tuple(dims)} do not match expert shape {shape}")
        elif tuple(leaf.shape) != tuple(shape):
            raise ValueError(f"params leaf {path} has shape {tuple(leaf.shape)}, expected {tuple(shape)}")
    missing = sorted(set(want) - set(got), key=str)
    if missing:
        raise ValueError(f"params lacks leaf {missing[0]} for config {cfg.name!r}")


def save_pretrained(
    model_dir: str | os.PathLike,
    cfg: ModelConfig,
    params: dict,
    *,
    layout: str = "k3",
    experts: str = "bf16",
    shard_size_bytes: int = 5 * 2**30,
) -> None:
    """Writes an HF-format directory that `load_pretrained` (and HF loaders) read back.

    layout: "k3" (K3's kimi_k3 config with text_config, `language_model.` names, A_log zero-padded to
        max(128, H) entries), "kimi_linear" (Kimi-Linear hub config and names, A_log [1, 1, H, 1]), or
        "transformers" (transformers-5.x kimi_linear config and runtime names; Kimi-Linear features only).
    experts: "bf16" -> routed experts unquantised (w1/w3/w2.weight in the params' dtype, like every other
        tensor); "mxfp4" -> compressed-tensors MXFP4 (weight_packed + weight_scale), as K3 ships them.
        Packed params (any layout: the checkpoint's, the kernel's k4r / k4 / kn) are written as the checkpoint's
        bytes with "mxfp4" (`mxfp4_checkpoint_layout`, exact) and dequantised with "bf16".
    Tensors keep their leaf dtypes (A_log / dt_bias / convs / router_bias float32 by construction).
    """
    from safetensors.numpy import save_file

    if layout not in ("k3", "kimi_linear", "transformers"):
        raise ValueError(f"layout must be 'k3', 'kimi_linear' or 'transformers', got {layout!r}")
    if experts not in ("bf16", "mxfp4"):
        raise ValueError(f"experts must be 'bf16' or 'mxfp4', got {experts!r}")
    if experts == "mxfp4" and layout == "transformers":
        raise ValueError("the transformers layout stores experts fused (gate_up_proj); MXFP4 needs layout 'k3' or 'kimi_linear'")
    if experts == "mxfp4" and cfg.expert_width % GROUP_SIZE:
        raise ValueError(f"MXFP4 experts need the expert input widths to be multiples of {GROUP_SIZE} "
                         f"(expert width {cfg.expert_width})")
    if experts == "mxfp4" and cfg.moe_intermediate_size % GROUP_SIZE:
        raise ValueError(f"MXFP4 experts need moe_intermediate_size ({cfg.moe_intermediate_size}) to be a multiple of {GROUP_SIZE}")
    _check_params(cfg, params)
    config = model_config_to_hf(cfg, layout)
    if experts == "mxfp4":
        text = config["text_config"] if layout == "k3" else config
        text["quantization_config"] = _mxfp4_quantization_config()

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    for old in [*model_dir.glob("model*.safetensors"), model_dir / INDEX_FILE]:
        if old.exists():
            old.unlink()
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    shards: list[dict[str, np.ndarray]] = [{}]
    written: list[tuple[Path, list[str]]] = []
    size = total = 0

    def flush():
        if shards[-1]:
            tmp = model_dir / f"model.part{len(written):05d}.safetensors"
            save_file(shards[-1], str(tmp), metadata={"format": "pt"})
            written.append((tmp, list(shards[-1])))
            shards[-1] = {}

    for name, tensor in _hf_tensors(cfg, params, layout, experts):
        nbytes = tensor.nbytes
        if shards[-1] and size + nbytes > shard_size_bytes:
            flush()
            size = 0
        shards[-1][name] = np.ascontiguousarray(tensor)
        size += nbytes
        total += nbytes
    flush()
    if len(written) == 1:
        written[0][0].rename(model_dir / SINGLE_FILE)
        return
    weight_map = {}
    n = len(written)
    for i, (tmp, names) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tmp.rename(model_dir / final)
        weight_map.update({name: final for name in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _mxfp4_quantization_config() -> dict:
    """compressed-tensors config as in K3's text_config (routed experts only are quantised)."""
    return {
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP_SIZE,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                    "strategy": "group", "symmetric": True, "type": "float", "zp_dtype": None,
                },
            }
        },
        "format": "mxfp4-pack-quantized",
        "global_compression_ratio": None,
        "ignore": [
            "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
            "re:.*vision_tower.*", "re:.*mm_projector.*",
        ],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
