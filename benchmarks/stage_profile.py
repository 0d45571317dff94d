"""Where the routed-expert stage's time goes outside its grouped GEMMs (make bench-stage-profile).

    python benchmarks/stage_profile.py --stages qwen3-30b-a3b,dsv3-e256 --out FILE.json [--calls 5]

`dropless bench gmm --stages` measures each stage's time beyond its two grouped GEMMs (`outside_gemms_*_ms`);
this names it. Each stage's forward and forward+backward programs (`expert_stage.stage_programs`: the layer's
LocalExecutor on the default grouped GEMM, Dirichlet routing) are compiled without CUDA graphs, run once, then
`--calls` times under jax.profiler; each device kernel is attributed to its HLO instruction and named scope
(`dropless profile`'s trace reader), and the record lists per program the kernel time per call in the grouped
GEMMs (`gmm_up`/`gmm_down` scopes) and in the rest, and the costliest instructions with their scope and share.
"""

from __future__ import annotations

import argparse

from dropless.bench import expert_stage
from dropless.bench.profile import PROFILE_COMPILER_OPTIONS, profile_calls
from dropless.bench.records import environment, write_json


def profile_program(program, args, calls: int, top: int) -> dict:
    """Kernel time per call of one jitted program, by category, and its `top` costliest HLO instructions."""
    result = profile_calls(program.lower(*args).compile(PROFILE_COMPILER_OPTIONS), args, calls, top=top)
    ms = result["ms_per_step_per_device"]
    return {"kernel_ms": result["kernel_ms_per_step_per_device"], "grouped_gemm_ms": ms["grouped_gemm"],
            "outside_gemms_ms": result["kernel_ms_per_step_per_device"] - ms["grouped_gemm"],
            "unattributed_share": result["unattributed_share"],
            "top_ops": [{k: op[k] for k in ("category", "op", "op_name", "ms_per_step_per_device", "share")}
                        for op in result["top_ops"]]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="qwen3-30b-a3b,dsv3-e256,qwen3-next")
    p.add_argument("--out", required=True)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    record = {"benchmark": "stage-profile", "environment": environment(), "calls": a.calls, "stages": {}}
    for name in a.stages.split(","):
        spec = expert_stage.STAGES[name]
        x, dy, experts = expert_stage.operands(spec, a.seed)
        ids_TK, weights_TK = expert_stage.routing(spec, a.seed)
        fwd, fwdbwd = expert_stage.stage_programs(expert_stage.stage_gmm("default"), ids_TK, weights_TK)
        record["stages"][name] = {
            "fwd": profile_program(fwd, (x, experts), a.calls, a.top),
            "fwdbwd": profile_program(fwdbwd, (x, experts, dy), a.calls, a.top)}
        for program, r in record["stages"][name].items():
            print(f"{name} {program}: kernels {r['kernel_ms']:.3f} ms per call, grouped GEMMs "
                  f"{r['grouped_gemm_ms']:.3f}, outside them {r['outside_gemms_ms']:.3f}", flush=True)
            for op in r["top_ops"]:
                if op["category"] != "grouped_gemm":
                    print(f"    {op['ms_per_step_per_device']:.3f} ms {op['op']:40s} {op['op_name'][-90:]}",
                          flush=True)
        write_json(a.out, record)  # after every stage: a timeout keeps what was done


if __name__ == "__main__":
    main()
