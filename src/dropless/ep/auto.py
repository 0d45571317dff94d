"""`moe.dispatch=auto`: alltoall when its slots are smaller than the whole token set, else allgather.

When every slot must hold all T tokens (few devices and a large top-k: at 2 devices with DeepSeek-V3's top-8,
nearly every token has an expert on the other device), all_to_all moves the same rows as all_gather at about
the same rate, while alltoall also packs and unpacks its slots, so allgather is the faster of the two there
(BENCHMARKS.md, expert parallelism). Decided per shape, at trace time (`resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax

from dropless.ep.allgather import AllGather
from dropless.ep.alltoall import AllToAll
from dropless.ep.contract import EXPERT_AXIS, LocalExperts, Strategy
from dropless.ep.wire import Wire


@dataclass(frozen=True)
class Auto:
    """alltoall (`buffer_factor`, `dedup`) or allgather, whichever `resolve` picks for the call's shape."""

    buffer_factor: float = 2.0
    dedup: bool = True
    wire: Wire = Wire()
    name: ClassVar[str] = "auto"

    def resolve(self, num_tokens: int, top_k: int, num_devices: int, num_local: int) -> Strategy:
        alltoall = AllToAll(self.buffer_factor, self.dedup, self.wire)
        normal, _ = alltoall.slot_sizes(num_tokens, top_k, num_devices, num_local)
        return AllGather(self.wire) if normal >= num_tokens else alltoall

    def __call__(self, x_TD, expert_ids_TK, weights_TK, local: LocalExperts):
        chosen = self.resolve(*expert_ids_TK.shape, jax.lax.axis_size(EXPERT_AXIS), local.num_local)
        return chosen(x_TD, expert_ids_TK, weights_TK, local)
