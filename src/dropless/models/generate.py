"""Sampling from a trained model: greedy, or temperature with nucleus (top-p) truncation.

The model has no KV cache here: each new token re-runs the forward over a fixed-length window, so one
compiled program serves every step. That is plenty for inspecting what a small model learned.

With `speculative` (a model with MTP modules, `model.mtp_layers` > 0) each forward pass also checks a token
drafted by the first MTP module and, when it holds, yields two tokens instead of one: the pass verifies the draft
at position L (the main model's distribution p there against the draft's q: greedy accepts when argmax p is the
draft; sampling accepts with probability min(1, p(d) / q(d)) and otherwise samples max(0, p - q), renormalised,
which leaves every token distributed exactly as p — Leviathan et al., 2023), then, the draft accepted, takes the
main model's token at L + 1 from the same pass. The MTP module then drafts the next token from the pass's final
hidden state (`transformer.mtp_logits`: one transformer block, the main model is not run again). A pass holds the
context, the draft and the token after it in one window, so it drafts while the context fits in the window's
first W - 2 positions; from there on each pass emits one token as plain decoding does, because the two tokens of a
pass would see windows that start at different tokens. Greedy output equals plain greedy decoding token for token.
"""

from __future__ import annotations

import functools
import json
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from dropless.core import config as config_lib
from dropless.core.config import Config, ConfigError
from dropless.models import transformer


def sample_next(logits_V: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """One token id from the final-position logits. temperature = 0 means greedy."""
    if temperature == 0.0:
        return jnp.argmax(logits_V).astype(jnp.int32)
    return jax.random.categorical(key, truncated_logits(logits_V, temperature, top_p)).astype(jnp.int32)


def truncated_logits(logits_V: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """The logits `sample_next` samples from at temperature > 0: scaled, and -inf outside the top-p nucleus.

    The largest logit is subtracted before scaling, so that a temperature near 0 (1e-40, or one below float32's
    range) gives 0 for the largest and -inf for the others, greedy's choice, where scaling first would overflow
    to inf - inf = NaN."""
    logits_V = logits_V.astype(jnp.float32)
    logits_V = (logits_V - jnp.max(logits_V)) / jnp.maximum(jnp.float32(temperature), jnp.finfo(jnp.float32).tiny)
    if top_p < 1.0:
        order_V = jnp.argsort(-logits_V)
        probs_sorted = jax.nn.softmax(logits_V[order_V])
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep_sorted = jnp.cumsum(probs_sorted) - probs_sorted < top_p
        keep_V = jnp.zeros_like(keep_sorted).at[order_V].set(keep_sorted)
        logits_V = jnp.where(keep_V, logits_V, -jnp.inf)
    return logits_V


def verify_draft(p_logits_V: jax.Array, q_logits_V: jax.Array, draft: jax.Array, key: jax.Array,
                 temperature: float, top_p: float) -> tuple[jax.Array, jax.Array]:
    """(accepted, token): whether the main model keeps `draft` (drawn from the draft logits q), and the token it
    emits at that position: the draft when accepted, else one from the corrected distribution (module docstring)."""
    if temperature == 0.0:
        token = jnp.argmax(p_logits_V).astype(jnp.int32)
        return token == draft, token
    p_V = jax.nn.softmax(truncated_logits(p_logits_V, temperature, top_p))
    q_V = jax.nn.softmax(truncated_logits(q_logits_V, temperature, top_p))
    accept_key, residual_key = jax.random.split(key)
    accepted = jax.random.uniform(accept_key) * q_V[draft] < p_V[draft]  # u < p(d) / q(d), q(d) > 0 as d ~ q
    residual_V = jnp.maximum(p_V - q_V, 0.0)
    residual_V = jnp.where(jnp.sum(residual_V) > 0, residual_V, p_V)  # p = q: a rejection never happens
    resampled = jax.random.categorical(residual_key, jnp.log(residual_V)).astype(jnp.int32)
    return accepted, jnp.where(accepted, draft, resampled)


# The window each step re-runs: the model's context, at most 1,024 tokens, so that one step of a long-context model
# stays cheap on the CPU (there is no KV cache).
MAX_WINDOW = 1024


def check_prompt(prompt_ids) -> None:
    """Refuse a prompt of no tokens (there is nothing to continue)."""
    if len(prompt_ids) == 0:
        raise ConfigError("The prompt holds no tokens; give a non-empty prompt.")


def check_sampling(temperature: float, top_p: float, max_new_tokens: int, seed: int) -> None:
    """Refuse a temperature that is not a finite number >= 0 (inf would sample uniformly; NaN), a top_p outside
    (0, 1], a token budget that is not an integer >= 0 (a negative one would read as none) and a seed that is not
    an integer within the 32 bits JAX's keys take (as train.seed). The names are the command's flags and
    generate()'s arguments alike."""
    real = all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in (temperature, top_p))
    if not (real and 0 <= temperature < math.inf and 0 < top_p <= 1):  # NaN fails both
        raise ConfigError(f"temperature must be a finite number >= 0 and top_p a number in (0, 1]; got "
                          f"{temperature!r} and {top_p!r}.")
    for name, value in (("max_new_tokens", max_new_tokens), ("seed", seed)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ConfigError(f"{name} must be an integer; got {value!r}.")
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0; got {max_new_tokens}.")
    if abs(seed) > config_lib.INT_LIMIT:
        raise ConfigError(f"seed={seed} is out of range; give an integer between -{config_lib.INT_LIMIT} and "
                          f"{config_lib.INT_LIMIT}.")


def check_speculative(config: Config, speculative: bool) -> None:
    """Refuse speculative decoding for a model without an MTP module (it has nothing to draft with)."""
    if speculative and not config.model.mtp_layers:
        raise ConfigError("Speculative decoding (--speculative, speculative=True) drafts tokens with the model's MTP "
                          "module, and this model has none (model.mtp_layers=0); generate without it.")


def prompt_list(prompt_ids, config: Config) -> list[int]:
    """`prompt_ids` (a list of ints, or a 1-D integer array such as `TextTokenizer.encode` returns) as a list of
    Python ints, each checked to be a token id of the model's vocabulary."""
    try:
        ids = np.asarray(prompt_ids)
    except ValueError:  # a ragged nest of lists, such as several prompts at once
        ids = np.asarray(prompt_ids, object)
    # The shape comes before the length: None, an int or an iterator has no len(), and neither is a prompt.
    if ids.ndim == 1:
        check_prompt(ids)
    vocab = config.model.vocab_size
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"The prompt must be one sequence of integer token ids (one prompt per call); got an "
                          f"array of shape {ids.shape} and dtype {ids.dtype}.")
    if ids.min() < 0 or ids.max() >= vocab:
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ConfigError(f"The prompt holds the token id {bad}, outside the model's vocabulary of {vocab} "
                          f"(model.vocab_size); encode it with the tokenizer the model was trained with.")
    return [int(i) for i in ids]


def context_window(config: Config) -> int:
    """How many of the latest tokens each forward pass of `generate` sees."""
    return min(config.model.max_seq_len, MAX_WINDOW)


def generate(config: Config, params, state, prompt_ids, *, max_new_tokens: int = 64,
             temperature: float = 0.8, top_p: float = 0.95, seed: int = 0,
             stop_id: int | None = None, speculative: bool = False, stats: dict | None = None) -> list[int]:
    """Continue `prompt_ids` (token ids: a list, or a 1-D integer array such as `TextTokenizer.encode` gives, each
    below model.vocab_size); returns only the new ids (stopping early at `stop_id`). `speculative`: draft with
    the MTP module (module docstring); `stats`, if given, receives the forward passes run and the drafts made
    and accepted."""
    check_sampling(temperature, top_p, max_new_tokens, seed)
    prompt_ids = prompt_list(prompt_ids, config)
    check_speculative(config, speculative)
    window = context_window(config)
    config = config.replace(**{"train.dtype": "float32"}) if jax.default_backend() == "cpu" else config
    if speculative:
        return _generate_speculative(config, params, state, prompt_ids, max_new_tokens, temperature, top_p, seed,
                                     stop_id, window, {} if stats is None else stats)

    new, forwards = _generate_plain(config, params, state, prompt_ids, max_new_tokens, temperature, top_p,
                                    jax.random.key(seed), stop_id, window)
    if stats is not None:
        stats.update(forwards=forwards, drafted=0, accepted=0)
    return new


def _generate_plain(config: Config, params, state, ids: list[int], count: int, temperature: float, top_p: float,
                    key: jax.Array, stop_id, window: int) -> tuple[list[int], int]:
    """Up to `count` ids after `ids`, one forward pass each over the last `window`, stopping before `stop_id` ->
    (the new ids, the passes run)."""
    next_token = _plain_step(json.dumps(config.to_dict(), sort_keys=True), temperature, top_p)
    ids, new = list(ids), []
    for _ in range(count):
        tokens_1S, length = _window(ids, window)
        key, sub = jax.random.split(key)
        token = int(next_token(params, state, tokens_1S, length, sub))
        if stop_id is not None and token == stop_id:
            return new, len(new) + 1
        ids.append(token)
        new.append(token)
    return new, len(new)


def _window(ids: list[int], window: int, free: int = 0, draft: int | None = None) -> tuple[jax.Array, int]:
    """([1, window] int32 tokens, context length): the last window - free ids from position 0, zeros after them,
    and `draft` (if any) at the first position after the context."""
    context = ids[-(window - free):]
    tokens_1S = np.zeros((1, window), np.int32)
    tokens_1S[0, :len(context)] = context
    if draft is not None:
        tokens_1S[0, len(context)] = draft
    return jnp.asarray(tokens_1S), len(context)


def _generate_speculative(config: Config, params, state, prompt_ids, max_new_tokens: int, temperature: float,
                          top_p: float, seed: int, stop_id, window: int, stats: dict) -> list[int]:
    """`generate` with MTP drafts: one jitted pass per iteration verifies the pending draft, emits one or two
    tokens and drafts the next (module docstring). The context keeps two free positions of the window: the
    draft's and the token after it; a longer context continues by plain decoding, whose windows a pass cannot
    reproduce."""
    step = _speculative_step(json.dumps(config.to_dict(), sort_keys=True), temperature, top_p)

    ids = list(prompt_ids)
    key = jax.random.key(seed)
    new: list[int] = []
    has_draft, draft = False, 0
    q_logits_V = jnp.zeros((config.model.vocab_size,), jnp.float32)
    forwards = drafted = accepted_total = 0
    while len(new) < max_new_tokens:
        if len(ids) > window - 2:
            rest, passes = _generate_plain(config, params, state, ids, max_new_tokens - len(new), temperature, top_p,
                                           key, stop_id, window)
            new += rest
            forwards += passes
            break
        tokens_1S, length = _window(ids, window, free=2, draft=draft if has_draft else None)
        key, sub = jax.random.split(key)
        accepted, first, second, next_draft, next_q = step(params, state, tokens_1S, length, has_draft, draft,
                                                           q_logits_V, sub)
        forwards += 1
        drafted += has_draft
        accepted = bool(accepted)
        accepted_total += accepted
        emitted = [int(first), int(second)] if accepted else [int(first)]
        stopped = False
        for token in emitted[:max_new_tokens - len(new)]:
            if stop_id is not None and token == stop_id:
                stopped = True
                break
            ids.append(token)
            new.append(token)
        if stopped:
            break
        has_draft, draft, q_logits_V = True, int(next_draft), next_q
    stats.update(forwards=forwards, drafted=drafted, accepted=accepted_total)
    return new


@functools.lru_cache(maxsize=8)
def _plain_step(config_json: str, temperature: float, top_p: float):
    """The jitted next-token program, one per (config, sampling settings): later calls reuse its compilation.
    (Config holds a dict, model.rope_scaling, so it is keyed by its JSON, as convert's forward is.)"""
    config = config_lib.from_dict(json.loads(config_json))
    @jax.jit
    def next_token(params, state, tokens_1S, length, key):
        logits_1SV, _ = transformer.forward(params, state, tokens_1S, config)
        return sample_next(logits_1SV[0, length - 1], key, temperature, top_p)

    return next_token


@functools.lru_cache(maxsize=8)
def _speculative_step(config_json: str, temperature: float, top_p: float):
    """The jitted speculative iteration: verify the pending draft, emit one or two tokens, draft the next (keyed
    as `_plain_step`)."""
    config = config_lib.from_dict(json.loads(config_json))
    @jax.jit
    def step(params, state, tokens_1S, length, has_draft, draft, q_logits_V, key):
        logits_1SV, aux = transformer.forward(params, state, tokens_1S, config, hidden=True)
        k_verify, k_first, k_second, k_draft = jax.random.split(key, 4)
        accepted, verified = verify_draft(logits_1SV[0, length - 1], q_logits_V, draft, k_verify, temperature, top_p)
        plain = sample_next(logits_1SV[0, length - 1], k_first, temperature, top_p)
        accepted = accepted & has_draft
        first = jnp.where(has_draft, verified, plain)  # the token at position `length`
        second = sample_next(logits_1SV[0, length], k_second, temperature, top_p)  # at length + 1, if accepted
        # The tokens as emitted (the MTP module at position i reads token i + 1); its depth-1 logits at `last`, the
        # position before the last emitted token, draft the token after that one.
        tokens_1S = tokens_1S.at[0, length].set(first).at[0, length + 1].set(jnp.where(accepted, second, 0))
        last = jnp.where(accepted, length, length - 1)
        draft_logits_V = transformer.mtp_logits(params, state, tokens_1S, aux["hidden"], config)[0][0, last]
        new_draft = sample_next(draft_logits_V, k_draft, temperature, top_p)
        return accepted, first, second, new_draft, draft_logits_V

    return step
