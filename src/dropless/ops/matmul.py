"""Matmuls whose output is wider than their operands, with a backward pass that stays in the operands' dtype.

`jnp.einsum(x_bf16, w_bf16, preferred_element_type=float32)` gives float32 logits, but JAX's transpose rule then
multiplies the float32 cotangent with the bf16 operand, which promotes both backward matmuls to float32, a
fraction of the bf16 rate on a GPU: for the lm_head, each of them then takes longer than its bf16 forward. Here the
cotangent is cast to the operands' dtype first, as in mixed-precision training generally: both backward matmuls
run at the bf16 rate and still accumulate in float32 (the GPU's bf16 GEMMs accumulate in float32 and round once).

The backward products are *emitted* in the operands' dtype, not computed in float32 and cast: with the batch split
over devices, the weight gradient is a partial sum that the partitioner all-reduces right after the dot, in the
dot's output dtype. For the lm_head, float32 partial sums would be an all-reduce of the whole float32 [D, V]
weight every step; in bf16 they are half the bytes, like every other weight gradient.
In float32 (the CPU tests) nothing changes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def matmul_f32_out(x_ND: jax.Array, w_DV: jax.Array) -> jax.Array:
    """x_ND · w_DV over x's last axis, accumulated and returned in float32 (operands of one dtype, e.g. bf16)."""
    return jnp.einsum("...d,dv->...v", x_ND, w_DV, preferred_element_type=jnp.float32)


def _fwd(x_ND, w_DV):
    return matmul_f32_out(x_ND, w_DV), (x_ND, w_DV)


def _bwd(residuals, g_NV):
    x_ND, w_DV = residuals
    g_NV = g_NV.astype(x_ND.dtype)
    dx_ND = jnp.einsum("...v,dv->...d", g_NV, w_DV, preferred_element_type=x_ND.dtype)
    leading = tuple(range(x_ND.ndim - 1))
    dw_DV = jnp.tensordot(x_ND, g_NV, axes=(leading, leading), preferred_element_type=w_DV.dtype)
    return dx_ND, dw_DV


matmul_f32_out.defvjp(_fwd, _bwd)
