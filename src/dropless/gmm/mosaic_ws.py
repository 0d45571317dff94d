"""A warp-specialised grouped GEMM for Hopper: one producer warpgroup feeds two consumer warpgroups.

`dropless.gmm.mosaic.grouped_matmul` runs one warpgroup per CTA that both issues the TMA loads and the
wgmma instructions, and stores each output tile before it starts loading the next: its tensor cores idle
during every epilogue and its 128x128 tile reads more shared memory per MMA than a wider one. This kernel
splits the work the way cuBLAS's fastest sm90 kernels do (the `..._256x128_..._coopA` kernels in our
profiles): a memory warpgroup runs ahead through the pipeline stages (`plgpu.emit_pipeline_warp_specialized`),
and two consumer warpgroups each own a block_m x block_n accumulator side by side, so a CTA computes a
block_m x 2*block_n tile (128x256 with the default tile). Each tile's pipeline drains (the producer waits until
its last stage is consumed), and the producer loads the next tile's first stages during the consumers' epilogue.

  grouped_matmul_ws(lhs_MK, rhs, group_sizes_G, tile, transpose_rhs)   out_MN = rows of group g · rhs[g] (rhs[g]ᵀ)
  grouped_matmul_tn_ws(lhs_MK, rhs_MN, group_sizes_G, tile)           out_GKN = (rows of g of lhs)ᵀ · (rows of g of rhs)
  grouped_matmul_stream, grouped_matmul_tn_stream                     the same, one stream of loads across tiles
  grouped_matmul_stacked                                              rows, streamed, consumers stacked along M

The work lists, the ragged store and the padding contracts are those of `dropless.gmm.mosaic.grouped_matmul`
and `grouped_matmul_tn`. The output's last dim must be a multiple of 2 * tile.block_n (block_n stacked). The first two are
`kernel="dropless_ws"` candidates of `dropless tune-gmm`, the streaming pair `kernel="dropless_ws_stream"` and,
with one MMA left running across steps (`mma_in_flight=1`, as CUTLASS's and tokamax's Hopper mainloops keep one),
`kernel="dropless_ws_stream_async"`, and the stacked rows kernel `kernel="dropless_ws_stacked"`; the tuned table
decides, per shape and product, whether they run.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dropless.gmm.api import TMA_ROW_ALIGNMENT
from dropless.gmm.mosaic import (GroupRefs, max_row_tiles, num_sms, plgpu, row_steps, row_tiles, store_rows,
                                 swizzled, zero_rows_outside_group)
from dropless.gmm.tuning import SMEM_BYTES, ProductConfig, TileConfig, smem_bytes

CONSUMERS = 2  # consumer warpgroups per CTA, side by side along N
MEMORY_REGISTERS = 40  # per thread for the producer warpgroup; the consumers get the rest (setmaxnreg)
BARRIER_BYTES = 1024  # the pipeline's barriers, beside its stages and the output blocks


def fitting_stages(tile: TileConfig, in_dtype, out_dtype, kernel: str = "dropless_ws") -> int:
    """`tile.num_stages`, or fewer if the stages and the output blocks of this dtype do not fit in shared memory
    together (a tile tuned with bf16 outputs, used for the MoE layer's float32 down projection)."""
    def needed(stages: int) -> int:
        config = ProductConfig(kernel, dataclasses.replace(tile, num_stages=stages))
        return smem_bytes(config, jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize) + BARRIER_BYTES

    stages = tile.num_stages
    while stages > 1 and needed(stages) > SMEM_BYTES:
        stages -= 1
    return stages


def _accumulate_then(block_m: int, block_n: int, finish):
    """The consumers' compute context: a float32 accumulator the pipeline fills, then `finish(value)` (the store)."""
    def context(run_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((block_m, block_n), jnp.float32))
        def _acc(acc_ref):
            run_pipeline(acc_ref)
            finish(acc_ref[...])
    return context

@dataclass(frozen=True)
class _RowsGridWS:
    """The static launch shape of `grouped_matmul_ws`: its tile, M rows in m_tiles row tiles, n_tiles CTA column
    tiles (2 * block_n wide), k_steps pipeline steps along K, `stages` pipeline stages that fit."""

    tile: TileConfig
    num_rows: int
    m_tiles: int
    n_tiles: int
    k_steps: int
    stages: int
    transpose_rhs: bool
    out_dtype: Any


def _in_flight(stream: bool, mma_in_flight: int, stages: int) -> int:
    """The MMAs a streaming kernel leaves running across steps with `stages` stages: `mma_in_flight`, or 0 where
    only one stage fits (`fitting_stages` with a float32 output). A slot is released only once its MMA has
    finished, so with one MMA left running the producer can refill a slot only after the next step's MMA has been
    issued, which needs a second slot."""
    assert mma_in_flight in (0, 1) and (stream or mma_in_flight == 0), (stream, mma_in_flight)
    return min(mma_in_flight, stages - 1)


def _family(stream: bool, mma_in_flight: int) -> str:
    return ("stream" + ("_async" if mma_in_flight else "")) if stream else "ws"


def grouped_matmul_ws(lhs_MK: jax.Array, rhs: jax.Array, group_sizes_G: jax.Array, tile: TileConfig, *,
                      transpose_rhs: bool = False, out_dtype=None, interpret=None, stream: bool = False,
                      mma_in_flight: int = 0, stacked: bool = False) -> jax.Array:
    """out[m] = lhs[m] @ rhs[g(m)] for the rows m of group g; rhs is [G, K, N], or [G, N, K] with transpose_rhs.

    Output rows past sum(group_sizes) are left unwritten (as `dropless.gmm.mosaic.grouped_matmul`). `stream`: one
    stream of loads per CTA (`grouped_matmul_stream`) instead of a pipeline per tile; `mma_in_flight` (streaming
    only, 0 or 1): the MMAs each consumer leaves running when it moves to the next step (`Ring.compute`).
    `stacked`: `grouped_matmul_stacked`'s layout (streaming, no MMA in flight).
    """
    m, k = lhs_MK.shape
    if transpose_rhs:
        g, n, k_rhs = rhs.shape
    else:
        g, k_rhs, n = rhs.shape
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    cta_m, cta_n = (CONSUMERS * bm, bn) if stacked else (bm, CONSUMERS * bn)
    assert k == k_rhs and n % cta_n == 0 and k % bk == 0, (lhs_MK.shape, rhs.shape, tile)
    assert not stacked or (stream and mma_in_flight == 0), (stacked, stream, mma_in_flight)
    out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)
    if stacked and m < cta_m:  # a row tile's box cannot exceed the array; the extra rows are stored by no tile
        return grouped_matmul_ws(jnp.pad(lhs_MK, ((0, cta_m - m), (0, 0))), rhs, group_sizes_G, tile,
                                 transpose_rhs=transpose_rhs, out_dtype=out_dtype, interpret=interpret, stream=stream,
                                 stacked=True)[:m]
    m_tiles = max_row_tiles(m, g, cta_m)
    n_tiles, k_steps = n // cta_n, k // bk
    tables = row_tiles(group_sizes_G, cta_m, m_tiles)
    stages = fitting_stages(tile, lhs_MK.dtype, out_dtype, "dropless_ws_stacked" if stacked else "dropless_ws")
    mma_in_flight = _in_flight(stream, mma_in_flight, stages)
    grid_shape = _RowsGridWS(tile, m, m_tiles, n_tiles, k_steps, stages, transpose_rhs, out_dtype)
    kernel = (functools.partial(_rows_stacked_kernel, grid_shape) if stacked else
              functools.partial(_rows_stream_kernel, grid_shape, in_flight=mma_in_flight) if stream
              else functools.partial(_rows_kernel_ws, grid_shape))
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(num_sms(),), grid_names=("sm",), num_threads=CONSUMERS + 1, thread_name="wg",
        kernel_name=f"dropless_grouped_matmul_{'stacked' if stacked else _family(stream, mma_in_flight)}"
                    + ("_nt" if transpose_rhs else ""),
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )(lhs_MK, rhs, *tables)


def _rows_pipeline_ws(s: _RowsGridWS, lhs_gmem, rhs_gmem, body, compute_context):
    """One tile's warp-specialised pipeline along K: the producer loads both blocks, the consumers run `body`."""
    bk, cta_n = s.tile.block_k, CONSUMERS * s.tile.block_n
    lhs_block = (s.tile.block_m, bk)
    rhs_block = (cta_n, bk) if s.transpose_rhs else (bk, cta_n)
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(s.k_steps,), memory_registers=MEMORY_REGISTERS,
        in_specs=[
            plgpu.BlockSpec(lhs_block, lambda ki: (0, ki), transforms=swizzled(bk, lhs_gmem.dtype),
                            memory_space=plgpu.SMEM),
            plgpu.BlockSpec(rhs_block, (lambda ki: (0, ki)) if s.transpose_rhs else (lambda ki: (ki, 0)),
                            transforms=swizzled(rhs_block[1], rhs_gmem.dtype), memory_space=plgpu.SMEM),
        ],
        wg_axis="wg", num_compute_wgs=CONSUMERS, max_concurrent_steps=s.stages,
        compute_context=compute_context)


def _rows_operands_ws(s: _RowsGridWS, lhs_gmem, rhs_gmem, start, group, ni):
    """The gmem windows one tile's pipeline walks along K: its rows of lhs, its columns of rhs[group]."""
    cta_n = CONSUMERS * s.tile.block_n
    rows = lhs_gmem.at[pl.ds(start, s.tile.block_m), :]
    cols = pl.ds(ni * cta_n, cta_n)
    return rows, (rhs_gmem.at[group].at[cols, :] if s.transpose_rhs else rhs_gmem.at[group].at[:, cols])


def _rows_kernel_ws(s: _RowsGridWS, lhs_gmem, rhs_gmem, group_gmem, start_gmem, offset_gmem, size_gmem, out_gmem):
    """grouped_matmul_ws's kernel: the pipeline's and the output blocks' shared memory, held for the whole kernel,
    and the tile schedule over (row tile, CTA column tile) pairs."""
    bm, bn, out_dtype = s.tile.block_m, s.tile.block_n, s.out_dtype
    ignore = lambda *_, **__: None  # the allocations depend on the block specs only
    out_type = plgpu.SMEM((CONSUMERS, bm, bn), out_dtype, transforms=swizzled(bn, out_dtype, leading_tile=1))
    allocations = _rows_pipeline_ws(s, lhs_gmem, rhs_gmem, ignore, ignore).get_allocations(
        *_rows_operands_ws(s, lhs_gmem, rhs_gmem, 0, 0, 0))

    @functools.partial(pl.run_scoped, allocations=allocations, out_smem=out_type, collective_axes="wg")
    def _scope(allocations, out_smem):
        wg = jax.lax.axis_index("wg")

        @plgpu.nd_loop((s.m_tiles * s.n_tiles,), collective_axes="sm")
        def _tile(loop_info):
            mi, ni = plgpu.planar_snake(loop_info.index[0], (s.m_tiles, s.n_tiles), s.tile.grid_minor_dim,
                                        s.tile.grid_tile_width)
            group, size = group_gmem[mi], size_gmem[mi]
            start = pl.multiple_of(start_gmem[mi], TMA_ROW_ALIGNMENT)

            @pl.when(size > 0)  # the same branch in every warpgroup: the pipeline's barriers stay paired
            def _compute():
                store = functools.partial(_rows_epilogue_ws, s, out_smem, out_gmem, wg, offset_gmem, mi, start, size,
                                          ni)
                pipeline = _rows_pipeline_ws(s, lhs_gmem, rhs_gmem, functools.partial(_rows_mma_ws, s, wg),
                                             _accumulate_then(bm, bn, store))
                pipeline(*_rows_operands_ws(s, lhs_gmem, rhs_gmem, start, group, ni), allocations=allocations)


def _rows_mma_ws(s: _RowsGridWS, wg, _, lhs_smem, rhs_smem, acc_ref, in_flight: int = 0):
    """The pipeline body of one consumer: its block_n half of the CTA's columns; returns with at most `in_flight`
    MMAs still running."""
    bn = s.tile.block_n
    mine = pl.ds(wg * bn, bn)
    b = rhs_smem.at[mine, :].transpose((1, 0)) if s.transpose_rhs else rhs_smem.at[:, mine]
    plgpu.wgmma(acc_ref, lhs_smem, b)
    plgpu.wgmma_wait(in_flight)
    return acc_ref


def _rows_epilogue_ws(s: _RowsGridWS, out_smem, out_gmem, wg, offset_gmem, mi, start, size, ni, value):
    """One consumer's epilogue: its accumulator through its output block, then the ragged store of its columns."""
    bm, bn = s.tile.block_m, s.tile.block_n
    cta_n = CONSUMERS * bn
    out_smem[wg] = value.astype(s.out_dtype)
    plgpu.commit_smem()
    store_rows(out_smem.at[wg], out_gmem, row0=start, offset=offset_gmem[mi], size=size,
               cols=pl.ds(ni * cta_n + wg * bn, bn), max_rows=min(bm, s.num_rows))


@dataclass(frozen=True)
class _ContractGridWS:
    """The static launch shape of `grouped_matmul_tn_ws`: its tile, G groups, k_tiles x n_tiles CTA output tiles
    each (block_m of K x 2 * block_n of N), `stages` pipeline stages that fit."""

    tile: TileConfig
    num_groups: int
    k_tiles: int
    n_tiles: int
    stages: int
    out_dtype: Any


def grouped_matmul_tn_ws(lhs_MK: jax.Array, rhs_MN: jax.Array, group_sizes_G: jax.Array, tile: TileConfig, *,
                         out_dtype=None, interpret=None, stream: bool = False, mma_in_flight: int = 0) -> jax.Array:
    """out[g] = lhs[rows of g]ᵀ @ rhs[rows of g], [G, K, N] (the weight gradient xᵀ·dy), warp-specialised.

    As `dropless.gmm.mosaic.grouped_matmul_tn`, with a producer warpgroup loading while two consumers compute (a
    group of 256 rows, DeepSeek-V3's 256 experts, is four 64-row steps, so each tile's pipeline is short and its
    fill and drain weigh). A CTA computes a block_m (of K) x 2*block_n (of N)
    tile; each consumer owns one block_n half of N. In a group's first and last step each consumer zeroes, in
    shared memory, the rows outside the group of its own half of `rhs` and of the shared `lhs` block: both
    consumers write the same values to `lhs` (zeros outside, the loaded rows inside), so whichever finishes
    first, its MMA reads a fully masked block, and NaN in padding rows cannot leak. Empty groups get zeros.
    `stream` and `mma_in_flight` as `grouped_matmul_ws`'s.
    """
    m, k = lhs_MK.shape
    m_rhs, n = rhs_MN.shape
    g = group_sizes_G.shape[0]
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    cta_n = CONSUMERS * bn
    assert m == m_rhs and k % bm == 0 and n % cta_n == 0, (lhs_MK.shape, rhs_MN.shape, tile)
    out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)
    k_tiles, n_tiles = k // bm, n // cta_n
    stages = fitting_stages(tile, lhs_MK.dtype, out_dtype)  # its blocks are the rows kernel's sizes, transposed
    starts_G, ends_G, first_G, steps_G = row_steps(group_sizes_G, bk)
    mma_in_flight = _in_flight(stream, mma_in_flight, stages)
    grid_shape = _ContractGridWS(tile, g, k_tiles, n_tiles, stages, out_dtype)
    kernel = (functools.partial(_stream_kernel, grid_shape, in_flight=mma_in_flight) if stream
              else functools.partial(_contract_kernel_ws, grid_shape))
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        grid=(num_sms(),), grid_names=("sm",), num_threads=CONSUMERS + 1, thread_name="wg",
        kernel_name=f"dropless_grouped_matmul_tn_{_family(stream, mma_in_flight)}",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )(starts_G, ends_G, first_G, steps_G, lhs_MK, rhs_MN)


def _contract_pipeline_ws(s: _ContractGridWS, lhs_gmem, rhs_gmem, body, compute_context, first, steps):
    """Steps of block_k rows from row `first` (elements, not blocks: a group starts anywhere) through one output
    tile's windows of lhs and rhs."""
    bm, bk, cta_n = s.tile.block_m, s.tile.block_k, CONSUMERS * s.tile.block_n
    rows = lambda r: (first + r * bk, 0)
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(steps,), memory_registers=MEMORY_REGISTERS,
        in_specs=[
            plgpu.BlockSpec((pl.Element(bk), bm), rows, transforms=swizzled(bm, lhs_gmem.dtype),
                            memory_space=plgpu.SMEM),
            plgpu.BlockSpec((pl.Element(bk), cta_n), rows, transforms=swizzled(cta_n, rhs_gmem.dtype),
                            memory_space=plgpu.SMEM),
        ],
        wg_axis="wg", num_compute_wgs=CONSUMERS, max_concurrent_steps=s.stages,
        compute_context=compute_context)


def _contract_operands_ws(s: _ContractGridWS, lhs_gmem, rhs_gmem, ki, ni):
    """The gmem windows one output tile's pipeline walks along the rows: K tile ki of lhs, CTA N tile ni of rhs."""
    bm, cta_n = s.tile.block_m, CONSUMERS * s.tile.block_n
    return lhs_gmem.at[:, pl.ds(ki * bm, bm)], rhs_gmem.at[:, pl.ds(ni * cta_n, cta_n)]


def _contract_kernel_ws(s: _ContractGridWS, start_gmem, end_gmem, first_gmem, steps_gmem, lhs_gmem, rhs_gmem,
                        out_gmem):
    """grouped_matmul_tn_ws's kernel: the pipeline's and the output blocks' shared memory, held for the whole
    kernel, and the tile schedule over (group, K tile, CTA N tile) outputs."""
    refs = GroupRefs(start_gmem, end_gmem, first_gmem, steps_gmem, lhs_gmem, rhs_gmem, out_gmem)
    bn, out_dtype = s.tile.block_n, s.out_dtype
    k_tiles, n_tiles = s.k_tiles, s.n_tiles
    ignore = lambda *_, **__: None
    out_type = plgpu.SMEM((CONSUMERS, s.tile.block_m, bn), out_dtype, transforms=swizzled(bn, out_dtype))
    allocations = _contract_pipeline_ws(s, lhs_gmem, rhs_gmem, ignore, ignore, 0, s.stages).get_allocations(
        *_contract_operands_ws(s, lhs_gmem, rhs_gmem, 0, 0))

    @functools.partial(pl.run_scoped, allocations=allocations, out_smem=out_type, collective_axes="wg")
    def _scope(allocations, out_smem):
        wg = jax.lax.axis_index("wg")
        store = functools.partial(_contract_epilogue_ws, s, out_smem, out_gmem, wg)

        @plgpu.nd_loop((s.num_groups * k_tiles * n_tiles,), collective_axes="sm")
        def _tile(loop_info):
            index = loop_info.index[0]
            gi, kn = jax.lax.div(index, k_tiles * n_tiles), jax.lax.rem(index, k_tiles * n_tiles)
            ki, ni = plgpu.planar_snake(kn, (k_tiles, n_tiles), s.tile.grid_minor_dim, s.tile.grid_tile_width)
            _contract_tile_ws(s, refs, allocations, store, wg, gi, ki, ni)


def _contract_tile_ws(s: _ContractGridWS, refs: GroupRefs, allocations, store, wg, gi, ki, ni):
    """One output tile out[gi, K tile ki, CTA N tile ni]: zeros for an empty group (the producer has nothing to
    load), else the pipeline over the group's rows with each consumer's epilogue after it."""
    bm, bn = s.tile.block_m, s.tile.block_n
    start, end, steps = refs.start[gi], refs.end[gi], refs.steps[gi]
    first = pl.multiple_of(refs.first[gi], TMA_ROW_ALIGNMENT)

    @pl.when((steps == 0) & (wg < CONSUMERS))
    def _empty_group():
        store(gi, ki, ni, plgpu.layout_cast(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA))

    @pl.when(steps > 0)
    def _group():
        mma = functools.partial(_contract_mma_ws, s, wg, first, start, end, steps)
        epilogue = _accumulate_then(bm, bn, lambda value: store(gi, ki, ni, value))
        _contract_pipeline_ws(s, refs.lhs, refs.rhs, mma, epilogue, first, steps)(
            *_contract_operands_ws(s, refs.lhs, refs.rhs, ki, ni), allocations=allocations)


def _contract_mma_ws(s: _ContractGridWS, wg, first, start, end, steps, idx, lhs_smem, rhs_smem, acc_ref,
                     in_flight: int = 0):
    """The pipeline body of one consumer: its half of rhs's columns, the rows outside the group zeroed first;
    returns with at most `in_flight` MMAs still running."""
    bn, bk = s.tile.block_n, s.tile.block_k
    (r,) = idx
    mine = rhs_smem.at[:, pl.ds(wg * bn, bn)]
    zero_rows_outside_group((lhs_smem, mine), first + r * bk, start, end, (r == 0) | (r == steps - 1))
    plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), mine)
    plgpu.wgmma_wait(in_flight)
    return acc_ref


def _contract_epilogue_ws(s: _ContractGridWS, out_smem, out_gmem, wg, gi, ki, ni, value):
    """One consumer's epilogue: its accumulator through its output block to out[gi], its half of the columns."""
    bm, bn = s.tile.block_m, s.tile.block_n
    cta_n = CONSUMERS * bn
    out_smem[wg] = value.astype(s.out_dtype)
    plgpu.commit_smem()
    cols = pl.ds(ni * cta_n + wg * bn, bn)
    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[gi, pl.ds(ki * bm, bm), cols])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)



def grouped_matmul_stream(lhs_MK: jax.Array, rhs: jax.Array, group_sizes_G: jax.Array, tile: TileConfig, *,
                          transpose_rhs: bool = False, out_dtype=None, interpret=None,
                          mma_in_flight: int = 0) -> jax.Array:
    """`grouped_matmul_ws` with one stream of loads per CTA: its producer walks every (row tile, K step) of the
    CTA's non-empty tiles through one ring of stages instead of draining a pipeline per tile (a contraction of
    768 or 512, Qwen3's down projections, is 12 or 8 steps of 64), and each consumer's ragged store runs under
    the next tile's MMAs. Same work lists, tiles and stores as `grouped_matmul_ws`; rows past sum(group_sizes)
    are left unwritten. `mma_in_flight=1`: each consumer issues its next step's MMA before the current one has
    finished (kernel name "dropless_ws_stream_async")."""
    return grouped_matmul_ws(lhs_MK, rhs, group_sizes_G, tile, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                             interpret=interpret, stream=True, mma_in_flight=mma_in_flight)


class Ring(NamedTuple):
    """The streaming kernels' shared memory: `stages` slots of each operand's block (both matrices; the FP8
    kernels' scale vectors too), the consumers' output blocks, and per slot a barrier for its loads landing and
    one for both consumers being done with it. Every warpgroup walks the CTA's tiles in the same order and
    counts the steps it has passed; step c uses slot c % stages."""

    operands: tuple
    out: Any
    produced: Any
    consumed: Any
    stages: int

    @staticmethod
    def allocations(stages: int, blocks, out_blocks: int, out_block, out_dtype, out_leading_tile: int = 8) -> dict:
        """`blocks`: per operand, (block shape, dtype, swizzled: whether it is a 2-D MMA operand or a plain
        vector); `out_blocks` output blocks of `out_block`."""
        return dict(
            operands=tuple(plgpu.SMEM((stages, *shape), dtype, transforms=swizzled(shape[1], dtype) if swizzle else ())
                           for shape, dtype, swizzle in blocks),
            out=plgpu.SMEM((out_blocks, *out_block), out_dtype,
                           transforms=swizzled(out_block[1], out_dtype, leading_tile=out_leading_tile)),
            produced=plgpu.Barrier(num_arrivals=len(blocks), num_barriers=stages),  # one arrival per copy
            consumed=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        )

    def load(self, c, *sources):
        """The producer's step c: wait until both consumers are done with the slot's previous use, then load each
        operand's block from its source."""
        slot = jax.lax.rem(c, self.stages)

        @pl.when(c >= self.stages)
        def _reuse():
            plgpu.barrier_wait(self.consumed.at[slot])

        for source, slots in zip(sources, self.operands, strict=True):
            plgpu.copy_gmem_to_smem(source, slots.at[slot], self.produced.at[slot])
        return c + 1

    def step(self, c, body, carry):
        """A consumer's step c whose `body(*blocks, carry) -> carry` has waited for its MMAs: wait for the slot's
        loads, run it, release the slot. Returns (c + 1, the new carry)."""
        slot = jax.lax.rem(c, self.stages)
        plgpu.barrier_wait(self.produced.at[slot])
        carry = body(*(slots.at[slot] for slots in self.operands), carry)
        plgpu.barrier_arrive(self.consumed.at[slot])
        return c + 1, carry

    def steps(self, c, count, body, carry):
        """`count` consecutive `step`s whose body is `body(r, *blocks, carry)` at the r-th. Returns (c + count,
        the last carry)."""
        return jax.lax.fori_loop(0, count, lambda r, state: self.step(state[0], functools.partial(body, r), state[1]),
                                 (c, carry))

    def compute(self, c, mma, in_flight: int = 0, first=None):
        """A consumer's step c: wait for the slot's loads, then `mma(*blocks)`, which returns with at most
        `in_flight` of its MMAs running, then release the slot whose MMA has finished: this step's, or with one
        MMA in flight the previous step's unless this is the tile's `first` (`finish` releases a tile's last)."""
        slot = jax.lax.rem(c, self.stages)
        plgpu.barrier_wait(self.produced.at[slot])
        mma(*(slots.at[slot] for slots in self.operands))
        if not in_flight:
            plgpu.barrier_arrive(self.consumed.at[slot])
        else:
            @pl.when(jnp.logical_not(first))
            def _release_previous():
                plgpu.barrier_arrive(self.consumed.at[jax.lax.rem(c + self.stages - 1, self.stages)])
        return c + 1

    def finish(self, before, after, in_flight: int = 0):
        """A consumer at the end of a tile that took steps `before` to `after`: with one MMA in flight, wait for
        it and release its slot, so that the accumulator can be read and every slot is released once."""
        if in_flight:
            @pl.when(after > before)
            def _last():
                self.drain(after)

    def drain(self, after):
        """`finish` for a tile known to have taken a step: wait for its last MMA and release that MMA's slot."""
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(self.consumed.at[jax.lax.rem(after - 1, self.stages)])

    def stage_output(self, wg, value):
        """A consumer's output block through shared memory: wait until its previous store has read the block (the
        store runs under the next tile's MMAs), then write it; the caller issues the store."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        self.out[wg] = value.astype(self.out.dtype)
        plgpu.commit_smem()
        return self.out.at[wg]


def tile_steps(size, steps: int, c, body):
    """A row tile's `steps` steps (a static count, as the per-tile pipeline's) and whatever follows them in
    `body(c)`, or nothing for an empty tile (size 0); the step count after it, the same in every warpgroup. The
    steps, the last MMA's wait and the store sit in one branch, so that no MMA is in flight where an empty tile's
    branch rejoins a full one's (ptxas would serialise the MMAs of an accumulator that crosses such a merge)."""
    @pl.when(size > 0)
    def _steps():
        body(c)

    return c + jnp.where(size > 0, steps, 0)


def run_stream(allocations: dict, stages: int, tiles: int, load_tile, compute_tile) -> None:
    """Run a streaming kernel: `load_tile(ring, tile, c) -> c` in the producer warpgroup and `compute_tile(ring, wg,
    tile, c) -> c` in each consumer, over this CTA's share of `tiles` tile indices (the same in every warpgroup)."""

    @functools.partial(pl.run_scoped, **allocations, collective_axes="wg")
    def _scope(**refs):
        ring, wg = Ring(**refs, stages=stages), jax.lax.axis_index("wg")

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            @plgpu.nd_loop((tiles,), collective_axes="sm", init_carry=jnp.int32(0))
            def _tile(loop_info, carry):
                return load_tile(ring, loop_info.index[0], carry)

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(_compute_registers(), action="increase")

            @plgpu.nd_loop((tiles,), collective_axes="sm", init_carry=jnp.int32(0))
            def _tile(loop_info, carry):
                return compute_tile(ring, wg, loop_info.index[0], carry)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _rows_walk(s: _RowsGridWS, lhs_gmem, rhs_gmem, group_gmem, start_gmem, size_gmem, cta_m: int, cta_n: int):
    """The streaming rows kernels' walk: `tile_at(index) -> (mi, ni, group, start, size)` over the CTA's (row tile,
    column tile) pairs, and the producer's `load_tile` of each tile's K steps of its cta_m x block_k lhs block and
    its cta_n-wide rhs block (none for a tile past the last group)."""
    bk = s.tile.block_k

    def tile_at(index):
        mi, ni = plgpu.planar_snake(index, (s.m_tiles, s.n_tiles), s.tile.grid_minor_dim, s.tile.grid_tile_width)
        return mi, ni, group_gmem[mi], pl.multiple_of(start_gmem[mi], TMA_ROW_ALIGNMENT), size_gmem[mi]

    def load_tile(ring, index, c):
        _, ni, group, start, size = tile_at(index)
        rows, cols = pl.ds(start, cta_m), pl.ds(ni * cta_n, cta_n)
        rhs = rhs_gmem.at[group]
        return tile_steps(size, s.k_steps, c, lambda c: jax.lax.fori_loop(0, s.k_steps, lambda ki, c: ring.load(
            c, lhs_gmem.at[rows, pl.ds(ki * bk, bk)],
            rhs.at[cols, pl.ds(ki * bk, bk)] if s.transpose_rhs else rhs.at[pl.ds(ki * bk, bk), cols]), c))

    return tile_at, load_tile


def _rows_stream_kernel(s: _RowsGridWS, lhs_gmem, rhs_gmem, group_gmem, start_gmem, offset_gmem, size_gmem,
                        out_gmem, *, in_flight: int = 0):
    """grouped_matmul_stream's kernel: the CTA's (row tile, CTA column tile) pairs, K steps each; tiles past the
    last group (size 0) take no step in any warpgroup."""
    bm, bn, bk = s.tile.block_m, s.tile.block_n, s.tile.block_k
    cta_n = CONSUMERS * bn
    rhs_block = (cta_n, bk) if s.transpose_rhs else (bk, cta_n)
    tile_at, load_tile = _rows_walk(s, lhs_gmem, rhs_gmem, group_gmem, start_gmem, size_gmem, bm, cta_n)

    def compute_tile(ring, wg, index, c):
        mi, ni, _, start, size = tile_at(index)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
        def _acc(acc_ref):
            mma = lambda lhs, rhs: _rows_mma_ws(s, wg, None, lhs, rhs, acc_ref, in_flight)

            def body(c):
                after = jax.lax.fori_loop(0, s.k_steps, lambda ki, c: ring.compute(c, mma, in_flight, ki == 0), c)
                if in_flight:
                    ring.drain(after)
                store_rows(ring.stage_output(wg, acc_ref[...]), out_gmem, row0=start, offset=offset_gmem[mi],
                           size=size, cols=pl.ds(ni * cta_n + wg * bn, bn), max_rows=min(bm, s.num_rows), wait=False)

            return tile_steps(size, s.k_steps, c, body)

        return _acc

    blocks = [((bm, bk), lhs_gmem.dtype, True), (rhs_block, rhs_gmem.dtype, True)]
    run_stream(Ring.allocations(s.stages, blocks, CONSUMERS, (bm, bn), s.out_dtype, out_leading_tile=1), s.stages,
               s.m_tiles * s.n_tiles, load_tile, compute_tile)


def grouped_matmul_stacked(lhs_MK: jax.Array, rhs: jax.Array, group_sizes_G: jax.Array, tile: TileConfig, *,
                           transpose_rhs: bool = False, out_dtype=None, interpret=None) -> jax.Array:
    """`grouped_matmul_stream` with the two consumers stacked along M: a CTA computes a 2*block_m x block_n tile,
    each consumer block_m rows of it against the whole rhs block, and a consumer none of whose rows lie in the
    tile's group issues no MMA for the tile (it only passes the ring's steps). A group's last row tile holds its
    remaining rows from the top, so wherever they fit in the first consumer's rows the second one rests: with
    Dirichlet groups of ~256 rows (DeepSeek-V3's 256 experts) the rows the MMAs compute fall from 1.29x the real
    rows to 1.15x, at 128 rows per expert from 1.58x to 1.30x. Rows past sum(group_sizes) are left unwritten
    (kernel name "dropless_ws_stacked")."""
    return grouped_matmul_ws(lhs_MK, rhs, group_sizes_G, tile, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                             interpret=interpret, stream=True, stacked=True)


def _rows_stacked_kernel(s: _RowsGridWS, lhs_gmem, rhs_gmem, group_gmem, start_gmem, offset_gmem, size_gmem,
                         out_gmem):
    """grouped_matmul_stacked's kernel: `_rows_stream_kernel`'s walk over (row tile, column tile) pairs with
    2*block_m-row tiles; consumer wg owns rows [wg*block_m, (wg+1)*block_m) of each tile and stores those of
    them in the group."""
    bm, bn, bk = s.tile.block_m, s.tile.block_n, s.tile.block_k
    cta_m = CONSUMERS * bm
    rhs_block = (bn, bk) if s.transpose_rhs else (bk, bn)
    # A consumer's output goes through shared memory in 128-column blocks: Mosaic GPU synthesizes no transfer of a
    # 256-column WGMMA accumulator into the row-tiled (1-row leading tile) block the ragged store needs.
    slices = max(1, bn // 128)
    width = bn // slices
    tile_at, load_tile = _rows_walk(s, lhs_gmem, rhs_gmem, group_gmem, start_gmem, size_gmem, cta_m, bn)

    def compute_tile(ring, wg, index, c):
        mi, ni, _, start, size = tile_at(index)
        offset = offset_gmem[mi]
        lo = jnp.clip(offset - wg * bm, 0, bm)  # this consumer's rows of the group, within its block_m
        mine = jnp.clip(offset + size - wg * bm, 0, bm) - lo

        def body(c):
            # Each branch holds its steps, the last MMA's wait and the store, so no MMA is in flight where the
            # branches rejoin (tile_steps).
            @pl.when(mine > 0)
            def _compute():
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
                def _acc(acc_ref):
                    def mma(lhs_smem, rhs_smem):
                        b = rhs_smem.transpose((1, 0)) if s.transpose_rhs else rhs_smem
                        plgpu.wgmma(acc_ref, lhs_smem.at[pl.ds(wg * bm, bm)], b)
                        plgpu.wgmma_wait(0)

                    jax.lax.fori_loop(0, s.k_steps, lambda ki, c: ring.compute(c, mma), c)
                    value = acc_ref[...]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this consumer's previous store has read
                    for i in range(slices):
                        ring.out[wg * slices + i] = value[:, i * width:(i + 1) * width].astype(ring.out.dtype)
                    plgpu.commit_smem()
                    for i in range(slices):
                        store_rows(ring.out.at[wg * slices + i], out_gmem, row0=start + wg * bm, offset=lo,
                                   size=mine, cols=pl.ds(ni * bn + i * width, width), max_rows=min(bm, s.num_rows),
                                   wait=False)

            @pl.when(mine == 0)
            def _rest():  # each step without an MMA: its slot's loads waited for (every warpgroup passes every
                # phase of the ring's barriers) and the slot released
                jax.lax.fori_loop(0, s.k_steps, lambda ki, c: ring.compute(c, lambda *blocks: None), c)

        return tile_steps(size, s.k_steps, c, body)

    blocks = [((cta_m, bk), lhs_gmem.dtype, True), (rhs_block, rhs_gmem.dtype, True)]
    run_stream(Ring.allocations(s.stages, blocks, CONSUMERS * slices, (bm, width), s.out_dtype, out_leading_tile=1),
               s.stages, s.m_tiles * s.n_tiles, load_tile, compute_tile)


def grouped_matmul_tn_stream(lhs_MK: jax.Array, rhs_MN: jax.Array, group_sizes_G: jax.Array, tile: TileConfig, *,
                             out_dtype=None, interpret=None, mma_in_flight: int = 0) -> jax.Array:
    """out[g] = lhs[rows of g]ᵀ @ rhs[rows of g], [G, K, N]: `grouped_matmul_tn_ws` with one stream of loads per CTA.

    `grouped_matmul_tn_ws` runs one pipeline per output tile, and a pipeline's producer waits until its last stage
    is consumed before the next tile's pipeline starts loading: with a group of 256 rows (four 64-row steps) every
    tile pays a fill and a drain. Here the producer walks the CTA's whole sequence of (tile, row step) pairs
    through the ring of stages, so it loads the next tile's first steps while the consumers finish the current
    tile and store it (`plgpu.emit_pipeline_warp_specialized` cannot dovetail pipelines whose step counts vary,
    as a group's do). Each consumer's output store runs under the next tile's MMAs; it waits for the store to have
    read its output block only when it next writes the block. Masking, tile order and the empty groups' zeros are
    `grouped_matmul_tn_ws`'s. `mma_in_flight` as `grouped_matmul_stream`'s.
    """
    return grouped_matmul_tn_ws(lhs_MK, rhs_MN, group_sizes_G, tile, out_dtype=out_dtype, interpret=interpret,
                                stream=True, mma_in_flight=mma_in_flight)


def _compute_registers() -> int:
    """Registers per thread for each consumer warpgroup once the producer has given up all but MEMORY_REGISTERS
    (as `emit_pipeline_warp_specialized` splits them): 512 per thread for one warpgroup's share of the register
    file, at most 256, a multiple of 8."""
    return int(min(256, (512 - MEMORY_REGISTERS) / CONSUMERS) // 8 * 8)


def _stream_kernel(s: _ContractGridWS, start_gmem, end_gmem, first_gmem, steps_gmem, lhs_gmem, rhs_gmem, out_gmem,
                   *, in_flight: int = 0):
    """grouped_matmul_tn_stream's kernel: the CTA's (group, K tile, CTA N tile) outputs, each over its group's row
    steps; both consumers mask the rows outside the group in a group's first and last step, as
    `grouped_matmul_tn_ws` does. An empty group takes no step and stores the zeros its accumulator starts as."""
    bm, bn, bk = s.tile.block_m, s.tile.block_n, s.tile.block_k
    cta_n = CONSUMERS * bn

    def tile_at(index):
        gi = jax.lax.div(index, s.k_tiles * s.n_tiles)
        ki, ni = plgpu.planar_snake(jax.lax.rem(index, s.k_tiles * s.n_tiles), (s.k_tiles, s.n_tiles),
                                    s.tile.grid_minor_dim, s.tile.grid_tile_width)
        return gi, ki, ni, pl.multiple_of(first_gmem[gi], TMA_ROW_ALIGNMENT), steps_gmem[gi]

    def load_tile(ring, index, c):
        _, ki, ni, first, steps = tile_at(index)
        rows = lambda r: pl.ds(first + r * bk, bk)
        return jax.lax.fori_loop(0, steps, lambda r, c: ring.load(
            c, lhs_gmem.at[rows(r), pl.ds(ki * bm, bm)], rhs_gmem.at[rows(r), pl.ds(ni * cta_n, cta_n)]), c)

    def compute_tile(ring, wg, index, c):
        gi, ki, ni, first, steps = tile_at(index)
        start, end = start_gmem[gi], end_gmem[gi]

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
        def _acc(acc_ref):
            def step(r, c):
                return ring.compute(c, lambda lhs, rhs: _contract_mma_ws(s, wg, first, start, end, steps, (r,), lhs,
                                                                         rhs, acc_ref, in_flight), in_flight, r == 0)

            after = jax.lax.fori_loop(0, steps, step, c)
            ring.finish(c, after, in_flight)
            block = ring.stage_output(wg, acc_ref[...])
            plgpu.copy_smem_to_gmem(block, out_gmem.at[gi, pl.ds(ki * bm, bm), pl.ds(ni * cta_n + wg * bn, bn)])
            return after

        return _acc

    blocks = [((bk, bm), lhs_gmem.dtype, True), ((bk, cta_n), rhs_gmem.dtype, True)]
    run_stream(Ring.allocations(s.stages, blocks, CONSUMERS, (bm, bn), s.out_dtype), s.stages,
               s.num_groups * s.k_tiles * s.n_tiles, load_tile, compute_tile)
