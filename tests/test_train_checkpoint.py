"""Checkpoints that were damaged, could not be written, or are resumed on another mesh.

Damage is seeded: which file of the newest checkpoint, and where in it, is truncated, emptied or has a byte
flipped. A damaged checkpoint must never restore silently into different arrays: it is reported and the
restore falls back to the previous one, or (where the damage missed everything that is read) it restores
exactly what was saved.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import sys
import warnings
from pathlib import Path

import etils.epath
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from dropless.core import config as config_lib

from dropless.train import checkpoint as ckpt
from dropless.train.loop import train
from dropless.train.metrics import read_metrics
from tests.filesystems import mounted_tmpfs
from tests.test_train import TRAINED_SCHEDULE, corpus, small_config  # noqa: F401 (corpus is a fixture)
from tests.test_train_overwrite import fake_run
from tests.test_train_parallel import run_two_processes


def _model(seed: int) -> tuple[dict, dict]:
    """A (model, optimizer) pair of trees with a float32, a bfloat16 and an int32 leaf, random so that
    compression cannot shrink them away."""
    rng = np.random.default_rng(seed)
    model = {"params": {"w": jnp.asarray(rng.normal(size=(64, 48)), jnp.float32),
                        "e": jnp.asarray(rng.normal(size=(4, 16, 8)), jnp.bfloat16)},
             "state": {"count": jnp.asarray(rng.integers(0, 100, size=(8,)), jnp.int32)}}
    optimizer = {"opt_state": {"mu": jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)}}
    return model, optimizer


def _save_run(run_dir: Path, steps) -> dict[int, tuple[dict, dict]]:
    saved = {}
    with ckpt.manager(run_dir, keep=10) as mngr:
        for step in steps:
            model, optimizer = saved[step] = _model(step)
            ckpt.save(mngr, step, model["params"], model["state"], optimizer["opt_state"])
    return saved


def _restore_latest(run_dir: Path):
    model, optimizer = _model(0)
    lines = []
    step, restored = ckpt.restore_latest(run_dir, model, {**optimizer, "step": 0}, log=lines.append)
    return step, restored, lines


def _assert_equal_trees(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _damage(path: Path, kind: str, rng: random.Random) -> str:
    data = path.read_bytes()
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncate":
        path.write_bytes(data[:rng.randrange(len(data))])
    else:
        offset = rng.randrange(len(data))
        path.write_bytes(data[:offset] + bytes([data[offset] ^ (1 << rng.randrange(8))]) + data[offset + 1:])
        return f"{kind}@{offset}"
    return kind


def test_damaged_checkpoints_are_reported_and_skipped(tmp_path, caplog):
    """Each damaged checkpoint is one line (`lines`), also where logging has a handler of its own (caplog's, as
    a user's logging setup): none of the failed read's task reports reaches it."""
    pristine = tmp_path / "pristine"
    saved = _save_run(pristine, [10, 20])
    rng = random.Random(19)
    outcomes = {"fell back": 0, "restored exactly": 0}
    for case in range(18):
        kind = ("truncate", "empty", "flip")[case % 3]
        run_dir = tmp_path / f"case{case}"
        shutil.copytree(pristine, run_dir)
        files = sorted(p for p in (run_dir / "checkpoints" / "20").rglob("*") if p.is_file() and p.stat().st_size)
        # Every other case hits an item's array data file, where most of a checkpoint's bytes are (the
        # per-process stores in ocdbt.process_*/ are merged into it when the save finishes, and not read).
        data_files = [p for p in files if p.parent.name == "d" and p.parent.parent.name in ("model", "optimizer")]
        target = rng.choice(data_files if case % 2 else files)
        what = f"{_damage(target, kind, rng)} {target.relative_to(run_dir)}"
        step, restored, lines = _restore_latest(run_dir)
        aimed = case % 2 == 1
        if step == 20 and not aimed:  # the damage missed every byte that is read: then the arrays must be exactly the saved ones
            assert not lines, what
            _assert_equal_trees((restored["model"], restored["optimizer"]["opt_state"]),
                                (saved[20][0], saved[20][1]["opt_state"]))
            outcomes["restored exactly"] += 1
            continue
        assert step == 10, what
        assert len(lines) == 1 and "checkpoint 20 in" in lines[0] and "resuming from checkpoint 10" in lines[0], lines
        assert ("is damaged" in lines[0] or "cannot be read" in lines[0]) and "\n" not in lines[0], lines
        _assert_equal_trees(restored["model"], saved[10][0])
        assert not (run_dir / "checkpoints" / "20").exists()  # set aside, so that the resumed run can save 20 again
        assert (run_dir / "checkpoints.damaged" / "20").is_dir()
        outcomes["fell back"] += 1
    assert outcomes["fell back"] >= 9, outcomes  # every aimed case, and some of the others
    assert not [r.getMessage()[:200] for r in caplog.records if r.name == "asyncio"]
    assert ckpt._READ_FAILED  # from now on, the failed reads' closed-loop stragglers are dropped too


def test_a_trained_checkpoint_without_its_optimizer_state_is_damaged_but_an_import_holds_weights_only(tmp_path):
    saved = _save_run(tmp_path / "run", [10, 20])
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "20" / "optimizer")
    shutil.copytree(tmp_path / "run", tmp_path / "import")
    step, restored, lines = _restore_latest(tmp_path / "run")
    assert step == 10 and len(lines) == 1 and "has no optimizer state" in lines[0], lines
    _assert_equal_trees((restored["model"], restored["optimizer"]["opt_state"]),
                        (saved[10][0], saved[10][1]["opt_state"]))
    assert (tmp_path / "run" / "checkpoints.damaged" / "20").is_dir()
    (tmp_path / "import" / "hf_source.json").write_text("{}")  # what `dropless convert --from-hf` leaves
    with pytest.raises(ckpt.CheckpointError, match="weights only .*--init-from-hf HF_DIR") as err:
        _restore_latest(tmp_path / "import")
    assert not isinstance(err.value, ckpt.DamagedCheckpoint)
    assert (tmp_path / "import" / "checkpoints" / "20" / "model").is_dir()  # nothing moved


def test_a_step_deleted_while_it_is_read_is_skipped_with_nothing_set_aside(tmp_path, monkeypatch):
    """Another process deleting the newest step during the read makes it unreadable; the resume goes on from the
    one before instead of failing on the move of a directory that is gone."""
    saved = _save_run(tmp_path, [10, 20])
    read = ocp.CheckpointManager.restore

    def deleted_meanwhile(self, step, *args, **kwargs):
        if step == 20:
            shutil.rmtree(ckpt.checkpoint_dir(tmp_path) / "20")
        return read(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", deleted_meanwhile)
    step, restored, lines = _restore_latest(tmp_path)
    assert step == 10 and len(lines) == 1 and "checkpoint 20 in" in lines[0] and "moved" not in lines[0], lines
    _assert_equal_trees(restored["model"], saved[10][0])
    assert not (tmp_path / "checkpoints.damaged").exists()


def test_a_reader_racing_a_trainer_that_rotates_its_only_checkpoint_reads_the_new_one(tmp_path, monkeypatch):
    """A trainer keeping one checkpoint saves the next step and deletes the one a reader is reading: the reader
    (generate, logits, convert, load_model) says in one warning that it was deleted and reads the new one, instead
    of calling it damaged with "every older checkpoint" and asking to restore the run from a copy. A step deleted
    between orbax's listing of the steps and its look at that step's metadata is listed again, not a traceback."""
    _save_run(tmp_path, [10])
    read, new = ocp.CheckpointManager.restore, _model(20)

    def trainer_saves_meanwhile(self, step, *args, **kwargs):
        if step == 10:
            with ckpt.manager(tmp_path, keep=1) as trainer:  # what the trainer's manager does: save, then rotate
                ckpt.save(trainer, 20, new[0]["params"], new[0]["state"], new[1]["opt_state"])
            assert not (ckpt.checkpoint_dir(tmp_path) / "10").exists()
        return read(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", trainer_saves_meanwhile)
    with pytest.warns(ckpt.CheckpointWarning, match=r"^checkpoint 10 in .* cannot be read: another process "
                                                    r"deleted it while it was read .*; using checkpoint 20\.$"):
        model = ckpt.restore_latest(tmp_path, _model(0)[0], set_aside=False, fix=ckpt.READ_FIX,
                                    log=lambda line: warnings.warn(line.removeprefix("dropless: ").replace(
                                        "resuming from", "using"), ckpt.CheckpointWarning))[1]["model"]
    _assert_equal_trees(model, new[0])
    monkeypatch.setattr(ocp.CheckpointManager, "restore", read)

    listed = ocp.step.standard_name_format().find_all
    deletions = iter([20])

    def deleted_after_listing(self, directory):  # the first listing finds step 20, which is gone before its look
        found = list(listed(directory))
        for step in deletions:
            shutil.rmtree(ckpt.checkpoint_dir(tmp_path) / str(step))
            _save_run(tmp_path, [30])
        return found

    monkeypatch.setattr(type(ocp.step.standard_name_format()), "find_all", deleted_after_listing)
    assert ckpt.all_steps(tmp_path) == [30]


def test_a_step_still_being_rotated_away_when_its_read_fails_is_not_called_damaged(tmp_path, monkeypatch):
    """The trainer deletes a rotated step file by file: a reader's read of it can fail (a truncated or missing
    file) while its directory is still there. With a newer step saved meanwhile it is given a moment to disappear,
    and reported as deleted, not as unreadable data ("Truncated Zstd-compressed data" read as damage)."""
    _save_run(tmp_path, [10])
    read, new, lexists = ocp.CheckpointManager.restore, _model(20), os.path.lexists
    step_10 = str(ckpt.checkpoint_dir(tmp_path) / "10")
    deleting = []

    def trainer_rotates_meanwhile(self, step, *args, **kwargs):
        if step == 10:
            with ckpt.manager(tmp_path, keep=10) as trainer:
                ckpt.save(trainer, 20, new[0]["params"], new[0]["state"], new[1]["opt_state"])
            shutil.rmtree(Path(step_10) / "model")  # the deletion under way: the read fails, the directory stays
            deleting.append(step)
        return read(self, step, *args, **kwargs)

    def deletion_ends_after_the_first_look(path):
        found = lexists(path)
        if deleting and str(path) == step_10 and found:
            shutil.rmtree(step_10)  # ... and ends just after the reader's first look
        return found

    monkeypatch.setattr(ocp.CheckpointManager, "restore", trainer_rotates_meanwhile)
    monkeypatch.setattr(ckpt.os.path, "lexists", deletion_ends_after_the_first_look)
    lines = []
    model = ckpt.restore_latest(tmp_path, _model(0)[0], set_aside=False, fix=ckpt.READ_FIX,
                                log=lines.append)[1]["model"]
    _assert_equal_trees(model, new[0])
    assert len(lines) == 1 and "checkpoint 10 in" in lines[0] and "another process deleted it" in lines[0], lines


def test_a_run_moved_aside_while_it_is_read_is_not_called_damaged(tmp_path, monkeypatch):
    """`train --overwrite` setting the run's checkpoints aside while a reader reads the only one: not "damaged,
    and so is every older checkpoint; restore its checkpoints from a copy" (nothing is damaged, and the old run is
    put back or replaced by the trainer), but one line saying another process moved them and to read it again."""
    _save_run(tmp_path, [10])
    read = ocp.CheckpointManager.restore

    def set_aside_meanwhile(self, step, *args, **kwargs):
        (ckpt.checkpoint_dir(tmp_path)).rename(tmp_path / "aside")
        ckpt.checkpoint_dir(tmp_path).mkdir()  # the new run's, empty until its first checkpoint
        return read(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", set_aside_meanwhile)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.restore_latest(tmp_path, _model(0)[0], set_aside=False, fix=ckpt.READ_FIX)
    message = str(err.value)
    assert "damaged" not in message and "every older" not in message and ckpt.READ_FIX not in message, message
    assert "(steps 10) was deleted or moved by another process" in message and "read it again" in message, message
    assert len(message.splitlines()) == 1 and not isinstance(err.value, ckpt.DamagedCheckpoint)


def test_a_step_listed_while_a_trainer_deletes_it_logs_nothing(tmp_path, caplog, monkeypatch):
    """A trainer rotating its oldest step deletes that step's metadata file first: a reader listing the steps
    meanwhile made orbax log "Metadata file does not exist" through the Python API (a warning per listing, beside
    the reader's own output); it stays out, as the notes on an unparsable metadata file do."""
    absl = logging.getLogger("absl")
    monkeypatch.setattr(absl, "filters", list(absl.filters))  # the filter the manager installs goes with the test
    monkeypatch.setattr(absl, "level", logging.NOTSET)
    _save_run(tmp_path, [10, 20])
    (ckpt.checkpoint_dir(tmp_path) / "10" / "_CHECKPOINT_METADATA").unlink()  # the deletion under way
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert ckpt.all_steps(tmp_path) == [20, 10]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_step_moved_away_while_orbax_looks_at_it_is_listed_again(tmp_path, monkeypatch):
    """`train --overwrite` moving the run's checkpoints aside while a reader lists them: a step orbax found, then
    gone between its check that the step's path exists and that it is a directory, made orbax raise "Path is not
    a directory" out of every reader (a traceback); the steps are listed again."""
    _save_run(tmp_path, [10])
    exists = etils.epath.gpath.PosixGPath.exists
    moves = iter([10])

    def moved_after_the_look(self):
        found = exists(self)
        looking = sys._getframe(1).f_code.co_name == "_sanitize_metadata_path"  # then orbax asks is_dir()
        if found and looking and self.name == "10" and next(moves, None) is not None:  # --overwrite: aside, new
            shutil.move(ckpt.checkpoint_dir(tmp_path), tmp_path / "aside")
            _save_run(tmp_path, [20])
        return found

    monkeypatch.setattr(etils.epath.gpath.PosixGPath, "exists", moved_after_the_look)
    assert ckpt.all_steps(tmp_path) == [20]


def test_a_step_replaced_by_a_file_is_damaged_not_passed_over(tmp_path):
    """orbax lists only directories: a file in a step's place is reported (not an older step read in silence),
    --resume sets it aside (a later save of that step would remove it), and a run of such files says so."""
    saved = _save_run(tmp_path / "run", [10, 20, 30])
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "30")
    (checkpoints / "30").write_text("not a checkpoint")
    assert ckpt.all_steps(tmp_path / "run") == [30, 20, 10]
    with pytest.warns(ckpt.CheckpointWarning, match=r"checkpoint 30 in .* cannot be read \(it is a file, not a "
                                                    r"checkpoint directory\); using checkpoint 20\.$"):
        model = ckpt.restore_latest(tmp_path / "run", _model(0)[0], set_aside=False, fix=ckpt.READ_FIX,
                                    log=lambda line: warnings.warn(line.replace("resuming from", "using"),
                                                                   ckpt.CheckpointWarning))[1]["model"]
    _assert_equal_trees(model, saved[20][0])
    step, restored, lines = _restore_latest(tmp_path / "run")
    assert step == 20 and len(lines) == 1 and "it is a file" in lines[0] and "moved it to" in lines[0], lines
    _assert_equal_trees(restored["model"], saved[20][0])
    assert (tmp_path / "run" / "checkpoints.damaged" / "30").read_text() == "not a checkpoint"
    for step in (10, 20):
        shutil.rmtree(checkpoints / str(step))
        (checkpoints / str(step)).write_text("")
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint 20 in .* \(it is a file, not a checkpoint "
                                                   r"directory\), and so is every older checkpoint .* \(steps 20, 10\)"):
        _restore_latest(tmp_path / "run")


def test_damaged_steps_behind_damaged_newer_ones_are_not_waited_for(tmp_path, monkeypatch):
    """A step that fails while a newer one exists may be one a trainer is deleting (rotation), and is given time to
    go; newer steps that were tried and failed themselves are no such sign, so each damaged step is reported at
    once."""
    _save_run(tmp_path, [10, 20, 30])
    for step in (20, 30):
        shutil.rmtree(tmp_path / "checkpoints" / str(step) / "optimizer")
    waits = []
    gone = ckpt._gone
    monkeypatch.setattr(ckpt, "_gone", lambda path, wait_s: waits.append((path.name, wait_s)) or gone(path, wait_s))
    step, _, lines = _restore_latest(tmp_path)
    assert step == 10 and len(lines) == 2, lines
    assert waits == [("30", 0.0), ("20", 0.0)]


@pytest.mark.parametrize("times", [2, 3])
def test_a_step_damaged_again_is_set_aside_beside_its_earlier_copies(tmp_path, times):
    """A resumed run saves the set-aside step again; damaged again, each copy goes beside the earlier ones (20,
    20.1, 20.2): none is moved into or over another."""
    saved = _save_run(tmp_path, [10, 20])
    for _ in range(times):
        shutil.rmtree(tmp_path / "checkpoints" / "20" / "optimizer")
        step, _, lines = _restore_latest(tmp_path)
        assert step == 10 and len(lines) == 1, lines
        with ckpt.manager(tmp_path, keep=10) as mngr:
            ckpt.save(mngr, 20, saved[20][0]["params"], saved[20][0]["state"], saved[20][1]["opt_state"])
    names = ["20"] + [f"20.{i}" for i in range(1, times)]
    damaged = tmp_path / "checkpoints.damaged"
    assert sorted(p.name for p in damaged.iterdir()) == names
    assert all(sorted(p.name for p in (damaged / name).iterdir() if p.is_dir()) == ["digest", "model"]
               for name in names)


@pytest.mark.parametrize("written", ['{"version": 1}', '{"version": 1, "leaves": [1, 2]}', "[]"])
def test_a_digest_without_its_leaves_is_damaged(tmp_path, written):
    """A digest file that orbax reads (valid JSON) but that holds no per-leaf folds verifies nothing: damaged."""
    _save_run(tmp_path, [10, 20])
    (ckpt.checkpoint_dir(tmp_path) / "20" / "digest" / "metadata").write_text(written)
    step, _, lines = _restore_latest(tmp_path)
    assert step == 10 and len(lines) == 1 and "has an unreadable digest" in lines[0], lines


def test_a_leaf_missing_from_the_digest_is_a_digest_mismatch(tmp_path):
    """A digest that lacks one restored leaf verifies that leaf against nothing: damaged, not accepted."""
    _save_run(tmp_path, [10, 20])
    path = ckpt.checkpoint_dir(tmp_path) / "20" / "digest" / "metadata"
    written = json.loads(path.read_text())
    del written["leaves"]["optimizer/opt_state/mu"]
    path.write_text(json.dumps(written))
    step, _, lines = _restore_latest(tmp_path)
    assert step == 10 and len(lines) == 1 and "digest mismatch in optimizer/opt_state/mu" in lines[0], lines


def test_a_model_of_another_shape_is_one_error_not_a_damaged_checkpoint(tmp_path):
    """Restoring into parameters of another shape (a changed config) stops with that reason: the checkpoints are
    fine, so none is reported damaged or set aside."""
    _save_run(tmp_path, [10, 20])
    model, optimizer = _model(0)
    model["params"]["w"] = jnp.zeros((64, 40), jnp.float32)
    lines = []
    with pytest.raises(ckpt.CheckpointError, match="does not match this model's parameters") as raised:
        ckpt.restore_latest(tmp_path, model, {**optimizer, "step": 0}, log=lines.append)
    assert not isinstance(raised.value, ckpt.DamagedCheckpoint) and not lines
    assert ckpt.all_steps(tmp_path) == [20, 10] and not (tmp_path / "checkpoints.damaged").exists()


def test_a_run_whose_checkpoints_were_all_set_aside_has_reached_a_checkpoint(tmp_path):
    """A run is trained once it finished a checkpoint, kept or set aside as damaged (a start without --overwrite
    must not take it for a run that never reached one); empty directories are no checkpoint."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints.damaged").mkdir()
    assert not ckpt.reached_a_checkpoint(tmp_path)
    (tmp_path / "checkpoints.damaged" / "20" / "model").mkdir(parents=True)
    assert ckpt.reached_a_checkpoint(tmp_path)


def test_the_digest_of_an_array_is_the_same_on_the_host_and_on_a_device():
    """A leaf may be saved as a NumPy array (folded on the host) and restored as a jax.Array (folded on a device):
    both folds must agree, for every width."""
    rng = np.random.default_rng(2)
    for dtype in (np.float32, jnp.bfloat16, np.int8, np.bool_):
        array = (rng.standard_normal((5, 33)) * 100).astype(dtype)
        on_host = ckpt.digest({"x": {"a": array}})["x/a"]
        assert on_host == ckpt.digest({"x": {"a": jnp.asarray(array)}})["x/a"], dtype


def test_the_digest_of_a_64_bit_host_array_folds_both_words_of_each_element():
    """A NumPy int64 or float64 leaf (the optimizer's step) is folded as two little-endian 32-bit words per element:
    a value that differs in its high word only (a step past 2**32, a float64's sign) has another digest."""
    for array in (np.asarray([5, 2**32 + 5, -7], np.int64), np.asarray([1.5, -1.5, 2.0**40], np.float64)):
        words = array.view(np.uint32).astype(np.uint64)
        want = [int(words.sum()) % 2**32, int((words * np.arange(1, words.size + 1, dtype=np.uint64)).sum()) % 2**32]
        assert ckpt.digest({"optimizer": {"step": array}})["optimizer/step"] == want, array.dtype


@pytest.mark.parametrize("change", ["flip", "swap"])
def test_a_changed_array_value_is_a_digest_mismatch(tmp_path, change):
    """Rewrite one leaf through orbax itself with one bit changed, or two of its elements exchanged: the files are
    valid, only the digest knows."""
    _save_run(tmp_path, [10, 20])
    model, optimizer = _model(20)
    changed = np.asarray(model["params"]["w"]).copy()
    if change == "flip":
        changed.view(np.uint32)[3, 5] ^= 1  # the lowest mantissa bit: a float sum could round it away
    else:
        changed[[3, 40], [5, 7]] = changed[[40, 3], [7, 5]]  # the same words: any plain sum of them is unchanged
    model["params"]["w"] = jnp.asarray(changed)
    item = ckpt.checkpoint_dir(tmp_path) / "20" / "model"
    shutil.rmtree(item)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(item, model)
    step, _, lines = _restore_latest(tmp_path)
    assert step == 10
    assert "digest mismatch in model/params/w" in lines[0], lines


@pytest.mark.parametrize("leaf", ["params/e", "params/w", "state/count"])
def test_a_flipped_bit_in_any_model_leaf_is_a_digest_mismatch(tmp_path, leaf):
    """Every leaf is verified, whatever its dtype or its place among the digest's keys: one bit of each rewritten
    through orbax is a mismatch naming that leaf."""
    _save_run(tmp_path, [10, 20])
    model, _ = _model(20)
    group, name = leaf.split("/")
    changed = np.asarray(model[group][name]).copy()
    changed.reshape(-1).view(np.dtype(f"u{changed.dtype.itemsize}"))[5] ^= 1
    model[group][name] = jnp.asarray(changed)
    item = ckpt.checkpoint_dir(tmp_path) / "20" / "model"
    shutil.rmtree(item)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(item, model)
    step, _, lines = _restore_latest(tmp_path)
    assert step == 10 and len(lines) == 1 and f"digest mismatch in model/{leaf}" in lines[0], lines


def test_a_changed_optimizer_array_is_a_digest_mismatch(tmp_path):
    """The optimizer item is verified as the model is: one bit of its state rewritten through orbax is a mismatch."""
    _save_run(tmp_path, [10, 20])
    _, optimizer = _model(20)
    changed = np.asarray(optimizer["opt_state"]["mu"]).copy()
    changed.view(np.uint32)[7, 9] ^= 1
    item = ckpt.checkpoint_dir(tmp_path) / "20" / "optimizer"
    shutil.rmtree(item)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(item, {"opt_state": {"mu": jnp.asarray(changed)}, "step": np.asarray(20, np.int64)})
    step, _, lines = _restore_latest(tmp_path)
    assert step == 10 and len(lines) == 1 and "digest mismatch in optimizer/opt_state/mu" in lines[0], lines


def test_a_changed_optimizer_step_is_a_digest_mismatch(tmp_path):
    """The optimizer's step, a 64-bit host leaf from which a resumed run takes its batches and schedules, is
    verified too: a step that differs in its high word only is a mismatch."""
    _save_run(tmp_path, [10, 20])
    _, optimizer = _model(20)
    item = ckpt.checkpoint_dir(tmp_path) / "20" / "optimizer"
    shutil.rmtree(item)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(item, {**optimizer, "step": np.asarray(2**32 + 20, np.int64)})
    step, _, lines = _restore_latest(tmp_path)
    assert step == 10 and len(lines) == 1 and "digest mismatch in optimizer/step" in lines[0], lines


def test_a_manager_keeps_only_the_newest_checkpoints_it_is_told_to(tmp_path):
    """train.keep_checkpoints: saving past the limit deletes the oldest, and what is kept restores."""
    saved = {}
    with ckpt.manager(tmp_path, keep=2) as mngr:
        for step in (10, 20, 30):
            model, optimizer = saved[step] = _model(step)
            ckpt.save(mngr, step, model["params"], model["state"], optimizer["opt_state"])
    assert ckpt.all_steps(tmp_path) == [30, 20]
    assert sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()) == ["20", "30"]
    step, restored, lines = _restore_latest(tmp_path)
    assert step == 30 and not lines
    _assert_equal_trees(restored["model"], saved[30][0])


def test_no_good_checkpoint_and_no_checkpoint_are_one_line_errors(tmp_path, corpus):
    _save_run(tmp_path / "run", [10])
    for data in (tmp_path / "run" / "checkpoints" / "10").rglob("d/*"):
        data.write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint 10 in .* and so is every older checkpoint.*"
                                                   r"start again with --overwrite\.$"):
        _restore_latest(tmp_path / "run")
    # `generate` and `logits` (load_model) have no --overwrite to offer
    with pytest.raises(ckpt.CheckpointError, match=r"every older checkpoint .*; restore its checkpoints from a copy"):
        ckpt.restore_latest(tmp_path / "run", _model(0)[0], fix=ckpt.READ_FIX)
    # A run with a config but no finished checkpoint: --resume says so instead of starting at step 0.
    config = small_config(corpus, **{"train.steps": 2, "train.eval_every": 100, "train.checkpoint_every": 100})
    (tmp_path / "early").mkdir()
    config_lib.save(config, tmp_path / "early" / "config.json")
    with pytest.raises(ckpt.CheckpointError, match="has no finished checkpoint.*the same command without --resume"):
        train(config, tmp_path / "early", resume=True, progress=False, log=lambda s: None)


def test_a_model_without_moe_layers_saves_resumes_and_loads(tmp_path, corpus):
    """Every layer dense: the router state has 0 rows, an array orbax refuses to save; it is left out of the
    checkpoint and made again on restore."""
    config = small_config(corpus, **{"model.first_dense_layers": 2, "model.num_layers": 2, "train.steps": 2,
                                     "train.eval_every": 100, "train.checkpoint_every": 1})
    train(config, tmp_path / "run", progress=False, log=lambda s: None)
    train(config.replace(**{"train.steps": 3}), tmp_path / "run", resume=True, progress=False, log=lambda s: None)
    loaded, params, state = ckpt.load_model(tmp_path / "run")
    assert ckpt.latest_step(tmp_path / "run") == 3 and loaded.model.layer_types == "DD"
    assert state["router_bias"].shape == (0, config.moe.num_experts)


def test_checkpoints_without_a_digest_still_load(tmp_path):
    saved = _save_run(tmp_path, [10])
    shutil.rmtree(ckpt.checkpoint_dir(tmp_path) / "10" / "digest")  # as written before digests existed
    step, restored, lines = _restore_latest(tmp_path)
    assert step == 10 and not lines
    _assert_equal_trees(restored["model"], saved[10][0])


def _fail_with(code: int):
    def write(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return write


@pytest.mark.parametrize("code, fix", [(errno.ENOSPC, "free space"), (errno.EACCES, "make it writable")])
def test_a_refused_write_is_one_line_and_keeps_earlier_checkpoints(tmp_path, monkeypatch, code, fix):
    saved = _save_run(tmp_path, [10])
    model, optimizer = _model(20)
    with ckpt.manager(tmp_path, keep=10) as mngr:
        # orbax writes its JSON metadata (the digest among it) through etils.epath
        monkeypatch.setattr(etils.epath.gpath.PosixGPath, "write_text", _fail_with(code))
        with pytest.raises(ckpt.CheckpointError) as raised:
            ckpt.save(mngr, 20, model["params"], model["state"], optimizer["opt_state"])
        monkeypatch.undo()
    message = str(raised.value)
    assert message == (f"could not write checkpoint 20 to {ckpt.checkpoint_dir(tmp_path)}: {os.strerror(code)}; "
                       f"{fix} and resume with --resume."), message
    assert ckpt.latest_step(tmp_path) == 10
    assert sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()) == ["10"]  # no temporary left
    step, restored, lines = _restore_latest(tmp_path)
    assert step == 10 and not lines
    _assert_equal_trees(restored["model"], saved[10][0])


def test_a_filesystem_refusal_behind_another_exception_is_found():
    """orbax and tensorstore re-raise a refused write as their own exceptions, explicitly chained or raised while
    handling it: either way the filesystem's reason is found; an unrelated error has none."""
    def raised(chain):
        try:
            try:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as err:
                if chain:
                    raise RuntimeError("write failed") from err
                raise RuntimeError("write failed")
        except RuntimeError as err:
            return err

    for chain in (True, False):
        assert ckpt._filesystem_reason(raised(chain)) == os.strerror(errno.ENOSPC), chain
    assert ckpt._filesystem_reason(RuntimeError("something else")) is None


@pytest.fixture
def small_tmpfs(tmp_path):
    yield from mounted_tmpfs(tmp_path / "tmpfs", "400k", "the injected write errors cover a full disk")


def test_a_full_filesystem_is_one_line_and_keeps_earlier_checkpoints(small_tmpfs, capfd):
    run_dir = small_tmpfs / "run"
    model, optimizer = _model(10)  # about 40 kB of arrays per checkpoint
    with ckpt.manager(run_dir, keep=10) as mngr:
        ckpt.save(mngr, 10, model["params"], model["state"], optimizer["opt_state"])
        with pytest.raises(ckpt.CheckpointError, match=r"could not write checkpoint \d+ to .*: No space left on "
                                                       r"device; free space and resume with --resume\.$"):
            for step in range(20, 200, 10):
                ckpt.save(mngr, step, model["params"], model["state"], optimizer["opt_state"])
    assert step > 20  # the filesystem filled up after a few checkpoints, not at once
    finished = ckpt.all_steps(run_dir)
    assert finished == list(range(step - 10, 0, -10))
    assert not [p for p in ckpt.checkpoint_dir(run_dir).iterdir() if "tmp" in p.name]
    printed = capfd.readouterr().err
    assert "Traceback" not in printed and "ERROR" not in printed, printed  # the error above is the one line
    got, restored, lines = _restore_latest(run_dir)
    assert got == step - 10 and not lines
    _assert_equal_trees(restored["model"], model)


def test_resume_on_another_mesh_continues_the_same_losses(tmp_path, corpus):
    """Saved on 8 devices as expert 4 x data 2, resumed as data 8 (one expert group): the losses of the
    uninterrupted run, to float32 rounding."""
    # The resumed part on data 8 is test_train.py's 40-step run's step and evaluation (TRAINED_SCHEDULE).
    base = {"train.eval_every": 100, "train.checkpoint_every": 1, "train.steps": 2, "train.plot": False,
            **TRAINED_SCHEDULE}
    quiet = {"progress": False, "log": lambda s: None}
    train(small_config(corpus, **base, **{"parallel.expert": 4, "parallel.data": 2}), tmp_path / "full", **quiet)
    shutil.copytree(tmp_path / "full", tmp_path / "split")  # as if the first run had stopped after step 1
    shutil.rmtree(ckpt.checkpoint_dir(tmp_path / "split") / "2")
    train(small_config(corpus, **base, **{"parallel.expert": 1, "parallel.data": 8}), tmp_path / "split",
          resume=True, **quiet)

    def losses(run):  # the last row of each step: the resumed run's
        return {r["step"]: r["loss"] for r in read_metrics(tmp_path / run) if "loss" in r}

    full, split = losses("full"), losses("split")
    np.testing.assert_allclose(split[2], full[2], rtol=1e-6, atol=0)
    assert ckpt.load_run_config(tmp_path / "split").parallel.expert == 1  # the run now records its new mesh
    # generate, logits and load_model read the run onto one device, whatever mesh saved it: a template without
    # shardings would restore the saved mesh, which a process of fewer devices cannot hold.
    _, params, _ = ckpt.load_model(tmp_path / "full")
    assert {d for leaf in jax.tree.leaves(params) for d in leaf.sharding.device_set} == {jax.devices()[0]}


def test_restore_into_fewer_devices(tmp_path):
    """A checkpoint saved sharded over 8 devices restores exactly into shardings over 4 devices and over 1."""
    model, optimizer = _model(10)
    mesh8 = jax.make_mesh((8,), ("fsdp",))
    shard = lambda mesh: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    model["params"]["w"] = jax.device_put(model["params"]["w"], shard(mesh8))
    optimizer["opt_state"]["mu"] = jax.device_put(optimizer["opt_state"]["mu"], shard(mesh8))
    with ckpt.manager(tmp_path) as mngr:
        ckpt.save(mngr, 10, model["params"], model["state"], optimizer["opt_state"])
    for devices in (jax.devices()[:4], jax.devices()[:1]):
        mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
        like_model, like_optimizer = _model(0)
        like_model["params"]["w"] = jax.ShapeDtypeStruct((64, 48), jnp.float32, sharding=shard(mesh))
        like_optimizer["opt_state"]["mu"] = jax.ShapeDtypeStruct((64, 48), jnp.float32, sharding=shard(mesh))
        restored = ckpt.restore(tmp_path, 10, like_model, {**like_optimizer, "step": 0})
        assert restored["model"]["params"]["w"].sharding.mesh.devices.size == len(devices)
        _assert_equal_trees((restored["model"], restored["optimizer"]["opt_state"]), (model, optimizer["opt_state"]))


# Two processes (tests/test_train_parallel.run_two_processes) save checkpoints 10, 20 and 30 of one array sharded
# over both; then each meets a fault the other does not: process 1 cannot read checkpoint 30 (as a host whose copy
# of a file is damaged or unreachable), process 0 reads checkpoint 20 different from its digest. Both must fall back
# to checkpoint 10, together, and print what they restored.
AGREEMENT_WORKER = """
import json, sys
import jax, numpy as np
from dropless.core import distributed
distributed.initialize()
import orbax.checkpoint as ocp
from dropless.train import checkpoint as ckpt

run_dir, me = sys.argv[1], jax.process_index()
sharding = jax.sharding.NamedSharding(jax.make_mesh((4,), ("fsdp",)), jax.sharding.PartitionSpec("fsdp"))
def model(step):
    w = np.arange(32 * 4, dtype=np.float32).reshape(32, 4) * step
    return {"params": {"w": jax.make_array_from_callback(w.shape, sharding, lambda i: w[i])}, "state": {}}
with ckpt.manager(run_dir, keep=10) as mngr:
    for step in (10, 20, 30):
        ckpt.save(mngr, step, model(step)["params"], {})
restore = ocp.CheckpointManager.restore
def restore_on_this_host(self, step, *args, **kwargs):
    restored = restore(self, step, *args, **kwargs)  # orbax's own barriers: every process passes them
    if me == 1 and step == 30:
        raise OSError(5, "Input/output error")  # then this host's read fails
    return restored
ocp.CheckpointManager.restore = restore_on_this_host
digest, calls = ckpt.digest, []
def digest_on_this_host(trees):
    found = digest(trees)  # every process takes part in the computation
    calls.append(1)
    if me == 0 and len(calls) == 1:  # the restore of checkpoint 20 (30 never gets to its digest)
        found["model/params/w"] = [found["model/params/w"][0] ^ 1, found["model/params/w"][1]]
    return found
ckpt.digest = digest_on_this_host
lines = []
like = {"params": {"w": jax.ShapeDtypeStruct((32, 4), np.float32, sharding=sharding)}, "state": {}}
step, restored = ckpt.restore_latest(run_dir, like, log=lines.append)
w = restored["model"]["params"]["w"]
mine = [np.asarray(s.data).tolist() for s in w.addressable_shards]
want = [np.asarray(s.data).tolist() for s in model(step)["params"]["w"].addressable_shards]
print(json.dumps({"step": step, "exact": mine == want, "lines": lines}), flush=True)
"""


def test_a_fault_seen_by_one_process_is_agreed_by_all(tmp_path):
    results = [json.loads(out.strip().splitlines()[-1])
               for out in run_two_processes([sys.executable, "-c", AGREEMENT_WORKER, str(tmp_path / "run")])]
    assert [r["step"] for r in results] == [10, 10] and all(r["exact"] for r in results), results
    lines = results[0]["lines"]  # process 0 reports (the run's log is process 0's)
    assert len(lines) == 2, lines
    assert "checkpoint 30 in" in lines[0] and "is damaged or unreadable on process 1" in lines[0], lines
    assert "checkpoint 20 in" in lines[1] and "digest mismatch in model/params/w" in lines[1], lines
    assert all("resuming from checkpoint 10" in line for line in lines), lines
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints.damaged").iterdir()) == ["20", "30"]


def test_the_worst_outcome_of_any_process_is_everyones(monkeypatch):
    """The agreement alone, with the all-gather faked: process 0 read fine, another did not."""
    where = "checkpoint 20 in /run/checkpoints"
    gathered = np.array([0, 0, 1, 2, 1], np.int32)  # restored, restored, damaged, unusable, damaged
    monkeypatch.setattr(jax, "process_count", lambda: 5)
    monkeypatch.setattr(ckpt.multihost_utils, "process_allgather", lambda x: gathered)
    assert ckpt.agreed_outcome(0) == (2, 3)
    with pytest.raises(ckpt.CheckpointError, match="cannot be used on process 3") as raised:
        ckpt._agree(None, where)
    assert not isinstance(raised.value, ckpt.DamagedCheckpoint)  # an unusable checkpoint stops every process
    gathered[3] = 0
    with pytest.raises(ckpt.DamagedCheckpoint, match=f"^{where} is damaged or unreadable on process 2$"):
        ckpt._agree(None, where)
    own = ckpt.DamagedCheckpoint(f"{where} is damaged (digest mismatch in model/params/w)")
    with pytest.raises(ckpt.DamagedCheckpoint, match="digest mismatch"):  # its own message where it saw it
        ckpt._agree(own, where)
    gathered[:] = 0
    ckpt._agree(None, where)  # all restored: nothing raised


def test_each_process_shares_how_bad_its_own_outcome_is(monkeypatch):
    """What a process contributes to the agreement: an unusable checkpoint (a shape mismatch) must reach the others
    as unusable, so that they stop too instead of falling back to an older checkpoint alone."""
    where = "checkpoint 20 in /run/checkpoints"
    shared = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(ckpt.multihost_utils, "process_allgather",
                        lambda x: shared.append(int(x)) or np.array([int(x), 0], np.int32))
    for error, outcome in [(None, 0), (ckpt.DamagedCheckpoint(f"{where} is damaged"), 1),
                           (ckpt.CheckpointError(f"{where} does not match this model"), 2)]:
        with pytest.raises(type(error)) if error else contextlib.nullcontext():
            ckpt._agree(error, where)
        assert shared.pop() == outcome


def test_a_resume_that_changes_nothing_leaves_config_json_untouched(tmp_path, corpus):
    """The file is rewritten only for a change a resume may make (the steps, say), and then atomically: a write that
    fails partway (a full disk) names the file and leaves the old one whole."""
    from dropless.train import loop
    run_dir, config = tmp_path / "run", small_config(corpus, **{"train.schedule_steps": 8})
    fake_run(run_dir, config)
    os.utime(run_dir / "config.json", ns=(0, 0))  # any write would stamp it now
    loop.prepare_run_dir(run_dir, config.replace(**{"train.schedule_steps": 0}), resume=True, overwrite=False)
    assert (run_dir / "config.json").stat().st_mtime_ns == 0
    # Fewer steps than the run's checkpoint (step 10) would shrink the saved config behind the run: refused.
    with pytest.raises(config_lib.ConfigError, match="--resume to step 9, but .* has a checkpoint of step 10 already"):
        loop.prepare_run_dir(run_dir, config.replace(**{"train.steps": 9}), resume=True, overwrite=False)
    assert (run_dir / "config.json").stat().st_mtime_ns == 0
    # A step directory no save made (empty, or without the run's items) is named, not taken for the run's step:
    # "--steps 60 or more" would train a run of step 10 to 60.
    for items, reason in (([], "it is empty"), (["optimizer"], "it holds no model weights"),
                          (["model"], "it holds no optimizer state")):
        stray = run_dir / "checkpoints" / "60"
        shutil.rmtree(stray, ignore_errors=True)
        for item in items:
            (stray / item).mkdir(parents=True)
        stray.mkdir(exist_ok=True)
        with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint 60 in .*checkpoints is not one the run saved "
                                                       rf"\({reason}\); move it away and resume."):
            loop.prepare_run_dir(run_dir, config.replace(**{"train.steps": 11}), resume=True, overwrite=False)
    shutil.rmtree(stray)
    assert (run_dir / "config.json").stat().st_mtime_ns == 0
    loop.prepare_run_dir(run_dir, config.replace(**{"train.steps": 11}), resume=True, overwrite=False)
    assert config_lib.load(run_dir / "config.json").train.steps == 11
    def fills_the_disk(path, data, *args, **kwargs):  # a write that stops partway, as on a full disk
        with open(path, "w") as file:
            file.write(data[:40])
        raise OSError(28, "No space left on device")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "write_text", fills_the_disk)
        with pytest.raises(OSError, match="config.json"):  # named, for the one-line error
            loop.prepare_run_dir(run_dir, config.replace(**{"train.steps": 12}), resume=True, overwrite=False)
    assert config_lib.load(run_dir / "config.json").train.steps == 11  # the old file, whole
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("config")) == ["config.json"]


def test_a_start_deletes_the_temporary_files_a_kill_mid_write_left_and_nothing_else(tmp_path, corpus):
    """write_atomic's `NAME.<pid>.tmp`, left by a kill between writing and renaming (a token cache's can be large),
    in the run directory and its corpus cache: the next start, holding the run's lock, deletes them; files of
    other names stay."""
    from dropless.train import loop
    run_dir, config = tmp_path / "run", small_config(corpus)
    fake_run(run_dir, config)
    left = [run_dir / "config.json.4242.tmp", run_dir / "corpus" / "tokens-0123.npz.77.tmp"]
    kept = [run_dir / "notes.tmp", run_dir / "corpus" / "tokens.x.tmp", run_dir / "checkpoints" / "10" / "a.1.tmp"]
    for path in left + kept:
        path.write_bytes(b"partial")
    loop.prepare_run_dir(run_dir, config, resume=True, overwrite=False)
    assert [path.exists() for path in left + kept] == [False] * len(left) + [True] * len(kept)


def test_the_reports_of_a_failed_restores_readers_are_dropped_and_no_others(tmp_path, monkeypatch):
    """Tasks and coroutines of a restore that failed report at exit, each with tensorstore's error naming the
    array's path under the checkpoints' directory: those reports are dropped, any other passes. Reading many
    directories keeps one filter and one wrapper of the hook (a chain of them would grow with every read)."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(ckpt, "_READ_DIRECTORIES", set())
    asyncio_log = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_log, "filters", [f for f in asyncio_log.filters
                                                 if not isinstance(f, ckpt._FailedReads)])
    directory = tmp_path / "run" / "checkpoints"
    for other_run in range(3):
        ckpt._silence_failed_reads(directory)
        ckpt._silence_failed_reads(tmp_path / f"other{other_run}" / "checkpoints")
    reads = sys.unraisablehook.__self__
    assert reads.hook == seen.append
    assert len([f for f in asyncio_log.filters if isinstance(f, ckpt._FailedReads)]) == 1
    theirs = type("Report", (), {"exc_value": Exception(f"reading {directory.resolve()}/10/model/d/x failed")})
    other = type("Report", (), {"exc_value": Exception("something else")})
    closed = type("Report", (), {"exc_value": RuntimeError("Event loop is closed")})
    monkeypatch.setattr(ckpt, "_READ_FAILED", False)
    sys.unraisablehook(theirs)
    sys.unraisablehook(other)
    sys.unraisablehook(closed)  # no read failed: not a straggler of one
    assert seen == [other, closed]
    monkeypatch.setattr(ckpt, "_READ_FAILED", True)  # a tensorstore thread after a failed read's loop closed
    sys.unraisablehook(closed)
    sys.unraisablehook(other)
    assert seen == [other, closed, other]
    record = lambda text: logging.LogRecord("asyncio", logging.ERROR, "", 0, text, None, None)
    assert not asyncio_log.filter(record(f"Task exception was never retrieved: {directory.resolve()}/10"))
    assert asyncio_log.filter(record("Task exception was never retrieved: elsewhere"))


def test_opening_a_run_read_only_logs_nothing(tmp_path, caplog):
    """orbax notes every read-only manager; ours are read-only on purpose, so a library user sees none of those
    notes (other orbax messages pass)."""
    _save_run(tmp_path / "run", [10])
    with caplog.at_level(logging.WARNING, logger="absl"):
        assert ckpt.latest_step(tmp_path / "run") == 10
        logging.getLogger("absl").warning("another orbax note")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == ["another orbax note"]


def test_resuming_past_a_decay_s_start_with_a_later_horizon_says_the_learning_rate_goes_back_up(tmp_path):
    """A warmup-stable-decay run resumed from a checkpoint inside its decay with a later train.schedule_steps
    would restart from the peak, without a warm-up: the resume says so in one line. From the stable phase it is
    the schedule the docs describe, and says nothing."""
    from dropless.models import transformer
    from dropless.train.loop import prepare_run_dir

    config = small_config(tmp_path, **{"train.steps": 10, "train.decay_steps": 4, "train.warmup_steps": 2,
                                       "train.schedule_steps": 10})
    params, state = transformer.init_params(jax.random.key(0), config), transformer.init_state(config)
    for step, warned in ((5, False), (8, True)):
        run_dir = tmp_path / f"run{step}"
        ckpt.save_model(run_dir, config, params, state, step=step)
        lines = []
        later = config.replace(**{"train.steps": 14, "train.schedule_steps": 14})
        prepare_run_dir(run_dir, later, resume=True, overwrite=False, log=lines.append)
        assert [line for line in lines if "warning" in line] == ([
            "dropless: warning: checkpoint 8 is past the start of the run's decay (step 6); train.schedule_steps=14 "
            "puts the learning rate back up to its peak, without a warm-up, and decays it again"] if warned else [])
