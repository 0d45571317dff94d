"""Multi-token prediction against a reference written from DeepSeek-V3's equations (section 2.2): depth k runs on
the T - k positions that have a target, forward and gradients; unused at inference; the same numbers on an
8-device mesh with rematerialisation and scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core import mesh as mesh_lib
from dropless.core.config import Config, ConfigError, ModelConfig
from dropless.ep import make_executor
from dropless.models import transformer
from dropless.train.step import loss_fn
from tests.test_models_transformer import (FAMILIES, INIT_PARAMS, _norm, reference_block, reference_head,
                                          reference_hidden)

B, S, DEPTH, LAMBDA = 8, 8, 2, 0.4
# One MoE layer and two MTP modules with MoE blocks; GQA, whose graph compiles faster than MLA's (the MTP code
# depends on neither the attention nor the main model's depth). The balancing losses are off: they see every
# position of a module's input, also the k that the loss leaves out (transformer's docstring).
CONFIG = FAMILIES["mixtral"].replace(**{
    "model.num_layers": 1, "model.mtp_layers": DEPTH, "model.mtp_loss_weight": LAMBDA, "moe.aux_loss_weight": 0.0,
    "train.batch_size": B})


def _setup(config: Config):
    params = INIT_PARAMS(jax.random.key(0), config)
    bias = 0.05 * jax.random.normal(jax.random.key(7), transformer.init_state(config)["router_bias"].shape)
    batch = jax.random.randint(jax.random.key(8), (B, S + 1), 0, config.model.vocab_size)
    return params, {"router_bias": bias}, batch


def _cross_entropy(logits, targets):
    return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))


def reference_loss(params, state, batch, config: Config):
    """CE_main + lambda / D * sum_k CE_k, each depth on its own T - k positions:
        h'_i^k = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})]      (the checkpoint's order of the halves)
        h_{1:T-k}^k = TRM_k(h'_{1:T-k}^k),  P_{i+k+1}^k = OutHead(RMSNorm(h_i^k))
    Returns (total, (CE_main, [CE_k]))."""
    m, moe = config.model, config.moe
    inputs, targets = batch[:, :-1], batch[:, 1:]
    h, _, _ = reference_hidden(params, state, inputs, config)
    main = _cross_entropy(reference_head(params, h, config), targets)
    depths, num_moe = [], transformer.layer_counts(m)[1]
    for k in range(1, m.mtp_layers + 1):
        module = jax.tree.map(lambda a: a[k - 1], params["mtp"])
        n = S - k
        e = params["embed"][inputs[:, k:]]
        joined = jnp.concatenate([_norm(e, module["enorm"], m.rms_norm_eps),
                                  _norm(h[:, :n], module["hnorm"], m.rms_norm_eps)], axis=-1)
        h, _, _ = reference_block(module["block"], joined @ module["eh_proj"], m, moe,
                                  state["router_bias"][num_moe + k - 1])
        logits = reference_head(params, _norm(h, module["head_norm"], m.rms_norm_eps), config)
        depths.append(_cross_entropy(logits, batch[:, k + 1:k + 1 + n]))
    total = main + LAMBDA / m.mtp_layers * sum(depths)
    return total, (main, depths)


@pytest.fixture(scope="module")
def one_device():
    params, state, batch = _setup(CONFIG)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, state, batch, CONFIG), has_aux=True))
    return params, state, batch, value_and_grad(params)


def test_mtp_loss_and_gradients_match_the_paper_equations(one_device):
    params, state, batch, ((total, (cross_entropy, aux)), grads) = one_device
    reference = jax.value_and_grad(lambda p: reference_loss(p, state, batch, CONFIG), has_aux=True)
    (_, (want_main, want_depths)), want_grads = jax.jit(reference)(params)
    assert float(cross_entropy) == pytest.approx(float(want_main), rel=1e-5)
    assert float(aux["mtp_loss"]) == pytest.approx(float(np.mean(want_depths)), rel=1e-5)
    assert float(total) == pytest.approx(float(want_main + LAMBDA * np.mean(want_depths)), rel=1e-5)
    # The MTP blocks' loads follow the main model's MoE layers, one row per module.
    assert aux["moe"].tokens_per_expert.shape == (transformer.num_router_rows(CONFIG.model), CONFIG.moe.num_experts)

    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
    for (path, g), w in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)):
        scale = float(np.max(np.abs(np.asarray(w))))
        assert scale > 0, jax.tree_util.keystr(path)  # every weight, the MTP modules' too, takes part
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-4 * scale, err_msg=jax.tree_util.keystr(path))


def test_mtp_with_dense_blocks_matches_the_paper_equations():
    """model.mtp_block=dense: each module's transformer block is a dense SwiGLU layer (no router row), run like the
    MoE block; the losses against the same reference."""
    config = CONFIG.replace(**{"model.mtp_block": "dense"})
    params, state, batch = _setup(config)
    assert "mlp" in params["mtp"]["block"] and state["router_bias"].shape[0] == transformer.layer_counts(config.model)[1]
    total, (cross_entropy, aux) = jax.jit(lambda p: loss_fn(p, state, batch, config))(params)
    _, (want_main, want_depths) = jax.jit(lambda p: reference_loss(p, state, batch, config))(params)
    assert float(cross_entropy) == pytest.approx(float(want_main), rel=1e-5)
    assert float(aux["mtp_loss"]) == pytest.approx(float(np.mean(want_depths)), rel=1e-5)


def test_inference_ignores_the_mtp_modules(one_device):
    params, state, batch, _ = one_device
    plain = CONFIG.replace(**{"model.mtp_layers": 0})
    rows = transformer.layer_counts(CONFIG.model)[1]
    without = {k: v for k, v in params.items() if k != "mtp"}
    forward = lambda p, s, c: transformer.forward(p, s, batch[:, :-1], c)
    logits, aux = jax.jit(lambda p, s: forward(p, s, CONFIG))(params, state)
    want, want_aux = jax.jit(lambda p, s: forward(p, s, plain))(without, {"router_bias": state["router_bias"][:rows]})
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))
    assert "mtp_logits" not in aux and aux["moe"].tokens_per_expert.shape == want_aux["moe"].tokens_per_expert.shape


def test_mtp_on_an_8_device_mesh_with_remat_and_scan_gives_the_same_numbers(one_device):
    params, state, batch, ((want_total, (want_ce, want_aux)), want_grads) = one_device
    config = CONFIG.replace(**{"parallel.data": 2, "parallel.fsdp": 2, "parallel.expert": 2, "train.remat": "full",
                               "train.scan_layers": True})
    mesh = mesh_lib.make_mesh(config.parallel, jax.devices()[:8])
    executor = make_executor(config, mesh)
    shardings = mesh_lib.param_shardings(mesh, transformer.logical_axes(config), params)
    sharded = jax.device_put(params, shardings)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, state, b, config, executor), has_aux=True),
                             in_shardings=(shardings, mesh_lib.batch_sharding(mesh)))
    (total, (cross_entropy, aux)), grads = value_and_grad(sharded, batch)
    assert float(total) == pytest.approx(float(want_total), rel=1e-5)
    assert float(aux["mtp_loss"]) == pytest.approx(float(want_aux["mtp_loss"]), rel=1e-5)
    np.testing.assert_array_equal(np.asarray(aux["moe"].tokens_per_expert), np.asarray(want_aux["moe"].tokens_per_expert))
    def norm(tree):  # on the host: no program to compile
        return float(np.sqrt(sum(np.sum(np.asarray(leaf, np.float64) ** 2) for leaf in jax.tree.leaves(tree))))

    assert norm(grads) == pytest.approx(norm(want_grads), rel=1e-4)
    for (path, g), w in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)):
        scale = float(np.max(np.abs(np.asarray(w))))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4 * scale, err_msg=jax.tree_util.keystr(path))


def _checkpoints(jaxpr, in_scan=False):
    """(in a scan body?, prevent_cse) of every remat region of a jaxpr, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("remat2", "checkpoint"):  # jax.checkpoint's primitive
            found.append((in_scan, eqn.params["prevent_cse"]))
        inner = in_scan or eqn.primitive.name == "scan"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += _checkpoints(sub, inner)
    return found


def test_remat_moe_keeps_the_mtp_blocks_recomputation_outside_the_scan():
    """Under remat=moe with scanned layers, the MTP modules' MoE blocks run outside the scan: their checkpoint must
    prevent CSE there (XLA would otherwise merge the recomputation into the forward and keep the activations),
    while the scanned layers' may leave it off."""
    config = CONFIG.replace(**{"train.remat": "moe", "train.scan_layers": True, "model.num_layers": 2})
    params, state, batch = _setup(config)
    jaxpr = jax.make_jaxpr(lambda p: loss_fn(p, state, batch, config)[0])(params).jaxpr  # the forward's regions
    regions = _checkpoints(jaxpr)
    outside = [cse for in_scan, cse in regions if not in_scan]
    assert len(outside) == DEPTH and all(outside)  # one per MTP module
    assert [cse for in_scan, cse in regions if in_scan] == [False]  # the scanned MoE layer's


def test_bad_mtp_settings_are_config_errors():
    with pytest.raises(ConfigError, match="model.mtp_layers=-1 must be >= 0"):
        ModelConfig(mtp_layers=-1)
    with pytest.raises(ConfigError, match="model.mtp_block='attention' is not valid; choose one of moe, dense"):
        CONFIG.replace(**{"model.mtp_block": "attention"})
