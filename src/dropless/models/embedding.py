"""The token embedding lookup, whose gradient crosses devices as the batch's rows when they are fewer bytes than
the table.

The gradient of `take(table_VD, tokens_BS)` is a scatter-add of the output gradient into a zero table. With the
batch split over devices, each device scatters its own tokens and the partitioner then all-reduces (for a table
split over `fsdp`: reduce-scatters) the whole float32 table, V*D*4 bytes every step, however few the tokens; the
batch's gradient rows are T*D*2 bytes in bf16 (at V = 32,768, D = 7,168 and 16,384 tokens: 940 MB against
235 MB). So when the batch's rows are
fewer bytes than the float32 table, the backward pass gathers the rows and their token ids onto every device and
scatters them there, in float32; otherwise (in bf16: a global batch of at least twice as many tokens as the
vocabulary has entries, as in large multi-host runs) it keeps the table's reduction. Both compute the same
float32 sum. The gathered rows are a temporary on every device of at most the float32 table's size, which both
paths also allocate for the sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def gathers_rows(mesh: Mesh | None, tokens: int, table_shape: tuple[int, int], row_dtype) -> bool:
    """Whether gathering `tokens` gradient rows moves fewer bytes than reducing the float32 table."""
    if mesh is None or mesh.size == 1:
        return False
    vocab, hidden = table_shape
    return tokens * hidden * jnp.dtype(row_dtype).itemsize < vocab * hidden * 4


def embed_tokens(table_VD: jax.Array, tokens_BS: jax.Array, dtype, mesh: Mesh | None = None, *,
                 gather_rows: bool | None = None) -> jax.Array:
    """table_VD[tokens_BS] in `dtype`. `mesh`: the mesh the batch is split over (None: one device);
    `gather_rows`: force the backward pass's choice (None: by bytes, `gathers_rows`)."""
    if gather_rows is None:
        gather_rows = gathers_rows(mesh, tokens_BS.size, table_VD.shape, dtype)
    return _lookup(table_VD, tokens_BS, jnp.dtype(dtype), mesh if gather_rows else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _lookup(table_VD, tokens_BS, dtype, gather_over):
    return jnp.take(table_VD, tokens_BS, axis=0).astype(dtype)


def _lookup_fwd(table_VD, tokens_BS, dtype, gather_over):
    return _lookup(table_VD, tokens_BS, dtype, gather_over), (table_VD, tokens_BS)


def _lookup_bwd(dtype, gather_over, residuals, g_BSD):
    table_VD, tokens_BS = residuals
    if gather_over is not None:  # every device gets every row (in the compute dtype) and sums them all
        everywhere = NamedSharding(gather_over, PartitionSpec())
        tokens_BS = jax.lax.with_sharding_constraint(tokens_BS, everywhere)
        g_BSD = jax.lax.with_sharding_constraint(g_BSD, everywhere)
    d_VD = jnp.zeros(table_VD.shape, jnp.float32).at[tokens_BS].add(g_BSD.astype(jnp.float32))
    return d_VD.astype(table_VD.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)
