"""The benchmarks' records: one file per benchmark and device, the environment (commit, date, device) inside."""

from __future__ import annotations

import json

import numpy as np

from dropless.bench import records


def test_device_slug():
    assert records.device_slug("NVIDIA H200") == "h200"
    assert records.device_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert records.device_slug("cpu") == "cpu"


def test_every_record_names_its_device_and_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("DROPLESS_COMMIT", "abc1234")
    env = records.environment()
    assert env["commit"] == "abc1234" and env["platform"] == "cpu" and env["device"] and env["date"]
    path = records.results_path(str(tmp_path / "results" / "gmm-{device}.json"), "NVIDIA H200")
    assert path == tmp_path / "results" / "gmm-h200.json" and not path.parent.exists()  # write_json makes it
    records.write_json(path, {"environment": env, "dtype": np.dtype("float32")})
    assert json.loads(path.read_text()) == {"environment": env, "dtype": "float32"}


def test_a_record_is_written_where_its_folder_does_not_exist_yet(tmp_path):
    """A benchmark that ran for minutes must not fail on its last line because nobody made the results folder."""
    path = records.write_json(tmp_path / "not" / "made" / "router.json", {"steps": [1, 2]})
    assert json.loads(path.read_text()) == {"steps": [1, 2]}


def test_a_block_that_never_finishes_ends_the_process_with_one_line():
    """tune-gmm runs kernels never run before on this GPU; a deadlocked one must not hang it silently."""
    import subprocess
    import sys

    code = ("import time\nfrom dropless.bench.harness import watchdog\n"
            "with watchdog(0.5, 'the candidate', 'leave it out.'):\n    time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert done.stderr.strip() == "dropless: error: the candidate did not finish in 0.5 s, so it never completes; leave it out."
    code = ("from dropless.bench.harness import watchdog\nimport time\n"
            "with watchdog(2.0, 'x', 'y'):\n    pass\ntime.sleep(3)\nprint('finished')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "finished"  # a finished block's timer is cancelled


def test_record_lines_prints_each_record_as_it_comes_and_writes_them_together(tmp_path, capsys):
    import jax.numpy as jnp

    out = tmp_path / "sub" / "r.json"
    got = records.record_lines("b", out, lambda emit: [emit({"i": i, "dtype": jnp.dtype(jnp.float32)}) for i in range(2)], shape=[1])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(line)["i"] for line in lines] == [0, 1] and len(got) == 2
    written = json.loads(out.read_text())
    assert written["benchmark"] == "b" and written["shape"] == [1] and written["environment"]["platform"]
    assert [r["i"] for r in written["records"]] == [0, 1] and written["records"][0]["dtype"] == "float32"
    assert records.record_lines("b", None, lambda emit: emit({"i": 0})) == [{"i": 0}]


def test_without_dropless_commit_a_record_names_the_checked_out_commit_of_its_source(monkeypatch):
    """No DROPLESS_COMMIT: the commit is `git rev-parse HEAD` of the source the benchmark ran from."""
    import subprocess
    from pathlib import Path

    import pytest

    monkeypatch.delenv("DROPLESS_COMMIT", raising=False)
    source = Path(records.__file__).resolve().parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=source)
    if head.returncode != 0:
        pytest.skip("the source is not a git checkout")
    commit = records.environment()["commit"]
    assert commit and len(commit) >= 7 and head.stdout.strip().startswith(commit)
