"""One trainer per run directory: a second one, --overwrite included, is refused in one line; the lock dies
with its holder, however it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dropless.core import config as config_lib
from dropless.train import run_lock
from dropless.train.loop import train
from tests.test_cli import assert_user_error, run_cli
from tests.test_train import corpus, small_config  # noqa: F401 (corpus is a fixture)

HOLDER = ("import sys, time; from dropless.train import run_lock\n"
          "with run_lock.hold(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)")


def test_a_second_trainer_is_refused_until_the_holder_dies(tmp_path, corpus):
    run_dir = tmp_path / "run"
    config = small_config(corpus, **{"train.steps": 1})
    run_dir.mkdir()
    config_lib.save(config, run_dir / "config.json")
    (run_dir / "metrics.jsonl").write_text("")
    before = sorted(p.name for p in run_dir.iterdir())
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(run_lock.RunDirLocked, match=rf"{run_dir} is in use by another dropless process "
                                                        rf"\(PID {holder.pid}\)"):
            train(config, run_dir, overwrite=True, progress=False, log=lambda s: None)
        assert sorted(p.name for p in run_dir.iterdir()) == sorted(before + [".lock"])  # --overwrite deleted nothing
        refused = run_cli("train", "--steps", "2", "--run-dir", str(run_dir), "--resume", "--no-progress")
        assert_user_error(refused, str(run_dir), f"PID {holder.pid}")
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # no chance to clean up: the kernel drops the lock
        holder.wait()
    with run_lock.hold(run_dir):
        pass


def test_the_lock_file_names_its_holder_and_is_released_on_exit(tmp_path):
    with run_lock.hold(tmp_path / "run"):
        assert (tmp_path / "run" / ".lock").read_text().strip() == str(os.getpid())
    with run_lock.hold(tmp_path / "run"):  # released on exit, retaken by the same process
        pass


def test_the_lock_file_names_only_its_current_holder(tmp_path):
    """A holder whose PID is shorter than the last one's leaves no digits of the old PID in the file."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").write_text("1234567890123\n")
    with run_lock.hold(run_dir):
        assert (run_dir / ".lock").read_text() == f"{os.getpid()}\n"


def test_the_lock_is_exclusive_within_one_process_too(tmp_path):
    """flock locks belong to the open file: a second hold() in the same process is refused while the first
    holds, and the refusal leaves the holder's PID in the file."""
    with run_lock.hold(tmp_path / "run"):
        with pytest.raises(run_lock.RunDirLocked, match=rf"\(PID {os.getpid()}\)"):
            with run_lock.hold(tmp_path / "run"):
                pass
        assert (tmp_path / "run" / ".lock").read_text().strip() == str(os.getpid())
    with run_lock.hold(tmp_path / "run"):
        pass


def test_a_refused_trainer_leaves_the_holder_s_new_directory_and_lock_alone(tmp_path, corpus):
    """A second trainer started on a directory the first one has just made (so it holds only the lock): refused,
    and the directory and the held lock file stay. The holder's own failed start removes the directory it made."""
    run_dir = tmp_path / "run"
    config = small_config(corpus, **{"train.steps": 1})
    with run_lock.hold(run_dir):
        with pytest.raises(run_lock.RunDirLocked):
            train(config, run_dir, progress=False, log=lambda s: None)
        assert [p.name for p in run_dir.iterdir()] == [".lock"]
        assert (run_dir / ".lock").read_text().strip() == str(os.getpid())
    broken = small_config(corpus, **{"train.steps": 1, "data.source": str(tmp_path / "no-such-data")})
    with pytest.raises(Exception, match="does not exist"):
        train(broken, tmp_path / "new", progress=False, log=lambda s: None)
    assert not (tmp_path / "new").exists()
