"""config.json <-> Config: the published configs map onto our presets, both config styles are read, every
unsupported setting is refused by name, and export refuses what a family cannot express."""

from __future__ import annotations

import dataclasses

import pytest

from dropless.core.config import load_preset
from dropless.convert import ConvertError, config_from_hf, config_to_hf

# The config.json files published with the models (abridged only by dropping keys irrelevant to the function).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                                     "quant_method": "fp8", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
ROUTING_KEYS = ("num_experts", "num_experts_per_tok", "expert_intermediate_size", "num_shared_experts", "score_func",
                "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group")


@pytest.mark.parametrize("hf, preset", [(DEEPSEEK_V3, "deepseek-v3-671b"), (MIXTRAL_8X7B, "mixtral-8x7b"),
                                        (QWEN3_30B_A3B, "qwen3-30b-a3b")])
def test_published_configs_equal_our_presets(hf, preset):
    ours, want = config_from_hf(hf), load_preset(preset)
    skip = {"init_std"}
    for field in dataclasses.fields(want.model):
        if field.name not in skip:
            assert getattr(ours.model, field.name) == getattr(want.model, field.name), field.name
    for key in ROUTING_KEYS:
        assert getattr(ours.moe, key) == getattr(want.moe, key), key
    assert config_from_hf(config_to_hf(ours, hf)) == ours


def test_transformers5_rope_parameters_style_is_read():
    v5 = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**DEEPSEEK_V3["rope_scaling"], "rope_type": "yarn", "rope_theta": 10000.0}
    assert config_from_hf(v5) == config_from_hf(DEEPSEEK_V3)


def test_yarn_factor_and_original_length_default_like_transformers():
    hf = {**QWEN3_30B_A3B, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 10240}}
    assert config_from_hf(hf).model.rope_scaling == {"type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 10240}


def test_missing_keys_take_the_family_defaults():
    minimal = {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
               "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100}
    config = config_from_hf(minimal)
    assert (config.model.rope_theta, config.model.head_dim, config.moe.num_experts, config.model.rms_norm_eps) == \
        (1e6, 16, 8, 1e-5)
    # DeepSeek-V3: the first three layers dense (first_k_dense_replace=3); Qwen3-MoE: every layer MoE, top-k
    # weights not renormalised (norm_topk_prob=False).
    deepseek = config_from_hf({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 5})
    assert (deepseek.model.layer_types, deepseek.moe.n_group, deepseek.moe.topk_group) == ("DDDMM", 8, 4)
    qwen = config_from_hf({"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 3})
    assert (qwen.model.layer_types, qwen.moe.norm_topk_prob) == ("MMM", False)


def test_deepseek_sequence_balance_loss_weight_is_read_only_with_seq_aux():
    """aux_loss_alpha becomes moe.seq_aux_loss_weight only where seq_aux is true (the official config); without
    seq_aux DeepSeek's code weighs a batch-wise loss with it, which must not turn into the sequence-wise one."""
    assert config_from_hf(DEEPSEEK_V3).moe.seq_aux_loss_weight == 0.001
    assert config_from_hf({**DEEPSEEK_V3, "seq_aux": False}).moe.seq_aux_loss_weight == 0.0
    without = {k: v for k, v in DEEPSEEK_V3.items() if k != "seq_aux"}
    assert config_from_hf(without).moe.seq_aux_loss_weight == 0.0


@pytest.mark.parametrize("hf, layers", [
    ({**QWEN3_30B_A3B, "num_hidden_layers": 4, "mlp_only_layers": [0, 1]}, "DDMM"),
    ({**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2}, "DMDMDM"),
    ({**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 3, "mlp_only_layers": [5]}, "DDMDDD"),
    ({**QWEN3_30B_A3B, "num_hidden_layers": 5, "mlp_only_layers": [1, 3]}, "MDMDM"),
    ({**DEEPSEEK_V3, "num_hidden_layers": 7, "first_k_dense_replace": 1, "moe_layer_freq": 3}, "DDDMDDM"),
    ({**DEEPSEEK_V3, "num_hidden_layers": 4, "first_k_dense_replace": 0, "moe_layer_freq": 2}, "MDMD"),
])
def test_layer_patterns_map_both_ways(hf, layers):
    config = config_from_hf(hf)
    m = config.model
    assert m.layer_types == layers and m.first_dense_layers == len(layers) - len(layers.lstrip("D"))
    assert config_from_hf(config_to_hf(config)) == config
    if m.family == "qwen3_moe":  # and any pattern goes through Qwen3's mlp_only_layers
        assert config_to_hf(config)["mlp_only_layers"] == [i for i, t in enumerate(layers) if t == "D"]


def test_patterns_a_family_cannot_express_are_refused_on_export():
    deepseek = config_from_hf({**DEEPSEEK_V3, "num_hidden_layers": 4, "num_nextn_predict_layers": 0})
    with pytest.raises(ConvertError, match="model.layer_pattern='MDMM' cannot be expressed in a DeepseekV3"):
        config_to_hf(deepseek.replace(**{"model.first_dense_layers": 0, "model.layer_pattern": "MDMM"}))
    mixtral = config_from_hf(MIXTRAL_8X7B)
    with pytest.raises(ConvertError, match="model.first_dense_layers=1 cannot be expressed in a MixtralForCausalLM"):
        config_to_hf(mixtral.replace(**{"model.first_dense_layers": 1}))
    with pytest.raises(ConvertError, match="model.mtp_layers=1 cannot be expressed in a Qwen3MoeForCausalLM"):
        config_to_hf(config_from_hf(QWEN3_30B_A3B).replace(**{"model.mtp_layers": 1}))


def test_an_mtp_block_type_deepseek_cannot_number_after_the_layers_is_refused_naming_it():
    """HF types DeepSeek's MTP layers by the main layers' rule: dense MTP blocks after MoE layers 0..3 cannot be
    written. The refusal names model.mtp_block (the key to change), not a layer pattern nobody set."""
    deepseek = config_from_hf({**DEEPSEEK_V3, "num_hidden_layers": 4, "first_k_dense_replace": 0})
    dense_mtp = deepseek.replace(**{"model.mtp_block": "dense"})
    with pytest.raises(ConvertError, match=r"model.mtp_block='dense' after model.layer_pattern='MMMM' cannot be "
                                           r"expressed in a DeepseekV3.*change model.mtp_block"):
        config_to_hf(dense_mtp)


def test_deepseek_mtp_layers_map_to_num_nextn_predict_layers():
    config = config_from_hf(DEEPSEEK_V3)
    assert (config.model.mtp_layers, config.model.mtp_block) == (1, "moe")
    assert config_to_hf(config)["num_nextn_predict_layers"] == 1
    # moe_layer_freq 2 over 4 layers makes layer 4, the MTP layer, MoE; over 5 layers layer 5 is dense.
    small = {**DEEPSEEK_V3, "first_k_dense_replace": 0, "moe_layer_freq": 2, "num_nextn_predict_layers": 1}
    assert config_from_hf({**small, "num_hidden_layers": 4}).model.mtp_block == "moe"
    dense = config_from_hf({**small, "num_hidden_layers": 5})
    assert dense.model.mtp_block == "dense" and config_from_hf(config_to_hf(dense)) == dense


@pytest.mark.parametrize("hf, field", [
    ({**DEEPSEEK_V3, "architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
    ({**DEEPSEEK_V3, "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({**DEEPSEEK_V3, "scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({**DEEPSEEK_V3, "topk_method": "greedy"}, "topk_method='greedy'"),
    ({**DEEPSEEK_V3, "attention_bias": True}, "attention_bias=True"),
    ({**DEEPSEEK_V3, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type='linear'"),
    ({**DEEPSEEK_V3, "quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({**MIXTRAL_8X7B, "sliding_window": 4096}, "sliding_window=4096"),
    ({**QWEN3_30B_A3B, "use_sliding_window": True}, "use_sliding_window=True"),
    ({**QWEN3_30B_A3B, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    # DeepSeek's rule divides by it (i % moe_layer_freq), as Qwen3's by decoder_sparse_step
    ({**DEEPSEEK_V3, "moe_layer_freq": 0}, "moe_layer_freq=0"),
    ({**QWEN3_30B_A3B, "decoder_sparse_step": 0}, "decoder_sparse_step=0"),
])
def test_unsupported_settings_are_named(hf, field):
    from dropless.convert.hf_weights import fp8_block_size

    with pytest.raises(ConvertError) as err:
        config_from_hf(hf)
        fp8_block_size(hf)
    assert field in str(err.value)
    assert str(err.value).count(".") >= 1 and "\n" not in str(err.value)


@pytest.mark.parametrize("hf, field", [
    ({**DEEPSEEK_V3, "hidden_size": "big"}, "hidden_size='big' is not an integer"),
    ({**DEEPSEEK_V3, "n_routed_experts": [256]}, "n_routed_experts=[256] is not an integer"),
    ({**DEEPSEEK_V3, "rms_norm_eps": "tiny"}, "rms_norm_eps='tiny' is not a number"),
    ({**DEEPSEEK_V3, "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": "forty"}},
     "rope_scaling.factor='forty' is not a number"),
    ({**DEEPSEEK_V3, "rope_scaling": "yarn"}, "rope_scaling='yarn' is not an object"),
    ({**DEEPSEEK_V3, "moe_layer_freq": "every"}, "moe_layer_freq='every' is not an integer"),
    ({**DEEPSEEK_V3, "max_position_embeddings": None}, "max_position_embeddings=None is not an integer"),
    ({**MIXTRAL_8X7B, "sliding_window": "4k"}, "sliding_window='4k' is not an integer"),
    ({**MIXTRAL_8X7B, "num_local_experts": float("inf")}, "num_local_experts=inf is not an integer"),
    ({**QWEN3_30B_A3B, "mlp_only_layers": 3}, "mlp_only_layers=3 is not a list"),
    ({**QWEN3_30B_A3B, "num_key_value_heads": "four"}, "num_key_value_heads='four' is not an integer"),
    # a quoted "false" would read as True through bool()
    ({**QWEN3_30B_A3B, "norm_topk_prob": "false"}, "norm_topk_prob='false' is not true or false"),
    ({**MIXTRAL_8X7B, "tie_word_embeddings": "false"}, "tie_word_embeddings='false' is not true or false"),
    ({**DEEPSEEK_V3, "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "truncate": 0}},
     "rope_scaling.truncate=0 is not true or false"),
    # numbers written as strings, and flags where numbers belong, which Python's int() and float() would read
    ({**QWEN3_30B_A3B, "rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6' is not a number"),
    ({**DEEPSEEK_V3, "hidden_size": "7168"}, "hidden_size='7168' is not an integer"),
    ({**MIXTRAL_8X7B, "num_experts_per_tok": True}, "num_experts_per_tok=True is not an integer"),
    ({**DEEPSEEK_V3, "architectures": [5]}, "architectures=[5] is not a list of names"),
    ({**DEEPSEEK_V3, "architectures": "DeepseekV3ForCausalLM"}, "architectures='DeepseekV3ForCausalLM' is not a list"),
])
def test_fields_of_the_wrong_json_kind_are_named(hf, field):
    """A value no number can be read from is the file's mistake: one ConvertError naming the field and the fix,
    not Python's ValueError or TypeError."""
    with pytest.raises(ConvertError) as err:
        config_from_hf(hf)
    assert f"config.json field {field}" in str(err.value) and "re-download" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("hf, field", [
    ({**DEEPSEEK_V3, "hidden_size": 32.5}, "hidden_size=32.5 is not an integer"),  # int() would make it 32
    ({**MIXTRAL_8X7B, "rope_theta": float("nan")}, "rope_theta=nan is not a finite number"),
    ({**QWEN3_30B_A3B, "rms_norm_eps": float("inf")}, "rms_norm_eps=inf is not a finite number"),
    ({**QWEN3_30B_A3B, "rms_norm_eps": -1}, "rms_norm_eps=-1.0 is not positive"),  # NaN logits
    ({**DEEPSEEK_V3, "rope_theta": 0}, "rope_theta=0.0 is not positive"),
    ({**MIXTRAL_8X7B, "num_hidden_layers": 10**12}, "num_hidden_layers=1000000000000 is beyond the 10000 layers"),
    ({**DEEPSEEK_V3, "num_nextn_predict_layers": 10**9}, "num_nextn_predict_layers=1000000000 is beyond"),
])
def test_values_no_model_has_are_named(hf, field):
    """Numbers of the right kind but impossible for a model are refused at import, naming the field: accepted,
    they would be truncated, give NaN logits, make every later command refuse the run, or spell out one layer
    letter per claimed layer for ever."""
    with pytest.raises(ConvertError) as err:
        config_from_hf(hf)
    assert f"config.json field {field}" in str(err.value) and "re-download" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_malformed_fp8_block_size_is_named():
    from dropless.convert.hf_weights import fp8_block_size

    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": ["128", 128]}
    with pytest.raises(ConvertError, match=r"weight_block_size=\['128', 128\] must be two positive integers"):
        fp8_block_size({"quantization_config": quant})
    assert fp8_block_size({"quantization_config": {**quant, "weight_block_size": [128, 64]}}) == (128, 64)
    # Without weight_block_size: transformers' default, 128 x 128 (DeepSeek-V3's).
    assert fp8_block_size({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}) == (128, 128)


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(ConvertError, match="Qwen2MoeForCausalLM is not supported.*DeepseekV3ForCausalLM, "
                                           "MixtralForCausalLM, Qwen3MoeForCausalLM"):
        config_from_hf({**QWEN3_30B_A3B, "architectures": ["Qwen2MoeForCausalLM"]})


def test_a_config_we_cannot_build_is_a_convert_error():
    # One group of 256 / 8 = 32 experts cannot hold a top-40 choice.
    with pytest.raises(ConvertError, match="config.json describes a model dropless cannot build.*topk_group"):
        config_from_hf({**DEEPSEEK_V3, "topk_group": 1, "num_experts_per_tok": 40})


def test_export_refuses_what_the_family_cannot_express():
    config = config_from_hf(MIXTRAL_8X7B)
    with pytest.raises(ConvertError, match="moe.num_shared_experts=1 cannot be expressed in a MixtralForCausalLM"):
        config_to_hf(config.replace(**{"moe.num_shared_experts": 1}))
    with pytest.raises(ConvertError, match="moe.score_func='softmax'.*DeepseekV3ForCausalLM"):
        config_to_hf(config_from_hf(DEEPSEEK_V3).replace(**{"moe.score_func": "softmax"}))
    qwen = config_from_hf(QWEN3_30B_A3B)
    assert config_to_hf(qwen.replace(**{"model.first_dense_layers": 2}))["mlp_only_layers"] == [0, 1]

