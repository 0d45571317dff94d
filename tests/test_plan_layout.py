"""`dropless.plan.layout`: the plan's state bytes equal the real sharded arrays' bytes on every mesh, exactly."""

from __future__ import annotations

import math

import jax
import pytest

from dropless.plan import Cluster, make_plan
from dropless.plan.layout import mesh_sizes
from dropless.train import setup as setup_lib
from tests.micro_config import micro_config

MESHES = [  # (parallel.data, parallel.fsdp, parallel.expert) on 8 devices
    (8, 1, 1), (1, 8, 1), (2, 1, 4), (1, 2, 4), (2, 4, 1), (1, 4, 2), (2, 2, 2),
]


def _bytes(shapes, shardings, kind: str | None = None) -> int:
    """Bytes the first device holds of a tree of ShapeDtypeStructs under its shardings (of one memory kind)."""
    total = 0
    for shape, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)):
        if kind is None or (sharding.memory_kind or "device") == kind:
            total += math.prod(sharding.shard_shape(shape.shape)) * shape.dtype.itemsize
    return total


def _actual(config):
    setup = setup_lib.build(config, jax.devices()[:8])
    shapes, shardings = setup.state_shapes, setup.state_shardings
    # The gradients: float32 arrays shaped and sharded like the parameters.
    grads = jax.eval_shape(jax.grad(lambda p: sum(x.sum() for x in jax.tree.leaves(p))), shapes.params)
    return {"parameters": _bytes(shapes.params, shardings.params),
            "gradients": _bytes(grads, shardings.params),
            "optimizer_state": _bytes(shapes.opt_state, shardings.opt_state),
            "host": _bytes(shapes, shardings, "pinned_host"),
            "model_state": _bytes((shapes.model_state, shapes.step), (shardings.model_state, shardings.step))}


@pytest.mark.parametrize("data,fsdp,expert", MESHES)
@pytest.mark.parametrize("features", [{}, {"train.offload_optimizer": True},
                                      {"train.optimizer_moments_dtype": "bfloat16"},
                                      {"model.layer_pattern": "MD", "model.first_dense_layers": 0,
                                       "model.mtp_layers": 1}])
def test_state_bytes_equal_the_sharded_arrays(data, fsdp, expert, features):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (virtual) devices")
    config = micro_config(**{"train.batch_size": 8, "parallel.data": data, "parallel.fsdp": fsdp,
                             "parallel.expert": expert, "model.hidden_size": 64, **features})
    actual = _actual(config)
    plan = make_plan(config, Cluster(1, 8, "cpu"))
    assert plan.mesh == {"data": data, "fsdp": fsdp, "expert": expert}
    assert plan.memory.parameters == actual["parameters"]
    assert plan.memory.gradients == actual["gradients"]
    assert plan.memory.optimizer_state == actual["optimizer_state"]
    assert plan.memory.optimizer_in_host == bool(actual["host"])
    if actual["host"]:
        assert actual["host"] == plan.memory.optimizer_state
    batch = config.train.batch_size * (config.train.seq_len + 1) * 4 // 8
    assert plan.memory.model_state_and_batch == actual["model_state"] + batch


def test_mesh_sizes_refuse_what_make_mesh_refuses():
    from dropless.core.config import ConfigError

    with pytest.raises(ConfigError, match="does not divide the 12 devices"):
        mesh_sizes(micro_config(**{"parallel.fsdp": 8}), 12)
    with pytest.raises(ConfigError, match="not divisible by the 4 devices"):
        mesh_sizes(micro_config(**{"train.batch_size": 2}), 4)
