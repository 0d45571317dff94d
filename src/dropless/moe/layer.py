"""The MoE layer: route -> executor (permute -> grouped GEMM -> unpermute) -> + shared experts.

Shapes: B batch, S sequence, T = B*S tokens, D hidden, E experts, K top-k, F expert width.
Parameters (float32 master weights, one layer; declared by `moe_params`):
    {"router": {"kernel": [D, E]},
     "experts": {"gate_up": [E, D, 2F], "down": [E, F, D]},
     "shared": {"gate_up": [D, 2Fs], "down": [Fs, D]}}      # only if moe.num_shared_experts > 0; Fs = n * F
The router bias (`router_bias_E`, DeepSeek-V3's e_score_correction_bias) is state, not a parameter; so is the
running mean of the router's input (`router_common_D`, moe.router_common_rate) whose direction the router does not
see (`dropless.moe.router.fold_common`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dropless.core import params as params_lib
from dropless.core.config import Config
from dropless.core.errors import MoEError
from dropless.core.params import ParamSpec, Specs
from dropless.moe import balance
from dropless.fp8 import Recipe
from dropless.moe.executor import ExecutorStats, ExpertExecutor, LocalExecutor
from dropless.moe.experts import dense_swiglu, swiglu_params
from dropless.moe.router import Routing, fold_common, other_sequences_mean, route


class MoEStats(NamedTuple):
    """Per-call accounting, all on device (no host sync)."""

    tokens_per_expert: jax.Array  # [E] int32, assignments chosen by the router (before any drop)
    max_load_ratio: jax.Array  # max/mean of tokens_per_expert
    tokens_dropped: jax.Array  # int32 (token, expert) assignments not computed; 0 unless gmm_backend=capacity
    aux_loss: jax.Array
    seq_aux_loss: jax.Array
    z_loss: jax.Array
    balance_loss: jax.Array  # aux_loss_weight*aux + seq_aux_loss_weight*seq_aux + z_loss_weight*z
    # Expert-parallel traffic (dropless.ep); 0 on one device.
    dispatch_overflowed: jax.Array  # int32 1 if alltoall slots or a local expert buffer overflowed (worst case ran)
    rows_sent: jax.Array  # int32 token rows sent between devices (dispatch; combine returns as many)
    rows_sent_without_dedup: jax.Array  # int32 rows one copy per remote (token, expert) pair would need
    # Router health: balance.routing_moments [2, E] of the selection scores (scores + bias) and of the logits over
    # the layer's tokens_routed tokens (summed over microbatches; balance.token_variance_share reads them).
    score_moments: jax.Array
    logit_moments: jax.Array
    tokens_routed: jax.Array  # int32
    logit_gram: jax.Array  # [E, E] balance.routing_gram of the logits (balance.routing_covariance reads it)
    input_moments: jax.Array  # [D + 1] balance.input_moments of the router's input (balance.input_common_share)


def moe_params(hidden_size: int, moe_cfg) -> Specs:
    """One layer's weights (the layout in the module docstring); the shared experts are absent, keeping their
    place in the key order, when moe.num_shared_experts = 0."""
    width = moe_cfg.expert_intermediate_size
    shared = moe_cfg.num_shared_experts
    return {
        "router": {"kernel": ParamSpec((hidden_size, moe_cfg.num_experts), ("embed", "router"))},
        "experts": swiglu_params(hidden_size, width, moe_cfg.num_experts),
        "shared": swiglu_params(hidden_size, shared * width) if shared > 0 else None,
    }


@functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one compilation instead of one per random draw
def init_moe(key: jax.Array, hidden_size: int, moe_cfg, init_std: float) -> dict:
    """One layer's float32 parameters, every weight drawn from normal(0, init_std)."""
    return params_lib.init(key, moe_params(hidden_size, moe_cfg), init_std)


def _expect(name: str, shape: tuple, expected: tuple, fix: str) -> None:
    if tuple(shape) != tuple(expected):
        raise MoEError(f"{name} has shape {tuple(shape)} but the MoE layer expects {tuple(expected)}; {fix}.")


def check_inputs(params: dict, router_bias_E, x_BSD, moe_cfg, router_common_D=None) -> None:
    """Validate shapes at the layer boundary against `moe_params` (trace time, so free under jit)."""
    if isinstance(moe_cfg, Config):
        raise MoEError("moe_cfg is the whole Config; the MoE layer takes its moe group: pass config.moe.")
    if getattr(x_BSD, "ndim", None) != 3:
        raise MoEError(f"x_BSD must be [batch, seq, hidden] but has shape {getattr(x_BSD, 'shape', None)}; "
                       f"reshape the activations to 3 dimensions.")
    fix = "build the parameters with init_moe(key, hidden_size, moe_cfg, init_std) for this config"
    if (moe_cfg.num_shared_experts > 0) != ("shared" in params):
        raise MoEError(f"moe.num_shared_experts={moe_cfg.num_shared_experts} but the parameters "
                       f"{'lack' if 'shared' not in params else 'have'} a 'shared' entry; {fix}.")
    for path, spec in params_lib.flatten(moe_params(x_BSD.shape[-1], moe_cfg)):
        weight = functools.reduce(lambda tree, name: tree[name], path, params)
        _expect("params" + "".join(f"[{name!r}]" for name in path), weight.shape, spec.shape, fix)
    if router_bias_E is not None:
        _expect("router_bias_E", router_bias_E.shape, (moe_cfg.num_experts,),
                "pass one bias per expert (zeros when the aux-loss-free bias is unused)")
    if router_common_D is not None:
        _expect("router_common_D", router_common_D.shape, (x_BSD.shape[-1],),
                "pass one running mean of the router's input per hidden unit (or None)")


def moe_stats(routing: Routing, executor_stats: ExecutorStats, batch_size: int, moe_cfg, x_TD: jax.Array) -> MoEStats:
    """The layer's MoEStats from its routing, its executor's accounting and the router's input x_TD."""
    num_tokens, top_k = routing.expert_ids_TK.shape
    seq_len = num_tokens // batch_size
    counts_E = balance.tokens_per_expert(routing.expert_ids_TK, moe_cfg.num_experts)
    aux = balance.aux_loss(routing.probs_TE, routing.expert_ids_TK)
    seq_aux = balance.seq_aux_loss(routing.probs_TE.reshape(batch_size, seq_len, -1),
                                   routing.expert_ids_TK.reshape(batch_size, seq_len, top_k))
    z = balance.z_loss(routing.logits_TE)
    total = moe_cfg.aux_loss_weight * aux + moe_cfg.seq_aux_loss_weight * seq_aux + moe_cfg.z_loss_weight * z
    return MoEStats(counts_E, balance.max_load_ratio(counts_E), executor_stats.tokens_dropped,
                    aux, seq_aux, z, total, executor_stats.dispatch_overflowed, executor_stats.rows_sent,
                    executor_stats.rows_sent_without_dedup, balance.routing_moments(routing.choice_TE),
                    balance.routing_moments(routing.logits_TE), jnp.asarray(num_tokens, jnp.int32),
                    balance.routing_gram(routing.logits_TE), balance.input_moments(x_TD))


def moe_layer(params: dict, router_bias_E: jax.Array | None, x_BSD: jax.Array, moe_cfg, *, compute_dtype,
              executor: ExpertExecutor | None = None, recipe: Recipe | None = None,
              router_common_D: jax.Array | None = None, training: bool = False,
              other_sequences: jax.Array | None = None) -> tuple[jax.Array, MoEStats]:
    """The routed (+ shared) expert layer: returns (y_BSD in compute_dtype, MoEStats).

    `router_common_D`: the running mean of the router's input (moe.router_common_rate); the router then sees its
    input without that direction, the experts see it whole. None = the router sees the input as it is. In
    `training` with moe.router_common_source="other_sequences" and more than one sequence, each sequence's
    direction is instead the mean over the batch's other sequences (`dropless.moe.router.other_sequences_mean`),
    or, where the traced boolean `other_sequences` is given and false (moe.router_common_other_steps), the running
    mean as evaluation uses it.

    `executor`: built once with the model (`dropless.ep.make_executor`: the grouped-GEMM backend, and the mesh
    under expert parallelism); None = the one-device `LocalExecutor.from_config(moe_cfg)`."""
    check_inputs(params, router_bias_E, x_BSD, moe_cfg, router_common_D)
    executor = LocalExecutor.from_config(moe_cfg, recipe) if executor is None else executor
    batch, seq, hidden = x_BSD.shape
    x_TD = x_BSD.reshape(batch * seq, hidden)
    with jax.named_scope("route"):
        kernel_DE, common_BD = params["router"]["kernel"], None
        if router_common_D is not None:
            if training and moe_cfg.router_common_source == "other_sequences" and batch > 1:
                common_BD = other_sequences_mean(x_BSD)
                if other_sequences is not None:
                    running_BD = jnp.broadcast_to(router_common_D.astype(jnp.float32), common_BD.shape)
                    common_BD = jnp.where(other_sequences, common_BD, running_BD)
            else:  # folded into the [D, E] kernel: cheaper than projecting the [T, D] input
                kernel_DE = fold_common(kernel_DE, jax.lax.stop_gradient(router_common_D))
        routing = route(kernel_DE, router_bias_E, x_TD, moe_cfg, mesh=executor.mesh, common_BD=common_BD)
    x_TD = x_TD.astype(compute_dtype)
    # Under FP8 the grouped GEMM quantizes the experts' weights as stored (GroupedMatmul.weights_as_stored), as the
    # dense FP8 matmuls do theirs; in bf16 they are cast here, before expert parallelism's shard_map, so that any
    # gathering of them moves bf16.
    experts = params["experts"] if recipe is not None else jax.tree.map(lambda w: w.astype(compute_dtype),
                                                                         params["experts"])
    y_TD, executor_stats = executor(x_TD, routing.expert_ids_TK, routing.weights_TK, experts)
    if "shared" in params:
        with jax.named_scope("shared"):
            y_TD = y_TD + dense_swiglu(x_TD, params["shared"], recipe, executor.mesh)
    stats = moe_stats(routing, executor_stats, batch, moe_cfg, x_BSD.reshape(batch * seq, hidden))
    return y_TD.astype(compute_dtype).reshape(batch, seq, hidden), stats
