"""The routed experts' grouped GEMM forward+backward as training runs it: from float32 master weights, on one GPU.

    PYTHONPATH=src python benchmarks/fp8/master_weights.py [--groups 32] [--out F]

Training keeps float32 master weights; each step's products read them through a cast to bf16 (the bf16 path) or
as stored (FP8: the quantizer reads them, GroupedMatmul.weights_as_stored). This times, at DeepSeek-V3's gate+up
shape (65,536 rows, K 7,168, N 4,096, Dirichlet groups), forward and both gradients, the weight's gradient in
float32 as the optimizer takes it:
- bf16: w.astype(bf16), our bf16 grouped GEMM (rows end to end);
- blockwise, cast first: w.astype(bf16), then Fp8Gmm on the expert-aligned rows (quantizing a bf16 copy);
- blockwise, as stored: Fp8Gmm on the float32 weight (what the MoE layer runs: GroupedMatmul.weights_as_stored);
- blockwise, as stored, bf16 weight gradient: the same with `train.fp8_wgrad_dtype=bfloat16` (the kernel writes the
  weight gradient in bf16 at fp8_mosaic.FP8_WGRAD_2BYTE's tile, and the product returns it cast to float32, as in
  a training step).
Each path's results are checked finite; the FP8 paths are compared with the float32-as-stored one (relative
Frobenius error of the output, the input gradient and the first 8 experts' weight gradient: a double rounding
through bf16 separates the cast-first path, the weight gradient's one rounding to bf16 the last). Median of 5
batches (dropless.bench.harness).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from dropless.bench.gmm import group_sizes, to_aligned
from dropless.bench.harness import time_calls
from dropless.bench.records import record_lines
from dropless.fp8 import Fp8Gmm, Recipe
from dropless.fp8.grouped import ALIGN, Fp8Products
from dropless.gmm.dropless_mosaic import DroplessMosaicGmm, TunedContract

M, K, N = 65536, 7168, 4096


def _rel(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.maximum(jnp.linalg.norm(b.ravel()), 1e-30))


def run(groups: int, emit) -> None:
    keys = jax.random.split(jax.random.key(0), 3)
    sizes = group_sizes("dirichlet", M, groups, 0)
    x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
    dy = jax.random.normal(keys[1], (M, N), jnp.bfloat16)
    w = jax.random.normal(keys[2], (groups, K, N), jnp.float32) / np.sqrt(K)
    gs = jnp.asarray(sizes)
    (x_al, dy_al), gs_al, _ = to_aligned(sizes, x, dy)
    bf16 = DroplessMosaicGmm()
    fp8 = Fp8Gmm(Fp8Products(Recipe("blockwise", native=True), bf16, TunedContract()), row_align=ALIGN)
    fp8_bf16_wgrad = Fp8Gmm(Fp8Products(Recipe("blockwise", native=True, wgrad="bfloat16"), bf16, TunedContract()),
                            row_align=ALIGN)
    paths = {
        "bf16, cast from float32": (lambda x, w, gs: bf16(x, w.astype(jnp.bfloat16), gs), x, dy, gs),
        "blockwise, cast to bf16 first": (lambda x, w, gs: fp8(x, w.astype(jnp.bfloat16), gs), x_al, dy_al, gs_al),
        "blockwise, float32 as stored": (lambda x, w, gs: fp8(x, w, gs), x_al, dy_al, gs_al),
        "blockwise, float32 as stored, bf16 weight gradient": (lambda x, w, gs: fp8_bf16_wgrad(x, w, gs), x_al, dy_al,
                                                               gs_al),
    }
    flops = 3 * 2.0 * M * K * N
    results, base = {}, None
    for name, (f, xs, dys, g) in paths.items():
        def fwd_bwd(x, w, dy, g=g, f=f):
            y, pullback = jax.vjp(lambda x, w: f(x, w, g), x, w)
            return (y, *pullback(dy))

        fn = jax.jit(fwd_bwd)
        out = fn(xs, w, dys)
        finite = all(bool(jnp.all(jnp.isfinite(o.astype(jnp.float32)))) for o in out)
        t = time_calls(fn, [(xs, w, dys)])
        base = base or t
        rec = {"groups": groups, "path": name, "ms": round(t * 1e3, 3), "tflops": round(flops / t / 1e12, 1),
               "vs_bf16": round(base / t, 3), "finite": finite, "dw_dtype": str(out[2].dtype)}
        if name.startswith("blockwise"):  # kept for the comparison: y, dx and the first experts' dw (not 30 GB)
            results[name] = (out[0], out[1], out[2][:8])
        del out
        emit(rec)
    stored = results["blockwise, float32 as stored"]
    for other, label in (("blockwise, cast to bf16 first", "as stored against cast first"),
                         ("blockwise, float32 as stored, bf16 weight gradient", "bf16 weight gradient against float32")):
        emit({"groups": groups, "path": label,
              "rel_diff": {p: _rel(u, v) for p, u, v in zip(("y", "dx", "dw"), results[other], stored)}})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", default="32", help="comma-separated group counts (256 does not fit one H200: its "
                   "float32 weight, float32 gradient and both copies are 90 GB)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    record_lines("fp8-master-weights", args.out,
                 lambda emit: [run(int(g), emit) for g in args.groups.split(",")], shape=[M, K, N])


if __name__ == "__main__":
    main()
