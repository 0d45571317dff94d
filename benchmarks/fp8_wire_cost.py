"""What FP8 on the wire costs in compute: the DeepSeek-V3-proxy MoE layer (bf16, forward + backward) with the
allgather strategy on a mesh whose `expert` axis spans the devices given (one GPU: its collectives do nothing,
so the difference is only the quantize and dequantize passes), with bf16 rows and with float8 rows on the wire,
timed in alternating rounds (dropless.bench.ep.paired_rounds). Prints and writes --out (JSON).

  python3 benchmarks/fp8_wire_cost.py --devices 1 --out $OUT/fp8-wire-cost.json
"""

from __future__ import annotations

import argparse
import json
import sys

from dropless import xla_flags


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="deepseek-v3-proxy")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per device")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    xla_flags.apply()
    import jax

    from dropless.bench.ep import _inputs, _layer_program, _placed, _router_bias, paired_rounds
    from dropless.bench.gmm import environment
    from dropless.cli import build_config
    from dropless.config import ParallelConfig
    from dropless.parallel.dispatch import AllGather
    from dropless.parallel.mesh import make_mesh
    from dropless.parallel.wire import Wire

    devices = jax.devices()[:args.devices]
    config = build_config(args.preset, {})
    mesh = make_mesh(ParallelConfig(data=1, expert=len(devices)), devices, num_experts=config.moe.num_experts)
    params, x_BSD, cotangent_BSD = _inputs(config, len(devices), args.tokens)
    arguments = (params, _router_bias(config.moe, "random"), x_BSD, cotangent_BSD)
    compiled = {name: _layer_program(config.moe, mesh, AllGather(Wire.from_config(name))).lower(*arguments).compile()
                for name in ("compute", "float8")}
    placed = {name: _placed(program, arguments) for name, program in compiled.items()}
    timing = paired_rounds(compiled["compute"], placed["compute"], compiled["float8"], placed["float8"], args.rounds)
    record = {"devices": len(devices), "tokens_per_device": args.tokens, "bf16_wire_ms": timing["single_device_ms"],
              "float8_wire_ms": timing["layer_ms"], "bf16_over_float8": timing["weak_scaling_efficiency"],
              "range": timing["efficiency_range"], "rounds_ms": timing["rounds_ms"], "environment": environment()}
    print(f"{len(devices)} device(s): bf16 rows {record['bf16_wire_ms']:.2f} ms, float8 rows "
          f"{record['float8_wire_ms']:.2f} ms (bf16/float8 {record['bf16_over_float8']:.3f}, rounds "
          f"{record['range'][0]:.3f}-{record['range'][1]:.3f})", flush=True)
    with open(args.out, "w") as stream:
        json.dump(record, stream, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
