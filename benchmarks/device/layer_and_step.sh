#!/usr/bin/env bash
# One device call (nvidia-h200-x2), run at commit 7d9def7 (BENCHMARKS.md), after the bounded local buffer and
# the fused combine:
# 1. bench ep: allgather, one chunk, the bounded local buffer (default) and the worst-case one, random routing;
# 2. the training step at 4 x 4,096 tokens per GPU on one GPU, then two (step_one_and_two_gpus.sh).
set -u
here=$(dirname "$0")
timeout 150 python3 -m dropless.bench ep --table --iters 4 --strategies allgather --skews random \
  --traces "$OUT/traces" --out "$OUT/ep-bounded.json" > "$OUT/ep-bounded.log" 2>&1
echo "bounded rc $? (${SECONDS}s)"; grep "^|" "$OUT/ep-bounded.log"
timeout 110 python3 -m dropless.bench ep --table --iters 4 --strategies allgather --skews random \
  --out "$OUT/ep-worst.json" moe.local_buffer_factor=0 > "$OUT/ep-worst.log" 2>&1
echo "worst rc $? (${SECONDS}s)"; grep "^|" "$OUT/ep-worst.log"
tar czf "$OUT/traces.tgz" -C "$OUT" traces && rm -rf "$OUT/traces"
bash "$here/step_one_and_two_gpus.sh"
