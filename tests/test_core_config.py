"""The config dataclasses: every choice declared once by its annotation, every value validated at construction."""

from __future__ import annotations

import dataclasses
import json
import math
import typing

import pytest

from dropless.core.config import (ACTIVATION_NAMES, INT_LIMIT, Config, ConfigError, DataConfig, ModelConfig,
                                  MoEConfig, ParallelConfig, TrainConfig, _group_classes, apply_overrides, build_config,
                                  from_dict, load_preset, parse_overrides)

LITERAL_FIELDS = [(group, f.name, typing.get_args(typing.get_type_hints(cls)[f.name]))
                  for group, cls in _group_classes().items() for f in dataclasses.fields(cls)
                  if typing.get_origin(typing.get_type_hints(cls)[f.name]) is typing.Literal]


def test_the_choices_are_the_annotations():
    assert ("moe", "dispatch", ("auto", "allgather", "alltoall", "ragged")) in LITERAL_FIELDS
    assert {(group, name) for group, name, _ in LITERAL_FIELDS} >= {
        ("model", "family"), ("model", "attention"), ("model", "attention_backend"), ("moe", "score_func"),
        ("moe", "gmm_backend"), ("moe", "dispatch_dtype"), ("train", "dtype"), ("train", "remat"),
        ("train", "optimizer_moments_dtype")}


@pytest.mark.parametrize("group, name, choices", LITERAL_FIELDS, ids=[f"{g}.{n}" for g, n, _ in LITERAL_FIELDS])
def test_every_choice_is_checked_with_one_sentence_from_its_annotation(group, name, choices):
    message = f"{group}.{name}='bogus' is not valid; choose one of {', '.join(choices)}."
    with pytest.raises(ConfigError) as constructed:
        _group_classes()[group](**{name: "bogus"})
    assert str(constructed.value) == message
    with pytest.raises(ConfigError) as overridden:
        apply_overrides(Config(), {f"{group}.{name}": "bogus"})
    assert str(overridden.value) == message
    for choice in choices:
        _group_classes()[group](**{name: choice, **NEEDS.get((group, name, choice), {})})


# Choices that are valid only with another setting (each refused without it in one sentence of its own).
NEEDS = {("moe", "router_common_source", "other_sequences"): {"router_common_rate": 0.3},
         ("train", "fp8_wgrad_dtype", "bfloat16"): {"fp8": "blockwise"}}


def test_activation_offloading_is_validated_when_the_config_is_built():
    assert TrainConfig(remat="full", offload=" moe_in, attn_out ").offload_names == ("moe_in", "attn_out")
    assert TrainConfig().offload_names == ()
    with pytest.raises(ConfigError, match="train.offload names unknown activation.s. nope; choose from "
                                          + ", ".join(ACTIVATION_NAMES)):
        TrainConfig(remat="full", offload="moe_in,nope")
    with pytest.raises(ConfigError, match="train.offload='moe_in' needs train.remat=full"):
        TrainConfig(offload="moe_in")
    with pytest.raises(ConfigError, match="train.offload names attn_out more than once; name each activation once"):
        TrainConfig(remat="full", offload="attn_out,moe_in,attn_out")


@pytest.mark.parametrize("fp8", ["off", "mxfp8"])
def test_the_fp8_weight_cache_can_be_turned_off_only_where_there_is_one(fp8):
    for mode in ("blockwise", "rowwise"):
        assert not TrainConfig(fp8=mode, fp8_cache_weights=False).fp8_cache_weights
    with pytest.raises(ConfigError, match=f"train.fp8_cache_weights=false .* and train.fp8={fp8} makes none; set "
                                          "train.fp8=blockwise or rowwise, or leave train.fp8_cache_weights=true."):
        TrainConfig(fp8=fp8, fp8_cache_weights=False)


def test_cross_group_and_rope_settings_are_validated_when_the_config_is_built():
    with pytest.raises(ConfigError, match=r"moe.num_experts=6 is not divisible by parallel.expert=4; .* the number of devices\)\."):
        Config(moe=MoEConfig(num_experts=6), parallel=ParallelConfig(expert=4))
    Config(moe=MoEConfig(num_experts=8), parallel=ParallelConfig(expert=4))
    with pytest.raises(ConfigError, match="needs 'factor' and 'original_max_position_embeddings'"):
        ModelConfig(rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="type 'linear' is not supported"):
        ModelConfig(rope_scaling={"type": "linear", "factor": 4.0})
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    ModelConfig(rope_scaling=yarn)
    for bad, match in [({"factor": "x"}, "factor='x' is not a number of at least 1"),
                       ({"factor": -4.0}, "factor=-4.0 is not a number"), ({"factor": math.nan}, "factor=nan"),
                       ({"beta_fast": "a"}, "beta_fast='a'"), ({"mscale": True}, "mscale=True"),
                       ({"original_max_position_embeddings": 0}, "=0 is not a positive integer"),
                       ({"original_max_position_embeddings": [1]}, r"=\[1\] is not a positive integer"),
                       ({"beta_fast": 1, "beta_slow": 32}, r"beta_fast=1 is below its beta_slow=32, .* beta_fast >= "),
                       ({"beta_slow": 40}, "beta_fast=32 is below its beta_slow=40")]:
        with pytest.raises(ConfigError, match=match):
            ModelConfig(rope_scaling={**yarn, **bad})
    ModelConfig(rope_scaling={**yarn, "beta_fast": 8, "beta_slow": 8})
    for bad, match in [({"rope_theta": 0.0}, "rope_theta=0.0 must be a number above 1"),
                       ({"rope_theta": 1e-300}, r"rope_theta=1e-300 must be a number above 1 \(RoPE's base"),
                       ({"rope_theta": -1e4}, "rope_theta=-10000.0"), ({"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0"),
                       ({"rms_norm_eps": math.inf}, "rms_norm_eps=inf"),
                       ({"init_std": -0.02}, "init_std=-0.02 must be > 0"),
                       ({"init_std": 0.0}, "init_std=0.0 must be > 0"), ({"init_std": math.nan}, "init_std=nan")]:
        with pytest.raises(ConfigError, match=match):
            ModelConfig(**bad)


@pytest.mark.parametrize("preset, key", [
    ("tiny", "model.dense_intermediate_size"), ("tiny", "model.v_head_dim"), ("tiny", "model.qk_nope_head_dim"),
    ("tiny", "model.qk_rope_head_dim"), ("tiny", "model.kv_lora_rank"), ("tiny", "model.vocab_size"),
    ("tiny", "model.hidden_size"), ("tiny", "model.num_layers"), ("tiny", "model.num_heads"),
    ("tiny", "moe.num_experts"), ("tiny", "moe.expert_intermediate_size"), ("mixtral-8x7b", "model.head_dim"),
    ("mixtral-8x7b", "model.num_kv_heads")])
def test_every_width_the_model_reads_must_be_positive(preset, key):
    config = load_preset(preset)
    for value in (0, -2):
        with pytest.raises(ConfigError) as refused:
            config.replace(**{key: str(value)})
        assert str(refused.value) == f"{key}={value} must be > 0."


def test_zero_is_kept_where_it_means_something():
    tiny = load_preset("tiny")
    for key in ("model.q_lora_rank", "model.first_dense_layers", "model.mtp_layers", "moe.num_shared_experts"):
        assert tiny.replace(**{key: "0"}).to_flat_dict()[key] == 0
    # Mixtral has no dense layer, so nothing reads the dense width; an MTP block that is dense reads it.
    assert load_preset("mixtral-8x7b").replace(**{"model.dense_intermediate_size": "0"})
    dense_mtp = {"model.first_dense_layers": "0", "model.mtp_layers": "1", "model.mtp_block": "dense"}
    tiny.replace(**dense_mtp)
    with pytest.raises(ConfigError, match=r"^model.dense_intermediate_size=0 must be > 0.$"):
        tiny.replace(**dense_mtp, **{"model.dense_intermediate_size": "0"})


def test_the_data_seed_must_not_be_negative():
    with pytest.raises(ConfigError, match=r"^data.shuffle_seed=-1 must be >= 0.$"):
        apply_overrides(Config(), {"data.shuffle_seed": "-1"})
    assert DataConfig(shuffle_seed=0).shuffle_seed == 0
    assert TrainConfig(seed=-1).seed == -1  # jax.random.key takes a negative seed


def test_integers_beyond_32_bits_are_refused_from_every_source():
    message = (f"model.hidden_size=100000000000000000000 is out of range; give an integer between -{INT_LIMIT} "
               f"and {INT_LIMIT}.")
    for build in (lambda: apply_overrides(Config(), {"model.hidden_size": "100_000_000_000_000_000_000"}),
                  lambda: from_dict(json.loads('{"model": {"hidden_size": 100000000000000000000}}')),
                  lambda: ModelConfig(hidden_size=10**20)):  # as an HF import builds it
        with pytest.raises(ConfigError) as refused:
            build()
        assert str(refused.value) == message
    with pytest.raises(ConfigError, match=r"^train.seed=-4294967296 is out of range"):
        apply_overrides(Config(), {"train.seed": str(-2**32)})
    with pytest.raises(ConfigError, match=r"^train.learning_rate=1000.* must be a finite number.$"):
        from_dict({"train": {"learning_rate": 10**400}})
    assert apply_overrides(Config(), {"data.max_bytes": str(2**40)}).data.max_bytes == 2**40  # a 1 TiB corpus cap


@pytest.mark.parametrize("value", [[1], {"a": 1}, ["xla"]])
def test_a_list_or_object_for_a_choice_is_refused_with_one_sentence(value):
    with pytest.raises(ConfigError) as refused:
        from_dict({"moe": {"gmm_backend": value}})
    assert str(refused.value) == (f"moe.gmm_backend={value!r} is not valid; choose one of auto, dropless_mosaic, "
                                  "tokamax_mosaic, xla, capacity.")


def test_cli_strings_become_each_keys_type():
    config = apply_overrides(Config(), {"train.plot": "false", "train.scan_layers": "No", "moe.dedup": "0",
                                        "train.auto_fit": "YES", "train.offload_optimizer": "1",
                                        "train.learning_rate": "1e-3", "train.steps": "1_000"})
    assert (config.train.plot, config.train.scan_layers, config.moe.dedup) == (False, False, False)
    assert (config.train.auto_fit, config.train.offload_optimizer) == (True, True)
    assert config.train.learning_rate == 1e-3 and type(config.train.learning_rate) is float
    assert config.train.steps == 1000 and type(config.train.steps) is int
    for key, raw, message in [("train.steps", "1.5", "train.steps='1.5' must be an integer."),
                              ("train.plot", "maybe", "train.plot='maybe' must be true or false."),
                              ("train.learning_rate", "fast", "train.learning_rate='fast' must be a number.")]:
        with pytest.raises(ConfigError) as refused:
            apply_overrides(Config(), {key: raw})
        assert str(refused.value) == message


@pytest.mark.parametrize("key, suggestion", [
    ("moe.gmm_backnd", " Did you mean 'moe.gmm_backend'?"),
    ("train.learnig_rate", " Did you mean 'train.learning_rate'?"),
    ("dedup", " Did you mean 'moe.dedup'?"),  # the group left out: found by the key's own name
    ("zzz.qqq", " Run 'dropless presets --keys' to list the keys.")])
def test_an_unknown_key_is_answered_with_the_closest_one(key, suggestion):
    with pytest.raises(ConfigError) as refused:
        apply_overrides(Config(), {key: "1"})
    assert str(refused.value) == f"Unknown config key '{key}'.{suggestion}"


def test_each_bound_takes_its_edge_value_and_refuses_the_next():
    assert MoEConfig(num_experts=4, num_experts_per_tok=4).num_experts_per_tok == 4  # dense routing: every expert
    with pytest.raises(ConfigError, match=r"^moe.num_experts_per_tok=5 must be between 1 and moe.num_experts=4.$"):
        MoEConfig(num_experts=4, num_experts_per_tok=5)
    assert DataConfig(eval_fraction=0.49).eval_fraction == 0.49
    for bad in (0.5, 0.0):
        with pytest.raises(ConfigError, match=rf"^data.eval_fraction={bad} must be in \(0, 0.5\).$"):
            DataConfig(eval_fraction=bad)
    assert TrainConfig(min_lr_ratio=1.0).min_lr_ratio == 1.0  # no decay
    with pytest.raises(ConfigError, match=r"^train.min_lr_ratio=1.01 must be in \[0, 1\].$"):
        TrainConfig(min_lr_ratio=1.01)
    assert ModelConfig(vocab_size=INT_LIMIT).vocab_size == INT_LIMIT
    assert TrainConfig(seed=-INT_LIMIT).seed == -INT_LIMIT
    for build in (lambda: ModelConfig(vocab_size=INT_LIMIT + 1), lambda: TrainConfig(seed=-INT_LIMIT - 1)):
        with pytest.raises(ConfigError, match="is out of range; give an integer between"):
            build()


def test_adam_betas_must_be_in_zero_to_one():
    # beta = 1 divides AdamW's bias correction by 1 - 1**t = 0: every step's update would be NaN.
    for key in ("train.beta1", "train.beta2"):
        assert Config().replace(**{key: "0"}).to_flat_dict()[key] == 0.0
        assert Config().replace(**{key: "0.999"}).to_flat_dict()[key] == 0.999
        for bad in ("1", "1.5", "-0.1"):
            with pytest.raises(ConfigError, match=rf"^{key}={float(bad)} must be in \[0, 1\)"):
                Config().replace(**{key: bad})


def test_the_routed_scaling_factor_must_be_positive():
    # 0 would silence every routed expert, a negative factor subtract their outputs.
    assert Config().replace(**{"moe.routed_scaling_factor": "2.5"}).moe.routed_scaling_factor == 2.5
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match=rf"^moe.routed_scaling_factor={float(bad)} must be > 0.$"):
            Config().replace(**{"moe.routed_scaling_factor": bad})


def test_mtp_depths_need_a_sequence_long_enough_to_have_their_targets():
    # Depth k scores positions i < seq_len - k: at seq_len <= k it has none, and its mean cross-entropy is 0 / 0,
    # which made every step non-finite (and skipped) while the run reported its losses.
    tiny = load_preset("tiny")
    assert tiny.replace(**{"model.mtp_layers": "2", "train.seq_len": "3"}).train.seq_len == 3
    for mtp, seq_len in ((1, 1), (2, 2)):
        with pytest.raises(ConfigError, match=rf"^model.mtp_layers={mtp} .* train.seq_len={seq_len} has; raise "
                                              rf"train.seq_len to {mtp + 1} or more, or lower model.mtp_layers.$"):
            tiny.replace(**{"model.mtp_layers": str(mtp), "train.seq_len": str(seq_len)})


def test_a_misspelt_yarn_key_is_named_with_the_closest_one():
    # beta_fst would leave beta_fast at its default of 32 without a word.
    yarn = '{"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fst": 8}'
    with pytest.raises(ConfigError, match=r"^model.rope_scaling has the unknown key 'beta_fst' \(did you mean "
                                          r"'beta_fast'\?\); use only type, .*truncate.$"):
        load_preset("tiny").replace(**{"model.rope_scaling": yarn})
    every = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fast": 8,
             "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1, "attention_factor": 1, "truncate": False}
    assert load_preset("tiny").replace(**{"model.rope_scaling": json.dumps(every)}).model.rope_scaling == every


def test_stop_signals_must_be_ones_a_process_can_catch():
    assert TrainConfig(stop_signals="term, usr1").stop_signal_names == ("SIGTERM", "SIGUSR1")
    for bad in ("SIGKILL", "SIGSTOP", "SIGNOPE"):
        with pytest.raises(ConfigError, match=f"train.stop_signals names '{bad}', which is not a signal"):
            TrainConfig(stop_signals=f"SIGTERM,{bad}")


def test_overrides_split_at_the_first_equals_sign_and_a_flag_may_not_contradict_one():
    assert parse_overrides(["data.source=/corpus/a=b.txt", " train.steps = 5 "]) == {
        "data.source": "/corpus/a=b.txt", "train.steps": "5"}
    for bad in ("train.steps", "=5"):
        with pytest.raises(ConfigError, match="is not a key=value override"):
            parse_overrides([bad])
    # --steps, --data and --tokenizer are the CLI's own flags for three settings: beside the same key=value they
    # must say the same, or neither would be the user's evident intent.
    given = {"train.steps": "0_003", "data.source": "b.txt", "data.tokenizer": "b.json"}  # 0_003 is 3
    config = build_config("tiny", {**given, "train.seed": "4"}, steps=3, data="b.txt", tokenizer="b.json")
    assert (config.train.steps, config.data.source, config.data.tokenizer) == (3, "b.txt", "b.json")
    assert config.train.seed == 4
    for key, flag, other in (("train.steps", "--steps 3", "4"), ("data.source", "--data b.txt", "x"),
                             ("data.tokenizer", "--tokenizer b.json", "x")):
        with pytest.raises(ConfigError, match=f"^{flag} and {key}={other} disagree; give the setting once.$"):
            build_config("tiny", {**given, key: other}, steps=3, data="b.txt", tokenizer="b.json")


def test_a_config_with_yarn_rope_scaling_hashes_so_it_can_be_a_static_jit_argument():
    """Equal configs hash alike, the rope_scaling dict included (every DeepSeek-V3 preset and import has one):
    `jax.jit(transformer.forward, static_argnums=3)` needs a hashable config."""
    yarn = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32}
    config = load_preset("deepseek-v3-671b")
    assert config.model.rope_scaling is not None and hash(config) == hash(load_preset("deepseek-v3-671b"))
    a = config.replace(**{"model.rope_scaling": yarn})
    b = config.replace(**{"model.rope_scaling": dict(reversed(yarn.items()))})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != config.replace(**{"model.rope_scaling": {**yarn, "factor": 4.0}})
