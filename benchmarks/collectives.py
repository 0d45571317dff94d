"""Bandwidth of the expert-parallel layer's collectives between the GPUs of one host, under the NCCL and XLA
settings of the environment it runs in (NCCL reads its variables once per process: one setting per run).

The MoE layer's default strategy moves one [tokens, hidden] bf16 block per GPU four times per forward+backward
(dispatch all-gather, combine reduce-scatter, and their transposes). This times exactly those collectives at the
DeepSeek-V3 proxy's size (16,384 x 7,168 bf16 per GPU = 235 MB), plus the dense all_to_all, each as a
throughput of back-to-back calls (dropless.bench.gmm.time_calls), and appends one JSON line:
{"label", "env", "ops": {op: {"ms", "GBps_per_device"}}}. GB/s per device = bytes each GPU receives / time
(for two GPUs: the block; (n-1)/n of it for all_to_all).

  python benchmarks/collectives.py --label default --out collectives.jsonl
  (`make bench-collectives` runs it once per NCCL/XLA setting)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dropless.core import xla_flags

WATCHED = ("NCCL_", "XLA_FLAGS")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True, help="the setting's name in the results")
    p.add_argument("--out", required=True, help="JSON-lines file to append to")
    p.add_argument("--rows", type=int, default=16384, help="rows per GPU")
    p.add_argument("--hidden", type=int, default=7168)
    args = p.parse_args(argv)
    xla_flags.apply()  # what dropless itself runs with; the caller's settings win
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dropless.bench.gmm import environment, time_calls

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
    block = (args.rows, args.hidden)
    count = len(devices)

    def collective(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    ops = {  # name -> (program, rows per device of its input, bytes each GPU receives)
        "all_gather": (collective(lambda x: jax.lax.all_gather(x, "x", tiled=True)), args.rows,
                       (count - 1) * args.rows),
        "reduce_scatter": (collective(lambda y: jax.lax.psum_scatter(y, "x", tiled=True)), count * args.rows,
                           (count - 1) * args.rows),
        "all_to_all": (collective(lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True)), args.rows,
                       (count - 1) * args.rows // count),
    }
    bytes_per_row = args.hidden * 2
    results = {}
    for name, (program, rows, received_rows) in ops.items():
        x = jax.device_put(jnp.ones((count * rows, args.hidden), jnp.bfloat16), NamedSharding(mesh, P("x")))
        seconds = time_calls(program, [(x,)], target_s=0.3, batches=7)
        results[name] = {"ms": 1e3 * seconds, "GBps_per_device": received_rows * bytes_per_row / seconds / 1e9}
        print(f"{args.label}: {name} {1e3 * seconds:.3f} ms, {results[name]['GBps_per_device']:.0f} GB/s per GPU",
              flush=True)
    env = {k: v for k, v in os.environ.items() if k.startswith(WATCHED)}
    record = {"label": args.label, "env": env, "block": list(block), "devices": count, "ops": results,
              "environment": environment()}
    with open(args.out, "a") as stream:
        stream.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
