"""Faults injected into the real `dropless train`, in subprocesses, each compared with one uninterrupted run of
the same config (the `reference` fixture, shared): SIGKILL at 3 seeded points (between steps and inside a
checkpoint save, both at exact places, and 1 at a seeded wall-clock delay), then SIGTERM and SIGINT at seeded
points (one while a checkpoint is being written), each followed by a restart, end exactly (`==`) where the
uninterrupted run ends; a learning rate that makes the loss non-finite stops the run with exit != 0, no checkpoint
with non-finite weights and the good one kept."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import pytest

from dropless.train import checkpoint as ckpt
from dropless.train import loop
from dropless.train.loop import TrainingDiverged
from dropless.train.metrics import read_metrics
from tests.filesystems import mounted_tmpfs
from tests.test_train import SMALL, write_corpus

ROOT = Path(__file__).resolve().parent.parent

# The CLI's train command, exiting with what train() reports (RunSummary.exit_status), whatever the CLI itself
# returns for a run that a signal stopped. With FAULT_KILL set, the process sends itself FAULT_SIGNAL (default
# SIGKILL) at one exact place, which a signal from outside would hit only by chance:
#   step:S      just after step S's metrics record is written, before any checkpoint of step S;
#   save:C:N    at the N-th metadata file orbax writes while saving checkpoint C (its temporary directory holds
#               the arrays, not yet renamed into place); orbax writes 12 here, all before the rename. A save that
#               wrote fewer would die just after returning, its checkpoint whole, and the test says so.
RUNNER = """
import os, signal, sys
import dropless.cli as cli
import dropless.train.loop as loop
summaries = []
def train(*args, **kwargs):
    summaries.append(loop.train(*args, **kwargs))
    return summaries[-1]
cli.train = train
fault = os.environ.get("FAULT_KILL")
if fault:
    kind, *at = fault.split(":")
    at = [int(n) for n in at]
    number = signal.Signals[os.environ.get("FAULT_SIGNAL", "SIGKILL")]
    die = lambda: os.kill(os.getpid(), number)
    if kind == "step":
        write = loop.metrics_lib.MetricsWriter.write
        def write_then_die(self, record):
            write(self, record)
            if record["step"] == at[0] and "loss" in record:
                die()
        loop.metrics_lib.MetricsWriter.write = write_then_die
    else:
        import etils.epath
        saving, writes, save = [], [0], loop.ckpt.save
        def watched_save(mngr, step, *args, **kwargs):
            saving.append(step)
            save(mngr, step, *args, **kwargs)
            if step == at[0] and number == signal.SIGKILL:
                die()
            saving.pop()
        loop.ckpt.save = watched_save
        for name in ("write_text", "write_bytes"):
            def counted(self, *args, _write=getattr(etils.epath.gpath.PosixGPath, name), **kwargs):
                if saving == [at[0]]:
                    writes[0] += 1
                    if writes[0] == at[1]:
                        die()
                return _write(self, *args, **kwargs)
            setattr(etils.epath.gpath.PosixGPath, name, counted)
status = cli.main(sys.argv[1:])
sys.exit(summaries[-1].exit_status if summaries and summaries[-1].exit_status else status)
"""

STEPS = 32
# The uninterrupted run checkpoints the steps the faulted run's checkpoints are compared at (10, 20, 30 and the
# last); no run here draws training.png, which none of these tests reads. The model is test_train.py's with one
# MoE layer and no dense one: what is tested here is the process (every start traces the step again), and the
# whole model's checkpoints and resumes are tested in test_train.py.
SETTINGS = {**SMALL, "model.num_layers": 1, "model.first_dense_layers": 0, "train.eval_every": 100,
            "train.checkpoint_every": 10, "train.keep_checkpoints": 10, "train.plot": False}


def _env(cache: Path, **extra: str) -> dict:
    # One compilation cache for every subprocess: the step compiles once, the later runs load it. One CPU device:
    # what is tested is the process (signals, kills, restarts), and a process starts ~30% faster than on the
    # suite's 8 virtual devices (sharded saves and restores are tested in test_train_checkpoint.py).
    xla_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
            "XLA_FLAGS": f"{xla_flags} --xla_force_host_platform_device_count=1".strip(),
            "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", **extra}


def _start(run_dir: Path, corpus: Path, cache: Path, *extra: str, steps: int = STEPS, settings: dict | None = None,
           env: dict | None = None) -> subprocess.Popen:
    options = [f"{key}={value}" for key, value in {**SETTINGS, **(settings or {})}.items()]
    command = [sys.executable, "-c", RUNNER, "train", "--run-dir", str(run_dir), "--data", str(corpus),
               "--steps", str(steps), "--no-progress", *extra, *options]
    return subprocess.Popen(command, cwd=ROOT, env=_env(cache, **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _signal_when(process: subprocess.Popen, ready, number: int, times: int = 1, delay: float = 0.0) -> str:
    """Send `number` to `process` `delay` seconds after `ready()` holds (`times` times, 20 ms apart); returns the
    process's output once it has ended."""
    while process.poll() is None and not ready():
        time.sleep(0.002)
    time.sleep(delay)
    for _ in range(times):
        if process.poll() is None:
            process.send_signal(number)
            time.sleep(0.02)
    output, _ = process.communicate(timeout=600)
    return output


def _stopped_at(output: str, name: str) -> int:
    found = re.findall(rf"dropless: stopped by {name} at step (\d+); checkpoint \1 written; resume with --resume",
                       output)
    assert len(found) == 1, output
    return int(found[0])


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


# run directory -> ((size, mtime) of its metrics.jsonl, the last step logged in it)
_LAST_LOGGED: dict[Path, tuple[tuple[int, int], int]] = {}


def _logged_steps(run_dir: Path) -> int:
    """The last step `run_dir` logged. Polled every 2 ms while a run trains: the file is parsed again only when
    its size or modification time has changed (parsing it each time took a third of a CPU core)."""
    try:
        stat = (run_dir / "metrics.jsonl").stat()
    except FileNotFoundError:
        return 0
    version = (stat.st_size, stat.st_mtime_ns)
    if run_dir not in _LAST_LOGGED or _LAST_LOGGED[run_dir][0] != version:
        _LAST_LOGGED[run_dir] = (version, max(_losses(run_dir), default=0))
    return _LAST_LOGGED[run_dir][1]


def _written_since(run_dir: Path, time_ns: int) -> bool:
    """RUN_DIR/metrics.jsonl was written (appended to, or replaced by a resumed run's trim) after `time_ns`."""
    try:
        return (run_dir / "metrics.jsonl").stat().st_mtime_ns > time_ns
    except FileNotFoundError:
        return False


def _weights(run_dir: Path, step: int | None = None) -> list[np.ndarray]:
    _, params, state = ckpt.load_model(run_dir, step)
    return [np.asarray(x) for x in jax.tree.leaves((params, state))]


@dataclass
class Reference:
    """The uninterrupted run every faulted run is compared with; it trains (in a subprocess) while the tests run
    theirs beside it."""
    root: Path
    corpus: Path
    cache: Path
    process: subprocess.Popen

    @property
    def run_dir(self) -> Path:
        return self.root / "full"

    def losses(self) -> dict[int, float]:
        if self.process.returncode is None:
            output, _ = self.process.communicate(timeout=600)
            assert self.process.returncode == 0, output
        return _losses(self.run_dir)

    def assert_same_run(self, run_dir: Path, steps: list[int]) -> None:
        """`run_dir` logged every step once and `==` the uninterrupted run, and its checkpoints of `steps` hold
        exactly its weights."""
        assert sorted(r["step"] for r in read_metrics(run_dir) if "loss" in r) == list(range(1, STEPS + 1))
        assert _losses(run_dir) == self.losses()  # bit for bit
        for step in steps:
            for got, want in zip(_weights(run_dir, step), _weights(self.run_dir, step), strict=True):
                np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(a directory for the runs, the corpus, the compilation cache every subprocess of this file shares)."""
    root = tmp_path_factory.mktemp("faults")
    (root / "corpus").mkdir()
    return root, write_corpus(root / "corpus"), root / "cache"


@pytest.fixture(scope="module")
def reference(workspace) -> Reference:
    root, corpus, cache = workspace
    process = _start(root / "full", corpus, cache)
    # The other runs start once it has logged a step: its compiled evaluation and step are in the shared cache
    # then, and they load them instead of compiling the same programs beside it.
    while process.poll() is None and _logged_steps(root / "full") < 1:
        time.sleep(0.05)
    return Reference(root, corpus, cache, process)


# The SIGKILL test checkpoints every 2 steps (a setting that changes no loss), so that kills land in many saves.
KILL_SETTINGS = {"train.checkpoint_every": 2, "train.keep_checkpoints": 20}
KILLS = ["step", "save", "wall"]


def test_sigkill_at_seeded_points_and_stop_signals_each_resumed_exactly(reference):
    """One run SIGKILLed 3 times (between steps, inside a save, at a wall-clock delay; in a seeded order), each
    followed by a restart: `--resume` from its newest checkpoint, or, before the first one, the same command
    again; then stopped by SIGTERM (sent twice) at a seeded step and by SIGINT during a checkpoint save, each
    resumed. Each killed part's logged losses are compared when it dies, the whole run and its checkpoints at the
    end."""
    corpus, cache, run = reference.corpus, reference.cache, reference.root / "killed"
    rng = random.Random(1020)  # its plan ends with the save, past checkpoint 2: the stop signals below resume it
    kills = rng.sample(KILLS, len(KILLS))
    start, landed = 0, []
    for kind in kills:
        every = KILL_SETTINGS["train.checkpoint_every"]
        resume = ["--resume"] if start else []
        if kind == "step":  # between steps, after the record of step `at`, before any checkpoint of it
            at = start + rng.randint(1, 2)
            point = f"step:{at}"
        elif kind == "save":  # inside the save of checkpoint `at`, at one of the files it writes
            at = (start // every + rng.randint(1, 2)) * every
            point = f"save:{at}:{rng.randint(1, 12)}"  # orbax 0.12 writes 12, the last just before the rename
        else:  # a wall-clock delay after step `at` was logged: anywhere in a step, a save or a metrics write
            at, delay = start + 1, rng.uniform(0.0, 0.03)
            point = f"wall:{at}+{delay * 1e3:.0f}ms"
        assert at < STEPS, (point, landed)  # the seeded plan fits the run
        env = {} if kind == "wall" else {"FAULT_KILL": point}
        launched = time.time_ns()
        process = _start(run, corpus, cache, *resume, settings=KILL_SETTINGS, env=env)
        if kind == "wall":  # the step logged by this process: until it trims the file, the old part's records show
            output = _signal_when(process, lambda: _written_since(run, launched) and _logged_steps(run) >= at,
                                  signal.SIGKILL, delay=delay)
        else:
            output, _ = process.communicate(timeout=600)
        assert process.returncode == -signal.SIGKILL, (point, output)
        part = {step: loss for step, loss in _losses(run).items() if step > start}  # what this part computed
        assert part and max(part) >= at, (point, part)
        want = reference.losses()
        assert part == {step: want[step] for step in part}, point  # bit for bit
        landed.append(point)
        start = ckpt.latest_step(run) or 0
        if kind == "save":  # it died inside that save: the checkpoint of `at` never became one, the one before did
            assert start == at - every, (point, start)
    # SIGTERM at a seeded step, twice: the second one, while stopping, changes nothing.
    at = start + random.Random(19).randrange(2, 5)
    launched = time.time_ns()
    stopped = _start(run, corpus, cache, "--resume", settings=KILL_SETTINGS)
    output = _signal_when(stopped, lambda: _written_since(run, launched) and _logged_steps(run) >= at,
                          signal.SIGTERM, times=2)
    assert stopped.returncode == 143, output
    first_stop = _stopped_at(output, "SIGTERM")
    assert ckpt.latest_step(run) == first_stop and "Traceback" not in output
    # SIGINT while a checkpoint is being written, at a seeded one of its files: the save finishes and the run
    # stops after it, with that checkpoint.
    every = KILL_SETTINGS["train.checkpoint_every"]
    during = (first_stop // every + 1) * every
    resumed = _start(run, corpus, cache, "--resume", settings=KILL_SETTINGS,
                     env={"FAULT_KILL": f"save:{during}:{random.Random(23).randint(1, 12)}", "FAULT_SIGNAL": "SIGINT"})
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 130, output
    second_stop = _stopped_at(output, "SIGINT")
    assert second_stop == during < STEPS and ckpt.latest_step(run) == during, output
    last = _start(run, corpus, cache, "--resume", settings=KILL_SETTINGS)
    output, _ = last.communicate(timeout=600)
    assert last.returncode == 0, output
    reference.assert_same_run(run, [10, 20, 30, STEPS])


@pytest.fixture
def tmpfs(tmp_path):
    yield from mounted_tmpfs(tmp_path / "tmpfs", "16m", "test_train_checkpoint.py injects the write errors")


def _fill(mount: Path, leave_bytes: int) -> Path:
    """A file that leaves about `leave_bytes` free on `mount`."""
    stats = os.statvfs(mount)
    fill = mount / "fill"
    size = (fill.stat().st_size if fill.exists() else 0) + stats.f_bavail * stats.f_frsize - leave_bytes
    with fill.open("wb") as f:
        f.truncate(0)
        f.write(b"\0" * max(size, 0))
    return fill


def test_a_full_disk_stops_the_run_with_one_line_and_it_resumes_exactly(reference, tmpfs):
    """The real command on a real full filesystem (a tmpfs), resuming a copy of the uninterrupted run without its
    checkpoints after 20 (whose later metrics records a resumed run trims): with no space at all the resumed run
    stops at its first write (the metrics file), and with a little space at the next checkpoint; each time one line, exit 2, in
    seconds (a TensorBoard writer thread that died with the disk used to block the loop for good). After space is
    freed `--resume` ends exactly where the uninterrupted run ends."""
    corpus, cache, run = reference.corpus, reference.cache, tmpfs / "run"
    reference.losses()  # it has ended: its run directory, as if it had stopped after checkpoint 20
    shutil.copytree(reference.run_dir, run, ignore=lambda directory, names: {"30", str(STEPS)} & set(names)
                    if Path(directory) == ckpt.checkpoint_dir(reference.run_dir) else set())
    for leave, expected in ((0, f"dropless: error: {run}/metrics.jsonl: no space left on device; "),
                            (200_000, f"dropless: error: could not write checkpoint 30 to {run}/checkpoints: No "
                                      "space left on device; free space and resume with --resume.")):
        fill = _fill(tmpfs, leave)
        process = _start(run, corpus, cache, "--resume")
        output, _ = process.communicate(timeout=120)  # a blocked loop would hang here
        lines = [line for line in output.splitlines() if not line.startswith("dropless: ") or "error" in line]
        assert process.returncode == 2 and output.rstrip().splitlines()[-1].startswith(expected), output
        assert lines == [output.rstrip().splitlines()[-1]], output  # nothing else: no traceback, no library log
        assert ckpt.latest_step(run) == 20
    fill.unlink()
    process = _start(run, corpus, cache, "--resume")
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    reference.assert_same_run(run, [20, 30, STEPS])


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(workspace):
    """The real command on one device, as the faulted runs above (what is tested is the loop's guard, not the mesh):
    TrainingDiverged ends it with its exit status and one line."""
    root, corpus, cache = workspace
    run = root / "diverged"
    # Warm-up to a learning rate that blows the weights up after step 2: every later step's loss is non-finite.
    process = _start(run, corpus, cache, steps=12, settings={
        "train.checkpoint_every": 2, "train.keep_checkpoints": 2, "train.learning_rate": 1e30,
        "train.max_nonfinite_steps": 3})
    output, _ = process.communicate(timeout=600)
    assert process.returncode == TrainingDiverged.exit_status == 3, output
    last_line = output.rstrip().splitlines()[-1]
    assert last_line.startswith("dropless: error: Training diverged: ") and "Traceback" not in output, output
    message = last_line.removeprefix("dropless: error: ")  # one line: a message with a newline would end otherwise
    records = [r for r in read_metrics(run) if "loss" in r]
    bad = [r["step"] for r in records if r["nonfinite"]]
    assert bad and all(r["nonfinite"] == 0 for r in records if r["step"] < bad[0]), records
    last_good = ckpt.latest_step(run)
    assert f"not finite at steps {bad[0]}-{bad[0] + 2}" in message, message
    assert f"the last good checkpoint is step {last_good} " in message, message
    assert last_good <= bad[0] + 2
    with ckpt.manager(run, read_only=True) as mngr:
        kept = sorted(mngr.all_steps())
    for step in kept:
        assert all(np.isfinite(w).all() for w in _weights(run, step)), step
    # A skipped step leaves the weights as they were: every checkpoint from the last applied step on holds them.
    frozen = [_weights(run, step) for step in kept if step >= bad[0] - 1]
    assert len(frozen) == 2, (kept, bad)
    for a, b in zip(*frozen):
        np.testing.assert_array_equal(a, b)


def test_processes_agree_on_one_stop_signal_at_steps_where_the_host_waits(monkeypatch):
    """With several processes a signal reaches some of them (or each a different one): at a step where the host
    reads from the device anyway, one all-gather makes every process stop with the lowest-numbered process's
    signal; at other steps nobody stops (no extra host sync). The all-gather is faked here; tests/test_train_parallel
    runs real processes."""
    gathered = np.array([0, int(signal.SIGUSR1), 0, int(signal.SIGTERM)], np.int32)
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(loop.multihost_utils, "process_allgather", lambda x: gathered)
    assert loop._agreed_stop(None, host_waits=True) == "SIGUSR1"  # process 0 saw nothing, still stops
    assert loop._agreed_stop("SIGTERM", host_waits=False) is None  # not a step where the host waits
    gathered[:] = 0
    assert loop._agreed_stop(None, host_waits=True) is None
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert loop._agreed_stop("SIGINT", host_waits=False) == "SIGINT"  # one process stops at once


def test_the_nonfinite_guard_counts_steps_in_a_row_across_its_checks(tmp_path):
    """A finite step ends a streak; a streak goes on from one check to the next; the limit itself stops the run."""
    guard = loop._NonfiniteGuard(3)
    for flag in (True, True, False, True):
        guard.add(np.bool_(flag))
    guard.check(4, None, tmp_path)
    guard.add(np.bool_(True))
    guard.check(5, 4, tmp_path)
    guard.add(np.bool_(True))
    with pytest.raises(TrainingDiverged, match=r"not finite at steps 4-6 \(3 in a row.*the last good checkpoint is "
                                               r"step 4 in "):
        guard.check(6, 4, tmp_path)


def test_a_loss_not_finite_from_the_first_step_is_not_blamed_on_the_learning_rate(tmp_path):
    """Step 1's loss and gradients come before any update: a streak from there is the model's settings or the
    data, and the one line says so instead of advising a lower learning rate."""
    guard = loop._NonfiniteGuard(2)
    for _ in range(2):
        guard.add(np.bool_(True))
    with pytest.raises(TrainingDiverged, match=r"not finite from step 1, before any update was applied \(2 steps in "
                                               r"a row.*the learning rate is not the cause; check the model's settings"):
        guard.check(2, None, tmp_path)
