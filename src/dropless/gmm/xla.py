"""`moe.gmm_backend=xla`: jax.lax.ragged_dot, on every platform; and XLA's weight gradient as a product."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from dropless.gmm.api import RAGGED_CONTRACTING, GroupedMatmul


@dataclass(frozen=True)
class XlaGmm(GroupedMatmul):
    """`jax.lax.ragged_dot`: works on every platform; XLA zeroes the padding rows and never reads them."""

    name: ClassVar[str] = "xla"

    def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None, zero_padding=True,
                 zero_lhs_grad_padding=True):
        del zero_padding, zero_lhs_grad_padding  # XLA's padding rows are zero anyway, gradients' too
        return jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32),
                                  preferred_element_type=preferred_element_type)


@dataclass(frozen=True)
class XlaContract:
    """The weight-gradient product (dropless.gmm.vjp) by `jax.lax.ragged_dot_general`, accumulated in float32."""

    def __call__(self, lhs_MK, rhs_MN, group_sizes_G, *, out_dtype):
        return jax.lax.ragged_dot_general(lhs_MK, rhs_MN, group_sizes_G, RAGGED_CONTRACTING,
                                          preferred_element_type=jnp.float32).astype(out_dtype)
