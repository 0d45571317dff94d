"""AdamW with linear warm-up and cosine decay, global-norm clipping, weight decay on matrices only, and the routers'
learning rate scaled by `train.router_lr_scale`."""

from __future__ import annotations

import jax
import optax

from dropless.core.config import TrainConfig
from dropless.models.transformer import is_router_weight
from dropless.train.offload import apply_memory_features


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
    """Linear warm-up from 0 to `learning_rate`, then cosine decay to `min_lr_ratio * learning_rate` at the
    schedule's horizon (`train.schedule_steps`, or `train.steps` where that is 0), constant after it."""
    horizon = train.schedule_horizon
    warmup = min(train.warmup_steps, max(horizon - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(horizon, warmup + 1),
        end_value=train.learning_rate * train.min_lr_ratio,
    )


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
