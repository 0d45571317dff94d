"""FP8 e4m3 quantization with fine-grained, power-of-two scales: the quantizer every FP8 path uses.

`quantize(x, block)` splits x into blocks (`block` gives the block's extent along each axis: an int, or None for
the whole axis) and stores each block as float8_e4m3fn values with one float32 scale, x ~= values * scale. The
scales of the recipes (`train.fp8`, dropless.fp8) are block shapes of this one function: a [M, K] activation per
row is (1, None), per 1x128 tile (1, 128), a weight per 128x128 block (128, 128).

Every scale is a power of two: the smallest 2^e with amax / 2^e <= 448 (e4m3's largest finite value), read
exactly off amax's bits, and at least 2^-126. A power of two divides and multiplies exactly, so dequantizing is
exact in any format with e4m3's exponent range (bf16, float32): an e4m3 GEMM and "dequantize, then multiply in
bf16 or float32 with float32 accumulation" compute the same products, which is what lets the CPU and every
non-FP8 backend run FP8 numerics exactly (and lets the tests compare the kernels with a float64 reference to
float32 rounding). The price is at most one binade of range against amax/448 scaling; OCP's MX formats and
DeepSeek's later checkpoints (UE8M0 scales) make the same choice.

Error bound per value: |x - values * scale| <= max(2^-4 |x|, 2^-10 scale) (half an e4m3 ulp; the second term is
e4m3's subnormal spacing). An all-zero block gets scale 1; a block holding inf or NaN gets a NaN scale and NaN
values, so the non-finite value reaches the output (and the training step's divergence guard) instead of being
clipped to 448.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(FP8).max)  # 448
BlockShape = Sequence[int | None]


class Quantized(NamedTuple):
    """e4m3 `values` and float32 `scales`: one scale per block, scales.shape[i] = ceil(values.shape[i] / block[i])."""

    values: jax.Array
    scales: jax.Array


def magnitude(x: jax.Array) -> jax.Array:
    """|x| in float32 with NaN as inf, so that a block's maximum is non-finite whenever any of its values is (a
    maximum may skip NaN: XLA's CPU reductions and Triton's do)."""
    x = x.astype(jnp.float32)
    return jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x))


def scale_exponent(amax: jax.Array) -> jax.Array:
    """int32 e of the smallest power of two 2^e with amax / 2^e <= E4M3_MAX, read exactly off amax's bits (no
    rounded division): amax = (1 + f) 2^a and 448 = 1.75 * 2^8, so e = a - 8 when f <= 0.75 and a - 7 otherwise.
    0 where amax is 0; at least -126, so that 2^e and 2^-e are normal float32 numbers (float32's largest finite
    value gives 120). XLA flushes subnormal inputs to zero, so a block of subnormal magnitudes reads as all-zero
    there. Meaningless where amax is not finite."""
    bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
    exponent = jax.lax.shift_right_logical(bits, 23) - 127
    exponent = exponent - 8 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)
    return jnp.where(amax > 0, jnp.maximum(exponent, -126), 0)


def exp2_int(exponent: jax.Array) -> jax.Array:
    """2.0 ** exponent in float32 for int32 exponents in [-126, 127], built from the bits (exact)."""
    return jax.lax.bitcast_convert_type(jax.lax.shift_left(exponent + 127, 23), jnp.float32)


def scale_and_inverse(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(s, 1/s) for the smallest power of two s with amax / s <= E4M3_MAX (`scale_exponent`): 1 where amax is 0,
    both NaN where amax is not finite, so every value of the block becomes NaN rather than saturating at 448."""
    amax = amax.astype(jnp.float32)
    exponent = scale_exponent(amax)
    finite = amax < jnp.inf  # False for inf and NaN
    return (jnp.where(finite, exp2_int(exponent), jnp.nan), jnp.where(finite, exp2_int(-exponent), jnp.nan))


def power_of_two_scale(amax: jax.Array) -> jax.Array:
    """The scale of `scale_and_inverse`."""
    return scale_and_inverse(amax)[0]


def _blocks(shape: Sequence[int], block: BlockShape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(block extents, block counts) per axis, None meaning the whole axis: one block, empty if the axis is."""
    if len(block) != len(shape):
        raise ValueError(f"block {tuple(block)} names {len(block)} axes of a {len(shape)}-d array {tuple(shape)}")
    extents = tuple(n if b is None else int(b) for n, b in zip(shape, block))
    return extents, tuple(1 if b is None else -(-n // e) for n, b, e in zip(shape, block, extents))


def _padded_blocks(x: jax.Array, extents, counts) -> jax.Array:
    """x zero-padded to whole blocks and reshaped to [c0, b0, c1, b1, ...]."""
    pad = [(0, c * b - n) for n, b, c in zip(x.shape, extents, counts)]
    if any(p for _, p in pad):
        x = jnp.pad(x, pad)
    return x.reshape([d for cb in zip(counts, extents) for d in cb])


def quantize(x: jax.Array, block: BlockShape) -> Quantized:
    """x as e4m3 values with one power-of-two scale per block (module docstring)."""
    extents, counts = _blocks(x.shape, block)
    if not math.prod(x.shape):
        return Quantized(x.astype(FP8), jnp.ones(counts, jnp.float32))
    blocks = _padded_blocks(x.astype(jnp.float32), extents, counts)
    inner = tuple(range(1, blocks.ndim, 2))
    scale, inverse = scale_and_inverse(jnp.max(magnitude(blocks), axis=inner, keepdims=True))
    values = jnp.clip(blocks * inverse, -E4M3_MAX, E4M3_MAX).astype(FP8)  # exact: the inverse is a power of two
    values = values.reshape([c * b for c, b in zip(counts, extents)])
    return Quantized(values[tuple(slice(0, n) for n in x.shape)], scale.reshape(counts))


def expand_scales(scales: jax.Array, shape: Sequence[int], block: BlockShape) -> jax.Array:
    """Each block's scale repeated over the block: float32 of `shape`."""
    extents, counts = _blocks(shape, block)
    if tuple(scales.shape) != counts:
        raise ValueError(f"scales {scales.shape} do not match {counts} blocks of {tuple(shape)} by {tuple(block)}")
    for axis, extent in enumerate(extents):
        # A static count alone: jnp.repeat broadcasts and reshapes (given total_repeat_length, it builds the
        # indices with a scatter and a cumulative sum, then gathers).
        scales = jnp.repeat(scales, extent, axis=axis)
    return scales[tuple(slice(0, n) for n in shape)]


def dequantize(q: Quantized, block: BlockShape, dtype=jnp.float32) -> jax.Array:
    """values * scale in `dtype` (exact for bf16 and float32: the scales are powers of two)."""
    scales = expand_scales(q.scales, q.values.shape, block)
    return (q.values.astype(jnp.float32) * scales).astype(dtype)


def fake_quantize(x: jax.Array, block: BlockShape, dtype=None) -> jax.Array:
    """dequantize(quantize(x, block)) in `dtype` (default x's): the value an FP8 GEMM computes with."""
    return dequantize(quantize(x, block), block, dtype or x.dtype)


def quantize_with_scales(x: jax.Array, scales: jax.Array, block: BlockShape) -> Quantized:
    """x as e4m3 values with the given per-block scales (powers of two, each at least its block's amax / 448),
    for scales chosen over more than one block: e.g. one scale per expert over that expert's 128-row blocks."""
    expanded = expand_scales(scales, x.shape, block)
    values = jnp.clip(x.astype(jnp.float32) / expanded, -E4M3_MAX, E4M3_MAX).astype(FP8)
    return Quantized(values, scales)


def block_amax(x: jax.Array, block: BlockShape) -> jax.Array:
    """The largest magnitude in each block, float32 with one entry per block."""
    extents, counts = _blocks(x.shape, block)
    blocks = _padded_blocks(magnitude(x), extents, counts)
    return jnp.max(blocks, axis=tuple(range(1, blocks.ndim, 2)))
