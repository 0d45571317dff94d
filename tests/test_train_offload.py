"""Memory features: bfloat16 optimizer moments, optimizer state in host memory, activation offloading by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dropless.core.config import ConfigError, TrainConfig
from dropless.train import offload
from dropless.train.optimizer import make_optimizer
from dropless.train.step import TrainState, applied_updates
from tests.micro_config import micro_config


def _params():
    keys = jax.random.split(jax.random.key(0), 2)
    return {"w": jax.random.normal(keys[0], (16, 8)), "b": jax.random.normal(keys[1], (8,))}


def _grads(step: int):
    keys = jax.random.split(jax.random.key(100 + step), 2)
    return {"w": jax.random.normal(keys[0], (16, 8)), "b": jax.random.normal(keys[1], (8,))}


def _run(optimizer, steps: int = 4):
    params, state = _params(), optimizer.init(_params())
    update = jax.jit(optimizer.update)  # compiled once, run every step
    for step in range(steps):
        updates, state = update(_grads(step), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_bfloat16_moments_are_stored_in_bfloat16_and_track_float32_adam():
    reference, _ = _run(optax.adamw(1e-2))
    params, state = _run(offload.stored_in(optax.adamw(1e-2), jnp.bfloat16))
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
    counts = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.integer)]
    assert counts and all(int(c) == 4 for c in counts)  # the step counter is untouched
    for name in params:
        moved, moved_ref = params[name] - _params()[name], reference[name] - _params()[name]
        assert float(jnp.linalg.norm(moved - moved_ref) / jnp.linalg.norm(moved_ref)) < 2e-2


def test_make_optimizer_moments_dtype_applies_to_both_moments():
    train = TrainConfig(optimizer_moments_dtype="bfloat16")
    state = make_optimizer(train).init(_params())
    adam = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
    assert len(adam) == 1
    assert {x.dtype for x in jax.tree.leaves((adam[0].mu, adam[0].nu))} == {jnp.dtype(jnp.bfloat16)}


def _mesh():
    return jax.make_mesh((1,), ("data",), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,))


def test_host_offloaded_optimizer_matches_the_device_one_and_stays_on_the_host():
    mesh = _mesh()
    device = NamedSharding(mesh, PartitionSpec())
    train = TrainConfig(offload_optimizer=True)
    offloaded, plain = make_optimizer(train), make_optimizer(TrainConfig())
    params = _params()
    param_shardings = jax.tree.map(lambda _: device, params)
    on_device = TrainState(device, param_shardings, jax.tree.map(lambda _: device, plain.init(params)), {})
    assert offload.state_shardings_for(TrainConfig(), on_device) is on_device
    state_shardings = offload.state_shardings_for(train, on_device)
    assert {s.memory_kind for s in jax.tree.leaves(state_shardings.opt_state)} == {"pinned_host"}
    assert {s.memory_kind for s in jax.tree.leaves(state_shardings.params)} == {"device"}

    def step(optimizer):
        def apply(params, opt_state, grads):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state
        return apply

    jitted = jax.jit(step(offloaded), in_shardings=(param_shardings, state_shardings.opt_state, param_shardings),
                     out_shardings=(param_shardings, state_shardings.opt_state))
    host_state = jax.jit(offloaded.init, out_shardings=state_shardings.opt_state)(params)
    device_state = plain.init(params)
    host_params, device_params = params, params
    on_device_step = jax.jit(step(plain))
    for i in range(3):
        host_params, host_state = jitted(host_params, host_state, _grads(i))
        device_params, device_state = on_device_step(device_params, device_state, _grads(i))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(host_state)} == {"pinned_host"}
    for name in params:
        np.testing.assert_array_equal(np.asarray(host_params[name]), np.asarray(device_params[name]))


def test_the_training_step_with_its_optimizer_state_on_the_host_equals_it_on_the_device():
    """train.offload_optimizer through the trainer's own step (`setup.build`): the learning rate reads the update
    count from the state in host memory, and losses, learning rates and parameters are the device run's, bit for
    bit; the state stays on the host."""
    from dropless.train import setup as setup_lib

    config = micro_config(**{"train.warmup_steps": 2, "train.steps": 4, "model.num_layers": 1})  # one dense layer
    batch = jax.random.randint(jax.random.key(1), (config.train.batch_size, config.train.seq_len + 1), 0,
                               config.model.vocab_size)
    runs = {}
    for on_host in (False, True):
        setup = setup_lib.build(config.replace(**{"train.offload_optimizer": on_host}), jax.devices()[:1])
        state, metrics = setup_lib.init_state(setup), []
        for _ in range(3):
            state, step_metrics = setup.step(state, batch)
            metrics.append((float(step_metrics["loss"]), float(step_metrics["lr"])))
        runs[on_host] = state, metrics
    (device_state, device_metrics), (host_state, host_metrics) = runs[False], runs[True]
    assert host_metrics == device_metrics and len({lr for _, lr in host_metrics}) == 3  # the warm-up moves it
    assert {x.sharding.memory_kind for x in jax.tree.leaves(host_state.opt_state)} == {"pinned_host"}
    for a, b in zip(jax.tree.leaves(host_state.params), jax.tree.leaves(device_state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # XLA:CPU reads host memory in place; a GPU program needs the count copied to the device, and only then (a
    # copy places the outputs of a step jitted without shardings, which then compiles again for its own output).
    copies = lambda on_host: str(jax.make_jaxpr(lambda opt_state: applied_updates(opt_state, state.step, on_host))(
        host_state.opt_state)).count("device_put")
    assert (copies(True), copies(False)) == (1, 0)


def test_optimizer_state_shardings_can_be_derived_through_the_wrappers():
    """`optax.tree_map_params` (how the trainer shards the optimizer state) sees through both wrappers."""
    train = TrainConfig(offload_optimizer=True, optimizer_moments_dtype="bfloat16")
    optimizer = make_optimizer(train)
    params = _params()
    shapes = jax.eval_shape(optimizer.init, params)
    marked = optax.tree_map_params(optimizer, lambda _, mark: mark, shapes, jax.tree.map(lambda _: "param", params),
                                   transform_non_params=lambda _: "other")
    assert jax.tree.leaves(marked).count("param") == 2 * len(params)  # mu and nu


class _DeviceWithoutHost:
    platform = "fake"

    def addressable_memories(self):
        class Memory:
            kind = "device"
        return [Memory()]


def test_check_host_memory_names_the_key_and_the_fix():
    offload.check_host_memory(TrainConfig(), [_DeviceWithoutHost()])  # nothing asked: nothing checked
    with pytest.raises(ConfigError, match="train.offload_optimizer needs 'pinned_host' memory"):
        offload.check_host_memory(TrainConfig(offload_optimizer=True), [_DeviceWithoutHost()])
    with pytest.raises(ConfigError, match="train.offload needs 'pinned_host'"):
        offload.check_host_memory(TrainConfig(remat="full", offload="moe_in"), [_DeviceWithoutHost()])
    offload.check_host_memory(TrainConfig(offload_optimizer=True), jax.devices()[:1])  # XLA:CPU has pinned_host


def test_activation_offload_validation():
    from dropless.models import transformer

    params = jax.eval_shape(lambda: transformer.init_params(jax.random.key(0), micro_config()))
    state = jax.eval_shape(lambda: transformer.init_state(micro_config()))
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    with pytest.raises(ConfigError, match="unknown activation"):
        jax.eval_shape(lambda p, s, t: transformer.forward(p, s, t, micro_config(**{"train.remat": "full",
                                                                              "train.offload": "nope"})),
                       params, state, tokens)
    with pytest.raises(ConfigError, match="needs train.remat=full"):
        jax.eval_shape(lambda p, s, t: transformer.forward(p, s, t, micro_config(**{"train.offload": "moe_in"})),
                       params, state, tokens)


def test_activation_offload_keeps_gradients_and_moves_activations_to_the_host(capsys):
    from jax.ad_checkpoint import print_saved_residuals

    from dropless.models import transformer
    from dropless.train.step import loss_fn

    config = micro_config()
    params = transformer.init_params(jax.random.key(0), config)
    state = transformer.init_state(config)
    batch = jax.random.randint(jax.random.key(1), (2, 9), 0, config.model.vocab_size)

    def grads(cfg):
        return jax.jit(jax.grad(lambda p: loss_fn(p, state, batch, cfg)[0]))(params)

    def host_residuals(cfg) -> int:
        print_saved_residuals(lambda p: loss_fn(p, state, batch, cfg)[0], params)
        return capsys.readouterr().out.count("<host>")

    offloading = config.replace(**{"train.remat": "full", "train.offload": "moe_in,attn_out"})
    for got, want in zip(jax.tree.leaves(grads(offloading)), jax.tree.leaves(grads(config))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-5)
    # The named activations are kept for the backward pass in host memory (one per name and layer stack)...
    assert host_residuals(offloading) == 3
    # ...and nothing is, without offloading.
    assert host_residuals(config.replace(**{"train.remat": "full"})) == 0


def test_state_shardings_for_refuses_offloading_on_devices_without_host_memory():
    """The trainer's shardings are checked: offloading on a backend without pinned host memory is refused with
    the key to turn off, not left to fail in XLA."""
    device = NamedSharding(_mesh(), PartitionSpec())
    shardings = TrainState(device, {"w": device}, {"mu": device}, {})
    with pytest.raises(ConfigError, match="train.offload_optimizer needs 'pinned_host' memory"):
        offload.state_shardings_for(TrainConfig(offload_optimizer=True), shardings, [_DeviceWithoutHost()])
    with pytest.raises(ConfigError, match="train.offload needs 'pinned_host'"):
        offload.state_shardings_for(TrainConfig(remat="full", offload="moe_in"), shardings, [_DeviceWithoutHost()])
    assert offload.state_shardings_for(TrainConfig(), shardings, [_DeviceWithoutHost()]) is shardings


def test_the_offloaded_update_returns_its_state_to_the_host():
    """Under jit without output shardings the wrapped update itself moves the new state back to pinned host
    memory: the caller need not ask for it."""
    sharding = NamedSharding(_mesh(), PartitionSpec())
    optimizer = make_optimizer(TrainConfig(offload_optimizer=True))
    params = jax.device_put(_params(), sharding)
    state = jax.device_put(optimizer.init(params), sharding.with_memory_kind("pinned_host"))
    _, new_state = jax.jit(optimizer.update)(_grads(0), state, params)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(new_state)} == {"pinned_host"}
