"""Profile-guided latency estimation (PGLE) for the benchmarks' ahead-of-time compiled programs.

XLA's latency-hiding scheduler decides which asynchronous collectives to overlap with which kernels from a cost
model, and our grouped GEMMs and flash attention are custom calls it cannot cost. On two H200s neither the
scheduler alone nor dispatch chunks overlapped anything (BENCHMARKS.md, expert parallelism). PGLE gives the
scheduler measured costs: run the compiled program under the profiler, turn the trace into XLA's
ProfiledInstructionsProto (`jax.experimental.profiler.get_profiled_instructions_proto`), and compile the same
lowering again with that file (`xla_gpu_pgle_profile_file_or_directory_path`) and the scheduler on. This is JAX's
manual PGLE workflow (docs.jax.dev, "GPU performance tips") for programs compiled with `Lowered.compile`;
`jax_enable_pgle` does the same for `jax.jit` calls. Only NVIDIA GPUs produce the costs; elsewhere the program
is kept as it was and the status says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}
NOT_APPLIED = "not applied: the trace gave no instruction costs (PGLE needs an NVIDIA GPU)"


def instruction_costs(run: Callable[[], object], directory: Path) -> bytes:
    """Trace `run()` (a few calls of one program, blocking) and return XLA's profiled instruction costs."""
    import jax
    from jax.experimental.profiler import get_profiled_instructions_proto

    directory = Path(directory)
    with jax.profiler.trace(str(directory)):
        jax.block_until_ready(run())
    runs = sorted(directory.glob("plugins/profile/*"))
    return get_profiled_instructions_proto(str(runs[-1])) if runs else b""


def compile_with_costs(lowered, costs: bytes, directory: Path, options: dict | None = None):
    """`lowered` compiled again with the latency-hiding scheduler reading `costs` (saved under `directory`)."""
    path = Path(directory) / "pgle_profile.pb"
    path.write_bytes(costs)
    return lowered.compile(compiler_options={**(options or {}), **OPTIONS, PROFILE_OPTION: str(path)})


def recompile(lowered, compiled, run: Callable[[object], object], directory: Path, options: dict | None = None):
    """-> (the program to time, a one-line status). `run(program)` runs it a few times and returns its outputs."""
    costs = instruction_costs(lambda: run(compiled), directory)
    if not costs:
        return compiled, NOT_APPLIED
    return compile_with_costs(lowered, costs, directory, options), f"applied: {len(costs):,} bytes of instruction costs"
