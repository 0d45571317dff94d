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

The trace comes from the same lowering compiled without command buffers: kernels replayed inside a CUDA graph
carry no HLO instruction in the trace, and XLA reported exactly our grouped GEMMs (custom calls) missing from
the profile of the program with graphs. The recompiled program has command buffers as usual. Off the GPU there
are no CUDA graphs: the program as compiled is traced, without a second compilation.

On two H200s the MoE layer compiled this way is no faster than with XLA's default schedule, so nothing uses it
by default; it stays a benchmark variant (`bench ep --xla pgle`,
`bench step --pgle`, ladder variant `8:pgle`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax
from jax.experimental.profiler import get_profiled_instructions_proto

from dropless.bench.profile import PROFILE_COMPILER_OPTIONS

PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}
NOT_APPLIED = "not applied: the trace gave no instruction costs (PGLE needs an NVIDIA GPU)"


def instruction_costs(run: Callable[[], object], directory: Path) -> bytes:
    """Trace `run()` (a few calls of one program, blocking) and return XLA's profiled instruction costs."""
    directory = Path(directory)
    with jax.profiler.trace(str(directory)):
        jax.block_until_ready(run())
    runs = sorted(directory.glob("plugins/profile/*"))
    return get_profiled_instructions_proto(str(runs[-1])) if runs else b""


def profiled_options(lowered, run: Callable[[object], object], directory: Path, options: dict | None = None,
                     compiled=None) -> tuple[dict | None, str]:
    """-> (compiler options that schedule `lowered` by its own measured kernel costs, or None; a one-line status).

    `run(program)` runs a program of `lowered` a few times and returns its outputs. The costs file is written
    under `directory`, which must outlive every compilation with the options. Off the GPU there are no CUDA graphs
    to turn off: the trace runs `lowered` as compiled with `options` (`compiled`, where the caller has it)."""
    if jax.default_backend() == "gpu":
        traced = lowered.compile(compiler_options={**(options or {}), **PROFILE_COMPILER_OPTIONS})
    else:
        traced = compiled if compiled is not None else lowered.compile(compiler_options=options or None)
    costs = instruction_costs(lambda: run(traced), directory)
    if not costs:
        return None, NOT_APPLIED
    path = Path(directory) / "pgle_profile.pb"
    path.write_bytes(costs)
    with_costs = {**(options or {}), **OPTIONS, PROFILE_OPTION: str(path)}
    return with_costs, f"applied: {len(costs):,} bytes of instruction costs"


def recompile(lowered, compiled, run: Callable[[object], object], directory: Path, options: dict | None = None):
    """-> (the program to time, a one-line status): `lowered` compiled with `profiled_options`, or `compiled`
    (`lowered` compiled with `options`) when there are no costs."""
    with_costs, status = profiled_options(lowered, run, directory, options, compiled)
    return (compiled if with_costs is None else lowered.compile(compiler_options=with_costs)), status
