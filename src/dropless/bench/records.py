"""What every benchmark writes: one JSON file per benchmark and device, with the environment inside.

`environment()` names the device, platform, JAX and tokamax versions, the date, the host and the commit
(`DROPLESS_COMMIT`, else `git rev-parse` of the installed source); `results_path` fills a results template's
`{device}` with `device_slug`; `write_json` writes the file, so that each benchmark's record looks alike.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any, Callable

import jax

from dropless.core.arguments import check_output


def environment() -> dict[str, Any]:
    """The device, software and commit a measurement was taken with."""
    info = {"device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform, "jax": jax.__version__,
            "date": datetime.date.today().isoformat(), "host": platform.node()}
    try:
        import tokamax

        info["tokamax"] = tokamax.__version__
    except ImportError:
        info["tokamax"] = None
    info["commit"] = os.environ.get("DROPLESS_COMMIT") or _git_commit()
    return info


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def device_slug(device_kind: str) -> str:
    """'NVIDIA H200' -> 'h200' (the results file name)."""
    words = device_kind.lower().replace("nvidia", "").split()
    return re.sub(r"[^a-z0-9]+", "-", "-".join(words)).strip("-") or "cpu"


def results_path(template: str, device_kind: str, flag: str = "--out",
                 inputs: dict[str, str | Path | None] | None = None) -> Path:
    """`template` with `{device}` filled in by the device's slug, checked as `flag` (`check_output`, with the
    command's `inputs`). Nothing is created: `write_json` makes the folder when the record is written, so an
    argument refused after this check leaves no empty folder behind."""
    return check_output(flag, template.format(device=device_slug(device_kind)), inputs=inputs)


def write_json(path: Path, payload, *, indent: int = 1) -> Path:
    """Write one benchmark's record (values JSON cannot hold, e.g. dtypes, as their text), creating its folder:
    a measurement that took minutes is not lost to a results folder nobody made yet."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent, default=str) + "\n")
    return path


def record_lines(benchmark: str, out: str | Path | None, run: Callable[[Callable[[dict], None]], None],
                 **fields) -> list[dict]:
    """Run `run(emit)`: each record it emits is printed as one JSON line as it comes (a call cut short keeps what
    it printed), then, with `out`, all of them are written as one record {benchmark, environment, **fields,
    records}."""
    records: list[dict] = []

    def emit(record: dict) -> None:
        print(json.dumps(record, default=str), flush=True)
        records.append(record)

    run(emit)
    if out:
        write_json(Path(out), {"benchmark": benchmark, "environment": environment(), **fields, "records": records})
    return records
