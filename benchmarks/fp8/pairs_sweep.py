"""The one-pass quantizer of both layouts (dropless.ops.fp8_pairs) on one GPU: each kernel setting (warps per
program) at the operands of DeepSeek-V3's expert stage, its bits against the quantizer's (on random operands, and
on one with a NaN, an inf and a tile of float32-floor magnitudes), its time and bandwidth beside the two-pass
quantizer and a bf16 elementwise pass in the same call.

    python benchmarks/fp8/pairs_sweep.py --out fp8-pairs-h200.json

Bandwidth counts the fewest bytes: the bf16 operand read once, both e4m3 layouts and the float32 scales written once.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from dropless.bench.harness import same_bits, time_calls
from dropless.bench.records import environment, write_json
from dropless.ops import fp8_pairs

# (name, shape, kind): the expert stage's activations and gradients at 65,536 rows, and its two weights.
OPERANDS = [("x / dy of down [65536, 7168]", (65536, 7168), "tiles"),
            ("dy of gate+up [65536, 4096]", (65536, 4096), "tiles"),
            ("h [65536, 2048]", (65536, 2048), "tiles"),
            ("gate_up [32, 7168, 4096]", (32, 7168, 4096), "blocks"),
            ("down [32, 2048, 7168]", (32, 2048, 7168), "blocks")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--warps", default="4,8,16")
    a = p.parse_args()
    warps = [int(w) for w in a.warps.split(",")]
    records = []
    for i, (name, shape, kind) in enumerate(OPERANDS):
        x = jax.random.normal(jax.random.key(i), shape, jnp.bfloat16)
        edges = x.at[..., 3, 5].set(jnp.nan).at[..., 200, 300].set(jnp.inf)
        edges = edges.at[..., 128:256, :128].multiply(1e-37)  # magnitudes whose scale is the 2^-126 floor
        n = x.size
        ideal = 2 * n + 2 * n + 4 * (2 * n // 128 if kind == "tiles" else n // 128 ** 2)
        base = {"operand": name, "kind": kind}
        reference = jax.jit(lambda x: fp8_pairs.quantize_pair_reference(x, kind))
        want, want_edges = reference(x), reference(edges)
        t = time_calls(reference, [(x,)])
        records.append(base | {"variant": "two passes (the quantizer per layout)", "ms": 1e3 * t,
                               "gb_s": ideal / t / 1e9})
        t = time_calls(jax.jit(lambda x: x * 2), [(x,)])
        records.append(base | {"variant": "bf16 x * 2 (read + write)", "ms": 1e3 * t, "gb_s": 4 * n / t / 1e9})
        for w in warps:
            fn = jax.jit(lambda x: fp8_pairs.quantize_pair(x, kind, num_warps=w))
            rec = base | {"variant": f"one pass, {w} warps"}
            try:
                rec["bits_equal"] = same_bits(fn(x), want)
                rec["bits_equal_edges"] = same_bits(fn(edges), want_edges)
                t = time_calls(fn, [(x,)])
                rec |= {"ms": 1e3 * t, "gb_s": ideal / t / 1e9}
            except Exception as e:  # noqa: BLE001 - a setting that fails is a result
                rec["error"] = str(e).split("\n")[0][:300]
            records.append(rec)
        for rec in records[-(2 + len(warps)):]:
            print(json.dumps(rec), flush=True)
        write_json(a.out, {"benchmark": "fp8-pairs", "environment": environment(), "records": records})


if __name__ == "__main__":
    main()
