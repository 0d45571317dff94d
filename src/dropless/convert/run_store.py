"""Stream weights into and out of a run directory's orbax checkpoint, one slab at a time.

orbax saves a whole pytree from memory, which a model larger than host memory cannot be. Its on-disk format is
simple, though: an OCDBT key-value store holding one zarr array per leaf, keyed by the leaf's dotted path
(`params.moe_layers.moe.experts.gate_up`), plus JSON metadata describing the tree. So the writer
  1. lets orbax save the model's exact tree with tiny placeholder leaves (`dropless.train.checkpoint.save_model`),
     which writes every metadata file as this orbax version wants it;
  2. replaces each leaf's zarr array with a full-size one (same codec) through tensorstore and writes it one
     slab at a time, chunked one slab per chunk, so no slab write reads anything back;
  3. fixes the recorded shapes in orbax's metadata, and renames the finished directory into place.
orbax then restores it like any checkpoint it wrote (tests/test_convert_run_store.py holds it to that). The
reader opens the same arrays and reads slab by slice, from converted and trained checkpoints alike.
"""

from __future__ import annotations

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


def _model_item_dir(run_dir: Path, step: int) -> Path:
    item = ckpt.checkpoint_dir(run_dir) / str(step) / "model"
    if not (item / "_METADATA").is_file():
        raise ckpt.CheckpointError(f"{item} is not an orbax checkpoint item (no _METADATA); pass a run directory "
                                   "written by 'dropless train' or 'dropless convert'.")
    return item


def _kvstore(item_dir: Path) -> dict:
    return {"driver": "ocdbt", "base": f"file://{item_dir}/"}


def _open_leaf(item_dir: Path, leaf: LeafPath, cache_bytes: int = 0) -> ts.TensorStore:
    key = ".".join(leaf)
    driver = "zarr3" if json.loads((item_dir / "_METADATA").read_text()).get("use_zarr3") else "zarr"
    spec = {"driver": driver, "kvstore": {**_kvstore(item_dir), "path": key + "/"},
            "context": {"cache_pool": {"total_bytes_limit": cache_bytes}}}
    try:
        return ts.open(spec, open=True, read=True, write=True).result()
    except ValueError as err:
        raise ckpt.CheckpointError(f"{item_dir} has no array for {key} ({str(err).splitlines()[0][:120]}); the "
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
        self.tmp_dir = self.run_dir.with_name(f".{self.run_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
        self.config, self.leaf_shapes = config, leaf_shapes
        self._arrays: dict[LeafPath, ts.TensorStore] = {}
        self._transaction, self._pending_bytes = ts.Transaction(), 0

    def __enter__(self) -> "RunWriter":
        tree: dict = {}
        for leaf, (shape, _) in self.leaf_shapes.items():
            node = tree
            for key in leaf[:-1]:
                node = node.setdefault(key, {})
            node[leaf[-1]] = jnp.zeros((1,) * len(shape), jnp.float32)
        # No digest: it would describe the placeholders, not the slabs written below.
        ckpt.save_model(self.tmp_dir, self.config, tree["params"], tree["state"], step=0, with_digest=False)
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
        return self

    def write(self, leaf: LeafPath, index: tuple[int, ...], slab: np.ndarray) -> None:
        array = self._arrays[leaf]
        want = tuple(array.shape[len(index):])
        assert slab.shape == want and slab.dtype == np.float32, f"{leaf}{list(index)}: {slab.shape} {slab.dtype} != {want}"
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

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._arrays.clear()
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            return
        self._commit()
        self._arrays.clear()
        self._fix_metadata()
        if self.run_dir.exists():
            self.run_dir.rmdir()  # empty (checked in __init__)
        self.tmp_dir.rename(self.run_dir)


class RunReader:
    """Read slabs of the model item of a run directory's checkpoint (latest step unless given)."""

    def __init__(self, run_dir: Path, step: int | None = None):
        step = ckpt.latest_step(run_dir) if step is None else step
        if step is None:
            raise ckpt.CheckpointError(f"{run_dir} has no finished checkpoint; train or import into it first.")
        self.step = step
        self.item_dir = _model_item_dir(Path(run_dir).resolve(), step)
        self._arrays: dict[LeafPath, ts.TensorStore] = {}

    def read(self, leaf: LeafPath, index: tuple[int, ...]) -> np.ndarray:
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
        return np.asarray((array[index] if index else array).read().result(), np.float32)


def model_leaf_shapes(config: Config) -> dict[LeafPath, tuple[int, ...]]:
    """Shapes of every leaf of {"params", "state"} for `config`, from the model's own init (nothing allocated)."""
    tree = jax.eval_shape(lambda: {"params": transformer.init_params(jax.random.key(0), config),
                                   "state": transformer.init_state(config)})
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        out[tuple(str(k.key) for k in path)] = tuple(leaf.shape)
    return out
