"""A training-like loop across processes, for tests/test_distributed.py: each step is one jitted program with a
cross-process all-reduce whose result the host reads, as `dropless train`'s logged steps do.

Run once per process as `python -m tests.distributed_worker STEPS`; it joins the run through
`dropless.core.distributed.initialize` (the DROPLESS_* or SLURM_* variables), prints `step i` after each step
and a last JSON line with what it saw. A process whose index is $DIE_AT_PROCESS SIGKILLs itself after step 2.
With $SIGNALS (`process:SIGNAL:step,...`) each named process sends itself that signal after that step, and the
processes stop as `dropless train` does (`dropless.train.loop`'s handlers and agreement), agreeing at every
fourth step, as at logged steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys

from dropless.core import distributed

if __name__ == "__main__":
    distributed.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rows = NamedSharding(mesh, P("data"))
    step = jax.jit(lambda x_B: jnp.mean(x_B) + x_B, out_shardings=rows)  # the mean is the all-reduce
    x_B = jax.make_array_from_process_local_data(rows, np.ones(jax.local_device_count(), np.float32),
                                                 (jax.device_count(),))
    me = jax.process_index()
    sends = {int(step): signal.Signals[name] for process, name, step in
             (entry.split(":") for entry in os.environ.get("SIGNALS", "").split(",") if entry) if int(process) == me}
    if "SIGNALS" in os.environ:  # the trainer's modules take seconds to import: only where they are tested
        from dropless.train import loop
    stop_signals = loop._StopSignals(("SIGTERM", "SIGINT", "SIGUSR1")) if "SIGNALS" in os.environ else None
    with stop_signals or contextlib.nullcontext():
        for i in range(int(sys.argv[1])):
            x_B = step(x_B)
            print(f"step {i} {float(x_B.addressable_shards[0].data[0]):.1f}", flush=True)
            if i == 2 and str(me) == os.environ.get("DIE_AT_PROCESS"):
                os.kill(os.getpid(), signal.SIGKILL)
            if i + 1 in sends:
                os.kill(os.getpid(), sends[i + 1])
            if stop_signals and (stopped_by := loop._agreed_stop(stop_signals.received, (i + 1) % 4 == 0)):
                print(f"stopped by {stopped_by} at step {i + 1}.", flush=True)
                break
    print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                      "devices": jax.device_count()}), flush=True)
