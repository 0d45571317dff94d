"""The decoder-only MoE transformer: the parameter declaration, state, forward pass and parameter counts.

Layers are pre-norm residual blocks, `x += attn(norm(x)); x += mlp_or_moe(norm(x))`. The first
`model.first_dense_layers` layers use a dense SwiGLU MLP, the rest the MoE layer of `dropless.moe`. Each group is
stored stacked on a leading `layers` axis (declared once by `param_specs`; `param_table` prints the layout) and
run with one `jax.lax.scan`, so compile time does not grow with depth, or unrolled with `train.scan_layers=false`
(same numbers; for shallow models the straight-line program skips the scan's stacked buffers). The numbers match
Hugging Face's DeepseekV3ForCausalLM, MixtralForCausalLM and Qwen3MoeForCausalLM (positions 0..S-1, no padding mask).

Precision: float32 master weights are cast to the compute dtype (`train.dtype`) where they are used; the
residual stream is in the compute dtype; norms, attention softmax, router and logits are float32.

Rematerialisation (`train.remat`): `none`; `moe` recomputes each MoE block in the backward pass, keeping only
its input; `full` recomputes each whole layer, keeping only the layer inputs, except the activations named in
`train.offload`, which are saved to pinned host memory instead. The names (`ACTIVATION_NAMES`) are attached
with `checkpoint_name`, so any `jax.checkpoint` policy can refer to them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dropless.core import params as params_lib
from dropless.core.config import ACTIVATION_NAMES, Config, ModelConfig, TrainConfig  # noqa: F401 (re-exported)
from dropless.core.params import ParamSpec, Specs
from dropless.fp8 import make_recipe
from dropless.models.attention import attention, attention_params, rotary_dim
from dropless.models.embedding import embed_tokens
from dropless.models.mlp import mlp_params, swiglu
from dropless.moe.executor import ExpertExecutor, LocalExecutor
from dropless.moe.layer import init_moe, moe_layer, moe_params
from dropless.ops.matmul import matmul_f32_out
from dropless.ops.norms import rms_norm
from dropless.ops.rope import rope_tables


def compute_dtype(config: Config) -> jnp.dtype:
    return jnp.dtype(config.train.dtype)


def layer_counts(m: ModelConfig) -> tuple[int, int]:
    """(dense layers, MoE layers)."""
    return m.first_dense_layers, m.num_layers - m.first_dense_layers


# ----------------------------------------------------------------------------------------------- parameters

def _layer_params(config: Config, mlp_name: str) -> Specs:
    m = config.model
    mlp = (mlp_params(m.hidden_size, m.dense_intermediate_size) if mlp_name == "mlp"
           else moe_params(m.hidden_size, config.moe))
    return {"attn_norm": ParamSpec((m.hidden_size,), ("embed",), "ones"), "attn": attention_params(m),
            "mlp_norm": ParamSpec((m.hidden_size,), ("embed",), "ones"), mlp_name: mlp}


def param_specs(config: Config) -> Specs:
    """The model's weights, declared once: each group of layers stacked on a leading `layers` axis, a group with no
    layers absent, `lm_head` absent with tied embeddings. Init, logical axes and counts derive from it."""
    m = config.model
    num_dense, num_moe = layer_counts(m)
    specs: Specs = {"embed": ParamSpec((m.vocab_size, m.hidden_size), ("vocab", "embed"))}
    if num_dense:
        specs["dense_layers"] = params_lib.stacked(_layer_params(config, "mlp"), num_dense)
    if num_moe:
        specs["moe_layers"] = params_lib.stacked(_layer_params(config, "moe"), num_moe)
    specs["final_norm"] = ParamSpec((m.hidden_size,), ("embed",), "ones")
    if not m.tie_embeddings:
        specs["lm_head"] = ParamSpec((m.hidden_size, m.vocab_size), ("embed", "vocab"))
    return specs


def init_params(key: jax.Array, config: Config) -> dict:
    """Float32 parameters: normal(0, model.init_std) matrices, ones for norm weights, every matrix a slice of one
    normal draw (`dropless.core.params.init_one_draw`)."""
    return params_lib.init_one_draw(key, param_specs(config), config.model.init_std)


def init_state(config: Config) -> dict:
    """Untrained model state: DeepSeek-V3's per-layer router bias (`e_score_correction_bias`), zeros."""
    return {"router_bias": jnp.zeros((layer_counts(config.model)[1], config.moe.num_experts), jnp.float32)}


def logical_axes(config: Config) -> dict:
    """A pytree shaped like `init_params(key, config)` whose leaves are tuples of logical axis names."""
    return params_lib.logical_axes(param_specs(config))


# The letters of the documented layout (docs/architecture.md, "Parameters") for the sizes the declaration reads.
SIZE_NAMES = {
    "model": {"vocab_size": "V", "hidden_size": "D", "num_layers": "L", "first_dense_layers": "L_dense",
              "dense_intermediate_size": "F_dense", "num_heads": "H", "num_kv_heads": "N", "head_dim": "hd",
              "q_lora_rank": "Rq", "kv_lora_rank": "Rkv", "qk_rope_head_dim": "rope", "qk_nope_head_dim": "nope",
              "v_head_dim": "v"},
    "moe": {"num_experts": "E", "expert_intermediate_size": "F", "num_shared_experts": "n_shared"},
}


def param_table(config: Config, *, symbolic: bool = True) -> str:
    """The parameter layout of this config as a Markdown table: shapes (as formulas of `SIZE_NAMES`, or the
    config's numbers), logical axes and initial values, one row per weight."""
    if symbolic:
        config = dataclasses.replace(config, **{group: params_lib.symbolic(getattr(config, group), names)
                                                for group, names in SIZE_NAMES.items()})
    return params_lib.table(param_specs(config))


def _component(path: tuple[str, ...]) -> str:
    """The `param_breakdown` bucket of a weight."""
    if path[0] in ("embed", "lm_head"):
        return path[0]
    if path[0] == "final_norm" or path[1] in ("attn_norm", "mlp_norm"):
        return "norms"
    if path[1] == "attn":
        return "attention"
    if path[1] == "mlp":
        return "dense_mlp"
    return {"router": "router", "experts": "routed_experts", "shared": "shared_experts"}[path[2]]


def param_breakdown(config: Config) -> dict[str, int]:
    """Parameter counts by component, from the declaration alone (no arrays are built)."""
    parts = dict.fromkeys(("embed", "lm_head", "norms", "attention", "dense_mlp", "router", "routed_experts",
                           "shared_experts"), 0)
    for path, spec in params_lib.flatten(param_specs(config)):
        parts[_component(path)] += math.prod(spec.shape)
    return parts


def param_counts(config: Config) -> tuple[int, int]:
    """(total, active per token). Active counts every dense weight, the shared experts and top-k of the routed
    experts; both include the embedding table (and the untied lm_head)."""
    parts = param_breakdown(config)
    total = sum(parts.values())
    moe = config.moe
    inactive = parts["routed_experts"] * (moe.num_experts - moe.num_experts_per_tok) // moe.num_experts
    return total, total - inactive


# ----------------------------------------------------------------------------------------------- forward

def _layer_checkpoint(fn, train: TrainConfig):
    """Wrap a layer body for `train.remat=full`; identity otherwise."""
    offload = train.offload_names
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


def _attention_block(layer: dict, x_BSD: jax.Array, cos_SP, sin_SP, m: ModelConfig, mesh, recipe) -> jax.Array:
    with jax.named_scope("attention"):
        h_BSD = rms_norm(x_BSD, layer["attn_norm"], m.rms_norm_eps)
        y_BSD = checkpoint_name(attention(layer["attn"], h_BSD, cos_SP, sin_SP, m, mesh, recipe), "attn_out")
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
    recipe = make_recipe(config.train.fp8)
    executor = LocalExecutor.from_config(config.moe, recipe) if executor is None else executor
    mesh = executor.mesh  # the attention kernel runs per batch shard over the same mesh
    with jax.named_scope("embed"):
        x_BSD = embed_tokens(params["embed"], tokens_BS, dtype, mesh)
    cos_SP, sin_SP = rope_tables(tokens_BS.shape[1], rotary_dim(m), m.rope_theta, m.rope_scaling)

    def dense_layer(x_BSD, layer):
        x_BSD = _attention_block(layer, x_BSD, cos_SP, sin_SP, m, mesh, recipe)
        with jax.named_scope("mlp"):
            h_BSD = rms_norm(x_BSD, layer["mlp_norm"], m.rms_norm_eps)
            y_BSD = checkpoint_name(swiglu(layer["mlp"], h_BSD, recipe), "mlp_out")
        return x_BSD + y_BSD, None

    def moe_block(moe_params, bias_E, h_BSD):
        y_BSD, stats = moe_layer(moe_params, bias_E, h_BSD, config.moe, compute_dtype=dtype, executor=executor,
                                 recipe=recipe)
        return y_BSD.astype(dtype), stats

    if config.train.remat == "moe":
        moe_block = jax.checkpoint(moe_block, policy=jax.checkpoint_policies.nothing_saveable,
                                   prevent_cse=not config.train.scan_layers)

    def moe_layer_body(x_BSD, layer_and_bias):
        layer, bias_E = layer_and_bias
        x_BSD = _attention_block(layer, x_BSD, cos_SP, sin_SP, m, mesh, recipe)
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
