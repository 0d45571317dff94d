"""The benchmarks' records: one file name per device."""

from __future__ import annotations

from dropless.bench import records


def test_device_slug():
    assert records.device_slug("NVIDIA H200") == "h200"
    assert records.device_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert records.device_slug("cpu") == "cpu"
