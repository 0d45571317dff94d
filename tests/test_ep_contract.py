"""The shared skeleton (dispatch -> LocalExperts -> combine): bounded local expert buffers, the padding rows of
the grouped GEMMs, and the profile scopes every strategy's exchange carries."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ep import AllGather, Auto, Chunked
from dropless.ep.contract import LocalExperts
from dropless.moe import moe_layer
from tests.ep_cases import (
    BATCH, EXPERTS, MOE, SEQ, SKEWED_BIAS, STRATEGIES, AlignedNanPaddingGmm, NanPaddingGmm,
    assert_executor_matches_local,
    assert_matches_single_device, balanced_inputs, equations, executor, executor_loss, problem)


@pytest.mark.parametrize("expert_parallel", [2, 8])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_bounded_local_buffers_equal_single_device_whichever_branch_each_device_takes(name, expert_parallel):
    """Local buffers of exactly the balanced load: random routing overflows some devices and not others (each
    decides alone), heavy skew overflows some; either way the result is the single-device one."""
    for case in (problem(seed=expert_parallel), problem(seed=9, bias_E=SKEWED_BIAS)):
        stats = assert_matches_single_device(STRATEGIES[name], expert_parallel, case, local_buffer_factor=1.0)
        assert int(stats.dispatch_overflowed) == 1  # reported: some device's pairs did not fit


def test_bounded_local_buffer_holds_at_least_its_factor_of_the_balanced_load():
    """buffer_factor x the balanced pairs, rounded UP to whole TMA row tiles (8), never past the worst case: a
    buffer rounded down would overflow on balanced routing."""
    buffer_rows = lambda factor, pairs, worst: LocalExperts({}, None, factor).buffer_rows(pairs, worst)
    assert buffer_rows(1.0, 12, 64) == 16 and buffer_rows(1.0, 16, 64) == 16 and buffer_rows(1.25, 16, 64) == 24
    assert buffer_rows(2.0, 40, 64) == 64 and buffer_rows(0.0, 12, 64) == 64


def test_bounded_local_buffer_that_fits_is_taken_and_keeps_only_its_rows():
    """Balanced routing fits a buffer of 1.0 x the balanced load: no overflow, same result; and the forward keeps
    residuals of the bounded buffer's size only (the worst-case branch is rematerialised, not stored)."""
    inputs = balanced_inputs()
    bounded = executor(AllGather(), 2, local_buffer_factor=1.0)
    stats = assert_executor_matches_local(bounded, *inputs)
    assert int(stats.dispatch_overflowed) == 0
    # Per device (8 tokens; 2 on the expert axis): R = 16 gathered tokens x J = 2 columns = 32 worst-case rows;
    # the bounded buffer holds T*K = 16.
    ids_TK, *differentiated = inputs
    loss = functools.partial(executor_loss, bounded, ids_TK)
    jaxpr = jax.make_jaxpr(lambda *args: jax.vjp(loss, *args))(*differentiated)
    conds = [e for e in equations(jaxpr.jaxpr) if e.primitive.name == "cond"]
    assert conds, "the bounded buffer's overflow branch is a lax.cond"
    residual_rows = {v.aval.shape[0] for e in conds for v in e.outvars if getattr(v.aval, "ndim", 0) == 2}
    assert 16 in residual_rows and 32 not in residual_rows


COLLECTIVES = {"psum", "psum_invariant", "pmax", "pmin", "ppermute", "all_gather", "all_gather_invariant",
               "all_to_all", "ragged_all_to_all", "reduce_scatter", "psum_scatter"}


def _conds(jaxpr):
    """(cond, whether every device computes the same predicate) for every lax.cond: the same where the predicate's
    type varies over no mesh axis, as alltoall's overflow decision, a pmax over the whole mesh, does not."""
    for eqn in equations(jaxpr):
        if eqn.primitive.name == "cond":
            yield eqn, not eqn.invars[0].aval.mat.varying


@pytest.mark.parametrize("expert_parallel", [2, 8])
@pytest.mark.parametrize("strategy", [*STRATEGIES.values(), Chunked(AllGather(), 2)], ids=[*STRATEGIES, "chunked"])
def test_no_collective_runs_inside_a_branch_each_device_picks_alone(strategy, expert_parallel):
    """Each device picks the bounded or the worst-case local buffer alone, so a collective inside either branch
    (forward or backward) would wait for devices that run the other branch's (XLA requires every participant to
    run the same one). The experts, the same on every device of data and fsdp, meet the rows there: their
    gradient's all-reduce must run outside that cond. alltoall's overflow cond holds its exchanges, legitimately:
    its predicate is reduced over the whole mesh first."""
    params, bias_E, x_BSD, cotangent_BSD = problem(seed=0)
    bounded = executor(strategy, expert_parallel, local_buffer_factor=1.0)

    def loss(p, x):
        y_BSD, stats = moe_layer(p, bias_E, x, MOE, compute_dtype=jnp.float32, executor=bounded)
        return jnp.sum(y_BSD * cotangent_BSD) + stats.balance_loss

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(params, x_BSD).jaxpr
    conds = list(_conds(jaxpr))
    inside = {uniform: [(str(c.source_info.name_stack), c.primitive.name) for eqn, same in conds if same == uniform
                        for branch in eqn.params["branches"] for c in equations(branch.jaxpr)
                        if c.primitive.name in COLLECTIVES] for uniform in (False, True)}
    assert any(not same for _, same in conds), "the bounded buffer's overflow branch is a per-device lax.cond"
    assert not inside[False]
    if strategy is STRATEGIES["alltoall"] and expert_parallel == 8:  # slots below the worst case: a second exchange
        assert {name for _, name in inside[True]} >= {"all_to_all"}
    if expert_parallel == 2:  # data 2 x fsdp 2 x expert 2: the experts' gradient is summed over data and fsdp
        reduced = {tuple(sorted(e.params["axes"])) for e in equations(jaxpr)
                   if e.primitive.name in ("psum", "psum_invariant")}
        assert ("data", "fsdp") in reduced


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_unfilled_received_rows_name_no_expert_so_a_balanced_local_buffer_fits(name):
    """alltoall's slots (2 x the balanced load) and ragged's worst-case receive buffers are mostly unfilled: those
    rows carry no expert (id G), so they are no pairs. Balanced routing on 8 devices then fits a local buffer of
    1.0 x the balanced load on every device: no overflow, the single-device result."""
    bounded = executor(STRATEGIES[name], 8, local_buffer_factor=1.0)
    stats = assert_executor_matches_local(bounded, *balanced_inputs())
    assert int(stats.dispatch_overflowed) == 0


@pytest.mark.parametrize("local_buffer_factor", [0.0, 1.25])
@pytest.mark.parametrize("name", ["allgather", "alltoall"])
def test_padding_rows_of_the_grouped_gemms_never_reach_the_result(name, local_buffer_factor):
    """The experts' GEMMs may leave their padding rows unwritten (NaN here), and the gate+up projection its input
    gradient's: the worst-case and the bounded local buffers both have such rows, and the output and every
    gradient still equal the single-device ones."""
    rng = np.random.default_rng(3)
    ids_TK = np.stack([rng.choice(EXPERTS, 2, replace=False) for _ in range(BATCH * SEQ)])
    nan_padding = executor(STRATEGIES[name], 2, local_buffer_factor, gmm=NanPaddingGmm())
    assert_executor_matches_local(nan_padding, *balanced_inputs(ids_TK))


@pytest.mark.parametrize("local_buffer_factor", [0.0, 1.0])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_expert_aligned_local_rows_equal_single_device(name, local_buffer_factor):
    """A grouped GEMM that asks for expert-aligned rows (the FP8 one's layout, here at 8 rows in float32) gets them
    in every strategy's local stage, worst-case and bounded buffers alike: the single-device result, exactly."""
    for case in (problem(seed=4), problem(seed=9, bias_E=SKEWED_BIAS)):
        assert_matches_single_device(STRATEGIES[name], 2, case, local_buffer_factor=local_buffer_factor,
                                     gmm=AlignedNanPaddingGmm())


@pytest.mark.parametrize("strategy", [*STRATEGIES.values(), Auto(), Chunked(AllGather(), 2)],
                         ids=[*STRATEGIES, "auto", "chunked"])
def test_every_exchange_runs_in_the_dispatch_and_combine_scopes(strategy):
    """The skeleton is shared: every collective that moves rows lies in the profile scope "dispatch" or "combine"
    (the others: the stats' all-reduce, alltoall's overflow decision)."""
    params, bias_E, x_BSD, _ = problem(seed=0)
    expert_parallel = executor(strategy, 2)
    jaxpr = jax.make_jaxpr(lambda p, x: moe_layer(p, bias_E, x, MOE, compute_dtype=jnp.float32,
                                                  executor=expert_parallel))(params, x_BSD)
    scopes = {str(e.source_info.name_stack).split("/")[-1] for e in equations(jaxpr.jaxpr)
              if e.primitive.name in ("all_gather", "all_to_all", "reduce_scatter", "ragged_all_to_all")}
    assert scopes == {"dispatch", "combine"}
