"""An FP8 operand in both layouts its products read, quantized in one pass (a Pallas Triton kernel on GPUs).

Training y = x · W reads every operand twice, in two layouts (dropless.fp8.recipe): the activation x as rows
[M, K] for the forward and transposed, xᵀ [K, M], for the weight gradient; the output gradient dy likewise; the
weight as W [K, N] for the input gradient and Wᵀ [N, K] for the forward. Each layout is contraction-last with its
own scales, and quantized separately each costs a read of the bf16 operand for its block maxima, another for its
values, and (transposed) a strided write. `quantize_pair` reads each 128 x 128 tile once, takes its maxima along
both axes in registers, and writes both e4m3 layouts and their scales:

  kind="tiles"   activations and gradients, blockwise: rows per 1 x 128 tile of the columns, the transposed copy
                 per 1 x 128 tile of the rows (DeepSeek-V3's 128-token tiles of the weight gradient)
  kind="blocks"  weights, blockwise: one scale per 128 x 128 block, shared by both layouts

The results are bit for bit those of `dropless.ops.fp8.quantize` on x and on its transpose (the same magnitudes,
NaN counted as inf; the same scale exponents, read off the maxima's bits; the values multiplied by the exact
inverse of a power of two; one rounding to e4m3), which `quantize_pair_reference` computes and the tests compare
against in Pallas's interpreter.

The kernel is written for Pallas's Triton backend (which JAX marks deprecated in favour of Mosaic GPU, where the
project's GEMM kernels live): a reduction, a register transpose and an 8-bit store per tile are what Triton
compiles directly, and the kernel is memory-bound, so the backend's matrix-unit features do not matter here.

Suffixes: R rows, C columns (both multiples of 128), Rb = R/128, Cb = C/128; leading axes (a stacked weight's
experts) pass through.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dropless.ops.fp8 import FP8, Quantized, magnitude, quantize, scale_and_inverse

TILE = 128
KINDS = ("tiles", "blocks")
# Warps per program (one 128 x 128 tile each), by kind: for tiles the fastest of 4, 8 and 16 warps; blocks run at
# about a bf16 elementwise pass's bandwidth with any of them (measured on one H200 by
# benchmarks/fp8/pairs_sweep.py: fp8-pairs-h200.json).
NUM_WARPS = {"tiles": 4, "blocks": 8}


# JAX's Pallas Triton lowering addresses an array with 32-bit element offsets unless the array holds more than
# 2**32 bytes (jax/_src/pallas/triton/lowering.py, _compute_offsets_from_indices), so a 1-byte e4m3 output of more
# than 2**31 - 1 elements and at most 2**32 wraps to negative offsets: at [256, 2048, 7168] (DeepSeek-V3's down
# projection, 256 experts) 147 of the experts came back wrong, from the 110th on (fp8-product-check-h200.json). Such
# operands take the two-pass quantizer; larger and smaller ones are addressed correctly.
INT32_MAX = 2**31 - 1


def fits(shape: tuple[int, ...]) -> bool:
    """Whether quantize_pair takes an operand of this shape: 2-d or more, its last two axes multiples of 128, and
    not of the sizes JAX's Pallas Triton addresses wrongly (INT32_MAX)."""
    size = math.prod(shape)
    return (len(shape) >= 2 and shape[-1] % TILE == 0 and shape[-2] % TILE == 0 and size > 0
            and not INT32_MAX < size <= 2**32)


def quantize_pair(x: jax.Array, kind: str, *, interpret: bool | None = None,
                  num_warps: int | None = None) -> tuple[Quantized, Quantized]:
    """(x [..., R, C] quantized contraction-last over C, xᵀ [..., C, R] quantized contraction-last over R), e4m3,
    in one pass over x (module docstring). Off a GPU the same bits come from `quantize_pair_reference`, unless
    `interpret` asks for the kernel in Pallas's interpreter (the tests). `num_warps` (default NUM_WARPS[kind])
    tunes the kernel, not its result."""
    if kind not in KINDS:
        raise ValueError(f"quantize_pair kind={kind!r}: choose from {KINDS}")
    if not fits(x.shape):
        raise ValueError(f"quantize_pair takes [..., R, C] with R and C multiples of {TILE}, got {x.shape}")
    if interpret is None:
        if jax.default_backend() != "gpu":
            return quantize_pair_reference(x, kind)
        interpret = False
    lead, (r, c) = x.shape[:-2], x.shape[-2:]
    x_BRC = x.reshape(-1, r, c)
    rows, cols, scales, *scales_t = _launch(x_BRC, kind, interpret, num_warps or NUM_WARPS[kind])
    rows, cols = rows.reshape(*lead, r, c), cols.reshape(*lead, c, r)
    if kind == "blocks":
        scales = scales.reshape(*lead, r // TILE, c // TILE)
        return Quantized(rows, scales), Quantized(cols, jnp.swapaxes(scales, -1, -2))
    [scales_t] = scales_t
    # The kernel stores the scales with the quantized axis leading ([Cb, R] and [Rb, C]): contiguous 128-wide rows.
    scales = jnp.swapaxes(scales.reshape(*lead, c // TILE, r), -1, -2)
    scales_t = jnp.swapaxes(scales_t.reshape(*lead, r // TILE, c), -1, -2)
    return Quantized(rows, scales), Quantized(cols, scales_t)


def quantize_pair_reference(x: jax.Array, kind: str) -> tuple[Quantized, Quantized]:
    """quantize_pair through `quantize`, one layout at a time: the same bits, two passes."""
    lead = (1,) * (x.ndim - 2)
    if kind == "blocks":
        q = quantize(x, (*lead, TILE, TILE))
        swap = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)
        return q, Quantized(swap(q.values), swap(q.scales))
    return quantize(x, (*lead, 1, TILE)), quantize(jnp.swapaxes(x, -1, -2), (*lead, 1, TILE))


def _tiles_kernel(x_ref, rows_ref, cols_ref, scales_ref, scales_t_ref):
    """One 128 x 128 tile: per-row scales (over its 128 columns) for the rows, per-column ones (over its 128 rows)
    for the transpose."""
    x = x_ref[...].astype(jnp.float32)
    size = magnitude(x)
    row_scale, row_inverse = scale_and_inverse(jnp.max(size, axis=1))
    col_scale, col_inverse = scale_and_inverse(jnp.max(size, axis=0))
    rows_ref[...] = (x * row_inverse[:, None]).astype(FP8)
    cols_ref[...] = (x * col_inverse[None, :]).T.astype(FP8)
    scales_ref[...] = row_scale[None, :]
    scales_t_ref[...] = col_scale[None, :]


def _blocks_kernel(x_ref, rows_ref, cols_ref, scales_ref):
    """One 128 x 128 block: one scale, both layouts."""
    x = x_ref[...].astype(jnp.float32)
    # One axis at a time: Pallas Triton's reduction over both axes at once fails to lower under an explicit mesh.
    scale, inverse = scale_and_inverse(jnp.max(jnp.max(magnitude(x), axis=1), axis=0))
    y = x * inverse
    rows_ref[...] = y.astype(FP8)
    cols_ref[...] = y.T.astype(FP8)
    scales_ref[...] = jnp.full((1, 1), scale, jnp.float32)


def _launch(x_BRC: jax.Array, kind: str, interpret: bool, num_warps: int):
    b, r, c = x_BRC.shape
    rb, cb = r // TILE, c // TILE
    tile = lambda index: pl.BlockSpec((None, TILE, TILE), index)
    # Inside shard_map the outputs vary over the mesh axes x does (check_vma needs the type stated).
    out = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=jax.typeof(x_BRC).mat)
    values = [tile(lambda g, i, j: (g, i, j)), tile(lambda g, i, j: (g, j, i))]
    values_shape = [out((b, r, c), FP8), out((b, c, r), FP8)]
    if kind == "tiles":
        kernel = _tiles_kernel
        scales = [pl.BlockSpec((None, 1, TILE), lambda g, i, j: (g, j, i)),
                  pl.BlockSpec((None, 1, TILE), lambda g, i, j: (g, i, j))]
        scales_shape = [out((b, cb, r), jnp.float32), out((b, rb, c), jnp.float32)]
    else:
        kernel = _blocks_kernel
        scales = [pl.BlockSpec((None, 1, 1), lambda g, i, j: (g, i, j))]
        scales_shape = [out((b, rb, cb), jnp.float32)]
    call = pl.pallas_call(
        kernel, grid=(b, rb, cb), in_specs=[tile(lambda g, i, j: (g, i, j))], out_specs=values + scales,
        out_shape=values_shape + scales_shape, interpret=interpret, name=f"dropless_quantize_pair_{kind}",
        compiler_params=None if interpret else _triton_params(num_warps))
    return call(x_BRC)


def _triton_params(num_warps: int):
    from jax.experimental.pallas import triton as pltriton  # GPU-only module, imported where a kernel is built

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
