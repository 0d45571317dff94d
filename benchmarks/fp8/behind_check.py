"""The blockwise e4m3 kernels with each block's product promoted behind the next block's wgmma
(`gmm_nt(behind=True)`, `gmm_tn_aligned(behind=True)`) against the per-tile kernels on one GPU, bit for bit, where
the interpreter cannot look: the wgmma left running while the previous block's product is promoted (make
bench-fp8-behind-check).

    python benchmarks/fp8/behind_check.py --out fp8-behind-check.json

Cases (kernel_check.py's operands: e4m3 values, power-of-two scales; the tables' stacked 64 x 128 tiles):
gmm_nt with 1, 2, 3, 17 and 56 K steps (K = 128 .. 7,168) over groups of 0 to 2,000 rows, the weight gradient
with groups of 0 to 32 128-row blocks (every count of steps after the first, odd and even). Each behind kernel
runs four times; every run must equal the per-tile kernel's bits on the rows in groups, and the streamed kernel
without promotion behind too. Prints one JSON line per case and writes them all to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from kernel_check import nt_case, tn_case  # noqa: E402

from dropless.bench.harness import same_bits  # noqa: E402
from dropless.bench.records import environment, write_json  # noqa: E402
from dropless.gmm import fp8_mosaic  # noqa: E402

NT_GROUPS = [0, 300, 0, 1000, 5, 0, 700, 2000]
TN_GROUPS = [0, 100, 128, 129, 256, 300, 0, 384, 1000, 5, 4000, 3000]
CASES = ([("gmm_nt", nt_case, k, 512, NT_GROUPS, fp8_mosaic.FP8_NARROW) for k in (128, 256, 384, 2176, 7168)]
         + [("gmm_tn_aligned", tn_case, 1024, 512, TN_GROUPS, fp8_mosaic.FP8_TILES[("drhs", "blockwise")])])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    records, env = [], environment()
    for kernel, case, k, n, groups, tile in CASES:
        sizes = np.array(groups, np.int32)
        make_fn, args, _, live = case("blockwise", sizes, k, n, int(sizes.sum()) + 64)
        rec = {"kernel": kernel, "k": k, "n": n, "groups": groups, "tile": str(tile)}
        try:
            rows = slice(live)  # gmm_nt: the rows in groups; the weight gradient (live None): all of it
            per_tile = make_fn(tile, "m")(*args)[rows]
            streamed = make_fn(tile, "m", True)(*args)[rows]
            behind = make_fn(tile, "m", True, True)
            runs = [same_bits(behind(*args)[rows], per_tile) for _ in range(4)]
            rec |= {"streamed_equal": same_bits(streamed, per_tile), "behind_equal": runs, "ok": all(runs)}
        except Exception as e:  # noqa: BLE001 - a case that fails is a result
            rec |= {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", "ok": False}
        print(json.dumps(rec), flush=True)
        records.append(rec)
        write_json(a.out, {"benchmark": "fp8-behind-check", "environment": env, "records": records})


if __name__ == "__main__":
    main()
