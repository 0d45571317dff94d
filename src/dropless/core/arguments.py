"""The command-line parser every `dropless` command uses: argparse, with its errors on one line."""

from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes (an unknown flag, a value of the wrong type) print one line naming the
    problem and where the help is, not argparse's usage block."""

    def error(self, message: str):
        self.exit(2, f"dropless: error: {message} (see '{self.prog} --help').\n")


def path_text(value: str) -> str:
    """An argparse `type` for options naming a file or directory: an empty value (an unset shell variable in
    `--run-dir "$RUN"`) is refused instead of meaning the current directory or the option's default."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or directory name")
    return value
