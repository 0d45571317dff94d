#!/usr/bin/env bash
# One device call (nvidia-h200-x2): rungs 2-5 and 8 of the step ladder at 4 x 2,048 tokens per GPU, with the
# grouped-GEMM table of the warp-specialised kernels (rung 1 runs out of memory at this batch; rungs 6 and 7 were
# measured in run E and are left out to fit one call). Writes to $OUT.
set -u
timeout 585 python3 -m dropless.bench step --ladder --preset deepseek-v3-proxy --rungs 2,3,4,5,8 --out "$OUT" \
  --traces "$OUT/traces" --steps 8 --seconds 2.5 --budget 430 train.batch_size=4 train.seq_len=2048 \
  > "$OUT/ladder.log" 2>&1
echo "ladder rc $? (${SECONDS}s)"; tail -45 "$OUT/ladder.log"; du -sh "$OUT"/* 
