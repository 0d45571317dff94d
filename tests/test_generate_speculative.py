"""Speculative decoding with the MTP module (`dropless generate --speculative`): the acceptance rule leaves every
token distributed as the main model's, greedy output equals plain greedy decoding, and accepted drafts yield two
tokens per forward pass."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.config import ConfigError
from dropless.models import generate as gen
from dropless.models import transformer
from tests.test_models_mtp import CONFIG

MODEL = CONFIG.replace(**{"model.mtp_layers": 1, "model.max_seq_len": 32})


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_verified_drafts_leave_tokens_distributed_as_the_main_model(temperature, top_p):
    p_logits = jnp.asarray([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    q_logits = jnp.asarray([0.0, 2.0, -1.0, 1.0, 0.5, 0.0])  # a poor draft: most of its mass where p has little

    def one(key):
        k_draft, k_verify = jax.random.split(key)
        draft = gen.sample_next(q_logits, k_draft, temperature, top_p)
        return gen.verify_draft(p_logits, q_logits, draft, k_verify, temperature, top_p)

    n = 200_000
    accepted, tokens = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), n))
    got = np.bincount(np.asarray(tokens), minlength=6) / n
    want = np.asarray(jax.nn.softmax(gen.truncated_logits(p_logits, temperature, top_p)))
    np.testing.assert_allclose(got, want, atol=4 * np.sqrt(0.25 / n))
    assert 0.05 < float(np.mean(accepted)) < 0.95  # both branches ran
    q = np.asarray(jax.nn.softmax(gen.truncated_logits(q_logits, temperature, top_p)))
    assert np.isclose(np.mean(accepted), np.minimum(q, want).sum(), atol=0.01)  # the acceptance rate is sum min(p, q)


@pytest.fixture(scope="module")
def model():
    params = jax.jit(lambda key: transformer.init_params(key, MODEL))(jax.random.key(3))
    return params, transformer.init_state(MODEL)


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 1e-300])
def test_a_temperature_near_zero_samples_greedily_instead_of_from_nan(temperature):
    """Scaled first, logits / 1e-40 overflow to inf in float32 and the softmax of inf - inf is NaN (every draw
    then token 0); shifted by the largest logit first, the nucleus is the argmax alone."""
    logits = jnp.asarray([0.5, 3.0, -1.0, 2.9], jnp.float32)
    for top_p in (1.0, 0.9):
        truncated = gen.truncated_logits(logits, temperature, top_p)
        assert not np.isnan(np.asarray(truncated)).any()
        assert np.asarray(jax.nn.softmax(truncated)).tolist() == [0.0, 1.0, 0.0, 0.0]
        assert {int(gen.sample_next(logits, jax.random.key(seed), temperature, top_p)) for seed in range(8)} == {1}


def test_speculative_greedy_equals_plain_greedy(model):
    params, state = model
    prompt = [5, 9, 2, 7]
    plain = gen.generate(MODEL, params, state, prompt, max_new_tokens=12, temperature=0.0)
    stats: dict = {}
    fast = gen.generate(MODEL, params, state, prompt, max_new_tokens=12, temperature=0.0, speculative=True,
                        stats=stats)
    assert fast == plain and len(plain) == 12
    assert stats["drafted"] == stats["forwards"] - 1 and stats["forwards"] == 12 - stats["accepted"]


def test_accepted_drafts_give_two_tokens_per_pass(model, monkeypatch, request):
    """With an oracle in place of the MTP module (the main model's own next-token logits), every draft holds: the
    output is plain greedy's, in half the forward passes."""
    params, state = model

    def oracle(params, state, tokens_BS, hidden_BSD, config):
        logits_BSV, _ = transformer.forward(params, state, tokens_BS, config)
        return (jnp.roll(logits_BSV, -1, axis=1),)  # position i: the main model's prediction of token i + 2

    plain = gen.generate(MODEL, params, state, [1, 2, 3], max_new_tokens=11, temperature=0.0)
    monkeypatch.setattr(transformer, "mtp_logits", oracle)
    gen._speculative_step.cache_clear()  # compiled programs are cached per config: trace one with the oracle
    request.addfinalizer(gen._speculative_step.cache_clear)
    stats: dict = {}
    fast = gen.generate(MODEL, params, state, [1, 2, 3], max_new_tokens=11, temperature=0.0, speculative=True,
                        stats=stats)
    assert fast == plain
    assert stats["accepted"] == stats["drafted"] == 5 and stats["forwards"] == 6


def test_speculative_sampling_stops_at_the_stop_token_and_the_budget(model):
    params, state = model
    stats: dict = {}
    out = gen.generate(MODEL, params, state, [4, 4], max_new_tokens=7, temperature=1.0, seed=1, speculative=True,
                       stats=stats)
    assert len(out) == 7 and stats["forwards"] <= 7
    stop = out[3]
    cut = gen.generate(MODEL, params, state, [4, 4], max_new_tokens=7, temperature=1.0, seed=1, speculative=True,
                       stop_id=stop)
    assert cut == out[:out.index(stop)]


@pytest.mark.parametrize("seed", range(4))
def test_the_first_pass_has_no_draft_to_accept(model, seed):
    """The first pass verifies nothing (the draft slot holds a placeholder): it emits one token and drafts the next,
    whatever the placeholder's verification would have said."""
    params, state = model
    stats: dict = {}
    out = gen.generate(MODEL, params, state, [4, 4], max_new_tokens=2, temperature=1.0, seed=seed, speculative=True,
                       stats=stats)
    assert len(out) == 2 and stats["forwards"] == 2 and stats["drafted"] == 1


def test_speculative_needs_an_mtp_module(model):
    params, state = model
    plain = MODEL.replace(**{"model.mtp_layers": 0})
    with pytest.raises(ConfigError, match="model.mtp_layers=0"):
        gen.generate(plain, params, state, [1], speculative=True)


@pytest.mark.parametrize("speculative", [False, True])
def test_generate_with_yarn_rope_scaling(model, speculative):
    """A config with a dict field (model.rope_scaling, as every imported DeepSeek-V3 has) keys the compiled-step
    cache by value: generating works, and a second call reuses the first's program."""
    params, state = model
    yarn = MODEL.replace(**{"model.rope_scaling": {"type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 16}})
    first = gen.generate(yarn, params, state, [5, 9, 2], max_new_tokens=3, temperature=0.0, speculative=speculative)
    again = gen.generate(yarn.replace(), params, state, [5, 9, 2], max_new_tokens=3, temperature=0.0,
                         speculative=speculative)
    assert len(first) == 3 and again == first
    cached = gen._speculative_step if speculative else gen._cached_steps
    assert cached.cache_info().hits >= 1


def test_top_p_keeps_the_smallest_prefix_that_reaches_its_mass():
    """Four equal logits: each token has exactly a quarter of the mass, so top_p = 0.5 is reached by two tokens."""
    for top_p, kept in ((0.5, 2), (0.3, 2), (0.25, 1), (0.76, 4)):
        truncated = np.asarray(gen.truncated_logits(jnp.zeros(4), 1.0, top_p))
        assert np.isfinite(truncated).sum() == kept, (top_p, truncated)


def test_top_p_truncates_the_tempered_distribution():
    """The nucleus is taken after the temperature (as Hugging Face's warpers run): probabilities 0.5, 0.3, 0.2 at
    temperature 0.5 become about 0.66, 0.24, 0.11, so top_p = 0.6 keeps the first token alone and 0.85 the first
    two, whose sampled distribution is the tempered one renormalised (untempered, 0.6 and 0.85 keep two and three)."""
    logits = jnp.log(jnp.asarray([0.5, 0.3, 0.2]))
    tempered = np.asarray(jax.nn.softmax(logits / 0.5))
    assert np.isfinite(np.asarray(gen.truncated_logits(logits, 0.5, 0.6))).tolist() == [True, False, False]
    truncated = gen.truncated_logits(logits, 0.5, 0.85)
    assert np.isfinite(np.asarray(truncated)).tolist() == [True, True, False]
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(truncated))[:2], tempered[:2] / tempered[:2].sum(),
                               rtol=1e-6)


def test_plain_generation_stops_before_the_stop_token_and_counts_its_pass(model):
    params, state = model
    stats: dict = {}
    out = gen.generate(MODEL, params, state, [4, 4], max_new_tokens=7, temperature=1.0, seed=1, stats=stats)
    assert len(out) == 7 and stats == {"forwards": 7, "drafted": 0, "accepted": 0}
    stop = out[3]
    cut = gen.generate(MODEL, params, state, [4, 4], max_new_tokens=7, temperature=1.0, seed=1, stop_id=stop,
                       stats=stats)
    assert cut == out[:out.index(stop)] and stats["forwards"] == len(cut) + 1  # the pass that drew the stop token


def _summing(params, state, tokens_BS, config, **options):
    """A stand-in for the main model: its prediction after each position is the sum of the tokens up to there (modulo
    the vocabulary), so that it changes with every token of the context."""
    vocab = config.model.vocab_size
    return (jax.nn.one_hot(jnp.cumsum(tokens_BS, axis=1) % vocab, vocab),
            {"hidden": jnp.zeros((*tokens_BS.shape, config.model.hidden_size))})


def summing_cached(monkeypatch, request):
    """`_summing` for KV-cache decoding: the cache holds the tokens, and the prediction after a position is the sum
    of the cache up to there, so it sees exactly the context the cache was filled with."""
    def init_cache(config, batch, length):
        return {"tokens": jnp.zeros((batch, length), jnp.int32)}

    def forward_cached(params, state, tokens_BS, cache, position, config):
        tokens_BT = jax.lax.dynamic_update_slice_in_dim(cache["tokens"], tokens_BS, position, axis=1)
        S, T = tokens_BS.shape[1], tokens_BT.shape[1]
        seen_ST = jnp.arange(T)[None, :] <= jnp.arange(S)[:, None] + position
        sums_BS = jnp.sum(jnp.where(seen_ST, tokens_BT[:, None, :], 0), axis=-1)
        vocab = config.model.vocab_size
        return jax.nn.one_hot(sums_BS % vocab, vocab), {"tokens": tokens_BT}

    monkeypatch.setattr(transformer, "init_cache", init_cache)
    monkeypatch.setattr(transformer, "forward_cached", forward_cached)
    gen._cached_steps.cache_clear()  # compiled programs are cached per config: trace them with the stand-in
    request.addfinalizer(gen._cached_steps.cache_clear)


@pytest.mark.parametrize("beyond", [9, -4], ids=["longer-prompt", "crossing"])
def test_speculative_greedy_equals_plain_greedy_past_the_context_window(model, monkeypatch, request, beyond):
    """A pass holds the context and two more positions: past window - 2 tokens of context, speculative decoding
    continues as plain decoding does (a prompt longer than the window, and one whose generation crosses it)."""
    params, state = model
    vocab, window = MODEL.model.vocab_size, gen.context_window(MODEL)
    monkeypatch.setattr(transformer, "forward", _summing)
    monkeypatch.setattr(transformer, "mtp_logits", lambda params, state, tokens_BS, hidden_BSD, config: (
        jnp.zeros((*tokens_BS.shape, vocab)),))
    summing_cached(monkeypatch, request)
    gen._speculative_step.cache_clear()
    request.addfinalizer(gen._speculative_step.cache_clear)
    prompt = [1 + i % (vocab - 1) for i in range(window + beyond)]
    plain = gen.generate(MODEL, params, state, prompt, max_new_tokens=8, temperature=0.0)
    ids = list(prompt)
    for _ in range(8):
        ids.append(sum(ids[gen.context_start(len(ids), MODEL.model.max_seq_len):]) % vocab)
    assert plain == ids[len(prompt):]
    assert gen.generate(MODEL, params, state, prompt, max_new_tokens=8, temperature=0.0, speculative=True) == plain


@pytest.mark.parametrize("temperature, top_p", [(-0.1, 0.9), (0.8, 0.0), (0.8, 1.01), (float("nan"), 0.9),
                                                (0.8, float("nan")), (float("inf"), 0.9), ("0.8", 0.9),
                                                (0.8, True), (None, 0.9)])
def test_sampling_settings_out_of_range_are_refused(model, temperature, top_p):
    """inf would sample uniformly; a string, a bool or None is no number (Python's own TypeError otherwise)."""
    params, state = model
    with pytest.raises(ConfigError, match=rf"^temperature must be a finite number >= 0 and top_p a number in "
                                          rf"\(0, 1\]; got {re.escape(repr(temperature))} and {top_p!r}.$"):
        gen.generate(MODEL, params, state, [1], temperature=temperature, top_p=top_p)


@pytest.mark.parametrize("settings, match", [({"max_new_tokens": -1}, "max_new_tokens must be >= 0; got -1"),
                                             ({"max_new_tokens": 4.0}, "max_new_tokens must be an integer; got 4.0"),
                                             ({"seed": True}, "seed must be an integer; got True"),
                                             ({"seed": 2**64}, "seed=18446744073709551616 is out of range"),
                                             ({"seed": -2**31}, "seed=-2147483648 is out of range")])
@pytest.mark.parametrize("speculative", [False, True])
def test_a_budget_or_seed_the_command_refuses_is_refused_from_python_too(model, settings, match, speculative):
    """A negative budget would return no tokens as if asked for none, and a seed beyond 32 bits end in JAX's
    OverflowError: the ConfigError `dropless generate` gives."""
    params, state = model
    with pytest.raises(ConfigError, match=match):
        gen.generate(MODEL, params, state, [1], temperature=0.0, speculative=speculative, **settings)


def test_a_prompt_given_as_the_tokenizers_int32_array_generates_as_its_list(model):
    """`TextTokenizer.encode` returns an int32 array: `generate` takes it as it takes the list of the same ids."""
    params, state = model
    as_list = gen.generate(MODEL, params, state, [5, 9, 2], max_new_tokens=3, temperature=0.0)
    assert gen.generate(MODEL, params, state, np.asarray([5, 9, 2], np.int32), max_new_tokens=3,
                        temperature=0.0) == as_list


@pytest.mark.parametrize("prompt, match", [([MODEL.model.vocab_size], "token id 64, outside"), ([3, -1], "token id -1"),
                                           (np.asarray([1.5]), "integer token ids"), ([], "no tokens"),
                                           ([[1, 2], [3]], "one prompt per call"), (None, "integer token ids"),
                                           (7, "integer token ids")])
def test_a_prompt_that_is_not_token_ids_of_the_model_is_refused(model, prompt, match):
    """An id outside the vocabulary would be read as a clamped or NaN embedding and generate nonsense silently;
    several prompts at once (a ragged list of lists), None or a bare int are a ConfigError too, as models.md says,
    not NumPy's ValueError or a TypeError from len()."""
    params, state = model
    with pytest.raises(ConfigError, match=match):
        gen.generate(MODEL, params, state, prompt, max_new_tokens=2, temperature=0.0)
