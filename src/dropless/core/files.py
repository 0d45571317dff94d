"""Files written whole or not at all."""

from __future__ import annotations

import os
import re
from pathlib import Path

_TEMPORARY = re.compile(r".+\.\d+\.tmp")  # write_atomic's: NAME.<pid>.tmp


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write `data` to a private temporary file beside `path` and rename it over `path`, so readers (and other
    processes) never see a partial file and a kill leaves the old file or the new one. A write the filesystem
    refuses (a full disk) removes the temporary file and raises the OSError naming `path`."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as err:
        raise refused(err, path, tmp) from None


def refused(err: OSError, path: Path, *temporaries: Path) -> OSError:
    """`err` as the failure to write `path` (its filename, for the one-line error), the partial `temporaries`
    removed."""
    for temporary in temporaries:
        try:
            temporary.unlink(missing_ok=True)
        except OSError:
            pass
    return OSError(err.errno, err.strerror, str(path)) if err.errno is not None else err


def remove_temporaries(directory: Path) -> list[Path]:
    """Delete the temporary files `write_atomic` left in `directory` when killed mid-write (a token cache's can be
    large); returns them. Only for a directory no live process writes into: the caller holds its lock."""
    removed = []
    for path in Path(directory).glob("*.tmp"):
        if _TEMPORARY.fullmatch(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
