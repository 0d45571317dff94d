"""The slab-by-slab orbax writer/reader agree with orbax itself: what RunWriter writes, orbax restores; what orbax
saved during training (its own chunking), RunReader reads; a failed import leaves no run directory behind."""

from __future__ import annotations

import dataclasses
import json
import warnings

import jax
import numpy as np
import pytest

from dropless.core.config import load_preset
from dropless.convert import ConvertError, ConvertWarning, convert_to_hf, load_hf
from dropless.convert.api import HF_SOURCE
from dropless.convert.run_store import RunReader, RunWriter, model_leaf_shapes
from dropless.models import transformer
from dropless.train import checkpoint as ckpt


def _tiny(family_overrides: dict):
    """The tiny preset, narrower; without the routers' running input means (which export folds into the router
    weights, so the round trip is exact only without them; their own test sets them)."""
    return load_preset("tiny").replace(**{"model.vocab_size": 96, "model.hidden_size": 32, "model.num_layers": 3,
                                          "model.dense_intermediate_size": 40, "moe.expert_intermediate_size": 24,
                                          "moe.router_common_rate": 0.0, **family_overrides})


def _random_model(config, seed=0):
    """Random (params, state) in the model's layout; NumPy-drawn, as compiling init_params is slow on CPU."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: {"params": transformer.init_params(jax.random.key(0), config),
                                     "state": transformer.init_state(config)})
    tree = jax.tree.map(lambda s: jax.numpy.asarray(rng.standard_normal(s.shape, np.float32)), shapes)
    return tree["params"], tree["state"]


def test_run_writer_output_restores_in_orbax_exactly(tmp_path):
    config = _tiny({})
    params, state = _random_model(config)
    flat = {tuple(str(k.key) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path({"params": params, "state": state})}
    shapes = model_leaf_shapes(config)
    assert set(shapes) == set(flat)
    depth = {leaf: (2 if "experts" in leaf else 1 if ("dense_layers" in leaf or "moe_layers" in leaf
                                                     or "state" in leaf) else 0) for leaf in shapes}
    with RunWriter(tmp_path / "run", config, {leaf: (shapes[leaf], depth[leaf]) for leaf in shapes}) as writer:
        for leaf, array in flat.items():
            for index in np.ndindex(*array.shape[:depth[leaf]]):
                writer.write(leaf, index, array[index])
    restored_config, restored_params, restored_state = ckpt.load_model(tmp_path / "run")
    assert restored_config == config
    for path, leaf in jax.tree_util.tree_leaves_with_path({"params": restored_params, "state": restored_state}):
        np.testing.assert_array_equal(np.asarray(leaf), flat[tuple(str(k.key) for k in path)])


def test_failed_import_leaves_no_run_directory(tmp_path):
    config = _tiny({})
    shapes = model_leaf_shapes(config)
    with pytest.raises(RuntimeError, match="boom"):
        with RunWriter(tmp_path / "run", config, {leaf: (shape, 0) for leaf, shape in shapes.items()}):
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overrides", [
    {},  # DeepSeek-V3 style (MLA, shared expert, correction bias)
    {"model.family": "qwen3_moe", "model.attention": "gqa", "model.qk_norm": True, "model.num_kv_heads": 2,
     "model.head_dim": 8, "model.first_dense_layers": 0, "moe.score_func": "softmax", "moe.num_shared_experts": 0,
     "moe.n_group": 1, "moe.topk_group": 1, "model.tie_embeddings": True},
])
def test_a_run_trained_here_exports_and_reimports_exactly(tmp_path, overrides):
    """A run saved by training (orbax's own chunking, no hf_source.json) exports losslessly in float32."""
    config = _tiny(overrides)
    params, state = _random_model(config, seed=3)
    ckpt.save_model(tmp_path / "run", config, params, state, step=7)
    (tmp_path / "run" / "tokenizer.json").write_text("{}")
    assert RunReader(tmp_path / "run").step == 7
    exported = tmp_path / "hf"
    if config.moe.score_func == "softmax":  # Qwen3's format has no tensor for the routers' balancing biases
        with pytest.warns(ConvertWarning, match=r"balancing biases \(largest \|bias\| .*\) have no tensor in the "
                                                r"qwen3_moe format and are left out.*moe.bias_update_rate=0"):
            assert convert_to_hf(tmp_path / "run", exported) == 7
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert convert_to_hf(tmp_path / "run", exported) == 7
    assert not (tmp_path / "run" / HF_SOURCE).exists() and (exported / "tokenizer.json").is_file()
    assert json.loads((exported / "config.json").read_text())["torch_dtype"] == "float32"
    loaded_config, loaded_params, loaded_state = load_hf(exported)
    unused = {"q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"} \
        if config.model.attention == "gqa" else {"num_kv_heads", "head_dim"}  # other attention's settings
    for field in dataclasses.fields(config.model):
        if field.name not in unused:
            assert getattr(loaded_config.model, field.name) == getattr(config.model, field.name), field.name
    if config.moe.score_func == "softmax":  # no correction bias in HF Qwen3: it comes back as zeros
        state = {"router_bias": np.zeros_like(state["router_bias"])}
        ckpt.save_model(tmp_path / "unbiased", config, params, state)  # nothing left out: no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            convert_to_hf(tmp_path / "unbiased", tmp_path / "hf-unbiased")
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((loaded_params, loaded_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_router_s_running_input_mean_is_folded_into_its_weight_on_export(tmp_path):
    """moe.router_common_rate: the running means have no HF tensor; the exported router weights carry them
    (fold_common), so the re-imported model (rate 0, no such state) computes the same logits, MTP block
    included, and every other tensor comes back exactly."""
    config = _tiny({"moe.router_common_rate": 0.1, "model.mtp_layers": 1})
    params, state = _random_model(config, seed=5)
    assert state["router_common"].shape == (transformer.num_router_rows(config.model), 32)
    ckpt.save_model(tmp_path / "run", config, params, state, step=3)
    convert_to_hf(tmp_path / "run", tmp_path / "hf")
    loaded_config, loaded_params, loaded_state = load_hf(tmp_path / "hf")
    assert loaded_config.moe.router_common_rate == 0.0 and set(loaded_state) == {"router_bias"}
    np.testing.assert_array_equal(loaded_state["router_bias"], state["router_bias"])
    tokens = np.random.default_rng(0).integers(0, 96, size=(2, 12))
    logits = lambda c, p, s: transformer.forward(p, s, tokens, c, mtp=True)
    want, want_aux = jax.jit(lambda p, s: logits(config, p, s))(params, state)
    got, got_aux = jax.jit(lambda p, s: logits(loaded_config, p, s))(loaded_params, loaded_state)
    np.testing.assert_array_equal(got_aux["moe"].tokens_per_expert, want_aux["moe"].tokens_per_expert)
    for a, b in ((got, want), *zip(got_aux["mtp_logits"], want_aux["mtp_logits"])):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * float(np.abs(np.asarray(b)).max()))
    routers = lambda tree: [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
                            if "router" in jax.tree_util.keystr(path)]
    for mine, exported in zip(routers(params), routers(loaded_params), strict=True):
        assert np.abs(np.asarray(mine) - np.asarray(exported)).max() > 1e-3  # folded, not copied
    others = lambda tree: [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
                           if "router" not in jax.tree_util.keystr(path)]
    for a, b in zip(others(params), others(loaded_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_trained_run_without_moe_layers_exports_and_round_trips_exactly(tmp_path):
    """All layers dense: the router state has 0 rows, which a training checkpoint does not store (nothing to
    save); the export's verification skips it rather than failing to read it, and the round trip is exact."""
    config = _tiny({"model.layer_pattern": "DDD", "model.first_dense_layers": 3})
    params, state = _random_model(config)
    assert state["router_bias"].shape == (0, config.moe.num_experts)
    ckpt.save_model(tmp_path / "run", config, params, state)
    convert_to_hf(tmp_path / "run", tmp_path / "hf")
    loaded_config, loaded_params, loaded_state = load_hf(tmp_path / "hf")
    assert loaded_config.model.layer_types == "DDD"
    for a, b in zip(jax.tree.leaves((loaded_params, loaded_state)), jax.tree.leaves((params, state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_exporting_a_run_whose_config_a_family_cannot_hold_is_refused(tmp_path):
    config = _tiny({"model.family": "mixtral"})  # MLA attention is not Mixtral's
    ckpt.save_model(tmp_path / "run", config, *_random_model(config))
    with pytest.raises(ConvertError, match="model.attention='mla' cannot be expressed in a MixtralForCausalLM"):
        convert_to_hf(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
