"""Faults injected into the real `dropless train`, in subprocesses: SIGTERM and SIGINT at seeded points (one while
a checkpoint is being written), each followed by --resume, end exactly where an uninterrupted run ends; a
learning rate that makes the loss non-finite stops the run with exit != 0, no checkpoint with non-finite weights
and the good one kept."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dropless.train import checkpoint as ckpt
from dropless.train.loop import TrainingDiverged, train
from dropless.train.metrics import read_metrics
from tests.test_train import SMALL, small_config, write_corpus

ROOT = Path(__file__).resolve().parent.parent

# The CLI's train command, exiting with what train() reports (RunSummary.exit_status), whatever the CLI itself
# returns for a run that a signal stopped.
RUNNER = """
import sys
import dropless.cli as cli
import dropless.train.loop as loop
summaries = []
def train(*args, **kwargs):
    summaries.append(loop.train(*args, **kwargs))
    return summaries[-1]
cli.train = train
status = cli.main(sys.argv[1:])
sys.exit(summaries[-1].exit_status if summaries and summaries[-1].exit_status else status)
"""

STEPS = 24
OPTIONS = [f"{key}={value}" for key, value in {**SMALL, "train.eval_every": 100, "train.checkpoint_every": 5,
                                               "train.keep_checkpoints": 10}.items()]


def _env(cache: Path) -> dict:
    # One compilation cache for every subprocess: the step compiles once, the later runs load it.
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
            "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _start(run_dir: Path, corpus: Path, cache: Path, *extra: str, steps: int = STEPS) -> subprocess.Popen:
    command = [sys.executable, "-c", RUNNER, "train", "--run-dir", str(run_dir), "--data", str(corpus),
               "--steps", str(steps), "--no-progress", *extra, *OPTIONS]
    return subprocess.Popen(command, cwd=ROOT, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _signal_when(process: subprocess.Popen, ready, number: int, times: int = 1) -> str:
    """Send `number` to `process` once `ready()` holds (`times` times, 20 ms apart); returns the process's
    output once it has ended."""
    while process.poll() is None and not ready():
        time.sleep(0.002)
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


def _logged_steps(run_dir: Path) -> int:
    return max((r["step"] for r in read_metrics(run_dir) if "loss" in r), default=0)


def _saving(run_dir: Path) -> bool:
    """An orbax checkpoint being written: its temporary directory exists."""
    directory = run_dir / "checkpoints"
    return directory.is_dir() and any("tmp" in p.name for p in directory.iterdir())


def _weights(run_dir: Path, step: int | None = None) -> list[np.ndarray]:
    _, params, state = ckpt.load_model(run_dir, step)
    return [np.asarray(x) for x in jax.tree.leaves((params, state))]


def test_signals_stop_with_a_checkpoint_and_resume_exactly(tmp_path):
    (tmp_path / "corpus").mkdir()
    corpus, cache = write_corpus(tmp_path / "corpus"), tmp_path / "cache"
    rng = random.Random(19)
    full = _start(tmp_path / "full", corpus, cache)  # the uninterrupted run, beside the first part of the split one
    run = tmp_path / "split"
    # SIGTERM at a seeded step of a fresh run, twice: the second one, while stopping, changes nothing.
    at = rng.randrange(2, 9)
    fresh = _start(run, corpus, cache)
    output = _signal_when(fresh, lambda: _logged_steps(run) >= at, signal.SIGTERM, times=2)
    assert fresh.returncode == 143, output
    first_stop = _stopped_at(output, "SIGTERM")
    assert full.wait(timeout=600) == 0, full.communicate()[0]
    assert ckpt.latest_step(run) == first_stop
    assert "Traceback" not in output
    # SIGINT while a checkpoint is being written (or, should no save be caught in the act, a few steps on): the
    # save finishes and the run stops after it.
    resumed = _start(run, corpus, cache, "--resume")
    output = _signal_when(resumed, lambda: _logged_steps(run) > first_stop and _saving(run)
                          or _logged_steps(run) >= first_stop + 8, signal.SIGINT)
    assert resumed.returncode == 130, output
    second_stop = _stopped_at(output, "SIGINT")
    assert first_stop < second_stop < STEPS and ckpt.latest_step(run) == second_stop
    last = _start(run, corpus, cache, "--resume")
    output, _ = last.communicate(timeout=600)
    assert last.returncode == 0, output

    losses = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    want = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "full") if "loss" in r}
    assert sorted(r["step"] for r in read_metrics(run) if "loss" in r) == list(range(1, STEPS + 1))  # each once
    assert losses == want  # bit for bit
    for got, expected in zip(_weights(run), _weights(tmp_path / "full")):
        np.testing.assert_array_equal(got, expected)


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(tmp_path):
    (tmp_path / "corpus").mkdir()
    # Warm-up to a learning rate that blows the weights up after step 2: every later step's loss is non-finite.
    config = small_config(write_corpus(tmp_path / "corpus"), **{
        "train.steps": 12, "train.eval_every": 100, "train.checkpoint_every": 2, "train.keep_checkpoints": 2,
        "train.learning_rate": 1e30, "train.max_nonfinite_steps": 3})
    lines = []
    with pytest.raises(TrainingDiverged) as caught:
        train(config, tmp_path / "run", progress=False, log=lines.append)
    message = str(caught.value)
    assert caught.value.exit_status == 3 and "\n" not in message, message
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    bad = [r["step"] for r in records if r["nonfinite"]]
    assert bad and all(r["nonfinite"] == 0 for r in records if r["step"] < bad[0]), records
    last_good = ckpt.latest_step(tmp_path / "run")
    assert f"not finite at steps {bad[0]}-{bad[0] + 2}" in message, message
    assert f"the last good checkpoint is step {last_good} " in message, message
    assert last_good <= bad[0] + 2
    with ckpt.manager(tmp_path / "run", read_only=True) as mngr:
        kept = sorted(mngr.all_steps())
    for step in kept:
        assert all(np.isfinite(w).all() for w in _weights(tmp_path / "run", step)), step
    # A skipped step leaves the weights as they were: every checkpoint from the last applied step on holds them.
    frozen = [_weights(tmp_path / "run", step) for step in kept if step >= bad[0] - 1]
    assert len(frozen) == 2, (kept, bad)
    for a, b in zip(*frozen):
        np.testing.assert_array_equal(a, b)
