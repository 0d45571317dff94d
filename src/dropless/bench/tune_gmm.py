"""`dropless tune-gmm`: measure kernel/tile candidates for the three grouped-GEMM products on this GPU and
write the fastest correct one per product into the tuned-config table.

  dropless tune-gmm --preset deepseek-v3-671b            # the preset's gate+up and down GEMMs
  dropless tune-gmm --shape 65536,7168,4096,32 --shape 65536,2048,7168,32 --out my_gmm.json

A preset gives two shapes: gate+up (K = hidden, N = 2 x expert width) and down (K = expert width,
N = hidden), with G = experts / parallel.expert and M = --rows. Each candidate is compiled (in parallel
threads), checked against an f32 reference on the largest, a median and an empty group, then timed
(median of batches, rotating inputs). The table written is the packaged one by default; write your own
with --out and point DROPLESS_GMM_CONFIGS at it: its entries then take precedence over the packaged ones.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import sys
from dataclasses import astuple
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dropless.bench.gmm import SHAPES, SKEWS, checked_groups, group_sizes
from dropless.bench.harness import REL_ERR_LIMIT, compile_in_threads, first_line, time_calls, watchdog
from dropless.bench.records import environment, write_json
from dropless.core import xla_flags
from dropless.core.arguments import ArgumentParser, check_count, check_output
from dropless.core.config import ConfigError, load_preset
from dropless.gmm import tuning as gt
from dropless.gmm.dropless_mosaic import ragged_contract, ragged_rows
from dropless.gmm.tuning import ProductConfig, ShapeKey, TileConfig

PACKAGED_TABLE = Path(gt.__file__).with_name(gt.DATA_FILE)


def _pc(kernel, bm, bn, bk, stages, persistent=True, minor="n", width=4) -> ProductConfig:
    return ProductConfig(kernel, TileConfig(bm, bn, bk, stages, persistent, "mn".index(minor), width))


# Hand-picked around tokamax's autotuned forward tile on an H200 (block 128x64x128, 4 stages, persistent,
# n-minor walk in bands of 4-8: shared/facts/autotune_dsv3_*.json, 96 configs each). 128-wide N tiles
# halve the shared-memory reads per MMA (tokamax's own search only tries N = 64); an m-minor walk makes the
# row tiles of one expert reuse its weight tile from L2 (matters when experts get few rows, e.g. G = 256).
# The warp-specialised kernels: CTA tiles of 128x256 (cuBLAS's shape for these GEMMs), 64x256
# and 128x128, with as many stages as shared memory holds beside the two consumers' output blocks.
WARP_SPECIALISED = (_pc("dropless_ws", 128, 128, 64, 3), _pc("dropless_ws", 64, 128, 64, 4),
                    _pc("dropless_ws", 128, 64, 64, 6))
# The same tiles with one stream of loads across each CTA's tiles (no pipeline drain per tile), and that with one
# MMA in flight across steps.
STREAMING = tuple(dataclasses.replace(c, kernel=kernel) for kernel in ("dropless_ws_stream", "dropless_ws_stream_async")
                  for c in WARP_SPECIALISED)
# 64x256 tiles are wgmma's widest single instruction (m64n256k16): per MMA they read 17% fewer operand bytes
# from shared memory than 128x128, and 64-row tiles waste fewer rows at group boundaries. Only the weight
# gradient's kernel compiles them (the rows kernel's ragged store fails Mosaic GPU's layout inference, on an H200
# and in tests/test_gmm_tuning.py on the CPU), and they stay a candidate there although 128x128 won on an H200.
QUICK = {
    "fwd": (_pc("tokamax", 128, 64, 128, 4, width=4), _pc("tokamax", 128, 64, 128, 4, width=8),
            _pc("tokamax", 128, 128, 64, 4), _pc("tokamax", 128, 128, 64, 4, minor="m"),
            _pc("dropless", 128, 128, 64, 4), _pc("dropless", 128, 128, 64, 6), *WARP_SPECIALISED, *STREAMING),
    "dlhs": (_pc("tokamax", 128, 64, 128, 4), _pc("dropless", 128, 64, 128, 4), _pc("dropless", 128, 128, 64, 4),
             _pc("dropless", 128, 128, 64, 4, minor="m"), _pc("dropless", 64, 128, 128, 4),
             _pc("dropless", 128, 128, 64, 6, minor="m"), *WARP_SPECIALISED, *STREAMING),
    "drhs": (_pc("tokamax", 64, 64, 128, 2, False, width=1), _pc("tokamax", 128, 64, 128, 4, False, width=1),
             _pc("dropless", 128, 128, 64, 4), _pc("dropless", 128, 128, 64, 2, False, width=1),
             _pc("dropless", 128, 128, 64, 6), _pc("dropless", 64, 256, 64, 4), *WARP_SPECIALISED, *STREAMING),
}


def wide_candidates(product: str) -> tuple[ProductConfig, ...]:
    """A larger grid for users with time to spare (several hundred candidates over all products)."""
    out = []
    for kernel in gt.KERNELS:
        for bm, bn, bk in ((128, 64, 128), (128, 128, 64), (64, 128, 128), (256, 64, 64), (128, 64, 64), (64, 64, 128),
                           (64, 256, 64)):
            for stages in (2, 3, 4, 6):
                for persistent in (True, False):
                    for minor, width in (("n", 4), ("n", 8), ("m", 4), ("m", 2)):
                        if kernel == "tokamax" and product == "drhs" and (persistent or (minor, width) != ("n", 4)):
                            continue  # tokamax's weight-gradient kernel has a fixed grid
                        c = _pc(kernel, bm, bn, bk, stages, persistent, minor, width)
                        if gt.smem_bytes(c) <= gt.SMEM_BYTES:
                            out.append(c)
    return tuple(dict.fromkeys(out))


def fine_candidates(product: str) -> tuple[ProductConfig, ...]:
    """Around the warp-specialised tiles that win the fine-grained shapes' products (DeepSeek-V3 with 256 experts,
    Qwen3-30B-A3B: 128x128x64 in 3 stages; Qwen3-Next's rows products 64x128x64), every walk order and band
    width: which operand the concurrently running tiles share from L2 matters most when each expert has few rows.
    Each also with one stream of loads across a CTA's tiles ("dropless_ws_stream"), and that with one MMA in
    flight ("dropless_ws_stream_async"): 54 candidates per product, against several hundred for `wide`."""
    out = []
    for kernel in ("dropless_ws", "dropless_ws_stream", "dropless_ws_stream_async"):
        for bm, bn, bk, stages in ((128, 128, 64, 3), (128, 64, 64, 6), (64, 128, 64, 4)):
            for minor, width in (("n", 2), ("n", 4), ("n", 8), ("m", 2), ("m", 4), ("m", 8)):
                c = _pc(kernel, bm, bn, bk, stages, minor=minor, width=width)
                if gt.smem_bytes(c) <= gt.SMEM_BYTES:
                    out.append(c)
    return tuple(out)


def stacked_candidates(product: str) -> tuple[ProductConfig, ...]:
    """The stacked rows kernel ("dropless_ws_stacked": consumers one above the other, 64 rows each, the second
    resting where a group's last rows fit in the first's) at 64 x 256 and 64 x 128 per consumer, walked m-minor in
    bands of 4 and 8 and n-minor in bands of 4; no weight-gradient candidate (`candidates` adds the table's
    current choice for the shape, so one run compares them)."""
    if product == "drhs":
        return ()
    return tuple(_pc("dropless_ws_stacked", 64, bn, 64, stages, minor=minor, width=width)
                 for bn, stages in ((256, 3), (128, 4)) for minor, width in (("m", 4), ("m", 8), ("n", 4)))


# A candidate's first run: well over a second would be thousands of times its expected time, so this is a hang.
CANDIDATE_SECONDS = 120.0

CANDIDATE_SETS = {"quick": lambda product: QUICK[product], "fine": fine_candidates, "wide": wide_candidates,
                  "stacked": stacked_candidates}


def candidates(product: str, shape: ShapeKey, which: str = "quick",
               kernels: tuple[str, ...] = gt.KERNELS) -> list[ProductConfig]:
    """The candidate set's configs of one product that fit the shape; "stacked" also takes the table's current
    choice for the shape (the one the stacked kernel would replace)."""
    pool = CANDIDATE_SETS[which](product)
    if which == "stacked":
        pool = (*pool, gt.plan_for(*astuple(shape)).product(product))
    return list(dict.fromkeys(c for c in pool if c.kernel in kernels and c.fits(product, shape.k, shape.n)))


def preset_shapes(name: str, rows: int) -> list[tuple[str, ShapeKey]]:
    """The two routed-expert GEMMs of a preset, with G = local experts."""
    cfg = load_preset(name)
    d, f = cfg.model.hidden_size, cfg.moe.expert_intermediate_size
    g = cfg.moe.num_experts // cfg.parallel.expert
    return [(f"{name}-gate-up-e{g}", ShapeKey(rows, d, 2 * f, g)), (f"{name}-down-e{g}", ShapeKey(rows, f, d, g))]


def product_fn(product: str, config: ProductConfig):
    """The product as a function of its two operands and the group sizes."""
    if product == "fwd":
        return lambda a, w, gs: ragged_rows(a, w, gs, config, transpose_rhs=False, out_dtype=jnp.bfloat16)
    if product == "dlhs":
        return lambda a, w, gs: ragged_rows(a, w, gs, config, transpose_rhs=True, out_dtype=jnp.bfloat16)
    return lambda a, b, gs: ragged_contract(a, b, gs, config, out_dtype=jnp.bfloat16)


def product_checker(product: str, rows: int = 256):
    """err(a, b, out, g, start, end): relative Frobenius error of the product's output for group g."""
    def rel(x, y):
        return jnp.linalg.norm((x - y).ravel()) / jnp.maximum(jnp.linalg.norm(y.ravel()), 1e-6)

    @jax.jit
    def err(a, b, out, g, start, end):
        f32 = lambda t: t.astype(jnp.float32)
        m = a.shape[0]
        if product == "drhs":
            inside = ((jnp.arange(m) >= start) & (jnp.arange(m) < end))[:, None]
            return rel(f32(out[g]), jnp.where(inside, f32(a), 0).T @ f32(b))
        lo = jnp.minimum(start, m - rows)
        keep = ((jnp.arange(rows) + lo >= start) & (jnp.arange(rows) + lo < end))[:, None]
        wg = f32(b[g]) if product == "fwd" else f32(b[g]).T
        ref = jnp.where(keep, jax.lax.dynamic_slice_in_dim(f32(a), lo, rows) @ wg, 0)
        return rel(jnp.where(keep, jax.lax.dynamic_slice_in_dim(f32(out), lo, rows), 0), ref)

    return err


def tune_shape(name: str, shape: ShapeKey, *, skew: str, seed: int, which: str, workers: int,
               products=gt.PRODUCTS, kernels=gt.KERNELS, log=print):
    """Measure every candidate of every product; returns ({product: best}, {product: best ms}, trial log)."""
    keys = jax.random.split(jax.random.key(seed), 5)
    bf16 = jnp.bfloat16
    xs = [jax.random.normal(keys[i], (shape.m, shape.k), bf16) for i in (0, 1)]
    dys = [jax.random.normal(keys[2 + i], (shape.m, shape.n), bf16) for i in (0, 1)]
    w = (jax.random.normal(keys[4], (shape.g, shape.k, shape.n), jnp.float32) / math.sqrt(shape.k)).astype(bf16)
    sizes = group_sizes(skew, shape.m, shape.g, seed)
    gs = jnp.asarray(sizes)
    ends = np.cumsum(sizes)
    operands = {"fwd": [(x, w) for x in xs], "dlhs": [(dy, w) for dy in dys], "drhs": list(zip(xs, dys))}
    best, best_ms, trials = {}, {}, []
    for product in products:
        pool = candidates(product, shape, which, kernels)
        if not pool:
            raise RuntimeError(f"{name}: no {product} candidate of kernels {', '.join(kernels)} fits this shape.")
        args = [(*ab, gs) for ab in operands[product]]

        def build(config):
            return jax.jit(product_fn(product, config)).lower(*args[0]).compile()

        compiled = compile_in_threads(lambda c: _try(build, c), pool, workers)
        check = product_checker(product)
        for config, (fn, error) in zip(pool, compiled):
            trial = {"shape": name, "product": product, **config.to_json(), "ms": None, "max_rel_err": None,
                     "error": error}
            if fn is not None:
                try:
                    with watchdog(CANDIDATE_SECONDS, f"{name} {product}: kernel {config.kernel}, {config.tile}",
                                  "the shapes before it are saved; leave that kernel family out (--kernels) and "
                                  "run again."):
                        out = jax.block_until_ready(fn(*args[0]))
                    errs = [float(check(*operands[product][0], out, g, int(ends[g] - sizes[g]), int(ends[g])))
                            for g in checked_groups(sizes)]
                    del out
                    trial["max_rel_err"] = max(errs)
                    if not trial["max_rel_err"] <= REL_ERR_LIMIT:
                        raise AssertionError(f"relative error {trial['max_rel_err']:.3g}")
                    trial["ms"] = time_calls(fn, args) * 1e3
                except Exception as e:  # noqa: BLE001 - a failing candidate is a result
                    trial["error"] = first_line(e)
            trials.append(trial)
            status = f"{trial['ms']:.3f} ms" if trial["ms"] else f"FAILED {trial['error']}"
            log(f"{name} {product:4s} {config.kernel:8s} {config.tile} -> {status}")
            if trial["ms"] and (product not in best_ms or trial["ms"] < best_ms[product]):
                best[product], best_ms[product] = config, trial["ms"]
        if product not in best:
            raise RuntimeError(f"{name}: no {product} candidate ran correctly; see the log above.")
    del xs, dys, w
    return best, best_ms, trials


def _try(build, config):
    try:
        return build(config), None
    except Exception as e:  # noqa: BLE001
        return None, first_line(e)


def _subset(text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The comma-separated names of `text` if they are a non-empty subset of `allowed`, else ()."""
    chosen = tuple(name for name in text.split(",") if name)
    return chosen if chosen and all(name in allowed for name in chosen) else ()


def parse_args(argv):
    p = ArgumentParser(prog="dropless tune-gmm", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", action="append", default=[], help="a preset name; repeatable")
    p.add_argument("--shape", action="append", default=[], help="M,K,N,G; repeatable")
    p.add_argument("--bench-shapes", default="", help="comma-separated shape classes of 'dropless bench gmm'")
    p.add_argument("--rows", type=int, default=65536, help="M for --preset shapes (rows per grouped GEMM)")
    p.add_argument("--skew", default="dirichlet", help="group-size distribution to tune on")
    p.add_argument("--candidates", choices=tuple(CANDIDATE_SETS), default="quick",
                   help="quick (the default, ~10 per product), fine (the warp-specialised tiles in every walk order, "
                        "for many small experts), stacked (the stacked rows kernel beside the table's choice) or wide "
                        "(several hundred)")
    p.add_argument("--products", default=",".join(gt.PRODUCTS),
                   help="comma-separated subset of fwd,dlhs,drhs to tune; the others keep the table's configs")
    p.add_argument("--kernels", default=",".join(gt.KERNELS),
                   help="comma-separated subset of the kernel families to try")
    p.add_argument("--out", default=None, help=f"table to write/extend (default: the packaged {gt.DATA_FILE})")
    p.add_argument("--log", default=None, help="also write every trial as JSON here, with the device and commit")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="parallel compilations")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _shapes(args) -> list[tuple[str, ShapeKey]]:
    """The (name, shape) pairs that --shape, --preset and --bench-shapes ask for."""
    shapes: list[tuple[str, ShapeKey]] = []
    try:
        for spec in args.shape:
            m, k, n, g = (int(v) for v in spec.split(","))
            if min(m, k, n, g) < 1:
                raise ValueError
            shapes.append((gt.shape_class(m, k, n, g), ShapeKey(m, k, n, g)))
    except ValueError:
        raise ConfigError(f"--shape {spec!r} must be four positive integers M,K,N,G.") from None
    for name in args.preset:
        shapes += preset_shapes(name, args.rows)
    for name in filter(None, args.bench_shapes.split(",")):
        if name not in SHAPES:
            raise ConfigError(f"unknown bench shape {name!r}; choose from {', '.join(SHAPES)}.")
        s = SHAPES[name]
        shapes.append((name, ShapeKey(s.m, s.k, s.n, s.g)))
    return shapes


def _keep_untuned(table: dict, device: str, shape: ShapeKey, products, best: dict, best_ms: dict) -> str:
    """Fill the products not tuned in this run with the current table's choice (and timing); returns what the
    entry's provenance adds about them."""
    current = gt.lookup(gt.overlay(gt.load_table(), table), device, *astuple(shape))
    previous = next((e for e in table["devices"].get(device, []) + gt.load_table()["devices"].get(
        device, []) if (e["m"], e["k"], e["n"], e["g"]) == astuple(shape)), {})
    kept = [p for p in gt.PRODUCTS if p not in products]
    for p in kept:
        best[p] = current.product(p)
        best_ms[p] = previous.get(p, {}).get("ms")
    source = previous.get("provenance", f"the table's nearest entry, {current.source}").split(";")[0]
    return f"; {', '.join(products)} tuned here, {', '.join(kept)} kept from: {source}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    check_count("--rows", args.rows, why=": the rows M of each --preset shape's grouped GEMM")
    check_count("--workers", args.workers, why=": the compilations run at once")
    check_count("--seed", args.seed, 0, why=": numpy's generator of the group sizes takes no negative seed")
    shapes = _shapes(args)
    if not shapes:
        raise ConfigError("give the shapes to tune: --preset NAME, --shape M,K,N,G or --bench-shapes.")
    if args.skew not in SKEWS:
        raise ConfigError(f"--skew {args.skew} is not known; choose from {', '.join(SKEWS)}.")
    products, kernels = _subset(args.products, gt.PRODUCTS), _subset(args.kernels, gt.KERNELS)
    for flag, chosen, allowed in (("--products", products, gt.PRODUCTS), ("--kernels", kernels, gt.KERNELS)):
        if not chosen:
            raise ConfigError(f"{flag} must be a comma-separated subset of {', '.join(allowed)}.")
    if args.out:  # the table and the log are written after each shape's minutes of trials
        check_output("--out", args.out)
    if args.log:
        check_output("--log", args.log)
    xla_flags.apply()  # before JAX starts a backend
    env = environment()
    if env["platform"] != "gpu":
        raise ConfigError("tune-gmm measures GPU kernels; run it on an NVIDIA Hopper GPU.")
    out = Path(args.out) if args.out else PACKAGED_TABLE
    # A folder not made yet is made when the table is saved: what must be writable is the nearest one that exists.
    if not os.access(next(p for p in (out, *out.parents) if p.exists()), os.W_OK):
        raise ConfigError(f"cannot write {out}; pass --out my_gmm.json and set DROPLESS_GMM_CONFIGS=my_gmm.json.")
    table = gt.load_table(out) if out.exists() else gt.empty_table()
    all_trials = []
    for name, shape in shapes:
        best, best_ms, trials = tune_shape(name, shape, skew=args.skew, seed=args.seed, which=args.candidates,
                                           workers=args.workers, products=products, kernels=kernels)
        kept = ""
        if len(products) < len(gt.PRODUCTS):  # keep the current table's choice (and timing) for the others
            kept = _keep_untuned(table, env["device"], shape, products, best, best_ms)
        all_trials += trials
        provenance = (f"dropless tune-gmm on {env['device']}, {datetime.date.today().isoformat()}, jax {env['jax']}, "
                      f"tokamax {env['tokamax']}, commit {env['commit']}; {args.candidates} candidates, skew "
                      f"{args.skew}, seed {args.seed}; median of batches, rotating inputs{kept}")
        table = gt.merge_entry(table, env["device"], gt.make_entry(name, shape, best, best_ms, provenance))
        gt.save_table(table, out)  # after every shape: a timeout keeps what was done
        print(f"{name}: " + ", ".join(f"{p} {best[p].kernel} {best_ms[p]} ms" for p in gt.PRODUCTS), flush=True)
        if args.log:  # a record like the benchmarks': what ran where, then every trial
            write_json(args.log, {"benchmark": "tune-gmm", "environment": env, "candidates": args.candidates,
                                  "skew": args.skew, "seed": args.seed, "kernels": list(kernels),
                                  "products": list(products), "trials": all_trials})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
