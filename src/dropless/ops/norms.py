"""RMSNorm, computed as Hugging Face's Llama-family models do.

The statistics are taken in float32 whatever the input dtype; the normalised activations are cast back to
the input dtype *before* the weight is applied, so bfloat16 runs round exactly where the reference does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """`weight * x / sqrt(mean(x**2) + eps)` over the last axis; returns x's dtype."""
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    normed = (x32 * jax.lax.rsqrt(variance + eps)).astype(x.dtype)
    return weight.astype(x.dtype) * normed
