"""What the blockwise e4m3 kernels compile to on one GPU: Mosaic GPU's SASS, PTX and ptxas report (registers,
spills) for the production gmm_nt beside the probe's unscaled kernel at the same tile, with an opcode count per
kernel (make bench-fp8-sass).

    python benchmarks/fp8/sass_dump.py --out-dir DIR

Kernels, at DeepSeek-V3's gate-up forward shape with 8,192 rows in 8 groups (the code does not depend on the
row count): gmm_nt blockwise under each consumer layout (fp8_mosaic.FP8_TILES' tile), stacked also streamed,
e4m3_probe_kernels.gmm_nt_ws unscaled at the same 64 x 128 tile side by side, and the stacked 64 x 128 tile
(FP8_NARROW) streamed, with each K block promoted after its wgmma and behind the next one (`behind=True`). Each
is compiled in a process of its own with MOSAIC_GPU_DUMP_{SASS,PTX,PTXAS} and MOSAIC_GPU_DUMP_TO=DIR/<kernel>, run
once, and its dumped SASS
counted by opcode (the static count of each instruction, e.g. HGMMA, FFMA, FMUL, MOV, CS2R, LDS, LDG, BAR);
DIR/summary.json holds the counts, the ptxas lines and the files (make bench-fp8-sass keeps it as the record
fp8-sass-<gpu>.json). The static counts say what one K step's
promotion costs against the unscaled kernel's step, which carries no promotion.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

KERNELS = ("blockwise-stacked", "blockwise-stacked-streamed", "blockwise-side-by-side", "unscaled-side-by-side",
           "blockwise-stacked-128-streamed", "blockwise-stacked-128-behind")
OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?\b")
# A PTX instruction line: optional predicate, then the opcode with its type suffixes (`fma.rn.f32`,
# `wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3`).
PTX_OPCODE = re.compile(r"^\s*(?:@!?%p\w+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_:]+)*)\s")


def compile_one(kernel: str) -> None:
    """In this process: compile and run one kernel (the dump variables are already in the environment)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dropless.gmm import fp8_mosaic
    from dropless.gmm.tuning import TileConfig
    from e4m3_probe_kernels import gmm_nt_ws

    m, k, n, g = 8192, 7168, 4096, 8
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(rng.multinomial(m, rng.dirichlet(np.ones(g))).astype(np.int32))
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(fp8_mosaic.FP8)
    w = jax.random.normal(jax.random.key(1), (g, n, k), jnp.float32).astype(fp8_mosaic.FP8)
    if kernel == "unscaled-side-by-side":
        tile = TileConfig(64, 128, 128, 4, grid_minor_dim=0, grid_tile_width=8)
        out = jax.jit(lambda x, w, s: gmm_nt_ws(x, w, s, tile))(x, w, sizes)
    else:
        narrow = "-128-" in kernel
        tile = fp8_mosaic.FP8_NARROW if narrow else fp8_mosaic.FP8_TILES[("fwd", "blockwise")]
        stack = "n" if kernel == "blockwise-side-by-side" else "m"
        ls = jnp.ones((k // 128, m), jnp.float32)
        rs = jnp.ones((g, n // 128, k // 128), jnp.float32)
        out = jax.jit(lambda x, w, s, a, b: fp8_mosaic.gmm_nt(x, w, s, tile, scaling="blockwise", lhs_scale=a,
                                                               rhs_scale=b, stack=stack,
                                                               stream=kernel.endswith(("streamed", "behind")),
                                                               behind=kernel.endswith("behind")))(x, w, sizes, ls, rs)
    jax.block_until_ready(out)


def count_opcodes(folder: Path) -> dict:
    """Static opcode counts over the SASS a kernel's compilation dumped (in files or in its log): the lines of the
    form `/*0a40*/  FFMA R0, ...` (PTX has no such lines)."""
    counts = collections.Counter()
    for path in folder.rglob("*"):
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                match = OPCODE.match(line)
                if match:
                    counts[match.group(1)] += 1
    return dict(counts.most_common())


def count_ptx_opcodes(folder: Path) -> dict:
    """Static PTX instruction counts (the full opcode with its suffixes) over the dumped .ptx files: where the
    driver's SASS dump is absent (no nvdisasm), `fma.rn.f32` and `mul.f32` still count the promotion's float32
    work against the wgmma instructions."""
    counts = collections.Counter()
    for path in folder.rglob("*.ptx"):
        for line in path.read_text(errors="replace").splitlines():
            match = PTX_OPCODE.match(line)
            if match and not line.lstrip().startswith(("//", ".")):
                counts[match.group(1)] += 1
    return dict(counts.most_common())


def ptxas_report(folder: Path) -> list[str]:
    """The register, spill and shared-memory lines of the dumped ptxas output and resource files."""
    lines = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in (".ptxas", ".txt") and "resources" in path.name + path.suffix:
            lines += path.read_text(errors="replace").splitlines()
        elif path.is_file() and path.suffix == ".ptxas":
            lines += [line for line in path.read_text(errors="replace").splitlines()
                      if any(word in line for word in ("registers", "spill", "smem", "stack", "bytes"))]
    return lines[:40]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--kernel", choices=KERNELS, help=argparse.SUPPRESS)  # the child process's
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated subset of " + ", ".join(KERNELS))
    a = p.parse_args()
    if a.kernel:
        compile_one(a.kernel)
        return
    from dropless.bench.records import environment

    out = Path(a.out_dir)
    summary = {"benchmark": "fp8-sass", "environment": environment(), "kernels": {}}
    for kernel in a.kernels.split(","):
        folder = out / kernel
        folder.mkdir(parents=True, exist_ok=True)
        env = os.environ | {"MOSAIC_GPU_DUMP_SASS": "1", "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1",
                            "MOSAIC_GPU_DUMP_TO": str(folder)}
        proc = subprocess.run([sys.executable, __file__, "--out-dir", a.out_dir, "--kernel", kernel], env=env,
                              capture_output=True, text=True, timeout=600)
        (folder / "log.txt").write_text(proc.stdout + proc.stderr)
        ptxas = [line for line in (proc.stdout + proc.stderr).splitlines()
                 if "registers" in line or "spill" in line or "ptxas" in line]
        files = sorted(str(f.relative_to(out)) for f in folder.rglob("*") if f.is_file())
        summary["kernels"][kernel] = {"returncode": proc.returncode, "ptxas": ptxas[:20] + ptxas_report(folder),
                                      "files": files, "opcodes": count_opcodes(folder),
                                      "ptx_opcodes": count_ptx_opcodes(folder)}
        print(json.dumps({kernel: {key: summary["kernels"][kernel][key] for key in ("returncode", "ptxas")}}),
              flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
