"""`dropless bench memory`: per-device accounting against the arithmetic from shapes, on abstract shapes only."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dropless.bench import harness, memory
from dropless.models import transformer
from tests.micro_config import micro_config


def test_report_matches_the_arithmetic_of_the_shapes():
    config = micro_config()
    report = memory.memory_report(config, jax.devices()[:1])
    total, _ = transformer.param_counts(config)
    parts = report["per_device_bytes"]
    assert parts["parameters"] == 4 * total  # float32 master weights, one device holds all
    assert parts["gradients"] == parts["parameters"]
    # AdamW's two float32 moments, and two int32 step counts (Adam's and the learning-rate schedule's)
    assert parts["optimizer_state"] == 2 * 4 * total + 8
    # The compiled program's arguments are exactly the train state plus the batch.
    model_state = 4 * config.moe.num_experts * (config.model.num_layers - config.model.first_dense_layers)
    batch = 4 * config.train.batch_size * (config.train.seq_len + 1)
    state = parts["parameters"] + parts["optimizer_state"] + model_state + 4  # + the int32 step
    assert report["compiled"]["argument"] == state + batch
    assert report["compiled"]["alias"] == state  # the state is donated: updated in place
    assert 0 < parts["activations"] and report["peak_device_bytes"] >= state + parts["activations"]
    assert report["in_host_memory_bytes"] == 0
    text = memory.format_report(report, device_memory=1e12)
    assert "optimizer state" in text and "fits" in text
    assert "DOES NOT FIT" in memory.format_report(report, device_memory=1024)


def test_residual_activations_grow_with_the_batch_and_shrink_with_remat():
    grows, fixed = memory.residual_bytes(micro_config())
    grows_double, fixed_double = memory.residual_bytes(micro_config(**{"train.batch_size": 4}))
    assert grows_double == 2 * grows and fixed_double == fixed
    assert fixed > 0  # bfloat16 copies of the weights, saved for the backward pass
    remat_grows, _ = memory.residual_bytes(micro_config(**{"train.remat": "full"}))
    assert 0 < remat_grows < grows / 2
    # Gradient accumulation keeps one microbatch's residuals alive, not the batch's.
    accumulated, _ = memory.residual_bytes(micro_config(**{"train.batch_size": 4, "train.grad_accum_steps": 2}))
    assert accumulated == grows


def test_sharding_memory_features_and_meshes_without_compiling():
    """Parameter and optimizer bytes per device follow the mesh, bf16 moments and host offloading."""
    def bytes_of(config, devices):
        setup = harness.build(config, devices)
        shapes, shardings = setup.state_shapes, setup.state_shardings
        return (memory.tree_bytes_per_device(shapes.params, shardings.params),
                memory.tree_bytes_per_device(shapes.opt_state, shardings.opt_state),
                memory.tree_bytes_per_device(shapes, shardings, "pinned_host"))

    params, opt_state, host = bytes_of(micro_config(), jax.devices()[:1])
    assert opt_state == 2 * params + 8 and host == 0
    _, bf16_state, _ = bytes_of(micro_config(**{"train.optimizer_moments_dtype": "bfloat16"}), jax.devices()[:1])
    assert bf16_state == params + 8
    _, offloaded, host = bytes_of(micro_config(**{"train.offload_optimizer": True}), jax.devices()[:1])
    assert host == offloaded == opt_state
    if jax.device_count() >= 2:
        sharded, _, _ = bytes_of(micro_config(**{"parallel.fsdp": 2, "parallel.data": 1}), jax.devices()[:2])
        assert params / 2 <= sharded < params  # nearly everything splits over fsdp; tiny vectors replicate


def test_cli_memory_rejects_devices_after_jax_started():
    from dropless.core.config import ConfigError

    jax.devices()  # the backend is up in this process
    with pytest.raises(ConfigError, match="--devices must be set before JAX starts"):
        memory.main(["--preset", "tiny", "--devices", "4"])
    np.testing.assert_equal(memory.GIB, 2**30)
