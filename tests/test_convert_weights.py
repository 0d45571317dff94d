"""Weight conversion without running the model: FP8 block dequantization, rope_interleave=false checkpoints,
bfloat16 and multi-shard round trips, bounded memory while streaming, MTP layers, clear errors."""

from __future__ import annotations

import json
import math
import shutil
import struct
import tracemalloc
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from dropless.convert import ConvertError, convert_from_hf, convert_to_hf, load_hf, run_store
from dropless.convert.hf_weights import dequantize_fp8_blocks
from dropless.convert.safetensors_io import DTYPE_NAMES, INDEX_NAME, CheckpointReader, write_sharded
from dropless.train import checkpoint as ckpt

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
BF16, E4M3 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)


def rewrite(src: Path, dst: Path, edit=None, config_update=None, max_shard_bytes=2**40) -> Path:
    """Copy an HF directory, passing every tensor through `edit(name, array) -> {name: array}`."""
    with CheckpointReader(src) as reader:
        tensors = {}
        for name in reader.tensors:
            array = reader.read(name)
            tensors.update(edit(name, array) if edit else {name: array})
    write_sharded(dst, [(n, DTYPE_NAMES[a.dtype], a.shape) for n, a in tensors.items()], tensors.items(),
                  max_shard_bytes)
    config = {**json.loads((src / "config.json").read_text()), **(config_update or {})}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def assert_trees_equal(a, b):
    flat_a, flat_b = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def assert_same_tensors(dir_a: Path, dir_b: Path):
    a, b = CheckpointReader(dir_a), CheckpointReader(dir_b)
    assert sorted(a.tensors) == sorted(b.tensors)
    for name in a.tensors:
        assert a.tensors[name].dtype == b.tensors[name].dtype, name
        assert a.read(name).tobytes() == b.read(name).tobytes(), name


# ----------------------------------------------------------------------------------------------- FP8

@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((37, 50), (16, 32)), ((64, 64), (64, 64))])
def test_fp8_dequantization_equals_the_elementwise_formula(shape, block):
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 100, shape).astype(E4M3)
    scale_inv = rng.uniform(1e-4, 1e-2, (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])))
    scale_inv = scale_inv.astype(np.float32)
    expected = np.empty(shape, BF16)
    for i in range(shape[0]):
        for j in range(shape[1]):  # y = x * s, in float32, rounded once to bfloat16
            expected[i, j] = np.float32(weight[i, j]) * scale_inv[i // block[0], j // block[1]]
    got = dequantize_fp8_blocks(weight, scale_inv, block)
    assert got.dtype == BF16
    assert got.tobytes() == expected.tobytes()


def test_fp8_scale_of_the_wrong_shape_is_refused():
    with pytest.raises(ConvertError, match=r"FP8 scale of shape \(1, 1\).*\(300, 200\).*expected \(3, 2\)"):
        dequantize_fp8_blocks(np.zeros((300, 200), E4M3), np.ones((1, 1), np.float32), (128, 128))


def _quantize(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = weight.shape
    scale = np.zeros((math.ceil(rows / block[0]), math.ceil(cols / block[1])), np.float32)
    quantized = np.zeros(weight.shape, E4M3)
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            tile = np.s_[bi * block[0]:(bi + 1) * block[0], bj * block[1]:(bj + 1) * block[1]]
            scale[bi, bj] = np.abs(weight[tile]).max() / 448.0
            quantized[tile] = (weight[tile] / scale[bi, bj]).astype(E4M3)
    return quantized, scale


def test_fp8_checkpoint_imports_dequantized_and_exports_as_bfloat16(tmp_path):
    block = (16, 8)  # small blocks: many tiles per weight, ragged at the edges

    def is_quantized(name, array):  # DeepSeek-V3 quantizes the linear layers, not norms, embeddings or the router
        return array.ndim == 2 and name.endswith("proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")

    def to_fp8(name, array):
        if not is_quantized(name, array):
            return {name: array}
        quantized, scale = _quantize(array, block)
        return {name: quantized, name + "_scale_inv": scale}

    def to_reference(name, array):  # the same numbers, dequantized by the formula above, stored as bfloat16
        if not is_quantized(name, array):
            return {name: array}
        quantized, scale = _quantize(array, block)
        rows = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:array.shape[0], :array.shape[1]]
        return {name: (quantized.astype(np.float32) * rows).astype(BF16)}

    quant = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}}
    fp8 = rewrite(FIXTURES / "deepseek_v3", tmp_path / "fp8", to_fp8, quant, max_shard_bytes=200_000)
    reference = rewrite(FIXTURES / "deepseek_v3", tmp_path / "ref", to_reference)
    assert len(list(fp8.glob("*.safetensors"))) > 1
    _, params, state = load_hf(fp8)
    _, ref_params, ref_state = load_hf(reference)
    assert_trees_equal((params, state), (ref_params, ref_state))

    convert_from_hf(fp8, tmp_path / "run")
    exported = tmp_path / "exported"
    convert_to_hf(tmp_path / "run", exported)
    assert_same_tensors(exported, reference)  # bfloat16 where FP8 was, nothing else changed, no scales
    config = json.loads((exported / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"  # most tensors are


def test_fp8_weight_without_its_scale_is_refused(tmp_path):
    def drop_scale(name, array):
        if name.endswith("kv_b_proj.weight"):
            return {name: array.astype(E4M3)}
        return {name: array}

    quant = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    broken = rewrite(FIXTURES / "deepseek_v3", tmp_path / "broken", drop_scale, quant)
    with pytest.raises(ConvertError, match=r"Tensor model\.layers\.0\.self_attn\.kv_b_proj\.weight is F8_E4M3 "
                                           r"without .*_scale_inv"):
        load_hf(broken)


# ----------------------------------------------------------------------------------------------- layouts and dtypes

def test_rope_interleave_false_checkpoints_load_to_the_same_model(tmp_path):
    """A rotate-half (rope_interleave=false) DeepSeek checkpoint is the interleaved one with its rotary output
    rows de-interleaved; both must import to identical parameters, and export must restore the rotate-half rows."""
    cfg = json.loads((FIXTURES / "deepseek_v3" / "config.json").read_text())
    heads, nope, rope, kv = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                             cfg["kv_lora_rank"])

    def deinterleave_rows(block_starts, array):
        out = array.copy()
        for start in block_starts:
            rows = array[start:start + rope]
            out[start:start + rope] = np.concatenate([rows[0::2], rows[1::2]])
        return out

    def to_rotate_half(name, array):
        if name.endswith("q_b_proj.weight"):
            return {name: deinterleave_rows([h * (nope + rope) + nope for h in range(heads)], array)}
        if name.endswith("kv_a_proj_with_mqa.weight"):
            return {name: deinterleave_rows([kv], array)}
        return {name: array}

    half = rewrite(FIXTURES / "deepseek_v3", tmp_path / "half", to_rotate_half, {"rope_interleave": False})
    _, params, state = load_hf(half)
    _, ref_params, ref_state = load_hf(FIXTURES / "deepseek_v3")
    assert_trees_equal((params, state), (ref_params, ref_state))

    convert_from_hf(half, tmp_path / "run")
    exported = tmp_path / "exported"
    convert_to_hf(tmp_path / "run", exported)
    assert_same_tensors(exported, half)
    assert json.loads((exported / "config.json").read_text())["rope_interleave"] is False


def test_bfloat16_checkpoint_round_trips_byte_identical(tmp_path):
    def to_bf16(name, array):  # as published: bfloat16 weights, the correction bias kept in float32
        return {name: array if name.endswith("e_score_correction_bias") else array.astype(BF16)}

    source = rewrite(FIXTURES / "deepseek_v3", tmp_path / "bf16", to_bf16, {"torch_dtype": "bfloat16"})
    convert_from_hf(source, tmp_path / "run")
    exported = tmp_path / "exported"
    convert_to_hf(tmp_path / "run", exported)
    assert_same_tensors(exported, source)
    assert json.loads((exported / "config.json").read_text())["torch_dtype"] == "bfloat16"
    cast = tmp_path / "as_f16"
    convert_to_hf(tmp_path / "run", cast, dtype="float16")
    reader = CheckpointReader(cast)
    assert {reader.tensors[n].dtype for n in reader.tensors if "correction" not in n} == {"F16"}
    assert {reader.tensors[n].dtype for n in reader.tensors if "correction" in n} == {"F32"}  # as transformers keeps it


def test_tokenizer_and_generation_files_travel_through_import_and_export(tmp_path):
    source = Path(shutil.copytree(FIXTURES / "qwen3_moe_tied", tmp_path / "hf"))
    (source / "tokenizer.json").write_text('{"model": "x"}')
    (source / "generation_config.json").write_text('{"do_sample": false}')
    convert_from_hf(source, tmp_path / "run")
    assert (tmp_path / "run" / "tokenizer.json").read_text() == '{"model": "x"}'  # where generate --run-dir looks
    convert_to_hf(tmp_path / "run", tmp_path / "exported")
    for name in ("tokenizer.json", "generation_config.json"):
        assert (tmp_path / "exported" / name).read_bytes() == (source / name).read_bytes(), name


def test_mtp_layers_and_rotary_buffers_are_skipped(tmp_path):
    cfg = json.loads((FIXTURES / "mixtral" / "config.json").read_text())
    extra_layer = cfg["num_hidden_layers"]

    def add_extras(name, array):
        out = {name: array}
        if name == "model.norm.weight":  # what DeepSeek-V3's multi-token-prediction layer and old exports add
            out[f"model.layers.{extra_layer}.enorm.weight"] = array
            out["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
        return out

    extended = rewrite(FIXTURES / "mixtral", tmp_path / "ext", add_extras)
    assert_trees_equal(load_hf(extended)[1:], load_hf(FIXTURES / "mixtral")[1:])


@pytest.mark.parametrize("fixture, dense_layers", [("qwen3_moe_interleaved", 1), ("deepseek_v3_noqlora", 2)])
def test_a_checkpoint_without_moe_layers_imports_and_round_trips_byte_identical(fixture, dense_layers, tmp_path):
    """Layers all dense (Qwen3-MoE's mlp_only_layers or decoder_sparse_step, DeepSeek's first_k_dense_replace
    covering every layer) leave the router state with no rows; the checkpoint still imports and exports."""
    def first_layers(name, array):
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        return {} if layer is not None and int(layer) >= dense_layers else {name: array}

    source = rewrite(FIXTURES / fixture, tmp_path / "dense", first_layers, {"num_hidden_layers": dense_layers})
    config, params, state = load_hf(source)
    assert config.model.layer_types == "D" * dense_layers
    assert state["router_bias"].shape == (0, config.moe.num_experts)
    convert_from_hf(source, tmp_path / "run")
    assert_trees_equal(ckpt.load_model(tmp_path / "run")[1:], (params, state))
    convert_to_hf(tmp_path / "run", tmp_path / "exported")
    assert_same_tensors(tmp_path / "exported", source)


# ----------------------------------------------------------------------------------------------- streaming

def _synthetic_checkpoint(path: Path, layers=3, experts=16, hidden=128, width=64, vocab=1024, shard_bytes=1_500_000):
    """A Mixtral-shaped random checkpoint whose largest tensor (the embedding, 512 kB) is small next to the
    whole (~8 MB in 6 shards)."""
    config = {"architectures": ["MixtralForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
              "intermediate_size": width, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_local_experts": experts, "num_experts_per_tok": 2,
              "max_position_embeddings": 64}
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (64, hidden),
                       p + "self_attn.v_proj.weight": (64, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "block_sparse_moe.gate.weight": (experts, hidden)})
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes.update({q + "w1.weight": (width, hidden), q + "w3.weight": (width, hidden),
                           q + "w2.weight": (hidden, width)})
    plan = [(name, "F32", shape) for name, shape in shapes.items()]
    tensors = ((name, rng.standard_normal(shape, np.float32)) for name, shape in shapes.items())
    write_sharded(path, plan, tensors, shard_bytes)
    (path / "config.json").write_text(json.dumps(config))
    return path, max(int(np.prod(s)) * 4 for s in shapes.values()), sum(int(np.prod(s)) * 4 for s in shapes.values())


def test_multi_shard_import_streams_with_memory_bounded_by_the_largest_tensor(tmp_path, monkeypatch):
    # Written slabs stay referenced until their transaction commits: scale the commit and chunk sizes to this
    # checkpoint (which also sends the 512 kB embedding through the chunk-row-by-chunk-row path, with a
    # partial last chunk: 1024 rows in chunks of 192).
    monkeypatch.setattr(run_store, "_COMMIT_BYTES", 2**18)
    monkeypatch.setattr(run_store, "_CHUNK_BYTES", 3 * 2**15)
    source, largest, total = _synthetic_checkpoint(tmp_path / "hf")
    assert len(list(source.glob("*.safetensors"))) >= 5 and (source / INDEX_NAME).is_file()
    convert_from_hf(FIXTURES / "qwen3_moe_tied", tmp_path / "warm_up")  # lazy imports are not what we measure
    tracemalloc.start()
    try:
        convert_from_hf(source, tmp_path / "run")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # NumPy allocations (the slabs tensorstore holds until commit included): a few tensors' worth at most.
    assert peak < 6 * largest < total / 2, (peak, largest, total)

    _, params, state = ckpt.load_model(tmp_path / "run")
    assert_trees_equal((params, state), load_hf(source)[1:])
    exported = tmp_path / "exported"
    convert_to_hf(tmp_path / "run", exported, max_shard_bytes=1_000_000)
    assert len(list(exported.glob("*.safetensors"))) >= total // 1_000_000
    index = json.loads((exported / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == total and set(index["weight_map"]) == set(CheckpointReader(source).tensors)
    assert_same_tensors(exported, source)


def test_our_safetensors_files_interoperate_with_the_safetensors_library(tmp_path):
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(5, np.float16),
               "c": np.array([1, -2], np.int64)}
    write_sharded(tmp_path / "ours", [(n, DTYPE_NAMES[a.dtype], a.shape) for n, a in tensors.items()], tensors.items())
    loaded = safetensors.numpy.load_file(tmp_path / "ours" / "model.safetensors")
    assert all(np.array_equal(loaded[n], tensors[n]) and loaded[n].dtype == tensors[n].dtype for n in tensors)
    (tmp_path / "theirs").mkdir()
    safetensors.numpy.save_file(tensors, tmp_path / "theirs" / "model.safetensors")
    reader = CheckpointReader(tmp_path / "theirs")
    assert all(np.array_equal(reader.read(n), tensors[n]) for n in tensors)


# What the safetensors library calls each dtype dropless reads, spelled out here rather than taken from DTYPES.
LIBRARY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": BF16, "F8_E4M3": E4M3,
                  "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
                  "U8": np.uint8, "BOOL": np.bool_}


def test_every_dtype_reads_and_writes_as_the_safetensors_library_does(tmp_path):
    """Each dtype, and a zero-size tensor, has the same name, shape and bytes in our files as in the library's, both
    ways (bfloat16 and float8 too, through the library's raw interface); our data starts 8-byte aligned, as theirs."""
    tensors = {code: (np.arange(6) - 3).reshape(2, 3).astype(dtype) for code, dtype in LIBRARY_DTYPES.items()}
    tensors["empty"] = np.zeros((0, 3), np.float32)
    codes = {**{code: code for code in LIBRARY_DTYPES}, "empty": "F32"}
    (ours,) = write_sharded(tmp_path / "ours", [(n, DTYPE_NAMES[a.dtype], a.shape) for n, a in tensors.items()],
                            tensors.items())
    data = ours.read_bytes()
    assert (8 + struct.unpack("<Q", data[:8])[0]) % 8 == 0
    assert {name: (t["dtype"], tuple(t["shape"]), bytes(t["data"])) for name, t in safetensors.deserialize(data)} == \
        {name: (codes[name], a.shape, a.tobytes()) for name, a in tensors.items()}
    specs = {name: safetensors.TensorSpec(dtype=a.dtype.name, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
             for name, a in tensors.items()}
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "model.safetensors").write_bytes(bytes(safetensors.serialize(specs)))
    with CheckpointReader(tmp_path / "theirs") as reader:
        for name, array in tensors.items():
            got = reader.read(name)
            assert (got.dtype, got.shape, got.tobytes()) == (array.dtype, array.shape, array.tobytes()), name


def test_shards_fill_up_to_max_shard_bytes_and_are_numbered_from_one(tmp_path):
    tensors = {name: np.full(10, i, np.float32) for i, name in enumerate("abc")}  # 40 bytes each
    paths = write_sharded(tmp_path, [(n, "F32", a.shape) for n, a in tensors.items()], tensors.items(),
                          max_shard_bytes=80)
    assert [p.name for p in paths] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index == {"metadata": {"total_size": 120},
                     "weight_map": {"a": paths[0].name, "b": paths[0].name, "c": paths[1].name}}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([INDEX_NAME, *(p.name for p in paths)])


def test_a_tensor_stream_that_fails_leaves_no_partial_shard(tmp_path):
    def failing():
        yield "a", np.zeros(10, np.float32)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_sharded(tmp_path, [("a", "F32", (10,)), ("b", "F32", (10,))], failing())
    assert not (tmp_path / "model.safetensors").exists()


# ----------------------------------------------------------------------------------------------- errors

def _fixture_copy(tmp_path: Path, edit=None, config_update=None) -> Path:
    return rewrite(FIXTURES / "qwen3_moe", tmp_path / "edited", edit, config_update)


def test_missing_tensor_is_named_with_its_shape(tmp_path):
    broken = _fixture_copy(tmp_path, lambda n, a: {} if n == "model.layers.2.mlp.experts.5.up_proj.weight" else {n: a})
    with pytest.raises(ConvertError, match=r"lacks tensor model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight "
                                           r"\(expected shape \[24, 48\]\)"):
        convert_from_hf(broken, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_mismatched_tensor_is_named_with_both_shapes(tmp_path):
    broken = _fixture_copy(tmp_path, lambda n, a: {n: a[:, :-1] if n.endswith("layers.1.self_attn.o_proj.weight") else a})
    with pytest.raises(ConvertError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight has shape \[48, 63\] but "
                                           r"config\.json implies \[48, 64\]"):
        load_hf(broken)


def test_unexpected_tensors_are_refused(tmp_path):
    broken = _fixture_copy(tmp_path, lambda n, a: {n: a, **({"model.layers.1.mlp.shared_expert_gate.weight": a[:1]}
                                                          if n.endswith("layers.1.mlp.gate.weight") else {})})
    with pytest.raises(ConvertError, match=r"1 tensor\(s\) this qwen3_moe model does not use, e\.g\. "
                                           r"model\.layers\.1\.mlp\.shared_expert_gate\.weight"):
        load_hf(broken)


def test_unexpected_tensors_without_elements_hold_no_weights_and_are_skipped(tmp_path):
    """transformers saves a DeepSeek-V3 model of n_shared_experts=0 with shared-expert tensors of width 0: they
    hold nothing the model could use or miss, so the checkpoint imports with the same weights."""
    empty = "model.layers.1.mlp.shared_experts.up_proj.weight"
    source = _fixture_copy(tmp_path, lambda n, a: {n: a, **({empty: a[:0]} if n.endswith("layers.1.mlp.gate.weight")
                                                            else {})})
    assert empty in CheckpointReader(source).tensors
    _, params, _ = load_hf(source)
    _, plain, _ = load_hf(FIXTURES / "qwen3_moe")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_truncated_and_absent_files_are_clear_errors(tmp_path):
    source = _fixture_copy(tmp_path)
    data = (source / "model.safetensors").read_bytes()
    (source / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(ConvertError, match="is truncated"):
        load_hf(source)
    (source / "model.safetensors").unlink()
    with pytest.raises(ConvertError, match="has no \\*\\.safetensors files"):
        load_hf(source)
    (source / "config.json").unlink()
    with pytest.raises(ConvertError, match="has no config.json"):
        load_hf(source)
    (source / "notes.txt").write_text("")
    with pytest.raises(ConvertError, match="notes.txt is a file, not a directory; pass a Hugging Face"):
        load_hf(source / "notes.txt")
    with pytest.raises(ConvertError, match="missing does not exist; pass a Hugging Face model directory"):
        load_hf(source / "missing")


def test_existing_output_directories_are_not_overwritten(tmp_path):
    run = tmp_path / "run"
    convert_from_hf(FIXTURES / "qwen3_moe_tied", run)
    with pytest.raises(ckpt.CheckpointError, match="already exists and is not empty"):
        convert_from_hf(FIXTURES / "qwen3_moe_tied", run)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ConvertError, match="already exists and is not empty"):
        convert_to_hf(run, tmp_path / "out")
    with pytest.raises(ConvertError, match="dtype='int8' is not supported"):
        convert_to_hf(run, tmp_path / "new", dtype="int8")
    shutil.rmtree(tmp_path / "out")
