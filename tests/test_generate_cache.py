"""KV-cache decoding (`transformer.forward_cached`, `dropless generate`): the cached logits are the whole forward's,
for every family and layer pattern, whatever the cache holds past the new positions; generation equals greedy
decoding by whole forward passes over the documented contexts, across context shifts."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.models import generate as gen
from dropless.models import transformer
from tests.test_generate_speculative import MODEL, summing_cached
from tests.test_models_transformer import FAMILIES, FORWARD, INIT_PARAMS, INTERLEAVED, _setup

CASES = {**FAMILIES, "interleaved": INTERLEAVED,
         "deepseek_v3_no_q_lora": FAMILIES["deepseek_v3"].replace(**{"model.q_lora_rank": 0})}


# Every case with scanned layers; unrolled, the two whose layers differ most from one another (MLA with dense and
# MoE layers, a dense layer between MoE layers): each layer then runs its own code with its own cache rows.
@pytest.mark.parametrize("name, scan", [*((name, True) for name in CASES),
                                        ("deepseek_v3", False), ("interleaved", False)])
def test_cached_logits_equal_the_whole_forward(name, scan):
    """A prompt of 1 (padded to 2 with another token, which the next pass overwrites), two tokens at once, then one
    at a time: each position's logits are the whole sequence's, in a cache longer than the sequence. The passes of
    two tokens, at position 0 and 1, run one program (the position is traced), the passes of one token another."""
    config = CASES[name].replace(**{"train.scan_layers": scan})
    # The parameters and the whole forward of the scanned layers, for the unrolled case too (whose whole forward
    # gives the scanned numbers: test_models_transformer): one program each for both cases.
    params, state, tokens_BS = _setup(CASES[name])
    B, S = tokens_BS.shape
    whole_BSV, _ = FORWARD(params, state, tokens_BS, CASES[name])
    step = jax.jit(transformer.forward_cached, static_argnums=5)
    cache = transformer.init_cache(config, B, S + 4)
    padded_BS = jnp.concatenate([tokens_BS[:, :1], jnp.full((B, 1), 7, tokens_BS.dtype)], axis=1)
    logits, cache = step(params, state, padded_BS, cache, jnp.int32(0), config)
    got = [logits[:, :1]]
    logits, cache = step(params, state, tokens_BS[:, 1:3], cache, jnp.int32(1), config)
    got.append(logits)
    for position in range(3, S):
        logits, cache = step(params, state, tokens_BS[:, position:position + 1], cache, jnp.int32(position), config)
        got.append(logits)
    np.testing.assert_allclose(np.concatenate(got, axis=1), whole_BSV, rtol=1e-5, atol=2e-6 * np.abs(whole_BSV).max())


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe"])
def test_cached_bf16_logits_are_as_close_to_float32_as_the_whole_forwards(name):
    """In bfloat16, two sequences: the cached pass is no further from the float32 logits than `forward` in
    bfloat16 is (MLA's absorbed kv_b rounds differently, not worse)."""
    config = FAMILIES[name].replace(**{"train.dtype": "bfloat16"})
    params, state, tokens_BS = _setup(FAMILIES[name])  # float32 masters, whatever the compute dtype
    exact_BSV, _ = FORWARD(params, state, tokens_BS, config.replace(**{"train.dtype": "float32"}))
    whole_BSV, _ = FORWARD(params, state, tokens_BS, config)
    step = jax.jit(transformer.forward_cached, static_argnums=5)
    logits, cache = step(params, state, tokens_BS[:, :4], transformer.init_cache(config, 2, 16), 0, config)
    got = [logits]
    for position in range(4, tokens_BS.shape[1]):
        logits, cache = step(params, state, tokens_BS[:, position:position + 1], cache, jnp.int32(position), config)
        got.append(logits)
    cached_error = np.abs(np.concatenate(got, axis=1) - exact_BSV).max()
    assert cached_error <= 1.5 * np.abs(whole_BSV - exact_BSV).max(), cached_error


def test_the_cache_holds_mla_latents_and_gqa_keys_and_values():
    """MLA caches Rkv + P numbers per token and layer (its latent and shared rotary key), not per-head keys."""
    mla = FAMILIES["deepseek_v3"]  # one dense layer, then two MoE layers
    cache = transformer.init_cache(mla, 2, 16)
    m = mla.model
    assert jax.tree.map(lambda a: a.shape, cache) == {
        "dense_layers": {"latent": (1, 2, 16, m.kv_lora_rank), "k_rope": (1, 2, 16, m.qk_rope_head_dim)},
        "moe_layers": {"latent": (2, 2, 16, m.kv_lora_rank), "k_rope": (2, 2, 16, m.qk_rope_head_dim)}}
    gqa = FAMILIES["qwen3_moe"]
    kv = (3, 2, 16, gqa.model.num_kv_heads, gqa.model.head_dim)
    assert jax.tree.map(lambda a: a.shape, transformer.init_cache(gqa, 2, 16)) == {"moe_layers": {"k": kv, "v": kv}}


@pytest.mark.parametrize("context", [1, 2, 5, 8, 9])
def test_each_token_sees_between_half_a_context_and_a_whole_one(context):
    starts = [gen.context_start(n, context) for n in range(1, 60)]
    for n, start in enumerate(starts, 1):
        assert start == 0 if n <= context else max(context // 2, 1) <= n - start <= context, (n, start)
        assert start % max(context // 2, 1) == 0
    assert starts == sorted(starts)  # the context only moves forward: a cache refill per move


@pytest.mark.parametrize("name", ["deepseek_v3", "mixtral"])
def test_greedy_generation_equals_whole_forward_passes_across_context_shifts(name):
    """A context of 12 positions and 24 new tokens: the cache is refilled at 13 and 19 tokens; every token is the
    argmax of a whole forward pass over the tokens `context_start` names."""
    config = FAMILIES[name].replace(**{"model.max_seq_len": 12})
    params, state, _ = _setup(config)
    prompt = [5, 9, 2, 7, 1]
    stats: dict = {}
    got = gen.generate(config, params, state, prompt, max_new_tokens=24, temperature=0.0, stats=stats)
    forward = jax.jit(transformer.forward, static_argnums=3)
    ids = list(prompt)
    for _ in range(24):
        # Each context padded at its end to the 12 positions of one compiled program: a causal model's logits at
        # the context's last token do not see what follows it.
        context = ids[gen.context_start(len(ids), 12):]
        logits_1SV, _ = forward(params, state, jnp.asarray([context + [0] * (12 - len(context))], jnp.int32), config)
        ids.append(int(jnp.argmax(logits_1SV[0, len(context) - 1])))
    assert got == ids[len(prompt):]
    assert stats["forwards"] == 24


def test_decoding_compiles_one_program_for_every_position(request):
    """The position is traced: a whole generation, and a second one from a longer prompt of the same padded
    length, reuse one prefill and one decode program."""
    params = INIT_PARAMS(jax.random.key(3), MODEL)
    state = transformer.init_state(MODEL)
    gen._cached_steps.cache_clear()
    request.addfinalizer(gen._cached_steps.cache_clear)
    gen.generate(MODEL, params, state, [1, 2, 3], max_new_tokens=9, temperature=0.0)
    gen.generate(MODEL, params, state, [1, 2, 3, 4, 5], max_new_tokens=7, temperature=0.0)
    assert gen._cached_steps.cache_info().currsize == 1
    config = MODEL.replace(**{"train.dtype": "float32"})  # as generate runs on the CPU
    fill, decode = gen._cached_steps(json.dumps(config.to_dict(), sort_keys=True), 0.0, 0.95)
    assert fill._cache_size() == 1 and decode._cache_size() == 1


def test_a_prompt_longer_than_the_context_is_continued_from_its_last_part(monkeypatch, request):
    """Each token sees exactly the tokens from `context_start` on, no fewer and no more (a stand-in model whose
    prediction is the sum of its context)."""
    params, state = None, None
    summing_cached(monkeypatch, request)
    vocab, context = MODEL.model.vocab_size, MODEL.model.max_seq_len
    prompt = [1 + i % (vocab - 1) for i in range(context + 9)]
    ids = list(prompt)
    for _ in range(30):
        ids.append(sum(ids[gen.context_start(len(ids), context):]) % vocab)
    assert gen.generate(MODEL, params, state, prompt, max_new_tokens=30, temperature=0.0) == ids[len(prompt):]


# The cases whose matrices differ (the cast is by leaf: every matrix but the routers'): MLA with and without the
# query's low rank, a dense layer, shared experts and the MTP module; GQA. Qwen3-MoE's matrices are Mixtral's,
# and a layer pattern moves matrices between stacks without adding any.
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_no_q_lora", "mixtral"])
def test_inference_weights_leave_the_bf16_numbers_as_they_are(name):
    """Matrices stored in the compute dtype give the bf16 forward's logits bit for bit (each is cast where it is
    used), the MTP modules' too; routers and norm weights stay float32."""
    config = CASES[name].replace(**{"train.dtype": "bfloat16", "model.mtp_layers": 1})
    params, state, tokens_BS = _setup(config)
    cast = transformer.inference_weights(params, config)
    assert cast["embed"].dtype == jnp.bfloat16 and cast["final_norm"].dtype == jnp.float32
    assert cast["moe_layers"]["moe"]["router"]["kernel"].dtype == jnp.float32
    assert cast["moe_layers"]["moe"]["experts"]["down"].dtype == jnp.bfloat16
    forward = jax.jit(transformer.forward, static_argnums=3, static_argnames="mtp")
    (want, want_aux), (got, got_aux) = (forward(p, state, tokens_BS, config, mtp=True) for p in (params, cast))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_aux["mtp_logits"][0], want_aux["mtp_logits"][0])


def test_inference_weights_keep_the_masters_an_fp8_recipe_quantizes():
    config = FAMILIES["mixtral"].replace(**{"train.dtype": "bfloat16", "train.fp8": "blockwise"})
    params, _, _ = _setup(config)
    assert transformer.inference_weights(params, config) is params


def test_donated_inference_weights_free_each_float32_matrix():
    config = FAMILIES["deepseek_v3"].replace(**{"train.dtype": "bfloat16"})
    params, state, tokens_BS = _setup(FAMILIES["deepseek_v3"])  # float32 masters, whatever the compute dtype
    want, _ = FORWARD(params, state, tokens_BS, config)
    copy = jax.tree.map(jnp.copy, params)
    cast = transformer.inference_weights(copy, config, donate=True)
    assert copy["embed"].is_deleted() and copy["moe_layers"]["moe"]["experts"]["gate_up"].is_deleted()
    assert not copy["final_norm"].is_deleted() and cast["final_norm"] is copy["final_norm"]
    np.testing.assert_array_equal(FORWARD(cast, state, tokens_BS, config)[0], want)
    assert transformer.inference_weights(cast, config, donate=True)["embed"] is cast["embed"]  # already cast
