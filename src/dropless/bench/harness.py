"""The real training step, built for measurement: the very step `dropless.train.loop` runs
(`dropless.train.setup`), without the data.

`build(config)` returns the mesh, the shardings and the jitted `dropless.train.step` train step (state donated).
`lower(setup)` lowers it from abstract shapes, so a program can be compiled and its memory analysed without
allocating a single parameter (that is how `dropless bench memory` looks at a 671B model on a laptop).
Batches are uniform random token ids: the router, the expert loads and every matmul are real; only the text is not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dropless.core.config import Config
from dropless.core import mesh as mesh_lib
from dropless.train.setup import StepSetup, build, init_state  # noqa: F401  (the benchmarks' entry points)
from dropless.train.step import TrainState


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


def random_batches(setup: StepSetup, count: int, seed: int = 0) -> list[jax.Array]:
    """`count` [B, S+1] batches of uniform random token ids, placed on the mesh."""
    rng = np.random.default_rng(seed)
    shape = batch_shape(setup.config).shape
    return [mesh_lib.place(rng.integers(0, setup.config.model.vocab_size, shape, dtype=np.int32), setup.batch_sharding)
            for _ in range(count)]
