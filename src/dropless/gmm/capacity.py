"""`moe.gmm_backend=capacity`: the GShard/Switch capacity-factor baseline, which drops rows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp

from dropless.core.errors import MoEError
from dropless.gmm.api import GroupedMatmul


@dataclass(frozen=True)
class CapacityGmm(GroupedMatmul):
    """The GShard/Switch capacity-factor baseline: it DROPS rows.

    Each group keeps only its first C = ceil(capacity_factor * P / G) rows, packed into a dense
    [G, C, K] buffer and multiplied by one batched einsum; rows past the capacity get output zero and are
    counted by `dropped_rows`. The row order inside a group decides who is dropped: after a stable sort
    by expert that is token order, as in GShard. P is `pairs`, the (token, expert) pairs the G experts share
    when the routing is balanced: by default the GEMM's M rows (one device, whose rows are its T*K pairs); under
    expert parallelism the executor sets it, since the rows a device receives (an all-gather's, a worst-case
    buffer's) are no measure of its experts' share.
    """

    capacity_factor: float = 1.25
    pairs: int | None = None
    name: ClassVar[str] = "capacity"

    def capacity(self, num_rows: int, num_groups: int) -> int:
        basis = num_rows if self.pairs is None else self.pairs
        return max(1, math.ceil(self.capacity_factor * basis / num_groups))

    def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None, zero_padding=True,
                 zero_lhs_grad_padding=True):
        del zero_padding, zero_lhs_grad_padding  # its padding rows are zero anyway
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
