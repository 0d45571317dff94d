"""What a dispatch strategy costs in compute, apart from its collectives: the DeepSeek-V3-proxy MoE layer (bf16,
forward + backward) on ONE GPU with each variant's strategy on a one-GPU `expert` axis (its collectives then do
nothing; what remains is its packing, unpacking and, for float8 rows, the quantize and dequantize passes), each
timed in alternating rounds against the plain one-GPU layer (dropless.bench.ep.paired_rounds). Variants:
a strategy name, with ":float8" for FP8 rows. Prints one line per variant and writes --out (JSON).

  python3 benchmarks/strategy_cost.py --variants allgather,allgather:float8,alltoall --out strategy-cost.json
  (make bench-strategy-cost)
"""

from __future__ import annotations

import argparse
import json
import sys

from dropless.core import xla_flags


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="allgather,allgather:float8,alltoall")
    p.add_argument("--preset", default="deepseek-v3-proxy")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    xla_flags.apply()
    import jax

    from dropless.bench.ep import _inputs, _layer_program, _placed, _router_bias, paired_rounds
    from dropless.bench.gmm import environment
    from dropless.core.config import build_config
    from dropless.core.config import ParallelConfig
    from dropless.ep.executor import _named_strategy
    from dropless.core.mesh import make_mesh

    config = build_config(args.preset, {})
    mesh = make_mesh(ParallelConfig(data=1, expert=1), jax.devices()[:1], num_experts=config.moe.num_experts)
    params, x_BSD, cotangent_BSD = _inputs(config, 1, args.tokens)
    arguments = (params, _router_bias(config.moe, "random"), x_BSD, cotangent_BSD)
    plain = _layer_program(config.moe, mesh, None).lower(*arguments).compile()
    plain_args = _placed(plain, arguments)
    records = []
    for variant in [v for v in args.variants.split(",") if v]:
        name, _, dtype = variant.partition(":")
        variant_config = config.replace(**{"moe.dispatch": name, "moe.dispatch_dtype": dtype or "compute"})
        strategy = _named_strategy(variant_config, platform=jax.devices()[0].platform)
        program = _layer_program(config.moe, mesh, strategy).lower(*arguments).compile()
        timing = paired_rounds(plain, plain_args, program, _placed(program, arguments), args.rounds)
        record = {"variant": variant, "tokens": args.tokens, "plain_ms": timing["single_device_ms"],
                  "variant_ms": timing["layer_ms"], "extra_ms": timing["layer_ms"] - timing["single_device_ms"],
                  "plain_over_variant": timing["weak_scaling_efficiency"], "range": timing["efficiency_range"],
                  "rounds_ms": timing["rounds_ms"]}
        records.append(record)
        print(f"{variant}: {record['variant_ms']:.2f} ms against the plain layer's {record['plain_ms']:.2f} "
              f"(+{record['extra_ms']:.2f} ms; ratio {record['plain_over_variant']:.3f}, rounds "
              f"{record['range'][0]:.3f}-{record['range'][1]:.3f})", flush=True)
    with open(args.out, "w") as stream:
        json.dump({"preset": args.preset, "environment": environment(), "records": records}, stream, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
