"""Sampling from a trained model: greedy, or temperature with nucleus (top-p) truncation.

The model has no KV cache here: each new token re-runs the forward over a fixed-length window, so one
compiled program serves every step. That is plenty for inspecting what a small model learned.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dropless.core.config import Config, ConfigError
from dropless.models import transformer


def sample_next(logits_V: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """One token id from the final-position logits. temperature = 0 means greedy."""
    if temperature == 0.0:
        return jnp.argmax(logits_V).astype(jnp.int32)
    logits_V = logits_V / temperature
    if top_p < 1.0:
        order_V = jnp.argsort(-logits_V)
        probs_sorted = jax.nn.softmax(logits_V[order_V])
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep_sorted = jnp.cumsum(probs_sorted) - probs_sorted < top_p
        keep_V = jnp.zeros_like(keep_sorted).at[order_V].set(keep_sorted)
        logits_V = jnp.where(keep_V, logits_V, -jnp.inf)
    return jax.random.categorical(key, logits_V).astype(jnp.int32)


def generate(config: Config, params, state, prompt_ids: list[int], *, max_new_tokens: int = 64,
             temperature: float = 0.8, top_p: float = 0.95, seed: int = 0,
             stop_id: int | None = None) -> list[int]:
    """Continue `prompt_ids`; returns only the new ids (stopping early at `stop_id`)."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ConfigError(f"--temperature must be >= 0 and --top-p in (0, 1]; got {temperature} and {top_p}.")
    if not prompt_ids:
        raise ConfigError("The prompt encodes to no tokens; give a non-empty --prompt.")
    window = config.model.max_seq_len if config.model.max_seq_len <= 1024 else 1024
    config = config.replace(**{"train.dtype": "float32"}) if jax.default_backend() == "cpu" else config

    @jax.jit
    def next_token(params, state, tokens_1S, length, key):
        logits_1SV, _ = transformer.forward(params, state, tokens_1S, config)
        return sample_next(logits_1SV[0, length - 1], key, temperature, top_p)

    ids = list(prompt_ids)
    key = jax.random.key(seed)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = ids[-window:]
        tokens_1S = np.zeros((1, window), np.int32)
        tokens_1S[0, :len(context)] = context
        key, sub = jax.random.split(key)
        token = int(next_token(params, state, jnp.asarray(tokens_1S), len(context), sub))
        if stop_id is not None and token == stop_id:
            break
        ids.append(token)
        new.append(token)
    return new
