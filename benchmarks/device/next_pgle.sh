#!/usr/bin/env bash
# The next device call (nvidia-h200-x2), not yet run: does profile-guided latency estimation let XLA overlap the
# expert-parallel exchanges (and the gradient all-reduce) with our Pallas kernels?
# 1. bench ep: allgather in 1 and 2 chunks, compiled plainly and with PGLE (random routing);
# 2. ladder rungs 5 and 8 at 4 x 2,048 tokens per GPU (rung 8 now includes 8:pgle and the collective flags alone).
# Writes to $OUT.
set -u
timeout 260 python3 -m dropless.bench ep --table --iters 4 --strategies allgather --chunks 1,2 --skews random \
  --xla none,pgle --out "$OUT/ep.json" > "$OUT/ep.log" 2>&1
echo "ep rc $? (${SECONDS}s)"; tail -8 "$OUT/ep.log"
timeout $((585 - SECONDS)) python3 -m dropless.bench step --ladder --preset deepseek-v3-proxy --rungs 5,8 \
  --out "$OUT" --traces "$OUT/traces" --steps 8 --seconds 2.5 train.batch_size=4 train.seq_len=2048 \
  > "$OUT/ladder.log" 2>&1
echo "ladder rc $? (${SECONDS}s)"; grep -E "^\| [58] |ok |PGLE|Dense" "$OUT/ladder.log"
