"""The step benchmark: throughput arithmetic, the ladder's assembly and table, and one real timed step on CPU."""

from __future__ import annotations

import json
import math

import jax
import pytest

from dropless.bench import step
from dropless.core.config import load_preset
from dropless.models import flops as flops_lib
from tests.micro_config import micro_config


def _record(key: str, step_ms: float, *, overrides=None, devices: int = 1, tokens: int = 4096, **extra) -> dict:
    rate = tokens / (step_ms / 1e3)
    return {"key": key, "status": "ok", "step_ms": step_ms, "devices": devices, "overrides": overrides or {},
            "tokens_per_s": rate, "tokens_per_s_per_device": rate / devices, "model_tflops_per_device": rate / devices * 1e-6,
            "mfu_vs_measured_dense": 0.5, "mfu_vs_datasheet_peak": 0.3, "peak_device_gib": 100.0,
            "tokens_dropped": 0, "dropped_fraction": 0.0, **extra}


HLO_BASE = "HloModule jit_a, x=1\n%f = f32[2] add(%a, %b), metadata={op_name=\"a\"}, backend_config={\"x\":1}\n"
HLO_SAME = "HloModule jit_b, x=2\n%f = f32[2] add(%a, %b), metadata={op_name=\"b\"}, backend_config={\"x\":2}\n"
HLO_OTHER = "HloModule jit_c\n%f = f32[2] multiply(%a, %b)\n"


def test_hlo_changed_ignores_names_metadata_and_autotuning():
    assert not step.hlo_changed(HLO_SAME, HLO_BASE)
    assert step.hlo_changed(HLO_OTHER, HLO_BASE)


def _variants() -> dict[str, dict]:
    return {
        "1": _record("1", 1000.0),
        "2": _record("2", 200.0, tokens_dropped=4096, dropped_fraction=0.02),
        "3": _record("3", 150.0),
        "4": _record("4", 100.0, overrides={"train.remat": "none"}),
        "5:remat=moe": _record("5:remat=moe", 110.0, overrides={"train.remat": "moe"}),
        "5:remat=full": {"key": "5:remat=full", "status": "does not fit: needs 150.0 GiB of 139.0"},
        "5:unrolled": _record("5:unrolled", 100.5, overrides={"train.remat": "none", "train.scan_layers": False}),
        "6": _record("6", 130.0),
        "7:latency_hiding_scheduler": _record("7:latency_hiding_scheduler", 99.9),  # same program, noise
        "7:no_command_buffers": _record("7:no_command_buffers", 90.0),             # faster
        "7:while_loop_double_buffering": _record("7:while_loop_double_buffering", 104.0),  # changed, slower
        "7:all": _record("7:all", 95.0),
        "8": _record("8", 110.0, devices=2, tokens=8192, overrides={"train.batch_size": 8}),
        "8:all_flags": _record("8:all_flags", 105.0, devices=2, tokens=8192, overrides={"train.batch_size": 8}),
        "8:chunks=2": _record("8:chunks=2", 108.0, devices=2, tokens=8192,
                              overrides={"train.batch_size": 8, "moe.dispatch_chunks": 2}),
    }


def test_assemble_ladder_chooses_by_measurement_and_reports_speedups():
    texts = {"4": HLO_BASE, "7:latency_hiding_scheduler": HLO_SAME, "7:no_command_buffers": HLO_OTHER,
             "7:while_loop_double_buffering": HLO_OTHER}
    rungs = step.assemble_ladder(_variants(), texts)
    assert [r["rung"] for r in rungs] == list(range(1, 9))
    by_rung = {r["rung"]: r for r in rungs}
    assert by_rung[1]["speedup_vs_rung1"] == pytest.approx(1.0)
    assert by_rung[4]["speedup_vs_rung1"] == pytest.approx(10.0)
    # Rung 5: remat=none (rung 4's program) beat moe and the unrolled loop; full did not fit and says so.
    assert by_rung[5]["chosen"] == {"train.remat": "none", "train.scan_layers": True}
    assert by_rung[5]["tried"]["5:unrolled"] == 100.5
    assert by_rung[5]["tried"]["5:remat=full"].startswith("does not fit")
    # Rung 7: only the flag that changed something and helped is kept; "all" is not eligible then.
    flags = by_rung[7]["flags"]
    assert flags["latency_hiding_scheduler"]["kept"] is False and not flags["latency_hiding_scheduler"]["changed_program"]
    assert flags["while_loop_double_buffering"]["kept"] is False and flags["while_loop_double_buffering"]["changed_program"]
    assert flags["no_command_buffers"]["kept"] is True
    assert by_rung[7]["key"] == "7:no_command_buffers"
    assert by_rung[7]["speedup_vs_rung1"] == pytest.approx(1000 / 90)
    # Rung 8: the faster EP variant, per-device throughput against rung 1 and against the best single device.
    assert by_rung[8]["key"] == "8:all_flags"
    assert by_rung[8]["speedup_vs_rung1"] == pytest.approx(1000 / 105)
    assert by_rung[8]["per_device_efficiency_vs_best_single"] == pytest.approx(90 / 105)
    table = step.format_ladder(rungs, dense_tflops=686.0)
    assert sum(line[2:3].isdigit() for line in table.splitlines()) == 8
    assert "(remat=none)" in table and "10.00x" in table and "(all_flags, 8 seq. global)" in table
    assert set(by_rung[8]["tried"]) == {"8", "8:all_flags", "8:chunks=2"}
    assert "4,096 (2.0%)" in table and "686 TFLOP/s" in table


def test_assemble_ladder_without_rung_3_or_with_rung_4_failing():
    variants = _variants()
    del variants["3"]
    rungs = {r["rung"]: r for r in step.assemble_ladder(variants, {})}
    assert rungs[3]["status"] == step.NO_DEFAULT_BACKEND
    assert rungs[4]["status"] == "ok" and rungs[5]["chosen"] == {"train.remat": "none", "train.scan_layers": True}
    assert "not run: tokamax's own kernel" in step.format_ladder(list(rungs.values()))
    variants = _variants()
    variants["4"] = {"key": "4", "status": "error: MoEError: boom"}
    rungs = {r["rung"]: r for r in step.assemble_ladder(variants, {})}
    assert rungs[4]["status"] == "error: MoEError: boom"
    assert set(rungs[5]["tried"]) == {"3", "5:remat=moe", "5:remat=full", "5:unrolled"}  # rung 3 stands in for none
    assert rungs[5]["chosen"] == {"train.remat": "none", "train.scan_layers": False}  # 100.5 beat moe's 110
    assert "(remat=none, unrolled)" in step.format_ladder(list(rungs.values()))
    del variants["5:unrolled"]
    rungs = {r["rung"]: r for r in step.assemble_ladder(variants, {})}
    assert rungs[5]["chosen"] == {"train.remat": "moe", "train.scan_layers": True}


def test_ladder_variants_cover_every_rung_and_share_lowerings():
    config = load_preset("tiny")
    variants = step.ladder_variants(config, tuned_backend="tokamax", default_backend="tokamax_default",
                                    flags={"a": {"xla_a": True}, "b": {"xla_b": 1}}, ep_devices=2,
                                    offload_names="moe_in")
    keys = [v.key for v in variants]
    assert keys[:4] == ["1", "2", "3", "4"] and "6" in keys and "7:all" in keys and "8" in keys
    by_key = {v.key: v for v in variants}
    assert by_key["7:a"].overrides == by_key["4"].overrides  # flags reuse rung 4's lowering
    assert by_key["7:all"].xla == {"xla_a": True, "xla_b": 1}
    assert by_key["8"].devices == 2 and by_key["8"].overrides["train.batch_size"] == 2 * config.train.batch_size
    assert by_key["8:chunks=2"].overrides == {**by_key["8"].overrides, "moe.dispatch_chunks": 2}
    assert by_key["5:unrolled"].overrides == {**by_key["4"].overrides, "train.scan_layers": False}
    assert by_key["6"].overrides["train.remat"] == "full" and by_key["6"].overrides["train.offload"] == "moe_in"
    assert by_key["profile"].profile and by_key["profile"].xla == {"xla_gpu_enable_command_buffer": ""}
    assert by_key["3"].overrides["moe.gmm_backend"] == "tokamax_default"
    keys = [v.key for v in step.ladder_variants(config, tuned_backend="tokamax", default_backend=None, flags={},
                                                ep_devices=1, offload_names="moe_in")]
    assert "3" not in keys and "8" not in keys and "4" in keys


def test_summarize_follows_the_readme_formulas():
    config = load_preset("tiny").replace(**{"train.batch_size": 4, "train.seq_len": 64})
    times = [0.2, 0.1, 0.3]
    record = step.summarize(config, times, {"tokens_dropped": 12, "max_expert_load": 1.5, "loss": 7.0},
                            devices=2, dense_tflops=1.0, peak_tflops=None)
    tokens = 4 * 64
    tokens_per_s = tokens / 0.2
    assert record["step_ms"] == pytest.approx(200.0) and record["step_ms_min"] == pytest.approx(100.0)
    assert record["tokens_per_s"] == pytest.approx(tokens_per_s)
    assert record["tokens_per_s_per_device"] == pytest.approx(tokens_per_s / 2)
    tflops = flops_lib.model_flops_per_token(config, 64) * tokens_per_s / 2 / 1e12
    assert record["model_tflops_per_device"] == pytest.approx(tflops)
    assert record["mfu_vs_measured_dense"] == pytest.approx(tflops)
    assert record["mfu_vs_datasheet_peak"] is None
    moe_layers = config.model.num_layers - config.model.first_dense_layers
    assert record["dropped_fraction"] == pytest.approx(12 / (tokens * config.moe.num_experts_per_tok * moe_layers))


def test_device_slug():
    assert step.device_slug("NVIDIA H200") == "h200"
    assert step.device_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert step.device_slug("cpu") == "cpu"


def test_one_real_step_is_timed_on_cpu():
    """The whole path on a micro model: compile (parallel), time, summarize."""
    config = micro_config(**{"moe.gmm_backend": "capacity"})
    programs = step.compile_variants(config, [step.Variant("a", devices=1), step.Variant("bad", {"moe.gmm_backend": "tokamax"})],
                                     log=lambda s: None)
    assert programs["bad"].error  # tokamax needs a GPU: reported, not raised
    runner = step.Runner(dense_tflops=None, peak_tflops=None, deadline=math.inf, log=lambda s: None,
                         warmup=1, steps=3, seconds=0.0)
    record = runner.run(programs["a"])
    assert record["status"] == "ok" and record["steps_timed"] == 3 and len(record["step_ms_all"]) == 3
    assert record["tokens_per_step"] == 16 and record["model_tflops_per_device"] > 0
    assert record["peak_device_gib"] > 0 and record["tokens_dropped"] >= 0
    assert runner.run(programs["bad"])["status"].startswith("error: MoEError")
    assert jax.device_count() >= 1


def test_every_ladder_variant_has_a_phase_and_the_anchors_come_first():
    variants = step.ladder_variants(load_preset("tiny"), tuned_backend="t", default_backend="d",
                                    flags={"a": {"x": 1}, "latency_hiding_scheduler": {"y": 2}}, ep_devices=2,
                                    offload_names="moe_in")
    phases = {v.key: step.ladder_phase(v.key) for v in variants}
    by_key = {v.key: v for v in variants}
    assert by_key["8:latency_hiding_scheduler"].xla == {"y": 2} and "8:a" not in by_key
    assert by_key["8:all_flags"].xla == {"x": 1, "y": 2}
    assert by_key["8:pgle"].pgle and by_key["8:pgle"].xla == {} and phases["8:pgle"] == 3
    assert {k for k, p in phases.items() if p == 0} == {"1", "2", "3", "4"}
    assert phases["5:remat=moe"] == phases["5:unrolled"] == 1
    assert phases["6"] == phases["7:a"] == phases["7:all"] == phases["profile"] == 2 == step.REBASE_PHASE
    assert phases["8"] == phases["8:all_flags"] == phases["8:chunks=2"] == phases["profile:ep"] == 3
    with pytest.raises(KeyError):
        step.ladder_phase("9")


def test_rung_1_out_of_memory_still_gives_a_table_and_a_chart(tmp_path):
    """On the H200 the naive ragged_dot step runs out of memory at 8 192 tokens: the error is named as such,
    and the table and chart are made without speed-ups over rung 1 (there is nothing to divide by)."""
    pytest.importorskip("matplotlib")
    error = RuntimeError("NOT_FOUND: All configs failed during profiling.\nFailures (3):\nEXECUTION FAILED: "
                         "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 56.02GiB with allocator GPU_0_bfc")
    assert step._short_error(error) == "out of memory: trying to allocate 56.02GiB"
    variants = _variants()
    variants["1"] = {"key": "1", "status": f"error: {step._short_error(error)}"}
    rungs = step.assemble_ladder(variants, {})
    assert all(r.get("speedup_vs_rung1") is None for r in rungs)
    table = step.format_ladder(rungs)
    assert "| 1 | naive dropless: jax.lax.ragged_dot | error: out of memory: trying to allocate 56.02GiB |" in table
    assert "Nonex" not in table
    path = step.plot_ladder({"ladder": rungs, "dense_tflops": 600.0, "environment": {}}, tmp_path / "ladder.png")
    assert path.stat().st_size > 1000


def test_rungs_6_to_8_are_rebuilt_on_rung_5s_measured_choice():
    records = _variants()
    assert step.rung5_choice({}) is None
    assert step.rung5_choice(records) == {"train.remat": "none"}  # rung 4 (100 ms) beat 5:unrolled (100.5)
    records["5:unrolled"]["step_ms"] = 80.0
    choice = step.rung5_choice(records)
    assert choice["train.scan_layers"] is False
    config = load_preset("tiny")
    kwargs = dict(tuned_backend="t", default_backend="d", flags={"a": {"x": 1}}, ep_devices=2, offload_names="moe_in")
    before = {v.key: v for v in step.ladder_variants(config, **kwargs)}
    after = {v.key: v for v in step.ladder_variants(config, **kwargs, rung5=choice)}
    assert before["4"].overrides == after["4"].overrides and before["4"].overrides["train.scan_layers"] is True
    assert before["5:unrolled"].overrides == after["5:unrolled"].overrides
    for key in ("6", "7:a", "profile", "8", "8:chunks=2", "profile:ep"):
        assert before[key].overrides["train.scan_layers"] is True and after[key].overrides["train.scan_layers"] is False
    assert after["6"].overrides["train.remat"] == "full" and after["8"].overrides["parallel.expert"] == 2


def test_dense_reference_rate_is_timed_in_batches():
    assert step.dense_matmul_tflops(128, warm_s=0.0, batches=2) > 0


def test_rungs_can_be_chosen_and_the_rest_are_not_run(capsys):
    variants = step.ladder_variants(load_preset("tiny"), tuned_backend="t", default_backend="d",
                                    flags={"a": {"x": 1}}, ep_devices=2, offload_names="moe_in")
    assert {step.variant_rung(v.key) for v in variants} == set(range(1, 9))
    assert step.variant_rung("5:unrolled") == 5 and step.variant_rung("profile") == 7
    assert step.variant_rung("profile:ep") == 8
    chosen = step.select_rungs(variants, {1, 4, 5})
    assert {v.key for v in chosen} == {"1", "4", "5:remat=moe", "5:remat=full", "5:unrolled"}
    assert step.select_rungs(variants, None) == variants
    records = {k: r for k, r in _variants().items() if step.variant_rung(k) in {1, 4, 5}}
    rungs = {r["rung"]: r for r in step.assemble_ladder(records, {})}
    assert rungs[5]["status"] == "ok"
    assert all(rungs[n]["status"] == "not run" for n in (2, 6, 7, 8))
    skipped = {**_variants(), **{k: {"key": k, "status": "skipped: out of time"} for k in _variants() if k[0] in "78"}}
    rungs = {r["rung"]: r for r in step.assemble_ladder(skipped, {})}
    assert rungs[7]["status"] == "skipped: out of time" == rungs[8]["status"]
    assert step.main(["--ladder", "--rungs", "1,9"]) == 2
    assert "--rungs '1,9' must list rungs from 1 to 8" in capsys.readouterr().err


def test_one_step_saves_its_record(tmp_path, capsys):
    out = tmp_path / "one" / "step.json"
    assert step.main(["--preset", "tiny", "--warmup", "1", "--steps", "3", "--seconds", "0", "--record", str(out),
                      "model.num_layers=2", "train.batch_size=8", "train.seq_len=16"]) == 0
    saved = json.loads(out.read_text())
    assert saved["record"]["status"] == "ok" and saved["record"]["steps_timed"] == 3
    assert saved["overrides"] == ["model.num_layers=2", "train.batch_size=8", "train.seq_len=16"]
    assert saved["config"]["train"]["seq_len"] == 16 and saved["environment"]["platform"] == "cpu"
    assert "step " in capsys.readouterr().out
    (tmp_path / "file").write_text("")
    assert step.main(["--preset", "tiny", "--warmup", "0", "--steps", "1", "--seconds", "0", "--record",
                      str(tmp_path / "file" / "step.json"), "model.num_layers=2", "train.batch_size=8",
                      "train.seq_len=16"]) == 2
    assert "cannot write --record" in capsys.readouterr().err


def test_pgle_variant_is_profiled_recompiled_and_timed(tmp_path, capsys, monkeypatch):
    """On the CPU there are no GPU kernel costs: the step says PGLE was not applied and times the program as it
    was. With costs (faked here), the program is compiled again with them and the new program is timed."""
    from dropless.bench import pgle

    assert step.main(["--preset", "tiny", "--warmup", "1", "--steps", "2", "--seconds", "0", "--pgle",
                      "--record", str(tmp_path / "a.json"), "model.num_layers=2", "train.batch_size=8",
                      "train.seq_len=16"]) == 0
    record = json.loads((tmp_path / "a.json").read_text())["record"]
    assert record["status"] == "ok" and record["pgle"] == pgle.NOT_APPLIED
    assert "PGLE not applied" in capsys.readouterr().out

    monkeypatch.setattr(pgle, "instruction_costs", lambda run, directory: (run(), b"fake costs")[1])
    config = micro_config(**{"moe.gmm_backend": "capacity"})
    program = step.compile_variants(config, [step.Variant("p", devices=1, pgle=True)], log=lambda s: None)["p"]
    first = program.compiled
    runner = step.Runner(dense_tflops=None, peak_tflops=None, deadline=math.inf, log=lambda s: None,
                         warmup=1, steps=2, seconds=0.0)
    record = runner.run(program)
    assert record["status"] == "ok" and record["pgle"].startswith("applied") and record["steps_timed"] == 2
    assert program.compiled is not first
    assert record["peak_device_gib"] == step.peak_bytes(program.compiled) / step.GIB  # the recompiled program's
