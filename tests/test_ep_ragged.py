"""ragged: the offsets of both ragged_all_to_all calls, and the emulation the CPU tests run it with."""

import jax
import jax.numpy as jnp
import numpy as np

from dropless.core.varying import varying_like
from dropless.ep.ragged import ragged_offsets
from tests.ep_cases import emulated_ragged_all_to_all


def test_emulated_ragged_all_to_all_follows_jax_documentation():
    """The example in jax.lax.ragged_all_to_all's docstring, through the emulation the tests use."""
    mesh = jax.make_mesh((2,), ("expert",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    operand = np.array([1, 2, 2, 3, 4, 0], np.float32)
    args = [np.array(a, np.int32) for a in ([0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1])]

    def per_device(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
        output = varying_like(jnp.zeros(4, jnp.float32), operand)
        return emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                          axis_name="expert")

    spec = jax.sharding.PartitionSpec("expert")
    out = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec))(operand, *args)
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
