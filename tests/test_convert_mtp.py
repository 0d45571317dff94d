"""DeepSeek-V3's multi-token-prediction layer through the converter: a checkpoint laid out like the official one
(layer num_hidden_layers holding enorm, hnorm, eh_proj, shared_head.{norm,head}, embed_tokens and a whole MoE
decoder layer; FP8 blocks in one variant) imports into `params.mtp`, exports back byte-identical, and leaves the
logits of `dropless logits` as transformers computes them without it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dropless import cli
from dropless.convert import ConvertError, config_from_hf, convert_from_hf, convert_to_hf, load_hf
from dropless.convert.safetensors_io import CheckpointReader
from tests.test_convert_weights import BF16, FIXTURES, _quantize, assert_same_tensors, assert_trees_equal, rewrite

SOURCE = FIXTURES / "deepseek_v3"  # layers: dense, MoE, MoE
MAIN_LAYERS = json.loads((SOURCE / "config.json").read_text())["num_hidden_layers"]
MTP = f"model.layers.{MAIN_LAYERS}."


def with_mtp_layer(name: str, array: np.ndarray, rng=np.random.default_rng(0)) -> dict:
    """Every tensor as it is, and for the last MoE layer's tensors a perturbed copy as the MTP layer's block; with
    the embedding and lm_head, the MTP layer's own tensors (the official checkpoint's names)."""
    out = {name: array}
    perturb = lambda a: (a * (1.0 + 0.1 * rng.standard_normal(a.shape))).astype(a.dtype)
    last = f"model.layers.{MAIN_LAYERS - 1}."
    if name.startswith(last):
        out[MTP + name[len(last):]] = perturb(array)
    hidden = array.shape[-1]
    if name == "model.embed_tokens.weight":
        out[MTP + "embed_tokens.weight"] = array.copy()
        out[MTP + "enorm.weight"] = perturb(np.ones(hidden, array.dtype))
        out[MTP + "hnorm.weight"] = perturb(np.ones(hidden, array.dtype))
        out[MTP + "eh_proj.weight"] = (0.05 * rng.standard_normal((hidden, 2 * hidden))).astype(array.dtype)
        out[MTP + "shared_head.norm.weight"] = perturb(np.ones(hidden, array.dtype))
    if name == "lm_head.weight":
        out[MTP + "shared_head.head.weight"] = array.copy()
    return out


@pytest.fixture(scope="module")
def official_layout(tmp_path_factory) -> Path:
    return rewrite(SOURCE, tmp_path_factory.mktemp("mtp") / "hf", with_mtp_layer, {"num_nextn_predict_layers": 1})


def test_mtp_layer_imports_into_params_mtp_and_round_trips_byte_identical(official_layout, tmp_path):
    config, params, state = load_hf(official_layout)
    assert (config.model.mtp_layers, config.model.mtp_block) == (1, "moe")
    # The main model is the fixture's, untouched; the MTP layer lands in params.mtp row 0 and router-bias row 2.
    _, plain_params, plain_state = load_hf(SOURCE)
    assert_trees_equal({k: v for k, v in params.items() if k != "mtp"}, plain_params)
    np.testing.assert_array_equal(np.asarray(state["router_bias"][:2]), np.asarray(plain_state["router_bias"]))
    with CheckpointReader(official_layout) as reader:
        mtp = params["mtp"]
        np.testing.assert_array_equal(np.asarray(mtp["eh_proj"][0]), reader.read(MTP + "eh_proj.weight").T)
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("head_norm", "shared_head.norm")):
            np.testing.assert_array_equal(np.asarray(mtp[ours][0]), reader.read(f"{MTP}{theirs}.weight"))
        np.testing.assert_array_equal(np.asarray(mtp["block"]["moe"]["router"]["kernel"][0]),
                                      reader.read(MTP + "mlp.gate.weight").T)
        np.testing.assert_array_equal(np.asarray(state["router_bias"][2]),
                                      reader.read(MTP + "mlp.gate.e_score_correction_bias"))

    run = tmp_path / "run"
    convert_from_hf(official_layout, run)
    exported = tmp_path / "exported"
    convert_to_hf(run, exported)
    assert_same_tensors(exported, official_layout)
    assert json.loads((exported / "config.json").read_text())["num_nextn_predict_layers"] == 1

    # `dropless logits` ignores the MTP module: transformers' logits of the checkpoint without it.
    out = tmp_path / "logits.npy"
    assert cli.main(["logits", "--run-dir", str(run), "--tokens", str(SOURCE / "tokens.npy"), "--out", str(out)]) == 0
    assert float(np.abs(np.load(out) - np.load(SOURCE / "logits.npy")).max()) <= 1e-4


def test_fp8_mtp_layer_imports_dequantized_and_exports_as_bfloat16(official_layout, tmp_path):
    block = (16, 8)

    def is_quantized(name, array):  # DeepSeek-V3 quantizes the linear layers, the MTP layer's included
        return array.ndim == 2 and name.endswith("proj.weight")

    def to_fp8(name, array):
        if not is_quantized(name, array):
            return {name: array}
        quantized, scale = _quantize(array, block)
        return {name: quantized, name + "_scale_inv": scale}

    def to_reference(name, array):
        if not is_quantized(name, array):
            return {name: array}
        quantized, scale = _quantize(array, block)
        rows = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:array.shape[0], :array.shape[1]]
        return {name: (quantized.astype(np.float32) * rows).astype(BF16)}

    quant = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}}
    fp8 = rewrite(official_layout, tmp_path / "fp8", to_fp8, quant)
    reference = rewrite(official_layout, tmp_path / "ref", to_reference)
    assert_trees_equal(load_hf(fp8)[1:], load_hf(reference)[1:])
    convert_from_hf(fp8, tmp_path / "run")
    convert_to_hf(tmp_path / "run", tmp_path / "exported")
    assert_same_tensors(tmp_path / "exported", reference)


def test_mtp_copies_that_differ_from_the_shared_tensors_are_refused(official_layout, tmp_path):
    def change_copy(name, array):
        return {name: array + 1 if name == MTP + "shared_head.head.weight" else array}

    changed = rewrite(official_layout, tmp_path / "changed", change_copy)
    with pytest.raises(ConvertError, match=rf"Tensor {MTP}shared_head\.head\.weight differs from lm_head\.weight"):
        load_hf(changed)


def test_a_config_announcing_mtp_without_its_weights_imports_the_main_model(tmp_path):
    config, params, _ = load_hf(rewrite(SOURCE, tmp_path / "hf", config_update={"num_nextn_predict_layers": 1}))
    assert config.model.mtp_layers == 0 and "mtp" not in params


def test_a_config_announcing_a_dense_mtp_layer_without_its_weights_exports_the_same_config(tmp_path):
    """DeepSeek's rule makes layer num_hidden_layers dense here (D D M, then D): the model imported without its
    MTP layer reads back from its export with an equal config."""
    source = FIXTURES / "deepseek_v3_interleaved"  # D D M D, moe_layer_freq 2

    def first_three_layers(name, array):
        return {} if name.startswith("model.layers.3.") else {name: array}

    hf = rewrite(source, tmp_path / "hf", first_three_layers, {"num_hidden_layers": 3, "num_nextn_predict_layers": 1})
    config = convert_from_hf(hf, tmp_path / "run")
    assert config.model.mtp_layers == 0
    convert_to_hf(tmp_path / "run", tmp_path / "exported")
    assert config_from_hf(json.loads((tmp_path / "exported" / "config.json").read_text())) == config

