"""Permutation: sort the (token, expert) pairs by expert so each expert's rows are contiguous, and back.

Shapes: T tokens, K experts per token, M = T*K rows after permutation, D hidden, E experts.
A *slot* is one (token, k) pair, numbered t*K + k. `permute` sorts the slots by expert id with a stable
sort (so inside an expert the rows stay in token order) and gathers the token rows; `unpermute` gathers
them back and combines the K expert outputs of each token with the routing weights, in float32.

Both directions have custom VJPs that are gathers too: the transpose of a gather is a scatter(-add), which on
accelerators is slower and, with duplicate indices, non-deterministic. Because the sort is a permutation we
know its inverse, so each backward pass is one more gather (plus a sum over K for the token rows).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class PermuteInfo(NamedTuple):
    """What `unpermute` needs to undo `permute` (a pytree of int32 device arrays)."""

    slot_of_row_M: jax.Array  # sorted row -> slot t*K + k
    row_of_slot_TK: jax.Array  # slot (t, k) -> sorted row (the inverse permutation)
    num_valid: jax.Array  # int32 scalar: sorted rows that hold a (token, expert) pair; sentinel ids sort after


def _rows(y_MD: jax.Array, rows_TK: jax.Array, num_valid: jax.Array) -> jax.Array:
    """y_MD[rows_TK] where the row holds a pair, zero elsewhere: a sentinel's row (past num_valid) and a row past
    the end of a bounded buffer are never read. So the grouped GEMMs' padding rows may hold anything (NaN too)."""
    picked = jnp.take(y_MD, rows_TK, axis=0, mode="fill", fill_value=0)
    return jnp.where((rows_TK < num_valid)[..., None], picked, jnp.zeros((), y_MD.dtype))


@jax.custom_vjp
def _gather_token_rows(x_TD, slot_of_row_M, row_of_slot_TK, num_valid):
    top_k = row_of_slot_TK.shape[1]
    return x_TD[slot_of_row_M // top_k]


def _gather_token_rows_fwd(x_TD, slot_of_row_M, row_of_slot_TK, num_valid):
    return _gather_token_rows(x_TD, slot_of_row_M, row_of_slot_TK, num_valid), (row_of_slot_TK, num_valid)


def _gather_token_rows_bwd(res, g_MD):
    row_of_slot_TK, num_valid = res
    # Token t was copied to the K rows row_of_slot[t]; its gradient is the sum of theirs. A slot whose row holds
    # no pair (a sentinel, or a row a bounded buffer did not keep) contributes nothing.
    g_TD = jnp.sum(_rows(g_MD, row_of_slot_TK, num_valid).astype(jnp.float32), axis=1).astype(g_MD.dtype)
    return g_TD, None, None, None


_gather_token_rows.defvjp(_gather_token_rows_fwd, _gather_token_rows_bwd)


def permute(x_TD: jax.Array, expert_ids_TK: jax.Array, num_experts: int, rows: int | None = None
            ) -> tuple[jax.Array, jax.Array, PermuteInfo]:
    """Sort token copies by expert: returns (x_sorted_MD, group_sizes_E int32, info), all on device.

    Row r of x_sorted is token slot_of_row[r] // K; rows of expert e are contiguous and in token order.
    Ids >= num_experts (e.g. a sentinel for "not on this device") sort last and are left out of
    group_sizes, so a grouped GEMM treats those rows as padding. `rows` keeps only the first `rows` sorted
    rows (a bounded buffer, default all T*K): correct when sum(group_sizes) <= rows, which the caller checks.
    """
    num_tokens, top_k = expert_ids_TK.shape
    flat_ids_M = expert_ids_TK.reshape(-1).astype(jnp.int32)
    slot_of_row_M = jnp.argsort(flat_ids_M, stable=True).astype(jnp.int32)
    row_of_slot_M = jnp.zeros_like(slot_of_row_M).at[slot_of_row_M].set(
        jnp.arange(num_tokens * top_k, dtype=jnp.int32), unique_indices=True)
    sorted_ids_M = flat_ids_M[slot_of_row_M]
    # Boundaries of each expert's run in the sorted ids: a binary search, no scatter-add and no host sync.
    bounds = jnp.searchsorted(sorted_ids_M, jnp.arange(num_experts + 1, dtype=jnp.int32), side="left")
    group_sizes_E = jnp.diff(bounds).astype(jnp.int32)
    info = PermuteInfo(slot_of_row_M, row_of_slot_M.reshape(num_tokens, top_k), bounds[-1].astype(jnp.int32))
    x_sorted_MD = _gather_token_rows(x_TD, info.slot_of_row_M[:rows], info.row_of_slot_TK, info.num_valid)
    return x_sorted_MD, group_sizes_E, info


@jax.custom_vjp
def unpermute(y_sorted_MD: jax.Array, info: PermuteInfo, weights_TK: jax.Array) -> jax.Array:
    """Undo `permute` and combine: y_TD[t] = sum_k weights[t, k] * y_sorted[row_of_slot[t, k]], in float32.

    Only rows that hold a (token, expert) pair are read (the first `info.num_valid`): padding rows, a sentinel's
    rows and rows past T*K are ignored whatever they hold, and get zero gradient. `y_sorted` may also have fewer
    rows than T*K (a bounded buffer, `permute(..., rows=...)`).
    One fused pass each way: the forward reads each slot's row once and writes y_TD; the backward writes each
    sorted row's cotangent, weight times its token's cotangent, directly in y_sorted's dtype (no [T, K, D]
    float32 intermediate, no separate cast), and reads y_sorted once for the weights' gradient.
    """
    rows_TKD = _rows(y_sorted_MD, info.row_of_slot_TK, info.num_valid).astype(jnp.float32)
    return jnp.sum(weights_TK.astype(jnp.float32)[..., None] * rows_TKD, axis=1)


def _unpermute_fwd(y_sorted_MD, info, weights_TK):
    return unpermute(y_sorted_MD, info, weights_TK), (y_sorted_MD, info, weights_TK)


def _unpermute_bwd(residuals, g_TD):
    y_sorted_MD, info, weights_TK = residuals
    top_k = info.row_of_slot_TK.shape[1]
    num_rows = y_sorted_MD.shape[0]  # fewer than T*K (a bounded buffer) or more (an expert-parallel one's padding)
    # Everything in sorted-row order, one pass over [rows, D]: sorted row m holds slot s = slot_of_row[m], i.e.
    # token s // K with weight weights[s]. Its cotangent is weight times the token's (in y_sorted's dtype), and
    # the weight's gradient is <token cotangent, y_sorted[m]>, a row sum of the same pass (XLA fuses the two; a
    # weight gradient in slot order read y_sorted through a second gather and, beside a padded buffer, did not fuse).
    slot_of_row_M = info.slot_of_row_M[:num_rows]
    slot_of_row_M = jnp.pad(slot_of_row_M, (0, num_rows - slot_of_row_M.shape[0]))  # padding rows: masked below
    holds_pair_M1 = (jnp.arange(num_rows, dtype=jnp.int32) < info.num_valid)[:, None]
    g_rows_MD = g_TD[slot_of_row_M // top_k].astype(jnp.float32)
    weight_M1 = weights_TK.astype(jnp.float32).reshape(-1)[slot_of_row_M][:, None]
    g_sorted_MD = (weight_M1 * g_rows_MD.astype(y_sorted_MD.dtype).astype(jnp.float32)).astype(y_sorted_MD.dtype)
    g_sorted_MD = jnp.where(holds_pair_M1, g_sorted_MD, jnp.zeros((), y_sorted_MD.dtype))
    products_MD = jnp.where(holds_pair_M1, g_rows_MD * y_sorted_MD.astype(jnp.float32), 0)
    g_weight_M = jnp.sum(products_MD, axis=1)
    # Back to slot order: slot (t, k)'s gradient is its row's; a slot whose row holds no pair gets zero.
    g_weights_TK = _rows(g_weight_M[:, None], info.row_of_slot_TK, info.num_valid)[..., 0].astype(weights_TK.dtype)
    return g_sorted_MD, None, g_weights_TK


unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)
