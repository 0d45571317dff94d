"""A few float32 training steps on random tokens, for tests/test_train_parallel.py: the losses, parameter checksums
and dropped tokens of the step `dropless train` runs. In a multi-process run each process feeds its own rows of
the global batch."""

from __future__ import annotations

# Tiny preset, shorter sequences: the same model on the same batch, compiled and run in seconds on a CPU.
OVERRIDES = {"train.dtype": "float32", "train.seq_len": 32, "train.warmup_steps": 1, "train.learning_rate": 1e-2}
STEPS = 4


def train_losses(overrides: dict, devices=None) -> dict:
    """Losses of STEPS steps of the tiny preset (+ overrides) on `devices` (default: every process's)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dropless.core import config as config_lib
    from dropless.train import setup as setup_lib

    config = config_lib.load_preset("tiny").replace(**{**OVERRIDES, **overrides})
    tc = config.train
    setup = setup_lib.build(config, devices)  # the very step `dropless train` runs
    state, step, mesh = setup_lib.init_state(setup), setup.step, setup.mesh
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (STEPS, tc.batch_size, tc.seq_len + 1))
    if config.data.document_mask:  # documents of ~10 tokens
        tokens[np.random.default_rng(1).random(tokens.shape) < 0.1] = config.data.eos_id
    rows = tc.batch_size // jax.process_count()
    losses, dropped = [], 0
    for batch in tokens.astype(np.int32):
        mine = batch[jax.process_index() * rows:(jax.process_index() + 1) * rows]
        global_batch = jax.make_array_from_process_local_data(setup.batch_sharding, mine, batch.shape)
        state, metrics = step(state, global_batch)
        losses.append(float(metrics["loss"]))
        dropped += int(metrics["tokens_dropped"])
    # Sums over every parameter and router bias: any difference in any update shows here. One program for all.
    sums = jax.jit(lambda leaves: [jnp.sum(jnp.abs(leaf)) for leaf in leaves])
    checksums = [float(total) for total in sums(jax.tree.leaves((state.params, state.model_state)))]
    return {"losses": losses, "checksums": checksums, "tokens_dropped": dropped, "devices": mesh.size,
            "processes": jax.process_count()}
