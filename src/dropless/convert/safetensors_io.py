"""Streaming safetensors: read one tensor at a time from sharded checkpoints, write sharded ones with an index.

The format is an 8-byte little-endian header length, a JSON header `{name: {dtype, shape, data_offsets}}`, then
the raw tensors back to back. We read each tensor with one `readinto` into a fresh NumPy buffer (no mmap), so a
process holds only the tensors it is working on, whatever the checkpoint's size; bfloat16 and float8 come from
`ml_dtypes`, which NumPy lacks. The writer plans each shard's header from the tensor list before writing, then
streams the tensors in order, so it too holds one tensor at a time.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from dropless.convert.hf_config import ConvertError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 2**20  # the limit the safetensors library enforces


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    path: Path
    start: int  # absolute byte offset of the data in `path`
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one .safetensors file (nothing but the header is read)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConvertError(f"{path} is not a safetensors file (shorter than 8 bytes); re-download it.")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER_BYTES:
            raise ConvertError(f"{path} is not a safetensors file (header length {length}); re-download it.")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConvertError(f"{path} has a corrupt safetensors header; re-download it.") from None
    if not isinstance(header, dict):
        raise ConvertError(f"{path} has a corrupt safetensors header; re-download it.")
    header.pop("__metadata__", None)
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, (begin, end), shape = entry["dtype"], entry["data_offsets"], tuple(entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{path} has a corrupt safetensors header (entry {name}); re-download it.") from None
        if not all(_is_count(n) for n in (begin, end, *shape)) or end < begin or not isinstance(dtype, str):
            raise ConvertError(f"{path} has a corrupt safetensors header (entry {name} has offsets {[begin, end]}, "
                               f"shape {list(shape)}: not counts); re-download it.")
        if dtype not in DTYPES:
            raise ConvertError(f"Tensor {name} in {path} has dtype {dtype}, which dropless cannot read; "
                               f"the readable dtypes are {', '.join(DTYPES)}.")
        tensors[name] = TensorInfo(name, dtype, shape, Path(path), 8 + length + begin, end - begin)
    return tensors


def _is_count(value) -> bool:
    """A non-negative JSON integer (what offsets and dimensions must be; bool is an int in Python)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class CheckpointReader:
    """All tensors of an HF checkpoint directory (one file, or shards with `model.safetensors.index.json`)."""

    def __init__(self, hf_dir: Path):
        hf_dir = Path(hf_dir)
        index = hf_dir / INDEX_NAME
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
                if not all(isinstance(name, str) for name in files):
                    raise TypeError("a shard name that is not a string")
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
                raise ConvertError(f"{index} is not a valid safetensors index (JSON with a 'weight_map' object); "
                                   "re-download it.") from None
            missing = [f for f in files if not (hf_dir / f).is_file()]
            if missing:
                raise ConvertError(f"{hf_dir} lacks shard(s) {', '.join(missing[:3])} named in {INDEX_NAME}; "
                                   "download the complete checkpoint.")
            paths = [hf_dir / f for f in files]
        else:
            paths = sorted(hf_dir.glob("*.safetensors"))
        if not paths:
            raise ConvertError(f"{hf_dir} has no *.safetensors files; dropless reads safetensors checkpoints only "
                               "(convert .bin files with transformers' save_pretrained first).")
        self.tensors: dict[str, TensorInfo] = {}
        for path in paths:
            self.tensors.update(read_header(path))
        self._files: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str) -> np.ndarray:
        """One tensor, freshly allocated (owned by the caller)."""
        info = self.tensors[name]
        f = self._files.get(info.path)
        if f is None:
            f = self._files[info.path] = open(info.path, "rb")
        out = np.empty(info.shape, DTYPES[info.dtype])
        if out.nbytes != info.nbytes:
            raise ConvertError(f"{info.path} is corrupt: tensor {name} has {info.nbytes} bytes for shape "
                               f"{list(info.shape)} {info.dtype}; re-download it.")
        f.seek(info.start)
        # Viewed as bytes: bfloat16/float8 arrays do not export the buffer protocol themselves.
        if f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != info.nbytes:
            raise ConvertError(f"{info.path} is truncated (tensor {name} is cut short); re-download it.")
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _header_bytes(entries: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    return struct.pack("<Q", len(raw)) + raw


def write_sharded(out_dir: Path, plan: list[tuple[str, str, tuple[int, ...]]],
                  tensors: Iterable[tuple[str, np.ndarray]], max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write `tensors` (yielded in `plan` order: (name, dtype name, shape)) as safetensors shards.

    One file is named `model.safetensors`; several are `model-0000i-of-0000n.safetensors` plus the index.
    Each yielded array must match its plan entry exactly.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sized = [(name, dtype, tuple(shape), int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize)
             for name, dtype, shape in plan]
    shards: list[list] = [[]]
    for entry in sized:
        if shards[-1] and sum(e[3] for e in shards[-1]) + entry[3] > max_shard_bytes:
            shards.append([])
        shards[-1].append(entry)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    iterator: Iterator[tuple[str, np.ndarray]] = iter(tensors)
    for file_name, entries in zip(names, shards):
        tmp = out_dir / (file_name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_header_bytes(entries))
            for name, dtype, shape, nbytes in entries:
                got_name, array = next(iterator)
                assert got_name == name and array.shape == shape and DTYPE_NAMES[array.dtype] == dtype, \
                    f"tensor stream out of plan: got {got_name} {array.shape} {array.dtype}, planned {name} {shape} {dtype}"
                f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))  # no copy
        os.replace(tmp, out_dir / file_name)
    assert next(iterator, None) is None, "tensor stream longer than the plan"
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e[3] for e in sized)},
                 "weight_map": {e[0]: file_name for file_name, entries in zip(names, shards) for e in entries}}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return [out_dir / n for n in names]
