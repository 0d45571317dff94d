"""FP8 training (`train.fp8`) through the MoE layer and the whole model, on one device and on 8-device meshes,
against the float32 layer and model within the documented bound (docs/fp8.md): e4m3 keeps 3 mantissa bits, so
each FP8 product is within ~4% (relative Frobenius norm, random operands) of its float32 value; outputs and
gradients are held to FP8_BOUND. Each check also asserts that FP8 changed the numbers, so a recipe that silently
ran in float32 fails.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.mesh import make_mesh
from dropless.ep import ExpertParallelExecutor
from dropless.fp8 import experts_gmm, make_recipe
from dropless.moe import moe_layer
from tests.ep_cases import FAST_COMPILE, MESHES, MOE, STRATEGIES, problem
from tests.parallel_train_worker import train_losses

FP8_BOUND = 0.1


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), compiler_options=FAST_COMPILE)
def layer(mode, strategy_name, expert_parallel, params, bias_E, x_BSD, cotangent_BSD):
    recipe = make_recipe(mode)
    executor = None
    if expert_parallel:
        executor = ExpertParallelExecutor(make_mesh(MESHES[expert_parallel]), STRATEGIES[strategy_name],
                                          experts_gmm(MOE, recipe))

    def loss(params, x_BSD):
        y_BSD, stats = moe_layer(params, bias_E, x_BSD, MOE, compute_dtype=jnp.float32, executor=executor,
                                 recipe=recipe)
        return jnp.sum(y_BSD * cotangent_BSD), (y_BSD, stats.tokens_dropped)

    (_, (y_BSD, dropped)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_BSD)
    return y_BSD, grads, dropped


def assert_within_fp8_bound(got, want):
    (y_got, grads_got, dropped), (y_want, grads_want, _) = got, want
    assert int(dropped) == 0
    assert 1e-5 < rel(y_got, y_want) < FP8_BOUND
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads_got), jax.tree.leaves(grads_want)):
        assert rel(g, w) < FP8_BOUND, jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def case():
    params, bias_E, x_BSD, cotangent_BSD = problem(seed=3)
    return params, bias_E, x_BSD, cotangent_BSD, layer("off", None, 0, params, bias_E, x_BSD, cotangent_BSD)


@pytest.mark.parametrize("mode", ["rowwise", "blockwise", "mxfp8"])
def test_fp8_moe_layer_on_one_device_is_within_the_bound_of_float32(case, mode):
    *inputs, want = case
    assert_within_fp8_bound(layer(mode, None, 0, *inputs), want)


@pytest.mark.parametrize("expert_parallel", sorted(MESHES))
def test_fp8_moe_layer_on_every_mesh_is_within_the_bound_of_the_float32_single_device(case, expert_parallel):
    *inputs, want = case
    assert_within_fp8_bound(layer("blockwise", "alltoall", expert_parallel, *inputs), want)


@pytest.mark.parametrize("strategy", ["allgather", "ragged"])
def test_fp8_moe_layer_under_the_other_dispatch_strategies(case, strategy):
    *inputs, want = case
    assert_within_fp8_bound(layer("rowwise", strategy, 4, *inputs), want)


@pytest.fixture(scope="module")
def float32_training():
    return train_losses({}, devices=jax.devices()[:1])


def test_fp8_training_on_a_mesh_with_remat_follows_the_float32_losses(float32_training):
    """blockwise FP8 under expert parallelism x data parallelism, the MoE blocks recomputed in the backward."""
    got = train_losses({"train.fp8": "blockwise", "parallel.expert": 4, "parallel.data": 2, "train.remat": "moe"})
    assert got["tokens_dropped"] == 0 and got["devices"] == 8
    losses, want = np.asarray(got["losses"]), np.asarray(float32_training["losses"])
    assert np.all(np.isfinite(losses)) and not np.array_equal(losses, want)
    np.testing.assert_allclose(losses, want, rtol=5e-3)
