"""Checkpoints with orbax: atomic, verified, the last few kept, restored with the shardings the caller asks for.

A run directory looks like
    RUN_DIR/config.json            the full Config of the run (dropless.core.config.save)
    RUN_DIR/tokenizer.json         the tokenizer (written by dropless.data)
    RUN_DIR/checkpoints/<step>/    one orbax checkpoint per saved step, with three items:
        model       {"params": ..., "state": ...}   what inference, export and fine-tuning need
        optimizer   {"opt_state": ..., "step": ...} what exact resumption needs (absent after an HF import)
        digest      two 32-bit folds of every array's bit patterns (absent in checkpoints of older versions)
orbax writes each step to a temporary directory and renames it when complete, so an interrupted save never
leaves a checkpoint that looks whole; `latest_step` only sees finished ones. The digest is an item of the same
checkpoint, so it is renamed into place with the arrays it describes. A restore recomputes it on the restored
arrays: a truncated, emptied or altered file shows as an error from orbax or as a mismatch, and
`restore_latest` then falls back to the newest checkpoint that is good. With several processes, each reads its own
shards, so each may see another outcome; they agree on the worst (`_agree`), so all fall back to the same one.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import json
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from dropless.core import config as config_lib
from dropless.core.debug import debugging
from dropless.models import transformer

ITEMS = ("model", "optimizer", "digest")
_STRAGGLERS_S = 0.2

# orbax writes an array replicated over N devices as N slices, one per replica, so that they write in parallel;
# each slice is a device computation, compiled the first time a checkpoint meets its shape. An array whose slices
# would be under 1 MiB (a model's norms, biases and router biases; every array of a small model) gains nothing
# from that and is written whole by its first replica (as orbax writes every array where JAX_PLATFORMS names a GPU).
_MIN_REPLICA_SLICE_BYTES = 1 << 20


def _write_small_replicated_arrays_whole() -> None:
    default = ocp.type_handlers.get_type_handler(jax.Array)
    try:  # the handler's private store keeps the saved format; an orbax without either keeps its own default
        handler = ocp.type_handlers.ArrayHandler(array_metadata_store=default._array_metadata_store,
                                                 min_slice_bytes_for_replica_parallel=_MIN_REPLICA_SLICE_BYTES)
    except (AttributeError, TypeError):
        return
    absl_log = logging.getLogger("absl")  # orbax notes each override as a warning: this one is ours, not the user's
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl_log.setLevel(level)


_write_small_replicated_arrays_whole()


class CheckpointError(ValueError):
    """A run directory or checkpoint that cannot be used; the message says why and what to do."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older one."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint that orbax cannot read, or that reads back different from what was saved."""


# Where --resume sets a damaged checkpoint aside, beside RUN_DIR/checkpoints.
DAMAGED_DIR = "checkpoints.damaged"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir).resolve() / "checkpoints"


# What orbax logs for every manager opened read-only, as ours are on purpose (a restore or a look never writes).
_READ_ONLY_NOTES = ("CheckpointManagerOptions.read_only=True", "Given directory is read only=")


def _not_a_read_only_note(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_READ_ONLY_NOTES)


def _not_a_metadata_note(record: logging.LogRecord) -> bool:
    """orbax logs an error for each step whose optional metadata file it cannot parse, and a warning for each
    whose metadata file is missing (a step another process is deleting while it is listed: a trainer rotating its
    oldest). That file is not what a checkpoint is verified by: the checkpoint then restores and matches its
    digest, or dropless reports it damaged in one line and reads another, so the note only adds lines before that
    one (DROPLESS_DEBUG keeps it)."""
    return debugging() or not str(record.msg).startswith(("Failed to json parse Metadata file",
                                                          "Metadata file does not exist"))


def manager(run_dir: Path, keep: int | None = None, read_only: bool = False) -> ocp.CheckpointManager:
    absl = logging.getLogger("absl")
    if _not_a_metadata_note not in absl.filters:  # for the process: orbax logs it whenever it lists the steps
        absl.addFilter(_not_a_metadata_note)
    absl.addFilter(_not_a_read_only_note)
    try:
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only, read_only=read_only,
                                               enable_async_checkpointing=False)
        for attempt in range(_LISTING_ATTEMPTS):
            try:
                return ocp.CheckpointManager(checkpoint_dir(run_dir), options=options, item_names=ITEMS)
            except (FileNotFoundError, NotADirectoryError):  # a step listed, then deleted (a trainer rotating
                # its oldest) or moved aside (--overwrite) before orbax looked at it (NotADirectoryError: gone
                # between orbax's exists() and is_dir()): list them again
                if not read_only or attempt == _LISTING_ATTEMPTS - 1:
                    raise
    finally:
        absl.removeFilter(_not_a_read_only_note)


_LISTING_ATTEMPTS = 5


def _has_checkpoint_dir(run_dir: Path) -> bool:
    """Whether the run has a checkpoints directory yet. A file in its place is refused in one line: read as a run
    without checkpoints, it would be reported as 'no finished checkpoint yet'."""
    directory = checkpoint_dir(run_dir)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory} is a file, not a checkpoints directory; move it out of the way (a run "
                              "keeps its checkpoints in a directory of that name).")
    return directory.is_dir()


def latest_step(run_dir: Path) -> int | None:
    if not _has_checkpoint_dir(run_dir):
        return None
    with manager(run_dir, read_only=True) as mngr:
        return mngr.latest_step()


def save(mngr: ocp.CheckpointManager, step: int, params, state, opt_state=None, *, with_digest: bool = True) -> None:
    """Save one step; blocks until the checkpoint is complete on disk. `with_digest=False` is for a writer that
    replaces the arrays afterwards (dropless.convert.run_store); such a checkpoint restores unverified.

    A write that the filesystem refuses (full disk, no permission) raises a CheckpointError naming the step and
    the reason; the failed step's temporary directory is removed and the earlier checkpoints are untouched."""
    trees = {"model": _without_empty({"params": params, "state": state})}
    if opt_state is not None:
        trees["optimizer"] = _without_empty({"opt_state": opt_state, "step": np.asarray(step, np.int64)})
    items = {name: ocp.args.StandardSave(tree) for name, tree in trees.items()}
    if with_digest:
        items["digest"] = ocp.args.JsonSave({"version": 1, "leaves": digest(trees)})
    with _held_output() as held:
        try:
            mngr.save(step, args=ocp.args.Composite(**items), force=True)
            mngr.wait_until_finished()
        except Exception as err:  # orbax and tensorstore wrap the OSError in their own exceptions
            reason = _filesystem_reason(err)
            if reason is None:
                raise
            directory = Path(mngr.directory)
            try:  # orbax's writer threads may still be creating files in the temporary directory: let them stop
                mngr.wait_until_finished()
            except Exception:  # noqa: BLE001 - the same failure, reported below
                pass
            _remove_until_quiet(directory, f"{step}.orbax-checkpoint-tmp*")
            _silence_failed_writes(directory / f"{step}.orbax-checkpoint-tmp", reason)
            held.drop()  # each writer thread's traceback of the same refused write: the line below says it once
            fix = "free space" if reason == "No space left on device" else "make it writable"
            raise CheckpointError(f"could not write checkpoint {step} to {directory}: {reason}; {fix} and resume "
                                  "with --resume.") from None


class _FailedWrites(logging.Filter):
    """Drops asyncio's reports of the writer tasks of a save that failed: each reports "exception was never
    retrieved" when it is freed, which may be at exit. A report is theirs when it names the save's temporary
    directory or its exception is the same refusal (`reason`)."""

    def __init__(self, temporary: Path, reason: str):
        super().__init__()
        self.temporary, self.reason = str(temporary), reason

    def filter(self, record: logging.LogRecord) -> bool:
        if self.temporary in record.getMessage():
            return False
        error = record.exc_info[1] if record.exc_info else None
        return error is None or _filesystem_reason(error) != self.reason


def _silence_failed_writes(temporary: Path, reason: str) -> None:
    if not debugging():
        logging.getLogger("asyncio").addFilter(_FailedWrites(temporary, reason))
    with warnings.catch_warnings():  # the failed save's never-awaited coroutines, freed with the tasks
        warnings.simplefilter("ignore", RuntimeWarning)
        gc.collect()  # the tasks freed now report while the save's output is held


class _FailedReads(logging.Filter):
    """Drops the reports of the reader tasks of a restore that failed (the one line raised says what failed):
    asyncio's "exception was never retrieved" for each task, and the interpreter's "Exception ignored" for each
    coroutine, both issued when they are freed, which may be at exit. A report is theirs when its text names a
    checkpoints' directory read in this process (tensorstore's error quotes the absolute path of the array it
    could not read). One instance serves the process: it filters the asyncio logger and wraps the unraisable
    hook it found."""

    def __init__(self, directories: set[str], hook):
        super().__init__()
        self.directories, self.hook = directories, hook

    def theirs(self, text: object) -> bool:
        return text is not None and any(directory in str(text) for directory in self.directories)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.theirs(record.getMessage()) or self.theirs(record.exc_info and record.exc_info[1]))

    def unraisable(self, report) -> None:
        if not (self.theirs(report.exc_value) or _READ_FAILED and _closed_loop(report.exc_value)):
            self.hook(report)


def _closed_loop(error: BaseException | None) -> bool:
    """A tensorstore thread finishing a read after orbax closed the read's event loop (`call_soon_threadsafe`):
    the straggler of a failed read, which may come after restore's sink is gone and names no path."""
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


_READ_DIRECTORIES: set[str] = set()
_READ_FAILED = False  # from the first failed read on, its stragglers' closed-loop reports are dropped too


def _silence_failed_reads(directory: Path) -> None:
    """Before each read: a failed read's first reports come while orbax closes its event loop, inside the read,
    and a logging handler set up before the read (the user's, or a test runner's) holds the real stderr, not
    restore's sink. Every report names the directory, so those issued later, whenever the cyclic collector frees
    the tasks, are dropped too; no collection is forced (a full one walks the whole heap of a process that has
    compiled for long). The hook is wrapped again only where another replaced it (a test runner's, per test)."""
    if debugging():
        return
    _READ_DIRECTORIES.add(str(Path(directory).resolve()))
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _FailedReads) for f in asyncio_log.filters):
        asyncio_log.addFilter(_FailedReads(_READ_DIRECTORIES, None))
    if not isinstance(getattr(sys.unraisablehook, "__self__", None), _FailedReads):
        sys.unraisablehook = _FailedReads(_READ_DIRECTORIES, sys.unraisablehook).unraisable


class _HeldOutput:
    """What is logged (through the root logger's handlers) and printed to sys.stderr while held: emitted when
    released, unless dropped. DROPLESS_DEBUG=1 (or --debug) keeps everything."""

    def __init__(self):
        self.records: list[logging.LogRecord] = []
        self.stderr = io.StringIO()
        self.dropped = False

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def drop(self) -> None:
        self.dropped = not debugging()


@contextlib.contextmanager
def _held_output():
    """Hold back what orbax's and tensorstore's threads log and print during a save. A refused write (a full disk)
    fails in every writer thread at once, each logging its traceback, and asyncio reports each failed future;
    the save's one-line CheckpointError replaces them (`drop`). Anything held otherwise is emitted at the end."""
    held, handlers = _HeldOutput(), list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(held)
    try:
        with contextlib.redirect_stderr(held.stderr):
            yield held
    finally:
        for handler in handlers:
            handler.removeFilter(held)
        if not held.dropped:
            sys.stderr.write(held.stderr.getvalue())
            for record in held.records:
                logging.getLogger(record.name).handle(record)


def _remove_until_quiet(directory: Path, pattern: str, quiet_s: float = 1.0, limit_s: float = 15.0) -> None:
    """Remove what matches `pattern` in `directory` until nothing has matched for `quiet_s` (at most `limit_s`).
    After a failed save orbax's writer threads can still be creating files and directories: waiting for the
    manager returns at the first error, not when the last of its threads stops (seen on a loaded machine)."""
    deadline = time.monotonic() + limit_s
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        leftovers = list(directory.glob(pattern))
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        if leftovers:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        time.sleep(0.05)


_FILESYSTEM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


def _filesystem_reason(err: BaseException) -> str | None:
    """The filesystem's reason (e.g. 'No space left on device') if `err` or an exception behind it is one."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _FILESYSTEM_ERRNOS:
            return err.strerror or str(err)
        for code in _FILESYSTEM_ERRNOS:  # tensorstore reports the OS error in its message only
            if os.strerror(code) in str(err):
                return os.strerror(code)
        err = err.__cause__ or err.__context__
    return None


# Digest: per leaf, the sum of its elements' bit patterns as 32-bit words and the sum weighted by position,
# both modulo 2**32. Integer sums are exact in any order, so the digest does not depend on how the array is
# sharded (a checkpoint saved on 8 devices verifies on 1); any single changed word changes the first sum, and
# moved words change the second. A float sum would miss flips that round away.

def _fold_device(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        words = x.astype(jnp.uint32)
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    position = jnp.ones(x.shape, jnp.uint32)  # 1 + the flat index, built without reshaping sharded data
    stride = 1
    for axis in reversed(range(x.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride)
        stride *= x.shape[axis]
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * position, dtype=jnp.uint32)])


def _fold_host(x) -> list[int]:
    x = np.ascontiguousarray(np.asarray(x))
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    if x.dtype.itemsize == 8:  # two little-endian words per element, as on a device
        words = x.reshape(-1).view(np.uint32).astype(np.uint64)
    else:
        words = x.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(np.uint64)
    position = np.arange(1, words.size + 1, dtype=np.uint64)
    mask = np.uint64(0xFFFFFFFF)
    return [int(words.sum() & mask), int(((words * position) & mask).sum() & mask)]


@jax.jit
def _fold_all(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_fold_device(x) for x in leaves]


@jax.jit
def _fold_from_host(x: jax.Array) -> jax.Array:
    return _fold_device(jax.device_put(x, jax.memory.Space.Device))


def _in_device_memory(x) -> bool:
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return kind is None or kind == "device"


def digest(trees: dict) -> dict[str, list[int]]:
    """{"item/path/to/leaf": [sum, position-weighted sum]} of every array in `trees`, folded where it lives."""
    flat = {f"{item}/{jax.tree_util.keystr(path, simple=True, separator='/')}": leaf
            for item, tree in trees.items() for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
    groups: dict[tuple, list[str]] = {}  # one jitted pass per set of devices the leaves live on
    for key, x in flat.items():
        if isinstance(x, jax.Array) and x.dtype.itemsize <= 4 and _in_device_memory(x):
            groups.setdefault(tuple(sorted(d.id for d in x.sharding.device_set)), []).append(key)
    folds = {}
    for keys in groups.values():
        folds.update(zip(keys, _fold_all([flat[k] for k in keys])))
    for key, leaf in flat.items():
        if key in folds:
            continue
        if isinstance(leaf, jax.Array) and leaf.dtype.itemsize <= 4:
            folds[key] = _fold_from_host(leaf)  # host-offloaded: one leaf at a time on the device
        else:
            folds[key] = _fold_host(leaf)
    return {k: [int(v) for v in np.asarray(jax.device_get(f)).tolist()] for k, f in folds.items()}


def _abstract(tree):
    """ShapeDtypeStructs (with shardings, where the leaves have them) describing `tree`."""
    def leaf(x):
        x = np.asarray(x) if isinstance(x, (int, float)) else x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(leaf, tree)


def _without_empty(tree):
    """`tree` with its arrays of no elements as None, which orbax stores as nothing: it refuses to save an array of
    zero size, and a model without MoE layers has a router state of 0 rows (`_with_empty` puts them back)."""
    return jax.tree.map(lambda x: None if getattr(x, "size", 1) == 0 else x, tree)


def _with_empty(restored, like):
    """`restored` with the arrays of no elements that `_without_empty` left out, made from the template `like`."""
    if isinstance(like, dict):
        restored = restored if isinstance(restored, dict) else {}
        return {key: _with_empty(restored.get(key), value) for key, value in like.items()}
    if restored is None and getattr(like, "size", 1) == 0:
        sharding = getattr(like, "sharding", None)
        empty = np.zeros(like.shape, like.dtype)
        return jax.device_put(empty, sharding) if sharding is not None else jnp.asarray(empty)
    return restored


def restore(run_dir: Path, step: int, like_model, like_optimizer=None) -> dict[str, Any]:
    """Restore `step` into trees shaped (and sharded) like the given templates, verified against its digest.

    `like_model` = {"params", "state"}; `like_optimizer` = {"opt_state", "step"} or None to skip it.
    Templates may be concrete arrays or ShapeDtypeStructs (e.g. from jax.eval_shape). Raises DamagedCheckpoint
    when the checkpoint cannot be read or reads back different from what was saved.
    """
    global _READ_FAILED
    items = {"model": ocp.args.StandardRestore(_abstract(_without_empty(like_model)))}
    if like_optimizer is not None:
        items["optimizer"] = ocp.args.StandardRestore(_abstract(_without_empty(like_optimizer)))
    where = f"checkpoint {step} in {checkpoint_dir(run_dir)}"
    with manager(run_dir, read_only=True) as mngr:
        if reason := step_is_a_file(run_dir, step):
            _agree(DamagedCheckpoint(f"{where} cannot be read ({reason})"), where)
        require_step(run_dir, step, mngr.all_steps())
        names = _item_names(run_dir, step)
        if like_optimizer is not None and "optimizer" not in names:
            if imported(run_dir):
                raise CheckpointError(
                    f"The checkpoint at step {step} in {run_dir} holds weights only (imported from Hugging Face), "
                    f"so there is nothing to resume; {imported_fix(run_dir)}.")
            _agree(DamagedCheckpoint(f"{where} has no optimizer state"), where)  # a trained run's: damaged
        if "digest" in names:
            items["digest"] = ocp.args.JsonRestore()
        # A failed read leaves tensorstore's threads completing futures of an event loop orbax has closed;
        # each prints a traceback to sys.stderr. The one line raised here replaces them, so they go to a sink,
        # with a moment after a failure for the stragglers.
        error = None
        _silence_failed_reads(checkpoint_dir(run_dir))
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                restored = dict(mngr.restore(step, args=ocp.args.Composite(**items)))
            except (ValueError, KeyError, TypeError) as err:
                error = (CheckpointError(f"The checkpoint at step {step} in {run_dir} does not match this model's "
                                         f"parameters ({first_line(err)}); check the run's config.json.")
                         if _shape_mismatch(err) else DamagedCheckpoint(f"{where} cannot be read ({first_line(err)})"))
            except Exception as err:  # tensorstore and orbax raise many kinds on truncated or garbled files
                error = DamagedCheckpoint(f"{where} cannot be read ({type(err).__name__}: {first_line(err)})")
            if error is not None:
                _READ_FAILED = True
                time.sleep(_STRAGGLERS_S)
        _agree(error, where)
    saved = restored.pop("digest", None)
    if saved is not None:
        got = digest(restored)  # a computation over every process's devices: all take part, whatever they read
        want = saved.get("leaves") if isinstance(saved, dict) else None
        if not isinstance(want, dict):
            error = DamagedCheckpoint(f"{where} has an unreadable digest")
        else:
            wrong = next((key for key in sorted(got) if want.get(key) != got[key]), None)
            error = DamagedCheckpoint(f"{where} is damaged (digest mismatch in {wrong})") if wrong else None
        _agree(error, where)
    restored["model"] = _with_empty(restored["model"], like_model)
    if "optimizer" in restored:
        restored["optimizer"] = _with_empty(restored["optimizer"], like_optimizer)
    return restored


# How a restore went on one process, worst last: every process takes the worst one (see _agree).
_RESTORED, _DAMAGED, _UNUSABLE = 0, 1, 2


def _agree(error: CheckpointError | None, where: str) -> None:
    """Raise `error`, or the kind of error another process met, so that all processes take the same branch.

    With several processes each reads its own shards, so a file that is damaged or unreachable on one host can
    read fine on another; left alone, one process would fall back to an older checkpoint while the others
    went on (and hung in the next collective). One all-gather of an integer makes the outcome common: any
    process's damage makes the checkpoint damaged for all, any unusable checkpoint stops all."""
    outcome = _RESTORED if error is None else _DAMAGED if isinstance(error, DamagedCheckpoint) else _UNUSABLE
    worst, process = agreed_outcome(outcome)
    if worst == outcome:
        if error is not None:
            raise error
        return
    if worst == _DAMAGED:
        raise DamagedCheckpoint(f"{where} is damaged or unreadable on process {process}")
    raise CheckpointError(f"{where} cannot be used on process {process} (its error says why); check the run's "
                          "config.json.")


def agreed_outcome(outcome: int) -> tuple[int, int]:
    """(the largest `outcome` of all processes, the lowest-numbered process that had it); alone: (outcome, 0)."""
    if jax.process_count() == 1:
        return outcome, jax.process_index()
    outcomes = np.ravel(multihost_utils.process_allgather(np.int32(outcome)))
    return int(outcomes.max()), int(np.argmax(outcomes == outcomes.max()))


def first_line(err: BaseException) -> str:
    """The error's first line, without the pointer to tensorstore's spec that orbax appends (a method's repr)."""
    lines = str(err).strip().splitlines()
    line = (lines[0] if lines else type(err).__name__).split(" See full TensorStore details")[0]
    return line[:160]


def _shape_mismatch(err: BaseException) -> bool:
    text = str(err).lower()
    return any(word in text for word in ("shape", "tree structure", "dict key mismatch", "missing key"))


def _item_names(run_dir: Path, step: int) -> set[str]:
    step_dir = checkpoint_dir(run_dir) / str(step)
    return {p.name for p in step_dir.iterdir() if p.is_dir()} if step_dir.is_dir() else set()


def unfinished(run_dir: Path, step: int) -> str | None:
    """How `step`'s directory in the run's checkpoints falls short of a run's checkpoint (a file, no model item, no
    optimizer state), or None. Looked at without reading: a checkpoint that passes may still fail its digest."""
    if reason := step_is_a_file(run_dir, step):
        return reason
    names = _item_names(run_dir, step)
    if "model" not in names:
        return "it holds no model weights" if names else "it is empty"
    return None if "optimizer" in names else "it holds no optimizer state"


def require_step(run_dir: Path, step: int, steps) -> None:
    """Refuse a `step` that is not among the run's saved `steps`, naming them."""
    if step not in steps:
        raise CheckpointError(f"{checkpoint_dir(run_dir)} has no checkpoint for step {step}; "
                              f"the saved steps are {sorted(steps) or 'none'}.")


def all_steps(run_dir: Path) -> list[int]:
    """The run's finished checkpoint steps, newest first, with any step whose directory a file has replaced:
    orbax does not list those, so without them a reader would take an older step without a word and a later save
    of that step would remove the file. `restore` reports such a step damaged (--resume sets it aside)."""
    if not _has_checkpoint_dir(run_dir):
        return []
    with manager(run_dir, read_only=True) as mngr:
        return sorted(set(mngr.all_steps()) | _steps_that_are_files(run_dir), reverse=True)


def _steps_that_are_files(run_dir: Path) -> set[int]:
    return {int(p.name) for p in checkpoint_dir(run_dir).iterdir()
            if p.name.isdigit() and p.name == str(int(p.name)) and not p.is_dir()}


def step_is_a_file(run_dir: Path, step: int) -> str | None:
    """A DamagedCheckpoint's reason where `step`'s directory is a file, else None."""
    path = checkpoint_dir(run_dir) / str(step)
    return "it is a file, not a checkpoint directory" if os.path.lexists(path) and not path.is_dir() else None


def imported(run_dir: Path) -> bool:
    """Whether `run_dir` was made by `dropless convert --from-hf` (its mark: the original's config, kept for export
    as hf_source.json): weights only, no optimizer state, nothing `train` can continue."""
    return (Path(run_dir) / "hf_source.json").is_file()


def imported_fix(run_dir: Path) -> str:
    """What to do instead of training an imported run in place."""
    return ("start a new run from the original with --init-from-hf HF_DIR (or export this one with "
            f"`dropless convert --from {run_dir} --to-hf DIR` first)")


def reached_a_checkpoint(run_dir: Path) -> bool:
    """Whether the run in `run_dir` ever finished a checkpoint (one kept, or one set aside as damaged)."""
    damaged = checkpoint_dir(run_dir).with_name(DAMAGED_DIR)
    return bool(all_steps(run_dir)) or (damaged.is_dir() and any(damaged.iterdir()))


# What a run none of whose checkpoints is good leaves the user to do: train it again, or read weights elsewhere.
RESUME_FIX = "start again with --overwrite"
READ_FIX = "restore its checkpoints from a copy of the run, or train it again"


def restore_latest(run_dir: Path, like_model, like_optimizer=None, *, log: Callable[[str], None] = print,
                   set_aside: bool = True, fix: str = RESUME_FIX) -> tuple[int, dict[str, Any]]:
    """(step, restored trees) of the newest good checkpoint, for --resume.

    Each damaged checkpoint on the way is reported in one line and, with `set_aside`, moved to
    RUN_DIR/checkpoints.damaged/ so that the resumed run can save that step again. Raises CheckpointError when
    the run has no finished checkpoint or none is good (ending with `fix`).
    """
    steps = all_steps(run_dir)
    if not steps:
        raise CheckpointError(f"--resume was given but {run_dir} has no finished checkpoint (the run stopped "
                              "before its first save); start it again with the same command without --resume.")
    step, restored, damaged = newest_good(run_dir, steps, lambda s: restore(run_dir, s, like_model, like_optimizer),
                                          fix)
    for bad_step, message in damaged:
        moved = _set_aside(run_dir, bad_step) if set_aside else None
        log(f"dropless: {message}; " + (f"moved it to {moved}; " if moved else "") +
            f"resuming from checkpoint {step}.")
    return step, restored


def newest_good(run_dir: Path, steps: list[int], attempt: Callable[[int], Any],
                fix: str) -> tuple[int, Any, list[tuple[int, str]]]:
    """(step, attempt(step), damaged) for the first of `steps` (newest first) whose `attempt` raises no
    DamagedCheckpoint; `damaged` holds the (step, message) of those before it. A step that another process deleted
    while it was read (a trainer keeping its newest train.keep_checkpoints) counts as such, whatever its error;
    after each failure the steps are listed again, so that the one saved meanwhile is read next. Where none is good, a
    CheckpointError names them all and ends with `fix` (what the user can do: RESUME_FIX, READ_FIX)."""
    damaged, tried, queue, vanished = [], set(), list(steps), []
    while queue:
        step = queue.pop(0)
        tried.add(step)
        try:
            return step, attempt(step), damaged
        except CheckpointError as err:
            # (a newer step not tried yet: saved meanwhile; older damaged steps of a run whose newer ones
            # failed too are not waited for)
            newer_saved = any(later > step and later not in tried for later in all_steps(run_dir))
            if not _gone(checkpoint_dir(run_dir) / str(step), _ROTATION_S if newer_saved else 0.0):
                if not isinstance(err, DamagedCheckpoint):
                    raise
                damaged.append((step, str(err)))
            else:  # another process (the run's trainer, rotating its oldest away) deleted it while it was read
                vanished.append(step)
                damaged.append((step, f"checkpoint {step} in {checkpoint_dir(run_dir)} cannot be read: another "
                                      "process deleted it while it was read (such as the run's trainer keeping "
                                      "its newest train.keep_checkpoints)"))
        # the steps saved meanwhile come first: a trainer that deleted this one has saved a newer one
        queue = sorted(set(all_steps(run_dir)) - tried, reverse=True)
    if len(vanished) == len(damaged):  # none damaged: the run was moved or deleted under the reader
        raise CheckpointError(f"every checkpoint of {run_dir} that was read (steps {', '.join(map(str, vanished))}) "
                              "was deleted or moved by another process meanwhile (a `dropless train --overwrite` "
                              "there, or a trainer keeping its newest train.keep_checkpoints), and none is left; "
                              "read it again once that process has written a checkpoint.")
    raise CheckpointError(f"{damaged[0][1]}, and so is every older checkpoint in {checkpoint_dir(run_dir)} "
                          f"(steps {', '.join(str(s) for s, _ in damaged)}); {fix}.")


# How long a step that failed to read, while a newer one was saved, is given to disappear: a trainer rotating it
# away deletes its files one by one, so a read can fail before the directory is gone.
_ROTATION_S = 2.0


def _gone(path: Path, wait_s: float) -> bool:
    """Whether `path` is gone, or goes within `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while os.path.lexists(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _set_aside(run_dir: Path, step: int) -> Path | None:
    """Move a damaged step out of orbax's sight (process 0; the others wait). None where the step is gone
    already: another process deleted it while it was read, which is why it could not be read."""
    source = checkpoint_dir(run_dir) / str(step)
    target = checkpoint_dir(run_dir).with_name(DAMAGED_DIR) / str(step)
    if jax.process_index() == 0:
        if not os.path.lexists(source):
            target = None
        else:
            target.parent.mkdir(exist_ok=True)
            suffix = 0
            while target.exists():
                suffix += 1
                target = target.with_name(f"{step}.{suffix}")
            try:
                shutil.move(source, target)
            except FileNotFoundError:  # deleted between the look and the move
                target = None
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"dropless: checkpoint {step} set aside")
    return target


def load_run_config(run_dir: Path) -> config_lib.Config:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{run_dir} is not a dropless run directory (no config.json); "
                              "pass the directory a 'dropless train' or 'dropless convert' wrote.")
    try:
        return config_lib.load(path)
    except config_lib.ConfigError:
        if hugging_face_config(path):
            raise CheckpointError(f"{run_dir} holds a Hugging Face model, not a dropless run; pass it with --hf-dir "
                                  f"(generate, logits), or import it first: dropless convert --from-hf {run_dir} "
                                  "--to RUN_DIR.") from None
        raise


def foreign_config(run_dir: Path) -> str | None:
    """Why `run_dir`'s config.json is no dropless run's, which nothing may replace (not even --overwrite, which
    replaces runs): a Hugging Face model's, or a JSON object with none of a run config's groups (another program's
    file); None for a run's config, a damaged one included, and where there is none."""
    path = Path(run_dir) / "config.json"
    fields = _json_object(path)
    if _hugging_face_fields(fields):
        return f"{run_dir} holds a Hugging Face model, not a dropless run"
    if fields and not set(config_lib.GROUPS) & set(fields):
        groups = ", ".join(sorted(config_lib.GROUPS))
        return f"{path} is not a dropless run's config (it has none of the groups {groups})"
    return None


def hugging_face_config(path: Path) -> bool:
    """Whether `path` reads as a Hugging Face config.json (a model_type or architectures field)."""
    return _hugging_face_fields(_json_object(path))


def _hugging_face_fields(fields: dict | None) -> bool:
    return fields is not None and ("model_type" in fields or "architectures" in fields)


def _json_object(path: Path) -> dict | None:
    """The JSON object in the file at `path`; None where there is none, it cannot be read, or it holds another kind."""
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return None
    return fields if isinstance(fields, dict) else None


def save_model(run_dir: Path, config: config_lib.Config, params, state, step: int = 0, *,
               with_digest: bool = True) -> None:
    """Write a weights-only run directory (config.json + one checkpoint), e.g. after an HF import."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_lib.save(config, run_dir / "config.json")
    with manager(run_dir) as mngr:
        save(mngr, step, params, state, with_digest=with_digest)


def check_step(run_dir: Path, step: int | None) -> None:
    """Refuse, before anything slow, what `load_checkpoint` would: a `step` the run has not saved, or (None) a run
    without any finished checkpoint."""
    steps = all_steps(run_dir)
    if step is not None:
        require_step(run_dir, step, steps)
    elif not steps:
        raise CheckpointError(f"{run_dir} has no finished checkpoint yet; train longer or pick another run.")


def load_model(run_dir: Path, step: int | None = None, shardings: dict | None = None):
    """(config, params, state) from a run directory's latest good (or given) checkpoint (`load_checkpoint`)."""
    return load_checkpoint(run_dir, step, shardings)[1:]


def load_checkpoint(run_dir: Path, step: int | None = None, shardings: dict | None = None):
    """(step, config, params, state) from a run directory's latest good (or given) checkpoint, on the default
    device, or restored straight into `shardings` ({"params": ..., "state": ...}, trees of shardings shaped like
    them), so that a model no one device holds is never gathered on one.

    Without `step`, a damaged latest checkpoint is skipped with a CheckpointWarning naming it."""
    config = load_run_config(run_dir)
    like = jax.eval_shape(lambda: {"params": transformer.init_params(jax.random.key(0), config),
                                   "state": transformer.init_state(config)})
    if shardings is None:  # a template without shardings would restore the saved mesh, which may need more devices
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, like)
    like = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        like, shardings)
    check_step(run_dir, step)
    if step is not None:
        model = restore(run_dir, step, like)["model"]
    else:
        def warn(message):
            warnings.warn(message.removeprefix("dropless: ").replace("resuming from", "using"), CheckpointWarning)
        step, restored = restore_latest(run_dir, like, log=warn, set_aside=False, fix=READ_FIX)
        model = restored["model"]
    return step, config, model["params"], model["state"]
