"""The MoE layer against the per-token float64 reference: forward output, losses and gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from dropless.core.config import Config, MoEConfig
from dropless.moe import MoEError, init_moe, moe_layer
from dropless.moe.reference import reference_moe, reference_route

HIDDEN = 12
# Every router option, k = 1 and k = E, groups, bias, scaling, shared experts; all three losses weighted so
# their gradients are checked too. (name, config kwargs, bias kind)
CASES = [
    ("mixtral", dict(num_experts=4, num_experts_per_tok=2, score_func="softmax", num_shared_experts=0), None),
    ("qwen3_unnormalised", dict(num_experts=8, num_experts_per_tok=3, score_func="softmax", norm_topk_prob=False,
                                num_shared_experts=0), None),
    ("deepseek_v3", dict(num_experts=8, num_experts_per_tok=2, score_func="sigmoid", n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, num_shared_experts=1), "random"),
    # k = 1 unnormalised (so the weight carries the router gradient); the bias puts every token on expert 2,
    # leaving three experts empty.
    ("all_on_one_expert", dict(num_experts=4, num_experts_per_tok=1, score_func="sigmoid", norm_topk_prob=False,
                               num_shared_experts=0), "one_expert"),
    ("k_equals_e", dict(num_experts=4, num_experts_per_tok=4, score_func="softmax", num_shared_experts=1), None),
    ("groups_k3_two_shared", dict(num_experts=16, num_experts_per_tok=3, score_func="sigmoid", n_group=4,
                                  topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.5,
                                  num_shared_experts=2), "random"),
]
LOSS_WEIGHTS = dict(aux_loss_weight=0.3, seq_aux_loss_weight=0.2, z_loss_weight=0.05)


def _problem(name, kwargs, bias_kind, seed):
    rng = np.random.default_rng(seed)
    cfg = MoEConfig(expert_intermediate_size=int(rng.integers(3, 9)), gmm_backend="xla", **kwargs, **LOSS_WEIGHTS)
    batch, seq = int(rng.integers(1, 4)), int(rng.integers(2, 7))
    # Parameters in the init_moe layout, drawn with NumPy (jax's PRNG would cost a compilation per case).
    width, shared_width = cfg.expert_intermediate_size, cfg.num_shared_experts * cfg.expert_intermediate_size
    normal = lambda *shape: (0.5 * rng.normal(size=shape)).astype(np.float32)
    params = {"router": {"kernel": normal(HIDDEN, cfg.num_experts)},
              "experts": {"gate_up": normal(cfg.num_experts, HIDDEN, 2 * width),
                          "down": normal(cfg.num_experts, width, HIDDEN)}}
    if shared_width:
        params["shared"] = {"gate_up": normal(HIDDEN, 2 * shared_width), "down": normal(shared_width, HIDDEN)}
    # NumPy inputs: eager jax ops would each compile, which dominates a small test's run time.
    x_BSD = rng.normal(size=(batch, seq, HIDDEN)).astype(np.float32)
    bias_E = np.zeros(cfg.num_experts, np.float32)
    if bias_kind == "random":
        bias_E = rng.normal(scale=0.3, size=cfg.num_experts).astype(np.float32)
    elif bias_kind == "one_expert":
        bias_E[2] = 10.0
    cotangent_BSD = rng.normal(size=x_BSD.shape).astype(np.float32)
    return cfg, params, bias_E, x_BSD, cotangent_BSD


def _float64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


@pytest.mark.parametrize("name,kwargs,bias_kind", CASES, ids=[c[0] for c in CASES])
def test_layer_matches_reference_forward_and_gradients(name, kwargs, bias_kind):
    cfg, params, bias_E, x_BSD, cotangent_BSD = _problem(name, kwargs, bias_kind, seed=len(name))

    def objective(params, x_BSD, layer):
        y_BSD, losses = layer(params, x_BSD)
        return jnp.sum(y_BSD * cotangent_BSD) + losses["balance_loss"], (y_BSD, losses)

    def layer(params, x_BSD):
        y_BSD, stats = moe_layer(params, bias_E, x_BSD, cfg, compute_dtype=jnp.float32)
        return y_BSD, stats._asdict()

    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True),
                                     static_argnums=2)(params, x_BSD, layer)

    ids_TK = reference_route(x_BSD.reshape(-1, HIDDEN), params["router"]["kernel"], bias_E, cfg)
    np.testing.assert_array_equal(np.bincount(ids_TK.ravel(), minlength=cfg.num_experts), stats["tokens_per_expert"])
    with enable_x64():
        cotangent_BSD = np.asarray(cotangent_BSD, np.float64)
        reference = lambda p, x: reference_moe(p, x, ids_TK, cfg)
        (_, (y_ref, losses_ref)), grads_ref = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True),
                                                      static_argnums=2)(*_float64((params, x_BSD)), reference)

    assert _rel_err(y, y_ref) < 1e-5
    for key in ("aux_loss", "seq_aux_loss", "z_loss", "balance_loss"):
        assert _rel_err(stats[key], losses_ref[key]) < 1e-5, key
    flat, flat_ref = jax.tree.leaves_with_path(grads), jax.tree.leaves(grads_ref)
    assert len(flat) == len(flat_ref)
    for (path, g), g_ref in zip(flat, flat_ref):
        assert _rel_err(g, g_ref) < 2e-5, jax.tree_util.keystr(path)
    if bias_kind == "one_expert":
        assert int(stats["tokens_per_expert"][2]) == x_BSD.shape[0] * x_BSD.shape[1]
        assert float(stats["max_load_ratio"]) == pytest.approx(cfg.num_experts)


@pytest.mark.parametrize("case", [2, 0], ids=["sigmoid_groups", "softmax"])
def test_router_sees_its_input_without_the_common_direction(case):
    """moe.router_common_rate: with `router_common_D` the router ranks and weighs the experts on x - (x·ĉ)ĉ while
    the experts compute on x itself; forward, losses and gradients against the float64 reference that projects
    each token's router input. Inputs sharing one large direction (every token's input nearly the same vector)
    make the difference: without the projection they choose differently."""
    cfg, params, bias_E, x_BSD, cotangent_BSD = _problem(*CASES[case], seed=11)
    rng = np.random.default_rng(5)
    common_D = rng.normal(size=HIDDEN).astype(np.float32)
    x_BSD = (x_BSD + 4.0 * common_D / np.linalg.norm(common_D)).astype(np.float32)

    def objective(params, x_BSD, layer):
        y_BSD, losses = layer(params, x_BSD)
        return jnp.sum(y_BSD * cotangent_BSD) + losses["balance_loss"], (y_BSD, losses)

    def layer(params, x_BSD):
        y_BSD, stats = moe_layer(params, bias_E, x_BSD, cfg, compute_dtype=jnp.float32,
                                 router_common_D=jnp.asarray(3.0 * common_D))
        return y_BSD, stats._asdict()

    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True),
                                     static_argnums=2)(params, x_BSD, layer)
    x_TD = x_BSD.reshape(-1, HIDDEN)
    ids_TK = reference_route(x_TD, params["router"]["kernel"], bias_E, cfg, common_D)
    assert not np.array_equal(ids_TK, reference_route(x_TD, params["router"]["kernel"], bias_E, cfg))
    np.testing.assert_array_equal(np.bincount(ids_TK.ravel(), minlength=cfg.num_experts), stats["tokens_per_expert"])
    with enable_x64():
        cotangent_BSD = np.asarray(cotangent_BSD, np.float64)
        reference = lambda p, x: reference_moe(p, x, ids_TK, cfg, common_D=np.asarray(common_D, np.float64))
        (_, (y_ref, losses_ref)), grads_ref = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True),
                                                      static_argnums=2)(*_float64((params, x_BSD)), reference)
    assert _rel_err(y, y_ref) < 1e-5
    assert _rel_err(stats["balance_loss"], losses_ref["balance_loss"]) < 1e-5
    for (path, g), g_ref in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(grads_ref)):
        assert _rel_err(g, g_ref) < 2e-5, jax.tree_util.keystr(path)
    # A zero running mean (an imported model's, or before the first update) routes as without one.
    y_zero, stats_zero = jax.jit(lambda p, x: moe_layer(p, bias_E, x, cfg, compute_dtype=jnp.float32,
                                                        router_common_D=jnp.zeros(HIDDEN)))(params, x_BSD)
    y_none, stats_none = jax.jit(lambda p, x: moe_layer(p, bias_E, x, cfg, compute_dtype=jnp.float32))(params, x_BSD)
    np.testing.assert_array_equal(y_zero, y_none)
    np.testing.assert_array_equal(stats_zero.tokens_per_expert, stats_none.tokens_per_expert)


def test_training_takes_each_sequence_s_common_direction_from_the_other_sequences():
    """moe.router_common_source="other_sequences": in a training pass each sequence's router input loses the
    direction of the mean over the batch's other sequences (float64 reference, per token), forward and gradients;
    outside training, and with one sequence, the running mean serves as before."""
    cfg, params, bias_E, x_BSD, cotangent_BSD = _problem(*CASES[2], seed=13)
    cfg = dataclasses.replace(cfg, router_common_source="other_sequences", router_common_rate=0.3)
    rng = np.random.default_rng(8)
    x_BSD = rng.normal(size=(3, 5, HIDDEN)).astype(np.float32) + 3.0 * rng.normal(size=HIDDEN).astype(np.float32)
    cotangent_BSD = rng.normal(size=x_BSD.shape).astype(np.float32)
    running_D = rng.normal(size=HIDDEN).astype(np.float32)

    def objective(params, x_BSD, layer):
        y_BSD, losses = layer(params, x_BSD)
        return jnp.sum(y_BSD * cotangent_BSD) + losses["balance_loss"], (y_BSD, losses)

    def layer(params, x_BSD, training=True):
        y_BSD, stats = moe_layer(params, bias_E, x_BSD, cfg, compute_dtype=jnp.float32,
                                 router_common_D=jnp.asarray(running_D), training=training)
        return y_BSD, stats._asdict()

    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True),
                                     static_argnums=2)(params, x_BSD, layer)
    x64 = x_BSD.astype(np.float64)
    others_BD = np.stack([np.delete(x64, b, axis=0).reshape(-1, HIDDEN).mean(axis=0) for b in range(3)])
    common_TD = np.repeat(others_BD, 5, axis=0)
    x_TD = x_BSD.reshape(-1, HIDDEN)
    ids_TK = reference_route(x_TD, params["router"]["kernel"], bias_E, cfg, common_TD)
    ids_running_TK = reference_route(x_TD, params["router"]["kernel"], bias_E, cfg, running_D)
    assert np.any(np.bincount(ids_TK.ravel(), minlength=8) != np.bincount(ids_running_TK.ravel(), minlength=8))
    np.testing.assert_array_equal(np.bincount(ids_TK.ravel(), minlength=cfg.num_experts), stats["tokens_per_expert"])
    with enable_x64():
        reference = lambda p, x: reference_moe(p, x, ids_TK, cfg, common_D=common_TD)
        cotangent_BSD = np.asarray(cotangent_BSD, np.float64)
        (_, (y_ref, _)), grads_ref = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True),
                                             static_argnums=2)(*_float64((params, x_BSD)), reference)
    assert _rel_err(y, y_ref) < 1e-5
    for (path, g), g_ref in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(grads_ref)):
        assert _rel_err(g, g_ref) < 2e-5, jax.tree_util.keystr(path)
    # Evaluation and inference (training=False), and a single sequence, route with the running mean.
    for x, training in ((x_BSD, False), (x_BSD[:1], True)):
        _, stats_running = jax.jit(lambda p, x: layer(p, x, training))(params, x)
        ids_running = reference_route(x.reshape(-1, HIDDEN), params["router"]["kernel"], bias_E, cfg, running_D)
        np.testing.assert_array_equal(np.bincount(ids_running.ravel(), minlength=cfg.num_experts),
                                      stats_running["tokens_per_expert"])
    # moe.router_common_other_steps: a training step past them (`other_sequences` false) routes on the running
    # mean as evaluation does; one within them as above, bit for bit.
    switched = jax.jit(lambda p, x, flag: moe_layer(p, bias_E, x, cfg, compute_dtype=jnp.float32,
                                                    router_common_D=jnp.asarray(running_D), training=True,
                                                    other_sequences=flag))
    y_on, stats_on = switched(params, x_BSD, jnp.asarray(True))
    np.testing.assert_array_equal(y_on, y)
    y_off, stats_off = switched(params, x_BSD, jnp.asarray(False))
    y_eval, stats_eval = jax.jit(lambda p, x: layer(p, x, False))(params, x_BSD)
    np.testing.assert_array_equal(stats_off.tokens_per_expert, stats_eval["tokens_per_expert"])
    assert _rel_err(y_off, y_eval) < 1e-5 and _rel_err(y_off, y) > 1e-3


def test_a_single_training_sequence_routes_on_the_running_mean_as_evaluation_does():
    """moe.router_common_source="other_sequences" with one sequence: there are no other sequences, so a training
    pass removes the running mean's direction exactly as evaluation does (not no direction at all)."""
    cfg, params, bias_E, _, _ = _problem(*CASES[2], seed=13)
    cfg = dataclasses.replace(cfg, router_common_source="other_sequences", router_common_rate=0.3)
    rng = np.random.default_rng(9)
    running_D = rng.normal(size=HIDDEN).astype(np.float32)
    x_BSD = (rng.normal(size=(1, 6, HIDDEN)) + 3.0 * running_D).astype(np.float32)
    layer = jax.jit(lambda x, training: moe_layer(params, bias_E, x, cfg, compute_dtype=jnp.float32,
                                                  router_common_D=jnp.asarray(running_D), training=training)[0],
                    static_argnums=1)
    y_eval = np.asarray(layer(x_BSD, False))
    np.testing.assert_allclose(np.asarray(layer(x_BSD, True)), y_eval, rtol=1e-6, atol=1e-6)
    without = np.asarray(jax.jit(lambda x: moe_layer(params, bias_E, x, cfg, compute_dtype=jnp.float32)[0])(x_BSD))
    assert _rel_err(without, y_eval) > 1e-3  # the running mean's direction matters for these inputs


def test_bfloat16_compute_stays_close_to_reference():
    cfg, params, bias_E, x_BSD, _ = _problem(*CASES[2], seed=7)
    y, stats = jax.jit(lambda p, x: moe_layer(p, bias_E, x, cfg, compute_dtype=jnp.bfloat16))(params, x_BSD)
    assert y.dtype == jnp.bfloat16 and stats.aux_loss.dtype == jnp.float32
    ids_TK = reference_route(x_BSD.reshape(-1, HIDDEN), params["router"]["kernel"], bias_E, cfg)
    with enable_x64():
        y_ref, _ = jax.jit(lambda p, x: reference_moe(p, x, ids_TK, cfg))(*_float64((params, x_BSD)))
    assert _rel_err(y, y_ref) < 2e-2


def test_init_layout_and_dtypes():
    cfg = MoEConfig(num_experts=6, num_experts_per_tok=2, expert_intermediate_size=5, num_shared_experts=2)
    params = init_moe(jax.random.key(0), 7, cfg, init_std=0.02)
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    assert shapes == {"router": {"kernel": ((7, 6), jnp.float32)},
                      "experts": {"gate_up": ((6, 7, 10), jnp.float32), "down": ((6, 5, 7), jnp.float32)},
                      "shared": {"gate_up": ((7, 20), jnp.float32), "down": ((10, 7), jnp.float32)}}
    assert abs(float(np.std(params["experts"]["gate_up"])) - 0.02) < 0.005
    assert "shared" not in init_moe(jax.random.key(0), 7, dataclasses.replace(cfg, num_shared_experts=0), 0.02)


def test_shape_mismatches_raise_one_clear_error():
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, expert_intermediate_size=4, num_shared_experts=1)
    params = init_moe(jax.random.key(0), 8, cfg, 0.1)
    x_BSD, bias_E = np.ones((1, 2, 8), np.float32), np.zeros(4, np.float32)
    call = lambda p=params, b=bias_E, x=x_BSD, c=cfg: moe_layer(p, b, x, c, compute_dtype=jnp.float32)
    with pytest.raises(MoEError, match=r"router'\]\['kernel'\] has shape \(8, 4\) but .* expects \(6, 4\)"):
        call(x=np.ones((1, 2, 6), np.float32))
    with pytest.raises(MoEError, match="x_BSD must be"):
        call(x=np.ones((2, 8), np.float32))
    with pytest.raises(MoEError, match="router_bias_E"):
        call(b=np.zeros(5, np.float32))
    with pytest.raises(MoEError, match=r"router_common_D has shape \(6,\) but .* expects \(8,\)"):
        moe_layer(params, bias_E, x_BSD, cfg, compute_dtype=jnp.float32, router_common_D=np.zeros(6, np.float32))
    with pytest.raises(MoEError, match="experts'\\]\\['gate_up'\\]"):
        call(c=dataclasses.replace(cfg, expert_intermediate_size=3))
    with pytest.raises(MoEError, match="lack a 'shared' entry"):
        call(p={k: v for k, v in params.items() if k != "shared"})
    with pytest.raises(MoEError, match=r"expects \(8, 8\)"):
        call(c=dataclasses.replace(cfg, num_experts=8))
    with pytest.raises(MoEError, match=r"^moe_cfg is the whole Config; .* pass config.moe.$"):
        call(c=Config(moe=cfg))


@pytest.mark.parametrize("rows", [None, 24, 32, 200])
def test_local_executor_reports_the_pairs_its_capacity_gemm_drops(rows):
    """LocalExecutor counts dropped pairs for the rows the grouped GEMM gets (at most T*K, whatever `rows` asks):
    the same count as the capacity GEMM's own on the permuted rows, none left out of the output silently."""
    from dropless.gmm.capacity import CapacityGmm
    from dropless.moe import LocalExecutor
    from dropless.moe.permute import permute

    rng = np.random.default_rng(0)
    num_tokens, top_k, num_experts, hidden, width = 16, 2, 4, 6, 5
    ids_TK = jnp.asarray(np.stack([rng.choice(num_experts, top_k, replace=False, p=[0.7, 0.1, 0.1, 0.1])
                                   for _ in range(num_tokens)]), jnp.int32)
    experts = {"gate_up": jnp.asarray(rng.normal(size=(num_experts, hidden, 2 * width)), jnp.float32),
               "down": jnp.asarray(rng.normal(size=(num_experts, width, hidden)), jnp.float32)}
    x_TD = jnp.asarray(rng.normal(size=(num_tokens, hidden)), jnp.float32)
    gmm = CapacityGmm(capacity_factor=1.0)
    _, stats = jax.jit(LocalExecutor(gmm, rows))(x_TD, ids_TK, jnp.ones((num_tokens, top_k)), experts)  # one program
    x_sorted_MD, group_sizes_E, _ = jax.jit(permute, static_argnums=(2, 3))(x_TD, ids_TK, num_experts, rows)
    want = gmm.dropped_rows(group_sizes_E, x_sorted_MD.shape[0])
    assert int(want) > 0 and int(stats.tokens_dropped) == int(want)
