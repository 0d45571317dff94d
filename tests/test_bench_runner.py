"""The step runner: throughput arithmetic, and real steps compiled and timed on the CPU."""

from __future__ import annotations

import math

import jax
import pytest

from dropless.bench import runner as runner_lib
from dropless.core.config import load_preset
from dropless.models import flops as flops_lib
from tests.micro_config import micro_config


def test_summarize_follows_the_readme_formulas():
    config = load_preset("tiny").replace(**{"train.batch_size": 4, "train.seq_len": 64})
    times = [0.2, 0.1, 0.3]
    record = runner_lib.summarize(config, times, {"tokens_dropped": 12, "max_expert_load": 1.5, "loss": 7.0},
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


def test_one_real_step_is_timed_on_cpu():
    """The whole path on a micro model: compile (parallel), time, summarize."""
    config = micro_config(**{"moe.gmm_backend": "capacity"})
    programs = runner_lib.compile_variants(config, [runner_lib.Variant("a", devices=1), runner_lib.Variant("bad", {"moe.gmm_backend": "dropless_mosaic"})],
                                     log=lambda s: None)
    assert programs["bad"].error  # dropless_mosaic needs a GPU: reported, not raised
    runner = runner_lib.Runner(dense_tflops=None, peak_tflops=None, deadline=math.inf, log=lambda s: None,
                         warmup=1, steps=3, seconds=0.0)
    record = runner.run(programs["a"])
    assert record["status"] == "ok" and record["steps_timed"] == 3 and len(record["step_ms_all"]) == 3
    assert record["tokens_per_step"] == 16 and record["model_tflops_per_device"] > 0
    assert record["peak_device_gib"] > 0 and record["tokens_dropped"] >= 0
    assert runner.run(programs["bad"])["status"].startswith("error: MoEError")
    assert jax.device_count() >= 1
