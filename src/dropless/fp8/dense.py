"""The dense layers' FP8 matmul: attention projections, dense MLPs and shared experts under `train.fp8`.

`linear(x, w, recipe)` is `x @ w` in x's dtype when recipe is None, and `fp8_matmul` otherwise. `fp8_matmul` is
differentiable in x and w through its own VJP, which quantizes each operand of the three products as the recipe
says (dropless.fp8.recipe): the forward keeps, for the backward, the e4m3 weight copy the input gradient reads
and the e4m3 transposed activations the weight gradient reads (half the bytes of the bf16 activations a bf16
matmul keeps). Products:

  rowwise     our Mosaic GPU grouped kernel with one group (dropless.gmm.fp8_mosaic: the row and column scales in
              its epilogue) where native and the dims fit it; native dims it does not fit, the dequantized bf16
              product (as blockwise); not native, an e4m3 dot_general with both operands contraction-last, float32
              out, then the scales (XLA:CPU runs e4m3 dots). Not XLA's e4m3 dot on a GPU: XLA hands it to
              cuBLASLt and autotunes every such call while compiling (the process compiling one matmul's three
              products at the proxy's dense-MLP shape had not finished after 120 s on an H200,
              fp8-rowwise-compile-h200.json)
  blockwise   our Mosaic GPU grouped kernel with one group (dropless.gmm.fp8_mosaic: promotion every 128 of the
              contraction) where native and the dims fit it; otherwise the dequantized bf16 product
  mxfp8       jax.nn.scaled_dot_general, with its own quantization and VJP (OCP MX, 1 x 32, e8m0 scales)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dropless.core.mesh import per_batch_shard
from dropless.fp8.recipe import BLOCK, MX_BLOCK, Recipe, one_pass_pair, unpack, weight_copies
from dropless.gmm import fp8_mosaic
from dropless.ops.fp8 import Quantized, dequantize, quantize
from dropless.ops.matmul import matmul_f32_out

NT = (((1,), (1,)), ((), ()))  # contract both operands' last axis


def linear(x: jax.Array, w: jax.Array, recipe: Recipe | None = None, out_dtype=None,
           mesh: Mesh | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in out_dtype (default x's): bf16 (w cast to x's dtype), or FP8 (`mesh`:
    see fp8_matmul)."""
    if recipe is None:
        if out_dtype is not None and jnp.dtype(out_dtype) == jnp.float32 and x.dtype != jnp.float32:
            return matmul_f32_out(x, w.astype(x.dtype))  # float32 out, backward at the operands' rate
        return x @ w.astype(x.dtype)
    return fp8_matmul(x, w, recipe, out_dtype, mesh)


def fp8_matmul(x: jax.Array, w: jax.Array, recipe: Recipe, out_dtype=None, mesh: Mesh | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] with e4m3 operands as `recipe` scales them, float32 accumulation, out_dtype out. A
    CachedWeight w brings its e4m3 copies (quantized once per step) and takes the gradient in its master weight.

    `mesh`, the training mesh, for an x whose leading axis is the batch (split over the mesh as the batch is):
    with several devices each multiplies its own rows by the whole w (gathered, as FSDP gathers it for the bf16
    matmul), and w's gradient is the sum of theirs. XLA cannot partition our kernels: under plain jit it would
    gather every row onto every device and run the whole product on each."""
    if mesh is not None and mesh.size > 1:
        return per_batch_shard(lambda x, w: fp8_matmul(x, w, recipe, out_dtype), mesh, whole=1)(x, w)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    lead, k = x.shape[:-1], x.shape[-1]
    x_TK = x.reshape(-1, k)
    w_KN, copies = unpack(w)
    if not x_TK.shape[0]:  # no rows (an empty batch): nothing to quantize or multiply, and w's gradient is 0
        return jnp.zeros((*lead, w.shape[1]), out_dtype)
    if recipe.mode == "mxfp8":
        return _mxfp8_matmul(x_TK, w_KN, out_dtype).reshape(*lead, w.shape[1])
    dtypes = (out_dtype, x.dtype, w.dtype)
    return _fp8_matmul_2d(x_TK, w_KN, copies, recipe, dtypes).reshape(*lead, w.shape[1])


def _mxfp8_matmul(x_TK: jax.Array, w_KN: jax.Array, out_dtype) -> jax.Array:
    """jax.nn.scaled_dot_general with OCP MX e4m3 blocks for the forward and both gradients. Each product
    contracts a different axis (K, N, then the tokens) in blocks of 32, so all three are zero-padded to whole
    blocks (zeros change neither a block's scale nor a sum)."""
    (t, k), n = x_TK.shape, w_KN.shape[1]
    config = jax.nn.get_scaled_dot_general_config("mxfp8")
    x_TK = _gradient_in(x_TK, x_TK.dtype)
    x_TK = jnp.pad(x_TK, ((0, -t % MX_BLOCK), (0, -k % MX_BLOCK)))
    w_KN = jnp.pad(w_KN.astype(x_TK.dtype), ((0, -k % MX_BLOCK), (0, -n % MX_BLOCK)))
    y_TN = jax.nn.scaled_dot_general(x_TK, w_KN, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                                     configs=[config] * 3)
    return y_TN[:t, :n].astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gradient_in(x, dtype):
    """x, whose cotangent comes back in `dtype`: scaled_dot_general's VJP returns its operands' gradients in its
    preferred_element_type (float32), where the caller's bf16 x needs a bf16 one (the permutation's VJP, for one,
    checks it)."""
    return x


_gradient_in.defvjp(lambda x, dtype: (x, None), lambda dtype, _, g: (g.astype(dtype),))


def _rows_and_transposed(a_TX: jax.Array, recipe: Recipe) -> tuple[Quantized, Quantized]:
    """(a [T, X] per recipe.operand for a rows product, aᵀ [X, T'] contraction-last for the weight gradient, T' = T
    rounded up to whole 128-token tiles of zeros); from one pass over a where the recipe fuses them and T is whole
    tiles already (padding first would cost the pass the fusion saves)."""
    if pair := one_pass_pair(a_TX, recipe):
        return pair
    padded_TX = jnp.pad(a_TX, ((0, -a_TX.shape[0] % BLOCK), (0, 0)))
    return quantize(a_TX, recipe.operand(2)), quantize(padded_TX.T, recipe.operand(2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_matmul_2d(x_TK, w_KN, copies, recipe: Recipe, dtypes: tuple):
    """dtypes: (output, x's, w's): the gradients come back in their primal's dtype. `copies`: w's two e4m3 copies
    (a CachedWeight's), or None to quantize w here; they take no gradient."""
    return _fwd(x_TK, w_KN, copies, recipe, dtypes)[0]


def _fwd(x_TK, w_KN, copies, recipe, dtypes):
    w_fwd, w_dlhs = copies or weight_copies(w_KN, recipe)
    x_q, xT = _rows_and_transposed(x_TK, recipe)
    y_TN = rows_product(x_q, w_fwd, recipe, out_dtype=dtypes[0])
    return y_TN, (xT, w_dlhs)


def _bwd(recipe, dtypes, residuals, dy_TN):
    xT, w_dlhs = residuals
    _, x_dtype, w_dtype = dtypes
    dy_q, dyT = _rows_and_transposed(dy_TN.astype(x_dtype), recipe)
    dx_TK = rows_product(dy_q, w_dlhs, recipe, "dlhs", out_dtype=x_dtype)
    dw_KN = contract_product(xT, dyT, recipe, recipe.wgrad_dtype(w_dtype)).astype(w_dtype)
    return dx_TK, dw_KN, None


_fp8_matmul_2d.defvjp(_fwd, _bwd)


def _dequantized_nt(a: Quantized, a_block, b: Quantized, b_block) -> jax.Array:
    """a [T, C] · b [O, C]ᵀ from the exactly dequantized operands (bf16, float32 accumulation)."""
    a_, b_ = dequantize(a, a_block, jnp.bfloat16), dequantize(b, b_block, jnp.bfloat16)
    return jax.lax.dot_general(a_, b_, NT, preferred_element_type=jnp.float32)


def _e4m3_nt(a: Quantized, b: Quantized) -> jax.Array:
    """a [T, C] · b [O, C]ᵀ as XLA's e4m3 dot, float32, then a's row and b's row scales (rowwise, not native)."""
    y = jax.lax.dot_general(a.values, b.values, NT, preferred_element_type=jnp.float32)
    return y * a.scales * b.scales.T


def rows_product(a: Quantized, b: Quantized, recipe: Recipe, product: str = "fwd", out_dtype=jnp.float32) -> jax.Array:
    """a [T, C] · b [O, C]ᵀ, [T, O] in out_dtype (float32 accumulation, one rounding to out_dtype); a scaled per
    recipe.operand, b per recipe.weight. `product`: fwd (C = the layer's k, O = n) or dlhs (C = n, O = k). Our
    kernel writes out_dtype from its epilogue: a bf16 layer's output never exists in float32 in memory."""
    (t, c), o = a.values.shape, b.values.shape[0]
    k, n = (c, o) if product == "fwd" else (o, c)
    rowwise = recipe.mode == "rowwise"
    if recipe.native and fp8_mosaic.fits(product, k, n, recipe.mode):
        tile = fp8_mosaic.default_tile(product, t, k, n, 1, recipe.mode)
        lhs_scale, rhs_scale = (a.scales[:, 0], b.scales[None, :, 0]) if rowwise else (a.scales.T, b.scales[None])
        return fp8_mosaic.gmm_nt(a.values, b.values[None], jnp.full((1,), t, jnp.int32), tile, scaling=recipe.mode,
                                 lhs_scale=lhs_scale, rhs_scale=rhs_scale, out_dtype=out_dtype,
                                 stack=fp8_mosaic.default_stack(product, recipe.mode),
                                 stream=fp8_mosaic.default_stream(product, recipe.mode),
                                 behind=fp8_mosaic.default_behind(product, recipe.mode, tile))
    if rowwise and not recipe.native:
        return _e4m3_nt(a, b).astype(out_dtype)
    return _dequantized_nt(a, recipe.operand(2), b, recipe.weight(2)).astype(out_dtype)


def contract_product(aT: Quantized, bT: Quantized, recipe: Recipe, out_dtype=jnp.float32) -> jax.Array:
    """aT [K, T'] · bT [N, T']ᵀ, [K, N] in out_dtype (float32 accumulation, one rounding): the weight gradient
    from the transposed operands."""
    (k, t), n = aT.values.shape, bT.values.shape[0]
    if recipe.native and fp8_mosaic.fits("drhs", k, n, recipe.mode):  # rowwise: one scale per row of each copy
        tile = fp8_mosaic.default_tile("drhs", t, k, n, 1, recipe.mode, out_dtype)
        return fp8_mosaic.gmm_tn_aligned(aT.values, bT.values, jnp.full((1,), t, jnp.int32), tile,
                                         scaling=recipe.mode, lhs_scale=aT.scales.T, rhs_scale=bT.scales.T,
                                         out_dtype=out_dtype, stack=fp8_mosaic.default_stack("drhs", recipe.mode),
                                         stream=fp8_mosaic.default_stream("drhs", recipe.mode),
                                         behind=fp8_mosaic.default_behind("drhs", recipe.mode, tile))[0]
    if recipe.mode == "rowwise" and not recipe.native:
        return _e4m3_nt(aT, bT).astype(out_dtype)
    return _dequantized_nt(aT, recipe.operand(2), bT, recipe.operand(2)).astype(out_dtype)
