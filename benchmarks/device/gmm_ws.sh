#!/usr/bin/env bash
# One device call (nvidia-h200): the warp-specialised grouped GEMMs on an H200 for the first time.
# 1. a smoke run of the dropless_ws candidates alone on one shape, under a timeout (a kernel whose
#    barriers disagree hangs rather than fails);
# 2. if it passed: tune the four DeepSeek-V3 shapes over both of our kernel families (tokamax's lost every
#    product in the last re-tune, benchmarks/results/gmm-h200-raw/run3-tune.log);
# 3. bench gmm through that table: dense vs dropless, Dirichlet-skewed groups.
# Run from the repo root after the wheel install line of shared/device/prepare-wheels.sh; writes to $OUT.
set -u
shapes=dsv3-gate-up-e32,dsv3-down-e32,dsv3-gate-up-e256,dsv3-down-e256
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > "$OUT/gpu.txt"
timeout 150 python3 -m dropless.bench.tune_gmm --kernels dropless_ws --bench-shapes dsv3-down-e256 \
  --out "$OUT/ws-smoke.json" --log "$OUT/ws-smoke-trials.json" > "$OUT/ws-smoke.log" 2>&1
rc=$?
echo "smoke rc $rc (${SECONDS}s)"; tail -12 "$OUT/ws-smoke.log"
[ $rc -eq 0 ] || exit $rc
timeout 300 python3 -m dropless.bench.tune_gmm --kernels dropless,dropless_ws --bench-shapes $shapes \
  --out "$OUT/tuned.json" --log "$OUT/tune-trials.json" > "$OUT/tune.log" 2>&1
echo "tune rc $? (${SECONDS}s)"; grep -E "^dsv3-[a-z0-9-]+: " "$OUT/tune.log"
timeout $((570 - SECONDS)) python3 -m dropless.bench gmm --shapes $shapes --skews dirichlet \
  --backends dense,dropless --configs "$OUT/tuned.json" --out "$OUT/bench.json" --table > "$OUT/bench.log" 2>&1
echo "bench rc $? (${SECONDS}s)"; tail -20 "$OUT/bench.log"
