"""The config dataclasses: every choice declared once by its annotation, every value validated at construction."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from dropless.core.config import (ACTIVATION_NAMES, Config, ConfigError, ModelConfig, MoEConfig, ParallelConfig,
                                  TrainConfig, _group_classes, apply_overrides)

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
NEEDS = {("moe", "router_common_source", "other_sequences"): {"router_common_rate": 0.3}}


def test_activation_offloading_is_validated_when_the_config_is_built():
    assert TrainConfig(remat="full", offload=" moe_in, attn_out ").offload_names == ("moe_in", "attn_out")
    assert TrainConfig().offload_names == ()
    with pytest.raises(ConfigError, match="train.offload names unknown activation.s. nope; choose from "
                                          + ", ".join(ACTIVATION_NAMES)):
        TrainConfig(remat="full", offload="moe_in,nope")
    with pytest.raises(ConfigError, match="train.offload='moe_in' needs train.remat=full"):
        TrainConfig(offload="moe_in")


def test_cross_group_and_rope_settings_are_validated_when_the_config_is_built():
    with pytest.raises(ConfigError, match="moe.num_experts=6 is not divisible by parallel.expert=4"):
        Config(moe=MoEConfig(num_experts=6), parallel=ParallelConfig(expert=4))
    Config(moe=MoEConfig(num_experts=8), parallel=ParallelConfig(expert=4))
    with pytest.raises(ConfigError, match="needs 'factor' and 'original_max_position_embeddings'"):
        ModelConfig(rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="type 'linear' is not supported"):
        ModelConfig(rope_scaling={"type": "linear", "factor": 4.0})
