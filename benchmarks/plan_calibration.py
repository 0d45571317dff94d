"""Measured peak device memory and step time of training-step configurations: what `dropless plan` is checked against.

    python benchmarks/plan_calibration.py --out benchmarks/results/plan-calibration-h200.json

Peak memory is a property of a process (the allocator's `peak_bytes_in_use` only grows), so each configuration
runs in its own subprocess. Compiling a proxy step takes about a minute, so the parent first compiles every
configuration at once, in threads, into JAX's persistent compilation cache; each subprocess then lowers its
step again and loads the compiled program from that cache, allocates the state, runs the timed steps and
reports: `peak_bytes_in_use` and `bytes_in_use` after the state is allocated (the device allocator's own
figures), the compiled program's `memory_analysis()`, and the median step time.

`--preset tiny --configs small` runs the same measurement on whatever device is present (a CPU in the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROXY = "deepseek-v3-proxy"
QWEN = "qwen3-30b-a3b"
QWEN_SMALL = {"model.num_layers": 4, "train.batch_size": 4}

# key -> (preset, overrides): batch 1/4/8 x remat, optimizer offload, bf16 moments, FP8, a second family.
CONFIGS = {
    "proxy-b8": (PROXY, {}),
    "proxy-b8-remat-moe": (PROXY, {"train.remat": "moe"}),
    "proxy-b8-remat-full": (PROXY, {"train.remat": "full"}),
    "proxy-b4": (PROXY, {"train.batch_size": 4}),
    "proxy-b4-remat-full": (PROXY, {"train.batch_size": 4, "train.remat": "full"}),
    "proxy-b1": (PROXY, {"train.batch_size": 1}),
    "proxy-b1-remat-full": (PROXY, {"train.batch_size": 1, "train.remat": "full"}),
    "proxy-b8-offload-optimizer": (PROXY, {"train.offload_optimizer": True}),
    "proxy-b8-bf16-moments": (PROXY, {"train.optimizer_moments_dtype": "bfloat16"}),
    "proxy-b8-fp8-blockwise": (PROXY, {"train.fp8": "blockwise"}),
    "qwen3-l4-b4": (QWEN, QWEN_SMALL),
    "qwen3-l4-b4-remat-full": (QWEN, {**QWEN_SMALL, "train.remat": "full"}),
}
SMALL = {
    "tiny": ("tiny", {"train.batch_size": 2, "train.seq_len": 64}),
    "tiny-remat-full": ("tiny", {"train.batch_size": 2, "train.seq_len": 64, "train.remat": "full"}),
}


def _config(preset: str, overrides: dict):
    from dropless.core.config import build_config
    return build_config(preset, {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in overrides.items()})


def _use_cache(cache: str) -> None:
    import jax
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def compile_all(configs: dict, cache: str) -> dict:
    """Compile every configuration in parallel threads into the persistent cache; returns compile seconds."""
    from dropless.bench import harness
    from dropless.core import xla_flags
    xla_flags.apply()
    _use_cache(cache)
    lowered = {}
    for key, (preset, overrides) in configs.items():
        lowered[key] = harness.lower(harness.build(_config(preset, overrides)))
    seconds = {}

    def compile_one(key):
        start = time.perf_counter()
        try:
            lowered[key].compile()
            seconds[key] = round(time.perf_counter() - start, 1)
        except Exception as error:  # noqa: BLE001 - one failing configuration must not stop the others
            seconds[key] = f"error: {harness.first_line(error)}"
        print(f"  compiled {key}: {seconds[key]}", flush=True)

    harness.compile_in_threads(compile_one, list(lowered))
    return seconds


def measure_one(preset: str, overrides: dict, cache: str, steps: int) -> dict:
    """In a fresh process: load the compiled step from the cache, allocate, time, and read the allocator's peak."""
    import jax
    from dropless.bench import harness
    from dropless.bench.harness import GIB
    from dropless.core import xla_flags
    from dropless.train import metrics as metrics_lib  # noqa: F401  (the step's metrics are plain arrays)
    xla_flags.apply()
    _use_cache(cache)
    device = jax.devices()[0]
    config = _config(preset, overrides)
    setup = harness.build(config)
    start = time.perf_counter()
    compiled = harness.lower(setup).compile()
    load_s = time.perf_counter() - start
    stats = compiled.memory_analysis()
    compiled_figures = {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in
                        ("argument", "output", "alias", "temp", "generated_code", "host_argument", "host_temp")} \
        if stats is not None else None
    state = harness.init_state(setup)
    batches = harness.random_batches(setup, 3)
    jax.block_until_ready((state, batches))
    after_state = (device.memory_stats() or {}).get("bytes_in_use")
    state, times, metrics = harness.time_steps(compiled, state, batches, warmup=2, steps=steps, seconds=4.0)
    memory = device.memory_stats() or {}
    return {
        "step_ms": 1e3 * statistics.median(times), "step_ms_all": [round(1e3 * t, 2) for t in times],
        "peak_bytes_in_use": memory.get("peak_bytes_in_use"), "bytes_in_use_after_state": after_state,
        "bytes_limit": memory.get("bytes_limit"), "compiled": compiled_figures,
        "compiled_peak_bytes": harness.peak_bytes(compiled), "compile_or_load_s": round(load_s, 1),
        "tokens_dropped": int(metrics["tokens_dropped"]), "loss": float(metrics["loss"]),
        "peak_gib": memory.get("peak_bytes_in_use", 0) / GIB,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON record to write")
    parser.add_argument("--configs", choices=("full", "small"), default="full")
    parser.add_argument("--only", help="comma-separated configuration keys")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cache", help="the compilation cache directory (default: a temporary one)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the subprocess: one key, prints one JSON line
    args = parser.parse_args(argv)
    configs = CONFIGS if args.configs == "full" else SMALL
    if args.only:
        configs = {k: configs[k] for k in args.only.split(",")}
    if args.one:
        preset, overrides = configs[args.one]
        print("RESULT " + json.dumps(measure_one(preset, overrides, args.cache, args.steps)), flush=True)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        cache = args.cache or scratch
        start = time.perf_counter()
        compile_s = compile_all(configs, cache)
        print(f"compiled {len(configs)} configurations in {time.perf_counter() - start:.0f} s", flush=True)
        results = {}
        for key, (preset, overrides) in configs.items():
            command = [sys.executable, __file__, "--out", args.out, "--configs", args.configs, "--one", key,
                       "--cache", cache, "--steps", str(args.steps)]
            done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
            line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
            result = json.loads(line[len("RESULT "):]) if line else \
                {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:400]}
            results[key] = {"preset": preset, "overrides": overrides, "compile_s": compile_s.get(key), **result}
            print(f"{key}: " + (f"{result['step_ms']:.1f} ms, peak {result['peak_gib']:.2f} GiB" if line
                                else result["error"]), flush=True)
    from dropless.bench.records import environment, write_json
    write_json(Path(args.out), {"benchmark": "plan-calibration", "environment": environment(), "results": results},
               indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
