"""Expert parallelism on 8 CPU devices: the MoE layer under every strategy and mesh equals the single-device layer;
the executor and strategy `make_executor` builds from the config."""

import jax
import numpy as np
import pytest

from dropless.core.config import Config, ConfigError, MoEConfig, ParallelConfig
from dropless.core.mesh import make_mesh
from dropless.ep import AllGather, Auto, NoDispatch, Ragged, make_executor, make_strategy
from dropless.gmm import make_gmm
from dropless.gmm.capacity import CapacityGmm
from dropless.moe import LocalExecutor

from tests.ep_cases import (BATCH, MESHES, MOE, SEQ, STRATEGIES, assert_matches_single_device, balanced_inputs,
                            executor, expected_rows, problem)


@pytest.mark.parametrize("expert_parallel", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_layer_matches_single_device(name, expert_parallel):
    case = problem(seed=expert_parallel)
    stats = assert_matches_single_device(STRATEGIES[name], expert_parallel, case)
    assert int(stats.rows_sent_without_dedup) == expected_rows(case, expert_parallel, dedup=False)
    if name == "allgather":  # every token to every other device of its group
        assert int(stats.rows_sent) == BATCH * SEQ * (expert_parallel - 1)
    else:
        assert int(stats.rows_sent) == expected_rows(case, expert_parallel, dedup=True)


def test_meshes_without_expert_parallelism_compute_locally():
    """parallel.expert=1 (data and fsdp only): make_executor's NoDispatch, each device its own tokens."""
    config = Config(moe=MOE, parallel=MESHES[1])
    executor = make_executor(config, make_mesh(config.parallel))
    assert executor.strategy == NoDispatch()
    stats = assert_matches_single_device(executor.strategy, 1, problem(seed=1))
    assert int(stats.rows_sent) == 0 == int(stats.rows_sent_without_dedup)


def test_make_executor_choices():
    tiny = Config(moe=MoEConfig(num_experts=8), parallel=ParallelConfig(expert=4))
    mesh = make_mesh(tiny.parallel)
    assert make_executor(tiny, mesh).strategy == Auto(2.0, True)
    assert make_strategy(tiny.replace(**{"moe.dispatch": "allgather"})) == AllGather()
    assert make_strategy(tiny.replace(**{"moe.dispatch": "ragged"}), platform="gpu") == Ragged(True)
    assert make_strategy(tiny.replace(**{"parallel.expert": 1})) == NoDispatch()
    # one device: the single-device executor, with the config's grouped-GEMM backend and no mesh
    one_device = make_executor(tiny, make_mesh(ParallelConfig(), devices=jax.devices()[:1]))
    assert one_device == LocalExecutor(make_gmm(tiny.moe)) and one_device.mesh is None
    with pytest.raises(ConfigError, match="moe.dispatch=ragged needs GPUs"):
        make_strategy(tiny.replace(**{"moe.dispatch": "ragged"}), platform="cpu")


def test_the_executor_declares_its_mesh_gmm_and_name():
    """What the layer and the logs read from an executor is declared, the same on one device and on a mesh."""
    tiny = Config(moe=MoEConfig(num_experts=8, gmm_backend="xla"), parallel=ParallelConfig(expert=4))
    mesh = make_mesh(tiny.parallel)
    executor = make_executor(tiny, mesh)
    assert executor.mesh is mesh and executor.gmm == make_gmm(tiny.moe) and executor.name == "auto"
    assert LocalExecutor.from_config(tiny.moe).name == "local" and LocalExecutor.from_config(tiny.moe).mesh is None


@pytest.mark.parametrize("name,expert_parallel,buffer_factor", [("allgather", 2, 0.0), ("allgather", 8, 0.0),
                                                                 ("alltoall", 4, 0.0), ("alltoall", 4, 1.0),
                                                                 ("ragged", 8, 1.0)])
def test_capacity_backend_under_expert_parallelism_counts_every_device_s_drops(name, expert_parallel, buffer_factor):
    """gmm_backend=capacity (the baseline) on 2, 4 and 8 expert devices, each strategy, worst-case and bounded local
    buffers: each expert keeps ceil(capacity_factor x T*K / E) of the pairs of its expert group's T tokens, as one
    device holding those tokens would (not a share of the rows a device receives: an all-gather's are every token
    of the group), and the layer reports the sum over the mesh, counted again in Python from each group's tokens."""
    gmm = CapacityGmm(capacity_factor=0.25)
    rng = np.random.default_rng(6)
    ids_TK, x_TD, weights_TK, experts = balanced_inputs(
        np.stack([rng.choice(8, 2, replace=False, p=[.4, .2, .1, .1, .05, .05, .05, .05]) for _ in range(BATCH * SEQ)]))
    run = executor(STRATEGIES[name], expert_parallel, local_buffer_factor=buffer_factor, gmm=gmm)
    _, stats = jax.jit(run)(x_TD, ids_TK, weights_TK, experts)
    group_tokens = expert_parallel * 8  # the expert group's devices, 8 tokens each
    capacity = gmm.capacity(group_tokens * 2, 8)  # top-2 over 8 experts, as on one device
    want = 0
    for group in range(BATCH * SEQ // group_tokens):
        counts_E = np.bincount(np.asarray(ids_TK)[group * group_tokens:(group + 1) * group_tokens].ravel(),
                               minlength=8)
        want += int(np.sum(np.maximum(counts_E - capacity, 0)))
    assert 0 < int(stats.tokens_dropped) == want
