"""The training step: one jitted pure function of (TrainState, batch) -> (TrainState, metrics).

The loss is next-token cross-entropy plus the MoE balancing losses, plus, with `model.mtp_layers` = D > 0, the
multi-token-prediction loss lambda / D * sum_k CE_k (`model.mtp_loss_weight` = lambda; CE_k the mean cross-entropy
of depth k over the positions that have a target, i < S - k), reported as `mtp_loss` = mean_k CE_k. After the
optimizer update, the
aux-loss-free router bias of every MoE layer moves by `rate * sign(mean_load - load)`: outside the
gradient, from the loads this very step routed.

The divergence guard: a step whose loss or gradient norm is not finite is not applied. Parameters, optimizer
state and router biases keep their values (a select on the device, no host round trip); the step counter
still advances, since it names the batch, and the metrics report `nonfinite` = 1. The loop stops a run after
`train.max_nonfinite_steps` such steps in a row.

With `train.grad_accum_steps = N > 1` the batch is split into N microbatches, run one after another in a
`jax.lax.scan`; their gradients are averaged in float32 before the one optimizer update, their expert loads
summed for the bias rule. Cross-entropy, the per-sequence balance loss and the z-loss are means over
sequences or tokens, so the step computes what one big batch would; the batch-level aux loss
(`moe.aux_loss_weight`) and capacity (`gmm_backend=capacity`) are per microbatch, as in other trainers. Under
`train.fp8` (blockwise, rowwise) the weights' e4m3 copies are made once, before the microbatches, and every
microbatch reads them (`dropless.fp8.recipe.weight_cache`): the same bits as quantizing in each.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dropless.core.config import Config
from dropless.fp8.recipe import caches_weights, train_recipe, weight_cache, with_weight_cache
from dropless.models import transformer
from dropless.moe import update_router_bias
from dropless.moe.balance import (center_router_bias, common_alignment, input_common_share, max_load_ratio,
                                  routing_covariance, token_variance_share, update_router_common)
from dropless.train.optimizer import learning_rate_schedule


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: steps taken (skipped non-finite ones included), the next batch's index
    params: Any
    opt_state: Any
    model_state: Any  # transformer.init_state's {"router_bias": [R, E], ...}: checkpointed, not the optimizer's


def init_train_state(key: jax.Array, config: Config, optimizer: optax.GradientTransformation,
                     params=None, model_state=None) -> TrainState:
    params = transformer.init_params(key, config) if params is None else params
    # A given state (an imported model's) lacks the leaves its config does not make, e.g. the routers' running
    # input means of moe.router_common_rate: they start at zero, which routes as without them.
    model_state = transformer.init_state(config) | ({} if model_state is None else dict(model_state))
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), model_state)


def split_batch(batch_BS1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, S+1] token windows -> (inputs [B, S], next-token targets [B, S])."""
    return batch_BS1[:, :-1], batch_BS1[:, 1:]


def mtp_cross_entropies(mtp_logits: tuple, targets_BS: jax.Array, documents_BS: jax.Array | None = None) -> jax.Array:
    """[D] mean cross-entropy of each MTP depth k = 1..D: position i scored on token i+k+1 (`targets_BS[:, i+k]`),
    over the positions i < S - k that have one. With `documents_BS` (data.document_mask: `transformer.document_ids`
    of the inputs), a position whose input token i+k lies in the next document scores nothing, as each document
    alone has no such position; the mean keeps its denominator, so microbatches add up to the whole batch."""
    seq_len = targets_BS.shape[1]
    losses = []
    for k, logits_BSV in enumerate(mtp_logits, start=1):
        per_token_BS = optax.softmax_cross_entropy_with_integer_labels(logits_BSV, jnp.roll(targets_BS, -k, axis=1))
        valid_BS = (jnp.arange(seq_len) < seq_len - k)[None, :]
        if documents_BS is not None:
            valid_BS = valid_BS & (documents_BS == jnp.roll(documents_BS, -k, axis=1))
        losses.append(jnp.sum(jnp.where(valid_BS, per_token_BS, 0.0)) / (targets_BS.shape[0] * (seq_len - k)))
    return jnp.stack(losses)


def loss_fn(params, model_state, batch_BS1, config: Config, executor=None, *, mtp: bool = True,
            training: bool = True, weight_cache: dict | None = None, other_sequences: jax.Array | None = None):
    """Mean next-token cross-entropy + MoE balancing losses (+ the MTP loss with `mtp` and model.mtp_layers).
    Returns (total, (cross_entropy, aux)); aux["mtp_loss"] is mean_k CE_k (0 without MTP). `training`: a training
    step's forward pass (evaluation: False, the model as inference runs it). `weight_cache`: the FP8 weights' e4m3
    copies (`dropless.fp8.recipe.weight_cache`), read instead of quantizing the weights again. `other_sequences`:
    `transformer.forward`'s (moe.router_common_other_steps)."""
    params = with_weight_cache(params, weight_cache)
    inputs_BS, targets_BS = split_batch(batch_BS1)
    with_mtp = mtp and config.model.mtp_layers > 0
    logits_BSV, aux = transformer.forward(params, model_state, inputs_BS, config, executor=executor, mtp=with_mtp,
                                          training=training, other_sequences=other_sequences)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits_BSV, targets_BS).mean()
    total = cross_entropy + aux["balance_loss"]
    mtp_loss = jnp.zeros((), jnp.float32)
    if with_mtp:  # lambda / D * sum_k CE_k = lambda * mean_k CE_k
        documents_BS = transformer.document_ids(inputs_BS, config)
        mtp_loss = jnp.mean(mtp_cross_entropies(aux.pop("mtp_logits"), targets_BS, documents_BS))
        total = total + config.model.mtp_loss_weight * mtp_loss
    return total, (cross_entropy, {**aux, "mtp_loss": mtp_loss})


def expert_shares(tokens_per_expert_LE: jax.Array, top_k: int) -> jax.Array:
    """[L, E] float32: the fraction of each layer's tokens that chose each expert (each token chooses K experts,
    so a row sums to K; balanced is K/E everywhere, a collapsed layer has one expert at 1)."""
    counts_LE = tokens_per_expert_LE.astype(jnp.float32)
    tokens_L1 = jnp.sum(counts_LE, axis=-1, keepdims=True) / top_k
    return counts_LE / jnp.maximum(tokens_L1, 1.0)


def _moe_metrics(aux, top_k: int) -> dict[str, jax.Array]:
    moe = aux.get("moe")
    if moe is None or moe.tokens_dropped.size == 0:  # a model without MoE layers
        zero_i, zero_f = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
        return {"tokens_dropped": zero_i, "max_expert_load": zero_f, "balance_loss": zero_f,
                "dispatch_overflows": zero_i, "rows_sent": zero_i, "rows_sent_without_dedup": zero_i}
    return {
        "tokens_dropped": jnp.sum(moe.tokens_dropped).astype(jnp.int32),
        "max_expert_load": jnp.max(moe.max_load_ratio),  # worst layer
        "balance_loss": aux["balance_loss"],
        # Expert parallelism: layers whose alltoall slots overflowed (and took the worst-case exchange,
        # dropping nothing), and token rows sent between devices with and without deduplication.
        "dispatch_overflows": jnp.sum(moe.dispatch_overflowed).astype(jnp.int32),
        "rows_sent": jnp.sum(moe.rows_sent).astype(jnp.int32),
        "rows_sent_without_dedup": jnp.sum(moe.rows_sent_without_dedup).astype(jnp.int32),
        # Router health (dropless.train.metrics draws and watches them): one row per MoE layer, then per MTP block.
        "expert_share": expert_shares(moe.tokens_per_expert, top_k),
        # [L] each: how much of the selection scores' / the logits' variance differs by token (1: all of it)
        "router_token_share": jax.vmap(token_variance_share)(moe.score_moments, moe.tokens_routed),
        "router_logit_token_share": jax.vmap(token_variance_share)(moe.logit_moments, moe.tokens_routed),
        # [L]: how much of the router input's mean square is common to the step's tokens (1: all of it)
        "router_input_common_share": jax.vmap(input_common_share)(moe.input_moments, moe.tokens_routed),
        # [L, E, E]: the covariance of the logits' per-token part; a logged step's router_logit_top_direction
        # (dropless.train.metrics.host_metrics) is read from it on the host
        "router_logit_covariance": jax.vmap(routing_covariance)(moe.logit_gram, moe.logit_moments,
                                                                moe.tokens_routed),
    }


def update_router_biases(model_state, aux, rate: float, center_rate: float = 0.0, rule: str = "sign"):
    """Apply the aux-loss-free bias rule (and, with center_rate > 0, the mean-score centring) to every router row
    (vectorised over the stacked row axis)."""
    if (rate == 0.0 and center_rate == 0.0) or "router_bias" not in model_state or aux.get("moe") is None:
        return model_state
    stats = aux["moe"]
    bias_LE = model_state["router_bias"]
    if center_rate > 0.0:
        bias_LE = center_router_bias(bias_LE, stats.score_moments, stats.tokens_routed, center_rate)
    if rate > 0.0:
        bias_LE = jax.vmap(update_router_bias, in_axes=(0, 0, None, None))(bias_LE, stats.tokens_per_expert, rate,
                                                                          rule)
    return {**model_state, "router_bias": bias_LE}


def update_router_commons(model_state, aux, rate: float):
    """Move every router's running input mean (`model_state["router_common"]`, moe.router_common_rate) towards
    the step's mean router input (its MoEStats.input_moments, summed over microbatches and devices)."""
    if rate == 0.0 or "router_common" not in model_state or aux.get("moe") is None:
        return model_state
    stats = aux["moe"]
    common_LD = update_router_common(model_state["router_common"], stats.input_moments, stats.tokens_routed, rate)
    return {**model_state, "router_common": common_LD}


def microbatches(batch_BS1: jax.Array, count: int) -> jax.Array:
    """[B, S+1] -> [count, B / count, S+1]; microbatch j holds rows j, j + count, j + 2 count, ...

    Strided rather than contiguous, so that every device's shard of the batch (a contiguous block of rows)
    holds its share of every microbatch and the split moves no data between devices.
    """
    rows, width = batch_BS1.shape
    return jnp.swapaxes(batch_BS1.reshape(rows // count, count, width), 0, 1)


# How the MoE statistics of N microbatches combine into the step's: counts and the router's moments add (the load
# ratio and the token shares are then the whole step's), losses (means over their microbatch) average.
_STATS_SUMMED = ("tokens_per_expert", "tokens_dropped", "dispatch_overflowed", "rows_sent", "rows_sent_without_dedup",
                 "score_moments", "logit_moments", "tokens_routed", "logit_gram", "input_moments")


def merge_microbatch_stats(stats_N):
    """MoEStats stacked over microbatches [N, ...] -> the step's MoEStats, as one batch would report them."""
    merged = {name: jnp.sum(value, axis=0) if name in _STATS_SUMMED else jnp.mean(value, axis=0)
              for name, value in zip(stats_N._fields, stats_N)}
    merged["max_load_ratio"] = jax.vmap(max_load_ratio)(merged["tokens_per_expert"])  # one row per MoE layer
    return type(stats_N)(**merged)


def accumulated_value_and_grad(params, model_state, batch_BS1, config: Config, executor=None,
                               other_sequences: jax.Array | None = None):
    """`jax.value_and_grad(loss_fn, has_aux=True)` over `config.train.grad_accum_steps` microbatches
    (`other_sequences`: loss_fn's).

    Returns ((total, (cross_entropy, aux)), grads) like one call on the whole batch: losses and gradients
    averaged, the MoE statistics merged (`merge_microbatch_stats`).
    """
    grad_fn = functools.partial(jax.value_and_grad(loss_fn, has_aux=True), other_sequences=other_sequences)
    count = config.train.grad_accum_steps
    # Under FP8 each weight's e4m3 copies are made once for the step (XLA does not hoist the quantization out of
    # the microbatch loop by itself): N - 1 fewer passes over every quantized weight, and with one microbatch one
    # pass for the forward's and the input gradient's copies together.
    cache = weight_cache(params, train_recipe(config.train)) if caches_weights(config.train) else None
    if count == 1:
        return grad_fn(params, model_state, batch_BS1, config, executor, weight_cache=cache)

    def one(grads_sum, micro_BS1):
        (total, (cross_entropy, aux)), grads = grad_fn(params, model_state, micro_BS1, config, executor,
                                                       weight_cache=cache)
        grads_sum = jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), grads_sum, grads)
        return grads_sum, (total, cross_entropy, aux)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    grads_sum, (total_N, cross_entropy_N, aux_N) = jax.lax.scan(one, zeros, microbatches(batch_BS1, count))
    grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads_sum, params)
    aux = {**aux_N, "moe": merge_microbatch_stats(aux_N["moe"]), "balance_loss": jnp.mean(aux_N["balance_loss"]),
           "mtp_loss": jnp.mean(aux_N["mtp_loss"])}
    return (jnp.mean(total_N), (jnp.mean(cross_entropy_N), aux)), grads


def where_tree(ok: jax.Array, new, old):
    """`new` where the scalar `ok` holds, else `old`, leaf by leaf (XLA fuses the select into the update)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def other_sequences_step(config: Config, step: jax.Array) -> jax.Array | None:
    """Whether training step `step` takes each sequence's common direction from the other sequences
    (moe.router_common_other_steps > 0: the first that many steps); None where every step does."""
    steps = config.moe.router_common_other_steps
    return None if steps == 0 else step < steps


def applied_updates(opt_state, step: jax.Array, on_host: bool = False) -> jax.Array:
    """How many updates the optimizer has applied: the count its learning-rate schedule reads. A skipped step
    (not finite) keeps the optimizer's state, count included, so after k of them the schedule runs k steps behind
    `TrainState.step` (as Megatron-LM's scheduler does, stepping only on a successful update). `step` where the
    state holds no schedule. `on_host`: the state is in host memory (train.offload_optimizer); the count is
    copied to the device. Only then: a copy to a memory space places the step's outputs on the device, and a
    step jitted without shardings would compile again for its own outputs."""
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
    schedules = [leaf for leaf in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(leaf)]
    if not schedules:
        return step
    return jax.device_put(schedules[0].count, jax.memory.Space.Device) if on_host else schedules[0].count


def make_train_step(config: Config, optimizer: optax.GradientTransformation, executor=None) -> Callable:
    """The un-jitted step; callers jit it with their shardings (see `dropless.train.loop`)."""
    schedule_lr = learning_rate_schedule(config.train)

    def train_step(state: TrainState, batch_BS1: jax.Array):
        (total, (cross_entropy, aux)), grads = accumulated_value_and_grad(
            state.params, state.model_state, batch_BS1, config, executor, other_sequences_step(config, state.step))
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        model_state = update_router_biases(state.model_state, aux, config.moe.bias_update_rate,
                                           config.moe.bias_center_rate, config.moe.bias_update_rule)
        model_state = update_router_commons(model_state, aux, config.moe.router_common_rate)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
        params, opt_state, model_state = where_tree(
            finite, (params, opt_state, model_state), (state.params, state.opt_state, state.model_state))
        metrics = {"loss": cross_entropy, "total_loss": total, "grad_norm": grad_norm,
                   "lr": schedule_lr(applied_updates(state.opt_state, state.step, config.train.offload_optimizer)),
                   "nonfinite": (~finite).astype(jnp.int32),
                   **_moe_metrics(aux, config.moe.num_experts_per_tok)}
        if "expert_share" in metrics:
            metrics["router_bias"] = model_state["router_bias"]  # after this step's update
            if "router_common" in state.model_state:  # before this step's update
                moe = aux["moe"]
                metrics["router_common_alignment"] = jax.vmap(common_alignment)(
                    state.model_state["router_common"], moe.input_moments, moe.tokens_routed)
        if config.model.mtp_layers:
            metrics["mtp_loss"] = aux["mtp_loss"]
        return TrainState(state.step + 1, params, opt_state, model_state), metrics

    return train_step


def make_eval_step(config: Config, executor=None) -> Callable:
    """Mean cross-entropy of a batch, in `train.grad_accum_steps` microbatches (the memory of a training one)."""
    def eval_step(params, model_state, batch_BS1):
        if config.train.grad_accum_steps == 1:
            return loss_fn(params, model_state, batch_BS1, config, executor, mtp=False, training=False)[1][0]

        def one(_, micro_BS1):
            return None, loss_fn(params, model_state, micro_BS1, config, executor, mtp=False, training=False)[1][0]
        _, cross_entropy_N = jax.lax.scan(one, None, microbatches(batch_BS1, config.train.grad_accum_steps))
        return jnp.mean(cross_entropy_N)
    return eval_step

