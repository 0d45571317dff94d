"""Typed, frozen configuration: the one source of truth for every option.

A `Config` holds five groups (`model`, `moe`, `train`, `data`, `parallel`). Presets are JSON files in
`dropless/presets/`; the CLI turns `group.key=value` arguments into overrides. Every value is
validated once, here, when the dataclass is built: a bad value raises `ConfigError` with one sentence
that names the key, the accepted values and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import signal
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from dropless.core.files import write_atomic


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message is one sentence naming the key and the fix."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# Retired values, by key: each raises one sentence naming its replacement, wherever it comes from
# (the CLI, a preset, a saved run's config).
RENAMED_VALUES = {
    "moe.gmm_backend": {"tokamax": "dropless_mosaic (our Mosaic GPU kernels)",
                        "tokamax_default": "tokamax_mosaic (tokamax's own Mosaic GPU kernel)"},
}


def _in_choices(key: str, value: Any, choices: tuple) -> None:
    listed = ", ".join(map(str, choices))
    # A list or object (from a JSON file) cannot even be looked up among the choices: it is unhashable.
    _require(isinstance(value, (str, int, float)), f"{key}={value!r} is not valid; choose one of {listed}.")
    renamed = RENAMED_VALUES.get(key, {})
    _require(value not in renamed, f"{key}={value} is now called {renamed.get(value)}; choose one of {listed}.")
    _require(value in choices, f"{key}={value!r} is not valid; choose one of {listed}.")


def _positive(key: str, value: int | float, allow_zero: bool = False) -> None:
    _require(math.isfinite(value), f"{key}={value} must be a finite number.")
    ok = value >= 0 if allow_zero else value > 0
    _require(ok, f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}.")


@functools.cache
def _choices(cls: type) -> dict[str, tuple]:
    """The allowed values of each `Literal[...]` field of a config dataclass: declared once, by its annotation."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Literal}


# No size needs an integer beyond 32 bits (a size that large fits no device); a larger one is a typo that would
# otherwise fail deep inside XLA with a traceback. The corpus cap and its shuffling seed (numpy's) may take 64.
INT_LIMIT = 2**31 - 1
WIDE_INTS = {"data.max_bytes": 2**63 - 1, "data.shuffle_seed": 2**63 - 1}


@functools.cache
def _int_fields(cls: type) -> tuple[str, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls) if hints[f.name] is int)


def _check_fields(group: str, values: Any) -> None:
    """The checks every field of a kind needs: each choice among its `Literal`'s values, each integer within 32 bits
    (64 for WIDE_INTS)."""
    for name, choices in _choices(type(values)).items():
        _in_choices(f"{group}.{name}", getattr(values, name), choices)
    for name in _int_fields(type(values)):
        value, limit = getattr(values, name), WIDE_INTS.get(f"{group}.{name}", INT_LIMIT)
        _require(-limit <= value <= limit,
                 f"{group}.{name}={value} is out of range; give an integer between -{limit} and {limit}.")


# YaRN's real-valued settings (HF's config.json keys) and the least each may be.
YARN_NUMBERS = {"factor": 1.0, "beta_fast": 0.0, "beta_slow": 0.0, "mscale": 0.0, "mscale_all_dim": 0.0,
                "attention_factor": 0.0}
# Every key a YaRN rope_scaling may hold (dropless.ops.rope reads them; HF import writes no others).
YARN_KEYS = ("type", "rope_type", "original_max_position_embeddings", *YARN_NUMBERS, "truncate")


def yarn_betas(rope_scaling: dict) -> tuple[float, float]:
    """(beta_fast, beta_slow) of a YaRN setting: a missing, null or zero one takes YaRN's default (32 and 1), as HF
    treats an explicit null like a missing key."""
    return float(rope_scaling.get("beta_fast") or 32.0), float(rope_scaling.get("beta_slow") or 1.0)


def check_yarn_keys(rope_scaling: dict) -> None:
    """A YaRN setting names the two values it cannot do without (HF's config.json keys), each value a number in
    its range: the factor at least 1 (YaRN extends the context), the original context a positive integer."""
    for key in rope_scaling:  # a misspelt key would leave its setting at the default without a word
        close = difflib.get_close_matches(str(key), YARN_KEYS, n=1)
        _require(key in YARN_KEYS, f"model.rope_scaling has the unknown key {key!r}"
                 + (f" (did you mean {close[0]!r}?)" if close else "") + f"; use only {', '.join(YARN_KEYS)}.")
    has_both = all(rope_scaling.get(key) is not None for key in ("factor", "original_max_position_embeddings"))
    _require(has_both, "model.rope_scaling of type 'yarn' needs 'factor' and 'original_max_position_embeddings'; "
             "add both (DeepSeek-V3 uses 40.0 and 4096).")
    for key, least in YARN_NUMBERS.items():
        value = rope_scaling.get(key)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        _require(number and value >= least, f"model.rope_scaling's {key}={value!r} is not a number of at least "
                 f"{least:g}; give one (DeepSeek-V3: factor 40, beta_fast 32, beta_slow 1, mscale 1).")
    fast, slow = yarn_betas(rope_scaling)
    _require(fast >= slow, f"model.rope_scaling's beta_fast={fast:g} is below its beta_slow={slow:g}, which would "
             "turn YaRN's ramp from kept to interpolated frequencies around; give beta_fast >= beta_slow "
             "(DeepSeek-V3: 32 and 1).")
    original = rope_scaling["original_max_position_embeddings"]
    _require(isinstance(original, int) and not isinstance(original, bool) and original > 0,
             f"model.rope_scaling's original_max_position_embeddings={original!r} is not a positive integer; give "
             "the context length the model was trained at (DeepSeek-V3: 4096).")


# Activations tagged with `checkpoint_name` in every layer (all [B, S, D] in the compute dtype): what
# `train.offload` may name.
ACTIVATION_NAMES = ("attn_out", "mlp_out", "moe_in", "moe_out")


@dataclass(frozen=True)
class ModelConfig:
    """Transformer architecture. Field names follow the Hugging Face configs where one exists."""

    family: Literal["deepseek_v3", "mixtral", "qwen3_moe"] = "deepseek_v3"
    vocab_size: int = 2048
    hidden_size: int = 128
    num_layers: int = 4
    # The first `first_dense_layers` layers use a dense SwiGLU MLP (DeepSeek-V3's first_k_dense_replace).
    first_dense_layers: int = 1
    # Any pattern of dense and MoE layers: one letter per layer, D (dense SwiGLU MLP) or M (MoE), e.g. "DMDM".
    # Empty: model.first_dense_layers D's, then M's. `layer_types` is the resolved pattern every module reads.
    layer_pattern: str = ""
    dense_intermediate_size: int = 384
    attention: Literal["mla", "gqa"] = "mla"
    num_heads: int = 4
    # GQA only.
    num_kv_heads: int = 4
    head_dim: int = 32
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE.
    # MLA only (DeepSeek-V2/V3). q_lora_rank = 0 means queries are projected directly.
    q_lora_rank: int = 0
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    rope_theta: float = 10000.0
    # None, or {"type": "yarn", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
    # "mscale", "mscale_all_dim"} as in DeepSeek-V3's config.json.
    rope_scaling: dict | None = None
    max_seq_len: int = 256
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    # The routers' initial weights: normal(0, router_init_std); 0 = model.init_std like every other matrix.
    router_init_std: float = 0.0
    # Attention kernel: "auto" = tokamax's flash attention on GPU in bfloat16, the plain XLA einsum otherwise;
    # "cudnn" = cuDNN's fused flash attention (NVIDIA GPU, bfloat16 or float16).
    attention_backend: Literal["auto", "xla", "tokamax", "cudnn"] = "auto"
    # Multi-token prediction (DeepSeek-V3): D sequential modules, module k predicting token i+k+1 from the
    # depth k-1 hidden state and the embedding of token i+k; 0 = off. Training only: inference ignores them.
    mtp_layers: int = 0
    # lambda: the MTP loss added to the training loss is lambda / D * the sum of the D depths' cross-entropies.
    mtp_loss_weight: float = 0.3
    # The transformer block inside each MTP module: "moe" (DeepSeek-V3's) or "dense" (a SwiGLU MLP).
    mtp_block: Literal["moe", "dense"] = "moe"

    def __post_init__(self):
        _check_fields("model", self)
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_seq_len"):
            _positive(f"model.{key}", getattr(self, key))
        _require(0 <= self.first_dense_layers <= self.num_layers,
                 f"model.first_dense_layers={self.first_dense_layers} must be between 0 and model.num_layers={self.num_layers}.")
        if self.layer_pattern:
            pattern = self.layer_pattern
            _require(set(pattern) <= {"D", "M"}, f"model.layer_pattern={pattern!r} may hold only the letters D "
                     "(dense layer) and M (MoE layer); write one letter per layer, e.g. 'DMDM'.")
            _require(len(pattern) == self.num_layers, f"model.layer_pattern={pattern!r} has {len(pattern)} letters "
                     f"but model.num_layers={self.num_layers}; give one letter per layer.")
            leading = len(pattern) - len(pattern.lstrip("D"))
            _require(self.first_dense_layers == leading,
                     f"model.first_dense_layers={self.first_dense_layers} disagrees with model.layer_pattern="
                     f"{pattern!r}, which starts with {leading} dense layer(s); set model.first_dense_layers="
                     f"{leading} or leave model.layer_pattern empty.")
        _positive("model.mtp_layers", self.mtp_layers, allow_zero=True)
        if "D" in self.layer_types or (self.mtp_layers and self.mtp_block == "dense"):
            # Only dense layers read it: a model without them (Mixtral, Qwen3) may leave it at anything.
            _positive("model.dense_intermediate_size", self.dense_intermediate_size)
        _positive("model.init_std", self.init_std)
        _positive("model.router_init_std", self.router_init_std, allow_zero=True)
        _positive("model.mtp_loss_weight", self.mtp_loss_weight, allow_zero=True)
        # Each attention kind checks the widths it reads; 0 keeps a meaning only for q_lora_rank (no low-rank q).
        if self.attention == "gqa":
            _positive("model.num_kv_heads", self.num_kv_heads)
            _require(self.num_heads % self.num_kv_heads == 0,
                     f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}.")
            _positive("model.head_dim", self.head_dim)
            _require(self.head_dim % 2 == 0, f"model.head_dim={self.head_dim} must be even for RoPE.")
        else:
            for key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"):
                _positive(f"model.{key}", getattr(self, key))
            _require(self.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE.")
            _positive("model.q_lora_rank", self.q_lora_rank, allow_zero=True)
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            _require(kind == "yarn", f"model.rope_scaling type {kind!r} is not supported; use 'yarn' or null.")
            check_yarn_keys(self.rope_scaling)
        # A base at or below 1 gives no long wavelengths, and one far below overflows the rotation frequencies.
        _require(math.isfinite(self.rope_theta) and self.rope_theta > 1,
                 f"model.rope_theta={self.rope_theta} must be a number above 1 (RoPE's base; 10000 in most models).")
        _require(math.isfinite(self.rms_norm_eps) and self.rms_norm_eps >= 0,
                 f"model.rms_norm_eps={self.rms_norm_eps} must be 0 or a small positive number (e.g. 1e-6).")

    def __hash__(self) -> int:
        """Equal configs hash alike, `rope_scaling` (a dict) by its sorted JSON: a Config can be a static argument of
        `jax.jit` (e.g. `jax.jit(transformer.forward, static_argnums=3)`) with YaRN too."""
        return hash(tuple(json.dumps(value, sort_keys=True) if isinstance(value, dict) else value
                          for value in (getattr(self, f.name) for f in dataclasses.fields(self))))

    @property
    def layer_types(self) -> str:
        """The layer pattern, one letter per layer: D (dense MLP) or M (MoE)."""
        return self.layer_pattern or "D" * self.first_dense_layers + "M" * (self.num_layers - self.first_dense_layers)


@dataclass(frozen=True)
class MoEConfig:
    """The routed-expert layer. docs/moe.md gives the formulas."""

    num_experts: int = 8
    num_experts_per_tok: int = 2  # top-k
    expert_intermediate_size: int = 64
    num_shared_experts: int = 1
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # Group-limited routing (DeepSeek-V3): n_group = 1 disables it.
    n_group: int = 1
    topk_group: int = 1
    # Aux-loss-free balancing: bias += rate * sign(mean_load - load) after each step; 0 = off.
    bias_update_rate: float = 0.0
    # How far each bias moves: "sign", DeepSeek-V3's rate * sign(mean_load - load), or "proportional",
    # rate * clip((mean_load - load) / mean_load, -1, 1): the sign rule's step for an expert off by the mean load or
    # more, a smaller one near balance (dropless.moe.balance.update_router_bias).
    bias_update_rule: Literal["sign", "proportional"] = "sign"
    # After each step the bias also moves every expert's mean selection score over the step's tokens this fraction
    # of the way to the mean over experts (dropless.moe.balance.center_router_bias); 0 = off, 1 = equal means.
    bias_center_rate: float = 0.0
    # Each router sees its input without the direction of that input's running mean over tokens (kept in
    # model_state["router_common"], updated after each step at this rate; dropless.moe.router.fold_common). A
    # common part of the tokens' router inputs that grows faster than the rest makes every token rank the experts
    # alike (docs/training.md, "Router health"); 0 = off (no such state).
    router_common_rate: float = 0.0
    # Where training takes that direction from: "running" (the running mean, as inference does) or
    # "other_sequences" (for each sequence, the mean router input of the microbatch's other sequences, current where
    # the running mean lags; the running mean when a microbatch holds one sequence). Evaluation, inference and HF
    # export use the running mean.
    router_common_source: Literal["running", "other_sequences"] = "running"
    # With "other_sequences": the training steps that take it (steps 0 .. N-1); later steps route on the running
    # mean, as evaluation does. 0 = every step.
    router_common_other_steps: int = 0
    # Balancing losses, each weighted; 0 = off.
    aux_loss_weight: float = 0.0
    seq_aux_loss_weight: float = 0.0
    z_loss_weight: float = 0.0
    # Grouped GEMM (dropless.gmm.registry): "dropless_mosaic" = our Mosaic GPU kernels with per-shape tuned tiles;
    # "tokamax_mosaic" = tokamax's own Mosaic GPU kernel with its heuristic tiles (a benchmark reference); "xla" =
    # jax.lax.ragged_dot; "capacity" drops tokens (the baseline); "auto" = dropless_mosaic on GPU, xla elsewhere.
    gmm_backend: Literal["auto", "dropless_mosaic", "tokamax_mosaic", "xla", "capacity"] = "auto"
    capacity_factor: float = 1.25
    # Expert-parallel dispatch (used when parallel.expert > 1).
    dispatch: Literal["auto", "allgather", "alltoall", "ragged"] = "auto"
    alltoall_buffer_factor: float = 2.0
    # Rows of each device's local-expert buffer as a multiple of the balanced load (T*K pairs per device); a
    # device whose pairs do not fit takes a worst-case-sized buffer for that layer (reported). 0 = always that.
    local_buffer_factor: float = 1.25
    dedup: bool = True
    # Split each device's tokens into this many chunks, dispatched and computed one after another, so that one
    # chunk's exchange can overlap the previous chunk's grouped GEMMs; it must divide the tokens each device holds
    # in the MoE layer. 1 = one exchange (measured default).
    dispatch_chunks: int = 1
    # The dtype of the rows sent to other devices' experts (the tokens, and in the backward the output's gradient):
    # "compute" (the training dtype) or "float8" (e4m3 with a scale per 128 values, half of bf16's bytes; the
    # rows coming back stay in the compute dtype). dropless.ep.wire.
    dispatch_dtype: Literal["compute", "float8"] = "compute"
    # Router health: training prints a warning when one expert has taken more than `router_warn_share` of a
    # layer's tokens for `router_warn_logs` logged steps in a row (dropless.train.metrics.RouterWatch).
    router_warn_share: float = 0.5
    router_warn_logs: int = 5

    def __post_init__(self):
        _check_fields("moe", self)
        _require(0 < self.router_warn_share <= 1, f"moe.router_warn_share={self.router_warn_share} must be in (0, 1]: "
                 "the fraction of a layer's tokens one expert may take before training warns.")
        _positive("moe.router_warn_logs", self.router_warn_logs)
        _positive("moe.num_experts", self.num_experts)
        _require(1 <= self.num_experts_per_tok <= self.num_experts,
                 f"moe.num_experts_per_tok={self.num_experts_per_tok} must be between 1 and moe.num_experts={self.num_experts}.")
        _positive("moe.expert_intermediate_size", self.expert_intermediate_size)
        _positive("moe.dispatch_chunks", self.dispatch_chunks)
        _positive("moe.num_shared_experts", self.num_shared_experts, allow_zero=True)
        _require(self.n_group >= 1 and self.num_experts % self.n_group == 0,
                 f"moe.n_group={self.n_group} must divide moe.num_experts={self.num_experts}.")
        _require(1 <= self.topk_group <= self.n_group,
                 f"moe.topk_group={self.topk_group} must be between 1 and moe.n_group={self.n_group}.")
        if self.n_group > 1:
            per_group = self.num_experts // self.n_group
            _require(self.topk_group * per_group >= self.num_experts_per_tok,
                     f"moe.topk_group={self.topk_group} groups of {per_group} experts cannot hold "
                     f"moe.num_experts_per_tok={self.num_experts_per_tok}; raise moe.topk_group.")
        _require(0.0 <= self.bias_center_rate <= 1.0,
                 f"moe.bias_center_rate={self.bias_center_rate} must be in [0, 1]: the fraction of the way to equal "
                 "mean selection scores the bias moves each step.")
        _require(self.router_common_source == "running" or self.router_common_rate > 0,
                 f"moe.router_common_source={self.router_common_source!r} needs moe.router_common_rate > 0 (the running "
                 "mean that evaluation and inference use); set moe.router_common_rate, e.g. 0.3.")
        _require(self.router_common_other_steps >= 0 and (self.router_common_other_steps == 0
                                                          or self.router_common_source == "other_sequences"),
                 f"moe.router_common_other_steps={self.router_common_other_steps} counts the training steps that take "
                 "the other sequences' direction: set it >= 0, and > 0 only with "
                 "moe.router_common_source=other_sequences.")
        _require(0.0 <= self.router_common_rate <= 1.0,
                 f"moe.router_common_rate={self.router_common_rate} must be in [0, 1]: the weight of each step's mean "
                 "router input in the running mean whose direction the router does not see (0 = off).")
        for key in ("bias_update_rate", "aux_loss_weight", "seq_aux_loss_weight", "z_loss_weight"):
            _positive(f"moe.{key}", getattr(self, key), allow_zero=True)
        _positive("moe.capacity_factor", self.capacity_factor)
        # At num_experts each expert's buffer already holds every routed pair; beyond it the buffers only grow
        # (past int32's rows for a factor like 1e8).
        _require(self.capacity_factor <= self.num_experts,
                 f"moe.capacity_factor={self.capacity_factor} is beyond moe.num_experts={self.num_experts}, where "
                 "each expert's buffer already holds every token; give a factor near 1 (e.g. 1.25).")
        _positive("moe.routed_scaling_factor", self.routed_scaling_factor)
        _require(self.alltoall_buffer_factor >= 1.0,
                 f"moe.alltoall_buffer_factor={self.alltoall_buffer_factor} must be >= 1.0.")
        _require(self.local_buffer_factor == 0 or self.local_buffer_factor >= 1.0,
                 f"moe.local_buffer_factor={self.local_buffer_factor} must be 0 (always the worst-case buffer) "
                 f"or >= 1.0.")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 16  # global batch, in sequences
    seq_len: int = 128
    learning_rate: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # The routers' learning rate as a multiple of learning_rate (AdamW's whole update of every router matrix,
    # weight decay included): a slower router leaves the balancing bias less drift to follow (docs/training.md,
    # "Router health", measures it on the proxy).
    router_lr_scale: float = 1.0
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype; master weights are float32
    fp8: Literal["off", "rowwise", "blockwise", "mxfp8"] = "off"
    # Under fp8 blockwise or rowwise: make each weight's e4m3 copies once per step, before its microbatches
    # (docs/fp8.md); false quantizes them in every microbatch's products, holding (with grad_accum_steps > 1) one
    # byte less per quantized parameter through the step. The other train.fp8 settings make no copies: true only.
    fp8_cache_weights: bool = True
    # Under fp8 blockwise or rowwise: the dtype the weight-gradient products write (each product accumulates in
    # float32 either way). float32 keeps the float32 promotion's result whole; bfloat16 rounds it once, as the bf16
    # path's grouped GEMMs write their weight gradients, halving the bytes the kernels store (docs/fp8.md); the other
    # train.fp8 settings take float32 only.
    fp8_wgrad_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "moe", "full"] = "none"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    # draw RUN_DIR/training.png when the run ends; false skips its few seconds of matplotlib where no one looks
    # at the picture (sweeps and CI read metrics.jsonl)
    plot: bool = True
    offload_optimizer: bool = False
    offload: str = ""  # comma-separated activation names to offload to pinned host memory
    optimizer_moments_dtype: Literal["float32", "bfloat16"] = "float32"
    # Run each group of identical layers with one jax.lax.scan (compile time flat in depth) or unrolled
    # (straight-line code: no stacked-residual buffers to fill and slice; compile time grows with depth).
    scan_layers: bool = True
    # Microbatches per optimizer step: the step runs batch_size / grad_accum_steps sequences at a time and sums
    # their gradients (float32) before one update; activation memory is that of one microbatch.
    grad_accum_steps: int = 1
    # The learning-rate schedule's horizon: warm-up, then the decay to min_lr_ratio at this step. 0 = train.steps,
    # resolved when the run starts and saved with it, so a resumed or extended run keeps the schedule it began with.
    schedule_steps: int = 0
    # The decay's length: it ends at the horizon and starts decay_steps before it, the learning rate held at its
    # peak from the warm-up's end until then (warmup-stable-decay, "WSD"). 0 = all of the steps after the warm-up.
    decay_steps: int = 0
    # The decay's shape from learning_rate to min_lr_ratio * learning_rate: a half cosine, a straight line, or
    # 1 - sqrt of the fraction of the decay done (the shape Hägele et al. 2024 find best for WSD).
    decay_shape: Literal["cosine", "linear", "1-sqrt"] = "cosine"
    # Signals that stop training after the current step with a checkpoint of it (comma-separated; "" = none).
    stop_signals: str = "SIGTERM,SIGINT,SIGUSR1"
    # Steps in a row whose loss or gradient norm is not finite (each one skipped) before the run stops.
    max_nonfinite_steps: int = 3
    # The fit check before compiling (dropless.plan): memory per device to plan against, in GiB; 0 = the GPU's own
    # limit, on the CPU the host's memory divided among its devices. auto_fit: train with the fastest layout the
    # plan says fits.
    device_memory_gib: float = 0.0
    auto_fit: bool = False

    def __post_init__(self):
        _check_fields("train", self)
        _positive("train.schedule_steps", self.schedule_steps, allow_zero=True)
        _positive("train.max_nonfinite_steps", self.max_nonfinite_steps)
        _positive("train.device_memory_gib", self.device_memory_gib, allow_zero=True)
        for name in self.stop_signal_names:
            _require(name in signal.Signals.__members__ and name not in ("SIGKILL", "SIGSTOP"),
                     f"train.stop_signals names {name!r}, which is not a signal a process can catch; "
                     "give comma-separated names such as SIGTERM,SIGINT,SIGUSR1.")
        for key in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_batches",
                    "checkpoint_every", "keep_checkpoints", "grad_accum_steps"):
            _positive(f"train.{key}", getattr(self, key))
        _require(self.batch_size % self.grad_accum_steps == 0,
                 f"train.batch_size={self.batch_size} is not divisible by train.grad_accum_steps="
                 f"{self.grad_accum_steps}; make the batch a multiple of the microbatch count.")
        _positive("train.learning_rate", self.learning_rate)
        _require(0.0 <= self.min_lr_ratio <= 1.0, f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1].")
        _positive("train.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("train.decay_steps", self.decay_steps, allow_zero=True)
        room = self.schedule_horizon - self.warmup_end
        _require(self.decay_steps <= room, f"train.decay_steps={self.decay_steps} does not fit between the warm-up's "
                 f"end (train.warmup_steps={self.warmup_steps}, at most the horizon - 1) and the schedule's horizon "
                 f"(step {self.schedule_horizon}: train.schedule_steps, or train.steps where that is 0); give at most "
                 f"{room}, or 0 to decay over every step after the warm-up.")
        _positive("train.weight_decay", self.weight_decay, allow_zero=True)
        for key in ("beta1", "beta2"):  # 1 would divide AdamW's bias correction by zero
            value = getattr(self, key)
            _require(0.0 <= value < 1.0, f"train.{key}={value} must be in [0, 1) (AdamW's moment decay, e.g. "
                                         f"{0.9 if key == 'beta1' else 0.95}).")
        _positive("train.grad_clip", self.grad_clip, allow_zero=True)
        _positive("train.router_lr_scale", self.router_lr_scale)
        unknown = [name for name in self.offload_names if name not in ACTIVATION_NAMES]
        _require(not unknown, f"train.offload names unknown activation(s) {', '.join(unknown)}; "
                              f"choose from {', '.join(ACTIVATION_NAMES)}.")
        repeated = sorted({name for name in self.offload_names if self.offload_names.count(name) > 1})
        _require(not repeated, f"train.offload names {', '.join(repeated)} more than once; name each activation once.")
        _require(self.fp8_cache_weights or self.fp8 in ("blockwise", "rowwise"),
                 f"train.fp8_cache_weights=false keeps train.fp8=blockwise or rowwise from caching the weights' e4m3 "
                 f"copies, and train.fp8={self.fp8} makes none; set train.fp8=blockwise or rowwise, or leave "
                 "train.fp8_cache_weights=true.")
        _require(self.fp8_wgrad_dtype == "float32" or self.fp8 in ("blockwise", "rowwise"),
                 f"train.fp8_wgrad_dtype={self.fp8_wgrad_dtype} sets what the weight-gradient products of "
                 f"train.fp8=blockwise or rowwise write, and train.fp8={self.fp8} has none; set train.fp8=blockwise "
                 "or rowwise, or leave train.fp8_wgrad_dtype=float32.")
        _require(not self.offload_names or self.remat == "full",
                 f"train.offload={self.offload!r} needs train.remat=full (offloaded activations replace "
                 f"recomputation); set train.remat=full or train.offload=''.")

    @property
    def offload_names(self) -> tuple[str, ...]:
        """The activations `train.offload` names, in order."""
        return tuple(name.strip() for name in self.offload.split(",") if name.strip())

    @property
    def stop_signal_names(self) -> tuple[str, ...]:
        """The signals `train.stop_signals` names, upper-case with the SIG prefix (SIGTERM, ...)."""
        names = (name.strip().upper() for name in self.stop_signals.split(",") if name.strip())
        return tuple(name if name.startswith("SIG") else f"SIG{name}" for name in names)

    @property
    def schedule_horizon(self) -> int:
        """The step at which the learning-rate schedule ends: train.schedule_steps, or train.steps where it is 0."""
        return self.schedule_steps or self.steps

    @property
    def warmup_end(self) -> int:
        """The step the warm-up ends at: train.warmup_steps, at most the horizon - 1, so the peak is reached."""
        return min(self.warmup_steps, max(self.schedule_horizon - 1, 0))

    @property
    def decay_start(self) -> int:
        """The step the decay starts at: train.decay_steps before the horizon, or the warm-up's end where that is 0."""
        return self.schedule_horizon - self.decay_steps if self.decay_steps else self.warmup_end


@dataclass(frozen=True)
class DataConfig:
    # "stdlib" = the Python standard library's own source files (always present, nothing to download).
    source: str = "stdlib"
    tokenizer: str = ""  # path to a tokenizer.json; empty = train a byte-level BPE on the corpus
    eval_fraction: float = 0.02
    # A corpus of its own to evaluate on (any form data.source takes), read whole, its documents in file order; the
    # training data is then all of data.source (data.eval_fraction unused). Empty: hold out data.eval_fraction of
    # data.source's documents.
    eval_source: str = ""
    shuffle_seed: int = 0
    max_bytes: int = 16_000_000  # cap on the text read from the default corpus
    prefetch: int = 4
    # Attention within each document of a packed sequence: a position sees only the positions of its own
    # document (from the one after the last end-of-document id before it); False = every earlier position.
    document_mask: bool = False
    # The end-of-document id that separates documents (what document_mask reads); -1 = the tokenizer's, which a
    # text corpus's run resolves and records when document_mask is on. A token corpus carries its own separators,
    # so it must name it.
    eos_id: int = -1

    def __post_init__(self):
        _check_fields("data", self)
        # An empty source (`data.source=` with an unset shell variable) would read the current directory.
        _require(str(self.source).strip() != "", "data.source is empty; give a file, directory or glob of .txt, "
                 ".jsonl, .parquet, .npy or .bin files, or leave it out for the default 'stdlib' corpus.")
        _require(0.0 < self.eval_fraction < 0.5, f"data.eval_fraction={self.eval_fraction} must be in (0, 0.5).")
        _require(not self.eval_source or self.eval_source != self.source,
                 f"data.eval_source is data.source ({self.source!r}), so the model would be evaluated on the data it "
                 "trains on; give another corpus, or leave data.eval_source empty to hold out part of data.source.")
        _positive("data.max_bytes", self.max_bytes)
        _positive("data.prefetch", self.prefetch, allow_zero=True)
        # numpy's generators take no negative seed (train.seed may be negative: jax.random.key takes it).
        _positive("data.shuffle_seed", self.shuffle_seed, allow_zero=True)
        _require(self.eos_id >= -1, f"data.eos_id={self.eos_id} must be a token id (>= 0), or -1 for the "
                 "tokenizer's end-of-document id.")


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh shape. The product must equal the number of devices (data = -1 takes what is left)."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1

    def __post_init__(self):
        _check_fields("parallel", self)
        _require(self.data == -1 or self.data > 0, f"parallel.data={self.data} must be > 0 or -1 (all remaining devices).")
        _positive("parallel.fsdp", self.fsdp)
        _positive("parallel.expert", self.expert)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self):
        _require(self.train.seq_len <= self.model.max_seq_len,
                 f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; lower one or raise the other.")
        _require(self.train.seq_len > self.model.mtp_layers,
                 f"model.mtp_layers={self.model.mtp_layers} predicts up to {self.model.mtp_layers + 1} tokens ahead, "
                 f"which no position of a sequence of train.seq_len={self.train.seq_len} has; raise train.seq_len to "
                 f"{self.model.mtp_layers + 1} or more, or lower model.mtp_layers.")
        _require(self.moe.num_experts % self.parallel.expert == 0,
                 f"moe.num_experts={self.moe.num_experts} is not divisible by parallel.expert={self.parallel.expert}; "
                 f"choose an expert-parallel size that divides the number of experts (and, with the other "
                 f"parallel sizes, the number of devices).")
        _require(self.train.fp8 == "off" or self.moe.gmm_backend in ("auto", "dropless_mosaic", "xla"),
                 f"train.fp8={self.train.fp8} runs the routed experts' GEMMs on e4m3, which moe.gmm_backend="
                 f"{self.moe.gmm_backend} does not; use moe.gmm_backend=auto, dropless_mosaic or xla, or train.fp8=off.")
        _require(self.data.eos_id < self.model.vocab_size,
                 f"data.eos_id={self.data.eos_id} is not an id of the model's vocabulary (model.vocab_size="
                 f"{self.model.vocab_size}); give the id that ends each document of the data.")
        _require(not (self.data.document_mask and self.model.attention_backend == "cudnn"),
                 "data.document_mask needs an attention kernel that takes a mask, and model.attention_backend=cudnn "
                 "runs cuDNN's causal mask only; set model.attention_backend=auto, tokamax or xla.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_flat_dict(self) -> dict:
        """{"group.key": value} for every key, the form overrides are written in."""
        return {f"{g}.{k}": v for g, d in self.to_dict().items() for k, v in d.items()}

    def replace(self, **overrides: Any) -> "Config":
        """Return a copy with dotted-key overrides applied, e.g. replace(**{"moe.gmm_backend": "xla"})."""
        return apply_overrides(self, overrides)


_GROUPS = {f.name: f.type for f in dataclasses.fields(Config)}
GROUPS = tuple(_GROUPS)  # the groups of settings, each a key of a run's config.json


def _group_classes() -> dict[str, type]:
    return {"model": ModelConfig, "moe": MoEConfig, "train": TrainConfig, "data": DataConfig,
            "parallel": ParallelConfig}


def all_keys() -> list[str]:
    return [f"{g}.{f.name}" for g, cls in _group_classes().items() for f in dataclasses.fields(cls)]


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    if not close:
        close = difflib.get_close_matches(key.split(".")[-1], [k.split(".")[-1] for k in all_keys()], n=1)
        close = [k for k in all_keys() if close and k.endswith("." + close[0])][:1]
    return f" Did you mean '{close[0]}'?" if close else " Run 'dropless presets --keys' to list the keys."


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _coerce(key: str, raw: Any, hint: Any) -> Any:
    """Turn a CLI string (or JSON value) into the field's type, or raise ConfigError."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        _in_choices(key, raw, choices)
        return raw
    if origin in (typing.Union, types.UnionType):  # `dict | None`
        if raw is None or (isinstance(raw, str) and raw.lower() in ("null", "none", "")):
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError:
                raise ConfigError(f"{key}={raw!r} is not valid JSON; give an object like '{{\"type\": \"yarn\", ...}}' or null.")
        _require(isinstance(raw, dict), f"{key} must be a JSON object or null.")
        return raw
    if hint is float and isinstance(raw, (int, float, str)) and not isinstance(raw, bool):
        # nan and inf pass float() and most range checks; no option means either.
        try:
            number = float(raw)
        except ValueError:
            raise ConfigError(f"{key}={raw!r} must be a number.")
        except OverflowError:  # an integer beyond any float, from a JSON file
            raise ConfigError(f"{key}={raw!r} must be a finite number.") from None
        _require(math.isfinite(number), f"{key}={raw!r} must be a finite number.")
        return number
    if not isinstance(raw, str):
        _require(isinstance(raw, hint) and not (hint is int and isinstance(raw, bool)),
                 f"{key}={raw!r} must be of type {hint.__name__}.")
        return raw
    if hint is bool:
        low = raw.lower()
        _require(low in ("true", "false", "1", "0", "yes", "no"), f"{key}={raw!r} must be true or false.")
        return low in ("true", "1", "yes")
    if hint is int:
        try:
            return int(raw.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key}={raw!r} must be an integer.")
    return raw


def apply_overrides(config: Config, overrides: dict[str, Any]) -> Config:
    """Apply `{"group.key": value}` overrides; values may be strings (from the CLI) or JSON values."""
    groups = _group_classes()
    changes: dict[str, dict[str, Any]] = {}
    for key, raw in overrides.items():
        group, _, name = key.partition(".")
        if group not in groups or name not in {f.name for f in dataclasses.fields(groups[group])}:
            raise ConfigError(f"Unknown config key '{key}'.{_suggest(key)}")
        changes.setdefault(group, {})[name] = _coerce(key, raw, _field_type(groups[group], name))
    updated = {g: dataclasses.replace(getattr(config, g), **kv) for g, kv in changes.items()}
    return dataclasses.replace(config, **updated)


def from_dict(d: dict) -> Config:
    """Build a Config from a nested dict (a preset file or a saved run config)."""
    _require(isinstance(d, dict), f"A config must be a JSON object of groups ({', '.join(_GROUPS)}), "
             f"not a {type(d).__name__}.")
    flat = {}
    for group, values in d.items():
        if group == "description":
            continue
        _require(group in _GROUPS, f"Unknown config group '{group}'; the groups are {', '.join(_GROUPS)}.")
        _require(isinstance(values, dict), f"Config group '{group}' must be a JSON object of keys, "
                 f"not a {type(values).__name__}.")
        for name, value in values.items():
            flat[f"{group}.{name}"] = value
    return apply_overrides(Config(), flat)


PRESETS_PACKAGE = "dropless.presets"


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(PRESETS_PACKAGE).iterdir() if p.name.endswith(".json"))


def preset_description(name: str) -> str:
    return json.loads(resources.files(PRESETS_PACKAGE).joinpath(f"{name}.json").read_text()).get("description", "")


def load_preset(name: str) -> Config:
    names = preset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"Unknown preset '{name}'; the presets are {', '.join(names)}.{hint}")
    return from_dict(json.loads(resources.files(PRESETS_PACKAGE).joinpath(f"{name}.json").read_text()))


def save(config: Config, path: Path) -> None:
    """Write `config` to `path` atomically: a full disk or a kill leaves the old file (a resumed run's) whole."""
    write_atomic(Path(path), json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")


def load(path: Path) -> Config:
    """A saved config file; a file that is not a readable config raises ConfigError naming it."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a config file; give the config.json inside a run directory.")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg.lower()}), "
                          "so it was cut short or edited by hand; restore it (e.g. from a copy of the run) or "
                          "start a new run.") from err
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file (it holds bytes that are not UTF-8); restore it or start a "
                          "new run.") from None
    # A saved config names every group (`save`); one without a group would run on that group's defaults, e.g. a
    # resumed run on another learning rate, without a word. A key missing inside a group takes its default, so a
    # run saved before the key existed keeps its meaning. Checked first: the defaults may clash with the groups
    # that are there. A file that is not an object of groups is left to `from_dict`'s message.
    grouped = isinstance(d, dict) and set(d) <= {*_GROUPS, "description"}
    missing = [group for group in _GROUPS if group not in d] if grouped else []
    _require(not missing, f"{path} lacks the config group{'s' * (len(missing) > 1)} {', '.join(missing)}, which "
             "every saved config holds, so it was cut short or edited by hand; restore it (e.g. from a copy of "
             "the run) or start a new run.")
    try:
        return from_dict(d)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    """['group.key=value', ...] -> {'group.key': 'value'}; anything else is a ConfigError."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"'{pair}' is not a key=value override; write it like moe.gmm_backend=xla.")
        out[key.strip()] = value.strip()
    return out


# The settings `dropless train` also takes as flags.
FLAGS = {"train.steps": "--steps", "data.source": "--data", "data.tokenizer": "--tokenizer"}


def with_flags(overrides: dict[str, str], *, steps: int | None = None, data: str | None = None,
               tokenizer: str | None = None) -> dict[str, str]:
    """`overrides` with the flags given among (--steps, --data, --tokenizer) added as their settings; a flag and an
    override of the same setting with different values (`train.steps=1_000` is `--steps 1000`) are refused rather
    than one silently taking precedence."""
    merged = dict(overrides)
    for key, value in zip(FLAGS, (steps, data, tokenizer), strict=True):
        if value is None:
            continue
        group, _, name = key.partition(".")
        hint = _field_type(_group_classes()[group], name)
        if key in overrides and _coerce(key, overrides[key], hint) != _coerce(key, str(value), hint):
            raise ConfigError(f"{FLAGS[key]} {value} and {key}={overrides[key]} disagree; give the setting once.")
        merged[key] = str(value)
    return merged


def build_config(preset: str, overrides: dict[str, str], *, steps: int | None = None, data: str | None = None,
                 tokenizer: str | None = None) -> Config:
    return apply_overrides(load_preset(preset), with_flags(overrides, steps=steps, data=data, tokenizer=tokenizer))
