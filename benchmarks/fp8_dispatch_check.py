"""On the GPUs: the DeepSeek-V3-proxy MoE layer (bf16, forward + backward, 2 devices) with moe.dispatch_dtype=float8
against the same layer with bf16 rows on the wire, per strategy: relative error of the gradients (input,
experts: they see the rounding of both trips towards the experts), and which collectives of the compiled
program carry float8. Prints one line per strategy and writes --out (JSON). The layer benchmark
(`dropless bench ep moe.dispatch_dtype=float8`) measures the speed.

  python3 benchmarks/fp8_dispatch_check.py --out fp8-check.json      (make bench-fp8-check)
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from dropless.core import xla_flags


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="deepseek-v3-proxy")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per device")
    p.add_argument("--strategies", default="allgather,alltoall,ragged")
    args = p.parse_args()
    xla_flags.apply()
    import jax
    import numpy as np

    from dropless.bench.ep import _inputs, _layer_program, _placed, _router_bias
    from dropless.bench.gmm import environment
    from dropless.core.config import build_config
    from dropless.core.config import ParallelConfig
    from dropless.ep import make_strategy
    from dropless.core.mesh import make_mesh

    devices = jax.devices()[:2]
    config = build_config(args.preset, {})
    mesh = make_mesh(ParallelConfig(data=1, expert=2), devices, num_experts=config.moe.num_experts)
    params, x_BSD, cotangent_BSD = _inputs(config, 2, args.tokens)
    arguments = (params, _router_bias(config.moe, "random"), x_BSD, cotangent_BSD)

    def run(strategy_name, dtype):
        cfg = config.replace(**{"moe.dispatch": strategy_name, "parallel.expert": 2, "moe.dispatch_dtype": dtype})
        compiled = _layer_program(cfg.moe, mesh, make_strategy(cfg, platform="gpu")).lower(*arguments).compile()
        (grad_experts, grad_x), (_, stats) = compiled(*_placed(compiled, arguments))
        carried = []  # the collectives whose result type (before the opcode) is float8
        for line in compiled.as_text().splitlines():
            op = re.search(r" (all-gather|all-to-all|reduce-scatter|ragged-all-to-all)(?:-start)?\(", line)
            if op and "f8e4m3fn" in line[:op.start()]:
                carried.append(op.group(1))
        return jax.device_get((grad_experts, grad_x)), int(stats.tokens_dropped), carried

    def relative(got, want):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))

    records = []
    for name in [s for s in args.strategies.split(",") if s]:
        (experts_bf16, x_bf16), _, _ = run(name, "compute")
        (experts_fp8, x_fp8), dropped, carried = run(name, "float8")
        record = {"preset": args.preset, "strategy": name, "tokens_per_device": args.tokens, "tokens_dropped": dropped,
                  "float8_collectives": carried,
                  "grad_x_relative_error": relative(x_fp8, x_bf16),
                  "grad_gate_up_relative_error": relative(experts_fp8["gate_up"], experts_bf16["gate_up"]),
                  "grad_down_relative_error": relative(experts_fp8["down"], experts_bf16["down"])}
        records.append(record)
        print(json.dumps(record), flush=True)
    with open(args.out, "w") as stream:
        json.dump({"environment": environment(), "records": records}, stream, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
