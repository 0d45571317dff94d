"""How rows cross the link between devices: in the compute dtype, or in FP8 (`moe.dispatch_dtype=float8`).

The rows that travel TO the experts (the tokens in the forward dispatch, the output's gradient in the backward
of the combine) can travel in FP8, as DeepSeek-V3 dispatches them: float8_e4m3fn with one float32 scale per
tile of 128 consecutive values of a row (the tile's largest magnitude maps to 448, e4m3's largest value), a
relative error of at most 2**-4 per value, at half the bytes of bf16 (plus 3% for the scales). The experts
still compute in the compute dtype: rows are dequantized on arrival. The rows that come BACK (partial sums of
the combine, the input's gradient in the backward of the dispatch) are sums and travel in the compute dtype.

Both directions are one `Wire` method around the strategy's collective (any collective that moves whole rows
along the leading axes, so that a row's scales can travel beside it by the same collective):

- `to_experts(collective, x, *operands)`: forward quantizes, moves the FP8 rows and their scales, dequantizes;
  the backward is the collective's transpose on the cotangent in its own dtype (the rounding is not
  differentiated: straight-through).
- `from_experts(collective, y, *operands)`: forward moves y as it is; the backward quantizes the cotangent and
  moves it through the transpose in FP8.
With `dtype=None` both are the collective itself. Values beyond FP8's range cannot occur (each tile is scaled
to fit); a non-finite value makes its tile non-finite, as it would make the layer's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
TILE = 128  # values per scale along a row (DeepSeek-V3's 1 x 128 activation tiles)


def tile_size(hidden: int) -> int:
    """Values per scale: TILE where it divides the row, else the whole row (one scale per row)."""
    return TILE if hidden % TILE == 0 else hidden


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., D] -> (float8_e4m3fn [..., D], float32 scales [..., D / tile]): x ~= q * scale, tile by tile.

    An all-zero tile gets scale 1 (and zeros)."""
    *lead, hidden = x.shape
    tile = tile_size(hidden)
    tiles = x.astype(jnp.float32).reshape(*lead, hidden // tile, tile)
    amax = jnp.max(jnp.abs(tiles), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (tiles / scale[..., None]).astype(FP8).reshape(x.shape)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """The inverse of `quantize` (up to its rounding), in `dtype`."""
    *lead, hidden = q.shape
    tiles = q.astype(jnp.float32).reshape(*lead, scale.shape[-1], hidden // scale.shape[-1])
    return (tiles * scale[..., None]).reshape(q.shape).astype(dtype)


def _transpose(collective: Callable, shape, dtype, varying: frozenset) -> Callable:
    """The linear transpose of `collective` at an input of this shape, dtype and mesh-axis type."""
    example = jnp.zeros(shape, dtype)
    if varying:  # only the example's type matters; mark it as varying like the real input
        example = jax.lax.pcast(example, tuple(sorted(varying)), to="varying")
    transposed = jax.linear_transpose(collective, example)
    return lambda cotangent: transposed(cotangent)[0]


def _through_fp8(move: Callable, rows: jax.Array, dtype) -> jax.Array:
    """`rows` quantized, moved (the FP8 rows and their scales by the same collective), dequantized to `dtype`."""
    q, scale = quantize(rows)
    return dequantize(move(q), move(scale), dtype)


def _with_backward(forward: Callable, backward: Callable, x: jax.Array, operands: tuple) -> jax.Array:
    """forward(x, operands) differentiated by backward(cotangent, operands) -> x's cotangent (operands: none)."""
    @jax.custom_vjp
    def move(x, operands):
        return forward(x, operands)

    move.defvjp(lambda x, operands: (move(x, operands), operands),
                lambda operands, cotangent: (backward(cotangent, operands), None))
    return move(x, operands)


@dataclass(frozen=True)
class Wire:
    """The dtype rows travel in towards the experts: None = as they are, or "float8" (see the module).

    `collective(rows, *operands)` moves rows along their leading axes; `operands` (e.g. the offsets of a
    ragged_all_to_all) are passed explicitly, not closed over, so that the backward can use them too.
    """

    dtype: str | None = None

    @classmethod
    def from_config(cls, name: str) -> "Wire":
        return cls(None if name == "compute" else name)

    def bytes_per_value(self, compute_bytes: int, hidden: int) -> float:
        """Bytes one value of a row towards the experts takes on the link (FP8: 1, plus its share of a scale)."""
        return compute_bytes if self.dtype is None else 1 + 4 / tile_size(hidden)

    def to_experts(self, collective: Callable, x: jax.Array, *operands) -> jax.Array:
        if self.dtype is None:
            return collective(x, *operands)
        varying = jax.typeof(x).mat.varying

        def forward(x, operands):
            return _through_fp8(lambda rows: collective(rows, *operands), x, x.dtype)

        def backward(cotangent, operands):  # the rounding is not differentiated: the transpose, as it is
            return _transpose(lambda rows: collective(rows, *operands), x.shape, x.dtype, varying)(cotangent)

        return _with_backward(forward, backward, x, operands)

    def from_experts(self, collective: Callable, y: jax.Array, *operands) -> jax.Array:
        if self.dtype is None:
            return collective(y, *operands)
        varying = jax.typeof(y).mat.varying
        scale_shape = y.shape[:-1] + (y.shape[-1] // tile_size(y.shape[-1]),)

        def backward(cotangent, operands):  # the transpose, on FP8 rows and their scales
            move = lambda rows: collective(rows, *operands)
            q, scale = quantize(cotangent)
            rows = _transpose(move, y.shape, FP8, varying)(q)
            scales = _transpose(move, scale_shape, jnp.float32, varying)(scale)
            return dequantize(rows, scales, y.dtype)

        return _with_backward(lambda y, operands: collective(y, *operands), backward, y, operands)
