"""The tokamax grouped-GEMM backend: tokamax.ragged_dot with its Mosaic GPU kernel.

Needs an NVIDIA GPU. On any other machine the backend can be built (so configs and tests can name it),
but calling it raises `MoEError` telling the user to pick `moe.gmm_backend=xla` or `auto`: we never
silently fall back, because a benchmark that quietly ran the XLA path would report the wrong thing.
`implementation="xla"` selects tokamax's portable reference path (used by the CPU tests of this wrapper).
Tuned kernel configurations, keyed by device and shape, belong in this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dropless.moe.errors import MoEError
from dropless.moe.gmm import GroupedMatmul, row_mask


@dataclass(frozen=True)
class TokamaxGmm(GroupedMatmul):
    implementation: str = "mosaic_gpu"
    name: str = "tokamax"

    def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None):
        import tokamax

        if self.implementation == "mosaic_gpu" and jax.default_backend() != "gpu":
            raise MoEError(f"moe.gmm_backend=tokamax needs an NVIDIA GPU (tokamax's Mosaic GPU kernel) but the "
                           f"JAX backend is {jax.default_backend()!r}; use moe.gmm_backend=xla or auto.")
        group_sizes_G = group_sizes_G.astype(jnp.int32)
        out_MN = tokamax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=preferred_element_type,
                                    implementation=self.implementation)
        # The kernel leaves rows past sum(group_sizes) unwritten (garbage); the contract says zero.
        return jnp.where(row_mask(lhs_MK.shape[0], group_sizes_G)[:, None], out_MN, 0)
