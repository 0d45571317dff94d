"""`dropless bench scale` on 8 CPU devices: every mesh and strategy runs the real step, records what issue 8 asks."""

import json

import pytest

from dropless.bench import report, scale
from dropless.bench.runner import Program
from dropless.core.config import ConfigError
from tests.micro_config import MICRO


def test_mesh_layouts():
    assert scale.mesh_layouts([1, 2, 4, 8], fsdp=False) == [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert scale.mesh_layouts([1, 2, 4, 8], fsdp=True)[4:] == [(2, 4), (4, 2)]
    assert scale.mesh_layouts([1, 2], fsdp=True) == [(1, 1), (1, 2)]


def test_scaling_records_divide_by_the_one_device_rate():
    ok = {"status": "ok", "step_ms": 10.0, "model_tflops_per_device": 1.0, "rows_sent": 0,
          "rows_sent_without_dedup": 0, "dispatch_overflows": 0, "tokens_dropped": 0}
    records = {"1:fsdp=1,expert=1:none": {**ok, "tokens_per_s_per_device": 100.0},
               "2:fsdp=1,expert=2:allgather": {**ok, "tokens_per_s_per_device": 90.0, "rows_sent": 40,
                                               "rows_sent_without_dedup": 100,
                                               "breakdown": {"communication_share": 0.1,
                                                             "communication_ms_per_step_per_device": {"all-gather": 1.0,
                                                                                                      "all-reduce": 0.0}}},
               "2:fsdp=1,expert=2:ragged": {"status": "error: x"}}
    rows = {r["key"]: r for r in scale.scaling_records(records)}
    assert rows["2:fsdp=1,expert=2:allgather"]["efficiency"] == pytest.approx(0.9)
    assert rows["2:fsdp=1,expert=2:allgather"]["rows_sent_per_device"] == 20
    assert rows["2:fsdp=1,expert=2:allgather"]["comm_ms_by_kind"] == {"all-gather": 1.0}
    table = report.scale_markdown(list(rows.values()))
    assert "| 2 | fsdp=1,expert=2 | allgather | 10.0 |" in table and "error: x" in table


def test_scale_runs_every_mesh_and_strategy_on_cpu(tmp_path, capsys):
    out = tmp_path / "scale.json"
    overrides = [f"{k}={v}" for k, v in MICRO.items() if k != "train.batch_size"] + ["train.batch_size=1"]
    # 1 and 4 devices, one strategy: each record kind once, in 2 runs (every mesh under every strategy, fsdp
    # included, is the expert-parallel tests' job, tests/test_ep_executor.py; --fsdp's meshes are checked below
    # without running them)
    assert scale.main(["--preset", "tiny", "--devices", "1,4", "--strategies", "alltoall",
                       "--steps", "1", "--seconds", "0", "--out", str(out), "--table", *overrides]) == 0
    result = json.loads(out.read_text())
    rows = {r["key"]: r for r in result["records"]}
    assert set(rows) == {"1:fsdp=1,expert=1:none", "4:fsdp=1,expert=4:alltoall"}
    assert all(r["status"] == "ok" and r["tokens_dropped"] == 0 for r in rows.values())
    for key, r in rows.items():
        if r["devices"] > 1:  # rows crossed devices; the efficiency is a ratio; a profile was read
            assert r["rows_sent_per_device"] > 0 and r["efficiency"] > 0 and r["comm_share"] is not None
        if r["strategy"] == "alltoall":  # deduplicated: never more rows than one per remote (token, expert)
            assert r["rows_sent_per_device"] <= r["rows_sent_without_dedup_per_device"]
    assert rows["1:fsdp=1,expert=1:none"]["efficiency"] == 1.0
    assert "| 4 | fsdp=1,expert=4 | alltoall |" in capsys.readouterr().out
    assert scale.mesh_layouts([1, 2, 8], fsdp=True) == [(1, 1), (1, 2), (1, 8), (2, 4), (4, 2)]
    assert scale.mesh_layouts([1, 4], fsdp=False) == [(1, 1), (1, 4)]


def test_scale_rejects_bad_devices():
    # ConfigError: `dropless bench scale` prints it as its one `dropless: error:` line, exit status 2
    with pytest.raises(ConfigError, match="include 1"):
        scale.main(["--devices", "2,4"])
    with pytest.raises(ConfigError, match="comma-separated integers"):
        scale.main(["--devices", "one"])
    with pytest.raises(ConfigError, match="not known; choose from"):
        scale.main(["--devices", "1", "--strategies", "teleport"])


def test_scale_writes_no_record_when_no_layout_ran(tmp_path, monkeypatch):
    out = tmp_path / "scale.json"
    monkeypatch.setattr(scale, "compile_variants",
                        lambda config, variants, log: {v.key: Program(v, error="out of memory: x") for v in variants})
    with pytest.raises(ConfigError, match=r"no layout ran \(1:fsdp=1,expert=1:none: error: out of memory: x\)"):
        scale.main(["--preset", "tiny", "--devices", "1", "--out", str(out)])
    assert not out.exists()
