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
from tests.test_models_transformer import FORWARD, INIT_PARAMS

MODEL = CONFIG.replace(**{"model.mtp_layers": 1, "model.max_seq_len": 32})
MTP_LOGITS = jax.jit(transformer.mtp_logits, static_argnums=4)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_verified_drafts_leave_tokens_distributed_as_the_main_model(temperature, top_p):
    p_logits = jnp.asarray([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    q_logits = jnp.asarray([0.0, 2.0, -1.0, 1.0, 0.5, 0.0])  # a poor draft: most of its mass where p has little

    def one(key):
        k_draft, k_verify = jax.random.split(key)
        draft, q_truncated = gen.draw(q_logits, k_draft, temperature, top_p)
        return gen.verify_draft(p_logits, q_truncated, draft, k_verify, temperature, top_p)

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
    params = INIT_PARAMS(jax.random.key(3), MODEL)
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


def _echoing(params: dict, config) -> dict:
    """The weights with every attention output and MLP/expert down projection zero, so the residual stream is the
    token's embedding: the main model predicts the next token from the current one alone, and the MTP module, its
    projection taking the embedding half unchanged, predicts the token after the next one the same way: an MTP
    module whose every draft holds."""
    zero = lambda path, leaf: jnp.zeros_like(leaf) if getattr(path[-1], "key", None) in ("o", "down") else leaf
    params = jax.tree_util.tree_map_with_path(zero, params)
    D = config.model.hidden_size
    eh_proj = jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))])[None]
    return {**params, "mtp": {**params["mtp"], "eh_proj": eh_proj}}


@pytest.mark.parametrize("mtp_block", ["moe", "dense"])
def test_greedy_drafts_are_the_mtp_modules_over_the_whole_sequence(monkeypatch, request, mtp_block):
    """Every draft a pass verifies is the MTP module's argmax at its position of the whole sequence (`mtp_logits`,
    as training computes it), for a module whose drafts never hold (random weights) and one whose drafts always
    do (`_echoing`): drafts read at a wrong position, or from a cache that still holds a rejected draft, differ.
    Both weightings run through the same compiled passes (the weights are their arguments)."""
    config = MODEL.replace(**{"model.mtp_block": mtp_block})
    random = INIT_PARAMS(jax.random.key(5), config)
    state = transformer.init_state(config)
    verified, verify_draft = [], gen.verify_draft

    def recording(p_logits_V, q_truncated_V, draft, *args):
        jax.debug.callback(lambda d: verified.append(int(d)), draft)
        return verify_draft(p_logits_V, q_truncated_V, draft, *args)

    monkeypatch.setattr(gen, "verify_draft", recording)
    gen._speculative_steps.cache_clear()  # trace the passes with the recording stand-in
    request.addfinalizer(gen._speculative_steps.cache_clear)
    prompt, count = [5, 9, 2, 7, 3], 16
    for weights, params in (("random", random), ("echoing", _echoing(random, config))):
        verified.clear()
        stats: dict = {}
        out = gen.generate(config, params, state, prompt, max_new_tokens=count, temperature=0.0, speculative=True,
                           stats=stats)
        ids = jnp.asarray([prompt + out], jnp.int32)
        _, aux = FORWARD(params, state, ids, config, hidden=True)
        drafts = np.argmax(MTP_LOGITS(params, state, ids, aux["hidden"], config)[0][0], axis=-1)
        # Token p is drafted at position p - 2; the first pass emits token n and drafts token n + 1.
        position, emitted, want = len(prompt) + 1, 1, []
        while emitted < count:
            want.append(int(drafts[position - 2]))
            step = 2 if want[-1] == int(ids[0, position]) else 1
            emitted, position = emitted + step, position + step
        assert verified == want, weights
        # The case each weighting is for: every draft kept, or rejections (a cache position written twice).
        assert stats["accepted"] == len(want) if weights == "echoing" else stats["accepted"] < len(want), weights


def test_accepted_drafts_give_two_tokens_per_pass(model, monkeypatch, request):
    """With a stand-in main model and an oracle in place of the MTP module (it knows the stand-in's rule), every
    draft holds: the output is plain greedy's, in half the forward passes."""
    summing_cached(monkeypatch, request, oracle=True)
    plain = gen.generate(MODEL, None, None, [1, 2, 3], max_new_tokens=11, temperature=0.0)
    stats: dict = {}
    fast = gen.generate(MODEL, None, None, [1, 2, 3], max_new_tokens=11, temperature=0.0, speculative=True,
                        stats=stats)
    assert fast == plain
    assert stats["accepted"] == stats["drafted"] == 5 and stats["forwards"] == 6


def test_the_cached_mtp_module_gives_the_whole_sequence_logits(model):
    """`mtp_forward_cached` over a prompt, then one position at a time, against `mtp_logits` on the whole sequence:
    the module that drafts reads the same numbers as the one training trains (a MoE block and a dense one)."""
    params, state = model
    tokens_1S = jax.random.randint(jax.random.key(2), (1, 12), 0, MODEL.model.vocab_size)
    step = jax.jit(transformer.mtp_forward_cached, static_argnums=6)  # one program for every later position
    for config in (MODEL, MODEL.replace(**{"model.mtp_block": "dense"})):
        if config is not MODEL:
            params = INIT_PARAMS(jax.random.key(4), config)
            state = transformer.init_state(config)
        _, aux = FORWARD(params, state, tokens_1S, config, hidden=True)
        (whole_1SV,) = MTP_LOGITS(params, state, tokens_1S, aux["hidden"], config)
        next_1S = jnp.roll(tokens_1S, -1, axis=1)
        cache = transformer.init_mtp_cache(config, 1, 16)
        logits, cache = step(params, state, next_1S[:, :7], aux["hidden"][:, :7], cache, 0, config)
        got = [logits]
        for i in range(7, 11):  # the last position has no next token
            logits, cache = step(params, state, next_1S[:, i:i + 1], aux["hidden"][:, i:i + 1], cache, jnp.int32(i),
                                 config)
            got.append(logits)
        np.testing.assert_allclose(np.concatenate(got, axis=1), whole_1SV[:, :11], rtol=1e-5,
                                   atol=2e-6 * float(jnp.abs(whole_1SV).max()))


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
    cached = gen._speculative_steps if speculative else gen._cached_steps
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


def summing_cached(monkeypatch, request, oracle: bool = False):
    """Stand-ins for the cached passes. The main model's prediction after a position is the sum of the tokens in its
    cache up to there (modulo the vocabulary), so it changes with every token of the context it was given; its
    hidden state there is that sum. The MTP module's logits are flat, or, with `oracle`, the main model's next
    prediction (its hidden state plus the token after it), so that every draft holds."""
    vocab = MODEL.model.vocab_size

    def init_cache(config, batch, length):
        return {"tokens": jnp.zeros((batch, length), jnp.int32)}

    def forward_cached(params, state, tokens_BS, cache, position, config, hidden=False):
        tokens_BT = jax.lax.dynamic_update_slice_in_dim(cache["tokens"], tokens_BS, position, axis=1)
        S, T = tokens_BS.shape[1], tokens_BT.shape[1]
        seen_ST = jnp.arange(T)[None, :] <= jnp.arange(S)[:, None] + position
        sums_BS = jnp.sum(jnp.where(seen_ST, tokens_BT[:, None, :], 0), axis=-1)
        out = (jax.nn.one_hot(sums_BS % vocab, vocab), {"tokens": tokens_BT})
        return (*out, sums_BS[..., None]) if hidden else out

    def mtp_forward_cached(params, state, next_tokens_BS, hidden_BSD, cache, position, config):
        if not oracle:
            return jnp.zeros((*next_tokens_BS.shape, vocab)), cache
        return jax.nn.one_hot((hidden_BSD[..., 0] + next_tokens_BS) % vocab, vocab), cache

    for name, stand_in in (("init_cache", init_cache), ("init_mtp_cache", init_cache),
                           ("forward_cached", forward_cached), ("mtp_forward_cached", mtp_forward_cached)):
        monkeypatch.setattr(transformer, name, stand_in)
    for cached in (gen._cached_steps, gen._speculative_steps):
        cached.cache_clear()  # compiled programs are cached per config: trace them with the stand-ins
        request.addfinalizer(cached.cache_clear)


@pytest.mark.parametrize("oracle", [False, True], ids=["rejected", "accepted"])
@pytest.mark.parametrize("beyond", [9, -4], ids=["longer-prompt", "crossing"])
def test_speculative_greedy_equals_plain_greedy_past_the_context(monkeypatch, request, beyond, oracle):
    """Past the context, each token sees the context plain decoding gives it, and drafting goes on (a prompt longer
    than the context, and one whose generation crosses it; drafts that fail and drafts that hold)."""
    vocab, context = MODEL.model.vocab_size, MODEL.model.max_seq_len
    summing_cached(monkeypatch, request, oracle=oracle)
    prompt = [1 + i % (vocab - 1) for i in range(context + beyond)]
    plain = gen.generate(MODEL, None, None, prompt, max_new_tokens=30, temperature=0.0)
    ids = list(prompt)
    for _ in range(30):
        ids.append(sum(ids[gen.context_start(len(ids), context):]) % vocab)
    assert plain == ids[len(prompt):]
    stats: dict = {}
    assert gen.generate(MODEL, None, None, prompt, max_new_tokens=30, temperature=0.0, speculative=True,
                        stats=stats) == plain
    past = 30 - max(0, context - len(prompt))  # tokens generated past the context
    assert stats["accepted"] >= past // 3 if oracle else stats["drafted"] >= past // 2


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
