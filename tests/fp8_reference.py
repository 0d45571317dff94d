"""A float64 NumPy reference of the FP8 recipes (dropless.fp8), written independently of the code it checks: its own
power-of-two scales, e4m3 rounding by ml_dtypes, and each product's operands quantized as docs/fp8.md says."""

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0


def quantize(x, block):
    """(values as float64 on e4m3's grid, float64 scales [one per block]) for an n-d array and a block shape."""
    x = np.asarray(x, np.float64)
    ext = [n if b is None else b for n, b in zip(x.shape, block)]
    counts = [-(-n // b) for n, b in zip(x.shape, ext)]
    scales = np.ones(counts)
    values = np.zeros_like(x)
    for idx in np.ndindex(*counts):
        sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, ext))
        amax = np.abs(x[sl]).max() if x[sl].size else 0.0
        # at least 2^-126: a scale and its inverse stay normal float32 numbers (docs/fp8.md)
        s = 1.0 if amax == 0 else 2.0 ** max(np.ceil(np.log2(amax / E4M3_MAX)), -126)
        if amax > 0 and amax / s > E4M3_MAX:  # log2 rounding: never let the block overflow
            s *= 2
        scales[idx] = s
        values[sl] = (x[sl] / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return values, scales


def fake(x, block):
    """values * scale: what an FP8 product computes with."""
    values, scales = quantize(x, block)
    out = values.copy()
    ext = [n if b is None else b for n, b in zip(values.shape, block)]
    for idx in np.ndindex(*scales.shape):
        sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, ext))
        out[sl] *= scales[idx]
    return out


def blocks(mode):
    """(operand block along the contraction, weight block [out, contraction]) of a recipe."""
    b = {"rowwise": None, "blockwise": 128, "mxfp8": 32}[mode]
    return (1, b), ((128, 128) if mode == "blockwise" else (1, b))


def dense(x, w, dy, mode):
    """(y, dx, dw) of y = x @ w under the recipe, in float64."""
    op, wb = blocks(mode)
    y = fake(x, op) @ fake(w.T, wb).T
    dx = fake(dy, op) @ fake(w, wb).T
    tok = (1, 32 if mode == "mxfp8" else (None if mode == "rowwise" else 128))
    dw = fake(x.T, tok) @ fake(dy.T, tok).T
    return y, dx, dw


def grouped(x, w, sizes, dy, mode):
    """(y, dx, dw) of the grouped GEMM under the recipe, float64; rows past sum(sizes) give zeros. The weight
    gradient's operands are quantized per expert: 128-token tiles from the expert's first row (one scale per
    expert and feature for rowwise)."""
    op, _ = blocks(mode)
    wb = (1,) + (((128, 128)) if mode == "blockwise" else (1, op[1]))
    y, dx = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x, dtype=np.float64)
    dw = np.zeros(w.shape)
    fx, fdy = fake(x, op), fake(dy, op)
    fwt, fw = fake(np.swapaxes(w, 1, 2), wb), fake(w, wb)
    tok = (1, 32 if mode == "mxfp8" else (None if mode == "rowwise" else 128))
    start = 0
    for g, s in enumerate(sizes):
        rows = slice(start, start + s)
        y[rows] = fx[rows] @ fwt[g].T
        dx[rows] = fdy[rows] @ fw[g].T
        if s:
            dw[g] = fake(x[rows].T, tok) @ fake(dy[rows].T, tok).T
        start += s
    return y, dx, dw
