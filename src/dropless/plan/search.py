"""`dropless plan --search` and `dropless train`'s fit check: the layouts a preset allows on a cluster, fastest first.

A layout is a choice of `parallel.fsdp` x `parallel.expert` (data takes the rest), `train.remat` (with
`train.offload` of every named activation, or none), `train.offload_optimizer`, `train.optimizer_moments_dtype`,
`train.grad_accum_steps` and `moe.dispatch`. The search plans each (arithmetic only: thousands per second) and keeps
those that fit, sorted by predicted step time.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from dropless.core.config import ACTIVATION_NAMES, Config, ConfigError, ParallelConfig
from dropless.plan.cost import load_rates
from dropless.plan.layout import Cluster
from dropless.plan.report import FIT_MARGIN, GIB, Plan, layout_overrides, make_plan


# (train.remat, train.offload): activation offloading needs remat=full and is tried with every named activation.
REMAT_CHOICES = (("none", ""), ("moe", ""), ("full", ""), ("full", ",".join(ACTIVATION_NAMES)))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(config: Config, cluster: Cluster):
    """Every layout config the preset allows on `cluster` (ones that do not divide evenly are skipped)."""
    n, train, moe = cluster.devices, config.train, config.moe
    experts = [e for e in _divisors(n) if moe.num_experts % e == 0]
    accum = [a for a in _divisors(train.batch_size) if (train.batch_size // a) % n == 0 and a <= 64]
    for expert, fsdp in itertools.product(experts, _divisors(n)):
        if (n // expert) % fsdp:
            continue
        dispatches = ("alltoall", "allgather") if expert > 1 else ("auto",)  # auto picks one of the two
        for (remat, activations), offload, moments, steps, dispatch in itertools.product(
                REMAT_CHOICES, (False, True), ("float32", "bfloat16"), accum, dispatches):
            # dataclasses.replace, not Config.replace: the values are already typed (thousands of candidates).
            try:
                yield dataclasses.replace(
                    config, parallel=ParallelConfig(-1, fsdp, expert),
                    train=dataclasses.replace(train, remat=remat, offload=activations, offload_optimizer=offload,
                                              optimizer_moments_dtype=moments, grad_accum_steps=steps),
                    moe=dataclasses.replace(moe, dispatch=dispatch))
            except ConfigError:
                continue


def _value(config: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def search(config: Config, cluster: Cluster, *, device_memory_gib: float | None = None, rates: dict | None = None,
           limit: int | None = None, keep: frozenset[str] = frozenset()) -> list[Plan]:
    """The layouts that fit, fastest first (ties: the smaller peak); `keep`: layout keys that stay as in `config`
    (a resumed run may change only its mesh)."""
    rates = rates or load_rates()
    fitting = []
    for candidate in candidates(config, cluster):
        if any(_value(candidate, key) != _value(config, key) for key in keep):
            continue
        try:
            plan = make_plan(candidate, cluster, device_memory_gib=device_memory_gib, rates=rates)
        except ConfigError:
            continue
        if plan.fits:
            fitting.append(plan)
    fitting.sort(key=lambda p: (p.time["seconds"], p.memory.peak))
    # Where two dispatch strategies move the same rows (auto's allgather case), keep the first of the equal plans.
    distinct, seen = [], set()
    for plan in fitting:
        key = (plan.time["seconds"], plan.memory.peak, layout_overrides(plan.config).rsplit(" moe.dispatch=", 1)[0])
        if key not in seen:
            seen.add(key)
            distinct.append(plan)
    return distinct[:limit] if limit else distinct


def check_fit(config: Config, cluster: Cluster, device_memory_gib: float | None = None, *,
              auto_fit: bool = False, rates: dict | None = None, within_margin: bool = False,
              keep: frozenset[str] = frozenset()) -> Plan:
    """The plan of `config` if it fits; with `auto_fit`, the plan of the fastest fitting layout; otherwise a
    ConfigError of one line saying by how much it does not fit and which settings would. `within_margin`: also
    accept a peak that fits the device's memory but not the plan's margin (`dropless train` warns about it
    instead of refusing; such a plan's `fits` is False). `keep`: layout keys the alternatives may not change."""
    plan = make_plan(config, cluster, device_memory_gib=device_memory_gib, rates=rates)
    accepted = plan.fits or (within_margin and plan.memory.peak <= plan.device_memory_bytes)
    if accepted and not auto_fit:
        return plan
    best = search(config, cluster, device_memory_gib=device_memory_gib, rates=rates, limit=1, keep=keep)
    if auto_fit and best:
        return best[0]
    usable = (1 - FIT_MARGIN) * plan.device_memory_bytes
    fix = (f"set {layout_overrides(best[0].config)} (predicted peak {_gib(best[0].memory.peak)} GiB) or "
           "train.auto_fit=true" if best else "no layout of this batch fits" + (
               " that keeps the run's " + ", ".join(sorted(keep)) if keep else "")
           + "; use more devices or a smaller train.batch_size")
    raise ConfigError(f"the plan does not fit: its peak is {_gib(plan.memory.peak)} GiB per device, "
                      f"{_gib(plan.memory.peak - usable)} GiB over the {_gib(usable)} GiB usable of "
                      f"{cluster.device}'s {_gib(plan.device_memory_bytes)} GiB ({FIT_MARGIN:.0%} kept free); {fix} "
                      "('dropless plan' shows the breakdown).")


def _gib(num_bytes: float) -> str:
    """GiB to one decimal, or to three significant digits below 10 GiB (a small device's 0.15 GiB is not 0.1)."""
    gib = num_bytes / GIB
    return f"{gib:.1f}" if gib >= 10 else np.format_float_positional(gib, precision=3, fractional=False, trim="-")
