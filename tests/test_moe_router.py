"""Router: group-limited selection vs brute force, bias for selection only, config errors, bias balancing."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.config import ConfigError, MoEConfig, ParallelConfig
from dropless.core.mesh import make_mesh
from dropless.moe import route, update_router_bias
from dropless.moe.balance import (common_alignment, input_moments, max_load_ratio, tokens_per_expert,
                                  update_router_common)
from dropless.moe.reference import reference_route
from dropless.moe.router import fold_common, other_sequences_mean, select_experts


def _brute_force_groups(choice_E, top_k, n_group, topk_group):
    """Try every set of topk_group groups; keep the one with the largest total group score (sum of top-2)."""
    per_group = len(choice_E) // n_group
    group_score = [np.sort(choice_E[g * per_group:(g + 1) * per_group])[-2:].sum() for g in range(n_group)]
    best = max(itertools.combinations(range(n_group), topk_group), key=lambda gs: sum(group_score[g] for g in gs))
    allowed = [e for e in range(len(choice_E)) if e // per_group in best]
    return set(sorted(allowed, key=lambda e: -choice_E[e])[:top_k])


@pytest.mark.parametrize("num_experts,top_k,n_group,topk_group", [(8, 3, 4, 2), (12, 4, 3, 2), (8, 2, 2, 1)])
def test_group_limited_selection_matches_brute_force(num_experts, top_k, n_group, topk_group):
    rng = np.random.default_rng(num_experts)
    # Biased sigmoid-like scores, some negative: the masked experts must not win with a fill of 0.
    choice_TE = rng.uniform(-0.6, 1.0, size=(64, num_experts)).astype(np.float32)
    ids_TK = np.asarray(jax.jit(select_experts, static_argnums=(1, 2, 3))(
        jnp.asarray(choice_TE), top_k, n_group, topk_group))
    for t in range(len(choice_TE)):
        assert set(ids_TK[t]) == _brute_force_groups(choice_TE[t], top_k, n_group, topk_group)
        assert list(np.argsort(-choice_TE[t][ids_TK[t]], kind="stable")) == list(range(top_k))  # best first


@pytest.mark.parametrize("score_func,n_group,bias", [
    ("softmax", 1, None),
    # Every group ties (each holds a 0.5 and a 0 bias), and so do the experts within the kept groups.
    ("sigmoid", 4, [0.0, 0.5, 0.5, 0.0, 0.5, 0.0, 0.0, 0.5]),
])
def test_tied_scores_go_to_the_lower_expert_and_group(score_func, n_group, bias):
    """A zero router input scores every expert alike (so do saturated or rounded scores): the choice is then the
    lower id, of experts and of groups, as in the reference (and PyTorch's stable top-k), not any of the tied."""
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=3, score_func=score_func, n_group=n_group,
                    topk_group=2 if n_group > 1 else 1)
    rng = np.random.default_rng(5)
    x_TD = rng.normal(size=(16, 6)).astype(np.float32)
    x_TD[::2] = 0.0  # every other token: all logits 0
    kernel_DE = rng.normal(size=(6, 8)).astype(np.float32)
    bias_E = None if bias is None else np.asarray(bias, np.float32)
    routing = jax.jit(route, static_argnums=3)(kernel_DE, bias_E, x_TD, cfg)
    want_TK = reference_route(x_TD, kernel_DE, bias_E, cfg)
    np.testing.assert_array_equal(routing.expert_ids_TK, want_TK)
    np.testing.assert_array_equal(want_TK[0], [0, 1, 2] if bias is None else [1, 2, 0])


def test_bias_changes_selection_but_not_weights():
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, score_func="sigmoid", n_group=4, topk_group=2,
                    norm_topk_prob=False, routed_scaling_factor=2.0)
    rng = np.random.default_rng(0)
    x_TD = jnp.asarray(rng.normal(size=(32, 6)), jnp.float32)
    kernel_DE = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32)
    bias_E = jnp.asarray(rng.normal(scale=0.5, size=8), jnp.float32)
    routing = jax.jit(route, static_argnums=3)(kernel_DE, bias_E, x_TD, cfg)
    np.testing.assert_array_equal(routing.expert_ids_TK, reference_route(x_TD, kernel_DE, bias_E, cfg))
    assert not np.array_equal(routing.expert_ids_TK, reference_route(x_TD, kernel_DE, None, cfg))
    scores_TE = jax.nn.sigmoid(x_TD @ kernel_DE)  # weights are the UNBIASED scores, scaled
    np.testing.assert_allclose(routing.weights_TK,
                               2.0 * np.take_along_axis(np.asarray(scores_TE), routing.expert_ids_TK, 1), rtol=1e-5)
    bias_grad = jax.grad(lambda b: jnp.sum(route(kernel_DE, b, x_TD, cfg).weights_TK))(bias_E)
    assert np.all(np.asarray(bias_grad) == 0)


def test_a_token_whose_sigmoid_scores_all_underflow_gets_zero_weights_and_probabilities():
    """Sigmoid scores of very negative logits are exactly 0 in float32: such a token's renormalised combine weights
    and its balancing probabilities are 0 (the +1e-20 of HF's DeepSeek-V3), never 0 / 0; any other token's weights
    still sum to routed_scaling_factor and its probabilities to 1."""
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, score_func="sigmoid", n_group=4, topk_group=2,
                    norm_topk_prob=True, routed_scaling_factor=2.5)
    x_TD = np.stack([np.full(8, -200.0), np.linspace(-1.0, 2.0, 8)]).astype(np.float32)
    routing = jax.jit(route, static_argnums=3)(jnp.eye(8), None, jnp.asarray(x_TD), cfg)
    np.testing.assert_array_equal(routing.weights_TK[0], 0.0)
    np.testing.assert_array_equal(routing.probs_TE[0], 0.0)
    np.testing.assert_array_equal(routing.expert_ids_TK[1], [7, 6])
    scores_E = 1 / (1 + np.exp(-x_TD[1].astype(np.float64)))
    np.testing.assert_allclose(routing.weights_TK[1], 2.5 * scores_E[[7, 6]] / scores_E[[7, 6]].sum(), rtol=1e-6)
    np.testing.assert_allclose(routing.probs_TE[1], scores_E / scores_E.sum(), rtol=1e-6)


def test_softmax_router_follows_mixtral_and_qwen3():
    """Softmax over all experts, top-k, then renormalise (Mixtral, Qwen3 norm_topk_prob=True) or not."""
    rng = np.random.default_rng(1)
    logits_TE = rng.normal(size=(5, 6))
    x_TD, kernel_DE = jnp.asarray(logits_TE, jnp.float32), jnp.eye(6)
    probs_TE = np.exp(logits_TE) / np.exp(logits_TE).sum(-1, keepdims=True)
    top_TK = np.sort(probs_TE, axis=-1)[:, ::-1][:, :2]
    for norm in (True, False):
        cfg = MoEConfig(num_experts=6, num_experts_per_tok=2, score_func="softmax", norm_topk_prob=norm)
        routing = route(kernel_DE, None, x_TD, cfg)
        want = top_TK / top_TK.sum(-1, keepdims=True) if norm else top_TK
        np.testing.assert_allclose(routing.weights_TK, want, rtol=1e-5)
        np.testing.assert_array_equal(routing.expert_ids_TK, np.argsort(-probs_TE, axis=-1)[:, :2])


@pytest.mark.parametrize("overrides,message", [
    (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5 must be between 1 and moe.num_experts=4"),
    (dict(num_experts=8, n_group=3), "n_group=3 must divide moe.num_experts=8"),
    (dict(num_experts=8, n_group=4, topk_group=5), "topk_group=5 must be between 1 and moe.n_group=4"),
    (dict(num_experts=8, num_experts_per_tok=6, n_group=4, topk_group=2), "raise moe.topk_group"),
    (dict(router_common_rate=1.5), r"router_common_rate=1.5 must be in \[0, 1\]"),
    (dict(router_common_rate=-0.1), r"router_common_rate=-0.1 must be in \[0, 1\]"),
    (dict(router_common_source="other_sequences"), r"needs moe.router_common_rate > 0"),
    (dict(router_common_rate=0.3, router_common_other_steps=100), r"> 0 only with moe.router_common_source=other"),
    (dict(router_common_rate=0.3, router_common_source="other_sequences", router_common_other_steps=-1),
     r"router_common_other_steps=-1 counts the training steps"),
])
def test_bad_router_configs_raise_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        MoEConfig(**overrides)


def test_max_load_ratio_counts_against_the_mean_load():
    # 1 is balance, E/K every pair on the same K experts; a step with fewer pairs than experts (mean load below 1)
    # is measured the same way.
    assert float(max_load_ratio(jnp.array([3, 3, 3, 3]))) == 1.0
    assert float(max_load_ratio(jnp.array([8, 8, 0, 0, 0, 0, 0, 0]))) == 4.0
    assert float(max_load_ratio(jnp.array([1, 0, 0, 0]))) == 4.0
    assert float(max_load_ratio(jnp.zeros(4, jnp.int32))) == 0.0  # no pairs: no load, no NaN


def test_update_router_bias_sign_rule_on_any_leading_axes():
    load_LE = jnp.array([[4, 0, 2, 2], [1, 1, 1, 1]])
    bias_LE = update_router_bias(jnp.zeros((2, 4)), load_LE, 0.1)
    np.testing.assert_allclose(bias_LE, [[-0.1, 0.1, 0.0, 0.0], [0, 0, 0, 0]])


def test_update_router_bias_proportional_rule_is_the_sign_rule_far_from_balance_and_smaller_near_it():
    # mean load 2: expert 0 at 4x the mean and expert 1 empty take the sign rule's full step; experts 2 and 3,
    # 10% off the mean, a tenth of it; an all-empty row (mean 0) does not move.
    load_LE = jnp.array([[8.0, 0.0, 2.2, 1.8, 0.0, 2.0, 2.0, 0.0], [0, 0, 0, 0, 0, 0, 0, 0]])
    mean = 2.0
    assert float(jnp.mean(load_LE[0])) == mean
    bias_LE = update_router_bias(jnp.full((2, 8), 0.5), load_LE, 0.1, rule="proportional")
    np.testing.assert_allclose(bias_LE[0], [0.4, 0.6, 0.49, 0.51, 0.6, 0.5, 0.5, 0.6], rtol=1e-6)
    np.testing.assert_array_equal(bias_LE[1], jnp.full(8, 0.5))
    sign_LE = update_router_bias(jnp.full((2, 8), 0.5), load_LE, 0.1)
    np.testing.assert_allclose(sign_LE[0], [0.4, 0.6, 0.4, 0.6, 0.6, 0.5, 0.5, 0.6], rtol=1e-6)


def _bias_update_reference(bias, load, rate, rule):
    """The aux-loss-free rule in float64, one router row and one expert at a time."""
    out = np.array(bias, np.float64)
    for row in np.ndindex(*load.shape[:-1]):
        mean = load[row].mean()
        for e, load_e in enumerate(load[row]):
            if rule == "sign":
                step = np.sign(mean - load_e)
            else:  # an empty row (mean 0) does not move
                step = 0.0 if mean == 0 else min(max((mean - load_e) / mean, -1.0), 1.0)
            out[row + (e,)] += rate * step
    return out


@pytest.mark.parametrize("rule", ["sign", "proportional"])
def test_update_router_bias_matches_a_per_expert_loop(rule):
    """Random loads on [2, 3, E] router rows: mean loads below one assignment per expert, near balance and large,
    a row that routed nothing and a row where one expert took every assignment."""
    rng = np.random.default_rng(3)
    load = rng.poisson(np.asarray([[0.3, 2.0, 50.0], [0.6, 4.0, 1.0]])[..., None], size=(2, 3, 16))
    load[0, 0] = 0
    load[1, 2] = 0
    load[1, 2, 5] = 3
    bias = rng.normal(0, 0.1, size=(2, 3, 16)).astype(np.float32)
    got = update_router_bias(jnp.asarray(bias), jnp.asarray(load, jnp.int32), 0.01, rule)
    np.testing.assert_allclose(np.asarray(got), _bias_update_reference(bias, load, 0.01, rule), rtol=0, atol=1e-7)


@pytest.mark.parametrize("rule", ["sign", "proportional"])
def test_bias_update_drives_a_skewed_router_toward_balance(rule):
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, score_func="sigmoid", n_group=4, topk_group=2)
    rng = np.random.default_rng(2)
    # Diverse tokens plus one constant feature that the kernel maps to a strong preference for experts 0, 1.
    x_TD = jnp.asarray(rng.normal(size=(512, 16)), jnp.float32).at[:, 0].set(1.0)
    kernel_DE = jnp.asarray(rng.normal(scale=0.5, size=(16, 8)), jnp.float32).at[0, :2].add(3.0)

    def step(bias_E, _):
        counts_E = tokens_per_expert(route(kernel_DE, bias_E, x_TD, cfg).expert_ids_TK, 8)
        return update_router_bias(bias_E, counts_E, 0.01, rule), max_load_ratio(counts_E)

    _, ratios = jax.jit(lambda b: jax.lax.scan(step, b, length=300))(jnp.zeros(8))
    assert float(ratios[0]) > 2.5  # most tokens pick experts 0 and 1 (the worst is E/K = 4)
    assert float(jnp.max(ratios[-50:])) < 1.15


def test_fold_common_removes_one_direction_from_the_router_input():
    """x·fold(W, c) = (x - (x·ĉ)ĉ)·W against float64, in NumPy (export) and jax (training) alike; the scale of c
    does not matter, and zero leaves W exactly."""
    rng = np.random.default_rng(4)
    kernel_DE, common_D = rng.normal(size=(24, 6)).astype(np.float32), rng.normal(size=24).astype(np.float32)
    x_TD = rng.normal(size=(10, 24))
    unit = common_D.astype(np.float64) / np.linalg.norm(common_D.astype(np.float64))
    want = (x_TD - np.outer(x_TD @ unit, unit)) @ kernel_DE.astype(np.float64)
    folded = fold_common(kernel_DE, common_D)
    assert folded.dtype == np.float32 and isinstance(folded, np.ndarray)
    np.testing.assert_allclose(x_TD @ folded, want, rtol=0, atol=2e-5 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(fold_common(jnp.asarray(kernel_DE), jnp.asarray(common_D))), folded,
                               atol=2e-6)
    np.testing.assert_allclose(fold_common(kernel_DE, 1e3 * common_D), folded, atol=2e-6)
    np.testing.assert_array_equal(fold_common(kernel_DE, np.zeros(24, np.float32)), kernel_DE)
    np.testing.assert_allclose(unit @ folded, 0.0, atol=1e-5)  # the common direction no longer moves the logits


def test_update_router_common_is_a_running_mean_of_the_input():
    rng = np.random.default_rng(6)
    x_TD = rng.normal(size=(40, 5)).astype(np.float32)
    moments = input_moments(jnp.asarray(x_TD))
    common = jnp.asarray(rng.normal(size=5), jnp.float32)
    got = update_router_common(common, moments, jnp.int32(40), 0.25)
    np.testing.assert_allclose(got, 0.75 * np.asarray(common) + 0.25 * x_TD.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(update_router_common(common, moments * 0, jnp.int32(0), 0.25), common)
    cosine = float(np.dot(x_TD.mean(0), common) / np.linalg.norm(x_TD.mean(0)) / np.linalg.norm(common))
    np.testing.assert_allclose(common_alignment(common, moments, jnp.int32(40)), abs(cosine), rtol=1e-5)
    np.testing.assert_allclose(common_alignment(-common, moments, jnp.int32(40)), abs(cosine), rtol=1e-5)
    assert float(common_alignment(0 * common, moments, jnp.int32(40))) == 0.0
    stacked = update_router_common(jnp.stack([common, 2 * common]), jnp.stack([moments, moments]),
                                   jnp.array([40, 40]), 0.25)  # any leading axes: one row per router
    np.testing.assert_allclose(stacked[0], got, rtol=1e-6)


def test_running_mean_projection_unsticks_a_router_whose_tokens_share_one_large_direction():
    """Every token's input is one large common vector plus its own small part, so every token ranks the experts
    alike. Removing the running mean's direction (moe.router_common_rate, no bias at all)
    balances the load from the first update on; without it the router stays collapsed."""
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, score_func="sigmoid", n_group=4, topk_group=2)
    rng = np.random.default_rng(2)
    common = rng.normal(size=16)
    x_TD = jnp.asarray(rng.normal(size=(512, 16)) + 8.0 * common / np.linalg.norm(common), jnp.float32)
    kernel_DE = jnp.asarray(rng.normal(scale=0.5, size=(16, 8)), jnp.float32)

    def ratios(rate):
        def step(common_D, _):
            counts_E = tokens_per_expert(route(fold_common(kernel_DE, common_D), None, x_TD, cfg).expert_ids_TK, 8)
            return update_router_common(common_D, input_moments(x_TD), jnp.int32(512), rate), max_load_ratio(counts_E)
        return np.asarray(jax.jit(lambda c: jax.lax.scan(step, c, length=20))(jnp.zeros(16))[1])

    without, with_common = ratios(0.0), ratios(0.3)
    assert without.min() >= 2.5  # the most chosen expert takes three quarters of the tokens, every step
    assert with_common[0] == without[0] and np.all(with_common[1:] <= 1.3)


def test_routing_on_a_mesh_selects_per_device_without_collectives():
    """With tokens split over devices, each device selects experts for its own tokens: XLA's partitioner gathered
    the group-limited top-k's group scores of all tokens onto every device (a blocking all-gather per layer, seen
    in two-H200 traces). Same choices as unsharded; the optimised program has no collective."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dropless.core.config import ParallelConfig
    from dropless.core.mesh import BATCH_AXES, make_mesh

    cfg = MoEConfig(num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, score_func="sigmoid")
    k_kernel, k_x = jax.random.split(jax.random.key(5))
    kernel_DE = jax.random.normal(k_kernel, (32, 16), jnp.float32)
    x_TD = jax.random.normal(k_x, (64, 32), jnp.float32)
    mesh = make_mesh(ParallelConfig(data=2, expert=4), jax.devices()[:8], num_experts=16)
    tokens = NamedSharding(mesh, P(BATCH_AXES))
    run = jax.jit(lambda k, x: route(k, None, x, cfg, mesh=mesh).expert_ids_TK,
                  in_shardings=(NamedSharding(mesh, P()), tokens), out_shardings=tokens)
    compiled = run.lower(kernel_DE, jax.device_put(x_TD, tokens)).compile()
    assert not any(op in compiled.as_text() for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"))
    want = route(kernel_DE, None, x_TD, cfg).expert_ids_TK
    np.testing.assert_array_equal(compiled(kernel_DE, jax.device_put(x_TD, tokens)), want)


def test_routing_on_a_mesh_whose_devices_do_not_split_the_tokens_selects_on_all_of_them():
    """Tokens that the mesh's devices cannot split evenly (the executor reports that, not the router): the
    selection runs unsplit, the same choices as without a mesh."""
    cfg = MoEConfig(num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, score_func="sigmoid")
    k_kernel, k_x = jax.random.split(jax.random.key(6))
    kernel_DE = jax.random.normal(k_kernel, (32, 16), jnp.float32)
    x_TD = jax.random.normal(k_x, (12, 32), jnp.float32)
    mesh = make_mesh(ParallelConfig(data=2, expert=4), jax.devices()[:8], num_experts=16)
    got = jax.jit(lambda k, x: route(k, None, x, cfg, mesh=mesh).expert_ids_TK)(kernel_DE, x_TD)
    np.testing.assert_array_equal(got, route(kernel_DE, None, x_TD, cfg).expert_ids_TK)


def test_other_sequences_mean_is_the_mean_over_the_other_sequences_tokens():
    x_BSD = np.random.default_rng(9).normal(size=(3, 4, 5)).astype(np.float32)
    x64 = x_BSD.astype(np.float64)
    want_BD = np.stack([np.delete(x64, b, axis=0).reshape(-1, 5).mean(axis=0) for b in range(3)])
    got_BD = jax.jit(other_sequences_mean)(jnp.asarray(x_BSD))
    assert got_BD.dtype == jnp.float32
    np.testing.assert_allclose(got_BD, want_BD, rtol=0, atol=1e-6)
