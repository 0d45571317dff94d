"""matmul_f32_out: float32 output, gradients equal to plain autodiff, backward matmuls in the operands' dtype."""

import jax
import jax.numpy as jnp
import numpy as np

from dropless.models.matmul import matmul_f32_out


def _inputs(dtype):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 5, 16), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (16, 24), jnp.float32) / 4).astype(dtype)
    g = jax.random.normal(kg, (2, 5, 24), jnp.float32)
    return x, w, g


def _plain(x, w):
    return jnp.einsum("bsd,dv->bsv", x, w, preferred_element_type=jnp.float32)


def _grads(f, x, w, g):
    return jax.grad(lambda x, w: jnp.sum(f(x, w) * g), (0, 1))(x, w)


def test_float32_output_and_gradients_equal_autodiff_in_float32():
    x, w, g = _inputs(jnp.float32)
    np.testing.assert_allclose(matmul_f32_out(x, w), _plain(x, w), rtol=1e-6)
    for ours, plain in zip(_grads(matmul_f32_out, x, w, g), _grads(_plain, x, w, g)):
        np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-6)


def test_bf16_backward_multiplies_bf16_operands_and_stays_close():
    x, w, g = _inputs(jnp.bfloat16)
    out = matmul_f32_out(x, w)
    assert out.dtype == jnp.float32
    dx, dw = _grads(matmul_f32_out, x, w, g)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    ref_dx, ref_dw = _grads(_plain, x.astype(jnp.float32), w.astype(jnp.float32), g)
    for ours, ref in ((dx, ref_dx), (dw, ref_dw)):
        assert float(jnp.linalg.norm(ours.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)) < 1e-2
    # Every matmul of the backward pass reads bf16 operands (plain autodiff promotes them to float32).
    jaxpr = jax.make_jaxpr(lambda x, w: _grads(matmul_f32_out, x, w, g))(x, w)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    plain_dots = [e for e in jax.make_jaxpr(lambda x, w: _grads(_plain, x, w, g))(x, w).jaxpr.eqns
                  if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    assert any(v.aval.dtype == jnp.float32 for e in plain_dots for v in e.invars)  # the cost this avoids
