"""The grouped-GEMM backends by name: `moe.gmm_backend` picks one, once, when the model is built.

  dropless_mosaic   our Mosaic GPU kernels, a tuned tile per product and shape (dropless.gmm.dropless_mosaic)
  tokamax_mosaic    tokamax's Mosaic GPU kernel with its heuristic tiles, our weight gradient (dropless.gmm.tokamax)
  xla               jax.lax.ragged_dot, on every platform (dropless.gmm.xla)
  capacity          the GShard/Switch baseline that drops rows over a fixed per-group capacity (dropless.gmm.capacity)
  auto              dropless_mosaic on a GPU, xla elsewhere

dropless.core.config validates the name (and names the new one for a renamed value), so every name that reaches
this module has a builder.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from dropless.gmm.api import GroupedMatmul
from dropless.gmm.capacity import CapacityGmm
from dropless.gmm.dropless_mosaic import DroplessMosaicGmm, TunedContract
from dropless.gmm.tokamax import TokamaxGmm
from dropless.gmm.xla import XlaGmm

# name -> builder(capacity_factor); only `capacity` reads the factor.
BUILDERS: dict[str, Callable[[float], GroupedMatmul]] = {
    DroplessMosaicGmm.name: lambda capacity_factor: DroplessMosaicGmm(),
    TokamaxGmm.name: lambda capacity_factor: TokamaxGmm(implementation="mosaic", weight_grad=TunedContract()),
    XlaGmm.name: lambda capacity_factor: XlaGmm(),
    CapacityGmm.name: CapacityGmm,
}


def resolve_backend_name(backend: str) -> str:
    """`auto` means dropless_mosaic on a GPU and xla elsewhere; any other name is itself."""
    if backend == "auto":
        return DroplessMosaicGmm.name if jax.default_backend() == "gpu" else XlaGmm.name
    return backend


@functools.lru_cache(maxsize=None)
def _build(backend: str, capacity_factor: float) -> GroupedMatmul:
    return BUILDERS[backend](capacity_factor)


def make_gmm(moe_cfg) -> GroupedMatmul:
    """The grouped-GEMM backend for this config (built once; the same object is returned on later calls)."""
    return _build(resolve_backend_name(moe_cfg.gmm_backend), float(moe_cfg.capacity_factor))
