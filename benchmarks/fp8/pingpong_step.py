"""The proxy's blockwise FP8 step with the e4m3 kernels' consumers taking turns issuing their MMAs in every product
and in none (`dropless.gmm.fp8_mosaic.FP8_PINGPONG`), and the bf16 step, one call (`make bench-fp8-pingpong`).

    python benchmarks/fp8/pingpong_step.py --out fp8-pingpong-step.json --scratch DIR [key=value ...]

Each run is `dropless bench step --preset deepseek-v3-proxy --steps 5 --seconds 6` in this process with the table
set before the step is traced; the record lists the three step records and each FP8 step's ratio to bf16's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dropless.bench.records import environment, write_json
from dropless.cli import main as dropless
from dropless.gmm import fp8_mosaic

EVERY = frozenset((product, "blockwise") for product in fp8_mosaic.PRODUCTS)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--scratch", required=True)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    Path(a.scratch).mkdir(parents=True, exist_ok=True)
    runs = [("bf16", "off", fp8_mosaic.FP8_PINGPONG), ("blockwise, no product ping-pong", "blockwise", frozenset()),
            ("blockwise, every product ping-pong", "blockwise", EVERY)]
    records = []
    for name, recipe, table in runs:
        fp8_mosaic.FP8_PINGPONG = table
        path = Path(a.scratch) / f"pingpong-step-{len(records)}.json"
        code = dropless(["bench", "step", "--preset", "deepseek-v3-proxy", "--steps", "5", "--seconds", "6",
                         "--record", str(path), f"train.fp8={recipe}", *a.overrides])
        if code:
            raise SystemExit(code)
        records.append({"run": name, "pingpong": sorted(p for p, _ in table)} | json.loads(path.read_text()))
    write_json(a.out, {"benchmark": "fp8-pingpong-step", "environment": environment(), "records": records})
    steps = {r["run"]: r["record"]["step_ms"] for r in records}
    print(json.dumps(steps | {"ratios to bf16": {k: steps["bf16"] / v for k, v in steps.items()}}))


if __name__ == "__main__":
    main()
