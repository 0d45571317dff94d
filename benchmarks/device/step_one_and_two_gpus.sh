#!/usr/bin/env bash
# One device call (nvidia-h200-x2): ladder rungs 5 and 8 as two plain `bench step` runs, back to back on one
# machine (the ladder's phases did not fit the call's limit on a cold machine): deepseek-v3-proxy, remat none,
# layers unrolled (rung 5's measured choice), 4 x 2,048 tokens per GPU; one GPU, then two with expert parallelism.
set -u
run() { timeout 190 python3 -m dropless.bench step --preset deepseek-v3-proxy --warmup 2 --steps 8 --seconds 2.5 \
  train.remat=none train.scan_layers=false "$@" 2>&1 | grep -v cuda_timer; }
CUDA_VISIBLE_DEVICES=0 run train.batch_size=4 | sed 's/^/one GPU: /'
echo "(${SECONDS}s)"
run train.batch_size=8 parallel.expert=2 | sed 's/^/two GPUs: /'
echo "(${SECONDS}s)"
