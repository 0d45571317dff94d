"""`moe.dispatch=allgather`: every device gathers its expert group's tokens, computes its own experts on all of
them, and a reduce-scatter returns each token's sum. Static and simple; every token crosses every link.

Legend, per device: T tokens, K top-k, D hidden, P devices on the `expert` axis, G local experts,
J = min(K, G) columns, R = P*T gathered rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from dropless.ep.contract import EXPERT_AXIS, DispatcherStrategy, Received
from dropless.ep.plan import carry_to_columns
from dropless.ep.wire import Wire


@dataclass(frozen=True)
class AllGather(DispatcherStrategy):
    """Gather the group's tokens, compute the local experts on all of them, reduce-scatter the sums.

    The reduce-scatter adds the P partial rows of a token in the compute dtype (bf16 in training).
    Its metadata is this device's token count: the reduce-scatter undoes the gather without more.
    """

    wire: Wire = Wire()
    name: ClassVar[str] = "allgather"

    def dispatch(self, x_TD, expert_ids_TK, weights_TK, num_local: int) -> tuple[Received, int]:
        gather = lambda a: jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True)
        ids_RK, weights_RK = gather(expert_ids_TK), gather(weights_TK)
        here_RK = ids_RK // num_local == jax.lax.axis_index(EXPERT_AXIS)
        ids_RJ, weights_RJ = carry_to_columns(here_RK, ids_RK, weights_RK, num_local, min(ids_RK.shape[1], num_local))
        return Received(self.wire.to_experts(gather, x_TD), ids_RJ, weights_RJ), x_TD.shape[0]

    def combine(self, partial_RD, num_tokens: int) -> jax.Array:
        del num_tokens
        scatter = lambda a: jax.lax.psum_scatter(a, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        return self.wire.from_experts(scatter, partial_RD).astype(jnp.float32)

    def rows_sent(self, num_tokens: int) -> jax.Array:
        """Every token to every other device of its group."""
        return jnp.asarray(num_tokens * (jax.lax.axis_size(EXPERT_AXIS) - 1), jnp.int32)
