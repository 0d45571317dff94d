"""Files written whole or not at all."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
from pathlib import Path
from typing import BinaryIO, Iterator

_TEMPORARY = re.compile(r"(.+)\.\d+\.tmp")  # write_atomic's: NAME.<pid>.tmp


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write `data` to a private temporary file beside `path` and rename it over `path`, so readers (and other
    processes) never see a partial file and a kill leaves the old file or the new one. A write the filesystem
    refuses (a full disk) removes the temporary file and raises the OSError naming `path`."""
    path = Path(path)
    tmp = _temporary(path)
    try:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as err:
        raise refused(err, path, tmp) from None


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """`write_atomic` for contents written in parts (a large array): a binary file whose contents replace `path`
    when the block ends without an error; any error removes them and leaves `path` as it was. Writes go through
    Python's file object, which reports a short write as the OSError of the system call (ENOSPC on a full disk),
    where NumPy's own writer to a real file reports one without an errno."""
    path = Path(path)
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as file:
            yield _Parts(file)
        os.replace(tmp, path)
    except OSError as err:
        raise refused(err, path, tmp) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _Parts:
    """A file object NumPy writes in chunks through `write` (it is no real file to numpy.save)."""

    def __init__(self, file: BinaryIO):
        self.write = file.write


def _temporary(path: Path) -> Path:
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def refused(err: OSError, path: Path, *temporaries: Path) -> OSError:
    """`err` as the failure to write `path` (its filename, for the one-line error), the partial `temporaries`
    removed."""
    for temporary in temporaries:
        try:
            temporary.unlink(missing_ok=True)
        except OSError:
            pass
    return OSError(err.errno, err.strerror, str(path)) if err.errno is not None else err


def file_in_the_way(directory: Path) -> Path | None:
    """The file (or pipe, or device) standing at `directory` or at the nearest of its parents that exists, which
    keeps the directory from being used or created; None where it is a directory or can be made. A check made
    before minutes of work that would otherwise end on the write."""
    directory = Path(directory)
    existing = next((part for part in (directory, *directory.parents) if part.exists()), None)
    return existing if existing is not None and not existing.is_dir() else None


def remove_temporaries(directory: Path, names: tuple[str, ...] = ("*",)) -> None:
    """Delete the temporary files `write_atomic` left in `directory` when killed mid-write (a token cache's can be
    large), of the files whose names match one of the glob patterns `names` (the caller's own: a directory may also
    hold someone else's `NAME.<number>.tmp`). Only for a directory no live process writes into: the caller holds its
    lock."""
    for path in Path(directory).glob("*.tmp"):
        match = _TEMPORARY.fullmatch(path.name)
        if match and path.is_file() and any(fnmatch.fnmatchcase(match.group(1), name) for name in names):
            path.unlink(missing_ok=True)
