"""One trainer per run directory: a second one, --overwrite included, is refused in one line; the lock dies
with its holder, however it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dropless.train import run_lock
from dropless.train.loop import train
from tests.test_cli import assert_user_error, run_cli
from tests.test_train import SMALL, corpus, small_config  # noqa: F401 (corpus is a fixture)

HOLDER = ("import sys, time; from dropless.train import run_lock\n"
          "with run_lock.hold(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)")


def test_a_second_trainer_is_refused_until_the_holder_dies(tmp_path, corpus):
    run_dir = tmp_path / "run"
    config = small_config(corpus, **{"train.steps": 1, "train.eval_every": 100, "train.checkpoint_every": 1})
    train(config, run_dir, progress=False, log=lambda s: None)
    before = sorted(p.name for p in run_dir.iterdir())
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(run_lock.RunDirLocked, match=rf"{run_dir} is in use by another dropless process "
                                                        rf"\(PID {holder.pid}\)"):
            train(config, run_dir, overwrite=True, progress=False, log=lambda s: None)
        assert sorted(p.name for p in run_dir.iterdir()) == before  # --overwrite deleted nothing
        overrides = [f"{k}={v}" for k, v in SMALL.items()]
        refused = run_cli("train", "--data", str(corpus), "--steps", "2", "--run-dir", str(run_dir), "--resume",
                          "--no-progress", *overrides)
        assert_user_error(refused, str(run_dir), f"PID {holder.pid}")
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # no chance to clean up: the kernel drops the lock
        holder.wait()
    with run_lock.hold(run_dir):
        pass
    train(config.replace(**{"train.steps": 2}), run_dir, resume=True, progress=False, log=lambda s: None)


def test_the_lock_file_names_its_holder_and_is_released_on_exit(tmp_path):
    with run_lock.hold(tmp_path / "run"):
        assert (tmp_path / "run" / ".lock").read_text().strip() == str(os.getpid())
    with run_lock.hold(tmp_path / "run"):  # released on exit, retaken by the same process
        pass
