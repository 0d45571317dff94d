"""Grouped-GEMM backends: xla and tokamax against a per-group loop; capacity equals them or drops exactly; the
registry and its names; the one custom VJP against jax.lax.ragged_dot's gradients."""

import dataclasses
import math
import sys
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.config import Config, ConfigError, MoEConfig, apply_overrides
from dropless.gmm import CapacityGmm, DroplessMosaicGmm, GmmProducts, TokamaxGmm, XlaGmm, make_gmm, registry
from dropless.gmm import tokamax as gmm_tokamax
from dropless.gmm.dropless_mosaic import TunedContract
from dropless.gmm.tokamax import TokamaxContract, TokamaxRows
from dropless.gmm.vjp import gmm_from_products
from dropless.gmm.xla import XlaContract
from dropless.moe import MoEError, init_moe, moe_layer
from dropless.moe.reference import reference_capacity_keep, reference_moe, reference_route

ROWS, K_DIM, N_DIM = 13, 5, 6
# Empty groups, a big group, and 2 padding rows past sum(group_sizes) = 11.
GROUP_SIZES = np.array([3, 0, 6, 0, 2], np.int32)


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    lhs = rng.normal(size=(ROWS, K_DIM)).astype(np.float32)
    lhs[GROUP_SIZES.sum():] = np.nan  # padding is never read as data
    rhs = rng.normal(size=(len(GROUP_SIZES), K_DIM, N_DIM)).astype(np.float32)
    cotangent = rng.normal(size=(ROWS, N_DIM)).astype(np.float32)
    return jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(GROUP_SIZES), jnp.asarray(cotangent)


def _loop_reference(lhs, rhs, group_sizes, capacity=None):
    """Per-group loop in float64: rows of group g times rhs[g]; rows past capacity or past the groups are zero."""
    lhs, rhs = np.nan_to_num(np.asarray(lhs, np.float64)), np.asarray(rhs, np.float64)
    out, start = np.zeros((lhs.shape[0], rhs.shape[2])), 0
    for g, size in enumerate(np.asarray(group_sizes)):
        kept = size if capacity is None else min(size, capacity)
        out[start:start + kept] = lhs[start:start + kept] @ rhs[g]
        start += size
    return out


def _forward_and_grads(gmm, lhs, rhs, group_sizes, cotangent):
    def objective(lhs, rhs):
        out = gmm(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0) * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(lhs, rhs)
    return out, grads


@pytest.mark.parametrize("gmm", [XlaGmm(), TokamaxGmm(implementation="xla"), CapacityGmm(capacity_factor=5.0),
                                 TokamaxGmm(implementation="xla", weight_grad=TokamaxContract("xla"))],
                         ids=["xla", "tokamax_xla_path", "capacity_large", "tokamax_own_weight_grad"])
def test_dropless_backends_match_per_group_loop(gmm):
    lhs, rhs, group_sizes, cotangent = _operands()
    out, (grad_lhs, grad_rhs) = _forward_and_grads(gmm, lhs, rhs, group_sizes, cotangent)
    want = _loop_reference(lhs, rhs, group_sizes)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[GROUP_SIZES.sum():] == 0)
    # d out / d lhs: row r of group g gets cotangent[r] @ rhs[g].T; padding rows get zero.
    grad_lhs_ref = np.zeros((ROWS, K_DIM))
    start = 0
    for g, size in enumerate(GROUP_SIZES):
        grad_lhs_ref[start:start + size] = np.asarray(cotangent)[start:start + size] @ np.asarray(rhs)[g].T
        start += size
    grad_rhs_ref = np.stack([np.nan_to_num(np.asarray(lhs))[s:s + n].T @ np.asarray(cotangent)[s:s + n]
                             for s, n in zip(np.cumsum(GROUP_SIZES) - GROUP_SIZES, GROUP_SIZES)])
    np.testing.assert_allclose(grad_lhs, grad_lhs_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_rhs, grad_rhs_ref, rtol=1e-5, atol=1e-5)
    assert int(gmm.dropped_rows(group_sizes, ROWS)) == 0


def test_capacity_drops_exactly_the_rows_over_capacity():
    lhs, rhs, group_sizes, cotangent = _operands(seed=1)
    gmm = CapacityGmm(capacity_factor=1.0)
    capacity = math.ceil(1.0 * ROWS / len(GROUP_SIZES))  # = 3: group 2 (6 rows) loses 3
    assert gmm.capacity(ROWS, len(GROUP_SIZES)) == capacity
    out, (grad_lhs, _) = _forward_and_grads(gmm, lhs, rhs, group_sizes, cotangent)
    np.testing.assert_allclose(out, _loop_reference(lhs, rhs, group_sizes, capacity), rtol=1e-5, atol=1e-5)
    dropped = np.zeros(ROWS, bool)
    dropped[3 + capacity:3 + 6] = True
    assert np.all(np.asarray(out)[dropped] == 0) and np.all(np.asarray(grad_lhs)[dropped] == 0)
    assert int(gmm.dropped_rows(group_sizes, ROWS)) == 3 == dropped.sum()
    with pytest.raises(MoEError, match="needs num_rows"):
        gmm.dropped_rows(group_sizes)


def test_backend_choice_and_dropless_mosaic_needs_a_gpu():
    assert isinstance(make_gmm(MoEConfig(gmm_backend="auto")),
                      XlaGmm if jax.default_backend() != "gpu" else DroplessMosaicGmm)
    assert make_gmm(MoEConfig(gmm_backend="capacity", capacity_factor=2.0)) == CapacityGmm(2.0)
    assert MoEConfig(capacity_factor=8.0).capacity_factor == 8.0  # every expert holds every token: allowed
    with pytest.raises(ConfigError, match=r"moe.capacity_factor=100000000.0 is beyond moe.num_experts=8, where each "
                                          r"expert's buffer already holds every token; give a factor near 1"):
        MoEConfig(capacity_factor=1e8)
    backend = make_gmm(MoEConfig(gmm_backend="dropless_mosaic"))
    assert isinstance(backend, DroplessMosaicGmm) and backend is make_gmm(MoEConfig(gmm_backend="dropless_mosaic"))
    if jax.default_backend() != "gpu":
        lhs, rhs, group_sizes, _ = _operands()
        with pytest.raises(MoEError, match="needs an NVIDIA GPU.*moe.gmm_backend=xla"):
            backend(lhs, rhs, group_sizes)


LAYER_CFG = MoEConfig(num_experts=4, num_experts_per_tok=2, expert_intermediate_size=6, score_func="softmax",
                      num_shared_experts=1, gmm_backend="capacity", capacity_factor=0.75)


def _layer_problem():
    params = init_moe(jax.random.key(3), 8, LAYER_CFG, init_std=0.5)
    # A skewed router so some experts overflow a capacity of ceil(0.75 * 24 / 4) = 5 assignments.
    params["router"]["kernel"] = params["router"]["kernel"].at[:, 0].add(0.8)
    x_BSD = jax.random.normal(jax.random.key(4), (2, 6, 8)) + 0.5
    return params, x_BSD


def test_capacity_layer_drops_the_expected_tokens_and_counts_them():
    params, x_BSD = _layer_problem()
    bias_E = jnp.zeros(4)
    layer = jax.jit(lambda p, x, cfg: moe_layer(p, bias_E, x, cfg, compute_dtype=jnp.float32), static_argnums=2)
    y, stats = layer(params, x_BSD, LAYER_CFG)
    ids_TK = reference_route(x_BSD.reshape(-1, 8), params["router"]["kernel"], None, LAYER_CFG)
    keep_TK = reference_capacity_keep(ids_TK, 4, capacity=5)
    assert 0 < int(stats.tokens_dropped) == int((~keep_TK).sum())
    with jax.enable_x64():
        y_ref, _ = reference_moe(jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params),
                                 jnp.asarray(x_BSD, jnp.float64), ids_TK, LAYER_CFG, keep_TK)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    # With room for every assignment (C >= T*K) the baseline is exactly the dropless layer.
    y_big, stats_big = layer(params, x_BSD, dataclasses.replace(LAYER_CFG, capacity_factor=4.0))
    y_xla, stats_xla = layer(params, x_BSD, dataclasses.replace(LAYER_CFG, gmm_backend="xla"))
    assert int(stats_big.tokens_dropped) == 0 == int(stats_xla.tokens_dropped)
    np.testing.assert_allclose(y_big, y_xla, rtol=1e-6, atol=1e-6)


def test_tokamax_wrapper_widened_output_has_a_working_backward():
    """bf16 operands with a float32 output (the down projection): tokamax's own VJP cannot take a float32
    cotangent with bf16 weights, so the wrapper casts it; its gradients must equal the xla backend's."""
    lhs, rhs, group_sizes, cotangent = _operands(seed=2)
    lhs, rhs = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
    out_t, grads_t = _forward_and_grads(TokamaxGmm(implementation="xla"), lhs, rhs, group_sizes, cotangent)
    out_x, grads_x = _forward_and_grads(XlaGmm(), lhs, rhs, group_sizes, cotangent)
    assert out_t.dtype == jnp.float32
    np.testing.assert_allclose(out_t, out_x, rtol=1e-5, atol=1e-5)
    for g_t, g_x in zip(grads_t, grads_x):
        assert g_t.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g_t, np.float32), np.asarray(g_x, np.float32), rtol=2e-2, atol=2e-2)


def test_tokamax_s_kernel_module_is_where_dropless_imports_it_and_its_absence_is_one_line(monkeypatch):
    """The pinned tokamax holds the Mosaic GPU kernel and tile under the names dropless uses (a module outside
    tokamax's public API); without tokamax, a product that needs it names the extra to install."""
    from dropless.gmm.tuning import TOKAMAX_MOSAIC_MODULE, TileConfig, import_tokamax

    module = import_tokamax(TOKAMAX_MOSAIC_MODULE)
    assert callable(module.PallasMosaicGpuRaggedDot) and callable(module.Config)
    assert TileConfig(block_m=64, block_n=128, block_k=64, num_stages=4).to_tokamax().block_m == 64
    for name in ("tokamax", TOKAMAX_MOSAIC_MODULE):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    lhs, rhs, group_sizes, _ = _operands()
    with pytest.raises(MoEError, match=r"tokamax cannot be imported .*pip install 'dropless\[gpu\]'"):
        TokamaxRows("xla")(lhs, rhs, group_sizes, transpose_rhs=False, out_dtype=jnp.float32)
    with pytest.raises(MoEError, match=f"{TOKAMAX_MOSAIC_MODULE} cannot be imported"):
        TileConfig(block_m=64, block_n=128, block_k=64, num_stages=4).to_tokamax()


def test_tokamax_mosaic_backend_uses_tokamax_heuristics_with_our_weight_gradient():
    """moe.gmm_backend=tokamax_mosaic (the ladder's rung 3): tokamax's own kernel for the forward and dx, our
    weight-gradient kernel for dW (tokamax's is wrong on the H200). The wrapper is checked here with tokamax's
    portable implementation and our dW kernel in Pallas's GPU interpreter: both gradients equal ragged_dot's."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    backend = make_gmm(MoEConfig(gmm_backend="tokamax_mosaic"))
    assert backend == TokamaxGmm(implementation="mosaic", weight_grad=TunedContract())
    if jax.default_backend() != "gpu":
        lhs, rhs, group_sizes, _ = _operands()
        with pytest.raises(MoEError, match="needs an NVIDIA GPU"):
            backend(lhs, rhs, group_sizes)
    rng = np.random.default_rng(3)
    sizes = jnp.asarray([70, 0, 101, 21], jnp.int32)  # 192 rows in groups, 8 of padding
    lhs = jnp.asarray(rng.normal(size=(200, 128)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(4, 128, 64)) / 8, jnp.bfloat16)
    cotangent = jnp.asarray(rng.normal(size=(200, 64)), jnp.float32)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        out, (dx, dw) = _forward_and_grads(TokamaxGmm(implementation="xla", weight_grad=TunedContract()), lhs, rhs,
                                           sizes, cotangent)
    out_x, (dx_x, dw_x) = _forward_and_grads(XlaGmm(), lhs, rhs, sizes, cotangent)
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32))
                             / np.linalg.norm(np.asarray(b, np.float32)))
    assert rel(out, out_x) < 1e-3 and rel(dx, dx_x) < 1e-2 and rel(dw, dw_x) < 1e-2
    assert (np.asarray(dw[1], np.float32) == 0).all()  # the empty group


@pytest.mark.parametrize("old, new", [("tokamax", "dropless_mosaic"), ("tokamax_default", "tokamax_mosaic")])
def test_old_backend_names_raise_one_sentence_naming_the_new_ones(old, new):
    for build in (lambda: MoEConfig(gmm_backend=old), lambda: apply_overrides(Config(), {"moe.gmm_backend": old})):
        with pytest.raises(ConfigError) as err:
            build()
        message = str(err.value)
        assert f"moe.gmm_backend={old} is now called {new}" in message and message.count(". ") == 0
        assert "dropless_mosaic" in message and "tokamax_mosaic" in message and "\n" not in message


def test_registry_builds_the_named_implementation_for_every_config_value():
    names = set(typing.get_args(typing.get_type_hints(MoEConfig)["gmm_backend"]))
    assert names == set(registry.BUILDERS) | {"auto"}
    for name in registry.BUILDERS:
        backend = make_gmm(MoEConfig(gmm_backend=name))
        assert backend.name == name and backend is make_gmm(MoEConfig(gmm_backend=name))
    assert registry.resolve_backend_name("auto") == ("dropless_mosaic" if jax.default_backend() == "gpu" else "xla")


def _ragged_dot_reference(lhs, rhs, group_sizes, cotangent):
    """Forward and gradients of jax.lax.ragged_dot on the same rows (padding rows zeroed: they hold NaN)."""
    clean = jnp.where((jnp.arange(lhs.shape[0]) < group_sizes.sum())[:, None], lhs, 0)
    return _forward_and_grads(lambda a, b, gs, **kw: jax.lax.ragged_dot(a, b, gs, **kw), clean, rhs, group_sizes,
                              cotangent)


@pytest.mark.parametrize("name", ["xla", "capacity", "tokamax_xla_path"])
def test_every_cpu_backend_has_ragged_dots_gradients(name):
    """Every backend that runs on a CPU (tokamax's through its portable path, capacity with room for every row):
    forward, d lhs and d rhs equal jax.lax.ragged_dot's."""
    if name == "tokamax_xla_path":
        gmm = TokamaxGmm(implementation="xla")
    else:
        gmm = make_gmm(MoEConfig(gmm_backend=name, capacity_factor=5.0))
    lhs, rhs, group_sizes, cotangent = _operands(seed=4)
    out, grads = _forward_and_grads(gmm, lhs, rhs, group_sizes, cotangent)
    want_out, want_grads = _ragged_dot_reference(lhs, rhs, group_sizes, cotangent)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("drhs", [XlaContract(), TokamaxContract("xla")], ids=["xla_dw", "tokamax_dw"])
@pytest.mark.parametrize("zero_cotangent_padding", [False, True])
def test_the_one_vjp_over_any_products_has_ragged_dots_gradients(drhs, zero_cotangent_padding):
    """gmm_from_products with tokamax's portable rows products and either weight gradient."""
    products = GmmProducts(fwd=TokamaxRows("xla"), dlhs=TokamaxRows("xla"), drhs=drhs,
                           zero_cotangent_padding=zero_cotangent_padding)
    lhs, rhs, group_sizes, cotangent = _operands(seed=5)
    clean = jnp.where((jnp.arange(ROWS) < group_sizes.sum())[:, None], lhs, 0)
    gmm = lambda a, b, gs, preferred_element_type=None: gmm_from_products(a, b, gs, products, preferred_element_type)
    out, grads = _forward_and_grads(gmm, clean, rhs, group_sizes, cotangent)
    want_out, want_grads = _ragged_dot_reference(lhs, rhs, group_sizes, cotangent)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_tokamax_backend_runs_through_the_one_vjp(monkeypatch):
    """TokamaxGmm zeroes the padding rows of lhs, pads M to tokamax's row tile, and hands the one VJP tokamax's rows
    products, its weight gradient and the cotangent zeroing its kernels need."""
    seen = {}

    def fake(lhs, rhs, group_sizes, products, out_dtype, zero_padding):
        seen.update(lhs=lhs, products=products, out_dtype=out_dtype, zero_padding=zero_padding)
        return jnp.zeros((lhs.shape[0], rhs.shape[2]), out_dtype)

    monkeypatch.setattr(gmm_tokamax, "gmm_from_products", fake)
    lhs, rhs, group_sizes, _ = _operands()
    out = TokamaxGmm(implementation="xla")(lhs, rhs, group_sizes, zero_padding=False)
    assert out.shape == (ROWS, N_DIM) and seen["lhs"].shape == (128, K_DIM)
    assert bool(jnp.isfinite(seen["lhs"]).all())  # the NaN padding rows were zeroed on the way in
    assert seen["products"] == GmmProducts(TokamaxRows("xla"), TokamaxRows("xla"), XlaContract(), True)
    assert seen["zero_padding"] is True and seen["out_dtype"] == jnp.float32  # tokamax's rows are always zeroed


@pytest.mark.parametrize("expert_parallel", [2, 4])
def test_the_one_vjp_sums_the_expert_gradient_over_the_token_axes_under_expert_parallelism(expert_parallel):
    """Experts replicated over `data` (and `fsdp`) meet different tokens on each device: their gradient is the sum of
    every device's part. JAX's own transpose rules add the psum; the one custom VJP adds it itself, whatever mesh-axis
    type its kernels' outputs claim (a Pallas kernel's claims none: without the psum its gradient would be one
    device's share; these portable products' claim every axis, and the cotangent's type would not match)."""
    from tests.ep_cases import STRATEGIES, assert_matches_single_device, problem

    gmm = TokamaxGmm(implementation="xla", weight_grad=XlaContract())
    assert_matches_single_device(STRATEGIES["alltoall"], expert_parallel, problem(seed=7), gmm=gmm)
