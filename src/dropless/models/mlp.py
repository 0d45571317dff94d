"""Dense SwiGLU MLP with a fused gate/up projection: `silu(x @ gate) * (x @ up) @ down`.

`gate_up[:, :F]` is the gate and `gate_up[:, F:]` the up projection (DESIGN.md), so one matmul feeds both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def init_mlp(key: jax.Array, hidden_size: int, intermediate_size: int, init_std: float) -> dict:
    """One layer's float32 weights: {"gate_up": [D, 2F], "down": [F, D]}."""
    k_gate_up, k_down = jax.random.split(key)
    return {
        "gate_up": init_std * jax.random.normal(k_gate_up, (hidden_size, 2 * intermediate_size), jnp.float32),
        "down": init_std * jax.random.normal(k_down, (intermediate_size, hidden_size), jnp.float32),
    }


MLP_LOGICAL_AXES = {"gate_up": ("embed", "mlp"), "down": ("mlp", "embed")}


def swiglu(params: dict, x_BSD: jax.Array) -> jax.Array:
    """SwiGLU in x's dtype (weights are cast at use)."""
    dtype = x_BSD.dtype
    gate_up_BSF2 = x_BSD @ params["gate_up"].astype(dtype)
    gate_BSF, up_BSF = jnp.split(gate_up_BSF2, 2, axis=-1)
    return (jax.nn.silu(gate_BSF) * up_BSF) @ params["down"].astype(dtype)
