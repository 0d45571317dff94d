"""Whether the user asked for the details behind one-line errors: `--debug` on the command line (the CLI sets the
variable for the command's duration) or DROPLESS_DEBUG=1."""

from __future__ import annotations

import os

DEBUG_ENV = "DROPLESS_DEBUG"


def debugging() -> bool:
    """DROPLESS_DEBUG is set to anything but "", "0", "false" or "no"."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
