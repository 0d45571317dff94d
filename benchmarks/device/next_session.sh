#!/usr/bin/env bash
# The next device call (nvidia-h200-x2), not yet run: measures commit 3e04eab and later, where the experts'
# GEMMs leave their padding rows unwritten (no zeroing pass inside the bounded buffer's lax.cond; estimated
# -2.2 ms of the two-GPU layer from the traces of 7d9def7) and ragged's collective buffers vary like their rows.
# 1. the whole `bench ep` (every strategy, random and skewed routing), traces of the default strategy kept;
# 2. the training step at 4 x 4,096 tokens per GPU on one GPU, then two (step_one_and_two_gpus.sh).
set -u
here=$(dirname "$0")
timeout 560 python3 -m dropless.bench ep --table --iters 11 --traces /tmp/tr --out "$OUT/ep-h200.json" > "$OUT/ep.log" 2>&1
echo "ep rc $? (${SECONDS}s)"; grep "^|" "$OUT/ep.log"
bash "$here/step_one_and_two_gpus.sh"
