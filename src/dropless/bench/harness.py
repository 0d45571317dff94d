"""The real training step, built for measurement: the same pieces `dropless.train.loop` jits, without the data.

`build(config)` returns the mesh, the shardings and the jitted `dropless.train.step` train step (state donated).
`lower(setup)` lowers it from abstract shapes, so a program can be compiled and its memory analysed without
allocating a single parameter (that is how `dropless bench memory` looks at a 671B model on a laptop).
Batches are uniform random token ids: the router, the expert loads and every matmul are real; only the text is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from dropless.config import Config
from dropless.parallel import dispatch
from dropless.parallel import mesh as mesh_lib
from dropless.train import offload
from dropless.train.loop import train_state_shardings
from dropless.train.optimizer import make_optimizer
from dropless.train.step import TrainState, init_train_state, make_train_step


@dataclass(frozen=True)
class StepSetup:
    config: Config
    mesh: Mesh
    optimizer: optax.GradientTransformation
    state_shapes: TrainState  # ShapeDtypeStructs
    state_shardings: TrainState  # NamedShardings
    batch_sharding: NamedSharding
    step: Any  # jax.jit(train_step), state donated


def build(config: Config, devices: Sequence[jax.Device] | None = None) -> StepSetup:
    """Mesh, shardings and the jitted train step for `config` on `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    mesh = mesh_lib.make_mesh(config.parallel, devices, batch_size=config.train.batch_size,
                              num_experts=config.moe.num_experts)
    optimizer = make_optimizer(config.train)
    state_shapes = jax.eval_shape(lambda: init_train_state(jax.random.key(config.train.seed), config, optimizer))
    shardings = offload.state_shardings_for(config.train, train_state_shardings(config, mesh, optimizer), devices)
    batch_sharding = mesh_lib.batch_sharding(mesh)
    step = jax.jit(make_train_step(config, optimizer, dispatch.make_executor(config, mesh)),
                   in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None), donate_argnums=0)
    return StepSetup(config, mesh, optimizer, state_shapes, shardings, batch_sharding, step)


def batch_shape(config: Config) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((config.train.batch_size, config.train.seq_len + 1), jnp.int32)


def abstract_args(setup: StepSetup) -> tuple[TrainState, jax.ShapeDtypeStruct]:
    """The step's arguments as ShapeDtypeStructs carrying their shardings (nothing is allocated)."""
    state = jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
                         setup.state_shapes, setup.state_shardings)
    batch = batch_shape(setup.config)
    return state, jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=setup.batch_sharding)


def lower(setup: StepSetup) -> jax.stages.Lowered:
    return setup.step.lower(*abstract_args(setup))


def init_state(setup: StepSetup) -> TrainState:
    """A freshly initialised TrainState, created directly in its shardings."""
    config, optimizer = setup.config, setup.optimizer
    return jax.jit(lambda: init_train_state(jax.random.key(config.train.seed), config, optimizer),
                   out_shardings=setup.state_shardings)()


def random_batches(setup: StepSetup, count: int, seed: int = 0) -> list[jax.Array]:
    """`count` [B, S+1] batches of uniform random token ids, placed on the mesh."""
    rng = np.random.default_rng(seed)
    shape = batch_shape(setup.config).shape
    return [mesh_lib.place(rng.integers(0, setup.config.model.vocab_size, shape, dtype=np.int32), setup.batch_sharding)
            for _ in range(count)]
