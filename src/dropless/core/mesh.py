"""The device mesh and the one table that maps logical axes to mesh axes.

Mesh axes, outermost first: `data` (pure data parallelism), `fsdp` (data parallelism whose weights are
sharded and gathered just before use), `expert` (data parallelism whose MoE experts are split between
devices). `expert` is innermost, so an expert group is a run of neighbouring devices: one host's NVLink
domain whenever the group fits in a host.

Every weight states its logical axes where it is declared (`dropless.core.params.ParamSpec`);
`LOGICAL_AXIS_RULES` below is the only place that says which mesh axis shards which logical axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dropless.core.config import ConfigError, ParallelConfig

MESH_AXES = ("data", "fsdp", "expert")
# Tokens are split over every device: the batch dimension is sharded over all three axes jointly.
BATCH_AXES = ("data", "fsdp", "expert")

# Logical axis -> mesh axis (or None: replicated). A mesh axis shards at most one dimension of a given
# array: the first dimension (left to right) whose logical axis maps to it and whose size it divides.
# So an expert weight [layers, experts, embed, mlp] is split over `expert` by experts and over `fsdp`
# by embed, and a weight without an `embed` dimension (kv_b: [layers, kv_lora, heads_x_dim]) is still
# split over `fsdp`, FSDP-style, by its first large dimension.
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "experts": "expert",
    "embed": "fsdp",
    "mlp": "fsdp",
    "heads_x_dim": "fsdp",
    "kv_lora": "fsdp",
    "q_lora": "fsdp",
    "vocab": "fsdp",
    "layers": None,  # stacked layers are scanned over: each step needs its own slice, never split it
    "router": None,  # the router's expert dimension: tiny, float32, needed whole by every token
}


def make_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None, *,
              batch_size: int | None = None, num_experts: int | None = None,
              microbatch_size: int | None = None) -> Mesh:
    """Build the ("data", "fsdp", "expert") mesh; `parallel.data = -1` takes the devices left over.

    `batch_size` (global sequences), `microbatch_size` (sequences per gradient-accumulation microbatch) and
    `num_experts`, when given, are checked for divisibility so that a bad layout fails here, with the fix in
    the message, rather than deep inside XLA.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(parallel, len(devices), batch_size=batch_size, num_experts=num_experts,
                       microbatch_size=microbatch_size)
    grid = np.asarray(devices, dtype=object).reshape(shape)
    # Auto axes: the compiler propagates shardings outside the MoE layer's explicit shard_map.
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_shape(parallel: ParallelConfig, count: int, *, batch_size: int | None = None,
               num_experts: int | None = None, microbatch_size: int | None = None) -> tuple[int, int, int]:
    """(data, fsdp, expert) sizes of the mesh over `count` devices, with `make_mesh`'s checks (no device needed:
    `dropless.plan` sizes meshes of clusters it does not run on)."""
    inner = parallel.fsdp * parallel.expert
    if parallel.data == -1:
        if count % inner:
            raise ConfigError(f"parallel.fsdp={parallel.fsdp} x parallel.expert={parallel.expert} = {inner} does not "
                              f"divide the {_devices(count)}; choose sizes whose product divides {count}.")
        data = count // inner
    else:
        data = parallel.data
    if data * inner != count:
        raise ConfigError(f"parallel.data={data} x parallel.fsdp={parallel.fsdp} x parallel.expert={parallel.expert} "
                          f"= {data * inner} but there {'is' if count == 1 else 'are'} {_devices(count)}; make the "
                          f"product {count} or set parallel.data=-1.")
    if num_experts is not None and num_experts % parallel.expert:
        raise ConfigError(f"moe.num_experts={num_experts} is not divisible by parallel.expert={parallel.expert}; "
                          f"choose an expert-parallel size that divides the number of experts.")
    if batch_size is not None and batch_size % count:
        raise ConfigError(f"train.batch_size={batch_size} is not divisible by the {count} devices of the mesh "
                          f"(the batch is split over all of them); use a multiple of {count}.")
    if microbatch_size is not None and microbatch_size % count:
        raise ConfigError(f"a microbatch (train.batch_size / train.grad_accum_steps = {microbatch_size} sequences) "
                          f"is not divisible by the {count} devices of the mesh; make it a multiple of {count}.")
    return data, parallel.fsdp, parallel.expert


def _devices(count: int) -> str:
    return "1 device" if count == 1 else f"{count} devices"


def _mesh_axes_of(logical: str | None) -> tuple[str, ...]:
    if logical is None:
        return ()
    if logical not in LOGICAL_AXIS_RULES:
        raise KeyError(f"logical axis {logical!r} has no rule in LOGICAL_AXIS_RULES")
    rule = LOGICAL_AXIS_RULES[logical]
    return () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)


def logical_to_spec(mesh: Mesh, logical_axes: Sequence[str | None],
                    shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for one array: apply the rules, each mesh axis at most once, size-1 axes dropped.

    With `shape`, a mesh axis that does not divide its dimension is skipped (that dimension stays
    replicated over it), except `expert` on `experts`, which `make_mesh` has already checked.
    """
    used: set[str] = set()
    spec = []
    for dim, logical in enumerate(logical_axes):
        chosen = []
        for axis in _mesh_axes_of(logical):
            size = mesh.shape[axis]
            if axis in used or size == 1:
                continue
            if shape is not None and shape[dim] % (size * math.prod(mesh.shape[a] for a in chosen)):
                assert logical != "experts", "make_mesh checks that parallel.expert divides moe.num_experts"
                continue
            chosen.append(axis)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def _is_axes_leaf(node: Any) -> bool:
    return isinstance(node, tuple) and all(a is None or isinstance(a, str) for a in node)


def param_shardings(mesh: Mesh, logical_axes_tree: Any, shapes_tree: Any = None) -> Any:
    """NamedShardings for a pytree whose leaves are tuples of logical axis names (one per dimension).

    `shapes_tree` (the params themselves, or `jax.eval_shape` of their init) lets a mesh axis that does
    not divide a dimension leave it replicated instead of failing.
    """
    if shapes_tree is None:
        return jax.tree.map(lambda axes: NamedSharding(mesh, logical_to_spec(mesh, axes)),
                            logical_axes_tree, is_leaf=_is_axes_leaf)
    return jax.tree.map(lambda axes, like: NamedSharding(mesh, logical_to_spec(mesh, axes, like.shape)),
                        logical_axes_tree, shapes_tree, is_leaf=_is_axes_leaf)


def per_batch_shard(kernel, mesh: Mesh | None, whole: int = 0):
    """`kernel(*arrays) -> array`, every array batch-first, run on each device's own slice of the batch; the last
    `whole` arrays (weights) are passed whole to every device.

    For kernels XLA cannot partition (Pallas calls such as tokamax's flash attention, our FP8 matmuls): under
    plain jit its SPMD partitioner gathers the whole batch onto every device and runs the kernel there: an
    all-gather of attention's q/k/v in every layer, and every device doing the whole batch's attention.
    Identity on one device. check_vma=False: Pallas kernels' custom VJPs return cotangents without mesh axes; the
    gradient of an array passed whole is then the sum of the devices' own (shard_map's transpose sums it).
    """
    if mesh is None or mesh.size == 1:
        return kernel

    def run(*arrays):
        spec = PartitionSpec(BATCH_AXES)
        in_specs = (spec,) * (len(arrays) - whole) + (PartitionSpec(),) * whole
        return jax.shard_map(kernel, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)(*arrays)

    return run


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [B, ...] batch: sequences split over every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def place(tree: Any, shardings: Any) -> Any:
    """Put a pytree of host or device arrays onto the mesh with the given shardings (a tree or one sharding).

    Works with several processes: every process passes the same global values, and each keeps only the
    shards of its own devices (host arrays are sliced, never copied whole to every device).
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def put(value, sharding):
        if jax.process_count() == 1 or (isinstance(value, jax.Array) and not value.is_fully_addressable):
            return jax.device_put(value, sharding)
        host = np.asarray(value)  # a process-local value: slice out this process's shards
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)
