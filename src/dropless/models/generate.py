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
hidden states (`transformer.mtp_forward_cached`: one transformer block with its own KV cache; the main model is
not run again). A pass runs over two positions, the last token and the draft, against the caches; a rejected
draft's position is written again by the next pass. Where the second token of a pass would see a shifted context,
a pass fills the caches again from the context the next token sees, as plain decoding does, so every token has
the context plain decoding gives it. Greedy output equals plain greedy decoding token for token.
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
    return draw(logits_V, key, temperature, top_p)[0]


def draw(logits_V: jax.Array, key: jax.Array, temperature: float, top_p: float) -> tuple[jax.Array, jax.Array]:
    """(`sample_next`'s token, the logits it was drawn from: `truncated_logits`, or the logits as given when greedy),
    so that a draft's distribution is truncated once (`verify_draft` reads it)."""
    if temperature == 0.0:
        return jnp.argmax(logits_V).astype(jnp.int32), logits_V
    truncated_V = truncated_logits(logits_V, temperature, top_p)
    return jax.random.categorical(key, truncated_V).astype(jnp.int32), truncated_V


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


def verify_draft(p_logits_V: jax.Array, q_truncated_V: jax.Array, draft: jax.Array, key: jax.Array,
                 temperature: float, top_p: float) -> tuple[jax.Array, jax.Array]:
    """(accepted, token): whether the main model keeps `draft` (drawn from the draft's truncated logits, as `draw`
    returns them; unused when greedy), and the token it emits at that position: the draft when accepted, else one
    from the corrected distribution (module docstring)."""
    if temperature == 0.0:
        token = jnp.argmax(p_logits_V).astype(jnp.int32)
        return token == draft, token
    p_V = jax.nn.softmax(truncated_logits(p_logits_V, temperature, top_p))
    q_V = jax.nn.softmax(q_truncated_V)
    accept_key, residual_key = jax.random.split(key)
    accepted = jax.random.uniform(accept_key) * q_V[draft] < p_V[draft]  # u < p(d) / q(d), q(d) > 0 as d ~ q
    residual_V = jnp.maximum(p_V - q_V, 0.0)
    residual_V = jnp.where(jnp.sum(residual_V) > 0, residual_V, p_V)  # p = q: a rejection never happens
    resampled = jax.random.categorical(residual_key, jnp.log(residual_V)).astype(jnp.int32)
    return accepted, jnp.where(accepted, draft, resampled)


# The shortest padded length of a prompt or a cache (`_padded`).
MIN_PADDED = 16


def check_prompt(prompt_ids) -> None:
    """Refuse a prompt of no tokens (there is nothing to continue)."""
    if len(prompt_ids) == 0:
        raise ConfigError("The prompt holds no tokens; give a non-empty prompt.")


def check_sampling(temperature: float, top_p: float, max_new_tokens: int, seed: int, *, flags: bool = False) -> None:
    """Refuse a temperature that is not a finite number >= 0 (inf would sample uniformly; NaN), a top_p outside
    (0, 1], a token budget that is not an integer >= 0 (a negative one would read as none) and a seed that is not
    an integer within the 32 bits JAX's keys take (as train.seed). The messages name generate()'s arguments, or
    with `flags` the command's flags (--top-p for top_p)."""
    def name(argument: str) -> str:
        return "--" + argument.replace("_", "-") if flags else argument

    real = all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in (temperature, top_p))
    if not (real and 0 <= temperature < math.inf and 0 < top_p <= 1):  # NaN fails both
        raise ConfigError(f"{name('temperature')} must be a finite number >= 0 and {name('top_p')} a number in "
                          f"(0, 1]; got {temperature!r} and {top_p!r}.")
    for argument, value in (("max_new_tokens", max_new_tokens), ("seed", seed)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ConfigError(f"{name(argument)} must be an integer; got {value!r}.")
    if max_new_tokens < 0:
        raise ConfigError(f"{name('max_new_tokens')} must be >= 0; got {max_new_tokens}.")
    if abs(seed) > config_lib.INT_LIMIT:
        raise ConfigError(f"{name('seed')}={seed} is out of range; give an integer between -{config_lib.INT_LIMIT} "
                          f"and {config_lib.INT_LIMIT}.")


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


def context_start(length: int, context: int) -> int:
    """Where the tokens that predict the next one start in a sequence of `length`: 0 while it fits in `context`
    (model.max_seq_len), then moving in steps of half a context, so that they number between context // 2 and
    `context` (the module docstring's context shift)."""
    half = max(context // 2, 1)
    return 0 if length <= context else half * (1 + (length - context - 1) // half)


def _padded(length: int, limit: int) -> int:
    """The compiled length for `length` positions: the next power of two, at least MIN_PADDED, at most `limit`."""
    return min(limit, max(MIN_PADDED, 1 << (length - 1).bit_length()))


def generation_config(config: Config) -> Config:
    """The config generation runs: float32 on a CPU (whose bf16 matmuls are slower and gain nothing), the given one
    elsewhere."""
    return config.replace(**{"train.dtype": "float32"}) if jax.default_backend() == "cpu" else config


def _capacity(longest: int, context: int) -> int:
    """The cache length for sequences of up to `longest` tokens: padded (`_padded`) while they fit in `context`,
    else the whole context (`context_start`'s shifts keep every window within it)."""
    return context if context_start(longest, context) else _padded(longest, context)


def _context(ids: list[int], start: int, capacity: int) -> tuple[np.ndarray, int]:
    """(ids[start:] as [1, padded length] int32 with zeros after them, their count): what a cache fill reads."""
    window = ids[start:]
    tokens_1S = np.zeros((1, _padded(len(window), capacity)), np.int32)
    tokens_1S[0, :len(window)] = window
    return tokens_1S, len(window)


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
    config = generation_config(config)
    params = transformer.inference_weights(params, config)
    if speculative:
        return _generate_speculative(config, params, state, prompt_ids, max_new_tokens, temperature, top_p, seed,
                                     stop_id, {} if stats is None else stats)

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
    capacity = _capacity(len(ids) + count - 1, context)  # the longest sequence a new token is predicted from
    fill, decode = _cached_steps(json.dumps(config.to_dict(), sort_keys=True), temperature, top_p)
    ids, new = list(ids), []
    cache, start, token = None, -1, None
    for _ in range(count):
        if context_start(len(ids), context) != start:  # the first token, or a context shift
            start = context_start(len(ids), context)
            tokens_1S, length = _context(ids, start, capacity)
            token, cache, key = fill(params, state, tokens_1S, length, key, capacity=capacity)
        else:  # the last token (still on the device) at its position in the cache
            token, cache, key = decode(params, state, cache, token, len(ids) - 1 - start, key)
        if stop_id is not None and int(token) == stop_id:
            return new, len(new) + 1
        ids.append(int(token))
        new.append(ids[-1])
    return new, len(new)


def _generate_speculative(config: Config, params, state, prompt_ids, max_new_tokens: int, temperature: float,
                          top_p: float, seed: int, stop_id, stats: dict) -> list[int]:
    """`generate` with MTP drafts (module docstring): a pass that fills the caches from the context emits one token
    and drafts the next; each further pass verifies the pending draft, emits one or two tokens and drafts again.
    A verifying pass predicts two tokens from one context, so where the second would see a shifted context
    (`context_start`), the caches are filled again from the context the next token sees."""
    context = config.model.max_seq_len
    capacity = _capacity(len(prompt_ids) + max_new_tokens, context)  # a pass writes the position after the last
    fill, verify = _speculative_steps(json.dumps(config.to_dict(), sort_keys=True), temperature, top_p)
    ids, new = list(prompt_ids), []
    key, last, draft, cache, mtp_cache, q_truncated_V = jax.random.key(seed), None, None, None, None, None
    start, forwards, drafted, accepted_total = -1, 0, 0, 0
    while len(new) < max_new_tokens:
        if context_start(len(ids), context) != start or len(ids) + 1 - start > capacity:
            start = context_start(len(ids), context)
            tokens_1S, length = _context(ids, start, capacity)
            last, draft, q_truncated_V, cache, mtp_cache, key = fill(params, state, tokens_1S, length, key,
                                                                  capacity=capacity)
            emitted = [int(last)]
        else:  # the last token and the draft after it, at the last token's position (both still on the device)
            accepted, first, last, draft, q_truncated_V, cache, mtp_cache, key = verify(
                params, state, cache, mtp_cache, last, draft, len(ids) - 1 - start, q_truncated_V, key)
            drafted += 1
            accepted_total += bool(accepted)
            emitted = [int(first), int(last)] if accepted else [int(first)]
        forwards += 1
        for token in emitted[:max_new_tokens - len(new)]:
            if stop_id is not None and token == stop_id:
                stats.update(forwards=forwards, drafted=drafted, accepted=accepted_total)
                return new
            ids.append(token)
            new.append(token)
    stats.update(forwards=forwards, drafted=drafted, accepted=accepted_total)
    return new


@functools.lru_cache(maxsize=8)
def _cached_steps(config_json: str, temperature: float, top_p: float):
    """The jitted programs of KV-cache decoding, one pair per (config, sampling settings), so that later calls reuse
    their compilations (Config holds a dict, model.rope_scaling, so it is keyed by its JSON, as convert's forward
    is): `fill`, a new cache of `capacity` positions holding a context of `length` tokens (padded) and the token
    after them; `decode`, one token more at `position`, the cache updated in place. Each takes the sampling key and
    returns the next one, so a token costs one dispatch."""
    config = config_lib.from_dict(json.loads(config_json))

    @functools.partial(jax.jit, static_argnames="capacity")
    def fill(params, state, tokens_1S, length, key, *, capacity):
        key, sub = jax.random.split(key)
        cache = transformer.init_cache(config, 1, capacity)
        logits_1SV, cache = transformer.forward_cached(params, state, tokens_1S, cache, 0, config)
        return sample_next(logits_1SV[0, length - 1], sub, temperature, top_p), cache, key

    @functools.partial(jax.jit, donate_argnames="cache")
    def decode(params, state, cache, token, position, key):
        key, sub = jax.random.split(key)
        logits_11V, cache = transformer.forward_cached(params, state, token.reshape(1, 1), cache, position, config)
        return sample_next(logits_11V[0, 0], sub, temperature, top_p), cache, key

    return fill, decode


@functools.lru_cache(maxsize=8)
def _speculative_steps(config_json: str, temperature: float, top_p: float):
    """The jitted programs of speculative decoding (keyed as `_cached_steps`, and as theirs, each takes the sampling
    key and returns the next): `fill`, the caches of the main model and of the first MTP module's block from a
    context of `length` tokens, the token after it and a draft of the one after that; `verify`, the pass over the
    last token and its draft that keeps the draft or replaces it, emits the token after an accepted draft, and
    drafts again."""
    config = config_lib.from_dict(json.loads(config_json))

    @functools.partial(jax.jit, static_argnames="capacity")
    def fill(params, state, tokens_1S, length, key, *, capacity):
        key, k_first, k_draft = jax.random.split(key, 3)
        cache = transformer.init_cache(config, 1, capacity)
        logits_1SV, cache, hidden_1SD = transformer.forward_cached(params, state, tokens_1S, cache, 0, config,
                                                                   hidden=True)
        first = sample_next(logits_1SV[0, length - 1], k_first, temperature, top_p)
        # The MTP module at position i reads token i + 1: the context shifted left, then the token just sampled.
        next_1S = jnp.roll(tokens_1S, -1, axis=1).at[0, length - 1].set(first)
        mtp_cache = transformer.init_mtp_cache(config, 1, capacity)
        draft_logits_1SV, mtp_cache = transformer.mtp_forward_cached(params, state, next_1S, hidden_1SD, mtp_cache,
                                                                     0, config)
        draft, q_truncated_V = draw(draft_logits_1SV[0, length - 1], k_draft, temperature, top_p)
        return first, draft, q_truncated_V, cache, mtp_cache, key

    @functools.partial(jax.jit, donate_argnames=("cache", "mtp_cache"))
    def verify(params, state, cache, mtp_cache, last, draft, position, q_truncated_V, key):
        """-> (accepted, the token at the draft's position, the last token emitted, the next draft, the logits it
        was drawn from (`draw`), the caches, the next key)."""
        key, k_verify, k_second, k_draft = jax.random.split(key, 4)
        tokens_12 = jnp.stack([last, draft])[None]
        logits_12V, cache, hidden_12D = transformer.forward_cached(params, state, tokens_12, cache, position, config,
                                                                   hidden=True)
        accepted, first = verify_draft(logits_12V[0, 0], q_truncated_V, draft, k_verify, temperature, top_p)
        second = sample_next(logits_12V[0, 1], k_second, temperature, top_p)  # after the draft, if it holds
        # Rejected, the draft's position holds the wrong token in both caches; the next pass writes it again.
        next_12 = jnp.stack([first, jnp.where(accepted, second, 0)])[None]
        draft_logits_12V, mtp_cache = transformer.mtp_forward_cached(params, state, next_12, hidden_12D, mtp_cache,
                                                                     position, config)
        # At the last emitted token's predecessor: its MTP logits score the token after the last.
        new_draft, q_truncated_V = draw(draft_logits_12V[0, accepted.astype(jnp.int32)], k_draft, temperature, top_p)
        return (accepted, first, jnp.where(accepted, second, first), new_draft, q_truncated_V, cache, mtp_cache,
                key)

    return fill, verify
