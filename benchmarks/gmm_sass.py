"""What the bf16 warp-specialised grouped-GEMM kernels compile to on one GPU: for each kernel family and product,
ptxas's performance messages (C75xx: "Potential Performance Loss: wgmma.mma_async instructions are serialized"
means the MMAs of one accumulator run one at a time; C7519 an injected warpgroup.arrive), its register and spill
lines, and the MMA waits in the PTX by how many MMAs each leaves in flight (make bench-gmm-sass).

    python benchmarks/gmm_sass.py --out-dir DIR [--kernels dropless_ws_stream,dropless_ws_stream_async]

Each (kernel, product) is compiled and run once at DeepSeek-V3's 256-expert gate-up shape, Dirichlet groups, tile
128 x 128 x 64 with 3 stages, in a process of its own with MOSAIC_GPU_DUMP_{SASS,PTX,PTXAS} and
MOSAIC_GPU_DUMP_TO=DIR/<kernel>-<product>; DIR/summary.json holds the findings and the files.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "fp8"))
from sass_dump import count_opcodes, ptxas_report  # noqa: E402

PRODUCTS = ("fwd", "dlhs", "drhs")
# `wgmma.wait_group.sync.aligned N;`: N MMA groups may still run after it.
WAIT = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)")
# ptxas's numbered performance messages and its warnings, whatever words follow.
PTXAS_MESSAGE = re.compile(r"\(C75\d\d\)|Potential Performance Loss|ptxas.*warning", re.IGNORECASE)


def compile_one(kernel: str, product: str) -> None:
    """In this process: compile and run one kernel (the dump variables are already in the environment)."""
    import jax
    import jax.numpy as jnp

    from dropless.bench.gmm import SHAPES, group_sizes
    from dropless.gmm.dropless_mosaic import CONTRACT_KERNELS, ROWS_KERNELS
    from dropless.gmm.tuning import TileConfig

    s = SHAPES["dsv3-gate-up-e256"]
    tile = TileConfig(128, 128, 64, 3, True, 0, 4)
    sizes = jnp.asarray(group_sizes("dirichlet", s.m, s.g))
    x = jax.random.normal(jax.random.key(0), (s.m, s.k), jnp.bfloat16)
    if product == "drhs":
        dy = jax.random.normal(jax.random.key(1), (s.m, s.n), jnp.bfloat16)
        out = jax.jit(lambda x, dy, g: CONTRACT_KERNELS[kernel](x, dy, g, tile, out_dtype=jnp.bfloat16))(x, dy, sizes)
    else:
        w = jax.random.normal(jax.random.key(1), (s.g, s.n, s.k) if product == "dlhs" else (s.g, s.k, s.n),
                              jnp.bfloat16)
        out = jax.jit(lambda x, w, g: ROWS_KERNELS[kernel](x, w, g, tile, transpose_rhs=product == "dlhs",
                                                            out_dtype=jnp.bfloat16))(x, w, sizes)
    jax.block_until_ready(out)


def mma_waits(folder: Path) -> dict:
    """How many MMA waits the PTX holds per number of MMAs each leaves in flight."""
    counts = collections.Counter()
    for path in folder.rglob("*.ptx"):
        counts.update(f"wait_group {n}" for n in WAIT.findall(path.read_text(errors="replace")))
    return dict(sorted(counts.items()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--kernels", default="dropless_ws,dropless_ws_stream,dropless_ws_stream_async")
    p.add_argument("--products", default="fwd,drhs", help="fwd, drhs; dlhs runs the forward's shape transposed")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # the child process's kernel and product
    a = p.parse_args()
    if a.child:
        compile_one(*a.child)
        return
    out = Path(a.out_dir)
    summary = {}
    for kernel in a.kernels.split(","):
        for product in a.products.split(","):
            name = f"{kernel}-{product}"
            folder = out / name
            shutil.rmtree(folder, ignore_errors=True)  # a dump left by an earlier run would be counted again
            folder.mkdir(parents=True)
            env = os.environ | {"MOSAIC_GPU_DUMP_SASS": "1", "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1",
                                "MOSAIC_GPU_DUMP_TO": str(folder)}
            proc = subprocess.run([sys.executable, __file__, "--out-dir", a.out_dir, "--child", kernel, product],
                                  env=env, capture_output=True, text=True, timeout=300)
            log = proc.stdout + proc.stderr
            (folder / "log.txt").write_text(log)
            files = [f for f in folder.rglob("*") if f.is_file()]
            messages = sorted({line.strip() for f in files for line in f.read_text(errors="replace").splitlines()
                               if PTXAS_MESSAGE.search(line)})
            sass = count_opcodes(folder)
            summary[name] = {"returncode": proc.returncode, "ptxas_messages": messages[:20],
                             "ptxas": ptxas_report(folder), "ptx_mma_waits": mma_waits(folder),
                             "sass_depbar": {k: v for k, v in sass.items() if "DEPBAR" in k or k == "HGMMA"},
                             "files": sorted(str(f.relative_to(out)) for f in files)}
            print(json.dumps({name: {k: summary[name][k] for k in ("returncode", "ptxas_messages", "ptx_mma_waits",
                                                                  "sass_depbar")}}), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
