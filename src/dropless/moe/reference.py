"""A deliberately simple reference MoE: a per-token loop in float64, the oracle for the tests.

Nothing here is fast or clever. Selection (`reference_route`, `reference_capacity_keep`) is plain NumPy
float64 with Python sorting. The forward (`reference_moe`) computes each token on its own, looping over its chosen
experts, with jax.numpy so the tests can differentiate it; call it inside `jax.enable_x64()` with float64
inputs to get float64 results. The selection is an input of the forward because a discrete choice has no
gradient: the tests compute it with `reference_route` and check it equals the layer's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _scores(logits_E, score_func: str, xp):
    if score_func == "softmax":
        shifted = xp.exp(logits_E - xp.max(logits_E))
        return shifted / xp.sum(shifted)
    return 1.0 / (1.0 + xp.exp(-logits_E))


def reference_route(x_TD, kernel_DE, bias_E, moe_cfg, common_D=None) -> np.ndarray:
    """[T, K] expert ids, best first: top-k of (score + bias) within the best topk_group groups; with `common_D`,
    each token's router input has that direction removed (moe.router_common_rate): one [D] for every token, or one
    per token [T, D]."""
    x_TD = np.asarray(x_TD, np.float64)
    units_TD = _common_units(common_D, x_TD.shape[0])
    kernel_DE = np.asarray(kernel_DE, np.float64)
    num_experts, top_k = moe_cfg.num_experts, moe_cfg.num_experts_per_tok
    bias_E = np.zeros(num_experts) if bias_E is None else np.asarray(bias_E, np.float64)
    per_group = num_experts // moe_cfg.n_group
    ids_TK = np.zeros((x_TD.shape[0], top_k), np.int32)
    for t in range(x_TD.shape[0]):
        x_D = _without_common(x_TD[t], None if units_TD is None else units_TD[t])
        choice = _scores(x_D @ kernel_DE, moe_cfg.score_func, np) + bias_E
        allowed = list(range(num_experts))
        if moe_cfg.n_group > 1:
            group_score = [sum(sorted(choice[g * per_group:(g + 1) * per_group])[-2:])
                           for g in range(moe_cfg.n_group)]
            kept = sorted(range(moe_cfg.n_group), key=lambda g: -group_score[g])[:moe_cfg.topk_group]
            allowed = [e for e in allowed if e // per_group in kept]
        ids_TK[t] = sorted(allowed, key=lambda e: -choice[e])[:top_k]  # stable: ties go to the lower id
    return ids_TK


def reference_capacity_keep(expert_ids_TK, num_experts: int, capacity: int) -> np.ndarray:
    """[T, K] bool: GShard's rule, each expert serves its first `capacity` assignments in token order."""
    expert_ids_TK = np.asarray(expert_ids_TK)
    served = np.zeros(num_experts, np.int64)
    keep_TK = np.zeros(expert_ids_TK.shape, bool)
    for t in range(expert_ids_TK.shape[0]):
        for k in range(expert_ids_TK.shape[1]):
            e = expert_ids_TK[t, k]
            keep_TK[t, k] = served[e] < capacity
            served[e] += 1
    return keep_TK


def _common_units(common, num_tokens: int) -> np.ndarray | None:
    """Per-token unit directions [T, D] (float64) from one direction [D] for every token or one per token
    [T, D]; a zero vector stays zero (no projection). None for None."""
    if common is None:
        return None
    common_TD = np.broadcast_to(np.asarray(common, np.float64), (num_tokens, np.shape(common)[-1]))
    norm_T1 = np.linalg.norm(common_TD, axis=-1, keepdims=True)
    return np.where(norm_T1 > 0, common_TD / np.where(norm_T1 > 0, norm_T1, 1.0), 0.0)


def _without_common(x_D, unit_D):
    """The router's input with a unit direction removed, x - (x·u)u (moe.router_common_rate); x for None."""
    return x_D if unit_D is None else x_D - (x_D @ unit_D) * unit_D


def _swiglu(x_D, gate_up_DF2, down_FD, jnp):
    width = down_FD.shape[0]
    h = x_D @ gate_up_DF2
    gate, up = h[:width], h[width:]
    return (gate / (1.0 + jnp.exp(-gate)) * up) @ down_FD


def _one_token(params, x_D, ids_K, keep_K, moe_cfg, unit_D=None):
    """One token through the router and its K chosen experts: (output_D, probs_E, logsumexp of the logits)."""
    logits_E = _without_common(x_D, unit_D) @ params["router"]["kernel"]
    scores_E = _scores(logits_E, moe_cfg.score_func, jnp)
    weights_K = scores_E[ids_K]
    if moe_cfg.norm_topk_prob:
        weights_K = weights_K / (jnp.sum(weights_K) + 1e-20)
    out_D = jnp.zeros_like(x_D)
    for k in range(ids_K.shape[0]):
        expert = ids_K[k]
        expert_out = _swiglu(x_D, params["experts"]["gate_up"][expert], params["experts"]["down"][expert], jnp)
        out_D = out_D + jnp.where(keep_K[k], moe_cfg.routed_scaling_factor * weights_K[k] * expert_out, 0.0)
    if "shared" in params:
        out_D = out_D + _swiglu(x_D, params["shared"]["gate_up"], params["shared"]["down"], jnp)
    log_partition = jnp.max(logits_E) + jnp.log(jnp.sum(jnp.exp(logits_E - jnp.max(logits_E))))
    return out_D, scores_E / jnp.sum(scores_E), log_partition


def reference_moe(params: dict, x_BSD, expert_ids_TK, moe_cfg, keep_TK=None, common_D=None):
    """Per-token MoE: returns (y_BSD, {"aux_loss", "seq_aux_loss", "z_loss", "balance_loss"}).

    `expert_ids_TK` is the selection (from reference_route); `keep_TK` marks which assignments the
    capacity baseline computes (None = all, the dropless layer); `common_D` as in `reference_route`. The token
    function is mapped with jax.vmap only so that it compiles once; each token is computed on its own, with no
    sorting, grouping or permutation.
    """
    batch, seq, hidden = x_BSD.shape
    ids_TK = np.asarray(expert_ids_TK)
    num_tokens, top_k = ids_TK.shape
    num_experts = moe_cfg.num_experts
    keep_TK = np.ones(ids_TK.shape, bool) if keep_TK is None else np.asarray(keep_TK)
    units_TD = _common_units(common_D, num_tokens)
    one_token = lambda x_D, ids_K, keep_K, unit_D: _one_token(params, x_D, ids_K, keep_K, moe_cfg, unit_D)
    y_TD, probs_TE, log_partition_T = jax.vmap(one_token, in_axes=(0, 0, 0, None if units_TD is None else 0))(
        x_BSD.reshape(num_tokens, hidden), ids_TK, keep_TK, units_TD)

    def balance(tokens: slice):
        count_E = np.bincount(ids_TK[tokens].ravel(), minlength=num_experts)
        mean_prob_E = jnp.mean(probs_TE[tokens], axis=0)
        return num_experts / (top_k * len(range(num_tokens)[tokens])) * jnp.sum(count_E * mean_prob_E)

    aux = balance(slice(None))
    seq_aux = sum(balance(slice(b * seq, (b + 1) * seq)) for b in range(batch)) / batch
    z = jnp.mean(log_partition_T ** 2)
    losses = {"aux_loss": aux, "seq_aux_loss": seq_aux, "z_loss": z,
              "balance_loss": moe_cfg.aux_loss_weight * aux + moe_cfg.seq_aux_loss_weight * seq_aux
              + moe_cfg.z_loss_weight * z}
    return y_TD.reshape(batch, seq, hidden), losses
