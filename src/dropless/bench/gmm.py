"""Grouped-GEMM benchmark: `python -m dropless.bench.gmm` / `dropless bench gmm`.

For each shape class and group-size skew, one run measures the dense matmul of equal FLOPs (the roofline
reference), `jax.lax.ragged_dot`, tokamax's default path, tokamax with its forward tuned, our default path
(`dropless`: the tuned plan for all three products), the FP8 recipes' grouped GEMM (`fp8_*`, on the
expert-aligned rows the MoE layer's permutation writes for it: each group from a multiple of 128, zero rows
between) and the capacity-factor batched GEMM (drops rows), forward and forward+backward. Each path is checked
against an f32 reference before it is timed. Timing: warm-up (compile + one run), then the median over batches
of back-to-back calls that rotate between two input sets, each batch ended by one device sync. Results: a list
of records in JSON (see `RECORD_KEYS`).

Shapes are rows M x K -> N with G groups (local experts); FLOPs count only rows inside groups. `--stages` adds
the whole routed-expert stage (permute -> gate+up -> SwiGLU -> down -> unpermute) against its dense matmuls
(dropless.bench.expert_stage) to the same record.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dropless.bench import expert_stage, report
from dropless.bench.harness import REL_ERR_LIMIT, compile_in_threads, first_line, time_calls
from dropless.bench.records import environment, results_path, write_json
from dropless.core import xla_flags
from dropless.core.arguments import ArgumentParser, check_choices, check_count, check_output
from dropless.core.config import ConfigError
from dropless.gmm import tuning as gmm_tuning
from dropless.gmm.capacity import CapacityGmm
from dropless.fp8 import Fp8Gmm, Recipe, fp8_matmul
from dropless.fp8.grouped import ALIGN, Fp8Products, aligned_sources
from dropless.gmm.dropless_mosaic import DroplessMosaicGmm, TunedContract, tuned_products
from dropless.gmm.tuning import TileConfig
from dropless.gmm.vjp import gmm_from_products


@dataclass(frozen=True)
class ShapeSpec:
    """One grouped GEMM of a model: M rows x K -> N, G local experts."""

    name: str
    m: int
    k: int
    n: int
    g: int
    what: str


SHAPES = {s.name: s for s in (
    ShapeSpec("dsv3-gate-up-e32", 65536, 7168, 4096, 32, "DeepSeek-V3 gate+up, 32 local experts"),
    ShapeSpec("dsv3-down-e32", 65536, 2048, 7168, 32, "DeepSeek-V3 down, 32 local experts"),
    ShapeSpec("dsv3-gate-up-e256", 65536, 7168, 4096, 256, "DeepSeek-V3 gate+up, 256 local experts"),
    ShapeSpec("dsv3-down-e256", 65536, 2048, 7168, 256, "DeepSeek-V3 down, 256 local experts"),
    ShapeSpec("mixtral-gate-up", 32768, 4096, 28672, 8, "Mixtral 8x7B gate+up"),
    ShapeSpec("qwen3-gate-up", 65536, 2048, 1536, 128, "Qwen3-30B-A3B gate+up"),
    ShapeSpec("qwen3-down", 65536, 768, 2048, 128, "Qwen3-30B-A3B down"),
    # The finest-grained published layout: Qwen3-Next-80B-A3B, 512 experts of width 512 on hidden 2048.
    ShapeSpec("qwen3-next-gate-up", 65536, 2048, 1024, 512, "Qwen3-Next-80B-A3B gate+up, 512 experts"),
    ShapeSpec("qwen3-next-down", 65536, 512, 2048, 512, "Qwen3-Next-80B-A3B down, 512 experts"),
    ShapeSpec("tiny", 512, 128, 256, 4, "CPU smoke test"),
)}
DEFAULT_SHAPES = tuple(n for n in SHAPES if n != "tiny")
SKEWS = ("balanced", "dirichlet", "hot")
BACKENDS = ("dense", "dense_fp8", "xla", "tokamax_default", "tokamax_fwd_tuned", "dropless", "fp8_rowwise",
            "fp8_blockwise", "capacity")
GPU_ONLY = ("tokamax_default", "tokamax_fwd_tuned", "dropless", "fp8_rowwise", "fp8_blockwise")
# Paths that take expert-aligned rows (Fp8Gmm.row_align = ALIGN), as the routed experts' permutation hands them
# under train.fp8; their FLOPs count the real rows only, and the check compares those rows.
ALIGNED = ("fp8_rowwise", "fp8_blockwise")
# FP8 paths are checked against the bf16 reference within e4m3's rounding (2^-4 per value, ~4% relative over a
# product of random operands), not REL_ERR_LIMIT: a wrong scale or tile is off by far more.
FP8_REL_ERR_LIMIT = 0.08
# Paths that run for minutes per call on big shapes are timed on one skew only (their cost does not depend on it).
SKEW_INSENSITIVE = ("xla",)
# tokamax's own autotuner's pick on an H200 for both DeepSeek-V3 32-expert shapes (shared/facts/autotune_dsv3_*.json).
TOKAMAX_AUTOTUNED_FWD = TileConfig(128, 64, 128, 4, True, 1, 4)
RECORD_KEYS = ("shape", "skew", "backend", "fwd_tflops", "fwdbwd_tflops", "dense_tflops", "max_rel_err")


def group_sizes(skew: str, m: int, g: int, seed: int = 0) -> np.ndarray:
    """[G] int32 summing to m. balanced: equal; dirichlet: multinomial(m, Dirichlet(alpha=1));
    hot: one expert holds half the rows, a quarter of the experts are empty, the rest share the remainder."""
    rng = np.random.default_rng(seed)
    if skew == "balanced":
        sizes = np.full(g, m // g)
        sizes[: m - sizes.sum()] += 1
    elif skew == "dirichlet":
        sizes = rng.multinomial(m, rng.dirichlet(np.ones(g)))
    elif skew == "hot":
        sizes = np.zeros(g, np.int64)
        sizes[0] = m // 2
        rest = [i for i in range(1, g) if i % 4 != 1] or [0]  # experts 1, 5, 9, ... stay empty
        sizes[rest] += rng.multinomial(m - sizes[0], np.full(len(rest), 1 / len(rest)))
    else:
        raise ValueError(f"skew={skew!r} is not valid; choose one of {', '.join(SKEWS)}.")
    assert sizes.sum() == m and (sizes >= 0).all()
    return sizes.astype(np.int32)


def make_backend(name: str, shape: ShapeSpec, plan=None, capacity_factor: float = 1.25) -> Callable:
    """gmm(x_MK, w_GKN, group_sizes_G) -> y_MN for one benchmarked path (dense: x @ w[0], ignores groups)."""
    if name == "dense":
        # Called with a [1, K, N] weight, so its gradient is one K x N matrix. A bf16 x bf16 -> bf16 dot (XLA
        # accumulates in f32 inside): with preferred_element_type=f32 the backward dots would run in f32.
        return lambda x, w, gs: jnp.dot(x, w[0])
    if name == "dense_fp8":  # the FP8 reference: the rowwise recipe's dense matmul (our e4m3 kernel, one group)
        return lambda x, w, gs: fp8_matmul(x, w[0], Recipe("rowwise", native=True))
    if name.startswith("fp8_"):
        recipe = Recipe(name.removeprefix("fp8_"), native=True)
        return Fp8Gmm(Fp8Products(recipe, DroplessMosaicGmm(), TunedContract()), row_align=ALIGN)
    if name == "xla":
        return lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)
    if name == "tokamax_default":
        import tokamax

        return lambda x, w, gs: tokamax.ragged_dot(x, w, gs, implementation="mosaic")
    if name == "tokamax_fwd_tuned":
        # What reusing a tuning result gives: the forward's config, passed explicitly; tokamax's own backward
        # builds its dx / dW ops afresh, with heuristic configs.
        from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot

        op = PallasMosaicGpuRaggedDot(config=TOKAMAX_AUTOTUNED_FWD.to_tokamax())
        return lambda x, w, gs: op(x, w, group_sizes=gs)
    if name == "dropless":
        # As the MoE layer calls it (dropless.moe.experts): padding rows of the output and of the input gradient
        # left unwritten, as for the gate+up projection (the down projection's input-gradient zeroing the layer's
        # SwiGLU backward fuses). The groups here fill every row, so the results are the same; the zeroing
        # passes would be costs the layer never pays.
        return lambda x, w, gs: gmm_from_products(x, w, gs, tuned_products(plan), None, False, False)
    if name == "capacity":
        return CapacityGmm(capacity_factor)
    raise ValueError(f"backend={name!r} is not valid; choose one of {', '.join(BACKENDS)}.")


def compile_all(paths, shape: ShapeSpec, plan, fwd_args: tuple, fwdbwd_args: tuple, *, dense_args: tuple,
                aligned_args: tuple = (), workers: int = 8) -> dict:
    """{(path, "fwd" | "fwdbwd"): (compiled function, None) or (None, error)}. The Mosaic GPU paths compile in
    parallel threads (seconds each, mostly in compilers that release the GIL); the XLA-only paths one at a
    time, because XLA's GEMM autotuner allocates device memory while it compiles. `aligned_args`: the
    (fwd, fwdbwd) arguments of the ALIGNED paths."""
    def build(job):
        path, which = job
        args = (dense_args if path.startswith("dense") else aligned_args if path in ALIGNED
                else (fwd_args, fwdbwd_args))
        try:
            fns = fwd_and_fwdbwd(make_backend(path, shape, plan))
            fn, a = (fns[0], args[0]) if which == "fwd" else (fns[1], args[1])
            return fn.lower(*a).compile(), None
        except Exception as e:  # noqa: BLE001
            return None, first_line(e)

    jobs = [(p, which) for p in paths for which in ("fwd", "fwdbwd")]
    parallel = [j for j in jobs if j[0] in GPU_ONLY]
    done = dict(zip(parallel, compile_in_threads(build, parallel, workers)))
    return done | {j: build(j) for j in jobs if j not in done}


def xla_ragged_dot_bytes(shape: ShapeSpec) -> int:
    """XLA lowers ragged_dot to a dense masked product over all groups: an [M, G, max(K, N)] bf16 temporary."""
    return shape.m * shape.g * max(shape.k, shape.n) * 2


def device_memory_bytes() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 1 << 62))


def fwd_and_fwdbwd(gmm: Callable):
    """Jitted forward, and forward + both input gradients for a given output cotangent."""
    def fwdbwd(x, w, gs, dy):
        out, pullback = jax.vjp(lambda x, w: gmm(x, w, gs), x, w)
        return (out, *pullback(dy))

    return jax.jit(gmm), jax.jit(fwdbwd)


def to_aligned(sizes: np.ndarray, *arrays_MX):
    """The rows of `arrays_MX` (groups of `sizes` laid end to end) in the expert-aligned layout of the MoE layer's
    permutation under train.fp8 (each group from a multiple of ALIGN rows, zero rows between), the group sizes
    rounded up to ALIGN as the permutation hands them to the GEMM, and back(a_PX) -> a_MX, the inverse for results."""
    gs = jnp.asarray(sizes)
    m = arrays_MX[0].shape[0]
    source_P, valid_P, _ = aligned_sources(gs, m, ALIGN)
    moved = [jnp.where(valid_P[:, None], a[source_P], 0) for a in arrays_MX]
    target_P = jnp.where(valid_P, source_P, m)  # padding rows land past the end and are dropped
    back = jax.jit(lambda a_PX: jnp.zeros((m, a_PX.shape[1]), a_PX.dtype).at[target_P].set(a_PX, mode="drop"))
    return moved, ALIGN * -(-gs // ALIGN), back


def reference_checker(rows: int = 256):
    """check(x, w, dy, out, dx, dw, g, start, end, check_dw) -> relative Frobenius errors [3] of: the output rows
    and the input-gradient rows [start, start + rows) of group g (clipped to the group), and the whole dw[g]."""
    def rel(a, b):
        return jnp.linalg.norm((a - b).ravel()) / jnp.maximum(jnp.linalg.norm(b.ravel()), 1e-6)

    @jax.jit
    def check(x, w, dy, out, dx, dw, g, start, end, check_dw):
        m = x.shape[0]
        lo = jnp.minimum(start, m - rows)
        keep = ((jnp.arange(rows) + lo >= start) & (jnp.arange(rows) + lo < end))[:, None]
        f32 = lambda a: a.astype(jnp.float32)
        xs, dys = (jax.lax.dynamic_slice_in_dim(f32(a), lo, rows) for a in (x, dy))
        wg = f32(w[g])
        ref_out = jnp.where(keep, xs @ wg, 0)
        ref_dx = jnp.where(keep, dys @ wg.T, 0)
        got_out = jnp.where(keep, jax.lax.dynamic_slice_in_dim(f32(out), lo, rows), 0)
        got_dx = jnp.where(keep, jax.lax.dynamic_slice_in_dim(f32(dx), lo, rows), 0)
        in_group = ((jnp.arange(m) >= start) & (jnp.arange(m) < end))[:, None]
        ref_dw = jnp.where(in_group, f32(x), 0).T @ f32(dy)
        err_dw = jnp.where(check_dw, rel(f32(dw[g]), ref_dw), 0.0)
        return jnp.stack([rel(got_out, ref_out), rel(got_dx, ref_dx), err_dw])

    return check


def checked_groups(sizes: np.ndarray) -> list[int]:
    """The largest group, a median one and an empty one (if any): where ragged kernels go wrong."""
    order = np.argsort(sizes)
    picks = [int(order[-1]), int(order[len(order) // 2])]
    empty = np.flatnonzero(sizes == 0)
    return picks + ([int(empty[0])] if empty.size else [])


def _flops(rows: int, shape: ShapeSpec) -> float:
    return 2.0 * rows * shape.k * shape.n


def _operands(shape: ShapeSpec, seed: int):
    """Two input sets to rotate between (xs, dys) and the weights; unit-variance weights scaled by 1/sqrt(K)
    keep outputs O(1)."""
    keys = jax.random.split(jax.random.key(seed), 6)
    bf16 = jnp.bfloat16
    xs = [jax.random.normal(keys[i], (shape.m, shape.k), bf16) for i in (0, 1)]
    dys = [jax.random.normal(keys[2 + i], (shape.m, shape.n), bf16) for i in (0, 1)]
    w = (jax.random.normal(keys[4], (shape.g, shape.k, shape.n), jnp.float32) / math.sqrt(shape.k)).astype(bf16)
    return xs, dys, w


def bench_shape(shape: ShapeSpec, skews, backends, *, plan_path=None, seed: int = 0, batches: int = 5,
                log=print) -> list[dict]:
    """All records of one shape: dense once, then every (skew, backend)."""
    env = environment()
    plan = gmm_tuning.plan_for(shape.m, shape.k, shape.n, shape.g, kind=env["device"], path=plan_path) \
        if env["platform"] == "gpu" else None
    xs, dys, w = _operands(shape, seed)
    check = reference_checker()
    records: list[dict] = []
    base = {"shape": shape.name, "m": shape.m, "k": shape.k, "n": shape.n, "g": shape.g} | env

    gs0 = jnp.asarray(group_sizes("balanced", shape.m, shape.g))
    w_dense = w[:1]  # the dense reference multiplies by one K x N matrix: equal FLOPs, a K x N weight gradient
    fwd_args = [(x, w_dense, gs0) for x in xs]
    fwdbwd_args = [(x, w_dense, gs0, dy) for x, dy in zip(xs, dys)]
    paths = [b for b in backends if b == "dense" or not (b in GPU_ONLY and env["platform"] != "gpu")]
    paths = ["dense"] + [b for b in paths if b != "dense"]
    skipped = {}
    if "xla" in paths and xla_ragged_dot_bytes(shape) > 0.9 * device_memory_bytes():
        skipped["xla"] = f"out of memory (XLA expands ragged_dot densely: needs {xla_ragged_dot_bytes(shape) / 2**30:.0f} GiB)"
    (x_al, dy_al), gs0_al, _ = to_aligned(np.asarray(gs0), xs[0], dys[0])
    compiled = compile_all([p for p in paths if p not in skipped], shape, plan, (xs[0], w, gs0), (xs[0], w, gs0, dys[0]),
                           dense_args=(fwd_args[0], fwdbwd_args[0]),
                           aligned_args=((x_al, w, gs0_al), (x_al, w, gs0_al, dy_al)))
    del x_al, dy_al
    compiled |= {(p, which): (None, why) for p, why in skipped.items() for which in ("fwd", "fwdbwd")}

    dense_record = _dense_record(shape, compiled, fwd_args, fwdbwd_args, batches, log)
    records.append(base | dense_record)
    dense_tf = {"fwd": dense_record["fwd_tflops"], "fwdbwd": dense_record["fwdbwd_tflops"]}
    if "dense_fp8" in paths:  # the same dense matmul in FP8 (rowwise, one group): the FP8 paths' reference
        records.append(base | _dense_record(shape, compiled, fwd_args, fwdbwd_args, batches, log, "dense_fp8"))
    for backend in [p for p in paths[1:] if p != "dense_fp8"]:
        (fwd, err_f), (fwdbwd, err_b) = compiled.pop((backend, "fwd")), compiled.pop((backend, "fwdbwd"))
        for skew in skews:
            if backend in SKEW_INSENSITIVE and "dirichlet" in skews and skew != "dirichlet":
                continue
            rec = base | {"skew": skew, "backend": backend, "dense_tflops": dense_tf["fwdbwd"],
                          "dense_fwd_tflops": dense_tf["fwd"], "error": None, "max_rel_err": None}
            if backend == "dropless":
                rec["plan"] = {p: plan.product(p).to_json() for p in gmm_tuning.PRODUCTS} | {"source": plan.source}
            try:
                if err_f or err_b:
                    raise RuntimeError(err_f or err_b)
                _check_and_time(rec, shape, group_sizes(skew, shape.m, shape.g, seed), (fwd, fwdbwd), check,
                                (xs, dys, w), dense_tf, batches)
                log(f"{shape.name} {skew:9s} {backend:17s} fwd {rec['fwd_tflops']:6.1f} TF/s "
                    f"fwd+bwd {rec['fwdbwd_tflops']:6.1f} TF/s = {rec['fwdbwd_vs_dense']:.0%} of dense, "
                    f"err {rec['max_rel_err']:.1e}")
            except Exception as e:  # noqa: BLE001 - a failing path is a result (e.g. XLA out of memory), not a crash
                text = str(e).split("\n")[0][:300]
                rec["error"] = "out of memory" if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e) else text
                log(f"{shape.name} {skew:9s} {backend:17s} FAILED: {rec['error']}")
            records.append(rec)
        del fwd, fwdbwd
    return records


def _dense_record(shape: ShapeSpec, compiled: dict, fwd_args, fwdbwd_args, batches: int, log,
                  path: str = "dense") -> dict:
    """The dense matmul of equal FLOPs (`dense` in bf16, `dense_fp8` by the rowwise FP8 recipe), timed: the
    roofline reference of every path of the shape."""
    (dense_fwd, err_f), (dense_fwdbwd, err_b) = compiled[(path, "fwd")], compiled[(path, "fwdbwd")]
    if err_f or err_b:
        if path != "dense":
            log(f"{shape.name}: {path} FAILED: {err_f or err_b}")
            return {"skew": None, "backend": path, "error": err_f or err_b, "max_rel_err": None}
        raise RuntimeError(f"{shape.name}: the dense reference failed to compile: {err_f or err_b}")
    dense = {"fwd": time_calls(dense_fwd, fwd_args, batches=batches),
             "fwdbwd": time_calls(dense_fwdbwd, fwdbwd_args, batches=batches)}
    dense_tf = {p: _flops(shape.m, shape) * (3 if p == "fwdbwd" else 1) / t / 1e12 for p, t in dense.items()}
    log(f"{shape.name}: {path} {dense['fwd']*1e3:.2f} ms fwd ({dense_tf['fwd']:.0f} TF/s), "
        f"{dense['fwdbwd']*1e3:.2f} ms fwd+bwd ({dense_tf['fwdbwd']:.0f} TF/s)")
    return {"skew": None, "backend": path, "fwd_ms": dense["fwd"] * 1e3,
            "fwdbwd_ms": dense["fwdbwd"] * 1e3, "fwd_tflops": dense_tf["fwd"],
            "fwdbwd_tflops": dense_tf["fwdbwd"], "dense_tflops": dense_tf["fwdbwd"],
            "dense_fwd_tflops": dense_tf["fwd"], "max_rel_err": None, "error": None}


def _check_and_time(rec: dict, shape: ShapeSpec, sizes: np.ndarray, programs, check, operands, dense_tf: dict,
                    batches: int) -> None:
    """Check one path against the f32 reference on the groups where ragged kernels go wrong, then time it
    forward and forward+backward; fills `rec`. Raises if the path is wrong (it is then not timed)."""
    fwd, fwdbwd = programs
    xs, dys, w = operands
    gs = jnp.asarray(sizes)
    rows = int(sizes.sum())
    if rec["backend"] in ALIGNED:  # timed on the aligned rows, checked on the rows they came from
        moved, gs, back = to_aligned(sizes, *xs, *dys)
        xs_in, dys_in = moved[:len(xs)], moved[len(xs):]
        rec["row_layout"], rec["gemm_rows"] = f"expert-aligned ({ALIGN})", int(gs.sum())
        out, dx, dw = fwdbwd(xs_in[0], w, gs, dys_in[0])
        out, dx = back(out), back(dx)
    else:
        xs_in, dys_in = xs, dys
        out, dx, dw = fwdbwd(xs[0], w, gs, dys[0])
    ends = np.cumsum(sizes)
    errs = []
    cap = None
    if rec["backend"] == "capacity":
        cap = make_backend("capacity", shape).capacity(shape.m, shape.g)
        rec["dropped_rows"] = int(np.maximum(sizes - cap, 0).sum())
    for g in checked_groups(sizes):
        start, end = int(ends[g] - sizes[g]), int(ends[g])
        if cap is not None:  # only the rows the capacity path keeps can match
            end = min(end, start + cap)
        errs.append(np.asarray(check(xs[0], w, dys[0], out, dx, dw, g, start, end, cap is None)))
    per_product = np.max(errs, axis=0)
    rec["rel_err"] = dict(zip(("fwd", "dlhs", "drhs"), map(float, per_product)))
    rec["max_rel_err"] = float(per_product.max())
    del out, dx, dw
    limit = FP8_REL_ERR_LIMIT if rec["backend"].startswith("fp8_") else REL_ERR_LIMIT
    if not rec["max_rel_err"] <= limit:
        raise AssertionError(f"relative error {rec['rel_err']} > {limit}: not timed")
    t_fwd = time_calls(fwd, [(x, w, gs) for x in xs_in], batches=batches)
    t_fb = time_calls(fwdbwd, [(x, w, gs, dy) for x, dy in zip(xs_in, dys_in)], batches=batches)
    rec |= {"fwd_ms": t_fwd * 1e3, "fwdbwd_ms": t_fb * 1e3,
            "fwd_tflops": _flops(rows, shape) / t_fwd / 1e12,
            "fwdbwd_tflops": 3 * _flops(rows, shape) / t_fb / 1e12}
    rec["fwd_vs_dense"] = rec["fwd_tflops"] / dense_tf["fwd"]
    rec["fwdbwd_vs_dense"] = rec["fwdbwd_tflops"] / dense_tf["fwdbwd"]


def write_chart(records: list[dict], path: Path, skew: str = "dirichlet") -> None:
    """Bar chart: fwd+bwd TFLOP/s per shape and path at one skew (`dropless.bench.report.gmm_chart`), its folder
    created as write_json creates the results'."""
    path.parent.mkdir(parents=True, exist_ok=True)
    report.gmm_chart(records, path, BACKENDS, skew)


def markdown_table(records: list[dict], skews=SKEWS) -> str:
    """The BENCHMARKS.md table of these records (`dropless.bench.report.gmm_markdown`)."""
    return report.gmm_markdown(records, skews, BACKENDS)


def parse_args(argv):
    p = ArgumentParser(prog="dropless bench gmm", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated shape classes from: {', '.join(SHAPES)} (default: all but tiny on a GPU, "
                        "tiny on a CPU)")
    p.add_argument("--skews", default=",".join(SKEWS), help=f"comma-separated, from {', '.join(SKEWS)}")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, from {', '.join(BACKENDS)}")
    p.add_argument("--stages", default="", help="comma-separated expert stages to measure as well, from: "
                   f"{', '.join(expert_stage.STAGES)} (default: none)")
    p.add_argument("--stage-paths", default=",".join(expert_stage.STAGE_PATHS),
                   help=f"the stages' grouped GEMMs, from {', '.join(expert_stage.STAGE_PATHS)}")
    p.add_argument("--configs", help="a tuned-config table to use instead of the packaged one")
    p.add_argument("--out", default="benchmarks/results/gmm-{device}.json", help="results JSON ({device} is filled in)")
    p.add_argument("--chart", default="", help="PNG chart path (default: the --out path with .png)")
    p.add_argument("--table", action="store_true", help="print the markdown table at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", type=int, default=5, help="timed batches per measurement (the median is kept)")
    return p.parse_args(argv)


def _refuse_gpu_sizes_on_cpu(shapes: list[str], stages: list[str]) -> None:
    """On a CPU only the tiny shape and stage run: the models' products are trillions of FLOPs over gigabytes of
    operands each (DeepSeek-V3's gate+up 3.8 TFLOP), hours of a CPU's time and more than its memory."""
    if jax.default_backend() != "cpu":
        return
    big = [f"--shapes {name}" for name in shapes if name != "tiny"] + [
        f"--stages {name}" for name in stages if name != "tiny"]
    if big:
        raise ConfigError(f"{', '.join(big)}: a model's size, trillions of FLOPs over gigabytes a product, beyond a "
                          "CPU's time and memory; on a CPU use --shapes tiny (the default there) or --stages tiny.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    shapes = [s for s in (args.shapes or "").split(",") if s]
    stages = [s for s in args.stages.split(",") if s]
    stage_paths = [s for s in args.stage_paths.split(",") if s]
    for flag, chosen, allowed in (("--shapes", shapes, SHAPES), ("--skews", args.skews.split(","), SKEWS),
                                  ("--backends", args.backends.split(","), BACKENDS),
                                  ("--stages", stages, expert_stage.STAGES),
                                  ("--stage-paths", stage_paths, expert_stage.STAGE_PATHS)):
        check_choices(flag, chosen, allowed)
    if args.shapes is not None and not shapes and not stages:
        raise ConfigError(f"--shapes names no shape; choose from {', '.join(SHAPES)}.")
    check_count("--batches", args.batches, why=": the timed batches whose median is kept")
    check_count("--seed", args.seed, 0, why=": numpy's generator of the group sizes takes no negative seed")
    xla_flags.apply()  # before JAX starts a backend
    if args.shapes is None:
        shapes = ["tiny"] if jax.default_backend() == "cpu" else list(DEFAULT_SHAPES)
    _refuse_gpu_sizes_on_cpu(shapes, stages)
    # checked, as the chart's path, before measuring
    out = results_path(args.out, jax.devices()[0].device_kind, inputs={"--configs": args.configs})
    chart = check_output("--chart", args.chart or out.with_suffix(".png"), kind="PNG")
    records: list[dict] = []
    for name in shapes:
        records += bench_shape(SHAPES[name], args.skews.split(","), args.backends.split(","),
                               plan_path=args.configs, seed=args.seed, batches=args.batches)
        write_json(out, records)  # after every shape: a timeout keeps what was done
    for name in stages:
        records += expert_stage.bench_stage(expert_stage.STAGES[name], stage_paths, environment(), seed=args.seed,
                                            batches=args.batches)
        write_json(out, records)
    gemms = [r for r in records if not r["shape"].startswith("stage:")]
    if gemms:
        write_chart(gemms, chart)
    if args.table:
        print(markdown_table(gemms, args.skews.split(",")))
        if stages:
            print(expert_stage.markdown_table(records))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
