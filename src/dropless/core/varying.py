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


def sum_like(cotangent: jax.Array, primal: jax.Array, *sources: jax.Array) -> jax.Array:
    """A custom VJP's cotangent of `primal`, computed from `sources`, in `primal`'s mesh-axis type: summed over the
    axes the sources vary over and the primal does not (unchanged outside a shard_map).

    A weight that is the same on every device of an axis (experts replicated over `data`) meets tokens that differ
    along it: each device's contribution to the weight's gradient is a partial sum, and JAX's own transpose rules
    add them with a psum. A custom VJP must do it itself, whatever type its kernels' outputs claim.
    """
    cotangent = varying_like(cotangent, *sources)
    extra = tuple(sorted(jax.typeof(cotangent).mat.varying - jax.typeof(primal).mat.varying))
    return jax.lax.psum(cotangent, extra) if extra else cotangent
