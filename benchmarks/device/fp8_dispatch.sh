#!/usr/bin/env bash
# One device call (nvidia-h200-x2): FP8 rows towards the experts (moe.dispatch_dtype=float8). First its error
# against bf16 rows and the float8 collectives of the compiled program, per strategy
# (benchmarks/fp8_dispatch_check.py); then the layer benchmark (default strategy, random routing, 11 alternating
# rounds) with bf16 and with float8 rows, one process each. Writes $OUT/fp8-check.json, $OUT/ep-h200-*.json, logs.
set -u
timeout 230 python3 benchmarks/fp8_dispatch_check.py --out "$OUT/fp8-check.json" 2>&1 | grep -v cuda_timer | tail -4
echo "(${SECONDS}s)"
run() { local label=$1; shift
  timeout 170 python3 -m dropless.bench ep --table --iters 11 --strategies auto --skews random \
    --out "$OUT/ep-h200-$label.json" "$@" > "$OUT/ep-$label.log" 2>&1
  echo "$label: rc $? (${SECONDS}s)"; grep "^ep: 2\|^| auto" "$OUT/ep-$label.log"; tail -2 "$OUT/ep-$label.log"; }
run bf16
run float8 moe.dispatch_dtype=float8
