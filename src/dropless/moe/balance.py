"""Load accounting and balancing: the three balancing losses and the aux-loss-free bias update.

Shapes: B batch, S sequence, T = B*S tokens, E experts, K top-k. `probs` are the router scores
normalised to sum to 1 over experts (softmax as is; sigmoid scores divided by their sum), and
`count_e` is how many of the T*K (token, expert) assignments chose expert e. All losses equal 1
(aux, seq-aux) when the load and the probabilities are uniform, whatever E and K.

  aux_loss     (Switch/GShard, over the batch)  = E/(K*T) * sum_e count_e * mean_t probs[t, e]
  seq_aux_loss (DeepSeek-V2/V3, per sequence)   = mean_b [ E/(K*S) * sum_e count_{b,e} * mean_s probs[b, s, e] ]
  z_loss       (ST-MoE)                         = mean_t logsumexp(logits[t])^2

Only `probs` carries gradient (the counts come from a discrete top-k), as in all three papers.
Hugging Face's Mixtral `load_balancing_loss_func` is K times our aux_loss (its weights are per slot).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def tokens_per_expert(expert_ids_TK: jax.Array, num_experts: int) -> jax.Array:
    """[E] int32 count of (token, expert) assignments per expert."""
    one_hot_TKE = expert_ids_TK[..., None] == jnp.arange(num_experts, dtype=expert_ids_TK.dtype)
    return jnp.sum(one_hot_TKE, axis=(0, 1), dtype=jnp.int32)


def max_load_ratio(tokens_per_expert_E: jax.Array) -> jax.Array:
    """max/mean tokens per expert: 1 is perfect balance, E/K the worst (every token on the same K experts)."""
    load_E = tokens_per_expert_E.astype(jnp.float32)
    return jnp.max(load_E) / jnp.maximum(jnp.mean(load_E), 1e-9)


def _balance(count_E: jax.Array, probs_NE: jax.Array, top_k: int) -> jax.Array:
    num_experts = probs_NE.shape[-1]
    num_rows = probs_NE.shape[-2]
    fraction_E = count_E.astype(jnp.float32) * (num_experts / (top_k * num_rows))
    return jnp.sum(fraction_E * jnp.mean(probs_NE, axis=-2), axis=-1)


def aux_loss(probs_TE: jax.Array, expert_ids_TK: jax.Array) -> jax.Array:
    """Switch/GShard load-balancing loss over all tokens of the batch."""
    count_E = tokens_per_expert(jax.lax.stop_gradient(expert_ids_TK), probs_TE.shape[-1])
    return _balance(count_E, probs_TE, expert_ids_TK.shape[-1])


def seq_aux_loss(probs_BSE: jax.Array, expert_ids_BSK: jax.Array) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss: the aux loss within each sequence, averaged over sequences."""
    num_experts = probs_BSE.shape[-1]
    one_hot_BSKE = expert_ids_BSK[..., None] == jnp.arange(num_experts, dtype=expert_ids_BSK.dtype)
    count_BE = jnp.sum(one_hot_BSKE, axis=(1, 2), dtype=jnp.int32)
    return jnp.mean(_balance(count_BE, probs_BSE, expert_ids_BSK.shape[-1]))


def _per_token_part(values_TE: jax.Array) -> jax.Array:
    """float32 values outside the gradient, each token's minus their mean over the experts (a shift common to all of
    one token's experts changes no choice)."""
    v_TE = jax.lax.stop_gradient(values_TE).astype(jnp.float32)
    return v_TE - jnp.mean(v_TE, axis=-1, keepdims=True)


def routing_moments(values_TE: jax.Array) -> jax.Array:
    """[2, E] float32: the sums over tokens of v and v², v = `_per_token_part(values)`. Sums add over microbatches
    and devices, so `token_variance_share` of summed moments is the whole batch's."""
    v_TE = _per_token_part(values_TE)
    return jnp.stack([jnp.sum(v_TE, axis=0), jnp.sum(jnp.square(v_TE), axis=0)])


def token_variance_share(moments_2E: jax.Array, tokens: jax.Array) -> jax.Array:
    """The share of a layer's routing that varies by token, from `routing_moments` over `tokens` tokens:
    mean_e var_t(v) / (mean_e var_t(v) + var_e(mean_t v)).

    1: which experts score high differs from token to token, no expert is ahead for every token; 0: every token
    ranks the experts alike, so every token chooses the same experts whatever the bias does to them. Of the
    selection scores (scores + bias) it says whether the choice depends on the token at all; of the logits,
    whether the router itself has lost the token (a common part of its input dominating its logits)."""
    n = jnp.maximum(jnp.asarray(tokens, jnp.float32), 1.0)
    mean_E = moments_2E[0] / n
    per_token = jnp.mean(jnp.maximum(moments_2E[1] / n - jnp.square(mean_E), 0.0))
    common = jnp.mean(jnp.square(mean_E - jnp.mean(mean_E)))
    return per_token / jnp.maximum(per_token + common, 1e-30)


def routing_gram(values_TE: jax.Array) -> jax.Array:
    """[E, E] float32: the sum over tokens of v vᵀ, v as in `routing_moments`; adds over microbatches and devices
    alike (`routing_covariance`)."""
    v_TE = _per_token_part(values_TE)
    return jnp.einsum("te,tf->ef", v_TE, v_TE, precision=jax.lax.Precision.HIGHEST)


def routing_covariance(gram_EE: jax.Array, moments_2E: jax.Array, tokens: jax.Array) -> jax.Array:
    """[E, E] float32: the covariance over `tokens` tokens of the per-token part of a layer's routing values, from
    their `routing_gram` and `routing_moments` (symmetric by construction)."""
    n = jnp.maximum(jnp.asarray(tokens, jnp.float32), 1.0)
    mean_E = moments_2E[0] / n
    covariance_EE = gram_EE / n - jnp.outer(mean_E, mean_E)
    return 0.5 * (covariance_EE + covariance_EE.T)


def input_moments(x_TD: jax.Array) -> jax.Array:
    """[D + 1] float32, outside the gradient: the sum over tokens of the router's input h, then the sum of |h|².
    Sums add over microbatches and devices (`input_common_share`)."""
    h_TD = jax.lax.stop_gradient(x_TD).astype(jnp.float32)
    return jnp.concatenate([jnp.sum(h_TD, axis=0), jnp.sum(jnp.square(h_TD))[None]])


def input_mean(moments_D1: jax.Array, tokens: jax.Array) -> jax.Array:
    """The mean router input over `tokens` tokens from `input_moments` (any leading axes; zero without tokens)."""
    return moments_D1[..., :-1] / jnp.maximum(jnp.asarray(tokens, jnp.float32), 1.0)[..., None]


def input_common_share(moments_D1: jax.Array, tokens: jax.Array) -> jax.Array:
    """The share of the router input's mean square that is common to the tokens, from `input_moments` over
    `tokens` tokens: |mean_t h|² / mean_t |h|².

    Near 0: the tokens' inputs point in many directions; near 1: every token's input is nearly the same vector, so
    the router's logits differ by token only through the small rest, and they rank the experts alike (the logits'
    `token_variance_share` falls) whatever the router's weights. It tells a router that lost the token through its
    input from one that lost it through its own weights."""
    mean_square = moments_D1[-1] / jnp.maximum(jnp.asarray(tokens, jnp.float32), 1.0)
    return jnp.sum(jnp.square(input_mean(moments_D1, tokens))) / jnp.maximum(mean_square, 1e-30)


def update_router_common(common_D: jax.Array, moments_D1: jax.Array, tokens: jax.Array, rate: float) -> jax.Array:
    """The running mean of a router's input (moe.router_common_rate): common += rate * (mean_t h - common), the
    step's mean from `input_moments` over `tokens` tokens, outside the gradient. Only its direction is used
    (`dropless.moe.router.fold_common`), so starting from zero costs nothing: the first update already points
    along the first step's mean. A step without tokens leaves it as it is. Works on any leading axes."""
    has_tokens = (jnp.asarray(tokens) > 0)[..., None]
    step = jnp.where(has_tokens, rate * (input_mean(moments_D1, tokens) - common_D), 0.0)
    return (common_D + jax.lax.stop_gradient(step)).astype(common_D.dtype)


def common_alignment(common_D: jax.Array, moments_D1: jax.Array, tokens: jax.Array) -> jax.Array:
    """|cosine| between a router's running input mean (moe.router_common_rate) and the mean of its input over a
    step's tokens (`input_moments`): 1 = the direction the router does not see (either sign: the projection
    removes both) is the step's common direction; lower = the running mean lags it, and what the router sees keeps
    part of the common vector. 0 where either is zero (a run's first step)."""
    mean_D = input_mean(moments_D1, tokens)
    norms = jnp.sqrt(jnp.sum(jnp.square(mean_D)) * jnp.sum(jnp.square(common_D.astype(jnp.float32))))
    return jnp.where(norms > 0, jnp.abs(jnp.sum(mean_D * common_D)) / jnp.maximum(norms, 1e-30), 0.0)


def top_direction_share(covariance_EE) -> np.ndarray:
    """The share of the per-token variance of a layer's routing values (`routing_covariance`) that lies along one
    direction in expert space: the covariance's largest eigenvalue over its trace; any leading axes (one value per
    router row). On the host, where a logged step's metrics are read: an eigendecomposition per router row is
    work the training step need not do every step.

    Near 1: tokens differ from each other along a single direction, t ↦ a_t·u, so they rank the experts in at most
    two ways (by the sign of a_t) however much they vary, and no bias can spread them over more; small (down to
    1/(E-1) for isotropic values): tokens differ in many independent ways. Read with `token_variance_share`: a
    router can lose the token by a common part outgrowing the per-token one (that share falls) or by the per-token
    part collapsing onto one direction (this one rises)."""
    covariance = np.asarray(covariance_EE, np.float64)
    finite = np.isfinite(covariance).all(axis=(-2, -1))
    # A step whose routing values are not finite (a diverging step, which the training loop's guard reports) has
    # no eigenvalues: NaN for its rows, instead of an eigensolver error.
    eigenvalues = np.maximum(np.linalg.eigvalsh(np.where(finite[..., None, None], covariance, 0.0)), 0.0)
    share = eigenvalues[..., -1] / np.maximum(np.sum(eigenvalues, axis=-1), 1e-30)
    return np.where(finite, share, np.nan)


def z_loss(logits_TE: jax.Array) -> jax.Array:
    """Router z-loss: penalises large logits, which make the softmax/sigmoid saturate."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1)))


def center_router_bias(bias_E: jax.Array, score_moments_2E: jax.Array, tokens: jax.Array, rate: float) -> jax.Array:
    """Move each expert's mean selection score (scores + bias, over the step's tokens, each token's mean over the
    experts removed: `routing_moments`) `rate` of the way to the mean over the experts, through the bias.

    When every token ranks the experts alike (a common part of the router's input dominating its logits), the
    experts whose mean score is ahead win every token and the sign rule of `update_router_bias`, a fixed step
    per update, only rotates which ones; equal means leave the choice to each token's own spread. rate = 1
    equalises them in one update, as seen on the step's tokens. Works on any leading axes, like
    `update_router_bias`."""
    n = jnp.maximum(jnp.asarray(tokens, jnp.float32), 1.0)[..., None]
    offset_E = score_moments_2E[..., 0, :] / n  # mean_t(v_e) - mean over experts: zero mean over E
    return (bias_E.astype(jnp.float32) - rate * offset_E).astype(bias_E.dtype)


def update_router_bias(bias_E: jax.Array, tokens_per_expert_E: jax.Array, rate: float,
                       rule: str = "sign") -> jax.Array:
    """Aux-loss-free balancing (DeepSeek-V3): bias += rate * sign(mean_load - load), outside the gradient.

    rule="proportional" moves each bias by rate * clip((mean_load - load) / mean_load, -1, 1) instead: the sign
    rule's step wherever an expert is off by the mean load or more (a collapse), and a step in proportion to the
    gap near balance, where the sign rule's fixed step keeps every bias moving by `rate` each update and so keeps
    moving tokens between experts whose loads already agree to sampling noise.
    Works on any leading axes (e.g. [L, E] for stacked layers); the mean is over the last (expert) axis.
    """
    load_E = tokens_per_expert_E.astype(jnp.float32)
    mean_E = jnp.mean(load_E, axis=-1, keepdims=True)
    if rule == "sign":
        step_E = jnp.sign(mean_E - load_E)
    else:
        step_E = jnp.clip((mean_E - load_E) / jnp.maximum(mean_E, 1e-9), -1.0, 1.0)
    return (bias_E.astype(jnp.float32) + rate * step_E).astype(bias_E.dtype)
