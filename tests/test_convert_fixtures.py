"""Each transformers fixture (tools/make_hf_fixtures.py) through dropless.convert: logits equal to transformers'
within 1e-4 in float32, through `dropless logits` from the HF directory and from an imported run directory, and
HF -> dropless -> HF gives byte-identical tensors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from dropless import cli
from dropless.models import transformer
from dropless.convert import ConvertError, compute_logits, config_from_hf, convert_from_hf, convert_to_hf, load_hf
from dropless.convert.safetensors_io import CheckpointReader
from dropless.train import checkpoint as ckpt
from dropless.train import setup as setup_lib

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())
TOLERANCE = 1e-4


def test_fixtures_cover_every_family_and_stay_small():
    families = {config_from_hf(json.loads((FIXTURES / n / "config.json").read_text())).model.family for n in NAMES}
    assert families == {"deepseek_v3", "mixtral", "qwen3_moe"}
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 5e6, f"fixtures take {total / 1e6:.1f} MB"


def _logits_cli(tmp_path: Path, source: list[str], tokens: Path) -> np.ndarray:
    out = tmp_path / f"logits_{source[0].strip('-')}.npy"
    assert cli.main(["logits", *source, "--tokens", str(tokens), "--out", str(out)]) == 0
    return np.load(out)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_and_round_trip_is_exact(name, tmp_path):
    fixture = FIXTURES / name
    tokens, expected = fixture / "tokens.npy", np.load(fixture / "logits.npy")

    from_hf = _logits_cli(tmp_path, ["--hf-dir", str(fixture)], tokens)
    assert from_hf.dtype == np.float32 and from_hf.shape == expected.shape
    error = float(np.abs(from_hf - expected).max())
    print(f"{name}: max |dropless - transformers| = {error:.2e}")
    assert error <= TOLERANCE

    run = tmp_path / "run"
    config = convert_from_hf(fixture, run)
    assert ckpt.load_run_config(run) == config
    from_run = _logits_cli(tmp_path, ["--run-dir", str(run)], tokens)
    np.testing.assert_array_equal(from_run, from_hf)  # the run directory holds exactly the same weights

    exported = tmp_path / "exported"
    assert convert_to_hf(run, exported) == 0  # the import's one checkpoint
    source, back = CheckpointReader(fixture), CheckpointReader(exported)
    assert sorted(back.tensors) == sorted(source.tensors)
    for tensor in source.tensors:
        assert back.tensors[tensor].dtype == source.tensors[tensor].dtype, tensor
        assert back.read(tensor).tobytes() == source.read(tensor).tobytes(), tensor
    hf_config = json.loads((exported / "config.json").read_text())
    original = json.loads((fixture / "config.json").read_text())
    assert config_from_hf(hf_config) == config
    assert hf_config["architectures"] == original["architectures"]
    assert all(hf_config.get(k) == original.get(k) for k in ("bos_token_id", "eos_token_id"))


@pytest.mark.parametrize("tokens, fragment", [
    (np.full((1, 3), 256), r"tokens_BS holds ids outside \[0, 256\)"), (np.asarray([[2, -1]]), "outside"),
    (np.ones((1, 257), np.int32), r"sequences of 257 tokens, longer than the model accepts \(256"),
    (np.asarray([1, 2, 3]), r"integer array \[batch, seq\].*shape \(3,\)"),
    (np.asarray([[1.5, 2.0]]), "float64"), (np.zeros((1, 0), np.int32), "non-empty")])
def test_compute_logits_refuses_tokens_the_model_cannot_take(tokens, fragment):
    """The Python API checks what `dropless logits` checks: an id outside the vocabulary would read a clamped
    embedding row and return wrong logits silently, a 1-D array would fail deep inside the model."""
    config, params, state = load_hf(FIXTURES / "deepseek_v3")
    with pytest.raises(ConvertError, match=fragment):
        compute_logits(config, params, state, tokens)


def test_export_of_a_step_the_run_does_not_have_names_the_saved_steps(tmp_path):
    run = tmp_path / "run"
    convert_from_hf(FIXTURES / "mixtral", run)
    with pytest.raises(ckpt.CheckpointError, match=r"has no checkpoint for step 5; the saved steps are \[0\]\.$"):
        convert_to_hf(run, tmp_path / "exported", step=5)
    assert not (tmp_path / "exported").exists()
    assert convert_to_hf(run, tmp_path / "exported", step=0) == 0


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe_tied"])
def test_weights_loaded_in_the_inference_dtypes_are_the_float32_weights_cast_bit_for_bit(name):
    """`load_hf(dtypes=...)` builds each matrix in bf16 on the host (what `dropless generate` loads on a GPU): the
    same bits as loading float32 and casting on the device, the routers and norm weights still float32."""
    def bf16(config):
        return transformer.inference_dtypes(config.replace(**{"train.dtype": "bfloat16"}))

    config, params, state = load_hf(FIXTURES / name, dtypes=bf16)
    _, full, full_state = load_hf(FIXTURES / name)
    want = transformer.inference_weights(full, config.replace(**{"train.dtype": "bfloat16"}))
    kinds = set()
    for (path, got), (_, expected) in zip(jax.tree_util.tree_leaves_with_path(params),
                                          jax.tree_util.tree_leaves_with_path(want), strict=True):
        assert got.dtype == expected.dtype, jax.tree_util.keystr(path)
        bits = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
        np.testing.assert_array_equal(np.asarray(got).view(bits), np.asarray(expected).view(bits),
                                      err_msg=jax.tree_util.keystr(path))
        kinds.add((transformer.is_router_weight(path), got.ndim >= 2, str(got.dtype)))
    assert kinds == {(True, True, "float32"), (False, True, "bfloat16"), (False, False, "float32")}
    assert jax.tree.map(lambda x: x.dtype, state) == jax.tree.map(lambda x: x.dtype, full_state)


def test_weights_loaded_into_shardings_are_placed_there_with_the_same_values():
    """`load_hf(shardings=...)` (what `dropless eval --hf-dir` loads) puts each array straight into its place on the
    mesh, expert weights split over the expert axis, with the values of the one-device load."""
    config, params, state = load_hf(FIXTURES / "deepseek_v3")
    setup = setup_lib.build(config.replace(**{"parallel.fsdp": 2, "parallel.expert": 4, "train.batch_size": 8}))
    shardings = {"params": setup.state_shardings.params, "state": setup.state_shardings.model_state}
    _, placed, placed_state = load_hf(FIXTURES / "deepseek_v3", shardings=shardings)
    split = 0
    for got, want, sharding in zip(jax.tree.leaves((placed, placed_state)), jax.tree.leaves((params, state)),
                                   jax.tree.leaves(shardings), strict=True):
        assert got.sharding == sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        split += got.addressable_shards[0].data.size < got.size
    experts = jax.tree.leaves(placed["moe_layers"]["moe"]["experts"])
    assert split and not any(weight.sharding.is_fully_replicated for weight in experts)
