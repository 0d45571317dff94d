"""The timing harness: the dense reference rate, timed in batches."""

from __future__ import annotations

from dropless.bench import harness


def test_dense_reference_rate_is_timed_in_batches():
    assert harness.dense_matmul_tflops(128, warm_s=0.0, batches=2) > 0
