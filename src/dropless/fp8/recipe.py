"""The FP8 recipes (`train.fp8`) as block shapes of the one quantizer (dropless.ops.fp8), per operand and product.

Training a linear layer y = x · W runs three products; each quantizes its two operands along the dimension it
contracts, in the layout the e4m3 GEMM reads (Hopper's wgmma takes 8-bit operands only with the contraction
contiguous, so every operand is stored contraction-last):

  product  left operand (contraction-last)       right operand (contraction-last)
  fwd      x     [M, K]   activations            Wᵀ  [N, K]  the weight, transposed copy
  dlhs     dy    [M, N]   activation gradients   W   [K, N]  the weight as stored
  drhs     xᵀ    [K, M]   activations            dyᵀ [N, M]  activation gradients

  recipe     activations, gradients (x, dy)   weights (Wᵀ, W)            drhs operands (xᵀ, dyᵀ)
  rowwise    one scale per row                one per row (of the copy)  one per row (per expert: over its rows)
  blockwise  1 x 128 tiles                    128 x 128 blocks (one set  128 x 1 tiles along the tokens (per
                                              of scales serves both)     expert: tiles start at its first row)
  mxfp8      1 x 32 blocks                    1 x 32 blocks              1 x 32 blocks (per expert, likewise)

`blockwise` is DeepSeek-V3's recipe: each 128-wide block of the contraction is multiplied in e4m3 and its
partial sum scaled and added in float32 ("promotion"); `rowwise` scales the float32 result once (cheaper, but one
outlier spends the whole row's range); `mxfp8` is OCP's MX format (power-of-two e8m0 scales), Blackwell's
hardware format, run here as its exact arithmetic. Every scale is a power of two (dropless.ops.fp8).

`native`: run e4m3 GEMMs (our Mosaic GPU kernels, for the grouped products and, with one group, the dense ones),
and under blockwise quantize each operand's two layouts in one pass
(`dropless.ops.fp8_pairs`: the bits of the quantizer run once per layout). Otherwise, and for a shape the
kernels do not take, each product dequantizes its operands exactly to bf16 and multiplies them with float32
accumulation: the same products and the same result to float32 rounding, at bf16 speed. So the recipe's numerics
are the same on every backend and the CPU tests check them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from dropless.ops import fp8_pairs
from dropless.ops.fp8 import BlockShape, Quantized, quantize

BLOCK = 128  # blockwise tile and weight-block extent (DeepSeek-V3)
MX_BLOCK = 32  # OCP MX block
MODES = ("rowwise", "blockwise", "mxfp8")
# The recipes whose products make their operands' e4m3 copies themselves (and keep them for the backward); mxfp8's
# dense products quantize inside jax.nn.scaled_dot_general, which keeps the compute-dtype operands.
COPY_MODES = ("rowwise", "blockwise")
WGRAD_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Recipe:
    """One FP8 recipe (`mode`, module docstring), whether its products run e4m3 kernels (`native`) and, blockwise
    and native, quantize each operand's two layouts in one pass (`fuse_pairs`)."""

    mode: str
    native: bool = False
    fuse_pairs: bool = True  # False: each layout quantized by its own pass (the benchmarks' comparison)
    wgrad: str = "float32"  # the dtype the weight-gradient products write (train.fp8_wgrad_dtype)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"FP8 recipe {self.mode!r} is not one of {', '.join(MODES)}")
        if self.wgrad not in WGRAD_DTYPES:
            raise ValueError(f"FP8 weight-gradient dtype {self.wgrad!r} is not one of {', '.join(WGRAD_DTYPES)}")
        if self.wgrad != "float32" and self.mode not in COPY_MODES:
            # mxfp8's dense products run jax.nn.scaled_dot_general, whose weight gradient this option cannot reach:
            # its grouped products alone would round theirs.
            raise ValueError(f"FP8 weight-gradient dtype {self.wgrad!r} applies to the {' and '.join(COPY_MODES)} "
                             f"recipes, not {self.mode!r}")

    def wgrad_dtype(self, weight_dtype) -> jnp.dtype:
        """What a weight-gradient product writes for a weight of `weight_dtype`: that dtype, or bfloat16 where the
        recipe rounds the float32 result once (never wider than the weight); the caller casts it to the weight's."""
        weight_dtype = jnp.dtype(weight_dtype)
        if self.wgrad == "bfloat16" and weight_dtype.itemsize > 2:
            return jnp.dtype(jnp.bfloat16)
        return weight_dtype

    @property
    def block(self) -> int | None:
        """Values per scale along the contraction: None for the whole row."""
        return {"rowwise": None, "blockwise": BLOCK, "mxfp8": MX_BLOCK}[self.mode]

    def operand(self, ndim: int) -> BlockShape:
        """Block of an activation or gradient operand, contraction-last, `ndim` axes (leading ones per row)."""
        return (1,) * (ndim - 1) + (self.block,)

    def weight(self, ndim: int) -> BlockShape:
        """Block of a weight copy [..., out, contraction]: 128 x 128 for blockwise (shared by Wᵀ and W)."""
        if self.mode == "blockwise":
            return (1,) * (ndim - 2) + (BLOCK, BLOCK)
        return self.operand(ndim)

    @property
    def one_pass_pairs(self) -> bool:
        """Whether each operand's two layouts come from one pass (`dropless.ops.fp8_pairs`): blockwise, native."""
        return self.native and self.mode == "blockwise" and self.fuse_pairs

    @property
    def contract_block(self) -> int:
        """Extent of a drhs operand's blocks along the tokens; rowwise shares one scale per expert over them."""
        return MX_BLOCK if self.mode == "mxfp8" else BLOCK


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class CachedWeight:
    """A master weight with the two e4m3 copies its products read (`weight_copies`), quantized once per optimizer
    step instead of in every microbatch (`weight_cache`). The FP8 matmuls take it wherever they take the weight;
    their gradient is the master weight's (the copies are constants of the step). Shape and dtype are the
    master's."""

    weight: jax.Array
    fwd: Quantized
    dlhs: Quantized

    shape = property(lambda self: self.weight.shape)
    dtype = property(lambda self: self.weight.dtype)
    ndim = property(lambda self: self.weight.ndim)


def unpack(w) -> tuple[jax.Array, tuple[Quantized, Quantized] | None]:
    """(the master weight, its e4m3 copies) of a CachedWeight, (w, None) of a plain weight: what the FP8 products'
    custom VJPs take."""
    return (w.weight, (w.fwd, w.dlhs)) if isinstance(w, CachedWeight) else (w, None)


# The parameters the FP8 recipes quantize, by leaf name: the attention projections, the dense and shared experts'
# MLPs and the routed experts (gate_up, down), MTP's projection. Embedding, output head, norms and routers stay in
# their precision (docs/fp8.md).
FP8_WEIGHTS = frozenset({"q_a", "q_b", "q", "kv_a", "kv_b", "k", "v", "o", "gate_up", "down", "eh_proj"})


def caches_weights(train) -> bool:
    """Whether a training step (its `TrainConfig`) makes the weights' copies once, before its microbatches
    (`weight_cache`): under train.fp8 blockwise or rowwise (mxfp8's dense products quantize inside
    jax.nn.scaled_dot_general), unless train.fp8_cache_weights is off. With one microbatch too: the copies then
    come from one pass over each weight (`weight_copies`) instead of the forward's and the backward's own."""
    return train.fp8 in COPY_MODES and train.fp8_cache_weights


def holds_weight_cache(train) -> bool:
    """Whether the step's weight cache adds to its peak memory: with several microbatches it holds both copies of
    every quantized weight through the step; with one, its copies are those the step's products would make (the
    measured peak is the same with and without it, fp8-step-h200.json)."""
    return caches_weights(train) and train.grad_accum_steps > 1


def _leaf_name(path) -> str | None:
    last = path[-1] if path else None
    return getattr(last, "key", None)


def weight_cache(params: Any, recipe: Recipe) -> dict[str, tuple[Quantized, Quantized]]:
    """Every FP8_WEIGHTS leaf's two e4m3 copies, by key path: quantized once, before a step's microbatches, so that
    each microbatch reads them instead of quantizing its weights again (stacked layers' weights at once: the blocks
    are per matrix, so the bits are those of the per-layer quantization)."""
    if jax.device_count() > 1:
        # XLA does not partition a Pallas call: here, outside any shard_map, the one-pass kernel would gather each
        # sharded weight whole onto every device and keep its copies whole there. The two-pass quantizer gives
        # the same bits and is partitioned like the weights.
        recipe = dataclasses.replace(recipe, fuse_pairs=False)
    return {jax.tree_util.keystr(path): weight_copies(w, recipe)
            for path, w in jax.tree_util.tree_leaves_with_path(params) if _leaf_name(path) in FP8_WEIGHTS}


def with_weight_cache(params: Any, cache: dict | None) -> Any:
    """`params` with each cached leaf a CachedWeight of itself and its copies (None: params unchanged)."""
    if not cache:
        return params

    def attach(path, w):
        copies = cache.get(jax.tree_util.keystr(path))
        return w if copies is None else CachedWeight(w, *copies)

    return jax.tree_util.tree_map_with_path(attach, params)


def weight_copies(w: jax.Array, recipe: Recipe) -> tuple[Quantized, Quantized]:
    """(Wᵀ [..., N, K] for the forward, W [..., K, N] for the input gradient), each contraction-last, for a weight
    [K, N] or stacked [G, K, N]. Under blockwise one set of 128 x 128 block scales serves both copies."""
    swap = lambda a: jnp.swapaxes(a, -1, -2)
    if recipe.one_pass_pairs and fp8_pairs.fits(w.shape):
        w_q, wT_q = fp8_pairs.quantize_pair(w, "blocks")
        return wT_q, w_q
    if recipe.mode == "blockwise":
        q = quantize(w, recipe.weight(w.ndim))
        return Quantized(swap(q.values), swap(q.scales)), q
    return quantize(swap(w), recipe.weight(w.ndim)), quantize(w, recipe.weight(w.ndim))


def one_pass_pair(a: jax.Array, recipe: Recipe) -> tuple[Quantized, Quantized] | None:
    """(a [..., R, X] per 1 x 128 tile, aᵀ [..., X, R] per 1 x 128 tile along R) from one pass over a, where the
    recipe quantizes pairs in one pass and a's rows and columns are whole tiles; None otherwise."""
    if recipe.one_pass_pairs and fp8_pairs.fits(a.shape):
        return fp8_pairs.quantize_pair(a, "tiles")
    return None


def make_recipe(mode: str, *, native: bool | None = None, wgrad: str = "float32") -> Recipe | None:
    """The recipe `train.fp8` names (None for "off"); native by default on a GPU."""
    if mode == "off":
        return None
    return Recipe(mode, jax.default_backend() == "gpu" if native is None else native, wgrad=wgrad)


def train_recipe(train) -> Recipe | None:
    """The recipe of a training config's `TrainConfig`: `train.fp8` with `train.fp8_wgrad_dtype`."""
    return make_recipe(train.fp8, wgrad=train.fp8_wgrad_dtype)
