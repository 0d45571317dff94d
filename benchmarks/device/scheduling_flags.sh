#!/usr/bin/env bash
# One device call (nvidia-h200-x2): the expert-parallel layer (default strategy, random routing) compiled with
# each XLA scheduling candidate that this XLA knows, each against the one-device layer compiled alike, timed in
# alternating rounds (`dropless bench ep`). Traces kept. Writes $OUT/ep-h200-flags.json, $OUT/flags.log.
set -u
known=$(python3 - <<'PY'
import jax, jax.numpy as jnp
from dropless.core.xla_flags import SCHEDULING_CANDIDATES
lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(4))
names = ["none"]
for name, options in SCHEDULING_CANDIDATES.items():
    try:
        lowered.compile(compiler_options=options)
        names.append(name)
    except Exception as error:  # an option this XLA does not have
        print(f"skipping {name}: {str(error).splitlines()[0][:160]}", flush=True, file=__import__("sys").stderr)
print(",".join(n for n in names if n not in ("no_command_buffers", "combine_all_reduce", "while_loop_double_buffering")))
PY
)
echo "candidates: $known"
timeout 420 python3 -m dropless.bench ep --table --iters 5 --strategies auto --skews random --xla "$known" \
  --out "$OUT/ep-h200-flags.json" --traces /tmp/tr "$@" > "$OUT/flags.log" 2>&1
echo "ep rc $? (${SECONDS}s)"; grep "^ep:\|^|" "$OUT/flags.log"; tail -3 "$OUT/flags.log"
(cd /tmp && tar czf "$OUT/traces.tgz" tr)
