"""Mesh-axis types inside `jax.shard_map`: mark a value as varying over the axes another one varies over.

Inside a shard_map every value carries the mesh axes it varies over. Values built inside (zeros, a Pallas
kernel's output) vary over none, and JAX checks the types where they meet: a custom_vjp's cotangent must
have its primal's axes, and a collective's output buffer sets the type of its result.
"""

from __future__ import annotations

import jax


def varying_like(out: jax.Array, *like: jax.Array) -> jax.Array:
    """`out` marked as varying over every mesh axis any of `like` varies over (unchanged outside a shard_map)."""
    have = jax.typeof(out).mat.varying
    want = frozenset().union(*(jax.typeof(a).mat.varying for a in like))
    missing = tuple(sorted(want - have))
    return jax.lax.pcast(out, missing, to="varying") if missing else out
