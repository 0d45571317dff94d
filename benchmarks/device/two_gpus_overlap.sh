#!/usr/bin/env bash
# One device call (nvidia-h200-x2), two measurements:
# 1. rungs 5 and 8 of the step ladder at 4 x 2,048 tokens per GPU, after the embedding's gradient crosses devices
#    as rows and the lm_head's / shared experts' weight gradients as bf16 (run F's profile: two float32 940 MB
#    all-reduces per step);
# 2. the MoE layer alone (bench ep), allgather in 1 and 2 chunks, with XLA's default scheduler and with the
#    latency-hiding scheduler, random routing.
# Writes to $OUT.
set -u
timeout 300 python3 -m dropless.bench step --ladder --preset deepseek-v3-proxy --rungs 5,8 --out "$OUT" \
  --traces "$OUT/traces" --steps 8 --seconds 2.5 train.batch_size=4 train.seq_len=2048 > "$OUT/ladder.log" 2>&1
echo "ladder rc $? (${SECONDS}s)"; grep -E "^\| [58] |ok |Dense" "$OUT/ladder.log"
timeout $((580 - SECONDS)) python3 -m dropless.bench ep --table --iters 4 --strategies allgather --chunks 1,2 \
  --skews random --xla none,latency_hiding_scheduler --out "$OUT/ep.json" > "$OUT/ep.log" 2>&1
echo "ep rc $? (${SECONDS}s)"; tail -12 "$OUT/ep.log"
