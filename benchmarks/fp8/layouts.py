"""The blockwise e4m3 kernels' consumer layouts and tiles on one GPU, each checked and timed, beside the bf16
grouped GEMM and the whole FP8 product under each layout table (part of `make bench-fp8-layouts`).

    python benchmarks/fp8/layouts.py --out fp8-layouts.json [--rows 65536 --groups 32] [--part kernels|pieces]

Kernels (dropless.gmm.fp8_mosaic, blockwise scaling) at DeepSeek-V3's shapes, rows in Dirichlet(alpha=1) groups
(seed 0), operands and scales as benchmarks/fp8/kernel_check.py makes them (e4m3 values, power-of-two scales):
  gate-up fwd   gmm_nt          x [M, 7168] · Wᵀ[g]          -> [M, 4096]
  gate-up dlhs  gmm_nt          dy [M, 4096] · W[g] (as [g, 7168, 4096])  -> [M, 7168]
  down fwd      gmm_nt          h [M, 2048] · Wᵀ[g]          -> [M, 7168]
  down dlhs     gmm_nt          dy [M, 7168] · W[g] (as [g, 2048, 7168])  -> [M, 2048]
  gate-up drhs  gmm_tn_aligned  xᵀ [7168, P] · dyᵀ [4096, P] -> [G, 7168, 4096]
  down drhs     gmm_tn_aligned  hᵀ [2048, P] · dyᵀ [7168, P] -> [G, 2048, 7168]
Each variant (stack "n": the two consumers side by side along N; "m": stacked along M; its tile, the pipeline
stages that fit in shared memory beside its output blocks, which can be fewer than the tile asks; a consumer
wider than 128 columns runs 128-column accumulator slices one after another; `stream`: one ring of stages across
the CTA's tiles instead of a pipeline per tile; "stores waited": streamed, each tile's output store waited for
where it is issued, a diagnostic of the streamed 64 x 256 kernel; "behind": streamed, each K block's product
promoted while the next block's wgmma runs, one 128-column slice per consumer) gets one record:
ms (kernel_check's timing: median of 5 batches of 10 calls), TF/s over the rows in groups, and whether its output
equals the first variant's bit for bit (every layout and tile sums each output's K blocks in the same order, so
they must; kernel_check.py and the tests hold the first against float32 references). At gate-up fwd the probe's
unscaled e4m3 kernel (e4m3_probe_kernels.gmm_nt_ws: consumers side by side, no scales) runs at the blockwise tile
and at its own best, so the promotion's cost is read at equal tiles in the same call. Then, at gate-up, the bf16
grouped GEMM (fwd, fwd+bwd) and dropless.fp8.Fp8Gmm fwd and fwd+bwd on expert-aligned rows with the blockwise
recipe under fp8_mosaic's tables, with no product and with every product streamed, and with gmm_nt's products
at 64x128 in five stages, per tile and with every product streamed and promoted behind, so each ratio to bf16
comes from one run; then one call's weight quantization alone, Fp8Gmm fwd+bwd with the weight's copies made
outside it (as each microbatch runs under gradient accumulation) and Fp8Gmm on the rows laid end to end
(row_align=1: only the weight gradient's copies padded, by a column gather).
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
from e4m3_probe_kernels import gmm_nt_ws  # noqa: E402
from kernel_check import error_fields, nt_case, timed_kernel, tn_case  # noqa: E402

from dropless.bench.gmm import group_sizes, to_aligned  # noqa: E402
from dropless.bench.harness import same_bits, time_calls  # noqa: E402
from dropless.bench.records import environment, write_json  # noqa: E402
from dropless.fp8 import Fp8Gmm, Recipe  # noqa: E402
from dropless.fp8.grouped import ALIGN, Fp8Products  # noqa: E402
from dropless.fp8.recipe import CachedWeight, weight_copies  # noqa: E402
from dropless.gmm import fp8_mosaic  # noqa: E402
from dropless.gmm.dropless_mosaic import DroplessMosaicGmm, TunedContract  # noqa: E402
from dropless.gmm.tuning import TileConfig  # noqa: E402

M_MINOR = dict(grid_minor_dim=0, grid_tile_width=8)
N_MINOR = dict(grid_minor_dim=1, grid_tile_width=4)
# (stack, tile, stream): each tile with one pipeline per output tile and streamed (`stream=True`: one ring of
# stages across the CTA's tiles); at 64x256 also streamed with its stores waited for (_with_waited_stores).
NT_VARIANTS = [
    ("m", TileConfig(64, 256, 128, 3, **M_MINOR), False),  # two 128-column slices per consumer: a 128x256 CTA tile
    ("m", TileConfig(64, 256, 128, 3, **M_MINOR), True),
    ("m", TileConfig(64, 256, 128, 3, **M_MINOR), "stores waited"),  # each tile's store finished before the next
    ("m", TileConfig(64, 128, 128, 5, **M_MINOR), False),
    ("m", TileConfig(64, 128, 128, 5, **M_MINOR), True),
    ("n", TileConfig(64, 128, 128, 4, **M_MINOR), False),  # the unscaled kernel's layout and tile, below
    # Streamed, each K block's product promoted while the next block's wgmma runs (gmm_nt(behind=True)); a slot is
    # held one step longer, so also with one stage more asked for (_stages keeps what fits).
    ("m", TileConfig(64, 128, 128, 5, **M_MINOR), "behind"),
    ("m", TileConfig(64, 128, 128, 6, **M_MINOR), "behind"),
    ("n", TileConfig(64, 128, 128, 4, **M_MINOR), "behind"),
]
# The weight gradient; at 64x256 one stage fits beside float32 outputs.
TN_VARIANTS = [("m", TileConfig(64, 128, 128, 4, **M_MINOR), stream) for stream in (False, True, "behind")]
UNSCALED = [TileConfig(64, 128, 128, 4, **M_MINOR), TileConfig(128, 128, 128, 3, **M_MINOR)]
# (name, kernel case, K and N of the case: the contraction and output columns of gmm_nt, the two row counts of tn)
SHAPES = [("gate-up fwd", nt_case, 7168, 4096), ("gate-up dlhs", nt_case, 4096, 7168),
          ("down fwd", nt_case, 2048, 7168), ("down dlhs", nt_case, 7168, 2048), ("gate-up drhs", tn_case, 7168, 4096),
          ("down drhs", tn_case, 2048, 7168)]


# One fused reduction, no temporary of the output's size (a weight gradient at 256 groups is 30 GB).
_finite = jax.jit(lambda a: jnp.all(jnp.isfinite(a)))


def _with_waited_stores(fn):
    """fn (jitted) traced with the streamed kernel's output stores waited for where they are issued (as the
    per-tile kernel does) instead of left running under the next tile's steps: a diagnostic of the streamed
    gmm_nt's run-time cost, not a product path. The kernel module's `store_rows` is swapped only while fn's first
    call traces and compiles; later calls reuse fn's executable."""
    warmed = []

    def wrapper(*args):
        if not warmed:
            original = fp8_mosaic.store_rows
            fp8_mosaic.gmm_nt.clear_cache()  # so that fn's trace enters the kernel's anew
            fp8_mosaic.store_rows = lambda *a, **k: original(*a, **(k | {"wait": True}))
            try:
                jax.block_until_ready(fn(*args))
            finally:
                fp8_mosaic.store_rows = original
                fp8_mosaic.gmm_nt.clear_cache()
            warmed.append(True)
        return fn(*args)

    return wrapper


def _fitting_stages(case, tile, stack) -> int:
    """The stages the kernel runs: gmm_nt writes bf16 (kernel_check's nt case), gmm_tn_aligned float32, and
    blockwise scaling pipelines one row-scale vector (nt) or a row and a column vector (tn) per stage."""
    cta_m, cta_n = fp8_mosaic.cta_shape(tile, stack)
    if case is tn_case:
        return fp8_mosaic._stages(tile, jnp.float32, "blockwise", (cta_m, cta_n), stack)
    return fp8_mosaic._stages(tile, jnp.bfloat16, "blockwise", (cta_m,), stack)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--part", choices=("all", "kernels", "pieces"), default="all",
                   help="kernels: gmm_nt's and gmm_tn_aligned's variants and the unscaled kernel; pieces: the bf16 "
                        "grouped GEMM and Fp8Gmm under each table")
    a = p.parse_args()
    m, g = a.rows, a.groups
    sizes = group_sizes("dirichlet", m, g, 0)
    records, env = [], environment()

    def emit(rec):
        print(json.dumps(rec), flush=True)
        records.append(rec)
        write_json(a.out, {"benchmark": "fp8-layouts", "environment": env, "rows": m, "groups": g,
                           "records": records})

    for name, case, k, n in SHAPES if a.part != "pieces" else ():
        make_fn, args, _, live = case("blockwise", sizes, k, n, m)
        first = None
        for stack, tile, stream in TN_VARIANTS if case is tn_case else NT_VARIANTS:
            rec = {"shape": name, "stack": stack, "tile": str(tile), "stages": _fitting_stages(case, tile, stack),
                   "stream": stream}
            try:
                fn = make_fn(tile, stack, bool(stream), stream == "behind")
                if stream == "stores waited":
                    fn = _with_waited_stores(fn)
                rec |= timed_kernel(fn, args, 2 * int(sizes.sum()) * k * n)
                out = fn(*args)
                out = out[:live] if live is not None else out
                rec |= {"equals_first": None if first is None else same_bits(out, first), "finite": bool(_finite(out))}
                first = out if first is None else first
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a result
                rec |= error_fields(e)
            emit(rec)
            out = None  # a weight gradient at 256 groups is 30 GB: one variant's output alive beside `first` at most
        if name == "gate-up fwd":
            x, w, gs = args[:3]
            for tile in UNSCALED:
                rec = {"shape": name, "stack": "n", "tile": str(tile), "unscaled": True}
                try:
                    fn = jax.jit(lambda x, w, gs, tile=tile: gmm_nt_ws(x, w, gs, tile))
                    rec |= timed_kernel(fn, (x, w, gs), 2 * int(sizes.sum()) * k * n)
                except Exception as e:  # noqa: BLE001 - as above
                    rec |= error_fields(e)
                emit(rec)
        del args, first
    if a.part == "kernels":
        return

    k, n = 7168, 4096
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    gs = jnp.asarray(sizes)
    (x_al, dy_al), gs_al, _ = to_aligned(sizes, x, dy)
    flops = 2.0 * m * k * n
    bf16 = DroplessMosaicGmm()

    def timed(piece, fn, *args, gemm_flops):
        t = time_calls(jax.jit(fn), [args])
        emit({"shape": "gate-up", "piece": piece, "ms": round(t * 1e3, 4),
              "tflops": round(gemm_flops / t / 1e12, 1) if gemm_flops else None})

    timed("bf16 gmm fwd", lambda gs, x, w: bf16(x, w, gs), gs, x, w, gemm_flops=flops)
    timed("bf16 gmm fwd+bwd", lambda gs, x, w, dy: fwd_bwd(lambda x, w: bf16(x, w, gs), x, w, dy), gs, x, w, dy,
          gemm_flops=3 * flops)
    tiles, streamed = dict(fp8_mosaic.FP8_TILES), fp8_mosaic.FP8_STREAM
    narrow = tiles | {(p, "blockwise"): fp8_mosaic.FP8_NARROW for p in ("fwd", "dlhs")}
    every = frozenset((p, "blockwise") for p in fp8_mosaic.PRODUCTS)
    behind = fp8_mosaic.FP8_BEHIND
    for name, tile_table, stream_set, behind_set in (
            ("the tables", tiles, streamed, behind),
            ("the tables, no product streamed", tiles, frozenset(), frozenset()),
            ("the tables, every product streamed", tiles, every, frozenset()),
            ("gmm_nt at 64x128 in five stages", narrow, streamed, frozenset()),
            ("gmm_nt at 64x128 in five stages, every product streamed and promoted behind", narrow, every, every)):
        # The tables are read when a product is traced: each jit below traces anew.
        fp8_mosaic.FP8_TILES.update(tile_table)
        fp8_mosaic.FP8_STREAM, fp8_mosaic.FP8_BEHIND = stream_set, behind_set
        fp8 = Fp8Gmm(Fp8Products(Recipe("blockwise", native=True), bf16, TunedContract()), row_align=ALIGN)
        timed(f"blockwise Fp8Gmm fwd (aligned rows), {name}", lambda gs, x, w: fp8(x, w, gs), gs_al, x_al, w,
              gemm_flops=flops)
        timed(f"blockwise Fp8Gmm fwd+bwd (aligned rows), {name}",
              lambda gs, x, w, dy: fwd_bwd(lambda x, w: fp8(x, w, gs), x, w, dy), gs_al, x_al, w, dy_al,
              gemm_flops=3 * flops)
    fp8_mosaic.FP8_TILES.update(tiles)
    fp8_mosaic.FP8_STREAM, fp8_mosaic.FP8_BEHIND = streamed, behind
    # Under the tables: what a call spends quantizing the weight (both e4m3 copies), and the product on rows laid
    # end to end (only the weight gradient's copies padded to 128-row groups, by a column gather).
    recipe = Recipe("blockwise", native=True)
    timed("blockwise weight copies (both e4m3 layouts, one call's quantization of W)",
          lambda w: weight_copies(w, recipe), w, gemm_flops=0.0)
    # The weight's copies made outside (once per optimizer step under gradient accumulation, train.fp8_cache_weights):
    # what each microbatch's products cost on top of them.
    fp8 = Fp8Gmm(Fp8Products(recipe, bf16, TunedContract()), row_align=ALIGN)
    w_fwd, w_dlhs = jax.jit(lambda w: weight_copies(w, recipe))(w)
    timed("blockwise Fp8Gmm fwd+bwd (aligned rows), the weight's copies made outside",
          lambda gs, x, w, dy, c0, c1: fwd_bwd(lambda x, w: fp8(x, CachedWeight(w, c0, c1), gs), x, w, dy),
          gs_al, x_al, w, dy_al, w_fwd, w_dlhs, gemm_flops=3 * flops)
    del w_fwd, w_dlhs
    fp8 = Fp8Gmm(Fp8Products(recipe, bf16, TunedContract()), row_align=1)
    timed("blockwise Fp8Gmm fwd (rows end to end), the tables", lambda gs, x, w: fp8(x, w, gs), gs, x, w,
          gemm_flops=flops)
    timed("blockwise Fp8Gmm fwd+bwd (rows end to end), the tables",
          lambda gs, x, w, dy: fwd_bwd(lambda x, w: fp8(x, w, gs), x, w, dy), gs, x, w, dy, gemm_flops=3 * flops)


if __name__ == "__main__":
    main()
