"""FP8 training (`train.fp8`) through the MoE layer and the whole model, on one device and on 8-device meshes,
against the float32 layer and model within the documented bound (docs/fp8.md): e4m3 keeps 3 mantissa bits, so
each FP8 product is within ~4% (relative Frobenius norm, random operands) of its float32 value; outputs and
gradients are held to FP8_BOUND, the whole model's gradients to MODEL_GRAD_BOUND and its loss to 0.5%. Each check also asserts that FP8 changed the numbers, so a recipe that silently
ran in float32 fails.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.config import ParallelConfig, load_preset
from dropless.core.mesh import make_mesh
from dropless.ep import ExpertParallelExecutor
from dropless.fp8 import experts_gmm, make_recipe
from dropless.models import transformer
from dropless.moe import LocalExecutor, moe_layer
from dropless.train.step import loss_fn
from tests.ep_cases import FAST_COMPILE, MESHES, MOE, STRATEGIES, problem
from tests.parallel_train_worker import OVERRIDES

FP8_BOUND = 0.1
# Through the whole model a gradient passes several quantized products (each layer's backward quantizes its
# output gradient again), so the errors compound: held to MODEL_GRAD_BOUND.
MODEL_GRAD_BOUND = 0.25


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 7), compiler_options=FAST_COMPILE)
def layer(mode, strategy_name, expert_parallel, params, bias_E, x_BSD, cotangent_BSD, row_align=None):
    """The layer's output, gradients and dropped tokens under recipe `mode`: on one device with the executor the
    model builds (or, given `row_align`, its grouped GEMM on rows aligned that way), or on the mesh with
    `expert_parallel` devices on `expert` under dispatch strategy `strategy_name`."""
    recipe = make_recipe(mode)
    executor = None
    if expert_parallel:
        executor = ExpertParallelExecutor(make_mesh(MESHES[expert_parallel]), STRATEGIES[strategy_name],
                                          experts_gmm(MOE, recipe))
    elif row_align is not None:
        executor = LocalExecutor(dataclasses.replace(experts_gmm(MOE, recipe), row_align=row_align))

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


def test_fp8_moe_layer_under_another_dispatch_strategy(case):
    *inputs, want = case
    assert_within_fp8_bound(layer("rowwise", "allgather", 4, *inputs), want)


@pytest.mark.parametrize("mode", ["rowwise", "blockwise", "mxfp8"])
def test_fp8_moe_layer_on_expert_aligned_rows_equals_it_on_rows_end_to_end(case, mode):
    """The routed experts' permutation in the FP8 GEMM's layout (row_align=128, zero rows between the experts: the
    executor the model builds, which the one-device test above runs) against the contiguous layout with gathered
    weight-gradient copies: the same numbers, to float32 rounding."""
    *inputs, _ = case
    assert LocalExecutor.from_config(MOE, make_recipe(mode)).gmm.row_align == 128  # the layer's own executor
    y_want, grads_want, _ = layer(mode, None, 0, *inputs, row_align=1)
    y_got, grads_got, _ = layer(mode, None, 0, *inputs)
    assert rel(y_got, y_want) < 1e-6
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads_got), jax.tree.leaves(grads_want)):
        assert rel(g, w) < 1e-5, jax.tree_util.keystr(path)


def test_fp8_model_with_remat_on_a_mesh_is_within_the_bound_of_float32_on_one_device(mode="blockwise"):
    """The whole model (attention projections, dense MLP, shared and routed experts in FP8) on an 8-device mesh
    (data x fsdp), its MoE blocks recomputed in the backward and its dense FP8 matmuls run per batch shard with the
    weights whole: the loss and every gradient against the float32 model on one device without remat (a weight
    gradient missing the other devices' shares would be ~8x off). Blockwise only: rowwise goes through the same
    per-batch-shard wrapper (tests/test_fp8.py exports both for CUDA on a mesh)."""
    from dropless.core.config import ParallelConfig
    from dropless.core.mesh import make_mesh
    from dropless.ep import make_executor

    config = load_preset("tiny").replace(**{**OVERRIDES, "model.num_layers": 2})
    params = jax.jit(transformer.init_params, static_argnums=1)(jax.random.key(0), config)  # one program, not op by op
    state = transformer.init_state(config)
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, config.model.vocab_size)
    mesh = make_mesh(ParallelConfig(data=4, fsdp=2, expert=1))

    @functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
    def loss_and_grads(fp8, params):
        cfg = config.replace(**({"train.fp8": fp8, "train.remat": "moe"} if fp8 != "off" else {}))
        executor = make_executor(cfg, mesh) if fp8 != "off" else None
        return jax.value_and_grad(lambda p: loss_fn(p, state, tokens, cfg, executor)[0])(params)

    (want_loss, want), (got_loss, got) = loss_and_grads("off", params), loss_and_grads(mode, params)
    assert 0 < abs(float(got_loss) / float(want_loss) - 1) < 5e-3
    flat = lambda tree: np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])
    assert rel(flat(got), flat(want)) < MODEL_GRAD_BOUND  # the whole gradient (0.12 on this model)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        # Each dense weight matrix. Not the norms' (small sums of cancelling terms) nor the router's and routed
        # experts': after one layer's FP8 error, a token whose top-k scores are close picks another expert.
        name = jax.tree_util.keystr(path)
        if not any(part in name for part in ("norm", "router", "experts")):
            assert rel(g, w) < MODEL_GRAD_BOUND, name


def test_fp8_experts_take_the_stored_weights_and_bf16_experts_a_cast_copy(case):
    """Under FP8 the routed experts' grouped GEMM receives the float32 master weights (one rounding, to e4m3, and no
    bf16 copy or cast of the gradient); in bf16 it receives them cast to the rows' dtype. Either way the weights'
    gradients come back float32."""
    params, bias_E, x_BSD, cotangent_BSD, _ = case
    seen = []

    def spying(gmm):
        def call(lhs, rhs, gs, **kw):
            seen.append((type(gmm).__name__, rhs.dtype))
            return gmm(lhs, rhs, gs, **kw)
        return dataclasses.make_dataclass(type(gmm).__name__, [], bases=(type(gmm),), frozen=True,
                                          namespace={"__call__": lambda self, *a, **kw: call(*a, **kw)})(
            **{f.name: getattr(gmm, f.name) for f in dataclasses.fields(gmm)})

    for mode in ("blockwise", "off"):
        recipe = make_recipe(mode)
        executor = LocalExecutor(spying(experts_gmm(MOE, recipe)))

        def loss(params):
            y_BSD, _ = moe_layer(params, bias_E, x_BSD.astype(jnp.bfloat16), MOE, compute_dtype=jnp.bfloat16,
                                 executor=executor, recipe=recipe)
            return jnp.sum(y_BSD.astype(jnp.float32) * cotangent_BSD)

        grads = jax.eval_shape(jax.grad(loss), params)  # traced: the calls and the gradients' dtypes, not compiled
        assert {g.dtype for g in jax.tree.leaves(grads["experts"])} == {jnp.dtype(jnp.float32)}
    assert seen == [("Fp8Gmm", jnp.float32)] * 2 + [("XlaGmm", jnp.bfloat16)] * 2, seen


GQA_MTP = {"model.attention": "gqa", "model.mtp_layers": 1, "model.layer_pattern": "MD",
           "model.first_dense_layers": 0}


# One MoE layer alone: attention's projections, the shared expert and the routed experts, each an FP8 product that
# reads the step's copies.
MOE_ONLY = {"model.num_layers": 1, "model.first_dense_layers": 0}


# The cases cover the recipes, one device and expert parallelism, both attentions, MTP and a dense layer after a
# MoE one. The first compiles and runs two whole training steps of one MoE layer and compares their numbers; the
# others (the cache keyed by the same leaf paths through the same `weight_copies`) trace them only, which is where
# the count is taken: every combination compiled would cost minutes of the suite.
@pytest.mark.parametrize("mode,parallel,model,compare,accum", [("blockwise", (2, 1, 4), MOE_ONLY, True, 2),
                                                               ("rowwise", None, GQA_MTP, False, 2),
                                                               ("blockwise", None, {}, False, 1)])
def test_grad_accumulation_quantizes_each_weight_once_per_step_with_the_same_bits(mode, parallel, model, compare,
                                                                                   accum, monkeypatch):
    """Under FP8 the step makes each weight's e4m3 copies once, before its microbatches (one or several:
    dropless.fp8.recipe.weight_cache): no FP8 product quantizes a weight inside them, on one device
    and under expert parallelism (the copies cross its shard_map with the experts), with MLA or GQA attention, MTP
    and a dense layer after a MoE one (every weight an FP8 product reads is cached); and (`compare`) the loss and
    every gradient are those of quantizing in each microbatch (the loss bit for bit, gradients to float32
    rounding)."""
    from dropless.core.config import ParallelConfig
    from dropless.core.mesh import make_mesh
    from dropless.ep import make_executor
    from dropless.fp8 import dense, grouped, recipe as recipe_lib
    from dropless.train import step as step_lib

    config = load_preset("tiny").replace(**{**OVERRIDES, "model.num_layers": 2, "train.fp8": mode,
                                             "train.grad_accum_steps": accum, **model})
    params = jax.jit(transformer.init_params, static_argnums=1)(jax.random.key(0), config)
    state = transformer.init_state(config)
    tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, config.model.vocab_size)
    executor = None if parallel is None else make_executor(config, make_mesh(ParallelConfig(*parallel)))
    quantized = []

    def counting(module):
        original = module.weight_copies

        def copies(w, r):
            if not isinstance(w, recipe_lib.CachedWeight):
                quantized.append(w.shape)
            return original(w, r)
        monkeypatch.setattr(module, "weight_copies", copies)

    counting(dense)
    counting(grouped)

    def run():
        fn = jax.jit(functools.partial(step_lib.accumulated_value_and_grad, config=config, executor=executor),
                     compiler_options=FAST_COMPILE)
        return fn(params, state, tokens) if compare else fn.trace(params, state, tokens)

    got_out = run()
    assert quantized == []  # the products read the step's copies
    config = config.replace(**{"train.fp8_cache_weights": False})
    want_out = run()
    assert quantized  # without the cache the products quantize their weights
    if not compare:
        return
    (got_loss, _), got = got_out
    (want_loss, _), want = want_out
    # The products see the same e4m3 bits; the programs differ around them, so XLA may sum a gradient's terms in
    # another order (float32 rounding). A copy of the wrong weight or layer would be off by e4m3's ~4%.
    assert float(got_loss) == float(want_loss)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert rel(g, w) < 1e-5, jax.tree_util.keystr(path)


@pytest.mark.parametrize("parallel,model", [(None, GQA_MTP), ((2, 1, 4), {})], ids=["one-device", "expert-parallel"])
def test_the_weight_gradient_dtype_reaches_every_fp8_product_of_the_step(parallel, model, monkeypatch):
    """train.fp8_wgrad_dtype travels from the config to every weight-gradient product of a training step: the
    routed experts (on one device and through the expert-parallel executor), the dense and shared MLPs, the
    attention projections and MTP's projection; each asks its recipe for the dtype to write (`Recipe.wgrad_dtype`),
    and a path that built its recipe from train.fp8 alone would ask a float32 one. Traced, not compiled."""
    from dropless.ep import make_executor
    from dropless.fp8 import Recipe
    from dropless.train import step as step_lib

    asked = []
    original = Recipe.wgrad_dtype

    def wgrad_dtype(self, weight_dtype):
        asked.append(self.wgrad)
        return original(self, weight_dtype)

    monkeypatch.setattr(Recipe, "wgrad_dtype", wgrad_dtype)
    config = load_preset("tiny").replace(**{**OVERRIDES, "model.num_layers": 2, "train.fp8": "blockwise",
                                             "train.fp8_wgrad_dtype": "bfloat16", "train.grad_accum_steps": 2,
                                             **model})
    params = jax.jit(transformer.init_params, static_argnums=1)(jax.random.key(0), config)
    tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, config.model.vocab_size)
    executor = None if parallel is None else make_executor(config, make_mesh(ParallelConfig(*parallel)))
    traced = jax.jit(functools.partial(step_lib.accumulated_value_and_grad, config=config, executor=executor)).trace(
        params, transformer.init_state(config), tokens)
    assert asked and set(asked) == {"bfloat16"}, asked
    grads = traced.out_info[1]
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}  # the master weights' dtype
