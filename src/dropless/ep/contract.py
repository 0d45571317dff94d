"""The expert-parallel contract: what a strategy implements, and the skeleton every exchange runs.

The experts are split evenly over the `expert` mesh axis; tokens are split over every device. The whole
exchange runs inside one `jax.shard_map` (dropless.ep.executor), so everything here is written for ONE
device's shard. Every way across the wire is a `Dispatcher`, in the style of torchtitan's token dispatchers:

    received, metadata = dispatcher.dispatch(x_TD, expert_ids_TK, weights_TK, num_local)   # rows out
    partial_RD = LocalExperts(received)            # this device's experts: permute -> grouped GEMM -> unpermute
    y_TD = dispatcher.combine(partial_RD, metadata)                                         # sums back, float32

`exchange` is that skeleton, with the stats (`ExecutorStats`) and the profile scopes "dispatch" / "combine".
A `Strategy` is what the executor calls per device: a dispatcher run by `exchange` (allgather, ragged), or a
strategy that builds its dispatcher on the device (alltoall: one per slot capacity, one inside each branch of
its overflow `lax.cond`), resolves to one per shape at trace time (auto), or splits the tokens (chunked).

Legend, per device: T tokens, K top-k, D hidden, P devices on the `expert` axis, G = E / P local
experts, J = experts one received row carries, R received rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from dropless.core.varying import varying_like
from dropless.gmm import GroupedMatmul
from dropless.gmm.api import TMA_ROW_ALIGNMENT
from dropless.gmm.capacity import CapacityGmm
from dropless.moe.executor import ExecutorStats, LocalExecutor

EXPERT_AXIS = "expert"


class Received(NamedTuple):
    """Rows that arrived on this device, each with the local experts it asks for."""

    x_RD: jax.Array
    local_ids_RJ: jax.Array  # int32 in [0, G]; G means "no expert" (an empty column or an empty row)
    weights_RJ: jax.Array  # float32 routing weights, 0 where the id is G


@dataclass(frozen=True)
class LocalExperts:
    """This device's G experts applied to received rows: the single-device permute -> gmm -> unpermute.

    The received rows carry up to J experts each, so the permuted buffer has R*J rows, while on average only
    the balanced load of T*K (token, expert) pairs names an expert here (T tokens per device; at two devices
    and DeepSeek-V3's top-8 that is half the buffer). With `buffer_factor` > 0 the layer keeps
    ceil(buffer_factor x T*K) rows. A device whose pairs do not fit, counted on the device, takes the
    worst-case R*J buffer instead (`lax.cond`; each device decides for itself, so no collective may run inside,
    in the forward or the backward pass). That branch is rematerialised (`jax.checkpoint`): its residuals are the
    branch's inputs, so the bounded branch pays nothing for it. Never a drop; the overflow is reported.
    """

    experts: dict  # {"gate_up": [G, D, 2F], "down": [G, F, D]}, this device's shard
    gmm: GroupedMatmul
    buffer_factor: float = 0.0  # 0: always the worst-case buffer

    @property
    def num_local(self) -> int:
        return self.experts["gate_up"].shape[0]

    def buffer_rows(self, balanced_pairs: int, worst_rows: int) -> int:
        """Rows of the bounded buffer: buffer_factor x the balanced load, rounded up to TMA_ROW_ALIGNMENT, capped."""
        if self.buffer_factor <= 0:
            return worst_rows
        return min(worst_rows, TMA_ROW_ALIGNMENT * math.ceil(self.buffer_factor * balanced_pairs / TMA_ROW_ALIGNMENT))

    def __call__(self, received: Received, balanced_pairs: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """-> (partial_RD: each row's weighted sum over its local experts, in x_RD's dtype; rows dropped, overflowed).

        The sum is taken in float32 and rounded to the compute dtype inside the branch, where XLA fuses the cast
        into the combine's pass (at the branch's boundary it is a pass of its own each way, and the combine sends
        the compute dtype anyway).

        `balanced_pairs`: the (token, expert) pairs one device holds when the routing is balanced, T*K."""
        # The experts are the same on every device of the axes the rows vary over (data, fsdp); where they first
        # meet the rows JAX casts them to varying, and that cast's transpose is their gradient's all-reduce. Cast
        # here, it runs outside the cond: inside, devices that took different branches would wait in different
        # all-reduces (XLA requires every participant to run the same one; jax 0.12.1's CPU runtime deadlocks).
        experts = jax.tree.map(lambda w: varying_like(w, *received), self.experts)
        operands = (received.x_RD, received.local_ids_RJ, received.weights_RJ, experts)
        worst = received.local_ids_RJ.size
        bound = self.buffer_rows(balanced_pairs, worst)

        gmm = self.gmm
        if isinstance(gmm, CapacityGmm):  # the baseline's capacity: this device's share of its tokens' pairs
            gmm = dataclasses.replace(gmm, pairs=balanced_pairs)

        def run(rows, in_cond=True):
            def local(x_RD, ids_RJ, weights_RJ, experts):
                executor = LocalExecutor(gmm, rows, remat_activation=in_cond)
                y_RD, stats = executor(x_RD, ids_RJ, weights_RJ, experts)
                return y_RD.astype(x_RD.dtype), stats.tokens_dropped
            return local

        if bound >= worst:
            y_RD, dropped = run(None, in_cond=False)(*operands)
            # Typed like the count below: a strategy's cond (alltoall's slots) may take this path in one branch
            # and the count in the other, and its branches must agree on the mesh axes their outputs vary over.
            return y_RD, dropped, varying_like(jnp.zeros((), jnp.int32), received.local_ids_RJ)
        overflowed = jnp.sum(received.local_ids_RJ < self.num_local) > bound
        y_RD, dropped = jax.lax.cond(overflowed, jax.checkpoint(run(None)), run(bound), *operands)
        return y_RD, dropped, overflowed.astype(jnp.int32)


class Dispatcher(Protocol):
    """One way across the wire. `metadata` is whatever this dispatcher's `combine` needs (a pytree)."""

    name: ClassVar[str]

    def dispatch(self, x_TD: jax.Array, expert_ids_TK: jax.Array, weights_TK: jax.Array,
                 num_local: int) -> tuple[Received, Any]:
        """Rows to the devices that hold their experts -> (what arrived here, metadata)."""

    def combine(self, partial_RD: jax.Array, metadata: Any) -> jax.Array:
        """Partial results back to their tokens' devices -> y_TD float32, each token's sum over its experts."""

    def rows_sent(self, metadata: Any) -> jax.Array:
        """int32: token rows this device sent to other devices (the combine returns as many)."""


class Strategy(Protocol):
    """What the executor runs per device, inside its shard_map: `strategy(x_TD, ids, weights, local)`."""

    name: ClassVar[str]

    def __call__(self, x_TD: jax.Array, expert_ids_TK: jax.Array, weights_TK: jax.Array,
                 local: LocalExperts) -> tuple[jax.Array, ExecutorStats]:
        """-> (y_TD float32, this device's ExecutorStats)."""

    def resolve(self, num_tokens: int, top_k: int, num_devices: int, num_local: int) -> "Strategy":
        """The strategy whose exchange runs for `num_tokens` tokens per device (decided at trace time): itself,
        except `auto` (its choice for the shape) and `chunked` (its inner strategy's, for one chunk)."""


def remote_pairs(expert_ids_TK, num_local: int) -> jax.Array:
    """(token, expert) pairs whose expert lives on another device: the rows sent without dedup."""
    return jnp.sum(expert_ids_TK // num_local != jax.lax.axis_index(EXPERT_AXIS)).astype(jnp.int32)


def exchange(dispatcher: Dispatcher, x_TD, expert_ids_TK, weights_TK,
             local: LocalExperts) -> tuple[jax.Array, ExecutorStats]:
    """The skeleton of every exchange: dispatch -> local experts -> combine, and its stats."""
    with jax.named_scope("dispatch"):
        received, metadata = dispatcher.dispatch(x_TD, expert_ids_TK, weights_TK, local.num_local)
    partial_RD, dropped, overflowed = local(received, expert_ids_TK.size)
    with jax.named_scope("combine"):
        y_TD = dispatcher.combine(partial_RD, metadata)
    stats = ExecutorStats(dropped, overflowed, dispatcher.rows_sent(metadata),
                          remote_pairs(expert_ids_TK, local.num_local))
    return y_TD, stats


class DispatcherStrategy:
    """Base of a dispatcher that is a whole strategy (allgather, ragged): `exchange` runs it, at every shape."""

    def __call__(self, x_TD, expert_ids_TK, weights_TK, local: LocalExperts) -> tuple[jax.Array, ExecutorStats]:
        return exchange(self, x_TD, expert_ids_TK, weights_TK, local)

    def resolve(self, num_tokens: int, top_k: int, num_devices: int, num_local: int) -> "DispatcherStrategy":
        return self
