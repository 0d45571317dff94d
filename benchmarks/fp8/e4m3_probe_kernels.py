"""E4m3 grouped-GEMM kernels of the FP8 probe (make bench-fp8-probe): a measurement of what our Mosaic GPU kernel
structure gives on float8 e4m3 operands, not the product path (that is src/dropless/gmm/fp8_mosaic.py).

They are dropless.gmm.mosaic_ws's warp-specialised grouped GEMM (one producer warpgroup, two consumers side by
side along N) with what e4m3 forces on Hopper, kept as they were measured (benchmarks/results/fp8-probe-h200.json).
Hopper's wgmma reads 8-bit operands K-major only (the contraction dim contiguous in shared memory) for BOTH A
and B; Mosaic GPU raises "Only f16 WGMMA supports transposes" otherwise. So every kernel here takes both
operands K-major:

  gmm_nt_ws(lhs_MK, rhs_GNK, sizes, tile)         out_MN[m] = lhs[m] · rhs[g(m)]ᵀ
      fwd  x · W[g]    with rhs = Wᵀ stored [G, N, K] (a transposed copy of W [G, K, N])
      dlhs dy · W[g]ᵀ  with rhs = W itself, [G, K, N] read as [g, out=K, contract=N] (no copy)
  gmm_tn_aligned_ws(lhsT_KM, rhsT_NM, padded_sizes, tile)   out_GKN[g] = lhsT[:, rows g] · rhsT[:, rows g]ᵀ
      drhs xᵀ · dy     with transposed copies xᵀ [K, Mp], dyᵀ [N, Mp] whose groups start at multiples of
                       block_k (=128) and are zero-padded to it (so no masking inside the kernel: Mosaic GPU
                       has no pointwise ops on 8-bit values, so rows cannot be masked in e4m3 shared memory)

scales=None is tensorwise scale 1 (no scale is applied). scales="blockwise" (gmm_nt_ws): DeepSeek-V3 / DeepGEMM
promotion. lhs scales sa_KbM [K/128, M] (one per row and 128-wide K block, stored K-block-major so one block's
row scales are contiguous), rhs scales sb_GNbKb [G, N/128, K/128] (one per 128x128 weight block). Each K step's
wgmma goes into a fresh accumulator, which is waited for and added into a float32 register carry:
acc += partial * sa[row] * sb.

Shape suffixes: M rows (all groups, concatenated), K contraction, N output columns, G groups, Mp rows of the
128-aligned copy, Kb = K/128, Nb = N/128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dropless.gmm.api import TMA_ROW_ALIGNMENT
from dropless.gmm.mosaic import max_row_tiles, num_sms, row_tiles, store_rows, swizzled
from dropless.gmm.mosaic_ws import CONSUMERS, MEMORY_REGISTERS, fitting_stages


def gmm_nt_ws(lhs_MK, rhs_GNK, group_sizes_G, tile, *, out_dtype=jnp.bfloat16, scales=None, sa_KbM=None,
              sb_GNbKb=None, stages=None):
    """out[m] = lhs[m] · rhs[g(m)]ᵀ for the rows m of group g, [M, N]; both operands K-major (module docstring)."""
    m, k = lhs_MK.shape
    g, n, k_rhs = rhs_GNK.shape
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    cta_n = CONSUMERS * bn
    assert k == k_rhs and n % cta_n == 0 and k % bk == 0, (lhs_MK.shape, rhs_GNK.shape, tile)
    blockwise = scales == "blockwise"
    if blockwise:
        assert bk == 128 and bn in (64, 128), tile  # a consumer's bn columns lie inside one 128-wide weight block
    out_dtype = jnp.dtype(out_dtype)
    m_tiles = max_row_tiles(m, g, bm)
    n_tiles, k_steps = n // cta_n, k // bk
    tables = row_tiles(group_sizes_G, bm, m_tiles)
    stages = stages or fitting_stages(tile, lhs_MK.dtype, out_dtype)

    def kernel(lhs_gmem, rhs_gmem, *rest):
        if blockwise:
            sa_gmem, sb_gmem, group_gmem, start_gmem, offset_gmem, size_gmem, out_gmem = rest
        else:
            group_gmem, start_gmem, offset_gmem, size_gmem, out_gmem = rest

        in_specs = [
            plgpu.BlockSpec((bm, bk), lambda ki: (0, ki), transforms=swizzled(bk, lhs_gmem.dtype),
                            memory_space=plgpu.SMEM),
            plgpu.BlockSpec((cta_n, bk), lambda ki: (0, ki), transforms=swizzled(bk, rhs_gmem.dtype),
                            memory_space=plgpu.SMEM),
        ]
        if blockwise:
            in_specs.append(plgpu.BlockSpec((1, bm), lambda ki: (ki, 0), memory_space=plgpu.SMEM))

        def pipeline(body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(k_steps,), memory_registers=MEMORY_REGISTERS, in_specs=in_specs,
                wg_axis="wg", num_compute_wgs=CONSUMERS, max_concurrent_steps=stages,
                compute_context=compute_context)

        def operands(start, group, ni):
            ops = [lhs_gmem.at[pl.ds(start, bm), :], rhs_gmem.at[group].at[pl.ds(ni * cta_n, cta_n), :]]
            if blockwise:
                ops.append(sa_gmem.at[:, pl.ds(start, bm)])
            return ops

        ignore = lambda *_, **__: None
        out_type = plgpu.SMEM((CONSUMERS, bm, bn), out_dtype, transforms=swizzled(bn, out_dtype, leading_tile=1))

        @functools.partial(pl.run_scoped, allocations=pipeline(ignore, ignore).get_allocations(*operands(0, 0, 0)),
                           out_smem=out_type, collective_axes="wg")
        def _scope(allocations, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
            def _tile(loop_info):
                mi, ni = plgpu.planar_snake(loop_info.index[0], (m_tiles, n_tiles), tile.grid_minor_dim,
                                            tile.grid_tile_width)
                group, size = group_gmem[mi], size_gmem[mi]
                start = pl.multiple_of(start_gmem[mi], TMA_ROW_ALIGNMENT)

                def store(value):
                    out_smem[wg] = value.astype(out_dtype)
                    plgpu.commit_smem()
                    store_rows(out_smem.at[wg], out_gmem, row0=start, offset=offset_gmem[mi], size=size,
                               cols=pl.ds(ni * cta_n + wg * bn, bn), max_rows=min(bm, m))

                @pl.when(size > 0)
                def _compute():
                    if not blockwise:
                        def mma(_, lhs_smem, rhs_smem, acc_ref):
                            b = rhs_smem.at[pl.ds(wg * bn, bn), :].transpose((1, 0))  # K-major B
                            plgpu.wgmma(acc_ref, lhs_smem, b)
                            plgpu.wgmma_wait(0)
                            return acc_ref

                        def context(run_pipeline):
                            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
                            def _acc(acc_ref):
                                run_pipeline(acc_ref)
                                store(acc_ref[...])
                    else:
                        def mma(idx, lhs_smem, rhs_smem, sa_smem, acc):
                            (ki,) = idx
                            b = rhs_smem.at[pl.ds(wg * bn, bn), :].transpose((1, 0))

                            def partial_mma(p_ref):
                                plgpu.wgmma(p_ref, lhs_smem, b)
                                return p_ref[...]  # waits for the wgmma

                            partial = pl.run_scoped(partial_mma, plgpu.ACC((bm, bn), jnp.float32))
                            sa = sa_smem[0, :]
                            sb = sb_gmem[group, (ni * cta_n + wg * bn) // 128, ki]
                            return acc + partial * lax.broadcast_in_dim(sa * sb, (bm, bn), [0])

                        def context(run_pipeline):
                            acc0 = plgpu.layout_cast(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA)
                            store(run_pipeline(acc0))

                    pipeline(mma, context)(*operands(start, group, ni), allocations=allocations)

    args = (lhs_MK, rhs_GNK) + ((sa_KbM, sb_GNbKb) if blockwise else ())
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(num_sms(),), grid_names=("sm",),
        num_threads=CONSUMERS + 1, thread_name="wg",
        kernel_name="fp8_gmm_nt_ws" + ("_blockwise" if blockwise else ""),
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(*args, *tables)


def aligned_layout(group_sizes_G, align: int):
    """Starts (in blocks of `align`) and block counts of each group in a copy whose groups are zero-padded to align."""
    sizes = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    blocks = (sizes + align - 1) // align
    first = jnp.cumsum(blocks) - blocks
    return first.astype(jnp.int32), blocks.astype(jnp.int32)


def gmm_tn_aligned_ws(lhsT_KM, rhsT_NM, group_sizes_G, tile, *, out_dtype=jnp.bfloat16, stages=None):
    """out[g] = lhsT[:, rows of g] · rhsT[:, rows of g]ᵀ, [G, K, N]; rows of group g are the block_k-aligned,
    zero-padded range given by aligned_layout(group_sizes, block_k)."""
    k, mp = lhsT_KM.shape
    n, mp2 = rhsT_NM.shape
    g = group_sizes_G.shape[0]
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    cta_n = CONSUMERS * bn
    assert mp == mp2 and k % bm == 0 and n % cta_n == 0 and mp % bk == 0
    out_dtype = jnp.dtype(out_dtype)
    k_tiles, n_tiles = k // bm, n // cta_n
    stages = stages or fitting_stages(tile, lhsT_KM.dtype, out_dtype)
    first_G, blocks_G = aligned_layout(group_sizes_G, bk)

    def kernel(first_gmem, blocks_gmem, lhs_gmem, rhs_gmem, out_gmem):
        def pipeline(body, compute_context, first, steps):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(steps,), memory_registers=MEMORY_REGISTERS,
                in_specs=[
                    plgpu.BlockSpec((bm, bk), lambda r: (0, first + r), transforms=swizzled(bk, lhs_gmem.dtype),
                                    memory_space=plgpu.SMEM),
                    plgpu.BlockSpec((cta_n, bk), lambda r: (0, first + r), transforms=swizzled(bk, rhs_gmem.dtype),
                                    memory_space=plgpu.SMEM),
                ],
                wg_axis="wg", num_compute_wgs=CONSUMERS, max_concurrent_steps=stages,
                compute_context=compute_context)

        def operands(ki, ni):
            return lhs_gmem.at[pl.ds(ki * bm, bm), :], rhs_gmem.at[pl.ds(ni * cta_n, cta_n), :]

        ignore = lambda *_, **__: None
        out_type = plgpu.SMEM((CONSUMERS, bm, bn), out_dtype, transforms=swizzled(bn, out_dtype))

        @functools.partial(pl.run_scoped,
                           allocations=pipeline(ignore, ignore, 0, stages).get_allocations(*operands(0, 0)),
                           out_smem=out_type, collective_axes="wg")
        def _scope(allocations, out_smem):
            wg = lax.axis_index("wg")

            def store(gi, ki, ni, value):
                out_smem[wg] = value.astype(out_dtype)
                plgpu.commit_smem()
                cols = pl.ds(ni * cta_n + wg * bn, bn)
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[gi, pl.ds(ki * bm, bm), cols])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            @plgpu.nd_loop((g * k_tiles * n_tiles,), collective_axes="sm")
            def _tile(loop_info):
                index = loop_info.index[0]
                gi, kn = lax.div(index, k_tiles * n_tiles), lax.rem(index, k_tiles * n_tiles)
                ki, ni = plgpu.planar_snake(kn, (k_tiles, n_tiles), tile.grid_minor_dim, tile.grid_tile_width)
                first, steps = first_gmem[gi], blocks_gmem[gi]

                @pl.when(steps == 0)
                def _empty():
                    @pl.when(wg < CONSUMERS)
                    def _zeros():
                        store(gi, ki, ni, plgpu.layout_cast(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA))

                @pl.when(steps > 0)
                def _group():
                    def mma(_, lhs_smem, rhs_smem, acc_ref):
                        b = rhs_smem.at[pl.ds(wg * bn, bn), :].transpose((1, 0))
                        plgpu.wgmma(acc_ref, lhs_smem, b)
                        plgpu.wgmma_wait(0)
                        return acc_ref

                    def context(run_pipeline):
                        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
                        def _acc(acc_ref):
                            run_pipeline(acc_ref)
                            store(gi, ki, ni, acc_ref[...])

                    pipeline(mma, context, first, steps)(*operands(ki, ni), allocations=allocations)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((g, k, n), out_dtype), grid=(num_sms(),), grid_names=("sm",),
        num_threads=CONSUMERS + 1, thread_name="wg", kernel_name="fp8_gmm_tn_aligned_ws",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(first_G, blocks_G, lhsT_KM, rhsT_NM)
