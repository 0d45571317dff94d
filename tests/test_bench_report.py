"""The benchmarks' tables and charts, made from records alone."""

from __future__ import annotations

import pytest

from dropless.bench import ladder, report
from dropless.bench import runner as runner_lib
from tests.test_bench_ladder import _variants


def test_rung_1_out_of_memory_still_gives_a_table_and_a_chart(tmp_path):
    """On the H200 the naive ragged_dot step runs out of memory at 8 192 tokens: the error is named as such,
    and the table and chart are made without speed-ups over rung 1 (there is nothing to divide by)."""
    pytest.importorskip("matplotlib")
    error = RuntimeError("NOT_FOUND: All configs failed during profiling.\nFailures (3):\nEXECUTION FAILED: "
                         "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 56.02GiB with allocator GPU_0_bfc")
    assert runner_lib.short_error(error) == "out of memory: trying to allocate 56.02GiB"
    variants = _variants()
    variants["1"] = {"key": "1", "status": f"error: {runner_lib.short_error(error)}"}
    rungs = ladder.assemble_ladder(variants, {})
    assert all(r.get("speedup_vs_rung1") is None for r in rungs)
    table = report.ladder_markdown(rungs)
    assert "| 1 | naive dropless: jax.lax.ragged_dot | error: out of memory: trying to allocate 56.02GiB |" in table
    assert "Nonex" not in table
    path = report.ladder_chart({"ladder": rungs, "dense_tflops": 600.0, "environment": {}}, tmp_path / "ladder.png")
    assert path.stat().st_size > 1000


def test_gmm_table_rows_name_each_path_s_rates_its_errors_and_our_share_of_dense():
    """BENCHMARKS.md's grouped-GEMM table, row by row: fwd / fwd+bwd TFLOP/s per path, an error above the limit
    named with its worst product, an out-of-memory as OOM, an unmeasured path as such, our share of dense."""
    backends = ("dense", "xla", "tokamax_default", "tokamax_fwd_tuned", "dropless", "capacity")
    rec = lambda backend, skew="hot", **kw: {"shape": "s1", "skew": skew, "backend": backend, **kw}
    records = [rec("dense", "balanced", fwd_tflops=600.0, fwdbwd_tflops=550.4),
               rec("xla", fwd_tflops=100.0, fwdbwd_tflops=90.0, max_rel_err=0.006),
               rec("tokamax_default", error="RESOURCE_EXHAUSTED: out of memory"),
               rec("tokamax_fwd_tuned", error="boom", max_rel_err=0.2, rel_err={"fwd": 0.01, "dgrad": 0.2}),
               rec("dropless", fwd_tflops=400.0, fwdbwd_tflops=330.0, fwdbwd_vs_dense=0.6),
               rec("capacity", error="not measured: no GPU")]
    table = report.gmm_markdown(records, ("hot", "balanced"), backends).splitlines()
    assert table[2:] == ["| s1 | hot | 600 / 550 | 100 / 90 (err 0.6%) | OOM | wrong (dgrad err 20.0%) | 400 / 330 | "
                         "**60%** | not measured |",
                         "| s1 | balanced | 600 / 550 | n/a | n/a | n/a | n/a | n/a | n/a |"]


def test_ep_table_rows_show_each_strategy_s_time_efficiency_and_traffic():
    base = {"skew": "hot", "layer_ms": 2.5, "weak_scaling_efficiency": 0.8, "efficiency_range": (0.7, 0.9),
            "comm_ms": 1.25, "comm_share": 0.5, "useful_GBps_per_device": 120.0, "rows_sent_per_device": 30.0,
            "rows_sent_without_dedup_per_device": 45.0, "overflowed": 0}
    records = [{"strategy": "single-device", "skew": "hot", "layer_ms": 2.0},
               {**base, "strategy": "auto", "chosen": "alltoall", "chunks": 2, "dispatch_dtype": "fp8",
                "comm_waiting_ms": 0.5}]
    table = report.ep_markdown(records).splitlines()
    assert table[2:] == ["| 1 device | hot | 2.00 | 1.00 | - | - | - | - |",
                         "| auto (alltoall), 2 chunks, fp8 dispatch | hot | 2.50 | 0.800 (0.700-0.900) | "
                         "1.25, 50.0% (0.50 waiting) | 120 | 30 (45) | 0 |"]


def test_scale_table_rows_show_the_communication_share_as_a_percentage():
    row = {"status": "ok", "devices": 2, "mesh": "fsdp=1,expert=2", "strategy": "alltoall", "step_ms": 10.0,
           "tokens_per_s_per_device": 1234.0, "model_tflops_per_device": 1.5, "efficiency": 0.9, "comm_share": 0.125,
           "rows_sent_per_device": 20.0, "rows_sent_without_dedup_per_device": 50.0, "dispatch_overflows": 0,
           "tokens_dropped": 3}
    assert report.scale_markdown([row]).splitlines()[2] == \
        "| 2 | fsdp=1,expert=2 | alltoall | 10.0 | 1,234 | 1.5 | 0.90 | 12.5% | 20 (50) | 0 | 3 |"
