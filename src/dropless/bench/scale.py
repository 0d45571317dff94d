"""`dropless bench scale`: weak scaling of the real training step with expert parallelism, per dispatch strategy.

    dropless bench scale --preset deepseek-v3-proxy [--devices 1,2,4,8] [--strategies allgather,alltoall,ragged]
                         [--fsdp] [--out benchmarks/results/scale-{device}.json] [key=value ...]

The per-device batch (`train.batch_size` of the config, default the preset's) stays fixed and the global batch
grows with the devices. For each device count N > 1 and each strategy the step runs on the mesh `expert = N`
(experts spread over all devices); with `--fsdp`, also on every `fsdp x expert` mesh of the largest N with both
axes >= 2. Each program is compiled once (on GPUs without command buffers, so that the trace shows every
kernel), timed like `dropless bench step` (median step time), then traced for two steps and broken down by
`dropless.bench.profile`. Per record: step time, tokens/s and model TFLOPS per device, weak-scaling efficiency
(tokens/s per device over the one-device figure of the same run), the communication share of kernel time and its
kinds, rows sent per device with and without deduplication, alltoall overflows and tokens dropped (0).
Results: benchmarks/results/scale-<device>.json; `--table` prints the BENCHMARKS.md table.
"""

from __future__ import annotations

import argparse
import math
import sys

import jax

from dropless.bench import report
from dropless.bench.profile import PROFILE_COMPILER_OPTIONS
from dropless.bench.records import environment, results_path, write_json
from dropless.bench.runner import Runner, Variant, compile_variants
from dropless.core import xla_flags
from dropless.core.arguments import ArgumentParser, check_choices, check_count, check_seconds
from dropless.core.config import ConfigError, build_config, parse_overrides
from dropless.train import metrics as metrics_lib
from dropless.train.setup import fit_check

STRATEGIES = ("allgather", "alltoall", "ragged")


def mesh_layouts(devices: list[int], fsdp: bool) -> list[tuple[int, int]]:
    """(fsdp, expert) per measured mesh: (1, N) for every N in `devices`, plus, with `fsdp`, every split of the
    largest N into fsdp x expert with both >= 2."""
    layouts = [(1, n) for n in devices]
    if fsdp:
        largest = max(devices)
        layouts += [(f, largest // f) for f in range(2, largest // 2 + 1) if largest % f == 0]
    return layouts


def scale_variants(base_config, devices: list[int], strategies: list[str], fsdp: bool) -> list[Variant]:
    """One Variant per (mesh, strategy); one device needs no dispatch, so it is measured once."""
    options = dict(PROFILE_COMPILER_OPTIONS) if jax.default_backend() == "gpu" else {}
    per_device = base_config.train.batch_size
    variants = []
    for f, e in mesh_layouts(devices, fsdp):
        n = f * e
        for strategy in (strategies if n > 1 else ["none"]):
            overrides = {"parallel.data": 1, "parallel.fsdp": f, "parallel.expert": e,
                         "train.batch_size": per_device * n}
            if n > 1:
                overrides["moe.dispatch"] = strategy
            key = f"{n}:fsdp={f},expert={e}:{strategy}"
            variants.append(Variant(key, overrides, options, n, profile_after=True))
    return variants


def scaling_records(records: dict[str, dict]) -> list[dict]:
    """Flat records with the weak-scaling efficiency against the one-device record (pure, testable)."""
    single = next((r for k, r in records.items() if k.startswith("1:") and r.get("status") == "ok"), None)
    base = single and single["tokens_per_s_per_device"]
    rows = []
    for key, r in records.items():
        devices, mesh, strategy = key.split(":")
        row = {"key": key, "devices": int(devices), "mesh": mesh, "strategy": strategy, "status": r.get("status")}
        if r.get("status") == "ok":
            breakdown = r.get("breakdown") or {}
            row.update(step_ms=r["step_ms"], tokens_per_s_per_device=r["tokens_per_s_per_device"],
                       model_tflops_per_device=r["model_tflops_per_device"],
                       efficiency=r["tokens_per_s_per_device"] / base if base else None,
                       comm_share=breakdown.get("communication_share"),
                       comm_ms_by_kind={k: v for k, v in breakdown.get("communication_ms_per_step_per_device",
                                                                         {}).items() if v},
                       rows_sent_per_device=r["rows_sent"] / int(devices),
                       rows_sent_without_dedup_per_device=r["rows_sent_without_dedup"] / int(devices),
                       dispatch_overflows=r["dispatch_overflows"], tokens_dropped=r["tokens_dropped"],
                       peak_device_gib=r.get("peak_device_gib"))
        rows.append(row)
    return rows


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dropless bench scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="deepseek-v3-proxy", help="a preset name (see 'dropless presets')")
    p.add_argument("--devices", default="1,2,4,8", help="device counts (those above the devices present are skipped)")
    p.add_argument("--strategies", default="", help=f"comma-separated from {', '.join(STRATEGIES)} "
                                                    "(default: all that the platform runs)")
    p.add_argument("--fsdp", action="store_true", help="also every fsdp x expert mesh of the largest device count")
    p.add_argument("--steps", type=int, default=5, help="timed steps (at most)")
    p.add_argument("--seconds", type=float, default=2.0, help="stop timing after this long (at least 3 steps)")
    p.add_argument("--out", default="benchmarks/results/scale-{device}.json", help="results JSON ({device} filled in)")
    p.add_argument("--table", action="store_true", help="print the markdown table at the end")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides; train.batch_size is the per-device batch")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    check_count("--steps", args.steps)
    check_seconds("--seconds", args.seconds)
    xla_flags.apply()  # before JAX starts a backend
    try:
        wanted = sorted({int(n) for n in args.devices.split(",") if n})
    except ValueError:
        raise ConfigError(f"--devices {args.devices!r} must be comma-separated integers, e.g. 1,2,4,8.") from None
    if not_counts := [n for n in wanted if n < 1]:
        raise ConfigError(f"--devices: {', '.join(map(str, not_counts))} is not a number of devices; give counts of "
                          "1 or more, e.g. 1,2,4,8.")
    devices = [n for n in wanted if n <= jax.device_count()]
    skipped = [n for n in wanted if n not in devices]
    platform = jax.default_backend()
    strategies = [s for s in args.strategies.split(",") if s] or [
        s for s in STRATEGIES if s != "ragged" or platform == "gpu"]
    check_choices("--strategies", strategies, STRATEGIES)
    if not devices or devices[0] != 1:
        raise ConfigError("weak scaling is measured against one device; include 1 in --devices.")
    config = build_config(args.preset, parse_overrides(args.overrides))
    env = environment()
    out = results_path(args.out, env["device"])  # before compiling: the record is written at the end
    say = lambda message: print(message, flush=True)
    if skipped:
        say(f"dropless: skipping {skipped} devices: only {jax.device_count()} present")
    variants = scale_variants(config, devices, strategies, args.fsdp)
    for overrides, n in {(tuple(v.overrides.items()), v.devices): None for v in variants}:
        # As `dropless train` would refuse each layout, before anything compiles: the layout as given, never
        # another that train.auto_fit might choose.
        fit_check(config.replace(**dict(overrides), **{"train.auto_fit": False}), jax.devices()[:n], log=say)
    programs = compile_variants(config, variants, log=say)
    runner = Runner(None, metrics_lib.device_peak_tflops(env["device"]), math.inf, say, steps=args.steps,
                    seconds=args.seconds)
    records = {}
    for key, program in sorted(programs.items(), key=lambda item: item[1].variant.devices):
        records[key] = runner.run(program)
        say(f"{key:32s} {records[key]['status']}" + (f" {records[key]['step_ms']:.1f} ms" if records[key].get("step_ms") else ""))
    rows = scaling_records(records)
    if not any(r["status"] == "ok" for r in rows):
        raise ConfigError(f"no layout ran ({rows[0]['key']}: {rows[0]['status']}); nothing was written to {out}.")
    write_json(out, {"preset": args.preset, "per_device_batch": config.train.batch_size,
                     "seq_len": config.train.seq_len, "overrides": args.overrides,
                     "devices_skipped": skipped, "environment": env, "records": rows, "raw": records})
    if args.table:
        say(report.scale_markdown(rows))
    say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
