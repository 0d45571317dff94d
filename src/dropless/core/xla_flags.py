"""XLA and JAX settings that dropless applies on GPUs, in one place.

`apply()` adds each flag below to the `XLA_FLAGS` environment variable unless that variable already names
the flag, and sets each variable of GPU_ENV_DEFAULTS that is not set: a value you set yourself always wins
(e.g. `XLA_FLAGS=--xla_gpu_..._decomposer=false`, `XLA_PYTHON_CLIENT_MEM_FRACTION=0.75`). XLA and JAX read
them once, when JAX first starts a backend, so `apply()` must run before anything touches devices:
`dropless.core.distributed.initialize()` and the benchmarks call it first thing. Set
`DROPLESS_XLA_FLAGS=0` to skip it entirely. The settings only concern GPUs; other backends ignore them.
"""

from __future__ import annotations

import os

GPU_XLA_FLAGS: dict[str, str] = {
    # jax.lax.ragged_all_to_all (moe.dispatch=ragged) with XLA's defaults moved 2.6 GB/s per GPU between two
    # H200s; decomposed into all_to_all + local copies it moved 63 GB/s (shared/facts/h200-measurements.md).
    "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer": "true",
}


GPU_ENV_DEFAULTS: dict[str, str] = {
    # JAX preallocates 75% of GPU memory by default, leaving 35 GiB of an H200 unused by XLA: the proxy's
    # naive ragged_dot step needed 109.7 GiB at 2,048 tokens against the 104.9 it got. 90% (125.8 GiB of an
    # H200) leaves ~14 GiB for the CUDA context, cuBLAS workspaces and NCCL buffers, which live outside it.
    "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9",
}


# The ladder's rung 7 (`dropless bench step --ladder`) tries each of these on top of the best program so far, as
# per-compile options (`Lowered.compile(compiler_options=...)`, the same settings as `--name=value` in
# XLA_FLAGS), keeps a flag only if it changed the compiled program or its step time and made the step faster,
# and records the verdicts in benchmarks/results/step-<device>.json. A flag joins GPU_XLA_FLAGS above only
# with such a measurement behind it.
SCHEDULING_CANDIDATES: dict[str, dict[str, bool | int | str]] = {
    # Schedules the program to overlap asynchronous collectives (and host offload copies) with compute.
    "latency_hiding_scheduler": {"xla_gpu_enable_latency_hiding_scheduler": True},
    # Unrolls the layer scan by two so that one layer's start can overlap the previous layer's end.
    "while_loop_double_buffering": {"xla_gpu_enable_while_loop_double_buffering": True},
    # Runs every kernel as its own launch instead of replaying CUDA graphs (command buffers): a check
    # that the default graphs help this step rather than hurt it.
    "no_command_buffers": {"xla_gpu_enable_command_buffer": ""},
    # Combines gradient all-reduces up to 256 MiB into one collective (multi-GPU only).
    "combine_all_reduce": {"xla_gpu_all_reduce_combine_threshold_bytes": 256 * 1024 * 1024},
    # Lets the scheduler keep two asynchronous collectives in flight at once (default one): the expert-parallel
    # layer's dispatch all-gather waited for nothing to overlap it while the next collective queued behind it.
    "parallel_collective_overlap": {"xla_gpu_experimental_parallel_collective_overlap_limit": 2},
    # The scheduler's cost of a collective from a speed-of-light model of the links instead of a fixed guess.
    "sol_latency_estimator": {"xla_gpu_enable_analytical_sol_latency_estimator": True},
}


def merged_flags(current: str, flags: dict[str, str] = GPU_XLA_FLAGS) -> str:
    """`current` (an XLA_FLAGS string) with every flag of `flags` it does not already set appended."""
    present = {token.split("=", 1)[0] for token in current.split()}
    added = [f"{name}={value}" for name, value in flags.items() if name not in present]
    return " ".join([current.strip(), *added]).strip()


def apply(environ: dict[str, str] | None = None) -> str:
    """Add dropless's GPU flags to XLA_FLAGS and its GPU_ENV_DEFAULTS to the environment (user settings win);
    returns the resulting XLA_FLAGS."""
    environ = os.environ if environ is None else environ
    if environ.get("DROPLESS_XLA_FLAGS", "1") == "0":
        return environ.get("XLA_FLAGS", "")
    for name, value in GPU_ENV_DEFAULTS.items():
        environ.setdefault(name, value)
    environ["XLA_FLAGS"] = merged_flags(environ.get("XLA_FLAGS", ""))
    return environ["XLA_FLAGS"]
