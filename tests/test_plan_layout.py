"""`dropless.plan.layout`: the plan's state bytes equal the real sharded arrays' bytes on every mesh, exactly."""

from __future__ import annotations

import math

import jax
import pytest

from dropless.plan import Cluster, make_plan
from dropless.core.config import ConfigError
from dropless.models import transformer
from dropless.plan.layout import mesh_sizes, state_bytes
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
    with pytest.raises(ConfigError, match="does not divide the 12 devices"):
        mesh_sizes(micro_config(**{"parallel.fsdp": 8}), 12)
    with pytest.raises(ConfigError, match="not divisible by the 4 devices"):
        mesh_sizes(micro_config(**{"train.batch_size": 2}), 4)


def test_the_state_s_element_counts_follow_the_real_parameters():
    """On an unsharded mesh: the matrices are every weight but the norms and the float32 router, the routed
    experts' elements those under `experts` (not the shared experts), and the largest layer that of the stack
    whose one layer holds the most elements; gathered over `fsdp`, that layer is whole again."""
    config = micro_config(**{"model.num_layers": 3, "model.first_dense_layers": 1})
    params = jax.eval_shape(lambda: transformer.init_params(jax.random.key(0), config))
    leaves = [(tuple(key.key for key in path), x) for path, x in jax.tree_util.tree_leaves_with_path(params)]
    size = {path: math.prod(x.shape) for path, x in leaves}
    unsharded = state_bytes(config, {"data": 8, "fsdp": 1, "expert": 1})
    assert unsharded.parameter_elements == sum(size.values())
    assert unsharded.matrix_elements == sum(n for path, n in size.items()
                                            if not path[-1].endswith("norm") and "router" not in path)
    assert unsharded.expert_elements == sum(n for path, n in size.items() if "experts" in path) > 0
    stacks = {}
    for path, x in leaves:
        if path[0] in ("dense_layers", "moe_layers"):
            stacks[path[0]] = stacks.get(path[0], 0) + size[path] // x.shape[0]
    assert stacks["moe_layers"] != stacks["dense_layers"]
    assert unsharded.largest_layer_elements == unsharded.largest_layer_gathered == max(stacks.values())
    sharded = state_bytes(config, {"data": 1, "fsdp": 8, "expert": 1})
    assert sharded.largest_layer_elements < sharded.largest_layer_gathered == max(stacks.values())


def test_the_model_state_without_the_routers_running_mean(tmp_path):
    """moe.router_common_rate=0 keeps no running input mean beside the router bias: the plan's model state is
    the real one's, exactly."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (virtual) devices")
    config = micro_config(**{"train.batch_size": 8, "parallel.data": 2, "parallel.fsdp": 2, "parallel.expert": 2,
                             "model.hidden_size": 64, "moe.router_common_rate": 0.0})
    actual = _actual(config)
    plan = make_plan(config, Cluster(1, 8, "cpu"))
    batch = config.train.batch_size * (config.train.seq_len + 1) * 4 // 8
    assert plan.memory.model_state_and_batch == actual["model_state"] + batch
    assert plan.memory.model_state_and_batch < make_plan(
        config.replace(**{"moe.router_common_rate": 0.3}), Cluster(1, 8, "cpu")).memory.model_state_and_batch


def test_mesh_sizes_split_each_microbatch_over_the_devices():
    """With train.grad_accum_steps each microbatch, not the whole batch, is split over the data axes."""
    config = micro_config(**{"train.batch_size": 16, "train.grad_accum_steps": 2})
    assert mesh_sizes(config, 8) == {"data": 8, "fsdp": 1, "expert": 1}
    with pytest.raises(ConfigError, match="not divisible by the 8 devices"):
        mesh_sizes(config.replace(**{"train.batch_size": 8}), 8)


def test_build_refuses_a_microbatch_that_does_not_split_over_the_devices():
    """The step setup checks each microbatch, not only the whole batch, against the mesh before compiling."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (virtual) devices")
    config = micro_config(**{"train.batch_size": 8, "train.grad_accum_steps": 2})
    with pytest.raises(ConfigError, match=r"a microbatch \(train.batch_size / train.grad_accum_steps = 4 sequences\)"):
        setup_lib.build(config, jax.devices()[:8])
