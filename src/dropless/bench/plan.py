"""`dropless plan`: will a training step fit, and how fast will it run, on a given cluster (no device needed).

    dropless plan --preset deepseek-v3-proxy
    dropless plan --preset deepseek-v3-671b --hosts 32 --gpus-per-host 8 parallel.fsdp=16 parallel.expert=8
    dropless plan --preset deepseek-v3-671b --devices 256 --search

The plan itself is `dropless.plan` (arithmetic over shapes and shardings, docs/planning.md). This command prints
it, writes it as JSON (`--json`), searches the layouts that fit (`--search`), and on a machine with devices
(`--compiled`) also compiles the real step (`dropless.bench.harness`) and reports XLA's `memory_analysis()`
beside the plan, with the difference.
"""

from __future__ import annotations

import argparse
import math

from dropless.bench import harness
from dropless.bench.records import write_json
from dropless.core import xla_flags
from dropless.core.arguments import ArgumentParser, check_count, check_output
from dropless.core.config import ConfigError, build_config, parse_overrides
from dropless.plan import Cluster, format_plan, make_plan, search
from dropless.plan.cost import load_rates, rate_key
from dropless.plan.report import GIB, layout_overrides

SEARCH_SHOWN = 10


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="dropless plan",
                                     description="Per-device memory, FLOPs, collectives and step time of a training "
                                                 "step, before anything is compiled (docs/planning.md).")
    parser.add_argument("--preset", default="tiny", help="a preset name (see 'dropless presets')")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--devices", type=int, help="N devices (hosts of 8 when N > 8)")
    size.add_argument("--hosts", type=int, help="hosts (with --gpus-per-host)")
    parser.add_argument("--gpus-per-host", type=int, help="GPUs per host (default 8, or --devices when <= 8)")
    parser.add_argument("--device", default="H200", help="the device kind: a key of the rate table (default H200)")
    parser.add_argument("--device-memory-gib", type=float, help="memory per device to plan against (default: "
                        "train.device_memory_gib where set, as training plans, else the rate table's figure)")
    parser.add_argument("--rates", help="a rate table written by 'dropless bench rates --out' (default: the packaged "
                        "one)")
    parser.add_argument("--json", help="also write the plan (and the search) as JSON to this file")
    parser.add_argument("--search", action="store_true", help="list the fastest layouts that fit")
    parser.add_argument("--compiled", action="store_true",
                        help="also compile the step on this machine's devices and compare XLA's memory analysis")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. parallel.expert=8")
    return parser


def cluster_from_args(args) -> Cluster:
    for flag, value in (("--devices", args.devices), ("--hosts", args.hosts), ("--gpus-per-host", args.gpus_per_host)):
        if value is not None:
            check_count(flag, value)
    if args.hosts is not None:
        return Cluster(args.hosts, args.gpus_per_host or 8, args.device)
    devices = args.devices or 1
    per_host = args.gpus_per_host or min(devices, 8)
    if devices % per_host:
        raise ConfigError(f"--devices={devices} is not a whole number of hosts of --gpus-per-host={per_host}; "
                          "give a multiple of it.")
    return Cluster(devices // per_host, per_host, args.device)


def check_memory_flag(value: float | None) -> None:
    """--device-memory-gib: a finite number of GiB above 0 (or absent: the rate table's figure)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--device-memory-gib={value} must be a finite number of GiB above 0; leave it out to plan "
                          "against the rate table's figure for the device.")


def memory_analysis(compiled) -> dict | None:
    """XLA's memory analysis of a compiled step (bytes): arguments, outputs, donated aliases, temporaries, host
    memory, and the peak they imply; None where the backend gives none."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # an executable loaded from the compilation cache may have none on some backends
        return None
    if stats is None:
        return None
    out = {k: int(getattr(stats, f"{k}_size_in_bytes", 0) or 0)
           for k in ("argument", "output", "alias", "temp", "host_argument", "host_temp")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def compiled_memory(config, devices: int) -> dict:
    """XLA's memory analysis of the real step compiled for the first `devices` of this machine's devices."""
    available = harness.jax.devices()
    if devices > len(available):
        raise ConfigError(f"--compiled needs the plan's {devices} devices but this machine has {len(available)}; "
                          "plan for fewer devices or drop --compiled.")
    setup = harness.build(config, available[:devices])
    out = memory_analysis(harness.lower(setup).compile()) or {"peak": 0, "argument": 0, "temp": 0}
    out["platform"] = available[0].platform
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    if args.json:  # written last, after the search and the compile (--compiled)
        check_output("--json", args.json, inputs={"--rates": args.rates})
    config = build_config(args.preset, parse_overrides(args.overrides))
    cluster = cluster_from_args(args)
    check_memory_flag(args.device_memory_gib)
    # The limit training's own fit check takes, unless the flag names another.
    memory_gib = args.device_memory_gib or config.train.device_memory_gib or None
    rates = load_rates(args.rates)
    plan = make_plan(config, cluster, device_memory_gib=memory_gib, rates=rates)
    print(format_plan(plan))
    record = {"preset": args.preset, "plan": plan.to_dict()}
    if args.compiled:
        xla_flags.apply()
        here = harness.jax.devices()[0]
        planned_for = rates[cluster.device].get("platform")
        if planned_for and planned_for != here.platform:  # XLA's analysis of another platform's program
            raise ConfigError(f"--compiled compiles the step on this machine, a {here.platform}, but the plan is for "
                              f"{cluster.device} ({planned_for}); run it where the plan's device is, or plan for "
                              f"--device {rate_key(rates, here.device_kind, here.platform)}.")
        compiled = compiled_memory(config, cluster.devices)
        diff = plan.memory.peak - compiled["peak"]
        print(f"compiled ({compiled['platform']}): peak {compiled['peak'] / GIB:.2f} GiB (arguments "
              f"{compiled['argument'] / GIB:.2f}, temporaries {compiled['temp'] / GIB:.2f}); the plan says "
              f"{plan.memory.peak / GIB:.2f} GiB, {diff / GIB:+.2f} GiB ({diff / max(compiled['peak'], 1):+.1%})")
        record["compiled"] = compiled
    if args.search:
        found = search(config, cluster, device_memory_gib=memory_gib, rates=rates)
        if not found:
            print(f"search: no layout of train.batch_size={config.train.batch_size} fits on {cluster.devices} x "
                  f"{cluster.device}; use more devices or a smaller batch.")
        else:
            print(f"search: {len(found)} layouts fit; the fastest {min(len(found), SEARCH_SHOWN)}:")
            print(f"  {'step ms':>9s} {'tokens/s':>11s} {'peak GiB':>9s}  key=value")
            for p in found[:SEARCH_SHOWN]:
                print(f"  {p.time['seconds'] * 1e3:9,.0f} {p.time['tokens_per_s']:11,.0f} "
                      f"{p.memory.peak / GIB:9.1f}  {layout_overrides(p.config)}")
        record["search"] = [{"overrides": layout_overrides(p.config), "step_s": p.time["seconds"],
                             "tokens_per_s": p.time["tokens_per_s"], "peak_bytes": p.memory.peak}
                            for p in found[:SEARCH_SHOWN]]
    if args.json:
        write_json(args.json, record, indent=2)
    return 0
