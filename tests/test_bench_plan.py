"""`dropless plan` (the command, its JSON and --compiled), `dropless bench rates` and `dropless bench plan-accuracy`
on the CPU."""

from __future__ import annotations

import json

import jax
import pytest

from dropless import cli
from dropless.bench import plan_accuracy, rates
from dropless.plan.cost import device_rates, load_rates
from dropless.plan.report import SCHEMA

MICRO = plan_accuracy.TINY


def test_plan_command_prints_the_breakdown_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    status = cli.main(["plan", "--preset", "deepseek-v3-671b", "--hosts", "128", "--gpus-per-host", "8",
                       "parallel.fsdp=16", "parallel.expert=8", "train.batch_size=1024", "train.remat=full",
                       "--json", str(out)])
    text = capsys.readouterr().out
    assert status == 0
    for line in ("parameters", "optimizer state", "gradients", "activations", "largest temporary", "peak",
                 "MoE worst case", "fsdp_all_gather", "gradient_all_reduce", "moe_", "tokens/s", "layout: "):
        assert line in text, line
    record = json.loads(out.read_text())
    plan = record["plan"]
    assert plan["schema"] == SCHEMA and plan["cluster"]["devices"] == 1024
    assert plan["mesh"] == {"data": 8, "fsdp": 16, "expert": 8}
    assert set(plan["per_device_bytes"]) >= {"parameters", "gradients", "optimizer_state", "activations",
                                             "temporaries", "largest_temporary", "peak", "peak_worst_case"}
    assert plan["step"]["seconds"] > 0 and plan["flops"]["model"] > 0
    assert {c["name"] for c in plan["collectives"]} >= {"fsdp_all_gather", "gradient_all_reduce"}
    assert plan["overrides"].startswith("parallel.data=-1 parallel.fsdp=16 parallel.expert=8 train.remat=full")


def test_plan_search_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "plan.json"
    status = cli.main(["plan", "--preset", "tiny", "--device", "cpu", "--device-memory-gib", "0.01", "--search",
                       "--json", str(out), *MICRO])
    text = capsys.readouterr().out
    assert status == 0 and "search:" in text
    record = json.loads(out.read_text())
    steps = [row["step_s"] for row in record["search"]]
    assert steps == sorted(steps) and all(row["peak_bytes"] <= 0.0095 * 1024**3 for row in record["search"])
    # train.device_memory_gib, the limit training plans against, is the plan's too where no flag names another.
    for flag, fits in (([], False), (["--device-memory-gib", "1"], True)):
        status = cli.main(["plan", "--preset", "tiny", "--device", "cpu", *flag, "--json", str(out), *MICRO,
                           "train.device_memory_gib=0.0001"])
        plan = json.loads(out.read_text())["plan"]
        assert status == 0 and plan["fits"] is fits, (flag, plan["device_memory_bytes"])


def test_plan_compiled_on_the_cpu_for_the_cpu(capsys):
    assert cli.main(["plan", "--preset", "tiny", "--device", "cpu", "--compiled", *MICRO]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("compiled (cpu): peak ") and "; the plan says " in line, line


RATE_FILES = {"list.json": "[1, 2]", "missing.json": '{"X": {"platform": "gpu", "dense_tflops": 700}}',
              "nan.json": None, "broken.json": "{", "latin1.json": b"\xff\xfe{"}


@pytest.fixture
def rate_files(tmp_path):
    """Rate tables that are not: a JSON list, an entry without most rates, one with a rate of NaN (written from
    the packaged table), broken JSON, bytes that are not text; and a directory."""
    table = load_rates()
    table["H200"]["hbm_gbps"]["value"] = float("nan")
    for name, text in RATE_FILES.items():
        path = tmp_path / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(json.dumps(table) if text is None else text)
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["--devices", "12", "--gpus-per-host", "8"], "not a whole number of hosts"),
    (["--device", "TPU9"], "has no device 'TPU9'"),
    (["--devices", "16", "--device", "cpu", "--compiled", "train.batch_size=16"],
     "--compiled needs the plan's 16 devices"),
    (["--compiled"], "--compiled compiles the step on this machine, a cpu, but the plan is for H200 (gpu); run it "
                     "where the plan's device is, or plan for --device cpu."),
    (["--devices", "0"], "--devices 0 must be at least 1"),
    (["--hosts", "2", "--gpus-per-host", "0"], "--gpus-per-host 0 must be at least 1"),
    (["--hosts", "-1"], "--hosts -1 must be at least 1"),
    (["--device-memory-gib", "0"], "--device-memory-gib=0.0 must be a finite number of GiB above 0"),
    (["--device-memory-gib", "-5"], "--device-memory-gib=-5.0 must be a finite number"),
    (["--device-memory-gib", "nan"], "--device-memory-gib=nan must be a finite number"),
    (["--device-memory-gib", "inf"], "--device-memory-gib=inf must be a finite number"),
    (["--rates", "{dir}/list.json"], "is not a rate table"),
    (["--rates", "{dir}/missing.json"], "device 'X' lacks a positive number for attention_tflops, gmm_tflops.by_rows_per_expert"),
    (["--rates", "{dir}/nan.json"], "device 'H200' lacks a positive number for hbm_gbps"),
    (["--rates", "{dir}/broken.json"], "is not valid JSON"),
    (["--rates", "{dir}/latin1.json"], "is not valid JSON"),
    (["--rates", "{dir}"], "is a directory"),
    (["--rates", "{dir}/absent.json"], "does not exist"),
    (["--devices", "8", "--device", "cpu", "moe.dispatch=ragged", "parallel.expert=8"],
     "moe.dispatch=ragged needs GPUs (XLA:CPU has no ragged_all_to_all); use moe.dispatch=alltoall or allgather."),
    # training refuses it before its first step; the plan (and so --search and train.auto_fit) refuses it too
    (["--devices", "8", "moe.dispatch_chunks=3", "parallel.expert=4"],
     "moe.dispatch_chunks=3 does not divide the 256 tokens each device holds in the MoE layer; choose a divisor of 256."),
])
def test_plan_command_errors_are_one_line(argv, message, capsys, rate_files):
    argv = [a.replace("{dir}", str(rate_files)) for a in argv]
    assert cli.main(["plan", "--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_bench_memory_points_to_plan(capsys):
    assert cli.main(["bench", "memory", "--preset", "tiny"]) == 2
    assert "there is no 'dropless bench memory': 'dropless plan' reports the memory" in capsys.readouterr().err


def test_rates_measure_a_table_the_planner_reads(tmp_path):
    entry = rates.measure("small")
    table = {**load_rates(), "measured": entry}
    values = device_rates(table, "measured")
    assert values["platform"] == jax.devices()[0].platform
    for key in ("dense_tflops", "attention_tflops", "hbm_gbps"):
        assert values[key] > 0 and "dropless bench rates" in entry[key]["source"]
    points = values["gmm_tflops"]["by_rows_per_expert"]
    assert [p["rows"] for p in points] == sorted(256 // g for g in rates.SIZES["small"]["groups"])
    assert all(p["value"] > 0 and "dropless bench rates" in p["source"] for p in points)


def test_plan_accuracy_runs_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setitem(plan_accuracy.CONFIG_SETS, "tiny", plan_accuracy.CONFIG_SETS["tiny"][:1])
    out = tmp_path / "accuracy.json"
    record = plan_accuracy.run("tiny", str(out), warmup=1, steps=2, seconds=0.1, budget=300, device=None,
                               log=lambda message: None)
    row, = record["configs"]
    assert row["status"] == "ok", row["status"]
    # The worker's compiled memory analysis is `dropless plan --compiled`'s (bench.plan.memory_analysis).
    assert row["measured"]["step_ms"] > 0 and row["measured"]["compiled"]["peak"] > 0
    assert row["predicted"]["fits"] and "step_error" in row
    assert json.loads(out.read_text())["benchmark"] == "plan-accuracy"
    table = plan_accuracy.markdown_table(record)
    assert table.startswith("| configuration |") and row["name"] in table


def test_plan_accuracy_table_marks_a_row_whose_steps_spread():
    """A median of steps that spread 44% (a step sharing the host with compiles) is marked; a steady one is not."""
    def row(name, steps):
        return {"name": name, "status": "ok", "predicted": {"peak_gib": 1.0, "step_ms": 200.0},
                "measured": {"peak_gib": 1.0, "step_ms": sorted(steps)[len(steps) // 2], "step_ms_all": steps},
                "peak_error": 0.0, "step_error": -0.5}
    table = plan_accuracy.markdown_table({"configs": [row("noisy", [720.9, 712.1, 666.6, 547.1, 578.2, 500.3]),
                                                      row("steady", [438.9, 442.8, 431.8])]})
    noisy, steady = (line for line in table.splitlines() if line.startswith(("| noisy", "| steady")))
    assert "steps spread 44%" in noisy and "spread" not in steady
    assert plan_accuracy.step_spread([500.0, 550.0]) == pytest.approx(0.10)


def test_plan_accuracy_parts_cover_the_set_once_and_records_merge(monkeypatch):
    names = [f"c{i}" for i in range(7)]
    configs = [(name, "tiny", []) for name in names]
    parts = [plan_accuracy.select_part(configs, f"{k}/3") for k in (1, 2, 3)]
    assert [c[0] for part in parts for c in part] == names and all(parts)
    with pytest.raises(ValueError, match="--part"):
        plan_accuracy.select_part(configs, "4/3")
    monkeypatch.setitem(plan_accuracy.CONFIG_SETS, "parts", configs)
    previous = {"benchmark": "plan-accuracy", "config_set": "parts",
                "configs": [{"name": n, "status": "ok", "old": True} for n in names[:3]]}
    rows = [{"name": "c1", "status": "ok"}, {"name": "c2", "status": "not run: the time budget (--budget) ran out"},
            {"name": "c4", "status": "ok"}]
    merged = plan_accuracy.merged_rows(previous, rows, "parts")
    # c1 re-measured replaces the old row; c2's old measurement survives a run that did not get to it.
    assert [(r["name"], "old" in r) for r in merged] == [("c0", True), ("c1", False), ("c2", True), ("c4", False)]
    assert plan_accuracy.merged_rows({**previous, "config_set": "h200"}, rows, "parts") == rows


def test_plan_accuracy_a_failure_replaces_an_older_row_and_other_parts_set_no_exit_status(monkeypatch, capsys):
    configs = [(f"c{i}", "tiny", []) for i in range(4)]
    monkeypatch.setitem(plan_accuracy.CONFIG_SETS, "parts", configs)
    predicted = {"peak_gib": 1.0, "step_ms": 1.0, "fits": True}
    previous = {"benchmark": "plan-accuracy", "config_set": "parts",
                "configs": [{"name": n, "status": "ok", "predicted": predicted} for n in ("c0", "c1")]}
    failed = [{"name": "c0", "status": "error: out of memory", "predicted": predicted}]
    merged = plan_accuracy.merged_rows(previous, failed, "parts")
    assert [(r["name"], r["status"]) for r in merged] == [("c0", "error: out of memory"), ("c1", "ok")]

    def run_ok(config_set, out, *, part, **_):  # every configuration of `part` measured, merged into `merged`
        ran = [{"name": name, "status": "ok", "predicted": predicted}
               for name, _, _ in plan_accuracy.select_part(configs, part)]
        return {"configs": plan_accuracy.merged_rows({**previous, "configs": merged}, ran, config_set)}

    monkeypatch.setattr(plan_accuracy, "run", run_ok)
    assert plan_accuracy.main(["--set", "parts", "--part", "2/2"]) == 0  # c0's failure is part 1's, not this run's
    monkeypatch.setattr(plan_accuracy, "run", lambda config_set, out, *, part, **_: {"configs": merged})
    assert plan_accuracy.main(["--set", "parts", "--part", "1/2"]) == 1
    capsys.readouterr()


def test_the_packaged_rate_table_passes_the_checks_a_users_table_gets():
    from importlib import resources

    packaged = resources.files("dropless.plan").joinpath("rates.json")
    assert load_rates(str(packaged)) == load_rates()
