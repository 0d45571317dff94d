"""Expert parallelism: send each token to the devices that hold its experts, compute there, bring it back.

The experts are split evenly over the `expert` mesh axis; tokens are split over every device. The whole
exchange runs inside one `jax.shard_map`, so everything below is written for ONE device's shard. A
strategy has the same three stages whatever the wire: `dispatch` (rows out, with the metadata its
`combine` needs), the local experts (the same permute -> grouped GEMM -> unpermute as on one device,
`dropless.moe.LocalExecutor`), and `combine` (partial results back, summed per token).

Strategies (`moe.dispatch`):
- `allgather`: every device gathers its expert group's tokens, computes its own experts on all of them,
  and a reduce-scatter returns each token's sum. Static and simple; every token crosses every link.
- `alltoall`: rows packed into fixed slots per destination (`moe.alltoall_buffer_factor` x the balanced
  load) and exchanged with `all_to_all`. If any device's rows for any destination do not fit, checked on
  the device, the layer takes a second, worst-case-sized exchange instead (`lax.cond`): never a drop.
- `ragged`: `jax.lax.ragged_all_to_all` moves exactly the rows needed (GPU only; see dropless.core.xla_flags).

Deduplication (`moe.dedup`, alltoall and ragged): a token whose top-k experts include several on one
device is sent there once, with the list of its experts on that device; the receiver expands it to
those experts and sends back ONE row, their weighted sum. Combine rows travel in the compute dtype; rows
towards the experts may travel in FP8 (`moe.dispatch_dtype=float8`, every strategy: dropless.ep.wire).

Legend, per device: T tokens, K top-k, D hidden, P devices on the `expert` axis, G = E / P local
experts, J = experts one sent row carries (min(K, G) with dedup, else 1), U = T*K send units
(a unit is a (token, destination) pair with dedup, a (token, k) pair without), C slot rows per
destination, R received rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dropless.core.config import Config, ConfigError
from dropless.moe.executor import ExecutorStats, LocalExecutor
from dropless.gmm.api import GroupedMatmul
from dropless.moe.permute import PermuteInfo, permute, unpermute
from dropless.core.varying import varying_like
from dropless.core.mesh import BATCH_AXES, MESH_AXES
from dropless.ep.wire import Wire

EXPERT_AXIS = "expert"
ROW_ALIGN = 8  # bounded local buffers hold a multiple of this many rows (the grouped GEMMs' row alignment)


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
    worst-case R*J buffer instead (`lax.cond`; each device decides for itself, no collective inside). That
    branch is rematerialised (`jax.checkpoint`): its residuals are the branch's inputs, so the bounded branch
    pays nothing for it. Never a drop; the overflow is reported.
    """

    experts: dict  # {"gate_up": [G, D, 2F], "down": [G, F, D]}, this device's shard
    gmm: GroupedMatmul
    buffer_factor: float = 0.0  # 0: always the worst-case buffer

    @property
    def num_local(self) -> int:
        return self.experts["gate_up"].shape[0]

    def buffer_rows(self, balanced_pairs: int, worst_rows: int) -> int:
        """Rows of the bounded buffer: buffer_factor x the balanced load, rounded up to ROW_ALIGN, capped."""
        if self.buffer_factor <= 0:
            return worst_rows
        return min(worst_rows, ROW_ALIGN * math.ceil(self.buffer_factor * balanced_pairs / ROW_ALIGN))

    def __call__(self, received: Received, balanced_pairs: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """-> (partial_RD: each row's weighted sum over its local experts, in x_RD's dtype; rows dropped, overflowed).

        The sum is taken in float32 and rounded to the compute dtype inside the branch, where XLA fuses the cast
        into the combine's pass (at the branch's boundary it was a pass of its own each way, and the combine sends
        the compute dtype anyway).

        `balanced_pairs`: the (token, expert) pairs one device holds when the routing is balanced, T*K."""
        operands = (received.x_RD, received.local_ids_RJ, received.weights_RJ, self.experts)
        worst = received.local_ids_RJ.size
        bound = self.buffer_rows(balanced_pairs, worst)

        def run(rows, in_cond=True):
            def local(x_RD, ids_RJ, weights_RJ, experts):
                executor = LocalExecutor(rows, remat_activation=in_cond)
                y_RD, stats = executor(x_RD, ids_RJ, weights_RJ, experts, self.gmm)
                return y_RD.astype(x_RD.dtype), stats.tokens_dropped
            return local

        if bound >= worst:
            y_RD, dropped = run(None, in_cond=False)(*operands)
            return y_RD, dropped, jnp.zeros((), jnp.int32)
        overflowed = jnp.sum(received.local_ids_RJ < self.num_local) > bound
        y_RD, dropped = jax.lax.cond(overflowed, jax.checkpoint(run(None)), run(bound), *operands)
        return y_RD, dropped, overflowed.astype(jnp.int32)


class Strategy(Protocol):
    """One way across the wire: `strategy(x_TD, expert_ids_TK, weights_TK, local) -> (y_TD f32, ExecutorStats)`.

    Called per device inside the shard_map; `local` computes this device's experts on what arrived.
    """

    name: str

    def __call__(self, x_TD: jax.Array, expert_ids_TK: jax.Array, weights_TK: jax.Array,
                 local: LocalExperts) -> tuple[jax.Array, ExecutorStats]: ...


def _carry_to_columns(carried_XK, ids_XK, weights_XK, num_local: int, width: int):
    """Compact the carried experts of each row into `width` columns (the rest: id G, weight 0)."""
    # A stable sort of "not carried" brings the carried columns to the front in their original order.
    order_XJ = jnp.argsort(~carried_XK, axis=-1, stable=True)[..., :width]
    valid_XJ = jnp.take_along_axis(carried_XK, order_XJ, axis=-1)
    ids_XJ = jnp.where(valid_XJ, jnp.take_along_axis(ids_XK % num_local, order_XJ, axis=-1), num_local)
    weights_XJ = jnp.where(valid_XJ, jnp.take_along_axis(weights_XK, order_XJ, axis=-1), 0.0)
    return ids_XJ.astype(jnp.int32), weights_XJ.astype(jnp.float32)


def _remote_pairs(expert_ids_TK, num_local: int) -> jax.Array:
    """(token, expert) pairs whose expert lives on another device: the rows sent without dedup."""
    return jnp.sum(expert_ids_TK // num_local != jax.lax.axis_index(EXPERT_AXIS)).astype(jnp.int32)


class SendPlan(NamedTuple):
    """The sender's side of alltoall and ragged: units sorted by destination device."""

    x_UD: jax.Array  # unit rows, destination-major; rows past sum(sends_P) are unused
    meta_UJ2: jax.Array  # float32 (weight, local id) of each expert a unit carries; id G = none
    sends_P: jax.Array  # int32 rows for each destination device
    info: PermuteInfo  # undoes the sort in the combine
    unit_used_TK: jax.Array  # float32: 1 for a unit that is sent, 0 for an unused one (dedup repeats)


def plan_units(x_TD, expert_ids_TK, weights_TK, num_devices: int, num_local: int, dedup: bool) -> SendPlan:
    """Which rows go to which device, destination-major, via the MoE `permute` (devices as its groups).

    Local ids travel as float32 beside their weights, so one collective carries both (exact below 2**24).
    """
    num_tokens, top_k = expert_ids_TK.shape
    dest_TK = expert_ids_TK // num_local
    if dedup:
        # A token's distinct destinations: sort them, and mark each repeat with the sentinel P (never sent).
        sorted_TK = jnp.sort(dest_TK, axis=1)
        repeat_TK = jnp.concatenate([jnp.zeros((num_tokens, 1), bool), sorted_TK[:, 1:] == sorted_TK[:, :-1]], 1)
        unit_dest_TK = jnp.where(repeat_TK, num_devices, sorted_TK)
        carried_TKK = dest_TK[:, None, :] == unit_dest_TK[:, :, None]  # [token, unit, k]
        width = min(top_k, num_local)  # a token's top-k ids are distinct: at most G of them on one device
    else:
        unit_dest_TK = dest_TK
        carried_TKK = jnp.broadcast_to(jnp.eye(top_k, dtype=bool), (num_tokens, top_k, top_k))
        width = 1
    ids_TKJ, weights_TKJ = _carry_to_columns(
        carried_TKK, jnp.broadcast_to(expert_ids_TK[:, None, :], carried_TKK.shape),
        jnp.broadcast_to(weights_TK[:, None, :], carried_TKK.shape), num_local, width)
    x_UD, sends_P, info = permute(x_TD, unit_dest_TK, num_devices)
    meta_UJ2 = jnp.stack([weights_TKJ, ids_TKJ.astype(jnp.float32)], -1).reshape(-1, width, 2)[info.slot_of_row_M]
    return SendPlan(x_UD, meta_UJ2, sends_P, info, (unit_dest_TK < num_devices).astype(jnp.float32))


def worst_case_rows(num_tokens: int, top_k: int, num_local: int, dedup: bool) -> int:
    """Most rows one device can send to one other: a token goes there once with dedup, else once per expert."""
    return num_tokens if dedup else num_tokens * min(top_k, num_local)


def balanced_rows(num_tokens: int, top_k: int, num_devices: int, num_local: int, dedup: bool) -> float:
    """Expected rows from one device to another when every expert is equally likely (uniform routing).

    Without dedup that is T*K/P. With dedup a token goes to a device if any of its K distinct experts is one
    of that device's G, which has probability 1 - C(E-G, K) / C(E, K).
    """
    if not dedup:
        return num_tokens * top_k / num_devices
    experts = num_devices * num_local
    return num_tokens * (1 - math.comb(experts - num_local, top_k) / math.comb(experts, top_k))


def _received(x_RD, meta_RJ2) -> Received:
    return Received(x_RD, meta_RJ2[..., 1].astype(jnp.int32), meta_RJ2[..., 0])


def _rows_sent(plan: SendPlan) -> jax.Array:
    return (jnp.sum(plan.sends_P) - plan.sends_P[jax.lax.axis_index(EXPERT_AXIS)]).astype(jnp.int32)


def _sum_units(y_UD, plan: SendPlan) -> jax.Array:
    """Each token's returned unit rows (each already weighted by the routing) summed in float32."""
    return unpermute(y_UD, plan.info, plan.unit_used_TK)


@dataclass(frozen=True)
class AllGather:
    """Gather the group's tokens, compute the local experts on all of them, reduce-scatter the sums.

    The reduce-scatter adds the P partial rows of a token in the compute dtype (bf16 in training).
    """

    wire: Wire = Wire()
    name: str = "allgather"

    def dispatch(self, x_TD, expert_ids_TK, weights_TK, num_local: int) -> Received:
        gather = lambda a: jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True)
        ids_RK, weights_RK = gather(expert_ids_TK), gather(weights_TK)
        here_RK = ids_RK // num_local == jax.lax.axis_index(EXPERT_AXIS)
        ids_RJ, weights_RJ = _carry_to_columns(here_RK, ids_RK, weights_RK, num_local, min(ids_RK.shape[1], num_local))
        return Received(self.wire.to_experts(gather, x_TD), ids_RJ, weights_RJ)

    def combine(self, partial_RD) -> jax.Array:
        scatter = lambda a: jax.lax.psum_scatter(a, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        return self.wire.from_experts(scatter, partial_RD).astype(jnp.float32)

    def __call__(self, x_TD, expert_ids_TK, weights_TK, local):
        with jax.named_scope("dispatch"):
            received = self.dispatch(x_TD, expert_ids_TK, weights_TK, local.num_local)
        partial_RD, dropped, overflowed = local(received, expert_ids_TK.size)
        with jax.named_scope("combine"):
            y_TD = self.combine(partial_RD)
        sent = x_TD.shape[0] * (jax.lax.axis_size(EXPERT_AXIS) - 1)
        stats = ExecutorStats(dropped, overflowed, jnp.asarray(sent, jnp.int32),
                              _remote_pairs(expert_ids_TK, local.num_local))
        return y_TD, stats


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


def _pick(rows_NX, index_M, valid_M):
    """rows_NX[index_M] where valid_M, else 0."""
    valid = valid_M.reshape(valid_M.shape + (1,) * (rows_NX.ndim - 1))
    return jnp.where(valid, rows_NX[index_M], jnp.zeros((), rows_NX.dtype))


@jax.custom_vjp
def _pick_one_to_one(rows_NX, index_M, valid_M, inverse_N, inverse_valid_N):
    """`_pick` for a map that reads each row at most once, with its inverse given (row n is read by output
    inverse_N[n] where inverse_valid_N[n]). The backward is then the inverse pick, a gather: JAX's transpose of a
    gather is a scatter-add, which took 16 ms of the two-H200 alltoall layer's backward for one [2T, D] buffer."""
    return _pick(rows_NX, index_M, valid_M)


def _pick_one_to_one_fwd(rows_NX, index_M, valid_M, inverse_N, inverse_valid_N):
    return _pick(rows_NX, index_M, valid_M), (inverse_N, inverse_valid_N)


def _pick_one_to_one_bwd(residuals, cotangent_MX):
    inverse_N, inverse_valid_N = residuals
    return _pick(cotangent_MX, inverse_N, inverse_valid_N), None, None, None, None


_pick_one_to_one.defvjp(_pick_one_to_one_fwd, _pick_one_to_one_bwd)


def _to_slots(rows_UX, slots: SlotMap, fill) -> jax.Array:
    """[U, ...] destination-major rows -> [P, C, ...]: slot (p, c) holds p's c-th row, or `fill`."""
    picked = _pick_one_to_one(rows_UX, slots.source_S, slots.filled_S, slots.slot_U, slots.sent_U)
    filled = slots.filled_S.reshape(slots.filled_S.shape + (1,) * (rows_UX.ndim - 1))
    packed = jnp.where(filled, picked, jnp.asarray(fill, rows_UX.dtype))
    return packed.reshape(-1, slots.capacity, *rows_UX.shape[1:])


def _from_slots(slots_PCD, slots: SlotMap) -> jax.Array:
    """The returning rows: [P, C, D] slots -> [U, D] destination-major units (unused units zero)."""
    return _pick_one_to_one(slots_PCD.reshape(-1, slots_PCD.shape[-1]), slots.slot_U, slots.sent_U,
                            slots.source_S, slots.filled_S)


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
    name: str = "alltoall"

    def slot_sizes(self, num_tokens: int, top_k: int, num_devices: int, num_local: int) -> tuple[int, int]:
        """(normal, worst case) slot rows per destination. Normal = buffer_factor x the balanced load."""
        worst = worst_case_rows(num_tokens, top_k, num_local, self.dedup)
        return min(worst, math.ceil(self.buffer_factor * balanced_rows(num_tokens, top_k, num_devices, num_local,
                                                                         self.dedup))), worst

    def dispatch(self, plan: SendPlan, slots: SlotMap, num_local: int) -> Received:
        a2a = lambda a: jax.lax.all_to_all(a, EXPERT_AXIS, 0, 0, tiled=True)
        x_PCD = self.wire.to_experts(a2a, _to_slots(plan.x_UD, slots, 0))
        empty = jnp.asarray([0.0, num_local], jnp.float32)  # weight 0, id G: "no expert"
        meta_PCJ2 = a2a(_to_slots(plan.meta_UJ2, slots, empty))
        return _received(x_PCD.reshape(-1, x_PCD.shape[-1]), meta_PCJ2.reshape(-1, *meta_PCJ2.shape[2:]))

    def combine(self, partial_RD, plan: SendPlan, slots: SlotMap) -> jax.Array:
        num_devices = plan.sends_P.shape[0]
        back = lambda a: jax.lax.all_to_all(a.reshape(num_devices, slots.capacity, -1), EXPERT_AXIS, 0, 0,
                                            tiled=True)
        back_PCD = self.wire.from_experts(back, partial_RD)
        return _sum_units(_from_slots(back_PCD, slots), plan)

    def __call__(self, x_TD, expert_ids_TK, weights_TK, local):
        num_devices, num_local = jax.lax.axis_size(EXPERT_AXIS), local.num_local
        plan = plan_units(x_TD, expert_ids_TK, weights_TK, num_devices, num_local, self.dedup)
        normal, worst = self.slot_sizes(*expert_ids_TK.shape, num_devices, num_local)

        def exchange(capacity):
            def run():
                slots = slot_map(plan.sends_P, capacity, plan.x_UD.shape[0])  # both ways, built once
                with jax.named_scope("dispatch"):
                    received = self.dispatch(plan, slots, num_local)
                partial_RD, dropped, local_overflowed = local(received, expert_ids_TK.size)
                with jax.named_scope("combine"):
                    return self.combine(partial_RD, plan, slots), dropped, local_overflowed
            return run

        # Decided on the device, identically everywhere (the branches run different collectives).
        overflowed = jax.lax.pmax(jnp.max(plan.sends_P) > normal, MESH_AXES)
        if normal == worst:
            y_TD, dropped, local_overflowed = exchange(worst)()
        else:
            y_TD, dropped, local_overflowed = jax.lax.cond(overflowed, exchange(worst), exchange(normal))
        stats = ExecutorStats(dropped, jnp.maximum(overflowed.astype(jnp.int32), local_overflowed), _rows_sent(plan),
                              _remote_pairs(expert_ids_TK, num_local))
        return y_TD, stats


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


@dataclass(frozen=True)
class Ragged:
    """`ragged_all_to_all`: exactly the needed rows each way. Receive buffers are worst-case sized.

    `collective` is `jax.lax.ragged_all_to_all` (GPU); tests pass an emulation, as XLA:CPU lacks it.
    """

    dedup: bool = True
    collective: Callable = jax.lax.ragged_all_to_all
    wire: Wire = Wire()
    name: str = "ragged"

    def dispatch(self, plan: SendPlan, offsets: dict, buffer_rows: int, num_local: int) -> Received:
        def send(operand, offsets, empty_row=0):
            output = jnp.broadcast_to(jnp.asarray(empty_row, operand.dtype), (buffer_rows, *operand.shape[1:]))
            output = varying_like(output, operand)  # the result's mesh-axis type is its output buffer's
            return self.collective(operand, output, offsets["input_offsets"], offsets["send_sizes"],
                                   offsets["output_offsets"], offsets["recv_sizes"], axis_name=EXPERT_AXIS)
        meta_RJ2 = send(plan.meta_UJ2, offsets, jnp.asarray([0.0, num_local]))  # unfilled rows: weight 0, id G
        return _received(self.wire.to_experts(send, plan.x_UD, offsets), meta_RJ2)

    def combine(self, partial_RD, plan: SendPlan, offsets: dict) -> jax.Array:
        def back(operand, offsets):
            output = varying_like(jnp.zeros((plan.x_UD.shape[0], *operand.shape[1:]), operand.dtype), operand)
            return self.collective(operand, output, offsets["recv_offsets"], offsets["recv_sizes"],
                                   offsets["back_offsets"], offsets["send_sizes"], axis_name=EXPERT_AXIS)
        return _sum_units(self.wire.from_experts(back, partial_RD, offsets), plan)

    def __call__(self, x_TD, expert_ids_TK, weights_TK, local):
        num_devices, num_local = jax.lax.axis_size(EXPERT_AXIS), local.num_local
        num_tokens, top_k = expert_ids_TK.shape
        plan = plan_units(x_TD, expert_ids_TK, weights_TK, num_devices, num_local, self.dedup)
        sends_SP = jax.lax.all_gather(plan.sends_P, EXPERT_AXIS, axis=0, tiled=False)
        offsets = ragged_offsets(sends_SP, jax.lax.axis_index(EXPERT_AXIS))
        buffer_rows = num_devices * worst_case_rows(num_tokens, top_k, num_local, self.dedup)
        with jax.named_scope("dispatch"):
            received = self.dispatch(plan, offsets, buffer_rows, num_local)
        partial_RD, dropped, overflowed = local(received, expert_ids_TK.size)
        with jax.named_scope("combine"):
            y_TD = self.combine(partial_RD, plan, offsets)
        stats = ExecutorStats(dropped, overflowed, _rows_sent(plan), _remote_pairs(expert_ids_TK, num_local))
        return y_TD, stats


@dataclass(frozen=True)
class NoDispatch:
    """parallel.expert = 1: every device holds every expert; nothing crosses a link."""

    name: str = "local"

    def __call__(self, x_TD, expert_ids_TK, weights_TK, local):
        return LocalExecutor()(x_TD, expert_ids_TK, weights_TK, local.experts, local.gmm)


@dataclass(frozen=True)
class Auto:
    """`moe.dispatch=auto`: alltoall when its slots are smaller than the whole token set, else allgather.

    When every slot must hold all T tokens (few devices and a large top-k: at 2 devices with DeepSeek-V3's
    top-8, nearly every token has an expert on the other device), all_to_all moves the same rows as
    all_gather at about the same rate (271 vs 251 GB/s per GPU between two H200s), while alltoall also packs
    and unpacks its slots: the layer took 74.6 ms with alltoall, 73.1 with allgather in one run (BENCHMARKS.md).
    Decided per shape, at trace time.
    """

    buffer_factor: float = 2.0
    dedup: bool = True
    wire: Wire = Wire()
    name: str = "auto"

    def choose(self, num_tokens: int, top_k: int, num_devices: int, num_local: int) -> Strategy:
        alltoall = AllToAll(self.buffer_factor, self.dedup, self.wire)
        normal, _ = alltoall.slot_sizes(num_tokens, top_k, num_devices, num_local)
        return AllGather(self.wire) if normal >= num_tokens else alltoall

    def __call__(self, x_TD, expert_ids_TK, weights_TK, local):
        chosen = self.choose(*expert_ids_TK.shape, jax.lax.axis_size(EXPERT_AXIS), local.num_local)
        return chosen(x_TD, expert_ids_TK, weights_TK, local)


@dataclass(frozen=True)
class ExpertParallelExecutor:
    """The MoE executor seam over a mesh: one `shard_map`, tokens over every device, experts over `expert`."""

    mesh: Mesh
    strategy: Strategy
    local_buffer_factor: float = 0.0  # LocalExperts.buffer_factor

    def __call__(self, x_TD, expert_ids_TK, weights_TK, experts, gmm):
        num_tokens, num_devices = x_TD.shape[0], self.mesh.size
        if num_tokens % num_devices:
            raise ConfigError(f"the MoE layer got {num_tokens} tokens, which do not split over the {num_devices} "
                              f"devices of the mesh; make train.batch_size a multiple of {num_devices}.")
        tokens, experts_spec = P(BATCH_AXES), P(EXPERT_AXIS)

        def per_device(x_TD, expert_ids_TK, weights_TK, experts):
            y_TD, stats = self.strategy(x_TD, expert_ids_TK, weights_TK, LocalExperts(experts, gmm,
                                                                                    self.local_buffer_factor))
            totals = jax.tree.map(lambda s: jax.lax.psum(s, MESH_AXES), stats)
            # The layer overflowed once, however many devices did (alltoall's slots: all of them), and within the
            # one all-reduce of the stats: a pmax of its own was a separate, synchronising collective.
            return y_TD, totals._replace(dispatch_overflowed=jnp.minimum(totals.dispatch_overflowed, 1))

        run = jax.shard_map(per_device, mesh=self.mesh, out_specs=(tokens, P()),
                            in_specs=(tokens, tokens, tokens, jax.tree.map(lambda _: experts_spec, experts)))
        return run(x_TD, expert_ids_TK, weights_TK, experts)


@dataclass(frozen=True)
class Chunked:
    """`moe.dispatch_chunks = n`: each device's tokens in n chunks, each through the inner strategy in turn.

    Chunk i+1's dispatch does not depend on chunk i's experts or combine, so XLA may run its collective while
    chunk i's grouped GEMMs run (the overlap NVIDIA's fused dispatch/combine gets); the price is n smaller
    exchanges and GEMMs. Exact: every token is routed, computed and combined as without chunks.
    """

    inner: Strategy
    chunks: int
    name: str = "chunked"

    def __call__(self, x_TD, expert_ids_TK, weights_TK, local):
        num_tokens = x_TD.shape[0]
        if num_tokens % self.chunks:
            raise ConfigError(f"moe.dispatch_chunks={self.chunks} does not divide the {num_tokens} tokens each device "
                              f"holds in the MoE layer; choose a divisor of {num_tokens}.")
        size = num_tokens // self.chunks
        outputs, stats = [], []
        for c in range(self.chunks):
            rows = slice(c * size, (c + 1) * size)
            with jax.named_scope(f"chunk{c}"):
                y_TD, chunk_stats = self.inner(x_TD[rows], expert_ids_TK[rows], weights_TK[rows], local)
            outputs.append(y_TD)
            stats.append(chunk_stats)
        # Dropped rows and rows sent add up; the overflow flag is 1 if any chunk overflowed.
        total = jax.tree.map(lambda *s: sum(s), *stats)
        return jnp.concatenate(outputs), total._replace(
            dispatch_overflowed=jnp.max(jnp.stack([s.dispatch_overflowed for s in stats])))


def make_strategy(config: Config, platform: str | None = None) -> Strategy:
    """The strategy `moe.dispatch` names, split into `moe.dispatch_chunks` chunks when that is > 1."""
    if config.parallel.expert == 1:
        return NoDispatch()
    strategy = _named_strategy(config, platform)
    return strategy if config.moe.dispatch_chunks == 1 else Chunked(strategy, config.moe.dispatch_chunks)


def _named_strategy(config: Config, platform: str | None = None) -> Strategy:
    """The strategy `moe.dispatch` names, for `parallel.expert` > 1 devices."""
    moe = config.moe
    name = moe.dispatch
    platform = platform or jax.default_backend()
    wire = Wire.from_config(moe.dispatch_dtype)
    if name == "auto":
        return Auto(moe.alltoall_buffer_factor, moe.dedup, wire)
    if name == "ragged" and platform != "gpu":
        raise ConfigError(f"moe.dispatch=ragged needs GPUs (XLA:{platform.upper()} has no ragged_all_to_all); "
                          f"use moe.dispatch=alltoall or allgather.")
    if name == "allgather":
        return AllGather(wire)
    if name == "alltoall":
        return AllToAll(moe.alltoall_buffer_factor, moe.dedup, wire)
    return Ragged(moe.dedup, wire=wire)


def make_executor(config: Config, mesh: Mesh) -> ExpertParallelExecutor | None:
    """The executor for this config and mesh; None (the single-device LocalExecutor) on one device."""
    if mesh.size == 1:
        return None
    if config.moe.num_experts % mesh.shape[EXPERT_AXIS]:
        raise ConfigError(f"moe.num_experts={config.moe.num_experts} is not divisible by parallel.expert="
                          f"{mesh.shape[EXPERT_AXIS]}; choose an expert-parallel size that divides it.")
    return ExpertParallelExecutor(mesh, make_strategy(config), config.moe.local_buffer_factor)
