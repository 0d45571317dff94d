"""The sender's plan: which rows go to which device, and how many a destination receives at most or on average.

Deduplication (`moe.dedup`, alltoall and ragged): a token whose top-k experts include several on one device
is sent there once, with the list of its experts on that device; the receiver expands it to those experts and
sends back ONE row, their weighted sum.

Legend, per device: T tokens, K top-k, D hidden, P devices on the `expert` axis, G = E / P local
experts, J = experts one sent row carries (min(K, G) with dedup, else 1), U = T*K send units
(a unit is a (token, destination) pair with dedup, a (token, k) pair without), X any leading rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dropless.ep.contract import EXPERT_AXIS, Received
from dropless.moe.permute import PermuteInfo, permute, unpermute


def carry_to_columns(carried_XK, ids_XK, weights_XK, num_local: int, width: int):
    """Compact the carried experts of each row into `width` columns (the rest: id G, weight 0)."""
    # A stable sort of "not carried" brings the carried columns to the front in their original order.
    order_XJ = jnp.argsort(~carried_XK, axis=-1, stable=True)[..., :width]
    valid_XJ = jnp.take_along_axis(carried_XK, order_XJ, axis=-1)
    ids_XJ = jnp.where(valid_XJ, jnp.take_along_axis(ids_XK % num_local, order_XJ, axis=-1), num_local)
    weights_XJ = jnp.where(valid_XJ, jnp.take_along_axis(weights_XK, order_XJ, axis=-1), 0.0)
    return ids_XJ.astype(jnp.int32), weights_XJ.astype(jnp.float32)


class SendPlan(NamedTuple):
    """The sender's side of alltoall and ragged: units sorted by destination device."""

    x_UD: jax.Array  # unit rows, destination-major; rows past sum(sends_P) are unused
    meta_UJ2: jax.Array  # float32 (weight, local id) of each expert a unit carries; id G = none
    sends_P: jax.Array  # int32 rows for each destination device
    info: PermuteInfo  # undoes the sort in the combine
    unit_used_TK: jax.Array  # float32: 1 for a unit that is sent, 0 for an unused one (dedup repeats)

    def rows_sent(self) -> jax.Array:
        """int32: the unit rows for other devices than this one."""
        return (jnp.sum(self.sends_P) - self.sends_P[jax.lax.axis_index(EXPERT_AXIS)]).astype(jnp.int32)

    def sum_units(self, y_UD) -> jax.Array:
        """Each token's returned unit rows (each already weighted by the routing) summed in float32."""
        return unpermute(y_UD, self.info, self.unit_used_TK)


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
    ids_TKJ, weights_TKJ = carry_to_columns(
        carried_TKK, jnp.broadcast_to(expert_ids_TK[:, None, :], carried_TKK.shape),
        jnp.broadcast_to(weights_TK[:, None, :], carried_TKK.shape), num_local, width)
    x_UD, sends_P, info = permute(x_TD, unit_dest_TK, num_devices)
    meta_UJ2 = jnp.stack([weights_TKJ, ids_TKJ.astype(jnp.float32)], -1).reshape(-1, width, 2)[info.slot_of_row_M]
    return SendPlan(x_UD, meta_UJ2, sends_P, info, (unit_dest_TK < num_devices).astype(jnp.float32))


def empty_meta(num_local: int) -> jax.Array:
    """The (weight, local id) of an unfilled column or row: weight 0, id G ("no expert")."""
    return jnp.asarray([0.0, num_local], jnp.float32)


def received(x_RD, meta_RJ2) -> Received:
    """Arrived rows and their (weight, local id) columns as the local experts take them."""
    return Received(x_RD, meta_RJ2[..., 1].astype(jnp.int32), meta_RJ2[..., 0])


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
