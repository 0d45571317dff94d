"""The GPU grouped-GEMM backend (`moe.gmm_backend=tokamax`, the GPU default): Mosaic GPU kernels, tuned per product.

`implementation="mosaic_gpu"` (the default) runs `gmm_tuned.tuned_gmm`: forward, dx and dW each with the kernel
and tile that `gmm_tuning.plan_for` picks for this GPU and shape from `gmm_configs.json` — our kernels in
`gmm_mosaic.py` for every shape measured so far (they read W and x in place, and their dW is correct), tokamax's
where a table entry names it. BENCHMARKS.md has the measurements. Other implementations (`"xla"`: tokamax's
portable path, used by the CPU tests of this wrapper) run tokamax.ragged_dot under the custom VJP below.

Needs an NVIDIA GPU. On any other machine the backend can be built (so configs and tests can name it),
but calling it raises `MoEError` telling the user to pick `moe.gmm_backend=xla` or `auto`: we never
silently fall back, because a benchmark that quietly ran the XLA path would report the wrong thing.

For tokamax.ragged_dot the backward pass is ours (a custom VJP), for three measured reasons (H200, jax 0.11.2,
tokamax 0.0.17):
- tokamax's weight gradient (its "ragged contracting dim" kernel) was wrong by 15-25 % per expert and
  differed from run to run for groups of >= 512 rows, so by default the weight gradient uses XLA's
  `ragged_dot_general` (`weight_grad="xla"`); set `weight_grad="tokamax"` once a release fixes it;
- tokamax's own VJP needs the cotangent in the operands' dtype (a float32 cotangent with bf16 weights
  raises), so we cast it;
- the kernel leaves rows past sum(group_sizes) unwritten and reads padding rows in the weight gradient,
  so we zero those rows on the way in and on the way out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp

from dropless.core.errors import MoEError
from dropless.gmm.api import GroupedMatmul, row_mask

ROW_ALIGNMENT = 128  # the kernel rejects row counts that are not a multiple of its row tile (seen: 64)

# Weight gradient: contract the (ragged) row axis, one [K, N] block per group.
_RAGGED_CONTRACTING = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, implementation, preferred_element_type=None):
    import tokamax

    return tokamax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=preferred_element_type,
                              implementation=implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(lhs_MK, rhs_GKN, group_sizes_G, implementation, out_dtype, weight_grad):
    return _ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, implementation, out_dtype)


def _gmm_fwd(lhs_MK, rhs_GKN, group_sizes_G, implementation, out_dtype, weight_grad):
    return _gmm(lhs_MK, rhs_GKN, group_sizes_G, implementation, out_dtype, weight_grad), (lhs_MK, rhs_GKN,
                                                                                          group_sizes_G)


def _gmm_bwd(implementation, out_dtype, weight_grad, residuals, g_MN):
    lhs_MK, rhs_GKN, group_sizes_G = residuals
    valid_M1 = row_mask(lhs_MK.shape[0], group_sizes_G)[:, None]
    g_MN = jnp.where(valid_M1, g_MN, 0).astype(lhs_MK.dtype)
    g_lhs_MK = _ragged_dot(g_MN, jnp.swapaxes(rhs_GKN, 1, 2), group_sizes_G, implementation)
    if weight_grad == "tokamax":
        import tokamax

        g_rhs_GKN = tokamax.ragged_dot_general(lhs_MK, g_MN, group_sizes_G, _RAGGED_CONTRACTING,
                                               preferred_element_type=rhs_GKN.dtype, implementation=implementation)
    elif weight_grad == "dropless":
        # Our weight-gradient kernel with the tuned tile for this shape (gmm_tuned.py): correct where tokamax's is not.
        from dropless.gmm.tuned import ragged_contract
        from dropless.gmm.tuning import plan_for

        (m, k), (g, _, n) = lhs_MK.shape, rhs_GKN.shape
        g_rhs_GKN = ragged_contract(lhs_MK, g_MN, group_sizes_G, plan_for(m, k, n, g).drhs, out_dtype=rhs_GKN.dtype)
    else:
        g_rhs_GKN = jax.lax.ragged_dot_general(lhs_MK, g_MN, group_sizes_G, _RAGGED_CONTRACTING,
                                               preferred_element_type=jnp.float32).astype(rhs_GKN.dtype)
    return jnp.where(valid_M1, g_lhs_MK, 0).astype(lhs_MK.dtype), g_rhs_GKN, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


@dataclass(frozen=True)
class TokamaxGmm(GroupedMatmul):
    """`implementation`: "mosaic_gpu" = our tuned three-product path (the GPU default); any other value runs
    tokamax.ragged_dot with that implementation under the custom VJP above: "mosaic" is tokamax's own Mosaic GPU
    kernel with its heuristic tiles (`moe.gmm_backend=tokamax_default`, the ladder's rung 3, with
    `weight_grad="dropless"` because tokamax's weight gradient is wrong on the H200), "xla" its portable path (the
    CPU tests of this wrapper)."""

    implementation: str = "mosaic_gpu"
    weight_grad: Literal["xla", "tokamax", "dropless"] = "xla"
    name: ClassVar[str] = "tokamax"

    def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None, zero_padding=True):
        if self.implementation != "xla" and jax.default_backend() != "gpu":
            raise MoEError(f"moe.gmm_backend=tokamax needs an NVIDIA GPU (tokamax's Mosaic GPU kernel) but the "
                           f"JAX backend is {jax.default_backend()!r}; use moe.gmm_backend=xla or auto.")
        group_sizes_G = group_sizes_G.astype(jnp.int32)
        if self.implementation == "mosaic_gpu":
            return _tuned(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type, zero_padding)
        num_rows = lhs_MK.shape[0]
        valid_M1 = row_mask(num_rows, group_sizes_G)[:, None]
        # Zero the padding rows (they may hold NaN) and pad to the kernel's row tile; extra rows are padding.
        lhs_PK = jnp.pad(jnp.where(valid_M1, lhs_MK, 0), ((0, -num_rows % ROW_ALIGNMENT), (0, 0)))
        out_dtype = jnp.dtype(preferred_element_type or lhs_MK.dtype)
        out_PN = _gmm(lhs_PK, rhs_GKN, group_sizes_G, self.implementation, out_dtype, self.weight_grad)
        return jnp.where(valid_M1, out_PN[:num_rows], 0)


def _tuned(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type, zero_padding=True):
    """The tuned three-product path; the plan is looked up while tracing (shapes are static)."""
    from dropless.gmm.tuned import tuned_gmm
    from dropless.gmm.tuning import plan_for

    if lhs_MK.dtype != rhs_GKN.dtype or lhs_MK.dtype not in (jnp.bfloat16, jnp.float16):
        raise MoEError(f"moe.gmm_backend=tokamax multiplies bf16 or f16 operands of one dtype, got {lhs_MK.dtype} x "
                       f"{rhs_GKN.dtype}; use train.dtype=bfloat16 or moe.gmm_backend=xla.")
    num_rows, k = lhs_MK.shape
    g, _, n = rhs_GKN.shape
    # tokamax's kernel (if a table entry names it) rejects row counts off its row tile; the extra rows are padding,
    # which every kernel here leaves out of dW and whose outputs tuned_gmm zeroes (unless zero_padding=False).
    lhs_PK = jnp.pad(lhs_MK, ((0, -num_rows % ROW_ALIGNMENT), (0, 0)))
    out_dtype = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
    out_PN = tuned_gmm(lhs_PK, rhs_GKN, group_sizes_G, plan_for(lhs_PK.shape[0], k, n, g), out_dtype, zero_padding)
    return out_PN[:num_rows]
