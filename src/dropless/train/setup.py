"""Everything a training step needs besides data, built once: mesh, executor, optimizer, shardings, the jitted step.

`dropless.train.loop` trains with it; the benchmarks (`dropless.bench`) lower and time the very same step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import optax
from jax.sharding import Mesh, NamedSharding

from dropless.core.config import Config
from dropless.models import transformer
from dropless.ep import make_executor
from dropless.core import mesh as mesh_lib
from dropless.moe.executor import ExpertExecutor
from dropless.plan import Cluster, check_fit
from dropless.plan.cost import load_rates, rate_key
from dropless.plan.report import FIT_MARGIN, layout_overrides
from dropless.train import offload
from dropless.train.optimizer import make_optimizer
from dropless.train.step import TrainState, init_train_state, make_train_step


@dataclass(frozen=True)
class StepSetup:
    config: Config
    mesh: Mesh
    executor: ExpertExecutor  # LocalExecutor on one device, else the expert-parallel one; holds the gmm backend
    optimizer: optax.GradientTransformation
    state_shapes: TrainState  # ShapeDtypeStructs
    state_shardings: TrainState  # NamedShardings
    batch_sharding: NamedSharding
    step: Any  # jax.jit(train_step), state donated


def train_state_shardings(config: Config, mesh: Mesh, optimizer: optax.GradientTransformation) -> TrainState:
    """Shardings of every TrainState leaf: parameters by their logical axes (the one rule table in
    dropless.core.mesh), optimizer moments like the parameters they track, the rest replicated."""
    replicated = mesh_lib.replicated(mesh)
    param_shapes = jax.eval_shape(lambda: transformer.init_params(jax.random.key(0), config))
    params = mesh_lib.param_shardings(mesh, transformer.logical_axes(config), param_shapes)
    opt_shapes = jax.eval_shape(optimizer.init, param_shapes)
    opt_state = optax.tree_map_params(optimizer, lambda _, sharding: sharding, opt_shapes, params,
                                      transform_non_params=lambda _: replicated)
    model_state = jax.tree.map(lambda _: replicated, jax.eval_shape(lambda: transformer.init_state(config)))
    return TrainState(replicated, params, opt_state, model_state)


def build(config: Config, devices: Sequence[jax.Device] | None = None) -> StepSetup:
    """Mesh, shardings and the jitted train step for `config` on `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    train = config.train
    mesh = mesh_lib.make_mesh(config.parallel, devices, batch_size=train.batch_size, num_experts=config.moe.num_experts,
                              microbatch_size=train.batch_size // train.grad_accum_steps)
    executor = make_executor(config, mesh)
    optimizer = make_optimizer(config.train)
    state_shapes = jax.eval_shape(lambda: init_train_state(jax.random.key(config.train.seed), config, optimizer))
    shardings = offload.state_shardings_for(config.train, train_state_shardings(config, mesh, optimizer), devices)
    batch_sharding = mesh_lib.batch_sharding(mesh)
    step = jax.jit(make_train_step(config, optimizer, executor),
                   in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None), donate_argnums=0)
    return StepSetup(config, mesh, executor, optimizer, state_shapes, shardings, batch_sharding, step)


def process_rows(batch_size: int) -> tuple[int, int]:
    """This process's rows [lo, hi) of a global batch of `batch_size` rows (each process feeds an equal share)."""
    rows = batch_size // jax.process_count()
    return jax.process_index() * rows, (jax.process_index() + 1) * rows


def global_batch(local_BS1, sharding: NamedSharding, batch_size: int) -> jax.Array:
    """This process's rows of the global batch, as one global array spread over the mesh."""
    return jax.make_array_from_process_local_data(sharding, local_BS1, (batch_size, local_BS1.shape[1]))


def host_memory_bytes() -> int:
    """This host's physical memory (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def fit_check(config: Config, devices: Sequence[jax.Device] | None = None, log=print,
              keep: frozenset[str] = frozenset()) -> Config:
    """The plan's verdict before compiling (`dropless.plan`): against `train.device_memory_gib`, on a GPU its own
    limit, on the CPU the host's memory shared by its devices. A config whose planned peak exceeds the limit raises
    a ConfigError naming the shortfall and a layout that fits; one within the plan's margin of it runs with a
    warning; with `train.auto_fit` the fastest layout that fits with the margin is returned (and printed) instead,
    changing none of the layout keys in `keep`."""
    devices = list(jax.devices() if devices is None else devices)
    limit = config.train.device_memory_gib
    if not limit and devices[0].platform == "gpu":
        limit = (devices[0].memory_stats() or {}).get("bytes_limit", 0) / 1024**3
    elif not limit and devices[0].platform == "cpu":
        # The CPU devices of one process share its host's memory: a config that cannot fit would otherwise make
        # the host swap or be killed without a word.
        limit = host_memory_bytes() / 1024**3 / (len(devices) // jax.process_count())
    if not limit:
        return config
    rates = load_rates()
    hosts = jax.process_count()
    cluster = Cluster(hosts, len(devices) // hosts, rate_key(rates, devices[0].device_kind, devices[0].platform))
    plan = check_fit(config, cluster, limit, auto_fit=config.train.auto_fit, rates=rates, within_margin=True,
                     keep=keep)
    if plan.config is not config:
        log(f"dropless: train.auto_fit chose {layout_overrides(plan.config)}")
    if not plan.fits:  # within the device's memory, but not within the plan's margin
        log(f"dropless: warning: the plan's peak is {plan.memory.peak / 1024**3:.1f} GiB of the "
            f"{limit:.1f} GiB per device, within the model's {FIT_MARGIN:.0%} error; the run may not fit.")
    return plan.config


def init_state(setup: StepSetup, init_weights: tuple | None = None) -> TrainState:
    """A fresh TrainState created directly in its shardings; `init_weights=(params, state)` starts from given
    weights (fine-tuning) instead of a random initialisation."""
    config, optimizer = setup.config, setup.optimizer
    params, model_state = init_weights if init_weights is not None else (None, None)
    return jax.jit(lambda: init_train_state(jax.random.key(config.train.seed), config, optimizer, params, model_state),
                   out_shardings=setup.state_shardings)()
