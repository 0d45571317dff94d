"""embed_tokens: the lookup and its gradient equal plain autodiff on one device and on a mesh, and on a mesh the
backward pass moves the batch's rows (all-gather) or the table (all-reduce) as chosen."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dropless.models.embedding import embed_tokens, gathers_rows

VOCAB, HIDDEN = 64, 16


def _inputs(batch=8, seq=6):
    k_table, k_tokens, k_g = jax.random.split(jax.random.key(0), 3)
    table = jax.random.normal(k_table, (VOCAB, HIDDEN), jnp.float32)
    tokens = jax.random.randint(k_tokens, (batch, seq), 0, VOCAB // 4)  # few distinct ids: repeats on every row
    g = jax.random.normal(k_g, (batch, seq, HIDDEN), jnp.float32)
    return table, tokens, g


def _loss(lookup):
    return lambda table, tokens, g: jnp.sum(lookup(table, tokens).astype(jnp.float32) * g)


def _plain(table, tokens, dtype=jnp.float32):
    return jnp.take(table, tokens, axis=0).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_device_equals_plain_autodiff(dtype):
    table, tokens, g = _inputs()
    ours = lambda t, i: embed_tokens(t, i, dtype)  # noqa: E731
    np.testing.assert_array_equal(ours(table, tokens), _plain(table, tokens, dtype))
    d_ours = jax.grad(_loss(ours))(table, tokens, g)
    d_plain = jax.grad(_loss(lambda t, i: _plain(t, i, dtype)))(table, tokens, g)
    assert d_ours.dtype == jnp.float32
    np.testing.assert_allclose(d_ours, d_plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gather_rows", [True, False])
@pytest.mark.parametrize("table_spec", [P(), P("fsdp")])
def test_on_a_mesh_the_gradient_is_exact_and_crosses_as_rows_or_as_the_table(gather_rows, table_spec):
    table, tokens, g = _inputs()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    table_s = jax.device_put(table, NamedSharding(mesh, table_spec))
    tokens_s, g_s = jax.device_put(tokens, batch), jax.device_put(g, batch)
    grad = jax.jit(jax.grad(_loss(lambda t, i: embed_tokens(t, i, jnp.float32, mesh, gather_rows=gather_rows))))
    d_mesh = grad(table_s, tokens_s, g_s)
    d_plain = jax.grad(_loss(_plain))(table, tokens, g)
    np.testing.assert_allclose(d_mesh, d_plain, rtol=1e-5, atol=1e-5)

    text = grad.lower(table_s, tokens_s, g_s).compile().as_text()
    reduces_table = [line for line in text.splitlines()
                     if ("all-reduce(" in line or "reduce-scatter(" in line) and "f32[" in line
                     and any(f"[{v},{HIDDEN}]" in line for v in (VOCAB, VOCAB // 4))]
    gathers = [line for line in text.splitlines() if "all-gather(" in line]
    if gather_rows:
        assert not reduces_table and gathers
    else:
        assert reduces_table


def test_the_choice_compares_the_rows_bytes_with_the_float32_table():
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    one = Mesh(np.array(jax.devices()[:1]), ("data",))
    assert not gathers_rows(None, 16, (32768, 7168), jnp.bfloat16)
    assert not gathers_rows(one, 16, (32768, 7168), jnp.bfloat16)
    assert gathers_rows(mesh, 16384, (32768, 7168), jnp.bfloat16)  # deepseek-v3-proxy on two GPUs: 235 < 940 MB
    assert not gathers_rows(mesh, 2 * 32768, (32768, 7168), jnp.bfloat16)  # as many bytes: keep the reduction
    assert not gathers_rows(mesh, 40000, (32768, 7168), jnp.float32)
