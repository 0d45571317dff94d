"""The one custom VJP of the grouped GEMM, over a plan of three products.

Training a layer y = x·W (x [M, K], rows sorted by group; W [G, K, N]) runs three grouped products:

  fwd   y  = x · W[g]             rows ragged, contracts K
  dlhs  dx = dy · W[g]ᵀ           rows ragged, contracts N
  drhs  dW = x[rows of g]ᵀ · dy   contracts the ragged rows

`GmmProducts` names the function that computes each; `gmm_from_products` is differentiable in x and W and runs
exactly those three. Why our own VJP rather than a kernel library's: it decides which kernel and which tile
run the backward products (tokamax's own VJP builds fresh ops for dx and dW, so a config given to its forward
never reaches them; tests/test_gmm_tuning.py shows it), it takes a float32 cotangent with bf16 operands, and it
keeps the row contract of dropless.gmm.api whatever the kernels do with padding rows.

Products, by signature (rows past sum(group_sizes) may be left unwritten):
  rows product      (lhs_MK, rhs, group_sizes_G, *, transpose_rhs, out_dtype) -> out_MN
                    out[m] = lhs[m] · rhs[g(m)]; with transpose_rhs rhs is [G, N, K] and read as rhs[g]ᵀ
  contract product  (lhs_MK, rhs_MN, group_sizes_G, *, out_dtype) -> out_GKN
                    out[g] = lhs[rows of g]ᵀ · rhs[rows of g]
Each is a frozen dataclass (or another hashable callable), so a plan is a static argument.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp

from dropless.core.varying import sum_like, varying_like
from dropless.gmm.api import zero_padding_rows


class RowsProduct(Protocol):
    def __call__(self, lhs_MK: jax.Array, rhs: jax.Array, group_sizes_G: jax.Array, *, transpose_rhs: bool,
                 out_dtype) -> jax.Array: ...


class ContractProduct(Protocol):
    def __call__(self, lhs_MK: jax.Array, rhs_MN: jax.Array, group_sizes_G: jax.Array, *, out_dtype) -> jax.Array: ...


@dataclass(frozen=True)
class GmmProducts:
    """Which function computes each product. `zero_cotangent_padding`: zero the cotangent's padding rows before
    the backward products, for kernels that read them (tokamax's); ours never do, and the zeroing would be a
    pass of its own over dy on a GPU."""

    fwd: RowsProduct
    dlhs: RowsProduct
    drhs: ContractProduct
    zero_cotangent_padding: bool = False


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def gmm_from_products(lhs_MK, rhs_GKN, group_sizes_G, products: GmmProducts, out_dtype=None,
                      zero_padding: bool = True, zero_lhs_grad_padding: bool = True):
    """out_MN[m] = lhs_MK[m] · rhs_GKN[g(m)], differentiable in lhs and rhs, each product by `products`.

    zero_padding=False leaves the output's padding rows unwritten, zero_lhs_grad_padding=False the input
    gradient's (dropless.gmm.api)."""
    out_dtype = jnp.dtype(out_dtype or lhs_MK.dtype)
    out_MN = products.fwd(lhs_MK, rhs_GKN, group_sizes_G, transpose_rhs=False, out_dtype=out_dtype)
    # Inside jax.shard_map a Pallas kernel's output varies over no mesh axis; it varies over its operands' axes
    # (with zero_padding the mask's `where` did this by accident; without it a custom_vjp downstream, unpermute,
    # got a cotangent typed unlike its primal).
    out_MN = varying_like(out_MN, lhs_MK, rhs_GKN, group_sizes_G)
    return zero_padding_rows(out_MN, group_sizes_G) if zero_padding else out_MN


def _fwd(lhs_MK, rhs_GKN, group_sizes_G, products, out_dtype, zero_padding, zero_lhs_grad_padding):
    out_MN = gmm_from_products(lhs_MK, rhs_GKN, group_sizes_G, products, out_dtype, zero_padding)
    return out_MN, (lhs_MK, rhs_GKN, group_sizes_G)


def _bwd(products, out_dtype, zero_padding, zero_lhs_grad_padding, residuals, dout_MN):
    lhs_MK, rhs_GKN, group_sizes_G = residuals
    dout_MN = dout_MN.astype(lhs_MK.dtype)  # the kernels take one input dtype; an f32 output's cotangent is f32
    if products.zero_cotangent_padding:
        dout_MN = zero_padding_rows(dout_MN, group_sizes_G)
    dlhs_MK = products.dlhs(dout_MN, rhs_GKN, group_sizes_G, transpose_rhs=True, out_dtype=lhs_MK.dtype)
    drhs_GKN = products.drhs(lhs_MK, dout_MN, group_sizes_G, out_dtype=rhs_GKN.dtype)
    # Inside jax.shard_map a cotangent must have its primal's type, although a Pallas kernel's output varies over
    # no mesh axis: the weight gradient of experts sharded over `expert` varies over `expert`, and is the sum of
    # every device's partial gradient along the axes the tokens vary over and the weights do not (`data`, `fsdp`).
    if zero_lhs_grad_padding:
        dlhs_MK = zero_padding_rows(dlhs_MK, group_sizes_G)
    return (varying_like(dlhs_MK, lhs_MK),
            sum_like(drhs_GKN, rhs_GKN, lhs_MK, dout_MN), None)


gmm_from_products.defvjp(_fwd, _bwd)
