"""Files written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write `data` to a private temporary file beside `path` and rename it over `path`, so readers (and other
    processes) never see a partial file and a kill leaves the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)
