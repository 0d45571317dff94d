"""Stream weights into and out of a run directory's orbax checkpoint, one slab at a time.

orbax saves a whole pytree from memory, which a model larger than host memory cannot be. Its on-disk format is
simple, though: an OCDBT key-value store holding one zarr array per leaf, keyed by the leaf's dotted path
(`params.moe_layers.moe.experts.gate_up`), plus JSON metadata describing the tree. So the writer
  1. lets orbax save the model's exact tree with tiny placeholder leaves (`dropless.train.checkpoint.save_model`),
     which writes every metadata file as this orbax version wants it;
  2. replaces each leaf's zarr array with a full-size one (same codec) through tensorstore and writes it one
     slab at a time, chunked one slab per chunk, so no slab write reads anything back;
  3. fixes the recorded shapes in orbax's metadata, replaces the placeholders' digest by the digest of the slabs
     written, and renames the finished directory into place.
orbax then restores it like any checkpoint it wrote, verified against that digest (tests/test_convert_run_store.py
holds it to that). The reader opens the same arrays and reads slab by slab, from converted and trained checkpoints
alike, and verifies what it reads against the checkpoint's digest as `dropless.train.checkpoint.restore` does.

The digest of a leaf (two sums of its elements' bit patterns modulo 2**32, the second weighted by 1 + the flat
position) adds up over slabs: a slab starting at flat position `offset` adds `offset * sum + weighted sum`. So both
the writer and the reader fold each slab as it passes, and a slab never written (zeros) adds nothing.
"""

from __future__ import annotations

import errno
import json
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from dropless.core.config import Config
from dropless.models import transformer
from dropless.train import checkpoint as ckpt

LeafPath = tuple[str, ...]
_CHUNK_BYTES = 64 * 2**20  # unstacked leaves (the embedding) are split into chunks of at most this size
# Slab writes are grouped into transactions of about this many bytes: committing each slab on its own costs
# a commit and a file in the store per slab (31k expert slabs in DeepSeek-V3); a transaction holds its data until commit.
_COMMIT_BYTES = 64 * 2**20
_FOLD_WORDS = 1 << 18  # a slab is folded this many words at a time, so folding adds 1 MiB to host memory


def temporary_sibling(path: Path) -> Path:
    """A new directory of a fresh hidden name next to `path` (resolved, so that `.` has a name) to build an output
    in, then rename. An OS error making it (an unwritable or missing parent) names `path`, the output the user
    gave, not the hidden name."""
    path = Path(path).resolve()
    if not path.name:
        raise ckpt.CheckpointError(f"{path} cannot be an output directory (it has no parent to build it in); "
                                   "choose a directory below it.")
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir(parents=True)
    except OSError as err:
        raise type(err)(err.errno, err.strerror, str(path)) from err
    return tmp


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`, which may exist only as an empty directory; raises CheckpointError when
    another process filled `out` meanwhile (the caller removes `tmp`)."""
    out = Path(out).resolve()
    try:
        if out.is_dir():
            out.rmdir()
        tmp.rename(out)
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
        raise ckpt.CheckpointError(f"{out} appeared while converting (another process wrote it); nothing was "
                                   "written there: choose a new output directory, or delete it and convert again.") \
            from None


def fold(slab: np.ndarray, offset: int) -> tuple[int, int]:
    """The digest of `slab`'s words as part of a leaf in which it starts at flat element `offset` (the words and
    their order of `dropless.train.checkpoint.digest`: 8-byte elements count as two little-endian words)."""
    slab = np.ascontiguousarray(slab)
    if slab.dtype == np.bool_:
        slab = slab.view(np.uint8)
    if slab.dtype.itemsize == 8:
        words, offset = slab.reshape(-1).view(np.uint32), 2 * offset
    else:
        words = slab.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[slab.dtype.itemsize])
    total = weighted = 0
    for start in range(0, words.size, _FOLD_WORDS):
        chunk = words[start:start + _FOLD_WORDS].astype(np.uint32, copy=False)
        # uint32 arithmetic wraps modulo 2**32, as the digest's sums do; one temporary of the chunk's size
        position = np.arange(chunk.size, dtype=np.uint32) + np.uint32((offset + start + 1) & 0xFFFFFFFF)
        np.multiply(position, chunk, out=position)
        total += int(chunk.sum(dtype=np.uint32))
        weighted += int(position.sum(dtype=np.uint32))
    return total & 0xFFFFFFFF, weighted & 0xFFFFFFFF


def _flat_offset(shape: tuple[int, ...], index: tuple[int, ...]) -> int:
    """The flat element offset of the slab `index` (leading indices) of a leaf of `shape`."""
    if not index:
        return 0
    slab_size = int(np.prod(shape[len(index):], dtype=np.int64))
    return int(np.ravel_multi_index(index, shape[:len(index)])) * slab_size


def digest_key(leaf: LeafPath) -> str:
    """The leaf's key in the checkpoint's digest item (the model item's tree path)."""
    return "/".join(("model", *leaf))


def _digest_path(run_dir: Path, step: int) -> Path:
    return ckpt.checkpoint_dir(run_dir) / str(step) / "digest" / "metadata"  # where orbax's JsonSave writes


def _model_item_dir(run_dir: Path, step: int) -> Path:
    """The model item of a finished checkpoint. One without its _METADATA (or without the item) is damaged, so
    that a reader falls back to an older checkpoint, as orbax's restore does for `generate` and `--resume`."""
    item = ckpt.checkpoint_dir(run_dir) / str(step) / "model"
    if not (item / "_METADATA").is_file():
        what = (ckpt.step_is_a_file(run_dir, step) or
                ("its model item has no _METADATA" if item.is_dir() else "it has no model item"))
        raise ckpt.DamagedCheckpoint(f"checkpoint {step} in {ckpt.checkpoint_dir(run_dir)} cannot be read ({what})")
    return item


def _kvstore(item_dir: Path) -> dict:
    return {"driver": "ocdbt", "base": f"file://{item_dir}/"}


def _open_leaf(item_dir: Path, leaf: LeafPath, cache_bytes: int = 0) -> ts.TensorStore:
    """The leaf's array in a checkpoint item. A leaf that orbax's tree metadata lists but that cannot be opened
    (a damaged index or manifest) is a DamagedCheckpoint, so that a reader can fall back to an older checkpoint;
    one it does not list means the checkpoint belongs to another config."""
    key = ".".join(leaf)
    where = f"checkpoint {item_dir.parent.name} in {item_dir.parent.parent}"
    try:
        metadata = json.loads((item_dir / "_METADATA").read_text())
        listed = str(tuple(leaf)) in metadata.get("tree_metadata", {})
    except (ValueError, AttributeError, OSError) as err:  # torn, garbled or of another shape; gone since opened
        raise ckpt.DamagedCheckpoint(f"{where} cannot be read (its _METADATA: {ckpt.first_line(err)})") from None
    driver = "zarr3" if metadata.get("use_zarr3") else "zarr"
    spec = {"driver": driver, "kvstore": {**_kvstore(item_dir), "path": key + "/"},
            "context": {"cache_pool": {"total_bytes_limit": cache_bytes}}}
    try:
        return ts.open(spec, open=True, read=True, write=True).result()
    except ValueError as err:
        if listed:
            raise ckpt.DamagedCheckpoint(f"{where} cannot be read ({key}: {ckpt.first_line(err)[:120]})") from None
        raise ckpt.CheckpointError(f"{item_dir} has no array for {key} ({ckpt.first_line(err)[:120]}); the "
                                   "checkpoint does not match the run's config.json.") from None


def _chunk_shape(shape: tuple[int, ...], depth: int, itemsize: int) -> list[int]:
    """One slab per chunk for stacked leaves; bounded row blocks for unstacked ones."""
    chunk = [1] * depth + list(shape[depth:])
    if depth == 0 and shape:
        row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
        chunk[0] = max(1, min(shape[0], _CHUNK_BYTES // row_bytes))
    return chunk


class RunWriter:
    """Write `config.json` and checkpoint step 0 of a new run directory, leaf slab by leaf slab.

    `leaf_shapes` maps each leaf path to (shape, depth): depth = number of leading indices its slabs use.
    Use as a context manager; the run directory appears only when every slab was written without error.
    """

    def __init__(self, run_dir: Path, config: Config, leaf_shapes: dict[LeafPath, tuple[tuple[int, ...], int]]):
        self.run_dir = Path(run_dir)
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise ckpt.CheckpointError(f"{self.run_dir} already exists and is not empty; choose a new run directory.")
        self.tmp_dir = temporary_sibling(self.run_dir)
        self.config, self.leaf_shapes = config, leaf_shapes
        self._arrays: dict[LeafPath, ts.TensorStore] = {}
        self._transaction, self._pending_bytes = ts.Transaction(), 0
        self._folds = {leaf: [0, 0] for leaf in leaf_shapes}

    def __enter__(self) -> "RunWriter":
        try:
            self._start()
        except BaseException:
            self._discard()
            raise
        return self

    def _start(self) -> None:
        tree: dict = {}
        for leaf, (shape, _) in self.leaf_shapes.items():
            node = tree
            for key in leaf[:-1]:
                node = node.setdefault(key, {})
            node[leaf[-1]] = jnp.zeros((1,) * len(shape), jnp.float32)
        # orbax writes the digest item too; `_write_digest` replaces the placeholders' digest by the slabs'.
        ckpt.save_model(self.tmp_dir, self.config, tree["params"], tree["state"], step=0)
        self.item_dir = _model_item_dir(self.tmp_dir, 0)
        for leaf, (shape, depth) in self.leaf_shapes.items():
            placeholder = _open_leaf(self.item_dir, leaf)
            spec = placeholder.spec().to_json()
            spec.pop("transform", None)  # the placeholder's index domain
            chunk = _chunk_shape(shape, depth, 4)
            meta = spec["metadata"]
            meta["shape"] = list(shape)
            if "chunks" in meta:  # zarr v2
                meta["chunks"] = chunk
            else:  # zarr v3
                meta["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": chunk}}
            self._arrays[leaf] = ts.open(spec, create=True, delete_existing=True).result()

    def write(self, leaf: LeafPath, index: tuple[int, ...], slab: np.ndarray) -> None:
        array = self._arrays[leaf]
        want = tuple(array.shape[len(index):])
        assert slab.shape == want and slab.dtype == np.float32, f"{leaf}{list(index)}: {slab.shape} {slab.dtype} != {want}"
        total, weighted = fold(slab, _flat_offset(tuple(array.shape), index))
        folds = self._folds[leaf]
        folds[0], folds[1] = (folds[0] + total) & 0xFFFFFFFF, (folds[1] + weighted) & 0xFFFFFFFF
        if index or slab.nbytes <= _COMMIT_BYTES:
            self._write(array, index, slab)
            return
        # A large unstacked leaf (the embedding) goes chunk-row by chunk-row, each in its own commit, so the
        # store never buffers more than one commit's worth of encoded data.
        self._commit()
        rows = array.chunk_layout.write_chunk.shape[0]
        for start in range(0, slab.shape[0], rows):
            stop = min(start + rows, slab.shape[0])  # tensorstore does not clip slices to the domain
            self._write(array[start:stop], (), slab[start:stop])
            self._commit()

    def _write(self, array: ts.TensorStore, index: tuple[int, ...], slab: np.ndarray) -> None:
        target = array.with_transaction(self._transaction)
        # The slab is never modified afterwards, so tensorstore may keep a reference instead of a copy.
        (target[index] if index else target).write(slab, can_reference_source_data_indefinitely=True).result()
        self._pending_bytes += slab.nbytes
        if self._pending_bytes >= _COMMIT_BYTES:
            self._commit()

    def _commit(self) -> None:
        self._transaction.commit_async().result()
        self._transaction, self._pending_bytes = ts.Transaction(), 0

    def _fix_metadata(self) -> None:
        """Record the real shapes where orbax noted the placeholders' (its metadata API reports them)."""
        shapes = {".".join(leaf): list(shape) for leaf, (shape, _) in self.leaf_shapes.items()}
        chunks = {".".join(leaf): _chunk_shape(shape, depth, 4) for leaf, (shape, depth) in self.leaf_shapes.items()}
        meta_path = self.item_dir / "_METADATA"
        meta = json.loads(meta_path.read_text())
        for entry in meta.get("tree_metadata", {}).values():
            key = ".".join(k["key"] for k in entry.get("key_metadata", []))
            if key in shapes and "write_shape" in entry.get("value_metadata", {}):
                entry["value_metadata"]["write_shape"] = shapes[key]
        meta_path.write_text(json.dumps(meta))
        for path in (self.item_dir / "array_metadatas").glob("process_*"):
            arrays = json.loads(path.read_text())
            for entry in arrays.get("array_metadatas", []):
                info = entry.get("array_metadata", {})
                if info.get("param_name") in shapes:
                    info["write_shape"], info["chunk_shape"] = shapes[info["param_name"]], chunks[info["param_name"]]
            path.write_text(json.dumps(arrays))

    def _write_digest(self) -> None:
        """The digest of the slabs written, in the file where orbax wrote the placeholders' one."""
        path = _digest_path(self.tmp_dir, 0)
        assert path.is_file(), f"orbax wrote no digest at {path}"
        leaves = {digest_key(leaf): folds for leaf, folds in self._folds.items()}
        path.write_text(json.dumps({"version": 1, "leaves": leaves}))

    def _discard(self) -> None:
        self._arrays.clear()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._discard()
            return
        try:
            self._commit()
            self._arrays.clear()
            self._fix_metadata()
            self._write_digest()
            move_into_place(self.tmp_dir, self.run_dir)  # run_dir is absent or empty (checked in __init__)
        finally:
            self._discard()  # nothing left once renamed


class RunReader:
    """Read slabs of the model item of a run directory's checkpoint (latest step unless given), verified.

    `layout` maps each leaf to (shape, depth) as for RunWriter. Each slab read is folded into its leaf's digest;
    once every slab of a leaf has been read, the leaf is compared with the checkpoint's digest (if it has one),
    and `verify` reads and compares the rest. A file that cannot be read or a mismatch raises DamagedCheckpoint.
    """

    def __init__(self, run_dir: Path, step: int | None = None,
                 layout: dict[LeafPath, tuple[tuple[int, ...], int]] | None = None):
        step = ckpt.latest_step(run_dir) if step is None else step
        if step is None:
            raise ckpt.CheckpointError(f"{run_dir} has no finished checkpoint; train or import into it first.")
        self.step, self.layout = step, layout or {}
        self.where = f"checkpoint {step} in {ckpt.checkpoint_dir(run_dir)}"
        self.item_dir = _model_item_dir(Path(run_dir).resolve(), step)
        self.digest = self._saved_digest(Path(run_dir))
        self._arrays: dict[LeafPath, ts.TensorStore] = {}
        self._folded: dict[LeafPath, dict[tuple[int, ...], tuple[int, int]]] = {}

    def _saved_digest(self, run_dir: Path) -> dict | None:
        """The digest's leaves, or None for a checkpoint without one (it reads unverified, as orbax restores it)."""
        path = _digest_path(run_dir, self.step)
        if not path.parent.is_dir():
            return None
        try:
            leaves = json.loads(path.read_text()).get("leaves")
        except (OSError, ValueError, AttributeError):
            leaves = None
        if not isinstance(leaves, dict):
            raise ckpt.DamagedCheckpoint(f"{self.where} has an unreadable digest")
        return leaves

    def _open(self, leaf: LeafPath, index: tuple[int, ...]) -> ts.TensorStore:
        array = self._arrays.get(leaf)
        if array is None:
            # A trained checkpoint may hold several slabs per chunk (orbax chunks by shard): cache one chunk
            # then, so reading its slabs in order decodes it once. Converted runs have one slab per chunk.
            probe = _open_leaf(self.item_dir, leaf)
            chunk = probe.chunk_layout.read_chunk.shape
            slabs_per_chunk = int(np.prod(chunk[:len(index)], dtype=np.int64))
            chunk_bytes = int(np.prod(chunk, dtype=np.int64)) * probe.dtype.numpy_dtype.itemsize
            cache = chunk_bytes + chunk_bytes // 4 if slabs_per_chunk > 1 else 0
            array = self._arrays[leaf] = _open_leaf(self.item_dir, leaf, cache)
        return array

    def read(self, leaf: LeafPath, index: tuple[int, ...]) -> np.ndarray:
        array = self._open(leaf, index)
        try:
            raw = np.asarray((array[index] if index else array).read().result())
        except Exception as err:  # tensorstore raises several kinds on a truncated, emptied or deleted file
            raise ckpt.DamagedCheckpoint(f"{self.where} cannot be read ({ckpt.first_line(err)})") from None
        shape, depth = self.layout.get(leaf, ((), -1))
        if self.digest is not None and depth == len(index):  # `verify` reads a slab read otherwise
            folded = self._folded.setdefault(leaf, {})
            if index not in folded:
                folded[index] = fold(raw, _flat_offset(tuple(array.shape), index))
                if len(folded) == int(np.prod(shape[:depth], dtype=np.int64)):
                    self._compare(leaf)
        return np.asarray(raw, np.float32)

    def _compare(self, leaf: LeafPath) -> None:
        folds = self._folded[leaf].values()
        got = [sum(f[0] for f in folds) & 0xFFFFFFFF, sum(f[1] for f in folds) & 0xFFFFFFFF]
        if self.digest.get(digest_key(leaf)) != got:
            raise ckpt.DamagedCheckpoint(f"{self.where} is damaged (digest mismatch in {digest_key(leaf)})")

    def verify(self) -> None:
        """Read the slabs of the layout's leaves not read yet and compare every leaf with the digest."""
        if self.digest is None:
            return
        for leaf, (shape, depth) in self.layout.items():
            if not np.prod(shape, dtype=np.int64):
                continue  # no elements (a model without MoE layers: router state of 0 rows): never saved
            folded = self._folded.get(leaf, {})
            if len(folded) == int(np.prod(shape[:depth], dtype=np.int64)):
                continue  # compared when its last slab was read
            for index in np.ndindex(*shape[:depth]):
                if index not in folded:
                    self.read(leaf, index)  # the last one compares the leaf


def model_leaf_shapes(config: Config) -> dict[LeafPath, tuple[int, ...]]:
    """Shapes of every leaf of {"params", "state"} for `config`, from the model's own init (nothing allocated)."""
    tree = jax.eval_shape(lambda: {"params": transformer.init_params(jax.random.key(0), config),
                                   "state": transformer.init_state(config)})
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        out[tuple(str(k.key) for k in path)] = tuple(leaf.shape)
    return out
