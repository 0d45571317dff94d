"""The expert-executor seam: how routed tokens reach their experts and come back.

An executor is built once, when the model is (`dropless.ep.make_executor`), and holds what the MoE layer
needs besides parameters: the grouped-GEMM backend and, for expert parallelism, the mesh. It is called as
    executor(x_TD, expert_ids_TK int32, weights_TK float32, experts) -> (y_TD float32, ExecutorStats)
where `experts` = {"gate_up": [E, D, 2F], "down": [E, F, D]} (already in the compute dtype). `LocalExecutor`
runs everything on one device; the expert-parallel executor (dropless.ep) adds dispatch/combine collectives
around the same permute / routed_experts / unpermute stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dropless.fp8 import Recipe, experts_gmm
from dropless.gmm import GroupedMatmul
from dropless.moe.experts import routed_experts
from dropless.moe.permute import permute, unpermute


class ExecutorStats(NamedTuple):
    """What an executor reports per call: int32 scalars, totals over all devices."""

    tokens_dropped: jax.Array  # (token, expert) assignments not computed; 0 unless gmm_backend=capacity
    dispatch_overflowed: jax.Array  # 1 if alltoall slots or a local expert buffer overflowed (a worst-case path ran)
    rows_sent: jax.Array  # token rows that crossed between devices in dispatch (combine returns as many)
    rows_sent_without_dedup: jax.Array  # rows needed with one copy per remote (token, expert) pair

    @classmethod
    def single_device(cls, tokens_dropped: jax.Array) -> "ExecutorStats":
        zero = jnp.zeros((), jnp.int32)
        return cls(jnp.asarray(tokens_dropped, jnp.int32), zero, zero, zero)


class ExpertExecutor(Protocol):
    """What the MoE layer calls between the router and the shared experts."""

    @property
    def mesh(self) -> Mesh | None:
        """The mesh whose devices split the tokens (the router and attention then work per device); None on one."""

    @property
    def name(self) -> str:
        """How tokens reach their experts, for logs: "local", or the expert-parallel strategy's name."""

    def __call__(self, x_TD: jax.Array, expert_ids_TK: jax.Array, weights_TK: jax.Array,
                 experts: dict) -> tuple[jax.Array, ExecutorStats]: ...


@dataclass(frozen=True)
class LocalExecutor:
    """Single device: permute -> grouped GEMM (SwiGLU) -> unpermute and weighted combine in float32.

    The permutation writes the layout the grouped GEMM asks for (`gmm.row_align`, dropless.gmm.api): under FP8
    each expert's rows from a multiple of 128 on.

    `rows`: keep only this many sorted rows (a bounded buffer; default all T*K). Exact only when at most `rows`
    (token, expert) pairs name an expert here (ids >= E are "none"); the caller checks that on the device.
    `remat_activation`: see dropless.moe.experts.routed_experts.
    """

    gmm: GroupedMatmul
    rows: int | None = None
    remat_activation: bool = False

    @classmethod
    def from_config(cls, moe_cfg, recipe: Recipe | None = None) -> "LocalExecutor":
        """The one-device executor with the grouped-GEMM backend `moe.gmm_backend` names (under an FP8 recipe)."""
        return cls(experts_gmm(moe_cfg, recipe))

    @property
    def mesh(self) -> None:
        return None

    @property
    def name(self) -> str:
        return "local"

    def __call__(self, x_TD, expert_ids_TK, weights_TK, experts):
        num_experts = experts["gate_up"].shape[0]
        with jax.named_scope("permute"):
            x_sorted_MD, group_sizes_E, info = permute(x_TD, expert_ids_TK, num_experts, self.rows,
                                                       self.gmm.row_align)
        y_sorted_MD = routed_experts(x_sorted_MD, group_sizes_E, experts, self.gmm,
                                     remat_activation=self.remat_activation)
        with jax.named_scope("unpermute"):
            y_TD = unpermute(y_sorted_MD, info, weights_TK)
        # Dropped pairs are counted from the real group sizes and rows, not an aligned layout's padded ones: the
        # rows permute keeps, at most all T*K (a `rows` above that keeps them all).
        num_rows = expert_ids_TK.size if self.rows is None else min(self.rows, expert_ids_TK.size)
        return y_TD, ExecutorStats.single_device(self.gmm.dropped_rows(info.pairs_E, num_rows))
