"""One trainer per run directory: an OS lock on RUN_DIR/.lock, held while the run trains.

`flock` locks belong to the open file, so the kernel drops the lock when the process ends, however it ends
(SIGKILL included): a lock is never stale. The holder writes its PID into the file for the refusal message.
With several processes, process 0 alone takes it; the others belong to the same run.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
from pathlib import Path
from typing import Iterator

import jax

from dropless.core.config import ConfigError

LOCK_NAME = ".lock"


class RunDirLocked(ConfigError):
    """Another process trains in the run directory."""


@contextlib.contextmanager
def hold(run_dir: Path) -> Iterator[None]:
    """Hold RUN_DIR/.lock for the body, or raise RunDirLocked naming the holder."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirLocked(f"{run_dir} is in use by another dropless process (PID {_pid(fd)}); wait for it to "
                               "finish or stop it, or choose another --run-dir.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race with a process about to lock it)


def _pid(fd: int) -> str:
    """The PID the lock's holder wrote into the open lock file `fd`."""
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"


def holder(run_dir: Path) -> str | None:
    """The PID of the process that holds RUN_DIR/.lock (a trainer), or None where none does. The look is a
    shared lock taken and dropped at once, without waiting; a trainer starting in that instant is refused."""
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY)
    except OSError:  # no lock file: never trained, or not readable (then nothing to tell)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _pid(fd)
    finally:
        os.close(fd)
    return None


def holds_run_dir(train):
    """Decorate `train(config, run_dir, ...)` so that process 0 holds the run directory's lock throughout,
    from before --overwrite deletes anything until the last checkpoint is written. A directory the lock made (it
    did not exist) that a failed run leaves holding nothing but the lock (`train` removes what a run that failed
    before its first step wrote) is removed, lock file included, while the lock is still held: only its maker can
    be about to lock it, so no other trainer loses a lock by it."""
    @functools.wraps(train)
    def locked(config, run_dir, *args, **kwargs):
        if jax.process_index() != 0:
            return train(config, run_dir, *args, **kwargs)
        run_dir = Path(run_dir)
        made = not run_dir.exists()
        with hold(run_dir):  # a refusal (another trainer holds it) leaves before anything below runs
            try:
                return train(config, run_dir, *args, **kwargs)
            except BaseException:
                if made:
                    _remove_if_only_locked(run_dir)
                raise
    return locked


def holds_only_the_lock(run_dir: Path) -> bool:
    """Whether the directory `run_dir` holds nothing but (at most) the lock file."""
    return all(p.name == LOCK_NAME for p in Path(run_dir).iterdir())


def _remove_if_only_locked(run_dir: Path) -> None:
    """Remove `run_dir` if it holds only the lock file; a file another process adds meanwhile keeps it."""
    if holds_only_the_lock(run_dir):
        with contextlib.suppress(OSError):
            (run_dir / LOCK_NAME).unlink()
            run_dir.rmdir()
