#!/usr/bin/env bash
# One device call (nvidia-h200-x2): the expert-parallel layer (default strategy, random routing, 11 alternating
# rounds against the one-GPU layer) with NCCL's default channel count and with 32 channels
# (NCCL_MIN_NCHANNELS=32: 8% more all-gather bandwidth in isolation, benchmarks/device/nccl_settings.sh), one
# process each. Writes $OUT/ep-h200-nccl-{default,channels32}.json and their logs.
set -u
run() { local label=$1; shift
  env "$@" timeout 270 python3 -m dropless.bench ep --table --iters 11 --strategies auto --skews random \
    --out "$OUT/ep-h200-nccl-$label.json" > "$OUT/ep-nccl-$label.log" 2>&1
  echo "$label: rc $? (${SECONDS}s)"; grep "^ep: 2\|^| auto" "$OUT/ep-nccl-$label.log"; }
run default
run channels32 NCCL_MIN_NCHANNELS=32
