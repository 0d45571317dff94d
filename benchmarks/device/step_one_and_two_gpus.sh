#!/usr/bin/env bash
# One device call (nvidia-h200-x2): ladder rungs 5 and 8 as two plain `bench step` runs, back to back on one
# machine (the ladder's phases did not fit the call's limit on a cold machine): deepseek-v3-proxy, remat none,
# layers unrolled (rung 5's measured choice), 4 sequences per GPU at the preset's 4,096 tokens unless the
# arguments say otherwise (e.g. train.seq_len=2048); one GPU, then two with expert parallelism. Writes to $OUT.
# (The two calls of 2026-11-30, commit 7b180f1, ran a version that dropped the arguments and saved no JSON: both
# measured 4 x 4,096 tokens; benchmarks/results/step-h200-ep-seq4096.json transcribes their output.)
set -u
run() { timeout 190 python3 -m dropless.bench step --preset deepseek-v3-proxy --warmup 2 --steps 8 --seconds 2.5 \
  --record "$OUT/$1.json" train.remat=none train.scan_layers=false "${@:2}" 2>&1 | grep -v cuda_timer; }
CUDA_VISIBLE_DEVICES=0 run one-gpu train.batch_size=4 "$@" | sed 's/^/one GPU: /'
echo "(${SECONDS}s)"
run two-gpus train.batch_size=8 parallel.expert=2 "$@" | sed 's/^/two GPUs: /'
echo "(${SECONDS}s)"
