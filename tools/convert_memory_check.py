"""Measure peak host memory (RSS) while converting a large synthetic multi-shard HF checkpoint, both ways.

    python tools/convert_memory_check.py --work-dir /tmp/big --gigabytes 4.3

writes a random bfloat16 Mixtral-shaped checkpoint of about that size (shards of --shard-mb), then runs
`convert_from_hf` and `convert_to_hf` each in a fresh subprocess and prints the subprocess's peak RSS next to
the checkpoint's size and its largest tensor. Needs disk for the checkpoint, its float32 run directory (twice
its size) and the export. Not part of the test suite (it moves gigabytes); the suite checks the same property
on a small checkpoint with tracemalloc.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from dropless.convert.safetensors_io import CheckpointReader, write_sharded

DIMS = dict(vocab=32000, hidden=2048, heads=16, kv_heads=4, head_dim=128, width=4096, experts=16)


def make_checkpoint(path: Path, gigabytes: float, shard_mb: int) -> tuple[int, int, int]:
    d = DIMS
    per_layer = 2 * (d["heads"] + d["kv_heads"]) * d["head_dim"] * d["hidden"] + d["experts"] * (
        3 * d["hidden"] * d["width"] + d["hidden"]) + 2 * d["hidden"]
    layers = max(1, round((gigabytes * 1e9 / 2 - 2 * d["vocab"] * d["hidden"]) / per_layer))
    config = {"architectures": ["MixtralForCausalLM"], "vocab_size": d["vocab"], "hidden_size": d["hidden"],
              "intermediate_size": d["width"], "num_hidden_layers": layers, "num_attention_heads": d["heads"],
              "num_key_value_heads": d["kv_heads"], "head_dim": d["head_dim"], "num_local_experts": d["experts"],
              "num_experts_per_tok": 2, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    shapes = {"model.embed_tokens.weight": (d["vocab"], d["hidden"])}
    for i in range(layers):
        p = f"model.layers.{i}."
        qd, kvd = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        shapes.update({p + "input_layernorm.weight": (d["hidden"],),
                       p + "self_attn.q_proj.weight": (qd, d["hidden"]), p + "self_attn.k_proj.weight": (kvd, d["hidden"]),
                       p + "self_attn.v_proj.weight": (kvd, d["hidden"]), p + "self_attn.o_proj.weight": (d["hidden"], qd),
                       p + "post_attention_layernorm.weight": (d["hidden"],),
                       p + "block_sparse_moe.gate.weight": (d["experts"], d["hidden"])})
        for e in range(d["experts"]):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes.update({q + "w1.weight": (d["width"], d["hidden"]), q + "w2.weight": (d["hidden"], d["width"]),
                           q + "w3.weight": (d["width"], d["hidden"])})
    shapes.update({"model.norm.weight": (d["hidden"],), "lm_head.weight": (d["vocab"], d["hidden"])})
    rng = np.random.default_rng(0)

    def tensors():
        for name, shape in shapes.items():
            bits = rng.integers(0, 2**16, shape, dtype=np.uint16) & 0xBFFF  # finite bfloat16 values, |x| < 2
            yield name, bits.view(ml_dtypes.bfloat16)

    write_sharded(path, [(n, "BF16", s) for n, s in shapes.items()], tensors(), shard_mb * 2**20)
    (path / "config.json").write_text(json.dumps(config))
    sizes = [int(np.prod(s)) * 2 for s in shapes.values()]
    return sum(sizes), max(sizes), len(list(path.glob("*.safetensors")))


def _measure(code: str) -> tuple[float, float]:
    """(peak RSS in bytes, seconds) of a fresh Python running `code`; the child reports its own ru_maxrss."""
    start = time.time()
    code += "; import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    result = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return int(result.stdout.split()[-1]) * 1024.0, time.time() - start  # ru_maxrss is in kB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--gigabytes", type=float, default=4.3)
    parser.add_argument("--shard-mb", type=int, default=500)
    parser.add_argument("--reuse", action="store_true", help="keep WORK_DIR/hf from an earlier run")
    args = parser.parse_args()
    hf, run, out = args.work_dir / "hf", args.work_dir / "run", args.work_dir / "exported"
    for path in (run, out) if args.reuse else (hf, run, out):
        shutil.rmtree(path, ignore_errors=True)
    if args.reuse:
        reader = CheckpointReader(hf)
        sizes = [info.nbytes for info in reader.tensors.values()]
        total, largest, shards = sum(sizes), max(sizes), len(list(hf.glob("*.safetensors")))
    else:
        total, largest, shards = make_checkpoint(hf, args.gigabytes, args.shard_mb)
    print(f"synthetic checkpoint: {total / 1e9:.2f} GB bfloat16 in {shards} shards; largest tensor "
          f"{largest / 1e6:.0f} MB ({2 * largest / 1e6:.0f} MB as float32)", flush=True)
    baseline, _ = _measure("import dropless.convert, dropless.models.transformer, orbax.checkpoint")
    print(f"baseline (imports only): peak RSS {baseline / 1e6:.0f} MB", flush=True)
    rss, seconds = _measure(f"from dropless.convert import convert_from_hf; convert_from_hf({str(hf)!r}, {str(run)!r})")
    print(f"convert_from_hf: peak RSS {rss / 1e6:.0f} MB, {seconds:.0f} s", flush=True)
    rss, seconds = _measure(f"from dropless.convert import convert_to_hf; "
                            f"convert_to_hf({str(run)!r}, {str(out)!r}, max_shard_bytes={args.shard_mb * 2**20})")
    print(f"convert_to_hf: peak RSS {rss / 1e6:.0f} MB, {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
