"""The blockwise weight gradient's output dtype and tiles on one GPU, each kernel checked and timed (part of `make
bench-fp8-wgrad`).

    python benchmarks/fp8/wgrad_tiles.py --out fp8-wgrad-tiles.json [--rows 65536 --groups 32]

`gmm_tn_aligned` (dropless.gmm.fp8_mosaic, blockwise scaling, the consumers stacked along M) at DeepSeek-V3's two
weight gradients, rows in Dirichlet(alpha=1) groups (seed 0), operands and scales as benchmarks/fp8/kernel_check.py
makes them (e4m3 values, power-of-two scales):
  gate-up drhs  xᵀ [7168, P] · dyᵀ [4096, P] -> [G, 7168, 4096]
  down drhs     hᵀ [2048, P] · dyᵀ [7168, P] -> [G, 2048, 7168]
Variants: the table's float32 kernel (64x128 per consumer, four stages, streamed) first, then bfloat16 outputs
(`train.fp8_wgrad_dtype=bfloat16`) at the same tile, at 64x128 in five stages (`fp8_mosaic.FP8_WGRAD_2BYTE`, what
the option runs), at 64x256 (two 128-column accumulator slices, three stages) streamed and per tile, and float32 at
64x256 with the one stage that fits. Each gets one record: the stages it runs, ms (kernel_check's timing: median
of 5 batches of 10 calls), TF/s over the rows in groups, and whether its output equals the first's rounded to its
dtype bit for bit (one float32 carry per output, the same K blocks in the same order, one rounding: it must).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from kernel_check import error_fields, timed_kernel, tn_case  # noqa: E402

from dropless.bench.gmm import group_sizes  # noqa: E402
from dropless.bench.harness import same_bits  # noqa: E402
from dropless.bench.records import record_lines  # noqa: E402
from dropless.gmm import fp8_mosaic  # noqa: E402
from dropless.gmm.tuning import TileConfig  # noqa: E402

M_MINOR = dict(grid_minor_dim=0, grid_tile_width=8)
TABLE = fp8_mosaic.FP8_TILES[("drhs", "blockwise")]
WIDE = TileConfig(64, 256, 128, 3, **M_MINOR)
# (tile, out dtype, stream)
VARIANTS = [
    (TABLE, jnp.float32, True),
    (TABLE, jnp.bfloat16, True),
    (fp8_mosaic.FP8_WGRAD_2BYTE, jnp.bfloat16, True),
    (WIDE, jnp.bfloat16, True),
    (WIDE, jnp.bfloat16, False),
    (WIDE, jnp.float32, True),
]
SHAPES = [("gate-up drhs", 7168, 4096), ("down drhs", 2048, 7168)]
_finite = jax.jit(lambda a: jnp.all(jnp.isfinite(a)))  # one fused reduction, no temporary of the output's size


def _rounded_equal(out, first) -> bool:
    return same_bits(out, first.astype(out.dtype))


def run(rows: int, groups: int, emit) -> None:
    sizes = group_sizes("dirichlet", rows, groups, 0)
    for name, k, n in SHAPES:
        _, args, _, _ = tn_case("blockwise", sizes, k, n, rows)
        first = None
        for tile, out_dtype, stream in VARIANTS:
            stages = fp8_mosaic._stages(tile, out_dtype, "blockwise", fp8_mosaic.cta_shape(tile, "m"), "m")
            rec = {"groups": groups, "shape": name, "tile": str(tile), "stages": stages,
                   "out_dtype": jnp.dtype(out_dtype).name, "stream": stream}
            try:
                fn = jax.jit(lambda a, b, gs, ls, rs, tile=tile, out_dtype=out_dtype, stream=stream:
                             fp8_mosaic.gmm_tn_aligned(a, b, gs, tile, scaling="blockwise", lhs_scale=ls,
                                                       rhs_scale=rs, out_dtype=out_dtype, stack="m", stream=stream))
                rec |= timed_kernel(fn, args, 2 * int(sizes.sum()) * k * n)
                out = fn(*args)
                rec |= {"equals_first_rounded": None if first is None else _rounded_equal(out, first),
                        "finite": bool(_finite(out))}
                first = out if first is None else first
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a result
                rec |= error_fields(e)
            emit(rec)
            out = None  # a float32 weight gradient at 256 groups is 30 GB: one beside `first` at most
        del args, first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--groups", default="32", help="comma-separated group counts")
    a = p.parse_args()
    record_lines("fp8-wgrad-tiles", a.out, lambda emit: [run(a.rows, int(g), emit) for g in a.groups.split(",")],
                 rows=a.rows)


if __name__ == "__main__":
    main()
