"""AdamW with a linear warm-up and a decay (cosine, linear or 1-sqrt, after the warm-up or over the run's last
steps), global-norm clipping, weight decay on matrices only, and the routers' learning rate scaled by
`train.router_lr_scale`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from dropless.core.config import TrainConfig
from dropless.models.transformer import is_router_weight
from dropless.train.offload import apply_memory_features


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
    """Linear warm-up from 0 to `learning_rate`, held there, then a decay over `train.decay_steps` (0 = every step
    after the warm-up) to `min_lr_ratio * learning_rate` at the schedule's horizon (`train.schedule_steps`, or
    `train.steps` where that is 0), constant after it. The decay is `train.decay_shape`: a half cosine, a line, or
    1 - sqrt of the fraction done."""
    horizon, warmup = train.schedule_horizon, train.warmup_end
    peak, end = train.learning_rate, train.learning_rate * train.min_lr_ratio
    if train.decay_start == warmup and train.decay_shape == "cosine":
        # The plain cosine schedule: optax's own, so that the learning rates are those it has always given.
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup,
                                                  decay_steps=max(horizon, warmup + 1), end_value=end)
    decay = horizon - train.decay_start  # >= 1: the warm-up ends before the horizon
    if train.decay_shape == "cosine":
        tail = optax.cosine_decay_schedule(peak, decay, alpha=train.min_lr_ratio)
    elif train.decay_shape == "linear":
        tail = optax.linear_schedule(peak, end, decay)
    else:
        def tail(count):
            done = jnp.clip(count / decay, 0.0, 1.0)
            return end + (peak - end) * (1.0 - jnp.sqrt(done))
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak), tail],
                                boundaries=[warmup, train.decay_start])


def _is_decayed(path: tuple, leaf: jax.Array) -> bool:
    """Decay weight matrices; skip norms (their names end in 'norm') and biases, whatever their stacking."""
    name = str(getattr(path[-1], "key", path[-1]))
    return not (name.endswith("norm") or name.endswith("bias"))


def weight_decay_mask(params):
    return jax.tree_util.tree_map_with_path(_is_decayed, params)


def router_mask(params):
    return jax.tree_util.tree_map_with_path(is_router_weight, params)


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    parts = []
    if train.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(train.grad_clip))
    parts.append(
        optax.adamw(
            learning_rate=learning_rate_schedule(train),
            b1=train.beta1,
            b2=train.beta2,
            eps=1e-8,
            weight_decay=train.weight_decay,
            mask=weight_decay_mask,
        )
    )
    if train.router_lr_scale != 1.0:
        # After AdamW, so the routers' whole update (weight decay included) is scaled, as a per-group learning
        # rate would be; no state, so checkpoints of runs without it keep their layout.
        parts.append(optax.masked(optax.scale(train.router_lr_scale), router_mask))
    # bfloat16 moments (both of them) and host offloading of the optimizer state: dropless.train.offload.
    return apply_memory_features(optax.chain(*parts), train)
