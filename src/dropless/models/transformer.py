"""The decoder-only MoE transformer: parameters, state, forward pass, parameter counts and logical axes.

Layers are pre-norm residual blocks, `x += attn(norm(x)); x += mlp_or_moe(norm(x))`. The first
`model.first_dense_layers` layers use a dense SwiGLU MLP, the rest the MoE layer of `dropless.moe`. Each group is
stored stacked on a leading `L` axis (layout in DESIGN.md "Parameters") and run with one `jax.lax.scan`, so
compile time does not grow with depth, or unrolled with `train.scan_layers=false` (same numbers; for shallow
models the straight-line program skips the scan's stacked buffers). The numbers match Hugging Face's DeepseekV3ForCausalLM,
MixtralForCausalLM and Qwen3MoeForCausalLM (positions 0..S-1, no padding mask).

Precision: float32 master weights are cast to the compute dtype (`train.dtype`) where they are used; the
residual stream is in the compute dtype; norms, attention softmax, router and logits are float32.

Rematerialisation (`train.remat`): `none`; `moe` recomputes each MoE block in the backward pass, keeping only
its input; `full` recomputes each whole layer, keeping only the layer inputs, except the activations named in
`train.offload`, which are saved to pinned host memory instead. The names (`ACTIVATION_NAMES`) are attached
with `checkpoint_name`, so any `jax.checkpoint` policy can refer to them.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dropless.core.config import Config, ConfigError, ModelConfig, TrainConfig
from dropless.models.attention import attention, attention_logical_axes, init_attention, rotary_dim
from dropless.models.embedding import embed_tokens
from dropless.ops.matmul import matmul_f32_out
from dropless.models.mlp import MLP_LOGICAL_AXES, init_mlp, swiglu
from dropless.ops.norms import rms_norm
from dropless.ops.rope import rope_tables
from dropless.moe.executor import ExpertExecutor, LocalExecutor
from dropless.moe.layer import init_moe, moe_layer

# Activations tagged with `checkpoint_name` in every layer (all [B, S, D] in the compute dtype).
ACTIVATION_NAMES = ("attn_out", "mlp_out", "moe_in", "moe_out")

MOE_LOGICAL_AXES = {
    "router": {"kernel": ("embed", "router")},
    "experts": {"gate_up": ("experts", "embed", "mlp"), "down": ("experts", "mlp", "embed")},
    "shared": MLP_LOGICAL_AXES,
}


def compute_dtype(config: Config) -> jnp.dtype:
    return jnp.dtype(config.train.dtype)


def layer_counts(m: ModelConfig) -> tuple[int, int]:
    """(dense layers, MoE layers)."""
    return m.first_dense_layers, m.num_layers - m.first_dense_layers


# ----------------------------------------------------------------------------------------------- parameters

def _init_dense_layer(key: jax.Array, config: Config) -> dict:
    m = config.model
    k_attn, k_mlp = jax.random.split(key)
    return {
        "attn_norm": jnp.ones((m.hidden_size,), jnp.float32),
        "attn": init_attention(k_attn, m),
        "mlp_norm": jnp.ones((m.hidden_size,), jnp.float32),
        "mlp": init_mlp(k_mlp, m.hidden_size, m.dense_intermediate_size, m.init_std),
    }


def _init_moe_layer(key: jax.Array, config: Config) -> dict:
    m = config.model
    k_attn, k_moe = jax.random.split(key)
    return {
        "attn_norm": jnp.ones((m.hidden_size,), jnp.float32),
        "attn": init_attention(k_attn, m),
        "mlp_norm": jnp.ones((m.hidden_size,), jnp.float32),
        "moe": init_moe(k_moe, m.hidden_size, config.moe, m.init_std),
    }


def _init_layout(key: jax.Array, config: Config) -> dict:
    """Parameters drawn weight by weight by each module's own init: defines the layout (only ever traced)."""
    m = config.model
    num_dense, num_moe = layer_counts(m)
    k_embed, k_dense, k_moe, k_head = jax.random.split(key, 4)
    params: dict[str, Any] = {
        "embed": m.init_std * jax.random.normal(k_embed, (m.vocab_size, m.hidden_size), jnp.float32)}
    # vmap over per-layer keys builds the stacked [L, ...] arrays directly.
    if num_dense:
        params["dense_layers"] = jax.vmap(partial(_init_dense_layer, config=config))(jax.random.split(k_dense, num_dense))
    if num_moe:
        params["moe_layers"] = jax.vmap(partial(_init_moe_layer, config=config))(jax.random.split(k_moe, num_moe))
    params["final_norm"] = jnp.ones((m.hidden_size,), jnp.float32)
    if not m.tie_embeddings:
        params["lm_head"] = m.init_std * jax.random.normal(k_head, (m.hidden_size, m.vocab_size), jnp.float32)
    return params


def _is_norm(path) -> bool:
    return str(getattr(path[-1], "key", "")).endswith("norm")


def init_params(key: jax.Array, config: Config) -> dict:
    """Float32 parameters: normal(0, model.init_std) matrices, ones for norm weights (DESIGN.md layout).

    The layout comes from the modules' own init functions (traced, never run); the values of all matrices are
    consecutive slices of ONE normal draw. XLA then compiles one random-number kernel instead of one per weight:
    on a 2-core CPU that cut compiling the tests' 3-layer model's init from 17 s to 1.6 s.
    """
    shapes = jax.eval_shape(partial(_init_layout, config=config), key)
    leaves, treedef = jax.tree.flatten_with_path(shapes)
    total = sum(math.prod(leaf.shape) for path, leaf in leaves if not _is_norm(path))
    draw = config.model.init_std * jax.random.normal(key, (total,), jnp.float32)
    values, offset = [], 0
    for path, leaf in leaves:
        if _is_norm(path):
            values.append(jnp.ones(leaf.shape, jnp.float32))
            continue
        size = math.prod(leaf.shape)
        values.append(draw[offset:offset + size].reshape(leaf.shape))
        offset += size
    return jax.tree.unflatten(treedef, values)


def init_state(config: Config) -> dict:
    """Untrained model state: DeepSeek-V3's per-layer router bias (`e_score_correction_bias`), zeros."""
    return {"router_bias": jnp.zeros((layer_counts(config.model)[1], config.moe.num_experts), jnp.float32)}


def logical_axes(config: Config) -> dict:
    """A pytree shaped like `init_params(key, config)` whose leaves are tuples of logical axis names."""
    m = config.model
    num_dense, num_moe = layer_counts(m)

    def stacked(tree: dict) -> dict:
        return jax.tree.map(lambda axes: ("layers", *axes), tree, is_leaf=lambda leaf: isinstance(leaf, tuple))

    def layer(mlp_name: str, mlp_axes: dict) -> dict:
        return stacked({"attn_norm": ("embed",), "attn": attention_logical_axes(m), "mlp_norm": ("embed",),
                        mlp_name: mlp_axes})

    axes: dict[str, Any] = {"embed": ("vocab", "embed")}
    if num_dense:
        axes["dense_layers"] = layer("mlp", MLP_LOGICAL_AXES)
    if num_moe:
        moe_axes = dict(MOE_LOGICAL_AXES)
        if config.moe.num_shared_experts == 0:
            del moe_axes["shared"]
        axes["moe_layers"] = layer("moe", moe_axes)
    axes["final_norm"] = ("embed",)
    if not m.tie_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def param_breakdown(config: Config) -> dict[str, int]:
    """Parameter counts by component, from the config alone (no arrays are built)."""
    m, moe = config.model, config.moe
    D, H = m.hidden_size, m.num_heads
    num_dense, num_moe = layer_counts(m)
    if m.attention == "mla":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = D * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * qk if m.q_lora_rank else D * H * qk
        kv = D * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
        attn = q + kv + H * m.v_head_dim * D
    else:
        hd = m.head_dim
        attn = 2 * D * H * hd + 2 * D * m.num_kv_heads * hd + (2 * hd if m.qk_norm else 0)
    expert = 3 * D * moe.expert_intermediate_size
    return {
        "embed": m.vocab_size * D,
        "lm_head": 0 if m.tie_embeddings else D * m.vocab_size,
        "norms": 2 * D * m.num_layers + D,
        "attention": attn * m.num_layers,
        "dense_mlp": 3 * D * m.dense_intermediate_size * num_dense,
        "router": D * moe.num_experts * num_moe,
        "routed_experts": expert * moe.num_experts * num_moe,
        "shared_experts": expert * moe.num_shared_experts * num_moe,
    }


def param_counts(config: Config) -> tuple[int, int]:
    """(total, active per token). Active counts every dense weight, the shared experts and top-k of the routed
    experts; both include the embedding table (and the untied lm_head)."""
    parts = param_breakdown(config)
    total = sum(parts.values())
    moe = config.moe
    inactive = parts["routed_experts"] * (moe.num_experts - moe.num_experts_per_tok) // moe.num_experts
    return total, total - inactive


# ----------------------------------------------------------------------------------------------- forward

def _offload_names(train: TrainConfig) -> tuple[str, ...]:
    names = tuple(name.strip() for name in train.offload.split(",") if name.strip())
    unknown = [name for name in names if name not in ACTIVATION_NAMES]
    if unknown:
        raise ConfigError(f"train.offload names unknown activation(s) {', '.join(unknown)}; "
                          f"choose from {', '.join(ACTIVATION_NAMES)}.")
    if names and train.remat != "full":
        raise ConfigError(f"train.offload={train.offload!r} needs train.remat=full (offloaded activations replace "
                          f"recomputation); set train.remat=full or train.offload=''.")
    return names


def _layer_checkpoint(fn, train: TrainConfig):
    """Wrap a layer body for `train.remat=full`; identity otherwise."""
    offload = _offload_names(train)
    if train.remat != "full":
        return fn
    if offload:
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(offload),
            offload_src="device", offload_dst="pinned_host")
    else:
        policy = jax.checkpoint_policies.nothing_saveable
    # prevent_cse=False is safe (and faster) under scan, which already keeps the recomputation separate.
    return jax.checkpoint(fn, policy=policy, prevent_cse=not train.scan_layers)


def _run_layers(body, x_BSD: jax.Array, stacked, scan: bool):
    """`jax.lax.scan(body, x, stacked)`, or the same loop unrolled in Python over the leading layer axis."""
    if scan:
        return jax.lax.scan(body, x_BSD, stacked)
    outputs = []
    for i in range(jax.tree.leaves(stacked)[0].shape[0]):
        x_BSD, out = body(x_BSD, jax.tree.map(lambda a: a[i], stacked))
        outputs.append(out)
    return x_BSD, jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *outputs)


def _attention_block(layer: dict, x_BSD: jax.Array, cos_SP, sin_SP, m: ModelConfig, mesh) -> jax.Array:
    with jax.named_scope("attention"):
        h_BSD = rms_norm(x_BSD, layer["attn_norm"], m.rms_norm_eps)
        y_BSD = checkpoint_name(attention(layer["attn"], h_BSD, cos_SP, sin_SP, m, mesh), "attn_out")
    return x_BSD + y_BSD


def _empty_moe_stats(config: Config, x_BSD: jax.Array):
    """MoEStats with a leading axis of length 0, for models without MoE layers (same pytree as with them)."""
    def one_layer():
        params = init_moe(jax.random.key(0), config.model.hidden_size, config.moe, config.model.init_std)
        bias_E = jnp.zeros((config.moe.num_experts,), jnp.float32)
        return moe_layer(params, bias_E, x_BSD[:1, :1], config.moe, compute_dtype=x_BSD.dtype)[1]
    shapes = jax.eval_shape(one_layer)
    return jax.tree.map(lambda s: jnp.zeros((0, *s.shape), s.dtype), shapes)


def forward(params: dict, state: dict, tokens_BS: jax.Array, config: Config, *,
            executor: ExpertExecutor | None = None):
    """Logits for next-token prediction. Returns (logits_BSV float32, aux).

    aux = {"moe": MoEStats stacked over the MoE layers [Lmoe, ...], "balance_loss": their summed
    `balance_loss`, the term to add to the training loss}. `executor` (built once: `dropless.ep.make_executor`)
    is handed to every `dropless.moe.moe_layer`; None = the one-device `LocalExecutor` for `config.moe`.
    """
    m = config.model
    dtype = compute_dtype(config)
    executor = LocalExecutor.from_config(config.moe) if executor is None else executor
    mesh = executor.mesh  # the attention kernel runs per batch shard over the same mesh
    with jax.named_scope("embed"):
        x_BSD = embed_tokens(params["embed"], tokens_BS, dtype, mesh)
    cos_SP, sin_SP = rope_tables(tokens_BS.shape[1], rotary_dim(m), m.rope_theta, m.rope_scaling)

    def dense_layer(x_BSD, layer):
        x_BSD = _attention_block(layer, x_BSD, cos_SP, sin_SP, m, mesh)
        with jax.named_scope("mlp"):
            h_BSD = rms_norm(x_BSD, layer["mlp_norm"], m.rms_norm_eps)
            y_BSD = checkpoint_name(swiglu(layer["mlp"], h_BSD), "mlp_out")
        return x_BSD + y_BSD, None

    def moe_block(moe_params, bias_E, h_BSD):
        y_BSD, stats = moe_layer(moe_params, bias_E, h_BSD, config.moe, compute_dtype=dtype, executor=executor)
        return y_BSD.astype(dtype), stats

    if config.train.remat == "moe":
        moe_block = jax.checkpoint(moe_block, policy=jax.checkpoint_policies.nothing_saveable,
                                   prevent_cse=not config.train.scan_layers)

    def moe_layer_body(x_BSD, layer_and_bias):
        layer, bias_E = layer_and_bias
        x_BSD = _attention_block(layer, x_BSD, cos_SP, sin_SP, m, mesh)
        with jax.named_scope("moe"):
            h_BSD = checkpoint_name(rms_norm(x_BSD, layer["mlp_norm"], m.rms_norm_eps), "moe_in")
            y_BSD, stats = moe_block(layer["moe"], bias_E, h_BSD)
            y_BSD = checkpoint_name(y_BSD, "moe_out")
        return x_BSD + y_BSD, stats

    if "dense_layers" in params:
        with jax.named_scope("dense_layers"):
            x_BSD, _ = _run_layers(_layer_checkpoint(dense_layer, config.train), x_BSD, params["dense_layers"],
                                   config.train.scan_layers)
    if "moe_layers" in params:
        with jax.named_scope("moe_layers"):
            x_BSD, moe_stats = _run_layers(_layer_checkpoint(moe_layer_body, config.train), x_BSD,
                                           (params["moe_layers"], state["router_bias"]), config.train.scan_layers)
    else:
        moe_stats = _empty_moe_stats(config, x_BSD)

    with jax.named_scope("final_norm"):
        x_BSD = rms_norm(x_BSD, params["final_norm"], m.rms_norm_eps)
    with jax.named_scope("lm_head"):
        head_DV = params["embed"].T if m.tie_embeddings else params["lm_head"]
        logits_BSV = matmul_f32_out(x_BSD.astype(dtype), head_DV.astype(dtype))
    return logits_BSV, {"moe": moe_stats, "balance_loss": jnp.sum(moe_stats.balance_loss)}
