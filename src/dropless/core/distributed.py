"""Multi-process (multi-host) start-up: one call to `initialize()` before anything touches devices.

Where the settings come from, first match wins:
1. `DROPLESS_COORDINATOR=host:port`, `DROPLESS_NUM_PROCESSES=N`, `DROPLESS_PROCESS_ID=i` (0..N-1), set by you
   for every process (e.g. one per host); optional `DROPLESS_LOCAL_DEVICE_IDS=0,1,...` limits a process to
   some of its host's accelerators (default: all of them).
2. SLURM (`srun`, more than one task): JAX reads SLURM's variables itself; it then gives each task one
   accelerator (task `SLURM_LOCALID` takes device `SLURM_LOCALID`), so launch one task per GPU, or set
   `DROPLESS_LOCAL_DEVICE_IDS` to give a task several.
3. Otherwise: a single process, nothing to do.
Every process must run the same program with the same config; the mesh then spans all processes' devices.
"""

from __future__ import annotations

import os

import jax

from dropless.core import xla_flags
from dropless.core.config import ConfigError

_OWN_KEYS = ("DROPLESS_COORDINATOR", "DROPLESS_NUM_PROCESSES", "DROPLESS_PROCESS_ID")
_SLURM_KEYS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def _int(environ, key: str) -> int:
    try:
        return int(environ[key])
    except ValueError:
        raise ConfigError(f"{key}={environ[key]!r} must be an integer.") from None


def _local_device_ids(environ) -> list[int] | None:
    raw = environ.get("DROPLESS_LOCAL_DEVICE_IDS", "").strip()
    if not raw:
        return None
    try:
        return [int(part) for part in raw.split(",")]
    except ValueError:
        raise ConfigError(f"DROPLESS_LOCAL_DEVICE_IDS={raw!r} must be a comma-separated list of device numbers, "
                          f"like 0,1,2,3.") from None


def distributed_settings(environ=None) -> dict | None:
    """The keyword arguments for `jax.distributed.initialize`, or None for a single process."""
    environ = os.environ if environ is None else environ
    given = [key for key in _OWN_KEYS if environ.get(key)]
    if given:
        missing = [key for key in _OWN_KEYS if not environ.get(key)]
        if missing:
            raise ConfigError(f"{', '.join(given)} set but {', '.join(missing)} missing; set all three of "
                              f"{', '.join(_OWN_KEYS)} for every process.")
        num_processes, process_id = _int(environ, "DROPLESS_NUM_PROCESSES"), _int(environ, "DROPLESS_PROCESS_ID")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ConfigError(f"DROPLESS_PROCESS_ID={process_id} must be in 0..DROPLESS_NUM_PROCESSES-1 "
                              f"(DROPLESS_NUM_PROCESSES={num_processes}).")
        if num_processes == 1:
            return None
        # "deactivate": our variables are the whole truth, even inside a SLURM allocation.
        return {"coordinator_address": environ["DROPLESS_COORDINATOR"], "num_processes": num_processes,
                "process_id": process_id, "local_device_ids": _local_device_ids(environ),
                "cluster_detection_method": "deactivate"}
    if all(key in environ for key in _SLURM_KEYS) and _int(environ, "SLURM_NTASKS") > 1:
        return {"local_device_ids": _local_device_ids(environ)}
    return None


def initialize(environ=None) -> bool:
    """Apply dropless's XLA flags and, for a multi-process run, start `jax.distributed`.

    Returns True when this is a multi-process run. Call it once, before any JAX computation.
    """
    xla_flags.apply()
    settings = distributed_settings(environ)
    if settings is None:
        return False
    if not jax.distributed.is_initialized():
        jax.distributed.initialize(**settings)
    return True
