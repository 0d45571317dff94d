"""Causal self-attention: DeepSeek's multi-head latent attention (MLA) and grouped-query attention (GQA).

Shape suffixes (docs/architecture.md legend, plus, in this file): `S` query positions, `T` key positions, `H` query heads,
`N` key/value heads, `G = H / N` query heads per key/value head, `Q` per-head query/key width, `P` rotary width,
`W` per-head value width, `R` a low-rank (LoRA) width.

Both functions take one layer's parameters (unstacked; the transformer scans over the stacked `L` axis), run in
the dtype of `x` (weights are float32 masters cast at use), and return the projection back to the hidden size.
The per-head layouts of the weights are the ones fixed in docs/architecture.md. The attention itself runs on one of
three backends (`model.attention_backend`): `xla`, a plain einsum with float32 logits and softmax (the reference),
`tokamax`, a flash-attention kernel that never holds the [S, S] logits (chosen by `auto` on GPUs in bfloat16), or
`cudnn`, NVIDIA's fused flash attention through JAX's cuDNN binding (GPU, 16-bit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dropless.core import params as params_lib
from dropless.core.config import ConfigError, ModelConfig
from dropless.core.mesh import per_batch_shard
from dropless.core.params import ParamSpec, Specs
from dropless.fp8 import Recipe, linear
from dropless.ops.norms import rms_norm
from dropless.ops.rope import apply_rope, mla_softmax_scale

# Hugging Face's DeepseekV3Attention builds q_a_layernorm and kv_a_layernorm without passing
# config.rms_norm_eps, so the latent norms always use the RMSNorm default.
LATENT_NORM_EPS = 1e-6


def mla_params(m: ModelConfig) -> Specs:
    """One MLA layer's weights (docs/architecture.md, "ATTN for MLA"); their order is the order of init_mla's keys."""
    D, H = m.hidden_size, m.num_heads
    qk_width = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank > 0:
        specs: Specs = {"q_a": ParamSpec((D, m.q_lora_rank), ("embed", "q_lora")),
                        "q_a_norm": ParamSpec((m.q_lora_rank,), ("q_lora",), "ones"),
                        "q_b": ParamSpec((m.q_lora_rank, H * qk_width), ("q_lora", "heads_x_dim"))}
    else:  # q draws with q_a's key; q_b's stays unused
        specs = {"q": ParamSpec((D, H * qk_width), ("embed", "heads_x_dim")), "q_b": None}
    return specs | {
        "kv_a": ParamSpec((D, m.kv_lora_rank + m.qk_rope_head_dim), ("embed", "kv_lora")),
        "kv_a_norm": ParamSpec((m.kv_lora_rank,), ("kv_lora",), "ones"),
        "kv_b": ParamSpec((m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim)), ("kv_lora", "heads_x_dim")),
        "o": ParamSpec((H * m.v_head_dim, D), ("heads_x_dim", "embed")),
    }


def gqa_params(m: ModelConfig) -> Specs:
    """One GQA layer's weights (docs/architecture.md, "ATTN for GQA"); the per-head q/k norms are [head_dim]: tiny, replicated."""
    D, H, N, hd = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim
    specs: Specs = {"q": ParamSpec((D, H * hd), ("embed", "heads_x_dim")),
                    "k": ParamSpec((D, N * hd), ("embed", "heads_x_dim")),
                    "v": ParamSpec((D, N * hd), ("embed", "heads_x_dim")),
                    "o": ParamSpec((H * hd, D), ("heads_x_dim", "embed"))}
    if m.qk_norm:
        specs |= {"q_norm": ParamSpec((hd,), (None,), "ones"), "k_norm": ParamSpec((hd,), (None,), "ones")}
    return specs


def attention_params(m: ModelConfig) -> Specs:
    """One layer's attention weights for `model.attention`."""
    return mla_params(m) if m.attention == "mla" else gqa_params(m)


def init_mla(key: jax.Array, m: ModelConfig) -> dict:
    """One MLA layer's float32 weights, normal(0, model.init_std) matrices and ones for the latent norms."""
    return params_lib.init(key, mla_params(m), m.init_std)


def init_gqa(key: jax.Array, m: ModelConfig) -> dict:
    """One GQA layer's float32 weights, normal(0, model.init_std) matrices and ones for the q/k norms."""
    return params_lib.init(key, gqa_params(m), m.init_std)


def init_attention(key: jax.Array, m: ModelConfig) -> dict:
    return params_lib.init(key, attention_params(m), m.init_std)


def causal_mask(S: int, T: int, first_position=None) -> jax.Array:
    """[S, T] booleans: query s (at position first_position + s) sees key t (at position t) when t <= its position.
    `first_position` None puts the queries on the last S of the T positions; it may be traced (a KV cache's fill)."""
    first = T - S if first_position is None else first_position
    return jnp.arange(T)[None, :] <= jnp.arange(S)[:, None] + first


def same_document(documents_BS: jax.Array) -> jax.Array:
    """[B, S, S] booleans: positions s and t of a sequence lie in the same document (`documents_BS`: each position's
    document index within its sequence, `transformer.document_ids`)."""
    return documents_BS[:, :, None] == documents_BS[:, None, :]


def document_starts(documents_BS: jax.Array) -> jax.Array:
    """[B, S] int32: the first position of each position's document (`documents_BS` as `same_document`'s)."""
    B, S = documents_BS.shape
    first = jnp.concatenate([jnp.ones((B, 1), bool), documents_BS[:, 1:] != documents_BS[:, :-1]], axis=1)
    return jax.lax.cummax(jnp.where(first, jnp.arange(S, dtype=jnp.int32), 0), axis=1)


def _tokamax_within_documents(q_BSHQ: jax.Array, k_BSNQ: jax.Array, v_BSNW: jax.Array, scale: float,
                              starts_BS: jax.Array) -> jax.Array:
    """tokamax's causal flash attention in which query s sees the keys from its document's first position on.

    The documents reach the kernel as those first positions (its mask's `k_start`, one integer per query), not as
    a [B, 1, S, S] boolean mask: nothing of S² size is built, kept for the backward pass or read tile by tile. The
    Mosaic GPU forward kernel skips the key blocks that lie wholly before a query block's documents; its backward
    kernels mask those keys element by element. The starts have one head (broadcast over every query head), the
    case tokamax's kernels index alike forward and backward. tokamax's public function takes the boolean mask only,
    so this builds its mask and tries its implementations in its own order (tokamax._src, as dropless.gmm.tokamax
    reaches its ragged dot)."""
    from tokamax._src.ops.attention import api, base
    mask = base.Mask(k_start=starts_BS[:, None, :], is_causal=True)
    errors = []
    for name in api._DEFAULT_IMPLEMENTATIONS:
        if name == "mosaic":
            name = "mosaic_gpu" if _on_gpu() else "mosaic_tpu"
        if name not in api.IMPLEMENTATIONS:
            continue
        try:
            return api.IMPLEMENTATIONS[name](q_BSHQ, k_BSNQ, v_BSNW, mask=mask, logits_scale=scale)
        except NotImplementedError as error:
            errors.append(error)
    raise ExceptionGroup("no tokamax attention implementation takes these inputs", errors)


def causal_attention(q_BSNGQ: jax.Array, k_BTNQ: jax.Array, v_BTNW: jax.Array, scale: float,
                     first_position=None, documents_BS: jax.Array | None = None) -> jax.Array:
    """softmax(scale * q k^T + causal mask) v, with G query heads sharing each key/value head.

    The plain XLA path (and the reference for the others): logits and softmax are float32; the probabilities
    are cast back to v's dtype for the second matmul, as Hugging Face's eager attention does. It materialises
    the [S, T] logits of every head. `first_position`: as `causal_mask`'s. `documents_BS` (S = T): a query sees
    only the keys of its own document as well. Returns o_BSNGW in q's dtype.
    """
    S, T = q_BSNGQ.shape[1], k_BTNQ.shape[1]
    logits_BNGST = jnp.einsum("bsngq,btnq->bngst", q_BSNGQ, k_BTNQ, preferred_element_type=jnp.float32) * scale
    mask = causal_mask(S, T, first_position)
    if documents_BS is not None:
        mask = mask & same_document(documents_BS)[:, None, None]
    logits_BNGST = jnp.where(mask, logits_BNGST, jnp.finfo(jnp.float32).min)
    probs_BNGST = jax.nn.softmax(logits_BNGST, axis=-1).astype(v_BTNW.dtype)
    out_BSNGW = jnp.einsum("bngst,btnw->bsngw", probs_BNGST, v_BTNW, preferred_element_type=jnp.float32)
    return out_BSNGW.astype(q_BSNGQ.dtype)


def attention_backend(m: ModelConfig, dtype) -> str:
    """`model.attention_backend` resolved: "auto" is tokamax's flash attention on a GPU in 16-bit compute
    (its Mosaic kernel takes bf16/fp16 only), the XLA einsum otherwise."""
    if m.attention_backend != "auto":
        return m.attention_backend
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "tokamax" if jax.default_backend() == "gpu" and half else "xla"


def _attend(q_BSHQ: jax.Array, k_BSNQ: jax.Array, v_BSNW: jax.Array, scale: float, m: ModelConfig,
            mesh: Mesh | None, documents_BS: jax.Array | None = None) -> jax.Array:
    """Causal attention of H query heads over N key/value heads (query head h uses kv head h // (H/N)), within
    each position's document where `documents_BS` is given, on each device's slice of the batch when a mesh is
    given (`per_batch_shard`)."""
    kernel = functools.partial(_attend_local, scale=scale, m=m)
    arrays = (q_BSHQ, k_BSNQ, v_BSNW) + (() if documents_BS is None else (documents_BS,))
    return per_batch_shard(kernel, mesh)(*arrays)


def _attend_local(q_BSHQ: jax.Array, k_BSNQ: jax.Array, v_BSNW: jax.Array, documents_BS: jax.Array | None = None, *,
                  scale: float, m: ModelConfig) -> jax.Array:
    B, S, H, Q = q_BSHQ.shape
    N = k_BSNQ.shape[2]
    backend = attention_backend(m, q_BSHQ.dtype)
    if backend == "cudnn":  # Config refuses data.document_mask with it
        return cudnn_attention(q_BSHQ, k_BSNQ, v_BSNW, scale)
    if backend == "tokamax":
        try:
            import tokamax  # optional (dropless[gpu]); imported only when used
        except ImportError as error:
            raise ConfigError("model.attention_backend=tokamax needs the tokamax package; install dropless[gpu] "
                              "or set model.attention_backend=xla.") from error
        # Flash attention: no [S, S] logits in memory. At DeepSeek-V3's MLA shape (128 heads, 4096 tokens) the
        # einsum path's float32 logits are 8 GiB per sequence, kept for the backward pass and read and written
        # again by the softmax; the kernel keeps one tile of them on chip.
        if documents_BS is None:
            return tokamax.dot_product_attention(q_BSHQ, k_BSNQ, v_BSNW, scale=scale, is_causal=True)
        return _tokamax_within_documents(q_BSHQ, k_BSNQ, v_BSNW, scale, document_starts(documents_BS))
    out_BSNGW = causal_attention(q_BSHQ.reshape(B, S, N, H // N, Q), k_BSNQ, v_BSNW, scale, documents_BS=documents_BS)
    return out_BSNGW.reshape(B, S, H, v_BSNW.shape[-1])


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def cudnn_attention(q_BSHQ: jax.Array, k_BSNQ: jax.Array, v_BSNW: jax.Array, scale: float) -> jax.Array:
    """Causal attention by cuDNN's fused flash-attention kernels, forward and backward, H query heads over N
    key/value heads. `jax.nn.dot_product_attention(implementation="cudnn")` asks the values to be as wide as the
    keys, which MLA's are not (128 against 192, where padding would add a fifth to the matmuls), so this calls the
    binding it wraps, which takes each width as it is (cuDNN 9.10 or later on Hopper)."""
    if not _on_gpu():
        raise ConfigError("model.attention_backend=cudnn runs NVIDIA's cuDNN kernels and needs an NVIDIA GPU; set "
                          "model.attention_backend=auto or xla on this machine.")
    if q_BSHQ.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ConfigError(f"model.attention_backend=cudnn takes bfloat16 or float16 inputs, not {q_BSHQ.dtype}; set "
                          "train.dtype=bfloat16 or model.attention_backend=xla.")
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    try:
        return dot_product_attention(q_BSHQ, k_BSNQ, v_BSNW, scale=scale, mask_type=MaskType.CAUSAL,
                                     qkv_layout="BTNH")
    except NotImplementedError as error:  # the binding's checks of this GPU, cuDNN version and shape
        raise ConfigError(f"model.attention_backend=cudnn cannot run this attention here ({error}); set "
                          "model.attention_backend=auto or xla.") from error


def _mla_queries(params: dict, x_BSD: jax.Array, cos_SP, sin_SP, m: ModelConfig, mesh, recipe):
    """MLA's per-head queries (q_nope_BSHn, q_rope_BSHP), the rotary part rotated."""
    B, S, _ = x_BSD.shape
    nope, P = m.qk_nope_head_dim, m.qk_rope_head_dim
    if "q_a" in params:
        q_latent_BSR = rms_norm(linear(x_BSD, params["q_a"], recipe, mesh=mesh), params["q_a_norm"], LATENT_NORM_EPS)
        q_BSX = linear(q_latent_BSR, params["q_b"], recipe, mesh=mesh)
    else:
        q_BSX = linear(x_BSD, params["q"], recipe, mesh=mesh)
    q_BSHQ = q_BSX.reshape(B, S, m.num_heads, nope + P)
    return q_BSHQ[..., :nope], apply_rope(q_BSHQ[..., nope:], cos_SP, sin_SP, interleaved=True)


def _mla_latent(params: dict, x_BSD: jax.Array, cos_SP, sin_SP, m: ModelConfig, mesh, recipe):
    """What MLA's keys and values are made from: (the normalised latent c_BSR, the rotated key shared by every
    head k_rope_BSP)."""
    kv_a_BSX = linear(x_BSD, params["kv_a"], recipe, mesh=mesh)
    latent_BSR = rms_norm(kv_a_BSX[..., : m.kv_lora_rank], params["kv_a_norm"], LATENT_NORM_EPS)
    k_rope_BSP = apply_rope(kv_a_BSX[..., m.kv_lora_rank :][:, :, None, :], cos_SP, sin_SP, interleaved=True)
    return latent_BSR, k_rope_BSP[:, :, 0, :]


def mla(params: dict, x_BSD: jax.Array, cos_SP: jax.Array, sin_SP: jax.Array, m: ModelConfig,
        mesh: Mesh | None = None, recipe: Recipe | None = None, documents_BS: jax.Array | None = None) -> jax.Array:
    """DeepSeek-V2/V3 multi-head latent attention, as Hugging Face's DeepseekV3Attention (rope_interleave=True).

    Queries: `x @ q` or `norm(x @ q_a) @ q_b`, per head [nope | rope]. Keys/values: `x @ kv_a` gives a latent
    c (first Rkv columns) and one rotary key shared by all heads (last P columns); `norm(c) @ kv_b` gives per
    head [k_nope | v]. Each head's key is [k_nope | shared rotary key].
    """
    B, S, _ = x_BSD.shape
    H, nope, P, W = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    q_nope_BSHn, q_rope_BSHP = _mla_queries(params, x_BSD, cos_SP, sin_SP, m, mesh, recipe)
    latent_BSR, k_rope_BSP = _mla_latent(params, x_BSD, cos_SP, sin_SP, m, mesh, recipe)
    kv_BSHX = linear(latent_BSR, params["kv_b"], recipe, mesh=mesh).reshape(B, S, H, nope + W)
    k_nope_BSHn, v_BSHW = kv_BSHX[..., :nope], kv_BSHX[..., nope:]

    q_BSHQ = jnp.concatenate([q_nope_BSHn, q_rope_BSHP], axis=-1)
    k_BSHQ = jnp.concatenate([k_nope_BSHn, jnp.broadcast_to(k_rope_BSP[:, :, None, :], (B, S, H, P))], axis=-1)
    out_BSHW = _attend(q_BSHQ, k_BSHQ, v_BSHW, mla_softmax_scale(nope + P, m.rope_scaling), m, mesh, documents_BS)
    return linear(out_BSHW.reshape(B, S, H * W), params["o"], recipe, mesh=mesh)


def _gqa_qkv(params: dict, x_BSD: jax.Array, cos_SP, sin_SP, m: ModelConfig, mesh, recipe):
    """GQA's (q_BSHQ, k_BSNQ, v_BSNW): projected, q/k normalised where the model has the norms, rotated."""
    B, S, _ = x_BSD.shape
    H, N, hd = m.num_heads, m.num_kv_heads, m.head_dim
    q_BSHQ = linear(x_BSD, params["q"], recipe, mesh=mesh).reshape(B, S, H, hd)
    k_BSNQ = linear(x_BSD, params["k"], recipe, mesh=mesh).reshape(B, S, N, hd)
    v_BSNW = linear(x_BSD, params["v"], recipe, mesh=mesh).reshape(B, S, N, hd)
    if "q_norm" in params:
        q_BSHQ = rms_norm(q_BSHQ, params["q_norm"], m.rms_norm_eps)
        k_BSNQ = rms_norm(k_BSNQ, params["k_norm"], m.rms_norm_eps)
    return apply_rope(q_BSHQ, cos_SP, sin_SP), apply_rope(k_BSNQ, cos_SP, sin_SP), v_BSNW


def gqa(params: dict, x_BSD: jax.Array, cos_SP: jax.Array, sin_SP: jax.Array, m: ModelConfig,
        mesh: Mesh | None = None, recipe: Recipe | None = None, documents_BS: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention (Mixtral; Qwen3 with per-head q/k RMSNorm before RoPE), rotate-half RoPE.

    Query head h attends with key/value head h // G, as Hugging Face's `repeat_kv` arranges it.
    """
    B, S, _ = x_BSD.shape
    q_BSHQ, k_BSNQ, v_BSNW = _gqa_qkv(params, x_BSD, cos_SP, sin_SP, m, mesh, recipe)
    out_BSHW = _attend(q_BSHQ, k_BSNQ, v_BSNW, m.head_dim**-0.5, m, mesh, documents_BS)
    return linear(out_BSHW.reshape(B, S, m.num_heads * m.head_dim), params["o"], recipe, mesh=mesh)


def attention(params: dict, x_BSD: jax.Array, cos_SP: jax.Array, sin_SP: jax.Array, m: ModelConfig,
              mesh: Mesh | None = None, recipe: Recipe | None = None, documents_BS: jax.Array | None = None
              ) -> jax.Array:
    """The configured attention (`model.attention`: mla or gqa); `mesh`: the training mesh (None on one device);
    `recipe`: FP8 projections (dropless.fp8; the attention core stays in the compute dtype and float32);
    `documents_BS`: each position's document (`transformer.document_ids`), None = one causal sequence."""
    return (mla if m.attention == "mla" else gqa)(params, x_BSD, cos_SP, sin_SP, m, mesh, recipe, documents_BS)


# ----------------------------------------------------------------------------------------------- KV cache

def cache_shapes(m: ModelConfig, batch: int, length: int) -> dict[str, tuple[int, ...]]:
    """One layer's KV cache for `length` positions. MLA keeps what its keys and values are made from, the
    normalised latent [B, T, Rkv] and the rotated shared key [B, T, P]: Rkv + P numbers a token (576 for
    DeepSeek-V3) where its keys and values would be H·(Q + W) (40,960). GQA keeps keys and values [B, T, N, hd]."""
    if m.attention == "mla":
        return {"latent": (batch, length, m.kv_lora_rank), "k_rope": (batch, length, m.qk_rope_head_dim)}
    return {"k": (batch, length, m.num_kv_heads, m.head_dim), "v": (batch, length, m.num_kv_heads, m.head_dim)}


def _write(cache_BT: jax.Array, new_BS: jax.Array, position) -> jax.Array:
    """The cache with positions position..position+S-1 replaced by `new` (in the cache's dtype)."""
    return jax.lax.dynamic_update_slice_in_dim(cache_BT, new_BS.astype(cache_BT.dtype), position, axis=1)


def mla_cached(params: dict, x_BSD: jax.Array, cache: dict, position, cos_SP, sin_SP, m: ModelConfig,
               recipe: Recipe | None = None) -> tuple[jax.Array, dict]:
    """`mla` for S new tokens at positions position.. over a cache of the positions before (`cache_shapes`), on one
    device; returns (the projection, the cache with the new positions written). kv_b is absorbed, as DeepSeek's
    inference does: a head's logit q_nope·(W_UK c) is (W_UK^T q_nope)·c and its output W_UV (p·c), so attention
    runs against the cached latents and no per-head key or value is formed. The same numbers as `mla` up to
    rounding (kv_b runs in the compute dtype, unquantized under an FP8 recipe)."""
    B, S, _ = x_BSD.shape
    H, nope, P, W, R = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    dtype = x_BSD.dtype
    q_nope_BSHn, q_rope_BSHP = _mla_queries(params, x_BSD, cos_SP, sin_SP, m, None, recipe)
    latent_BSR, k_rope_BSP = _mla_latent(params, x_BSD, cos_SP, sin_SP, m, None, recipe)
    cache = {"latent": _write(cache["latent"], latent_BSR, position), "k_rope": _write(cache["k_rope"], k_rope_BSP,
                                                                                        position)}
    kv_b_RHX = params["kv_b"].astype(dtype).reshape(R, H, nope + W)
    q_latent_BSHR = jnp.einsum("bshn,rhn->bshr", q_nope_BSHn, kv_b_RHX[..., :nope],
                               preferred_element_type=jnp.float32).astype(dtype)
    logits_BHST = (jnp.einsum("bshr,btr->bhst", q_latent_BSHR, cache["latent"], preferred_element_type=jnp.float32)
                   + jnp.einsum("bshp,btp->bhst", q_rope_BSHP, cache["k_rope"], preferred_element_type=jnp.float32))
    logits_BHST = logits_BHST * mla_softmax_scale(nope + P, m.rope_scaling)
    T = cache["latent"].shape[1]
    logits_BHST = jnp.where(causal_mask(S, T, position), logits_BHST, jnp.finfo(jnp.float32).min)
    probs_BHST = jax.nn.softmax(logits_BHST, axis=-1).astype(dtype)
    # [b, h, s, r] then swapped: XLA's CPU backend has no bf16 x bf16 = f32 dot that writes "bshr" directly.
    out_latent_BSHR = jnp.swapaxes(jnp.einsum("bhst,btr->bhsr", probs_BHST, cache["latent"],
                                              preferred_element_type=jnp.float32), 1, 2).astype(dtype)
    out_BSHW = jnp.einsum("bshr,rhw->bshw", out_latent_BSHR, kv_b_RHX[..., nope:],
                          preferred_element_type=jnp.float32).astype(dtype)
    return linear(out_BSHW.reshape(B, S, H * W), params["o"], recipe), cache


def gqa_cached(params: dict, x_BSD: jax.Array, cache: dict, position, cos_SP, sin_SP, m: ModelConfig,
               recipe: Recipe | None = None) -> tuple[jax.Array, dict]:
    """`gqa` for S new tokens at positions position.. over a cache of the keys and values before (`cache_shapes`),
    on one device; returns (the projection, the cache with the new positions written)."""
    B, S, _ = x_BSD.shape
    H, N, hd = m.num_heads, m.num_kv_heads, m.head_dim
    q_BSHQ, k_BSNQ, v_BSNW = _gqa_qkv(params, x_BSD, cos_SP, sin_SP, m, None, recipe)
    cache = {"k": _write(cache["k"], k_BSNQ, position), "v": _write(cache["v"], v_BSNW, position)}
    out_BSNGW = causal_attention(q_BSHQ.reshape(B, S, N, H // N, hd), cache["k"], cache["v"], hd**-0.5, position)
    return linear(out_BSNGW.reshape(B, S, H * hd), params["o"], recipe), cache


def attention_cached(params: dict, x_BSD: jax.Array, cache: dict, position, cos_SP, sin_SP, m: ModelConfig,
                     recipe: Recipe | None = None) -> tuple[jax.Array, dict]:
    """The configured attention over a KV cache: (the projection, the updated cache). `cos_SP`, `sin_SP`: the
    RoPE tables of the new positions."""
    return (mla_cached if m.attention == "mla" else gqa_cached)(params, x_BSD, cache, position, cos_SP, sin_SP, m,
                                                                recipe)


def rotary_dim(m: ModelConfig) -> int:
    """Width of the rotated part of each query/key head."""
    return m.qk_rope_head_dim if m.attention == "mla" else m.head_dim
