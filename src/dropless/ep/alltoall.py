"""`moe.dispatch=alltoall`: rows packed into fixed slots per destination and exchanged with `all_to_all`.

Slots hold `moe.alltoall_buffer_factor` x the balanced load. If any device's rows for any destination do not
fit, checked on the device, the layer takes a second, worst-case-sized exchange instead (`lax.cond`): never a
drop. The plan (dropless.ep.plan) is made once, before the choice; each branch of the cond runs the whole
exchange skeleton (`dropless.ep.contract.exchange`) with a `SlotExchange` of its own capacity.

Legend, per device: U send units, D hidden, P devices on the `expert` axis, C slot rows per destination,
S = P*C slots, J experts one row carries, R = S received rows; N, M, X: a pick's source rows, output rows, and
any trailing axes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from dropless.core.mesh import MESH_AXES
from dropless.ep.contract import EXPERT_AXIS, LocalExperts, Received, exchange
from dropless.ep.plan import SendPlan, balanced_rows, empty_meta, plan_units, received, worst_case_rows
from dropless.ep.wire import Wire


class SlotMap(NamedTuple):
    """Where alltoall's unit rows travel in its [P, C] slots, both ways; built once per exchange (`slot_map`)."""

    source_S: jax.Array  # int32 [P*C]: the destination-major unit row slot p*C + c holds (0 where unfilled)
    filled_S: jax.Array  # bool [P*C]
    slot_U: jax.Array  # int32 [U]: the slot unit row u travels in (0 where unsent)
    sent_U: jax.Array  # bool [U]
    capacity: int


def slot_map(sends_P, capacity: int, num_units: int) -> SlotMap:
    """Slot (p, c) holds destination p's c-th unit row; unit row u travels in slot p*C + c.

    Each map inverts the other only for sends_P <= capacity, the only case in which the slot exchange runs."""
    num_devices = sends_P.shape[0]
    starts_P = jnp.cumsum(sends_P) - sends_P
    pos_C = jnp.arange(capacity, dtype=jnp.int32)
    filled_PC = pos_C[None, :] < sends_P[:, None]
    source_S = jnp.where(filled_PC, starts_P[:, None] + pos_C[None, :], 0).reshape(-1)
    unit_U = jnp.arange(num_units, dtype=jnp.int32)
    dest_U = jnp.searchsorted(starts_P + sends_P, unit_U, side="right").astype(jnp.int32)
    sent_U = dest_U < num_devices
    dest_U = jnp.minimum(dest_U, num_devices - 1)
    slot_U = dest_U * capacity + unit_U - starts_P[dest_U]
    return SlotMap(source_S, filled_PC.reshape(-1), jnp.where(sent_U, slot_U, 0), sent_U, capacity)


def pick(rows_NX, index_M, valid_M):
    """rows_NX[index_M] where valid_M, else 0."""
    valid = valid_M.reshape(valid_M.shape + (1,) * (rows_NX.ndim - 1))
    return jnp.where(valid, rows_NX[index_M], jnp.zeros((), rows_NX.dtype))


@jax.custom_vjp
def pick_one_to_one(rows_NX, index_M, valid_M, inverse_N, inverse_valid_N):
    """`pick` for a map that reads each row at most once, with its inverse given (row n is read by output
    inverse_N[n] where inverse_valid_N[n]). The backward is then the inverse pick, a gather: JAX's transpose of a
    gather is a scatter-add, which on a GPU is far slower than a gather for the slot buffers' [2T, D] rows."""
    return pick(rows_NX, index_M, valid_M)


def _pick_one_to_one_fwd(rows_NX, index_M, valid_M, inverse_N, inverse_valid_N):
    return pick(rows_NX, index_M, valid_M), (inverse_N, inverse_valid_N)


def _pick_one_to_one_bwd(residuals, cotangent_MX):
    inverse_N, inverse_valid_N = residuals
    return pick(cotangent_MX, inverse_N, inverse_valid_N), None, None, None, None


pick_one_to_one.defvjp(_pick_one_to_one_fwd, _pick_one_to_one_bwd)


def to_slots(rows_UX, slots: SlotMap, fill) -> jax.Array:
    """[U, ...] destination-major rows -> [P, C, ...]: slot (p, c) holds p's c-th row, or `fill`."""
    picked = pick_one_to_one(rows_UX, slots.source_S, slots.filled_S, slots.slot_U, slots.sent_U)
    filled = slots.filled_S.reshape(slots.filled_S.shape + (1,) * (rows_UX.ndim - 1))
    packed = jnp.where(filled, picked, jnp.asarray(fill, rows_UX.dtype))
    return packed.reshape(-1, slots.capacity, *rows_UX.shape[1:])


def from_slots(slots_PCD, slots: SlotMap) -> jax.Array:
    """The returning rows: [P, C, D] slots -> [U, D] destination-major units (unused units zero)."""
    return pick_one_to_one(slots_PCD.reshape(-1, slots_PCD.shape[-1]), slots.slot_U, slots.sent_U,
                           slots.source_S, slots.filled_S)


@dataclass(frozen=True)
class SlotExchange:
    """The dispatcher of one branch: `plan`'s rows in slots of `capacity` rows per destination, one `all_to_all`
    each way. The plan is made once by `AllToAll`, outside its cond, so dispatch takes the tokens through it."""

    plan: SendPlan
    capacity: int
    wire: Wire = Wire()
    name: ClassVar[str] = "alltoall"

    def dispatch(self, x_TD, expert_ids_TK, weights_TK, num_local: int) -> tuple[Received, SlotMap]:
        del x_TD, expert_ids_TK, weights_TK  # already in the plan's unit rows
        slots = slot_map(self.plan.sends_P, self.capacity, self.plan.x_UD.shape[0])  # both ways, built once
        a2a = lambda a: jax.lax.all_to_all(a, EXPERT_AXIS, 0, 0, tiled=True)
        x_PCD = self.wire.to_experts(a2a, to_slots(self.plan.x_UD, slots, 0))
        meta_PCJ2 = a2a(to_slots(self.plan.meta_UJ2, slots, empty_meta(num_local)))
        return received(x_PCD.reshape(-1, x_PCD.shape[-1]), meta_PCJ2.reshape(-1, *meta_PCJ2.shape[2:])), slots

    def combine(self, partial_RD, slots: SlotMap) -> jax.Array:
        num_devices = self.plan.sends_P.shape[0]
        back = lambda a: jax.lax.all_to_all(a.reshape(num_devices, slots.capacity, -1), EXPERT_AXIS, 0, 0,
                                            tiled=True)
        back_PCD = self.wire.from_experts(back, partial_RD)
        return self.plan.sum_units(from_slots(back_PCD, slots))

    def rows_sent(self, slots: SlotMap) -> jax.Array:
        del slots
        return self.plan.rows_sent()


@dataclass(frozen=True)
class AllToAll:
    """Fixed-size slots per destination, one `all_to_all` each way; a worst-case exchange on overflow.

    Both exchanges are compiled; one runs. Under autodiff JAX keeps residual buffers for both branches of a
    `lax.cond` (the untaken one as zeros), so the slots save link traffic, not activation memory, unless
    the MoE layer is rematerialised (train.remat).
    """

    buffer_factor: float = 2.0
    dedup: bool = True
    wire: Wire = Wire()
    name: ClassVar[str] = "alltoall"

    def slot_sizes(self, num_tokens: int, top_k: int, num_devices: int, num_local: int) -> tuple[int, int]:
        """(normal, worst case) slot rows per destination. Normal = buffer_factor x the balanced load."""
        worst = worst_case_rows(num_tokens, top_k, num_local, self.dedup)
        return min(worst, math.ceil(self.buffer_factor * balanced_rows(num_tokens, top_k, num_devices, num_local,
                                                                         self.dedup))), worst

    def __call__(self, x_TD, expert_ids_TK, weights_TK, local: LocalExperts):
        num_devices, num_local = jax.lax.axis_size(EXPERT_AXIS), local.num_local
        plan = plan_units(x_TD, expert_ids_TK, weights_TK, num_devices, num_local, self.dedup)
        normal, worst = self.slot_sizes(*expert_ids_TK.shape, num_devices, num_local)

        def run(capacity):
            return lambda: exchange(SlotExchange(plan, capacity, self.wire), x_TD, expert_ids_TK, weights_TK, local)

        # Decided on the device, identically everywhere (the branches run different collectives).
        overflowed = jax.lax.pmax(jnp.max(plan.sends_P) > normal, MESH_AXES)
        y_TD, stats = run(worst)() if normal == worst else jax.lax.cond(overflowed, run(worst), run(normal))
        return y_TD, stats._replace(dispatch_overflowed=jnp.maximum(overflowed.astype(jnp.int32),
                                                                     stats.dispatch_overflowed))

    def resolve(self, num_tokens: int, top_k: int, num_devices: int, num_local: int) -> "AllToAll":
        return self
