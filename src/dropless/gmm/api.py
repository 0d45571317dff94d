"""Grouped GEMM backends behind one interface, chosen once from `moe.gmm_backend`.

A backend is called as `gmm(lhs_MK, rhs_GKN, group_sizes_G) -> out_MN`: rows
`[offset_g, offset_g + group_sizes_G[g])` of `lhs` are multiplied by `rhs[g]`, where the offsets are the
exclusive cumulative sum of `group_sizes_G`. Rows past `sum(group_sizes_G)` are padding: they are never read
as data (NaN there must not leak) and their outputs are zero, unless the caller passes `zero_padding=False`,
which lets a backend leave them unwritten (anything, NaN included) when no reader looks at them: on a GPU the
zeroing is a pass of its own over the output wherever XLA cannot fuse it into the reader. The padding rows'
input gradients are zero either way. `dropped_rows(group_sizes_G, num_rows)` counts the rows a backend did not
compute (always 0 except for `capacity`).

Backends: `xla` (jax.lax.ragged_dot, everywhere), `tokamax` (Mosaic GPU kernel, in gmm_tokamax.py) and
`capacity` (the GShard/Switch baseline that drops rows over a fixed per-group capacity).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from dropless.core.errors import MoEError


class GroupedMatmul:
    """Interface of a grouped-GEMM backend. Subclasses are frozen dataclasses, so they are hashable and static."""

    name: ClassVar[str] = "abstract"

    def __call__(self, lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array, *,
                 preferred_element_type=None, zero_padding: bool = True) -> jax.Array:
        raise NotImplementedError

    def dropped_rows(self, group_sizes_G: jax.Array, num_rows: int | None = None) -> jax.Array:
        """Rows of the grouped GEMM that were not computed (their output is zero). Dropless backends: 0."""
        del group_sizes_G, num_rows
        return jnp.zeros((), jnp.int32)


def row_mask(num_rows: int, group_sizes_G: jax.Array) -> jax.Array:
    """[M] bool: True for rows that belong to a group, False for the padding past sum(group_sizes)."""
    return jnp.arange(num_rows, dtype=jnp.int32) < jnp.sum(group_sizes_G)


@dataclass(frozen=True)
class XlaGmm(GroupedMatmul):
    """`jax.lax.ragged_dot`: works on every platform; XLA zeroes the padding rows and never reads them."""

    name: ClassVar[str] = "xla"

    def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None, zero_padding=True):
        del zero_padding  # XLA's padding rows are zero anyway
        return jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32),
                                  preferred_element_type=preferred_element_type)


@dataclass(frozen=True)
class CapacityGmm(GroupedMatmul):
    """The GShard/Switch capacity-factor baseline: it DROPS rows.

    Each group keeps only its first C = ceil(capacity_factor * M / G) rows, packed into a dense
    [G, C, K] buffer and multiplied by one batched einsum; rows past the capacity get output zero and are
    counted by `dropped_rows`. The row order inside a group decides who is dropped: after a stable sort
    by expert that is token order, as in GShard.
    """

    capacity_factor: float = 1.25
    name: ClassVar[str] = "capacity"

    def capacity(self, num_rows: int, num_groups: int) -> int:
        return max(1, math.ceil(self.capacity_factor * num_rows / num_groups))

    def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None, zero_padding=True):
        del zero_padding  # its padding rows are zero anyway
        num_rows, num_groups = lhs_MK.shape[0], rhs_GKN.shape[0]
        cap = self.capacity(num_rows, num_groups)
        group_sizes_G = group_sizes_G.astype(jnp.int32)
        starts_G = jnp.cumsum(group_sizes_G) - group_sizes_G
        # Pack: slot (g, c) holds row starts[g] + c if c < min(size[g], C); empty slots read nothing.
        slot_C = jnp.arange(cap, dtype=jnp.int32)
        rows_GC = starts_G[:, None] + slot_C[None, :]
        filled_GC = slot_C[None, :] < group_sizes_G[:, None]
        packed_GCK = jnp.where(filled_GC[..., None], lhs_MK[jnp.where(filled_GC, rows_GC, 0)], 0)
        out_GCN = jnp.einsum("gck,gkn->gcn", packed_GCK, rhs_GKN, preferred_element_type=preferred_element_type)
        # Unpack: row m of group g at position p = m - starts[g] reads slot (g, p) if p < C.
        row_M = jnp.arange(num_rows, dtype=jnp.int32)
        group_M = jnp.searchsorted(jnp.cumsum(group_sizes_G), row_M, side="right").astype(jnp.int32)
        in_group_M = group_M < num_groups
        group_M = jnp.minimum(group_M, num_groups - 1)
        pos_M = row_M - starts_G[group_M]
        kept_M = in_group_M & (pos_M < cap)
        out_MN = out_GCN[group_M, jnp.minimum(pos_M, cap - 1)]
        return jnp.where(kept_M[:, None], out_MN, 0)

    def dropped_rows(self, group_sizes_G, num_rows=None):
        if num_rows is None:
            raise MoEError("CapacityGmm.dropped_rows needs num_rows, the row count M of the grouped GEMM, "
                           "because the capacity is ceil(capacity_factor * M / G); pass lhs.shape[0].")
        cap = self.capacity(num_rows, group_sizes_G.shape[0])
        return jnp.sum(jnp.maximum(group_sizes_G.astype(jnp.int32) - cap, 0)).astype(jnp.int32)


def resolve_backend_name(backend: str) -> str:
    """`auto` means tokamax on a GPU and xla elsewhere."""
    if backend == "auto":
        return "tokamax" if jax.default_backend() == "gpu" else "xla"
    return backend


@functools.lru_cache(maxsize=None)
def _make(backend: str, capacity_factor: float) -> GroupedMatmul:
    if backend == "xla":
        return XlaGmm()
    if backend == "capacity":
        return CapacityGmm(capacity_factor)
    if backend == "tokamax":
        from dropless.gmm.tokamax import TokamaxGmm  # imports tokamax only when asked for

        return TokamaxGmm()
    if backend == "tokamax_default":
        from dropless.gmm.tokamax import TokamaxGmm

        return TokamaxGmm(implementation="mosaic", weight_grad="dropless")
    raise MoEError(f"moe.gmm_backend={backend!r} is not valid; choose one of auto, xla, tokamax, tokamax_default, "
                   f"capacity.")


def make_gmm(moe_cfg) -> GroupedMatmul:
    """The grouped-GEMM backend for this config (built once; the same object is returned on later calls)."""
    return _make(resolve_backend_name(moe_cfg.gmm_backend), float(moe_cfg.capacity_factor))
