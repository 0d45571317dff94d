"""`dropless bench memory`: where the bytes of a training step go, per device, before a long run finds out.

    dropless bench memory --preset deepseek-v3-proxy
    dropless bench memory --preset deepseek-v3-671b --devices 256 parallel.fsdp=32 parallel.expert=8 train.batch_size=256

The real train step is lowered from abstract shapes (`dropless.bench.harness.lower`) and compiled, and nothing
is allocated, so a 671B model can be analysed on a laptop: `--devices N` makes N virtual CPU devices. Two
sources are combined, per device:

- arithmetic from shapes and shardings: parameters, gradients (float32, like the master weights; twice that
  with `train.grad_accum_steps` > 1: the running sum and one microbatch's) and optimizer state, each in
  device or pinned host memory;
- activations: the residuals the backward pass keeps (the outputs of `jax.vjp`'s forward), those that grow
  with the batch (one microbatch's with gradient accumulation), split over the devices that split the batch.
  They follow `train.remat` and `train.offload`;
- the compiled program's `memory_analysis()`: arguments, outputs, aliasing (donation) and XLA's temporary
  buffer. `temporaries` is what that buffer holds beyond the gradients and activations (matmul
  workspace, bfloat16 weight copies, recomputation).

The compiled figures are the compiler's for the backend you run on: XLA:CPU's buffer assignment differs from
XLA:GPU's (fusion, the lowering of `ragged_dot`), so a CPU analysis of a GPU run is an estimate; on the GPU
itself the same command gives the GPU's numbers.
"""

from __future__ import annotations

import argparse
import math
import os

import jax

from dropless.bench import harness
from dropless.bench.harness import GIB, batch_shape
from dropless.bench.records import write_json
from dropless.core import xla_flags
from dropless.core.config import ConfigError, build_config, parse_overrides
from dropless.ep import make_executor
from dropless.models import transformer
from dropless.train.step import loss_fn


def _shard_bytes(shape, sharding) -> int:
    return math.prod(sharding.shard_shape(shape.shape)) * shape.dtype.itemsize


def tree_bytes_per_device(shapes, shardings, memory_kind: str | None = None) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs under its shardings (optionally of one memory kind)."""
    def kind(sharding) -> str:
        return sharding.memory_kind or "device"

    total = 0
    for shape, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)):
        if memory_kind is None or kind(sharding) == memory_kind:
            total += _shard_bytes(shape, sharding)
    return total


def residual_bytes(config, executor=None) -> tuple[int, int]:
    """(bytes that grow with the batch, bytes that do not) of the residuals the backward pass keeps, global.

    The residuals are the non-input outputs of `jax.vjp`'s forward; tracing at batch B and 2B tells the
    activations (which double) from saved weight casts (which do not).
    """
    params = jax.eval_shape(lambda: transformer.init_params(jax.random.key(0), config))
    model_state = jax.eval_shape(lambda: transformer.init_state(config))

    def residuals(batch_size: int) -> list[tuple[tuple, object]]:
        batch = batch_shape(config)
        batch = jax.ShapeDtypeStruct((batch_size, batch.shape[1]), batch.dtype)

        def forward(p, s, b):
            return jax.vjp(lambda q: loss_fn(q, s, b, config, executor)[0], p)[1]

        closed = jax.make_jaxpr(forward)(params, model_state, batch)
        inputs = set(map(id, closed.jaxpr.invars))
        return [(tuple(v.aval.shape), v.aval.dtype) for v in closed.jaxpr.outvars
                if hasattr(v, "aval") and id(v) not in inputs and hasattr(v.aval, "shape")]

    def nbytes(entry) -> int:
        shape, dtype = entry
        return math.prod(shape) * dtype.itemsize

    base = config.train.batch_size // config.train.grad_accum_steps  # one microbatch's residuals are alive at a time
    single, double = residuals(base), residuals(2 * base)
    if len(single) != len(double):  # the program's structure changed with the batch: count all as activations
        return sum(map(nbytes, single)), 0
    grows = sum(nbytes(a) for a, b in zip(single, double) if nbytes(b) > nbytes(a))
    return grows, sum(map(nbytes, single)) - grows


def memory_report(config, devices=None, *, compiled=None) -> dict:
    """Per-device bytes of a training step: parameters, gradients, optimizer state, activations, temporaries,
    the compiled program's own figures, and the peak estimate. Nothing is allocated."""
    setup = harness.build(config, devices)
    compiled = compiled or harness.lower(setup).compile()
    stats = compiled.memory_analysis()
    shapes, shardings = setup.state_shapes, setup.state_shardings
    params = tree_bytes_per_device(shapes.params, shardings.params)
    activations_global, _ = residual_bytes(config, make_executor(config, setup.mesh))
    activations = activations_global // setup.mesh.size
    # float32 gradients, sharded like the float32 master weights; with gradient accumulation, the running sum
    # and one microbatch's
    gradients = params * (2 if config.train.grad_accum_steps > 1 else 1)
    host_state = tree_bytes_per_device(shapes, shardings, "pinned_host")
    argument, output, alias, temp = (int(getattr(stats, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp"))
    # XLA:CPU counts host-memory arguments as device arguments; XLA:GPU reports them separately.
    host_counted_as_device = host_state if int(stats.host_argument_size_in_bytes) == 0 else 0
    peak = argument + output - alias + temp - host_counted_as_device
    device = setup.mesh.devices.flat[0]
    limit = (device.memory_stats() or {}).get("bytes_limit") if hasattr(device, "memory_stats") else None
    return {
        "devices": setup.mesh.size,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "mesh": dict(setup.mesh.shape),
        "batch_per_device": config.train.batch_size / setup.mesh.size,
        "seq_len": config.train.seq_len,
        "remat": config.train.remat,
        "offload": config.train.offload,
        "offload_optimizer": config.train.offload_optimizer,
        "optimizer_moments_dtype": config.train.optimizer_moments_dtype,
        "per_device_bytes": {
            "parameters": params,
            "gradients": gradients,
            "optimizer_state": tree_bytes_per_device(shapes.opt_state, shardings.opt_state),
            "activations": activations,
            "temporaries": max(0, temp - gradients - activations),
        },
        "in_host_memory_bytes": host_state,
        "compiled": {"argument": argument, "output": output, "alias": alias, "temp": temp,
                     "host_argument": int(stats.host_argument_size_in_bytes),
                     "host_temp": int(stats.host_temp_size_in_bytes)},
        "peak_device_bytes": peak,
        "device_memory_bytes": limit,
    }


def format_report(report: dict, device_memory: float | None = None) -> str:
    """A short table; `device_memory` (bytes) overrides the limit the devices report."""
    limit = device_memory or report["device_memory_bytes"]
    parts = report["per_device_bytes"]
    host = report["in_host_memory_bytes"]
    notes = {
        "parameters": "float32 master weights",
        "gradients": "float32",
        "optimizer_state": f"AdamW moments in {report['optimizer_moments_dtype']}"
                           + (", pinned host memory" if report["offload_optimizer"] else ""),
        "activations": f"kept for the backward pass, train.remat={report['remat']}"
                       + (f", offloaded: {report['offload']}" if report["offload"] else ""),
        "temporaries": "the rest of XLA's scratch buffer",
    }
    lines = [f"per device ({report['devices']} {report['platform']} device(s), mesh {report['mesh']}, "
             f"{report['batch_per_device']:g} sequences of {report['seq_len']} per device):"]
    for key, value in parts.items():
        lines.append(f"  {key.replace('_', ' '):17s} {value / GIB:9.2f} GiB  {notes[key]}")
    if host:
        lines.append(f"  {'(in host memory)':17s} {host / GIB:9.2f} GiB")
    peak = report["peak_device_bytes"]
    verdict = ""
    if limit:
        verdict = f" of {limit / GIB:.1f} GiB: " + ("fits" if peak <= limit else "DOES NOT FIT")
    lines.append(f"  {'peak (compiled)':17s} {peak / GIB:9.2f} GiB{verdict}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dropless bench memory",
                                     description="Per-device memory of a training step, from the compiled program.")
    parser.add_argument("--preset", default="tiny", help="a preset name (see 'dropless presets')")
    parser.add_argument("--devices", type=int,
                        help="analyse on N virtual CPU devices (any size of mesh, nothing allocated)")
    parser.add_argument("--device-memory-gib", type=float, help="memory per device to check against (e.g. 141)")
    parser.add_argument("--json", help="also write the report as JSON to this file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. parallel.expert=8")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.devices is not None:
        if args.devices < 1:
            raise ConfigError(f"--devices={args.devices} must be >= 1.")
        if jax._src.xla_bridge.backends_are_initialized():
            raise ConfigError("--devices must be set before JAX starts; run 'dropless bench memory' in a fresh process.")
        # JAX reads both when it starts its first backend: N virtual CPU devices, whatever accelerator is present.
        jax.config.update("jax_platforms", "cpu")
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
    else:
        xla_flags.apply()
    config = build_config(args.preset, parse_overrides(args.overrides))
    report = memory_report(config)
    report["preset"] = args.preset
    print(format_report(report, args.device_memory_gib * GIB if args.device_memory_gib else None))
    if args.json:
        write_json(args.json, report, indent=2)
    return 0
