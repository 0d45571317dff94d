"""`dropless bench step`: one real timed step on CPU, saved with --record, and its PGLE variant."""

from __future__ import annotations

import errno
import json
import math
import os

import pytest

from dropless.bench import harness, step
from dropless.bench import runner as runner_lib
from dropless.core.config import ConfigError
from tests.micro_config import micro_config


def test_one_step_saves_its_record(tmp_path, capsys, monkeypatch):
    """A timed step saved with --record; with --pgle on the CPU, which has no GPU kernel costs, the step says PGLE
    was not applied and times the program as it was."""
    from dropless.bench import pgle

    out = tmp_path / "one" / "step.json"
    assert step.main(["--preset", "tiny", "--warmup", "1", "--steps", "3", "--seconds", "0", "--pgle", "--record",
                      str(out), "model.num_layers=2", "train.batch_size=8", "train.seq_len=16"]) == 0
    saved = json.loads(out.read_text())
    assert saved["record"]["status"] == "ok" and saved["record"]["steps_timed"] == 3
    assert saved["record"]["pgle"] == pgle.NOT_APPLIED
    assert saved["overrides"] == ["model.num_layers=2", "train.batch_size=8", "train.seq_len=16"]
    assert saved["config"]["train"]["seq_len"] == 16 and saved["environment"]["platform"] == "cpu"
    printed = capsys.readouterr()
    assert "step " in printed.out and "compiled" not in printed.out and "PGLE not applied" in printed.out
    assert "dropless: lowered step in" in printed.err and "dropless: compiled step in" in printed.err
    (tmp_path / "file").write_text("")
    argv = ["--preset", "tiny", "--warmup", "0", "--steps", "1", "--seconds", "0", "model.num_layers=2",
            "train.batch_size=8", "train.seq_len=16"]
    with pytest.raises(ConfigError, match="file is a file, not a directory"):  # refused before compiling
        step.main([*argv, "--record", str(tmp_path / "file" / "step.json")])
    assert "lowered" not in capsys.readouterr().err

    def full_disk(path, payload):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(step, "write_json", full_disk)  # a write that fails after the measurement
    assert step.main([*argv, "--record", str(tmp_path / "full" / "step.json")]) == 2
    assert "cannot write --record" in capsys.readouterr().err


def test_pgle_variant_is_profiled_recompiled_and_timed(monkeypatch):
    """With kernel costs (faked here: the CPU has none; test_one_step_saves_its_record runs --pgle without them),
    the program is compiled again with them and the new program is timed."""
    from dropless.bench import pgle

    monkeypatch.setattr(pgle, "instruction_costs", lambda run, directory: (run(), b"fake costs")[1])
    config = micro_config(**{"moe.gmm_backend": "capacity"})
    program = runner_lib.compile_variants(config, [runner_lib.Variant("p", devices=1, pgle=True)], log=lambda s: None)["p"]
    first = program.compiled
    runner = runner_lib.Runner(dense_tflops=None, peak_tflops=None, deadline=math.inf, log=lambda s: None,
                         warmup=1, steps=2, seconds=0.0)
    record = runner.run(program)
    assert record["status"] == "ok" and record["pgle"].startswith("applied") and record["steps_timed"] == 2
    assert program.compiled is not first
    assert record["peak_device_gib"] == harness.peak_bytes(program.compiled) / harness.GIB  # the recompiled program's
