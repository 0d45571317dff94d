"""alltoall: slot sizes, the overflow branch that takes the worst-case exchange, and the slot packing's backward;
auto's choice between alltoall and allgather."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ep import AllGather, AllToAll, Auto
from dropless.ep import alltoall
from tests.ep_cases import (EXPERTS, HIDDEN, SKEWED_BIAS, assert_executor_matches_local, assert_matches_single_device,
                            balanced_inputs, equations, executor, problem)


def test_alltoall_slot_sizes_and_the_auto_choice():
    # dedup: the balanced load is T * P(a token has an expert on a given device) = 8 * (1 - C(7,3)/C(8,3)) = 3
    assert AllToAll(2.0, dedup=True).slot_sizes(num_tokens=8, top_k=3, num_devices=8, num_local=1) == (6, 8)
    assert AllToAll(2.0, dedup=True).slot_sizes(num_tokens=8, top_k=3, num_devices=2, num_local=4) == (8, 8)
    assert AllToAll(1.0, dedup=False).slot_sizes(num_tokens=8, top_k=3, num_devices=4, num_local=2) == (6, 16)
    # DeepSeek-V3 proxy (32 experts, top-8): on 2 devices the slots would hold every token, on 8 they need not.
    assert Auto(2.0).resolve(num_tokens=4096, top_k=8, num_devices=2, num_local=16) == AllGather()
    assert Auto(1.25).resolve(num_tokens=4096, top_k=8, num_devices=8, num_local=4) == AllToAll(1.25)
    assert AllToAll(1.25).resolve(num_tokens=4096, top_k=8, num_devices=8, num_local=4) == AllToAll(1.25)


def test_alltoall_slots_round_a_fractional_balanced_load_up():
    """Slots hold buffer_factor x the balanced load rounded UP: rounded down, uniform routing at buffer factor 1
    would overflow into the worst-case exchange for the fraction of a row."""
    # dedup: 8 tokens, top-2 of 8 experts, 2 per device: 8 * (1 - C(6,2)/C(8,2)) = 26/7 = 3.71 rows per destination
    assert AllToAll(1.0, dedup=True).slot_sizes(num_tokens=8, top_k=2, num_devices=4, num_local=2) == (4, 8)
    # without dedup: 8 tokens x top-3 over 5 devices = 4.8 rows per destination
    assert AllToAll(1.0, dedup=False).slot_sizes(num_tokens=8, top_k=3, num_devices=5, num_local=1) == (5, 8)


@pytest.mark.parametrize("expert_parallel,dedup", [(4, True), (8, False), (2, False)])
def test_alltoall_overflow_takes_the_worst_case_path_and_drops_nothing(expert_parallel, dedup):
    # The bias sends every token to experts 0, 1 and 2: the devices holding them receive far more than
    # buffer_factor x the balanced load; on 2 devices without dedup each token sends all 3 rows to device 0, the
    # worst case the fallback exchange must hold.
    skewed = problem(seed=7, bias_E=SKEWED_BIAS)
    strategy = AllToAll(buffer_factor=1.0, dedup=dedup)
    assert int(assert_matches_single_device(strategy, expert_parallel, skewed).dispatch_overflowed) == 1


def test_alltoall_routing_that_fits_takes_the_slots():
    """Perfectly balanced routing at buffer factor 1 fills every slot exactly: no overflow, same result."""
    inputs = balanced_inputs()
    ids_TK = inputs[0]
    stats = assert_executor_matches_local(executor(AllToAll(buffer_factor=1.0), 8), *inputs)
    assert int(stats.dispatch_overflowed) == 0 and int(stats.rows_sent) == ids_TK.size * 7 // 8


def test_alltoall_one_row_past_the_slots_overflows():
    """Balanced routing fills every slot exactly (2 per destination at buffer factor 1); moving one token's expert
    to another device makes that destination's rows one more than its slots: the worst-case exchange runs and
    nothing is dropped, as it must at any excess however small."""
    ids_TK = np.asarray(balanced_inputs()[0]).copy()
    ids_TK[0, 0] = 1  # token 0 (device 0): experts 1 and 3, so device 0 sends 3 rows to device 1 and 1 to itself
    inputs = balanced_inputs(ids_TK)
    stats = assert_executor_matches_local(executor(AllToAll(buffer_factor=1.0), 8), *inputs)
    assert int(stats.dispatch_overflowed) == 1


@pytest.mark.parametrize("which", ["to_slots", "from_slots"])
def test_slot_packing_backward_is_a_gather_that_equals_the_scatter_add(which):
    """alltoall's slot packing and unpacking differentiate as the inverse pick (a gather; JAX's own transpose of a
    gather is a scatter-add, far slower on a GPU), with the same gradient as that scatter-add."""
    rng = np.random.default_rng(0)
    sends_P, capacity, num_units, hidden = jnp.asarray([3, 0, 5, 2], jnp.int32), 6, 12, 5  # 10 of 12 units sent
    slots = alltoall.slot_map(sends_P, capacity, num_units)
    if which == "to_slots":
        args = (jnp.asarray(rng.normal(size=(num_units, hidden)), jnp.float32),)
        fast = lambda rows: alltoall.to_slots(rows, slots, 0.0)
        plain = lambda rows: alltoall.pick(rows, slots.source_S, slots.filled_S).reshape(4, capacity, hidden)
    else:
        args = (jnp.asarray(rng.normal(size=(4, capacity, hidden)), jnp.float32),)
        fast = lambda packed: alltoall.from_slots(packed, slots)
        plain = lambda packed: alltoall.pick(packed.reshape(-1, hidden), slots.slot_U, slots.sent_U)
    out, vjp = jax.vjp(fast, *args)
    want_out, want_vjp = jax.vjp(plain, *args)
    cotangent = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(vjp(cotangent)[0], want_vjp(cotangent)[0])
    primitives = {e.primitive.name for e in equations(jax.make_jaxpr(vjp)(cotangent).jaxpr)}
    assert "scatter-add" not in primitives and "gather" in primitives
    assert "scatter-add" in {e.primitive.name for e in equations(jax.make_jaxpr(want_vjp)(cotangent).jaxpr)}


def test_alltoall_whose_slots_fit_the_local_buffer_and_whose_worst_case_does_not():
    """Top-1 over 8 devices, 32 tokens each, slots at buffer factor 1: the slots' rows (32) fit the bounded local
    buffer (128 rows) and the worst-case exchange's (256) do not, so only the worst-case branch checks the local
    buffer's overflow on the device. Both branches of the slots' cond must give it the same mesh-axis type (it
    failed to trace); the result equals one device's and nothing overflows (balanced routing)."""
    tokens = 256
    rng = np.random.default_rng(0)
    ids_TK = jnp.asarray(rng.permutation(tokens)[:, None] % EXPERTS, jnp.int32)
    x_TD = jnp.asarray(rng.normal(size=(tokens, HIDDEN)), jnp.float32)
    weights_TK = jnp.asarray(rng.uniform(size=ids_TK.shape), jnp.float32)
    experts = balanced_inputs()[3]
    stats = assert_executor_matches_local(executor(AllToAll(buffer_factor=1.0), 8, local_buffer_factor=1.25),
                                          ids_TK, x_TD, weights_TK, experts)
    assert int(stats.tokens_dropped) == 0
