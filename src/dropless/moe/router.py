"""The router: scores, expert selection (top-k, group-limited, bias-corrected) and combine weights.

Everything here is float32 whatever the compute dtype. Shapes: T tokens, D hidden, E experts, K top-k,
G expert groups (n_group). Semantics follow Hugging Face transformers exactly:
- Mixtral / Qwen3-MoE: softmax over all E experts, top-k, renormalise if norm_topk_prob.
- DeepSeek-V3: sigmoid scores; selection on scores + bias (the aux-loss-free correction bias), limited
  to the best `topk_group` of `n_group` groups, a group scored by the sum of its top-2 biased scores;
  combine weights are the *unbiased* scores of the chosen experts, renormalised (+1e-20) if
  norm_topk_prob, then multiplied by routed_scaling_factor.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dropless.core.mesh import per_batch_shard


class Routing(NamedTuple):
    expert_ids_TK: jax.Array  # int32, in descending order of the selection score
    weights_TK: jax.Array  # float32 combine weights
    logits_TE: jax.Array  # float32 router logits (for the z-loss)
    probs_TE: jax.Array  # float32 scores normalised to sum to 1 over experts (for the balancing losses)
    choice_TE: jax.Array  # float32 selection scores (scores + bias, no gradient): what the top-k ranks


def router_logits(kernel_DE: jax.Array, x_TD: jax.Array) -> jax.Array:
    # HIGHEST: on GPUs a default float32 dot may run in TF32, which can flip near-tied top-k choices.
    return jnp.dot(x_TD.astype(jnp.float32), kernel_DE.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def scores_from_logits(logits_TE: jax.Array, score_func: str) -> jax.Array:
    if score_func == "softmax":
        return jax.nn.softmax(logits_TE, axis=-1)
    return jax.nn.sigmoid(logits_TE)


def select_experts(choice_TE: jax.Array, top_k: int, n_group: int, topk_group: int) -> jax.Array:
    """Top-k expert ids of the selection scores, restricted to the best `topk_group` of `n_group` groups."""
    if n_group > 1:
        num_tokens, num_experts = choice_TE.shape
        choice_TGX = choice_TE.reshape(num_tokens, n_group, num_experts // n_group)
        # A group's score is the sum of its best two experts (DeepSeek-V3); one if groups have one expert.
        best_in_group = min(2, num_experts // n_group)
        group_score_TG = jnp.sum(jax.lax.top_k(choice_TGX, best_in_group)[0], axis=-1)
        _, kept_groups_TJ = jax.lax.top_k(group_score_TG, topk_group)
        kept_TG = jnp.any(kept_groups_TJ[:, :, None] == jnp.arange(n_group)[None, None, :], axis=1)
        # -inf (not 0, as older HF versions did): a masked expert must never beat a negative biased score.
        choice_TE = jnp.where(kept_TG[:, :, None], choice_TGX, -jnp.inf).reshape(num_tokens, num_experts)
    _, expert_ids_TK = jax.lax.top_k(choice_TE, top_k)
    return expert_ids_TK.astype(jnp.int32)


def _unit(v_ND, xp=jnp):
    """v / |v| along the last axis (NumPy or jax, float32); a zero vector stays zero."""
    norm_N1 = xp.sqrt(xp.sum(xp.square(v_ND), axis=-1, keepdims=True))
    return xp.where(norm_N1 > 0, v_ND / xp.maximum(norm_N1, xp.float32(1e-30)), xp.float32(0.0))


def fold_common(kernel_DE, common_D):
    """The router kernel that sees its input without the direction of `common_D` (a running mean of the input):
    (I - ĉĉᵀ)W, ĉ = common / |common|, so x·fold(W) = (x - (x·ĉ)ĉ)·W. A zero `common_D` leaves W as it is. The
    same function on the device (jax) and on export (numpy: `dropless.convert` writes the folded kernel, which
    routes alike in any implementation of the HF model)."""
    xp = np if isinstance(kernel_DE, np.ndarray) and isinstance(common_D, np.ndarray) else jnp
    kernel_DE = kernel_DE.astype(xp.float32)
    unit_D = _unit(common_D.astype(xp.float32), xp)
    return kernel_DE - xp.outer(unit_D, unit_D @ kernel_DE)


def other_sequences_mean(x_BSD: jax.Array) -> jax.Array:
    """[B, D] float32, outside the gradient: for each sequence, the mean of the router's input over the batch's
    other sequences (B > 1). A direction common to the step's tokens estimated without the sequence's own tokens
    (moe.router_common_source): a token's routing in this layer does not depend on its own sequence's later tokens.
    Through later layers it can, at second order: the other sequences' inputs there depend on their routing in this
    layer, which saw this sequence's mean, diluted by the other sequences' token count. Evaluation and inference, on
    the running mean, are causal."""
    batch, seq, _ = x_BSD.shape
    sums_BD = jnp.sum(jax.lax.stop_gradient(x_BSD).astype(jnp.float32), axis=1)
    return (jnp.sum(sums_BD, axis=0) - sums_BD) / ((batch - 1) * seq)


def route(kernel_DE: jax.Array, bias_E: jax.Array | None, x_TD: jax.Array, moe_cfg, *,
          mesh: Mesh | None = None, common_BD: jax.Array | None = None) -> Routing:
    """Choose K experts per token and their combine weights. The bias steers selection only.

    With a `mesh` whose devices split the tokens, the selection runs on each device's own tokens
    (`dropless.core.mesh.per_batch_shard`): XLA's partitioner gathered the group-limited top-k's group scores
    of every token onto every device (a blocking all-gather per layer) and selected for all tokens on each.

    `common_BD` (B rows, the T tokens being B sequences in order): the router sees sequence b's tokens without the
    direction of `common_BD[b]`, x - (x·ĉ_b)ĉ_b, through a rank-one correction of the logits (no [T, D] copy)."""
    logits_TE = router_logits(kernel_DE, x_TD)
    if common_BD is not None:
        batch, hidden = common_BD.shape
        unit_BD = _unit(jax.lax.stop_gradient(common_BD).astype(jnp.float32))
        x_BSD = x_TD.reshape(batch, -1, hidden).astype(jnp.float32)
        along_BS = jnp.einsum("bsd,bd->bs", x_BSD, unit_BD, precision=jax.lax.Precision.HIGHEST)
        unit_logits_BE = jnp.dot(unit_BD, kernel_DE.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        logits_TE = logits_TE - (along_BS[:, :, None] * unit_logits_BE[:, None, :]).reshape(logits_TE.shape)
    scores_TE = scores_from_logits(logits_TE, moe_cfg.score_func)
    choice_TE = jax.lax.stop_gradient(scores_TE)
    if bias_E is not None:
        choice_TE = choice_TE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    select = functools.partial(select_experts, top_k=moe_cfg.num_experts_per_tok, n_group=moe_cfg.n_group,
                               topk_group=moe_cfg.topk_group)
    if mesh is not None and x_TD.shape[0] % mesh.size == 0:  # else the executor names the problem
        select = per_batch_shard(select, mesh)
    expert_ids_TK = select(choice_TE)
    weights_TK = jnp.take_along_axis(scores_TE, expert_ids_TK, axis=-1)
    if moe_cfg.norm_topk_prob:
        weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
    weights_TK = weights_TK * moe_cfg.routed_scaling_factor
    if moe_cfg.score_func == "softmax":
        probs_TE = scores_TE
    else:
        probs_TE = scores_TE / (jnp.sum(scores_TE, axis=-1, keepdims=True) + 1e-20)
    return Routing(expert_ids_TK, weights_TK, logits_TE, probs_TE, choice_TE)
