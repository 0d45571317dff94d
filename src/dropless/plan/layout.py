"""The cluster and the mesh a plan is made for, and the exact bytes of the training state on one device.

Nothing here touches a device: the mesh is a `jax.sharding.AbstractMesh` of the sizes `parallel.*` gives, and
each parameter's shard shape follows from its declaration (`transformer.param_specs`) and the one rule table
(`dropless.core.mesh.logical_to_spec`), exactly as `dropless.train.setup` shards the real arrays. The optimizer
state (AdamW's two moments, each sharded like its parameter, and two replicated int32 step counts) and the model
state (the replicated router bias) are counted the same way.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax.numpy as jnp
from jax.sharding import AbstractMesh

from dropless.core import params as params_lib
from dropless.core.config import Config
from dropless.core.mesh import MESH_AXES, logical_to_spec, mesh_shape
from dropless.models import transformer

# int32 step counts in the optimizer state: AdamW's and the learning-rate schedule's (optax's `count`s).
OPTIMIZER_COUNTS = 2


@dataclass(frozen=True)
class Cluster:
    """`hosts` x `gpus_per_host` devices of one kind (a key of the rate table)."""

    hosts: int = 1
    gpus_per_host: int = 1
    device: str = "H200"

    @property
    def devices(self) -> int:
        return self.hosts * self.gpus_per_host


def mesh_sizes(config: Config, devices: int) -> dict[str, int]:
    """{"data", "fsdp", "expert"} sizes for `devices`, with the divisibility checks of `core.mesh.make_mesh`."""
    micro = config.train.batch_size // config.train.grad_accum_steps
    return dict(zip(MESH_AXES, mesh_shape(config.parallel, devices, microbatch_size=micro)))


_MODELS: dict[str, tuple] = {}


def model_facts(config: Config) -> tuple[list, dict[str, int], tuple[int, int]]:
    """(flattened parameter specs, `param_breakdown`, `param_counts`) of the config's model, computed once per
    model: a search plans thousands of layouts of one model."""
    moe = config.moe  # only the sizes of the experts shape the parameters
    key = repr((config.model, moe.num_experts, moe.num_experts_per_tok, moe.expert_intermediate_size,
                moe.num_shared_experts))
    if key not in _MODELS:
        _MODELS[key] = (params_lib.flatten(transformer.param_specs(config)), transformer.param_breakdown(config),
                        transformer.param_counts(config))
    return _MODELS[key]


@functools.cache
def _shard_shape_cached(sizes: tuple[int, ...], shape: tuple[int, ...], axes: tuple) -> tuple[int, ...]:
    return _shard_shape(abstract_mesh(dict(zip(MESH_AXES, sizes))), shape, axes)


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)


def mesh_axes_of(mesh: AbstractMesh, shape: tuple[int, ...], axes: tuple) -> frozenset[str]:
    """The mesh axes that shard an array with these logical axes."""
    return _mesh_axes_cached(tuple(mesh.shape[a] for a in MESH_AXES), tuple(shape), tuple(axes))


@functools.cache
def _mesh_axes_cached(sizes: tuple[int, ...], shape: tuple[int, ...], axes: tuple) -> frozenset[str]:
    used: set[str] = set()
    for entry in logical_to_spec(abstract_mesh(dict(zip(MESH_AXES, sizes))), axes, shape):
        used.update(() if entry is None else (entry,) if isinstance(entry, str) else entry)
    return frozenset(used)


def shard_shape(mesh: AbstractMesh, shape: tuple[int, ...], axes: tuple) -> tuple[int, ...]:
    """The shape one device holds of an array with these logical axes (the sharding rules of `core.mesh`)."""
    return _shard_shape_cached(tuple(mesh.shape[a] for a in MESH_AXES), tuple(shape), tuple(axes))


def _shard_shape(mesh: AbstractMesh, shape: tuple[int, ...], axes: tuple) -> tuple[int, ...]:
    spec = logical_to_spec(mesh, axes, shape)
    out = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(dim // math.prod(mesh.shape[n] for n in names))
    return tuple(out)


@dataclass(frozen=True)
class StateBytes:
    """Bytes one device holds of the training state between steps."""

    parameters: int  # float32 master weights
    gradients: int  # float32 gradients, sharded like the parameters
    optimizer_state: int  # both moments and the step counts, wherever they live
    optimizer_in_host: bool  # train.offload_optimizer: the optimizer state lives in pinned host memory
    model_state: int  # the router bias (and running input mean), the step counter, replicated
    parameter_elements: int  # elements of the parameters one device holds
    largest_layer_elements: int  # elements of the largest single layer's weights on one device (one stack entry)
    largest_layer_gathered: int  # the same layer's elements once gathered over `fsdp` (as the layer uses it)
    matrix_elements: int  # elements of the weights a matmul reads in the compute dtype (all but norms, router)
    expert_elements: int  # elements of the routed experts' weights (the expert-parallel shard_map's operands)


def state_bytes(config: Config, sizes: dict[str, int]) -> StateBytes:
    """The exact per-device bytes of parameters, gradients, optimizer and model state under `sizes`."""
    mesh = abstract_mesh(sizes)
    unsharded = abstract_mesh({**sizes, "fsdp": 1})
    elements = matrices = experts = 0
    layer_local: dict[str, int] = {}
    layer_gathered: dict[str, int] = {}
    for path, spec in model_facts(config)[0]:
        local = math.prod(shard_shape(mesh, spec.shape, spec.axes))
        elements += local
        if path[-1] != "kernel" and not path[-1].endswith("norm"):  # the router stays float32; norms are vectors
            matrices += local
        if "experts" in path:
            experts += local
        if spec.axes and spec.axes[0] == "layers":
            per_layer = spec.shape[0]
            layer_local[path[0]] = layer_local.get(path[0], 0) + local // per_layer
            layer_gathered[path[0]] = (layer_gathered.get(path[0], 0)
                                       + math.prod(shard_shape(unsharded, spec.shape, spec.axes)) // per_layer)
    moments = jnp.dtype(config.train.optimizer_moments_dtype).itemsize
    router_rows = transformer.num_router_rows(config.model)  # the main MoE layers' and the MTP modules'
    largest = max(layer_local, key=layer_local.get) if layer_local else None
    return StateBytes(
        parameters=4 * elements,
        gradients=4 * elements,
        optimizer_state=2 * moments * elements + 4 * OPTIMIZER_COUNTS,
        optimizer_in_host=config.train.offload_optimizer,
        model_state=4 * router_rows * (config.moe.num_experts
                                       + (config.model.hidden_size if config.moe.router_common_rate > 0 else 0)) + 4,
        parameter_elements=elements,
        largest_layer_elements=layer_local.get(largest, 0),
        largest_layer_gathered=layer_gathered.get(largest, 0),
        matrix_elements=matrices,
        expert_elements=experts,
    )
