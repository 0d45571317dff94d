"""Multi-process (multi-host) start-up: one call to `initialize()` before anything touches devices.

Where the settings come from, first match wins:
1. `DROPLESS_COORDINATOR=host:port`, `DROPLESS_NUM_PROCESSES=N`, `DROPLESS_PROCESS_ID=i` (0..N-1), set by you
   for every process (e.g. one per host or one per GPU); optional `DROPLESS_LOCAL_DEVICE_IDS=0,1,...` limits a
   process to some of its host's accelerators (default: all of them).
2. SLURM (`srun`, more than one task) or Open MPI 4 (`mpirun`, more than one rank): JAX's own cluster detection
   reads the launcher's variables (SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST, SLURM_JOB_ID for the port;
   OMPI_COMM_WORLD_RANK/SIZE, the HNP URI) and gives each task one accelerator (local task i takes device i), so
   launch one task per GPU, or set `DROPLESS_LOCAL_DEVICE_IDS` to give a task several.
3. Otherwise: a single process, nothing to do.
Every process must run the same program with the same config; the mesh then spans all processes' devices.

A process that dies (killed, crashed, its host gone) must not leave the others hanging in a collective: each
process publishes a beat in the coordination service's key-value store, and a process that has heard nothing
from another for `DROPLESS_PEER_TIMEOUT` seconds prints one line naming it and exits with EXIT_PROCESS_LOST.
JAX's own heartbeat (which would end the process with a fatal log and a stack trace) is set to fire only later,
and `DROPLESS_COLLECTIVE_TIMEOUT` bounds a collective on CPU processes that waits for a live but stuck one.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time

import jax
from jax._src import distributed as jax_distributed  # its client: the coordination service's key-value store

from dropless.core import xla_flags
from dropless.core.config import ConfigError

_OWN_KEYS = ("DROPLESS_COORDINATOR", "DROPLESS_NUM_PROCESSES", "DROPLESS_PROCESS_ID")
_SLURM_KEYS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
# Open MPI before 5 (JAX detects Open MPI 5 only through mpi4py, opt-in: `cluster_detection_method="mpi4py"`).
_OMPI_KEYS = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")

# Seconds, as (environment variable, default). A peer's beat arrives every PEER_TIMEOUT/10 s; 60 s of silence
# outlasts any pause of a healthy process (a checkpoint save, a compile: the beat runs on its own thread).
TIMEOUTS = {"peer": ("DROPLESS_PEER_TIMEOUT", 60.0), "init": ("DROPLESS_INIT_TIMEOUT", 300.0),
            "collective": ("DROPLESS_COLLECTIVE_TIMEOUT", 1800.0)}
# The exit status of a process that lost another one of its run (a finished run: 0; a user error: 2; diverged: 3).
EXIT_PROCESS_LOST = 4
EXIT_NOT_JOINED = 2  # the processes never formed a run: a launch mistake, a user error's status
_BEAT_DIR = "dropless/beat/"
_EXITED = "exited"


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


def _launched_by(environ) -> str | None:
    """"slurm" or "ompi" when a launcher started several tasks (JAX's cluster detection then applies), else None."""
    if all(key in environ for key in _SLURM_KEYS) and _int(environ, "SLURM_NTASKS") > 1:
        return "slurm"
    if all(key in environ for key in _OMPI_KEYS) and _int(environ, "OMPI_COMM_WORLD_SIZE") > 1:
        return "ompi"
    return None


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
    if _launched_by(environ):
        return {"local_device_ids": _local_device_ids(environ)}
    return None


def timeouts(environ=None) -> dict[str, float]:
    """The seconds of `TIMEOUTS`, from the environment (validated) or their defaults."""
    environ = os.environ if environ is None else environ
    seconds = {}
    for name, (key, default) in TIMEOUTS.items():
        raw = environ.get(key, "").strip()
        try:
            value = float(raw) if raw else default
        except ValueError:
            value = float("nan")
        if not 1 <= value < 1e7:  # also refuses nan and inf
            raise ConfigError(f"{key}={raw!r} must be a number of seconds, at least 1 (default {default:g}).")
        seconds[name] = value
    return seconds


def initialize(environ=None) -> bool:
    """Apply dropless's XLA flags and, for a multi-process run, start `jax.distributed` and the peer watch.

    Returns True when this is a multi-process run. Call it once, before any JAX computation.
    """
    environ = os.environ if environ is None else environ
    settings = distributed_settings(environ)
    if settings is None:
        xla_flags.apply(environ)
        return False
    limits = timeouts(environ)
    # Read by XLA:CPU's cross-process (gloo) collectives; XLA:GPU's NCCL collectives have no such deadline,
    # there the peer watch alone ends a wait for a dead process.
    environ["XLA_FLAGS"] = xla_flags.merged_flags(
        environ.get("XLA_FLAGS", ""), {"--xla_cpu_collective_timeout_seconds": str(int(limits["collective"]))})
    xla_flags.apply(environ)
    if not jax.distributed.is_initialized():
        # JAX's own start-up deadline ends the process with a fatal log: this timer speaks first, in one line.
        where = settings.get("coordinator_address") or "the address JAX detected"
        late = threading.Timer(limits["init"], _exit_lost, [
            f"dropless: error: process {settings.get('process_id', environ.get('SLURM_PROCID', '?'))} could not "
            f"join the run's other processes at {where} within DROPLESS_INIT_TIMEOUT={limits['init']:g} s; start "
            "every process with the same coordinator address and process count, and check that the coordinator's "
            "host and port are reachable.", EXIT_NOT_JOINED])
        late.daemon = True
        late.start()
        try:
            jax.distributed.initialize(**settings, initialization_timeout=int(limits["init"]) + 10,
                                       # JAX's heartbeat ends a process with a fatal log: ours speaks first.
                                       heartbeat_timeout_seconds=int(2 * limits["peer"] + 10))
        finally:
            late.cancel()
        state = jax_distributed.global_state  # not jax.process_index(): that would start the backends already
        watch_peers(state.client, state.process_id, state.num_processes, limits["peer"])
        sys.excepthook = _one_line_for_collective_timeouts(sys.excepthook)
    return True


# ------------------------------------------------------------------------------------------------ peer watch

class PeerWatch:
    """Beats for this process and listens for the others' (a daemon thread, so it runs whatever the main thread
    waits in: a collective, a compile, a checkpoint save). `check` is the decision, apart from the clock and
    the store, so that it can be tested alone."""

    def __init__(self, client, process_id: int, num_processes: int, timeout: float, *, clock=time.monotonic,
                 lost=None):
        self.client, self.me, self.timeout, self.clock = client, process_id, timeout, clock
        self.lost = lost or _exit_lost
        self.interval = timeout / 10
        self.beats = 0
        now = clock()
        self.heard = {p: (None, now) for p in range(num_processes) if p != process_id}  # last value, when it changed
        self.unreachable_since: float | None = None
        self.stopped = threading.Event()

    def check(self, values: dict[int, str] | None, now: float) -> str | None:
        """The one line to exit with, or None: `values` are the peers' last beats (None: the store, i.e. process
        0's coordination service, did not answer)."""
        if values is None:
            self.unreachable_since = self.unreachable_since if self.unreachable_since is not None else now
            if now - self.unreachable_since >= self.timeout and self.me != 0:
                return self._message(0, f"stopped answering for {now - self.unreachable_since:.0f} s (it hosts "
                                        "the run's coordination service; killed, crashed, or its host went down)")
            return None
        self.unreachable_since = None
        for peer, (value, since) in self.heard.items():
            if values.get(peer) != value:
                self.heard[peer] = (values.get(peer), now)
            elif now - since >= self.timeout:
                why = ("exited while this process still runs" if value == _EXITED else
                       f"sent no sign of life for {now - since:.0f} s (killed, crashed, or its host went down)")
                return self._message(peer, why)
        return None

    def _message(self, peer: int, why: str) -> str:
        return (f"dropless: error: process {peer} of {len(self.heard) + 1} {why}; process {self.me} stops too. "
                f"Look at process {peer}'s output for the cause, then start every process again (with --resume "
                "to continue from the last checkpoint).")

    def beat(self) -> dict[int, str] | None:
        """Publish this process's next beat; the peers' last ones, or None if the store did not answer."""
        self.beats += 1
        try:
            self.client.key_value_set(f"{_BEAT_DIR}{self.me}", str(self.beats), allow_overwrite=True)
            return {int(key.rsplit("/", 1)[1]): value for key, value in self.client.key_value_dir_get(_BEAT_DIR)}
        except Exception:  # the coordination service's errors carry no type of their own
            return None

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            message = self.check(self.beat(), self.clock())
            if message and not self.stopped.is_set():
                self.lost(message)
                return

    def stop(self) -> None:
        """At a normal exit: stop listening and tell the others this process ended (see `check`)."""
        self.stopped.set()
        try:
            self.client.key_value_set(f"{_BEAT_DIR}{self.me}", _EXITED, allow_overwrite=True)
        except Exception:
            pass


def _exit_lost(message: str, status: int = EXIT_PROCESS_LOST) -> None:
    # os._exit: a normal exit would wait in jax.distributed's shutdown barrier for the lost process, then abort.
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)


def watch_peers(client, process_id: int, num_processes: int, timeout: float) -> PeerWatch:
    """Start the peer watch of this process; it stops at exit (before jax.distributed's own shutdown)."""
    watch = PeerWatch(client, process_id, num_processes, timeout)
    threading.Thread(target=watch.run, name="dropless-peer-watch", daemon=True).start()
    atexit.register(watch.stop)
    return watch


_COLLECTIVE_ERROR = re.compile(r"\b(gloo|nccl)\b", re.IGNORECASE)


def collective_failure_message(err: BaseException, process_id: int, num_processes: int) -> str | None:
    """The one line for a cross-process collective that failed (it waited past DROPLESS_COLLECTIVE_TIMEOUT, or
    its connection to another process broke), or None for any other exception."""
    text = str(err)
    if not (isinstance(err, jax.errors.JaxRuntimeError) and _COLLECTIVE_ERROR.search(text)):
        return None
    why = (f"waited DROPLESS_COLLECTIVE_TIMEOUT={timeouts()['collective']:g} s in a collective for another process, "
           "alive but stuck or far slower" if re.search(r"timed out|timeout", text, re.IGNORECASE)
           else "lost a collective's connection to another process, which probably died")
    return (f"dropless: error: process {process_id} of {num_processes} {why}; look at the other processes' output, "
            "then start every process again (with --resume to continue from the last checkpoint).")


def _one_line_for_collective_timeouts(previous):
    """sys.excepthook: `collective_failure_message`'s line and EXIT_PROCESS_LOST for a failed collective; other
    exceptions go to `previous`."""
    def hook(kind, err, tb):
        if message := collective_failure_message(err, jax.process_index(), jax.process_count()):
            _exit_lost(message)
        previous(kind, err, tb)
    return hook
