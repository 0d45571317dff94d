"""The optimizer: its schedule, weight decay on matrices only, global-norm clipping, and train.router_lr_scale
scaling exactly the routers' updates and nothing else."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core import config as config_lib
from dropless.train.optimizer import learning_rate_schedule, make_optimizer, router_mask


def _params():
    k = iter(jax.random.split(jax.random.key(0), 4))
    return {"layers": {"moe": {"router": {"kernel": jax.random.normal(next(k), (16, 4))},
                               "experts": {"w_down": jax.random.normal(next(k), (4, 8, 16))}},
                       "attn_norm": jax.random.normal(next(k), (16,))},
            "embed": jax.random.normal(next(k), (32, 16))}


def _updates(scale, steps=3):
    train = config_lib.TrainConfig(router_lr_scale=scale, learning_rate=1e-2, warmup_steps=0, steps=10)
    opt = make_optimizer(train)
    params = _params()
    state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.cos(p) + 0.5, params)  # the same gradients each step
    update = jax.jit(opt.update)  # one program, not one compilation per operation and leaf
    out = []
    for _ in range(steps):
        updates, state = update(grads, state, params)
        out.append(updates)
    return out, state


def test_schedule_warms_up_linearly_then_decays_by_a_cosine_to_min_lr_ratio():
    train = config_lib.TrainConfig(learning_rate=2e-3, min_lr_ratio=0.1, warmup_steps=4, steps=20)
    schedule = learning_rate_schedule(train)
    peak, end = 2e-3, 2e-4

    def reference(n):
        if n < 4:
            return peak * n / 4
        return end + (peak - end) * 0.5 * (1 + np.cos(np.pi * min(n - 4, 16) / 16))

    for n in range(24):  # constant at the end value after the horizon
        assert float(schedule(n)) == pytest.approx(reference(n), rel=1e-5, abs=1e-9), n
    assert float(schedule(20)) == pytest.approx(end) and float(schedule(12)) == pytest.approx((peak + end) / 2)


@pytest.mark.parametrize("shape", ["cosine", "linear", "1-sqrt"])
@pytest.mark.parametrize("warmup", [0, 4])
def test_warmup_stable_decay_holds_the_peak_then_decays_over_the_last_steps(shape, warmup):
    """train.decay_steps=6 of a 20-step horizon: the peak from the warm-up's end to step 14, then the shape's
    decay to min_lr_ratio at step 20, constant after it (reference: the formulas, in float64)."""
    train = config_lib.TrainConfig(learning_rate=2e-3, min_lr_ratio=0.1, warmup_steps=warmup, steps=20,
                                   decay_steps=6, decay_shape=shape)
    schedule = learning_rate_schedule(train)
    peak, end = 2e-3, 2e-4
    fraction = {"cosine": lambda x: 0.5 * (1 + np.cos(np.pi * x)), "linear": lambda x: 1 - x,
                "1-sqrt": lambda x: 1 - np.sqrt(x)}[shape]

    def reference(n):
        if n < warmup:
            return peak * n / warmup
        return end + (peak - end) * fraction(min(max(n - 14, 0), 6) / 6)

    for n in range(24):
        assert float(schedule(n)) == pytest.approx(reference(n), rel=1e-5, abs=1e-9), n
    assert float(schedule(14)) == pytest.approx(peak) and float(schedule(20)) == pytest.approx(end)
    # A later horizon (a resumed run given train.schedule_steps=40) leaves the steps before the decay as they were.
    later = learning_rate_schedule(dataclasses.replace(train, schedule_steps=40))
    assert [float(later(n)) for n in range(14)] == [float(schedule(n)) for n in range(14)]
    assert float(later(33)) == pytest.approx(peak) and float(later(40)) == pytest.approx(end)


def test_a_whole_run_decay_of_another_shape_starts_at_the_warm_up_s_end():
    train = config_lib.TrainConfig(learning_rate=1e-3, min_lr_ratio=0.0, warmup_steps=2, steps=10, decay_shape="linear")
    assert [round(float(learning_rate_schedule(train)(n)) * 1e4, 6) for n in range(11)] == \
        [0.0, 5.0, 10.0, 8.75, 7.5, 6.25, 5.0, 3.75, 2.5, 1.25, 0.0]


def test_a_decay_longer_than_the_steps_after_the_warm_up_is_refused():
    with pytest.raises(config_lib.ConfigError, match=r"^train.decay_steps=17 does not fit between the warm-up's end "
                                                     r"\(train.warmup_steps=4, .* horizon \(step 20: .* at most 16, "):
        config_lib.TrainConfig(warmup_steps=4, steps=20, decay_steps=17)
    config_lib.TrainConfig(warmup_steps=4, steps=20, decay_steps=16)
    config_lib.TrainConfig(warmup_steps=4, steps=20, schedule_steps=40, decay_steps=30)


def test_a_warm_up_longer_than_the_run_reaches_the_peak_at_the_last_step():
    schedule = learning_rate_schedule(config_lib.TrainConfig(learning_rate=1e-2, warmup_steps=10, steps=5))
    assert float(schedule(4)) == pytest.approx(1e-2)
    assert float(schedule(3)) == pytest.approx(0.75e-2)


def test_weight_decay_shrinks_the_matrices_and_leaves_norms_and_biases():
    """With zero gradients AdamW's update is its weight decay alone: -lr * weight_decay * p on every matrix
    (stacked or not, the embedding and the router included), nothing on a norm or a bias."""
    train = config_lib.TrainConfig(learning_rate=1e-2, warmup_steps=0, steps=10, weight_decay=0.1)
    params = {**_params(), "final_norm": jnp.ones(16), "out_bias": jnp.ones(16)}
    opt = make_optimizer(train)
    updates, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
    lr = float(learning_rate_schedule(train)(0))
    assert lr > 0
    for (path, u), p in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(params)):
        name = jax.tree_util.keystr(path)
        if name.endswith("norm']") or name.endswith("bias']"):
            np.testing.assert_array_equal(np.asarray(u), 0.0, err_msg=name)
        else:
            np.testing.assert_allclose(np.asarray(u), -lr * 0.1 * np.asarray(p), rtol=1e-6, err_msg=name)


def test_clipping_gives_adamw_the_gradients_scaled_to_the_clip_norm():
    """train.grad_clip: a step whose gradients' global norm exceeds it updates as the same gradients scaled down to
    that norm would; a step below it is left alone. (AdamW divides by the gradients' own scale, so one step alone
    could not tell: the first step's large gradients then weigh less against the second's small ones.)"""
    params = _params()
    base = jax.tree.map(lambda p: jnp.cos(p) + 0.5, params)
    grads = [jax.tree.map(lambda g: 40.0 * g, base), jax.tree.map(lambda g: -0.01 * g, base)]
    norms = [float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(g))))
             for g in grads]  # the global norm, computed here rather than by the library under test
    assert norms[0] > 1.0 > norms[1]
    scaled = [jax.tree.map(lambda g, n=n: g * min(1.0, 1.0 / n), g) for g, n in zip(grads, norms)]

    def last_update(clip, gradients):
        opt = make_optimizer(config_lib.TrainConfig(learning_rate=1e-2, warmup_steps=0, steps=10, grad_clip=clip))
        state = opt.init(params)
        for g in gradients:
            updates, state = opt.update(g, state, params)
        return updates

    got, want = last_update(1.0, grads), last_update(0.0, scaled)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-9)
    unclipped = last_update(0.0, grads)
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(unclipped), jax.tree.leaves(want))) > 1e-4


def test_router_updates_scaled_others_unchanged():
    base, _ = _updates(1.0)
    scaled, _ = _updates(0.25)
    for u0, u1 in zip(base, scaled):
        r0, r1 = u0["layers"]["moe"]["router"]["kernel"], u1["layers"]["moe"]["router"]["kernel"]
        assert float(jnp.abs(r0).max()) > 0
        np.testing.assert_allclose(np.asarray(r1), 0.25 * np.asarray(r0), rtol=1e-6)
        for path in (("layers", "moe", "experts", "w_down"), ("layers", "attn_norm"), ("embed",)):
            a, b = u0, u1
            for key in path:
                a, b = a[key], b[key]
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_router_mask_finds_only_routers():
    mask = router_mask(_params())
    assert jax.tree.leaves(mask).count(True) == 1 and mask["layers"]["moe"]["router"]["kernel"]


def test_scale_one_keeps_the_state_layout():
    """Without a scale the optimizer state is AdamW's own, so checkpoints of such runs keep their layout."""
    _, plain = _updates(1.0, steps=1)
    _, scaled = _updates(0.5, steps=1)
    assert len(jax.tree.leaves(plain)) == len(jax.tree.leaves(scaled))
    assert jax.tree.structure(plain) != jax.tree.structure(scaled)
    reference = make_optimizer(config_lib.TrainConfig()).init(_params())
    assert jax.tree.structure(plain) == jax.tree.structure(reference)


def test_scale_must_be_positive():
    with pytest.raises(config_lib.ConfigError, match="train.router_lr_scale"):
        config_lib.TrainConfig(router_lr_scale=0.0)


@pytest.mark.parametrize("overrides", [{}, {"train.scan_layers": False, "model.mtp_layers": 1}])
def test_router_mask_on_a_model(overrides):
    """On the tiny preset's parameters (scanned or not, with an MTP block): every router matrix, nothing else."""
    from dropless.models.transformer import init_params

    cfg = config_lib.load_preset("tiny").replace(**overrides)
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
    flagged = [jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_leaves_with_path(router_mask(params)) if m]
    assert flagged and all("'router'" in name and name.endswith("['kernel']") for name in flagged)
    leaves = dict(jax.tree_util.tree_leaves_with_path(params))
    flagged_rows = sum(leaf.shape[0] if leaf.ndim == 3 else 1 for path, leaf in leaves.items()
                       if jax.tree_util.keystr(path) in flagged)
    assert flagged_rows == cfg.model.num_layers - cfg.model.first_dense_layers + cfg.model.mtp_layers
