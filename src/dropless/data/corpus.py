"""Where the training text comes from: the standard-library corpus, or files named by `data.source`.

A corpus is a list of files of one kind: text (`.txt`, `.jsonl`, `.parquet`, read into documents) or
pre-tokenized token arrays (`.npy`, `.bin`, read as integer streams). Every user mistake raises
`DataError` with one sentence; a file that is not valid UTF-8 is skipped with a `DataWarning`.

`.bin` convention: raw little-endian uint16 tokens (nanoGPT's `train.bin`), or llm.c's format, recognised by
its 1024-byte header (magic 20240520; version 1 = uint16 tokens, version 2 = uint32 tokens).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

STDLIB = "stdlib"
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
TOKEN_SUFFIXES = (".npy", ".bin")
SUFFIXES = TEXT_SUFFIXES + TOKEN_SUFFIXES
# Directories of the standard library that are not library source: test suites and installed packages.
STDLIB_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
NPY_MAGIC = b"\x93NUMPY"
LLMC_MAGIC = 20240520
LLMC_HEADER_INT32S = 256
LLMC_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}


class DataError(ValueError):
    """A user-facing data mistake; the message is one sentence naming the problem and the fix."""


class DataWarning(UserWarning):
    """A recoverable data problem (e.g. a file skipped because it is not UTF-8)."""


@dataclass(frozen=True)
class Corpus:
    """The resolved files of a corpus. `max_bytes` caps the text read (the stdlib corpus only)."""

    name: str  # for messages: "the standard-library corpus (...)" or "data.source 'x'"
    kind: Literal["text", "tokens"]
    files: tuple[Path, ...]
    max_bytes: int | None = None

    def fingerprint(self) -> str:
        """A hash of the file list, sizes and modification times: equal fingerprints mean equal contents."""
        h = hashlib.sha256(f"{self.kind}:{self.max_bytes}".encode())
        for path in self.files:
            stat = path.stat()
            h.update(f"\n{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        return h.hexdigest()


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's own `.py` files, sorted by relative path, without test suites or site-packages."""
    root = stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIPPED_DIRS and not d.startswith(".")]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def resolve(source: str, max_bytes: int, key: str = "data.source") -> Corpus:
    """Turn `data.source` ("stdlib", a file, a directory or a glob) into a `Corpus`, or raise DataError; `key`
    names the setting it came from in its name and messages."""
    if source == STDLIB:
        files = stdlib_files()
        if not files:
            raise DataError(f"No Python source files were found in the standard library at {stdlib_dir()}; "
                            "give a corpus with --data PATH.")
        return Corpus(f"the standard-library corpus ({stdlib_dir()})", "text", tuple(files), max_bytes)
    name = f"{key} '{source}'"
    expanded = os.path.expanduser(source)
    if glob.has_magic(expanded):
        matches = sorted(glob.glob(expanded, recursive=True))
        if not matches:
            raise DataError(f"{name} is a glob that matches no files; check the pattern (quote it so the shell "
                            "does not expand it).")
        files = []
        for match in map(Path, matches):
            files.extend(_files_in_dir(match, name) if match.is_dir() else [_checked_file(match)])
    else:
        path = Path(expanded)
        if not path.exists():
            raise DataError(f"{name} does not exist; give an existing file, directory or glob, or 'stdlib'.")
        files = _files_in_dir(path, name) if path.is_dir() else [_checked_file(path)]
    kinds = {"tokens" if f.suffix.lower() in TOKEN_SUFFIXES else "text" for f in files}
    if len(kinds) > 1:
        raise DataError(f"{name} mixes text files ({', '.join(TEXT_SUFFIXES)}) with token arrays "
                        f"({', '.join(TOKEN_SUFFIXES)}); point it at one kind only.")
    return Corpus(name, kinds.pop(), tuple(files))


def _checked_file(path: Path) -> Path:
    if path.exists() and not path.is_file():  # a pipe or a device: reading it may never end, and it is read twice
        raise DataError(f"{path} is not a regular file (a pipe or a device); save the data into a file and give "
                        "its path.")
    if path.suffix.lower() not in SUFFIXES:
        raise DataError(f"{path} has an unsupported extension '{path.suffix}'; data files must be "
                        f"{', '.join(SUFFIXES)}.")
    return path


def _files_in_dir(directory: Path, name: str) -> list[Path]:
    """Every supported file under `directory`, recursively, sorted; other files are ignored."""
    files = sorted(p for p in directory.rglob("*")
                   if p.is_file() and p.suffix.lower() in SUFFIXES and not p.name.startswith("."))
    if not files:
        raise DataError(f"{name}: the directory {directory} holds no {', '.join(SUFFIXES)} files; "
                        "point data.source at one that does.")
    return files


# ---------------------------------------------------------------------------------------------- text


def iter_documents(corpus: Corpus) -> Iterator[str]:
    """The text documents of a text corpus, in file order: one per `.py`/`.txt` file, `.jsonl` line or
    `.parquet` row. Empty documents are dropped. The stdlib corpus stops at `max_bytes` UTF-8 bytes."""
    assert corpus.kind == "text"
    budget = corpus.max_bytes
    for path in corpus.files:
        for text in _read_text_file(path):
            if not text:
                continue
            if budget is not None:
                size = len(text.encode("utf-8"))
                if size > budget:
                    # Cut the last document to fill the cap exactly (dropping a split trailing character).
                    text = text.encode("utf-8")[:budget].decode("utf-8", errors="ignore")
                    size = budget
                budget -= size
            if text:
                yield text
            if budget == 0:
                return


def _read_text_file(path: Path) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _read_parquet(path)
        return
    text = _decode(path)
    if text is None:
        return
    if suffix == ".jsonl":
        yield from _parse_jsonl(path, text)
    else:
        yield text


def _decode(path: Path) -> str | None:
    """The file's text, or None (with a warning) when it is not valid UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        warnings.warn(f"Skipping {path}: it is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                      "convert it to UTF-8 to include it.", DataWarning, stacklevel=4)
        return None


def _parse_jsonl(path: Path, text: str) -> Iterator[str]:
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"Line {line_number} of {path} is not valid JSON ({e.msg}); each line must be an "
                            "object like {\"text\": \"...\"}.") from None
        if not isinstance(record, dict) or "text" not in record:
            raise DataError(f"Line {line_number} of {path} has no 'text' field; each line must be an object "
                            "like {\"text\": \"...\"}.")
        if not isinstance(record["text"], str):
            raise DataError(f"Line {line_number} of {path} has a 'text' field of type "
                            f"{type(record['text']).__name__}; it must be a string.")
        yield record["text"]


def _read_parquet(path: Path) -> Iterator[str]:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable Parquet file ({e}); check the file.") from None
    columns = parquet.schema_arrow.names
    if "text" not in columns:
        raise DataError(f"{path} has no 'text' column (its columns are {', '.join(columns) or 'none'}); "
                        "rename the column that holds the documents to 'text'.")
    column_type = parquet.schema_arrow.field("text").type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"The 'text' column of {path} has type {column_type}; it must hold strings.")
    for batch in parquet.iter_batches(columns=["text"]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


# -------------------------------------------------------------------------------------------- tokens


def read_token_file(path: Path) -> np.ndarray:
    """A pre-tokenized file as a flat integer array (memory-mapped, not copied)."""
    if path.suffix.lower() == ".npy":
        return load_token_array(path).reshape(-1)
    return _read_bin(path)


def load_token_array(path: Path, what: str = "") -> np.ndarray:
    """An integer `.npy` array, memory-mapped; a file numpy cannot read as one raises DataError naming it.

    `what` names where the path came from in messages (e.g. "--tokens ").
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{what}{path} is a directory; give an .npy file saved with numpy.save.")
    if path.exists() and not path.is_file():  # a pipe or a device: numpy would block on it or misread it
        raise DataError(f"{what}{path} is not a regular file (a pipe or a device); save the token ids into an "
                        ".npy file with numpy.save.")
    with open(path, "rb") as f:
        magic = f.read(len(NPY_MAGIC))
    if not magic:
        raise DataError(f"{what}{path} is empty; save the token ids into it with numpy.save.")
    if magic != NPY_MAGIC:  # numpy would take it for a pickle and talk of allow_pickle
        raise DataError(f"{what}{path} is not an .npy file (it lacks numpy's header); save the token ids with "
                        "numpy.save.")
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        if isinstance(e, (FileNotFoundError, PermissionError)):
            raise
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{what}{path} is not a readable .npy array ({reason}); save it with numpy.save.") from e
    if not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"{what}{path} holds {tokens.dtype} values; token arrays must hold integers.")
    return tokens


def _read_bin(path: Path) -> np.ndarray:
    size = path.stat().st_size
    header_bytes = LLMC_HEADER_INT32S * 4
    if size >= header_bytes:
        header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INT32S)
        version, count = int(header[1]), int(header[2])
        if header[0] == LLMC_MAGIC and version not in LLMC_DTYPES:
            raise DataError(f"{path} has an llm.c header of version {version}, which dropless does not read; write it "
                            "as version 1 (uint16 ids) or 2 (uint32 ids), or save the ids as .npy.")
        if header[0] == LLMC_MAGIC:
            dtype = LLMC_DTYPES[version]
            if size != header_bytes + count * dtype.itemsize:
                raise DataError(f"{path} has an llm.c header announcing {count} tokens but holds "
                                f"{(size - header_bytes) // dtype.itemsize}; the file is truncated or corrupt.")
            return np.memmap(path, dtype=dtype, mode="r", offset=header_bytes, shape=(count,))
    if size % 2:
        raise DataError(f"{path} has an odd number of bytes ({size}), so it is not a raw uint16 token file; "
                        "write .bin files as little-endian uint16, or use .npy for other dtypes.")
    if size == 0:
        return np.zeros(0, np.dtype("<u2"))
    return np.memmap(path, dtype="<u2", mode="r")
