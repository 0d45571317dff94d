"""FP8 on the wire (moe.dispatch_dtype=float8): rows towards the experts travel as e4m3 with per-tile scales.

Checked three ways: the quantizer's rounding is within e4m3's precision; on inputs whose values FP8 holds exactly,
every strategy's layer (output and all gradients) equals the single-device layer as tightly as without FP8, so
that what moves, where its scales go and the backward's transposes are all right; and on random inputs the rows
really are rounded and really cross the link as float8 (in the forward dispatch and the backward combine).
"""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.config import Config, ConfigError, MoEConfig, ParallelConfig
from dropless.ep import AllToAll, Auto, Chunked, make_strategy
from dropless.ep.wire import FP8, FP8_MAX, TILE, Wire, dequantize, quantize, tile_size
from tests.ep_cases import MOE, SKEWED_BIAS, STRATEGIES, assert_matches_single_device, executor, layer, problem

FLOAT8 = Wire("float8")


def _fp8_strategy(name):
    return dataclasses.replace(STRATEGIES[name], wire=FLOAT8)


def test_quantize_rounds_within_e4m3_precision_tile_by_tile():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 2 * TILE)) * np.array([1e-3, 1e3])[np.arange(2 * TILE) // TILE]  # tiles of unlike size
    x[1, :TILE] = 0.0  # an all-zero tile
    q, scale = quantize(jnp.asarray(x, jnp.float32))
    assert q.dtype == FP8 and q.shape == x.shape and scale.shape == (6, 2)
    np.testing.assert_allclose(np.max(np.abs(np.asarray(q, np.float32)), axis=1), FP8_MAX)  # the largest maps to 448
    back = np.asarray(dequantize(q, scale, jnp.float32))
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2**-4 for normals; below 2**-6 (subnormals) an
    # absolute one of 2**-10, in units of the tile's scale.
    bound = 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * np.repeat(np.asarray(scale), TILE, axis=1)
    assert np.all(np.abs(back - x) <= bound)
    assert np.all(back[1, :TILE] == 0.0)
    assert not np.allclose(back, x, rtol=1e-3)  # it does round
    assert tile_size(7168) == TILE and tile_size(8) == 8  # a row that 128 does not divide: one scale per row


def _fp8_exact_problem(seed, bias_E=None):
    """A `problem` whose input and output cotangent FP8 holds exactly: e4m3 values times 2**-8, each row with one
    +-448 (so every row's scale is 448 * 2**-8 / 448, a power of two, and quantizing changes nothing)."""
    params, bias_E, x_BSD, cotangent_BSD = problem(seed, bias_E)

    def representable(a):
        values = np.array(jnp.asarray(np.clip(a * 100.0, -440, 440), jnp.float32).astype(FP8).astype(jnp.float32))
        values[..., 0] = FP8_MAX * np.where(np.arange(values.shape[1]) % 2, 1.0, -1.0)[None, :]
        return (values * 2.0 ** -8).astype(np.float32)
    return params, bias_E, representable(x_BSD), representable(cotangent_BSD)


@pytest.mark.parametrize("expert_parallel", [2, 8])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_fp8_wire_equals_single_device_where_fp8_holds_the_values(name, expert_parallel):
    assert_matches_single_device(_fp8_strategy(name), expert_parallel, _fp8_exact_problem(seed=expert_parallel))


def test_fp8_wire_through_overflowing_alltoall_slots_and_chunks_equals_single_device():
    """The worst-case exchange that alltoall takes on overflow (a lax.cond), and the dispatch in chunks."""
    skewed = _fp8_exact_problem(seed=7, bias_E=SKEWED_BIAS)
    strategy = AllToAll(buffer_factor=1.0, wire=FLOAT8)
    assert int(assert_matches_single_device(strategy, 4, skewed).dispatch_overflowed) == 1
    assert_matches_single_device(Chunked(_fp8_strategy("allgather"), 2), 2, _fp8_exact_problem(seed=3))


def _wire_collectives(lowered_text: str) -> list[tuple[str, str]]:
    """(collective, operand type) of every all_gather, all_to_all and reduce_scatter in StableHLO text."""
    return re.findall(r'"stablehlo\.(all_gather|all_to_all|reduce_scatter)".*?\}> .*?: \((tensor<[^>]*>)', lowered_text,
                      re.S)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_fp8_wire_rounds_random_rows_and_moves_them_as_float8(name):
    case = problem(seed=5)
    y_want, grads_want, _ = layer(None, MOE, *case)
    fp8_executor = executor(_fp8_strategy(name), 4)
    y_got, grads_got, stats = layer(fp8_executor, MOE, *case)
    assert int(stats.tokens_dropped) == 0
    error = np.linalg.norm(np.asarray(y_got) - y_want) / np.linalg.norm(y_want)
    assert 1e-4 < error < 2.0 ** -4  # rounded, by about e4m3's precision
    experts_got, experts_want = grads_got[0]["experts"]["gate_up"], grads_want[0]["experts"]["gate_up"]
    error = np.linalg.norm(np.asarray(experts_got) - experts_want) / np.linalg.norm(experts_want)
    assert 1e-4 < error < 2.0 ** -3
    text = layer.lower(fp8_executor, MOE, *case).as_text()
    fp8 = [op for op, operand in _wire_collectives(text) if "f8E4M3FN" in operand]
    # Forward: the tokens out. Backward: the output's gradient out (the combine's transpose; for the emulated
    # ragged_all_to_all, built from all_gather, that transpose is a reduce_scatter).
    assert len(fp8) == 2, _wire_collectives(text)


def test_dispatch_dtype_config():
    tiny = Config(moe=MoEConfig(num_experts=8, dispatch_dtype="float8"), parallel=ParallelConfig(expert=4))
    assert make_strategy(tiny) == Auto(2.0, True, FLOAT8)
    assert make_strategy(tiny.replace(**{"moe.dispatch": "ragged"}), platform="gpu").wire == FLOAT8
    assert make_strategy(tiny.replace(**{"moe.dispatch_dtype": "compute"})).wire == Wire()
    with pytest.raises(ConfigError, match="moe.dispatch_dtype='e5m2' is not valid; choose one of compute, float8"):
        MoEConfig(dispatch_dtype="e5m2")
