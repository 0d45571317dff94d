"""`--overwrite` without losing the run it replaces to a mistake or a kill.

The old run's files wait in RUN_DIR/.replaced until the new run's data has loaded (`discard`), so that a mistake
found while loading it (a mistyped --data, a corpus too small) puts them back (`put_back`) instead of having cost
the old run. The tokenizer and its origin record are copied aside rather than moved: the new run's loader checks
them against its data and reuses them or trains over them, and the old run gets back the tokenizer its weights were
trained with either way.

Every step is a rename or works on a directory whose name says how far it got, so a process killed anywhere
leaves a state that the next `dropless train` in the directory finishes undoing (`recover`) before it does
anything else:

- `.replacing`: being set aside; each of REPLACED_FILES is in it or still in place, both the old run's.
- `.replaced`: set aside whole; the run directory's REPLACED_FILES and COPIED_FILES are the new run's (or absent).
- `.restoring`: being put back; whatever it still holds goes back to its place, where nothing is.
- `.discarded`: the new run has its data; deleting it finishes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from dropless.data.loader import CACHE_DIR, TOKENIZER_FILE

# What the new run replaces; it writes only config.json (and the tokenizer) before its data has loaded.
REPLACED_FILES = ("checkpoints", "metrics.jsonl", "router.bin", "router.json", "tensorboard", "training.png",
                  "config.json")
COPIED_FILES = (TOKENIZER_FILE, f"{CACHE_DIR}/tokenizer-origin.json")
REPLACING, REPLACED, RESTORING, DISCARDED = ".replacing", ".replaced", ".restoring", ".discarded"


def set_aside(run_dir: Path) -> None:
    """Move the run in `run_dir` into RUN_DIR/.replaced (the tokenizer copied) before a new run starts there."""
    building = Path(run_dir) / REPLACING
    building.mkdir()  # none is left: `recover` runs first
    for name in COPIED_FILES:
        if (Path(run_dir) / name).is_file():
            (building / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(run_dir) / name, building / name)
    for name in REPLACED_FILES:
        if (Path(run_dir) / name).exists():
            (Path(run_dir) / name).rename(building / name)
    building.rename(Path(run_dir) / REPLACED)


def put_back(run_dir: Path) -> None:
    """The run set aside, back in place of what the new run wrote (nothing, where the old run had none)."""
    run_dir = Path(run_dir)
    if (run_dir / REPLACED).is_dir():
        for name in REPLACED_FILES + COPIED_FILES:  # the new run's: the old run's are all aside
            _remove(run_dir / name)
        (run_dir / REPLACED).rename(run_dir / RESTORING)
    if (run_dir / RESTORING).is_dir():
        _move_back(run_dir, run_dir / RESTORING, REPLACED_FILES + COPIED_FILES)


def discard(run_dir: Path) -> None:
    """Delete the run set aside: the new one has its data."""
    run_dir = Path(run_dir)
    if (run_dir / REPLACED).is_dir():
        (run_dir / REPLACED).rename(run_dir / DISCARDED)  # one step: a kill in the deletion leaves no `.replaced`
    shutil.rmtree(run_dir / DISCARDED, ignore_errors=True)


def recover(run_dir: Path, log: Callable[[str], None]) -> None:
    """Finish what a killed `--overwrite` left half done in `run_dir`: the old run back in place where the new one
    never had its data, the set-aside copy deleted where it had."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    shutil.rmtree(run_dir / DISCARDED, ignore_errors=True)
    interrupted = [name for name in (REPLACING, REPLACED, RESTORING) if (run_dir / name).is_dir()]
    if (run_dir / REPLACING).is_dir():  # the copies are partial at worst, and their originals untouched
        _move_back(run_dir, run_dir / REPLACING, REPLACED_FILES)
    put_back(run_dir)
    if interrupted:
        log(f"dropless: {run_dir} held the run that an interrupted --overwrite had set aside before the new run's "
            "data loaded; that run is back in place")


def _move_back(run_dir: Path, aside: Path, names: tuple[str, ...]) -> None:
    for name in names:
        if (aside / name).exists():
            (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (aside / name).rename(run_dir / name)
    shutil.rmtree(aside)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
