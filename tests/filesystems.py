"""A real filesystem of limited size for the full-disk tests: a tmpfs, which needs root (skipped otherwise)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


def mounted_tmpfs(where: Path, size: str, instead: str):
    """Yield `where` with a tmpfs of `size` (e.g. "400k") mounted on it, unmounted afterwards; skip the test, naming
    what covers it `instead`, where mounting is not allowed."""
    where.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root); {instead}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
