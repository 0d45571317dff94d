"""Rotary position embeddings (RoPE), with DeepSeek-V3's YaRN frequency scaling.

Conventions follow Hugging Face transformers, so converted checkpoints give the same numbers:
- Frequencies: `inv_freq[i] = theta ** (-2i / R)` for i < R/2, R the rotary width.
- Layout "rotate-half" (Llama, Mixtral, Qwen3): dimension i is paired with i + R/2.
- Layout "interleaved" (DeepSeek-V3, `rope_interleave=True`): dimension 2i is paired with 2i + 1. We de-interleave
  (evens first, then odds) and rotate-half, exactly as HF does. The result is in the de-interleaved order; that is
  harmless because queries and keys are permuted alike and only their dot products are used.
- YaRN: `inverse_frequencies` blends interpolated and extrapolated frequencies over a linear ramp, and returns an
  `attention_factor` that multiplies cos and sin. MLA additionally multiplies its softmax scale by
  `yarn_mscale(factor, mscale_all_dim) ** 2` (see `mla_softmax_scale`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dropless.core.config import check_yarn_keys, yarn_betas


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(factor) + 1` (1 when not extending)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _yarn_settings(rope_scaling: dict) -> tuple[float, float, float, float]:
    check_yarn_keys(rope_scaling)  # ModelConfig has checked its own; this guards direct callers
    factor, original = rope_scaling["factor"], rope_scaling["original_max_position_embeddings"]
    return float(factor), float(original), *yarn_betas(rope_scaling)


def yarn_attention_factor(rope_scaling: dict) -> float:
    """The factor YaRN multiplies cos and sin by (1.0 for DeepSeek-V3, where mscale == mscale_all_dim)."""
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = _yarn_settings(rope_scaling)[0]
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def inverse_frequencies(dim: int, theta: float, rope_scaling: dict | None = None) -> tuple[np.ndarray, float]:
    """Return (`inv_freq` float32 [dim/2], attention_factor) for a rotary width `dim`.

    Without scaling this is plain RoPE and the factor is 1. With YaRN, frequencies whose wavelength fits many
    times into the original context (above `beta_fast` rotations) are kept (extrapolated), those rotating fewer
    than `beta_slow` times are divided by `factor` (interpolated), and a linear ramp blends the ones between.
    """
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv_freq = 1.0 / theta**exponents
    if rope_scaling is None:
        return inv_freq.astype(np.float32), 1.0
    factor, original, beta_fast, beta_slow = _yarn_settings(rope_scaling)

    def correction_dim(rotations: float) -> float:
        # The rotary dimension whose wavelength makes `rotations` turns over the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1 = extrapolate (keep the frequency), 0 = interpolate (divide by factor)
    inv_freq = inv_freq / factor * (1.0 - keep) + inv_freq * keep
    return inv_freq.astype(np.float32), yarn_attention_factor(rope_scaling)


def mla_softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """DeepSeek MLA's softmax scale: `qk_head_dim**-0.5`, times `yarn_mscale(factor, mscale_all_dim)**2` under YaRN."""
    scale = qk_head_dim**-0.5
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(_yarn_settings(rope_scaling)[0], rope_scaling["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


def rope_tables(seq_len: int, dim: int, theta: float, rope_scaling: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """Float32 (cos_SR, sin_SR) for positions 0..seq_len-1, R = dim, each frequency repeated in both halves."""
    inv_freq, attention_factor = inverse_frequencies(dim, theta, rope_scaling)
    angles_SR2 = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles_SR = jnp.concatenate([angles_SR2, angles_SR2], axis=-1)
    return jnp.cos(angles_SR) * attention_factor, jnp.sin(angles_SR) * attention_factor


def _rotate_half(x: jax.Array) -> jax.Array:
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-second, first], axis=-1)


def deinterleave(x: jax.Array) -> jax.Array:
    """Reorder the last axis from (x0, x1, x2, x3, ...) to (x0, x2, ..., x1, x3, ...)."""
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    return jnp.swapaxes(pairs, -1, -2).reshape(x.shape)


def apply_rope(x_BSHR: jax.Array, cos_SR: jax.Array, sin_SR: jax.Array, *, interleaved: bool = False) -> jax.Array:
    """Rotate `x[b, s, h, :]` by position s; computed in float32, returned in x's dtype."""
    dtype = x_BSHR.dtype
    x = x_BSHR.astype(jnp.float32)
    if interleaved:
        x = deinterleave(x)
    cos, sin = cos_SR[:, None, :], sin_SR[:, None, :]  # broadcast over heads
    return (x * cos + _rotate_half(x) * sin).astype(dtype)
