"""The optimisation ladder: its variants, phases and rung choices, assembled from measured records (pure)."""

from __future__ import annotations

import pytest

from dropless.bench import ladder, report, step
from dropless.core.config import load_preset


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
    assert not ladder.hlo_changed(HLO_SAME, HLO_BASE)
    assert ladder.hlo_changed(HLO_OTHER, HLO_BASE)


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
    rungs = ladder.assemble_ladder(_variants(), texts)
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
    table = report.ladder_markdown(rungs, dense_tflops=686.0)
    assert sum(line[2:3].isdigit() for line in table.splitlines()) == 8
    assert "(remat=none)" in table and "10.00x" in table and "(all_flags, 8 seq. global)" in table
    assert set(by_rung[8]["tried"]) == {"8", "8:all_flags", "8:chunks=2"}
    assert "4,096 (2.0%)" in table and "686 TFLOP/s" in table


def test_assemble_ladder_without_rung_3_or_with_rung_4_failing():
    variants = _variants()
    del variants["3"]
    rungs = {r["rung"]: r for r in ladder.assemble_ladder(variants, {})}
    assert rungs[3]["status"] == ladder.NO_DEFAULT_BACKEND
    assert rungs[4]["status"] == "ok" and rungs[5]["chosen"] == {"train.remat": "none", "train.scan_layers": True}
    assert "not run: tokamax's own kernel" in report.ladder_markdown(list(rungs.values()))
    variants = _variants()
    variants["4"] = {"key": "4", "status": "error: MoEError: boom"}
    rungs = {r["rung"]: r for r in ladder.assemble_ladder(variants, {})}
    assert rungs[4]["status"] == "error: MoEError: boom"
    assert set(rungs[5]["tried"]) == {"3", "5:remat=moe", "5:remat=full", "5:unrolled"}  # rung 3 stands in for none
    assert rungs[5]["chosen"] == {"train.remat": "none", "train.scan_layers": False}  # 100.5 beat moe's 110
    assert "(remat=none, unrolled)" in report.ladder_markdown(list(rungs.values()))
    del variants["5:unrolled"]
    rungs = {r["rung"]: r for r in ladder.assemble_ladder(variants, {})}
    assert rungs[5]["chosen"] == {"train.remat": "moe", "train.scan_layers": True}


def test_ladder_variants_cover_every_rung_and_share_lowerings():
    config = load_preset("tiny")
    variants = ladder.ladder_variants(config, tuned_backend="dropless_mosaic", default_backend="tokamax_mosaic",
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
    assert by_key["3"].overrides["moe.gmm_backend"] == "tokamax_mosaic"
    keys = [v.key for v in ladder.ladder_variants(config, tuned_backend="dropless_mosaic", default_backend=None, flags={},
                                                ep_devices=1, offload_names="moe_in")]
    assert "3" not in keys and "8" not in keys and "4" in keys


def test_every_ladder_variant_has_a_phase_and_the_anchors_come_first():
    variants = ladder.ladder_variants(load_preset("tiny"), tuned_backend="t", default_backend="d",
                                    flags={"a": {"x": 1}, "latency_hiding_scheduler": {"y": 2}}, ep_devices=2,
                                    offload_names="moe_in")
    phases = {v.key: ladder.ladder_phase(v.key) for v in variants}
    by_key = {v.key: v for v in variants}
    assert by_key["8:latency_hiding_scheduler"].xla == {"y": 2} and "8:a" not in by_key
    assert by_key["8:all_flags"].xla == {"x": 1, "y": 2}
    assert by_key["8:pgle"].pgle and by_key["8:pgle"].xla == {} and phases["8:pgle"] == 3
    assert {k for k, p in phases.items() if p == 0} == {"1", "2", "3", "4"}
    assert phases["5:remat=moe"] == phases["5:unrolled"] == 1
    assert phases["6"] == phases["7:a"] == phases["7:all"] == phases["profile"] == 2 == ladder.REBASE_PHASE
    assert phases["8"] == phases["8:all_flags"] == phases["8:chunks=2"] == phases["profile:ep"] == 3
    with pytest.raises(KeyError):
        ladder.ladder_phase("9")


def test_rungs_6_to_8_are_rebuilt_on_rung_5s_measured_choice():
    records = _variants()
    assert ladder.rung5_choice({}) is None
    assert ladder.rung5_choice(records) == {"train.remat": "none"}  # rung 4 (100 ms) beat 5:unrolled (100.5)
    records["5:unrolled"]["step_ms"] = 80.0
    choice = ladder.rung5_choice(records)
    assert choice["train.scan_layers"] is False
    config = load_preset("tiny")
    kwargs = dict(tuned_backend="t", default_backend="d", flags={"a": {"x": 1}}, ep_devices=2, offload_names="moe_in")
    before = {v.key: v for v in ladder.ladder_variants(config, **kwargs)}
    after = {v.key: v for v in ladder.ladder_variants(config, **kwargs, rung5=choice)}
    assert before["4"].overrides == after["4"].overrides and before["4"].overrides["train.scan_layers"] is True
    assert before["5:unrolled"].overrides == after["5:unrolled"].overrides
    for key in ("6", "7:a", "profile", "8", "8:chunks=2", "profile:ep"):
        assert before[key].overrides["train.scan_layers"] is True and after[key].overrides["train.scan_layers"] is False
    assert after["6"].overrides["train.remat"] == "full" and after["8"].overrides["parallel.expert"] == 2


def test_rungs_can_be_chosen_and_the_rest_are_not_run(capsys):
    variants = ladder.ladder_variants(load_preset("tiny"), tuned_backend="t", default_backend="d",
                                    flags={"a": {"x": 1}}, ep_devices=2, offload_names="moe_in")
    assert {ladder.variant_rung(v.key) for v in variants} == set(range(1, 10))
    assert ladder.variant_rung("5:unrolled") == 5 and ladder.variant_rung("profile") == 7
    assert ladder.variant_rung("profile:ep") == 8
    chosen = ladder.select_rungs(variants, {1, 4, 5})
    assert {v.key for v in chosen} == {"1", "4", "5:remat=moe", "5:remat=full", "5:unrolled"}
    assert ladder.select_rungs(variants, None) == variants
    records = {k: r for k, r in _variants().items() if ladder.variant_rung(k) in {1, 4, 5}}
    rungs = {r["rung"]: r for r in ladder.assemble_ladder(records, {})}
    assert rungs[5]["status"] == "ok"
    assert all(rungs[n]["status"] == "not run" for n in (2, 6, 7, 8))
    skipped = {**_variants(), **{k: {"key": k, "status": "skipped: out of time"} for k in _variants() if k[0] in "78"}}
    rungs = {r["rung"]: r for r in ladder.assemble_ladder(skipped, {})}
    assert rungs[7]["status"] == "skipped: out of time" == rungs[8]["status"]
    assert step.main(["--ladder", "--rungs", "1,10"]) == 2
    assert "--rungs '1,10' must list rungs from 1 to 9" in capsys.readouterr().err
