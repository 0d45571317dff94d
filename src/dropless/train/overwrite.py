"""`--overwrite` that keeps the run it replaces until the new run has its first checkpoint.

The old run's files wait in RUN_DIR/.replaced until the new run has written its first checkpoint (`discard`), so
that a mistake found while loading its data (a mistyped --data, a corpus too small) or in its first steps (a
setting the step cannot take here, a divergence), or a kill before that checkpoint, puts them back (`put_back`)
instead of having cost the old run. The tokenizer and its origin record are copied aside and the
token cache linked there, rather than moved: the new run's loader checks them against its data and reuses them,
or trains and tokenizes over them, and the old run gets back the tokenizer its weights were trained with and its
tokens either way. Once the new run has a checkpoint, the old run is gone.

Every step is a rename, or works on a directory whose name says how far it got, so a process killed anywhere
leaves a state that the next `dropless train` in the directory finishes undoing (`recover`) before it does
anything else:

- `.replacing`: being set aside; each of REPLACED_FILES is in it or still in place, both the old run's.
- `.replaced`: set aside whole; the run directory's REPLACED_FILES, COPIED_FILES and token cache are the new
  run's, or copies of the old run's, or absent.
- `.restoring`: being put back; whatever it still holds goes back to its place, where nothing is.
- `.discarded`: the new run has a checkpoint; deleting it finishes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from dropless.core import files
from dropless.data.loader import CACHE_DIR, ORIGIN_FILE, TOKEN_CACHE, TOKENIZER_FILE
from dropless.train import checkpoint as ckpt
from dropless.train import run_lock

# What the new run replaces (hf_source.json: a run made by `dropless convert --from-hf`, whose export reads it).
REPLACED_FILES = ("checkpoints", "checkpoints.damaged", "metrics.jsonl", "router.bin", "router.json", "tensorboard",
                  "training.png", "hf_source.json", "config.json")
COPIED_FILES = (TOKENIZER_FILE, f"{CACHE_DIR}/{ORIGIN_FILE}")  # the loader may write over them in place
REPLACING, REPLACED, RESTORING, DISCARDED = ".replacing", ".replaced", ".restoring", ".discarded"


def set_aside(run_dir: Path) -> None:
    """Move the run in `run_dir` into RUN_DIR/.replaced (the tokenizer copied, the token cache linked) before a
    new run starts there. The caller puts it back (`put_back`) or deletes it (`discard`)."""
    run_dir = Path(run_dir)
    building = run_dir / REPLACING
    building.mkdir()  # none is left: `recover` runs first
    try:
        for name in COPIED_FILES:
            if (run_dir / name).is_file():
                (building / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(run_dir / name, building / name)
        # Linked: the loader replaces and deletes a token cache, never writes into one.
        for cache in sorted((run_dir / CACHE_DIR).glob(TOKEN_CACHE)):
            (building / CACHE_DIR).mkdir(exist_ok=True)
            _link_or_copy(cache, building / CACHE_DIR / cache.name)
        for name in REPLACED_FILES:
            if (run_dir / name).exists():
                (run_dir / name).rename(building / name)
    except OSError as err:  # a full disk while copying: the run goes back as it was, and the error names it
        _move_back(run_dir, building, [building / name for name in REPLACED_FILES])
        raise files.refused(err, run_dir) from None
    building.rename(run_dir / REPLACED)


def put_back(run_dir: Path) -> None:
    """The run set aside, back in place of what the new run wrote (nothing, where the old run had none)."""
    run_dir = Path(run_dir)
    if (run_dir / REPLACED).is_dir():
        for path in _restorable(run_dir):  # the new run's, or copies: the old run's are all aside
            _remove(path)
        (run_dir / REPLACED).rename(run_dir / RESTORING)
    if (run_dir / RESTORING).is_dir():
        _move_back(run_dir, run_dir / RESTORING, _restorable(run_dir / RESTORING))


def discard(run_dir: Path) -> None:
    """Delete the run set aside: the new one has a checkpoint."""
    run_dir = Path(run_dir)
    if (run_dir / REPLACED).is_dir():
        (run_dir / REPLACED).rename(run_dir / DISCARDED)  # one step: a kill in the deletion leaves no `.replaced`
    shutil.rmtree(run_dir / DISCARDED, ignore_errors=True)


def recover(run_dir: Path, log: Callable[[str], None]) -> None:
    """Finish what a killed `--overwrite` left half done in `run_dir`: the old run back in place where the new one
    never had a checkpoint, the set-aside copy deleted where it had."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    shutil.rmtree(run_dir / DISCARDED, ignore_errors=True)
    if not any((run_dir / name).is_dir() for name in (REPLACING, REPLACED, RESTORING)):
        return
    if (run_dir / REPLACING).is_dir():  # the copies are partial at worst, and their originals untouched
        _move_back(run_dir, run_dir / REPLACING, [run_dir / REPLACING / name for name in REPLACED_FILES])
    elif (run_dir / REPLACED).is_dir() and ckpt.reached_a_checkpoint(run_dir):
        # A kill between the new run's first checkpoint and its `discard`: the new run is the one to keep.
        discard(run_dir)
        return
    put_back(run_dir)
    log(f"dropless: {run_dir} held the run that an interrupted --overwrite had set aside before the new run's "
        "first checkpoint; that run is back in place")


def run_config_path(run_dir: Path) -> Path:
    """Where the config.json of the run that `recover` will leave in `run_dir` lies now, read before that recovery
    (which only the lock's holder makes): `train --resume` builds the config it resumes with from it, so that an
    interrupted --overwrite's new config is not taken for the run that is put back."""
    run_dir = Path(run_dir)
    for aside in (REPLACING, RESTORING):  # on its way aside or back: each file is there or still in its place
        if (run_dir / aside / "config.json").is_file():
            return run_dir / aside / "config.json"
    if (run_dir / REPLACED).is_dir() and not ckpt.reached_a_checkpoint(run_dir):
        return run_dir / REPLACED / "config.json"  # absent where the old run had none: none comes back
    return run_dir / "config.json"


def reaches_a_checkpoint(run_dir: Path) -> bool:
    """Whether the run that `recover` will leave in `run_dir` has reached a checkpoint: the run in place, or one an
    interrupted --overwrite set aside, which the next `dropless train` there puts back."""
    run_dir = Path(run_dir)
    return ckpt.reached_a_checkpoint(run_dir) or any(
        (run_dir / aside).is_dir() and ckpt.reached_a_checkpoint(run_dir / aside)
        for aside in (REPLACING, REPLACED, RESTORING))


def check_readable(run_dir: Path) -> None:
    """Refuse to read a run whose checkpoints an interrupted --overwrite set aside (none in place): told "no
    checkpoint", a user may delete the run; the next `dropless train` there puts it back."""
    run_dir = Path(run_dir)
    if not ckpt.all_steps(run_dir) and reaches_a_checkpoint(run_dir):
        if (pid := run_lock.holder(run_dir)) is not None:  # not stopped: that --overwrite is training now
            raise ckpt.CheckpointError(
                f"{run_dir} is being overwritten by dropless process {pid}, which set its old run aside and has not "
                "written the new run's first checkpoint yet; read it once that checkpoint is written, or stop that "
                "process (the next `dropless train` there then puts the old run back).")
        raise ckpt.CheckpointError(
            f"{run_dir}'s run was set aside by an --overwrite stopped before its new run's first checkpoint, and has "
            f"no finished checkpoint in place; the next `dropless train` there puts it back (`dropless train "
            f"--run-dir {run_dir} --resume` continues it).")


def _restorable(root: Path) -> list[Path]:
    """The paths under `root` that a set-aside run may hold, as they stand there."""
    names = [root / name for name in REPLACED_FILES + COPIED_FILES]
    return [path for path in names if path.exists()] + sorted((root / CACHE_DIR).glob(TOKEN_CACHE))


def _move_back(run_dir: Path, aside: Path, paths: list[Path]) -> None:
    """Each of `paths` (under `aside`) that exists, back to its place under `run_dir`; then `aside` deleted."""
    for path in paths:
        if path.exists():
            target = run_dir / path.relative_to(aside)
            target.parent.mkdir(parents=True, exist_ok=True)
            path.rename(target)
    shutil.rmtree(aside)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)  # free, and safe: the loader replaces a cache file, never writes into it
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, target)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
