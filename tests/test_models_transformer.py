"""The whole model: forward and gradients against a layer-by-layer reference for each family, causality,
precision, rematerialisation, parameter counts and logical axes."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.config import Config, ConfigError, ModelConfig, MoEConfig, TrainConfig, load_preset, preset_names
from dropless.models import transformer
from dropless.moe.reference import _one_token, reference_moe, reference_route
from tests.test_models_attention import naive_gqa, naive_mla

B, S = 2, 8


def _config(model: dict, moe: dict, **train) -> Config:
    return Config(model=ModelConfig(vocab_size=64, hidden_size=32, num_layers=3, **model),
                  moe=MoEConfig(expert_intermediate_size=16, **moe),
                  train=TrainConfig(dtype=train.pop("dtype", "float32"), seq_len=S, batch_size=B, **train))


# One tiny model per family, each switching on its family's peculiarities.
FAMILIES = {
    # MLA with q-LoRA, YaRN with the mscale softmax correction, a dense first layer, a shared expert,
    # sigmoid routing limited to 2 of 4 groups, routed scaling, and the sequence-level balance loss.
    "deepseek_v3": _config(
        dict(family="deepseek_v3", attention="mla", first_dense_layers=1, dense_intermediate_size=48, num_heads=2,
             q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                           "mscale": 1.0, "mscale_all_dim": 0.8}),
        dict(num_experts=8, num_experts_per_tok=2, num_shared_experts=1, score_func="sigmoid",
             routed_scaling_factor=2.5, n_group=4, topk_group=2, seq_aux_loss_weight=0.01)),
    # GQA (4 query heads on 2 key/value heads), softmax top-2, no shared expert, the aux loss.
    "mixtral": _config(
        dict(family="mixtral", attention="gqa", first_dense_layers=0, num_heads=4, num_kv_heads=2, head_dim=8,
             rope_theta=1e6, rms_norm_eps=1e-5),
        dict(num_experts=4, num_experts_per_tok=2, num_shared_experts=0, score_func="softmax",
             aux_loss_weight=0.02)),
    # GQA with q/k RMSNorm, tied embeddings, the z-loss.
    "qwen3_moe": _config(
        dict(family="qwen3_moe", attention="gqa", first_dense_layers=0, num_heads=4, num_kv_heads=1, head_dim=8,
             qk_norm=True, tie_embeddings=True),
        dict(num_experts=8, num_experts_per_tok=2, num_shared_experts=0, score_func="softmax",
             aux_loss_weight=0.01, z_loss_weight=0.001)),
}


# DeepSeek-V3's parts with a MoE layer first and a dense layer between two MoE layers: three runs of layers.
INTERLEAVED = FAMILIES["deepseek_v3"].replace(**{"model.first_dense_layers": 0, "model.layer_pattern": "MDM"})


# The whole forward pass as one program (op by op, each of its operations would compile on its own), compiled once
# per config and process, and shared by the tests here and in other files.
FORWARD = jax.jit(transformer.forward, static_argnums=3, static_argnames=("mtp", "hidden"))


# Parameters drawn by one program per config, whatever the seed, shared like FORWARD.
INIT_PARAMS = jax.jit(transformer.init_params, static_argnums=1)


def _setup(config: Config, seed=0):
    params = INIT_PARAMS(jax.random.key(seed), config)
    # A non-zero router bias, different in each layer, checks that layer l gets its own bias row.
    state = transformer.init_state(config)
    state = {"router_bias": 0.05 * jax.random.normal(jax.random.key(7), state["router_bias"].shape)}
    tokens = jax.random.randint(jax.random.key(8), (B, S), 0, config.model.vocab_size)
    return params, state, tokens


def _norm(v, w, eps):
    return w * v / jnp.sqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)


def _swiglu(p, x):
    width = p["down"].shape[0]
    h = x @ p["gate_up"]
    return jax.nn.silu(h[..., :width]) * h[..., width:] @ p["down"]


def host_route(h_TD, kernel_DE, bias_E, moe_cfg):
    """`reference_route` (NumPy, float64) as a host callback, so that a jitted reference routes by it too; the
    choice is discrete, so no gradient flows through it."""
    shape = jax.ShapeDtypeStruct((h_TD.shape[0], moe_cfg.num_experts_per_tok), jnp.int32)
    route = lambda x, w, b: reference_route(x, w, b, moe_cfg)
    return jax.pure_callback(route, shape, *map(jax.lax.stop_gradient, (h_TD, kernel_DE, bias_E)))


def reference_block(layer, x, m, moe_cfg, bias=None, ids=None):
    """One pre-norm decoder layer on [B, S, D]: naive per-head attention, then the SwiGLU MLP (a dense layer) or
    the per-token MoE oracle, routed by `ids` or else by `host_route`. Returns (x, expert ids or None, balance
    loss)."""
    naive_attention = naive_mla if m.attention == "mla" else naive_gqa
    h = _norm(x, layer["attn_norm"], m.rms_norm_eps)
    x = x + jax.vmap(lambda h_SD: naive_attention(layer["attn"], h_SD, m))(h)  # sequence by sequence
    h = _norm(x, layer["mlp_norm"], m.rms_norm_eps)
    if "mlp" in layer:
        return x + _swiglu(layer["mlp"], h), None, 0.0
    if ids is None:
        ids = host_route(h.reshape(-1, m.hidden_size), layer["moe"]["router"]["kernel"], bias, moe_cfg)
    if isinstance(ids, jax.core.Tracer):  # under jit: the oracle's per-token function, without its NumPy counts
        assert moe_cfg.aux_loss_weight == moe_cfg.seq_aux_loss_weight == 0, "balance losses need concrete ids"
        keep_K = jnp.ones((moe_cfg.num_experts_per_tok,), bool)
        one_token = lambda x_D, ids_K: _one_token(layer["moe"], x_D, ids_K, keep_K, moe_cfg)
        y_TD, _, log_partition_T = jax.vmap(one_token)(h.reshape(-1, m.hidden_size), ids)
        return x + y_TD.reshape(h.shape), ids, moe_cfg.z_loss_weight * jnp.mean(log_partition_T ** 2)
    y, losses = reference_moe(layer["moe"], h, ids, moe_cfg)
    return x + y, ids, losses["balance_loss"]


def reference_hidden(params, state, tokens, config: Config, routes=None):
    """The main model layer after layer in a Python loop, in `model.layer_types` order; returns (the output after
    the final norm, summed balance loss, expert ids per MoE layer).

    `routes` (one [T, K] array per MoE layer) fixes the expert choice; when None it is computed with
    `reference_route` from concrete values and returned, so a second, traced call can reuse it.
    """
    m = config.model
    x = params["embed"][tokens]
    chosen, balance, seen = [], 0.0, {"D": 0, "M": 0}
    for kind in m.layer_types:
        l = seen[kind]
        seen[kind] += 1
        layer = jax.tree.map(lambda a: a[l], params["dense_layers" if kind == "D" else "moe_layers"])
        ids = None if routes is None or kind == "D" else routes[l]
        x, ids, loss = reference_block(layer, x, m, config.moe, state["router_bias"][l], ids)
        if kind == "M":
            chosen.append(ids)
        balance = balance + loss
    return _norm(x, params["final_norm"], m.rms_norm_eps), balance, chosen


def reference_head(params, h, config: Config):
    return h @ (params["embed"].T if config.model.tie_embeddings else params["lm_head"])


def reference_forward(params, state, tokens, config: Config, routes=None):
    """(logits, balance loss, expert ids per MoE layer) of `reference_hidden`."""
    h, balance, chosen = reference_hidden(params, state, tokens, config, routes)
    return reference_head(params, h, config), balance, chosen



@pytest.mark.parametrize("family", FAMILIES)
def test_forward_matches_layer_by_layer_reference(family):
    config = FAMILIES[family]
    params, state, tokens = _setup(config)
    logits, aux = FORWARD(params, state, tokens, FAMILIES[family])
    want_logits, want_balance, _ = reference_forward(params, state, tokens, config)
    assert logits.dtype == jnp.float32 and logits.shape == (B, S, config.model.vocab_size)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-4, atol=1e-5)
    assert float(aux["balance_loss"]) > 0
    assert float(aux["balance_loss"]) == pytest.approx(float(want_balance), rel=1e-4)


def test_gradients_match_layer_by_layer_reference():
    config = FAMILIES["deepseek_v3"]  # the family with the most parts: MLA, YaRN, dense layer, shared expert
    params, state, tokens = _setup(config)
    _, _, routes = reference_forward(params, state, tokens, config)  # concrete pass: the expert choice
    probe = jax.random.normal(jax.random.key(3), (B, S, config.model.vocab_size))

    def ours(p):
        logits, aux = transformer.forward(p, state, tokens, config)
        return jnp.sum(logits * probe) + aux["balance_loss"]

    def reference(p):
        logits, balance, _ = reference_forward(p, state, tokens, config, routes)
        return jnp.sum(logits * probe) + balance

    grads, want_grads = jax.jit(jax.grad(ours))(params), jax.jit(jax.grad(reference))(params)
    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
    for (path, g), w in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)):
        scale = float(np.max(np.abs(np.asarray(w))))
        assert scale > 0, jax.tree_util.keystr(path)  # every parameter takes part
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-4 * scale, err_msg=jax.tree_util.keystr(path))


def test_aux_stacks_moe_stats_over_moe_layers_and_causality_holds():
    config = FAMILIES["deepseek_v3"]
    params, state, tokens = _setup(config)
    forward = lambda p, s, t: FORWARD(p, s, t, config)
    logits, aux = forward(params, state, tokens)
    num_moe = config.model.num_layers - config.model.first_dense_layers
    assert aux["moe"].tokens_per_expert.shape == (num_moe, config.moe.num_experts)
    np.testing.assert_array_equal(np.asarray(aux["moe"].tokens_per_expert).sum(-1), B * S * config.moe.num_experts_per_tok)
    np.testing.assert_allclose(float(aux["balance_loss"]), float(aux["moe"].balance_loss.sum()), rtol=1e-6)
    # Changing the tokens from position 5 on leaves the logits of positions 0..4 exactly unchanged.
    later = tokens.at[:, 5:].set((tokens[:, 5:] + 1) % config.model.vocab_size)
    changed, _ = forward(params, state, later)
    np.testing.assert_array_equal(np.asarray(changed[:, :5]), np.asarray(logits[:, :5]))
    assert not np.allclose(np.asarray(changed[:, 5:]), np.asarray(logits[:, 5:]))


def test_bfloat16_compute_stays_close_to_float32():
    config = FAMILIES["deepseek_v3"]
    params, state, tokens = _setup(config)
    full, _ = FORWARD(params, state, tokens, config)
    half, _ = FORWARD(params, state, tokens, config.replace(**{"train.dtype": "bfloat16"}))
    assert half.dtype == jnp.float32  # logits stay float32 whatever the compute dtype
    full, half = np.asarray(full), np.asarray(half)
    assert np.abs(half - full).max() < 0.05 * np.abs(full).max()
    assert np.mean(np.argmax(half, -1) == np.argmax(full, -1)) > 0.9


def _has_remat(jaxpr: str) -> bool:
    # jax.checkpoint's primitive prints as `remat2[...]` (older JAX) or `checkpoint[...]`.
    return re.search(r"\b(remat\w*|checkpoint)\[", jaxpr) is not None


# Mixtral's parts in two layers: two scanned iterations, or two unrolled copies of the layer.
REMAT_MODEL = FAMILIES["mixtral"].replace(**{"model.num_layers": 2})


def _jaxpr_and_value_and_grad(config: Config):
    """The jaxpr of the mean squared logits' value and gradient, and their values, from one trace."""
    params, state, tokens = _setup(config)
    loss = lambda p: jnp.mean(transformer.forward(p, state, tokens, config)[0] ** 2)
    traced = jax.jit(jax.value_and_grad(loss)).trace(params)
    return str(traced.jaxpr), traced.lower().compile()(params)


@pytest.fixture(scope="module")
def plain_loss_and_grads():
    jaxpr, loss_and_grads = _jaxpr_and_value_and_grad(REMAT_MODEL)
    assert not _has_remat(jaxpr)
    return loss_and_grads


# remat=full without offloading differs from the offloading case only in its policy (nothing saved).
@pytest.mark.parametrize("remat, offload", [("moe", ""), ("full", "attn_out,moe_out")])
def test_rematerialisation_changes_memory_not_numbers(remat, offload, plain_loss_and_grads):
    jaxpr, (got, got_grads) = _jaxpr_and_value_and_grad(
        REMAT_MODEL.replace(**{"train.remat": remat, "train.offload": offload}))
    assert _has_remat(jaxpr)
    want, want_grads = plain_loss_and_grads
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_unrolled_layers_give_the_scanned_numbers(remat, plain_loss_and_grads):
    jaxpr, (got, got_grads) = _jaxpr_and_value_and_grad(
        REMAT_MODEL.replace(**{"train.scan_layers": False, "train.remat": remat}))
    assert "scan[" not in jaxpr
    want, want_grads = plain_loss_and_grads
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("overrides, message", [
    ({"train.offload": "moe_out,attn"}, "unknown activation"),
    ({"train.offload": "moe_out", "train.remat": "moe"}, "train.remat=full"),
])
def test_bad_offload_settings_are_config_errors(overrides, message):
    """Refused when the config is built (core.config), before any model is traced."""
    with pytest.raises(ConfigError, match=message):
        FAMILIES["mixtral"].replace(**overrides)


def test_all_dense_model_reports_empty_moe_stats():
    config = FAMILIES["deepseek_v3"].replace(**{"model.first_dense_layers": 3})
    params, state, tokens = _setup(config)
    assert "moe_layers" not in params and state["router_bias"].shape == (0, config.moe.num_experts)
    logits, aux = jax.jit(lambda p, s: transformer.forward(p, s, tokens, config))(params, state)
    assert logits.shape == (B, S, config.model.vocab_size)
    assert aux["moe"].tokens_per_expert.shape == (0, config.moe.num_experts) and float(aux["balance_loss"]) == 0.0


def _configs_to_count():
    yield from ((name, load_preset(name)) for name in preset_names())
    yield from FAMILIES.items()
    yield "mla_without_q_lora", FAMILIES["deepseek_v3"].replace(**{"model.q_lora_rank": 0})
    yield "interleaved_with_mtp", INTERLEAVED.replace(**{"model.mtp_layers": 2})
    yield "dense_mtp_block", FAMILIES["qwen3_moe"].replace(**{"model.mtp_layers": 1, "model.mtp_block": "dense"})


@pytest.mark.parametrize("name, config", list(_configs_to_count()))
def test_param_counts_logical_axes_and_layout_agree_with_init_params(name, config):
    shapes = jax.eval_shape(lambda key: transformer.init_params(key, config), jax.random.key(0))
    total, active = transformer.param_counts(config)
    leaves = jax.tree.leaves_with_path(shapes)
    assert total == sum(math.prod(leaf.shape) for _, leaf in leaves)
    moe = config.moe
    routed = sum(math.prod(leaf.shape) for path, leaf in leaves if "experts" in jax.tree_util.keystr(path)
                 and "shared" not in jax.tree_util.keystr(path))
    assert active == total - routed + routed * moe.num_experts_per_tok // moe.num_experts
    assert all(leaf.dtype == jnp.float32 for _, leaf in leaves)

    axes = transformer.logical_axes(config)
    is_axes = lambda leaf: isinstance(leaf, tuple)
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(shapes)
    known = {"layers", "vocab", "embed", "q_lora", "kv_lora", "heads_x_dim", "mlp", "experts", "router", None}
    for names, leaf in zip(jax.tree.leaves(axes, is_leaf=is_axes), jax.tree.leaves(shapes)):
        assert len(names) == leaf.ndim and set(names) <= known

    m = config.model
    num_dense, num_moe = m.layer_types.count("D"), m.layer_types.count("M")
    if num_dense:
        assert shapes["dense_layers"]["mlp"]["gate_up"].shape == (num_dense, m.hidden_size, 2 * m.dense_intermediate_size)
    if num_moe:
        experts = shapes["moe_layers"]["moe"]["experts"]
        assert experts["gate_up"].shape == (num_moe, moe.num_experts, m.hidden_size, 2 * moe.expert_intermediate_size)
        assert shapes["moe_layers"]["moe"]["router"]["kernel"].shape == (num_moe, m.hidden_size, moe.num_experts)
    assert ("lm_head" in shapes) == (not m.tie_embeddings)
    assert ("mtp" in shapes) == (m.mtp_layers > 0)
    assert transformer.init_state(config)["router_bias"].shape == (num_moe + (m.mtp_block == "moe") * m.mtp_layers,
                                                                   moe.num_experts)


@pytest.mark.parametrize("name, overrides, total_b, active_b", [
    # Published: 671B total and 37B activated for the main model, 685B with the MTP module ("14B"), which holds
    # a copy of the embedding and of the output head (2 x 0.93B) that dropless shares with the main model.
    ("deepseek-v3-671b", {"model.mtp_layers": 0}, 671.0, 37.6),
    ("deepseek-v3-671b", {}, 682.6, 38.24),
    ("mixtral-8x7b", {}, 46.7, 12.9),       # published: 46.7B total, 12.9B active
    ("qwen3-30b-a3b", {}, 30.5, 3.35),      # published: 30.5B total, 3.3B activated
])
def test_param_counts_of_published_models(name, overrides, total_b, active_b):
    total, active = transformer.param_counts(load_preset(name).replace(**overrides))
    assert total / 1e9 == pytest.approx(total_b, abs=0.05)
    assert active / 1e9 == pytest.approx(active_b, abs=0.05)


def test_init_params_values():
    config = FAMILIES["deepseek_v3"]
    params, _, _ = _setup(config)
    layers = params["moe_layers"]
    np.testing.assert_array_equal(np.asarray(layers["attn_norm"]), 1.0)
    np.testing.assert_array_equal(np.asarray(layers["attn"]["kv_a_norm"]), 1.0)
    np.testing.assert_array_equal(np.asarray(params["final_norm"]), 1.0)
    experts = np.asarray(layers["moe"]["experts"]["gate_up"])
    assert experts.std() == pytest.approx(config.model.init_std, rel=0.05) and abs(experts.mean()) < 1e-3
    # Each stacked layer is drawn independently.
    assert not np.allclose(np.asarray(layers["attn"]["o"][0]), np.asarray(layers["attn"]["o"][1]))


# ----------------------------------------------------------------------------------------------- layer patterns


def test_layer_runs_and_stack_positions_follow_the_pattern():
    m = ModelConfig(num_layers=6, first_dense_layers=1, layer_pattern="DMMDMD")
    assert transformer.layer_runs(m) == [("D", 0, 1), ("M", 0, 2), ("D", 1, 2), ("M", 2, 3), ("D", 2, 3)]
    assert [transformer.stack_position(m, i) for i in (0, 3, 4)] == [("dense_layers", 0), ("dense_layers", 1),
                                                                     ("moe_layers", 2)]
    assert transformer.layer_counts(m) == (3, 3)
    assert ModelConfig(num_layers=4, first_dense_layers=1).layer_types == "DMMM"


@pytest.mark.parametrize("model, message", [
    ({"layer_pattern": "DMX"}, "only the letters D"),
    ({"layer_pattern": "DM"}, "has 2 letters but model.num_layers=3"),
    ({"layer_pattern": "MDM"}, "model.first_dense_layers=1 disagrees.*set model.first_dense_layers=0"),
])
def test_bad_layer_patterns_are_config_errors(model, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(num_layers=3, first_dense_layers=1, **model)


@pytest.fixture(scope="module")
def interleaved_grads():
    params, state, tokens = _setup(INTERLEAVED)
    probe = jax.random.normal(jax.random.key(3), (B, S, INTERLEAVED.model.vocab_size))

    def value_and_grad(config):
        def loss(p):
            logits, aux = transformer.forward(p, state, tokens, config)
            return jnp.sum(logits * probe) + aux["balance_loss"], (logits, aux)
        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    return params, state, tokens, value_and_grad, value_and_grad(INTERLEAVED)(params)


def test_interleaved_layers_match_the_reference(interleaved_grads):
    params, state, tokens, _, ((_, (logits, aux)), _) = interleaved_grads
    want_logits, want_balance, routes = reference_forward(params, state, tokens, INTERLEAVED)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-4, atol=1e-5)
    assert float(aux["balance_loss"]) == pytest.approx(float(want_balance), rel=1e-4)
    assert aux["moe"].tokens_per_expert.shape == (2, INTERLEAVED.moe.num_experts)
    # Each MoE layer reads its own bias row: the stats follow the layers' order.
    for l, ids in enumerate(routes):
        counts = np.bincount(np.asarray(ids).ravel(), minlength=INTERLEAVED.moe.num_experts)
        np.testing.assert_array_equal(np.asarray(aux["moe"].tokens_per_expert[l]), counts)


def test_interleaved_layers_unrolled_give_the_scanned_gradients_and_stack_the_moe_stats_like_scan(
        interleaved_grads):
    params, _, _, value_and_grad, ((want, (_, want_aux)), want_grads) = interleaved_grads
    (got, (_, got_aux)), got_grads = value_and_grad(INTERLEAVED.replace(**{"train.scan_layers": False}))(params)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert jax.tree.structure(got_aux) == jax.tree.structure(want_aux)
    for g, w in zip(jax.tree.leaves(got_aux), jax.tree.leaves(want_aux)):  # the MoE stats, one row per MoE layer
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)
