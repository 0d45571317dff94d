"""The grouped-GEMM interface every backend implements, and the row contract they share.

A backend is called as `gmm(lhs_MK, rhs_GKN, group_sizes_G) -> out_MN`: rows
`[offset_g, offset_g + group_sizes_G[g])` of `lhs` are multiplied by `rhs[g]`, where the offsets are the
exclusive cumulative sum of `group_sizes_G`. Rows past `sum(group_sizes_G)` are padding: they are never read
as data (NaN there must not leak) and their outputs are zero, unless the caller passes `zero_padding=False`,
which lets a backend leave them unwritten (anything, NaN included) when no reader looks at them: on a GPU the
zeroing is a pass of its own over the output wherever XLA cannot fuse it into the reader. The padding rows'
input gradients are zero too, unless the caller passes `zero_lhs_grad_padding=False` because nothing reads them
(the routed experts' gate+up projection, whose input gradient only the permutation's backward reads, row by
row of the (token, expert) pairs); backends whose zeros cost nothing ignore both flags. `dropped_rows(group_sizes_G, num_rows)` counts the rows a backend did not
compute (always 0 except for `capacity`).

`row_align`: the layout a backend asks of its caller. 1 (every backend but the FP8 one): groups lie end to end.
A > 1: each group starts at a multiple of `row_align` rows and its size is a multiple of it, the rows a group holds
beyond its (token, expert) pairs being zeros, in a buffer of `aligned_rows(pairs, G, row_align)` rows; the
permutation (dropless.moe.permute) writes that layout. Zero rows change no product (forward, input gradient,
weight gradient, SwiGLU), so the results are exact; the FP8 weight gradient then reads its 128-token scale tiles
from a plain transpose (dropless.fp8.grouped).

`weights_as_stored`: whether a backend takes the weights in their stored dtype (the float32 master weights) rather
than cast to the rows' dtype. The FP8 one does: it quantizes them itself, and a cast first would add a pass over
every weight, hold a bf16 copy of them, and round each value twice (the cast of the gradient back to float32 XLA
fuses into the optimizer's reads).

The backends and their names are in `dropless.gmm.registry`.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

# Row alignment, the two constraints the kernels put on rows:
# our Mosaic GPU kernels start a group's row tiles at its first row rounded down to a multiple of this, so that
# every TMA box starts on a row of an 8-row shared-memory tile; expert parallelism's bounded buffers hold a
# multiple of it too.
TMA_ROW_ALIGNMENT = 8
# The Mosaic GPU backends pad the row count M to a multiple of this: tokamax's kernel rejects row counts that are
# not a multiple of its row tile (64 was refused), and a tuned table entry may name that kernel for any product.
TOKAMAX_ROW_MULTIPLE = 128

# The weight gradient's dimension numbers: contract the (ragged) row axis, one [K, N] block per group.
RAGGED_CONTRACTING = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


class GroupedMatmul:
    """Interface of a grouped-GEMM backend. Subclasses are frozen dataclasses, so they are hashable and static;
    `name` is the `moe.gmm_backend` value that builds it."""

    name: ClassVar[str] = "abstract"
    row_align: int = 1  # the layout asked of the caller (module docstring)
    weights_as_stored: ClassVar[bool] = False  # module docstring

    def __call__(self, lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array, *,
                 preferred_element_type=None, zero_padding: bool = True,
                 zero_lhs_grad_padding: bool = True) -> jax.Array:
        raise NotImplementedError

    def dropped_rows(self, group_sizes_G: jax.Array, num_rows: int | None = None) -> jax.Array:
        """Rows of the grouped GEMM that were not computed (their output is zero). Dropless backends: 0."""
        del group_sizes_G, num_rows
        return jnp.zeros((), jnp.int32)


def aligned_rows(num_rows: int, num_groups: int, align: int) -> int:
    """The static length of a buffer holding `num_rows` rows in `num_groups` groups, each padded to a multiple of
    `align`: at most align - 1 padding rows per group, in whole blocks of `align`."""
    return num_rows if align == 1 else align * (-(-num_rows // align) + num_groups)


def row_mask(num_rows: int, group_sizes_G: jax.Array) -> jax.Array:
    """[M] bool: True for rows that belong to a group, False for the padding past sum(group_sizes)."""
    return jnp.arange(num_rows, dtype=jnp.int32) < jnp.sum(group_sizes_G)


def zero_padding_rows(out_MX: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    """`out_MX` with the rows past sum(group_sizes) set to zero (they may hold anything, NaN included)."""
    return jnp.where(row_mask(out_MX.shape[0], group_sizes_G)[:, None], out_MX, jnp.zeros((), out_MX.dtype))
