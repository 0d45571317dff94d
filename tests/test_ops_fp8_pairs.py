"""The one-pass quantizer of both layouts (dropless.ops.fp8_pairs): its kernel, in Pallas's interpreter, gives the
bits of the quantizer applied to x and to xᵀ (`quantize_pair_reference`), which in turn are the float64 reference's
(tests/fp8_reference.py), for wide-ranging values, all-zero tiles, e4m3's range limits and non-finite values; the
kernel lowers for CUDA on the CPU."""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops.fp8 import E4M3_MAX, FP8, power_of_two_scale, scale_exponent
from dropless.ops.fp8_pairs import fits, quantize_pair, quantize_pair_reference
from tests import fp8_reference as ref

pair_kernel = jax.jit(lambda x, kind: quantize_pair(x, kind, interpret=True), static_argnums=1)
pair_reference = jax.jit(quantize_pair_reference, static_argnums=1)


def operand(shape, seed=0, dtype=jnp.bfloat16):
    """Values spanning 2^-20 .. 2^20 across rows, with an all-zero tile, one at e4m3's maximum, one next to
    bfloat16's largest value (scale 2^120) and one whose scale is the 2^-126 floor (normal magnitudes near 1e-37:
    XLA flushes subnormal inputs to zero)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape) * 2.0 ** rng.integers(-20, 20, size=shape[:-1] + (1,))
    tile = x[..., :128, :128].shape
    sign = lambda: np.where(rng.random(tile) < 0.5, -1.0, 1.0)
    x[..., :128, :128] = 0.0
    x[..., 128:256, :128] = E4M3_MAX * sign()
    x[..., :128, 128:256] = sign() * rng.uniform(0.5, 1.0, tile) * float(jnp.finfo(jnp.bfloat16).max)
    x[..., 128:256, 128:256] = sign() * (1 + np.abs(rng.normal(size=tile))) * 1e-37
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
def test_non_finite_values_make_their_tiles_nan(kind):
    """An inf or a NaN makes its tile's scale NaN in each layout, and so every value of the tile NaN (never 448,
    never a finite scale that a maximum skipping NaN would give)."""
    x = np.array(operand((256, 256), seed=1, dtype=jnp.float32))
    x[3, 5], x[200, 130] = np.inf, np.nan
    got = pair_kernel(jnp.asarray(x), kind)
    assert_same_bits(got, pair_reference(jnp.asarray(x), kind))
    (rows, rows_scales), (cols, cols_scales) = ((np.asarray(q.values.astype(jnp.float32)), np.asarray(q.scales))
                                                for q in got)
    if kind == "tiles":  # row 3 / column 5 in the first tile of their line, row 200 / column 130 in the second
        assert np.isnan(rows_scales[3, 0]) and np.isnan(rows_scales[200, 1])
        assert np.isnan(cols_scales[5, 0]) and np.isnan(cols_scales[130, 1])
        assert np.all(np.isnan(rows[3, :128])) and np.all(np.isnan(rows[200, 128:]))
        assert np.all(np.isnan(cols[5, :128])) and np.all(np.isnan(cols[130, 128:]))
        assert np.isnan(rows_scales).sum() == 2 and np.isnan(cols_scales).sum() == 2
        assert np.isnan(rows).sum() == 256 and np.isnan(cols).sum() == 256
    else:
        np.testing.assert_array_equal(np.isnan(rows_scales), [[True, False], [False, True]])
        assert np.all(np.isnan(rows[:128, :128])) and np.all(np.isnan(rows[128:, 128:]))
        assert not np.isnan(rows[128:, :128]).any() and not np.isnan(cols[:128, 128:]).any()


def test_scale_exponent_is_exact_for_every_float32():
    """The scale read off amax's bits against exact rational arithmetic: the smallest e with amax / 2^e <= 448,
    at least -126, for random normal float32 bit patterns and the edges. A subnormal amax gives the floor, or 0
    where XLA flushes it to zero (the CPU): its block quantizes to zeros either way."""
    rng = np.random.default_rng(0)
    edges = np.array([np.finfo(np.float32).tiny, np.finfo(np.float32).smallest_subnormal, 448 * 2.0 ** -127,
                      448 * 2.0 ** -126, np.nextafter(np.float32(448 * 2.0 ** -126), np.float32(1)),
                      np.finfo(np.float32).max, 448.0, np.nextafter(np.float32(448), np.float32(1e3)), 224.0,
                      1.0, 2.0 ** -20, 448 * 2.0 ** 100, np.nextafter(np.float32(448 * 2.0 ** 100), np.float32(np.inf)),
                      2.0 ** 127, 3 * 2.0 ** 126], np.float32)
    amax = np.concatenate([edges, rng.integers(0x00800000, 0x7F800000, size=20000, dtype=np.int64)
                           .astype(np.uint32).view(np.float32)])
    got = np.asarray(jax.jit(scale_exponent)(jnp.asarray(amax)))
    for a, e in zip(amax.tolist(), got.tolist()):
        if a < np.finfo(np.float32).tiny:
            assert e in (0, -126), (a, e)
            continue
        exact = Fraction(a)
        want = math.floor(math.log2(a)) - 12
        while exact / Fraction(2) ** want > 448:
            want += 1
        assert e == max(want, -126), (a, e, want)
    assert got.max() == 120
    scales = np.asarray(power_of_two_scale(jnp.asarray([0.0, np.inf, np.nan, 448.0], jnp.float32)))
    assert scales[0] == 1 and np.isnan(scales[1]) and np.isnan(scales[2]) and scales[3] == 1


def test_recipe_takes_the_two_pass_quantizer_where_the_kernel_does_not_fit(monkeypatch):
    from dropless.fp8 import Recipe
    from dropless.fp8.recipe import one_pass_pair, weight_copies
    from dropless.ops import fp8_pairs

    def refuse(*_, **__):
        raise AssertionError("the one-pass kernel ran")

    monkeypatch.setattr(fp8_pairs, "quantize_pair", refuse)
    recipe = Recipe("blockwise", native=True)
    w = jax.ShapeDtypeStruct((256, 2048, 7168), jnp.bfloat16)  # traced only: nothing of its 7.5 GB is allocated
    w_fwd, w_dlhs = jax.eval_shape(lambda w: weight_copies(w, recipe), w)
    assert w_fwd.values.shape == (256, 7168, 2048) and w_dlhs.scales.shape == (256, 16, 56)
    assert one_pass_pair(jax.ShapeDtypeStruct((2**24, 256), jnp.bfloat16), recipe) is None
    with pytest.raises(AssertionError, match="one-pass kernel ran"):
        jax.eval_shape(lambda w: weight_copies(w, recipe), jax.ShapeDtypeStruct((256, 7168, 4096), jnp.bfloat16))


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
    assert not fits((128, 200)) and not fits((3, 128, 130))
    assert not fits((0, 128, 128))
    for shape in ((200, 128), (128, 200)):
        with pytest.raises(ValueError, match="multiples of 128"):
            quantize_pair(jnp.zeros(shape), "tiles")
    # Pallas Triton addresses an e4m3 output of 2**31 .. 2**32 bytes with wrapping 32-bit offsets: the operands of
    # those sizes (DeepSeek-V3's down projection with 256 experts) go to the two-pass quantizer, and the ones below
    # and above stay on the kernel.
    assert not fits((256, 2048, 7168)) and not fits((2**24, 256)) and not fits((2**25, 128))
    assert fits((146, 2048, 7168)) and fits((256, 7168, 4096)) and fits((2**24 + 128, 256))
    with pytest.raises(ValueError, match="choose from"):
        quantize_pair(jnp.zeros((128, 128)), "rows")
