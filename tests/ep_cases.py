"""Shared cases for the expert-parallel tests (tests/test_ep_*.py): the MoE layer on 8 CPU devices against the
single-device layer, in float32 with tight tolerances: the output and the gradients with respect to the input
and every parameter (router, experts, shared expert, through the balancing losses too), plus the accounting:
tokens_dropped, overflow, and rows sent with and without deduplication, counted again in Python.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dropless.core.config import MoEConfig, ParallelConfig
from dropless.core.mesh import make_mesh
from dropless.ep import AllGather, AllToAll, ExpertParallelExecutor, Ragged
from dropless.gmm import XlaGmm, make_gmm
from dropless.gmm.api import row_mask
from dropless.moe import LocalExecutor, init_moe, moe_layer, route

HIDDEN, WIDTH, EXPERTS = 8, 4, 8
# Tiny programs, many compilations: XLA:CPU's LLVM optimisation is most of the time and buys nothing here.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all`'s documented semantics built from all_gather (XLA:CPU lacks the primitive)."""
    del recv_sizes  # implied by the senders' sizes; `test_ragged_offsets_are_consistent` checks they agree
    # The real primitive's result has its output buffer's mesh-axis type: that buffer must vary like the rows.
    assert jax.typeof(output).mat.varying == jax.typeof(operand).mat.varying, "mark the output buffer varying"
    me = jax.lax.axis_index(axis_name)
    gather = lambda a: jax.lax.all_gather(a, axis_name, axis=0, tiled=False)
    operand_SN = gather(operand)
    start_S, size_S = gather(output_offsets)[:, me], gather(send_sizes)[:, me]
    source_start_S = gather(input_offsets)[:, me]
    pos_M = jnp.arange(output.shape[0])
    inside_SM = (pos_M[None] >= start_S[:, None]) & (pos_M[None] < (start_S + size_S)[:, None])
    source_M, hit_M = jnp.argmax(inside_SM, axis=0), jnp.any(inside_SM, axis=0)
    row_M = jnp.where(hit_M, source_start_S[source_M] + pos_M - start_S[source_M], 0)
    hit = hit_M.reshape(hit_M.shape + (1,) * (output.ndim - 1))
    return jnp.where(hit, operand_SN[source_M, row_M], output)


STRATEGIES = {
    "allgather": AllGather(),
    "alltoall": AllToAll(buffer_factor=2.0, dedup=True),
    "ragged": Ragged(dedup=True, collective=emulated_ragged_all_to_all),
}
MESHES = {1: ParallelConfig(data=4, fsdp=2, expert=1), 2: ParallelConfig(data=2, fsdp=2, expert=2),
          4: ParallelConfig(data=2, fsdp=1, expert=4), 8: ParallelConfig(data=1, fsdp=1, expert=8)}
BATCH, SEQ = 8, 8  # 64 tokens, 8 per device
MOE = MoEConfig(num_experts=EXPERTS, num_experts_per_tok=3, expert_intermediate_size=WIDTH, num_shared_experts=1,
                score_func="sigmoid", gmm_backend="xla", aux_loss_weight=0.1, z_loss_weight=0.01)
SKEWED_BIAS = [10.0, 10.0, 10.0, 0, 0, 0, 0, 0]  # every token to experts 0, 1 and 2


def executor(strategy, expert_parallel, local_buffer_factor=0.0, gmm=None):
    """The expert-parallel executor of `strategy` on the mesh with `expert_parallel` devices on `expert`."""
    gmm = make_gmm(MOE) if gmm is None else gmm
    return ExpertParallelExecutor(make_mesh(MESHES[expert_parallel]), strategy, gmm, local_buffer_factor)


def problem(seed, bias_E=None):
    rng = np.random.default_rng(seed)
    params = init_moe(jax.random.key(seed), HIDDEN, MOE, init_std=0.5)
    bias_E = np.zeros(EXPERTS, np.float32) if bias_E is None else np.asarray(bias_E, np.float32)
    x_BSD = rng.normal(size=(BATCH, SEQ, HIDDEN)).astype(np.float32)
    cotangent_BSD = rng.normal(size=x_BSD.shape).astype(np.float32)
    return params, bias_E, x_BSD, cotangent_BSD


@functools.partial(jax.jit, static_argnums=(0, 1), compiler_options=FAST_COMPILE)
def layer(executor, moe_cfg, params, bias_E, x_BSD, cotangent_BSD):
    """The MoE layer's output, its gradients w.r.t. every parameter and the input, and its stats."""
    def loss(params, x_BSD):
        y_BSD, stats = moe_layer(params, bias_E, x_BSD, moe_cfg, compute_dtype=jnp.float32, executor=executor)
        return jnp.sum(y_BSD * cotangent_BSD) + stats.balance_loss, (y_BSD, stats)
    (_, (y_BSD, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_BSD)
    return y_BSD, grads, stats


def expected_rows(problem, expert_parallel, dedup):
    """Rows that cross devices, counted in Python: per (token, device) with dedup, per (token, expert) without."""
    params, bias_E, x_BSD, _ = problem
    routing = route(params["router"]["kernel"], jnp.asarray(bias_E), x_BSD.reshape(-1, HIDDEN), MOE)
    ids_TK = np.asarray(routing.expert_ids_TK)
    per_device, num_local = BATCH * SEQ // 8, EXPERTS // expert_parallel
    sent = 0
    for t, ids in enumerate(ids_TK):
        me = (t // per_device) % expert_parallel  # the token's device's position on the `expert` axis
        remote = [int(e) // num_local for e in ids if int(e) // num_local != me]
        sent += len(set(remote)) if dedup else len(remote)
    return sent


def assert_matches_single_device(strategy, expert_parallel, problem, moe_cfg=MOE, local_buffer_factor=0.0, gmm=None):
    y_want, grads_want, stats_want = layer(None, moe_cfg, *problem)
    y_got, grads_got, stats = layer(executor(strategy, expert_parallel, local_buffer_factor, gmm), moe_cfg, *problem)
    np.testing.assert_allclose(y_got, y_want, rtol=1e-5, atol=1e-6)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads_got), jax.tree.leaves(grads_want)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert int(stats.tokens_dropped) == 0
    np.testing.assert_array_equal(stats.tokens_per_expert, stats_want.tokens_per_expert)
    return stats


def equations(jaxpr):
    """Every equation of a jaxpr, nested ones (shard_map, pjit, custom_vjp bodies) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def balanced_inputs(ids_TK=None):
    """(ids_TK, x_TD, weights_TK, experts): 64 tokens whose two experts are spread evenly over the 8 experts, so
    every device, slot and local buffer gets exactly the balanced load (or the given `ids_TK`)."""
    tokens = BATCH * SEQ
    rng = np.random.default_rng(0)
    if ids_TK is None:
        ids_TK = np.stack([np.arange(tokens) % 8, (np.arange(tokens) + 3) % 8], 1)
    ids_TK = jnp.asarray(ids_TK, jnp.int32)
    x_TD = jnp.asarray(rng.normal(size=(tokens, HIDDEN)), jnp.float32)
    weights_TK = jnp.asarray(rng.uniform(size=ids_TK.shape), jnp.float32)
    return ids_TK, x_TD, weights_TK, init_moe(jax.random.key(0), HIDDEN, MOE, init_std=0.5)["experts"]


def executor_loss(executor, ids_TK, x_TD, weights_TK, experts):
    y_TD, stats = executor(x_TD, ids_TK, weights_TK, experts)
    return jnp.sum(y_TD ** 2), (y_TD, stats)


@functools.partial(jax.jit, static_argnums=(0,), compiler_options=FAST_COMPILE)
def executor_grads(executor, ids_TK, x_TD, weights_TK, experts):
    loss = functools.partial(executor_loss, executor, ids_TK)
    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x_TD, weights_TK, experts)


@jax.custom_vjp
def _nan_grad_padding(lhs_MK, group_sizes_G):
    """lhs_MK, whose gradient's padding rows become NaN."""
    return lhs_MK


def _nan_grad_padding_fwd(lhs_MK, group_sizes_G):
    return lhs_MK, group_sizes_G


def _nan_grad_padding_bwd(group_sizes_G, g_MK):
    return (jnp.where(row_mask(g_MK.shape[0], group_sizes_G)[:, None], g_MK, jnp.nan),
            np.zeros(group_sizes_G.shape, jax.dtypes.float0))


_nan_grad_padding.defvjp(_nan_grad_padding_fwd, _nan_grad_padding_bwd)


@dataclasses.dataclass(frozen=True)
class NanPaddingGmm(XlaGmm):
    """XlaGmm whose output padding rows, and its input gradient's, hold NaN wherever the caller lets them be
    anything (zero_padding=False, zero_lhs_grad_padding=False), as the GPU kernels leave them unwritten."""

    def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None, zero_padding=True,
                 zero_lhs_grad_padding=True):
        if not zero_lhs_grad_padding:
            lhs_MK = _nan_grad_padding(lhs_MK, group_sizes_G)
        out_MN = super().__call__(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=preferred_element_type)
        return out_MN if zero_padding else jnp.where(row_mask(lhs_MK.shape[0], group_sizes_G)[:, None], out_MN,
                                                     jnp.nan)


class AlignedNanPaddingGmm(NanPaddingGmm):
    """NanPaddingGmm asking for expert-aligned rows (`row_align`, dropless.gmm.api), as the FP8 backend does: the
    permutation leaves zero rows inside each group and NaN reaches only the rows past the groups. Group sizes off
    the alignment (a caller that ignored it) make the whole output NaN."""

    row_align = 8

    def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None, zero_padding=True,
                 zero_lhs_grad_padding=True):
        out_MN = super().__call__(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=preferred_element_type,
                                  zero_padding=zero_padding, zero_lhs_grad_padding=zero_lhs_grad_padding)
        return jnp.where(jnp.all(group_sizes_G % self.row_align == 0), out_MN, jnp.nan)


def assert_executor_matches_local(executor, *inputs):
    """The executor's output and its gradients w.r.t. x, weights and experts equal LocalExecutor's; its stats."""
    (_, (y_want, _)), grads_want = executor_grads(LocalExecutor(XlaGmm()), *inputs)
    (_, (y_got, stats)), grads_got = executor_grads(executor, *inputs)
    np.testing.assert_allclose(y_got, y_want, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(grads_got), jax.tree.leaves(grads_want)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return stats
