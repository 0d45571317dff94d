"""The tuned grouped GEMM for training: one custom_vjp, an explicit kernel and tile for each of its products.

Why our own custom_vjp rather than tokamax's: tokamax picks a kernel config when the op is traced, from
(1) `op.config`, else (2) its autotuning cache, else (3) heuristics. Its backward always builds fresh
`PallasMosaicGpuRaggedDot()` ops for dx and dW, so a config given to the forward never reaches them, and
an `AutotuningResult` used as a context never matches at all: the overlay is keyed by the op object, whose
`vjp` field is a fresh `functools.partial` in every instance (partials compare by identity), so a result
loaded from JSON is never found (see tests/test_gmm_tuning.py). Passing `config=` per product, at trace
time, is the one mechanism that always takes effect, so that is what this module does, for all three:

  fwd   y  = x · W[g]             tokamax ragged_dot, or dropless grouped_matmul (or its warp-specialised _ws)
  dlhs  dx = dy · W[g]ᵀ           dropless grouped_matmul(_ws)(transpose_rhs) reads W in place; tokamax copies Wᵀ
  drhs  dW = x[rows of g]ᵀ · dy   dropless grouped_matmul_tn(_ws) reads x in place; tokamax copies xᵀ

Rows past sum(group_sizes) are padding: their outputs and input gradients are zero, and the weight
gradient never reads them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dropless.gmm.api import row_mask
from dropless.gmm.tuning import GmmPlan, ProductConfig
from dropless.core.varying import varying_like

_RAGGED_CONTRACTING = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _tokamax_op(config: ProductConfig):
    # = tokamax.ops.gpu.PallasMosaicRaggedDot; that module also imports tokamax's Triton kernels (jax_triton).
    from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot

    return PallasMosaicGpuRaggedDot(config=config.tile.to_tokamax(), bypass_device_check=True)


def _ragged_rows(lhs_MK, rhs_GKN, group_sizes_G, config: ProductConfig, *, transpose_rhs: bool, out_dtype):
    """out[m] = lhs[m] · rhs[g(m)] (or rhs[g(m)]ᵀ); rows past sum(group_sizes) unwritten."""
    if config.kernel == "dropless":
        from dropless.gmm.mosaic import grouped_matmul

        return grouped_matmul(lhs_MK, rhs_GKN, group_sizes_G, config.tile, transpose_rhs=transpose_rhs,
                              out_dtype=out_dtype)
    if config.kernel == "dropless_ws":
        from dropless.gmm.mosaic_ws import grouped_matmul_ws

        return grouped_matmul_ws(lhs_MK, rhs_GKN, group_sizes_G, config.tile, transpose_rhs=transpose_rhs,
                                 out_dtype=out_dtype)
    if transpose_rhs:  # tokamax 0.0.17 materialises this transpose itself; doing it here makes the cost visible
        rhs_GKN = jnp.swapaxes(rhs_GKN, 1, 2)
    return _tokamax_op(config)(lhs_MK, rhs_GKN, group_sizes=group_sizes_G, preferred_element_type=out_dtype)


def ragged_contract(lhs_MK, rhs_MN, group_sizes_G, config: ProductConfig, *, out_dtype):
    """out[g] = lhs[rows of g]ᵀ · rhs[rows of g], [G, K, N]."""
    if config.kernel == "dropless":
        from dropless.gmm.mosaic import grouped_matmul_tn

        return grouped_matmul_tn(lhs_MK, rhs_MN, group_sizes_G, config.tile, out_dtype=out_dtype)
    if config.kernel == "dropless_ws":
        from dropless.gmm.mosaic_ws import grouped_matmul_tn_ws

        return grouped_matmul_tn_ws(lhs_MK, rhs_MN, group_sizes_G, config.tile, out_dtype=out_dtype)
    return _tokamax_op(config)(lhs_MK, rhs_MN, group_sizes=group_sizes_G,
                               ragged_dot_dimension_numbers=_RAGGED_CONTRACTING, preferred_element_type=out_dtype)


def _zero_padding_rows(out_MX: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    return jnp.where(row_mask(out_MX.shape[0], group_sizes_G)[:, None], out_MX, jnp.zeros((), out_MX.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def tuned_gmm(lhs_MK, rhs_GKN, group_sizes_G, plan: GmmPlan, out_dtype=None, zero_padding: bool = True):
    """out_MN[m] = lhs_MK[m] · rhs_GKN[g(m)], differentiable in lhs and rhs, each product with the plan's kernel.

    zero_padding=False leaves the output's padding rows unwritten (dropless.gmm.api); the input gradient's padding
    rows are zero either way."""
    out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)
    out_MN = _ragged_rows(lhs_MK, rhs_GKN, group_sizes_G, plan.fwd, transpose_rhs=False, out_dtype=out_dtype)
    # Inside jax.shard_map the kernel's output varies over no mesh axis; it varies over its operands' axes (with
    # zero_padding the mask's `where` did this by accident; without it a custom_vjp downstream, unpermute, got a
    # cotangent typed unlike its primal: `bench ep` on two H200s at 3e04eab).
    out_MN = varying_like(out_MN, lhs_MK, rhs_GKN, group_sizes_G)
    return _zero_padding_rows(out_MN, group_sizes_G) if zero_padding else out_MN


def _fwd(lhs_MK, rhs_GKN, group_sizes_G, plan, out_dtype, zero_padding):
    out_MN = tuned_gmm(lhs_MK, rhs_GKN, group_sizes_G, plan, out_dtype, zero_padding)
    return out_MN, (lhs_MK, rhs_GKN, group_sizes_G)


def _bwd(plan, out_dtype, zero_padding, residuals, dout_MN):
    lhs_MK, rhs_GKN, group_sizes_G = residuals
    dout_MN = dout_MN.astype(lhs_MK.dtype)  # the kernels take one input dtype; an f32 output's cotangent is f32
    # Inside jax.shard_map a Pallas kernel's output varies over no mesh axis, but a cotangent must have its
    # primal's type: the weight gradient of experts sharded over `expert` must vary over `expert`.
    dlhs_MK = _ragged_rows(dout_MN, rhs_GKN, group_sizes_G, plan.dlhs, transpose_rhs=True, out_dtype=lhs_MK.dtype)
    drhs_GKN = ragged_contract(lhs_MK, dout_MN, group_sizes_G, plan.drhs, out_dtype=rhs_GKN.dtype)
    return (varying_like(_zero_padding_rows(dlhs_MK, group_sizes_G), lhs_MK), varying_like(drhs_GKN, rhs_GKN),
            None)


tuned_gmm.defvjp(_fwd, _bwd)
