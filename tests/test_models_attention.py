"""MLA and GQA attention against naive per-head references (forward and gradients), shapes, and causality."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.config import ModelConfig
from dropless.models import attention as attn_lib
from dropless.ops import rope

S = 6
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 4, "beta_slow": 1,
        "mscale": 0.7, "mscale_all_dim": 1.0}  # mscale != mscale_all_dim: cos/sin and softmax both rescaled


def mla_config(q_lora_rank=16, rope_scaling=None) -> ModelConfig:
    # nope, rope, v_head_dim and nope + rope all differ so that a mixed-up split cannot go unnoticed.
    return ModelConfig(hidden_size=32, num_heads=4, attention="mla", q_lora_rank=q_lora_rank, kv_lora_rank=16,
                       qk_rope_head_dim=8, qk_nope_head_dim=10, v_head_dim=12, rope_scaling=rope_scaling)


def gqa_config(num_kv_heads=2, qk_norm=False) -> ModelConfig:
    return ModelConfig(family="qwen3_moe" if qk_norm else "mixtral", attention="gqa", hidden_size=32, num_heads=4,
                       num_kv_heads=num_kv_heads, head_dim=8, qk_norm=qk_norm, first_dense_layers=0)


def _params(m: ModelConfig, seed=0) -> dict:
    """Random weights in init_attention's layout, drawn with NumPy (no compilation): std 0.15 matrices and
    norm weights around 1, non-trivial so that a norm applied to the wrong tensor shows up."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda key: attn_lib.init_attention(key, m), jax.random.key(0))
    return {name: jnp.asarray((1.0 + 0.3 * rng.normal(size=leaf.shape)) if name.endswith("norm")
                              else 0.15 * rng.normal(size=leaf.shape), jnp.float32)
            for name, leaf in shapes.items()}


def _tables(m: ModelConfig):
    return rope.rope_tables(S, attn_lib.rotary_dim(m), m.rope_theta, m.rope_scaling)


def _norm(v, w, eps):
    return w * v / jnp.sqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)


def _rotate(v_SP, inv_freq, factor, *, interleaved):
    """Rotate pairs of dimensions by position * inv_freq_i; pairs are (2i, 2i+1) if interleaved, else (i, i+P/2).
    The result keeps the input's layout."""
    angle_SP = jnp.arange(v_SP.shape[0])[:, None] * inv_freq[None, :]
    a, b = (v_SP[:, 0::2], v_SP[:, 1::2]) if interleaved else jnp.split(v_SP, 2, axis=-1)
    a, b = a * jnp.cos(angle_SP) - b * jnp.sin(angle_SP), b * jnp.cos(angle_SP) + a * jnp.sin(angle_SP)
    out = jnp.stack([a, b], axis=-1).reshape(v_SP.shape) if interleaved else jnp.concatenate([a, b], axis=-1)
    return factor * out


def _softmax_attention(q_SQ, k_SQ, v_SW, scale):
    scores = q_SQ @ k_SQ.T * scale
    scores = jnp.where(jnp.tril(jnp.ones(scores.shape, bool)), scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1) @ v_SW


def naive_mla(p: dict, x_SD, m: ModelConfig):
    """One sequence, one head at a time, slicing each head's columns out of q_b / kv_b (head-major layout)."""
    H, nope, P, W, R = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    inv_freq, factor = rope.inverse_frequencies(P, m.rope_theta, m.rope_scaling)
    q_all = _norm(x_SD @ p["q_a"], p["q_a_norm"], 1e-6) @ p["q_b"] if m.q_lora_rank else x_SD @ p["q"]
    kv_a = x_SD @ p["kv_a"]
    kv_all = _norm(kv_a[:, :R], p["kv_a_norm"], 1e-6) @ p["kv_b"]
    k_rope = _rotate(kv_a[:, R:], inv_freq, factor, interleaved=True)  # one rotary key shared by all heads
    scale = rope.mla_softmax_scale(nope + P, m.rope_scaling)
    heads = []
    for h in range(H):
        q_h = q_all[:, h * (nope + P):(h + 1) * (nope + P)]
        kv_h = kv_all[:, h * (nope + W):(h + 1) * (nope + W)]
        q_h = jnp.concatenate([q_h[:, :nope], _rotate(q_h[:, nope:], inv_freq, factor, interleaved=True)], axis=-1)
        k_h = jnp.concatenate([kv_h[:, :nope], k_rope], axis=-1)
        heads.append(_softmax_attention(q_h, k_h, kv_h[:, nope:], scale))
    return jnp.concatenate(heads, axis=-1) @ p["o"]


def naive_gqa(p: dict, x_SD, m: ModelConfig):
    """Hugging Face's eager path: project, (q/k norm), rotate-half RoPE, repeat_kv, per-head softmax."""
    H, N, hd = m.num_heads, m.num_kv_heads, m.head_dim
    inv_freq, factor = rope.inverse_frequencies(hd, m.rope_theta, m.rope_scaling)
    seq = x_SD.shape[0]
    q = (x_SD @ p["q"]).reshape(seq, H, hd)
    k = (x_SD @ p["k"]).reshape(seq, N, hd)
    v = (x_SD @ p["v"]).reshape(seq, N, hd)
    if m.qk_norm:
        q, k = _norm(q, p["q_norm"], m.rms_norm_eps), _norm(k, p["k_norm"], m.rms_norm_eps)
    k, v = jnp.repeat(k, H // N, axis=1), jnp.repeat(v, H // N, axis=1)  # repeat_kv: head h uses kv head h // G
    rotate = lambda t: _rotate(t, inv_freq, factor, interleaved=False)  # Llama pairs dimensions (i, i + hd/2)
    heads = [_softmax_attention(rotate(q[:, h]), rotate(k[:, h]), v[:, h], hd**-0.5) for h in range(H)]
    return jnp.concatenate(heads, axis=-1) @ p["o"]


CASES = {
    "mla_q_lora": (mla_config(16), naive_mla),
    "mla_no_q_lora_yarn": (mla_config(0, YARN), naive_mla),
    "gqa": (gqa_config(2), naive_gqa),
    "mqa_qk_norm": (gqa_config(1, qk_norm=True), naive_gqa),
}


def _output_and_grads(fn, params, x_BSD, probe):
    """fn(params, x) and the gradient of sum(fn * probe) with respect to (params, x), in one compilation."""
    def run(params, x_BSD):
        out, vjp = jax.vjp(fn, params, x_BSD)
        return out, vjp(probe)
    return jax.jit(run)(params, x_BSD)


@pytest.mark.parametrize("case", CASES)
def test_attention_matches_naive_per_head_reference(case):
    m, naive = CASES[case]
    params = _params(m)
    x_BSD = jax.random.normal(jax.random.key(1), (2, S, m.hidden_size))
    probe = jax.random.normal(jax.random.key(2), x_BSD.shape)
    cos, sin = _tables(m)
    got, got_grads = _output_and_grads(lambda p, x: attn_lib.attention(p, x, cos, sin, m), params, x_BSD, probe)
    want, want_grads = _output_and_grads(lambda p, x: jnp.stack([naive(p, x[b], m) for b in range(2)]),
                                         params, x_BSD, probe)
    assert got.shape == x_BSD.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    # Gradients with respect to every weight and the input.
    assert jax.tree.structure(got_grads) == jax.tree.structure(want_grads)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("case", ["mla_q_lora", "gqa"])
def test_tokamax_backend_matches_xla_backend(case):
    # On a CPU tokamax runs its XLA implementation: this checks our layouts, head grouping, scale and causal
    # flag as handed to the kernel (the Mosaic GPU kernel itself was checked against the einsum on an H200).
    m, _ = CASES[case]
    params = _params(m)
    x_BSD = jax.random.normal(jax.random.key(1), (2, S, m.hidden_size))
    probe = jax.random.normal(jax.random.key(2), x_BSD.shape)
    cos, sin = _tables(m)
    run = lambda backend: _output_and_grads(
        lambda p, x: attn_lib.attention(p, x, cos, sin, dataclasses.replace(m, attention_backend=backend)),
        params, x_BSD, probe)
    (got, got_grads), (want, want_grads) = run("tokamax"), run("xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("case", ["mla_q_lora", "mqa_qk_norm"])
def test_cudnn_backend_hands_the_binding_what_it_computes(case, monkeypatch):
    """model.attention_backend=cudnn: the arguments reach JAX's cuDNN binding in its contract (BTNH, query head h on
    key/value head h // (H/N), values as wide as they are, the causal mask, the scale). The binding is replaced by
    that contract written out naively, since cuDNN needs a GPU (`make bench-attention-vjp` checks the kernels
    against tokamax's there)."""
    from jax._src.cudnn import fused_attention_stablehlo as binding

    def contract(q, k, v, *, scale, mask_type, qkv_layout):
        assert mask_type == binding.MaskType.CAUSAL and qkv_layout == "BTNH"
        (B, S_, H, Q), N, W = q.shape, k.shape[2], v.shape[3]
        kv_head = jnp.arange(H) // (H // N)
        logits = jnp.einsum("bshq,bthq->bhst", q.astype(jnp.float32), k[:, :, kv_head].astype(jnp.float32)) * scale
        logits = jnp.where(jnp.tril(jnp.ones((S_, S_), bool)), logits, -jnp.inf)
        out = jnp.einsum("bhst,bthw->bshw", jax.nn.softmax(logits, -1), v[:, :, kv_head].astype(jnp.float32))
        assert out.shape == (B, S_, H, W)
        return out.astype(q.dtype)

    monkeypatch.setattr(binding, "dot_product_attention", contract)
    monkeypatch.setattr(attn_lib, "_on_gpu", lambda: True)
    m, _ = CASES[case]
    params = _params(m)
    x_BSD = jax.random.normal(jax.random.key(1), (2, S, m.hidden_size))
    cos, sin = _tables(m)
    run = lambda backend: attn_lib.attention(params, x_BSD.astype(jnp.bfloat16), cos, sin,
                                             dataclasses.replace(m, attention_backend=backend)).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(run("cudnn")), np.asarray(run("xla")), rtol=2e-2, atol=2e-2)


def test_cudnn_backend_says_what_it_needs(monkeypatch):
    from dropless.core.config import ConfigError

    q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
    if jax.default_backend() != "gpu":
        with pytest.raises(ConfigError, match="needs an NVIDIA GPU; set model.attention_backend=auto or xla"):
            attn_lib.cudnn_attention(q, q, q, 1.0)
    monkeypatch.setattr(attn_lib, "_on_gpu", lambda: True)
    with pytest.raises(ConfigError, match="takes bfloat16 or float16 inputs, not float32"):
        attn_lib.cudnn_attention(q.astype(jnp.float32), q, q, 1.0)

    from jax._src.cudnn import fused_attention_stablehlo as binding

    def refuses(*args, **kwargs):
        raise NotImplementedError("mla requires cudnn version >= 9.10 and at least hopper arch.")

    monkeypatch.setattr(binding, "dot_product_attention", refuses)
    with pytest.raises(ConfigError, match=r"cannot run this attention here \(mla requires cudnn version >= 9.10 and "
                                          r"at least hopper arch.\); set model.attention_backend=auto or xla"):
        attn_lib.cudnn_attention(q, q, q, 1.0)


def test_auto_backend_is_xla_off_gpu_and_in_float32():
    m = mla_config(16)
    assert attn_lib.attention_backend(m, jnp.bfloat16) == ("tokamax" if jax.default_backend() == "gpu" else "xla")
    assert attn_lib.attention_backend(m, jnp.float32) == "xla"
    assert attn_lib.attention_backend(dataclasses.replace(m, attention_backend="tokamax"), jnp.float32) == "tokamax"


def test_mla_parameter_shapes():
    m = mla_config(16)
    init = lambda config: jax.eval_shape(lambda key: attn_lib.init_mla(key, config), jax.random.key(0))
    shapes = {k: v.shape for k, v in init(m).items()}
    assert shapes == {"q_a": (32, 16), "q_a_norm": (16,), "q_b": (16, 4 * (10 + 8)), "kv_a": (32, 16 + 8),
                      "kv_a_norm": (16,), "kv_b": (16, 4 * (10 + 12)), "o": (4 * 12, 32)}
    shapes = {k: v.shape for k, v in init(mla_config(0)).items()}
    assert shapes["q"] == (32, 4 * (10 + 8)) and "q_a" not in shapes and "q_b" not in shapes


def test_mla_latent_norms_use_their_own_epsilon_not_model_rms_norm_eps():
    """Hugging Face builds q_a_layernorm and kv_a_layernorm without config.rms_norm_eps: they keep 1e-6 whatever
    model.rms_norm_eps is (the naive reference hard-codes 1e-6)."""
    m = dataclasses.replace(mla_config(16), rms_norm_eps=0.5)
    params = _params(m)
    x_BSD = jax.random.normal(jax.random.key(1), (1, S, m.hidden_size))
    cos, sin = _tables(m)
    got = jax.jit(lambda p, x: attn_lib.attention(p, x, cos, sin, m))(params, x_BSD)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(naive_mla(params, x_BSD[0], m)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["mla_q_lora", "mqa_qk_norm"])
def test_attention_is_causal(case):
    # d out[t] / d x[s] must vanish exactly for every later position s > t, and not for s <= t.
    m, _ = CASES[case]
    params = _params(m)
    cos, sin = _tables(m)
    x_SD = jax.random.normal(jax.random.key(3), (S, m.hidden_size))
    jac = jax.jit(jax.jacrev(lambda x: attn_lib.attention(params, x[None], cos, sin, m)[0]))(x_SD)  # [S, D, S, D]
    influence_SS = np.abs(np.asarray(jac)).sum(axis=(1, 3))
    assert np.all(influence_SS[np.triu_indices(S, k=1)] == 0.0)
    assert np.all(influence_SS[np.tril_indices(S)] > 0.0)


def test_bfloat16_attention_stays_close_to_float32():
    m = mla_config(16)
    params = _params(m)
    cos, sin = _tables(m)
    x = jax.random.normal(jax.random.key(4), (2, S, m.hidden_size))
    run = jax.jit(lambda p, x: attn_lib.attention(p, x, cos, sin, m))
    full, half = run(params, x), run(params, x.astype(jnp.bfloat16))
    assert half.dtype == jnp.bfloat16
    err = np.abs(np.asarray(half, np.float32) - np.asarray(full))
    assert err.max() < 0.05 * np.abs(np.asarray(full)).max()
