"""`moe.dispatch=ragged`: `jax.lax.ragged_all_to_all` moves exactly the rows needed each way (GPU only; see
dropless.core.xla_flags). Receive buffers are worst-case sized.

Legend, per device: U send units (dropless.ep.plan), D hidden, P devices on the `expert` axis, S source
devices (the same P, seen from a receiver), J experts one row carries, R = P x worst-case received rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from dropless.core.varying import varying_like
from dropless.ep.contract import EXPERT_AXIS, DispatcherStrategy, Received
from dropless.ep.plan import SendPlan, empty_meta, plan_units, received, worst_case_rows
from dropless.ep.wire import Wire


def ragged_offsets(sends_SP: jax.Array, me) -> dict[str, jax.Array]:
    """Offsets and sizes for both `ragged_all_to_all` calls, from the [source, destination] row counts.

    A receiver stores its rows source-major: source s's rows start at the sum of what sources < s send it.
    """
    recv_sizes_S = sends_SP[:, me]
    return {
        "input_offsets": (jnp.cumsum(sends_SP, axis=1) - sends_SP)[me],  # my rows for p start here
        "send_sizes": sends_SP[me],
        "output_offsets": (jnp.cumsum(sends_SP, axis=0) - sends_SP)[me],  # ... and land here on p
        "recv_sizes": recv_sizes_S,
        "recv_offsets": jnp.cumsum(recv_sizes_S) - recv_sizes_S,  # where source s's rows are here
        "back_offsets": (jnp.cumsum(sends_SP, axis=1) - sends_SP)[:, me],  # where they came from on s
    }


class RaggedRoute(NamedTuple):
    """Ragged's metadata: the sender's plan and both calls' offsets."""

    plan: SendPlan
    offsets: dict


@dataclass(frozen=True)
class Ragged(DispatcherStrategy):
    """`ragged_all_to_all`: exactly the needed rows each way. Receive buffers are worst-case sized.

    `collective` is `jax.lax.ragged_all_to_all` (GPU); tests pass an emulation, as XLA:CPU lacks it.
    """

    dedup: bool = True
    collective: Callable = jax.lax.ragged_all_to_all
    wire: Wire = Wire()
    name: ClassVar[str] = "ragged"

    def dispatch(self, x_TD, expert_ids_TK, weights_TK, num_local: int) -> tuple[Received, RaggedRoute]:
        num_devices = jax.lax.axis_size(EXPERT_AXIS)
        num_tokens, top_k = expert_ids_TK.shape
        plan = plan_units(x_TD, expert_ids_TK, weights_TK, num_devices, num_local, self.dedup)
        sends_SP = jax.lax.all_gather(plan.sends_P, EXPERT_AXIS, axis=0, tiled=False)
        offsets = ragged_offsets(sends_SP, jax.lax.axis_index(EXPERT_AXIS))
        buffer_rows = num_devices * worst_case_rows(num_tokens, top_k, num_local, self.dedup)

        def send(operand, offsets, empty_row=0):
            output = jnp.broadcast_to(jnp.asarray(empty_row, operand.dtype), (buffer_rows, *operand.shape[1:]))
            output = varying_like(output, operand)  # the result's mesh-axis type is its output buffer's
            return self.collective(operand, output, offsets["input_offsets"], offsets["send_sizes"],
                                   offsets["output_offsets"], offsets["recv_sizes"], axis_name=EXPERT_AXIS)
        meta_RJ2 = send(plan.meta_UJ2, offsets, empty_meta(num_local))  # unfilled rows: weight 0, id G
        return received(self.wire.to_experts(send, plan.x_UD, offsets), meta_RJ2), RaggedRoute(plan, offsets)

    def combine(self, partial_RD, route: RaggedRoute) -> jax.Array:
        plan = route.plan

        def back(operand, offsets):
            output = varying_like(jnp.zeros((plan.x_UD.shape[0], *operand.shape[1:]), operand.dtype), operand)
            return self.collective(operand, output, offsets["recv_offsets"], offsets["recv_sizes"],
                                   offsets["back_offsets"], offsets["send_sizes"], axis_name=EXPERT_AXIS)
        return plan.sum_units(self.wire.from_experts(back, partial_RD, route.offsets))

    def rows_sent(self, route: RaggedRoute) -> jax.Array:
        return route.plan.rows_sent()
