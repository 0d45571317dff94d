"""The training step's gradient accumulation: N microbatches give the gradients, losses and MoE statistics of one
batch (float32, the tiny preset's architecture at test_train.SMALL's widths), and the configuration refuses splits
that cannot work."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.config import ConfigError, load_preset
from dropless.core.mesh import make_mesh
from dropless.train import setup as setup_lib
from dropless.train.step import accumulated_value_and_grad, make_eval_step, microbatches

from tests.test_train import SMALL

# What these tests spend is compiling (the whole batch once, each split once): narrow layers compile faster, and
# keep every feature the accumulation must get right (MLA, a dense layer, 8 grouped experts, shared expert, bias).
# Without the routers' running input means (the tiny preset keeps them): the step as every other preset runs it;
# the tests of the option set it.
CONFIG = load_preset("tiny").replace(**{k: v for k, v in SMALL.items() if k.startswith(("model.", "moe."))},
                                     **{"train.dtype": "float32", "train.batch_size": 8, "train.seq_len": 16,
                                        "moe.router_common_rate": 0.0})


@contextlib.contextmanager
def compilations():
    """The XLA compilations (durations in seconds) of the block."""
    compiled = []
    listener = lambda event, seconds, **_: compiled.append(seconds) if event == BACKEND_COMPILE else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"

# One jitted function for every call of the accumulated gradient: a call with the same config (static) and shapes
# as an earlier one runs that one's program.
value_and_grad = jax.jit(accumulated_value_and_grad, static_argnums=3)


@pytest.fixture(scope="module")
def batch_and_state():
    from dropless.models import transformer

    params = transformer.init_params(jax.random.key(0), CONFIG)
    state = {"router_bias": 0.05 * jax.random.normal(jax.random.key(2), transformer.init_state(CONFIG)["router_bias"].shape)}
    batch = jax.random.randint(jax.random.key(1), (8, 17), 0, CONFIG.model.vocab_size)
    whole = value_and_grad(params, state, batch, CONFIG)  # shared by every split
    return params, state, batch, whole


@pytest.fixture(scope="module")
def other_sequences_step():
    """(config, optimizer, jitted step) of moe.router_common_source="other_sequences" with running means at rate
    0.5: one program for the tests that train with it."""
    from dropless.train.optimizer import make_optimizer
    from dropless.train.step import make_train_step

    config = CONFIG.replace(**{"moe.router_common_rate": 0.5, "moe.router_common_source": "other_sequences"})
    optimizer = make_optimizer(config.train)
    return config, optimizer, jax.jit(make_train_step(config, optimizer))


def test_a_fresh_state_follows_train_seed_and_given_weights_are_kept(batch_and_state):
    params, state, _, _ = batch_and_state

    def fresh(seed, init_weights=None):
        # The seed's states of one dense and one MoE layer; the given weights are the fixture's, CONFIG's model.
        config = CONFIG.replace(**{"train.seed": seed, **({} if init_weights else {"model.num_layers": 2})})
        return setup_lib.init_state(setup_lib.build(config, jax.devices()[:1]), init_weights)

    leaves = [jax.tree.leaves(fresh(seed).params) for seed in (0, 0, 1)]
    for a, b in zip(leaves[0], leaves[1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(leaves[0], leaves[2], strict=True))
    given = fresh(1, (params, state))
    for a, b in zip(jax.tree.leaves(given.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(given.model_state["router_bias"], state["router_bias"])


def test_microbatches_are_strided_rows_that_cover_the_batch_once():
    batch = jnp.arange(8 * 3).reshape(8, 3)
    micro = microbatches(batch, 4)
    assert micro.shape == (4, 2, 3)
    np.testing.assert_array_equal(micro[1], batch[jnp.array([1, 5])])
    np.testing.assert_array_equal(np.sort(micro.reshape(-1, 3)[:, 0]), batch[:, 0])


def test_accumulated_gradients_equal_the_whole_batch(batch_and_state):
    """Four microbatches of two sequences (the split of test_router_common_moves_towards_the_step_s_mean_router_input
    too; two microbatches under expert parallelism: test_train_parallel's unrolled-layers test)."""
    params, state, batch, whole = batch_and_state
    config = CONFIG.replace(**{"train.grad_accum_steps": 4})
    split = value_and_grad(params, state, batch, config)
    (total, (cross_entropy, aux)), grads = split
    (want_total, (want_cross_entropy, want_aux)), want_grads = whole
    assert float(cross_entropy) == pytest.approx(float(want_cross_entropy), rel=1e-6)
    assert float(total) == pytest.approx(float(want_total), rel=1e-6)  # the per-sequence balance loss is linear too
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):  # f32 sums in another order
        want = np.asarray(want)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    # Loads add up to the whole batch's (the router-bias rule sees the same counts), the load ratio follows.
    np.testing.assert_array_equal(np.asarray(aux["moe"].tokens_per_expert), np.asarray(want_aux["moe"].tokens_per_expert))
    np.testing.assert_allclose(np.asarray(aux["moe"].max_load_ratio), np.asarray(want_aux["moe"].max_load_ratio), rtol=1e-6)
    # The router's moments add too: the token shares are the whole batch's, not a mean of the microbatches'.
    np.testing.assert_array_equal(np.asarray(aux["moe"].tokens_routed), np.asarray(want_aux["moe"].tokens_routed))
    for name in ("score_moments", "logit_moments", "logit_gram", "input_moments"):
        np.testing.assert_allclose(np.asarray(getattr(aux["moe"], name)), np.asarray(getattr(want_aux["moe"], name)),
                                   rtol=1e-4, atol=1e-4, err_msg=name)
    assert int(jnp.sum(aux["moe"].tokens_dropped)) == 0
    # Losses that are means over tokens or sequences average over equal microbatches to the whole batch's: the
    # layers' z-loss and per-sequence balance loss, and the step's balance loss (the metrics report it).
    for name in ("z_loss", "seq_aux_loss"):
        want = np.asarray(getattr(want_aux["moe"], name))
        assert np.all(want > 0), name
        np.testing.assert_allclose(np.asarray(getattr(aux["moe"], name)), want, rtol=1e-5, err_msg=name)
    assert float(want_aux["balance_loss"]) > 0
    assert float(aux["balance_loss"]) == pytest.approx(float(want_aux["balance_loss"]), rel=1e-5)
    # Evaluation splits the same way and gives the same mean.
    evaluated = jax.jit(make_eval_step(config))(params, state, batch)
    assert float(evaluated) == pytest.approx(float(want_cross_entropy), rel=1e-6)


def test_the_total_loss_adds_the_balance_loss_to_the_cross_entropy(batch_and_state):
    _, _, _, ((total, (cross_entropy, aux)), _) = batch_and_state
    assert float(aux["balance_loss"]) > 0
    assert float(total) == pytest.approx(float(cross_entropy) + float(aux["balance_loss"]), rel=1e-6)


def test_merged_microbatch_stats_add_the_dropped_tokens(batch_and_state):
    """Under gmm_backend=capacity each microbatch drops its own tokens: the step dropped their sum."""
    from dropless.train.step import merge_microbatch_stats

    _, _, _, ((_, (_, aux)), _) = batch_and_state
    one = aux["moe"]._replace(tokens_dropped=jnp.arange(1, 1 + aux["moe"].tokens_dropped.size, dtype=jnp.int32)
                              .reshape(aux["moe"].tokens_dropped.shape))
    merged = merge_microbatch_stats(jax.tree.map(lambda x: jnp.stack([x, 2 * x]), one))
    np.testing.assert_array_equal(merged.tokens_dropped, 3 * np.asarray(one.tokens_dropped))


def test_accumulation_splits_that_cannot_work_are_config_errors():
    with pytest.raises(ConfigError, match="not divisible by train.grad_accum_steps=3"):
        CONFIG.replace(**{"train.grad_accum_steps": 3})
    with pytest.raises(ConfigError, match="train.grad_accum_steps"):
        CONFIG.replace(**{"train.grad_accum_steps": 0})
    with pytest.raises(ConfigError, match=r"microbatch .* 2 sequences\) is not divisible by the 8 devices"):
        make_mesh(CONFIG.parallel, jax.devices()[:8], batch_size=8, microbatch_size=2)


def test_fault_tolerance_keys_are_checked():
    with pytest.raises(ConfigError, match="train.stop_signals names 'SIGKILL'"):
        CONFIG.replace(**{"train.stop_signals": "SIGTERM,SIGKILL"})
    with pytest.raises(ConfigError, match="train.stop_signals names 'SIGBOGUS'"):
        CONFIG.replace(**{"train.stop_signals": "bogus"})
    assert CONFIG.replace(**{"train.stop_signals": "term, usr1"}).train.stop_signal_names == ("SIGTERM", "SIGUSR1")
    assert CONFIG.replace(**{"train.stop_signals": ""}).train.stop_signal_names == ()
    with pytest.raises(ConfigError, match="train.max_nonfinite_steps"):
        CONFIG.replace(**{"train.max_nonfinite_steps": 0})
    assert CONFIG.replace(**{"train.schedule_steps": 0, "train.steps": 7}).train.schedule_horizon == 7
    assert CONFIG.replace(**{"train.schedule_steps": 9, "train.steps": 7}).train.schedule_horizon == 9


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", float("inf")])
def test_non_finite_numbers_are_refused(value):
    for key in ("train.learning_rate", "train.grad_clip", "moe.routed_scaling_factor", "data.eval_fraction"):
        with pytest.raises(ConfigError, match=f"{key}=.* must be a finite number"):
            CONFIG.replace(**{key: value})


def test_bias_centring_equalises_the_step_s_mean_selection_scores(batch_and_state):
    """moe.bias_center_rate=1 through the step's own statistics: routing the same batch again with the updated
    bias, the first router row's experts have equal mean selection scores (the later rows' inputs change with the
    first layer's new choices, so theirs come close); the sign rule adds its step on top."""
    from dropless.train.step import update_router_biases

    params, state, batch, whole = batch_and_state
    (_, (_, aux)), _ = whole
    stats = aux["moe"]
    offsets = lambda moments, tokens: np.asarray(moments)[:, 0] / np.asarray(tokens)[:, None]
    before = offsets(stats.score_moments, stats.tokens_routed)
    assert np.abs(before).max(axis=1).min() > 1e-3
    centred = update_router_biases(state, aux, 0.0, 1.0)
    again = value_and_grad(params, centred, batch, CONFIG)  # the fixture's program
    (_, (_, aux_again)), _ = again
    after = offsets(aux_again["moe"].score_moments, aux_again["moe"].tokens_routed)
    np.testing.assert_allclose(after[0], 0.0, atol=2e-6)
    assert np.all(np.abs(after[1:]).max(axis=1) < 0.1 * np.abs(before[1:]).max(axis=1))
    both = update_router_biases(state, aux, 1e-3, 1.0)
    signs = np.sign(np.mean(stats.tokens_per_expert, axis=1, keepdims=True) - np.asarray(stats.tokens_per_expert))
    np.testing.assert_allclose(np.asarray(both["router_bias"]) - np.asarray(centred["router_bias"]), 1e-3 * signs,
                               atol=1e-7)


def test_the_training_step_moves_the_bias_by_moe_bias_update_rule(batch_and_state):
    """moe.bias_update_rule="proportional": the step's bias update is rate * clip((mean - load) / mean, -1, 1) of
    the step's own loads, per router row; "sign" (the default) rate * sign(mean - load)."""
    from dropless.train.optimizer import make_optimizer
    from dropless.train.step import init_train_state, make_train_step

    params, state, batch, whole = batch_and_state
    (_, (_, aux)), _ = whole  # the step's loads, the same under either rule (the rule acts after the forward pass)
    load = np.asarray(aux["moe"].tokens_per_expert, np.float64)
    mean = load.mean(axis=1, keepdims=True)
    expected = {}
    for rule in ("sign", "proportional"):
        config = CONFIG.replace(**{"moe.bias_update_rate": 0.1, "moe.bias_update_rule": rule})
        optimizer = make_optimizer(config.train)
        start = init_train_state(jax.random.key(0), config, optimizer, params, state)
        train_step = jax.jit(make_train_step(config, optimizer))
        stepped, metrics = train_step(start, batch)
        expected[rule] = np.sign(mean - load) if rule == "sign" else np.clip((mean - load) / mean, -1, 1)
        np.testing.assert_allclose(np.asarray(stepped.model_state["router_bias"]) - np.asarray(state["router_bias"]),
                                   0.1 * expected[rule], atol=1e-6)
        np.testing.assert_array_equal(metrics["router_bias"], stepped.model_state["router_bias"])  # after the update
    # A non-finite step (the output head poisoned: the routing before it stays finite) moves no bias either.
    poisoned = start._replace(params={**start.params, "lm_head": start.params["lm_head"].at[0, 0].set(jnp.nan)})
    skipped, metrics = train_step(poisoned, batch)
    assert int(metrics["nonfinite"]) == 1
    np.testing.assert_array_equal(skipped.model_state["router_bias"], poisoned.model_state["router_bias"])
    assert np.abs(expected["sign"] - expected["proportional"]).max() > 0.1  # the two rules told apart


def test_a_step_whose_gradient_is_not_finite_is_skipped_whole(batch_and_state, monkeypatch):
    """A finite loss with one infinite gradient: parameters, optimizer state and router biases keep their values."""
    from dropless.train import step as step_lib
    from dropless.train.optimizer import learning_rate_schedule, make_optimizer

    params, state, batch, _ = batch_and_state
    config = CONFIG.replace(**{"model.num_layers": 1, "moe.bias_update_rate": 0.1})
    real = step_lib.accumulated_value_and_grad

    def infinite_gradient(*args, **kwargs):
        value, grads = real(*args, **kwargs)
        return value, {**grads, "lm_head": grads["lm_head"].at[0, 0].set(jnp.inf)}

    monkeypatch.setattr(step_lib, "accumulated_value_and_grad", infinite_gradient)
    optimizer = make_optimizer(config.train)
    start = step_lib.init_train_state(jax.random.key(0), config, optimizer)
    ones = jax.tree.map(jnp.ones_like, start.params)
    moved = jax.jit(optimizer.update)(ones, start.opt_state, start.params)[1]  # moments a reset would change
    start = start._replace(opt_state=moved)
    train_step = jax.jit(step_lib.make_train_step(config, optimizer))
    stepped, metrics = train_step(start, batch)
    assert int(metrics["nonfinite"]) == 1 and np.isfinite(float(metrics["total_loss"]))
    assert int(stepped.step) == 1
    for got, want in zip(jax.tree.leaves((stepped.params, stepped.opt_state, stepped.model_state)),
                         jax.tree.leaves((start.params, start.opt_state, start.model_state)), strict=True):
        np.testing.assert_array_equal(got, want)
    # The schedule counts applied updates: the next step still runs at the skipped step's rate, and reports it.
    _, again = train_step(stepped, batch)
    assert float(again["lr"]) == float(metrics["lr"])
    assert float(metrics["lr"]) == pytest.approx(float(learning_rate_schedule(config.train)(1)), rel=1e-6)


def test_the_step_reports_the_learning_rate_it_applies(batch_and_state):
    """Step n runs at schedule(n): the first warm-up step at 0 (no weight moves), the second at lr / warmup."""
    from dropless.train.optimizer import learning_rate_schedule, make_optimizer
    from dropless.train.step import init_train_state, make_train_step

    _, _, batch, _ = batch_and_state
    config = CONFIG.replace(**{"model.num_layers": 1, "train.warmup_steps": 4, "train.learning_rate": 1e-2})
    optimizer = make_optimizer(config.train)
    start = init_train_state(jax.random.key(0), config, optimizer)
    train_step = jax.jit(make_train_step(config, optimizer))
    first, metrics = train_step(start, batch)
    assert float(metrics["lr"]) == 0.0
    for got, want in zip(jax.tree.leaves(first.params), jax.tree.leaves(start.params)):
        np.testing.assert_array_equal(got, want)
    _, metrics = train_step(first, batch)
    assert float(metrics["lr"]) == pytest.approx(1e-2 / 4) == float(learning_rate_schedule(config.train)(1))


def test_router_common_moves_towards_the_step_s_mean_router_input(batch_and_state):
    """moe.router_common_rate: after a step each router's running mean moves `rate` of the way to the mean of its
    input over the step's tokens (its input_moments, summed over the microbatches); the bias is left to its own
    rule, and a model without the state (rate 0) is untouched."""
    from dropless.models import transformer
    from dropless.train.step import update_router_commons

    params, state, batch, whole = batch_and_state
    (_, (_, aux)), _ = whole
    stats = aux["moe"]
    rows = transformer.num_router_rows(CONFIG.model)
    common = 0.1 * jax.random.normal(jax.random.key(3), (rows, CONFIG.model.hidden_size))
    with_common = {**state, "router_common": common}
    updated = update_router_commons(with_common, aux, 0.25)
    mean = np.asarray(stats.input_moments)[:, :-1] / np.asarray(stats.tokens_routed)[:, None]
    np.testing.assert_allclose(updated["router_common"], 0.75 * np.asarray(common) + 0.25 * mean, rtol=1e-5,
                               atol=1e-6)
    assert updated["router_bias"] is state["router_bias"]
    assert update_router_commons(state, aux, 0.25) is state
    # Accumulating over microbatches gives the same running mean as the whole batch.
    split = value_and_grad(params, state, batch, CONFIG.replace(**{"train.grad_accum_steps": 4}))
    np.testing.assert_allclose(update_router_commons(with_common, split[0][1][1], 0.25)["router_common"],
                               updated["router_common"], rtol=1e-5, atol=1e-6)
    assert "router_common" in transformer.init_state(CONFIG.replace(**{"moe.router_common_rate": 0.1}))
    assert "router_common" not in transformer.init_state(CONFIG.replace(**{"moe.router_common_rate": 0.0}))


def test_the_other_sequences_direction_serves_the_first_router_common_other_steps(batch_and_state,
                                                                                   other_sequences_step):
    """moe.router_common_other_steps=1: step 0 routes on the other sequences' mean, as without the option, and
    step 1 on the running mean, as evaluation does (the loss of that pass, not the other sequences')."""
    from dropless.models import transformer
    from dropless.train.step import init_train_state, loss_fn, make_train_step

    params, state, batch, _ = batch_and_state
    always, optimizer, step_always = other_sequences_step
    first = always.replace(**{"moe.router_common_other_steps": 1})
    with_common = {**state, "router_common": transformer.init_state(always)["router_common"]}
    start = init_train_state(jax.random.key(0), always, optimizer, params, with_common)
    step_first = jax.jit(make_train_step(first, optimizer))
    (a1, m_a1), (b1, m_b1) = step_always(start, batch), step_first(start, batch)
    assert float(m_a1["loss"]) == float(m_b1["loss"])
    with compilations() as compiled:  # each step takes its own output without compiling again
        (_, m_a2), (_, m_b2) = step_always(a1, batch), step_first(b1, batch)
    assert compiled == []
    losses = jax.jit(lambda p, s: [loss_fn(p, s, batch, first, mtp=False, other_sequences=jnp.asarray(flag))[1][0]
                                   for flag in (False, True)])(b1.params, b1.model_state)
    np.testing.assert_allclose(float(m_b2["loss"]), float(losses[0]), rtol=1e-6)
    np.testing.assert_allclose(float(m_a2["loss"]), float(losses[1]), rtol=1e-6)
    assert abs(float(losses[0]) - float(losses[1])) > 3 * 1e-6 * float(losses[0])  # the two passes told apart


def test_the_training_step_threads_the_router_common_options(batch_and_state, other_sequences_step):
    """With moe.router_common_source="other_sequences" a training pass routes on the other sequences' mean and an
    evaluation pass on the running mean (zero here: as the model without the option); the step moves the running
    means towards the step's mean router input; an imported state without them (`init_train_state` given the
    router bias alone) gets zeros."""
    from dropless.models import transformer
    from dropless.train.step import init_train_state, loss_fn, make_eval_step, make_train_step

    params, state, batch, _ = batch_and_state
    config, optimizer, step = other_sequences_step
    with_common = {**state, "router_common": transformer.init_state(config)["router_common"]}
    losses = jax.jit(lambda p, s: [loss_fn(p, s, batch, c, mtp=False, training=t)[1][0]
                                   for c, s, t in ((config, with_common, True), (config, with_common, False),
                                                   (CONFIG, state, True))])(params, state)
    assert float(losses[0]) != float(losses[1])
    assert float(losses[1]) == float(losses[2])
    assert float(jax.jit(make_eval_step(config))(params, with_common, batch)) == float(losses[1])

    train_state = init_train_state(jax.random.key(0), config, optimizer, params, state)
    np.testing.assert_array_equal(train_state.model_state["router_common"], 0.0)
    stepped, metrics = step(train_state, batch)
    (_, (_, aux)), _ = value_and_grad(params, train_state.model_state, batch, config)
    mean = np.asarray(aux["moe"].input_moments)[:, :-1] / np.asarray(aux["moe"].tokens_routed)[:, None]
    np.testing.assert_allclose(stepped.model_state["router_common"], 0.5 * mean, rtol=1e-5, atol=1e-6)
    # The running mean's cosine with the step's mean: 0 while it is zero; near 1 on the same batch a step later.
    np.testing.assert_array_equal(metrics["router_common_alignment"], 0.0)
    again = np.asarray(step(stepped, batch)[1]["router_common_alignment"])
    assert again.shape == (transformer.num_router_rows(config.model),) and np.all((again > 0.9) & (again <= 1 + 1e-6))
    plain = init_train_state(jax.random.key(0), CONFIG, optimizer, params, state)  # the option off: no metric
    shapes = jax.eval_shape(make_train_step(CONFIG, optimizer), plain, batch)
    assert "router_common_alignment" not in shapes[1] and set(shapes[0].model_state) == {"router_bias"}


def test_initial_weights_that_are_not_the_config_s_model_are_refused_before_the_run_starts(batch_and_state, tmp_path):
    """Fine-tuning's `init_weights` must be the config's model: weights of another vocabulary were trained (the
    embedding rows past the config's vocabulary, the head's logits over the weights' own) and saved under a
    config.json that does not describe them; a missing leaf failed inside jit with a pytree mismatch."""
    from dropless.models import transformer
    from dropless.train.loop import train

    params, state, _, _ = batch_and_state
    transformer.check_weights(CONFIG, params, state)  # the config's own weights
    transformer.check_weights(CONFIG.replace(**{"moe.router_common_rate": 0.3}), params, state)  # means start at 0
    other_vocab = CONFIG.replace(**{"model.vocab_size": CONFIG.model.vocab_size * 2})
    cases = [(other_vocab, (params, state), r"params\['embed'\] has shape \(320, 32\), but this config's model has "
                                            r"\(640, 32\); start from the config the weights come with"),
             (CONFIG, ({k: v for k, v in params.items() if k != "lm_head"}, state), r"lack params\['lm_head'\]"),
             (CONFIG, (params, {}), r"lack state\['router_bias'\]"),
             (CONFIG, (params, {**state, "extra": jnp.zeros(3)}), r"hold state\['extra'\] \(3,\), which this config")]
    for config, weights, message in cases:
        with pytest.raises(ConfigError, match=message):
            train(config, tmp_path / "run", init_weights=weights, progress=False, log=lambda line: None)
        assert not (tmp_path / "run").exists()
