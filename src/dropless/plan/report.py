"""A plan: the memory and time models combined for one config on one cluster, as a table and as JSON."""

from __future__ import annotations

from dataclasses import dataclass

from dropless.core.config import Config
from dropless.ep.chunked import check_chunks
from dropless.ep.executor import check_dispatch_platform
from dropless.fp8.recipe import holds_weight_cache
from dropless.plan.cost import device_rates, load_rates, step_time
from dropless.plan.layout import Cluster, mesh_sizes, model_facts, state_bytes
from dropless.plan.memory import MemoryPlan, plan_memory

GIB = 1024**3
SCHEMA = "dropless-plan/1"
# A plan fits when its peak leaves this share of the device's memory free, so that a run the plan accepts does not
# run out of memory: the model underestimates no measured peak by more than 5.7% (docs/planning.md, Accuracy: 2
# H200s with expert parallelism, step-offload-flags-h200.json; the single-device table's lowest is -3.0%).
FIT_MARGIN = 0.06


@dataclass(frozen=True)
class Plan:
    config: Config
    cluster: Cluster
    mesh: dict[str, int]
    memory: MemoryPlan
    time: dict
    device_memory_bytes: int

    @property
    def fits(self) -> bool:
        return self.memory.peak <= (1 - FIT_MARGIN) * self.device_memory_bytes

    def to_dict(self) -> dict:
        mem = self.memory
        name, largest = mem.largest_temporary
        total, active = model_facts(self.config)[2]
        return {
            "schema": SCHEMA,
            "cluster": {"hosts": self.cluster.hosts, "gpus_per_host": self.cluster.gpus_per_host,
                        "devices": self.cluster.devices, "device": self.cluster.device},
            "mesh": self.mesh,
            "parameters": {"total": total, "active_per_token": active},
            "tokens_per_device_per_microbatch": (self.config.train.batch_size // self.config.train.grad_accum_steps
                                                 * self.config.train.seq_len // self.cluster.devices),
            "per_device_bytes": {
                "parameters": mem.parameters,
                "gradients": mem.gradients,
                "gradient_buffers": mem.gradient_buffers,
                "optimizer_state": mem.optimizer_state,
                "optimizer_state_in": "pinned_host" if mem.optimizer_in_host else "device",
                "model_state_and_batch": mem.model_state_and_batch,
                "activations": mem.activations,
                "activations_in_host": mem.activations_in_host,
                "weight_copies": mem.weight_copies,
                "temporaries": mem.temporaries,
                "largest_temporary": {"name": name, "bytes": largest},
                "update_phase": mem.update_phase,
                "peak": mem.peak,
                "peak_worst_case": mem.peak_worst_case,
            },
            "moe_buffers": mem.moe_buffers,
            "device_memory_bytes": self.device_memory_bytes,
            "fit_margin": FIT_MARGIN,
            "fits": self.fits,
            "step": {"seconds": self.time["seconds"], "terms_s": self.time["terms_s"],
                     "tokens_per_s": self.time["tokens_per_s"],
                     "model_tflops_per_device": self.time["model_tflops_per_device"],
                     "grouped_gemm": self.time["grouped_gemm"]},
            "flops": self.time["flops"],
            "collectives": self.time["collectives"],
            "overrides": layout_overrides(self.config),
        }


# The keys a layout is made of: what `--search` varies and what its `key=value` lines name.
LAYOUT_KEYS = ("parallel.data", "parallel.fsdp", "parallel.expert", "train.remat", "train.offload",
               "train.offload_optimizer", "train.grad_accum_steps", "train.optimizer_moments_dtype", "moe.dispatch")


def layout_overrides(config: Config) -> str:
    """The `key=value` line that sets this config's layout: every layout key, `train.offload=` too when it is
    empty, so that the line applied after a command that named activations to offload replaces them."""
    flat = config.to_flat_dict()
    return " ".join(f"{k}={str(flat[k]).lower() if isinstance(flat[k], bool) else flat[k]}" for k in LAYOUT_KEYS)


def make_plan(config: Config, cluster: Cluster, *, device_memory_gib: float | None = None,
              rates: dict | None = None) -> Plan:
    """The plan of `config`'s training step on `cluster` (pure arithmetic; no device is touched)."""
    table = device_rates(rates or load_rates(), cluster.device)
    sizes = mesh_sizes(config, cluster.devices)
    if sizes["expert"] > 1:  # training builds a dispatch strategy only for expert parallelism
        check_dispatch_platform(config.moe.dispatch, table.get("platform", "gpu"))
        # the tokens each device holds in the MoE layer: one microbatch's, spread over every device
        check_chunks(config.moe.dispatch_chunks,
                     config.train.batch_size // config.train.grad_accum_steps * config.train.seq_len // cluster.devices)
    backend = config.model.attention_backend
    if backend == "auto":
        half = config.train.dtype == "bfloat16"
        backend = "tokamax" if table.get("platform") == "gpu" and half else "xla"
    memory = plan_memory(config, sizes, attention_backend=backend, state=state_bytes(config, sizes))
    time = step_time(config, sizes, cluster, memory, table)
    limit = device_memory_gib if device_memory_gib else table["memory_gib"]
    return Plan(config, cluster, sizes, memory, time, int(limit * GIB))


def verdict(plan: Plan) -> str:
    """Fits (with the margin), tight (within the device's memory but not the margin: `dropless train` warns and
    runs) or does not fit (`dropless train` refuses)."""
    peak, memory = plan.memory.peak, plan.device_memory_bytes
    if plan.fits:
        return f"fits, {FIT_MARGIN:.0%} kept free"
    if peak <= memory:
        over = (peak - (1 - FIT_MARGIN) * memory) / GIB
        return (f"TIGHT: within the device's memory but {over:.2f} GiB into the {FIT_MARGIN:.0%} kept free for the "
                "model's error; it may run out of memory")
    usable = (1 - FIT_MARGIN) * memory
    return (f"DOES NOT FIT ({(peak - memory) / GIB:.2f} GiB over the device's memory, {(peak - usable) / GIB:.2f} "
            f"over with {FIT_MARGIN:.0%} kept free)")


def _gib(value: int) -> str:
    return f"{value / GIB:9.2f} GiB"


def format_plan(plan: Plan) -> str:
    """The per-device breakdown, the verdict, FLOPs, collectives and the predicted step time."""
    d = plan.to_dict()
    mem = plan.memory
    cfg = plan.config.train
    name, largest = mem.largest_temporary
    lines = [f"plan: {d['cluster']['devices']} x {plan.cluster.device} ({plan.cluster.hosts} host(s) x "
             f"{plan.cluster.gpus_per_host}), mesh {plan.mesh}, {d['tokens_per_device_per_microbatch']:,} tokens "
             f"per device per microbatch, remat={cfg.remat}",
             "per device:",
             f"  parameters         {_gib(mem.parameters)}  float32 master weights",
             f"  optimizer state    {_gib(mem.optimizer_state)}  AdamW moments in {cfg.optimizer_moments_dtype}"
             + (", pinned host memory (not counted on the device)" if mem.optimizer_in_host else ""),
             f"  gradients          {_gib(mem.gradient_buffers)}  ({mem.gradients / GIB:.2f} GiB as float32 arrays;"
             " the compute dtype where XLA fuses the cast)",
             f"  activations        {_gib(mem.activations)}  kept for the backward pass"
             + (f"; {mem.activations_in_host / GIB:.2f} GiB offloaded to host" if mem.activations_in_host else ""),
             ]
    if mem.weight_copies:
        what = "what the quantized weights' e4m3 copies, made once per step, add" if holds_weight_cache(cfg) else \
            "stacked weights cast under scan_layers"
        lines.append(f"  weight copies      {_gib(mem.weight_copies)}  {what}")
    lines.append(f"  largest temporary  {_gib(largest)}  {name.replace('_', ' ')}")
    lines.append(f"  state + batch      {_gib(mem.model_state_and_batch)}")
    if mem.update_phase:
        lines.append(f"  update phase       {_gib(mem.update_phase)}  the optimizer update, moments on the device")
    lines.append(f"  peak               {_gib(mem.peak)}  of {plan.device_memory_bytes / GIB:.1f} GiB: "
                 f"{verdict(plan)}")
    if mem.moe_buffers:
        mb = mem.moe_buffers
        lines.append(f"  MoE worst case     {_gib(mem.peak_worst_case)}  peak if a layer overflows its bounded "
                     f"buffer ({mb['strategy']}: {mb['local_rows']:,} rows bounded, {mb['worst_rows']:,} worst case)")
    t = plan.time
    lines.append(f"step: {t['flops']['model'] / 1e15:.2f} PFLOP model"
                 + (f" + {t['flops']['recompute'] / 1e15:.2f} recomputed" if t['flops']['recompute'] else "")
                 + f"; predicted {t['seconds'] * 1e3:,.0f} ms, {t['tokens_per_s']:,.0f} tokens/s, "
                 f"{t['model_tflops_per_device']:.0f} model TFLOP/s per device")
    lines.append("  time: " + ", ".join(f"{k.replace('_', ' ')} {v * 1e3:,.0f} ms"
                                        for k, v in t["terms_s"].items() if v))
    for x in t["collectives"]:
        lines.append(f"  {x['name']:22s} {x['bytes_per_device'] / GIB:9.2f} GiB sent per device per step, "
                     f"{'within a host' if x['within_host'] else 'across hosts'}, {x['seconds'] * 1e3:,.0f} ms")
    lines.append(f"layout: {d['overrides']}")
    return "\n".join(lines)
