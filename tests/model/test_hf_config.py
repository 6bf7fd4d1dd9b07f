"""HF config.json -> ModelConfig (k3jax.hf_config): K3's real config, Kimi-Linear-48B in the hub layout and
in the transformers-5.x layout, the writer's round trip, and malformed configs.

Run: python -m pytest tests/model/test_hf_config.py -q

Sources of the literal configs below (public config data):
* K3_CONFIG: moonshotai/Kimi-K3 config.json as dumped in a public model report (see
  /work/shared/design/k3-model.md §10, S1), verbatim.
* KIMI_LINEAR_48B_HUB: moonshotai/Kimi-Linear-48B-A3B-Instruct config.json, reassembled from two public
  copies (an agent log that printed the file's head, and an MLX port test that kept the rest; the MLX
  "quantization" entry is dropped).
* KIMI_LINEAR_48B_TRANSFORMERS: what transformers 5.24.0 writes for KimiLinearConfig(layer_types=<48B
  pattern>, dtype="bfloat16") (its defaults are the 48B values), produced with that version.
"""

import copy
import json

import pytest

from k3jax import ModelConfig, load_config
from k3jax.hf_config import model_config_from_hf, model_config_to_hf

K3_CONFIG = {'architectures': ['KimiK3ForConditionalGeneration'],
 'auto_map': {'AutoConfig': 'configuration_kimi_k3.KimiK3Config',
              'AutoModel': 'modeling_kimi_k3.KimiK3ForConditionalGeneration',
              'AutoModelForCausalLM': 'modeling_kimi_k3.KimiK3ForConditionalGeneration'},
 'bos_token_id': 163584,
 'dtype': 'bfloat16',
 'eos_token_id': 163586,
 'ignore_index': -100,
 'image_placeholder': '<|kimi_image_placeholder|>',
 'media_placeholder_token_id': 163605,
 'model_type': 'kimi_k3',
 'pad_token_id': 163839,
 'text_config': {'_name_or_path': '',
                 'activation_situ_beta': 4.0,
                 'activation_situ_linear_beta': 25.0,
                 'add_cross_attention': False,
                 'architectures': ['KimiLinearForCausalLM'],
                 'attn_res_block_size': 12,
                 'auto_map': {'AutoConfig': 'configuration_kimi_k3.KimiLinearConfig',
                              'AutoModel': 'modeling_kimi_linear.KimiLinearModel',
                              'AutoModelForCausalLM': 'modeling_kimi_linear.KimiLinearForCausalLM'},
                 'bad_words_ids': None,
                 'begin_suppress_tokens': None,
                 'bos_token_id': 163584,
                 'chunk_size_feed_forward': 0,
                 'cross_attention_hidden_size': None,
                 'decoder_start_token_id': None,
                 'diversity_penalty': 0.0,
                 'do_sample': False,
                 'dtype': 'bfloat16',
                 'early_stopping': False,
                 'encoder_no_repeat_ngram_size': 0,
                 'eos_token_id': 163586,
                 'exponential_decay_length_penalty': None,
                 'finetuning_task': None,
                 'first_k_dense_replace': 1,
                 'forced_bos_token_id': None,
                 'forced_eos_token_id': None,
                 'hidden_act': 'situ',
                 'hidden_size': 7168,
                 'id2label': {'0': 'LABEL_0', '1': 'LABEL_1'},
                 'initializer_range': 0.02,
                 'intermediate_size': 33792,
                 'is_decoder': False,
                 'is_encoder_decoder': False,
                 'kv_lora_rank': 512,
                 'label2id': {'LABEL_0': 0, 'LABEL_1': 1},
                 'latent_moe_use_norm': True,
                 'length_penalty': 1.0,
                 'linear_attn_config': {'full_attn_layers': [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56,
                                                             60, 64, 68, 72, 76, 80, 84, 88, 92, 93],
                                        'gate_lower_bound': -5.0,
                                        'head_dim': 128,
                                        'kda_layers': [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22,
                                                       23, 25, 26, 27, 29, 30, 31, 33, 34, 35, 37, 38, 39, 41, 42,
                                                       43, 45, 46, 47, 49, 50, 51, 53, 54, 55, 57, 58, 59, 61, 62,
                                                       63, 65, 66, 67, 69, 70, 71, 73, 74, 75, 77, 78, 79, 81, 82,
                                                       83, 85, 86, 87, 89, 90, 91],
                                        'num_heads': 96,
                                        'short_conv_kernel_size': 4,
                                        'use_full_rank_gate': True},
                 'max_length': 20,
                 'max_position_embeddings': 1048576,
                 'min_length': 0,
                 'mla_use_nope': True,
                 'mla_use_output_gate': True,
                 'model_type': 'kimi_linear',
                 'moe_intermediate_size': 3072,
                 'moe_layer_freq': 1,
                 'moe_renormalize': True,
                 'moe_router_activation_func': 'sigmoid',
                 'no_repeat_ngram_size': 0,
                 'num_attention_heads': 96,
                 'num_beam_groups': 1,
                 'num_beams': 1,
                 'num_expert_group': 1,
                 'num_experts': 896,
                 'num_experts_per_token': 16,
                 'num_hidden_layers': 93,
                 'num_key_value_heads': 96,
                 'num_nextn_predict_layers': 0,
                 'num_return_sequences': 1,
                 'num_shared_experts': 2,
                 'output_attentions': False,
                 'output_hidden_states': False,
                 'output_scores': False,
                 'pad_token_id': 163839,
                 'prefix': None,
                 'problem_type': None,
                 'pruned_heads': {},
                 'q_lora_rank': 1536,
                 'qk_nope_head_dim': 128,
                 'qk_rope_head_dim': 64,
                 'quantization_config': {'config_groups': {'group_0': {'format': 'mxfp4-pack-quantized',
                                                                       'input_activations': None,
                                                                       'output_activations': None,
                                                                       'targets': ['Linear'],
                                                                       'weights': {'actorder': None,
                                                                                   'block_structure': None,
                                                                                   'dynamic': False,
                                                                                   'group_size': 32,
                                                                                   'num_bits': 4,
                                                                                   'observer': 'minmax',
                                                                                   'observer_kwargs': {},
                                                                                   'scale_dtype': 'torch.uint8',
                                                                                   'strategy': 'group',
                                                                                   'symmetric': True,
                                                                                   'type': 'float',
                                                                                   'zp_dtype': None}}},
                                         'format': 'mxfp4-pack-quantized',
                                         'global_compression_ratio': None,
                                         'ignore': ['re:.*self_attn.*', 're:.*shared_experts.*',
                                                    're:.*mlp\\.(gate|up|gate_up|down)_proj.*', 're:.*lm_head.*',
                                                    're:.*vision_tower.*', 're:.*mm_projector.*'],
                                         'kv_cache_scheme': None,
                                         'quant_method': 'compressed-tensors',
                                         'quantization_status': 'compressed'},
                 'remove_invalid_values': False,
                 'repetition_penalty': 1.0,
                 'return_dict': True,
                 'return_dict_in_generate': False,
                 'rms_norm_eps': 1e-05,
                 'routed_expert_hidden_size': 3584,
                 'routed_scaling_factor': 1.0,
                 'sep_token_id': None,
                 'suppress_tokens': None,
                 'task_specific_params': None,
                 'temperature': 1.0,
                 'tf_legacy_loss': False,
                 'tie_encoder_decoder': False,
                 'tie_word_embeddings': False,
                 'tokenizer_class': None,
                 'top_k': 50,
                 'top_p': 1.0,
                 'topk_group': 1,
                 'topk_method': 'noaux_tc',
                 'torchscript': False,
                 'transformers_version': '4.56.2',
                 'typical_p': 1.0,
                 'use_bfloat16': False,
                 'use_cache': True,
                 'use_grouped_topk': True,
                 'v_head_dim': 128,
                 'vocab_size': 163840},
 'tie_word_embeddings': False,
 'vision_config': {'_attn_implementation': 'flash_attention_2',
                   'activation_func': 'gelu_pytorch_tanh',
                   'attn_bias': False,
                   'init_pos_emb_height': 64,
                   'init_pos_emb_time': 4,
                   'init_pos_emb_width': 64,
                   'linear_bias': False,
                   'merge_kernel_size': [2, 2],
                   'merge_type': 'sd2_tpool',
                   'mlp_type': 'mlp2',
                   'mm_hidden_size': 1024,
                   'mm_projector_type': 'patchmergerv2',
                   'norm_type': 'rmsnorm',
                   'patch_embed_proj_bias': False,
                   'patch_size': 14,
                   'pos_emb_interpolation_mode': 'bilinear',
                   'pos_emb_type': 'divided_fixed',
                   'projector_hidden_act': 'gelu',
                   'projector_ln_eps': 1e-05,
                   'qkv_hidden_size': 1536,
                   'text_hidden_size': 7168,
                   'vt_hidden_size': 1024,
                   'vt_intermediate_size': 4096,
                   'vt_num_attention_heads': 12,
                   'vt_num_hidden_layers': 27}}


KIMI_LINEAR_48B_HUB = {'architectures': ['KimiLinearForCausalLM'],
 'auto_map': {'AutoConfig': 'configuration_kimi.KimiLinearConfig',
              'AutoModel': 'modeling_kimi.KimiLinearModel',
              'AutoModelForCausalLM': 'modeling_kimi.KimiLinearForCausalLM'},
 'bos_token_id': 163584,
 'dtype': 'bfloat16',
 'eos_token_id': 163586,
 'first_k_dense_replace': 1,
 'head_dim': 72,
 'hidden_act': 'silu',
 'hidden_size': 2304,
 'initializer_range': 0.02,
 'intermediate_size': 9216,
 'kv_lora_rank': 512,
 'linear_attn_config': {'full_attn_layers': [4, 8, 12, 16, 20, 24, 27],
                        'head_dim': 128,
                        'kda_layers': [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                        'num_heads': 32,
                        'short_conv_kernel_size': 4},
 'mla_use_nope': True,
 'model_max_length': 1048576,
 'model_type': 'kimi_linear',
 'moe_intermediate_size': 1024,
 'moe_layer_freq': 1,
 'moe_renormalize': True,
 'moe_router_activation_func': 'sigmoid',
 'num_attention_heads': 32,
 'num_expert_group': 1,
 'num_experts': 256,
 'num_experts_per_token': 8,
 'num_hidden_layers': 27,
 'num_key_value_heads': 32,
 'num_nextn_predict_layers': 0,
 'num_shared_experts': 1,
 'pad_token_id': 163839,
 'q_lora_rank': None,
 'qk_nope_head_dim': 128,
 'qk_rope_head_dim': 64,
 'rms_norm_eps': 1e-05,
 'rope_scaling': None,
 'rope_theta': 10000.0,
 'routed_scaling_factor': 2.446,
 'tie_word_embeddings': False,
 'topk_group': 1,
 'transformers_version': '4.57.1',
 'use_cache': True,
 'use_grouped_topk': True,
 'v_head_dim': 128,
 'vocab_size': 163840}


KIMI_LINEAR_48B_TRANSFORMERS = {'architectures': ['KimiLinearForCausalLM'],
 'attention_bias': False,
 'attention_dropout': 0.0,
 'bos_token_id': 163584,
 'dtype': 'bfloat16',
 'eos_token_id': 163586,
 'head_dim': 64,
 'hidden_act': 'silu',
 'hidden_size': 2304,
 'initializer_range': 0.02,
 'intermediate_size': 9216,
 'kv_lora_rank': 512,
 'layer_types': ['linear_attention', 'linear_attention', 'linear_attention', 'full_attention', 'linear_attention',
                 'linear_attention', 'linear_attention', 'full_attention', 'linear_attention', 'linear_attention',
                 'linear_attention', 'full_attention', 'linear_attention', 'linear_attention', 'linear_attention',
                 'full_attention', 'linear_attention', 'linear_attention', 'linear_attention', 'full_attention',
                 'linear_attention', 'linear_attention', 'linear_attention', 'full_attention', 'linear_attention',
                 'linear_attention', 'full_attention'],
 'linear_conv_kernel_dim': 4,
 'linear_head_dim': 128,
 'linear_num_heads': 32,
 'mlp_layer_types': ['dense', 'sparse', 'sparse', 'sparse', 'sparse', 'sparse', 'sparse', 'sparse', 'sparse',
                     'sparse', 'sparse', 'sparse', 'sparse', 'sparse', 'sparse', 'sparse', 'sparse', 'sparse',
                     'sparse', 'sparse', 'sparse', 'sparse', 'sparse', 'sparse', 'sparse', 'sparse', 'sparse'],
 'model_max_length': 1048576,
 'model_type': 'kimi_linear',
 'moe_intermediate_size': 1024,
 'moe_renormalize': True,
 'num_attention_heads': 32,
 'num_expert_group': 1,
 'num_experts': 256,
 'num_experts_per_token': 8,
 'num_hidden_layers': 27,
 'num_key_value_heads': 32,
 'num_shared_experts': 1,
 'output_router_logits': False,
 'pad_token_id': 163839,
 'pretraining_tp': 1,
 'q_lora_rank': None,
 'qk_head_dim': 192,
 'qk_nope_head_dim': 128,
 'qk_rope_head_dim': 64,
 'rms_norm_eps': 1e-05,
 'routed_scaling_factor': 2.446,
 'tie_word_embeddings': False,
 'topk_group': 1,
 'transformers_version': '5.24.0',
 'use_cache': True,
 'v_head_dim': 128,
 'vocab_size': 163840}


def same_except_name(a: ModelConfig, b: ModelConfig) -> dict:
    """Fields that differ (empty when equal), name ignored."""
    return {f: (getattr(a, f), getattr(b, f)) for f in a.to_dict() if f != "name" and getattr(a, f) != getattr(b, f)}


def test_k3_config_matches_preset():
    cfg = model_config_from_hf(copy.deepcopy(K3_CONFIG), "k3-hf")
    assert cfg.name == "k3-hf"
    assert same_except_name(cfg, load_config("k3")) == {}
    assert cfg.mla_layers[-2:] == (91, 92) and cfg.num_kda_layers == 69


def test_kimi_linear_hub_layout_matches_preset():
    cfg = model_config_from_hf(copy.deepcopy(KIMI_LINEAR_48B_HUB), "kl")
    assert same_except_name(cfg, load_config("kimi-linear-48b")) == {}


def test_kimi_linear_transformers_layout_matches_preset():
    cfg = model_config_from_hf(copy.deepcopy(KIMI_LINEAR_48B_TRANSFORMERS), "kl")
    assert same_except_name(cfg, load_config("kimi-linear-48b")) == {}


def test_mixed_layout_as_transformers_resaves_hub_config():
    # transformers 5.x keeps linear_attn_config and adds layer_types / mlp_layer_types / linear_* when it
    # re-saves a hub config
    mixed = copy.deepcopy(KIMI_LINEAR_48B_HUB)
    tf = KIMI_LINEAR_48B_TRANSFORMERS
    for key in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        mixed[key] = copy.deepcopy(tf[key])
    assert same_except_name(model_config_from_hf(mixed, "kl"), load_config("kimi-linear-48b")) == {}


def test_transformers_aliases():
    tf = copy.deepcopy(KIMI_LINEAR_48B_TRANSFORMERS)
    for new, old in (("n_group", "num_expert_group"), ("num_local_experts", "num_experts"),
                     ("num_experts_per_tok", "num_experts_per_token"), ("n_shared_experts", "num_shared_experts"),
                     ("norm_topk_prob", "moe_renormalize"), ("max_position_embeddings", "model_max_length")):
        tf[new] = tf.pop(old)
    assert same_except_name(model_config_from_hf(tf, "kl"), load_config("kimi-linear-48b")) == {}


def test_mlp_layer_types_derive_first_k_and_freq():
    tf = copy.deepcopy(KIMI_LINEAR_48B_TRANSFORMERS)
    n = tf["num_hidden_layers"]
    tf["mlp_layer_types"] = ["sparse" if l >= 3 and l % 2 == 0 else "dense" for l in range(n)]
    cfg = model_config_from_hf(tf, "kl")
    assert (cfg.first_k_dense_replace, cfg.moe_layer_freq) == (4, 2)
    assert [cfg.is_moe(l) for l in range(n)] == [t == "sparse" for t in tf["mlp_layer_types"]]
    tf["mlp_layer_types"] = ["dense"] * n
    cfg = model_config_from_hf(tf, "kl")
    assert not any(cfg.is_moe(l) for l in range(n))


def test_k3_top_level_fallbacks():
    # kimi_k3 takes bos/eos/pad, tie_word_embeddings and dtype from the top level when text_config lacks them
    c = copy.deepcopy(K3_CONFIG)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "dtype"):
        c["text_config"].pop(key)
    c["eos_token_id"] = [163586, 163585]
    cfg = model_config_from_hf(c, "k3")
    assert same_except_name(cfg, load_config("k3")) == {}


@pytest.mark.parametrize("preset,layout", [
    ("k3", "k3"), ("k3-tiny", "k3"), ("k3-small", "kimi_linear"), ("kimi-linear-48b", "kimi_linear"),
    ("kimi-linear-48b", "transformers"), ("k3-tiny", "kimi_linear"),
])
def test_writer_round_trip(preset, layout):
    cfg = load_config(preset)
    written = json.loads(json.dumps(model_config_to_hf(cfg, layout)))  # through JSON, as on disk
    assert model_config_from_hf(written, preset) == cfg


def test_from_hf_reads_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(K3_CONFIG))
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg.name == tmp_path.name and same_except_name(cfg, load_config("k3")) == {}
    assert same_except_name(load_config(str(tmp_path / "config.json")), cfg) == {}


def test_writer_refuses_what_it_cannot_express():
    with pytest.raises(ValueError, match="kda_gate"):
        model_config_to_hf(load_config("k3-tiny"), "transformers")
    with pytest.raises(ValueError, match="kda_gate_rank"):
        model_config_to_hf(load_config("k3-tiny").replace(kda_gate_rank=8), "k3")
    with pytest.raises(ValueError, match="mla_norm_eps"):
        model_config_to_hf(load_config("k3-tiny").replace(mla_norm_eps=1e-5), "k3")
    with pytest.raises(ValueError, match="layout"):
        model_config_to_hf(load_config("k3-tiny"), "gguf")


def _k3(edit):
    c = copy.deepcopy(K3_CONFIG)
    edit(c["text_config"])
    return c


def _hub(edit):
    c = copy.deepcopy(KIMI_LINEAR_48B_HUB)
    edit(c)
    return c


def _tf(edit):
    c = copy.deepcopy(KIMI_LINEAR_48B_TRANSFORMERS)
    edit(c)
    return c


def _set(key, value):
    return lambda c: c.__setitem__(key, value)


def _pop(*keys):
    def edit(c):
        for k in keys[:-1]:
            c = c[k]
        c.pop(keys[-1])
    return edit


MALFORMED = [
    ("unknown model_type", lambda: {**KIMI_LINEAR_48B_HUB, "model_type": "deepseek_v3"}, "model_type"),
    ("no model_type", lambda: {k: v for k, v in KIMI_LINEAR_48B_HUB.items() if k != "model_type"}, "model_type"),
    ("k3 without text_config", lambda: {k: v for k, v in K3_CONFIG.items() if k != "text_config"}, "text_config"),
    ("k3 text model_type", lambda: _k3(_set("model_type", "deepseek_v3")), "model_type"),
    ("missing hidden_size", lambda: _k3(_pop("hidden_size")), "hidden_size"),
    ("missing vocab_size", lambda: _hub(_pop("vocab_size")), "vocab_size"),
    ("missing num_hidden_layers", lambda: _tf(_pop("num_hidden_layers")), "num_hidden_layers"),
    ("missing kv_lora_rank", lambda: _hub(_pop("kv_lora_rank")), "kv_lora_rank"),
    ("missing num_experts", lambda: _k3(_pop("num_experts")), "num_experts"),
    ("missing num_experts_per_token", lambda: _tf(_pop("num_experts_per_token")), "num_experts_per_token"),
    ("missing moe_intermediate_size", lambda: _k3(_pop("moe_intermediate_size")), "moe_intermediate_size"),
    ("missing hidden_act", lambda: _hub(_pop("hidden_act")), "hidden_act"),
    ("missing rms_norm_eps", lambda: _hub(_pop("rms_norm_eps")), "rms_norm_eps"),
    ("missing layer pattern", lambda: _hub(_pop("linear_attn_config")), "linear_attn_config"),
    ("missing kda num_heads", lambda: _k3(_pop("linear_attn_config", "num_heads")), "num_heads"),
    ("missing kda head_dim", lambda: _hub(_pop("linear_attn_config", "head_dim")), "head_dim"),
    ("missing linear_num_heads", lambda: _tf(_pop("linear_num_heads")), "linear_num_heads"),
    ("missing full_attn_layers", lambda: _k3(_pop("linear_attn_config", "full_attn_layers")), "full_attn_layers"),
    ("RoPE MLA", lambda: _k3(_set("mla_use_nope", False)), "mla_use_nope"),
    ("hub default is RoPE", lambda: _hub(_pop("mla_use_nope")), "mla_use_nope"),
    ("unsupported activation", lambda: _hub(_set("hidden_act", "gelu")), "hidden_act"),
    ("unsupported router", lambda: _k3(_set("moe_router_activation_func", "sqrtsoftplus")), "moe_router_activation_func"),
    ("layers overlap", lambda: _k3(lambda c: c["linear_attn_config"]["kda_layers"].append(4)), "full_attn_layers"),
    ("layer out of range", lambda: _hub(lambda c: c["linear_attn_config"]["full_attn_layers"].append(28)), "full_attn_layers"),
    ("bad layer_types entry", lambda: _tf(lambda c: c["layer_types"].__setitem__(5, "sliding_attention")), "layer_types"),
    ("short layer_types", lambda: _tf(lambda c: c["layer_types"].pop()), "layer_types"),
    ("layer_types disagree", lambda: _hub(_set("layer_types", KIMI_LINEAR_48B_TRANSFORMERS["layer_types"][::-1])), "layer_types"),
    ("mlp pattern not expressible", lambda: _tf(lambda c: c["mlp_layer_types"].__setitem__(5, "dense")), "mlp_layer_types"),
    ("mlp pattern disagrees", lambda: _hub(_set("mlp_layer_types", ["dense"] * 2 + ["sparse"] * 25)), "mlp_layer_types"),
    ("mlp entry", lambda: _tf(lambda c: c["mlp_layer_types"].__setitem__(5, "moe")), "mlp_layer_types"),
    ("positive gate bound", lambda: _k3(lambda c: c["linear_attn_config"].__setitem__("gate_lower_bound", 5.0)), "gate_lower_bound"),
    ("latent norm without latent", lambda: _k3(_pop("routed_expert_hidden_size")), "routed_expert_hidden_size"),
    ("non-integer size", lambda: _k3(_set("hidden_size", "7168")), "hidden_size"),
    ("kv heads", lambda: _k3(_set("num_key_value_heads", 8)), "num_key_value_heads"),
    ("dtype", lambda: _k3(_set("dtype", "int8")), "dtype"),
    ("attention bias", lambda: _tf(_set("attention_bias", True)), "attention_bias"),
]


@pytest.mark.parametrize("what,make,field", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_config_raises_naming_the_field(what, make, field):
    with pytest.raises(ValueError, match=field):
        model_config_from_hf(make(), "bad")
