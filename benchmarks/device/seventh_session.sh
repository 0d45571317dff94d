#!/usr/bin/env bash
# One device call (nvidia-h200-x2), 2026-12-01: the layer benchmark (random routing, 11 alternating rounds, 8 traced
# calls) for the default strategy and alltoall with bf16 rows (alltoall's slot packing now differentiates as a
# gather), then the default with float8 rows (moe.dispatch_dtype=float8), one process each; then FP8's error and
# float8 collectives on the GPU (benchmarks/fp8_dispatch_check.py). Writes $OUT/ep-h200-{bf16,float8}.json,
# $OUT/fp8-check.json and logs.
set -u
run() { local label=$1 strategies=$2; shift 2
  timeout 200 python3 -m dropless.bench ep --table --iters 11 --strategies "$strategies" --skews random \
    --out "$OUT/ep-h200-$label.json" "$@" > "$OUT/ep-$label.log" 2>&1
  echo "$label: rc $? (${SECONDS}s)"; grep "^| " "$OUT/ep-$label.log"; }
run bf16 auto,alltoall
run float8 auto moe.dispatch_dtype=float8
timeout 150 python3 benchmarks/fp8_dispatch_check.py --strategies allgather,ragged --out "$OUT/fp8-check.json" 2>&1 \
  | grep -v cuda_timer | tail -3
echo "(${SECONDS}s)"
