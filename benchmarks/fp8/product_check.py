"""Check every piece of the blockwise FP8 grouped GEMM on one GPU at a `dropless bench gmm` shape, piece by piece.

    PYTHONPATH=src python benchmarks/fp8/product_check.py --shapes dsv3-down-e256,dsv3-gate-up-e256 [--out F]

For each shape (bench gmm's operands and Dirichlet groups, the rows expert-aligned as the MoE layer's permutation
writes them) it compares what the GPU path computes with the same recipe's reference path:
- the weight's two e4m3 copies (`weight_copies`: the one-pass Triton kernel where `fp8_pairs.fits`, against the
  quantizer): values and scales bit for bit; and the Triton kernel run directly on the weight whatever `fits`
  says, the experts whose copies it gets wrong (JAX's Pallas Triton addressing, fp8_pairs.INT32_MAX);
- the rows' pair (`one_pass_pair`: x per 1 x 128 tile and its expert-aligned transpose) against the quantizer;
- each product on the same quantized operands: the e4m3 kernels (`gmm_nt` fwd and dlhs, `gmm_tn_aligned` drhs)
  against the dequantized operands multiplied by our bf16 grouped GEMM (the same products: dequantized values
  are exact in bf16), relative Frobenius error over the rows in groups, and the non-finite count of each output.
Prints one JSON line per piece and writes them to --out; a piece that fails prints its error and the script goes on.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dropless.bench.gmm import SHAPES, _operands, group_sizes, to_aligned
from dropless.bench.records import record_lines
from dropless.fp8 import Recipe
from dropless.fp8.grouped import ALIGN, Fp8Products, transposed
from dropless.fp8.recipe import one_pass_pair, weight_copies
from dropless.gmm.dropless_mosaic import DroplessMosaicGmm, TunedContract
from dropless.ops import fp8_pairs
from dropless.ops.fp8 import quantize


def _bits_differ(a, b) -> int:
    """How many elements of two arrays of one dtype differ in their bits (NaN payloads included)."""
    if a.dtype.itemsize == 1:
        a, b = a.view(jnp.uint8), b.view(jnp.uint8)
    else:
        a, b = a.view(jnp.uint32), b.view(jnp.uint32)
    return int(jnp.sum(a != b))


@jax.jit
def _count_nonfinite(a):
    return jnp.sum(~jnp.isfinite(a.astype(jnp.float32)))


def _nonfinite(a) -> int:
    return int(_count_nonfinite(a))


@jax.jit
def _rel_fused(got, ref):
    """One fused reduction over both arrays: no difference array of their size (30 GB at 256 experts)."""
    got, ref = got.astype(jnp.float32), ref.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(jnp.square(got - ref))) / jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(ref))), 1e-30)


def _rel(got, ref, rows_valid=None) -> float:
    if rows_valid is not None:
        got, ref = (jnp.where(rows_valid[:, None], a, 0) for a in (got, ref))
    return float(_rel_fused(got, ref))


def check_shape(name: str, emit) -> None:
    shape = SHAPES[name]
    xs, dys, w = _operands(shape, 0)
    sizes = group_sizes("dirichlet", shape.m, shape.g, 0)
    (x, dy), gs, _ = to_aligned(sizes, xs[0], dys[0])
    del xs, dys
    starts = np.concatenate([[0], np.cumsum(np.asarray(gs))[:-1]])
    valid = np.zeros(x.shape[0], bool)  # the aligned rows that hold a row of a group
    for s, n in zip(starts, sizes):
        valid[s:s + n] = True
    rows_valid = jnp.asarray(valid)
    native, ref = Recipe("blockwise", native=True), Recipe("blockwise", native=False)
    base = {"shape": name, "m": shape.m, "k": shape.k, "n": shape.n, "g": shape.g, "gemm_rows": int(gs.sum())}

    def piece(what, fn):
        try:
            emit(base | {"piece": what} | fn())
        except Exception as e:  # noqa: BLE001 - a failing piece is a result; the others still run
            emit(base | {"piece": what, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"})

    w_fwd, w_dlhs = jax.jit(lambda w: weight_copies(w, native))(w)
    r_fwd, r_dlhs = jax.jit(lambda w: weight_copies(w, ref))(w)
    piece("weight copies (one pass vs quantizer)", lambda: {
        "values_differ": [_bits_differ(w_fwd.values, r_fwd.values), _bits_differ(w_dlhs.values, r_dlhs.values)],
        "scales_differ": [_bits_differ(w_fwd.scales, r_fwd.scales), _bits_differ(w_dlhs.scales, r_dlhs.scales)],
        "nonfinite_scales": _nonfinite(w_fwd.scales)})

    def forced():  # the Triton kernel itself, whether or not fp8_pairs.fits sends this weight to it
        rows, cols, _ = jax.jit(lambda w: fp8_pairs._launch(w, "blocks", False, fp8_pairs.NUM_WARPS["blocks"]))(w)
        wrong = jnp.any(rows.view(jnp.uint8) != r_dlhs.values.view(jnp.uint8), axis=(1, 2))
        wrong |= jnp.any(cols.view(jnp.uint8) != r_fwd.values.view(jnp.uint8), axis=(1, 2))
        groups = np.flatnonzero(np.asarray(wrong))
        return {"fits": fp8_pairs.fits(w.shape), "wrong_groups": int(groups.size),
                "first_wrong_group": int(groups[0]) if groups.size else None}

    piece("one-pass weight kernel run directly (vs quantizer)", forced)
    del r_fwd, r_dlhs

    def pairs(a):
        got = jax.jit(lambda a: one_pass_pair(a, native))(a)
        want = jax.jit(lambda a: (quantize(a, ref.operand(2)), transposed(a, gs, ref)))(a)
        return got, want

    (x_q, xT), (x_r, xT_r) = pairs(x)
    (dy_q, dyT), (dy_r, dyT_r) = pairs(dy)
    for what, got, want in (("x", (x_q, xT), (x_r, xT_r)), ("dy", (dy_q, dyT), (dy_r, dyT_r))):
        piece(f"{what} pair (one pass vs quantizer)", lambda got=got, want=want: {
            "values_differ": [_bits_differ(g.values, r.values) for g, r in zip(got, want)],
            "scales_differ": [_bits_differ(g.scales, r.scales) for g, r in zip(got, want)]})
    del x_r, xT_r, dy_r, dyT_r

    kernels = Fp8Products(native, DroplessMosaicGmm(), TunedContract())
    dequantized = Fp8Products(ref, DroplessMosaicGmm(), TunedContract())
    bf16 = jnp.bfloat16
    # Each product's operands are arguments of its jitted function (closed over, they would be baked into the
    # program as constants of gigabytes).
    products = {
        "fwd": (lambda p, a, b, gs: p.rows(a, b, gs, "fwd", bf16), x_q, w_fwd),
        "dlhs": (lambda p, a, b, gs: p.rows(a, b, gs, "dlhs", bf16), dy_q, w_dlhs),
        "drhs": (lambda p, a, b, gs: p.contract(a, b, gs, jnp.float32), xT, dyT),
    }
    for product, (run, a, b) in products.items():
        def compare(run=run, a=a, b=b, product=product):
            got = jax.jit(functools.partial(run, kernels))(a, b, gs)
            want = jax.jit(functools.partial(run, dequantized))(a, b, gs)
            valid = None if product == "drhs" else rows_valid
            mask = (lambda t: t) if valid is None else (lambda t: jnp.where(valid[:, None], t, 0))
            bad_groups = []
            if product == "drhs":
                bad = jax.jit(lambda a: jnp.any(~jnp.isfinite(a), axis=(1, 2)))(got)
                bad_groups = [int(g) for g in np.flatnonzero(np.asarray(bad))][:20]
            return {"product": product, "rel_err": _rel(got, want, valid), "nonfinite": _nonfinite(mask(got)),
                    "nonfinite_reference": _nonfinite(mask(want)), "nonfinite_groups": bad_groups}
        piece(f"{product} kernel vs dequantized bf16", compare)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="dsv3-down-e256,dsv3-gate-up-e256")
    p.add_argument("--out", default="")
    args = p.parse_args()
    record_lines("fp8-product-check", args.out, lambda emit: [check_shape(n, emit) for n in args.shapes.split(",")])


if __name__ == "__main__":
    main()
