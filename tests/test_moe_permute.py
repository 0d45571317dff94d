"""Permutation: sort by expert, invert, combine; gather-only custom VJPs against plain autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.moe import permute, unpermute


def _problem(num_tokens, top_k, num_experts, seed):
    rng = np.random.default_rng(seed)
    x_TD = jnp.asarray(rng.normal(size=(num_tokens, 3)), jnp.float32)
    # Distinct experts per token (as top-k gives), drawn from a skewed distribution so some experts are empty.
    p = rng.dirichlet(np.full(num_experts, 0.3))
    ids_TK = np.stack([rng.choice(num_experts, top_k, replace=False, p=p) for _ in range(num_tokens)])
    weights_TK = jnp.asarray(rng.uniform(size=(num_tokens, top_k)), jnp.float32)
    return x_TD, jnp.asarray(ids_TK, jnp.int32), weights_TK


@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(7, 1, 5), (9, 3, 4), (6, 6, 6)])
def test_permute_sorts_stably_and_unpermute_inverts(num_tokens, top_k, num_experts):
    x_TD, ids_TK, weights_TK = _problem(num_tokens, top_k, num_experts, seed=num_tokens)

    @jax.jit
    def roundtrip(x_TD, ids_TK, weights_TK):
        x_sorted_MD, group_sizes_E, info = permute(x_TD, ids_TK, num_experts)
        # Scale each row by its expert id + 1 so the combine must route every row back to its slot.
        scale_M = (ids_TK.reshape(-1)[info.slot_of_row_M] + 1).astype(jnp.float32)
        return x_sorted_MD, group_sizes_E, info, unpermute(x_sorted_MD * scale_M[:, None], info, weights_TK)

    x_sorted_MD, group_sizes_E, info, y_TD = roundtrip(x_TD, ids_TK, weights_TK)
    flat_ids = np.asarray(ids_TK).ravel()
    np.testing.assert_array_equal(group_sizes_E, np.bincount(flat_ids, minlength=num_experts))
    np.testing.assert_array_equal(info.slot_of_row_M, np.argsort(flat_ids, kind="stable"))
    np.testing.assert_array_equal(x_sorted_MD, np.asarray(x_TD)[np.argsort(flat_ids, kind="stable") // top_k])
    want_TD = np.einsum("tk,td->td", np.asarray(weights_TK) * (np.asarray(ids_TK) + 1), np.asarray(x_TD))
    np.testing.assert_allclose(y_TD, want_TD, rtol=1e-6)
    # permute then unpermute with weights summing to one is the identity.
    identity_TD = unpermute(x_sorted_MD, info, jnp.full((num_tokens, top_k), 1.0 / top_k))
    np.testing.assert_allclose(identity_TD, x_TD, rtol=1e-6)


def test_gather_only_vjps_equal_plain_autodiff():
    x_TD, ids_TK, weights_TK = _problem(8, 2, 4, seed=3)
    w_M = jnp.asarray(np.random.default_rng(4).normal(size=(16, 1)), jnp.float32)

    def ours(x_TD, weights_TK):
        x_sorted_MD, _, info = permute(x_TD, ids_TK, 4)
        return jnp.sum(jnp.sin(unpermute(jnp.tanh(x_sorted_MD) * w_M, info, weights_TK)))

    def plain(x_TD, weights_TK):  # the same maths with ordinary gathers (scatter-add transposes)
        order = jnp.argsort(ids_TK.reshape(-1), stable=True)
        y_MD = jnp.tanh(x_TD[order // 2]) * w_M
        y_TKD = y_MD[jnp.argsort(order)].reshape(8, 2, -1)
        return jnp.sum(jnp.sin(jnp.einsum("tk,tkd->td", weights_TK, y_TKD)))

    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(x_TD, weights_TK)
    want = jax.jit(jax.grad(plain, argnums=(0, 1)))(x_TD, weights_TK)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_sentinel_ids_sort_last_and_padding_rows_get_no_gradient():
    x_TD = jnp.arange(8.0).reshape(4, 2)
    ids_TK = jnp.array([[1, 3], [0, 3], [3, 1], [1, 0]], jnp.int32)  # 3 = "not on this device" for E = 3
    x_sorted_MD, group_sizes_E, info = jax.jit(permute, static_argnums=2)(x_TD, ids_TK, 3)  # one program
    np.testing.assert_array_equal(group_sizes_E, [2, 3, 0])
    np.testing.assert_array_equal(np.asarray(x_sorted_MD)[5:], np.asarray(x_TD)[[0, 1, 2]])  # token order
    # unpermute accepts a padded buffer (rows past T*K); only the 5 rows that hold a pair are read, whatever the
    # weights of the sentinels' slots, so only they get a gradient.
    padded_RD = jnp.concatenate([x_sorted_MD, jnp.full((3, 2), 7.0)])
    grad_RD = jax.jit(jax.grad(lambda y: jnp.sum(unpermute(y, info, jnp.ones((4, 2))))))(padded_RD)
    np.testing.assert_array_equal(grad_RD, np.r_[np.ones((5, 2)), np.zeros((6, 2))])


@pytest.mark.parametrize("row_align", [1, 4])
def test_rows_that_hold_no_pair_are_never_read(row_align):
    """A grouped GEMM may leave the sentinels' rows (and a buffer's padding, an aligned layout's too) unwritten:
    NaN there must not reach the combine, its weights' gradient, or the token gradient of `permute`."""
    x_TD = jnp.arange(8.0).reshape(4, 2)
    ids_TK = jnp.array([[1, 3], [0, 3], [3, 1], [1, 0]], jnp.int32)  # 3 = "not on this device" for E = 3
    weights_TK = jnp.array([[0.5, 0.0], [0.25, 0.0], [0.0, 1.0], [2.0, 3.0]])
    _, _, info = permute(x_TD, ids_TK, 3, row_align=row_align)
    assert int(np.sum(info.holds_pair_M)) == 5
    if row_align == 1:  # the pairs are the first rows; aligned, they are not (expert 0's 2 rows, then 4 from row 4)
        np.testing.assert_array_equal(np.flatnonzero(info.holds_pair_M), range(5))
    else:
        np.testing.assert_array_equal(np.flatnonzero(info.holds_pair_M), [0, 1, 4, 5, 6])

    def combine(x_TD, weights_TK):
        x_sorted_MD, _, info = permute(x_TD, ids_TK, 3, row_align=row_align)
        poisoned_MD = jnp.where(info.holds_pair_M[:, None], x_sorted_MD, jnp.nan)
        return jnp.sum(unpermute(poisoned_MD, info, weights_TK) ** 2)

    def clean(x_TD, weights_TK):  # the same sum over the five real pairs only
        keep_TK = ids_TK < 3
        rows_TKD = jnp.where(keep_TK[..., None], x_TD[:, None, :], 0)
        return jnp.sum(jnp.einsum("tk,tkd->td", jnp.where(keep_TK, weights_TK, 0), rows_TKD) ** 2)

    got = jax.jit(jax.value_and_grad(combine, argnums=(0, 1)))(x_TD, weights_TK)  # one program each, not op by op
    want = jax.jit(jax.value_and_grad(clean, argnums=(0, 1)))(x_TD, weights_TK)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6)  # finite, and a sentinel's weight gets no gradient


def _routing(kind, num_tokens, top_k, num_experts, seed):
    """Distinct expert ids per token: skewed (some experts empty), all on expert 2, group sizes at every residue
    that rounding up to an alignment can get wrong, or with sentinels (ids >= E, "not on this device") in some
    slots."""
    rng = np.random.default_rng(seed)
    if kind in ("one_expert", "residues"):  # one real column, the others sentinels
        ids = np.full((num_tokens, top_k), num_experts)
        ids[:, 0] = 2  # one_expert: every token's first choice is expert 2
        if kind == "residues":  # group sizes 1, 0, 9, 7, 8, 12: one past a multiple of 8 (and of 128), one short, ...
            ids[:, 0] = np.repeat(np.arange(num_experts), [1, 0, 9, 7, 8, num_tokens - 25])
        return ids
    p = rng.dirichlet(np.full(num_experts, 0.3))
    ids = np.stack([rng.choice(num_experts, top_k, replace=False, p=p) for _ in range(num_tokens)])
    if kind == "sentinels":
        ids = np.where(rng.uniform(size=ids.shape) < 0.4, num_experts + rng.integers(0, 3, ids.shape), ids)
    return ids


@pytest.mark.parametrize("kind, bounded", [("skewed", False), ("one_expert", False), ("residues", False),
                                           ("sentinels", False), ("sentinels", True), ("skewed", True)])
@pytest.mark.parametrize("row_align", [8, 128])
def test_aligned_permutation_equals_the_contiguous_one(kind, bounded, row_align):
    """permute(row_align=a): each expert's rows from a multiple of a, zero rows between, padded group sizes; and
    through a grouped GEMM and unpermute the same outputs and gradients (x, weights, W) as the contiguous layout."""
    num_tokens, top_k, num_experts = 37, 3, 6
    ids_TK = jnp.asarray(_routing(kind, num_tokens, top_k, num_experts, seed=row_align), jnp.int32)
    rng = np.random.default_rng(1)
    x_TD = jnp.asarray(rng.normal(size=(num_tokens, 5)), jnp.float32)
    w_EDF = jnp.asarray(rng.normal(size=(num_experts, 5, 4)), jnp.float32)
    w_back_EFD = jnp.asarray(rng.normal(size=(num_experts, 4, 5)), jnp.float32)
    weights_TK = jnp.asarray(rng.uniform(size=(num_tokens, top_k)), jnp.float32)
    pairs = int(np.sum(np.asarray(ids_TK) < num_experts))
    rows = pairs + 3 if bounded else None

    def layer(x_TD, weights_TK, w_EDF, align):
        x_sorted_MD, group_sizes_E, info = permute(x_TD, ids_TK, num_experts, rows, row_align=align)
        h_MF = jnp.tanh(jax.lax.ragged_dot(x_sorted_MD, w_EDF, group_sizes_E))
        y_MD = jax.lax.ragged_dot(h_MF, w_back_EFD, group_sizes_E)
        return jnp.sum(jnp.sin(unpermute(y_MD, info, weights_TK))), (x_sorted_MD, group_sizes_E, info)

    grad = jax.jit(jax.value_and_grad(layer, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (want, _), want_grads = grad(x_TD, weights_TK, w_EDF, 1)
    (got, (x_sorted_MD, group_sizes_E, info)), got_grads = grad(x_TD, weights_TK, w_EDF, row_align)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)

    counts_E = np.bincount(np.asarray(ids_TK).ravel(), minlength=num_experts)[:num_experts]
    np.testing.assert_array_equal(info.pairs_E, counts_E)
    np.testing.assert_array_equal(group_sizes_E, -(-counts_E // row_align) * row_align)
    assert x_sorted_MD.shape[0] == row_align * (-(-(rows or num_tokens * top_k) // row_align) + num_experts)
    # Expert e's pairs are the first counts[e] rows of its run, in token order; every other row is zero.
    first_E = np.cumsum(group_sizes_E) - group_sizes_E
    holds = np.zeros(x_sorted_MD.shape[0], bool)
    flat_ids = np.asarray(ids_TK).ravel()
    for e in range(num_experts):
        run = slice(first_E[e], first_E[e] + counts_E[e])
        holds[run] = True
        tokens = np.flatnonzero(flat_ids == e) // top_k
        np.testing.assert_array_equal(np.asarray(x_sorted_MD)[run], np.asarray(x_TD)[tokens])
    np.testing.assert_array_equal(info.holds_pair_M, holds)
    np.testing.assert_array_equal(np.asarray(x_sorted_MD)[~holds], 0.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("width", [6, 7])
def test_row_gather_through_words_equals_plain_take(dtype, width):
    """take_rows moves 2-byte rows as uint32 words: bit for bit the plain gather (signed zeros and infinities
    too), rows past the end zero (fill) or promised absent, an odd width gathered plainly."""
    from dropless.moe.permute import take_rows

    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.standard_normal((9, width)) * 10.0 ** rng.integers(-3, 4, (9, width)), dtype)
    y = y.at[0, 0].set(-0.0).at[1, 1].set(jnp.inf).at[2, 2].set(-jnp.inf)
    rows_TK = jnp.asarray(rng.integers(0, 12, (5, 3)), jnp.int32)  # 9..11 past the end
    plain = jnp.take(y, rows_TK, axis=0, mode="fill", fill_value=0)
    np.testing.assert_array_equal(np.asarray(take_rows(y, rows_TK)).view(np.uint8),
                                  np.asarray(plain).view(np.uint8))
    inside = rows_TK % 9
    np.testing.assert_array_equal(np.asarray(take_rows(y, inside, in_bounds=True)).view(np.uint8),
                                  np.asarray(jnp.take(y, inside, axis=0)).view(np.uint8))
    assert take_rows(y[:0], rows_TK[:0]).shape == (0, 3, width)  # no rows to take from, none to take


def test_permute_of_no_tokens_is_empty():
    x_sorted, sizes, info = permute(jnp.zeros((0, 6), jnp.bfloat16), jnp.zeros((0, 2), jnp.int32), 4)
    assert x_sorted.shape == (0, 6) and np.asarray(sizes).tolist() == [0, 0, 0, 0]


def test_the_combines_backward_writes_weight_times_the_rounded_cotangent():
    """unpermute's backward gives sorted row (t, k) the cotangent w[t, k] · g[t] in y_sorted's dtype, from g[t] in
    that dtype (as the bf16 rows it stands for), multiplied in float32 and rounded once: bit for bit."""
    rng = np.random.default_rng(3)
    num_tokens, top_k, num_experts, d = 16, 2, 4, 8
    x_TD = jnp.asarray(rng.normal(size=(num_tokens, d)), jnp.bfloat16)
    ids_TK = jnp.asarray(np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)]), jnp.int32)
    x_sorted_MD, _, info = permute(x_TD, ids_TK, num_experts)
    weights_TK = jnp.asarray(rng.uniform(0.1, 1.0, size=(num_tokens, top_k)), jnp.float32)
    g_TD = rng.normal(size=(num_tokens, d)).astype(np.float32)
    _, pullback = jax.vjp(lambda y: unpermute(y, info, weights_TK), x_sorted_MD)
    (got_MD,) = pullback(jnp.asarray(g_TD))
    assert got_MD.dtype == jnp.bfloat16
    g_rounded_TD = np.asarray(jnp.asarray(g_TD).astype(jnp.bfloat16).astype(jnp.float32))
    want_MD = np.zeros(got_MD.shape, np.float32)
    rows_TK = np.asarray(info.row_of_slot_TK)
    for t in range(num_tokens):
        for k in range(top_k):
            want_MD[rows_TK[t, k]] = np.asarray(weights_TK)[t, k] * g_rounded_TD[t]
    want_MD = np.asarray(jnp.asarray(want_MD).astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(got_MD), want_MD)
