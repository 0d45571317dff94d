"""The one-pass quantizer of both layouts (dropless.ops.fp8_pairs): its kernel, in Pallas's interpreter, gives the
bits of the quantizer applied to x and to xᵀ (`quantize_pair_reference`), which in turn are the float64 reference's
(tests/fp8_reference.py), for wide-ranging values, all-zero tiles, e4m3's range limits and non-finite values; the
kernel lowers for CUDA on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops.fp8 import E4M3_MAX, FP8
from dropless.ops.fp8_pairs import fits, quantize_pair, quantize_pair_reference
from tests import fp8_reference as ref

pair_kernel = jax.jit(lambda x, kind: quantize_pair(x, kind, interpret=True), static_argnums=1)
pair_reference = jax.jit(quantize_pair_reference, static_argnums=1)


def operand(shape, seed=0, dtype=jnp.bfloat16):
    """Values spanning 2^-20 .. 2^20 across rows, with an all-zero tile, one at e4m3's maximum, one of float32's
    largest values and one whose scale is the floor, 2^-126 (normal magnitudes: XLA flushes subnormal inputs to
    zero)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape) * 2.0 ** rng.integers(-20, 20, size=shape[:-1] + (1,))
    x[..., :128, :128] = 0.0
    x[..., 128:256, :128] = E4M3_MAX * np.sign(x[..., 128:256, :128])
    x[..., :128, 128:256] = rng.normal(size=x[..., :128, 128:256].shape) * 1e36
    tiny = rng.normal(size=x[..., 128:256, 128:256].shape)
    x[..., 128:256, 128:256] = np.sign(tiny) * (1 + np.abs(tiny)) * 1e-36
    return jnp.asarray(x, dtype)


def assert_same_bits(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))


@pytest.mark.parametrize("shape", [(256, 384), (2, 384, 256)])
@pytest.mark.parametrize("kind", ["tiles", "blocks"])
def test_kernel_gives_the_quantizers_bits_on_both_layouts(kind, shape):
    x = operand(shape)
    got = pair_kernel(x, kind)
    assert_same_bits(got, pair_reference(x, kind))
    rows, cols = got
    assert rows.values.dtype == cols.values.dtype == FP8
    assert rows.values.shape == shape and cols.values.shape == shape[:-2] + shape[:-3:-1]
    # Each layout is the float64 reference's quantization of x or xᵀ along its own last axis.
    lead = (1,) * (len(shape) - 2)
    block = (*lead, 128, 128) if kind == "blocks" else (*lead, 1, 128)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    for q, a in ((rows, x64), (cols, np.swapaxes(x64, -1, -2))):
        values, scales = ref.quantize(a, block)
        np.testing.assert_array_equal(np.asarray(q.values.astype(jnp.float32)), values)
        np.testing.assert_array_equal(np.asarray(q.scales), scales)


@pytest.mark.parametrize("kind", ["tiles", "blocks"])
def test_non_finite_values_reach_both_layouts(kind):
    """An inf makes its tile's scale NaN and so every value of the tile NaN (never 448); a NaN stays NaN."""
    x = np.array(operand((256, 256), seed=1, dtype=jnp.float32))
    x[3, 5], x[200, 130] = np.inf, np.nan
    got = pair_kernel(jnp.asarray(x), kind)
    assert_same_bits(got, pair_reference(jnp.asarray(x), kind))
    rows, cols = (np.asarray(q.values.astype(jnp.float32)) for q in got)
    assert np.isnan(rows[200, 130]) and np.isnan(cols[130, 200])
    if kind == "tiles":  # row 3's first tile and column 5's first tile
        assert np.isnan(got[0].scales[3, 0]) and np.isnan(got[1].scales[5, 0])
        assert np.all(np.isnan(rows[3, :128])) and np.all(np.isnan(cols[5, :128]))
        assert np.isfinite(got[0].scales[4, 0]) and not np.isnan(rows[4, :128]).any()
    else:
        assert np.isnan(got[0].scales[0, 0]) and np.all(np.isnan(rows[:128, :128]))
        assert not np.isnan(rows[128:, :128]).any()


def test_kernel_lowers_for_cuda_on_the_cpu():
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    for kind, shape in (("tiles", (1024, 512)), ("blocks", (4, 512, 1024))):
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(lambda x: quantize_pair(x, kind, interpret=False)).trace(
                jax.ShapeDtypeStruct(shape, jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
        assert f"dropless_quantize_pair_{kind}" in text and "__gpu$xla.gpu.triton" in text


def test_shapes_it_takes_and_one_clear_error_for_others():
    assert fits((256, 128)) and fits((3, 128, 384)) and not fits((200, 128)) and not fits((128,))
    assert not fits((0, 128, 128))
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_pair(jnp.zeros((200, 128)), "tiles")
    with pytest.raises(ValueError, match="choose from"):
        quantize_pair(jnp.zeros((128, 128)), "rows")
