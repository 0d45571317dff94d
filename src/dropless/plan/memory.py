"""Per-device memory of one training step, from shapes, dtypes, shardings and the program's structure.

The model counts what the step holds on one device at its peak, the start of the backward pass:

- the state (`layout.state_bytes`): float32 parameters, the optimizer state (with `train.offload_optimizer` it
  lives in pinned host memory, and `OFFLOADED_MOMENTS_AT_PEAK` of it is back on the device at the peak), the model
  state and the batch;
- the gradients. The gradient of a weight cast to the compute dtype is the float32 cast of a compute-dtype
  cotangent, and XLA fuses that cast into its readers (the global norm and the AdamW update), so the buffers hold
  the compute dtype (float32 for the router and the norms, and for the routed experts under expert parallelism,
  whose cast happens inside the shard_map). With `train.grad_accum_steps` > 1 the running sum is float32 and one
  microbatch's gradients come on top;
- the activations the backward pass keeps, per layer and token, from the tensors each stage saves
  (`layer_bytes`; under expert parallelism the received rows, and with alltoall both exchanges' residuals),
  following `train.remat` (`none`; `moe`: an MoE block keeps only its input; `full`: a layer keeps only its
  input) and `train.offload` (named activations go to host memory), for one microbatch;
- the largest temporary alive beside them: the compute-dtype copy of the logits' gradient over the vocabulary, one
  layer's compute-dtype weights (gathered over `fsdp`), one attention layer's backward workspace, the
  recomputation of one block under remat (`RECOMPUTE_FACTOR`), the backward of the MoE layer's buffers (the bounded
  local buffer, the all-to-all slots or the gathered tokens) and, as the worst case the plan also reports, the
  worst-case branch a layer takes when its tokens overflow the bounded buffer;
- under expert parallelism, the routed experts' weights are cast inside the shard_map: their gradients stay
  float32 and, without remat, their compute-dtype copies are saved for the backward pass.

Under `train.fp8` the inputs of the FP8 products are kept as their e4m3 copies (one byte per value); with
microbatches the step holds every quantized weight's e4m3 copies throughout (`train.fp8_cache_weights`,
docs/fp8.md), one byte per quantized parameter more than without them, as measured (fp8-accum-h200.json).

`train.scan_layers=true` adds what the GPU program measurably adds under `jax.lax.scan`: the loop-invariant
cast of every stacked weight to the compute dtype, hoisted out of the loop (one copy; a second one is saved for the
backward pass without remat), and stacked residual buffers (`SCAN_RESIDUAL_EXTRA` of the activations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax.numpy as jnp

from dropless.core.config import Config
from dropless.ep.plan import balanced_rows, worst_case_rows
from dropless.fp8.grouped import ALIGN as FP8_ROW_ALIGN
from dropless.fp8.recipe import COPY_MODES, holds_weight_cache
from dropless.gmm.api import TMA_ROW_ALIGNMENT, aligned_rows
from dropless.models import transformer
from dropless.plan.layout import StateBytes, model_facts, state_bytes

# Under `jax.lax.scan` without remat, the stacked residual buffers (filled per iteration, read back in the
# backward) add this fraction of the scanned layers' activations: deepseek-v3-proxy, 1 H200, batch 1 and 4 x 2,048
# (benchmarks/results/step-batch1-h200.json and step-h200.json, rung 4 against 5:unrolled).
SCAN_RESIDUAL_EXTRA = 0.6
# The backward of a rematerialised block holds about this share of the block's activations at once (it frees
# them as it goes): deepseek-v3-proxy, remat=moe and full at 8 x 4,096 tokens, unrolled
# (benchmarks/results/plan-calibration-h200.json).
RECOMPUTE_FACTOR = 0.9
# With `train.offload_optimizer`, XLA brings the moments back to the device while the backward pass still holds its
# activations: at the peak this share of them is on the device (deepseek-v3-proxy, 8 x 4,096 tokens: 101.2 GiB
# against 113.1 without offloading and 32.3 GiB of moments; benchmarks/results/plan-calibration-h200.json).
OFFLOADED_MOMENTS_AT_PEAK = 0.55


# Attention backends that keep only a log-sum-exp per query and head, never the [S, S] logits.
FLASH_BACKENDS = ("tokamax", "cudnn")


def blocks(m) -> tuple[int, int]:
    """(dense, MoE) transformer blocks of the training step: the main model's and the MTP modules'."""
    dense, moe = transformer.layer_counts(m)
    mtp_moe = transformer.mtp_moe_blocks(m)
    return dense + m.mtp_layers - mtp_moe, moe + mtp_moe


@dataclass(frozen=True)
class Dims:
    """The sizes the per-token formulas read, for one microbatch on one device."""

    tokens: int  # T: tokens per device per microbatch
    c: int  # compute dtype bytes
    fp8: bool


def _dims(config: Config, devices: int) -> Dims:
    micro = config.train.batch_size // config.train.grad_accum_steps
    return Dims(micro * config.train.seq_len // devices, jnp.dtype(config.train.dtype).itemsize,
                config.train.fp8 != "off")


def fp8_input_bytes(config: Config) -> int:
    """Bytes per value of an input a dense FP8 product keeps for its backward: its e4m3 copy under blockwise and
    rowwise (COPY_MODES); mxfp8's `jax.nn.scaled_dot_general` keeps the compute-dtype input."""
    return 1 if config.train.fp8 in COPY_MODES else jnp.dtype(config.train.dtype).itemsize


def fp8_copy_bytes(config: Config) -> int:
    """Bytes per value of the e4m3 copy an FP8 product keeps of an input that the layer also keeps in the compute
    dtype for another reader: 1 under COPY_MODES, else 0."""
    return 1 if config.train.fp8 in COPY_MODES else 0


def attention_bytes_per_token(config: Config, backend: str) -> int:
    """Bytes per token one attention layer saves for its backward: the projections' outputs, q, k, v and the
    output in the compute dtype; flash attention (tokamax, cuDNN) adds its float32 log-sum-exp per head, the XLA
    einsum its [S, S] float32 logits and probabilities and the compute-dtype probabilities per head. Under
    `train.fp8` the inputs of the FP8 projections inside the layer (MLA's normed q and kv latents, the output
    projection's input) are kept as their copies (`fp8_input_bytes`); flash attention keeps its output for its
    own backward as well, so there the output projection's copy comes on top."""
    m, c = config.model, jnp.dtype(config.train.dtype).itemsize
    H = m.num_heads
    fp8_in = fp8_input_bytes(config)
    flash = backend in FLASH_BACKENDS
    if m.attention == "mla":
        qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        lora = m.q_lora_rank if m.q_lora_rank else 0  # q_a's output; its normed copy is q_b's input
        widths = lora + H * qk + (m.kv_lora_rank + m.qk_rope_head_dim) + H * (m.qk_nope_head_dim + v) + H * qk
        projection_inputs = lora + m.kv_lora_rank
    else:
        qk = v = m.head_dim
        norms = (H + m.num_kv_heads) * qk if m.qk_norm else 0
        widths = H * qk + 2 * m.num_kv_heads * qk + norms
        projection_inputs = 0
    output = H * v * (c + fp8_copy_bytes(config) if flash else fp8_in)
    score = H * 4 if flash else H * config.train.seq_len * (2 * 4 + c)
    return widths * c + projection_inputs * fp8_in + output + score


@dataclass(frozen=True)
class MoEBuffers:
    """One MoE layer's buffers on one device (rows of the hidden size unless said)."""

    strategy: str  # "local" (one device on `expert`), "allgather", "alltoall" or "ragged"
    pairs: int  # T*K (token, expert) pairs this device routes
    local_rows: int  # rows of the local experts' bounded buffer (all of them without a bound)
    worst_rows: int  # rows of the worst-case buffer a layer takes on overflow (= local_rows: none)
    received_rows: int  # rows that arrive from the expert group (slots, gathered tokens or ragged worst case)
    exchange_rows: int  # rows one device sends to the others per exchange (one way)
    dedup: bool
    # alltoall with slots smaller than the worst case: both exchanges of its lax.cond are compiled, and under
    # autodiff the residuals of both are kept (the untaken one's as zeros): the worst-case slots' received rows
    # and a second local buffer (dropless.ep.alltoall).
    worst_received_rows: int = 0


def moe_buffers(config: Config, sizes: dict[str, int], tokens: int) -> MoEBuffers:
    """The MoE layer's buffer sizes as `dropless.ep` and `dropless.moe` build them for `tokens` per device."""
    moe = config.moe
    P, K = sizes["expert"], moe.num_experts_per_tok
    pairs = tokens * K
    # Under FP8 the permutation starts each local expert's rows at a multiple of 128 (dropless.moe.permute): the
    # buffers hold up to 127 zero rows more per expert.
    align = FP8_ROW_ALIGN if config.train.fp8 != "off" else 1
    if P == 1:
        rows = aligned_rows(pairs, moe.num_experts, align)
        return MoEBuffers("local", pairs, rows, rows, 0, 0, False)
    G = moe.num_experts // P
    dedup = moe.dedup
    J = min(K, G) if dedup else 1
    worst_slots = worst_case_rows(tokens, K, G, dedup)
    normal = min(worst_slots, math.ceil(moe.alltoall_buffer_factor * balanced_rows(tokens, K, P, G, dedup)))
    strategy = moe.dispatch
    if strategy == "auto":
        strategy = "allgather" if normal >= tokens else "alltoall"
    if strategy == "allgather":
        received, per_row, sent = P * tokens, K, (P - 1) * tokens
        dedup = False
    elif strategy == "alltoall":
        received, per_row, sent = P * normal, J, (P - 1) * normal
    else:  # ragged: worst-case receive buffers, the balanced rows on the wire
        received, per_row = P * worst_slots, J
        sent = math.ceil((P - 1) * balanced_rows(tokens, K, P, G, dedup))
    worst = received * per_row
    factor = moe.local_buffer_factor
    bound = worst if factor <= 0 else min(worst, TMA_ROW_ALIGNMENT * math.ceil(factor * pairs / TMA_ROW_ALIGNMENT))
    both = P * worst_slots if strategy == "alltoall" and normal < worst_slots else 0
    return MoEBuffers(strategy, pairs, aligned_rows(bound, G, align), aligned_rows(worst, G, align), received, sent,
                      dedup, both)


def _moe_row_bytes(config: Config, c: int, fp8: bool) -> int:
    """Bytes one row of the local experts' buffer saves: the sorted input and output [D], the up projection [2F]
    and the activation [F]; under FP8 the grouped GEMMs' inputs are saved in e4m3."""
    D, F = config.model.hidden_size, config.moe.expert_intermediate_size
    gemm_in = 1 if fp8 else c
    return (D + F) * gemm_in + (D + 2 * F) * c


@dataclass(frozen=True)
class LayerBytes:
    """Per-token bytes a layer saves (remat none), split by stage."""

    residual: int  # the layer input, the two norm outputs, the attention output [D] each
    attention: int
    mlp: int  # the dense MLP's or the MoE block's (router, local-expert rows, shared experts, exchange)
    offloadable: int  # of those, the [D] tensors `train.offload` names


def layer_bytes(config: Config, kind: str, backend: str, buffers: MoEBuffers | None, tokens: int) -> LayerBytes:
    m, moe, train = config.model, config.moe, config.train
    c = jnp.dtype(train.dtype).itemsize
    fp8 = train.fp8 != "off"
    fp8_in = fp8_input_bytes(config)  # what an FP8 product keeps of its input
    D = m.hidden_size
    attention = attention_bytes_per_token(config, backend)
    # The residual stream: the layer input and the attention output in the compute dtype; the attention's normed
    # input feeds only (FP8) projections, the MLP's too in a dense layer, while a MoE layer's router reads its normed
    # input in the compute dtype and its shared experts keep their own copy of it.
    if kind == "dense":
        residual = 2 * D * c + 2 * D * fp8_in
        F = m.dense_intermediate_size
        mlp = 2 * F * c + F * fp8_in  # gate and up, and the activation the down projection reads
        names = ("attn_out", "mlp_out")
    else:
        residual = 3 * D * c + D * fp8_in + (D * fp8_copy_bytes(config) if moe.num_shared_experts else 0)
        Fs = moe.num_shared_experts * moe.expert_intermediate_size
        branches = 2 if buffers.worst_received_rows else 1
        rows = branches * buffers.local_rows / max(tokens, 1)
        received = buffers.received_rows + buffers.worst_received_rows
        exchange = 2 * D * c * received / max(tokens, 1)  # received rows and their partial outputs
        mlp = int(moe.num_experts * 4 + rows * _moe_row_bytes(config, c, fp8) + Fs * (2 * c + fp8_in) + D * 4
                  + exchange)
        names = ("attn_out", "moe_in", "moe_out")
    offloaded = sum(1 for n in train.offload_names if n in names) * D * c
    return LayerBytes(residual, attention, mlp, offloaded)


def saved_per_token(config: Config, lb: LayerBytes, kind: str) -> tuple[int, int]:
    """(device, host) bytes per token a layer keeps for the backward pass under `train.remat`/`train.offload`."""
    remat, D, c = config.train.remat, config.model.hidden_size, jnp.dtype(config.train.dtype).itemsize
    if remat == "full":
        return D * c, lb.offloadable
    if remat == "moe" and kind == "moe":
        return lb.residual + lb.attention + D * c, 0
    return lb.residual + lb.attention + lb.mlp, 0


@dataclass
class MemoryPlan:
    """Per-device bytes of one training step (see the module docstring); `peak` is what must fit."""

    parameters: int
    gradients: int  # float32 gradient arrays, sharded like the parameters
    gradient_buffers: int  # what the step holds for them at its peak (compute dtype where XLA fuses the cast)
    optimizer_state: int
    optimizer_in_host: bool
    model_state_and_batch: int
    activations: int
    activations_in_host: int
    weight_copies: int  # compute-dtype copies of stacked weights under scan (hoisted casts), FP8's step copies
    temporaries: dict[str, int]  # the candidates for the largest temporary
    moe_buffers: dict = field(default_factory=dict)
    update_phase: int = 0  # the optimizer update's peak with an offloaded optimizer state
    # What the layers write without remat and do not keep under it: the recomputation writes it again in the
    # backward pass, one block at a time (a time cost, not part of the peak).
    recomputed_activations: int = 0
    # Under `train.scan_layers`, the stacked buffers the loop fills and reads back: the layers' saved activations
    # (one microbatch) and the float32 gradient accumulators of the stacked weights (a time cost).
    stacked_bytes: int = 0

    @property
    def largest_temporary(self) -> tuple[str, int]:
        normal = {k: v for k, v in self.temporaries.items() if k != "moe_worst_case"}
        name = max(normal, key=normal.get)
        return name, normal[name]

    @property
    def resident(self) -> int:
        optimizer = (int(OFFLOADED_MOMENTS_AT_PEAK * self.optimizer_state) if self.optimizer_in_host
                     else self.optimizer_state)
        return self.parameters + optimizer + self.model_state_and_batch

    @property
    def peak(self) -> int:
        backward = (self.resident + self.gradient_buffers + self.activations + self.weight_copies
                    + self.largest_temporary[1])
        return max(backward, self.update_phase)

    @property
    def peak_worst_case(self) -> int:
        """The peak when a layer's tokens overflow the bounded buffers and take the worst-case branch."""
        worst = self.temporaries.get("moe_worst_case", 0)
        return max(self.peak, self.peak - self.largest_temporary[1] + max(worst, self.largest_temporary[1]))


def plan_memory(config: Config, sizes: dict[str, int], *, attention_backend: str = "tokamax",
                state: StateBytes | None = None) -> MemoryPlan:
    """The per-device memory of `config`'s training step on a mesh of `sizes`."""
    devices = math.prod(sizes.values())
    state = state or state_bytes(config, sizes)
    train, m = config.train, config.model
    d = _dims(config, devices)
    T, c = d.tokens, d.c
    num_dense, num_moe = blocks(m)
    buffers = moe_buffers(config, sizes, T)
    layers = {"dense": (num_dense, layer_bytes(config, "dense", attention_backend, None, T)),
              "moe": (num_moe, layer_bytes(config, "moe", attention_backend, buffers, T))}
    device_tok = host_tok = recomputed_tok = 0
    for kind, (count, lb) in layers.items():
        dev, host = saved_per_token(config, lb, kind)
        device_tok += count * dev
        host_tok += count * host
        recomputed_tok += count * (lb.residual + lb.attention + lb.mlp - dev - host)
    scan_extra = SCAN_RESIDUAL_EXTRA * device_tok if train.scan_layers else 0
    V = m.vocab_size
    loss_tok = V * 4 + m.hidden_size * c  # log-softmax (float32) and the lm_head's input
    activations = T * int(device_tok + scan_extra + loss_tok)

    matrix_bytes = state.matrix_elements * (1 if d.fp8 else c)
    other = state.parameter_elements - state.matrix_elements
    gradient_buffers = state.matrix_elements * c + other * 4
    if train.grad_accum_steps > 1:
        gradient_buffers += state.gradients  # the float32 running sum
    weight_copies = 0
    if sizes["expert"] > 1:
        # The routed experts' weights enter the expert-parallel shard_map in float32 and are cast inside it, where XLA
        # cannot fuse the gradient's cast into its readers (float32 gradient buffers), and without remat the
        # compute-dtype copies leave it as residuals of every MoE layer: deepseek-v3-proxy on 2 H200s with
        # parallel.expert=2 (benchmarks/results/step-h200.json rung 8 and step-4x4096-h200x2.json).
        gradient_buffers += state.expert_elements * (4 - c)
        if train.remat == "none":  # under FP8 the residual is the input gradient's e4m3 copy
            weight_copies += state.expert_elements * (1 if d.fp8 else c)
    stacked_bytes = 0
    # The layers' share of the parameters (all but the embedding and the output head).
    stacked_share = 1.0 - (V * m.hidden_size * (1 if m.tie_embeddings else 2)) / max(1, model_facts(config)[2][0])
    if train.scan_layers:
        weight_copies += int(matrix_bytes * stacked_share * (2 if train.remat == "none" else 1))
        stacked_bytes = int(T * device_tok + stacked_share * state.gradients)
    if holds_weight_cache(train):
        # The step's e4m3 copies of every quantized weight, held from before the first microbatch to the last
        # (dropless.fp8.recipe.weight_cache); they stand in for the copies a scanned stack hoists (above). Each FP8
        # forward keeps its weight's input-gradient copy for the backward; with the cache that residual is the
        # cached copy, so the cache adds the forward's copy, one byte per quantized parameter: the proxy's step with
        # 4 microbatches holds 3.48 GiB more with it (fp8-accum-h200.json), for 3.60 GiB of quantized parameters.
        # (The uncached step's per-layer residual copies are not counted: its planned peak errs high by more.)
        weight_copies = max(weight_copies, int(state.matrix_elements * stacked_share))

    layer_copy = state.largest_layer_gathered * (1 if d.fp8 else c)
    temporaries = {
        # The logits' float32 gradient takes the place of the saved log-softmax; its compute-dtype copy, which
        # the lm_head's backward matmul reads, is the temporary.
        "logits": T * V * c,
        "layer_weights": layer_copy,  # one layer's weights cast to the compute dtype (gathered over fsdp)
        # One layer's attention backward: the XLA einsum's [S, S] float32 score gradients per head, or flash
        # attention's per-row statistics (float32 per head).
        "attention": T * m.num_heads * 4 * (2 if attention_backend in FLASH_BACKENDS else train.seq_len),
    }
    moe_lb = layers["moe"][1]
    if num_moe:
        row = _moe_row_bytes(config, c, d.fp8)
        # The backward of one MoE layer: the cotangents of its sorted rows [D] and up projection [2F], and of the
        # received rows; the worst-case branch recomputes its forward (it is checkpointed) on top.
        cotangent_row = (m.hidden_size + 2 * config.moe.expert_intermediate_size) * c
        received = buffers.received_rows * 2 * m.hidden_size * c
        temporaries["moe_buffers"] = int(buffers.local_rows * cotangent_row + received)
        # (No bound, no second branch: one device, or a bound as large as the worst case.)
        worst_received = (buffers.worst_received_rows or buffers.received_rows) * 2 * m.hidden_size * c
        temporaries["moe_worst_case"] = (temporaries["moe_buffers"] if buffers.local_rows >= buffers.worst_rows
                                         else int(buffers.worst_rows * (row + cotangent_row) + worst_received))
        if train.fp8 == "rowwise":
            # rowwise quantizes the weight gradient's transposed copies with XLA, which writes their operands
            # transposed in float32: the proxy's compiled step holds two of gate+up's [D, rows] in its heap
            # (benchmarks/results/fp8-step-memory-h200.json), and with them as the largest temporary the plan is
            # within 1% of its measured peak. blockwise's one-pass kernel writes none; its two-pass quantizer (on
            # several devices) and mxfp8's copies are not measured.
            temporaries["rowwise_transposes"] = 2 * buffers.local_rows * m.hidden_size * 4
    if train.remat == "full":
        per_layer = max(lb.residual + lb.attention + lb.mlp for n, lb in layers.values() if n)
        temporaries["recompute_layer"] = int(RECOMPUTE_FACTOR * T * per_layer)
    elif train.remat == "moe" and num_moe:
        temporaries["recompute_moe"] = int(RECOMPUTE_FACTOR * T * moe_lb.mlp)

    model_state_and_batch = state.model_state + train.batch_size * (train.seq_len + 1) * 4 // devices
    update_phase = 0
    if train.offload_optimizer:
        # The update brings the moments in, upcasts them to float32, and writes the new ones back.
        update_phase = (state.parameters + model_state_and_batch + gradient_buffers + state.optimizer_state
                        + 8 * state.largest_layer_elements)
    return MemoryPlan(
        parameters=state.parameters, gradients=state.gradients, gradient_buffers=gradient_buffers,
        optimizer_state=state.optimizer_state, optimizer_in_host=state.optimizer_in_host,
        model_state_and_batch=model_state_and_batch, activations=activations,
        activations_in_host=int(T * host_tok), weight_copies=weight_copies, temporaries=temporaries,
        moe_buffers=buffers.__dict__ if num_moe else {}, update_phase=update_phase,
        recomputed_activations=int(T * recomputed_tok), stacked_bytes=stacked_bytes)
