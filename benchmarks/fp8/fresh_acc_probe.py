"""The blockwise kernels with each K block's fresh accumulator left unwritten and its first wgmma issued with
scale-d off (dropless.gmm.fresh_acc) against the same kernels with the zero fill, on one GPU
(`make bench-fp8-fresh-acc`).

    python benchmarks/fp8/fresh_acc_probe.py --out fp8-fresh-acc.json

Every product of DeepSeek-V3's two expert projections at the tables' tiles (kernel_check's operands: 65,536 rows
in 32 Dirichlet groups; then gate-up's forward and weight gradient in 256 groups), each kernel compiled
with `fresh_acc.ENABLED` off and on, timed alternately twice (kernel_check's timing: median of 5 batches of 10
calls), the outputs compared bit for bit. Then `Fp8Gmm` forward+backward at gate-up on aligned rows both ways
beside the bf16 grouped GEMM, in the same call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from breakdown import fwd_bwd  # noqa: E402
from kernel_check import nt_case, timed_kernel, tn_case  # noqa: E402

from dropless.bench.gmm import group_sizes, to_aligned  # noqa: E402
from dropless.bench.harness import same_bits, time_calls  # noqa: E402
from dropless.bench.records import environment, write_json  # noqa: E402
from dropless.fp8 import Fp8Gmm, Recipe  # noqa: E402
from dropless.fp8.grouped import ALIGN, Fp8Products  # noqa: E402
from dropless.gmm import fp8_mosaic, fresh_acc  # noqa: E402
from dropless.gmm.dropless_mosaic import DroplessMosaicGmm, TunedContract  # noqa: E402

# (name, case, K and N of the case, product in fp8_mosaic's tables, groups)
SHAPES = [("gate-up fwd", nt_case, 7168, 4096, "fwd", 32), ("gate-up dlhs", nt_case, 4096, 7168, "dlhs", 32),
          ("down fwd", nt_case, 2048, 7168, "fwd", 32), ("down dlhs", nt_case, 7168, 2048, "dlhs", 32),
          ("gate-up drhs", tn_case, 7168, 4096, "drhs", 32), ("down drhs", tn_case, 2048, 7168, "drhs", 32),
          ("gate-up fwd", nt_case, 7168, 4096, "fwd", 256), ("gate-up drhs", tn_case, 7168, 4096, "drhs", 256)]


def lowered(make, args, fresh: bool):
    """A fresh jit of make()'s function lowered for args with fresh_acc on or off; the kernels' own jit caches
    are cleared first, so neither lowering reuses the other's kernels."""
    fp8_mosaic.gmm_nt.clear_cache()
    fp8_mosaic.gmm_tn_aligned.clear_cache()
    enabled, fresh_acc.ENABLED = fresh_acc.ENABLED, fresh
    try:
        return jax.jit(make()).lower(*args)
    finally:
        fresh_acc.ENABLED = enabled


def compiled(make, args) -> tuple[dict, bool]:
    """The executables with the zero fill (False) and without (True), and whether their programs differ (they
    must: the kernels' code differs)."""
    low = {fresh: lowered(make, args, fresh) for fresh in (False, True)}
    return {fresh: low[fresh].compile() for fresh in low}, low[True].as_text() != low[False].as_text()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=65536)
    a = p.parse_args()
    m = a.rows
    records, env = [], environment()

    def emit(rec):
        print(json.dumps(rec), flush=True)
        records.append(rec)
        write_json(a.out, {"benchmark": "fp8-fresh-acc", "environment": env, "rows": m, "records": records})

    for name, case, k, n, product, g in SHAPES:
        sizes = group_sizes("dirichlet", m, g, 0)
        make_fn, args, _, live = case("blockwise", sizes, k, n, m)
        tile = fp8_mosaic.FP8_TILES[(product, "blockwise")] if product == "drhs" else \
            fp8_mosaic.default_tile(product, m, k, n, g, "blockwise")
        stack, stream = fp8_mosaic.default_stack(product, "blockwise"), fp8_mosaic.default_stream(product, "blockwise")
        flops = 2 * int(sizes.sum()) * k * n
        exe, differ = compiled(lambda: make_fn(tile, stack, stream).__wrapped__, args)
        outs = {fresh: exe[fresh](*args) for fresh in exe}
        live_rows = (lambda o: o[:live]) if live is not None else (lambda o: o)
        equal = same_bits(live_rows(outs[True]), live_rows(outs[False]))
        del outs
        timings = {False: [], True: []}
        for _ in range(2):
            for fresh in (False, True):
                timings[fresh].append(timed_kernel(exe[fresh], args, flops))
        rec = {"shape": name, "groups": g, "tile": str(tile), "stack": stack, "stream": stream,
               "programs_differ": differ, "fresh_equals_zero_filled": equal}
        for fresh, label in ((False, "zero_filled"), (True, "fresh")):
            rec[label] = {"ms": [t["ms"] for t in timings[fresh]], "tflops": [t["tflops"] for t in timings[fresh]]}
        rec["zero_filled_over_fresh"] = round(min(rec["zero_filled"]["ms"]) / min(rec["fresh"]["ms"]), 4)
        emit(rec)
        del exe, args

    k, n, g = 7168, 4096, 32
    sizes = group_sizes("dirichlet", m, g, 0)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    (x_al, dy_al), gs_al, _ = to_aligned(sizes, x, dy)
    gs = jnp.asarray(sizes)
    flops = 3 * 2.0 * m * k * n
    bf16 = DroplessMosaicGmm()
    fp8 = Fp8Gmm(Fp8Products(Recipe("blockwise", native=True), bf16, TunedContract()), row_align=ALIGN)
    fp8_fn = lambda gs, x, w, dy: fwd_bwd(lambda x, w: fp8(x, w, gs), x, w, dy)
    bf16_fn = jax.jit(lambda gs, x, w, dy: fwd_bwd(lambda x, w: bf16(x, w, gs), x, w, dy))
    fp8_args = (gs_al, x_al, w, dy_al)
    exe, differ = compiled(lambda: lambda *args: fp8_fn(*args), fp8_args)
    equal = same_bits(exe[True](*fp8_args), exe[False](*fp8_args))
    times = {"bf16": [], False: [], True: []}
    for _ in range(2):
        times["bf16"].append(time_calls(bf16_fn, [(gs, x, w, dy)]))
        for fresh in (False, True):
            times[fresh].append(time_calls(exe[fresh], [fp8_args]))
    rec = {"shape": "gate-up", "piece": "Fp8Gmm fwd+bwd (aligned rows) beside the bf16 grouped GEMM fwd+bwd",
           "programs_differ": differ, "fresh_equals_zero_filled": equal}
    for key, label in (("bf16", "bf16"), (False, "blockwise zero-filled"), (True, "blockwise fresh")):
        rec[label] = {"ms": [round(t * 1e3, 4) for t in times[key]],
                      "tflops": [round(flops / t / 1e12, 1) for t in times[key]]}
    rec["zero_filled_over_fresh"] = round(min(times[False]) / min(times[True]), 4)
    rec["bf16_over_fresh"] = round(min(times["bf16"]) / min(times[True]), 4)
    rec["bf16_over_zero_filled"] = round(min(times["bf16"]) / min(times[False]), 4)
    emit(rec)


if __name__ == "__main__":
    main()
