"""XLA settings that dropless applies on GPUs, in one place.

`apply()` adds each flag below to the `XLA_FLAGS` environment variable unless that variable already names
the flag: a value you set yourself always wins (e.g. `XLA_FLAGS=--xla_gpu_..._decomposer=false`). XLA reads
`XLA_FLAGS` once, when JAX first starts a backend, so `apply()` must run before anything touches devices:
`dropless.parallel.distributed.initialize()` and the benchmarks call it first thing. Set
`DROPLESS_XLA_FLAGS=0` to skip it entirely. The flags only concern XLA:GPU; other backends ignore them.
"""

from __future__ import annotations

import os

GPU_XLA_FLAGS: dict[str, str] = {
    # jax.lax.ragged_all_to_all (moe.dispatch=ragged) with XLA's defaults moved 2.6 GB/s per GPU between two
    # H200s; decomposed into all_to_all + local copies it moved 63 GB/s (shared/facts/h200-measurements.md).
    "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer": "true",
}


def merged_flags(current: str, flags: dict[str, str] = GPU_XLA_FLAGS) -> str:
    """`current` (an XLA_FLAGS string) with every flag of `flags` it does not already set appended."""
    present = {token.split("=", 1)[0] for token in current.split()}
    added = [f"{name}={value}" for name, value in flags.items() if name not in present]
    return " ".join([current.strip(), *added]).strip()


def apply(environ: dict[str, str] | None = None) -> str:
    """Add dropless's GPU flags to XLA_FLAGS (user settings win); returns the resulting XLA_FLAGS."""
    environ = os.environ if environ is None else environ
    if environ.get("DROPLESS_XLA_FLAGS", "1") == "0":
        return environ.get("XLA_FLAGS", "")
    environ["XLA_FLAGS"] = merged_flags(environ.get("XLA_FLAGS", ""))
    return environ["XLA_FLAGS"]
