"""Parameter declarations: the key order of `init`, the one-draw init, stacking, shardings and the layout table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core import params
from dropless.core.config import ModelConfig, MoEConfig, ParallelConfig
from dropless.core.mesh import make_mesh, param_shardings
from dropless.core.params import ParamSpec
from dropless.models import transformer
from dropless.models.attention import init_mla
from dropless.moe import init_moe
from tests.test_models_transformer import FAMILIES

W = ParamSpec((2, 3), ("embed", "mlp"))
NORM = ParamSpec((3,), ("mlp",), "ones")


def test_an_absent_optional_weight_keeps_its_key_and_a_lone_weight_takes_its_dict_key():
    key = jax.random.key(0)
    full = params.init(key, {"a": W, "b": W, "norm": NORM, "c": W}, 0.5)
    without_b = params.init(key, {"a": W, "b": None, "norm": NORM, "c": W}, 0.5)
    assert set(without_b) == {"a", "norm", "c"}
    for name in ("a", "c"):
        np.testing.assert_array_equal(without_b[name], full[name])
    np.testing.assert_array_equal(full["norm"], np.ones(3, np.float32))
    keys = jax.random.split(key, 4)  # "norm" takes no key
    np.testing.assert_array_equal(full["c"], 0.5 * jax.random.normal(keys[2], (2, 3)))
    lone = params.init(key, {"router": {"kernel": W}}, 0.5)
    np.testing.assert_array_equal(lone["router"]["kernel"], 0.5 * jax.random.normal(key, (2, 3)))


def test_one_draw_init_slices_one_normal_draw_in_pytree_order():
    key = jax.random.key(1)
    values = params.init_one_draw(key, {"z": W, "a": {"norm": NORM, "w": ParamSpec((4,), (None,))}}, 0.1)
    draw = 0.1 * jax.random.normal(key, (10,))
    np.testing.assert_array_equal(values["a"]["w"], draw[:4])  # "a" sorts before "z"
    np.testing.assert_array_equal(values["z"], draw[4:].reshape(2, 3))
    np.testing.assert_array_equal(values["a"]["norm"], np.ones(3, np.float32))


def test_stacking_and_the_derived_trees():
    specs = params.stacked({"w": W, "opt": None, "sub": {"norm": NORM}}, 5)
    assert params.present(specs) == {"w": ParamSpec((5, 2, 3), ("layers", "embed", "mlp")),
                                     "sub": {"norm": ParamSpec((5, 3), ("layers", "mlp"), "ones")}}
    assert params.logical_axes(specs) == {"w": ("layers", "embed", "mlp"), "sub": {"norm": ("layers", "mlp")}}
    assert params.shapes(specs)["w"] == jax.ShapeDtypeStruct((5, 2, 3), jnp.float32)
    assert [path for path, _ in params.flatten(specs)] == [("w",), ("sub", "norm")]


def test_a_spec_needs_one_known_logical_axis_per_dimension():
    with pytest.raises(AssertionError):
        ParamSpec((2, 3), ("embed",))
    with pytest.raises(AssertionError):
        ParamSpec((2,), ("no_such_axis",))


def test_shardings_from_the_declaration_equal_those_from_traced_shapes():
    config = FAMILIES["deepseek_v3"]
    mesh = make_mesh(ParallelConfig(data=2, fsdp=2, expert=2))
    specs = transformer.param_specs(config)
    traced = param_shardings(mesh, transformer.logical_axes(config), params.shapes(specs))
    assert params.shardings(mesh, specs) == traced


def test_the_layout_table_has_one_row_per_weight_as_formulas_or_numbers():
    config = FAMILIES["deepseek_v3"]
    symbolic, numeric = transformer.param_table(config), transformer.param_table(config, symbolic=False)
    paths = [".".join(path) for path, _ in params.flatten(transformer.param_specs(config))]
    for table in (symbolic, numeric):
        assert [line.split("`")[1] for line in table.splitlines()[2:]] == paths
    assert "| `moe_layers.moe.experts.gate_up` | [L-L_dense, E, D, 2*F] | (layers, experts, embed, mlp) | normal |" \
        in symbolic
    assert "| `moe_layers.attn.q_b` | [L-L_dense, Rq, H*(nope+rope)] |" in symbolic
    assert "| `moe_layers.moe.experts.gate_up` | [2, 8, 32, 32] |" in numeric
    assert "| `final_norm` | [D] | (embed) | ones |" in symbolic


def test_the_modules_key_orders_are_the_historic_ones():
    """init_moe splits its key into (router, experts, shared) even without shared experts, and each SwiGLU into
    (gate_up, down); init_mla into (q_a or q, q_b, kv_a, kv_b, o). Checkpoints and tests depend on these draws."""
    key = jax.random.key(4)
    normal = lambda k, shape: 0.5 * jax.random.normal(k, shape)
    moe = init_moe(key, 4, MoEConfig(num_experts=2, num_experts_per_tok=1, expert_intermediate_size=3,
                                     num_shared_experts=0), 0.5)
    k_router, k_experts, _ = jax.random.split(key, 3)
    np.testing.assert_array_equal(moe["router"]["kernel"], normal(k_router, (4, 2)))
    np.testing.assert_array_equal(moe["experts"]["down"], normal(jax.random.split(k_experts)[1], (2, 3, 4)))
    m = ModelConfig(hidden_size=4, num_heads=1, q_lora_rank=0, kv_lora_rank=2, qk_rope_head_dim=2,
                    qk_nope_head_dim=2, v_head_dim=2, init_std=0.5)
    mla = init_mla(key, m)
    k_q, _, k_kv_a, _, k_o = jax.random.split(key, 5)
    np.testing.assert_array_equal(mla["q"], normal(k_q, (4, 4)))
    np.testing.assert_array_equal(mla["kv_a"], normal(k_kv_a, (4, 4)))
    np.testing.assert_array_equal(mla["o"], normal(k_o, (2, 4)))
