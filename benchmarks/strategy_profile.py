"""Where a dispatch strategy's extra time goes on one GPU (benchmarks/strategy_cost.py measures how much): the
DeepSeek-V3-proxy layer with each variant's strategy on a one-GPU `expert` axis (its collectives do nothing), each
traced for 4 calls; prints the kernel time by category and every memory-bound kernel ("other") over 0.04 ms, and
keeps the traces and HLO text in OUTDIR. Variants as in strategy_cost.py: a strategy name, ":float8" for FP8 rows.

  python3 benchmarks/strategy_profile.py OUTDIR allgather,allgather:float8,ragged
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

from dropless.core import xla_flags

CALLS = 4


def main(out: Path, variants: list[str]) -> int:
    xla_flags.apply()
    import jax

    from dropless.bench import profile
    from dropless.bench.ep import _compiled, _inputs, _layer_program, _placed, _profile, _router_bias
    from dropless.core.config import build_config
    from dropless.core.config import ParallelConfig
    from dropless.ep.executor import _named_strategy
    from dropless.core.mesh import make_mesh

    config = build_config("deepseek-v3-proxy", {})
    mesh = make_mesh(ParallelConfig(data=1, expert=1), jax.devices()[:1], num_experts=config.moe.num_experts)
    params, x_BSD, cotangent_BSD = _inputs(config, 1, 16384)
    arguments = (params, _router_bias(config.moe, "random"), x_BSD, cotangent_BSD)
    for variant in variants:
        name, _, dtype = variant.partition(":")
        variant_config = config.replace(**{"moe.dispatch": name, "moe.dispatch_dtype": dtype or "compute"})
        program = _layer_program(config.moe, mesh, _named_strategy(variant_config, jax.devices()[0].platform))
        _, profiled = _compiled(program.lower(*arguments), {})
        keep = out / f"one-gpu-{variant.replace(':', '-')}"
        _profile(profiled, _placed(profiled, arguments), CALLS, keep=keep)
        with gzip.open(keep.with_name(keep.name + ".hlo.txt.gz"), "rt") as stream:
            text = stream.read()
        result = profile.breakdown(profile.read_trace(keep.with_name(keep.name + ".trace.json.gz")),
                                   profile.parse_hlo(text), module=profile.hlo_module_name(text), steps=CALLS, top=200)
        by_category = {k: round(v, 2) for k, v in result["ms_per_step_per_device"].items()}
        print(f"{variant}: {result['kernel_ms_per_step_per_device']:.2f} ms of kernels, {by_category}")
        for op in result["top_ops"]:
            if op["category"] == "other" and op["ms_per_step_per_device"] > 0.04:
                print(f"    {op['ms_per_step_per_device']:.3f} ms {op['op']} {op['op_name'][-90:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2].split(",")))
