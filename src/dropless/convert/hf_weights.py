"""Tensor mapping between Hugging Face checkpoints and our parameter layout (docs/architecture.md, "Parameters").

The mapping is a list of `Slab`s. A slab ties a few HF tensors to one slice of one of our stacked leaves:
`model.layers.5.mlp.experts.7.{gate_proj,up_proj}.weight` <-> `params.moe_layers.moe.experts.gate_up[2, 7]`.
Conversion in either direction walks the slabs in HF layer order and holds one slab at a time, which is what
keeps memory bounded by the largest tensor however large the checkpoint.

Per-slab operations (HF `nn.Linear` weights are [out, in]; ours are [in, out]):
  copy       norms, the embedding, the correction bias
  transpose  projections, the router, lm_head
  gate_up    gate and up [F, D] each -> one [D, 2F] (gate first)
  zeros      our router_bias for families without a correction bias, our router_common (no HF tensor)
A router's running input mean (`state.router_common`, moe.router_common_rate) has no HF tensor: on export it is
folded into the router's weight (`Slab.fold`, `dropless.moe.router.fold_common`), which routes every token as the
trained model does; on import it is zero, which leaves the router as it is.
Layers map by type: HF layer i is row l of `dense_layers` or `moe_layers`, l counting that type's layers before i
(`transformer.stack_position`). DeepSeek-V3's multi-token-prediction modules are HF layers num_hidden_layers + k
(layer 61 in the official checkpoint): `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and a whole decoder layer
map to `params.mtp` row k (their MoE block's correction bias to the router-bias row after the MoE layers'), and the
copies of the embedding and the output head each module carries (`embed_tokens`, `shared_head.head`) are
*duplicate* slabs: checked equal to the main model's on import (dropless shares them) and written from them on
export.
MLA rotary columns: our model applies DeepSeek's interleaved RoPE, the layout of `rope_interleave: true`
checkpoints (all official ones). A `rope_interleave: false` checkpoint gets its rotary columns interleaved on
import, which computes the same function; it is exported with `rope_interleave: true`.
FP8 (DeepSeek-V3's official weights): e4m3 weights with a `<name>_scale_inv` float32 tensor per 128x128 block
(the block size comes from `quantization_config.weight_block_size`) are dequantized to bfloat16 while reading.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from dropless.core.config import Config
from dropless.convert.hf_config import ConvertError, malformed
from dropless.convert.safetensors_io import CheckpointReader
from dropless.models import transformer

# Keys of our pytrees: ("params", ...) or ("state", ...).
LeafPath = tuple[str, ...]


@dataclass(frozen=True)
class Slab:
    leaf: LeafPath
    index: tuple[int, ...]  # leading indices into the stacked leaf ([L] or [L, E]); () for unstacked leaves
    hf_names: tuple[str, ...]
    op: str  # "copy" | "transpose" | "gate_up" | "zeros"
    columns: tuple[int, ...] | None = None  # ours[:, j] = transposed_hf[:, columns[j]] (rope interleaving)
    duplicate_of: str | None = None  # the HF tensor holding the same values: this slab's leaf is covered there
    fold: int | None = None  # a router weight: the state.router_common row folded into it on export


def _interleave_columns(width: int, rope: int, group: int, groups: int) -> tuple[int, ...]:
    """Column gather turning rotate-half rotary columns into interleaved ones, in each of `groups` blocks of
    `group` columns whose last `rope` columns are rotary."""
    half = rope // 2
    perm = list(range(width))
    for g in range(groups):
        start = g * group + group - rope
        for i in range(half):
            perm[start + 2 * i] = start + i
            perm[start + 2 * i + 1] = start + half + i
    return tuple(perm)


def plan(config: Config, rope_interleave: bool = True) -> list[Slab]:
    """Every slab of the model, in HF order (embedding, layer 0, 1, ..., final norm, lm_head, MTP layers)."""
    m, moe, family = config.model, config.moe, config.model.family
    slabs = [Slab(("params", "embed"), (), ("model.embed_tokens.weight",), "copy")]
    rope_fix = m.attention == "mla" and not rope_interleave
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    moe_root = "block_sparse_moe." if family == "mixtral" else "mlp."
    expert_names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    num_moe = transformer.layer_counts(m)[1]

    def decoder_layer(i: int, root: tuple[str, ...], l: int, dense: bool, bias_row: int) -> None:
        """HF layer i's tensors -> row l of the stacked layer weights under `root`."""
        def add(keys, names, op, columns=None, index=(l,)):
            slabs.append(Slab(("params", *root, *keys), index, tuple(f"model.layers.{i}.{n}" for n in names),
                              op, columns))

        add(("attn_norm",), ["input_layernorm.weight"], "copy")
        a = "self_attn."
        if m.attention == "mla":
            q_cols = _interleave_columns(m.num_heads * qk, m.qk_rope_head_dim, qk, m.num_heads) if rope_fix else None
            if m.q_lora_rank:
                add(("attn", "q_a"), [a + "q_a_proj.weight"], "transpose")
                add(("attn", "q_a_norm"), [a + "q_a_layernorm.weight"], "copy")
                add(("attn", "q_b"), [a + "q_b_proj.weight"], "transpose", q_cols)
            else:
                add(("attn", "q"), [a + "q_proj.weight"], "transpose", q_cols)
            kv_width = m.kv_lora_rank + m.qk_rope_head_dim
            kv_cols = _interleave_columns(kv_width, m.qk_rope_head_dim, kv_width, 1) if rope_fix else None
            add(("attn", "kv_a"), [a + "kv_a_proj_with_mqa.weight"], "transpose", kv_cols)
            add(("attn", "kv_a_norm"), [a + "kv_a_layernorm.weight"], "copy")
            add(("attn", "kv_b"), [a + "kv_b_proj.weight"], "transpose")
        else:
            for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
                add(("attn", ours), [a + theirs + ".weight"], "transpose")
            if m.qk_norm:
                add(("attn", "q_norm"), [a + "q_norm.weight"], "copy")
                add(("attn", "k_norm"), [a + "k_norm.weight"], "copy")
        add(("attn", "o"), [a + "o_proj.weight"], "transpose")
        add(("mlp_norm",), ["post_attention_layernorm.weight"], "copy")
        if dense:
            add(("mlp", "gate_up"), ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "gate_up")
            add(("mlp", "down"), ["mlp.down_proj.weight"], "transpose")
            return
        common = moe.router_common_rate > 0
        slabs.append(Slab(("params", *root, "moe", "router", "kernel"), (l,),
                          (f"model.layers.{i}.{moe_root}gate.weight",), "transpose", fold=bias_row if common else None))
        bias = (f"model.layers.{i}.{moe_root}gate.e_score_correction_bias",) if family == "deepseek_v3" else ()
        slabs.append(Slab(("state", "router_bias"), (bias_row,), bias, "copy" if bias else "zeros"))
        if common:
            slabs.append(Slab(("state", "router_common"), (bias_row,), (), "zeros"))
        for e in range(moe.num_experts):
            gate, up, down = (f"{moe_root}experts.{e}.{n}.weight" for n in expert_names)
            add(("moe", "experts", "gate_up"), [gate, up], "gate_up", index=(l, e))
            add(("moe", "experts", "down"), [down], "transpose", index=(l, e))
        if moe.num_shared_experts:
            add(("moe", "shared", "gate_up"), ["mlp.shared_experts.gate_proj.weight",
                                               "mlp.shared_experts.up_proj.weight"], "gate_up")
            add(("moe", "shared", "down"), ["mlp.shared_experts.down_proj.weight"], "transpose")

    for i in range(m.num_layers):
        stack, l = transformer.stack_position(m, i)
        decoder_layer(i, (stack,), l, stack == "dense_layers", l)
    slabs.append(Slab(("params", "final_norm"), (), ("model.norm.weight",), "copy"))
    if not m.tie_embeddings:
        slabs.append(Slab(("params", "lm_head"), (), ("lm_head.weight",), "transpose"))
    head = ("params", "embed") if m.tie_embeddings else ("params", "lm_head")
    for k in range(m.mtp_layers):
        i = m.num_layers + k
        name = f"model.layers.{i}."
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("head_norm", "shared_head.norm")):
            slabs.append(Slab(("params", "mtp", ours), (k,), (f"{name}{theirs}.weight",), "copy"))
        slabs.append(Slab(("params", "mtp", "eh_proj"), (k,), (f"{name}eh_proj.weight",), "transpose"))
        slabs.append(Slab(("params", "embed"), (), (f"{name}embed_tokens.weight",), "copy",
                          duplicate_of="model.embed_tokens.weight"))
        slabs.append(Slab(head, (), (f"{name}shared_head.head.weight",), "copy" if m.tie_embeddings else "transpose",
                          duplicate_of="model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight"))
        decoder_layer(i, ("mtp", "block"), k, m.mtp_block == "dense", num_moe + k)
    if not transformer.num_router_rows(m):  # a model without MoE layers still has the (empty) router state
        slabs.append(Slab(("state", "router_bias"), (), (), "zeros"))
        if moe.router_common_rate > 0:
            slabs.append(Slab(("state", "router_common"), (), (), "zeros"))
    return slabs


def check_coverage(slabs: list[Slab], leaf_shapes: dict[LeafPath, tuple[int, ...]]) -> None:
    """Invariant: the slabs cover every element of every leaf exactly once."""
    seen: dict[LeafPath, list[tuple[int, ...]]] = {}
    for slab in slabs:
        if slab.duplicate_of is not None:
            continue
        seen.setdefault(slab.leaf, []).append(slab.index)
    assert set(seen) == set(leaf_shapes), f"plan leaves {sorted(set(seen) ^ set(leaf_shapes))} differ from the model's"
    for leaf, indices in seen.items():
        depth = len(indices[0])
        expected = list(itertools.product(*(range(n) for n in leaf_shapes[leaf][:depth])))
        assert sorted(indices) == expected, f"plan does not cover {leaf} exactly once"


def hf_shapes(slab: Slab, slab_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The HF tensor shapes a slab of our shape `slab_shape` corresponds to."""
    if slab.op == "copy":
        return [slab_shape]
    if slab.op == "transpose":
        return [slab_shape[::-1]]
    if slab.op == "gate_up":
        d, f2 = slab_shape
        return [(f2 // 2, d), (f2 // 2, d)]
    return []


BF16 = np.dtype(ml_dtypes.bfloat16)


def to_ours(slab: Slab, tensors: list[np.ndarray], slab_shape: tuple[int, ...]) -> np.ndarray:
    """HF tensors (any float dtype) -> our float32 slab; the cast and the layout change are one copy."""
    out = np.zeros(slab_shape, np.float32) if slab.op == "zeros" else np.empty(slab_shape, np.float32)
    if slab.op == "copy":
        out[...] = tensors[0]
    elif slab.op == "transpose":
        out[...] = tensors[0].T
    elif slab.op == "gate_up":
        half = slab_shape[1] // 2
        out[:, :half], out[:, half:] = tensors[0].T, tensors[1].T
    if slab.columns is not None:
        out = out[:, list(slab.columns)]
    return out


def to_hf(slab: Slab, array: np.ndarray) -> list[np.ndarray]:
    """Our slab -> HF tensors in `slab.hf_names` order, as (possibly strided) views; the inverse of `to_ours`."""
    if slab.columns is not None:
        array = array[:, list(np.argsort(slab.columns))]
    if slab.op == "zeros":
        return []
    if slab.op == "copy":
        return [array]
    if slab.op == "transpose":
        return [array.T]
    half = array.shape[1] // 2
    return [array[:, :half].T, array[:, half:].T]


# --------------------------------------------------------------------------------------------- FP8 weights

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64") + FP8_DTYPES


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """`weight * scale_inv` per (block[0] x block[1]) tile, rounded to bfloat16, as DeepSeek's `weight_dequant`.

    Works one row of tiles at a time, so the float32 temporaries stay one tile-row in size.
    """
    rows, cols = weight.shape
    br, bc = block
    want = (math.ceil(rows / br), math.ceil(cols / bc))
    if scale_inv.shape != want:
        raise ConvertError(f"FP8 scale of shape {scale_inv.shape} does not fit a weight of shape {weight.shape} "
                           f"in {br}x{bc} blocks (expected {want}); check quantization_config.weight_block_size.")
    out = np.empty((rows, cols), BF16)
    scale_inv = scale_inv.astype(np.float32)
    for b in range(want[0]):
        r0, r1 = b * br, min((b + 1) * br, rows)
        scale_row = np.repeat(scale_inv[b], bc)[:cols]
        out[r0:r1] = weight[r0:r1].astype(np.float32) * scale_row
    return out


def fp8_block_size(hf_config: dict) -> tuple[int, int] | None:
    """The FP8 block size from `quantization_config`, or None when the checkpoint is not quantized."""
    quant = hf_config.get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") not in ("e4m3", "e5m2"):
        raise ConvertError(f"config.json field quantization_config (quant_method={quant.get('quant_method')!r}, "
                           f"fmt={quant.get('fmt')!r}) is not supported; dropless reads fp8 block-quantized "
                           "checkpoints (DeepSeek-V3's) and unquantized ones.")
    block = quant.get("weight_block_size") or [128, 128]
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in block)):
        raise malformed("quantization_config.weight_block_size", block, "must be two positive integers")
    return block[0], block[1]


# --------------------------------------------------------------------------------------------- reading and checking

_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|_scale_inv$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_checkpoint(reader: CheckpointReader, slabs: list[Slab], leaf_shapes: dict, config: Config) -> None:
    """Before anything is written: every expected tensor is there with its shape, and nothing is left over."""
    expected: set[str] = set()
    for slab in slabs:
        for name, shape in zip(slab.hf_names, hf_shapes(slab, leaf_shapes[slab.leaf][len(slab.index):])):
            expected.add(name)
            if name not in reader:
                raise ConvertError(f"The checkpoint lacks tensor {name} (expected shape {list(shape)}); "
                                   "it is incomplete or its config.json describes another model.")
            got = reader.tensors[name].shape
            if got != shape:
                raise ConvertError(f"Tensor {name} has shape {list(got)} but config.json implies {list(shape)}; "
                                   "the config and the weights disagree.")
            info = reader.tensors[name]
            if info.dtype not in FLOAT_DTYPES:  # integers would be cast to float: garbage weights, no error
                raise ConvertError(f"Tensor {name} is stored as {info.dtype}, not as floating-point weights "
                                   f"({', '.join(FLOAT_DTYPES)}); the safetensors file is corrupt, re-download it.")
            if info.dtype in FP8_DTYPES and name + "_scale_inv" not in reader:
                raise ConvertError(f"Tensor {name} is {info.dtype} without {name}_scale_inv; dropless reads FP8 "
                                   "weights only with their block scales (DeepSeek-V3's format).")
    extra = []
    for name in reader.tensors:
        layer = _LAYER.match(name)
        if name in expected or _IGNORED.search(name):
            continue
        if layer and int(layer.group(1)) >= config.model.num_layers + config.model.mtp_layers:
            continue  # multi-token-prediction layers of a model imported without them
        if name == "lm_head.weight" and config.model.tie_embeddings:
            continue  # some tied checkpoints store the copy
        if 0 in reader.tensors[name].shape:
            continue  # holds no weights: transformers saves DeepSeek's shared expert of n_shared_experts=0 so
        extra.append(name)
    if extra:
        raise ConvertError(f"The checkpoint has {len(extra)} tensor(s) this {config.model.family} model does not use, "
                           f"e.g. {', '.join(sorted(extra)[:3])}; check that config.json matches the weights.")


def read_hf_tensor(reader: CheckpointReader, name: str, block: tuple[int, int] | None) -> np.ndarray:
    """One HF tensor as stored, except FP8 weights, which come back dequantized to bfloat16."""
    tensor = reader.read(name)
    if reader.tensors[name].dtype in FP8_DTYPES:
        if block is None:
            raise ConvertError(f"Tensor {name} is FP8 but config.json has no quantization_config; add the "
                               "checkpoint's original config.json.")
        return dequantize_fp8_blocks(tensor, reader.read(name + "_scale_inv"), block)
    return tensor


def name_pattern(name: str) -> str:
    """A tensor name with its layer and expert numbers replaced by '*' (to record dtypes compactly)."""
    return re.sub(r"\.\d+\.", ".*.", re.sub(r"\.\d+\.", ".*.", name))
