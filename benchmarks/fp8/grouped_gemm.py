"""FP8 probe, grouped GEMMs: our bf16 production kernels against the e4m3 probe kernels, DeepSeek-V3 shapes, one GPU.

    python benchmarks/fp8/grouped_gemm.py --out fp8-probe-gmm.json [--parts lower,fwd,drhs,blockwise] [--small]
    (part of make bench-fp8-probe)

Parts (each a list of measurements in the record; a failure is a result here, recorded as its error):
  lower      which e4m3 layouts the production kernels (gmm.mosaic, gmm.mosaic_ws) and the probe kernels compile for
  fwd        the fwd and dlhs products: bf16 production grouped_matmul_ws (configs.json's tile) against e4m3
             gmm_nt_ws; at gate-up fwd also other e4m3 tiles, the production kernels fed e4m3, the dense bf16 rate
             and the e4m3 transposed copies the fwd (Wᵀ) and drhs (xᵀ) products need
  drhs       bf16 production grouped_matmul_tn against e4m3 gmm_tn_aligned_ws on 128-aligned transposed copies
  blockwise  gate-up fwd: 1x128 / 128x128 scale promotion inside gmm_nt_ws against the plain e4m3 kernel

Method: group sizes Dirichlet(alpha=1) over 32 groups of 65,536 rows, floored to multiples of 16, seed 0 (65,328
rows, two empty groups). FLOPs = 2 * rows * K * N. Time: median (and min) of 5 batches of 10 back-to-back calls,
host clock, one block_until_ready per batch. Inputs random normal cast to e4m3 (tensorwise scale 1); the bf16
kernels get the same values in bf16. Error: ||out - ref|| / ||ref|| over every valid row against float32
Precision.HIGHEST on the same values (one batched einsum over groups zero-padded to the largest: one dot shape to
compile, not one per group). --small: tiny shapes in Pallas's GPU interpreter, a CPU check that the parts run.

Shape suffixes: M rows, K contracted, N out, G groups, Mp rows of the 128-aligned copy, Kb = K/128, Nb = N/128.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from dropless.bench.records import environment, write_json
from dropless.gmm.mosaic import grouped_matmul, grouped_matmul_tn
from dropless.gmm.mosaic_ws import grouped_matmul_tn_ws, grouped_matmul_ws
from dropless.gmm.tuning import TileConfig
from e4m3_probe_kernels import aligned_layout, gmm_nt_ws, gmm_tn_aligned_ws

F8, BF = jnp.float8_e4m3fn, jnp.bfloat16
ITERS, BATCHES = 10, 5
# bf16 production tiles of src/dropless/gmm/configs.json (dsv3-*-e32): fwd and dlhs 128x128x64/3 n-minor 4.
BF16_WS = TileConfig(128, 128, 64, 3, grid_minor_dim=1, grid_tile_width=4)
DRHS_BF16 = {"gate-up": TileConfig(128, 128, 64, 4, grid_minor_dim=1, grid_tile_width=4),
             "down": TileConfig(128, 128, 64, 6, grid_minor_dim=1, grid_tile_width=4)}
# The e4m3 tile that measured fastest on every product: 128x128x128 per consumer, 3 stages, rows minor, 8 wide.
E4M3_BEST = TileConfig(128, 128, 128, 3, grid_minor_dim=0, grid_tile_width=8)


class Probe:
    """The problem sizes (full or --small) and the measurements taken so far."""

    def __init__(self, small: bool):
        self.small = small
        self.rows_total, self.groups = (1024, 4) if small else (65536, 32)
        # (K contracted, N out) of DeepSeek-V3's expert products: fwd of each projection, and dlhs (dy · Wᵀ, which
        # contracts the layer's output dim)
        self.shapes = ({"gate-up fwd": (256, 512), "gate-up dlhs": (512, 256)} if small else
                       {"down fwd": (2048, 7168), "gate-up dlhs": (4096, 7168), "down dlhs": (7168, 2048),
                        "gate-up fwd": (7168, 4096)})
        self.drhs_shapes = ({"gate-up": (256, 512), "down": (256, 512)} if small else
                            {"down": (2048, 7168), "gate-up": (7168, 4096)})
        self.dense_n = 512 if small else 8192
        self.records: list[dict] = []

    def emit(self, **record):
        print(json.dumps(record), flush=True)
        self.records.append(record)

    def bench(self, f, *args):
        """(median ms, min ms) of BATCHES batches of ITERS back-to-back calls."""
        f(*args).block_until_ready()
        if self.small:  # the interpreter's times mean nothing
            return 1.0, 1.0
        f(*args).block_until_ready()
        times = []
        for _ in range(BATCHES):
            t0 = time.perf_counter()
            for _ in range(ITERS):
                out = f(*args)
            out.block_until_ready()
            times.append((time.perf_counter() - t0) / ITERS)
        return float(np.median(times)) * 1e3, float(np.min(times)) * 1e3

    def group_sizes(self, seed: int = 0) -> np.ndarray:
        rng = np.random.default_rng(seed)
        return (np.floor(rng.dirichlet(np.ones(self.groups)) * self.rows_total) // 16 * 16).astype(np.int32)


def padded_index(sizes_G):
    """[G, S] row indices of each group, S its largest size rounded up to 128 (clipped to row 0), and their mask."""
    s_max = int(-(-max(int(sizes_G.max()), 1) // 128) * 128)
    starts_G = np.concatenate([[0], np.cumsum(sizes_G)[:-1]])
    j = np.arange(s_max)[None, :]
    mask_GS = j < sizes_G[:, None]
    return jnp.asarray(np.where(mask_GS, starts_G[:, None] + j, 0)), jnp.asarray(mask_GS)


def check_rows(out_MN, x_MK, wt_GNK, sizes_G):
    """Relative error of out (rows of x · wt[g]ᵀ) against float32 HIGHEST over every valid row, and all finite."""
    idx_GS, mask_GS = padded_index(sizes_G)
    x_GSK = jnp.where(mask_GS[..., None], x_MK[idx_GS], 0.0)
    ref_GSN = jnp.einsum("gsk,gnk->gsn", x_GSK, wt_GNK, precision=lax.Precision.HIGHEST)
    out_GSN = jnp.where(mask_GS[..., None], out_MN[idx_GS].astype(jnp.float32), 0.0)
    return (float(jnp.linalg.norm(out_GSN - ref_GSN) / jnp.linalg.norm(ref_GSN)),
            bool(jnp.isfinite(out_GSN).all()))


def part_lower(probe: Probe):
    """Compile (not run) each kernel on e4m3 operands: which operand layouts wgmma accepts for 8-bit types."""
    S = jax.ShapeDtypeStruct
    m, k, n, g = 1024, 512, 512, 4
    s = S((g,), jnp.int32)
    t = TileConfig(128, 128, 128, 3, grid_minor_dim=1, grid_tile_width=4)
    cases = [
        ("mosaic.grouped_matmul fwd, W [G,K,N] (B MN-major)",
         lambda x, w, s: grouped_matmul(x, w, s, t, out_dtype=BF), (S((m, k), F8), S((g, k, n), F8), s)),
        ("mosaic.grouped_matmul transpose_rhs, W [G,N,K] (B K-major)",
         lambda x, w, s: grouped_matmul(x, w, s, t, transpose_rhs=True, out_dtype=BF),
         (S((m, k), F8), S((g, n, k), F8), s)),
        ("mosaic_ws.grouped_matmul_ws fwd, W [G,K,N]",
         lambda x, w, s: grouped_matmul_ws(x, w, s, t, out_dtype=BF), (S((m, k), F8), S((g, k, n), F8), s)),
        ("mosaic_ws.grouped_matmul_ws transpose_rhs, W [G,N,K]",
         lambda x, w, s: grouped_matmul_ws(x, w, s, t, transpose_rhs=True, out_dtype=BF),
         (S((m, k), F8), S((g, n, k), F8), s)),
        ("mosaic.grouped_matmul_tn x[M,K], dy[M,N] (A, B MN-major)",
         lambda x, y, s: grouped_matmul_tn(x, y, s, t, out_dtype=BF), (S((m, k), F8), S((m, n), F8), s)),
        ("mosaic_ws.grouped_matmul_tn_ws x[M,K], dy[M,N]",
         lambda x, y, s: grouped_matmul_tn_ws(x, y, s, t, out_dtype=BF), (S((m, k), F8), S((m, n), F8), s)),
        ("e4m3_probe_kernels.gmm_nt_ws", lambda x, w, s: gmm_nt_ws(x, w, s, t), (S((m, k), F8), S((g, n, k), F8), s)),
        ("e4m3_probe_kernels.gmm_nt_ws blockwise",
         lambda x, w, s, a, b: gmm_nt_ws(x, w, s, t, scales="blockwise", sa_KbM=a, sb_GNbKb=b),
         (S((m, k), F8), S((g, n, k), F8), s, S((k // 128, m), jnp.float32), S((g, n // 128, k // 128), jnp.float32))),
        ("e4m3_probe_kernels.gmm_tn_aligned_ws xT[K,Mp], dyT[N,Mp]",
         lambda a, b, s: gmm_tn_aligned_ws(a, b, s, t), (S((k, m + g * 128), F8), S((n, m + g * 128), F8), s)),
    ]
    for name, fn, args in cases:
        try:
            jax.jit(fn).lower(*args).compile()
            probe.emit(part="lower", case=name, result="compiles")
        except Exception as e:  # noqa: BLE001 - the error is the finding
            probe.emit(part="lower", case=name, result=f"{type(e).__name__}: {str(e)[:300]}")


def make_problem(probe: Probe, k: int, n: int, key):
    """e4m3 x [M, K] and Wᵀ [G, N, K] (K-major, the layout the e4m3 kernel takes)."""
    kx, kw = jax.random.split(key)
    x8_MK = jax.random.normal(kx, (probe.rows_total, k), jnp.float32).astype(F8)
    wt8_GNK = (jax.random.normal(kw, (probe.groups, n, k), jnp.float32) * 0.05).astype(F8)
    return x8_MK, wt8_GNK


def part_fwd(probe: Probe):
    sizes_G = probe.group_sizes()
    rows = int(sizes_G.sum())
    s = jnp.asarray(sizes_G)
    probe.emit(part="fwd", sizes=sizes_G.tolist(), rows=rows)
    a, b = jax.random.split(jax.random.key(0))
    nd = probe.dense_n
    xd, yd = jax.random.normal(a, (nd, nd), BF), jax.random.normal(b, (nd, nd), BF)
    ms, _ = probe.bench(jax.jit(lambda p, q: p @ q), xd, yd)
    probe.emit(part="fwd", op=f"dense bf16 jnp.dot {nd}^3", ms=ms, tflops=2 * nd ** 3 / ms / 1e9)
    del xd, yd
    for si, (name, (k, n)) in enumerate(probe.shapes.items()):
        flops = 2 * rows * k * n
        x8_MK, wt8_GNK = make_problem(probe, k, n, jax.random.key(si + 1))
        x_MK = x8_MK.astype(BF)
        w_GKN = jnp.swapaxes(wt8_GNK.astype(BF), 1, 2)  # bf16 W [G, K, N]: the production layout, same values
        outs = {}

        def run(label, fn, *args, keep=False):
            try:
                f = jax.jit(fn)
                ms, mn = probe.bench(f, *args)
                probe.emit(part="fwd", shape=name, op=label, ms=ms, min_ms=mn, tflops=flops / ms / 1e9)
                if keep:
                    outs[label] = f(*args)
            except Exception as e:  # noqa: BLE001 - a kernel that fails on e4m3 is a result
                probe.emit(part="fwd", shape=name, op=label, error=f"{type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc(limit=2)

        if "fwd" in name:
            run("bf16 production grouped_matmul_ws W[G,K,N] 128x128x64/3",
                lambda x, w: grouped_matmul_ws(x, w, s, BF16_WS), x_MK, w_GKN, keep=True)
        else:  # dlhs: the layer's W [G, K_layer, N_layer] read transposed in place (k = N_layer, n = K_layer here)
            run("bf16 production grouped_matmul_ws transpose_rhs 128x128x64/3",
                lambda x, w: grouped_matmul_ws(x, w, s, BF16_WS, transpose_rhs=True), x_MK,
                jnp.swapaxes(w_GKN, 1, 2), keep=True)
        del w_GKN
        variants = [("fp8 gmm_nt_ws 128x128x128/3 m-minor 8", lambda x, w: gmm_nt_ws(x, w, s, E4M3_BEST))]
        if name == "gate-up fwd":  # the other tiles, and the production kernels fed e4m3 (K-major B)
            n_minor = lambda bm, bn, bk, st: TileConfig(bm, bn, bk, st, grid_minor_dim=1, grid_tile_width=4)
            variants += [
                ("fp8 gmm_nt_ws 128x128x128/3", lambda x, w: gmm_nt_ws(x, w, s, n_minor(128, 128, 128, 3))),
                ("fp8 gmm_nt_ws 128x128x64/6", lambda x, w: gmm_nt_ws(x, w, s, n_minor(128, 128, 64, 6))),
                ("fp8 gmm_nt_ws 128x64x128/4", lambda x, w: gmm_nt_ws(x, w, s, n_minor(128, 64, 128, 4))),
                ("fp8 production grouped_matmul (1 warpgroup) transpose_rhs 128x128x128/4",
                 lambda x, w: grouped_matmul(x, w, s, n_minor(128, 128, 128, 4), transpose_rhs=True, out_dtype=BF)),
                ("fp8 production grouped_matmul_ws transpose_rhs 128x128x128/3",
                 lambda x, w: grouped_matmul_ws(x, w, s, n_minor(128, 128, 128, 3), transpose_rhs=True,
                                                out_dtype=BF)),
            ]
        for label, fn in variants:
            run(label, fn, x8_MK, wt8_GNK, keep=(label == variants[0][0]))
        if name == "gate-up fwd":  # the e4m3 copies the products need, as XLA transposes
            copies = [("e4m3 W[G,K,N] -> W^T[G,N,K] transpose copy (XLA)", lambda w: jnp.swapaxes(w, 1, 2),
                       jnp.swapaxes(wt8_GNK, 1, 2)),
                      ("e4m3 x[M,K] -> x^T[K,M] transpose copy (XLA)", lambda v: v.T, x8_MK)]
            for label, fn, arg in copies:
                try:
                    ms, _ = probe.bench(jax.jit(fn), arg)
                    probe.emit(part="fwd", shape=name, op=label, ms=ms, gbytes_per_s=2 * arg.size / ms / 1e6)
                except Exception as e:  # noqa: BLE001
                    probe.emit(part="fwd", shape=name, op=label, error=str(e)[:300])
            del copies, arg
        x_f32, wt_f32 = x8_MK.astype(jnp.float32), wt8_GNK.astype(jnp.float32)
        for label, out in outs.items():
            err, finite = check_rows(out, x_f32, wt_f32, sizes_G)
            probe.emit(part="fwd", shape=name, op=label, check="relerr vs f32 ref of e4m3 values", relerr=err,
                       finite=finite)
        outs.clear()  # free this shape's arrays before the next one's (`run` holds `outs`)
        del x8_MK, wt8_GNK, x_MK, x_f32, wt_f32


def part_drhs(probe: Probe):
    sizes_G = probe.group_sizes()
    rows = int(sizes_G.sum())
    s = jnp.asarray(sizes_G)
    first_G, _ = aligned_layout(s, 128)
    m, g = probe.rows_total, probe.groups
    mp = m + g * 128  # room for every group's padding to a multiple of 128
    dest_rows = jnp.asarray(np.concatenate(
        [int(first_G[gi]) * 128 + np.arange(sizes_G[gi]) for gi in range(g)]).astype(np.int32))

    def to_aligned_T(v_MD):  # [M, D] -> [D, Mp], groups at multiples of 128, zero-padded
        return jnp.zeros((v_MD.shape[1], mp), v_MD.dtype).at[:, dest_rows].set(v_MD[:rows].T)

    for si, (name, (k, n)) in enumerate(probe.drhs_shapes.items()):
        flops = 2 * rows * k * n
        kx, kd = jax.random.split(jax.random.key(10 + si))
        x8_MK = jax.random.normal(kx, (m, k), jnp.float32).astype(F8)
        dy8_MN = jax.random.normal(kd, (m, n), jnp.float32).astype(F8)
        outs = {}
        try:
            f = jax.jit(lambda x, y: grouped_matmul_tn(x, y, s, DRHS_BF16[name]))
            args = (x8_MK.astype(BF), dy8_MN.astype(BF))
            ms, mn = probe.bench(f, *args)
            probe.emit(part="drhs", shape=name, op="bf16 production grouped_matmul_tn", ms=ms, min_ms=mn,
                       tflops=flops / ms / 1e9)
            outs["bf16"] = f(*args)
            del args
        except Exception as e:  # noqa: BLE001
            probe.emit(part="drhs", shape=name, op="bf16 production", error=str(e)[:400])
        label = "fp8 gmm_tn_aligned_ws 128x128x128/3"
        try:
            transpose = jax.jit(to_aligned_T)
            # the copy by an XLA scatter: what it costs if the quantizer does not write the aligned layout itself
            ms, _ = probe.bench(transpose, x8_MK)
            probe.emit(part="drhs", shape=name, op="e4m3 x[M,K] -> aligned x^T[K,Mp] (XLA scatter)", ms=ms)
            xT_KMp, dyT_NMp = transpose(x8_MK), transpose(dy8_MN)
            tile = TileConfig(128, 128, 128, 3, grid_minor_dim=1, grid_tile_width=4)
            f = jax.jit(lambda a, b: gmm_tn_aligned_ws(a, b, s, tile))
            ms, mn = probe.bench(f, xT_KMp, dyT_NMp)
            probe.emit(part="drhs", shape=name, op=label, ms=ms, min_ms=mn, tflops=flops / ms / 1e9)
            outs[label] = f(xT_KMp, dyT_NMp)
            del xT_KMp, dyT_NMp
        except Exception as e:  # noqa: BLE001
            probe.emit(part="drhs", shape=name, op=label, error=f"{type(e).__name__}: {str(e)[:400]}")
        idx_GS, mask_GS = padded_index(sizes_G)
        x_GSK = jnp.where(mask_GS[..., None], x8_MK.astype(jnp.float32)[idx_GS], 0.0)
        dy_GSN = jnp.where(mask_GS[..., None], dy8_MN.astype(jnp.float32)[idx_GS], 0.0)
        ref_GKN = jnp.einsum("gsk,gsn->gkn", x_GSK, dy_GSN, precision=lax.Precision.HIGHEST)
        del x_GSK, dy_GSN
        for label, out in outs.items():
            o = out.astype(jnp.float32)
            probe.emit(part="drhs", shape=name, op=label, check="relerr vs f32 ref",
                       relerr=float(jnp.linalg.norm(o - ref_GKN) / jnp.linalg.norm(ref_GKN)),
                       finite=bool(jnp.isfinite(o).all()))
        del x8_MK, dy8_MN, outs, ref_GKN


def part_blockwise(probe: Probe):
    sizes_G = probe.group_sizes()
    rows = int(sizes_G.sum())
    s = jnp.asarray(sizes_G)
    m, g = probe.rows_total, probe.groups
    name = "gate-up fwd"
    k, n = probe.shapes[name]
    flops = 2 * rows * k * n
    x8_MK, wt8_GNK = make_problem(probe, k, n, jax.random.key(20))
    ka, kb = jax.random.split(jax.random.key(30))
    sa_KbM = jax.random.uniform(ka, (k // 128, m), jnp.float32, 0.5, 2.0)
    sb_GNbKb = jax.random.uniform(kb, (g, n // 128, k // 128), jnp.float32, 0.5, 2.0)
    m_minor = lambda bm, bn, bk, st: TileConfig(bm, bn, bk, st, grid_minor_dim=0, grid_tile_width=8)
    blockwise = lambda t: (lambda x, w, a, b: gmm_nt_ws(x, w, s, t, scales="blockwise", sa_KbM=a, sb_GNbKb=b))
    outs = {}
    for label, fn, args in [
        ("fp8 plain gmm_nt_ws 128x128x128/3 m-minor 8", lambda x, w: gmm_nt_ws(x, w, s, E4M3_BEST), (x8_MK, wt8_GNK)),
        ("fp8 plain gmm_nt_ws 128x64x128/4 m-minor 8", lambda x, w: gmm_nt_ws(x, w, s, m_minor(128, 64, 128, 4)),
         (x8_MK, wt8_GNK)),
        # 128x128 per consumer: two 128x128 float32 accumulators (carry and partial) per warpgroup
        ("fp8 blockwise gmm_nt_ws 128x128x128/3 m-minor 8", blockwise(E4M3_BEST), (x8_MK, wt8_GNK, sa_KbM, sb_GNbKb)),
        ("fp8 blockwise gmm_nt_ws 128x64x128/4 m-minor 8", blockwise(m_minor(128, 64, 128, 4)),
         (x8_MK, wt8_GNK, sa_KbM, sb_GNbKb)),
        ("fp8 blockwise gmm_nt_ws 64x128x128/4 m-minor 8", blockwise(m_minor(64, 128, 128, 4)),
         (x8_MK, wt8_GNK, sa_KbM, sb_GNbKb)),
    ]:
        try:
            f = jax.jit(fn)
            ms, mn = probe.bench(f, *args)
            probe.emit(part="blockwise", shape=name, op=label, ms=ms, min_ms=mn, tflops=flops / ms / 1e9)
            outs[label] = f(*args)
        except Exception as e:  # noqa: BLE001
            probe.emit(part="blockwise", shape=name, op=label, error=f"{type(e).__name__}: {str(e)[:600]}")
            traceback.print_exc(limit=3)
    # the blockwise kernels against the dequantized (scaled) values, the plain ones against the e4m3 values
    xs_MK = (x8_MK.astype(jnp.float32).reshape(m, k // 128, 128) * sa_KbM.T[:, :, None]).reshape(m, k)
    ws_GNK = (wt8_GNK.astype(jnp.float32).reshape(g, n // 128, 128, k // 128, 128)
              * sb_GNbKb[:, :, None, :, None]).reshape(g, n, k)
    x_f32, wt_f32 = x8_MK.astype(jnp.float32), wt8_GNK.astype(jnp.float32)
    for label, out in outs.items():
        err, finite = (check_rows(out, xs_MK, ws_GNK, sizes_G) if "blockwise" in label
                       else check_rows(out, x_f32, wt_f32, sizes_G))
        probe.emit(part="blockwise", shape=name, op=label, check="relerr vs f32 ref (scaled dequantized inputs)",
                   relerr=err, finite=finite)


PARTS = {"lower": part_lower, "fwd": part_fwd, "drhs": part_drhs, "blockwise": part_blockwise}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON record to write")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    p.add_argument("--small", action="store_true", help="tiny shapes in Pallas's GPU interpreter (CPU check)")
    args = p.parse_args()
    parts = [part for part in args.parts.split(",") if part]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
    probe = Probe(args.small)
    try:
        for part in parts:
            # lowering is for CUDA itself; the other parts run their kernels in the interpreter under --small
            interpret = args.small and part != "lower"
            with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()) if interpret else contextlib.nullcontext():
                PARTS[part](probe)
    finally:  # a part cut short still leaves what it measured
        write_json(args.out, {
            "benchmark": "fp8-probe-grouped-gemm", "environment": environment(), "small": args.small,
            "method": {"groups": probe.groups, "rows_total": probe.rows_total,
                       "group_sizes": "dirichlet(1), //16, seed 0",
                       "timing": f"median of {BATCHES} batches of {ITERS} back-to-back calls, host clock"},
            "records": probe.records})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
