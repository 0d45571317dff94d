#!/usr/bin/env bash
# One device call (nvidia-h200-x2): the whole `dropless bench ep` (every strategy, random and skewed routing),
# each two-GPU program timed against the one-GPU layer in 11 alternating rounds; traces of every profiled
# program kept (tarred: the call brings back few files). Writes $OUT/ep-h200.json, $OUT/ep.log, $OUT/traces.tgz.
set -u
timeout 560 python3 -m dropless.bench ep --table --iters 11 --traces /tmp/tr --out "$OUT/ep-h200.json" "$@" \
  > "$OUT/ep.log" 2>&1
echo "ep rc $? (${SECONDS}s)"; grep "^|" "$OUT/ep.log"; tail -2 "$OUT/ep.log"
(cd /tmp && tar czf "$OUT/traces.tgz" tr)
