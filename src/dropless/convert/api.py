"""The conversion entry points behind `dropless convert`, `train --init-from-hf`, `generate --hf-dir` and `logits`.

A run directory imported from Hugging Face also keeps `hf_source.json` (the original config.json and the dtype
of each kind of tensor) and `hf_files/` (tokenizer and generation files), so that exporting it again restores
the same token ids, files and dtypes: HF -> dropless -> HF gives byte-identical tensors.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dropless.core import config as config_lib
from dropless.core.config import Config
from dropless.convert import run_store
from dropless.convert.hf_config import ConvertError, ConvertWarning, config_from_hf, config_to_hf
from dropless.convert.hf_weights import (FP8_DTYPES, Slab, check_checkpoint, check_coverage, fp8_block_size,
                                         hf_shapes, name_pattern, plan, read_hf_tensor, to_hf, to_ours)
from dropless.convert.run_store import LeafPath, RunReader, RunWriter, model_leaf_shapes
from dropless.convert.safetensors_io import DTYPES, CheckpointReader, write_sharded
from dropless.models import transformer
from dropless.moe.router import fold_common
from dropless.train import checkpoint as ckpt

HF_SOURCE = "hf_source.json"
HF_FILES = "hf_files"
# Small non-weight files worth carrying between an HF directory and a run directory.
CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
EXPORT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_TORCH_NAMES = {code: name for name, code in EXPORT_DTYPES.items()}
# What hf_source.json may record for a weight: an import records the float dtype it read (FP8 as BF16).
WEIGHT_DTYPES = ("F32", "BF16", "F16", "F64")


def read_hf_config(hf_dir: Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        what = ("does not exist" if not Path(hf_dir).exists() else
                "is a file, not a directory" if not Path(hf_dir).is_dir() else "has no config.json")
        raise ConvertError(f"{hf_dir} {what}; pass a Hugging Face model directory (the one holding config.json and "
                           "*.safetensors).")
    hf = _read_json(path, "re-download it")
    if not isinstance(hf, dict):
        raise ConvertError(f"{path} holds a JSON {type(hf).__name__}, not an object; re-download it.")
    if _dropless_config(hf):
        raise ConvertError(f"{hf_dir} looks like a dropless run directory (its config.json is dropless's own), not a "
                           f"Hugging Face model; pass it with --run-dir (generate, logits), or export it first: "
                           f"dropless convert --from {hf_dir} --to-hf HF_DIR.")
    return hf


def _dropless_config(fields: dict) -> bool:
    """Whether a config.json reads as a dropless run's (every group of Config, none of HF's identifying fields)."""
    groups = {field.name for field in dataclasses.fields(Config)}
    return groups <= fields.keys() and not fields.keys() & {"model_type", "architectures"}


def _read_json(path: Path, fix: str):
    """A JSON file we read from the user's directories; a damaged one raises ConvertError naming it and `fix`."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConvertError(f"{path} is not valid JSON (line {err.lineno}: {err.msg.lower()}); {fix}.") from err
    except UnicodeDecodeError:
        raise ConvertError(f"{path} is not a UTF-8 text file; {fix}.") from None


def hf_model_config(hf_dir: Path, base: Config | None = None) -> Config:
    """The Config of an HF directory. A config.json announcing MTP layers (num_nextn_predict_layers) whose
    weights hold none, as many re-published DeepSeek-V3 checkpoints, gives a model without MTP."""
    config = config_from_hf(read_hf_config(hf_dir), base)
    m = config.model
    if m.mtp_layers:
        with CheckpointReader(hf_dir) as reader:
            if f"model.layers.{m.num_layers}.eh_proj.weight" not in reader:
                # mtp_block as config_from_hf gives it without MTP layers, so that the export reads back equal
                config = config.replace(**{"model.mtp_layers": 0, "model.mtp_block": "moe"})
    return config


def _check_duplicate(reader: CheckpointReader, slab: Slab, tensor: np.ndarray, block) -> None:
    """An MTP module's copy of the embedding or output head must hold the main model's values (they are shared)."""
    primary = read_hf_tensor(reader, slab.duplicate_of, block)
    if primary.shape != tensor.shape or primary.tobytes() != tensor.tobytes():
        raise ConvertError(f"Tensor {slab.hf_names[0]} differs from {slab.duplicate_of}; dropless shares the "
                           "embedding and output head between the model and its MTP modules, so it imports only "
                           "checkpoints whose copies are equal (set num_nextn_predict_layers to 0 in config.json "
                           "to import the model without its MTP modules).")


def _import(hf_dir: Path, sink: Callable[[Slab, np.ndarray], None], base: Config | None = None):
    """Stream every slab of an HF checkpoint into `sink`. Returns (config, hf config dict, dtype record)."""
    hf = read_hf_config(hf_dir)
    config = hf_model_config(hf_dir, base)
    shapes = model_leaf_shapes(config)
    slabs = plan(config, rope_interleave=hf.get("rope_interleave", True))
    check_coverage(slabs, shapes)
    block = fp8_block_size(hf)
    with CheckpointReader(hf_dir) as reader:
        check_checkpoint(reader, slabs, shapes, config)
        dtypes: dict[str, str] = {}
        for slab in slabs:
            tensors = [read_hf_tensor(reader, name, block) for name in slab.hf_names]
            for name in slab.hf_names:  # FP8 weights are dequantized to bfloat16, and exported so
                stored = reader.tensors[name].dtype
                dtypes[name_pattern(name)] = "BF16" if stored in FP8_DTYPES else stored
            if slab.duplicate_of is not None:
                _check_duplicate(reader, slab, tensors[0], block)
                continue
            array = to_ours(slab, tensors, shapes[slab.leaf][len(slab.index):])
            del tensors  # before the sink takes its share of memory
            sink(slab, array)
    return config, hf, dtypes


def _leaf_depths(slabs: list[Slab]) -> dict[LeafPath, int]:
    return {slab.leaf: len(slab.index) for slab in slabs}


def _copy_carried(src: Path, dst: Path) -> None:
    for name in CARRIED_FILES:
        if (src / name).is_file():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, dst / name)


def convert_from_hf(hf_dir: Path, run_dir: Path) -> Config:
    """Import an HF checkpoint into a new run directory (config.json + an orbax checkpoint at step 0).

    Streams slab by slab: host memory stays near the size of the largest tensor, whatever the checkpoint's.
    """
    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    config = hf_model_config(hf_dir)
    shapes = model_leaf_shapes(config)
    depths = _leaf_depths([slab for slab in plan(config) if slab.duplicate_of is None])
    with RunWriter(run_dir, config, {leaf: (shape, depths[leaf]) for leaf, shape in shapes.items()}) as writer:
        config, hf, dtypes = _import(hf_dir, lambda slab, array: writer.write(slab.leaf, slab.index, array))
        (writer.tmp_dir / HF_SOURCE).write_text(json.dumps({"config": hf, "dtypes": dtypes}, indent=1) + "\n")
        _copy_carried(hf_dir, writer.tmp_dir / HF_FILES)
        if (hf_dir / "tokenizer.json").is_file():  # where `dropless generate --run-dir` looks for it
            shutil.copy2(hf_dir / "tokenizer.json", writer.tmp_dir / "tokenizer.json")
    return config


def _nest(flat: dict[LeafPath, jax.Array]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def load_hf(hf_dir: Path, base: Config | None = None, *, dtypes: Callable[[Config], dict] | None = None,
            shardings: dict | None = None) -> tuple[Config, dict, dict]:
    """(config, params, state) straight from an HF directory, in memory, without a run dir.

    `base` supplies the train/data/parallel groups (defaults if None). The params are float32, or with `dtypes`
    (given the model's config, a tree of dtypes shaped like the params, e.g. `transformer.inference_dtypes`) in
    those: each leaf is built in its dtype on the host, so a bf16 checkpoint loaded for bf16 inference takes half
    the host and device memory of its float32 copy, which never exists. A float32 value is rounded to nearest
    even as XLA's cast does, so the weights equal the float32 ones cast after loading, bit for bit.

    The arrays go to the default device, or with `shardings` ({"params": ..., "state": ...}, trees of shardings
    shaped like them, as `checkpoint.load_checkpoint` takes) each straight into its sharding, so that a model no
    one device holds is never put on one.
    """
    hf_dir = Path(hf_dir)
    config = hf_model_config(hf_dir, base)
    leaf_dtypes = {("params", *(str(k.key) for k in path)): dtype for path, dtype
                   in jax.tree_util.tree_leaves_with_path(dtypes(config))} if dtypes else {}
    arrays = {leaf: np.empty(shape, leaf_dtypes.get(leaf, np.float32))
              for leaf, shape in model_leaf_shapes(config).items()}

    def sink(slab: Slab, array: np.ndarray) -> None:
        arrays[slab.leaf][slab.index] = array

    _import(hf_dir, sink, base)
    # Committed to the default device, like arrays orbax restores, so both share compiled functions.
    device = jax.devices()[0]
    placement = ({tuple(str(k.key) for k in path): sharding
                  for path, sharding in jax.tree_util.tree_leaves_with_path(shardings)}
                 if shardings is not None else dict.fromkeys(arrays, device))
    tree = _nest({leaf: jax.device_put(arrays.pop(leaf), placement[leaf]) for leaf in list(arrays)})
    return config, tree["params"], tree["state"]


def _export_dtype(name: str, recorded: dict[str, str], dtype: str | None) -> str:
    if name.endswith("e_score_correction_bias"):  # transformers keeps DeepSeek's correction bias in float32
        return recorded.get(name_pattern(name), "F32") if dtype is None else "F32"
    if dtype is not None:
        return EXPORT_DTYPES[dtype]
    return recorded.get(name_pattern(name), "F32")


def _read_source(run_dir: Path) -> tuple[dict | None, dict[str, str]]:
    """(the original config.json or None, the recorded dtype of each tensor pattern) from the run's hf_source.json;
    (None, {}) for a run trained here. A malformed file raises ConvertError naming it."""
    path = run_dir / HF_SOURCE
    if not path.is_file():
        return None, {}
    fix = "restore it, or delete it to export with float32 weights and a config.json written from the run's config"
    source = _read_json(path, fix)
    config, recorded = (source.get("config"), source.get("dtypes", {})) if isinstance(source, dict) else (None, None)
    if not isinstance(config, (dict, type(None))) or not isinstance(recorded, dict):
        raise ConvertError(f"{path} is not an object with a 'config' object and a 'dtypes' object; {fix}.")
    for pattern, code in recorded.items():
        if code not in WEIGHT_DTYPES:
            raise ConvertError(f"{path} records dtype {code!r} for {pattern}, but weights export only as "
                               f"{', '.join(WEIGHT_DTYPES)}; {fix}.")
    return config, recorded


def convert_to_hf(run_dir: Path, hf_dir: Path, *, dtype: str | None = None, step: int | None = None,
                  max_shard_bytes: int = 5 * 2**30) -> int:
    """Export a run directory's checkpoint (latest good step unless `step`) as an HF model directory; returns the
    step exported.

    `dtype` ("float32", "bfloat16", "float16") casts every weight; None keeps each tensor's dtype from the
    import this run came from, or float32 (lossless) for a run trained from scratch. Streams slab by slab,
    verifying what it reads against the checkpoint's digest: without `step`, a damaged checkpoint is skipped for
    the newest good one with a CheckpointWarning naming both (as `dropless.train.checkpoint.load_model` does);
    a damaged `step` raises DamagedCheckpoint.
    """
    run_dir, hf_dir = Path(run_dir), Path(hf_dir)
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ConvertError(f"dtype={dtype!r} is not supported for export; choose one of {', '.join(EXPORT_DTYPES)}.")
    if hf_dir.exists() and any(hf_dir.iterdir()):
        raise ConvertError(f"{hf_dir} already exists and is not empty; choose a new output directory.")
    config = ckpt.load_run_config(run_dir)
    source_config, recorded = _read_source(run_dir)
    rope_interleave = bool((source_config or {}).get("rope_interleave", True))
    shapes = model_leaf_shapes(config)
    slabs = plan(config, rope_interleave=rope_interleave)
    check_coverage(slabs, shapes)
    entries = [(name, _export_dtype(name, recorded, dtype), shape) for slab in slabs
               for name, shape in zip(slab.hf_names, hf_shapes(slab, shapes[slab.leaf][len(slab.index):]))]
    main_code = collections.Counter(code for _, code, _ in entries).most_common(1)[0][0]
    hf = config_to_hf(config, source_config, dtype=_TORCH_NAMES.get(main_code, "float32"))
    if config.model.attention == "mla":
        hf["rope_interleave"] = rope_interleave
    depths = _leaf_depths([slab for slab in slabs if slab.duplicate_of is None])
    layout = {leaf: (shape, depths.get(leaf, 0)) for leaf, shape in shapes.items()}

    def export(candidate: int) -> None:
        tmp = run_store.temporary_sibling(hf_dir)
        try:
            reader = RunReader(run_dir, candidate, layout)
            write_sharded(tmp, entries, _export_tensors(reader, slabs, shapes, entries, run_dir), max_shard_bytes)
            reader.verify()
            _warn_of_dropped_router_bias(reader, slabs, config)
            (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
            if (run_dir / HF_FILES).is_dir():
                _copy_carried(run_dir / HF_FILES, tmp)
            elif (run_dir / "tokenizer.json").is_file():
                shutil.copy2(run_dir / "tokenizer.json", tmp / "tokenizer.json")
            run_store.move_into_place(tmp, hf_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    if step is not None:
        ckpt.require_step(run_dir, step, ckpt.all_steps(run_dir))
        export(step)
        return step
    steps = ckpt.all_steps(run_dir)
    if not steps:
        raise ckpt.CheckpointError(f"{run_dir} has no finished checkpoint; train or import into it first.")
    exported, _, damaged = ckpt.newest_good(run_dir, steps, export, ckpt.READ_FIX)
    for _, message in damaged:
        warnings.warn(f"{message}; exported checkpoint {exported} instead.", ckpt.CheckpointWarning)
    return exported


def _warn_of_dropped_router_bias(reader: RunReader, slabs: list[Slab], config) -> None:
    """Warn where the run's routers have balancing biases the family's HF format has no tensor for (Mixtral,
    Qwen3-MoE: trained with moe.bias_update_rate > 0): they are left out, and the exported model selects experts
    without them."""
    rows = [reader.read(slab.leaf, slab.index) for slab in slabs  # (a whole-leaf slab: no MoE layer, no rows)
            if slab.leaf == ("state", "router_bias") and not slab.hf_names and slab.index]
    largest = max((float(np.max(np.abs(row), initial=0.0)) for row in rows), default=0.0)
    if largest > 0:
        warnings.warn(f"the routers' balancing biases (largest |bias| {largest:.3g}) have no tensor in the "
                      f"{config.model.family} format and are left out, so the exported model selects experts "
                      "without them and its outputs differ from the run's; for an exact export train this family "
                      "with moe.bias_update_rate=0 (balancing by moe.aux_loss_weight)", ConvertWarning)


def _export_tensors(reader: RunReader, slabs: list[Slab], shapes: dict, entries: list,
                    run_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """The HF tensors of `entries`, in order, from the slabs `reader` reads."""
    codes = {name: code for name, code, _ in entries}
    for slab in slabs:
        if not slab.hf_names:
            continue
        array = reader.read(slab.leaf, slab.index)
        want = shapes[slab.leaf][len(slab.index):]
        if array.shape != want:
            raise ckpt.CheckpointError(f"{'.'.join(slab.leaf)} in {run_dir} has slabs of shape {array.shape}, "
                                       f"but the run's config.json implies {want}.")
        if slab.fold is not None:
            array = fold_common(array, reader.read(("state", "router_common"), (slab.fold,)))
        for name, tensor in zip(slab.hf_names, to_hf(slab, array)):
            yield name, np.asarray(tensor, DTYPES[codes[name]], order="C")  # cast and lay out in one copy


@functools.lru_cache(maxsize=8)
def _jitted_forward(config_json: str):
    """One compiled forward per distinct config (Config holds a dict, so it is keyed by its JSON)."""
    config = config_lib.from_dict(json.loads(config_json))
    return jax.jit(lambda params, state, tokens_BS: transformer.forward(params, state, tokens_BS, config)[0])


def check_tokens(tokens_BS, config: Config, name: str = "tokens_BS") -> np.ndarray:
    """`tokens_BS` as int32 [B, S] after checking that the model can take it (`name` is how the messages call
    it): a non-empty integer array of two dimensions, every id in [0, model.vocab_size), rows of at most
    model.max_seq_len tokens. An id outside the vocabulary would otherwise read a clamped embedding row."""
    tokens = np.asarray(tokens_BS)
    if tokens.ndim != 2 or not (np.issubdtype(tokens.dtype, np.integer) or tokens.dtype == bool) or not tokens.size:
        raise ConvertError(f"{name} must be a non-empty integer array [batch, seq] of token ids; it has "
                           f"{tokens.dtype} of shape {tokens.shape}.")
    vocab = config.model.vocab_size
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ConvertError(f"{name} holds ids outside [0, {vocab}); the model's vocabulary has {vocab} entries.")
    if tokens.shape[1] > config.model.max_seq_len:
        raise ConvertError(f"{name} holds sequences of {tokens.shape[1]} tokens, longer than the model accepts "
                           f"({config.model.max_seq_len}, model.max_seq_len); give at most that many per row.")
    return tokens.astype(np.int32)


def compute_logits(config: Config, params: dict, state: dict, tokens_BS: np.ndarray) -> np.ndarray:
    """Float32 logits [B, S, V] for int token ids [B, S], computed in float32 with exact matmuls; tokens the model
    cannot take raise ConvertError (`check_tokens`).

    Attention and the MoE layer run their XLA reference paths whatever `model.attention_backend` and
    `moe.gmm_backend` say, so no token is dropped and the numbers are comparable with another implementation.
    """
    tokens_BS = check_tokens(tokens_BS, config)
    config = config.replace(**{"train.dtype": "float32", "moe.gmm_backend": "xla", "model.attention_backend": "xla"})
    forward = _jitted_forward(json.dumps(config.to_dict(), sort_keys=True))
    with jax.default_matmul_precision("highest"):
        logits = forward(params, state, jnp.asarray(tokens_BS, jnp.int32))
    return np.asarray(logits, np.float32)
