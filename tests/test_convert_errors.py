"""`dropless convert` on damaged or hostile input: a damaged checkpoint is noticed through its digest, an imported
run gets a digest of its own, malformed files are refused in one line naming them, and no failure leaves an output
or a temporary directory behind."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path

import jax
import numpy as np
import pytest

from dropless import cli
from dropless.convert import ConvertError, convert_from_hf, convert_to_hf, run_store
from dropless.convert import api
from dropless.convert.api import HF_SOURCE
from dropless.convert.safetensors_io import CheckpointReader, write_sharded
from dropless.core import config as config_lib
from dropless.train import checkpoint as ckpt
from tests.test_convert_run_store import _random_model, _tiny

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def _damage(run: Path, step: int, how: str) -> None:
    """Flip bytes in, cut in half or delete the largest data file of checkpoint `step`'s model item (orbax's
    writes are under ocdbt.process_0/, RunWriter's in the item's own store)."""
    files = sorted((run / "checkpoints" / str(step) / "model").glob("**/d/*"), key=lambda path: path.stat().st_size)
    data = bytearray(files[-1].read_bytes())
    if how == "flip":
        data[len(data) // 2:len(data) // 2 + 4] = bytes(255 - b for b in data[len(data) // 2:len(data) // 2 + 4])
        files[-1].write_bytes(bytes(data))
    elif how == "truncate":
        files[-1].write_bytes(bytes(data[:len(data) // 2]))
    else:
        files[-1].unlink()


def _cli(capsys, *argv: str) -> tuple[int, list[str]]:
    """(exit status, the non-empty lines of stderr) of `dropless ARGV`, in this process."""
    status = cli.main(list(argv))
    return status, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _leftovers(directory: Path) -> list[str]:
    return [path.name for path in directory.iterdir() if ".tmp-" in path.name]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run with checkpoints 2 and 4 of different weights (copy it before damaging it)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    config = _tiny({})
    for step, seed in ((2, 0), (4, 1)):
        ckpt.save_model(run, config, *_random_model(config, seed), step=step)
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def test_fold_of_slabs_adds_up_to_the_checkpoint_digest():
    """The streamed digest (slab by slab, any order) equals train's digest of the whole array, for every width."""
    rng = np.random.default_rng(0)
    for dtype in (np.float32, jax.numpy.bfloat16, np.bool_):
        array = (rng.standard_normal((3, 2, 1001)) * 100).astype(dtype)
        folds = [run_store.fold(array[index], run_store._flat_offset(array.shape, index))
                 for index in reversed(list(np.ndindex(3, 2)))]
        got = [sum(f[0] for f in folds) & 0xFFFFFFFF, sum(f[1] for f in folds) & 0xFFFFFFFF]
        assert got == ckpt.digest({"x": {"a": jax.numpy.asarray(array)}})["x/a"], dtype


def test_fold_of_slabs_of_8_byte_elements_adds_up_to_the_checkpoint_digest():
    """8-byte elements count as two words each, in a slab's starting offset too (host arrays: int64, float64)."""
    rng = np.random.default_rng(0)
    for dtype in (np.int64, np.float64):
        array = (rng.standard_normal((3, 2, 5)) * 1e6).astype(dtype)
        folds = [run_store.fold(array[index], run_store._flat_offset(array.shape, index))
                 for index in np.ndindex(3, 2)]
        got = [sum(f[0] for f in folds) & 0xFFFFFFFF, sum(f[1] for f in folds) & 0xFFFFFFFF]
        assert got == ckpt.digest({"x": {"a": array}})["x/a"], dtype


def test_export_skips_a_damaged_checkpoint_for_the_newest_good_one(trained, tmp_path):
    run = _copy(trained, tmp_path)
    _damage(run, 4, "flip")
    with pytest.warns(ckpt.CheckpointWarning, match=r"checkpoint 4 in .* is damaged \(digest mismatch in model/"
                                                    r"params/.*\); exported checkpoint 2 instead"):
        convert_to_hf(run, tmp_path / "hf")
    _, params, _ = ckpt.load_model(run, step=2)
    with CheckpointReader(tmp_path / "hf") as reader:
        np.testing.assert_array_equal(reader.read("model.embed_tokens.weight"), np.asarray(params["embed"]))
    with pytest.raises(ckpt.DamagedCheckpoint, match="checkpoint 4 .* is damaged"):
        convert_to_hf(run, tmp_path / "hf4", step=4)
    assert not (tmp_path / "hf4").exists() and _leftovers(tmp_path) == []


def test_load_model_skips_a_damaged_checkpoint_and_leaves_it_in_place(trained, tmp_path):
    """`generate` and `logits` (load_model) only read a run: the damaged newest checkpoint is skipped with a
    warning, and stays where it is (a resume, not a read, sets it aside)."""
    run = _copy(trained, tmp_path)
    _damage(run, 4, "flip")
    with pytest.warns(ckpt.CheckpointWarning, match=r"checkpoint 4 in .* is damaged .*; using checkpoint 2"):
        _, params, _ = ckpt.load_model(run)
    _, want, _ = ckpt.load_model(run, step=2)
    for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert ckpt.all_steps(run) == [4, 2] and not (run / "checkpoints.damaged").exists()


@pytest.mark.parametrize("index", ["manifest", "metadata", "no metadata", "no item", "a file"])
def test_export_skips_a_checkpoint_whose_index_is_damaged(trained, tmp_path, capsys, index):
    """A torn OCDBT manifest (where each array's chunks are found) or orbax's _METADATA (the tree) of the newest
    checkpoint, or that _METADATA or the whole model item gone: a damaged checkpoint, exported from the one before
    as `dropless train --resume` would resume."""
    run = _copy(trained, tmp_path)
    item = run / "checkpoints" / "4" / "model"
    if index == "no metadata":
        (item / "_METADATA").unlink()
    elif index == "no item":
        shutil.rmtree(item)
    elif index == "a file":  # the step's directory replaced by a file: listed, not skipped in silence
        shutil.rmtree(item.parent)
        item.parent.write_text("not a checkpoint")
    for path in (item.glob("**/manifest.ocdbt") if index == "manifest" else
                 [item / "_METADATA"] if index == "metadata" else []):
        path.write_bytes(path.read_bytes()[:20])
    status = cli.main(["convert", "--from", str(run), "--to-hf", str(tmp_path / "hf")])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert status == 0 and len(lines) == 1, lines
    assert lines[0].startswith("dropless: warning: checkpoint 4 in ") and "cannot be read" in lines[0], lines
    assert lines[0].endswith("exported checkpoint 2 instead."), lines
    assert captured.out == f"dropless: exported checkpoint 2 of {run} to Hugging Face format in {tmp_path / 'hf'}\n"
    _, params, _ = ckpt.load_model(run, step=2)
    with CheckpointReader(tmp_path / "hf") as reader:
        np.testing.assert_array_equal(reader.read("model.embed_tokens.weight"), np.asarray(params["embed"]))


def test_export_skips_a_checkpoint_deleted_while_it_is_read(trained, tmp_path, capsys, monkeypatch):
    """Another process deleting the newest step after the reader found it: damaged, exported from the one before,
    not an error naming a vanished file."""
    run = _copy(trained, tmp_path)
    found = run_store.RunReader.__init__

    def deleted_meanwhile(self, *args, **kwargs):
        found(self, *args, **kwargs)
        if self.step == 4:
            shutil.rmtree(self.item_dir.parent)

    monkeypatch.setattr(run_store.RunReader, "__init__", deleted_meanwhile)
    status, lines = _cli(capsys, "convert", "--from", str(run), "--to-hf", str(tmp_path / "hf"))
    assert status == 0 and len(lines) == 1, lines
    assert lines[0].startswith("dropless: warning: checkpoint 4 in ") and "cannot be read" in lines[0], lines
    assert lines[0].endswith("exported checkpoint 2 instead."), lines


def test_export_of_a_checkpoint_of_another_config_is_one_line(trained, tmp_path, capsys):
    """A config.json that names parameters the checkpoints do not hold (an MTP module added) is no damage: no
    fallback, one line naming the mismatch."""
    run = _copy(trained, tmp_path)
    config = config_lib.load(run / "config.json")
    config_lib.save(config.replace(**{"model.mtp_layers": 1}), run / "config.json")
    status, lines = _cli(capsys, "convert", "--from", str(run), "--to-hf", str(tmp_path / "hf"))
    assert status == 2 and len(lines) == 1, lines
    assert "has no array for params.mtp" in lines[0] and "does not match the run's config.json" in lines[0], lines
    assert not (tmp_path / "hf").exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_export_of_a_run_without_a_good_checkpoint_is_one_line(trained, tmp_path, capsys, how):
    run = _copy(trained, tmp_path)
    for step in (2, 4):
        _damage(run, step, how)
    status, lines = _cli(capsys, "convert", "--from", str(run), "--to-hf", str(tmp_path / "hf"))
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("dropless: error: checkpoint 4 in ") and "(steps 4, 2)" in lines[0], lines
    assert ("digest mismatch" if how == "flip" else "cannot be read") in lines[0]
    assert not (tmp_path / "hf").exists() and _leftovers(tmp_path) == []


def test_an_imported_run_has_a_digest_that_later_loads_verify(tmp_path):
    run = tmp_path / "run"
    convert_from_hf(FIXTURES / "qwen3_moe_tied", run)
    assert (run / "checkpoints" / "0" / "digest").is_dir()
    ckpt.load_model(run)  # verified: no warning, no error
    _damage(run, 0, "flip")
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint 0 in .* is damaged \(digest mismatch"):
        ckpt.load_model(run)
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint 0 in .* is damaged \(digest mismatch"):
        convert_to_hf(run, tmp_path / "hf")


def test_an_import_whose_output_appears_meanwhile_fails_in_one_line_and_cleans_up(tmp_path, monkeypatch, capsys):
    """Two converts to one output: the loser's final rename fails; it says so and leaves no temporary directory.
    A failure while the writer starts leaves none either."""
    real_import = run_store.RunWriter._fix_metadata

    def rival_finishes_first(writer):
        real_import(writer)
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / "config.json").write_text("{}")

    monkeypatch.setattr(run_store.RunWriter, "_fix_metadata", rival_finishes_first)
    status, lines = _cli(capsys, "convert", "--from-hf", str(FIXTURES / "qwen3_moe_tied"),
                         "--to", str(tmp_path / "run"))
    assert status == 2 and len(lines) == 1 and "appeared while converting" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    monkeypatch.undo()

    def no_array(*args, **kwargs):  # after orbax wrote the placeholders into the temporary directory
        raise ckpt.CheckpointError("no array for params.embed")

    monkeypatch.setattr(run_store, "_open_leaf", no_array)
    with pytest.raises(ckpt.CheckpointError, match="no array"):
        convert_from_hf(FIXTURES / "qwen3_moe_tied", tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_an_export_whose_output_appears_meanwhile_fails_in_one_line_and_cleans_up(trained, tmp_path, monkeypatch,
                                                                                  capsys):
    real_write = api.write_sharded

    def rival_finishes_first(*args, **kwargs):
        written = real_write(*args, **kwargs)
        (tmp_path / "hf").mkdir(exist_ok=True)
        (tmp_path / "hf" / "config.json").write_text("{}")
        return written

    monkeypatch.setattr(api, "write_sharded", rival_finishes_first)
    status, lines = _cli(capsys, "convert", "--from", str(trained), "--to-hf", str(tmp_path / "hf"))
    assert status == 2 and len(lines) == 1 and f"{tmp_path / 'hf'} appeared while converting" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_the_current_directory_is_a_valid_output(trained, tmp_path, monkeypatch):
    """`--to .` and `--to-hf .` name the (empty) current directory, which Path.with_name cannot build beside."""
    for name in ("hf", "imported"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / "hf")
    convert_to_hf(trained, Path("."))
    monkeypatch.chdir(tmp_path / "imported")
    convert_from_hf(FIXTURES / "qwen3_moe_tied", Path("."))
    monkeypatch.chdir(tmp_path)
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "imported" / "config.json").is_file()
    assert _leftovers(tmp_path) == []
    with pytest.raises(ckpt.CheckpointError, match="cannot be an output directory"):
        run_store.temporary_sibling(Path("/"))


def test_an_output_in_an_unwritable_directory_is_named_in_one_line(trained, tmp_path, capsys, monkeypatch):
    """The one line names the output given, not the hidden directory each direction builds it in."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: make the directory refuse as the OS would
        original = Path.mkdir

        def refuse(self, *args, **kwargs):
            if locked in self.parents:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return original(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", refuse)
    for argv, out in ((["--from", str(trained), "--to-hf"], locked / "hf"),
                      (["--from-hf", str(FIXTURES / "qwen3_moe_tied"), "--to"], locked / "run")):
        status, lines = _cli(capsys, "convert", *argv, str(out))
        assert status == 2 and lines == [f"dropless: error: {out}: permission denied; check its permissions or "
                                         "choose another location."]
    locked.chmod(0o700)
    assert list(locked.iterdir()) == []


@pytest.mark.parametrize("source, fault", [
    ({"config": 5, "dtypes": {}}, "is not an object with a 'config' object"),
    ([1], "is not an object with a 'config' object"),
    ({"config": None, "dtypes": []}, "is not an object with a 'config' object"),
    ({"config": None, "dtypes": {"model.embed_tokens.weight": "Q8"}}, "records dtype 'Q8' for model.embed_tokens"),
    ({"config": None, "dtypes": {"model.embed_tokens.weight": "I8"}}, "records dtype 'I8'"),  # would cast to int8
])
def test_a_malformed_hf_source_json_is_named(trained, tmp_path, source, fault):
    run = _copy(trained, tmp_path)
    (run / HF_SOURCE).write_text(json.dumps(source))
    with pytest.raises(ConvertError, match=fault) as err:
        convert_to_hf(run, tmp_path / "hf")
    assert str(run / HF_SOURCE) in str(err.value) and "delete it" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("offsets", [["0", "8"], [-8, 0], [8, 4], [True, 8]])
def test_a_safetensors_header_with_impossible_offsets_is_named(tmp_path, offsets):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(ConvertError, match="model.safetensors has a corrupt safetensors header"):
        CheckpointReader(tmp_path).read("w")


@pytest.mark.parametrize("start", [b"PK\x03\x04\x14\x00\x00\x00", b"\x80\x02}q\x00(X\x15"])  # a zip (torch), a pickle
def test_a_file_that_is_not_safetensors_is_named_by_its_header_length(tmp_path, start):
    (tmp_path / "model.safetensors").write_bytes(start + bytes(64))
    with pytest.raises(ConvertError, match=r"model.safetensors is not a safetensors file \(header length \d+\); "
                                           "re-download it"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize("end", [4, 12])
def test_a_safetensors_tensor_whose_bytes_disagree_with_its_shape_is_named(tmp_path, end):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, end]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(ConvertError, match=rf"model.safetensors is corrupt: tensor w has {end} bytes for shape "
                                           r"\[2\] F32; re-download it"):
        CheckpointReader(tmp_path).read("w")


@pytest.mark.parametrize("weight_map", [{"w": 5}, {"w": ["a.safetensors"]}, ["a.safetensors"]])
def test_an_index_whose_weight_map_is_not_names_of_files_is_one_error(tmp_path, weight_map):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConvertError, match="is not a valid safetensors index"):
        CheckpointReader(tmp_path)


def test_a_shard_the_index_names_but_the_directory_lacks_is_named(tmp_path):
    tensors = {name: np.full(10, i, np.float32) for i, name in enumerate("abc")}
    paths = write_sharded(tmp_path, [(n, "F32", a.shape) for n, a in tensors.items()], tensors.items(),
                          max_shard_bytes=40)
    paths[1].unlink()
    with pytest.raises(ConvertError, match=rf"lacks shard\(s\) {paths[1].name} named in model.safetensors.index.json; "
                                           "download the complete checkpoint"):
        CheckpointReader(tmp_path)


def test_a_weight_stored_as_integers_is_named(tmp_path, capsys):
    # A float32 tensor's header relabelled I32 (same bytes): its bit patterns read as integers and cast to float
    # would compute garbage logits without a word.
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "mixtral", hf)
    data = (hf / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    name = next(n for n, info in header.items() if n != "__metadata__" and info["dtype"] == "F32")
    header[name]["dtype"] = "I32"
    text = json.dumps(header, separators=(",", ":")).encode()
    (hf / "model.safetensors").write_bytes(data[:8] + text.ljust(size) + data[8 + size:])
    status, lines = _cli(capsys, "logits", "--hf-dir", str(hf), "--tokens", str(FIXTURES / "mixtral" / "tokens.npy"),
                         "--out", str(tmp_path / "logits.npy"))
    assert status == 2 and len(lines) == 1, lines
    assert f"Tensor {name} is stored as I32" in lines[0], lines
    assert not (tmp_path / "logits.npy").exists()
    with pytest.raises(ConvertError, match=f"Tensor {name} is stored as I32"):
        convert_from_hf(hf, tmp_path / "run")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
