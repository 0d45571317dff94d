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
warpgroups each own a block_m x block_n accumulator, side by side along N (stack="n": a CTA tile is
block_m x 2*block_n, the consumers share the lhs block) or stacked along M (stack="m": 2*block_m x block_n, they
share the rhs block; blockwise scaling only).

Scaling. "rowwise": one scale per row of each operand, applied to the float32 accumulator after the last K step.
Each consumer starts a TMA copy of its tile's two scale vectors into its own shared-memory slots before the K loop
and waits for it after (the C-operand epilogue of JAX's hopper_matmul_mgpu): Mosaic GPU lowers no vector loads
from global memory inside a warpgroup ("Only optimized transfers to SMEM supported"), and the vectors, needed once
per tile, take no pipeline buffers.
"blockwise": DeepSeek-V3 / DeepGEMM promotion: each 128-wide contraction block's wgmma goes into a fresh
accumulator that is waited for, scaled and added into a float32 register carry. Hopper's e4m3 wgmma accumulates
with reduced precision, and the promotion bounds that error to one 128-wide block. A blockwise consumer holds two
float32 tiles (partial and carry), so its tile is 64x128: at 128x128 the 256 registers per thread spill. A
blockwise consumer wider than 128 columns computes each K block in 128-column slices, one
after another (one partial live beside the carry: 64x256 fits where two 64x256 tiles do not), each slice inside
one 128x128 weight-scale block.

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

from dropless.gmm import fresh_acc
from dropless.gmm.api import TMA_ROW_ALIGNMENT
from dropless.gmm.mosaic import max_row_tiles, num_sms, plgpu, row_tiles, store_rows, swizzled
from dropless.gmm.mosaic_ws import BARRIER_BYTES, CONSUMERS, MEMORY_REGISTERS, Ring, run_stream, tile_steps
from dropless.gmm.tuning import SMEM_BYTES, TileConfig

FP8 = jnp.float8_e4m3fn
SCALE_BLOCK = 128  # blockwise scales: one per 128 contraction elements (activations), per 128x128 block (weights)
SCALINGS = ("rowwise", "blockwise")
PRODUCTS = ("fwd", "dlhs", "drhs")
TMA_MAX_BOX = 256  # elements along any dim of one TMA copy
STACKS = ("n", "m")  # where the two consumers' tiles sit in the CTA tile: side by side along N, stacked along M

# Tiles per consumer warpgroup, keyed by (product, scaling), with the consumers' layout in FP8_STACKS. Chosen on
# one H200 at DeepSeek-V3's 32-expert shapes by benchmarks/fp8/grouped_gemm.py (measured: fp8-probe-h200.json) and,
# for the blockwise layouts, benchmarks/fp8/layouts.py (measured: fp8-layouts-h200.json):
#   fwd/dlhs rowwise: 128x128x128/3 m-minor 8, timed with no scales applied; the rowwise epilogue (two
#                     scale-vector loads per tile, two multiplies per output) is not timed.
#   drhs rowwise:     128x128x128/3 n-minor 4, timed unscaled with bf16 outputs; with the default float32 output
#                     only 2 stages fit beside the output blocks (untimed).
#   blockwise:        64 rows per consumer (a 128-row partial beside the carry spills), stacked along M: stacked
#                     takes N in multiples of 128 rather than 256, and at 64x128 it runs ahead of side by side in
#                     every gmm_nt product. gmm_nt's products take 64x256 in two 128-column slices run one after
#                     another (a 128x256 CTA tile, three stages), the fastest layout measured at 32 groups, where
#                     the output's columns are a multiple of 256 (64x128 in five stages elsewhere). With a float32
#                     output (the shared experts' and dense MLPs' down projection) two stages fit at 64x256:
#                     untimed alone, inside the measured step (fp8-step-h200.json). The promotion's cost at equal
#                     tiles is the gap to the unscaled kernel in the same record. Splitting a 64x128 consumer into
#                     two 64-column accumulators, both issued before either is promoted (overlapping one's
#                     promotion with the other's wgmma), is not in the code: narrower wgmmas re-read the lhs.
#                     drhs (float32 output): stacked 64x128 in four stages (five do not fit beside the output
#                     blocks).
FP8_TILES = {
    ("fwd", "rowwise"): TileConfig(128, 128, 128, 3, grid_minor_dim=0, grid_tile_width=8),
    ("dlhs", "rowwise"): TileConfig(128, 128, 128, 3, grid_minor_dim=0, grid_tile_width=8),
    ("drhs", "rowwise"): TileConfig(128, 128, 128, 3, grid_minor_dim=1, grid_tile_width=4),
    ("fwd", "blockwise"): TileConfig(64, 256, 128, 3, grid_minor_dim=0, grid_tile_width=8),
    ("dlhs", "blockwise"): TileConfig(64, 256, 128, 3, grid_minor_dim=0, grid_tile_width=8),
    ("drhs", "blockwise"): TileConfig(64, 128, 128, 4, grid_minor_dim=0, grid_tile_width=8),
}
# The entries whose tile was timed (the rowwise ones without their scale epilogue), for callers that report it.
MEASURED = frozenset({("fwd", "rowwise"), ("dlhs", "rowwise"), ("drhs", "rowwise"), ("fwd", "blockwise"),
                      ("dlhs", "blockwise"), ("drhs", "blockwise")})
# The consumers' layout per table entry (STACKS).
FP8_STACKS = {(product, scaling): "m" if scaling == "blockwise" else "n" for product, scaling in FP8_TILES}
# The products whose kernel streams its CTA's tiles through one ring of stages (`stream=True`, the same bits as the
# per-tile pipeline): the blockwise weight gradient, faster streamed than per tile at DeepSeek-V3's widths with 32
# and 256 groups (measured: fp8-layouts-h200.json, fp8-layouts-e256-h200.json). gmm_nt's products stay per tile:
# at the table's 64x256 the streamed kernel is slower in every product, at 256 groups several times slower at
# gate+up fwd and down dlhs, and Fp8Gmm's forward on aligned rows is slower with it. That slow case and the fast
# 32-group kernel are one compiled kernel at two row counts, so the cause is a run-time one (unexplained); at
# 64x128 in five stages the streamed kernel stays behind 64x256 per tile at gate+up. Rowwise has no streamed kernel.
FP8_STREAM = frozenset({("drhs", "blockwise")})
# The products whose streamed kernel promotes each block's product behind the next block's wgmma (`behind=True`,
# the same bits; a consumer of one 128-column slice only).
FP8_BEHIND: frozenset = frozenset()
# gmm_nt's blockwise tile where the output's columns are not a multiple of the table's 256 (see default_tile).
FP8_NARROW = TileConfig(64, 128, 128, 5, grid_minor_dim=0, grid_tile_width=8)
# The blockwise weight gradient writing 2-byte outputs (train.fp8_wgrad_dtype=bfloat16): the table's 64x128 tile in
# five stages, which its output blocks, half the shared memory of float32 ones, leave room for. The fastest of
# benchmarks/fp8/wgrad_tiles.py's 2-byte variants at 32 and 256 groups (fp8-wgrad-tiles*-h200.json); 64x256
# consumers, three stages of which fit, run 3.1x / 2.5x its time at 32 / 256 groups.
FP8_WGRAD_2BYTE = TileConfig(64, 128, 128, 5, grid_minor_dim=0, grid_tile_width=8)


def cta_shape(tile: TileConfig, stack: str) -> tuple[int, int]:
    """(rows, columns) of a CTA's output tile: the two consumers' block_m x block_n tiles along `stack`."""
    return (tile.block_m, CONSUMERS * tile.block_n) if stack == "n" else (CONSUMERS * tile.block_m, tile.block_n)


def default_tile(product: str, m: int, k: int, n: int, g: int, scaling: str, out_dtype=jnp.float32) -> TileConfig:
    """The FP8_TILES entry of a product of the layer y = x·W (x [m, k], W [g, k, n]), or FP8_NARROW for a blockwise
    gmm_nt product whose output columns (fwd: n, dlhs: k) the entry's CTA tile does not divide, or FP8_WGRAD_2BYTE
    for a blockwise weight gradient written in 2 bytes (`out_dtype`). The rows and groups do not choose the tile:
    every entry was measured at one shape class (65,536 rows in 32 groups)."""
    del m, g
    if product not in PRODUCTS or scaling not in SCALINGS:
        raise ValueError(f"product={product!r} / scaling={scaling!r}: choose from {PRODUCTS} and {SCALINGS}.")
    tile = FP8_TILES[(product, scaling)]
    if (product, scaling) == ("drhs", "blockwise") and jnp.dtype(out_dtype).itemsize == 2:
        return FP8_WGRAD_2BYTE
    if scaling == "blockwise" and product != "drhs" and tile.block_n > FP8_NARROW.block_n:
        cta_n = cta_shape(tile, FP8_STACKS[(product, scaling)])[1]
        if (n if product == "fwd" else k) % cta_n:
            return FP8_NARROW
    return tile


def default_stack(product: str, scaling: str) -> str:
    """The FP8_STACKS entry of a product (the layout default_tile's tile was chosen with)."""
    default_tile(product, 0, 0, 0, 0, scaling)  # the same check of the key
    return FP8_STACKS[(product, scaling)]


def default_stream(product: str, scaling: str) -> bool:
    """Whether a product's kernel streams its tiles (FP8_STREAM): gmm_nt's or gmm_tn_aligned's `stream`."""
    default_tile(product, 0, 0, 0, 0, scaling)  # the same check of the key
    return (product, scaling) in FP8_STREAM


def default_behind(product: str, scaling: str, tile: TileConfig) -> bool:
    """Whether a product's streamed kernel at `tile` promotes behind the next wgmma (FP8_BEHIND): its `behind`."""
    return ((product, scaling) in FP8_BEHIND and default_stream(product, scaling)
            and tile.block_n <= SCALE_BLOCK)


def fits(product: str, k: int, n: int, scaling: str) -> bool:
    """Whether these kernels with default_tile take a product of the layer y = x·W with x [M, k], W [G, k, n] (the
    dims of `dropless.gmm.tuning.ProductConfig.fits`): the output's columns a multiple of the CTA tile's (cta_shape),
    its rows (drhs) of the CTA tile's, a row-ragged product's contraction of 128 (the scale block and block_k)."""
    cta_m, cta_n = cta_shape(default_tile(product, 0, k, n, 0, scaling), default_stack(product, scaling))
    if product == "fwd":  # out [M, n], contracts k
        return n % cta_n == 0 and k % SCALE_BLOCK == 0 and n % SCALE_BLOCK == 0
    if product == "dlhs":  # out [M, k], contracts n
        return k % cta_n == 0 and n % SCALE_BLOCK == 0 and k % SCALE_BLOCK == 0
    return k % cta_m == 0 and n % cta_n == 0  # drhs: out [G, k, n], contracts the 128-aligned rows


def aligned_layout(group_sizes_G: jax.Array, align: int = SCALE_BLOCK) -> tuple[jax.Array, jax.Array]:
    """(first_G, blocks_G): each group's first block and block count in a copy whose groups are zero-padded to
    multiples of `align` columns and laid end to end (blocks = ceil(size / align), first = exclusive cumsum)."""
    sizes = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    blocks = (sizes + align - 1) // align
    return (jnp.cumsum(blocks) - blocks).astype(jnp.int32), blocks.astype(jnp.int32)


@dataclass(frozen=True)
class _Launch:
    """The static shape of one kernel launch: the tile, `stages` that fit, `groups` x `outer` x n_tiles CTA output
    tiles (gmm_nt: one group axis, row tiles; gmm_tn_aligned: each group's K tiles), the scaling, the output dtype,
    (gmm_nt) the row count and the consumers' layout."""

    tile: TileConfig
    stages: int
    outer: int
    n_tiles: int
    scaling: str
    out_dtype: Any
    num_rows: int = 0
    groups: int = 1
    stack: str = "n"
    behind: bool = False

    @property
    def slices(self) -> int:
        """A blockwise consumer's accumulator slices: 128 columns each (one weight-scale block), rowwise one."""
        return max(1, self.tile.block_n // SCALE_BLOCK) if self.scaling == "blockwise" else 1

    @property
    def width(self) -> int:
        """Columns of one accumulator slice."""
        return self.tile.block_n // self.slices

    @property
    def cta(self) -> tuple[int, int]:
        return cta_shape(self.tile, self.stack)

    def out_origin(self, wg):
        """(row, column) of a consumer's output tile inside its CTA tile."""
        return (0, wg * self.tile.block_n) if self.stack == "n" else (wg * self.tile.block_m, 0)

    def lhs_rows(self, wg):
        """A consumer's rows of the CTA's lhs block: its output rows (all of them when side by side)."""
        return pl.ds(self.out_origin(wg)[0], self.tile.block_m)

    def rhs_rows(self, wg):
        """A consumer's rows of the CTA's K-major rhs block: its output columns (all of them when stacked)."""
        return pl.ds(self.out_origin(wg)[1], self.tile.block_n)

    def operands(self, lhs_smem, rhs_smem, wg):
        """A consumer's wgmma operands: its [block_m, K] lhs rows and its rhs rows viewed [K, block_n]."""
        return lhs_smem.at[self.lhs_rows(wg)], rhs_smem.at[self.rhs_rows(wg), :].transpose((1, 0))

    def slice_operands(self, lhs_smem, rhs_smem, wg):
        """A consumer's lhs rows and, per accumulator slice, its rhs rows viewed [K, width]."""
        return lhs_smem.at[self.lhs_rows(wg)], [
            rhs_smem.at[self.slice_cols(wg, i), :].transpose((1, 0)) for i in range(self.slices)]

    def slice_cols(self, wg, i):
        """Slice i's columns inside the CTA tile."""
        return pl.ds(self.out_origin(wg)[1] + i * self.width, self.width)

    def stage_out(self, out_smem, wg):
        """The consumer's staging of its accumulator slices, one [block_m, width] output block each, in its
        out_dtype."""
        def stage(slices):
            for i, value in enumerate(slices):
                out_smem[wg * self.slices + i] = value.astype(self.out_dtype)

        return stage


def _stages(tile: TileConfig, out_dtype, scaling: str, scale_lengths: tuple[int, ...], stack: str = "n") -> int:
    """tile.num_stages, or fewer if the pipeline's buffers (e4m3 operand blocks and float32 scale vectors of
    these lengths, each buffer aligned to 1 KiB), the rowwise epilogue's scale slots and the output blocks do not
    fit in shared memory together."""
    cta_m, cta_n = cta_shape(tile, stack)
    out_bytes = CONSUMERS * tile.block_m * tile.block_n * jnp.dtype(out_dtype).itemsize
    epilogue = [CONSUMERS * 4 * tile.block_m, CONSUMERS * 4 * tile.block_n] if scaling == "rowwise" else []

    def needed(stages: int) -> int:
        buffers = [stages * cta_m * tile.block_k, stages * cta_n * tile.block_k] + epilogue
        buffers += [stages * 4 * length for length in scale_lengths]
        return sum(-(-b // 1024) * 1024 for b in buffers) + out_bytes + BARRIER_BYTES

    stages = tile.num_stages
    while stages > 1 and needed(stages) > SMEM_BYTES:
        stages -= 1
    return stages


def _check(scaling: str, tile: TileConfig, shapes: dict, expected: dict, stack: str) -> None:
    """One clear error for a caller's mistake in scaling, layout or operand shapes (named by argument)."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r}; choose one of {SCALINGS}.")
    if stack not in STACKS or (stack == "m" and scaling != "blockwise"):
        raise ValueError(f"stack={stack!r}: choose one of {STACKS} ('m' with blockwise scaling only).")
    if scaling == "blockwise" and (tile.block_k != SCALE_BLOCK or (SCALE_BLOCK % tile.block_n and
                                                                   tile.block_n % SCALE_BLOCK)):
        raise ValueError(f"blockwise scaling needs block_k == {SCALE_BLOCK} and block_n dividing it or a multiple "
                         f"of it; got {tile}.")
    for name, shape in expected.items():
        if tuple(shapes[name]) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(shapes[name])}; {scaling} scaling needs {tuple(shape)}.")


def _outer(rows_vec, cols_vec, shape):
    """rows_vec[:, None] * cols_vec[None, :] in the wgmma accumulator's register layout."""
    return lax.broadcast_in_dim(rows_vec, shape, [0]) * lax.broadcast_in_dim(cols_vec, shape, [1])


def _zeros(shape):
    """A float32 zero tile in the accumulator's layout (an empty group's output, the blockwise carry's start)."""
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _promote(a, bs, carries, scaled):
    """One K step of blockwise promotion: for each accumulator slice in turn, its product into a fresh float32
    accumulator, waited for, and scaled(i, partial) added into carries[i] (one partial live at a time)."""
    def run(b, acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]

    return tuple(carry + scaled(i, pl.run_scoped(functools.partial(run, b), plgpu.ACC((a.shape[0], b.shape[1]),
                                                                                     jnp.float32)))
                 for i, (b, carry) in enumerate(zip(bs, carries)))


def _rowwise_body(s: _Launch, wg):
    """Pipeline body of rowwise scaling: each K step's product accumulates in the one float32 ACC."""
    def body(_, lhs_smem, rhs_smem, acc_ref):
        plgpu.wgmma(acc_ref, *s.operands(lhs_smem, rhs_smem, wg))
        plgpu.wgmma_wait(0)
        return acc_ref

    return body


def _scale_slots(tile: TileConfig):
    """The rowwise epilogue's shared memory: each consumer's [1, block_m] row and [1, block_n] column scale
    vectors, and one barrier per copy (row copies of consumers 0, 1, then their column copies)."""
    return (plgpu.SMEM((CONSUMERS, 1, tile.block_m), jnp.float32),
            plgpu.SMEM((CONSUMERS, 1, tile.block_n), jnp.float32), plgpu.Barrier(num_barriers=2 * CONSUMERS))


def _rowwise_context(s: _Launch, wg, slots, rows_gmem, cols_gmem, stage_out, store):
    """The rowwise consumers' context: the TMA copies of this consumer's [1, block_m] row and [1, block_n] column
    scales (rows_gmem, cols_gmem) into its slots, issued before the K loop so they overlap it; a float32 ACC
    through the pipeline; then the sum times the outer product of the two vectors read from shared memory (as the
    blockwise body reads its row scales), staged and stored. The next tile's copy overwrites the slots only after
    store()'s commit_smem, a fence and warpgroup barrier that every read of them precedes."""
    rows_smem, cols_smem, barriers = slots
    rows_slot, cols_slot = rows_smem.at[wg], cols_smem.at[wg]
    rows_barrier, cols_barrier = barriers.at[wg], barriers.at[CONSUMERS + wg]

    def context(run_pipeline):
        plgpu.copy_gmem_to_smem(rows_gmem, rows_slot, rows_barrier)
        plgpu.copy_gmem_to_smem(cols_gmem, cols_slot, cols_barrier)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((s.tile.block_m, s.tile.block_n), jnp.float32))
        def _acc(acc_ref):
            run_pipeline(acc_ref)
            plgpu.barrier_wait(rows_barrier)
            plgpu.barrier_wait(cols_barrier)
            stage_out((acc_ref[...] * _outer(rows_slot[0, :], cols_slot[0, :], acc_ref.shape),))
            store()

    return context


def _blockwise_context(s: _Launch, stage_out, store):
    """The blockwise consumers' context: a float32 register carry per accumulator slice through the pipeline,
    staged, then stored."""
    def context(run_pipeline):
        stage_out(run_pipeline(tuple(_zeros((s.tile.block_m, s.width)) for _ in range(s.slices))))
        store()

    return context


def _pipeline(s: _Launch, steps: int, specs, body, context):
    """The warp-specialised pipeline of one output tile: the producer loads `specs`' blocks `steps` times."""
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(steps,), memory_registers=MEMORY_REGISTERS, in_specs=specs, wg_axis="wg",
        num_compute_wgs=CONSUMERS, max_concurrent_steps=s.stages, compute_context=context)


def _call(kernel, s: _Launch, out_shape, name: str):
    """The persistent launch: one CTA per SM, two consumer warpgroups and the producer."""
    fresh_acc.install()  # blockwise promotion's per-block accumulators lowered without their zero fill
    return plgpu.kernel(
        functools.partial(kernel, s), out_type=jax.ShapeDtypeStruct(out_shape, s.out_dtype), grid=(num_sms(),),
        grid_names=("sm",), num_threads=CONSUMERS + 1, thread_name="wg",
        kernel_name=f"dropless_fp8_gmm_{name}_{s.scaling}_{s.stack}",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def _operand_specs(s: _Launch, dtype, index_map, scale_lengths=(), scale_index_map=None):
    """BlockSpecs of the CTA's K-major lhs and rhs blocks, then of one [1, length] float32 scale vector per
    length."""
    (cta_m, cta_n), bk = s.cta, s.tile.block_k
    specs = [plgpu.BlockSpec((cta_m, bk), index_map, transforms=swizzled(bk, dtype), memory_space=plgpu.SMEM),
             plgpu.BlockSpec((cta_n, bk), index_map, transforms=swizzled(bk, dtype), memory_space=plgpu.SMEM)]
    return specs + [plgpu.BlockSpec((1, length), scale_index_map, memory_space=plgpu.SMEM)
                    for length in scale_lengths]


def _check_operands(lhs, rhs, contraction: int, tile: TileConfig, out_cols: int, stack: str) -> None:
    """The operands' dtype and the dims the tile must divide (a caller's mistake: one clear error)."""
    if lhs.dtype != FP8 or rhs.dtype != FP8:
        raise ValueError(f"operands must be {jnp.dtype(FP8).name}; got {lhs.dtype} and {rhs.dtype}.")
    cta_n = cta_shape(tile, stack)[1]
    if contraction % SCALE_BLOCK or contraction % tile.block_k or out_cols % cta_n:
        raise ValueError(f"the contraction ({contraction}) must be a multiple of {SCALE_BLOCK} and block_k and the "
                         f"output columns ({out_cols}) of the CTA tile's {cta_n}; see fits().")


# One jitted program per (tile, scaling, dtypes, shapes): a step calling the same product from several layers and
# from the recomputed forward lowers its kernel once (each lowering runs Mosaic GPU's compiler passes on the host).
@functools.partial(jax.jit, static_argnames=("tile", "scaling", "out_dtype", "stack", "stream", "behind"))
def gmm_nt(lhs_MK: jax.Array, rhs_GNK: jax.Array, group_sizes_G: jax.Array, tile: TileConfig, *, scaling: str,
           lhs_scale: jax.Array, rhs_scale: jax.Array, out_dtype=jnp.bfloat16, stack: str = "n",
           stream: bool = False, behind: bool = False) -> jax.Array:
    """out[m] = lhs[m] · rhs[g(m)]ᵀ, scaled, [M, N]; rows past sum(group_sizes) are left unwritten.

    rowwise:   lhs_scale [M], rhs_scale [G, N]; out[m, n] = acc[m, n] * lhs_scale[m] * rhs_scale[g(m), n].
    blockwise: lhs_scale [K/128, M], rhs_scale [G, N/128, K/128]; each 128-wide K block's product is scaled by
               lhs_scale[kb, m] * rhs_scale[g(m), n // 128, kb] and added into a float32 carry.
    stream (blockwise only): one producer walks the CTA's whole sequence of (tile, K step) pairs through one ring
    of stages (`mosaic_ws.run_stream`), so the next tile's first blocks load while the consumers finish the current
    one and its store runs under the next tile's steps, instead of one pipeline per tile filled and drained. The
    same steps in the same order: the same bits as the per-tile pipeline.
    behind (streamed, one 128-column accumulator slice per consumer): each K block's product is promoted one step
    behind its wgmma, while the next block's wgmma runs (`_steps_behind`); the same additions in the same order,
    so the same bits.
    """
    m, k = lhs_MK.shape
    g, n, _ = rhs_GNK.shape
    kb = k // SCALE_BLOCK
    expected = {"rhs_GNK": (g, n, k)} | ({"lhs_scale": (m,), "rhs_scale": (g, n)} if scaling == "rowwise" else
                                         {"lhs_scale": (kb, m), "rhs_scale": (g, n // SCALE_BLOCK, kb)})
    _check(scaling, tile, {"rhs_GNK": rhs_GNK.shape, "lhs_scale": lhs_scale.shape, "rhs_scale": rhs_scale.shape},
           expected, stack)
    _check_operands(lhs_MK, rhs_GNK, k, tile, n, stack)
    if stream and scaling != "blockwise":
        raise ValueError("gmm_nt(stream=True) runs blockwise scaling only; use stream=False for rowwise.")
    cta_m, cta_n = cta_shape(tile, stack)
    out_dtype = jnp.dtype(out_dtype)
    padded = max(cta_m, -(-m // TMA_ROW_ALIGNMENT) * TMA_ROW_ALIGNMENT)
    if padded != m:  # a row tile's box cannot exceed the array, and the array's rows tile by 8 in shared memory
        rows = ((0, padded - m),)
        return gmm_nt(jnp.pad(lhs_MK, rows + ((0, 0),)), rhs_GNK, group_sizes_G, tile, scaling=scaling,
                      lhs_scale=jnp.pad(lhs_scale, rows if scaling == "rowwise" else ((0, 0),) + rows),
                      rhs_scale=rhs_scale, out_dtype=out_dtype, stack=stack, stream=stream, behind=behind)[:m]
    m_tiles = max_row_tiles(m, g, cta_m)
    tables = row_tiles(group_sizes_G, cta_m, m_tiles)
    scale_lengths = (cta_m,) if scaling == "blockwise" else ()
    s = _Launch(tile, _stages(tile, out_dtype, scaling, scale_lengths, stack), m_tiles, n // cta_n, scaling,
                out_dtype, m, stack=stack, behind=behind)
    _check_behind("gmm_nt", behind, stream, scaling, tile, s.stages)
    lhs_scale, rhs_scale = lhs_scale.astype(jnp.float32), rhs_scale.astype(jnp.float32)
    if scaling == "rowwise":
        # [1, M + bm]: a row tile's [1, bm] copy stays inside the array even when the tile runs past row M (TMA
        # would zero-fill there on the GPU; the padding also keeps M < bm and the interpreter in bounds).
        lhs_scale = jnp.pad(lhs_scale, (0, cta_m))[None, :]
    kernel, name = (_nt_stream_kernel, "nt_stream" + "_behind" * behind) if stream else (_nt_kernel, "nt")
    return _call(kernel, s, (m, n), name)(lhs_MK, rhs_GNK, lhs_scale, rhs_scale, *tables)


def _nt_blockwise_body(s: _Launch, wg, col_scale_gmem, group, ni):
    """Blockwise promotion along K: each slice's product of the step, times its row scales and its weight block's
    scale (read from global memory, one scalar per slice and step; reading it a step ahead, before the wgmma, ran
    no faster on an H200), added into its carry. A slice lies inside one 128-wide weight-scale block (_check)."""
    blocks = [(ni * s.cta[1] + s.out_origin(wg)[1] + i * s.width) // SCALE_BLOCK for i in range(s.slices)]

    def body(idx, lhs_smem, rhs_smem, row_scale_smem, carries):
        a, bs = s.slice_operands(lhs_smem, rhs_smem, wg)
        rows = row_scale_smem[0, s.lhs_rows(wg)]
        block_scales = [col_scale_gmem[group, block, idx[0]] for block in blocks]
        return _promote(a, bs, carries, lambda i, partial: partial * lax.broadcast_in_dim(
            rows * block_scales[i], partial.shape, [0]))

    return body


def _nt_kernel(s: _Launch, lhs, rhs, row_scale, col_scale, group_T, start_T, offset_T, size_T, out):
    """gmm_nt's kernel: pipeline and output blocks held for the whole kernel, the walk over (row tile, CTA column
    tile) pairs of `dropless.gmm.mosaic.row_tiles`, each tile's pipeline along K."""
    bm, bn, bk = s.tile.block_m, s.tile.block_n, s.tile.block_k
    (cta_m, cta_n), k_steps = s.cta, lhs.shape[1] // bk
    blockwise = s.scaling == "blockwise"
    specs = (_operand_specs(s, lhs.dtype, lambda ki: (0, ki), (cta_m,), lambda ki: (ki, 0)) if blockwise else
             _operand_specs(s, lhs.dtype, lambda ki: (0, ki)))

    def operands(start, group, ni):
        ops = [lhs.at[pl.ds(start, cta_m), :], rhs.at[group].at[pl.ds(ni * cta_n, cta_n), :]]
        return ops + [row_scale.at[:, pl.ds(start, cta_m)]] if blockwise else ops

    ignore = lambda *_, **__: None  # the allocations depend on the block specs only
    allocations = _pipeline(s, k_steps, specs, ignore, ignore).get_allocations(*operands(0, 0, 0))
    out_type = plgpu.SMEM((CONSUMERS * s.slices, bm, s.width), s.out_dtype,
                          transforms=swizzled(s.width, s.out_dtype, leading_tile=1))
    slots = None if blockwise else _scale_slots(s.tile)

    @functools.partial(pl.run_scoped, allocations=allocations, out_smem=out_type, slots=slots,
                       collective_axes="wg")
    def _scope(allocations, out_smem, slots):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((s.outer * s.n_tiles,), collective_axes="sm")
        def _tile(loop_info):
            mi, ni = plgpu.planar_snake(loop_info.index[0], (s.outer, s.n_tiles), s.tile.grid_minor_dim,
                                        s.tile.grid_tile_width)
            group, size = group_T[mi], size_T[mi]
            start = pl.multiple_of(start_T[mi], TMA_ROW_ALIGNMENT)
            row0, col0 = s.out_origin(wg)
            stage_out = s.stage_out(out_smem, wg)

            def store():
                _store_nt_tile(s, out_smem, out, wg, offset_T[mi], size, start, ni, wait=True)

            @pl.when(size > 0)  # the same branch in every warpgroup: the pipeline's barriers stay paired
            def _compute():
                if blockwise:
                    body = _nt_blockwise_body(s, wg, col_scale, group, ni)
                    context = _blockwise_context(s, stage_out, store)
                else:
                    rows_gmem = row_scale.at[:, pl.ds(start + row0, bm)]
                    cols_gmem = col_scale.at[pl.ds(group, 1), pl.ds(ni * cta_n + col0, bn)]
                    body = _rowwise_body(s, wg)
                    context = _rowwise_context(s, wg, slots, rows_gmem, cols_gmem, stage_out, store)
                _pipeline(s, k_steps, specs, body, context)(*operands(start, group, ni), allocations=allocations)


def _store_nt_tile(s: _Launch, out_smem, out, wg, offset, size, start, ni, *, wait: bool) -> None:
    """A gmm_nt consumer's staged output blocks (one per accumulator slice) into out: the tile's valid rows
    [offset, offset + size) of the CTA tile at row `start`, clipped to this consumer's rows, the smem writes
    committed first; `wait` as store_rows'."""
    row0, col0 = s.out_origin(wg)
    lo = jnp.clip(offset - row0, 0, s.tile.block_m)
    hi = jnp.clip(offset + size - row0, 0, s.tile.block_m)
    plgpu.commit_smem()
    for i in range(s.slices):
        store_rows(out_smem.at[wg * s.slices + i], out, row0=start + row0, offset=lo, size=jnp.maximum(hi - lo, 0),
                   cols=pl.ds(ni * s.cta[1] + col0 + i * s.width, s.width), max_rows=min(s.tile.block_m, s.num_rows),
                   wait=wait)


def _nt_stream_kernel(s: _Launch, lhs, rhs, row_scale, col_scale, group_T, start_T, offset_T, size_T, out):
    """gmm_nt(stream=True)'s kernel (blockwise): the CTA's (row tile, CTA column tile) pairs in `_nt_kernel`'s order,
    K steps each, every step's two e4m3 blocks and its row-scale vector through one ring. A tile past the last
    group (size 0) takes no step in any warpgroup. Each consumer's store runs under the next tile's steps; it
    waits for the store to have read its output blocks only when it next writes them."""
    bm, bk = s.tile.block_m, s.tile.block_k
    (cta_m, cta_n), k_steps = s.cta, lhs.shape[1] // bk

    def tile_at(index):
        mi, ni = plgpu.planar_snake(index, (s.outer, s.n_tiles), s.tile.grid_minor_dim, s.tile.grid_tile_width)
        return mi, ni, group_T[mi], pl.multiple_of(start_T[mi], TMA_ROW_ALIGNMENT), size_T[mi]

    def load_tile(ring, index, c):
        _, ni, group, start, size = tile_at(index)
        rows, cols, weights = pl.ds(start, cta_m), pl.ds(ni * cta_n, cta_n), rhs.at[group]
        return tile_steps(size, k_steps, c, lambda c: lax.fori_loop(0, k_steps, lambda ki, c: ring.load(
            c, lhs.at[rows, pl.ds(ki * bk, bk)], weights.at[cols, pl.ds(ki * bk, bk)],
            row_scale.at[pl.ds(ki, 1), rows]), c))

    def compute_tile(ring, wg, index, c):
        mi, ni, group, start, size = tile_at(index)

        def body(c):
            if s.behind:
                block = (ni * cta_n + s.out_origin(wg)[1]) // SCALE_BLOCK
                scale = lambda ki, blocks, shape: lax.broadcast_in_dim(
                    blocks[2][0, s.lhs_rows(wg)] * col_scale[group, block, ki], shape, [0])
                carries = (_steps_behind(ring, s, wg, c, k_steps, scale),)
            else:
                promote = _nt_blockwise_body(s, wg, col_scale, group, ni)
                start_carries = tuple(_zeros((bm, s.width)) for _ in range(s.slices))
                _, carries = ring.steps(c, k_steps, lambda ki, *blocks_and_carry: promote((ki,), *blocks_and_carry),
                                        start_carries)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this consumer's previous store has read its blocks
            s.stage_out(ring.out, wg)(carries)
            _store_nt_tile(s, ring.out, out, wg, offset_T[mi], size, start, ni, wait=False)

        return tile_steps(size, k_steps, c, body)

    blocks = [((cta_m, bk), lhs.dtype, True), ((cta_n, bk), rhs.dtype, True), ((1, cta_m), jnp.float32, False)]
    run_stream(Ring.allocations(s.stages, blocks, CONSUMERS * s.slices, (bm, s.width), s.out_dtype,
                                out_leading_tile=1), s.stages, s.outer * s.n_tiles, load_tile, compute_tile)


def _check_behind(kernel: str, behind: bool, stream: bool, scaling: str, tile: TileConfig, stages: int) -> None:
    if behind and not (stream and scaling == "blockwise" and tile.block_n <= SCALE_BLOCK):
        raise ValueError(f"{kernel}(behind=True) promotes a streamed blockwise consumer at most {SCALE_BLOCK} "
                         f"columns wide (its carry and two accumulators fill the registers); got stream={stream}, "
                         f"scaling={scaling!r}, {tile}.")
    if behind and stages < 2:  # a consumer holds a step's slot until the next step's blocks have landed
        raise ValueError(f"{kernel}(behind=True) needs two pipeline stages or more; {stages} fit(s) in shared "
                         f"memory at {tile}.")


def _steps_behind(ring: Ring, s: _Launch, wg, c, steps, scale):
    """A streamed blockwise consumer's `steps` contraction steps of one tile (at least one) from ring step c, its
    one accumulator slice promoted one step behind its wgmma: each step's wgmma goes into a fresh accumulator whose
    registers are carried to the next step unread; there, once the next step's wgmma is issued and at most that
    one runs, they are multiplied by `scale(i, blocks, shape)` (step i's scales, read from its slot, which is
    released only after) and added into the float32 carry. The carry takes the same additions in the same order as
    `ring.steps`; returns it after the last step."""
    shape = (s.tile.block_m, s.width)

    def issue(c):
        """Step c's wgmma into a fresh accumulator, left running; its registers, to be read once it finishes."""
        slot = lax.rem(c, ring.stages)
        plgpu.barrier_wait(ring.produced.at[slot])
        a, (b,) = s.slice_operands(ring.operands[0].at[slot], ring.operands[1].at[slot], wg)

        def run(acc):
            plgpu.wgmma(acc, a, b)
            return plgpu.wgmma_accumulator_load(acc, wait_n=None)

        return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

    def promote(c, ki, partial, carry, in_flight):
        """Step c's partial, finished once at most `in_flight` wgmmas run, into the carry; its slot released."""
        plgpu.wgmma_wait(in_flight)
        slot = lax.rem(c, ring.stages)
        blocks = tuple(operand.at[slot] for operand in ring.operands)
        carry = carry + partial * scale(ki, blocks, shape)
        plgpu.barrier_arrive(ring.consumed.at[slot])
        return carry

    def pair(p, state):
        """Steps 2p + 1 and 2p + 2, step 2p's wgmma running: two per iteration, so that the accumulator issued
        after a promotion can take the registers that promotion freed and the carried one stays in place across
        the loop's back edge (a carried accumulator moved while its wgmma runs would have ptxas wait for it)."""
        c, carry, pending = state
        odd = issue(c)
        carry = promote(c - 1, 2 * p, pending, carry, 1)
        even = issue(c + 1)
        return c + 2, promote(c, 2 * p + 1, odd, carry, 1), even

    after, carry, pending = lax.fori_loop(0, (steps - 1) // 2, pair, (c + 1, _zeros(shape), issue(c)))

    def last_two():
        partial = issue(after)
        return promote(after, steps - 1, partial, promote(after - 1, steps - 2, pending, carry, 1), 0)

    def last_one():
        return promote(after - 1, steps - 1, pending, carry, 0)

    if isinstance(steps, int):
        return last_two() if (steps - 1) % 2 else last_one()
    return lax.cond((steps - 1) % 2 == 1, last_two, last_one)


@functools.partial(jax.jit, static_argnames=("tile", "scaling", "out_dtype", "stack", "stream", "behind"))
def gmm_tn_aligned(lhsT_KP: jax.Array, rhsT_NP: jax.Array, group_sizes_G: jax.Array, tile: TileConfig, *,
                   scaling: str, lhs_scale: jax.Array, rhs_scale: jax.Array, out_dtype=jnp.float32,
                   stack: str = "n", stream: bool = False, behind: bool = False) -> jax.Array:
    """out[g] = lhsT[:, cols of g] · rhsT[:, cols of g]ᵀ, scaled, [G, K, N]: the weight gradient xᵀ·dy.

    Group g occupies columns [128 * first_g, 128 * (first_g + blocks_g)) of both copies, with (first_G, blocks_G)
    = aligned_layout(group_sizes_G); the columns past its rows hold zeros (written by the quantizer: no 8-bit
    masking exists in shared memory). Empty groups give zeros.
    rowwise:   lhs_scale [G, K], rhs_scale [G, N]; out[g, k, n] = acc * lhs_scale[g, k] * rhs_scale[g, n].
    blockwise: lhs_scale [P/128, K], rhs_scale [P/128, N]; each 128-column block pb of group g adds its product
               times lhs_scale[pb, k] * rhs_scale[pb, n] into a float32 carry.
    stream (blockwise only): one producer walks the CTA's whole sequence of (output tile, column block) steps
    through one ring of stages (`mosaic_ws.run_stream`), so the next tile's blocks load while the consumers finish
    and store the current one, instead of one pipeline per tile filled and drained: a group's gradient tile has
    as many steps as the group has 128-row blocks (16 at DeepSeek-V3's 32 experts, 2 at 256). The same steps
    in the same order: the same bits as the per-tile pipeline.
    behind: as gmm_nt's, each column block's product promoted while the next block's wgmma runs.
    """
    k, p = lhsT_KP.shape
    n = rhsT_NP.shape[0]
    g = group_sizes_G.shape[0]
    pb = p // SCALE_BLOCK
    expected = {"rhsT_NP": (n, p)} | ({"lhs_scale": (g, k), "rhs_scale": (g, n)} if scaling == "rowwise" else
                                      {"lhs_scale": (pb, k), "rhs_scale": (pb, n)})
    _check(scaling, tile, {"rhsT_NP": rhsT_NP.shape, "lhs_scale": lhs_scale.shape, "rhs_scale": rhs_scale.shape},
           expected, stack)
    _check_operands(lhsT_KP, rhsT_NP, p, tile, n, stack)
    cta_m, cta_n = cta_shape(tile, stack)
    if tile.block_k != SCALE_BLOCK or k % cta_m:
        raise ValueError(f"gmm_tn_aligned steps over the {SCALE_BLOCK}-column group blocks: block_k must be "
                         f"{SCALE_BLOCK} and K ({k}) a multiple of the CTA tile's {cta_m} rows; got {tile}.")
    if stream and scaling != "blockwise":
        raise ValueError("gmm_tn_aligned(stream=True) runs blockwise scaling only; use stream=False for rowwise.")
    if scaling == "blockwise" and max(cta_m, cta_n) > TMA_MAX_BOX:
        raise ValueError(f"blockwise scaling loads the CTA tile's {cta_m} row and {cta_n} column scales in one copy "
                         f"each, at most {TMA_MAX_BOX} long: choose a smaller tile or stack the consumers.")
    out_dtype = jnp.dtype(out_dtype)
    scale_lengths = (cta_m, cta_n) if scaling == "blockwise" else ()
    s = _Launch(tile, _stages(tile, out_dtype, scaling, scale_lengths, stack), k // cta_m, n // cta_n, scaling,
                out_dtype, groups=g, stack=stack, behind=behind)
    _check_behind("gmm_tn_aligned", behind, stream, scaling, tile, s.stages)
    lhs_scale, rhs_scale = lhs_scale.astype(jnp.float32), rhs_scale.astype(jnp.float32)
    kernel, name = (_tn_stream_kernel, "tn_aligned_stream" + "_behind" * behind) if stream else (_tn_kernel,
                                                                                                 "tn_aligned")
    return _call(kernel, s, (g, k, n), name)(*aligned_layout(group_sizes_G, SCALE_BLOCK), lhsT_KP, rhsT_NP,
                                             lhs_scale, rhs_scale)


def _tn_blockwise_body(s: _Launch, wg):
    """Blockwise promotion along the group's columns: the block's product times the outer product of its K-row
    and N-column scales, added into the carry."""
    def body(_, lhs_smem, rhs_smem, row_scale_smem, col_scale_smem, carries):
        a, bs = s.slice_operands(lhs_smem, rhs_smem, wg)
        rows = row_scale_smem[0, s.lhs_rows(wg)]
        cols = [col_scale_smem[0, s.slice_cols(wg, i)] for i in range(s.slices)]
        return _promote(a, bs, carries, lambda i, partial: partial * _outer(rows, cols[i], partial.shape))

    return body


def _store_tn_tile(s: _Launch, out_smem, out, wg, gi, ki, ni) -> None:
    """A weight-gradient consumer's staged output blocks (one per accumulator slice) into out[gi] at the CTA tile
    (ki, ni): the smem writes committed, one copy per slice, one commit group; the caller waits for it when it
    needs the blocks again."""
    plgpu.commit_smem()
    row0, col0 = s.out_origin(wg)
    rows = pl.ds(ki * s.cta[0] + row0, s.tile.block_m)
    for i in range(s.slices):
        cols = pl.ds(ni * s.cta[1] + col0 + i * s.width, s.width)
        plgpu.copy_smem_to_gmem(out_smem.at[wg * s.slices + i], out.at[gi, rows, cols], commit_group=False)
    plgpu.commit_smem_to_gmem_group()


def _tn_kernel(s: _Launch, first_G, blocks_G, lhs, rhs, row_scale, col_scale, out):
    """gmm_tn_aligned's kernel: pipeline and output blocks held for the whole kernel, the walk over (group, K tile,
    CTA N tile) outputs, each tile's pipeline over its group's column blocks."""
    bm, bn = s.tile.block_m, s.tile.block_n
    (cta_m, cta_n), per_group = s.cta, s.outer * s.n_tiles
    blockwise = s.scaling == "blockwise"

    def specs(first):
        if blockwise:
            return _operand_specs(s, lhs.dtype, lambda r: (0, first + r), (cta_m, cta_n), lambda r: (first + r, 0))
        return _operand_specs(s, lhs.dtype, lambda r: (0, first + r))

    def operands(ki, ni):
        rows, cols = pl.ds(ki * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)
        ops = [lhs.at[rows, :], rhs.at[cols, :]]
        return ops + [row_scale.at[:, rows], col_scale.at[:, cols]] if blockwise else ops

    ignore = lambda *_, **__: None  # the allocations depend on the block specs only
    allocations = _pipeline(s, s.stages, specs(0), ignore, ignore).get_allocations(*operands(0, 0))
    out_type = plgpu.SMEM((CONSUMERS * s.slices, bm, s.width), s.out_dtype, transforms=swizzled(s.width, s.out_dtype))
    slots = None if blockwise else _scale_slots(s.tile)

    @functools.partial(pl.run_scoped, allocations=allocations, out_smem=out_type, slots=slots,
                       collective_axes="wg")
    def _scope(allocations, out_smem, slots):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((s.groups * per_group,), collective_axes="sm")
        def _tile(loop_info):
            gi, kn = lax.div(loop_info.index[0], per_group), lax.rem(loop_info.index[0], per_group)
            ki, ni = plgpu.planar_snake(kn, (s.outer, s.n_tiles), s.tile.grid_minor_dim, s.tile.grid_tile_width)
            first, steps = first_G[gi], blocks_G[gi]
            row0, col0 = s.out_origin(wg)
            stage_out = s.stage_out(out_smem, wg)

            def store():
                _store_tn_tile(s, out_smem, out, wg, gi, ki, ni)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            @pl.when(steps == 0)  # an empty group's gradient is zero; the producer has nothing to load
            def _empty():
                @pl.when(wg < CONSUMERS)
                def _zeros_out():
                    stage_out(tuple(_zeros((bm, s.width)) for _ in range(s.slices)))
                    store()

            @pl.when(steps > 0)
            def _group():
                if blockwise:
                    body, context = _tn_blockwise_body(s, wg), _blockwise_context(s, stage_out, store)
                else:
                    rows_gmem = row_scale.at[pl.ds(gi, 1), pl.ds(ki * cta_m + row0, bm)]
                    cols_gmem = col_scale.at[pl.ds(gi, 1), pl.ds(ni * cta_n + col0, bn)]
                    body = _rowwise_body(s, wg)
                    context = _rowwise_context(s, wg, slots, rows_gmem, cols_gmem, stage_out, store)
                _pipeline(s, steps, specs(first), body, context)(*operands(ki, ni), allocations=allocations)


def _tn_stream_kernel(s: _Launch, first_G, blocks_G, lhs, rhs, row_scale, col_scale, out):
    """gmm_tn_aligned(stream=True)'s kernel (blockwise): the CTA's (group, K tile, CTA N tile) outputs in
    `_tn_kernel`'s order, each over its group's column blocks, every step's two e4m3 blocks and two scale vectors
    through one ring. An empty group takes no step and stores the zeros its carries start as. Each consumer's
    store runs under the next tile's steps; it waits for the store to have read its output blocks only when it
    next writes them."""
    bm, bk = s.tile.block_m, s.tile.block_k
    (cta_m, cta_n), per_group = s.cta, s.outer * s.n_tiles

    def tile_at(index):
        gi, kn = lax.div(index, per_group), lax.rem(index, per_group)
        ki, ni = plgpu.planar_snake(kn, (s.outer, s.n_tiles), s.tile.grid_minor_dim, s.tile.grid_tile_width)
        return gi, ki, ni, first_G[gi], blocks_G[gi]

    def load_tile(ring, index, c):
        _, ki, ni, first, steps = tile_at(index)
        rows, cols = pl.ds(ki * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)

        def load(r, c):
            block = first + r
            return ring.load(c, lhs.at[rows, pl.ds(block * bk, bk)], rhs.at[cols, pl.ds(block * bk, bk)],
                             row_scale.at[pl.ds(block, 1), rows], col_scale.at[pl.ds(block, 1), cols])

        return lax.fori_loop(0, steps, load, c)

    def compute_tile(ring, wg, index, c):
        gi, ki, ni, _, steps = tile_at(index)
        start = tuple(_zeros((bm, s.width)) for _ in range(s.slices))
        if s.behind:  # an empty group's tile takes no step: its wgmmas and their waits stay inside the branch
            scale = lambda _, blocks, shape: _outer(blocks[2][0, s.lhs_rows(wg)], blocks[3][0, s.slice_cols(wg, 0)],
                                                    shape)
            carries = (lax.cond(steps > 0, lambda: _steps_behind(ring, s, wg, c, steps, scale), lambda: start[0]),)
            c = c + steps
        else:
            c, carries = ring.steps(c, steps, _tn_blockwise_body(s, wg), start)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this consumer's previous store has read its blocks
        s.stage_out(ring.out, wg)(carries)
        _store_tn_tile(s, ring.out, out, wg, gi, ki, ni)
        return c

    blocks = [((cta_m, bk), lhs.dtype, True), ((cta_n, bk), rhs.dtype, True), ((1, cta_m), jnp.float32, False),
              ((1, cta_n), jnp.float32, False)]
    run_stream(Ring.allocations(s.stages, blocks, CONSUMERS * s.slices, (bm, s.width), s.out_dtype), s.stages,
               s.groups * per_group, load_tile, compute_tile)
