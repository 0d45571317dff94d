"""The decoder-only MoE transformer: the parameter declaration, state, forward pass and parameter counts.

Layers are pre-norm residual blocks, `x += attn(norm(x)); x += mlp_or_moe(norm(x))`. `model.layer_types` says
which layers use a dense SwiGLU MLP (D) and which the MoE layer of `dropless.moe` (M), in any order. The dense
layers are stored stacked on a leading `layers` axis, and so are the MoE layers (declared once by `param_specs`;
`param_table` prints the layout), each stack in model order. Every run of consecutive layers of one type is one
`jax.lax.scan` over its slice of the stack, so compile time grows with the number of runs (2 for DeepSeek-V3's
61 layers), not with depth; `train.scan_layers=false` unrolls them (same numbers; for shallow models the
straight-line program skips the scan's stacked buffers). The numbers match Hugging Face's DeepseekV3ForCausalLM,
MixtralForCausalLM and Qwen3MoeForCausalLM (positions 0..S-1, no padding mask).

Multi-token prediction (`model.mtp_layers` = D > 0, DeepSeek-V3 section 2.2), run only when `forward(mtp=True)`:
module k (1..D) turns the depth k-1 hidden state h^{k-1} (h^0: the main model's output after its final norm, as
Megatron-Core and vLLM feed it) and the embedding of token i+k into
    h^k_i = Block_k(eh_proj_k [enorm_k(Emb(t_{i+k})); hnorm_k(h^{k-1}_i)])
and predicts token i+k+1 with the shared output head, `OutHead(head_norm_k(h^k_i))`. The embedding comes first
in the concatenation, as in DeepSeek-V3's checkpoint (the paper writes the two halves the other way round; the
order only permutes eh_proj's rows). Sequences keep their length S: depth k reads the tokens shifted left by k,
and its last k positions, which have no target, are left out of the loss (`dropless.train.step`); causal
attention keeps them from reaching the other positions. Embedding and output head are the main model's.

KV-cache decoding (`init_cache`, `forward_cached`; `mtp_forward_cached` for the first MTP module) runs the same
layers over new positions only, each layer's attention reading and extending its cache (`attention.cache_shapes`),
for `dropless generate` on one device.

Precision: float32 master weights are cast to the compute dtype (`train.dtype`) where they are used; the
residual stream is in the compute dtype; norms, attention softmax, router and logits are float32.

Rematerialisation (`train.remat`): `none`; `moe` recomputes each MoE block in the backward pass, keeping only
its input; `full` recomputes each whole layer, keeping only the layer inputs, except the activations named in
`train.offload`, which are saved to pinned host memory instead. The names (`ACTIVATION_NAMES`) are attached
with `checkpoint_name`, so any `jax.checkpoint` policy can refer to them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dropless.core import params as params_lib
from dropless.core.config import (ACTIVATION_NAMES, Config, ConfigError, ModelConfig,  # noqa: F401 (re-exported)
                                  TrainConfig)
from dropless.core.params import ParamSpec, Specs
from dropless.fp8 import linear, train_recipe
from dropless.models.attention import attention, attention_cached, attention_params, cache_shapes, rotary_dim
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
    """(dense layers, MoE layers) of the main model (the MTP modules' blocks not included)."""
    if not m.layer_pattern:  # arithmetic on the fields keeps `param_table`'s symbols: L_dense, L-L_dense
        return m.first_dense_layers, m.num_layers - m.first_dense_layers
    return m.layer_types.count("D"), m.layer_types.count("M")


def layer_runs(m: ModelConfig) -> list[tuple[str, int, int]]:
    """The main model's runs of consecutive layers of one type, in order: (type "D" or "M", start, stop), start
    and stop indexing that type's stack. "DMMDM" -> [("D", 0, 1), ("M", 0, 2), ("D", 1, 2), ("M", 2, 3)]."""
    runs: list[tuple[str, int, int]] = []
    seen = {"D": 0, "M": 0}
    for kind in m.layer_types:
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((kind, seen[kind], seen[kind] + 1))
        seen[kind] += 1
    return runs


def stack_position(m: ModelConfig, layer: int) -> tuple[str, int]:
    """Layer `layer` of the main model as (its stack, its index there): ("dense_layers" | "moe_layers", l)."""
    kind = m.layer_types[layer]
    return ("dense_layers" if kind == "D" else "moe_layers"), m.layer_types[:layer].count(kind)


def mtp_moe_blocks(m: ModelConfig) -> int:
    """How many MoE blocks the MTP modules hold (their router biases follow the main model's in the state)."""
    return m.mtp_layers if m.mtp_block == "moe" else 0


def num_router_rows(m: ModelConfig) -> int:
    """Rows of the router-bias state and of the MoE statistics of a training step: the main model's MoE layers
    in order, then the MTP modules' MoE blocks."""
    return layer_counts(m)[1] + mtp_moe_blocks(m)


# ----------------------------------------------------------------------------------------------- parameters

def _layer_params(config: Config, mlp_name: str) -> Specs:
    m = config.model
    mlp = (mlp_params(m.hidden_size, m.dense_intermediate_size) if mlp_name == "mlp"
           else moe_params(m.hidden_size, config.moe))
    return {"attn_norm": ParamSpec((m.hidden_size,), ("embed",), "ones"), "attn": attention_params(m),
            "mlp_norm": ParamSpec((m.hidden_size,), ("embed",), "ones"), mlp_name: mlp}


def _mtp_params(config: Config) -> Specs:
    """One MTP module: the two input norms, the projection of their concatenation [2D, D] (embedding rows
    first), one transformer block, and the norm before the shared output head."""
    m = config.model
    hidden = ParamSpec((m.hidden_size,), ("embed",), "ones")
    return {"enorm": hidden, "hnorm": hidden,
            "eh_proj": ParamSpec((2 * m.hidden_size, m.hidden_size), ("embed", "embed")),
            "block": _layer_params(config, "moe" if m.mtp_block == "moe" else "mlp"), "head_norm": hidden}


def param_specs(config: Config) -> Specs:
    """The model's weights, declared once: each group of layers stacked on a leading `layers` axis, a group with no
    layers absent, `lm_head` absent with tied embeddings, `mtp` (the MTP modules, stacked) absent without them.
    Init, logical axes and counts derive from it."""
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
    if m.mtp_layers:
        specs["mtp"] = params_lib.stacked(_mtp_params(config), m.mtp_layers)
    return specs


def is_router_weight(path: tuple, leaf=None) -> bool:
    """A routers' weight matrix: a leaf under a "router" key (dense layers and dense MTP blocks have none)."""
    return any(getattr(k, "key", None) == "router" for k in path)


def init_params(key: jax.Array, config: Config) -> dict:
    """Float32 parameters: normal(0, model.init_std) matrices (the routers': normal(0, model.router_init_std) when
    it is set), ones for norm weights, every matrix a slice of one normal draw (`dropless.core.params.init_one_draw`)."""
    m = config.model
    params = params_lib.init_one_draw(key, param_specs(config), m.init_std)
    if m.router_init_std:  # the same draw, rescaled: every other weight keeps its value
        rescale = lambda path, leaf: leaf * (m.router_init_std / m.init_std) if is_router_weight(path) else leaf
        params = jax.tree_util.tree_map_with_path(rescale, params)
    return params


def init_state(config: Config) -> dict:
    """Untrained model state, one row per router (per MoE layer, then per MTP MoE block: `num_router_rows`), zeros:
    DeepSeek-V3's router bias (`e_score_correction_bias`) [R, E] and, with moe.router_common_rate > 0, the running
    mean of each router's input whose direction the router does not see, "router_common" [R, D]."""
    rows = num_router_rows(config.model)
    state = {"router_bias": jnp.zeros((rows, config.moe.num_experts), jnp.float32)}
    if config.moe.router_common_rate > 0:
        state["router_common"] = jnp.zeros((rows, config.model.hidden_size), jnp.float32)
    return state


def _leaf_shapes(tree, name: str) -> dict[str, tuple]:
    """{"name['a']['b']": shape} of every leaf of a nested dict of arrays (or of shape-carrying leaves)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {name + "".join(f"[{getattr(key, 'key', key)!r}]" for key in path): tuple(getattr(leaf, "shape", ()))
            for path, leaf in leaves}


def check_weights(config: Config, params, state) -> None:
    """Refuse given weights (fine-tuning's `init_weights`) that are not this config's model: every parameter of
    `init_params` present with its shape and no other, and the state's leaves those of `init_state` (a state without
    "router_common" is taken: its running means start at zero). One ConfigError naming the first difference."""
    want = _leaf_shapes(jax.eval_shape(lambda: init_params(jax.random.key(0), config)), "params")
    want_state = _leaf_shapes(jax.eval_shape(lambda: init_state(config)), "state")
    got = _leaf_shapes(params, "params")
    got_state = _leaf_shapes(state, "state")
    fix = ("start from the config the weights come with (the one load_model or load_hf returns, as --init-from-hf "
           "does) and keep the keys that shape the weights (model.*, moe.num_experts and the like)")
    for expected, given in ((want, got), (want_state, got_state)):
        optional = {"state['router_common']"} if expected is want_state else set()
        for key, shape in expected.items():
            if key not in given and key not in optional:
                raise ConfigError(f"The initial weights lack {key} {shape}, which this config's model has; {fix}.")
            if key in given and given[key] != shape:
                raise ConfigError(f"The initial weights' {key} has shape {given[key]}, but this config's model "
                                  f"has {shape}; {fix}.")
        extra = sorted(set(given) - set(expected))
        if extra:
            raise ConfigError(f"The initial weights hold {extra[0]} {given[extra[0]]}, which this config's model "
                              f"does not have; {fix}.")


def _router_rows(state: dict, start: int, stop: int) -> dict:
    """Routers start..stop-1's rows of every per-router state leaf (`init_state`)."""
    return {key: value[start:stop] for key, value in state.items() if key in ("router_bias", "router_common")}


def logical_axes(config: Config) -> dict:
    """A pytree shaped like `init_params(key, config)` whose leaves are tuples of logical axis names."""
    return params_lib.logical_axes(param_specs(config))


# The letters of the documented layout (docs/architecture.md, "Parameters") for the sizes the declaration reads.
SIZE_NAMES = {
    "model": {"vocab_size": "V", "hidden_size": "D", "num_layers": "L", "first_dense_layers": "L_dense",
              "mtp_layers": "L_mtp",
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
    if path[0] == "mtp":
        return "mtp_routed_experts" if path[2:4] == ("moe", "experts") else "mtp"
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
                           "shared_experts", "mtp", "mtp_routed_experts"), 0)
    for path, spec in params_lib.flatten(param_specs(config)):
        parts[_component(path)] += math.prod(spec.shape)
    return parts


def param_counts(config: Config) -> tuple[int, int]:
    """(total, active per token). Active counts every dense weight, the shared experts and top-k of the routed
    experts; both include the embedding table (and the untied lm_head) and the MTP modules (`mtp` and
    `mtp_routed_experts` in `param_breakdown`), which a model trained with MTP computes for every token."""
    parts = param_breakdown(config)
    total = sum(parts.values())
    moe = config.moe
    routed = parts["routed_experts"] + parts["mtp_routed_experts"]
    inactive = routed * (moe.num_experts - moe.num_experts_per_tok) // moe.num_experts
    return total, total - inactive


# ----------------------------------------------------------------------------------------------- forward

def _layer_checkpoint(fn, train: TrainConfig, *, in_scan: bool):
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
    return jax.checkpoint(fn, policy=policy, prevent_cse=not in_scan)


def _run_layers(body, x_BSD: jax.Array, stacked, scan: bool):
    """`jax.lax.scan(body, x, stacked)`, or the same loop unrolled in Python over the leading layer axis."""
    if scan:
        return jax.lax.scan(body, x_BSD, stacked)
    outputs = []
    for i in range(jax.tree.leaves(stacked)[0].shape[0]):
        x_BSD, out = body(x_BSD, jax.tree.map(lambda a: a[i], stacked))
        outputs.append(out)
    return x_BSD, jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *outputs)


def _rows(stacked, start: int, stop: int):
    """Layers start..stop-1 of a stack (the stack itself when that is all of it: no copy)."""
    if start == 0 and stop == jax.tree.leaves(stacked)[0].shape[0]:
        return stacked
    return jax.tree.map(lambda a: a[start:stop], stacked)


def _attention_block(layer: dict, x_BSD: jax.Array, cos_SP, sin_SP, m: ModelConfig, mesh, recipe,
                     documents_BS: jax.Array | None = None) -> jax.Array:
    with jax.named_scope("attention"):
        h_BSD = rms_norm(x_BSD, layer["attn_norm"], m.rms_norm_eps)
        y_BSD = checkpoint_name(attention(layer["attn"], h_BSD, cos_SP, sin_SP, m, mesh, recipe, documents_BS),
                                "attn_out")
    return x_BSD + y_BSD


def _empty_moe_stats(config: Config, x_BSD: jax.Array):
    """MoEStats with a leading axis of length 0, for models without MoE layers (same pytree as with them)."""
    def one_layer():
        params = init_moe(jax.random.key(0), config.model.hidden_size, config.moe, config.model.init_std)
        bias_E = jnp.zeros((config.moe.num_experts,), jnp.float32)
        return moe_layer(params, bias_E, x_BSD[:1, :1], config.moe, compute_dtype=x_BSD.dtype)[1]
    shapes = jax.eval_shape(one_layer)
    return jax.tree.map(lambda s: jnp.zeros((0, *s.shape), s.dtype), shapes)


def _concat_stats(stats: list, config: Config, x_BSD: jax.Array):
    """MoEStats of several runs of layers, concatenated along the layer axis in model order."""
    if not stats:
        return _empty_moe_stats(config, x_BSD)
    return stats[0] if len(stats) == 1 else jax.tree.map(lambda *runs: jnp.concatenate(runs), *stats)


class _Layers:
    """The bodies of a dense and of a MoE layer, `(x_BSD, weights) -> (x_BSD, per-layer output)`, closed over
    what every layer of one forward pass shares (RoPE tables, mesh, executor, recipe)."""

    def __init__(self, config: Config, executor: ExpertExecutor, cos_SP, sin_SP, dtype, training: bool = False,
                 other_sequences: jax.Array | None = None, documents_BS: jax.Array | None = None):
        self.config, self.executor, self.cos_SP, self.sin_SP, self.dtype = config, executor, cos_SP, sin_SP, dtype
        self.training, self.other_sequences, self.documents_BS = training, other_sequences, documents_BS
        self.recipe = train_recipe(config.train)
        self.mesh = executor.mesh  # the attention kernel and FP8 matmuls run per batch shard over the same mesh
        def remat_moe(in_scan: bool):
            if config.train.remat != "moe":
                return self._moe_block
            # Outside a scan, XLA would merge the recomputation with the forward (CSE) and keep the activations.
            return jax.checkpoint(self._moe_block, policy=jax.checkpoint_policies.nothing_saveable,
                                  prevent_cse=not in_scan)
        self.moe_block = remat_moe(in_scan=config.train.scan_layers)  # the main layers
        self.moe_block_unscanned = remat_moe(in_scan=False)  # the MTP modules, never scanned

    @classmethod
    def for_sequence(cls, config: Config, executor: ExpertExecutor | None, seq_len: int,
                     training: bool = False, other_sequences: jax.Array | None = None,
                     documents_BS: jax.Array | None = None) -> "_Layers":
        """The layers of one forward pass over `seq_len` positions; executor None = the one-device LocalExecutor;
        `training` and `other_sequences`: as `forward`'s; `documents_BS`: attention within documents
        (`document_ids`), None = over the whole sequence."""
        if executor is None:
            executor = LocalExecutor.from_config(config.moe, train_recipe(config.train))
        m = config.model
        cos_SP, sin_SP = rope_tables(seq_len, rotary_dim(m), m.rope_theta, m.rope_scaling)
        return cls(config, executor, cos_SP, sin_SP, compute_dtype(config), training, other_sequences, documents_BS)

    def _moe_block(self, moe_params, router: dict, h_BSD):
        y_BSD, stats = moe_layer(moe_params, router["router_bias"], h_BSD, self.config.moe, compute_dtype=self.dtype,
                                 executor=self.executor, recipe=self.recipe,
                                 router_common_D=router.get("router_common"), training=self.training,
                                 other_sequences=self.other_sequences)
        return y_BSD.astype(self.dtype), stats

    def attention(self, layer, x_BSD):
        return _attention_block(layer, x_BSD, self.cos_SP, self.sin_SP, self.config.model, self.mesh, self.recipe,
                                self.documents_BS)

    def dense(self, x_BSD, layer):
        return self.dense_mlp(layer, self.attention(layer, x_BSD)), None

    def dense_mlp(self, layer, x_BSD):
        """The second half of a dense layer: x + mlp(norm(x))."""
        m = self.config.model
        with jax.named_scope("mlp"):
            h_BSD = rms_norm(x_BSD, layer["mlp_norm"], m.rms_norm_eps)
            y_BSD = checkpoint_name(swiglu(layer["mlp"], h_BSD, self.recipe, self.mesh), "mlp_out")
        return x_BSD + y_BSD

    def moe(self, x_BSD, layer_and_router, *, unscanned: bool = False):
        """`layer_and_router`: (the layer's weights, its router's state row: `_router_rows`)."""
        layer, router = layer_and_router
        return self.moe_mlp(layer, router, self.attention(layer, x_BSD), unscanned=unscanned)

    def moe_mlp(self, layer, router: dict, x_BSD, *, unscanned: bool = False):
        """The second half of a MoE layer: (x + moe(norm(x)), the layer's MoEStats)."""
        m = self.config.model
        with jax.named_scope("moe"):
            h_BSD = checkpoint_name(rms_norm(x_BSD, layer["mlp_norm"], m.rms_norm_eps), "moe_in")
            block = self.moe_block_unscanned if unscanned else self.moe_block
            y_BSD, stats = block(layer["moe"], router, h_BSD)
            y_BSD = checkpoint_name(y_BSD, "moe_out")
        return x_BSD + y_BSD, stats


def document_ids(tokens_BS: jax.Array, config: Config) -> jax.Array | None:
    """With data.document_mask, each position's document within its sequence [B, S] int32: the number of
    end-of-document ids (data.eos_id) before it, so an end-of-document id belongs to the document it ends; None
    without. RoPE scores a query and a key by their distance alone, so positions need no restart per document."""
    if not config.data.document_mask:
        return None
    if config.data.eos_id < 0:
        raise ConfigError("data.document_mask needs the end-of-document id that separates the documents; set "
                          "data.eos_id (a run on text data takes its tokenizer's).")
    ends_BS = (tokens_BS == config.data.eos_id).astype(jnp.int32)
    return jnp.cumsum(ends_BS, axis=1) - ends_BS


def _output_head(params: dict, x_BSD: jax.Array, config: Config, dtype) -> jax.Array:
    head_DV = params["embed"].T if config.model.tie_embeddings else params["lm_head"]
    return matmul_f32_out(x_BSD.astype(dtype), head_DV.astype(dtype))


def _mtp_input(params: dict, module: dict, next_tokens_BS, h_BSD, layers: _Layers, mesh) -> jax.Array:
    """An MTP module's block input at each position i: eh_proj [enorm(Emb(token i + k)); hnorm(h^{k-1}_i)]."""
    m = layers.config.model
    e_BSD = embed_tokens(params["embed"], next_tokens_BS, layers.dtype, mesh)
    joined_BS2D = jnp.concatenate([rms_norm(e_BSD, module["enorm"], m.rms_norm_eps),
                                   rms_norm(h_BSD, module["hnorm"], m.rms_norm_eps)], axis=-1)
    return linear(joined_BS2D, module["eh_proj"], layers.recipe, mesh=layers.mesh).astype(layers.dtype)


def _mtp_modules(params: dict, state: dict, tokens_BS, h_BSD, layers: _Layers, mesh):
    """The MTP depths 1..D after the main model's normalised output `h_BSD`. Returns (logits per depth, the
    MoEStats of each MoE block, [1, ...] each; none for dense blocks)."""
    config, dtype = layers.config, layers.dtype
    m = config.model
    moe_block = m.mtp_block == "moe"
    body = _layer_checkpoint(functools.partial(layers.moe, unscanned=True) if moe_block else layers.dense,
                             config.train, in_scan=False)
    first_router_row = layer_counts(m)[1]
    logits, stats = [], []
    for k in range(1, m.mtp_layers + 1):
        module = jax.tree.map(lambda a: a[k - 1], params["mtp"])
        with jax.named_scope(f"mtp_{k}"):
            # Token i+k at position i; the last k positions wrap around to the sequence's start and are never
            # scored (causal attention keeps them out of the earlier positions).
            x_BSD = _mtp_input(params, module, jnp.roll(tokens_BS, -k, axis=1), h_BSD, layers, mesh)
            if moe_block:
                row = first_router_row + k - 1
                router = jax.tree.map(lambda a: a[0], _router_rows(state, row, row + 1))
                x_BSD, layer_stats = body(x_BSD, (module["block"], router))
                stats.append(jax.tree.map(lambda a: a[None], layer_stats))
            else:
                x_BSD, _ = body(x_BSD, module["block"])
            h_BSD = x_BSD
            logits.append(_output_head(params, rms_norm(x_BSD, module["head_norm"], m.rms_norm_eps), config, dtype))
    return tuple(logits), stats


def mtp_logits(params: dict, state: dict, tokens_BS: jax.Array, hidden_BSD: jax.Array, config: Config):
    """The MTP modules alone, after a main forward pass that returned its `hidden` (`forward(..., hidden=True)`):
    D float32 [B, S, V] arrays, depth k's position i scoring token i+k+1 from the main model's state at i and the
    tokens up to i+k, without running the main model again (the reference `mtp_forward_cached`'s drafts are
    tested against)."""
    layers = _Layers.for_sequence(config, None, tokens_BS.shape[1], documents_BS=document_ids(tokens_BS, config))
    return _mtp_modules(params, state, tokens_BS, hidden_BSD, layers, None)[0]


def forward(params: dict, state: dict, tokens_BS: jax.Array, config: Config, *,
            executor: ExpertExecutor | None = None, mtp: bool = False, hidden: bool = False, training: bool = False,
            other_sequences: jax.Array | None = None):
    """Logits for next-token prediction. Returns (logits_BSV float32, aux).

    aux = {"moe": MoEStats stacked over the MoE layers [Lmoe, ...], "balance_loss": their summed
    `balance_loss`, the term to add to the training loss}. With `mtp` (training) and `model.mtp_layers` = D > 0,
    also "mtp_logits": D float32 [B, S, V] arrays, depth k's position i scoring token i+k+1 (positions S-k..
    S-1 have no target), and the MTP modules' MoE blocks follow the MoE layers in "moe" and "balance_loss"
    (`num_router_rows`). With `hidden`, also "hidden": the final-normed [B, S, D] state the output head and the
    MTP modules read (`mtp_logits`). `executor` (built once: `dropless.ep.make_executor`) is handed to every
    `dropless.moe.moe_layer`; None = the one-device `LocalExecutor` for `config.moe`. `training`: a training
    step's pass (moe.router_common_source="other_sequences" applies; evaluation and inference leave it False).
    `other_sequences`: a traced boolean, whether this training step takes the other sequences' direction
    (moe.router_common_other_steps); None = every training step does.
    """
    m = config.model
    layers = _Layers.for_sequence(config, executor, tokens_BS.shape[1], training, other_sequences,
                                  document_ids(tokens_BS, config))
    dtype, mesh = layers.dtype, layers.mesh
    with jax.named_scope("embed"):
        x_BSD = embed_tokens(params["embed"], tokens_BS, dtype, mesh)
    scan = config.train.scan_layers
    dense_body = _layer_checkpoint(layers.dense, config.train, in_scan=scan)
    moe_body = _layer_checkpoint(layers.moe, config.train, in_scan=scan)

    stats = []
    for run, (kind, start, stop) in enumerate(layer_runs(m)):
        # One named scope per stack, as with a dense prefix; runs after the first two are numbered.
        name = ("dense_layers" if kind == "D" else "moe_layers") + (f"_{run}" if run > 1 else "")
        with jax.named_scope(name):
            if kind == "D":
                x_BSD, _ = _run_layers(dense_body, x_BSD, _rows(params["dense_layers"], start, stop), scan)
            else:
                routers = _router_rows(state, start, stop)
                x_BSD, run_stats = _run_layers(moe_body, x_BSD, (_rows(params["moe_layers"], start, stop), routers),
                                               scan)
                stats.append(run_stats)

    with jax.named_scope("final_norm"):
        x_BSD = rms_norm(x_BSD, params["final_norm"], m.rms_norm_eps)
    with jax.named_scope("lm_head"):
        logits_BSV = _output_head(params, x_BSD, config, dtype)
    aux = {}
    if mtp and m.mtp_layers:
        aux["mtp_logits"], mtp_stats = _mtp_modules(params, state, tokens_BS, x_BSD, layers, mesh)
        stats += mtp_stats
    if hidden:
        aux["hidden"] = x_BSD
    moe_stats = _concat_stats(stats, config, x_BSD)
    return logits_BSV, {"moe": moe_stats, "balance_loss": jnp.sum(moe_stats.balance_loss), **aux}


# ----------------------------------------------------------------------------------------------- KV cache decoding

def inference_weights(params: dict, config: Config, *, donate: bool = False) -> dict:
    """`params` as a pass without FP8 uses them: every matrix but the routers' in the compute dtype, the rest (norm
    weights, routers) float32. The numbers are unchanged, since each such matrix is cast where it is used; a
    decoding step then reads each weight once in the compute dtype instead of converting its float32 master at
    every token (the experts' whole stack included). Under an FP8 recipe, which quantizes the masters themselves,
    and in float32, the params as they are. `donate` frees each float32 matrix once its copy exists, so the peak
    is the float32 weights and one matrix more, not both copies (the caller must not use `params` again)."""
    dtype = compute_dtype(config)
    if train_recipe(config.train) is not None or dtype == jnp.float32:
        return params

    def cast(path, leaf):
        if leaf.ndim < 2 or is_router_weight(path) or leaf.dtype == dtype:
            return leaf
        copy = leaf.astype(dtype)
        if donate:
            leaf.delete()
        return copy

    return jax.tree_util.tree_map_with_path(cast, params)


def inference_dtypes(config: Config) -> dict:
    """The dtype of each leaf of `inference_weights(params, config)`, as a tree shaped like the params (nothing
    allocated): what a loader can build the weights in, so that their float32 copy never exists."""
    shapes = jax.eval_shape(lambda: inference_weights(init_params(jax.random.key(0), config), config))
    return jax.tree.map(lambda leaf: leaf.dtype, shapes)


def init_cache(config: Config, batch: int, length: int) -> dict:
    """An empty KV cache for `length` positions of `batch` sequences, in the compute dtype: per layer stack
    ("dense_layers", "moe_layers", as the weights), each leaf of `attention.cache_shapes` stacked on the stack's
    layer axis. The MTP modules have none (inference does not run them)."""
    counts = dict(zip(("dense_layers", "moe_layers"), layer_counts(config.model)))
    shapes = cache_shapes(config.model, batch, length)
    return {stack: {name: jnp.zeros((layers, *shape), compute_dtype(config)) for name, shape in shapes.items()}
            for stack, layers in counts.items() if layers}


def _attention_cached(layer: dict, x_BSD: jax.Array, kv: dict, position, cos_SP, sin_SP, layers: _Layers):
    """The first half of a layer over a KV cache: (x + attn(norm(x)), the layer's cache updated)."""
    m = layers.config.model
    h_BSD = rms_norm(x_BSD, layer["attn_norm"], m.rms_norm_eps)
    y_BSD, kv = attention_cached(layer["attn"], h_BSD, kv, position, cos_SP, sin_SP, m, layers.recipe)
    return x_BSD + y_BSD, kv


def _cached_layers(config: Config, length: int, position, S: int):
    """(the layers of a cached pass over a cache of `length` positions, the RoPE tables of positions
    position..position+S-1)."""
    layers = _Layers.for_sequence(config, None, length)
    return layers, (jax.lax.dynamic_slice_in_dim(layers.cos_SP, position, S),
                    jax.lax.dynamic_slice_in_dim(layers.sin_SP, position, S))


def forward_cached(params: dict, state: dict, tokens_BS: jax.Array, cache: dict, position, config: Config, *,
                   hidden: bool = False):
    """The logits of `tokens_BS` at positions position..position+S-1 after the positions before them, whose keys
    and values `cache` holds (`init_cache`); returns (logits_BSV float32, the cache with these positions written),
    and with `hidden` also the final-normed [B, S, D] state the MTP modules read (`mtp_forward_cached`). The
    numbers are `forward`'s at those positions of the whole sequence, up to rounding (under an FP8 recipe, MLA's
    kv_b runs unquantized here: `attention.mla_cached`); positions past
    position+S-1 in the cache are masked, whatever they hold. `position` may be traced. One device, no MTP
    modules (the main model's next-token logits, as `dropless generate` needs them)."""
    m = config.model
    length = jax.tree.leaves(cache)[0].shape[2]  # [layers, B, T, ...]
    layers, (cos_SP, sin_SP) = _cached_layers(config, length, position, tokens_BS.shape[1])

    def dense_body(x_BSD, layer_and_kv):
        layer, kv = layer_and_kv
        x_BSD, kv = _attention_cached(layer, x_BSD, kv, position, cos_SP, sin_SP, layers)
        return layers.dense_mlp(layer, x_BSD), kv

    def moe_body(x_BSD, layer_router_kv):
        layer, router, kv = layer_router_kv
        x_BSD, kv = _attention_cached(layer, x_BSD, kv, position, cos_SP, sin_SP, layers)
        return layers.moe_mlp(layer, router, x_BSD)[0], kv

    x_BSD = embed_tokens(params["embed"], tokens_BS, layers.dtype, None)
    cache = dict(cache)
    for kind, start, stop in layer_runs(m):
        stack = "dense_layers" if kind == "D" else "moe_layers"
        weights, kv = _rows(params[stack], start, stop), _rows(cache[stack], start, stop)
        if kind == "D":
            x_BSD, kv = _run_layers(dense_body, x_BSD, (weights, kv), config.train.scan_layers)
        else:
            inputs = (weights, _router_rows(state, start, stop), kv)
            x_BSD, kv = _run_layers(moe_body, x_BSD, inputs, config.train.scan_layers)
        cache[stack] = jax.tree.map(lambda whole, run: whole.at[start:stop].set(run), cache[stack], kv)
    x_BSD = rms_norm(x_BSD, params["final_norm"], m.rms_norm_eps)
    logits_BSV = _output_head(params, x_BSD, config, layers.dtype)
    return (logits_BSV, cache, x_BSD) if hidden else (logits_BSV, cache)


def init_mtp_cache(config: Config, batch: int, length: int) -> dict:
    """An empty KV cache of the first MTP module's block (`mtp_forward_cached`), as one layer of `init_cache`."""
    shapes = cache_shapes(config.model, batch, length)
    return {name: jnp.zeros(shape, compute_dtype(config)) for name, shape in shapes.items()}


def mtp_forward_cached(params: dict, state: dict, next_tokens_BS: jax.Array, hidden_BSD: jax.Array, cache: dict,
                       position, config: Config):
    """The first MTP module at positions position..position+S-1 over a cache of its block's earlier positions
    (`init_mtp_cache`): position i reads the main model's final-normed state there (`forward_cached(...,
    hidden=True)`) and the token at i + 1 (`next_tokens_BS`), and scores the token at i + 2. Returns (logits_BSV
    float32, the cache updated); `mtp_logits`'s numbers at those positions, up to rounding. Speculative decoding
    drafts with it."""
    m = config.model
    length = jax.tree.leaves(cache)[0].shape[1]  # [B, T, ...]
    layers, (cos_SP, sin_SP) = _cached_layers(config, length, position, next_tokens_BS.shape[1])
    module = jax.tree.map(lambda a: a[0], params["mtp"])
    x_BSD = _mtp_input(params, module, next_tokens_BS, hidden_BSD, layers, None)
    x_BSD, cache = _attention_cached(module["block"], x_BSD, cache, position, cos_SP, sin_SP, layers)
    if m.mtp_block == "moe":
        row = layer_counts(m)[1]
        router = jax.tree.map(lambda a: a[0], _router_rows(state, row, row + 1))
        x_BSD = layers.moe_mlp(module["block"], router, x_BSD)[0]
    else:
        x_BSD = layers.dense_mlp(module["block"], x_BSD)
    head_BSD = rms_norm(x_BSD, module["head_norm"], m.rms_norm_eps)
    return _output_head(params, head_BSD, config, layers.dtype), cache
