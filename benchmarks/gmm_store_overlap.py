"""The per-tile warp-specialised rows kernel with its store overlapped or not, in one run (make bench-gmm-store-overlap).

    python benchmarks/gmm_store_overlap.py --out FILE.json

`mosaic_ws.grouped_matmul_ws` stores each consumer's tile through its shared-memory block with TMA. With
`overlap_store` (the default) the consumer waits for that store to have read the block only when its next tile's
epilogue writes the block again, so the store runs under the next tile's MMAs; without it the consumer waits at
once, before its next tile starts. At DeepSeek-V3's expert shapes (65,536 rows in 32 or 256 Dirichlet groups, the
draw of `dropless bench gmm`) the forward and input-gradient products run with the packaged table's tile for the
H200, both forms timed alternately in one run (median of batches, rotating inputs) and checked bit for bit against
each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from dropless.bench.gmm import group_sizes
from dropless.bench.harness import same_bits, time_calls
from dropless.bench.records import environment, write_json

SHAPES = {"dsv3-gate-up-e32": (65536, 7168, 4096, 32), "dsv3-down-e32": (65536, 2048, 7168, 32),
          "dsv3-gate-up-e256": (65536, 7168, 4096, 256), "dsv3-down-e256": (65536, 2048, 7168, 256)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two forms per product")
    a = p.parse_args()
    from dropless.gmm import mosaic_ws
    from dropless.gmm.tuning import plan_for

    record = {"benchmark": "gmm-store-overlap", "environment": environment(), "results": []}
    for name in a.shapes.split(","):
        m, k, n, g = SHAPES[name]
        plan = plan_for(m, k, n, g, kind="NVIDIA H200")
        sizes = jnp.asarray(group_sizes("dirichlet", m, g, seed=0))
        keys = jax.random.split(jax.random.key(0), 4)
        w = [(jax.random.normal(keys[i], (g, k, n)) / np.sqrt(k)).astype(jnp.bfloat16) for i in (0, 1)]
        for product in ("fwd", "dlhs"):
            config = getattr(plan, product)
            row = {"shape": name, "m": m, "k": k, "n": n, "g": g, "product": product, "kernel": config.kernel,
                   "tile": dataclasses.asdict(config.tile)}
            if config.kernel != "dropless_ws":
                row["skipped"] = f"the table's kernel is {config.kernel}"
                record["results"].append(row)
                print(json.dumps(row), flush=True)
                continue
            width = k if product == "fwd" else n  # the rows' width: x [m, k] forward, dy [m, n] input gradient
            args = [(jax.random.normal(keys[2 + i], (m, width), jnp.bfloat16), w[i], sizes) for i in (0, 1)]
            forms = {overlap: jax.jit(functools.partial(mosaic_ws.grouped_matmul_ws, tile=config.tile,
                                                        transpose_rhs=product == "dlhs", overlap_store=overlap))
                     for overlap in (True, False)}
            rows = int(sizes.sum())
            outs = {overlap: fn(*args[0])[:rows] for overlap, fn in forms.items()}
            row["same_bits"] = bool(same_bits(outs[True], outs[False]))
            times = {True: [], False: []}
            for _ in range(a.rounds):
                for overlap, fn in forms.items():
                    times[overlap].append(time_calls(fn, args, target_s=0.1, batches=5))
            flops = 2 * rows * k * n
            for overlap, label in ((True, "overlapped"), (False, "waited")):
                ms = float(np.median(times[overlap])) * 1e3
                row[label] = {"ms": ms, "tflops": flops / ms / 1e9, "ms_rounds": [t * 1e3 for t in times[overlap]]}
            row["speedup"] = row["waited"]["ms"] / row["overlapped"]["ms"]
            print(json.dumps(row), flush=True)
            record["results"].append(row)
    write_json(a.out, record)


if __name__ == "__main__":
    main()
