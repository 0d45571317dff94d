"""Memory features that let a big model fit: optimizer state in host memory and bfloat16 optimizer moments.

- `train.offload_optimizer=true`: the optimizer state (AdamW's two moments, 8 bytes per parameter in float32)
  lives in pinned host memory between steps. Its shardings carry `memory_kind="pinned_host"`
  (`host_state_shardings`), and the optimizer is wrapped (`host_offloaded`) so that the update copies the
  state to the device, updates it and copies it back, all inside the one jitted step. The moments then use
  device memory only during the update, after the backward pass has freed the activations, instead of
  through the whole step. The price is two host<->device copies of the state per step (16 bytes per
  parameter over PCIe), which XLA may overlap with the update of other leaves.
- `train.optimizer_moments_dtype=bfloat16`: the moments are *stored* in bfloat16 (`stored_in`), half the
  bytes, and upcast to float32 for the update itself. Round-to-nearest storage loses updates smaller than
  bfloat16's resolution (about 0.4% of the moment), which a long run can feel: keep float32 unless memory
  demands it.
- Activation offloading by name (`train.offload`) is a rematerialisation policy and lives with the model
  (`dropless.models.transformer`, validated there).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from dropless.core.config import ConfigError, TrainConfig

HOST_MEMORY_KIND = "pinned_host"


def check_host_memory(train: TrainConfig, devices=None) -> None:
    """Raise ConfigError if `train.offload_optimizer` or `train.offload` is set but the devices have no host memory."""
    if not (train.offload_optimizer or train.offload.strip()):
        return
    device = (devices or jax.devices())[0]
    kinds = {memory.kind for memory in device.addressable_memories()}
    if HOST_MEMORY_KIND not in kinds:
        key = "train.offload_optimizer" if train.offload_optimizer else "train.offload"
        raise ConfigError(f"{key} needs '{HOST_MEMORY_KIND}' memory but {device.platform} devices offer only "
                          f"{', '.join(sorted(kinds))}; turn {key} off on this backend.")


def host_offloaded(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` whose state lives in host memory: moved to the device for each update, and back after it.

    Use under `jax.jit` with the state's shardings in host memory (`host_state_shardings`): the moves are
    `jax.device_put` to a memory space, which XLA turns into host<->device copies inside the step.
    """

    def update(updates, state, params=None):
        state = jax.device_put(state, jax.memory.Space.Device)
        updates, state = inner.update(updates, state, params)
        return updates, jax.device_put(state, jax.memory.Space.Host)

    return optax.GradientTransformation(inner.init, update)


def host_state_shardings(state_shardings: Any) -> Any:
    """The TrainState shardings with every optimizer-state leaf moved to pinned host memory."""
    opt_state = jax.tree.map(lambda sharding: sharding.with_memory_kind(HOST_MEMORY_KIND), state_shardings.opt_state)
    return state_shardings._replace(opt_state=opt_state)


def state_shardings_for(train: TrainConfig, state_shardings: Any, devices=None) -> Any:
    """The TrainState shardings `train` asks for: the optimizer state in pinned host memory when
    `train.offload_optimizer`, once the devices are checked to have such memory (for `train.offload` too)."""
    check_host_memory(train, devices)
    return host_state_shardings(state_shardings) if train.offload_optimizer else state_shardings


def _cast_floats(tree: Any, dtype) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def stored_in(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`inner` whose floating-point state (AdamW's moments) is stored in `dtype` and computed in float32."""

    def init(params):
        return _cast_floats(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, _cast_floats(state, jnp.float32), params)
        return updates, _cast_floats(state, dtype)

    return optax.GradientTransformation(init, update)


def apply_memory_features(optimizer: optax.GradientTransformation, train: TrainConfig) -> optax.GradientTransformation:
    """Wrap the optimizer for `train.optimizer_moments_dtype` and `train.offload_optimizer`."""
    if train.optimizer_moments_dtype != "float32":
        optimizer = stored_in(optimizer, jnp.dtype(train.optimizer_moments_dtype))
    if train.offload_optimizer:
        optimizer = host_offloaded(optimizer)
    return optimizer
