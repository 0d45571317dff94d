"""The FP8 grouped GEMM of the routed experts (`train.fp8`): three e4m3 products under one VJP.

`Fp8Gmm` is a grouped-GEMM backend (dropless.gmm.api's interface and row contract) wrapping the configured one:
it quantizes each product's operands as its recipe says (dropless.fp8.recipe) and runs the product on e4m3
(our Mosaic GPU kernels, dropless.gmm.fp8_mosaic, when the recipe is native and the dims fit them) or on the
exactly dequantized bf16 operands through the wrapped backend (the same arithmetic, to float32 rounding).

  fwd   y  = x · W[g]         x [M, K] per recipe.operand, Wᵀ [G, N, K] per recipe.weight (a transposed copy)
  dlhs  dx = dy · W[g]ᵀ       dy [M, N] per recipe.operand, W [G, K, N] as stored
  drhs  dW = xᵀ · dy          transposed, expert-aligned copies xᵀ [K, P], dyᵀ [N, P]

The weight gradient contracts the (ragged) token axis, so its operands are transposed copies in which each
expert's rows start at a multiple of 128 and are zero-padded to it: a 128-token scale tile then never straddles
two experts, and the kernel needs no masking (8-bit shared memory has no pointwise ops on Hopper). The routed
experts' permutation writes its rows in that layout already (`row_align` = 128, dropless.gmm.api; experts_gmm
builds that Fp8Gmm), so each copy is one transpose fused with its quantization (`transposed`). A caller whose
groups lie end to end (row_align = 1) gets copies built by a transpose and a column gather (`aligned_sources`,
`aligned_transposed`): a pass that reads the rows at scattered columns, several times the plain transpose's cost.
The forward keeps xᵀ in e4m3 for the backward instead of x in bf16, and quantizes each weight once for both of
its products.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from dropless.core.varying import sum_like, varying_like
from dropless.fp8.recipe import Recipe, one_pass_pair, unpack, weight_copies
from dropless.gmm import fp8_mosaic, make_gmm
from dropless.gmm.dropless_mosaic import DroplessMosaicGmm, TunedContract
from dropless.gmm.api import GroupedMatmul, aligned_rows, zero_padding_rows
from dropless.gmm.vjp import ContractProduct
from dropless.gmm.xla import XlaContract
from dropless.ops.fp8 import Quantized, block_amax, dequantize, power_of_two_scale, quantize, quantize_with_scales

ALIGN = fp8_mosaic.SCALE_BLOCK  # 128: the weight gradient's token tiles, each inside one expert


def _block_groups(group_sizes_G: jax.Array, num_blocks: int, align: int) -> jax.Array:
    """The group of each `align`-row block of an expert-aligned layout [num_blocks] int32, G past the last group."""
    _, blocks_G = fp8_mosaic.aligned_layout(group_sizes_G, align)
    return jnp.searchsorted(jnp.cumsum(blocks_G), jnp.arange(num_blocks, dtype=jnp.int32),
                            side="right").astype(jnp.int32)


def aligned_sources(group_sizes_G: jax.Array, num_rows: int, align: int):
    """For each position p of the aligned copy of rows laid end to end: (source row [P] int32, valid [P] bool,
    group of each align-block [P / align] int32, G for blocks past the last group)."""
    g = group_sizes_G.shape[0]
    p = aligned_rows(num_rows, g, align)
    sizes_G = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    first_G, _ = fp8_mosaic.aligned_layout(sizes_G, align)
    offsets_G = jnp.cumsum(sizes_G) - sizes_G
    block_group_B = _block_groups(sizes_G, p // align, align)
    group_P = jnp.repeat(block_group_B, align)  # p // align blocks of align rows (a broadcast, see ops.fp8)
    safe_P = jnp.minimum(group_P, g - 1)
    within_P = jnp.arange(p, dtype=jnp.int32) - align * first_G[safe_P]
    valid_P = (group_P < g) & (within_P < sizes_G[safe_P])
    source_P = jnp.clip(offsets_G[safe_P] + within_P, 0, num_rows - 1)
    return source_P, valid_P, block_group_B


def _quantized_copy(aT_XP: jax.Array, block_group_B: jax.Array, num_groups: int, recipe: Recipe) -> Quantized:
    """An expert-aligned copy aᵀ [X, P] in e4m3: per (1, recipe.contract_block) block, for rowwise one scale per
    expert and feature over its 128-row blocks (`block_group_B`: each block's expert, G for none)."""
    block = recipe.contract_block
    if recipe.mode != "rowwise":
        return quantize(aT_XP, (1, block))
    amax_BX = block_amax(aT_XP, (1, block)).T
    group_amax_GX = jax.ops.segment_max(amax_BX, block_group_B, num_segments=num_groups + 1)
    scales_XB = power_of_two_scale(jnp.maximum(group_amax_GX, 0.0))[block_group_B].T
    return quantize_with_scales(aT_XP, scales_XB, (1, block))


def aligned_transposed(a_MX: jax.Array, group_sizes_G: jax.Array, recipe: Recipe) -> Quantized:
    """aᵀ [X, P] in e4m3 of rows laid end to end: each expert's rows from a multiple of 128 on, zeros between;
    scales per (1, recipe.contract_block) block [X, P / block], for rowwise one value per expert over its blocks."""
    source_P, valid_P, block_group_B = aligned_sources(group_sizes_G, a_MX.shape[0], ALIGN)
    # Transpose first, then gather columns: neighbouring outputs then read neighbouring inputs. Fused into one
    # pass, the row gather would read x[source[p], k] for consecutive p, K elements apart (a strided read, several
    # times slower on an H200); the barrier keeps XLA from fusing the transpose into the gather.
    aT_XM = jax.lax.optimization_barrier(a_MX.T)
    aT_XP = jnp.where(valid_P[None, :], jnp.take(aT_XM, source_P, axis=1), 0)
    return _quantized_copy(aT_XP, block_group_B, group_sizes_G.shape[0], recipe)


def transposed(a_MX: jax.Array, group_sizes_G: jax.Array, recipe: Recipe) -> Quantized:
    """aᵀ [X, M] in e4m3 of rows already expert-aligned (each group a multiple of 128 rows, so starting at one):
    one transpose fused with its quantization. The rows past sum(group_sizes) may hold anything (a grouped GEMM's
    unwritten padding): they fill whole 128-row blocks of their own, whose scales no product reads."""
    m = a_MX.shape[0]
    return _quantized_copy(a_MX.T, _block_groups(group_sizes_G, m // ALIGN, ALIGN), group_sizes_G.shape[0], recipe)


@dataclass(frozen=True)
class Fp8Products:
    """How an Fp8Gmm runs its products: e4m3 kernels where native and the dims fit, else `dequantized_rows` (a
    grouped-GEMM backend) and `dequantized_contract` (a weight-gradient product) on the dequantized operands."""

    recipe: Recipe
    dequantized_rows: GroupedMatmul
    dequantized_contract: ContractProduct

    def _kernel(self, product: str, k: int, n: int) -> bool:
        """Whether the e4m3 kernels run this product of the layer y = x·W, x [M, k], W [G, k, n]."""
        return self.recipe.native and self.recipe.mode != "mxfp8" and fp8_mosaic.fits(product, k, n, self.recipe.mode)

    def rows(self, a: Quantized, b: Quantized, group_sizes_G, product: str, out_dtype) -> jax.Array:
        """a [M, C] · b[g] [O, C]ᵀ per row's group: [M, O]; rows past sum(group_sizes) unspecified. `product`:
        fwd (C = the layer's k, O = n) or dlhs (C = n, O = k)."""
        (m, c), (g, o, _) = a.values.shape, b.values.shape
        r = self.recipe
        k, n = (c, o) if product == "fwd" else (o, c)
        if self._kernel(product, k, n):
            tile = fp8_mosaic.default_tile(product, m, k, n, g, r.mode)
            lhs_scale = a.scales[:, 0] if r.mode == "rowwise" else a.scales.T
            rhs_scale = b.scales[..., 0] if r.mode == "rowwise" else b.scales
            return fp8_mosaic.gmm_nt(a.values, b.values, group_sizes_G, tile, scaling=r.mode, lhs_scale=lhs_scale,
                                     rhs_scale=rhs_scale, out_dtype=out_dtype,
                                     stack=fp8_mosaic.default_stack(product, r.mode),
                                     stream=fp8_mosaic.default_stream(product, r.mode),
                                     behind=fp8_mosaic.default_behind(product, r.mode, tile))
        a_ = dequantize(a, r.operand(2), jnp.bfloat16)
        b_ = jnp.swapaxes(dequantize(b, r.weight(3), jnp.bfloat16), 1, 2)
        return self.dequantized_rows(a_, b_, group_sizes_G, preferred_element_type=out_dtype, zero_padding=False)

    def contract(self, aT: Quantized, bT: Quantized, group_sizes_G, out_dtype) -> jax.Array:
        """dW[g] = aT[:, rows of g] · bT[:, rows of g]ᵀ from expert-aligned copies: [G, K, N]."""
        (k, _), n, g = aT.values.shape, bT.values.shape[0], group_sizes_G.shape[0]
        r = self.recipe
        if self._kernel("drhs", k, n):
            tile = fp8_mosaic.default_tile("drhs", aT.values.shape[1], k, n, g, r.mode, out_dtype)
            if r.mode == "rowwise":  # one scale per expert: its first block's
                first_G, _ = fp8_mosaic.aligned_layout(group_sizes_G, 128)
                first_G = jnp.minimum(first_G, aT.scales.shape[1] - 1)
                lhs_scale, rhs_scale = aT.scales[:, first_G].T, bT.scales[:, first_G].T
            else:
                lhs_scale, rhs_scale = aT.scales.T, bT.scales.T
            return fp8_mosaic.gmm_tn_aligned(aT.values, bT.values, group_sizes_G, tile, scaling=r.mode,
                                             lhs_scale=lhs_scale, rhs_scale=rhs_scale, out_dtype=out_dtype,
                                             stack=fp8_mosaic.default_stack("drhs", r.mode),
                                             stream=fp8_mosaic.default_stream("drhs", r.mode),
                                             behind=fp8_mosaic.default_behind("drhs", r.mode, tile))
        block = (1, r.contract_block)
        a_PK = dequantize(aT, block, jnp.bfloat16).T
        b_PN = dequantize(bT, block, jnp.bfloat16).T
        _, blocks_G = fp8_mosaic.aligned_layout(group_sizes_G, 128)
        return self.dequantized_contract(a_PK, b_PN, 128 * blocks_G, out_dtype=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def fp8_gmm(x_MK, w_GKN, copies, group_sizes_G, products: Fp8Products, dtypes: tuple, zero_padding: bool,
            aligned: bool, zero_lhs_grad_padding: bool = True):
    """out_MN[m] = x[m] · W[g(m)] with e4m3 operands (module docstring), differentiable in x and W.
    `copies`: W's two e4m3 copies (a CachedWeight's; they take no gradient), or None to quantize W here.
    dtypes: (output, x's, W's): the gradients come back in their primal's dtype. `aligned`: the rows are
    expert-aligned (Fp8Gmm.row_align), so the weight gradient's copies are plain transposes.
    `zero_lhs_grad_padding` as dropless.gmm.api's."""
    return _fwd(x_MK, w_GKN, copies, group_sizes_G, products, dtypes, zero_padding, aligned,
                zero_lhs_grad_padding)[0]


def _rows_and_copy(a_MX: jax.Array, group_sizes_G: jax.Array, recipe: Recipe, aligned: bool):
    """(a [M, X] quantized per recipe.operand for a rows product, its expert-aligned transposed copy aᵀ for the
    weight gradient): from one pass over a where the recipe fuses them (expert-aligned rows, blockwise: the copy's
    128-token tiles are the 128-row tiles of a)."""
    if aligned and (pair := one_pass_pair(a_MX, recipe)):
        return pair
    copy = transposed if aligned else aligned_transposed
    return quantize(a_MX, recipe.operand(2)), copy(a_MX, group_sizes_G, recipe)


def _fwd(x_MK, w_GKN, copies, group_sizes_G, products, dtypes, zero_padding, aligned, zero_lhs_grad_padding):
    r = products.recipe
    w_fwd, w_dlhs = copies or weight_copies(w_GKN, r)
    x_q, xT = _rows_and_copy(x_MK, group_sizes_G, r, aligned)
    y_MN = products.rows(x_q, w_fwd, group_sizes_G, "fwd", dtypes[0])
    y_MN = varying_like(y_MN, x_MK, w_GKN, group_sizes_G)
    if zero_padding:
        y_MN = zero_padding_rows(y_MN, group_sizes_G)
    return y_MN, (xT, w_dlhs, group_sizes_G)


def _bwd(products, dtypes, zero_padding, aligned, zero_lhs_grad_padding, residuals, dy_MN):
    xT, w_dlhs, group_sizes_G = residuals
    r = products.recipe
    _, x_dtype, w_dtype = dtypes
    dy_q, dyT = _rows_and_copy(dy_MN.astype(x_dtype), group_sizes_G, r, aligned)
    dx_MK = products.rows(dy_q, w_dlhs, group_sizes_G, "dlhs", x_dtype)
    dw_GKN = products.contract(xT, dyT, group_sizes_G, r.wgrad_dtype(w_dtype)).astype(w_dtype)
    if zero_lhs_grad_padding:
        dx_MK = zero_padding_rows(dx_MK, group_sizes_G)
    return (varying_like(dx_MK, xT.values, w_dlhs.values),
            sum_like(dw_GKN, w_dlhs.values, xT.values), None, None)


fp8_gmm.defvjp(_fwd, _bwd)


@dataclass(frozen=True)
class Fp8Gmm(GroupedMatmul):
    """The routed experts' grouped GEMM under `train.fp8` (module docstring); counts no dropped rows.

    `row_align` (dropless.gmm.api): 128 asks the caller for expert-aligned rows (the routed experts' permutation
    writes them), and the weight gradient's copies are plain transposes; 1 takes groups laid end to end and
    builds the aligned copies by a column gather."""

    name: ClassVar[str] = "fp8"
    weights_as_stored: ClassVar[bool] = True  # quantized from the master weights (dropless.gmm.api)
    products: Fp8Products
    row_align: int = 1

    def __post_init__(self):
        if self.row_align not in (1, ALIGN):
            raise ValueError(f"Fp8Gmm row_align={self.row_align}: use {ALIGN} (expert-aligned rows) or 1 (any).")

    def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None, zero_padding=True,
                 zero_lhs_grad_padding=True):
        aligned = self.row_align > 1
        if aligned and lhs_MK.shape[0] % ALIGN:
            raise ValueError(f"Fp8Gmm with row_align={ALIGN} takes a multiple of {ALIGN} rows, got "
                             f"{lhs_MK.shape[0]}; permute with row_align={ALIGN} (dropless.moe.permute).")
        dtypes = (jnp.dtype(preferred_element_type or lhs_MK.dtype), lhs_MK.dtype, rhs_GKN.dtype)
        return fp8_gmm(lhs_MK, *unpack(rhs_GKN), group_sizes_G.astype(jnp.int32), self.products, dtypes,
                       zero_padding, aligned, zero_lhs_grad_padding)


def experts_gmm(moe_cfg, recipe: Recipe | None) -> GroupedMatmul:
    """The routed experts' grouped GEMM: `moe.gmm_backend`'s, wrapped in Fp8Gmm under an FP8 recipe. The e4m3
    kernels run only where the backend is our Mosaic one (`dropless_mosaic`, or `auto` on a GPU); under any other
    backend the recipe's arithmetic runs dequantized through that backend."""
    inner = make_gmm(moe_cfg)
    if recipe is None:
        return inner
    ours = isinstance(inner, DroplessMosaicGmm)
    products = Fp8Products(dataclasses.replace(recipe, native=recipe.native and ours), inner,
                           TunedContract() if ours else XlaContract())
    return Fp8Gmm(products, row_align=ALIGN)  # the routed experts' permutation writes the aligned layout
