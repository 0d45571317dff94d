"""tokamax's grouped-GEMM kernels as products of dropless.gmm.vjp, and `moe.gmm_backend=tokamax_mosaic`.

Two ways to run tokamax's Mosaic GPU ragged_dot:
- with an explicit tile (`tiled_rows`, `tiled_contract`): a tuned table entry (dropless.gmm.tuning) may name
  kernel "tokamax" for a product of the dropless_mosaic backend;
- with tokamax's heuristic tiles (`TokamaxRows`, `TokamaxContract`): `TokamaxGmm`, the tokamax_mosaic backend, a
  benchmark reference. Its weight gradient is ours by default there: tokamax 0.0.17's weight-gradient kernel (its
  "ragged contracting dim" kernel) was wrong by 15-25 % per expert on an H200, and differed from run to run, for
  groups of >= 512 rows.

tokamax is an optional dependency: it is imported where a kernel is traced. Its kernels leave rows past
sum(group_sizes) unwritten and its weight gradient reads the padding rows, so `TokamaxGmm` zeroes those rows on
the way in and on the way out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp

from dropless.core.errors import MoEError
from dropless.gmm.api import RAGGED_CONTRACTING, TOKAMAX_ROW_MULTIPLE, GroupedMatmul, row_mask
from dropless.gmm.tuning import TOKAMAX_MOSAIC_MODULE, TileConfig, import_tokamax
from dropless.gmm.vjp import ContractProduct, GmmProducts, gmm_from_products
from dropless.gmm.xla import XlaContract


def _tiled_op(tile: TileConfig):
    # = tokamax.ops.gpu.PallasMosaicRaggedDot, without the Triton kernels that module also imports.
    kernel = import_tokamax(TOKAMAX_MOSAIC_MODULE).PallasMosaicGpuRaggedDot
    return kernel(config=tile.to_tokamax(), bypass_device_check=True)


def tiled_rows(lhs_MK, rhs, group_sizes_G, tile: TileConfig, *, transpose_rhs: bool, out_dtype):
    """A rows product by tokamax's Mosaic GPU kernel with this tile; rows past sum(group_sizes) unwritten."""
    if transpose_rhs:  # tokamax 0.0.17 materialises this transpose itself; doing it here makes the cost visible
        rhs = jnp.swapaxes(rhs, 1, 2)
    return _tiled_op(tile)(lhs_MK, rhs, group_sizes=group_sizes_G, preferred_element_type=out_dtype)


def tiled_contract(lhs_MK, rhs_MN, group_sizes_G, tile: TileConfig, *, out_dtype):
    """The weight-gradient product by tokamax's Mosaic GPU kernel with this tile (it copies lhsᵀ first)."""
    return _tiled_op(tile)(lhs_MK, rhs_MN, group_sizes=group_sizes_G,
                           ragged_dot_dimension_numbers=RAGGED_CONTRACTING, preferred_element_type=out_dtype)


@dataclass(frozen=True)
class TokamaxRows:
    """A rows product by `tokamax.ragged_dot` with its heuristic tiles; `implementation` is tokamax's name."""

    implementation: str

    def __call__(self, lhs_MK, rhs, group_sizes_G, *, transpose_rhs, out_dtype):
        tokamax = import_tokamax()
        if transpose_rhs:
            rhs = jnp.swapaxes(rhs, 1, 2)
        return tokamax.ragged_dot(lhs_MK, rhs, group_sizes_G, preferred_element_type=out_dtype,
                                  implementation=self.implementation)


@dataclass(frozen=True)
class TokamaxContract:
    """The weight-gradient product by `tokamax.ragged_dot_general` (wrong on an H200 with tokamax 0.0.17)."""

    implementation: str

    def __call__(self, lhs_MK, rhs_MN, group_sizes_G, *, out_dtype):
        tokamax = import_tokamax()
        return tokamax.ragged_dot_general(lhs_MK, rhs_MN, group_sizes_G, RAGGED_CONTRACTING,
                                          preferred_element_type=out_dtype, implementation=self.implementation)


@dataclass(frozen=True)
class TokamaxGmm(GroupedMatmul):
    """tokamax's ragged_dot with its heuristic tiles for the forward and dx; dW by `weight_grad`.

    `implementation="mosaic"` is tokamax's Mosaic GPU kernel (moe.gmm_backend=tokamax_mosaic, built with our
    tuned weight-gradient kernel by dropless.gmm.registry); `"xla"` is tokamax's portable path, which only the CPU
    tests of this wrapper use. Needs an NVIDIA GPU for "mosaic": elsewhere the backend can be built (so configs
    and tests can name it), but calling it raises MoEError; it never falls back silently, because a benchmark
    that quietly ran the XLA path would report the wrong thing."""

    implementation: Literal["mosaic", "xla"] = "mosaic"
    weight_grad: ContractProduct = field(default_factory=XlaContract)
    name: ClassVar[str] = "tokamax_mosaic"

    def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None, zero_padding=True,
                 zero_lhs_grad_padding=True):
        # Padding rows are zeroed always, output and input gradient: tokamax's kernel leaves them unwritten.
        del zero_padding, zero_lhs_grad_padding
        if self.implementation != "xla" and jax.default_backend() != "gpu":
            raise MoEError(f"moe.gmm_backend={self.name} needs an NVIDIA GPU (tokamax's Mosaic GPU kernel) but the "
                           f"JAX backend is {jax.default_backend()!r}; use moe.gmm_backend=xla or auto.")
        group_sizes_G = group_sizes_G.astype(jnp.int32)
        num_rows = lhs_MK.shape[0]
        # Zero the padding rows (they may hold NaN) and pad to the kernel's row tile; extra rows are padding.
        lhs_PK = jnp.pad(jnp.where(row_mask(num_rows, group_sizes_G)[:, None], lhs_MK, 0),
                         ((0, -num_rows % TOKAMAX_ROW_MULTIPLE), (0, 0)))
        rows = TokamaxRows(self.implementation)
        products = GmmProducts(fwd=rows, dlhs=rows, drhs=self.weight_grad, zero_cotangent_padding=True)
        out_dtype = jnp.dtype(preferred_element_type or lhs_MK.dtype)
        return gmm_from_products(lhs_PK, rhs_GKN, group_sizes_G, products, out_dtype, True)[:num_rows]
