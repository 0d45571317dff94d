"""Expert parallelism on 8 CPU devices: the MoE layer under every strategy and mesh equals the single-device layer.

Checked in float32 with tight tolerances: the output and the gradients with respect to the input and every
parameter (router, experts, shared expert, through the balancing losses too), plus the accounting:
tokens_dropped, alltoall overflow, and rows sent with and without deduplication, counted again in Python.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core.config import Config, ConfigError, MoEConfig, ParallelConfig
from dropless.gmm import XlaGmm
from dropless.moe import LocalExecutor, init_moe, moe_layer, route
from dropless.gmm.api import row_mask
from dropless.core.varying import varying_like
from dropless.ep import dispatch
from dropless.ep.dispatch import AllGather, AllToAll, Auto, NoDispatch, Ragged, ragged_offsets
from dropless.core.mesh import make_mesh

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


def _problem(seed, bias_E=None):
    rng = np.random.default_rng(seed)
    params = init_moe(jax.random.key(seed), HIDDEN, MOE, init_std=0.5)
    bias_E = np.zeros(EXPERTS, np.float32) if bias_E is None else np.asarray(bias_E, np.float32)
    x_BSD = rng.normal(size=(BATCH, SEQ, HIDDEN)).astype(np.float32)
    cotangent_BSD = rng.normal(size=x_BSD.shape).astype(np.float32)
    return params, bias_E, x_BSD, cotangent_BSD


@functools.partial(jax.jit, static_argnums=(0, 1), compiler_options=FAST_COMPILE)
def _layer(executor, moe_cfg, params, bias_E, x_BSD, cotangent_BSD):
    """The MoE layer's output, its gradients w.r.t. every parameter and the input, and its stats."""
    def loss(params, x_BSD):
        y_BSD, stats = moe_layer(params, bias_E, x_BSD, moe_cfg, compute_dtype=jnp.float32, executor=executor)
        return jnp.sum(y_BSD * cotangent_BSD) + stats.balance_loss, (y_BSD, stats)
    (_, (y_BSD, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_BSD)
    return y_BSD, grads, stats


def _expected_rows(problem, expert_parallel, dedup):
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


def _assert_matches_single_device(strategy, expert_parallel, problem, moe_cfg=MOE, local_buffer_factor=0.0):
    y_want, grads_want, stats_want = _layer(None, moe_cfg, *problem)
    executor = dispatch.ExpertParallelExecutor(make_mesh(MESHES[expert_parallel]), strategy, local_buffer_factor)
    y_got, grads_got, stats = _layer(executor, moe_cfg, *problem)
    np.testing.assert_allclose(y_got, y_want, rtol=1e-5, atol=1e-6)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads_got), jax.tree.leaves(grads_want)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert int(stats.tokens_dropped) == 0
    np.testing.assert_array_equal(stats.tokens_per_expert, stats_want.tokens_per_expert)
    return stats


@pytest.mark.parametrize("expert_parallel", sorted(MESHES))
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_layer_matches_single_device(name, expert_parallel):
    problem = _problem(seed=expert_parallel)
    stats = _assert_matches_single_device(STRATEGIES[name], expert_parallel, problem)
    assert int(stats.rows_sent_without_dedup) == _expected_rows(problem, expert_parallel, dedup=False)
    if name == "allgather":  # every token to every other device of its group
        assert int(stats.rows_sent) == BATCH * SEQ * (expert_parallel - 1)
    else:
        assert int(stats.rows_sent) == _expected_rows(problem, expert_parallel, dedup=True)


@pytest.mark.parametrize("expert_parallel", [2, 8])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_bounded_local_buffers_equal_single_device_whichever_branch_each_device_takes(name, expert_parallel):
    """Local buffers of exactly the balanced load: random routing overflows some devices and not others (each
    decides alone), heavy skew overflows some; either way the result is the single-device one."""
    for problem in (_problem(seed=expert_parallel), _problem(seed=9, bias_E=[10.0, 10.0, 10.0, 0, 0, 0, 0, 0])):
        stats = _assert_matches_single_device(STRATEGIES[name], expert_parallel, problem, local_buffer_factor=1.0)
        assert int(stats.dispatch_overflowed) == 1  # reported: some device's pairs did not fit


def test_bounded_local_buffer_that_fits_is_taken_and_keeps_only_its_rows():
    """Balanced routing fits a buffer of 1.0 x the balanced load: no overflow, same result; and the forward keeps
    residuals of the bounded buffer's size only (the worst-case branch is rematerialised, not stored)."""
    inputs = _balanced_inputs()
    executor = dispatch.ExpertParallelExecutor(make_mesh(MESHES[2]), AllGather(), local_buffer_factor=1.0)
    stats = _assert_executor_matches_local(executor, *inputs)
    assert int(stats.dispatch_overflowed) == 0
    # Per device (8 tokens; 2 on the expert axis): R = 16 gathered tokens x J = 2 columns = 32 worst-case rows;
    # the bounded buffer holds T*K = 16.
    ids_TK, *differentiated = inputs
    loss = functools.partial(_executor_loss, executor, ids_TK)
    jaxpr = jax.make_jaxpr(lambda *args: jax.vjp(loss, *args))(*differentiated)
    conds = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "cond"]
    assert conds, "the bounded buffer's overflow branch is a lax.cond"
    residual_rows = {v.aval.shape[0] for e in conds for v in e.outvars if getattr(v.aval, "ndim", 0) == 2}
    assert 16 in residual_rows and 32 not in residual_rows


def _equations(jaxpr):
    """Every equation of a jaxpr, nested ones (shard_map, pjit, custom_vjp bodies) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_alltoall_slot_sizes_and_the_auto_choice():
    # dedup: the balanced load is T * P(a token has an expert on a given device) = 8 * (1 - C(7,3)/C(8,3)) = 3
    assert AllToAll(2.0, dedup=True).slot_sizes(num_tokens=8, top_k=3, num_devices=8, num_local=1) == (6, 8)
    assert AllToAll(2.0, dedup=True).slot_sizes(num_tokens=8, top_k=3, num_devices=2, num_local=4) == (8, 8)
    assert AllToAll(1.0, dedup=False).slot_sizes(num_tokens=8, top_k=3, num_devices=4, num_local=2) == (6, 16)
    # DeepSeek-V3 proxy (32 experts, top-8): on 2 devices the slots would hold every token, on 8 they need not.
    assert Auto(2.0).choose(num_tokens=4096, top_k=8, num_devices=2, num_local=16) == AllGather()
    assert Auto(1.25).choose(num_tokens=4096, top_k=8, num_devices=8, num_local=4) == AllToAll(1.25)


def test_meshes_without_expert_parallelism_compute_locally():
    """parallel.expert=1 (data and fsdp only): make_executor's NoDispatch, each device its own tokens."""
    config = Config(moe=MOE, parallel=MESHES[1])
    executor = dispatch.make_executor(config, make_mesh(config.parallel))
    assert executor.strategy == NoDispatch()
    stats = _assert_matches_single_device(executor.strategy, 1, _problem(seed=1))
    assert int(stats.rows_sent) == 0 == int(stats.rows_sent_without_dedup)


@pytest.mark.parametrize("name", ["alltoall", "ragged"])
def test_dedup_sends_fewer_rows_and_changes_nothing(name):
    problem = _problem(seed=4)
    undeduplicated = dataclasses.replace(STRATEGIES[name], dedup=False)
    without = _assert_matches_single_device(undeduplicated, 4, problem)
    with_dedup = _assert_matches_single_device(STRATEGIES[name], 4, problem)  # compiled above, for this problem
    assert int(with_dedup.rows_sent) < int(without.rows_sent) == int(without.rows_sent_without_dedup)
    assert int(with_dedup.rows_sent_without_dedup) == int(without.rows_sent)


@pytest.mark.parametrize("expert_parallel,dedup", [(4, True), (8, False)])
def test_alltoall_overflow_takes_the_worst_case_path_and_drops_nothing(expert_parallel, dedup):
    # The bias sends every token to experts 0, 1 and 2: the devices holding them receive far more than
    # buffer_factor x the balanced load.
    skewed = _problem(seed=7, bias_E=[10.0, 10.0, 10.0, 0, 0, 0, 0, 0])
    strategy = AllToAll(buffer_factor=1.0, dedup=dedup)
    assert int(_assert_matches_single_device(strategy, expert_parallel, skewed).dispatch_overflowed) == 1


def _balanced_inputs(ids_TK=None):
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


def _executor_loss(executor, ids_TK, x_TD, weights_TK, experts, gmm=XlaGmm()):
    y_TD, stats = executor(x_TD, ids_TK, weights_TK, experts, gmm)
    return jnp.sum(y_TD ** 2), (y_TD, stats)


@functools.partial(jax.jit, static_argnums=(0, 1), compiler_options=FAST_COMPILE)
def _executor_grads(executor, gmm, ids_TK, x_TD, weights_TK, experts):
    loss = functools.partial(_executor_loss, executor, ids_TK, gmm=gmm)
    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x_TD, weights_TK, experts)


@dataclasses.dataclass(frozen=True)
class NanPaddingGmm(XlaGmm):
    """XlaGmm whose output padding rows hold NaN wherever the caller lets them be anything (zero_padding=False),
    as the GPU kernels leave them unwritten."""

    def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None, zero_padding=True):
        out_MN = super().__call__(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=preferred_element_type)
        return out_MN if zero_padding else jnp.where(row_mask(lhs_MK.shape[0], group_sizes_G)[:, None], out_MN,
                                                     jnp.nan)


def _assert_executor_matches_local(executor, *inputs, gmm=XlaGmm()):
    """The executor's output and its gradients w.r.t. x, weights and experts equal LocalExecutor's; its stats."""
    (_, (y_want, _)), grads_want = _executor_grads(LocalExecutor(), XlaGmm(), *inputs)
    (_, (y_got, stats)), grads_got = _executor_grads(executor, gmm, *inputs)
    np.testing.assert_allclose(y_got, y_want, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(grads_got), jax.tree.leaves(grads_want)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return stats


@pytest.mark.parametrize("local_buffer_factor", [0.0, 1.25])
@pytest.mark.parametrize("name", ["allgather", "alltoall"])
def test_padding_rows_of_the_grouped_gemms_never_reach_the_result(name, local_buffer_factor):
    """The experts' GEMMs may leave their padding rows unwritten (NaN here): the worst-case and the bounded local
    buffers both have such rows, and the output and every gradient still equal the single-device ones."""
    rng = np.random.default_rng(3)
    ids_TK = np.stack([rng.choice(EXPERTS, 2, replace=False) for _ in range(BATCH * SEQ)])
    executor = dispatch.ExpertParallelExecutor(make_mesh(MESHES[2]), STRATEGIES[name], local_buffer_factor)
    _assert_executor_matches_local(executor, *_balanced_inputs(ids_TK), gmm=NanPaddingGmm())


def test_alltoall_routing_that_fits_takes_the_slots():
    """Perfectly balanced routing at buffer factor 1 fills every slot exactly: no overflow, same result."""
    inputs = _balanced_inputs()
    ids_TK = inputs[0]
    executor = dispatch.ExpertParallelExecutor(make_mesh(MESHES[8]), AllToAll(buffer_factor=1.0))
    stats = _assert_executor_matches_local(executor, *inputs)
    assert int(stats.dispatch_overflowed) == 0 and int(stats.rows_sent) == ids_TK.size * 7 // 8


def test_emulated_ragged_all_to_all_follows_jax_documentation():
    """The example in jax.lax.ragged_all_to_all's docstring, through the emulation used above."""
    mesh = jax.make_mesh((2,), ("expert",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    operand = np.array([1, 2, 2, 3, 4, 0], np.float32)
    args = [np.array(a, np.int32) for a in ([0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1])]

    def per_device(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
        output = varying_like(jnp.zeros(4, jnp.float32), operand)
        return emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                          axis_name="expert")

    spec = jax.sharding.PartitionSpec("expert")
    out = jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)(operand, *args)
    np.testing.assert_array_equal(out, [1, 3, 0, 0, 2, 2, 4, 0])


def test_ragged_offsets_are_consistent():
    """Senders' output offsets tile each receiver's buffer source by source; the return trip inverts it."""
    rng = np.random.default_rng(0)
    sends_SP = rng.integers(0, 5, size=(4, 4)).astype(np.int32)
    plans = [jax.tree.map(np.asarray, ragged_offsets(jnp.asarray(sends_SP), me)) for me in range(4)]
    for receiver in range(4):
        recv = plans[receiver]
        for source in range(4):
            assert plans[source]["output_offsets"][receiver] == recv["recv_offsets"][source]
            assert plans[source]["send_sizes"][receiver] == recv["recv_sizes"][source]
            # the combine writes back where the sender's rows for this receiver started
            assert recv["back_offsets"][source] == plans[source]["input_offsets"][receiver]
        assert recv["recv_offsets"][-1] + recv["recv_sizes"][-1] == sends_SP[:, receiver].sum()


def test_make_executor_choices():
    tiny = Config(moe=MoEConfig(num_experts=8), parallel=ParallelConfig(expert=4))
    mesh = make_mesh(tiny.parallel)
    assert dispatch.make_executor(tiny, mesh).strategy == Auto(2.0, True)
    assert dispatch.make_strategy(tiny.replace(**{"moe.dispatch": "allgather"})) == AllGather()
    assert dispatch.make_strategy(tiny.replace(**{"moe.dispatch": "ragged"}), platform="gpu") == Ragged(True)
    assert dispatch.make_strategy(tiny.replace(**{"parallel.expert": 1})) == NoDispatch()
    assert dispatch.make_executor(tiny, make_mesh(ParallelConfig(), devices=jax.devices()[:1])) is None
    with pytest.raises(ConfigError, match="moe.dispatch=ragged needs GPUs"):
        dispatch.make_strategy(tiny.replace(**{"moe.dispatch": "ragged"}), platform="cpu")


@pytest.mark.parametrize("name,expert_parallel", [("allgather", 2), ("alltoall", 4)])
def test_chunked_dispatch_matches_single_device_and_adds_up_the_accounting(name, expert_parallel):
    """moe.dispatch_chunks: each device's 8 tokens in 2 chunks; same output and gradients, the same rows sent as one
    exchange (dedup is per token, so chunks change nothing), and an overflow in a chunk is reported."""
    problem = _problem(seed=11)
    whole = _assert_matches_single_device(STRATEGIES[name], expert_parallel, problem)
    chunked = _assert_matches_single_device(dispatch.Chunked(STRATEGIES[name], 2), expert_parallel, problem)
    assert int(chunked.rows_sent) == int(whole.rows_sent)
    assert int(chunked.rows_sent_without_dedup) == int(whole.rows_sent_without_dedup)
    skewed = _problem(seed=7, bias_E=[10.0, 10.0, 10.0, 0, 0, 0, 0, 0])
    strategy = dispatch.Chunked(AllToAll(buffer_factor=1.0), 2)
    assert int(_assert_matches_single_device(strategy, 4, skewed).dispatch_overflowed) == 1


def test_chunked_dispatch_config_and_errors():
    tiny = Config(moe=MoEConfig(num_experts=8, dispatch_chunks=2), parallel=ParallelConfig(expert=4))
    assert dispatch.make_strategy(tiny) == dispatch.Chunked(Auto(2.0, True), 2)
    assert dispatch.make_strategy(tiny.replace(**{"parallel.expert": 1})) == NoDispatch()
    with pytest.raises(ConfigError, match="moe.dispatch_chunks"):
        MoEConfig(dispatch_chunks=0)
    problem = _problem(seed=1)
    with pytest.raises(ConfigError, match="moe.dispatch_chunks=3 does not divide the 8 tokens"):
        _assert_matches_single_device(dispatch.Chunked(AllGather(), 3), 2, problem)


@pytest.mark.parametrize("which", ["to_slots", "from_slots"])
def test_slot_packing_backward_is_a_gather_that_equals_the_scatter_add(which):
    """alltoall's slot packing and unpacking differentiate as the inverse pick (a gather; JAX's own transpose of a
    gather is a scatter-add, 16 ms of a two-H200 layer's backward), with the same gradient as that scatter-add."""
    rng = np.random.default_rng(0)
    sends_P, capacity, num_units, hidden = jnp.asarray([3, 0, 5, 2], jnp.int32), 6, 12, 5  # 10 of 12 units sent
    slots = dispatch.slot_map(sends_P, capacity, num_units)
    if which == "to_slots":
        args = (jnp.asarray(rng.normal(size=(num_units, hidden)), jnp.float32),)
        fast = lambda rows: dispatch._to_slots(rows, slots, 0.0)
        plain = lambda rows: dispatch._pick(rows, slots.source_S, slots.filled_S).reshape(4, capacity, hidden)
    else:
        args = (jnp.asarray(rng.normal(size=(4, capacity, hidden)), jnp.float32),)
        fast = lambda packed: dispatch._from_slots(packed, slots)
        plain = lambda packed: dispatch._pick(packed.reshape(-1, hidden), slots.slot_U, slots.sent_U)
    out, vjp = jax.vjp(fast, *args)
    want_out, want_vjp = jax.vjp(plain, *args)
    cotangent = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(vjp(cotangent)[0], want_vjp(cotangent)[0])
    primitives = {e.primitive.name for e in _equations(jax.make_jaxpr(vjp)(cotangent).jaxpr)}
    assert "scatter-add" not in primitives and "gather" in primitives
    assert "scatter-add" in {e.primitive.name for e in _equations(jax.make_jaxpr(want_vjp)(cotangent).jaxpr)}
