"""FP8 recipes (dropless.ops.fp8, dropless.fp8) against the float64 reference of tests/fp8_reference.py.

The quantizer: the same e4m3 values and power-of-two scales as the reference, within half an e4m3 ulp per value,
no inf or NaN from scaling at e4m3's range limits, non-finite input kept non-finite. Each product (dense and
grouped, forward and both gradients) equals the reference that quantizes the same operands the same way and
multiplies in float64, to float32 rounding: dequantized operands are exact, so only the float32 accumulation
differs. The e4m3 kernels (Pallas's GPU interpreter) equal the dequantized path to float32 rounding.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.config import ConfigError, load_preset
from dropless.fp8 import Fp8Gmm, Recipe, experts_gmm, fp8_matmul, linear, make_recipe, train_recipe
from dropless.fp8.grouped import Fp8Products, aligned_sources
from dropless.gmm import XlaGmm, fp8_mosaic
from dropless.gmm.xla import XlaContract
from dropless.ops import fp8_pairs
from dropless.ops.fp8 import E4M3_MAX, FP8, dequantize, fake_quantize, power_of_two_scale, quantize
from tests import fp8_reference as ref

MODES = ("rowwise", "blockwise", "mxfp8")
# float32 accumulation against float64 over a few hundred terms, relative to the output's norm
F32_RTOL = 2e-6


# The quantizer as one program per block shape: op by op, each of its operations compiles on its own, which costs
# most of the quantizer tests' time.
jit_quantize = jax.jit(quantize, static_argnums=1)
jit_dequantize = jax.jit(dequantize, static_argnums=1)


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def wide_range(rng, shape):
    """Values whose magnitude spans 2^-20 .. 2^20 across rows and blocks, so each scale choice matters."""
    return rng.normal(size=shape) * 2.0 ** rng.integers(-20, 20, size=shape[:-1] + (1,))


@pytest.mark.parametrize("block", [(1, None), (1, 128), (128, 128), (1, 32), (3, 50)])
def test_quantizer_matches_the_float64_reference_and_its_error_bound(block):
    rng = np.random.default_rng(0)
    x = wide_range(rng, (300, 260)).astype(np.float32)
    q = jit_quantize(jnp.asarray(x), block)
    want_values, want_scales = ref.quantize(x, block)
    np.testing.assert_array_equal(np.asarray(q.scales), want_scales)
    np.testing.assert_array_equal(np.asarray(q.values.astype(jnp.float32)), want_values)
    assert q.values.dtype == FP8 and np.all(np.log2(want_scales) == np.round(np.log2(want_scales)))
    deq = np.asarray(jit_dequantize(q, block), np.float64)
    # each value's bound: half an e4m3 ulp of it, or half the subnormal spacing of its block's scale
    scales = np.ones_like(x, np.float64)
    ext = [n if b is None else b for n, b in zip(x.shape, block)]
    for idx in np.ndindex(*want_scales.shape):
        scales[tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, ext))] = want_scales[idx]
    err = np.abs(deq - x)
    assert np.all(err <= np.maximum(2.0 ** -4 * np.abs(x), 2.0 ** -10 * scales) * (1 + 1e-12))


def test_quantizer_at_the_range_limits_and_with_non_finite_values():
    x = jnp.asarray([[E4M3_MAX, -E4M3_MAX, 1.0, 0.0], [3e38, -3e38, 1e-38, 0.0], [0.0] * 4,
                     [1e-45, 0.0, 0.0, 0.0], [jnp.inf, 1.0, 0.0, 0.0], [jnp.nan, 1.0, 0.0, 0.0]], jnp.float32)
    q = jit_quantize(x, (1, None))
    deq = np.asarray(jit_dequantize(q, (1, None)))
    np.testing.assert_array_equal(deq[0], [E4M3_MAX, -E4M3_MAX, 1.0, 0.0])  # 448 is its own scale's maximum
    assert np.all(np.isfinite(deq[:4])) and abs(deq[1, 0] / 3e38 - 1) < 2 ** -4
    np.testing.assert_array_equal(deq[2], 0.0)  # an all-zero block: scale 1, zeros
    assert float(q.scales[2, 0]) == 1.0
    assert np.all(np.isnan(deq[4])) and np.all(np.isnan(deq[5]))  # inf / NaN reach the product
    np.testing.assert_array_equal(np.asarray(power_of_two_scale(jnp.asarray([448.0, 449.0, 224.0]))), [1, 2, 0.5])
    # Blocks of the smallest normal magnitudes take the floor 2^-126, as in the reference.
    tiny = np.asarray([[1.5e-38, -1.2e-38, 0.0, 0.0], [1.2e-38, 0.0, 0.0, 0.0]], np.float32)
    q = jit_quantize(jnp.asarray(tiny), (1, None))
    want_values, want_scales = ref.quantize(tiny, (1, None))
    np.testing.assert_array_equal(np.asarray(q.scales), want_scales)
    assert np.all(want_scales == 2.0 ** -126)
    np.testing.assert_array_equal(np.asarray(q.values.astype(jnp.float32)), want_values)


def test_dequantized_values_come_in_the_dtype_asked_for():
    """dequantize writes `dtype` (exact in bf16: e4m3 values times powers of two), and fake_quantize x's dtype by
    default: the values an FP8 product computes with, in the reference's float64 arithmetic."""
    x = jnp.asarray(wide_range(np.random.default_rng(3), (4, 256)), jnp.bfloat16)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    q = jit_quantize(x, (1, 128))
    deq = dequantize(q, (1, 128), jnp.bfloat16)
    assert deq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(deq.astype(jnp.float32)), ref.fake(x64, (1, 128)))
    fake = fake_quantize(x, (1, 128))
    assert fake.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(fake.astype(jnp.float32)), ref.fake(x64, (1, 128)))
    assert fake_quantize(x, (1, 128), jnp.float32).dtype == jnp.float32


def test_quantizer_takes_empty_axes_under_a_whole_axis_block():
    """An array with an empty axis (a batch of no tokens) quantizes to no values, a whole-axis block (None) on the
    empty axis included, and dequantizes back to its shape."""
    for shape, block, counts in (((3, 0), (1, None), (3, 1)), ((0, 5), (None, 1), (1, 5)), ((0, 4), (1, None), (0, 1)),
                                 ((0, 256), (1, 128), (0, 2))):
        q = quantize(jnp.zeros(shape, jnp.float32), block)
        assert q.values.shape == shape and q.values.dtype == FP8
        assert q.scales.shape == counts  # a whole-axis block is one block, empty or not
        assert dequantize(q, block).shape == shape


@pytest.mark.parametrize("mode", MODES)
def test_a_matmul_of_no_rows_is_empty_and_gives_w_a_zero_gradient(mode):
    """x with no rows (an empty batch): the output has none, x's gradient none, and w's gradient is zeros in w's
    dtype, in every recipe (rowwise's transposed copy of x is [K, 0], one whole-row block per row)."""
    x, w = jnp.zeros((0, 256), jnp.bfloat16), jnp.ones((256, 128), jnp.float32)
    y, pullback = jax.vjp(lambda x, w: fp8_matmul(x, w, Recipe(mode)), x, w)
    dx, dw = pullback(jnp.zeros((0, 128), jnp.bfloat16))
    assert y.shape == (0, 128) and y.dtype == jnp.bfloat16 and dx.shape == (0, 256) and dx.dtype == jnp.bfloat16
    assert dw.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(dw), np.zeros((256, 128)))


def _dense_case(seed=0, t=200, k=256, n=384):
    rng = np.random.default_rng(seed)
    return (wide_range(rng, (t, k)).astype(np.float32), (rng.normal(size=(k, n)) * 0.05).astype(np.float32),
            wide_range(rng, (t, n)).astype(np.float32))


@dataclasses.dataclass(frozen=True)
class Dense:
    """fp8_matmul under `recipe`, as a value: equal products are one static argument of `fwd_bwd`'s program."""
    recipe: Recipe
    out_dtype: object = None

    def __call__(self, x, w, _):
        return fp8_matmul(x, w, self.recipe, self.out_dtype)


@dataclasses.dataclass(frozen=True)
class Grouped:
    """A grouped GEMM with float32 output, as a value (see Dense)."""
    gmm: Fp8Gmm
    zero_lhs_grad_padding: bool = True

    def __call__(self, x, w, gs):
        return self.gmm(x, w, gs, preferred_element_type=jnp.float32,
                        zero_lhs_grad_padding=self.zero_lhs_grad_padding)


@functools.partial(jax.jit, static_argnums=0)
def _fwd_bwd(f, x, w, gs, dy):
    y, pullback = jax.vjp(lambda x, w: f(x, w, gs), x, w)
    return (y, *pullback(dy))


def fwd_bwd(f, x, w, gs, dy):
    """(f(x, w, gs), dx, dw) for cotangent dy, as one jitted program (op by op, each of the quantizers' operations
    compiled on its own took most of these tests' time); gs may be None (a dense product). `f` is a Dense or
    Grouped value, so that equal products on operands of the same shapes share one compilation across tests."""
    return _fwd_bwd(f, jnp.asarray(x), jnp.asarray(w), None if gs is None else jnp.asarray(gs), jnp.asarray(dy))


@pytest.mark.parametrize("mode", ["rowwise", "blockwise"])
def test_dense_fp8_matmul_and_its_gradients_match_the_float64_reference(mode):
    x, w, dy = _dense_case()
    y, dx, dw = fwd_bwd(Dense(Recipe(mode), jnp.float32), x, w, None, dy)
    for got, want in zip((y, dx, dw), ref.dense(x, w, dy, mode)):
        assert rel(got, want) < F32_RTOL


def test_mxfp8_goes_through_scaled_dot_general_within_mx_rounding():
    """jax.nn.scaled_dot_general quantizes by its own rules (e8m0 scales); it is held to MX rounding against the
    float32 product, at dims that are not multiples of 32 (padded) and on leading batch axes."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 50, 80)).astype(np.float32)
    w = (rng.normal(size=(80, 100)) * 0.1).astype(np.float32)
    dy = rng.normal(size=(2, 50, 100)).astype(np.float32)
    y, dx, dw = fwd_bwd(Dense(Recipe("mxfp8"), jnp.float32), x, w, None, dy)
    want = (x @ w, dy @ w.T, np.einsum("btk,btn->kn", x, dy))
    for got, exact in zip((y, dx, dw), want):
        assert 0 < rel(got, exact) < 0.08


def test_linear_without_a_recipe_is_the_plain_matmul_in_the_dtype_asked_for():
    """linear(x, w) with no recipe: x @ w in x's dtype, or, asked for float32 out of bf16 operands, the float32
    accumulation itself (not its bf16 rounding)."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(2, 8, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)
    want = np.einsum("btk,kn->btn", np.asarray(x.astype(jnp.float32), np.float64),
                     np.asarray(w.astype(jnp.bfloat16).astype(jnp.float32), np.float64))
    y32 = jax.jit(lambda x, w: linear(x, w, out_dtype=jnp.float32))(x, w)
    assert y32.dtype == jnp.float32 and y32.shape == (2, 8, 48)
    assert rel(y32, want) < F32_RTOL
    assert linear(x, w).dtype == jnp.bfloat16


def _grouped_case(sizes, rows, seed=0, k=256, n=128):
    rng = np.random.default_rng(seed)
    g = len(sizes)
    return (wide_range(rng, (rows, k)).astype(np.float32), (rng.normal(size=(g, k, n)) * 0.05).astype(np.float32),
            np.asarray(sizes, np.int32), wide_range(rng, (rows, n)).astype(np.float32))


GROUPS = {"uneven": ([70, 0, 130, 1, 20], 240),  # empty and 1-row groups, 19 padding rows
          "skewed": ([0, 0, 300, 0], 300),  # every row on one expert
          "empty": ([0, 0, 0], 64)}  # nothing routed here: zero outputs and gradients


@pytest.mark.parametrize("mode, case", [(mode, "uneven") for mode in MODES]
                         + [("blockwise", "skewed"), ("rowwise", "skewed"), ("mxfp8", "empty")])
def test_grouped_fp8_and_its_gradients_match_the_float64_reference(mode, case):
    sizes, rows = GROUPS[case]
    x, w, gs, dy = _grouped_case(sizes, rows)
    gmm = Fp8Gmm(Fp8Products(Recipe(mode), XlaGmm(), XlaContract()))
    y, dx, dw = fwd_bwd(Grouped(gmm), x, w, gs, dy)
    want = ref.grouped(x, w, sizes, dy, mode)
    for got, exact in zip((y, dx, dw), want):
        assert np.all(np.isfinite(np.asarray(got)))
        if np.linalg.norm(exact) == 0:
            np.testing.assert_array_equal(np.asarray(got), 0.0)
        else:
            assert rel(got, exact) < F32_RTOL
    np.testing.assert_array_equal(np.asarray(y)[sum(sizes):], 0.0)  # padding rows: zero out, zero gradient
    np.testing.assert_array_equal(np.asarray(dx)[sum(sizes):], 0.0)
    # the input gradient's padding rows left unzeroed change none of the rows that hold data
    _, dx_unzeroed, dw_unzeroed = fwd_bwd(Grouped(gmm, zero_lhs_grad_padding=False), x, w, gs, dy)
    np.testing.assert_array_equal(np.asarray(dx_unzeroed)[:sum(sizes)], np.asarray(dx)[:sum(sizes)])
    np.testing.assert_array_equal(np.asarray(dw_unzeroed), np.asarray(dw))


def test_native_mxfp8_grouped_products_are_the_dequantized_ones():
    """Our e4m3 kernels take rowwise and blockwise scales: under a native mxfp8 recipe the grouped products run on
    the dequantized operands, the same bits as the recipe not native."""
    sizes, rows = GROUPS["uneven"]
    x, w, gs, dy = _grouped_case(sizes, rows)
    got, want = (fwd_bwd(Grouped(Fp8Gmm(Fp8Products(Recipe("mxfp8", native), XlaGmm(), XlaContract()))), x, w, gs, dy)
                 for native in (True, False))
    for g, v in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(v))


def _aligned(a_MX, sizes, poison=np.nan):
    """The rows in the expert-aligned layout of dropless.moe.permute(row_align=128): group g from row 128 * first_g
    on, zeros after its rows, `poison` past the last group (rows a grouped GEMM may leave unwritten)."""
    padded = [-(-s // 128) * 128 for s in sizes]
    num_rows = 128 * (-(-a_MX.shape[0] // 128) + len(sizes))
    out = np.zeros((num_rows, a_MX.shape[1]), a_MX.dtype)
    out[sum(padded):] = poison
    src = dst = 0
    for s, p in zip(sizes, padded):
        out[dst:dst + s] = a_MX[src:src + s]
        src, dst = src + s, dst + p
    return out, np.asarray(padded, np.int32)


def _unaligned(a_PX, sizes):
    """The inverse of `_aligned`: each group's rows end to end."""
    starts = np.cumsum([0] + [-(-s // 128) * 128 for s in sizes])
    return np.concatenate([a_PX[st:st + s] for st, s in zip(starts, sizes)])


@pytest.mark.parametrize("mode, case", [(mode, "uneven") for mode in MODES]
                         + [("blockwise", "skewed"), ("rowwise", "skewed"), ("mxfp8", "empty")])
@pytest.mark.parametrize("poison", [np.nan, 1e30])
def test_grouped_fp8_on_aligned_rows_equals_the_gathered_path_and_the_reference(mode, case, poison):
    """Fp8Gmm(row_align=128) on expert-aligned rows (plain transposes for the weight gradient) against Fp8Gmm on
    the same rows end to end (gathered aligned copies) and the float64 reference; the rows past the last group hold
    NaN or huge values and are never read (a huge value in an expert's rowwise scale would flush its rows to 0)."""
    sizes, rows = GROUPS[case]
    x, w, gs, dy = _grouped_case(sizes, rows)
    x_al, gs_al = _aligned(x, sizes, poison)
    dy_al, _ = _aligned(dy, sizes, poison)
    products = Fp8Products(Recipe(mode), XlaGmm(), XlaContract())
    results = []
    for gmm, x_, gs_, dy_ in ((Fp8Gmm(products), x, gs, dy), (Fp8Gmm(products, row_align=128), x_al, gs_al, dy_al)):
        out = fwd_bwd(Grouped(gmm), x_, w, gs_, dy_)
        results.append(tuple(map(np.asarray, out)))
    (y, dx, dw), (y_al, dx_al, dw_al) = results
    n = sum(sizes)
    np.testing.assert_array_equal(y_al[sum(gs_al):], 0.0)  # past the groups: zero output, zero gradient
    np.testing.assert_array_equal(dx_al[sum(gs_al):], 0.0)
    exact = ref.grouped(x, w, sizes, dy, mode)
    got = (_unaligned(y_al, sizes), _unaligned(dx_al, sizes), dw_al)
    for name, got, gathered, want in zip(("y", "dx", "dW"), got, (y[:n], dx[:n], dw),
                                         (exact[0][:n], exact[1][:n], exact[2])):
        assert np.all(np.isfinite(got)), name
        if np.linalg.norm(want) == 0:
            np.testing.assert_array_equal(got, 0.0)
        else:
            assert rel(got, gathered) < F32_RTOL and rel(got, want) < F32_RTOL, name


def test_aligned_copy_puts_each_expert_at_a_multiple_of_128():
    sources = jax.jit(aligned_sources, static_argnums=(1, 2))  # one program, not op by op
    source, valid, block_group = sources(jnp.asarray([3, 0, 130, 1], jnp.int32), 140, 128)
    valid, source = np.asarray(valid), np.asarray(source)
    assert source.shape == (128 * (2 + 4),)
    np.testing.assert_array_equal(np.flatnonzero(valid), list(range(0, 3)) + list(range(128, 258)) + [384])
    np.testing.assert_array_equal(source[valid], np.arange(134))
    np.testing.assert_array_equal(np.asarray(block_group), [0, 2, 2, 3, 4, 4])


@pytest.mark.parametrize("row_align", [1, 128])
@pytest.mark.parametrize("mode", ["rowwise", "blockwise"])
def test_e4m3_kernels_equal_the_dequantized_path_in_the_gpu_interpreter(mode, row_align):
    """The native products (dropless.gmm.fp8_mosaic) against the dequantized ones on the same operands, on rows end
    to end and on expert-aligned rows (_wide_n_cases: whose rows past the groups hold inf; the last group is empty
    there, so its rowwise scale is NaN, a block's past the groups, which the kernel must not read)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if row_align == 1:
        x, w, gs, dy = _grouped_case([50, 0, 70], 130, k=256, n=256)
    results = []
    for native in (False, True):
        gmm = Fp8Gmm(Fp8Products(Recipe(mode, native), XlaGmm(), XlaContract()), row_align=row_align)
        if row_align > 1:
            results.append(_interpreted(Grouped(gmm), "grouped"))
        else:
            with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
                results.append(fwd_bwd(Grouped(gmm), x, w, gs, dy))
    for got, want in zip(*results[::-1]):
        assert rel(got, want) < F32_RTOL


def _spread_dense_case():
    """A dense product's x [64, 256], W [256, 256] and dy [64, 256] whose magnitudes spread over every axis by powers
    of two (exact): each row or column scale the kernels take (x's rows, W's rows and columns, the transposed copies'
    rows: x's and dy's columns) differs from its neighbours, so a scale applied to the wrong row or column is far
    outside float32 rounding; a factor per 128-wide tile and per 128 x 128 block does the same for blockwise's tile
    and block scales (W's are [2, 2]: transposed, the off-diagonal blocks swap). x and dy are exact in bf16."""
    x, w, dy = _dense_case(t=64, k=256, n=256)
    rng = np.random.default_rng(7)
    spread = lambda shape: 2.0 ** rng.integers(-5, 6, size=shape)
    tiles = np.repeat(2.0 ** np.asarray([[0, 3]]), 128, axis=1)
    x, dy = x * spread((1, 256)) * tiles, dy * spread((1, 256)) * tiles[:, ::-1]
    w = w * spread((256, 1)) * spread((1, 256)) * np.kron(2.0 ** np.asarray([[0, 4], [-4, 2]]), np.ones((128, 128)))
    x, dy = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (x, dy))
    return x, w.astype(np.float32), dy


def _wide_n_cases():
    """(grouped x, w, gs, dy on expert-aligned rows with empty groups, inf past the groups; dense x, w, dy of
    _spread_dense_case), both with N = 256, two of the blockwise weight gradient's 128-column CTA tiles."""
    sizes = [50, 0, 70, 0]
    x, w, gs, dy = _grouped_case(sizes, 130, k=256, n=256)
    (x, gs), (dy, _) = _aligned(x, sizes, np.inf), _aligned(dy, sizes, np.inf)
    return (x, w, gs, dy), _spread_dense_case()


@functools.cache
def _interpreted(f, case):
    """fwd_bwd(f) on _wide_n_cases' "grouped" or "dense" operands, kernels in the GPU interpreter: once per (f, case),
    so that the tests that check the same products on the same operands share one interpreted run."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    grouped, (x, w, dy) = _wide_n_cases()
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        return fwd_bwd(f, *(grouped if case == "grouped" else (x, w, None, dy)))


@pytest.mark.parametrize("mode", ["rowwise", "blockwise"])
@pytest.mark.parametrize("native", [False, True], ids=["dequantized", "kernels"])
def test_a_bf16_weight_gradient_is_the_float32_one_rounded_once(mode, native):
    """train.fp8_wgrad_dtype=bfloat16: each weight-gradient product (dense and grouped, on the dequantized path and
    on our kernels in the GPU interpreter, there at FP8_WGRAD_2BYTE's tile under blockwise) writes its float32
    result rounded once to bf16, which comes back as the float32 master's gradient; the output and the input
    gradient are the same bits."""
    results = {}
    for wgrad in ("float32", "bfloat16"):
        recipe = Recipe(mode, native, wgrad=wgrad)
        gmm = Fp8Gmm(Fp8Products(recipe, XlaGmm(), XlaContract()), row_align=128)
        results[wgrad] = (_interpreted(Grouped(gmm), "grouped"), _interpreted(Dense(recipe), "dense"))
    for f32, bf16 in zip(results["float32"], results["bfloat16"]):
        assert bf16[2].dtype == jnp.float32
        for a, b in zip(f32[:2], bf16[:2]):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        rounded = np.asarray(f32[2].astype(jnp.bfloat16).astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(bf16[2]), rounded)
        assert not np.array_equal(rounded, np.asarray(f32[2]))  # the rounding is there to see
    assert Recipe(mode, wgrad="bfloat16").wgrad_dtype(jnp.bfloat16) == jnp.bfloat16  # never wider than the weight
    assert Recipe(mode, wgrad="bfloat16").wgrad_dtype(jnp.float16) == jnp.float16  # 2 bytes already: its own dtype
    assert Recipe(mode).wgrad_dtype(jnp.float32) == jnp.float32


@pytest.mark.parametrize("mode", ["rowwise", "blockwise"])
def test_a_bf16_weight_gradient_reaches_the_kernel(mode, monkeypatch):
    """The equal bits above cannot tell a kernel that writes bf16 from one that writes float32 rounded afterwards:
    here the weight-gradient kernel itself (grouped and dense) is asked for bf16 and, under blockwise, for the five
    stages that 2-byte outputs leave room for (rowwise keeps its table's tile), and for float32 at the table's tile
    without the option."""
    calls = []
    kernel = fp8_mosaic.gmm_tn_aligned

    def spy(*args, **kwargs):
        calls.append((args[3], jnp.dtype(kwargs["out_dtype"])))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(fp8_mosaic, "gmm_tn_aligned", spy)
    (x, w, gs, dy), (dense_x, dense_w, dense_dy) = _wide_n_cases()
    table = fp8_mosaic.FP8_TILES[("drhs", mode)]
    wide = fp8_mosaic.FP8_WGRAD_2BYTE if mode == "blockwise" else table
    for wgrad, want in (("bfloat16", (wide, jnp.dtype(jnp.bfloat16))), ("float32", (table, jnp.dtype(jnp.float32)))):
        recipe = Recipe(mode, native=True, wgrad=wgrad)
        gmm = Fp8Gmm(Fp8Products(recipe, XlaGmm(), XlaContract()), row_align=128)
        calls.clear()
        for f, (a, b, g, d) in ((Grouped(gmm), (x, w, gs, dy)), (Dense(recipe), (dense_x, dense_w, None, dense_dy))):
            # Traced afresh (not through fwd_bwd's cache), so that every kernel call passes the spy.
            jax.make_jaxpr(lambda a, b, d, f=f, g=g: jax.vjp(lambda a, b: f(a, b, g), a, b)[1](d))(
                *map(jnp.asarray, (a, b, d)))
        assert calls == [want, want], (wgrad, calls)


@pytest.mark.parametrize("mode", ["rowwise", "blockwise"])
def test_dense_kernel_writes_the_output_dtype_in_the_gpu_interpreter(mode):
    """The dense product runs our kernel with one group: against the non-native path in float32 (rowwise: XLA's
    e4m3 dot and the scales after it; blockwise: the dequantized product), and with bf16 operands its bf16 output
    and input gradient are the float32 ones rounded once (the kernel's epilogue writes bf16, no float32 copy), the
    weight gradient (float32, the master's dtype) unchanged."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    x, w, dy = _spread_dense_case()  # its scales all differ: one applied to the wrong row or column shows
    native = Recipe(mode, native=True)
    f32 = _interpreted(Dense(native), "dense")
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        bf16 = fwd_bwd(Dense(native), jnp.asarray(x, jnp.bfloat16), w, None,
                       jnp.asarray(dy, jnp.bfloat16))
    dequantized = _interpreted(Dense(Recipe(mode, native=False)), "dense")
    for got, want in zip(f32, dequantized):
        assert got.dtype == jnp.float32 and rel(got, want) < F32_RTOL
    assert [a.dtype for a in bf16] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
    np.testing.assert_array_equal(np.asarray(bf16[0]), np.asarray(f32[0].astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(bf16[1]), np.asarray(f32[1].astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(bf16[2]), np.asarray(f32[2]))


@pytest.mark.parametrize("mode", ["rowwise", "blockwise"])
def test_dense_kernel_output_is_bf16_in_the_program_for_cuda(mode):
    """With bf16 operands the kernel's own result is bf16: no float32 [T, N] or [T, K] array leaves it; all three
    products are our kernels (none is an XLA e4m3 dot, which XLA would autotune while compiling)."""
    from jax import export

    def run(x, w, dy):
        y, pullback = jax.vjp(lambda x, w: fp8_matmul(x, w, Recipe(mode, native=True)), x, w)
        return y, *pullback(dy)

    S = jax.ShapeDtypeStruct
    text = export.export(jax.jit(run), platforms=["cuda"])(
        S((256, 512), jnp.bfloat16), S((512, 256), jnp.float32), S((256, 256), jnp.bfloat16)).mlir_module()
    results = [line.rsplit("->", 1)[1].split(" loc(")[0].strip() for line in text.splitlines()
               if "custom_call @mosaic_gpu" in line]
    # forward y [T, N], input gradient dx [T, K], weight gradient dW [1, K, N] (float32, the master's dtype)
    assert sorted(results) == sorted(["tensor<256x256xbf16>", "tensor<256x512xbf16>", "tensor<1x512x256xf32>"])
    assert not [line for line in text.splitlines() if "dot_general" in line and "f8E4M3FN" in line]


def test_rowwise_dense_products_our_kernel_does_not_fit_are_the_dequantized_bf16_ones_natively():
    """Natively (a GPU), a rowwise product with dims the kernel does not take (192 output columns) is the
    dequantized bf16 product, never an XLA e4m3 dot (XLA autotunes those while compiling, for minutes at the
    proxy's shapes); its numbers are the e4m3 dot's, which the non-native path keeps (XLA:CPU)."""
    from jax import export

    x, w, dy = _dense_case(t=64, k=256, n=192)
    assert not any(fp8_mosaic.fits(p, 256, 192, "rowwise") for p in ("fwd", "dlhs", "drhs"))
    native, xla_dot = Dense(Recipe("rowwise", native=True)), Dense(Recipe("rowwise", native=False))
    for got, want in zip(fwd_bwd(native, x, w, None, dy), fwd_bwd(xla_dot, x, w, None, dy)):
        assert rel(got, want) < F32_RTOL

    def run(recipe, x, w, dy):
        y, pullback = jax.vjp(lambda x, w: fp8_matmul(x, w, recipe), x, w)
        return y, *pullback(dy)

    S = jax.ShapeDtypeStruct
    shapes = (S((64, 256), jnp.bfloat16), S((256, 192), jnp.float32), S((64, 192), jnp.bfloat16))
    e4m3_dots = lambda recipe: [line for line in export.export(jax.jit(functools.partial(run, recipe)),
                                                               platforms=["cuda"])(*shapes).mlir_module().splitlines()
                                if "dot_general" in line and "f8E4M3FN" in line]
    assert not e4m3_dots(native.recipe)
    assert len(e4m3_dots(xla_dot.recipe)) == 3  # forward, input and weight gradients


@pytest.mark.parametrize("mode", ["rowwise", "blockwise"])
def test_dense_fp8_kernel_runs_on_each_devices_rows_under_a_mesh(mode):
    """XLA cannot partition our kernels: given the training mesh, fp8_matmul runs the kernel per batch shard (its
    output the device's 2 x 64 rows), where plain jit would hand it all 16 x 64 rows."""
    from jax import export
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dropless.core.config import ParallelConfig
    from dropless.core.mesh import BATCH_AXES, make_mesh

    mesh = make_mesh(ParallelConfig(data=4, fsdp=2, expert=1))
    S = jax.ShapeDtypeStruct

    def kernel_outputs(given_mesh):
        f = jax.jit(lambda x, w: fp8_matmul(x, w, Recipe(mode, native=True), mesh=given_mesh))
        text = export.export(f, platforms=["cuda"])(
            S((16, 64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P(BATCH_AXES))),
            S((256, 512), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))).mlir_module()
        return [line.rsplit("->", 1)[1].split(" loc(")[0].strip() for line in text.splitlines()
                if "custom_call @mosaic_gpu" in line]

    assert kernel_outputs(mesh) == ["tensor<128x512xbf16>"]
    assert kernel_outputs(None) == ["tensor<1024x512xbf16>"]


def _gathered_operand_types(row_align: int, mode: str) -> set:
    """The element types of the arrays every gather reads in Fp8Gmm's forward and backward, exported for CUDA."""
    from jax import export

    gmm = Fp8Gmm(Fp8Products(Recipe(mode, native=True), XlaGmm(), XlaContract()), row_align=row_align)

    def fwd_bwd(x, w, gs, dy):
        y, pullback = jax.vjp(lambda x, w: gmm(x, w, gs), x, w)
        return y, *pullback(dy)

    S, m = jax.ShapeDtypeStruct, 128 * 12
    text = export.export(jax.jit(fwd_bwd), platforms=["cuda"])(
        S((m, 256), jnp.bfloat16), S((4, 256, 256), jnp.bfloat16), S((4,), jnp.int32),
        S((m, 256), jnp.bfloat16)).mlir_module()
    # '"stablehlo.gather"(%a, %i) <{...}> : (tensor<256x1536xbf16>, tensor<...>) -> ...': the operand's type
    operands = [line.split(": (tensor<", 1)[1].split(",", 1)[0] for line in text.splitlines()
                if '"stablehlo.gather"' in line]
    return {operand.rsplit("x", 1)[-1].rstrip(">") for operand in operands}


@pytest.mark.parametrize("mode", ["rowwise", "blockwise"])
def test_aligned_rows_need_no_gather_of_activations(mode):
    """On expert-aligned rows the weight gradient's copies are plain transposes: no gather in the lowered program
    reads the bf16 activations (only index tables and float32 scales), while rows end to end gather their
    columns."""
    assert "bf16" not in _gathered_operand_types(128, mode)
    assert "bf16" in _gathered_operand_types(1, mode)


@pytest.fixture
def pair_kernel(monkeypatch):
    """quantize_pair's kernel itself (in Pallas's interpreter) wherever the one-pass path runs; the calls made."""
    calls, original = [], fp8_pairs.quantize_pair

    def kernel(x, kind, **_):
        calls.append((kind, x.shape))
        return original(x, kind, interpret=True)

    monkeypatch.setattr(fp8_pairs, "quantize_pair", kernel)
    return calls


def _products(f, x, w, gs, dy):
    """(y, dx, dw) of f in a program of its own (not fwd_bwd's shared cache, traced before the kernel was
    patched in)."""
    def run(x, w, gs, dy):
        y, pullback = jax.vjp(lambda x, w: f(x, w, gs), x, w)
        return y, *pullback(dy)
    return jax.jit(run)(*(None if a is None else jnp.asarray(a) for a in (x, w, gs, dy)))


def test_one_pass_pairs_give_the_two_pass_products_bit_for_bit(pair_kernel, monkeypatch):
    """Blockwise and native, each operand's two layouts come from the one-pass kernel: the dense product (whole
    128-token tiles; 200 tokens go the two-pass way), and the grouped one on expert-aligned rows whose rows past
    the groups hold NaN and inf, give exactly the two-pass products. The products run dequantized (the e4m3 GEMM
    kernels, whose own tests are in test_gmm_fp8_kernels.py, are kept out: they would need Mosaic's interpreter)."""
    monkeypatch.setattr(fp8_mosaic, "fits", lambda *_: False)
    one_pass = Recipe("blockwise", native=True)
    two_pass = dataclasses.replace(one_pass, fuse_pairs=False)
    rng = np.random.default_rng(3)
    for t, tiles in ((256, 2), (200, 0)):
        x = jnp.asarray(wide_range(rng, (t, 128)), jnp.bfloat16)
        w = rng.normal(size=(128, 128)).astype(np.float32) * 0.05
        dy = jnp.asarray(rng.normal(size=(t, 128)), jnp.bfloat16)
        pair_kernel.clear()
        got = _products(Dense(one_pass), x, w, None, dy)
        assert [kind for kind, _ in pair_kernel].count("tiles") == tiles and ("blocks", (128, 128)) in pair_kernel
        want = _products(Dense(two_pass), x, w, None, dy)
        for g, v in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(v, np.float32))
    sizes = [100, 0, 200]
    x, dy = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in _grouped_case(sizes, 300, k=128, n=128)[::3])
    w = _grouped_case(sizes, 300, k=128, n=128)[1]
    (x, gs), (dy, _) = _aligned(x, sizes, np.nan), _aligned(dy, sizes, np.inf)
    pair_kernel.clear()
    got = _products(Grouped(Fp8Gmm(Fp8Products(one_pass, XlaGmm(), XlaContract()), row_align=128)), x, w, gs, dy)
    assert sorted(kind for kind, _ in pair_kernel) == ["blocks", "tiles", "tiles"]
    want = _products(Grouped(Fp8Gmm(Fp8Products(two_pass, XlaGmm(), XlaContract()), row_align=128)), x, w, gs, dy)
    real = int(gs.sum())
    for g, v in ((got[0][:real], want[0][:real]), (got[1][:real], want[1][:real]), (got[2], want[2])):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(v))
    assert np.isfinite(np.asarray(got[2])).all()


def test_one_pass_pairs_lower_for_cuda_under_expert_parallelism(monkeypatch):
    """Inside shard_map (expert parallelism's local stage) the kernel's outputs vary like its input, so the FP8
    grouped GEMM's forward and backward lower for CUDA with the one-pass kernel on a mesh of two GPUs."""
    from jax.sharding import PartitionSpec as P

    original = fp8_pairs.quantize_pair
    monkeypatch.setattr(fp8_pairs, "quantize_pair", lambda x, kind, **_: original(x, kind, interpret=False))
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((2,), ("expert",), abstract_device=device)
    gmm = Fp8Gmm(Fp8Products(Recipe("blockwise", native=True), XlaGmm(), XlaContract()), row_align=128)

    def step(x, w, gs, dy):
        y, pullback = jax.vjp(lambda x, w: gmm(x, w, gs), x, w)
        return y, *pullback(dy)

    spec = P("expert")
    S = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, spec))
    with jax.sharding.use_abstract_mesh(mesh):
        f = jax.shard_map(step, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3)
        text = jax.jit(f).trace(S((2048, 512), jnp.bfloat16), S((4, 512, 512), jnp.bfloat16), S((4,), jnp.int32),
                                S((2048, 512), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("dropless_quantize_pair_tiles") >= 2 and "dropless_quantize_pair_blocks" in text


def test_recipes_config_and_backend_choice():
    assert make_recipe("off") is None
    assert make_recipe("blockwise") == Recipe("blockwise", native=False)  # no GPU here
    with pytest.raises(ValueError, match="not one of"):
        Recipe("e5m2")
    with pytest.raises(ValueError, match="weight-gradient dtype 'float16' is not one of"):
        Recipe("blockwise", wgrad="float16")
    assert train_recipe(load_preset("tiny").replace(**{"train.fp8": "blockwise",
                                                       "train.fp8_wgrad_dtype": "bfloat16"}).train).wgrad == "bfloat16"
    assert train_recipe(load_preset("tiny").train) is None
    with pytest.raises(ConfigError, match="train.fp8_wgrad_dtype"):
        load_preset("tiny").replace(**{"train.fp8_wgrad_dtype": "float16"})
    # The option reaches only the recipes whose products write the weight gradient themselves: under mxfp8 the
    # dense layers' gradients come from jax.nn.scaled_dot_general, and under off there is nothing to round.
    for fp8 in ("off", "mxfp8"):
        with pytest.raises(ConfigError, match=f"train.fp8={fp8} has none"):
            load_preset("tiny").replace(**{"train.fp8": fp8, "train.fp8_wgrad_dtype": "bfloat16"})
    with pytest.raises(ValueError, match="applies to the rowwise and blockwise recipes, not 'mxfp8'"):
        Recipe("mxfp8", wgrad="bfloat16")
    config = load_preset("tiny").replace(**{"train.fp8": "blockwise"})
    gmm = experts_gmm(config.moe, make_recipe("blockwise", native=True))
    assert isinstance(gmm, Fp8Gmm) and gmm.row_align == 128  # the routed experts' permutation aligns the rows
    with pytest.raises(ValueError, match="row_align=64"):
        Fp8Gmm(gmm.products, row_align=64)
    with pytest.raises(ValueError, match="multiple of 128 rows, got 130"):
        gmm(jnp.zeros((130, 256)), jnp.zeros((2, 256, 256)), jnp.asarray([128, 0]))
    # under the xla backend the recipe runs dequantized even where it could run the kernels
    gmm = experts_gmm(config.moe.replace(gmm_backend="xla") if hasattr(config.moe, "replace") else
                      config.replace(**{"moe.gmm_backend": "xla"}).moe, make_recipe("blockwise", native=True))
    assert gmm.products.recipe.native is False
    with pytest.raises(ConfigError, match="train.fp8=rowwise runs the routed experts"):
        load_preset("tiny").replace(**{"train.fp8": "rowwise", "moe.gmm_backend": "capacity"})
    with pytest.raises(ConfigError, match="train.fp8"):
        load_preset("tiny").replace(**{"train.fp8": "fp4"})


@pytest.mark.parametrize("mode", ["rowwise", "blockwise", "mxfp8"])
def test_gradients_come_back_in_their_primals_dtypes(mode):
    """bf16 activations and float32 master weights (as training passes them): every FP8 product gives the input
    gradient in bf16 and the weight gradient in float32 (scaled_dot_general's own VJP, under mxfp8, gives float32
    for both; a float32 cotangent reaching the permutation's bf16 rows fails its VJP)."""
    recipe = Recipe(mode)
    x = jax.random.normal(jax.random.key(0), (256, 128), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (2, 128, 256), jnp.float32)
    gs = jnp.array([100, 156], jnp.int32)
    grouped = Fp8Gmm(Fp8Products(recipe, XlaGmm(), XlaContract()))
    def product_and_gradients(f, x, w):
        y, pullback = jax.vjp(f, x, w)
        return y, *pullback(jnp.ones_like(y))

    for f, w_ in ((lambda x, w: fp8_matmul(x, w, recipe), w[0]), (lambda x, w: grouped(x, w, gs), w)):
        y, dx, dw = jax.eval_shape(functools.partial(product_and_gradients, f), x, w_)  # traced: the dtypes
        assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)


def test_weight_cache_on_several_devices_is_partitioned_like_the_weights(monkeypatch):
    """The step's e4m3 weight copies (recipe.weight_cache) are made outside any shard_map: on several devices by the
    two-pass quantizer, which XLA partitions like the weights (the one-pass Pallas kernel it would gather whole onto
    every device); on one device by the one-pass kernel."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from dropless.fp8.recipe import weight_cache

    calls = []
    monkeypatch.setattr(fp8_pairs, "quantize_pair", lambda x, kind, **_: calls.append(kind) or
                        fp8_pairs.quantize_pair_reference(x, kind))
    recipe = Recipe("blockwise", native=True)
    mesh = Mesh(np.array(jax.devices()[:8]), ("expert",))
    w = jax.device_put(jnp.ones((2, 8, 256, 128), jnp.float32), NamedSharding(mesh, P(None, "expert")))
    params = {"moe": {"experts": {"down": w}, "router": {"kernel": jnp.ones((128, 8))}}}
    cache = jax.jit(weight_cache, static_argnums=1)(params, recipe)
    assert list(cache) == ["['moe']['experts']['down']"] and calls == []
    for copy in cache["['moe']['experts']['down']"]:
        assert not copy.values.sharding.is_fully_replicated
        assert copy.values.addressable_shards[0].data.shape[1] == 1  # one expert per device
    monkeypatch.setattr(jax, "device_count", lambda *_: 1)
    jax.eval_shape(lambda p: weight_cache(p, recipe), params)
    assert calls == ["blocks"]


@pytest.mark.parametrize("mode", ["rowwise", "blockwise"])
def test_the_output_gradient_is_quantized_from_the_inputs_dtype(mode):
    """With bf16 activations and a float32 output, the backward quantizes dy from its bf16 rounding, as the bf16
    operands it stands beside (and as the bf16 path reads it): a float32 dy and the same dy rounded to bf16 first
    give the same bits in dx and dW, dense and grouped."""
    (x, w, gs, dy), _ = _wide_n_cases()
    dense_x, dense_w, dense_dy = _dense_case(t=128, k=256, n=256)  # dy not exact in bf16
    recipe = Recipe(mode)
    gmm = Fp8Gmm(Fp8Products(recipe, XlaGmm(), XlaContract()), row_align=128)
    for f, a, b, g, d in ((Grouped(gmm), x, w, gs, dy), (Dense(recipe, jnp.float32), dense_x, dense_w, None, dense_dy)):
        a = jnp.asarray(a, jnp.bfloat16)
        rounded = np.asarray(jnp.asarray(d).astype(jnp.bfloat16).astype(jnp.float32))
        assert not np.array_equal(np.nan_to_num(rounded), np.nan_to_num(d))
        for got, want in zip(fwd_bwd(f, a, b, g, d)[1:], fwd_bwd(f, a, b, g, rounded)[1:]):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
