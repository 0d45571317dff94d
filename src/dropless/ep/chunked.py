"""`moe.dispatch_chunks = n`: each device's tokens in n chunks, each through the inner strategy in turn.

Chunk i+1's dispatch does not depend on chunk i's experts or combine, so XLA may run its collective while
chunk i's grouped GEMMs run (the overlap NVIDIA's fused dispatch/combine gets); the price is n smaller
exchanges and GEMMs. Exact: every token is routed, computed and combined as without chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from dropless.core.config import ConfigError
from dropless.ep.contract import LocalExperts, Strategy


def check_chunks(chunks: int, num_tokens: int) -> None:
    """Refuse `moe.dispatch_chunks` that do not divide the `num_tokens` a device holds in the MoE layer, in one
    line; `dropless plan` refuses them as training does."""
    if num_tokens % chunks:
        raise ConfigError(f"moe.dispatch_chunks={chunks} does not divide the {num_tokens} tokens each device holds in "
                          f"the MoE layer; choose a divisor of {num_tokens}.")


@dataclass(frozen=True)
class Chunked:
    """`inner` on each of `chunks` equal slices of the device's tokens; the stats add up."""

    inner: Strategy
    chunks: int
    name: ClassVar[str] = "chunked"

    def resolve(self, num_tokens: int, top_k: int, num_devices: int, num_local: int) -> Strategy:
        return self.inner.resolve(num_tokens // self.chunks, top_k, num_devices, num_local)

    def __call__(self, x_TD, expert_ids_TK, weights_TK, local: LocalExperts):
        num_tokens = x_TD.shape[0]
        check_chunks(self.chunks, num_tokens)
        size = num_tokens // self.chunks
        outputs, stats = [], []
        for c in range(self.chunks):
            rows = slice(c * size, (c + 1) * size)
            with jax.named_scope(f"chunk{c}"):
                y_TD, chunk_stats = self.inner(x_TD[rows], expert_ids_TK[rows], weights_TK[rows], local)
            outputs.append(y_TD)
            stats.append(chunk_stats)
        # Dropped rows and rows sent add up; the overflow flag is 1 if any chunk overflowed.
        total = jax.tree.map(lambda *s: sum(s), *stats)
        return jnp.concatenate(outputs), total._replace(
            dispatch_overflowed=jnp.max(jnp.stack([s.dispatch_overflowed for s in stats])))
