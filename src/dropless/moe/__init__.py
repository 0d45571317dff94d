"""dropless.moe: the dropless Mixture-of-Experts layer (route -> permute -> grouped GEMM -> unpermute)."""

from dropless.moe.balance import update_router_bias
from dropless.core.errors import MoEError
from dropless.moe.executor import ExpertExecutor, LocalExecutor
from dropless.moe.experts import dense_swiglu, routed_experts
from dropless.moe.layer import MoEStats, init_moe, moe_layer
from dropless.moe.permute import PermuteInfo, permute, unpermute
from dropless.moe.router import Routing, route

__all__ = [
    "ExpertExecutor", "LocalExecutor", "MoEError", "MoEStats", "PermuteInfo",
    "Routing", "dense_swiglu", "init_moe", "moe_layer", "permute", "route",
    "routed_experts", "unpermute", "update_router_bias",
]
