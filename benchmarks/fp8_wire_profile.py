"""Where FP8 rows' extra time goes on one GPU: the proxy layer (allgather on a one-GPU expert axis) with bf16 and
float8 rows, each traced (4 calls), and its memory-bound kernels listed. python3 benchmarks/fp8_wire_profile.py OUTDIR
"""
import sys, json
from dropless import xla_flags
xla_flags.apply()
import jax
from pathlib import Path
from dropless.bench.ep import _inputs, _layer_program, _placed, _router_bias, _profile, _compiled
from dropless.bench import profile
from dropless.cli import build_config
from dropless.config import ParallelConfig
from dropless.parallel.dispatch import AllGather
from dropless.parallel.mesh import make_mesh
from dropless.parallel.wire import Wire
out = Path(sys.argv[1])
devices = jax.devices()[:1]
config = build_config("deepseek-v3-proxy", {})
mesh = make_mesh(ParallelConfig(data=1, expert=1), devices, num_experts=32)
params, x, c = _inputs(config, 1, 16384)
args = (params, _router_bias(config.moe, "random"), x, c)
for name in ("compute", "float8"):
    lowered = _layer_program(config.moe, mesh, AllGather(Wire.from_config(name))).lower(*args)
    _, profiled = _compiled(lowered, {})
    keep = out / f"one-gpu-{name}"
    _profile(profiled, _placed(profiled, args), 4, keep=keep)
    import gzip
    text = gzip.open(keep.with_name(keep.name + ".hlo.txt.gz"), "rt").read()
    b = profile.breakdown(profile.read_trace(keep.with_name(keep.name + ".trace.json.gz")), profile.parse_hlo(text),
                          module=profile.hlo_module_name(text), steps=4, top=80)
    print(name, round(b["kernel_ms_per_step_per_device"], 2), {k: round(v, 2) for k, v in b["ms_per_step_per_device"].items()})
    for op in b["top_ops"]:
        if any(w in (op["op_name"] or op["op"]) for w in ("dispatch", "combine", "convert", "wire")) or op["category"] == "other":
            print("   ", round(op["ms_per_step_per_device"], 3), op["category"], (op["op_name"] or op["op"])[-110:])
