#!/usr/bin/env bash
# MoE layer on two H200s (nvidia-h200-x2): the bounded local-expert buffer (moe.local_buffer_factor, default 1.25)
# against the worst-case buffer (0), allgather in 1 and 2 chunks, throughput timing (several calls per batch).
# Usage: local_buffer.sh [SKEWS]   (default: random). Writes $OUT/ep-bounded.json (+ traces.tgz), $OUT/ep-worst.json.
set -u
skews=${1:-random}
timeout 280 python3 -m dropless.bench ep --table --iters 4 --strategies allgather --chunks 1,2 --skews "$skews" \
  --traces "$OUT/traces" --out "$OUT/ep-bounded.json" > "$OUT/ep-bounded.log" 2>&1
echo "bounded rc $? (${SECONDS}s)"; grep "^|" "$OUT/ep-bounded.log"
timeout $((570 - SECONDS)) python3 -m dropless.bench ep --table --iters 4 --strategies allgather --chunks 1,2 \
  --skews "$skews" --out "$OUT/ep-worst.json" moe.local_buffer_factor=0 > "$OUT/ep-worst.log" 2>&1
echo "worst rc $? (${SECONDS}s)"; grep "^|" "$OUT/ep-worst.log"
tar czf "$OUT/traces.tgz" -C "$OUT" traces && rm -rf "$OUT/traces"
