"""The e4m3 grouped-GEMM kernels (dropless.gmm.fp8_mosaic): both kernels with both scalings in Pallas's GPU
interpreter against float64 numpy loops over the groups, the tile table lowered for CUDA on the CPU, and the
errors a caller gets for malformed operands."""

import functools

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax import export
from jax.experimental.pallas import mosaic_gpu as plgpu

from dropless.gmm import fp8_mosaic
from dropless.gmm.fp8_mosaic import FP8, FP8_TILES, SCALE_BLOCK, aligned_layout, gmm_nt, gmm_tn_aligned
from dropless.gmm.tuning import TileConfig

S = jax.ShapeDtypeStruct
# Small tiles for the interpreter: 64 x 64 per consumer (a CTA tile of 64 x 128 side by side, 128 x 64 stacked),
# block_k = the scale block; WIDE_TILE has the table's 64 x 128, whose side-by-side consumers fall in different
# 128-column weight-scale blocks. The interpreter's time grows with the tiles it walks: two 128-wide K blocks and
# N = 256 keep the file around a minute.
NT_TILE = TileConfig(64, 64, 128, 2, grid_minor_dim=0, grid_tile_width=2)
WIDE_TILE = TileConfig(64, 128, 128, 2, grid_minor_dim=0, grid_tile_width=2)
TN_TILE = TileConfig(64, 64, 128, 2, grid_minor_dim=1, grid_tile_width=2)
# 1-row, empty, not a multiple of the tile, starting unaligned; 212 rows in groups, 44 rows of padding.
MIXED = [1, 0, 100, 0, 37, 74]
SKEW = [0, 256, 0]  # every row in one group, no padding


def _e4m3(rng, shape, extremes=True):
    """Random e4m3 values as float64; with extremes, a few at the format's limits, ±448."""
    values = rng.standard_normal(shape) * 64
    if extremes:
        values.flat[rng.choice(values.size, values.size // 50, replace=False)] = 448
        values.flat[rng.choice(values.size, values.size // 50, replace=False)] = -448
    return np.asarray(jnp.asarray(values, FP8), np.float64)


def _scales(rng, shape):
    """float32-exact scales spread over twelve decades (1e-6 .. 1e6), so tiny and large ones meet in one output."""
    return np.asarray(np.float32(10.0 ** rng.uniform(-6, 6, shape)), np.float64)


def _assert_matches(out, ref, mag):
    """Equal up to float32 accumulation: |out - ref| <= 4e-6 * sum_k |terms| elementwise (float32 rounding of
    terms and partial sums of a 256-long contraction is far below that), finite everywhere."""
    assert np.isfinite(out).all()
    np.testing.assert_array_less(np.abs(out - ref), 4e-6 * mag + 1e-30)


def _nt_reference(x, w, sizes, scaling, lhs_scale, rhs_scale):
    """out[m] = sum over 128-blocks of x[m, blk] · w[g(m), :, blk]ᵀ times its scales (float64), with the same sum
    of absolute values (the rounding bound), rows outside groups left zero."""
    m, k = x.shape
    ref, mag = np.zeros((m, w.shape[1])), np.zeros((m, w.shape[1]))
    for g, (lo, hi) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes))):
        for kb in range(k // SCALE_BLOCK):
            cols = slice(kb * SCALE_BLOCK, (kb + 1) * SCALE_BLOCK)
            if scaling == "rowwise":
                scale = lhs_scale[lo:hi, None] * rhs_scale[g][None, :]
            else:
                scale = lhs_scale[kb, lo:hi, None] * np.repeat(rhs_scale[g, :, kb], SCALE_BLOCK)[None, :]
            ref[lo:hi] += x[lo:hi, cols] @ w[g][:, cols].T * scale
            mag[lo:hi] += np.abs(x[lo:hi, cols]) @ np.abs(w[g][:, cols]).T * scale
    return ref, mag


def _nt_case(sizes, scaling, seed, m=256, k=256, n=256):
    rng = np.random.default_rng(seed)
    g = len(sizes)
    x, w = _e4m3(rng, (m, k)), _e4m3(rng, (g, n, k))
    if scaling == "rowwise":
        lhs_scale, rhs_scale = _scales(rng, (m,)), _scales(rng, (g, n))
    else:
        kb = k // SCALE_BLOCK
        lhs_scale, rhs_scale = _scales(rng, (kb, m)), _scales(rng, (g, n // SCALE_BLOCK, kb))
    return x, w, np.array(sizes, np.int32), lhs_scale, rhs_scale


def _run_nt(x, w, sizes, scaling, lhs_scale, rhs_scale, out_dtype=jnp.float32, stack="n", tile=NT_TILE,
            stream=False, behind=False):
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        out = gmm_nt(jnp.asarray(x, FP8), jnp.asarray(w, FP8), jnp.asarray(sizes), tile, scaling=scaling,
                     lhs_scale=jnp.asarray(lhs_scale, jnp.float32), rhs_scale=jnp.asarray(rhs_scale, jnp.float32),
                     out_dtype=out_dtype, stack=stack, stream=stream, behind=behind)
    return np.asarray(out.astype(jnp.float32), np.float64)


@functools.cache
def _nt_cached(sizes, scaling, seed, m=256, k=256, n=256, stack="n", tile=NT_TILE, stream=False, behind=False):
    """_nt_case's operands and gmm_nt's float32 output on them, once per case (read-only): tests that check the same
    kernel run share one interpretation."""
    case = _nt_case(list(sizes), scaling, seed, m=m, k=k, n=n)
    x, w, sizes_G, lhs_scale, rhs_scale = case
    out = _run_nt(x, w, sizes_G, scaling, lhs_scale, rhs_scale, stack=stack, tile=tile, stream=stream,
                  behind=behind)
    for a in (*case, out):
        a.flags.writeable = False
    return case, out


# (scaling, stack): blockwise also with the consumers stacked along M (a CTA tile of 128 rows: the 100- and 74-row
# groups are split between the consumers, and a tile runs past the last row).
LAYOUTS = [("rowwise", "n"), ("blockwise", "n"), ("blockwise", "m")]


@pytest.mark.parametrize("tile", [NT_TILE, WIDE_TILE], ids=["64x64", "64x128"])
@pytest.mark.parametrize("scaling, stack", LAYOUTS)
def test_gmm_nt_matches_a_float64_loop_over_groups_in_the_gpu_interpreter(scaling, stack, tile):
    x, w, sizes, lhs_scale, rhs_scale = _nt_case(MIXED, scaling, seed=1)
    out = _run_nt(x, w, sizes, scaling, lhs_scale, rhs_scale, stack=stack, tile=tile)
    live = sizes.sum()
    ref, mag = _nt_reference(x, w, sizes, scaling, lhs_scale, rhs_scale)
    _assert_matches(out[:live], ref[:live], mag[:live])  # rows past the groups are unwritten
    wrong = rhs_scale.copy()
    wrong[4, -1, ...] *= 1.001  # the 37-row group's scales of its last 128 columns off by 0.1%: the check sees it
    ref, mag = _nt_reference(x, w, sizes, scaling, lhs_scale, wrong)
    with pytest.raises(AssertionError):
        _assert_matches(out[:live], ref[:live], mag[:live])


WIDEST_TILE = TileConfig(64, 256, 128, 2, grid_minor_dim=0, grid_tile_width=2)


@pytest.mark.parametrize("stack", fp8_mosaic.STACKS)
def test_gmm_nt_with_a_256_column_consumer_matches_a_float64_loop_over_groups(stack):
    """64x256 per consumer: two 128-column accumulator slices one after another, each in its own 128-column
    weight-scale block, each slice's output columns stored to their place (the check resolves one slice's scale
    blocks off by 0.1%)."""
    tile = WIDEST_TILE
    (x, w, sizes, lhs_scale, rhs_scale), out = _nt_cached(tuple(MIXED), "blockwise", 9,
                                                          n=2 * fp8_mosaic.cta_shape(tile, stack)[1], stack=stack,
                                                          tile=tile)
    live = sizes.sum()
    ref, mag = _nt_reference(x, w, sizes, "blockwise", lhs_scale, rhs_scale)
    _assert_matches(out[:live], ref[:live], mag[:live])
    wrong = rhs_scale.copy()
    wrong[:, 1::2, :] *= 1.001  # every consumer's second slice's weight-scale blocks off by 0.1%
    with pytest.raises(AssertionError):
        _assert_matches(out[:live], *(r[:live] for r in _nt_reference(x, w, sizes, "blockwise", lhs_scale, wrong)))


@pytest.mark.parametrize("scaling, stack", LAYOUTS)
def test_gmm_nt_with_every_row_in_one_group_and_a_bf16_output(scaling, stack):
    x, w, sizes, lhs_scale, rhs_scale = _nt_case(SKEW, scaling, seed=2)
    out = _run_nt(x, w, sizes, scaling, lhs_scale, rhs_scale, out_dtype=jnp.bfloat16, stack=stack)
    ref, mag = _nt_reference(x, w, sizes, scaling, lhs_scale, rhs_scale)
    assert np.isfinite(out).all()
    np.testing.assert_array_less(np.abs(out - ref), 2.0 ** -8 * np.abs(ref) + 4e-6 * mag + 1e-30)  # bf16 rounding


@pytest.mark.parametrize("scaling, stack", LAYOUTS)
def test_gmm_nt_with_fewer_rows_than_one_tile(scaling, stack):
    """42 rows against a CTA tile of 64 (side by side) or 128 (stacked) rows: padded to one tile, 42 returned."""
    x, w, sizes, lhs_scale, rhs_scale = _nt_case([0, 25, 17], scaling, seed=4, m=42, n=128)
    out = _run_nt(x, w, sizes, scaling, lhs_scale, rhs_scale, stack=stack)
    assert out.shape == (42, 128)
    _assert_matches(out, *_nt_reference(x, w, sizes, scaling, lhs_scale, rhs_scale))


def _tn_case(sizes, scaling, seed, k=256, n=128):
    """Group-aligned transposed copies xᵀ [k, P], dyᵀ [n, P] (zeros between groups), laid out by a numpy cumsum,
    and the group blocks [(first, count)] the reference walks."""
    rng = np.random.default_rng(seed)
    blocks = -(-np.array(sizes) // SCALE_BLOCK)
    first = np.cumsum(blocks) - blocks
    p = SCALE_BLOCK * (blocks.sum() + 1)  # one block of slack past the last group
    xT, dyT = np.zeros((k, p)), np.zeros((n, p))
    for size, f in zip(sizes, first):
        xT[:, SCALE_BLOCK * f:SCALE_BLOCK * f + size] = _e4m3(rng, (k, size))
        dyT[:, SCALE_BLOCK * f:SCALE_BLOCK * f + size] = _e4m3(rng, (n, size))
    g = len(sizes)
    if scaling == "rowwise":
        lhs_scale, rhs_scale = _scales(rng, (g, k)), _scales(rng, (g, n))
    else:
        lhs_scale, rhs_scale = _scales(rng, (p // SCALE_BLOCK, k)), _scales(rng, (p // SCALE_BLOCK, n))
    return xT, dyT, np.array(sizes, np.int32), list(zip(first, blocks)), lhs_scale, rhs_scale


def _tn_reference(xT, dyT, layout, scaling, lhs_scale, rhs_scale):
    ref = np.zeros((len(layout), xT.shape[0], dyT.shape[0]))
    mag = np.zeros_like(ref)
    for g, (first, count) in enumerate(layout):
        for blk in range(first, first + count):
            cols = slice(SCALE_BLOCK * blk, SCALE_BLOCK * (blk + 1))
            scale = lhs_scale[blk][:, None] * rhs_scale[blk][None, :] if scaling == "blockwise" else 1.0
            ref[g] += xT[:, cols] @ dyT[:, cols].T * scale
            mag[g] += np.abs(xT[:, cols]) @ np.abs(dyT[:, cols]).T * scale
        if scaling == "rowwise":
            ref[g] *= lhs_scale[g][:, None] * rhs_scale[g][None, :]
            mag[g] *= lhs_scale[g][:, None] * rhs_scale[g][None, :]
    return ref, mag


@functools.cache
def _tn_cached(sizes, scaling, seed, n=128, stack="n", tile=TN_TILE, stream=False, out_dtype=jnp.float32,
               behind=False):
    """_tn_case's operands and gmm_tn_aligned's output on them, once per case (read-only numpy): tests that check
    the same kernel run share one interpretation."""
    xT, dyT, sizes_G, layout, lhs_scale, rhs_scale = _tn_case(list(sizes), scaling, seed, n=n)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        out = np.asarray(gmm_tn_aligned(jnp.asarray(xT, FP8), jnp.asarray(dyT, FP8), jnp.asarray(sizes_G), tile,
                                        scaling=scaling, lhs_scale=jnp.asarray(lhs_scale, jnp.float32),
                                        rhs_scale=jnp.asarray(rhs_scale, jnp.float32), stack=stack, stream=stream,
                                        out_dtype=out_dtype, behind=behind))
    for a in (xT, dyT, sizes_G, lhs_scale, rhs_scale, out):
        a.flags.writeable = False
    return (xT, dyT, sizes_G, layout, lhs_scale, rhs_scale), out


@pytest.mark.parametrize("scaling, stack", LAYOUTS)
@pytest.mark.parametrize("sizes", [MIXED, SKEW], ids=["mixed", "skew"])
def test_gmm_tn_aligned_matches_a_float64_loop_over_groups_in_the_gpu_interpreter(scaling, stack, sizes):
    (xT, dyT, sizes_G, layout, lhs_scale, rhs_scale), out = _tn_cached(tuple(sizes), scaling, 8, stack=stack)
    first, blocks = map(np.asarray, aligned_layout(jnp.asarray(sizes_G)))
    assert [(int(f), int(b)) for f, b in zip(first, blocks)] == layout
    assert out.dtype == jnp.float32 and out.shape == (len(sizes), 256, 128)
    out = np.asarray(out, np.float64)
    ref, mag = _tn_reference(xT, dyT, layout, scaling, lhs_scale, rhs_scale)
    _assert_matches(out, ref, mag)
    assert all((out[g] == 0).all() for g, size in enumerate(sizes) if size == 0)  # empty groups: zeros
    big = int(np.argmax(sizes))
    wrong = lhs_scale.copy()
    wrong[big if scaling == "rowwise" else sum(layout[big]) - 1, 5] *= 1.001  # one scale of the largest group
    with pytest.raises(AssertionError):
        _assert_matches(out, *_tn_reference(xT, dyT, layout, scaling, wrong, rhs_scale))


def test_gmm_tn_aligned_with_a_256_column_consumer_matches_a_float64_loop_over_groups(stack="m"):
    """Stacked (side by side, its 512 column scales exceed one TMA copy: refused, tested with the lowering)."""
    (xT, dyT, sizes_G, layout, lhs_scale, rhs_scale), out = _tn_cached(
        tuple(MIXED), "blockwise", 8, n=fp8_mosaic.cta_shape(WIDEST_TILE, stack)[1], stack=stack, tile=WIDEST_TILE)
    out = np.asarray(out, np.float64)
    _assert_matches(out, *_tn_reference(xT, dyT, layout, "blockwise", lhs_scale, rhs_scale))
    assert all((out[g] == 0).all() for g, size in enumerate(MIXED) if size == 0)
    wrong = rhs_scale.copy()
    wrong[:, 128:256] *= 1.001  # the column scales of the second slice
    with pytest.raises(AssertionError):
        _assert_matches(out, *_tn_reference(xT, dyT, layout, "blockwise", lhs_scale, wrong))


def _lower(product, scaling, tile, m, k, n, g, out_dtype, stack="n", stream=False, behind=False):
    """Export the product of the layer y = x·W (x [m, k], W [g, k, n]) for CUDA on this CPU: Mosaic GPU's layout
    inference and shared-memory check run here, as when the GPU compiles the kernel."""
    f32, sizes = jnp.float32, S((g,), jnp.int32)
    if product == "drhs":
        p = m + g * SCALE_BLOCK  # the aligned copies' bound: each group pads to at most one more block
        scales = ((S((g, k), f32), S((g, n), f32)) if scaling == "rowwise" else
                  (S((p // SCALE_BLOCK, k), f32), S((p // SCALE_BLOCK, n), f32)))
        fn = lambda a, b, gs, ls, rs: gmm_tn_aligned(a, b, gs, tile, scaling=scaling, lhs_scale=ls, rhs_scale=rs,
                                                     out_dtype=out_dtype, stack=stack, stream=stream, behind=behind)
        operands = (S((k, p), FP8), S((n, p), FP8), sizes, *scales)
    else:
        contract, out_cols = (k, n) if product == "fwd" else (n, k)  # dlhs: dy [m, n] · W[g]ᵀ, W read [g, k, n]
        scales = ((S((m,), f32), S((g, out_cols), f32)) if scaling == "rowwise" else
                  (S((contract // SCALE_BLOCK, m), f32),
                   S((g, out_cols // SCALE_BLOCK, contract // SCALE_BLOCK), f32)))
        fn = lambda a, b, gs, ls, rs: gmm_nt(a, b, gs, tile, scaling=scaling, lhs_scale=ls, rhs_scale=rs,
                                             out_dtype=out_dtype, stack=stack, stream=stream, behind=behind)
        operands = (S((m, contract), FP8), S((g, out_cols, contract), FP8), sizes, *scales)
    return export.export(jax.jit(fn), platforms=["cuda"])(*operands)


# DeepSeek-V3's gate-up (7168 -> 4096) and down (2048 -> 7168) projections at 8192 rows; nt's bf16 output and
# the float32 one of the down projection, tn's float32 weight gradient and a bf16 one.
@pytest.mark.parametrize("product, scaling", sorted(FP8_TILES))
@pytest.mark.parametrize("k, n, g, out_dtype", [(7168, 4096, 32, jnp.bfloat16), (2048, 7168, 8, jnp.float32)],
                         ids=["gate-up", "down"])
def test_every_table_tile_lowers_for_cuda_on_the_cpu(product, scaling, k, n, g, out_dtype):
    assert fp8_mosaic.fits(product, k, n, scaling)
    tile = fp8_mosaic.default_tile(product, 8192, k, n, g, scaling)
    assert tile == FP8_TILES[(product, scaling)]
    stack = fp8_mosaic.default_stack(product, scaling)
    stream = fp8_mosaic.default_stream(product, scaling)
    assert _lower(product, scaling, tile, 8192, k, n, g, out_dtype, stack, stream).platforms == ("cuda",)


@pytest.mark.parametrize("product", fp8_mosaic.PRODUCTS)
@pytest.mark.parametrize("stack", fp8_mosaic.STACKS)
@pytest.mark.parametrize("tile", [FP8_TILES[("drhs", "blockwise")], fp8_mosaic.FP8_NARROW,
                                  TileConfig(64, 256, 128, 3, grid_minor_dim=0, grid_tile_width=8)],
                         ids=["64x128/4", "64x128/5", "64x256/3"])
def test_the_blockwise_tiles_lower_with_either_consumer_layout(product, stack, tile):
    if product == "drhs" and fp8_mosaic.cta_shape(tile, stack)[1] > fp8_mosaic.TMA_MAX_BOX:
        with pytest.raises(ValueError, match="column scales in one copy"):  # Mosaic GPU's limit, said plainly
            _lower(product, "blockwise", tile, 8192, 7168, 4096, 32, jnp.bfloat16, stack)
        return
    assert _lower(product, "blockwise", tile, 8192, 7168, 4096, 32, jnp.bfloat16, stack).platforms == ("cuda",)


def test_the_default_tile_is_narrow_where_the_output_columns_take_no_256_wide_tile():
    """gmm_nt's blockwise products at 64x256 where 256 divides the output's columns, FP8_NARROW (128) elsewhere;
    fits() follows the tile default_tile gives."""
    assert fp8_mosaic.default_tile("fwd", 8192, 7168, 4096, 32, "blockwise").block_n == 256
    assert fp8_mosaic.default_tile("fwd", 8192, 7168, 4096 + 128, 32, "blockwise") == fp8_mosaic.FP8_NARROW
    assert fp8_mosaic.default_tile("dlhs", 8192, 7168 + 128, 4096, 32, "blockwise") == fp8_mosaic.FP8_NARROW
    assert fp8_mosaic.default_tile("dlhs", 8192, 7168, 4096 + 128, 32, "blockwise").block_n == 256
    assert fp8_mosaic.fits("fwd", 7168, 4096 + 128, "blockwise") and fp8_mosaic.fits("dlhs", 7168 + 128, 4096, "blockwise")
    assert fp8_mosaic.default_tile("drhs", 8192, 7168, 4096 + 128, 32, "blockwise") == FP8_TILES[("drhs", "blockwise")]
    _lower("fwd", "blockwise", fp8_mosaic.default_tile("fwd", 8192, 2048, 1152, 8, "blockwise"), 8192, 2048, 1152, 8,
           jnp.bfloat16, "m")
    _lower("dlhs", "blockwise", fp8_mosaic.default_tile("dlhs", 8192, 7296, 4096, 8, "blockwise"), 8192, 7296, 4096, 8,
           jnp.bfloat16, "m")


@pytest.mark.parametrize("product, scaling", [("fwd", "rowwise"), ("drhs", "blockwise")])
def test_lowering_fails_when_the_stages_do_not_fit_and_the_stage_count_is_the_largest_that_does(
        product, scaling, monkeypatch):
    """The check above can fail: one stage more than `_stages` picks (for a float32 output, where it drops
    stages) exceeds shared memory, so the pick is also the largest that fits."""
    def retrace(stages):  # the kernels are jitted: a program traced before would not call the patched _stages
        fp8_mosaic.gmm_nt.clear_cache()
        fp8_mosaic.gmm_tn_aligned.clear_cache()
        monkeypatch.setattr(fp8_mosaic, "_stages", stages)

    tile = FP8_TILES[(product, scaling)]
    chosen = []
    pick = fp8_mosaic._stages
    retrace(lambda *a: chosen.append(pick(*a)) or chosen[-1])
    _lower(product, scaling, tile, 8192, 2048, 7168, 8, jnp.float32)
    assert chosen[-1] < tile.num_stages
    retrace(lambda *a: chosen[0] + 1)
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        _lower(product, scaling, tile, 8192, 2048, 7168, 8, jnp.float32)


def test_a_bf16_weight_gradient_takes_the_table_tile_in_five_stages():
    """train.fp8_wgrad_dtype=bfloat16: 2-byte output blocks leave five stages at the table's 64x128 weight-gradient
    tile, where float32 ones leave four; rowwise keeps its table's tile."""
    two_byte, table = fp8_mosaic.FP8_WGRAD_2BYTE, FP8_TILES[("drhs", "blockwise")]
    assert (two_byte.block_m, two_byte.block_n, two_byte.block_k) == (table.block_m, table.block_n, table.block_k)
    for k, n in ((7168, 4096), (2048, 7168), (7168, 4096 + 128)):
        assert fp8_mosaic.default_tile("drhs", 8192, k, n, 32, "blockwise", jnp.bfloat16) == two_byte
        assert fp8_mosaic.default_tile("drhs", 8192, k, n, 32, "blockwise") == table
    assert fp8_mosaic.default_tile("drhs", 8192, 7168, 4096, 32, "rowwise", jnp.bfloat16) == \
        FP8_TILES[("drhs", "rowwise")]
    assert fp8_mosaic._stages(two_byte, jnp.bfloat16, "blockwise", (128, 128), "m") == two_byte.num_stages == 5
    assert fp8_mosaic._stages(two_byte, jnp.float32, "blockwise", (128, 128), "m") == table.num_stages == 4
    assert _lower("drhs", "blockwise", two_byte, 8192, 7168, 4096, 32, jnp.bfloat16, "m", True).platforms == ("cuda",)


def test_a_bf16_weight_gradient_is_the_float32_one_rounded_once():
    """The kernel rounds its float32 carry to the output dtype in the epilogue and nowhere else: the bf16 output
    at the wide tile, streamed, is the float32 output of the same kernel (the streamed test's 256-column case)
    rounded to bf16, bit for bit."""
    case = (tuple(MIXED), "blockwise", 8)
    kw = dict(n=fp8_mosaic.cta_shape(WIDEST_TILE, "m")[1], stack="m", tile=WIDEST_TILE, stream=True)
    (xT, dyT, _, layout, lhs_scale, rhs_scale), f32 = _tn_cached(*case, **kw)
    _, bf16 = _tn_cached(*case, **kw, out_dtype=jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16 and f32.dtype == jnp.float32
    np.testing.assert_array_equal(bf16.view(np.uint16), f32.astype(jnp.bfloat16).view(np.uint16))
    assert not np.array_equal(bf16.astype(np.float32), f32)  # the rounding is there to see
    _assert_matches(f32.astype(np.float64), *_tn_reference(xT, dyT, layout, "blockwise", lhs_scale, rhs_scale))


def test_a_stacked_tile_gets_the_most_stages_that_fit():
    """Stacked consumers: a CTA tile of 128 x 128 and bf16 output, six stages asked for; _stages picks five, and
    six do not fit (the check can fail)."""
    tile = TileConfig(64, 128, 128, 6, grid_minor_dim=0, grid_tile_width=8)
    assert fp8_mosaic._stages(tile, jnp.bfloat16, "blockwise", (128,), "m") == 5
    _lower("fwd", "blockwise", tile, 8192, 7168, 4096, 32, jnp.bfloat16, "m")
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        fp8_mosaic.gmm_nt.clear_cache()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fp8_mosaic, "_stages", lambda *_: 6)
            _lower("fwd", "blockwise", tile, 8192, 7168, 4096, 32, jnp.bfloat16, "m")
    fp8_mosaic.gmm_nt.clear_cache()


@pytest.mark.parametrize("scaling, stack", LAYOUTS)
def test_row_counts_off_the_shared_memory_tiling_lower_for_cuda(scaling, stack):
    """Rows not a multiple of 8 (a token count of a dense layer): padded to the next 8, not refused by Mosaic."""
    assert _lower("fwd", scaling, FP8_TILES[("fwd", scaling)], 8190, 2048, 4096, 1, jnp.bfloat16, stack).platforms \
        == ("cuda",)


def test_fits_and_default_tile():
    for product in fp8_mosaic.PRODUCTS:
        for scaling in fp8_mosaic.SCALINGS:
            assert fp8_mosaic.fits(product, 7168, 4096, scaling) and fp8_mosaic.fits(product, 2048, 7168, scaling)
    assert not fp8_mosaic.fits("fwd", 7168, 4000, "rowwise")  # output columns not a multiple of 256
    assert not fp8_mosaic.fits("fwd", 7000, 4096, "rowwise")  # contraction not a multiple of 128
    assert not fp8_mosaic.fits("dlhs", 7168 + 128, 4096, "rowwise")  # dlhs writes k columns: 256 must divide
    for product in fp8_mosaic.PRODUCTS:  # stacked consumers: a CTA tile 128 wide and 128 rows
        assert fp8_mosaic.fits(product, 7168 + 128, 4096 + 128, "blockwise")
    assert not fp8_mosaic.fits("drhs", 7168, 4096 + 128, "rowwise")
    assert fp8_mosaic.MEASURED <= set(FP8_TILES)
    assert all(t.block_m == 64 for (_, scaling), t in FP8_TILES.items() if scaling == "blockwise")  # registers
    with pytest.raises(ValueError, match="scaling"):
        fp8_mosaic.default_tile("fwd", 1, 128, 256, 1, "tensorwise")


@pytest.mark.parametrize("change, message", [
    (dict(scaling="tensorwise"), "scaling='tensorwise'"),
    (dict(lhs_scale=jnp.ones((256,), jnp.float32)), r"lhs_scale has shape \(256,\); blockwise .* \(2, 256\)"),
    (dict(rhs_scale=jnp.ones((2, 256), jnp.float32)), "rhs_scale has shape"),
    (dict(lhs=jnp.zeros((256, 256), jnp.bfloat16)), "operands must be float8_e4m3fn"),
    (dict(tile=TileConfig(64, 64, 64, 2)), "block_k == 128"),
    (dict(stack="k"), "stack='k'"),
    (dict(tile=TileConfig(64, 192, 128, 2)), "block_n dividing it or a multiple"),
    (dict(scaling="rowwise", lhs_scale=jnp.ones((256,)), rhs_scale=jnp.ones((2, 256)), stack="m"),
     "blockwise scaling only"),
    (dict(lhs=jnp.zeros((256, 320), FP8), rhs=jnp.zeros((2, 256, 320), FP8)), "multiple of 128"),
])
def test_gmm_nt_rejects_malformed_operands_with_one_clear_error(change, message):
    args = dict(lhs=jnp.zeros((256, 256), FP8), rhs=jnp.zeros((2, 256, 256), FP8), tile=NT_TILE,
                scaling="blockwise", lhs_scale=jnp.ones((2, 256), jnp.float32),
                rhs_scale=jnp.ones((2, 2, 2), jnp.float32)) | change
    if "lhs" in change and "rhs" in change:  # the scales follow the operands, so the dims are what fails
        args |= dict(scaling="rowwise", lhs_scale=jnp.ones((256,)), rhs_scale=jnp.ones((2, 256)))
    with pytest.raises(ValueError, match=message):
        gmm_nt(args["lhs"], args["rhs"], jnp.array([100, 100], jnp.int32), args["tile"], scaling=args["scaling"],
               lhs_scale=args["lhs_scale"], rhs_scale=args["rhs_scale"], stack=args.get("stack", "n"))


def test_gmm_tn_aligned_rejects_a_row_block_other_than_the_group_alignment():
    xT, dyT = jnp.zeros((128, 256), FP8), jnp.zeros((256, 256), FP8)
    with pytest.raises(ValueError, match="block_k must be 128"):
        gmm_tn_aligned(xT, dyT, jnp.array([10, 0], jnp.int32), TileConfig(64, 64, 64, 2), scaling="rowwise",
                       lhs_scale=jnp.ones((2, 128)), rhs_scale=jnp.ones((2, 256)))


def test_a_kernel_called_from_several_places_is_lowered_once():
    """Layers and the recomputed forward call the same product many times: the program holds one copy of each
    distinct kernel (each lowering costs host time), and a second shape its own."""
    tile = FP8_TILES[("fwd", "blockwise")]
    m, k, n, g = 8192, 2048, 4096, 8

    def nt(a, b, gs, ls, rs):
        return gmm_nt(a, b, gs, tile, scaling="blockwise", lhs_scale=ls, rhs_scale=rs,
                      stack=fp8_mosaic.default_stack("fwd", "blockwise"))

    def three_calls(a, b, gs, ls, rs):
        half = nt(a[: m // 2], b, gs, ls[:, : m // 2], rs)  # another shape: another kernel
        return nt(a, b, gs, ls, rs) + nt(a, b, gs, ls, rs), half

    operands = (S((m, k), FP8), S((g, n, k), FP8), S((g,), jnp.int32), S((k // SCALE_BLOCK, m), jnp.float32),
                S((g, n // SCALE_BLOCK, k // SCALE_BLOCK), jnp.float32))
    text = export.export(jax.jit(three_calls), platforms=["cuda"])(*operands).mlir_module()
    assert text.count("custom_call @mosaic_gpu") == 2


@pytest.mark.parametrize("stack, tile, sizes", [("n", TN_TILE, MIXED), ("m", TN_TILE, SKEW),
                                                ("m", TN_TILE, [0, 384, 0, 5]),  # 3 steps through 2 stages
                                                ("m", WIDEST_TILE, MIXED)],
                         ids=["side-by-side", "stacked-skew", "wraps-in-a-tile", "256-columns"])
def test_streamed_weight_gradient_equals_the_per_tile_pipeline_bit_for_bit(stack, tile, sizes):
    """gmm_tn_aligned(stream=True): one ring of stages across the CTA's tiles, the same steps in the same order as
    the per-tile pipeline, so the same bits: empty groups' zeros, 1-row groups, the ring wrapping inside and
    across tiles, two accumulator slices per consumer."""
    n = fp8_mosaic.cta_shape(tile, stack)[1] * (2 if tile.block_n < 128 else 1)
    (xT, dyT, _, layout, lhs_scale, rhs_scale), per_tile = _tn_cached(tuple(sizes), "blockwise", 8, n=n,
                                                                      stack=stack, tile=tile)
    _, streamed = _tn_cached(tuple(sizes), "blockwise", 8, n=n, stack=stack, tile=tile, stream=True)
    np.testing.assert_array_equal(streamed.view(np.uint32), per_tile.view(np.uint32))
    _assert_matches(streamed.astype(np.float64), *_tn_reference(xT, dyT, layout, "blockwise", lhs_scale, rhs_scale))


@pytest.mark.parametrize("stack, sizes", [("m", MIXED), ("m", [0, 384, 0, 5])], ids=["mixed", "wraps-in-a-tile"])
def test_weight_gradient_promoted_behind_the_next_wgmma_equals_the_per_tile_pipeline_bit_for_bit(stack, sizes):
    """gmm_tn_aligned(stream=True, behind=True): each column block's product promoted while the next block's wgmma
    runs gives the per-tile pipeline's bits: empty groups (no step: their zeros), 1- and 2-block groups, three
    blocks through two stages (the per-tile runs: the float64 and streamed tests' own)."""
    (xT, dyT, _, layout, lhs_scale, rhs_scale), per_tile = _tn_cached(tuple(sizes), "blockwise", 8, stack=stack)
    _, behind = _tn_cached(tuple(sizes), "blockwise", 8, stack=stack, stream=True, behind=True)
    np.testing.assert_array_equal(behind.view(np.uint32), per_tile.view(np.uint32))
    _assert_matches(behind.astype(np.float64), *_tn_reference(xT, dyT, layout, "blockwise", lhs_scale, rhs_scale))


# A walk of width 3 over four column tiles: some CTA meets a row tile past the last group (no step) and then a
# full one, so a consumer and the producer that counted an empty tile's steps differently fall out of step.
EMPTY_THEN_FULL = TileConfig(64, 64, 128, 2, grid_minor_dim=0, grid_tile_width=3)


@pytest.mark.parametrize("stack, tile, sizes, k, n_tiles", [
    ("m", EMPTY_THEN_FULL, MIXED, 384, 4), ("n", NT_TILE, SKEW, 256, 2), ("m", WIDEST_TILE, MIXED, 256, 2)],
    ids=["stacked-wraps-empty-then-full", "side-by-side-skew", "256-columns"])
def test_streamed_gmm_nt_equals_the_per_tile_pipeline_bit_for_bit(stack, tile, sizes, k, n_tiles):
    """gmm_nt(stream=True): one ring of stages across the CTA's (row tile, column tile) pairs, the same steps in
    the same order as the per-tile pipeline, so the same bits on every row in a group: 1-row and empty groups, row
    tiles split between groups and past the last group (no step) followed by full ones in the same CTA, three K
    steps through two stages (the ring wraps inside a tile), two accumulator slices per consumer. Whether a
    consumer waits for its previous store before reusing the output blocks is a GPU timing question that the
    interpreter does not see (its race detector flags the per-tile kernel as well)."""
    n = n_tiles * fp8_mosaic.cta_shape(tile, stack)[1]
    (x, w, sizes, lhs_scale, rhs_scale), per_tile = _nt_cached(tuple(sizes), "blockwise", 9, k=k, n=n,
                                                               stack=stack, tile=tile)
    _, streamed = _nt_cached(tuple(sizes), "blockwise", 9, k=k, n=n, stack=stack, tile=tile, stream=True)
    live = sizes.sum()
    np.testing.assert_array_equal(streamed[:live].view(np.uint64), per_tile[:live].view(np.uint64))
    ref, mag = _nt_reference(x, w, sizes, "blockwise", lhs_scale, rhs_scale)
    _assert_matches(streamed[:live], ref[:live], mag[:live])


@pytest.mark.parametrize("stack, tile, sizes, k, n_tiles", [
    ("m", EMPTY_THEN_FULL, MIXED, 384, 4), ("n", NT_TILE, SKEW, 256, 2), ("m", WIDE_TILE, MIXED, 512, 2)],
    ids=["stacked-three-steps-empty-then-full", "side-by-side-skew-two-steps", "64x128-four-steps"])
def test_promotion_behind_the_next_wgmma_equals_the_per_tile_pipeline_bit_for_bit(stack, tile, sizes, k, n_tiles):
    """gmm_nt(stream=True, behind=True): each K block's product promoted while the next block's wgmma runs, the
    two accumulators taken in turn, is the same additions in the same order as the per-tile pipeline, so the same
    bits: two, three and four K steps through two stages (the steps after the first taken in pairs, then one more
    or none: every path of `_steps_behind`; the ring wrapping inside a tile), empty tiles followed by full ones,
    side by side and stacked. Which step's product is added with which step's scales, and after which
    release, is what the interpreter checks (it runs each wgmma to completion where it is issued); the wgmma left
    running is a GPU timing question it does not see."""
    n = n_tiles * fp8_mosaic.cta_shape(tile, stack)[1]  # the first two: the streamed test's cases, run once
    (x, w, sizes, lhs_scale, rhs_scale), per_tile = _nt_cached(tuple(sizes), "blockwise", 9, k=k, n=n,
                                                               stack=stack, tile=tile)
    _, behind = _nt_cached(tuple(sizes), "blockwise", 9, k=k, n=n, stack=stack, tile=tile, stream=True,
                           behind=True)
    live = sizes.sum()
    np.testing.assert_array_equal(behind[:live].view(np.uint64), per_tile[:live].view(np.uint64))
    ref, mag = _nt_reference(x, w, sizes, "blockwise", lhs_scale, rhs_scale)
    _assert_matches(behind[:live], ref[:live], mag[:live])


@pytest.mark.parametrize("product", fp8_mosaic.PRODUCTS)
def test_promotion_behind_lowers_for_cuda_at_128_columns_and_refuses_what_it_does_not_run(product):
    """At DeepSeek-V3's gate+up shape, the 64x128 stacked tiles (gmm_nt's in five stages, the weight gradient's
    table tile, float32 out); refused with one clear error per case where it does not run: a consumer wider than
    one 128-column slice, the per-tile pipeline, one pipeline stage (a consumer holds a step's slot until the next
    step's blocks have landed: with one slot it would wait for itself); rowwise has no streamed kernel, which the
    test below checks."""
    tile, wide = fp8_mosaic.FP8_NARROW, TileConfig(64, 256, 128, 2, grid_minor_dim=0, grid_tile_width=8)
    out_dtype, kernel = (jnp.float32, "gmm_tn_aligned") if product == "drhs" else (jnp.bfloat16, "gmm_nt")
    if product == "drhs":
        tile = FP8_TILES[(product, "blockwise")]
    assert _lower(product, "blockwise", tile, 8192, 7168, 4096, 32, out_dtype, "m", stream=True,
                  behind=True).platforms == ("cuda",)
    one_stage = TileConfig(64, 128, 128, 1, grid_minor_dim=0, grid_tile_width=8)
    for wrong, message in ((dict(tile=wide), "at most 128"), (dict(stream=False), "at most 128"),
                           (dict(tile=one_stage), "two pipeline stages")):
        args = dict(tile=tile, stream=True) | wrong
        with pytest.raises(ValueError, match=kernel + r"\(behind=True\) .*" + message):
            _lower(product, "blockwise", args["tile"], 8192, 7168, 4096, 32, out_dtype, "m",
                   stream=args["stream"], behind=True)


@pytest.mark.parametrize("product", fp8_mosaic.PRODUCTS)
def test_the_streamed_kernels_lower_for_cuda_and_refuse_rowwise_scaling(product):
    tile = fp8_mosaic.default_tile(product, 8192, 7168, 4096, 32, "blockwise")
    out_dtype = jnp.float32 if product == "drhs" else jnp.bfloat16
    stack = fp8_mosaic.default_stack(product, "blockwise")
    assert _lower(product, "blockwise", tile, 8192, 7168, 4096, 32, out_dtype, stack, stream=True).platforms == \
        ("cuda",)
    with pytest.raises(ValueError, match="blockwise scaling only"):
        if product == "drhs":
            gmm_tn_aligned(jnp.zeros((128, 256), FP8), jnp.zeros((256, 256), FP8), jnp.zeros((2,), jnp.int32),
                           TN_TILE, scaling="rowwise", lhs_scale=jnp.ones((2, 128)), rhs_scale=jnp.ones((2, 256)),
                           stream=True)
        else:
            gmm_nt(jnp.zeros((256, 256), FP8), jnp.zeros((2, 256, 256), FP8), jnp.array([100, 100], jnp.int32),
                   NT_TILE, scaling="rowwise", lhs_scale=jnp.ones((256,)), rhs_scale=jnp.ones((2, 256)), stream=True)
