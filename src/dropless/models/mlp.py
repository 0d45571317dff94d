"""Dense SwiGLU MLP with a fused gate/up projection: `silu(x @ gate) * (x @ up) @ down`.

`gate_up[:, :F]` is the gate and `gate_up[:, F:]` the up projection (docs/architecture.md), so one matmul feeds both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dropless.core import params as params_lib
from dropless.core.params import Specs
from dropless.fp8 import Recipe, linear
from dropless.moe.experts import swiglu_params


def mlp_params(hidden_size: int, intermediate_size: int) -> Specs:
    """One layer's weights: {"gate_up": [D, 2F], "down": [F, D]} (the shared experts' layout)."""
    return swiglu_params(hidden_size, intermediate_size)


def init_mlp(key: jax.Array, hidden_size: int, intermediate_size: int, init_std: float) -> dict:
    """One layer's float32 weights, normal(0, init_std)."""
    return params_lib.init(key, mlp_params(hidden_size, intermediate_size), init_std)


def swiglu(params: dict, x_BSD: jax.Array, recipe: Recipe | None = None, mesh=None) -> jax.Array:
    """SwiGLU in x's dtype (weights are cast at use); FP8 matmuls with a `recipe`, per batch shard over `mesh`."""
    gate_up_BSF2 = linear(x_BSD, params["gate_up"], recipe, mesh=mesh)
    gate_BSF, up_BSF = jnp.split(gate_up_BSF2, 2, axis=-1)
    return linear(jax.nn.silu(gate_BSF) * up_BSF, params["down"], recipe, mesh=mesh)
