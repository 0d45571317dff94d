"""The command-line parser every `dropless` command uses: argparse, with its errors on one line; the checks of
counts and durations a command measures with; and the check of an output path that a command writes only after
minutes of work."""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
from pathlib import Path

from dropless.core.config import ConfigError
from dropless.core.debug import DEBUG_ENV
from dropless.core.files import file_in_the_way


DEBUG_FLAG = "--debug"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes (an unknown flag, a value of the wrong type) print one line naming the
    problem and where the help is, not argparse's usage block. Each command's parser lists `--debug`, which
    `dropless` reads wherever it stands (and takes out) before any parser sees the arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument(DEBUG_FLAG, action="store_true",
                          help="show the full traceback of an error (also: DROPLESS_DEBUG=1)")

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, and where --debug reached this parser (a module run as `python -m`, which no `dropless`
        took it out for) DROPLESS_DEBUG=1 for the rest of the process, as `dropless --debug` sets it."""
        parsed, rest = super().parse_known_args(args, namespace)
        if getattr(parsed, "debug", False):
            os.environ[DEBUG_ENV] = "1"
        return parsed, rest

    def error(self, message: str):
        self.exit(2, f"dropless: error: {message} (see '{self.prog} --help').\n")


def path_text(value: str) -> str:
    """An argparse `type` for options naming a file or directory: an empty value (an unset shell variable in
    `--run-dir "$RUN"`) is refused instead of meaning the current directory or the option's default, and so is a
    name that is not UTF-8 text, which the checkpoint writer (tensorstore) cannot take."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or directory name")
    utf8_text(value, "path")
    return value


def utf8_text(value: str, what: str) -> str:
    """`value`, or an ArgumentTypeError where it is not UTF-8 text: Python keeps the bytes of an argument that are
    not UTF-8 as lone surrogates, which no tokenizer or file writer takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        byte = value[error.start].encode("utf-8", "surrogateescape").hex()
        raise argparse.ArgumentTypeError(f"a {what} that is not UTF-8 text (byte 0x{byte}); give it in UTF-8") from None
    return value


def check_choices(flag: str, chosen: list[str], allowed) -> None:
    """A ConfigError naming `flag`, those of its comma-separated values `chosen` not in `allowed` (an empty one
    shown as ''), and the choices."""
    if bad := [x if x else repr(x) for x in chosen if x not in allowed]:
        raise ConfigError(f"{flag}: {', '.join(bad)} not known; choose from {', '.join(allowed)}.")


def check_count(flag: str, value: int, least: int = 1, why: str = "") -> None:
    """A ConfigError where the count `value`, given as `flag`, is below `least`: no steps or calls leave nothing to
    take a median of, and a negative count means nothing (a range of it is empty). `why` ends the sentence."""
    if value < least:
        raise ConfigError(f"{flag} {value} must be at least {least}{why}.")


def check_seconds(flag: str, value: float, *, above_zero: bool = False) -> None:
    """A ConfigError where `value`, given as `flag`, is not a finite number of seconds, 0 or more (above 0 with
    `above_zero`): nan passes float() and then fails every comparison, which quietly means a limit no one asked for."""
    if not (math.isfinite(value) and (value > 0 if above_zero else value >= 0)):
        raise ConfigError(f"{flag} {value} must be a number of seconds, {'above 0' if above_zero else '0 or more'}.")


# The files of a model directory (a dropless run, or a Hugging Face model: a folder holding config.json) that an
# output path must not name: a command's result written there would break the run or the model.
MODEL_FILES = ("config.json", "metrics.jsonl", "router.bin", "router.json", "training.png", "hf_source.json",
               "tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
               "*.safetensors", "*.safetensors.index.json")


def _same_file(a: Path, b: Path) -> bool:
    """`a` and `b` name one file: the same path once resolved, or two links to one existing file."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_output(flag: str, path: str | Path, *, directory: bool = False, kind: str = "JSON",
                 inputs: dict[str, str | Path | None] | None = None) -> Path:
    """`path`, given as `flag`, as a Path, or a ConfigError naming what stands in its way: a directory where the
    `kind` file goes, a file where the directory goes (with `directory`), a file in place of any folder above
    it, one of a model directory's own files (MODEL_FILES), or a file the same command reads (`inputs`: its flag
    -> the path given, or None), which the write would replace. A folder not made yet passes: the benchmarks'
    writers create theirs. Called before anything is compiled or timed, so that a mistyped path costs a second,
    not the measurement the write comes after."""
    path = Path(path)
    for name, given in (inputs or {}).items():
        if given is not None and not directory and _same_file(path, Path(given)):
            raise ConfigError(f"{flag} {path} is the {name} file; writing the {kind} there would replace the input, "
                              "so choose another path.")
    if not directory and path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give the path of the {kind} file to write.")
    if (not directory and (path.parent / "config.json").is_file()
            and any(fnmatch.fnmatch(path.name, pattern) for pattern in MODEL_FILES)):
        raise ConfigError(f"{flag} {path} names a file of the model directory {path.parent} (a run's or a Hugging "
                          f"Face model's), which writing the {kind} there would break; give another path.")
    if blocking := file_in_the_way(path if directory else path.parent):
        raise ConfigError(f"{flag} {path}: {blocking} is a file, not a directory; give a path "
                          + ("to a directory, new or existing." if directory else "inside a directory."))
    return path

