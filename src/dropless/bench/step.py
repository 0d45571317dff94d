"""`dropless bench step`: the real training step, timed; and the optimisation ladder in one run.

    dropless bench step --preset deepseek-v3-proxy [key=value ...]
    dropless bench step --preset deepseek-v3-proxy --ladder [--out benchmarks/results]
    dropless bench step --chart benchmarks/results/step-h200.json      # redraw a ladder's PNG

One measurement compiles `dropless.train.step`'s train step (the same jitted, donated step the trainer runs;
`dropless.bench.harness`), runs `--warmup` steps, then times steps one by one (each ended by a device sync)
until `--steps` are timed or `--seconds` have passed, and reports the median step time, tokens/s, model
TFLOPS per device (`dropless.models.flops` x tokens/s, `dropless.train.metrics.throughput`), MFU against the
dense bf16 matmul rate measured in the same process and against the datasheet peak, the compiled program's
peak device memory, and the tokens the step dropped (`dropless.bench.runner`).

`--ladder` runs the eight rungs of `dropless.bench.ladder` instead and writes step-<device>.json and its chart.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import jax

from dropless.bench import report
from dropless.bench.harness import dense_matmul_tflops
from dropless.bench.ladder import RUNGS, run_ladder
from dropless.bench.records import environment, write_json
from dropless.bench.runner import Runner, Variant, compile_variants
from dropless.core import xla_flags
from dropless.core.arguments import ArgumentParser, check_count, check_output, check_seconds
from dropless.core.config import ConfigError, build_config, parse_overrides
from dropless.train import metrics as metrics_lib
from dropless.train.setup import fit_check


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="dropless bench step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="deepseek-v3-proxy", help="a preset name (see 'dropless presets')")
    parser.add_argument("--ladder", action="store_true", help="run the whole optimisation ladder")
    parser.add_argument("--out", default="benchmarks/results", help="where the ladder writes step-<device>.json/.png")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (at most)")
    parser.add_argument("--seconds", type=float, default=5.0, help="stop timing after this long (at least 3 steps)")
    parser.add_argument("--budget", type=float, default=1e9, help="ladder: skip the phases not started within this many seconds")
    parser.add_argument("--tuned-backend", default="dropless_mosaic", help="ladder rung 4: the tuned grouped GEMM's moe.gmm_backend")
    parser.add_argument("--default-backend",
                        help="ladder rung 3: the moe.gmm_backend running tokamax's kernel with its default heuristics "
                             "(default on GPUs: tokamax_mosaic; 'none' skips the rung)")
    parser.add_argument("--ep-devices", type=int, default=2, help="ladder rung 8: devices for expert parallelism")
    parser.add_argument("--rungs", help="ladder: comma-separated rungs to run, e.g. 1,4,5 (default: all eight)")
    parser.add_argument("--traces", help="ladder: keep the profiled programs' traces and HLO texts in this directory")
    parser.add_argument("--compile-workers", type=int, help="ladder: programs compiled at once (default: all of a phase)")
    parser.add_argument("--compilation-cache", metavar="DIR",
                        help="JAX's persistent compilation cache: a second run on the same machine skips compiling")
    parser.add_argument("--chart", metavar="JSON", help="only redraw the PNG of a ladder's JSON file")
    parser.add_argument("--pgle", action="store_true",
                        help="one step (no --ladder): profile three steps, then compile again with their measured "
                             "kernel costs (profile-guided latency estimation) before timing")
    parser.add_argument("--record", metavar="JSON",
                        help="one step (no --ladder): also save the measurement, the environment and the config here")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. moe.gmm_backend=xla")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    if args.chart:
        path = Path(args.chart)
        try:
            ladder = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            ladder = None
        # JSON of another kind (a list, another benchmark's record) has no rungs to draw
        if not (isinstance(ladder, dict) and isinstance(ladder.get("ladder"), list)
                and all(isinstance(rung, dict) for rung in ladder["ladder"])):
            raise ConfigError(f"--chart {path} is not a JSON record; give the step-<device>.json a ladder wrote.")
        print(f"dropless: wrote {report.ladder_chart(ladder, path.with_suffix('.png'))}")
        return 0
    try:
        rungs = {int(r) for r in args.rungs.split(",")} if args.rungs else None
    except ValueError:
        rungs = {0}
    if not (args.budget >= 0):
        raise ConfigError(f"--budget {args.budget} must be a number of seconds, 0 or more.")
    check_count("--steps", args.steps)
    check_count("--warmup", args.warmup, 0)
    check_seconds("--seconds", args.seconds)
    check_count("--ep-devices", args.ep_devices)
    if args.compile_workers is not None:
        check_count("--compile-workers", args.compile_workers)
    if rungs is not None and not rungs <= set(RUNGS):
        print(f"dropless: error: --rungs {args.rungs!r} must list rungs from 1 to {max(RUNGS)}, e.g. --rungs 1,4,5.",
              file=sys.stderr)
        return 2
    if args.compilation_cache:  # JAX would only warn, once per program, that it cannot write there
        check_output("--compilation-cache", args.compilation_cache, directory=True)
    if args.record:  # checked now, not after minutes of compiling and timing (a missing folder is created then)
        check_output("--record", args.record)
    if args.ladder:
        check_output("--out", args.out, directory=True)
    if args.traces:
        check_output("--traces", args.traces, directory=True)
    xla_flags.apply()  # before JAX starts a backend
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    config = build_config(args.preset, parse_overrides(args.overrides))
    if not args.ladder:  # the ladder's rungs change the layout, and each reports its own out-of-memory
        config = fit_check(config, log=_progress)  # as `dropless train` would refuse it, before compiling
    timing = {"warmup": args.warmup, "steps": args.steps, "seconds": args.seconds}
    if args.ladder:
        default_backend = args.default_backend or ("tokamax_mosaic" if jax.default_backend() == "gpu" else None)
        run_ladder(config, Path(args.out), budget_s=args.budget, tuned_backend=args.tuned_backend,
                   default_backend=None if default_backend == "none" else default_backend,
                   ep_devices=args.ep_devices, preset=args.preset, traces_dir=args.traces and Path(args.traces),
                   timing=timing, compile_workers=args.compile_workers, rungs=rungs,
                   log=lambda s: print(s, flush=True))
        return 0
    return _one_step(args, config, timing)


def _progress(line: str) -> None:
    """Lowering and compiling a large step take minutes: say where it is on stderr (the result stays on stdout)."""
    print("dropless: " + line.strip().removeprefix("dropless: "), file=sys.stderr, flush=True)


def _one_step(args, config, timing: dict) -> int:
    """Time the step of `config` on all devices, print one line, and save it with --record."""
    gpu = jax.default_backend() == "gpu"
    dense = dense_matmul_tflops() if gpu else None
    peak = metrics_lib.device_peak_tflops(jax.devices()[0].device_kind)
    programs = compile_variants(config, [Variant("step", devices=jax.device_count(), pgle=args.pgle)], log=_progress)
    runner = Runner(dense, peak, math.inf, **timing)
    record = runner.run(programs["step"])
    if record["status"] != "ok":
        print(f"dropless: {record['status']}", file=sys.stderr)
        return 1
    print(f"step {record['step_ms']:.1f} ms (median of {record['steps_timed']}), {record['tokens_per_s']:,.0f} tokens/s, "
          f"{record['model_tflops_per_device']:.1f} model TFLOPS per device"
          + (f", {100 * record['mfu_vs_measured_dense']:.0f}% of the measured dense rate ({dense:.0f})" if dense else "")
          + (f", MFU {100 * record['mfu_vs_datasheet_peak']:.0f}% of the datasheet peak" if record["mfu_vs_datasheet_peak"] else "")
          + f"; peak memory {record['peak_device_gib']:.2f} GiB; tokens dropped {record['tokens_dropped']}"
          + (f"; PGLE {record['pgle']}" if "pgle" in record else ""))
    if args.record:
        saved = {"preset": args.preset, "overrides": args.overrides, "environment": environment(),
                 "dense_tflops": dense, "datasheet_peak_tflops": peak, "config": config.to_dict(),
                 "xla_flags_env": os.environ.get("XLA_FLAGS", ""), "record": record}
        try:
            Path(args.record).parent.mkdir(parents=True, exist_ok=True)
            write_json(Path(args.record), saved)
        except OSError as error:
            print(f"dropless: error: cannot write --record {args.record} ({error.strerror}); pass a writable path.",
                  file=sys.stderr)
            return 2
    return 0
