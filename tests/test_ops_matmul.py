"""matmul_f32_out: float32 output, gradients equal to plain autodiff, backward matmuls in the operands' dtype."""

import jax
import jax.numpy as jnp
import numpy as np

from dropless.ops.matmul import matmul_f32_out


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


def test_any_leading_axes_match_autodiff_in_float32():
    x, w, g = _inputs(jnp.float32)
    x_TD, g_TV = x.reshape(10, 16), g.reshape(10, 24)
    plain = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)  # noqa: E731
    np.testing.assert_allclose(matmul_f32_out(x_TD, w), plain(x_TD, w), rtol=1e-6)
    for ours, ref in zip(_grads(matmul_f32_out, x_TD, w, g_TV), _grads(plain, x_TD, w, g_TV)):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


def test_backward_products_are_emitted_in_bf16():
    """The weight gradient is a partial sum when the batch is split over devices; XLA:GPU all-reduces it in the
    dot's output dtype, so the dot must emit bf16 (XLA:CPU widens bf16 dots, so the compiled CPU program cannot
    show this)."""
    x, w, g = _inputs(jnp.bfloat16)

    def backward_dot_outputs(f):
        jaxpr = jax.make_jaxpr(lambda x, w: _grads(f, x, w, g))(x, w).jaxpr
        return {e.outvars[0].aval.shape: e.outvars[0].aval.dtype for e in jaxpr.eqns
                if e.primitive.name == "dot_general"}

    ours, plain = backward_dot_outputs(matmul_f32_out), backward_dot_outputs(_plain)
    assert ours[w.shape] == jnp.bfloat16 and ours[x.shape] == jnp.bfloat16
    assert set(plain.values()) == {jnp.dtype(jnp.float32)}  # what the float32 cotangent makes of them
