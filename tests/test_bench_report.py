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
