"""`moe.gmm_backend=dropless_mosaic` (the GPU default): our Mosaic GPU kernels, with a tuned tile per product.

Each of the three products (dropless.gmm.vjp) runs the kernel and tile that `tuning.plan_for` picks for this GPU
and shape from configs.json: our kernels (`dropless.gmm.mosaic`, and its warp-specialised variant
`dropless.gmm.mosaic_ws`) for every shape measured so far, since they read W and x in place and their weight
gradient is correct; tokamax's (`dropless.gmm.tokamax.tiled_*`) where a table entry names it.

Needs an NVIDIA GPU. On any other machine the backend can be built (so configs and tests can name it), but
calling it raises MoEError telling the user to pick `moe.gmm_backend=xla` or `auto`: it never falls back
silently, because a benchmark that quietly ran the XLA path would report the wrong thing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from dropless.core.errors import MoEError
from dropless.gmm import mosaic, mosaic_ws, tokamax
from dropless.gmm.api import TOKAMAX_ROW_MULTIPLE, GroupedMatmul
from dropless.gmm.tuning import GmmPlan, ProductConfig, plan_for
from dropless.gmm.vjp import GmmProducts, gmm_from_products

# The kernel a table entry names (ProductConfig.kernel), for each kind of product.
ROWS_KERNELS = {"dropless": mosaic.grouped_matmul, "dropless_ws": mosaic_ws.grouped_matmul_ws,
                "dropless_ws_stream": mosaic_ws.grouped_matmul_stream,
                "dropless_ws_stream_async": functools.partial(mosaic_ws.grouped_matmul_stream, mma_in_flight=1),
                "dropless_ws_stacked": mosaic_ws.grouped_matmul_stacked, "tokamax": tokamax.tiled_rows}
CONTRACT_KERNELS = {"dropless": mosaic.grouped_matmul_tn, "dropless_ws": mosaic_ws.grouped_matmul_tn_ws,
                    "dropless_ws_stream": mosaic_ws.grouped_matmul_tn_stream,
                    "dropless_ws_stream_async": functools.partial(mosaic_ws.grouped_matmul_tn_stream, mma_in_flight=1),
                    "tokamax": tokamax.tiled_contract}


# Each entry is one jitted program per (config, shapes): a step that calls one kernel from many places (layers,
# the recomputed forward) lowers it once, and the program's profile names it.
@functools.partial(jax.jit, static_argnames=("config", "transpose_rhs", "out_dtype"))
def ragged_rows(lhs_MK, rhs, group_sizes_G, config: ProductConfig, *, transpose_rhs: bool, out_dtype):
    """out[m] = lhs[m] · rhs[g(m)] (or rhs[g(m)]ᵀ) by the config's kernel and tile; rows past sum(group_sizes)
    unwritten."""
    return ROWS_KERNELS[config.kernel](lhs_MK, rhs, group_sizes_G, config.tile, transpose_rhs=transpose_rhs,
                                       out_dtype=out_dtype)


@functools.partial(jax.jit, static_argnames=("config", "out_dtype"))
def ragged_contract(lhs_MK, rhs_MN, group_sizes_G, config: ProductConfig, *, out_dtype):
    """out[g] = lhs[rows of g]ᵀ · rhs[rows of g], [G, K, N], by the config's kernel and tile."""
    return CONTRACT_KERNELS[config.kernel](lhs_MK, rhs_MN, group_sizes_G, config.tile, out_dtype=out_dtype)


@dataclass(frozen=True)
class TiledRows:
    """A rows product (fwd or dlhs) by one tuned kernel and tile."""

    config: ProductConfig

    def __call__(self, lhs_MK, rhs, group_sizes_G, *, transpose_rhs, out_dtype):
        return ragged_rows(lhs_MK, rhs, group_sizes_G, self.config, transpose_rhs=transpose_rhs, out_dtype=out_dtype)


@dataclass(frozen=True)
class TiledContract:
    """The weight-gradient product (drhs) by one tuned kernel and tile."""

    config: ProductConfig

    def __call__(self, lhs_MK, rhs_MN, group_sizes_G, *, out_dtype):
        return ragged_contract(lhs_MK, rhs_MN, group_sizes_G, self.config, out_dtype=out_dtype)


@dataclass(frozen=True)
class TunedContract:
    """The weight-gradient product by the kernel and tile the table picks for its shape (looked up while tracing:
    shapes are static). tokamax_mosaic's weight gradient: correct where tokamax's own is not."""

    def __call__(self, lhs_MK, rhs_MN, group_sizes_G, *, out_dtype):
        (m, k), n = lhs_MK.shape, rhs_MN.shape[1]
        return ragged_contract(lhs_MK, rhs_MN, group_sizes_G, plan_for(m, k, n, group_sizes_G.shape[0]).drhs,
                               out_dtype=out_dtype)


def tuned_products(plan: GmmPlan) -> GmmProducts:
    """The three products of one tuned plan."""
    return GmmProducts(fwd=TiledRows(plan.fwd), dlhs=TiledRows(plan.dlhs), drhs=TiledContract(plan.drhs))


def padded_tuned_gmm(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type, zero_padding=True,
                     zero_lhs_grad_padding=True):
    """The tuned three-product path; the plan is looked up while tracing (shapes are static)."""
    if lhs_MK.dtype != rhs_GKN.dtype or lhs_MK.dtype not in (jnp.bfloat16, jnp.float16):
        raise MoEError(f"moe.gmm_backend={DroplessMosaicGmm.name} multiplies bf16 or f16 operands of one dtype, "
                       f"got {lhs_MK.dtype} x {rhs_GKN.dtype}; use train.dtype=bfloat16 or moe.gmm_backend=xla.")
    num_rows, k = lhs_MK.shape
    g, _, n = rhs_GKN.shape
    # tokamax's kernel (if a table entry names it) rejects row counts off its row tile; the extra rows are padding,
    # which every kernel here leaves out of dW and whose outputs gmm_from_products zeroes (unless zero_padding=False).
    lhs_PK = jnp.pad(lhs_MK, ((0, -num_rows % TOKAMAX_ROW_MULTIPLE), (0, 0)))
    out_dtype = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
    products = tuned_products(plan_for(lhs_PK.shape[0], k, n, g))
    out_PN = gmm_from_products(lhs_PK, rhs_GKN, group_sizes_G, products, out_dtype, zero_padding,
                               zero_lhs_grad_padding)
    return out_PN[:num_rows]


@dataclass(frozen=True)
class DroplessMosaicGmm(GroupedMatmul):
    """Our Mosaic GPU kernels with the tuned tile for each product and shape (needs an NVIDIA GPU)."""

    name: ClassVar[str] = "dropless_mosaic"

    def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None, zero_padding=True,
                 zero_lhs_grad_padding=True):
        if jax.default_backend() != "gpu":
            raise MoEError(f"moe.gmm_backend={self.name} needs an NVIDIA GPU (Mosaic GPU kernels) but the JAX "
                           f"backend is {jax.default_backend()!r}; use moe.gmm_backend=xla or auto.")
        return padded_tuned_gmm(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32), preferred_element_type,
                                zero_padding, zero_lhs_grad_padding)
