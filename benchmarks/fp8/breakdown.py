"""Where an FP8 grouped GEMM's time goes: each quantization pass and each kernel of the blockwise recipe, timed alone,
beside the whole FP8 product and the bf16 one, on one GPU (part of `make bench-fp8`).

    python benchmarks/fp8/breakdown.py --out fp8-breakdown.json [--rows 65536 --k 7168 --n 4096 --groups 32]

One line of JSON per piece: ms (median of batches of back-to-back calls, dropless.bench.harness.time_calls) and, for
GEMMs, TF/s = 2 * rows * K * N / time; the record is rewritten after every piece (`complete` false until the last),
so a call cut short keeps what it timed. Group sizes: Dirichlet(alpha=1), seed 0, passed (with the routing ids) as
runtime operands as in training (a constant would let XLA fold the index arithmetic that a step computes).

Two layouts of the same rows: end to end (the pieces without a suffix: Fp8Gmm builds the weight gradient's
expert-aligned copies by a column gather) and expert-aligned ("(aligned rows)": each group from a multiple of 128
on, zero rows between, as the routed experts' permutation writes them; the copies are plain transposes). The
aligned pieces' TF/s count the real rows' FLOPs only, so the two layouts' figures compare directly. The permute
pieces time the routed experts' permutation of rows / 8 tokens at top-8 into each layout. Blockwise quantizes
each operand's two layouts in one pass (dropless.ops.fp8_pairs); the ", two passes" pieces run the quantizer once
per layout instead, in the same call, and a first record checks that both give the same bits on this GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from dropless.bench.harness import same_bits, time_calls
from dropless.bench.records import environment, write_json
from dropless.fp8 import Fp8Gmm, Recipe, fp8_matmul
from dropless.fp8.grouped import ALIGN, Fp8Products, aligned_sources, aligned_transposed, transposed
from dropless.fp8.recipe import weight_copies
from dropless.gmm import fp8_mosaic
from dropless.gmm.dropless_mosaic import DroplessMosaicGmm, TunedContract
from dropless.moe.permute import permute
from dropless.ops import fp8_pairs
from dropless.ops.fp8 import quantize


def fwd_bwd(f, x, w, dy):
    """The output and both gradients: returning the output keeps XLA from dropping the forward GEMM."""
    y, pullback = jax.vjp(f, x, w)
    return y, *pullback(dy)


def check_pairs(x, w, records) -> None:
    """The one-pass kernel's bits against the quantizer's on this GPU (finite operands), one record."""
    rec = {"piece": "quantize_pair bits equal quantize's (x tiles, W blocks)"}
    for name, a, kind in (("x", x, "tiles"), ("w", w, "blocks")):
        rec[name] = same_bits(jax.jit(lambda a: fp8_pairs.quantize_pair(a, kind))(a),
                              jax.jit(lambda a: fp8_pairs.quantize_pair_reference(a, kind))(a))
    print(json.dumps(rec), flush=True)
    records.append(rec)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--k", type=int, default=7168)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--modes", default="blockwise,rowwise")
    a = p.parse_args()
    m, k, n, g = a.rows, a.k, a.n, a.groups
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(rng.multinomial(m, rng.dirichlet(np.ones(g))).astype(np.int32))
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    flops = 2.0 * m * k * n
    records = []
    env = environment()

    def save(complete: bool) -> None:
        write_json(a.out, {"benchmark": "fp8-breakdown", "environment": env, "complete": complete,
                           "shape": {"rows": m, "k": k, "n": n, "groups": g}, "records": records})
    # The same rows expert-aligned: group g from row 128 * first_g on, zeros after its rows.
    source_P, valid_P, _ = aligned_sources(sizes, m, ALIGN)
    align_rows = lambda a: jnp.where(valid_P[:, None], a[source_P], 0)
    x_al, dy_al = align_rows(x), align_rows(dy)
    sizes_al = ALIGN * -(-sizes // ALIGN)
    top_k = min(8, g)
    tokens = m // top_k
    ids_TK = jax.lax.top_k(jax.random.normal(jax.random.key(1), (tokens, g)), top_k)[1].astype(jnp.int32)

    def emit(name, fn, *args, gemm_flops=None):
        """Time fn(*args). Group sizes and routing ids are among the args, runtime operands as in a step."""
        try:
            t = time_calls(jax.jit(fn), [args])
            rec = {"piece": name, "ms": t * 1e3} | ({"tflops": gemm_flops / t / 1e12} if gemm_flops else {})
        except Exception as e:  # noqa: BLE001 - a failing piece is a result
            rec = {"piece": name, "error": str(e).split("\n")[0][:300]}
        print(json.dumps(rec), flush=True)
        records.append(rec)
        save(complete=False)  # a call cut short still leaves every piece timed so far

    bf16 = DroplessMosaicGmm()
    emit("bf16 gmm fwd", lambda gs, x, w: bf16(x, w, gs), sizes, x, w, gemm_flops=flops)
    emit("bf16 gmm fwd+bwd", lambda gs, x, w, dy: fwd_bwd(lambda x, w: bf16(x, w, gs), x, w, dy), sizes, x, w, dy,
         gemm_flops=3 * flops)
    for align in (1, ALIGN):
        emit(f"permute top-{top_k} x [T,K] -> [rows,K]" + (" (aligned rows)" if align > 1 else ""),
             lambda ids, x: permute(x, ids, g, row_align=align)[0], ids_TK, x[:tokens])
    for mode in a.modes.split(","):
        r = Recipe(mode, native=True)
        emit(f"{mode} quantize x [M,K]", lambda x: quantize(x, r.operand(2)), x)
        if r.one_pass_pairs:  # the one-pass quantizer of both layouts against the quantizer run once per layout
            check_pairs(x, w, records)
            two_pass = dataclasses.replace(r, fuse_pairs=False)
            emit(f"{mode} weight copies (W^T and W), two passes", lambda w: weight_copies(w, two_pass), w)
            emit(f"{mode} x and x^T (aligned rows), two passes",
                 lambda gs, x: (quantize(x, r.operand(2)), transposed(x, gs, r)), sizes_al, x_al)
            emit(f"{mode} x and x^T (aligned rows), one pass", lambda x: fp8_pairs.quantize_pair(x, "tiles"), x_al)
            fp8_two = Fp8Gmm(Fp8Products(two_pass, bf16, TunedContract()), row_align=ALIGN)
            emit(f"{mode} Fp8Gmm fwd+bwd (aligned rows), two passes",
                 lambda gs, x, w, dy: fwd_bwd(lambda x, w: fp8_two(x, w, gs), x, w, dy), sizes_al, x_al, w, dy_al,
                 gemm_flops=3 * flops)
            emit(f"{mode} dense fp8_matmul fwd+bwd, two passes",
                 lambda x, w, dy: fwd_bwd(lambda x, w: fp8_matmul(x, w[0], two_pass), x, w, dy), x, w, dy,
                 gemm_flops=3 * flops)
        emit(f"{mode} weight copies (W^T and W)", lambda w: weight_copies(w, r), w)
        emit(f"{mode} aligned x^T copy", lambda gs, x: aligned_transposed(x, gs, r), sizes, x)
        xq = quantize(x, r.operand(2))
        wt, wq = weight_copies(w, r)
        tile = fp8_mosaic.default_tile("fwd", m, k, n, g, mode)
        stack = fp8_mosaic.default_stack("fwd", mode)
        ls = xq.scales[:, 0] if mode == "rowwise" else xq.scales.T
        rs = wt.scales[..., 0] if mode == "rowwise" else wt.scales
        emit(f"{mode} gmm_nt kernel alone (fwd)",
             lambda gs, a_, b_, s1, s2: fp8_mosaic.gmm_nt(a_, b_, gs, tile, scaling=mode, lhs_scale=s1, rhs_scale=s2,
                                                          stack=stack),
             sizes, xq.values, wt.values, ls, rs, gemm_flops=flops)
        fp8 = Fp8Gmm(Fp8Products(r, bf16, TunedContract()))
        emit(f"{mode} Fp8Gmm fwd", lambda gs, x, w: fp8(x, w, gs), sizes, x, w, gemm_flops=flops)
        emit(f"{mode} Fp8Gmm fwd+bwd", lambda gs, x, w, dy: fwd_bwd(lambda x, w: fp8(x, w, gs), x, w, dy),
             sizes, x, w, dy, gemm_flops=3 * flops)
        fp8_al = Fp8Gmm(Fp8Products(r, bf16, TunedContract()), row_align=ALIGN)
        emit(f"{mode} x^T copy (aligned rows)", lambda gs, x: transposed(x, gs, r), sizes_al, x_al)
        emit(f"{mode} Fp8Gmm fwd (aligned rows)", lambda gs, x, w: fp8_al(x, w, gs), sizes_al, x_al, w,
             gemm_flops=flops)
        emit(f"{mode} Fp8Gmm fwd+bwd (aligned rows)",
             lambda gs, x, w, dy: fwd_bwd(lambda x, w: fp8_al(x, w, gs), x, w, dy), sizes_al, x_al, w, dy_al,
             gemm_flops=3 * flops)
        emit(f"{mode} dense fp8_matmul fwd", lambda x, w: fp8_matmul(x, w[0], r), x, w, gemm_flops=flops)
        emit(f"{mode} dense fp8_matmul fwd+bwd",
             lambda x, w, dy: fwd_bwd(lambda x, w: fp8_matmul(x, w[0], r), x, w, dy), x, w, dy,
             gemm_flops=3 * flops)
    emit("bf16 dense fwd", lambda x, w: x @ w[0], x, w, gemm_flops=flops)
    emit("bf16 dense fwd+bwd", lambda x, w, dy: fwd_bwd(lambda x, w: x @ w[0], x, w, dy), x, w, dy,
         gemm_flops=3 * flops)
    save(complete=True)


if __name__ == "__main__":
    main()
