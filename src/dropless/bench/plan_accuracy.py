"""`dropless bench plan-accuracy` (`make bench-plan`): the plan's predicted peak memory and step time against
measured ones, per configuration, on this machine's first device.

    dropless bench plan-accuracy --out benchmarks/results/plan-accuracy-h200.json [--part 1/3]
    dropless bench plan-accuracy --set tiny --out /tmp/plan-accuracy.json          (CPU, the tests)
    dropless bench plan-accuracy --table benchmarks/results/plan-accuracy-h200.json  (the BENCHMARKS.md table)

Peak memory is per process, so each configuration runs in a process of its own (`--worker`): it builds the step,
compiles it (XLA's `memory_analysis()` goes into the record), times `--steps` steps after a warm-up
(`harness.time_steps`; step time = the median; the table marks a row whose steps spread over `NOISY_SPREAD`),
and reads `peak_bytes_in_use` from the device's memory stats. The
compiles come first, all of them in one process in parallel threads, into a persistent compilation cache
(`jax_compilation_cache_dir`), which each worker then hits. The prediction is `dropless.plan` for one device of the
kind measured. A configuration the plan says does not fit is recorded and not run.
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

from dropless.core.arguments import ArgumentParser, check_count, check_output, check_seconds
from dropless.core.config import ConfigError, build_config, parse_overrides

GIB = 1024**3
PROXY = "deepseek-v3-proxy"
TINY = ["model.num_layers=2", "model.hidden_size=32", "model.vocab_size=64", "model.num_heads=2",
        "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
        "model.v_head_dim=8", "model.dense_intermediate_size=32", "moe.num_experts=4", "moe.n_group=2",
        "moe.topk_group=1", "moe.expert_intermediate_size=16", "train.batch_size=2", "train.seq_len=8",
        "train.scan_layers=false"]
QWEN = ("qwen3-30b-a3b", ["model.num_layers=4", "train.batch_size=4"])
OUT_OF_TIME = "not run: the time budget (--budget) ran out"  # a row's status when --budget ends first
# A row whose timed steps spread wider than this (slowest / fastest - 1) is marked in the table: its median does
# not measure the program alone. A step alone on its device repeats within a few percent; one that shares the
# host's CPUs with compiles does not.
NOISY_SPREAD = 0.10

CONFIG_SETS = {
    # Twelve configurations, each measured in a process of its own: `make bench-plan` runs them in three parts of
    # four, so that each part fits one device call's 10-minute limit.
    "h200": [("proxy b1", PROXY, ["train.batch_size=1"])]
    + [(f"proxy b{b} remat={r}", PROXY, [f"train.batch_size={b}", f"train.remat={r}"])
       for b in (4, 8) for r in ("none", "moe", "full")]
    + [("proxy b8 offload_optimizer", PROXY, ["train.offload_optimizer=true"]),
       ("proxy b8 bf16 moments", PROXY, ["train.optimizer_moments_dtype=bfloat16"]),
       ("proxy b8 fp8 blockwise", PROXY, ["train.fp8=blockwise"]),
       ("qwen3-30b-a3b 4 layers b4", QWEN[0], QWEN[1]),
       ("qwen3-30b-a3b 4 layers b4 remat=full", QWEN[0], [*QWEN[1], "train.remat=full"])],
    # CPU-sized: the tiny preset with two layers of width 32, to run the whole benchmark in the tests.
    "tiny": [(f"tiny remat={r}", "tiny", [*TINY, f"train.remat={r}"]) for r in ("none", "full")],
}


def _enable_cache(cache_dir: str) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def compile_all(jobs: list[dict], cache_dir: str, device: str | None) -> dict:
    """The `--compile` process: the device's environment, each job's prediction for it, and every job the plan
    says fits compiled in parallel threads into the persistent cache. (The orchestrator itself never starts a
    backend, which on a GPU would hold memory that the workers need.)"""
    from dropless.bench import harness
    from dropless.bench.records import environment
    from dropless.core import xla_flags
    from dropless.plan.cost import load_rates, rate_key

    xla_flags.apply()
    _enable_cache(cache_dir)
    env = environment()
    device = device or rate_key(load_rates(), env["device"], env["platform"])
    predicted = {job["name"]: predict(job, device) for job in jobs}

    def one(job):
        try:
            config = build_config(job["preset"], parse_overrides(job["overrides"]))
            harness.lower(harness.build(config, harness.jax.devices()[:1])).compile()
            return "ok"
        except Exception as error:  # the worker compiles again, fails the same way and records it
            return harness.first_line(error)

    runnable = [job for job in jobs if predicted[job["name"]]["fits"]]
    compiled = dict(zip((job["name"] for job in runnable),
                        harness.compile_in_threads(one, runnable,
                                                   workers=min(len(runnable) or 1, max(1, (os.cpu_count() or 2) - 2)))))
    return {"environment": env, "device": device, "predicted": predicted, "compiled": compiled}


def run_one(job: dict, cache_dir: str, warmup: int, steps: int, seconds: float) -> dict:
    """Compile (from the cache), time and measure one job on the first device (the `--worker` process)."""
    from dropless.bench import harness
    from dropless.bench.plan import memory_analysis
    from dropless.core import xla_flags

    xla_flags.apply()
    _enable_cache(cache_dir)
    import jax

    config = build_config(job["preset"], parse_overrides(job["overrides"]))
    start = time.perf_counter()
    setup = harness.build(config, jax.devices()[:1])
    compiled = harness.lower(setup).compile()
    compile_s = time.perf_counter() - start
    state = harness.init_state(setup)
    batches = harness.random_batches(setup, 2)
    state, times, _ = harness.time_steps(compiled, state, batches, warmup=warmup, steps=steps, seconds=seconds)
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {"step_ms": 1e3 * statistics.median(times), "step_ms_all": [1e3 * t for t in times],
            "peak_gib": peak / GIB if peak else None, "bytes_limit_gib": stats.get("bytes_limit", 0) / GIB or None,
            "compile_s": compile_s, "compiled": memory_analysis(compiled),
            "device_kind": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform}


def _subprocess(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dropless.bench.plan_accuracy", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ})


def predict(job: dict, device: str) -> dict:
    from dropless.plan import Cluster, make_plan

    config = build_config(job["preset"], parse_overrides(job["overrides"]))
    plan = make_plan(config, Cluster(1, 1, device))
    return {"peak_gib": plan.memory.peak / GIB, "peak_worst_case_gib": plan.memory.peak_worst_case / GIB,
            "step_ms": plan.time["seconds"] * 1e3, "fits": plan.fits,
            "device_memory_gib": plan.device_memory_bytes / GIB,
            "largest_temporary": plan.memory.largest_temporary[0]}


def _last_json(result: subprocess.CompletedProcess) -> dict | None:
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if result.returncode == 0 and lines else None


def _failure(result: subprocess.CompletedProcess) -> str:
    tail = (result.stderr or result.stdout).strip().splitlines()
    return "error: " + (tail[-1][:300] if tail else f"exit {result.returncode}")


def select_part(configs: list, part: str | None) -> list:
    """Part "K/N": the K-th of N contiguous, nearly equal slices of `configs` (None: all of them)."""
    if part is None:
        return configs
    try:
        k, n = (int(v) for v in part.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise ConfigError(f"--part {part!r} is not K/N with 1 <= K <= N; pass e.g. --part 1/3.")
    return configs[(k - 1) * len(configs) // n:k * len(configs) // n]


def merged_rows(previous: dict | None, rows: list[dict], config_set: str) -> list[dict]:
    """This run's rows, with the rows of `previous` (an earlier record of the same set, e.g. another --part) for the
    configurations this run did not measure, in the set's order. A row this run ran out of time for keeps the
    earlier one; any other row of this run replaces it (a failure now is not hidden behind an older success)."""
    if not previous or previous.get("benchmark") != "plan-accuracy" or previous.get("config_set") != config_set:
        return rows
    by_name = {row["name"]: row for row in previous.get("configs", [])}
    by_name.update({row["name"]: row for row in rows if row["status"] != OUT_OF_TIME or row["name"] not in by_name})
    return [by_name[name] for name, _, _ in CONFIG_SETS[config_set] if name in by_name]


def run(config_set: str, out: str | None, *, warmup: int, steps: int, seconds: float, budget: float,
        device: str | None, part: str | None = None, log=print) -> dict:
    """The whole benchmark (or one `part` of it): predictions, the compile process, one worker per configuration,
    the record. An existing record at `out` of the same set keeps the rows this run does not measure."""
    from dropless.bench.records import write_json

    start = time.perf_counter()
    jobs = [{"name": name, "preset": preset, "overrides": overrides}
            for name, preset, overrides in select_part(CONFIG_SETS[config_set], part)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dropless-plan-cache-") as cache_dir:
        try:
            done = _subprocess(["--compile", json.dumps(jobs), "--cache", cache_dir]
                               + (["--device", device] if device else []), timeout=budget)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"the compile phase ran past --budget={budget:.0f} s; raise --budget.") from None
        phase = _last_json(done)
        if phase is None:
            raise RuntimeError(f"the compile process failed: {_failure(done)}")
        env, device = phase["environment"], phase["device"]
        for job in jobs:
            job["predicted"] = phase["predicted"][job["name"]]
        log(f"compile phase: {time.perf_counter() - start:.0f} s; " + ", ".join(
            f"{name}: {status}" for name, status in phase["compiled"].items()))
        for job in jobs:
            row = {k: job[k] for k in ("name", "preset", "overrides", "predicted")}
            left = budget - (time.perf_counter() - start)
            if not job["predicted"]["fits"]:
                row["status"] = "not run: the plan says it does not fit"
            elif left < 20:
                row["status"] = OUT_OF_TIME
            else:
                try:
                    result = _subprocess(["--worker", json.dumps(job), "--cache", cache_dir, "--warmup", str(warmup),
                                          "--steps", str(steps), "--seconds", str(seconds)], timeout=left)
                    measured = _last_json(result)
                    if measured is not None:
                        row["measured"], row["status"] = measured, "ok"
                    else:
                        row["status"] = _failure(result)
                except subprocess.TimeoutExpired:
                    row["status"] = OUT_OF_TIME
            row["environment"] = {k: env.get(k) for k in ("commit", "date", "device")}
            measured = row.get("measured") or {}
            if measured.get("peak_gib"):
                row["peak_error"] = row["predicted"]["peak_gib"] / measured["peak_gib"] - 1
            if measured.get("step_ms"):
                row["step_error"] = row["predicted"]["step_ms"] / measured["step_ms"] - 1
                row["step_spread"] = step_spread(measured["step_ms_all"])
            log(f"{row['name']:32s} {row['status']:6.40s} " + " ".join(
                f"{k} {row[k]:+.1%}" for k in ("peak_error", "step_error") if k in row))
            rows.append(row)
    previous = read_record(out, "--out") if out and Path(out).is_file() else None
    record = {"benchmark": "plan-accuracy", "environment": env, "device": device, "config_set": config_set,
              "wall_s": time.perf_counter() - start, "targets": {"peak": 0.10, "step": 0.20},
              "configs": merged_rows(previous, rows, config_set)}
    if out:
        write_json(out, record, indent=2)
    return record


def step_spread(step_ms_all: list[float]) -> float:
    """How far apart the timed steps are: the slowest over the fastest, minus one."""
    return max(step_ms_all) / min(step_ms_all) - 1


def read_record(path: str, flag: str = "--table") -> dict:
    """The record a run of this benchmark wrote at `path` (given as `flag`), or a ConfigError saying it is not
    one."""
    try:
        record = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        record = None
    if not (isinstance(record, dict) and record.get("benchmark") == "plan-accuracy"
            and isinstance(record.get("configs"), list) and all(isinstance(row, dict) for row in record["configs"])):
        raise ConfigError(f"{flag} {path} is not a plan-accuracy record; give the JSON that "
                          "'dropless bench plan-accuracy --out' wrote.")
    return record


def markdown_table(record: dict) -> str:
    """The predicted-against-measured table (BENCHMARKS.md, docs/planning.md) from a record."""
    lines = ["| configuration | peak predicted / measured (GiB) | error | step predicted / measured (ms) | error |",
             "| --- | --- | --- | --- | --- |"]

    def fmt(value, spec):
        return format(value, spec) if isinstance(value, (int, float)) else "–"

    for row in record["configs"]:
        p, m = row["predicted"], row.get("measured") or {}
        if row.get("status") != "ok":
            lines.append(f"| {row['name']} | {fmt(p['peak_gib'], '.1f')} / – | | {fmt(p['step_ms'], ',.0f')} / – | "
                         f"{row.get('status', '')} |")
            continue
        spread = step_spread(m["step_ms_all"]) if m.get("step_ms_all") else 0.0
        noisy = f" (steps spread {spread:.0%})" if spread > NOISY_SPREAD else ""
        lines.append(f"| {row['name']} | {fmt(p['peak_gib'], '.1f')} / {fmt(m.get('peak_gib'), '.1f')} | "
                     f"{fmt(row.get('peak_error'), '+.1%')} | {fmt(p['step_ms'], ',.0f')} / "
                     f"{fmt(m.get('step_ms'), ',.0f')} | {fmt(row.get('step_error'), '+.1%')}{noisy} |")
    env = record.get("environment", {})
    lines.append(f"\n{env.get('device')}, {env.get('date')}, commit {env.get('commit')}; "
                 "`dropless bench plan-accuracy` (`make bench-plan`).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="dropless bench plan-accuracy", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--set", default="h200", choices=tuple(CONFIG_SETS), help="the configurations to run")
    parser.add_argument("--out", help="where to write the record")
    parser.add_argument("--table", help="print the Markdown table of this record and stop")
    parser.add_argument("--device", help="the rate table's device to predict for (default: this machine's)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--budget", type=float, default=460.0,
                        help="seconds for the whole run (default 460); configurations left when it ends are recorded "
                             "as not run")
    parser.add_argument("--part", help="run only part K/N of the set (contiguous slices); the record at --out keeps "
                                       "the other parts' rows")
    parser.add_argument("--compile", help=argparse.SUPPRESS)  # internal: the compile process's jobs
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one worker's job
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(read_record(args.table)))
        return 0
    check_count("--warmup", args.warmup, 0)
    check_count("--steps", args.steps)
    check_seconds("--seconds", args.seconds)
    # the compile phase and each worker run under what is left of it (subprocess timeouts)
    check_seconds("--budget", args.budget, above_zero=True)
    if args.device:  # the compile process would fail on it after starting a backend
        from dropless.plan.cost import device_rates, load_rates

        device_rates(load_rates(), args.device)
    if args.compile:
        print(json.dumps(compile_all(json.loads(args.compile), args.cache, args.device)))
        return 0
    if args.worker:
        print(json.dumps(run_one(json.loads(args.worker), args.cache, args.warmup, args.steps, args.seconds)))
        return 0
    if args.out:  # the record is written once every configuration has run, beside the rows it holds already
        check_output("--out", args.out)
        if Path(args.out).is_file():
            read_record(args.out, "--out")
    record = run(args.set, args.out, warmup=args.warmup, steps=args.steps, seconds=args.seconds,
                 budget=args.budget, device=args.device, part=args.part)
    print(markdown_table(record))
    # The exit status is this run's: rows kept from other parts are not re-run here, so their failures are not.
    ran = {name for name, _, _ in select_part(CONFIG_SETS[args.set], args.part)}
    return 0 if all(row["status"] == "ok" or row["status"].startswith("not run") for row in record["configs"]
                    if row["name"] in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
