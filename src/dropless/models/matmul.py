"""Matmuls whose output is wider than their operands, with a backward pass that stays in the operands' dtype.

`jnp.einsum(x_bf16, w_bf16, preferred_element_type=float32)` gives float32 logits, but JAX's transpose rule then
multiplies the float32 cotangent with the bf16 operand, which promotes both backward matmuls to float32. On an
H200 (deepseek-v3-proxy, 8 192 tokens, vocabulary 32 768) the lm_head's input gradient took 9.6 ms and its weight
gradient 17.4 ms against 4.9 ms for its bf16 forward (benchmarks/results/step-h200.json, the profile). Here the
cotangent is cast to the operands' dtype first, as in mixed-precision training generally: both backward matmuls
run at the bf16 rate and still accumulate in float32. In float32 (the CPU tests) nothing changes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def matmul_f32_out(x_BSD: jax.Array, w_DV: jax.Array) -> jax.Array:
    """x_BSD · w_DV accumulated and returned in float32 (operands of one dtype, e.g. bf16)."""
    return jnp.einsum("bsd,dv->bsv", x_BSD, w_DV, preferred_element_type=jnp.float32)


def _fwd(x_BSD, w_DV):
    return matmul_f32_out(x_BSD, w_DV), (x_BSD, w_DV)


def _bwd(residuals, g_BSV):
    x_BSD, w_DV = residuals
    g_BSV = g_BSV.astype(x_BSD.dtype)
    dx_BSD = jnp.einsum("bsv,dv->bsd", g_BSV, w_DV, preferred_element_type=jnp.float32).astype(x_BSD.dtype)
    dw_DV = jnp.einsum("bsd,bsv->dv", x_BSD, g_BSV, preferred_element_type=jnp.float32).astype(w_DV.dtype)
    return dx_BSD, dw_DV


matmul_f32_out.defvjp(_fwd, _bwd)
