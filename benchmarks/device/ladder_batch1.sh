#!/usr/bin/env bash
# One device call (nvidia-h200): rungs 1-5 of the step ladder at one sequence of 2,048 tokens, so that rung 1
# (jax.lax.ragged_dot, which runs out of memory at 8,192 tokens) is measured in the same run as the best rung.
# Run from the repo root after the wheel install line of shared/device/prepare-wheels.sh; writes to $OUT.
set -u
timeout 580 python3 -m dropless.bench step --ladder --preset deepseek-v3-proxy --rungs 1,2,3,4,5 --out "$OUT" \
  --traces "$OUT/traces" --steps 5 --seconds 1.5 --budget 420 train.batch_size=1 train.seq_len=2048 \
  > "$OUT/ladder.log" 2>&1
echo "ladder rc $? (${SECONDS}s)"; tail -40 "$OUT/ladder.log"
