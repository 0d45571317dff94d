"""RoPE, YaRN and RMSNorm against direct formulas; the dense SwiGLU against separate gate/up matmuls."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.config import ConfigError
from dropless.ops import rope
from dropless.models.mlp import init_mlp, swiglu
from dropless.ops.norms import rms_norm

# DeepSeek-V3's published rope_scaling (config.json of deepseek-ai/DeepSeek-V3).
DEEPSEEK_YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _rotate_complex(pairs_re, pairs_im, positions, inv_freq):
    """Rotate each (re, im) pair by angle position * inv_freq: the defining formula of RoPE."""
    z = (pairs_re + 1j * pairs_im) * np.exp(1j * positions[:, None, None] * inv_freq[None, None, :])
    return z.real, z.imag


def test_plain_rope_frequencies_are_theta_powers():
    inv_freq, factor = rope.inverse_frequencies(16, 500.0)
    np.testing.assert_allclose(inv_freq, [500.0 ** (-2 * i / 16) for i in range(8)], rtol=1e-6)
    assert factor == 1.0


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_matches_complex_rotation(interleaved):
    S, H, R = 7, 3, 8
    x_SHR = np.random.default_rng(0).normal(size=(S, H, R))
    cos_SR, sin_SR = rope.rope_tables(S, R, 10000.0)
    got = np.asarray(rope.apply_rope(jnp.asarray(x_SHR[None], jnp.float32), cos_SR, sin_SR, interleaved=interleaved))[0]

    inv_freq = 10000.0 ** (-np.arange(0, R, 2) / R)
    if interleaved:  # pairs (2i, 2i+1); the result comes out de-interleaved: all real parts, then imaginary
        re, im = _rotate_complex(x_SHR[..., 0::2], x_SHR[..., 1::2], np.arange(S), inv_freq)
    else:  # pairs (i, i + R/2)
        re, im = _rotate_complex(x_SHR[..., : R // 2], x_SHR[..., R // 2 :], np.arange(S), inv_freq)
    np.testing.assert_allclose(got, np.concatenate([re, im], axis=-1), atol=1e-5)


def test_interleaved_rope_preserves_relative_dot_products():
    # q.k after rotation depends only on the distance between positions: the property RoPE exists for.
    R = 8
    q, k = np.random.default_rng(1).normal(size=(2, R))
    cos, sin = rope.rope_tables(12, R, 10000.0)
    tile = lambda v: jnp.asarray(np.tile(v, (12, 1))[None, :, None, :], jnp.float32)
    rq = np.asarray(rope.apply_rope(tile(q), cos, sin, interleaved=True))[0, :, 0]
    rk = np.asarray(rope.apply_rope(tile(k), cos, sin, interleaved=True))[0, :, 0]
    assert rq[5] @ rk[2] == pytest.approx(rq[9] @ rk[6], abs=1e-5)
    assert rq[5] @ rk[2] != pytest.approx(rq[5] @ rk[3], abs=1e-3)


def test_yarn_frequencies_for_deepseek_v3():
    # Direct formula, worked out by hand for R=64, theta=1e4, original context 4096:
    # pair i makes 4096 * theta**(-2i/64) / (2 pi) turns over the original context. It makes beta_fast=32 turns
    # at i = 10.47 (floor -> 10) and beta_slow=1 turn at i = 22.5 (ceil -> 23). Pairs up to 10 keep their
    # frequency, pairs from 23 on are divided by the factor 40, and between them the blend is linear in i.
    inv_freq, attention_factor = rope.inverse_frequencies(64, 10000.0, DEEPSEEK_YARN)
    base = 10000.0 ** (-np.arange(32) * 2 / 64)
    keep = 1.0 - np.clip((np.arange(32) - 10) / (23 - 10), 0.0, 1.0)
    np.testing.assert_allclose(inv_freq, base * keep + base / 40.0 * (1.0 - keep), rtol=1e-6)
    assert attention_factor == 1.0  # mscale == mscale_all_dim: the cos/sin correction cancels


def test_yarn_keeps_fast_and_interpolates_slow_frequencies():
    scaling = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256}  # betas default to 32 / 1
    inv_freq, _ = rope.inverse_frequencies(32, 10000.0, scaling)
    base = 10000.0 ** (-np.arange(16) * 2 / 32)
    turns = 256 * base / (2 * math.pi)
    fast, slow = turns > 32, turns < 1
    assert fast.any() and slow.any()
    np.testing.assert_allclose(inv_freq[fast], base[fast], rtol=1e-6)
    np.testing.assert_allclose(inv_freq[slow], base[slow] / 8.0, rtol=1e-6)
    assert np.all((inv_freq >= base / 8.0 * (1 - 1e-6)) & (inv_freq <= base * (1 + 1e-6)))


def test_yarn_ramp_may_end_beyond_the_last_frequency_pair():
    # R=16, theta=100, original context 4096: beta_fast=32 turns at pair 5.23 (floor -> 5), beta_slow=1 at pair
    # 11.26 (ceil -> 12), beyond the last pair (7). Transformers clamps the ramp's end to R - 1 only, so pairs 6
    # and 7 are still on the ramp (1/7 and 2/7 of the way), not interpolated fully.
    inv_freq, _ = rope.inverse_frequencies(16, 100.0, {"type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 4096})
    base = 100.0 ** (-np.arange(8) * 2 / 16)
    keep = 1.0 - np.clip((np.arange(8) - 5) / (12 - 5), 0.0, 1.0)
    np.testing.assert_allclose(inv_freq, base * keep + base / 4.0 * (1.0 - keep), rtol=1e-6)


def test_yarn_attention_factor_and_mla_softmax_scale():
    mscale_40 = 0.1 * math.log(40.0) + 1.0
    # DeepSeek-V3: softmax scale 1/sqrt(192) times mscale(40, mscale_all_dim=1)^2.
    assert rope.mla_softmax_scale(192, DEEPSEEK_YARN) == pytest.approx(192**-0.5 * mscale_40**2, rel=1e-12)
    assert rope.mla_softmax_scale(192, None) == pytest.approx(192**-0.5)
    # cos/sin factor: mscale(f, mscale) / mscale(f, mscale_all_dim), or mscale(f) when either is unset.
    two = dict(DEEPSEEK_YARN, mscale=0.5, mscale_all_dim=1.0)
    assert rope.yarn_attention_factor(two) == pytest.approx((0.05 * math.log(40) + 1) / mscale_40)
    # The softmax scale takes mscale_all_dim alone, not mscale.
    assert rope.mla_softmax_scale(192, two) == pytest.approx(192**-0.5 * mscale_40**2, rel=1e-12)
    assert rope.yarn_attention_factor({"factor": 40.0, "original_max_position_embeddings": 4096}) == pytest.approx(mscale_40)
    cos, sin = rope.rope_tables(4, 8, 10000.0, {"factor": 40.0, "original_max_position_embeddings": 64})
    np.testing.assert_allclose(np.asarray(cos**2 + sin**2), mscale_40**2, rtol=1e-5)


def test_yarn_without_factor_is_a_config_error():
    with pytest.raises(ConfigError, match="factor"):
        rope.inverse_frequencies(8, 10000.0, {"type": "yarn", "original_max_position_embeddings": 64})


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_matches_formula(dtype):
    x = jax.random.normal(jax.random.key(0), (3, 16), jnp.float32).astype(dtype)
    weight = jnp.linspace(0.5, 1.5, 16)
    got = rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype
    x64 = np.asarray(x, np.float64)
    normed = (x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-6)).astype(np.float32)
    # Hugging Face casts the normalised values to the input dtype, then multiplies by the weight in that dtype.
    want = np.asarray(weight.astype(dtype)) * np.asarray(jnp.asarray(normed).astype(dtype))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(jnp.asarray(want).astype(dtype), np.float32),
                               rtol=1e-6 if dtype == jnp.float32 else 2**-7)


def test_swiglu_fused_gate_up_matches_separate_projections():
    params = init_mlp(jax.random.key(0), 8, 12, 0.5)
    x = np.random.default_rng(0).normal(size=(2, 3, 8))
    gate, up = np.asarray(params["gate_up"])[:, :12], np.asarray(params["gate_up"])[:, 12:]
    silu = lambda a: a / (1 + np.exp(-a))
    want = (silu(x @ gate) * (x @ up)) @ np.asarray(params["down"])
    np.testing.assert_allclose(np.asarray(swiglu(params, jnp.asarray(x, jnp.float32))), want, rtol=1e-4, atol=1e-5)
    assert params["gate_up"].shape == (8, 24) and params["down"].shape == (12, 8)
