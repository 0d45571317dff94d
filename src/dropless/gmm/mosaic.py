"""Grouped-GEMM kernels for Hopper (sm90) in Pallas Mosaic GPU, reading every operand in the layout it has.

tokamax 0.0.17's Mosaic GPU ragged_dot is fast on the forward product once tuned, but for both backward
products it first materialises a transpose: `dy·Wᵀ` copies W to [G, N, K] (15 GB for DeepSeek-V3's 256
experts: a copy that takes longer than the whole matmul at dense speed) and the weight gradient copies x to
[K, M]. The two kernels here let the tensor cores' transposed-operand modes (wgmma reads either operand
K-major or MN-major from shared memory) do that work instead:

  grouped_matmul(lhs_MK, rhs, group_sizes_G, tile, transpose_rhs)   out_MN  = rows of group g · rhs[g]   (rhs[g]ᵀ)
  grouped_matmul_tn(lhs_MK, rhs_MN, group_sizes_G, tile)            out_GKN = (rows of group g of lhs)ᵀ · (same rows of rhs)

Suffixes: M rows sorted by group, K and N feature dims, G groups, T row tiles. Rows past sum(group_sizes)
are padding: grouped_matmul leaves their output rows unwritten (the caller masks them), grouped_matmul_tn
never lets them reach the accumulator. Inputs must be bf16 or f16 with dims that are multiples of the tile.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dropless.gmm.api import TMA_ROW_ALIGNMENT
from dropless.gmm.tuning import TileConfig


class _ImportedOnFirstUse:
    """Module `name`'s attributes, the module imported on the first one asked for. importlib's per-module lock
    makes a thread that asks while another imports it wait for the whole module (kernels are traced in several
    threads at once: bench.harness.compile_in_threads)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # the proxy's own names (copy and pickle probe them before _name is set)
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


# Mosaic GPU takes ~0.8 s of a process's start-up to import on a CPU, and only a kernel built here (for a GPU or its
# interpreter) uses it: it loads then, not with every `dropless` command. The kernel modules share this one.
plgpu = _ImportedOnFirstUse("jax.experimental.pallas.mosaic_gpu")

# Row tiles of a group start at its first row rounded down to TMA_ROW_ALIGNMENT rows, so the TMA box starts on
# a sublane-aligned row (tokamax does the same); the few rows before the group are computed and not stored.


def swizzled(minor_dim: int, dtype, leading_tile: int = 8) -> tuple:
    """Tiling + swizzle transforms for a 2-D shared-memory block whose last dim (`minor_dim` long) is contiguous."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor_dim * bits)
    return plgpu.TilingTransform((leading_tile, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _block(shape, dtype, index_map) -> plgpu.BlockSpec:
    # delay_release=1: a stage's buffers stay alive one step longer, so wgmma_wait(1) may keep one MMA in flight.
    return plgpu.BlockSpec(shape, index_map, transforms=swizzled(shape[-1], dtype), delay_release=1)


def num_sms() -> int:
    """Streaming multiprocessors of the device the kernel is built for (persistent grids launch one CTA each)."""
    mesh_device = jax.sharding.get_abstract_mesh().abstract_device
    if mesh_device is not None and mesh_device.num_cores:  # inside shard_map (None on CPU meshes)
        return mesh_device.num_cores
    device = jax.devices()[0]
    if device.platform != "gpu":  # Pallas's GPU interpreter on CPU (tests): a few simulated SMs are enough
        return 4
    return int(getattr(device, "core_count", 0) or 132)  # 132: H100/H200 SXM


def row_tiles(group_sizes_G: jax.Array, block_m: int, num_tiles: int) -> tuple[jax.Array, ...]:
    """The work list of `grouped_matmul`, computed by XLA before the kernel runs.

    Tile t multiplies lhs rows [start_T[t], start_T[t] + block_m) by rhs[group_T[t]] and stores the rows
    [start_T[t] + offset_T[t], ... + size_T[t]), which all belong to that group. A group's tiles start at
    its first row rounded down to TMA_ROW_ALIGNMENT; tiles past the last group have size 0 and are skipped.
    """
    sizes_G = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    ends_G = jnp.cumsum(sizes_G)
    starts_G = ends_G - sizes_G
    first_G = starts_G // TMA_ROW_ALIGNMENT * TMA_ROW_ALIGNMENT
    tiles_G = jnp.where(sizes_G > 0, pl.cdiv(ends_G - first_G, block_m), 0)
    tile_end_G = jnp.cumsum(tiles_G)
    t_T = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all: one fused comparison matrix, fast for the few thousand tiles x few hundred groups here.
    group_T = jnp.searchsorted(tile_end_G[:-1], t_T, side="right", method="compare_all").astype(jnp.int32)
    start_T = first_G[group_T] + block_m * (t_T - (tile_end_G - tiles_G)[group_T])
    lo_T = jnp.maximum(start_T, starts_G[group_T])
    hi_T = jnp.minimum(start_T + block_m, ends_G[group_T])
    size_T = jnp.maximum(hi_T - lo_T, 0)
    return group_T, start_T, jnp.where(size_T > 0, lo_T - start_T, 0), size_T


def max_row_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """An upper bound on the tiles `row_tiles` produces: a group of r rows starting at misalignment
    a < TMA_ROW_ALIGNMENT needs ceil((r + a) / block_m) <= (r + a - 1) // block_m + 1 tiles; summing over groups
    gives this bound."""
    return (num_rows + (TMA_ROW_ALIGNMENT - 1) * num_groups) // block_m + num_groups


def store_rows(out_smem, out_gmem, *, row0, offset, size, cols, max_rows: int, wait: bool = True) -> None:
    """Copy `size` rows starting at `offset` of out_smem to out_gmem rows row0 + offset...

    TMA boxes have static sizes, so the dynamic row count is stored as its binary digits: one copy of 2^i
    rows for each set bit i of `size` (at most log2(block_m) + 1 copies, issued together, waited once).
    `wait=False` leaves them running: the caller waits before it next writes out_smem.
    """
    step = 1 << (max_rows.bit_length() - 1)
    while step:
        @pl.when((size & step) != 0)
        def _copy(step=step, offset=offset):
            plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(offset, step)], out_gmem.at[pl.ds(row0 + offset, step), cols],
                                    commit_group=False)

        offset = offset + (size & step)
        step //= 2
    plgpu.commit_smem_to_gmem_group()
    if wait:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@dataclass(frozen=True)
class _RowsGrid:
    """The static launch shape of `grouped_matmul`: its tile, M rows in m_tiles row tiles (the work list's bound),
    n_tiles output column tiles, k_steps pipeline steps along K."""

    tile: TileConfig
    num_rows: int
    m_tiles: int
    n_tiles: int
    k_steps: int
    transpose_rhs: bool
    out_dtype: Any


def grouped_matmul(lhs_MK: jax.Array, rhs: jax.Array, group_sizes_G: jax.Array, tile: TileConfig, *,
                   transpose_rhs: bool = False, out_dtype=None, interpret=None) -> jax.Array:
    """out[m] = lhs[m] @ rhs[g(m)] for the rows m of group g; rhs is [G, K, N], or [G, N, K] with transpose_rhs.

    With transpose_rhs the kernel computes lhs · rhs[g]ᵀ straight from W's own layout: this is the input
    gradient dy·Wᵀ of a forward x·W without copying W. Output rows past sum(group_sizes) are left unwritten.
    """
    m, k = lhs_MK.shape
    if transpose_rhs:
        g, n, k_rhs = rhs.shape
    else:
        g, k_rhs, n = rhs.shape
    assert k == k_rhs and n % tile.block_n == 0 and k % tile.block_k == 0, (lhs_MK.shape, rhs.shape, tile)
    out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    m_tiles = max_row_tiles(m, g, bm)
    n_tiles, k_steps = n // bn, k // bk
    tables = row_tiles(group_sizes_G, bm, m_tiles)
    grid_shape = _RowsGrid(tile, m, m_tiles, n_tiles, k_steps, transpose_rhs, out_dtype)
    grid, names = ((num_sms(),), ("sm",)) if tile.persistent else ((m_tiles * n_tiles,), ("mn",))
    return plgpu.kernel(
        functools.partial(_rows_kernel, grid_shape), out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=grid,
        grid_names=names, kernel_name="dropless_grouped_matmul" + ("_nt" if transpose_rhs else ""),
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
        interpret=interpret,
    )(lhs_MK, rhs, *tables)


def _rows_kernel(s: _RowsGrid, lhs_gmem, rhs_gmem, group_gmem, start_gmem, offset_gmem, size_gmem, out_gmem):
    """grouped_matmul's kernel: the tile schedule over (row tile, column tile) pairs, each pair's body."""
    def tile_body(first_tile, num_tiles, loop_info):
        mi, ni = plgpu.planar_snake(loop_info.index[0], (num_tiles, s.n_tiles), s.tile.grid_minor_dim,
                                    s.tile.grid_tile_width)
        t = first_tile + mi
        group, size = group_gmem[t], size_gmem[t]
        start = pl.multiple_of(start_gmem[t], TMA_ROW_ALIGNMENT)

        @pl.when(size > 0)
        def _compute():
            acc = pl.run_scoped(functools.partial(_rows_pipeline, s, lhs_gmem, rhs_gmem, group, start, ni),
                                plgpu.ACC((s.tile.block_m, s.tile.block_n)))
            _rows_epilogue(s, acc, out_gmem, offset_gmem, t, start=start, size=size, ni=ni)

    _rows_schedule(s, tile_body)


def _rows_schedule(s: _RowsGrid, tile_body) -> None:
    """Runs tile_body(first_tile, num_tiles, loop_info) over every (row tile, column tile) pair."""
    if s.tile.persistent:
        # One CTA per SM walks the tiles. The first ceil(M / block_m) tiles almost all hold rows; the rest
        # are mostly empty, and walking them second spreads the no-ops over all SMs.
        busy = pl.cdiv(s.num_rows, s.tile.block_m)
        for first, count in ((0, busy), (busy, s.m_tiles - busy)):
            if count > 0:
                plgpu.nd_loop((count * s.n_tiles,), collective_axes="sm")(
                    functools.partial(tile_body, first, count))
    else:
        index = jax.lax.axis_index("mn")
        tile_body(0, s.m_tiles, plgpu.NDLoopInfo((index,), local_index=0, num_local_steps=1))


def _rows_pipeline(s: _RowsGrid, lhs_gmem, rhs_gmem, group, start, ni, acc_ref):
    """The pipeline body of one tile: block_m rows from `start` times rhs[group]'s column tile ni, along K."""
    bm, bn, bk = s.tile.block_m, s.tile.block_n, s.tile.block_k

    def step(_, lhs_smem, rhs_smem):
        b = rhs_smem.transpose((1, 0)) if s.transpose_rhs else rhs_smem
        plgpu.wgmma(acc_ref, lhs_smem, b)
        plgpu.wgmma_wait(1)

    if s.transpose_rhs:
        rhs_spec = _block((bn, bk), rhs_gmem.dtype, lambda ki: (ni, ki))
    else:
        rhs_spec = _block((bk, bn), rhs_gmem.dtype, lambda ki: (ki, ni))
    lhs_spec = _block((pl.Element(bm), bk), lhs_gmem.dtype, lambda ki: (start, ki))
    plgpu.emit_pipeline(step, grid=(s.k_steps,), in_specs=(lhs_spec, rhs_spec),
                        max_concurrent_steps=s.tile.num_stages)(lhs_gmem, rhs_gmem.at[group])
    return acc_ref[...]


def _rows_epilogue(s: _RowsGrid, acc, out_gmem, offset_gmem, t, *, start, size, ni) -> None:
    """Stores the tile's rows of its group: the accumulator through shared memory, then the ragged store."""
    bm, bn, out_dtype = s.tile.block_m, s.tile.block_n, s.out_dtype
    # Leading tile of 1 row: the ragged store slices the staging buffer at any row.
    out_type = plgpu.SMEM((bm, bn), out_dtype, transforms=swizzled(bn, out_dtype, leading_tile=1))

    @functools.partial(pl.run_scoped, out_smem=out_type)
    def _epilogue(out_smem):
        out_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        store_rows(out_smem, out_gmem, row0=start, offset=offset_gmem[t], size=size, cols=pl.ds(ni * bn, bn),
                   max_rows=min(bm, s.num_rows))


def row_steps(group_sizes_G: jax.Array, block_k: int) -> tuple[jax.Array, ...]:
    """The weight-gradient kernels' walk over each group's rows: (start, end, first row read, steps of block_k).

    A group's rows are read from its first row rounded down to TMA_ROW_ALIGNMENT (TMA boxes start sublane-aligned);
    empty groups take no step."""
    sizes_G = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    ends_G = jnp.cumsum(sizes_G)
    starts_G = ends_G - sizes_G
    first_G = starts_G // TMA_ROW_ALIGNMENT * TMA_ROW_ALIGNMENT
    return starts_G, ends_G, first_G, jnp.where(sizes_G > 0, pl.cdiv(ends_G - first_G, block_k), 0)


def zero_rows_outside_group(smem_refs, first_row, start, end, when) -> None:
    """Zero, in shared memory, the rows of row tiles (starting at global row `first_row`) that fall outside
    [start, end): the first and last tiles of a group overlap its neighbours, whose rows must not count."""

    @pl.when(when)
    def _mask():
        for ref in smem_refs:
            row = first_row + plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, ref.shape, 0), plgpu.Layout.WGMMA)
            inside = (row >= start) & (row < end)
            ref[...] = jnp.where(inside, ref[...], jnp.zeros(ref.shape, ref.dtype))
        plgpu.commit_smem()


@dataclass(frozen=True)
class _ContractGrid:
    """The static launch shape of `grouped_matmul_tn`: its tile, G groups, k_tiles x n_tiles output tiles each."""

    tile: TileConfig
    num_groups: int
    k_tiles: int
    n_tiles: int
    out_dtype: Any


class GroupRefs(NamedTuple):
    """The weight-gradient kernels' operands: the per-group walk (row_steps), lhs, rhs and the output."""

    start: Any
    end: Any
    first: Any
    steps: Any
    lhs: Any
    rhs: Any
    out: Any


def grouped_matmul_tn(lhs_MK: jax.Array, rhs_MN: jax.Array, group_sizes_G: jax.Array, tile: TileConfig, *,
                      out_dtype=None, interpret=None) -> jax.Array:
    """out[g] = lhs[rows of g]ᵀ @ rhs[rows of g], [G, K, N]: the weight gradient xᵀ·dy, contracting over rows.

    Tiles: block_m over K, block_n over N, block_k over rows. A group's rows are read in steps of block_k
    starting at its first row rounded down to TMA_ROW_ALIGNMENT; in the first and last step the rows outside the
    group are zeroed in shared memory (both operands, so NaN in padding rows cannot leak). Empty groups
    get zero gradients.
    """
    m, k = lhs_MK.shape
    m_rhs, n = rhs_MN.shape
    g = group_sizes_G.shape[0]
    assert m == m_rhs and k % tile.block_m == 0 and n % tile.block_n == 0, (lhs_MK.shape, rhs_MN.shape, tile)
    out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)
    bm, bn = tile.block_m, tile.block_n
    k_tiles, n_tiles = k // bm, n // bn

    starts_G, ends_G, first_G, steps_G = row_steps(group_sizes_G, tile.block_k)
    grid_shape = _ContractGrid(tile, g, k_tiles, n_tiles, out_dtype)
    if tile.persistent:
        grid, names = (num_sms(),), ("sm",)
    else:
        grid, names = (k_tiles, n_tiles, g), ("k", "n", "g")
    return plgpu.kernel(
        functools.partial(_contract_kernel, grid_shape), out_type=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        grid=grid, grid_names=names, kernel_name="dropless_grouped_matmul_tn",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )(starts_G, ends_G, first_G, steps_G, lhs_MK, rhs_MN)


def _contract_kernel(s: _ContractGrid, start_gmem, end_gmem, first_gmem, steps_gmem, lhs_gmem, rhs_gmem,
                     out_gmem) -> None:
    """grouped_matmul_tn's kernel: the tile schedule over (group, K tile, N tile) outputs."""
    refs = GroupRefs(start_gmem, end_gmem, first_gmem, steps_gmem, lhs_gmem, rhs_gmem, out_gmem)
    k_tiles, n_tiles = s.k_tiles, s.n_tiles
    if s.tile.persistent:
        @plgpu.nd_loop((s.num_groups * k_tiles * n_tiles,), collective_axes="sm")
        def _loop(loop_info):
            index = loop_info.index[0]
            gi, kn = jax.lax.div(index, k_tiles * n_tiles), jax.lax.rem(index, k_tiles * n_tiles)
            ki, ni = plgpu.planar_snake(kn, (k_tiles, n_tiles), s.tile.grid_minor_dim, s.tile.grid_tile_width)
            _contract_tile(s, refs, gi, ki, ni)
    else:
        _contract_tile(s, refs, jax.lax.axis_index("g"), jax.lax.axis_index("k"), jax.lax.axis_index("n"))


def _contract_tile(s: _ContractGrid, refs: GroupRefs, gi, ki, ni) -> None:
    """One output tile out[gi, K tile ki, N tile ni]: the pipeline over the group's rows, then the epilogue."""
    bm, bn, out_dtype = s.tile.block_m, s.tile.block_n, s.out_dtype
    start, end, steps = refs.start[gi], refs.end[gi], refs.steps[gi]
    first = pl.multiple_of(refs.first[gi], TMA_ROW_ALIGNMENT)
    acc = pl.run_scoped(functools.partial(_contract_pipeline, s, refs, ki, ni, start, end, first, steps),
                        plgpu.ACC((bm, bn)))
    out_type = plgpu.SMEM((bm, bn), out_dtype, transforms=swizzled(bn, out_dtype))

    @functools.partial(pl.run_scoped, out_smem=out_type)
    def _epilogue(out_smem):
        out_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, refs.out.at[gi, pl.ds(ki * bm, bm), pl.ds(ni * bn, bn)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _contract_pipeline(s: _ContractGrid, refs: GroupRefs, ki, ni, start, end, first, steps, acc_ref):
    """The pipeline body of one output tile: the group's rows in steps of block_k, rows outside it zeroed."""
    bm, bn, bk = s.tile.block_m, s.tile.block_n, s.tile.block_k

    def step(idx, lhs_smem, rhs_smem):
        (r,) = idx

        zero_rows_outside_group((lhs_smem, rhs_smem), first + r * bk, start, end,
                                (r == 0) | (r == steps - 1))

        plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), rhs_smem)
        plgpu.wgmma_wait(1)

    @pl.when(steps > 0)
    def _pipeline():
        lhs_spec = _block((pl.Element(bk), bm), refs.lhs.dtype, lambda r: (first + r * bk, ki))
        rhs_spec = _block((pl.Element(bk), bn), refs.rhs.dtype, lambda r: (first + r * bk, ni))
        plgpu.emit_pipeline(step, grid=(steps,), in_specs=(lhs_spec, rhs_spec),
                            max_concurrent_steps=s.tile.num_stages)(refs.lhs, refs.rhs)

    return acc_ref[...]
