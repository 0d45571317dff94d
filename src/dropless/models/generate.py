"""Sampling from a trained model: greedy, or temperature with nucleus (top-p) truncation.

Decoding keeps a KV cache (`transformer.forward_cached`): one pass over the prompt fills it, then each new token
is one pass over that token alone. The next token of a sequence of n tokens is predicted from its last n - s tokens,
s = `context_start(n, C)`, C = model.max_seq_len: all of them while they fit in C, then, each time the sequence
outgrows C, the last half of C, refilled in one pass (a context shift), so every token sees at least C/2 and at most
C tokens and the cache never holds more than C positions. Prompts and caches are padded to powers of two (at least
16, at most C), so a handful of compiled programs serve every length.

With `speculative` (a model with MTP modules, `model.mtp_layers` > 0) each forward pass also checks a token
drafted by the first MTP module and, when it holds, yields two tokens instead of one: the pass verifies the draft
at position L (the main model's distribution p there against the draft's q: greedy accepts when argmax p is the
draft; sampling accepts with probability min(1, p(d) / q(d)) and otherwise samples max(0, p - q), renormalised,
which leaves every token distributed exactly as p — Leviathan et al., 2023), then, the draft accepted, takes the
main model's token at L + 1 from the same pass. The MTP module then drafts the next token from the pass's final
hidden state (`transformer.mtp_logits`: one transformer block, the main model is not run again). These passes run
without a cache over a window of W = min(C, 1,024) positions holding the context, the draft and the token after it,
so they draft while the context fits in the window's first W - 2 positions; from there on the cached decoding
above continues, from the same contexts. Greedy output equals plain greedy decoding token for token.
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


# The window of a speculative pass (it runs without a cache): the model's context, at most 1,024 tokens.
MAX_WINDOW = 1024
# The shortest padded length of a prompt or a cache (`_padded`).
MIN_PADDED = 16


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
    """How many positions a speculative pass holds (the module docstring's W)."""
    return min(config.model.max_seq_len, MAX_WINDOW)


def context_start(length: int, context: int) -> int:
    """Where the tokens that predict the next one start in a sequence of `length`: 0 while it fits in `context`
    (model.max_seq_len), then moving in steps of half a context, so that they number between context // 2 and
    `context` (the module docstring's context shift)."""
    half = max(context // 2, 1)
    return 0 if length <= context else half * (1 + (length - context - 1) // half)


def _padded(length: int, limit: int) -> int:
    """The compiled length for `length` positions: the next power of two, at least MIN_PADDED, at most `limit`."""
    return min(limit, max(MIN_PADDED, 1 << (length - 1).bit_length()))


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
    config = config.replace(**{"train.dtype": "float32"}) if jax.default_backend() == "cpu" else config
    if speculative:
        return _generate_speculative(config, params, state, prompt_ids, max_new_tokens, temperature, top_p, seed,
                                     stop_id, context_window(config), {} if stats is None else stats)

    new, forwards = _generate_cached(config, params, state, prompt_ids, max_new_tokens, temperature, top_p,
                                     jax.random.key(seed), stop_id)
    if stats is not None:
        stats.update(forwards=forwards, drafted=0, accepted=0)
    return new


def _generate_cached(config: Config, params, state, ids: list[int], count: int, temperature: float, top_p: float,
                     key: jax.Array, stop_id) -> tuple[list[int], int]:
    """Up to `count` ids after `ids` by KV-cache decoding (module docstring), stopping before `stop_id` -> (the
    new ids, the passes run)."""
    context = config.model.max_seq_len
    longest = len(ids) + count - 1  # the longest sequence a new token is predicted from
    capacity = context if context_start(longest, context) else _padded(longest, context)
    fill, decode = _cached_steps(json.dumps(config.to_dict(), sort_keys=True), temperature, top_p)
    ids, new = list(ids), []
    cache, start = None, -1
    for _ in range(count):
        key, sub = jax.random.split(key)
        if context_start(len(ids), context) != start:  # the first token, or a context shift
            start = context_start(len(ids), context)
            window = ids[start:]
            tokens_1S = np.zeros((1, _padded(len(window), capacity)), np.int32)
            tokens_1S[0, :len(window)] = window
            token, cache = fill(params, state, jnp.asarray(tokens_1S), len(window), sub, capacity=capacity)
        else:  # the last token at its position in the cache
            token, cache = decode(params, state, cache, jnp.asarray([[ids[-1]]], jnp.int32), len(ids) - 1 - start,
                                  sub)
        token = int(token)
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
    draft's and the token after it; a longer context continues by cached decoding (`_generate_cached`)."""
    step = _speculative_step(json.dumps(config.to_dict(), sort_keys=True), temperature, top_p)

    ids = list(prompt_ids)
    key = jax.random.key(seed)
    new: list[int] = []
    has_draft, draft = False, 0
    q_logits_V = jnp.zeros((config.model.vocab_size,), jnp.float32)
    forwards = drafted = accepted_total = 0
    while len(new) < max_new_tokens:
        if len(ids) > window - 2:
            rest, passes = _generate_cached(config, params, state, ids, max_new_tokens - len(new), temperature,
                                            top_p, key, stop_id)
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
def _cached_steps(config_json: str, temperature: float, top_p: float):
    """The jitted programs of KV-cache decoding, one pair per (config, sampling settings), so that later calls reuse
    their compilations (Config holds a dict, model.rope_scaling, so it is keyed by its JSON, as convert's forward
    is): `fill`, a new cache of `capacity` positions holding a context of `length` tokens (padded) and the token
    after them; `decode`, one token more at `position`, the cache updated in place."""
    config = config_lib.from_dict(json.loads(config_json))

    @functools.partial(jax.jit, static_argnames="capacity")
    def fill(params, state, tokens_1S, length, key, *, capacity):
        cache = transformer.init_cache(config, 1, capacity)
        logits_1SV, cache = transformer.forward_cached(params, state, tokens_1S, cache, 0, config)
        return sample_next(logits_1SV[0, length - 1], key, temperature, top_p), cache

    @functools.partial(jax.jit, donate_argnames="cache")
    def decode(params, state, cache, token_11, position, key):
        logits_11V, cache = transformer.forward_cached(params, state, token_11, cache, position, config)
        return sample_next(logits_11V[0, 0], key, temperature, top_p), cache

    return fill, decode


@functools.lru_cache(maxsize=8)
def _speculative_step(config_json: str, temperature: float, top_p: float):
    """The jitted speculative iteration: verify the pending draft, emit one or two tokens, draft the next (keyed
    as `_cached_steps`)."""
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
