"""Float8 e4m3 grouped-GEMM kernels for Hopper (sm90) in Pallas Mosaic GPU, with rowwise or blockwise scales.

Hopper's wgmma reads 8-bit operands K-major only (the contraction contiguous in shared memory), A and B both,
and Mosaic GPU has no pointwise operations on 8-bit values in shared memory (no row masking). So both kernels
take both operands K-major, and the weight gradient takes group-aligned, zero-padded transposed copies:

  gmm_nt(lhs_MK, rhs_GNK, group_sizes_G, tile, scaling=...)           out_MN[m] = lhs[m] · rhs[g(m)]ᵀ
      fwd  x · W[g]    with rhs = Wᵀ [G, N, K], a transposed e4m3 copy of W [G, K, N]
      dlhs dy · W[g]ᵀ  with rhs = W itself, [G, K, N] read as [g, out, contracted]
  gmm_tn_aligned(lhsT_KP, rhsT_NP, group_sizes_G, tile, scaling=...) out_GKN[g] = lhsT[:, cols g] · rhsT[:, cols g]ᵀ
      drhs xᵀ · dy     with xᵀ [K, P], dyᵀ [N, P] whose groups start at multiples of 128 columns, zero-padded

Both are warp-specialised like `dropless.gmm.mosaic_ws`: a producer warpgroup runs the TMA pipeline, two consumer
warpgroups each own a block_m x block_n accumulator side by side (a CTA tile is block_m x 2*block_n).

Scaling. "rowwise": one scale per row of each operand, applied to the float32 accumulator after the last K step
(the scale vectors travel through the pipeline beside the operand blocks). "blockwise": DeepSeek-V3 / DeepGEMM
promotion: each 128-wide contraction block's wgmma goes into a fresh accumulator that is waited for, scaled and
added into a float32 register carry. Hopper's e4m3 wgmma accumulates with reduced precision, and the promotion
bounds that error to one 128-wide block. A blockwise consumer holds two float32 tiles (partial and carry), so its
tile is 64x128: at 128x128 the 256 registers per thread spill (3.2x slower on an H200).

Suffixes: M rows sorted by group, K contraction (nt) or output rows (tn), N output columns, G groups, P columns of
the aligned copies, Kb = K/128, Nb = N/128, Pb = P/128.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dropless.gmm.api import TMA_ROW_ALIGNMENT
from dropless.gmm.mosaic import max_row_tiles, num_sms, row_tiles, store_rows, swizzled
from dropless.gmm.mosaic_ws import BARRIER_BYTES, CONSUMERS, MEMORY_REGISTERS
from dropless.gmm.tuning import SMEM_BYTES, TileConfig

FP8 = jnp.float8_e4m3fn
SCALE_BLOCK = 128  # blockwise scales: one per 128 contraction elements (activations), per 128x128 block (weights)
SCALINGS = ("rowwise", "blockwise")
PRODUCTS = ("fwd", "dlhs", "drhs")

# Tiles per consumer warpgroup (two side by side along N), keyed by (product, scaling). Measured on one H200 by
# benchmarks/fp8/grouped_gemm.py at DeepSeek-V3's 32-expert shapes (benchmarks/results/fp8-probe-h200.json):
#   fwd/dlhs rowwise: 128x128x128/3 m-minor 8 ran 1,198-1,284 TF/s with no scales applied; the rowwise epilogue
#                     (two vector loads per step, one multiply per output) is not timed.
#   drhs rowwise:     128x128x128/3 n-minor 4 ran 1,174-1,191 TF/s unscaled, with bf16 outputs; with the default
#                     float32 output only 2 stages fit beside the output blocks (untimed).
#   fwd blockwise:    64x128x128/4 m-minor 8 ran 959 TF/s (against 1,274 unscaled; 128x128 per consumer spills).
# Untested guesses: dlhs blockwise (the fwd tile: the same kernel) and drhs blockwise (64x128 for the same
# register reason, with the drhs walk order).
FP8_TILES = {
    ("fwd", "rowwise"): TileConfig(128, 128, 128, 3, grid_minor_dim=0, grid_tile_width=8),
    ("dlhs", "rowwise"): TileConfig(128, 128, 128, 3, grid_minor_dim=0, grid_tile_width=8),
    ("drhs", "rowwise"): TileConfig(128, 128, 128, 3, grid_minor_dim=1, grid_tile_width=4),
    ("fwd", "blockwise"): TileConfig(64, 128, 128, 4, grid_minor_dim=0, grid_tile_width=8),
    ("dlhs", "blockwise"): TileConfig(64, 128, 128, 4, grid_minor_dim=0, grid_tile_width=8),
    ("drhs", "blockwise"): TileConfig(64, 128, 128, 4, grid_minor_dim=1, grid_tile_width=4),
}
MEASURED = frozenset({("fwd", "rowwise"), ("dlhs", "rowwise"), ("drhs", "rowwise"), ("fwd", "blockwise")})


def default_tile(product: str, m: int, k: int, n: int, g: int, scaling: str) -> TileConfig:
    """The tile of FP8_TILES for a product; m and g are accepted for a shape-keyed table and do not change it yet
    (every entry was measured at one shape class, 65,536 rows in 32 groups)."""
    del m, g
    if product not in PRODUCTS or scaling not in SCALINGS:
        raise ValueError(f"product={product!r} / scaling={scaling!r}: choose from {PRODUCTS} and {SCALINGS}.")
    del k, n
    return FP8_TILES[(product, scaling)]


def fits(product: str, k: int, n: int, scaling: str) -> bool:
    """Whether these kernels with default_tile take a product of layer dims k (x's features) and n (y's): the
    output's columns a multiple of the CTA tile, its rows (drhs) of block_m, the contraction of 128."""
    tile = default_tile(product, 0, k, n, 0, scaling)
    cta_n = CONSUMERS * tile.block_n
    if product == "fwd":  # out [M, n], contracts k
        return n % cta_n == 0 and k % SCALE_BLOCK == 0 and n % SCALE_BLOCK == 0
    if product == "dlhs":  # out [M, k], contracts n
        return k % cta_n == 0 and n % SCALE_BLOCK == 0 and k % SCALE_BLOCK == 0
    return k % tile.block_m == 0 and n % cta_n == 0 and k % SCALE_BLOCK == 0  # drhs: out [G, k, n], contracts rows


def aligned_layout(group_sizes_G: jax.Array, align: int = SCALE_BLOCK) -> tuple[jax.Array, jax.Array]:
    """(first_G, blocks_G): each group's first block and block count in a copy whose groups are zero-padded to
    multiples of `align` columns and laid end to end (blocks = ceil(size / align), first = exclusive cumsum)."""
    sizes = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    blocks = (sizes + align - 1) // align
    return (jnp.cumsum(blocks) - blocks).astype(jnp.int32), blocks.astype(jnp.int32)


@dataclass(frozen=True)
class _Launch:
    """The static shape of one kernel launch: the tile, `stages` that fit, `outer` x n_tiles CTA output tiles
    (row tiles for gmm_nt, groups x K tiles for gmm_tn_aligned), the scaling, the output dtype and row bound."""

    tile: TileConfig
    stages: int
    outer: int
    n_tiles: int
    scaling: str
    out_dtype: Any
    num_rows: int = 0


def _stages(tile: TileConfig, out_dtype, scale_bytes: int) -> int:
    """tile.num_stages, or fewer if the stages (e4m3 operand blocks plus `scale_bytes` of scale vectors each, every
    pipeline buffer aligned to 1 KiB) and the output blocks do not fit in shared memory together."""
    cta_n = CONSUMERS * tile.block_n
    out_bytes = CONSUMERS * tile.block_m * tile.block_n * jnp.dtype(out_dtype).itemsize
    stages = tile.num_stages
    while stages > 1:
        per_stage = (tile.block_m + cta_n) * tile.block_k + 2 * max(scale_bytes, 1024)
        if stages * per_stage + out_bytes + BARRIER_BYTES <= SMEM_BYTES:
            break
        stages -= 1
    return stages


def _check(scaling: str, tile: TileConfig, shapes: dict, expected: dict) -> None:
    """One clear error for a caller's mistake in scaling or operand shapes (named by argument)."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r}; choose one of {SCALINGS}.")
    if scaling == "blockwise" and (tile.block_k != SCALE_BLOCK or SCALE_BLOCK % tile.block_n):
        raise ValueError(f"blockwise scaling needs block_k == {SCALE_BLOCK} and block_n dividing it; got {tile}.")
    for name, shape in expected.items():
        if tuple(shapes[name]) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(shapes[name])}; {scaling} scaling needs {tuple(shape)}.")


def _outer(rows_vec, cols_vec, shape):
    """rows_vec[:, None] * cols_vec[None, :] in the wgmma accumulator's register layout."""
    return lax.broadcast_in_dim(rows_vec, shape, [0]) * lax.broadcast_in_dim(cols_vec, shape, [1])


def _zeros(shape):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _k_major_b(rhs_smem, wg, block_n):
    """A consumer's B operand: its block_n rows of the CTA's K-major rhs block, viewed [K, block_n]."""
    return rhs_smem.at[pl.ds(wg * block_n, block_n), :].transpose((1, 0))


def _partial_mma(lhs_smem, b):
    """One K step's product into a fresh float32 accumulator, waited for and returned as a value."""
    def run(partial_ref):
        plgpu.wgmma(partial_ref, lhs_smem, b)
        return partial_ref[...]

    return pl.run_scoped(run, plgpu.ACC((lhs_smem.shape[0], b.shape[1]), jnp.float32))


def _rowwise_body(s: _Launch, wg, last_step, stage_out):
    """Pipeline body accumulating in one ACC; after the last step it scales the sum by the outer product of the
    rows' and the columns' scales and hands the result to stage_out (the output block)."""
    bn = s.tile.block_n

    def body(idx, lhs_smem, rhs_smem, row_scale_smem, col_scale_smem, acc_ref):
        plgpu.wgmma(acc_ref, lhs_smem, _k_major_b(rhs_smem, wg, bn))
        plgpu.wgmma_wait(0)

        @pl.when(idx[0] == last_step)
        def _scale():
            scale = _outer(row_scale_smem[0, :], col_scale_smem[0, pl.ds(wg * bn, bn)], acc_ref.shape)
            stage_out(acc_ref[...] * scale)

        return acc_ref

    return body


def _rowwise_context(s: _Launch, store):
    """The rowwise consumers' context: a float32 ACC through the pipeline, then `store` of the staged output."""
    def context(run_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((s.tile.block_m, s.tile.block_n), jnp.float32))
        def _acc(acc_ref):
            run_pipeline(acc_ref)
            store()

    return context


def _blockwise_context(s: _Launch, stage_out, store):
    """The blockwise consumers' context: a float32 register carry through the pipeline, staged, then stored."""
    def context(run_pipeline):
        stage_out(run_pipeline(_zeros((s.tile.block_m, s.tile.block_n))))
        store()

    return context


def _every_step(step):
    """The index map of a block that is the same at every step (rowwise scales). The warp-specialised pipeline
    takes only inputs whose index depends on the step, so this one does, trivially: the block is loaded again each
    step, 4 * (block_m + 2 * block_n) bytes beside the operands' (block_m + 2 * block_n) * block_k."""
    return 0, step * 0


def _pipeline(s: _Launch, steps: int, specs, body, context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(steps,), memory_registers=MEMORY_REGISTERS, in_specs=specs, wg_axis="wg",
        num_compute_wgs=CONSUMERS, max_concurrent_steps=s.stages, compute_context=context)


def _operand_specs(s: _Launch, dtype, index_map, scale_index_map, col_scales: bool):
    """BlockSpecs of the K-major lhs and rhs blocks, the [1, block_m] row-scale vector and (col_scales) the
    [1, cta_n] column-scale vector."""
    bm, bk, cta_n = s.tile.block_m, s.tile.block_k, CONSUMERS * s.tile.block_n
    specs = [plgpu.BlockSpec((bm, bk), index_map, transforms=swizzled(bk, dtype), memory_space=plgpu.SMEM),
             plgpu.BlockSpec((cta_n, bk), index_map, transforms=swizzled(bk, dtype), memory_space=plgpu.SMEM),
             plgpu.BlockSpec((1, bm), scale_index_map, memory_space=plgpu.SMEM)]
    if col_scales:
        specs.append(plgpu.BlockSpec((1, cta_n), scale_index_map, memory_space=plgpu.SMEM))
    return specs


def _check_operands(lhs, rhs, contraction: int, tile: TileConfig, out_cols: int) -> None:
    if lhs.dtype != FP8 or rhs.dtype != FP8:
        raise ValueError(f"operands must be {jnp.dtype(FP8).name}; got {lhs.dtype} and {rhs.dtype}.")
    cta_n = CONSUMERS * tile.block_n
    if contraction % SCALE_BLOCK or contraction % tile.block_k or out_cols % cta_n:
        raise ValueError(f"the contraction ({contraction}) must be a multiple of {SCALE_BLOCK} and block_k and the "
                         f"output columns ({out_cols}) of 2 * block_n = {cta_n}; see fits().")


def gmm_nt(lhs_MK: jax.Array, rhs_GNK: jax.Array, group_sizes_G: jax.Array, tile: TileConfig, *, scaling: str,
           lhs_scale: jax.Array, rhs_scale: jax.Array, out_dtype=jnp.bfloat16) -> jax.Array:
    """out[m] = lhs[m] · rhs[g(m)]ᵀ, scaled, [M, N]; rows past sum(group_sizes) are left unwritten.

    rowwise:   lhs_scale [M], rhs_scale [G, N]; out[m, n] = acc[m, n] * lhs_scale[m] * rhs_scale[g(m), n].
    blockwise: lhs_scale [K/128, M], rhs_scale [G, N/128, K/128]; each 128-wide K block's product is scaled by
               lhs_scale[kb, m] * rhs_scale[g(m), n // 128, kb] and added into a float32 carry.
    """
    m, k = lhs_MK.shape
    g, n, _ = rhs_GNK.shape
    kb = k // SCALE_BLOCK
    expected = {"rhs_GNK": (g, n, k)} | ({"lhs_scale": (m,), "rhs_scale": (g, n)} if scaling == "rowwise" else
                                         {"lhs_scale": (kb, m), "rhs_scale": (g, n // SCALE_BLOCK, kb)})
    _check(scaling, tile, {"rhs_GNK": rhs_GNK.shape, "lhs_scale": lhs_scale.shape, "rhs_scale": rhs_scale.shape},
           expected)
    _check_operands(lhs_MK, rhs_GNK, k, tile, n)
    bm, cta_n = tile.block_m, CONSUMERS * tile.block_n
    out_dtype = jnp.dtype(out_dtype)
    m_tiles = max_row_tiles(m, g, bm)
    tables = row_tiles(group_sizes_G, bm, m_tiles)
    scale_bytes = 4 * (bm + (cta_n if scaling == "rowwise" else 0))
    s = _Launch(tile, _stages(tile, out_dtype, scale_bytes), m_tiles, n // cta_n, scaling, out_dtype, m)
    lhs_scale, rhs_scale = lhs_scale.astype(jnp.float32), rhs_scale.astype(jnp.float32)
    if scaling == "rowwise":  # 2-D for TMA: one [1, block_m] / [1, cta_n] box per tile
        lhs_scale, rhs_scale = lhs_scale.reshape(1, m), rhs_scale.reshape(g, 1, n)
    return plgpu.kernel(
        functools.partial(_nt_kernel, s), out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(num_sms(),),
        grid_names=("sm",), num_threads=CONSUMERS + 1, thread_name="wg",
        kernel_name=f"dropless_fp8_gmm_nt_{scaling}",
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(lhs_MK, rhs_GNK, lhs_scale, rhs_scale, *tables)


def _nt_blockwise_body(s: _Launch, wg, col_scale_gmem, group, ni):
    """Blockwise promotion along K: the step's product, times its row scales and its weight block's scale (read
    from global memory: one scalar per step), added into the carry."""
    bn = s.tile.block_n
    block_n = (ni * CONSUMERS * bn + wg * bn) // SCALE_BLOCK

    def body(idx, lhs_smem, rhs_smem, row_scale_smem, carry):
        partial = _partial_mma(lhs_smem, _k_major_b(rhs_smem, wg, bn))
        block_scale = col_scale_gmem[group, block_n, idx[0]]
        return carry + partial * lax.broadcast_in_dim(row_scale_smem[0, :] * block_scale, partial.shape, [0])

    return body


def _nt_kernel(s: _Launch, lhs, rhs, row_scale, col_scale, group_T, start_T, offset_T, size_T, out):
    """gmm_nt's kernel: pipeline and output blocks held for the whole kernel, the walk over (row tile, CTA column
    tile) pairs of `dropless.gmm.mosaic.row_tiles`, each tile's pipeline along K."""
    bm, bn, bk = s.tile.block_m, s.tile.block_n, s.tile.block_k
    cta_n, k_steps = CONSUMERS * bn, lhs.shape[1] // bk
    blockwise = s.scaling == "blockwise"
    specs = _operand_specs(s, lhs.dtype, lambda ki: (0, ki), (lambda ki: (ki, 0)) if blockwise else _every_step,
                           col_scales=not blockwise)

    def operands(start, group, ni):
        cols = pl.ds(ni * cta_n, cta_n)
        ops = [lhs.at[pl.ds(start, bm), :], rhs.at[group].at[cols, :], row_scale.at[:, pl.ds(start, bm)]]
        return ops if blockwise else ops + [col_scale.at[group].at[:, cols]]

    ignore = lambda *_, **__: None  # the allocations depend on the block specs only
    allocations = _pipeline(s, k_steps, specs, ignore, ignore).get_allocations(*operands(0, 0, 0))
    out_type = plgpu.SMEM((CONSUMERS, bm, bn), s.out_dtype, transforms=swizzled(bn, s.out_dtype, leading_tile=1))

    @functools.partial(pl.run_scoped, allocations=allocations, out_smem=out_type, collective_axes="wg")
    def _scope(allocations, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((s.outer * s.n_tiles,), collective_axes="sm")
        def _tile(loop_info):
            mi, ni = plgpu.planar_snake(loop_info.index[0], (s.outer, s.n_tiles), s.tile.grid_minor_dim,
                                        s.tile.grid_tile_width)
            group, size = group_T[mi], size_T[mi]
            start = pl.multiple_of(start_T[mi], TMA_ROW_ALIGNMENT)

            def stage_out(value):
                out_smem[wg] = value.astype(s.out_dtype)

            def store():
                plgpu.commit_smem()
                store_rows(out_smem.at[wg], out, row0=start, offset=offset_T[mi], size=size,
                           cols=pl.ds(ni * cta_n + wg * bn, bn), max_rows=min(bm, s.num_rows))

            @pl.when(size > 0)  # the same branch in every warpgroup: the pipeline's barriers stay paired
            def _compute():
                if blockwise:
                    body = _nt_blockwise_body(s, wg, col_scale, group, ni)
                    context = _blockwise_context(s, stage_out, store)
                else:
                    body, context = _rowwise_body(s, wg, k_steps - 1, stage_out), _rowwise_context(s, store)
                _pipeline(s, k_steps, specs, body, context)(*operands(start, group, ni), allocations=allocations)
