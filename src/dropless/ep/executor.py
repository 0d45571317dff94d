"""The expert-parallel executor: one `shard_map` over the mesh, and the strategy `moe.dispatch` names.

Tokens are split over every device, experts over the `expert` axis; inside the shard_map each device runs the
strategy (dropless.ep.contract) on its own tokens and the stats are summed over the mesh. `make_executor`
builds the executor once, with the model: the one-device `LocalExecutor` on a single device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dropless.core.config import Config, ConfigError
from dropless.core.mesh import BATCH_AXES, MESH_AXES
from dropless.ep.allgather import AllGather
from dropless.ep.alltoall import AllToAll
from dropless.ep.auto import Auto
from dropless.ep.chunked import Chunked
from dropless.ep.contract import EXPERT_AXIS, LocalExperts, Strategy
from dropless.ep.ragged import Ragged
from dropless.ep.wire import Wire
from dropless.fp8 import experts_gmm, train_recipe
from dropless.gmm import GroupedMatmul
from dropless.moe.executor import ExpertExecutor, LocalExecutor


@dataclass(frozen=True)
class NoDispatch:
    """parallel.expert = 1: every device holds every expert; nothing crosses a link."""

    name: ClassVar[str] = "local"

    def resolve(self, num_tokens: int, top_k: int, num_devices: int, num_local: int) -> "NoDispatch":
        return self

    def __call__(self, x_TD, expert_ids_TK, weights_TK, local: LocalExperts):
        return LocalExecutor(local.gmm)(x_TD, expert_ids_TK, weights_TK, local.experts)


@dataclass(frozen=True)
class ExpertParallelExecutor:
    """The MoE executor over a mesh: one `shard_map`, tokens over every device, experts over `expert`."""

    mesh: Mesh
    strategy: Strategy
    gmm: GroupedMatmul
    local_buffer_factor: float = 0.0  # LocalExperts.buffer_factor

    @property
    def name(self) -> str:
        return self.strategy.name

    def __call__(self, x_TD, expert_ids_TK, weights_TK, experts):
        num_tokens, num_devices = x_TD.shape[0], self.mesh.size
        if num_tokens % num_devices:
            raise ConfigError(f"the MoE layer got {num_tokens} tokens, which do not split over the {num_devices} "
                              f"devices of the mesh; make train.batch_size a multiple of {num_devices}.")
        tokens, experts_spec = P(BATCH_AXES), P(EXPERT_AXIS)

        def per_device(x_TD, expert_ids_TK, weights_TK, experts):
            local = LocalExperts(experts, self.gmm, self.local_buffer_factor)
            y_TD, stats = self.strategy(x_TD, expert_ids_TK, weights_TK, local)
            totals = jax.tree.map(lambda s: jax.lax.psum(s, MESH_AXES), stats)
            # The layer overflowed once, however many devices did (alltoall's slots: all of them), and within the
            # one all-reduce of the stats: a pmax of its own would be a separate, synchronising collective.
            return y_TD, totals._replace(dispatch_overflowed=jnp.minimum(totals.dispatch_overflowed, 1))

        run = jax.shard_map(per_device, mesh=self.mesh, out_specs=(tokens, P()),
                            in_specs=(tokens, tokens, tokens, jax.tree.map(lambda _: experts_spec, experts)))
        return run(x_TD, expert_ids_TK, weights_TK, experts)


def check_dispatch_platform(dispatch: str, platform: str) -> None:
    """Refuse a `moe.dispatch` the platform's XLA cannot run (ragged off GPUs), in one line; `dropless plan`
    refuses it as training does."""
    if dispatch == "ragged" and platform != "gpu":
        raise ConfigError(f"moe.dispatch=ragged needs GPUs (XLA:{platform.upper()} has no ragged_all_to_all); "
                          f"use moe.dispatch=alltoall or allgather.")


def make_strategy(config: Config, platform: str | None = None) -> Strategy:
    """The strategy `moe.dispatch` names, split into `moe.dispatch_chunks` chunks when that is > 1."""
    if config.parallel.expert == 1:
        return NoDispatch()
    strategy = _named_strategy(config, platform)
    return strategy if config.moe.dispatch_chunks == 1 else Chunked(strategy, config.moe.dispatch_chunks)


def _named_strategy(config: Config, platform: str | None = None) -> Strategy:
    """The strategy `moe.dispatch` names, for `parallel.expert` > 1 devices."""
    moe = config.moe
    name = moe.dispatch
    platform = platform or jax.default_backend()
    wire = Wire.from_config(moe.dispatch_dtype)
    if name == "auto":
        return Auto(moe.alltoall_buffer_factor, moe.dedup, wire)
    check_dispatch_platform(name, platform)
    if name == "allgather":
        return AllGather(wire)
    if name == "alltoall":
        return AllToAll(moe.alltoall_buffer_factor, moe.dedup, wire)
    return Ragged(moe.dedup, wire=wire)


def make_executor(config: Config, mesh: Mesh) -> ExpertExecutor:
    """The MoE executor for this config and mesh, with its grouped-GEMM backend: `LocalExecutor` on one device."""
    gmm = experts_gmm(config.moe, train_recipe(config.train))
    if mesh.size == 1:
        return LocalExecutor(gmm)
    if config.moe.num_experts % mesh.shape[EXPERT_AXIS]:
        raise ConfigError(f"moe.num_experts={config.moe.num_experts} is not divisible by parallel.expert="
                          f"{mesh.shape[EXPERT_AXIS]}; choose an expert-parallel size that divides it.")
    return ExpertParallelExecutor(mesh, make_strategy(config), gmm, config.moe.local_buffer_factor)
