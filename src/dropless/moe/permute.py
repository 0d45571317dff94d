"""Permutation: sort the (token, expert) pairs by expert so each expert's rows are contiguous, and back.

Shapes: T tokens, K experts per token, M = T*K rows after permutation, D hidden, E experts.
A *slot* is one (token, k) pair, numbered t*K + k. `permute` sorts the slots by expert id with a stable
sort (so inside an expert the rows stay in token order) and gathers the token rows; `unpermute` gathers
them back and combines the K expert outputs of each token with the routing weights, in float32.

Under a grouped GEMM whose `row_align` is > 1 (the FP8 one: 128, dropless.gmm.api) each expert's rows start at a
multiple of the alignment and its group is rounded up to one, zero rows between: the FP8 weight gradient then
takes its 128-token scale tiles from a plain transpose of the rows, each tile inside one expert. So rows holding
a pair are no longer the first ones: validity is per row (`holds_pair_M`) and per slot (`row_of_slot_TK`).

Both directions have custom VJPs that are gathers too: the transpose of a gather is a scatter(-add), which on
accelerators is slower and, with duplicate indices, non-deterministic. Because the sort is a permutation we
know its inverse, so each backward pass is one more gather (plus a sum over K for the token rows).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dropless.gmm.api import aligned_rows

NO_ROW = jnp.iinfo(jnp.int32).max  # row_of_slot of a slot that holds no pair: past the end of every buffer


class PermuteInfo(NamedTuple):
    """What `unpermute` needs to undo `permute` (a pytree of device arrays)."""

    slot_of_row_M: jax.Array  # int32 row -> slot t*K + k; T*K ("none") for an aligned layout's padding rows
    row_of_slot_TK: jax.Array  # int32 slot (t, k) -> row (the inverse); NO_ROW for a sentinel's slot
    holds_pair_M: jax.Array  # bool: the row holds a (token, expert) pair (not a sentinel's, not padding)
    pairs_E: jax.Array  # int32 (token, expert) pairs per expert: the group sizes before any alignment


def _rows(y_MD: jax.Array, rows_TK: jax.Array) -> jax.Array:
    """y_MD[rows_TK], zero where the index is past y's rows (NO_ROW: a sentinel's slot; or a row a bounded buffer
    did not keep). Only rows that hold a pair are read, so the grouped GEMMs' padding rows may hold anything.
    A plain gather, not `take_rows`' words: its readers widen each row to float32 in the same fusion, and the
    word form of the backward's gather and sum measured no faster (`make bench-permute`)."""
    return jnp.take(y_MD, rows_TK, axis=0, mode="fill", fill_value=0)


def _as_words(x_ND: jax.Array) -> jax.Array | None:
    """A 2-byte [N, D] array (D even) seen as [N, D/2] uint32 words, each holding elements 2j and 2j+1; else None."""
    if x_ND.dtype.itemsize != 2 or x_ND.shape[-1] % 2:
        return None
    return jax.lax.bitcast_convert_type(x_ND.reshape(*x_ND.shape[:-1], x_ND.shape[-1] // 2, 2), jnp.uint32)


def take_rows(x_ND: jax.Array, rows: jax.Array, *, in_bounds: bool = False) -> jax.Array:
    """x_ND[rows] ([*rows.shape, D]), zero where an index is past x's rows unless `in_bounds` promises none is.
    Rows of a 2-byte dtype move as uint32 words, two elements per word: the same bits, half the elements for
    XLA's gather to index, which on an H200 moves the rows faster (measured: permute-h200.json)."""
    mode = dict(mode="promise_in_bounds") if in_bounds else dict(mode="fill", fill_value=0)
    x_ND = jnp.asarray(x_ND)
    words = _as_words(x_ND)
    if words is None:
        return x_ND.at[rows].get(**mode)
    out = words.at[rows].get(**mode)
    return jax.lax.bitcast_convert_type(out, x_ND.dtype).reshape(*rows.shape, x_ND.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_token_rows(x_TD, slot_of_row_M, row_of_slot_TK, aligned: bool):
    # An aligned layout's padding rows read slot T*K ("none"), i.e. token T, past x: zero rows. Without
    # alignment every row holds a slot (a sentinel's too), so no index needs the bounds check.
    return take_rows(x_TD, slot_of_row_M // row_of_slot_TK.shape[1], in_bounds=not aligned)


def _gather_token_rows_fwd(x_TD, slot_of_row_M, row_of_slot_TK, aligned):
    return _gather_token_rows(x_TD, slot_of_row_M, row_of_slot_TK, aligned), row_of_slot_TK


def _gather_token_rows_bwd(aligned, row_of_slot_TK, g_MD):
    # Token t was copied to the K rows row_of_slot[t]; its gradient is the sum of theirs. A slot whose row holds
    # no pair (a sentinel, or a row a bounded buffer did not keep) contributes nothing.
    g_TD = jnp.sum(_rows(g_MD, row_of_slot_TK).astype(jnp.float32), axis=1).astype(g_MD.dtype)
    return g_TD, None, None


_gather_token_rows.defvjp(_gather_token_rows_fwd, _gather_token_rows_bwd)


def _aligned_layout(sorted_ids_M, bounds, num_experts: int, num_rows: int, align: int):
    """Each expert's sorted rows moved to start at a multiple of `align`: (row of each sorted position [M], NO_ROW
    for a sentinel's; sorted position of each of the `num_rows` aligned rows [P]; whether it holds one [P];
    the padded group sizes [E])."""
    sizes_E = jnp.diff(bounds).astype(jnp.int32)
    padded_E = align * ((sizes_E + align - 1) // align)
    first_E = jnp.cumsum(padded_E) - padded_E
    expert_M = jnp.minimum(sorted_ids_M, num_experts - 1)
    position_M = jnp.arange(sorted_ids_M.shape[0], dtype=jnp.int32)
    row_M = jnp.where(sorted_ids_M < num_experts, first_E[expert_M] + position_M - bounds[expert_M], NO_ROW)
    # The expert of aligned row p: the first whose padded run ends after p (empty experts end where they start).
    row_P = jnp.arange(num_rows, dtype=jnp.int32)
    expert_P = jnp.searchsorted(first_E + padded_E, row_P, side="right").astype(jnp.int32)
    safe_P = jnp.minimum(expert_P, num_experts - 1)
    within_P = row_P - first_E[safe_P]
    holds_P = (expert_P < num_experts) & (within_P < sizes_E[safe_P])
    return row_M.astype(jnp.int32), jnp.where(holds_P, bounds[safe_P] + within_P, 0), holds_P, padded_E


def _bounds_method(num_pairs: int, num_experts: int) -> str:
    """How `jnp.searchsorted` finds the experts' boundaries in the sorted ids. `compare_all` compares every id
    with every boundary in one fused reduction, far faster on an H200 for 8.5M to 42M comparisons (65,536 or
    81,920 ids, 129 to 513 boundaries) than the default binary search, whose dependent steps are each a kernel
    (measured: permute-h200.json). Its work grows with ids x experts, so beyond 2^27 comparisons (3x
    the most measured) the search is kept: untimed there, it costs no more than measured."""
    return "compare_all" if num_pairs * (num_experts + 1) <= 2**27 else "scan"


def permute(x_TD: jax.Array, expert_ids_TK: jax.Array, num_experts: int, rows: int | None = None,
            row_align: int = 1) -> tuple[jax.Array, jax.Array, PermuteInfo]:
    """Sort token copies by expert: returns (x_sorted_MD, group_sizes_E int32, info), all on device.

    Row r of x_sorted is token slot_of_row[r] // K; rows of expert e are contiguous and in token order.
    Ids >= num_experts (e.g. a sentinel for "not on this device") sort last and are left out of
    group_sizes, so a grouped GEMM treats those rows as padding. `rows` keeps only the first `rows` sorted
    rows (a bounded buffer, default all T*K): correct when sum(group_sizes) <= rows, which the caller checks.

    `row_align` > 1 (a grouped GEMM's `row_align`, dropless.gmm.api): each expert's rows start at a multiple of
    it and its group size is rounded up to one, the rows between being zeros, in a buffer of
    aligned_rows(rows or T*K, E, row_align) rows; the sentinels' pairs get no row. `info.pairs_E` keeps the
    sizes before rounding (what a count of dropped pairs reads).
    """
    num_tokens, top_k = expert_ids_TK.shape
    num_pairs = num_tokens * top_k
    flat_ids_M = expert_ids_TK.reshape(-1).astype(jnp.int32)
    order_M = jnp.argsort(flat_ids_M, stable=True).astype(jnp.int32)  # sorted position -> slot
    position_of_slot_M = jnp.zeros_like(order_M).at[order_M].set(
        jnp.arange(num_pairs, dtype=jnp.int32), unique_indices=True)
    sorted_ids_M = flat_ids_M[order_M]
    # Boundaries of each expert's run in the sorted ids (`_bounds_method`): no scatter-add and no host sync.
    bounds = jnp.searchsorted(sorted_ids_M, jnp.arange(num_experts + 1, dtype=jnp.int32), side="left",
                              method=_bounds_method(num_pairs, num_experts))
    pairs_E = jnp.diff(bounds).astype(jnp.int32)
    if row_align == 1:
        slot_of_row_M = order_M[:rows]
        row_of_slot_M = jnp.where(flat_ids_M < num_experts, position_of_slot_M, NO_ROW)
        holds_pair_M = jnp.arange(slot_of_row_M.shape[0], dtype=jnp.int32) < bounds[-1]
        group_sizes_E = pairs_E
    else:
        buffer_rows = aligned_rows(num_pairs if rows is None else rows, num_experts, row_align)
        row_of_sorted_M, position_P, holds_pair_M, group_sizes_E = _aligned_layout(
            sorted_ids_M, bounds, num_experts, buffer_rows, row_align)
        slot_of_row_M = jnp.where(holds_pair_M, order_M[position_P], num_pairs)
        row_of_slot_M = row_of_sorted_M[position_of_slot_M]
    info = PermuteInfo(slot_of_row_M, row_of_slot_M.reshape(num_tokens, top_k), holds_pair_M, pairs_E)
    x_sorted_MD = _gather_token_rows(x_TD, info.slot_of_row_M, info.row_of_slot_TK, row_align > 1)
    return x_sorted_MD, group_sizes_E, info


@jax.custom_vjp
def unpermute(y_sorted_MD: jax.Array, info: PermuteInfo, weights_TK: jax.Array) -> jax.Array:
    """Undo `permute` and combine: y_TD[t] = sum_k weights[t, k] * y_sorted[row_of_slot[t, k]], in float32.

    Only rows that hold a (token, expert) pair are read (`info.holds_pair_M`): padding rows (an aligned layout's
    too), a sentinel's rows and rows past the buffer are ignored whatever they hold, and get zero gradient.
    `y_sorted` may also have fewer rows than permute wrote (a bounded buffer, `permute(..., rows=...)`).
    One fused pass each way: the forward reads each slot's row once and writes y_TD; the backward writes each
    sorted row's cotangent, weight times its token's cotangent, directly in y_sorted's dtype (no [T, K, D]
    float32 intermediate, no separate cast), and reads y_sorted once for the weights' gradient.
    """
    rows_TKD = _rows(y_sorted_MD, info.row_of_slot_TK).astype(jnp.float32)
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
    extra = num_rows - info.slot_of_row_M.shape[0]
    slot_of_row_M = jnp.pad(info.slot_of_row_M[:num_rows], (0, max(extra, 0)))  # padding rows: masked below
    holds_pair_M1 = jnp.pad(info.holds_pair_M[:num_rows], (0, max(extra, 0)))[:, None]
    g_rows_MD = jnp.take(g_TD, slot_of_row_M // top_k, axis=0, mode="clip").astype(jnp.float32)
    weight_M1 = jnp.take(weights_TK.astype(jnp.float32).reshape(-1), slot_of_row_M, mode="clip")[:, None]
    g_sorted_MD = (weight_M1 * g_rows_MD.astype(y_sorted_MD.dtype).astype(jnp.float32)).astype(y_sorted_MD.dtype)
    g_sorted_MD = jnp.where(holds_pair_M1, g_sorted_MD, jnp.zeros((), y_sorted_MD.dtype))
    products_MD = jnp.where(holds_pair_M1, g_rows_MD * y_sorted_MD.astype(jnp.float32), 0)
    g_weight_M = jnp.sum(products_MD, axis=1)
    # Back to slot order: slot (t, k)'s gradient is its row's; a slot whose row holds no pair gets zero.
    g_weights_TK = _rows(g_weight_M[:, None], info.row_of_slot_TK)[..., 0].astype(weights_TK.dtype)
    return g_sorted_MD, None, g_weights_TK


unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)
