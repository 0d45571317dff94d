"""Multi-process start-up (`dropless.core.distributed`): the environment-to-arguments mapping of every launch
(dropless's own variables, SLURM, Open MPI, through JAX's own cluster detection), the timeouts, the peer watch's
decisions on a fake clock, and real CPU processes on localhost: a SLURM-style launch emulated on one host, and a
process SIGKILLed mid-run, after which the other exits with one line instead of hanging.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import jax
import pytest
from jax._src import clusters

from dropless.core import distributed
from dropless.core.config import ConfigError
from tests.test_train_parallel import ROOT, _free_port

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[007-008],big1", "SLURM_NTASKS": "16",
         "SLURM_PROCID": "9", "SLURM_LOCALID": "1"}
OMPI = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.7:44787", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}


def _jax_detects(monkeypatch, environ: dict, settings: dict) -> tuple:
    """What JAX's cluster detection makes of `environ` given dropless's `settings` (as jax.distributed.initialize
    calls it): (coordinator address, process count, process id, local device ids)."""
    for key in [*SLURM, *OMPI, "JAX_COORDINATOR_PORT"]:
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    return clusters.ClusterEnv.auto_detect_unset_distributed_params(
        settings.get("coordinator_address"), settings.get("num_processes"), settings.get("process_id"),
        settings.get("local_device_ids"), settings.get("cluster_detection_method"), 10)


def test_slurm_tasks_are_left_to_jax_cluster_detection_one_gpu_per_task(monkeypatch):
    settings = distributed.distributed_settings(SLURM)
    assert settings == {"local_device_ids": None}
    # the first node of the step's list, a port from the job id; the task's local id picks its GPU
    assert _jax_detects(monkeypatch, SLURM, settings) == (f"gpu007:{4242 % 4096 + 61440}", 16, 9, [1])
    assert _jax_detects(monkeypatch, {**SLURM, "JAX_COORDINATOR_PORT": "5000"}, settings)[0] == "gpu007:5000"
    several = distributed.distributed_settings({**SLURM, "DROPLESS_LOCAL_DEVICE_IDS": "4,5,6,7"})
    assert _jax_detects(monkeypatch, SLURM, several)[3] == [4, 5, 6, 7]
    assert distributed.distributed_settings({**SLURM, "SLURM_NTASKS": "1"}) is None  # srun of one task
    with pytest.raises(ConfigError, match="SLURM_NTASKS='x' must be an integer"):
        distributed.distributed_settings({**SLURM, "SLURM_NTASKS": "x"})


def test_open_mpi_ranks_are_left_to_jax_cluster_detection(monkeypatch):
    settings = distributed.distributed_settings(OMPI)
    assert settings == {"local_device_ids": None}
    assert _jax_detects(monkeypatch, OMPI, settings)[1:] == (4, 2, [0])
    assert distributed.distributed_settings({**OMPI, "OMPI_COMM_WORLD_SIZE": "1"}) is None


def test_dropless_variables_win_over_a_launcher_and_switch_its_detection_off(monkeypatch):
    own = {"DROPLESS_COORDINATOR": "10.0.0.1:4545", "DROPLESS_NUM_PROCESSES": "2", "DROPLESS_PROCESS_ID": "1"}
    settings = distributed.distributed_settings({**SLURM, **own})
    assert settings["cluster_detection_method"] == "deactivate" and settings["num_processes"] == 2
    assert _jax_detects(monkeypatch, SLURM, settings) == ("10.0.0.1:4545", 2, 1, None)


def test_timeouts_from_the_environment():
    assert distributed.timeouts({}) == {"peer": 60.0, "init": 300.0, "collective": 1800.0}
    assert distributed.timeouts({"DROPLESS_PEER_TIMEOUT": "5", "DROPLESS_COLLECTIVE_TIMEOUT": " 90.5 "}) == {
        "peer": 5.0, "init": 300.0, "collective": 90.5}
    for bad in ("0", "-3", "soon", "nan", "inf"):
        with pytest.raises(ConfigError, match=f"DROPLESS_PEER_TIMEOUT='{bad}' must be a number of seconds"):
            distributed.timeouts({"DROPLESS_PEER_TIMEOUT": bad})


def _watch(process_id: int = 0, processes: int = 3) -> distributed.PeerWatch:
    return distributed.PeerWatch(None, process_id, processes, timeout=10.0, clock=lambda: 0.0)


def test_peer_watch_names_the_process_that_went_silent_once_the_timeout_passed():
    watch = _watch()
    assert watch.check({0: "1", 1: "1", 2: "1"}, now=1.0) is None
    assert watch.check({0: "2", 1: "2", 2: "1"}, now=9.0) is None  # process 2 silent for 8 s of 10
    assert watch.check({0: "3", 1: "3", 2: "2"}, now=10.5) is None  # it beat again
    assert watch.check({0: "9", 1: "9", 2: "2"}, now=19.0) is None
    message = watch.check({0: "9", 1: "9", 2: "2"}, now=20.5)
    assert message.startswith("dropless: error: process 2 of 3 sent no sign of life for 10 s")
    assert "process 0 stops too" in message and "--resume" in message and "\n" not in message


def test_peer_watch_tells_an_exited_process_from_a_silent_one():
    watch = _watch(process_id=1, processes=2)
    assert watch.check({0: distributed._EXITED, 1: "4"}, now=1.0) is None  # the others may be exiting too
    assert "process 0 of 2 exited while this process still runs" in watch.check({0: "exited", 1: "5"}, now=11.0)


def test_peer_watch_counts_an_unanswering_store_as_the_coordinator_lost():
    watch = _watch(process_id=2)
    assert watch.check(None, now=1.0) is None
    assert watch.check({0: "1", 1: "1"}, now=5.0) is None  # it answered again: the count starts over
    assert watch.check(None, now=6.0) is None and watch.check(None, now=15.0) is None
    assert "process 0 of 3 stopped answering for 10 s (it hosts the run's coordination service" in (
        watch.check(None, now=16.0))
    coordinator = _watch(process_id=0)  # process 0 holds the store itself: it never counts itself lost
    assert coordinator.check(None, now=100.0) is None and coordinator.check(None, now=200.0) is None


def _launch(environs: list[dict], steps: int) -> list[subprocess.Popen]:
    base = {**os.environ, "JAX_PLATFORMS": "cpu", "DROPLESS_PEER_TIMEOUT": "3",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"}
    return [subprocess.Popen([sys.executable, "-m", "tests.distributed_worker", str(steps)], cwd=ROOT,
                             env={**base, **environ}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for environ in environs]


def _finish(workers: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each worker; a worker that has not ended after 120 s is killed (and the
    test fails on its status): the bound on a hang, not a measurement."""
    results = []
    for worker in workers:
        try:
            stdout, stderr = worker.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            worker.kill()
            stdout, stderr = worker.communicate()
        results.append((worker.returncode, stdout, stderr))
    return results


def test_a_slurm_launch_emulated_on_one_host_forms_one_run():
    """Two tasks with the variables srun sets (one node, localhost), JAX's own detection doing the rest."""
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
             "JAX_COORDINATOR_PORT": str(_free_port())}
    results = _finish(_launch([{**slurm, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)} for i in range(2)], 3))
    for i, (status, stdout, stderr) in enumerate(results):
        assert status == 0, stderr[-3000:]
        assert json.loads(stdout.splitlines()[-1]) == {"process": i, "processes": 2, "devices": 4}
        assert "step 2 " in stdout


def test_a_process_killed_mid_run_makes_the_other_exit_with_one_line_instead_of_hanging():
    """SIGKILL to process 1 after step 2: process 0, blocked in step 3's all-reduce, ends with EXIT_PROCESS_LOST and
    dropless's one line (the peer watch). (Losing process 0 takes JAX's coordination service with it, and JAX
    ends the others at once with its own fatal error: docs/parallelism.md.)"""
    victim = 1
    own = {"DROPLESS_COORDINATOR": f"127.0.0.1:{_free_port()}", "DROPLESS_NUM_PROCESSES": "2",
           "DIE_AT_PROCESS": str(victim)}
    results = _finish(_launch([{**own, "DROPLESS_PROCESS_ID": str(i)} for i in range(2)], 100_000))
    assert results[victim][0] == -signal.SIGKILL
    status, stdout, stderr = results[1 - victim]
    assert "step 2 " in stdout and status == distributed.EXIT_PROCESS_LOST, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("dropless:")]
    assert lines == [line for line in stderr.splitlines() if "error" in line.lower()], stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(
        f"dropless: error: process {victim} of 2 sent no sign of life for 3 s"), stderr[-3000:]
    assert "Traceback" not in stderr and "Check failure" not in stderr


def test_a_process_whose_peers_never_come_ends_in_one_line_at_the_start_up_deadline():
    alone = {"DROPLESS_COORDINATOR": f"127.0.0.1:{_free_port()}", "DROPLESS_NUM_PROCESSES": "2",
             "DROPLESS_PROCESS_ID": "1", "DROPLESS_INIT_TIMEOUT": "1"}
    ((status, stdout, stderr),) = _finish(_launch([alone], 3))
    assert status == distributed.EXIT_NOT_JOINED and stdout == "", stderr[-3000:]
    assert stderr.strip().splitlines() == [
        f"dropless: error: process 1 could not join the run's other processes at {alone['DROPLESS_COORDINATOR']} "
        "within DROPLESS_INIT_TIMEOUT=1 s; start every process with the same coordinator address and process count, "
        "and check that the coordinator's host and port are reachable."]


def test_a_signal_to_one_process_stops_both_at_the_same_agreed_step():
    """dropless train's stop signals across real processes: SIGTERM to process 1 alone after step 2 stops both at
    step 4, the next step where they agree (here every fourth), through the trainer's real all-gather. (Signals
    to several processes, the lowest-numbered one's winning, are tested with a faked all-gather in
    tests/test_train_faults.py, and so is the checkpoint the trainer writes at that step.)"""
    stop = "SIGTERM"
    own = {"DROPLESS_COORDINATOR": f"127.0.0.1:{_free_port()}", "DROPLESS_NUM_PROCESSES": "2",
           "SIGNALS": "1:SIGTERM:2"}
    for status, stdout, stderr in _finish(_launch([{**own, "DROPLESS_PROCESS_ID": str(i)} for i in range(2)], 100)):
        assert status == 0, stdout[-1000:] + stderr[-3000:]
        # gloo writes to the same stdout without newlines of its own: search, not split
        assert re.findall(r"stopped by (\w+) at step (\d+)\.", stdout) == [(stop, "4")], stdout


def test_a_failed_cross_process_collective_gets_one_line_and_other_errors_none(monkeypatch):
    monkeypatch.setenv("DROPLESS_COLLECTIVE_TIMEOUT", "90")
    timed_out = jax.errors.JaxRuntimeError("INTERNAL: Error dispatching computation: Gloo all-reduce failed: "
                                           "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 90000ms")
    assert distributed.collective_failure_message(timed_out, 0, 2) == (
        "dropless: error: process 0 of 2 waited DROPLESS_COLLECTIVE_TIMEOUT=90 s in a collective for another process, "
        "alive but stuck or far slower; look at the other processes' output, then start every process again (with "
        "--resume to continue from the last checkpoint).")
    broken = jax.errors.JaxRuntimeError("Gloo all-gather failed: Connection closed by peer [127.0.0.1]:4545")
    assert "lost a collective's connection to another process" in distributed.collective_failure_message(broken, 1, 2)
    assert distributed.collective_failure_message(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory"),
                                                  0, 2) is None
    assert distributed.collective_failure_message(ValueError("Gloo timed out"), 0, 2) is None
