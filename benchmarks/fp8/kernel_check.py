"""Compile, check and time the e4m3 kernels of dropless.gmm.fp8_mosaic on one GPU: both kernels x both scalings.

    PYTHONPATH=src python benchmarks/fp8/kernel_check.py [--small]

Cases: gmm_nt (the fwd product x · W[g], rhs = Wᵀ [G, N, K], bf16 output) and gmm_tn_aligned (the weight gradient
xᵀ · dy from 128-aligned transposed copies, float32 output), each with rowwise and blockwise scales and its
FP8_TILES, FP8_STACKS and FP8_STREAM entries (fwd, drhs). Shape: M = 16,384 rows in 8 groups, sizes Dirichlet(alpha=1)
floored (seed 0: some rows past the groups, groups starting unaligned), K = 2048, N = 4096. Operands random
normal * 32 cast to e4m3; scales random powers of two, 2^-4 .. 2^4, so dequantising is exact in float32.
Reference: the dequantised operands (each e4m3 value times its scale) multiplied per group in float32 with
Precision.HIGHEST; error ||out - ref|| / ||ref|| over the rows in groups (nt) or over every output (tn).
Time: median of 5 batches of 10 back-to-back calls, host clock, one block_until_ready per batch; TF/s counts
2 * rows in groups * K * N. compile_s is the first call (compile and one run).
Prints one JSON line per case; a failing case prints its error's first line and the script goes on.
--small: tiny shapes and tiles in Pallas's GPU interpreter on the CPU, to check this script (times meaningless).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from dropless.gmm.fp8_mosaic import (FP8, FP8_STACKS, FP8_STREAM, FP8_TILES, SCALE_BLOCK, aligned_layout, gmm_nt,
                                      gmm_tn_aligned)
from dropless.gmm.tuning import TileConfig

ITERS, BATCHES = 10, 5
HIGHEST = lax.Precision.HIGHEST
# --small: the tests' interpreter tiles (64 x 64 per consumer, block_k the scale block)
SMALL_TILES = {"nt": TileConfig(64, 64, 128, 2, grid_minor_dim=0, grid_tile_width=2),
               "tn": TileConfig(64, 64, 128, 2, grid_minor_dim=1, grid_tile_width=2)}


def _group_sizes(rows: int, groups: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.floor(rng.dirichlet(np.ones(groups)) * rows).astype(np.int32)


def _e4m3(key, shape):
    return (jax.random.normal(key, shape, jnp.float32) * 32).astype(FP8)


def _pow2(key, shape):
    return jnp.exp2(jax.random.randint(key, shape, -4, 5).astype(jnp.float32))


def _time(fn, *args, batches: int = BATCHES) -> tuple[float, float]:
    """(compile_s, median ms per call over `batches` batches of ITERS calls)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(ITERS):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / ITERS)
    return compile_s, float(np.median(times)) * 1e3 if times else float("nan")


def timed_kernel(fn, args, flops: float) -> dict:
    """A kernel variant's timing fields (`_time`): ms, TF/s for `flops` per call, compile seconds."""
    compile_s, ms = _time(fn, *args)
    return {"ms": round(ms, 4), "tflops": round(flops / (ms * 1e-3) / 1e12, 1), "compile_s": round(compile_s, 2)}


def error_fields(error: BaseException) -> dict:
    """A variant that failed to compile or run, as a result: its exception's type and first line."""
    return {"error": f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"}


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def nt_case(scaling, sizes, k, n, m):
    """(kernel fn of (tile, stack), its args, reference fn, rows compared) of gmm_nt: out[m] = x[m] · w[g(m)]ᵀ,
    scaled."""
    g = len(sizes)
    kx, kw, kls, krs = jax.random.split(jax.random.key(1), 4)
    x, w = _e4m3(kx, (m, k)), _e4m3(kw, (g, n, k))
    kb = k // SCALE_BLOCK
    if scaling == "rowwise":
        lhs_scale, rhs_scale = _pow2(kls, (m,)), _pow2(krs, (g, n))
    else:
        lhs_scale, rhs_scale = _pow2(kls, (kb, m)), _pow2(krs, (g, n // SCALE_BLOCK, kb))
    fn = lambda tile, stack, stream=False, behind=False: jax.jit(lambda x, w, gs, ls, rs: gmm_nt(
        x, w, gs, tile, scaling=scaling, lhs_scale=ls, rhs_scale=rs, stack=stack, stream=stream, behind=behind))

    def reference():
        if scaling == "rowwise":
            x_deq = x.astype(jnp.float32) * lhs_scale[:, None]
            w_deq = w.astype(jnp.float32) * rhs_scale[:, :, None]
        else:
            x_deq = x.astype(jnp.float32) * jnp.repeat(lhs_scale.T, SCALE_BLOCK, axis=1)
            w_deq = w.astype(jnp.float32) * jnp.repeat(jnp.repeat(rhs_scale, SCALE_BLOCK, 1), SCALE_BLOCK, 2)
        ends = np.cumsum(sizes)
        return jnp.concatenate([jnp.dot(x_deq[lo:hi], w_deq[gi].T, precision=HIGHEST)
                                for gi, (lo, hi) in enumerate(zip(ends - sizes, ends))])

    return fn, (x, w, jnp.asarray(sizes), lhs_scale, rhs_scale), reference, int(sizes.sum())


def tn_case(scaling, sizes, k, n, m):
    """The same for gmm_tn_aligned: x [m, k] and dy [m, n] laid into 128-aligned transposed copies xᵀ [k, P],
    dyᵀ [n, P] (zeros between groups); out[g] = xᵀ[:, cols g] · dyᵀ[:, cols g]ᵀ, scaled."""
    g = len(sizes)
    kx, kd, kls, krs = jax.random.split(jax.random.key(2), 4)
    first, blocks = (np.asarray(a) for a in aligned_layout(jnp.asarray(sizes)))
    p = SCALE_BLOCK * int(blocks.sum() + 1)  # one block of slack past the last group
    starts = np.cumsum(sizes) - sizes
    cols = np.concatenate([SCALE_BLOCK * f + np.arange(s) for f, s in zip(first, sizes)]).astype(np.int32)
    rows = int(sizes.sum())
    x, dy = _e4m3(kx, (rows, k)), _e4m3(kd, (rows, n))
    xT = jnp.zeros((k, p), FP8).at[:, cols].set(x.T)
    dyT = jnp.zeros((n, p), FP8).at[:, cols].set(dy.T)
    if scaling == "rowwise":
        lhs_scale, rhs_scale = _pow2(kls, (g, k)), _pow2(krs, (g, n))
    else:
        lhs_scale, rhs_scale = _pow2(kls, (p // SCALE_BLOCK, k)), _pow2(krs, (p // SCALE_BLOCK, n))
    fn = lambda tile, stack, stream=False, behind=False: jax.jit(lambda a, b, gs, ls, rs: gmm_tn_aligned(
        a, b, gs, tile, scaling=scaling, lhs_scale=ls, rhs_scale=rs, stack=stack, stream=stream, behind=behind))

    def reference():
        outs = []
        for gi, (start, size) in enumerate(zip(starts, sizes)):
            xg, dyg = x[start:start + size].astype(jnp.float32), dy[start:start + size].astype(jnp.float32)
            if scaling == "blockwise":  # row r of the group sits in aligned block first + r // 128
                block = first[gi] + np.arange(size) // SCALE_BLOCK
                xg, dyg = xg * lhs_scale[block], dyg * rhs_scale[block]
            out = jnp.dot(xg.T, dyg, precision=HIGHEST)
            outs.append(out * lhs_scale[gi][:, None] * rhs_scale[gi][None, :] if scaling == "rowwise" else out)
        return jnp.stack(outs)

    return fn, (xT, dyT, jnp.asarray(sizes), lhs_scale, rhs_scale), reference, None


def run_case(kernel: str, scaling: str, small: bool) -> dict:
    m, k, n, g = (256, 256, 256, 4) if small else (16384, 2048, 4096, 8)
    sizes = _group_sizes(m, g)
    record = {"kernel": kernel, "scaling": scaling, "M": m, "K": k, "N": n, "G": g, "rows": int(sizes.sum()),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    try:
        key = ("fwd" if kernel == "gmm_nt" else "drhs", scaling)
        tile = SMALL_TILES["nt" if kernel == "gmm_nt" else "tn"] if small else FP8_TILES[key]
        stream = {"stream": key in FP8_STREAM} if scaling == "blockwise" else {}
        record |= {"tile": str(tile), "stack": FP8_STACKS[key], **stream}
        case = nt_case if kernel == "gmm_nt" else tn_case
        make_fn, args, reference, live = case(scaling, sizes, k, n, m)
        fn = make_fn(tile, FP8_STACKS[key], **stream)
        interpret = plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()) if small else contextlib.nullcontext()
        with interpret:
            compile_s, ms = _time(fn, *args, batches=0 if small else BATCHES)  # the interpreter's times: none
            out = fn(*args)
        out = np.asarray(out.astype(jnp.float32))
        record |= {"compile_s": round(compile_s, 2), "ms": None if small else round(ms, 4),
                   "tflops": None if small else round(2 * int(sizes.sum()) * k * n / (ms * 1e-3) / 1e12, 1),
                   "rel_err": _rel_err(out[:live] if live is not None else out, reference()),
                   "finite": bool(np.isfinite(out[:live] if live is not None else out).all())}
        record["ok"] = record["finite"] and record["rel_err"] < 1e-2  # bf16 / reduced-precision accumulation
    except Exception as e:  # noqa: BLE001 -- a failing case is a result here
        record |= {"ok": False, "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"}
    print(json.dumps(record), flush=True)
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes in Pallas's GPU interpreter (CPU)")
    args = parser.parse_args()
    for kernel in ("gmm_nt", "gmm_tn_aligned"):
        for scaling in ("rowwise", "blockwise"):
            run_case(kernel, scaling, args.small)


if __name__ == "__main__":
    main()
