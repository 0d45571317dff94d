"""Measured peak device memory and step time of training-step configurations: what `dropless plan` is checked against.

    python benchmarks/plan_calibration.py --out benchmarks/results/plan-calibration-h200.json

Peak memory is a property of a process (the allocator's `peak_bytes_in_use` only grows, and a process keeps
what its allocator has grown to), so each configuration is measured in a fresh subprocess, one at a time. Compiling
a proxy step takes one to two minutes, so first one subprocess per configuration compiles its step into JAX's
persistent compilation cache, all at once (XLA_PYTHON_CLIENT_PREALLOCATE=false), and exits; then each
measuring subprocess lowers its step again, loads the compiled program from the cache, allocates the state, runs
the timed steps, and reports `peak_bytes_in_use` and `bytes_in_use` after the state is allocated (the device
allocator's own figures), the compiled program's `memory_analysis()`, and the median step time. The record is rewritten as each configuration finishes, so a
run cut short keeps what it measured.

`--configs small` runs the same measurement with the tiny preset on whatever device is present (a CPU in tests).
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
    "proxy-b8-fp8-rowwise": (PROXY, {"train.fp8": "rowwise"}),
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


def measure_one(preset: str, overrides: dict, cache: str, steps: int, compile_only: bool) -> dict:
    """In a fresh process: compile (or load from the cache); unless `compile_only`, allocate, time, and read the
    allocator's peak."""
    import jax
    from dropless.bench import harness
    from dropless.bench.harness import GIB
    from dropless.core import xla_flags
    xla_flags.apply()
    _use_cache(cache)
    device = jax.devices()[0]
    setup = harness.build(_config(preset, overrides))
    start = time.perf_counter()
    compiled = harness.lower(setup).compile()
    compile_s = time.perf_counter() - start
    stats = compiled.memory_analysis()
    compiled_figures = {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in
                        ("argument", "output", "alias", "temp", "generated_code", "host_argument", "host_temp")} \
        if stats is not None else None
    if compile_only:
        return {"compile_s": round(compile_s, 1)}
    state = harness.init_state(setup)
    batches = harness.random_batches(setup, 3)
    jax.block_until_ready((state, batches))
    after_state = (device.memory_stats() or {}).get("bytes_in_use")
    state, times, metrics = harness.time_steps(compiled, state, batches, warmup=2, steps=steps, seconds=4.0)
    memory = device.memory_stats() or {}
    return {
        "step_ms": 1e3 * statistics.median(times), "step_ms_all": [round(1e3 * t, 2) for t in times],
        "peak_bytes_in_use": memory.get("peak_bytes_in_use"), "bytes_in_use_after_state": after_state,
        "peak_gib": (memory.get("peak_bytes_in_use") or 0) / GIB,
        "compiled": compiled_figures, "compiled_peak_bytes": harness.peak_bytes(compiled),
        "load_s": round(compile_s, 1),
        "tokens_dropped": int(metrics["tokens_dropped"]), "loss": float(metrics["loss"]),
    }


def _result(stdout: str, stderr: str) -> dict:
    line = next((l for l in stdout.splitlines() if l.startswith("RESULT ")), None)
    return json.loads(line[len("RESULT "):]) if line else \
        {"error": (stderr.strip().splitlines() or ["no output"])[-1][:400]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON record to write")
    parser.add_argument("--configs", choices=("full", "small"), default="full")
    parser.add_argument("--only", help="comma-separated configuration keys")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the subprocess: one key, prints one JSON line
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    configs = CONFIGS if args.configs == "full" else SMALL
    if args.only:
        configs = {k: configs[k] for k in args.only.split(",")}
    if args.one:
        preset, overrides = configs[args.one]
        print("RESULT " + json.dumps(measure_one(preset, overrides, args.cache, args.steps, args.compile_only)), flush=True)
        return 0
    from dropless.bench.records import environment, write_json
    record = {"benchmark": "plan-calibration", "environment": environment(), "results": {}}
    with tempfile.TemporaryDirectory() as cache:
        def command(key: str, *extra: str) -> list[str]:
            return [sys.executable, __file__, "--configs", args.configs, "--out", args.out, "--one", key,
                    "--cache", cache, "--steps", str(args.steps), *extra]

        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        compiling = {key: subprocess.Popen(command(key, "--compile-only"), stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True, env=env) for key in configs}
        compile_s = {}
        for key, child in compiling.items():
            compile_s[key] = _result(*child.communicate()).get("compile_s")
            print(f"{key}: compiled in {compile_s[key]} s", flush=True)
        for key, (preset, overrides) in configs.items():
            done = subprocess.run(command(key), capture_output=True, text=True)
            result = _result(done.stdout, done.stderr)
            record["results"][key] = {"preset": preset, "overrides": overrides, "compile_s": compile_s[key], **result}
            write_json(Path(args.out), record, indent=2)
            print(f"{key}: " + (f"{result['step_ms']:.1f} ms, peak {result['peak_gib']:.2f} GiB"
                                if "error" not in result else result["error"]), flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
