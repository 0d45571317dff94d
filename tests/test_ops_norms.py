"""RMSNorm rounds where Hugging Face's Llama-family models do: statistics in float32, the normalised activations cast
to the input dtype before the weight multiplies them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dropless.ops.norms import rms_norm


def test_bfloat16_rms_norm_rounds_before_the_weight_as_hugging_face_does():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 96)), jnp.bfloat16)
    weight = jnp.asarray(1 + 0.3 * rng.normal(size=96), jnp.float32)
    x32 = x.astype(jnp.float32)
    normed = (x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)
    want = weight.astype(jnp.bfloat16) * normed  # transformers' LlamaRMSNorm: weight * hidden.to(input_dtype)
    got = rms_norm(x, weight, 1e-6)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    x = jnp.asarray(1e-4 * rng.normal(size=(4, 96)), jnp.float32)  # eps dominates a tiny input's mean square
    np.testing.assert_allclose(rms_norm(x, jnp.ones(96), 1e-2), x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-2),
                               rtol=1e-6)
