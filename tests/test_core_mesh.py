"""Mesh construction, logical-axis rules, placement, multi-process settings and XLA flags (8 CPU devices)."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dropless.core import xla_flags
from dropless.core.config import ConfigError, ParallelConfig
from dropless.core import distributed
from dropless.core.mesh import batch_sharding, logical_to_spec, make_mesh, mesh_shape, param_shardings, place


@pytest.mark.parametrize("data,fsdp,expert,shape", [(-1, 1, 1, (8, 1, 1)), (-1, 2, 2, (2, 2, 2)),
                                                     (2, 1, 4, (2, 1, 4)), (1, 1, 8, (1, 1, 8))])
def test_make_mesh_shapes(data, fsdp, expert, shape):
    mesh = make_mesh(ParallelConfig(data=data, fsdp=fsdp, expert=expert), batch_size=16, num_experts=8)
    assert tuple(mesh.shape.values()) == shape and mesh.axis_names == ("data", "fsdp", "expert")
    # expert is innermost: an expert group is a run of neighbouring devices.
    assert [d.id for d in mesh.devices[0, 0]] == list(range(expert))


@pytest.mark.parametrize("parallel,kwargs,words", [
    (ParallelConfig(data=2, expert=2), {}, "parallel.data=2 x parallel.fsdp=1 x parallel.expert=2 = 4 but there are 8"),
    (ParallelConfig(fsdp=3), {}, "does not divide the 8 devices"),
    (ParallelConfig(expert=8), {"num_experts": 12}, "moe.num_experts=12 is not divisible by parallel.expert=8"),
    (ParallelConfig(expert=2), {"batch_size": 12}, "train.batch_size=12 is not divisible by the 8 devices"),
    (ParallelConfig(), {"batch_size": 16, "microbatch_size": 4},
     "= 4 sequences.*is not divisible by the 8 devices of the mesh; make it a multiple of 8"),
])
def test_make_mesh_errors(parallel, kwargs, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        make_mesh(parallel, **kwargs)


def test_one_device_is_named_in_the_singular():
    with pytest.raises(ConfigError, match="= 2 does not divide the 1 device; choose"):
        mesh_shape(ParallelConfig(expert=2), 1)
    with pytest.raises(ConfigError, match="= 2 but there is 1 device; make the product 1"):
        mesh_shape(ParallelConfig(data=2), 1)


def test_rules_map_each_mesh_axis_once_and_skip_non_divisors():
    mesh = make_mesh(ParallelConfig(data=2, fsdp=2, expert=2))
    assert logical_to_spec(mesh, ("layers", "experts", "embed", "mlp")) == P(None, "expert", "fsdp", None)
    assert logical_to_spec(mesh, ("layers", "experts", "mlp", "embed")) == P(None, "expert", "fsdp", None)
    assert logical_to_spec(mesh, ("layers", "kv_lora", "heads_x_dim")) == P(None, "fsdp", None)
    assert logical_to_spec(mesh, ("vocab", "embed")) == P("fsdp", None)  # the embedding: split by vocabulary rows
    assert logical_to_spec(mesh, ("batch", None)) == P(("data", "fsdp", "expert"), None)
    # 4 sequences split over data x fsdp = 4 devices, not over all 8: the joint size must divide the dimension.
    assert logical_to_spec(mesh, ("batch", None), (4, 3)) == P(("data", "fsdp"), None)
    # 81 rows do not split over fsdp=2: the next eligible dimension takes it.
    assert logical_to_spec(mesh, ("layers", "embed", "kv_lora"), (3, 81, 64)) == P(None, None, "fsdp")
    # size-1 mesh axes never appear in a spec.
    assert logical_to_spec(make_mesh(ParallelConfig()), ("experts", "embed")) == P(None, None)


def test_param_shardings_and_place_round_trip():
    mesh = make_mesh(ParallelConfig(fsdp=2, expert=4))
    params = {"experts": {"gate_up": np.arange(2 * 8 * 4 * 6, dtype=np.float32).reshape(2, 8, 4, 6)},
              "norm": np.ones((3,), np.float32)}
    axes = {"experts": {"gate_up": ("layers", "experts", "embed", "mlp")}, "norm": ("embed",)}
    shardings = param_shardings(mesh, axes, params)
    assert shardings["experts"]["gate_up"].spec == P(None, "expert", "fsdp", None)
    assert shardings["norm"].spec == P(None)  # 3 does not divide over fsdp=2
    placed = place(params, shardings)
    assert placed["experts"]["gate_up"].sharding == shardings["experts"]["gate_up"]
    assert placed["experts"]["gate_up"].addressable_shards[0].data.shape == (2, 2, 2, 6)
    np.testing.assert_array_equal(np.asarray(placed["experts"]["gate_up"]), params["experts"]["gate_up"])

    batch = np.arange(16 * 5, dtype=np.int32).reshape(16, 5)
    sharded = place(batch, batch_sharding(mesh))
    assert sharded.sharding == batch_sharding(mesh) and sharded.addressable_shards[0].data.shape == (2, 5)
    np.testing.assert_array_equal(np.asarray(sharded), batch)


def test_distributed_settings_from_environment():
    assert distributed.distributed_settings({}) is None
    own = {"DROPLESS_COORDINATOR": "10.0.0.1:1234", "DROPLESS_NUM_PROCESSES": "4", "DROPLESS_PROCESS_ID": "3",
           "DROPLESS_LOCAL_DEVICE_IDS": "0,1"}
    assert distributed.distributed_settings(own) == {
        "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3, "local_device_ids": [0, 1],
        "cluster_detection_method": "deactivate"}
    assert distributed.distributed_settings({**own, "DROPLESS_NUM_PROCESSES": "1", "DROPLESS_PROCESS_ID": "0"}) is None
    with pytest.raises(ConfigError, match="DROPLESS_PROCESS_ID missing"):
        distributed.distributed_settings({"DROPLESS_COORDINATOR": "h:1", "DROPLESS_NUM_PROCESSES": "2"})
    with pytest.raises(ConfigError, match="must be in 0..DROPLESS_NUM_PROCESSES-1"):
        distributed.distributed_settings({**own, "DROPLESS_PROCESS_ID": "4"})
    with pytest.raises(ConfigError, match="must be an integer"):
        distributed.distributed_settings({**own, "DROPLESS_NUM_PROCESSES": "four"})
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0"}
    assert distributed.distributed_settings(slurm) == {"local_device_ids": None}
    assert distributed.distributed_settings({**slurm, "SLURM_NTASKS": "1"}) is None
    assert not distributed.initialize({})  # one process: a no-op


def test_xla_flags_user_setting_wins():
    name = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert xla_flags.apply(env) == f"--xla_force_host_platform_device_count=8 {name}=true"
    assert xla_flags.apply(env) == env["XLA_FLAGS"]  # idempotent
    assert xla_flags.apply({"XLA_FLAGS": f"{name}=false"}) == f"{name}=false"
    assert xla_flags.apply({"DROPLESS_XLA_FLAGS": "0"}) == ""
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    mine = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    xla_flags.apply(mine)
    assert mine["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"  # the user's value wins


def test_per_batch_shard_runs_an_unpartitionable_kernel_on_each_devices_slice():
    """A host callback stands in for a Pallas kernel: XLA cannot split it, so under plain jit every call sees the
    whole batch; through per_batch_shard each device's call sees its own slice and the result is unchanged."""
    import jax

    from dropless.core.mesh import per_batch_shard

    seen = []

    def opaque(x):  # [B, S] -> [B, S], on the host
        def host(x):
            seen.append(x.shape)
            return np.cumsum(x, axis=1).astype(x.dtype)
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    mesh = make_mesh(ParallelConfig(data=2, expert=4), batch_size=16, num_experts=8)
    x = place(np.arange(16 * 3, dtype=np.float32).reshape(16, 3), batch_sharding(mesh))
    expected = np.cumsum(np.asarray(x), axis=1)
    np.testing.assert_array_equal(jax.jit(opaque)(x), expected)
    assert seen == [(16, 3)]  # plain jit: the whole batch, gathered
    seen.clear()
    np.testing.assert_array_equal(jax.jit(per_batch_shard(opaque, mesh))(x), expected)
    assert seen == [(2, 3)] * 8
    assert per_batch_shard(opaque, None) is opaque


def test_the_model_runs_attention_per_batch_shard_on_a_mesh(monkeypatch):
    """forward() hands the executor's mesh to the attention kernel, which is traced on one device's batch slice."""
    import jax

    from dropless.models import attention, transformer
    from dropless.ep import make_executor
    from tests.micro_config import micro_config

    config = micro_config(**{"train.batch_size": 8, "parallel.data": 2, "parallel.expert": 4})
    mesh = make_mesh(config.parallel, batch_size=8, num_experts=config.moe.num_experts)
    traced_batches = []
    local = attention._attend_local

    def recording(q, *args, **kwargs):
        traced_batches.append(q.shape[0])
        return local(q, *args, **kwargs)

    monkeypatch.setattr(attention, "_attend_local", recording)
    params, state = transformer.init_params(jax.random.key(0), config), transformer.init_state(config)
    tokens = np.zeros((8, config.train.seq_len), np.int32)
    jax.eval_shape(lambda p, s, t: transformer.forward(p, s, t, config, executor=make_executor(config, mesh)),
                   params, state, tokens)
    assert traced_batches and set(traced_batches) == {1}  # 8 sequences over 8 devices
    traced_batches.clear()
    jax.eval_shape(lambda p, s, t: transformer.forward(p, s, t, config), params, state, tokens)
    assert set(traced_batches) == {8}
