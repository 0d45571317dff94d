"""Does sharing operand loads across a 2-CTA cluster (TMA multicast) raise a warp-specialised Hopper matmul's rate?

    python benchmarks/gmm_cluster_probe.py --out FILE.json          (make bench-gmm-cluster-probe)

Our grouped-GEMM kernels (dropless.gmm.mosaic_ws) give each CTA its own loads: a 128 x 256 output tile streams
128 + 256 rows of K from L2 per step, 48 KB per 64-wide step for 4.2 MFLOP, about 7 TB/s of L2 reads at 600 TF/s
on 132 SMs. cuBLAS's fastest sm90 kernels run in clusters of two CTAs that multicast the operand they share.
This probe measures, in one run and at the expert layers' dense shapes (all rows one group, so no ragged-tile
effect), JAX's own warp-specialised Hopper matmul (jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu) at our
table's tile with no cluster, with the weight block multicast to two CTAs of adjacent row tiles (cluster along M)
and with the row block multicast to two CTAs of adjacent column tiles (cluster along N), beside our own kernel at
the same tile (one group) and XLA's dot. Every result is checked against XLA's before it is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from dropless.bench.harness import time_calls
from dropless.bench.records import environment, write_json

SHAPES = {  # name: (M rows, K contraction, N columns): the expert layers' shapes at 65,536 rows
    "dsv3-gate-up": (65536, 7168, 4096),
    "dsv3-down": (65536, 2048, 7168),
    "qwen3-gate-up": (65536, 2048, 1536),
}


def jax_kernel_configs(hm):
    """(name, TuningConfig) of JAX's kernel: our table's 128 x 128 x 64 consumer tile, consumers side by side (CTA
    128 x 256) or stacked (256 x 128), in 3 or 4 stages, with no cluster, a cluster along M and one along N."""
    fields = {f.name for f in dataclasses.fields(hm.TuningConfig)}
    M, N = hm.MatmulDimension.M, hm.MatmulDimension.N
    for wg in (N, M):
        for stages in (3, 4):
            for cluster in (None, M, N):
                kw = dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=stages, epi_tile_m=64,
                          epi_tile_n=64, grid_minor_dim=M, grid_tile_width=8, wg_dimension=wg,
                          cluster_dimension=cluster)
                if "cluster_dimension" not in fields and cluster is not None:
                    continue
                yield (f"jax wg={wg.name} stages={stages} cluster={cluster.name if cluster is not None else '-'}",
                       hm.TuningConfig(**{k: v for k, v in kw.items() if k in fields}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args()
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    from dropless.gmm import mosaic_ws
    from dropless.gmm.tuning import TileConfig

    record = {"benchmark": "gmm-cluster-probe", "environment": environment(), "results": []}
    for name in a.shapes.split(","):
        m, k, n = SHAPES[name]
        keys = jax.random.split(jax.random.key(0), 4)
        pairs = [(jax.random.normal(keys[i], (m, k), jnp.bfloat16),
                  (jax.random.normal(keys[i + 1], (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)) for i in (0, 2)]
        flops = 2 * m * k * n
        dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        want = np.asarray(dot(*pairs[0]).astype(jnp.float32))
        sizes = jnp.array([m], jnp.int32)
        paths = [("xla dot", dot)]
        paths.append(("dropless_ws 128x128x64/4 (one group)", jax.jit(functools.partial(
            lambda x, w, t: mosaic_ws.grouped_matmul_ws(x, w[None], sizes, t),
            t=TileConfig(128, 128, 64, 4, grid_minor_dim=0, grid_tile_width=8)))))
        for label, config in jax_kernel_configs(hm):
            paths.append((label, jax.jit(functools.partial(lambda x, w, c: hm.matmul(x, w, None, c), c=config))))
        for label, fn in paths:
            row = {"shape": name, "m": m, "k": k, "n": n, "path": label}
            try:
                got = np.asarray(fn(*pairs[0]).astype(jnp.float32))
                err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
                row["max_rel_error"] = err
                if not err < 2e-2:
                    raise AssertionError(f"result differs from XLA's: {err:.3g}")
                seconds = time_calls(fn, pairs, target_s=0.1, batches=7)
                row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12)
            except Exception as e:  # a config that does not fit or lower is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                traceback.print_exc(limit=2)
            print(json.dumps(row), flush=True)
            record["results"].append(row)
    write_json(a.out, record)


if __name__ == "__main__":
    main()
