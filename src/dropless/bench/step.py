"""`dropless bench step`: the real training step, timed; and the optimisation ladder in one run.

    dropless bench step --preset deepseek-v3-proxy [key=value ...]
    dropless bench step --preset deepseek-v3-proxy --ladder [--out benchmarks/results]
    dropless bench step --chart benchmarks/results/step-h200.json      # redraw a ladder's PNG

One measurement compiles `dropless.train.step`'s train step (the same jitted, donated step the trainer runs;
`dropless.bench.harness`), runs `--warmup` steps, then times steps one by one (each ended by a device sync)
until `--steps` are timed or `--seconds` have passed, and reports the median step time, tokens/s, model
TFLOPS per device (`dropless.models.flops` x tokens/s, `dropless.train.metrics.throughput`), MFU against the
dense bf16 matmul rate measured in the same process and against the datasheet peak, the compiled program's
peak device memory, and the tokens the step dropped.

The ladder (`--ladder`), every rung on the same model and per-device batch:
  1 naive dropless: jax.lax.ragged_dot         5 + the best rematerialisation policy (none, moe, full) and
                                                 layer loop (scanned, or unrolled: train.scan_layers=false)
  2 capacity factor 1.25 (drops tokens)        6 + activations offloaded to pinned host memory (remat=full)
  3 tokamax's kernel, default heuristics        7 + XLA scheduling flags, each verified to change the program
    (moe.gmm_backend=tokamax_default)          8 expert parallelism on 2 devices, the default dispatch (also
                                                 with all flags, the collective flags alone, with PGLE, or in 2 chunks)
  4 the tuned grouped GEMM (moe.gmm_backend=tokamax)
Rungs 5 and 7 are chosen by measurement in the same run, and rungs 6-8 are built on rung 5's choice; every
variant tried is kept in the JSON. The ladder runs in phases (LADDER_PHASES: the anchor rungs first); each
phase's programs are compiled in parallel threads (XLA's compiler releases the GIL), then timed one after
another, never while anything compiles.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1024**3


# ------------------------------------------------------------------------------------------------ measuring

def dense_matmul_tflops(size: int = 8192, warm_s: float = 1.0, batches: int = 7) -> float:
    """The bf16 rate of `a @ b` (size^3) on the default device: after `warm_s` seconds of the same matmul (a GPU
    that has just woken up runs below its clocks), the median of `batches` batches of back-to-back calls on two
    rotating input pairs, one sync per batch (`dropless.bench.gmm.time_calls`, as the grouped-GEMM benchmark
    times its dense reference). Single synced calls measured 557-570 TFLOP/s in two ladder runs on H200s where
    the batched timing of the grouped-GEMM benchmark measured 678-696 the same hour: a sync per 1.6 ms call
    charges the host's round trip to the GPU."""
    import jax
    import jax.numpy as jnp

    from dropless.bench.gmm import time_calls

    keys = jax.random.split(jax.random.key(0), 4)
    pairs = [tuple(jax.random.normal(k, (size, size), jnp.bfloat16) for k in keys[i:i + 2]) for i in (0, 2)]
    matmul = jax.jit(lambda x, y: x @ y)
    start = time.perf_counter()
    jax.block_until_ready(matmul(*pairs[0]))
    while time.perf_counter() - start < warm_s:
        jax.block_until_ready(matmul(*pairs[0]))
    return 2 * size**3 / time_calls(matmul, pairs, target_s=0.1, batches=batches) / 1e12


def time_steps(compiled, state, batches, *, warmup: int = 2, steps: int = 10, seconds: float = 5.0):
    """Run `warmup` steps, then time steps one by one until `steps` are timed or `seconds` have passed
    (at least 3). Returns (state, step times in seconds, the last step's metrics on the host)."""
    import jax

    metrics = None
    for i in range(warmup):
        state, metrics = compiled(state, batches[i % len(batches)])
    jax.block_until_ready((state, metrics))
    times: list[float] = []
    while len(times) < steps and (len(times) < 3 or sum(times) < seconds):
        start = time.perf_counter()
        state, metrics = compiled(state, batches[len(times) % len(batches)])
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return state, times, jax.device_get(metrics)


def peak_bytes(compiled) -> int | None:
    """The compiled program's peak device memory: arguments + outputs - donated aliases + XLA's temporaries."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
               + stats.temp_size_in_bytes)


def summarize(config, times: list[float], metrics: dict, *, devices: int, dense_tflops: float | None,
              peak_tflops: float | None) -> dict:
    """Throughput figures of one timed program (pure: testable without a device)."""
    from dropless.models import flops as flops_lib
    from dropless.models.transformer import layer_counts
    from dropless.train import metrics as metrics_lib

    tokens = config.train.batch_size * config.train.seq_len
    step_s = statistics.median(times)
    rates = metrics_lib.throughput(tokens, step_s, flops_lib.model_flops_per_token(config, config.train.seq_len),
                                   devices, peak_tflops)
    assignments = tokens * config.moe.num_experts_per_tok * layer_counts(config.model)[1]
    dropped = int(metrics["tokens_dropped"])
    return {
        "step_ms": 1e3 * step_s,
        "step_ms_min": 1e3 * min(times),
        "steps_timed": len(times),
        "tokens_per_step": tokens,
        "tokens_per_s": rates["tokens_per_s"],
        "tokens_per_s_per_device": rates["tokens_per_s"] / devices,
        "model_tflops_per_device": rates["tflops_per_device"],
        "mfu_vs_measured_dense": rates["tflops_per_device"] / dense_tflops if dense_tflops else None,
        "mfu_vs_datasheet_peak": rates["mfu"],
        "tokens_dropped": dropped,
        "dropped_fraction": dropped / assignments if assignments else 0.0,
        "max_expert_load": float(metrics["max_expert_load"]),
        "loss": float(metrics["loss"]),
    }


# ------------------------------------------------------------------------------------------------ variants

@dataclass(frozen=True)
class Variant:
    """One program to compile and time: overrides of the base config, per-compile XLA options, devices."""

    key: str
    overrides: dict = field(default_factory=dict)
    xla: dict = field(default_factory=dict)
    devices: int = 1
    profile: bool = False  # traced and broken down instead of timed
    profile_after: bool = False  # timed, then the same program traced and broken down (dropless bench scale)
    pgle: bool = False  # before timing: profiled, then compiled again with its measured kernel costs


@dataclass
class Program:
    variant: Variant
    config: object = None
    setup: object = None
    compiled: object = None
    lowering: object = None  # kept for a PGLE recompilation
    hlo_text: str = ""
    compile_s: float = 0.0
    error: str = ""


def _short_error(error: BaseException) -> str:
    """One line for the results table. Out-of-memory is named as such: XLA reports it from deep inside (its
    autotuner's "All configs failed" wraps "Out of memory while trying to allocate 56.02GiB")."""
    import re

    full = str(error)
    if oom := re.search(r"Out of memory while trying to allocate [0-9.]+ ?[KMGT]i?B", full):
        return f"out of memory: {oom.group(0)[len('Out of memory while '):]}"
    text = full.strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def compile_variants(base_config, variants: list[Variant], *, workers: int | None = None, log=print) -> dict[str, Program]:
    """Lower every variant (serially: tracing holds the GIL), then compile them all in parallel threads.

    Variants with the same config and devices share one lowering; only their XLA options differ.
    """
    import jax

    from dropless.bench import harness

    programs = {v.key: Program(v) for v in variants}
    lowered: dict[tuple, object] = {}
    jobs = []
    for program in programs.values():
        v = program.variant
        lower_key = (tuple(sorted(v.overrides.items())), v.devices)
        try:
            program.config = base_config.replace(**v.overrides)
            if lower_key not in lowered:
                start = time.perf_counter()
                setup = harness.build(program.config, jax.devices()[:v.devices])
                lowered[lower_key] = (setup, harness.lower(setup))
                log(f"  lowered {v.key} in {time.perf_counter() - start:.0f} s")
            program.setup, program.lowering = lowered[lower_key]
            jobs.append((program, program.lowering))
        except Exception as error:  # noqa: BLE001 - one broken rung must not stop the ladder
            program.error = _short_error(error)
            log(f"  {v.key}: cannot be built: {program.error}")

    def compile_one(job):
        program, lowering = job
        start = time.perf_counter()
        try:
            program.compiled = lowering.compile(compiler_options=program.variant.xla or None)
            program.hlo_text = program.compiled.as_text()
        except Exception as error:  # noqa: BLE001
            program.error = _short_error(error)
        program.compile_s = time.perf_counter() - start
        log(f"  compiled {program.variant.key} in {program.compile_s:.0f} s" + (f": {program.error}" if program.error else ""))

    log(f"dropless: compiling {len(jobs)} programs ({len(lowered)} lowerings) in parallel")
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers or min(len(jobs) or 1, os.cpu_count() or 1)) as pool:
        list(pool.map(compile_one, jobs))
    return programs


def _fit(compiled) -> tuple[int | None, str | None]:
    """(the compiled program's peak device bytes, why it does not fit on this device or None)."""
    import jax

    peak = peak_bytes(compiled)
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if peak is not None and limit and peak > limit:
        return peak, f"needs {peak / GIB:.1f} GiB of {limit / GIB:.1f}"
    return peak, None


class Runner:
    """Times compiled programs one after another, keeping one live TrainState per device count.

    The step donates its state, so a program that fails mid-run leaves no valid state: a fresh one is made.
    """

    def __init__(self, dense_tflops: float | None, peak_tflops: float | None, deadline: float, log=print, *,
                 warmup: int = 2, steps: int = 10, seconds: float = 5.0):
        self.dense_tflops, self.peak_tflops, self.deadline, self.log = dense_tflops, peak_tflops, deadline, log
        self.warmup, self.steps, self.seconds = warmup, steps, seconds
        self._state = None
        self._state_key = None
        self._batches = {}

    def _inputs(self, program: Program):
        import jax

        from dropless.bench import harness

        setup = program.setup
        key = (tuple(setup.mesh.shape.items()), jax.tree.structure(setup.state_shapes), setup.config.train.batch_size)
        if self._state_key != key:
            self._state = None  # free the old state before the new one is made
            self._state = harness.init_state(setup)
            self._state_key = key
        if key not in self._batches:
            self._batches[key] = harness.random_batches(setup, 3)
        return self._state, self._batches[key]

    def run(self, program: Program, trace_dir: Path | None = None) -> dict:
        """Time (or, for a profile variant, trace) one program; returns its record."""
        v = program.variant
        record = {"key": v.key, "overrides": v.overrides, "xla_options": v.xla, "devices": v.devices,
                  "compile_s": round(program.compile_s, 1)}
        if program.error:
            return {**record, "status": f"error: {program.error}"}
        if time.monotonic() > self.deadline:
            return {**record, "status": "skipped: out of time"}
        peak, too_big = _fit(program.compiled)
        record["peak_device_gib"] = peak / GIB if peak is not None else None
        if too_big:
            return {**record, "status": f"does not fit: {too_big}"}
        try:
            state, batches = self._inputs(program)
            self._state = None
            if v.pgle:  # the program timed below is the recompiled one: its own peak memory
                state, record["pgle"], peak = self._recompile_with_costs(program, state, batches)
                record["peak_device_gib"] = peak / GIB if peak is not None else None
            if v.profile:
                from dropless.bench import profile

                state, _, _ = time_steps(program.compiled, state, batches, warmup=1, steps=0)
                state, result = profile.profile_compiled(program.compiled, state, batches, 2, trace_dir)
                record.update(status="ok", breakdown=result)
            else:
                state, times, metrics = time_steps(program.compiled, state, batches, warmup=self.warmup,
                                                   steps=self.steps, seconds=self.seconds)
                record.update(status="ok", step_ms_all=[round(1e3 * t, 2) for t in times],
                              **summarize(program.config, times, metrics, devices=v.devices,
                                          dense_tflops=self.dense_tflops, peak_tflops=self.peak_tflops),
                              rows_sent=int(metrics["rows_sent"]),
                              rows_sent_without_dedup=int(metrics["rows_sent_without_dedup"]),
                              dispatch_overflows=int(metrics["dispatch_overflows"]))
                if v.profile_after:
                    import tempfile

                    from dropless.bench import profile

                    with tempfile.TemporaryDirectory() as scratch:
                        state, breakdown = profile.profile_compiled(program.compiled, state, batches, 2,
                                                                    trace_dir or Path(scratch))
                    record["breakdown"] = {name: value for name, value in breakdown.items() if name != "trace"}
            self._state = state
        except Exception as error:  # noqa: BLE001
            self._state_key = None
            record["status"] = f"error: {_short_error(error)}"
            self.log(traceback.format_exc(limit=3))
        return record

    def _recompile_with_costs(self, program: Program, state, batches):
        """PGLE (dropless.bench.pgle): profile three steps (of the graph-free program pgle compiles), compile again
        with their kernel costs (replacing `program.compiled`), and check the new program still fits.
        Returns (state, status, peak bytes)."""
        import tempfile

        from dropless.bench import pgle

        holder = [state]

        def three_steps(compiled):
            for i in range(3):
                holder[0], metrics = compiled(holder[0], batches[i % len(batches)])
            return holder[0], metrics

        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as scratch:
            compiled, status = pgle.recompile(program.lowering, program.compiled, three_steps, scratch,
                                              program.variant.xla)
        if compiled is not program.compiled:
            program.compiled, program.hlo_text = compiled, compiled.as_text()
            status += f", recompiled in {time.perf_counter() - start:.0f} s"
        peak, too_big = _fit(program.compiled)
        if too_big:
            raise RuntimeError(f"with PGLE the program does not fit: {too_big}")
        self.log(f"  {program.variant.key}: PGLE {status}")
        return holder[0], status, peak


# ------------------------------------------------------------------------------------------------ the ladder

RUNGS = {
    1: "naive dropless: jax.lax.ragged_dot",
    2: "capacity factor 1.25 (drops tokens)",
    3: "tokamax, default heuristics",
    4: "tuned grouped GEMM",
    5: "+ best rematerialisation policy and layer loop",
    6: "+ activations offloaded to host memory",
    7: "+ XLA scheduling flags",
    8: "expert parallelism, 2 devices",
}
REMAT_POLICIES = ("none", "moe", "full")
# Rung 8 also tries the dispatch in chunks (moe.dispatch_chunks), whose exchanges may overlap the grouped GEMMs.
# Four chunks lost in every run on two H200s (runs D and F: 294.8 vs 287.1 and 251.1 vs 240.6 ms) and compiled
# slowest (86 s, which cut a ladder call); two chunks stay as the check.
EP_CHUNKS = (2,)
# ...and, besides all flags together, the collective-scheduling flags alone: all together also combine the
# gradient all-reduces into 256 MiB collectives, which leaves the scheduler less to overlap.
EP_FLAGS = ("latency_hiding_scheduler", "combine_all_reduce")
NO_DEFAULT_BACKEND = ("not run: tokamax's own kernel (moe.gmm_backend=tokamax_default, the default of "
                      "--default-backend on GPUs) needs a GPU")


def ladder_variants(base_config, *, tuned_backend: str, default_backend: str | None, flags: dict[str, dict],
                    ep_devices: int, offload_names: str, rung5: dict | None = None) -> list[Variant]:
    """Every program the ladder needs. Rung 5 varies rung 4's config (the tuned backend, remat none, scanned
    layers); rungs 6-8 build on `rung5`, the overrides rung 5 chose (rung 4's until it has been measured)."""
    from dropless.bench.profile import PROFILE_COMPILER_OPTIONS

    common = {"train.remat": "none", "train.offload": "", "train.scan_layers": True}
    tuned = {**common, "moe.gmm_backend": tuned_backend}
    variants = [
        Variant("1", {**common, "moe.gmm_backend": "xla"}),
        Variant("2", {**common, "moe.gmm_backend": "capacity", "moe.capacity_factor": 1.25}),
    ]
    if default_backend:
        variants.append(Variant("3", {**common, "moe.gmm_backend": default_backend}))
    variants.append(Variant("4", tuned))
    variants += [Variant(f"5:remat={p}", {**tuned, "train.remat": p}) for p in REMAT_POLICIES if p != "none"]
    variants.append(Variant("5:unrolled", {**tuned, "train.scan_layers": False}))
    best = {**tuned, **(rung5 or {})}
    variants.append(Variant("6", {**best, "train.remat": "full", "train.offload": offload_names}))
    variants += [Variant(f"7:{name}", best, options) for name, options in flags.items()]
    all_flags = {k: v for options in flags.values() for k, v in options.items()}
    if len(flags) > 1:
        variants.append(Variant("7:all", best, all_flags))
    variants.append(Variant("profile", best, dict(PROFILE_COMPILER_OPTIONS), profile=True))
    if ep_devices > 1:
        ep = {**best, "parallel.expert": ep_devices,
              "train.batch_size": base_config.train.batch_size * ep_devices}
        variants += [Variant("8", ep, {}, ep_devices), Variant("8:all_flags", ep, all_flags, ep_devices),
                     *(Variant(f"8:{name}", ep, flags[name], ep_devices) for name in EP_FLAGS if name in flags),
                     Variant("8:pgle", ep, {}, ep_devices, pgle=True),
                     *(Variant(f"8:chunks={n}", {**ep, "moe.dispatch_chunks": n}, {}, ep_devices) for n in EP_CHUNKS),
                     Variant("profile:ep", ep, dict(PROFILE_COMPILER_OPTIONS), ep_devices, profile=True)]
    return variants


def variant_rung(key: str) -> int:
    """The rung a ladder variant's key belongs to ("5:remat=moe" -> 5; the profiles go with rungs 7 and 8)."""
    return {"profile": 7, "profile:ep": 8}.get(key) or int(key.split(":")[0])


def select_rungs(variants: list[Variant], rungs: set[int] | None) -> list[Variant]:
    """The variants of the chosen rungs (all when `rungs` is None)."""
    return variants if rungs is None else [v for v in variants if variant_rung(v.key) in rungs]


def rung5_choice(records: dict[str, dict]) -> dict | None:
    """The overrides of rung 5's winner (rung 4 or a "5:" variant), once measured; None before."""
    best = _fastest([r for key, r in records.items() if key == "4" or key.startswith("5:")])
    return dict(best["overrides"]) if best else None


# The ladder runs in phases, each compiled in parallel and then timed, so that a run cut short by its budget
# still has its first rungs: the anchors first (1, 3, 4, 2), then rung 5's remat policies and layer loops, then
# what builds on rung 5's choice: offloading, flags and the profile, and expert parallelism last.
LADDER_PHASES = (("1", "3", "4", "2"), ("5:",), ("6", "7:", "profile"), ("8", "8:", "profile:ep"))
REBASE_PHASE = 2  # from this phase on, variants are rebuilt on rung 5's measured choice


def ladder_phase(key: str) -> int:
    """The phase (index into LADDER_PHASES) of a ladder variant's key."""
    for index, members in enumerate(LADDER_PHASES):
        if any(key == m or (m.endswith(":") and key.startswith(m)) for m in members):  # "5:" = every "5:..."
            return index
    raise KeyError(f"ladder variant {key!r} belongs to no phase")


def hlo_changed(program_text: str, reference_text: str) -> bool:
    """True if two compiled programs differ beyond their module names and metadata (a flag did something)."""
    import re

    def canonical(text: str) -> str:
        # Metadata names source lines; backend_config holds autotuning picks, which may differ between two
        # compiles of one program. Neither is a change the flag made.
        text = re.sub(r"^HloModule[^\n]*\n", "", text)
        text = re.sub(r", metadata=\{[^}]*\}", "", text)
        return re.sub(r", backend_config=.*$", "", text, flags=re.MULTILINE)

    return canonical(program_text) != canonical(reference_text)


def _fastest(records: list[dict]) -> dict | None:
    ok = [r for r in records if r.get("status") == "ok" and r.get("step_ms")]
    return min(ok, key=lambda r: r["step_ms"]) if ok else None


def assemble_ladder(records: dict[str, dict], hlo_texts: dict[str, str], *, noise: float = 0.01) -> list[dict]:
    """Turn the measured variants into the eight rungs (pure, testable).

    Rung 5 is the fastest remat policy or layer loop on rung 4's config; rung 6 is rung 5's choice with remat=full
    and offloading; rung 7 is the fastest of rung 5's program + one flag or + all flags, counting only flags that
    changed the compiled program or its time by more than `noise`; rung 8 the fastest expert-parallel variant.
    """
    def rung(number: int, record: dict | None, **extra) -> dict:
        base = {"rung": number, "what": RUNGS[number]}
        if record is None:
            return {**base, "status": extra.pop("missing", "not run"), **extra}
        return {**base, **record, **extra}

    rungs = [rung(n, records.get(str(n))) for n in (1, 2)]
    rungs.append(rung(3, records.get("3"), missing=NO_DEFAULT_BACKEND))
    tuned = records.get("4")
    rungs.append(rung(4, tuned))
    reference = tuned if tuned and tuned.get("status") == "ok" else records.get("3")
    remat = [r for r in [reference, *(records.get(f"5:remat={p}") for p in REMAT_POLICIES), records.get("5:unrolled")]
             if r]
    best_remat = _fastest(remat)
    chosen = best_remat and best_remat["overrides"]
    rungs.append(rung(5, best_remat, tried={r["key"]: r.get("step_ms") or r.get("status") for r in remat},
                      chosen=chosen and {"train.remat": chosen.get("train.remat", "none"),
                                         "train.scan_layers": chosen.get("train.scan_layers", True)}))
    rungs.append(rung(6, records.get("6")))
    reference = best_remat or reference  # the flags were added to rung 5's choice
    verdicts, candidates = {}, []
    for key, record in records.items():
        if not key.startswith("7:") or key == "7:all":
            continue
        name = key[2:]
        if record.get("status") != "ok" or not reference or reference.get("status") != "ok":
            verdicts[name] = {"status": record.get("status")}
            continue
        changed_program = hlo_changed(hlo_texts.get(key, ""), hlo_texts.get(reference["key"], ""))
        ratio = record["step_ms"] / reference["step_ms"]
        changed = changed_program or abs(ratio - 1) > noise
        verdicts[name] = {"changed_program": changed_program, "step_ms": record["step_ms"],
                          "time_vs_without": ratio, "kept": changed and ratio < 1 - noise / 2}
        if verdicts[name]["kept"]:
            candidates.append(record)
    if records.get("7:all", {}).get("status") == "ok" and all(v.get("kept") for v in verdicts.values()):
        candidates.append(records["7:all"])
    best_flags = _fastest(candidates)
    flag_records = [r for key, r in records.items() if key.startswith("7:")]
    if not any(r.get("status") == "ok" for r in flag_records):  # not run (--rungs), skipped or failed
        rungs.append(rung(7, None, flags=verdicts,
                          missing=flag_records[0].get("status", "not run") if flag_records else "not run"))
    else:
        rungs.append(rung(7, best_flags or reference, flags=verdicts,
                          note=None if best_flags else "no flag made the step faster; rung 7 = rung 5's program"))
    ep = [r for key, r in records.items() if key == "8" or key.startswith("8:")]
    rungs.append(rung(8, _fastest(ep) or (ep[0] if ep else None),
                      tried={r["key"]: r.get("step_ms") or r.get("status") for r in ep}))
    return ladder_table(rungs)


def ladder_table(rungs: list[dict]) -> list[dict]:
    """Add each rung's speed-up over rung 1 (per-device tokens/s) and, for rung 8, its per-device efficiency
    against the best one-device rung."""
    first = rungs[0].get("tokens_per_s_per_device") if rungs else None
    single = [r.get("tokens_per_s_per_device") or 0 for r in rungs if r.get("devices", 1) == 1]
    best_single = max(single, default=0)
    for r in rungs:
        rate = r.get("tokens_per_s_per_device")
        r["speedup_vs_rung1"] = rate / first if rate and first else None
        if r.get("devices", 1) > 1 and rate and best_single:
            r["per_device_efficiency_vs_best_single"] = rate / best_single
    return rungs


def format_ladder(rungs: list[dict], dense_tflops: float | None = None) -> str:
    """The ladder as a Markdown table."""
    def num(value, fmt: str, unit: str = "") -> str:
        return "" if value is None else format(value, fmt) + unit

    header = ("| rung | what | step ms | tokens/s/GPU | model TFLOPS/GPU | vs dense | MFU (peak) | peak GiB "
              "| dropped | speed-up |")
    lines = [header, "|" + " --- |" * 10]
    for r in rungs:
        if r.get("status") != "ok":
            lines.append(f"| {r['rung']} | {r['what']} | {r.get('status')} |" + " |" * 7)
            continue
        dropped = f"{r['tokens_dropped']:,} ({100 * r['dropped_fraction']:.1f}%)" if r.get("tokens_dropped") else "0"
        lines.append(
            f"| {r['rung']} | {r['what']}{_chosen(r)} | {r['step_ms']:.1f} | {r['tokens_per_s_per_device']:,.0f} "
            f"| {r['model_tflops_per_device']:.3g} | {num(r.get('mfu_vs_measured_dense') and 100 * r['mfu_vs_measured_dense'], '.0f', '%')} "
            f"| {num(r.get('mfu_vs_datasheet_peak') and 100 * r['mfu_vs_datasheet_peak'], '.0f', '%')} "
            f"| {num(r.get('peak_device_gib'), '.1f')} | {dropped} | {num(r.get('speedup_vs_rung1'), '.2f', 'x')} |")
    if dense_tflops:
        lines.append(f"\nDense bf16 matmul measured in the same run: {dense_tflops:.0f} TFLOP/s.")
    return "\n".join(lines)


def _chosen(r: dict) -> str:
    if r["rung"] == 5 and r.get("chosen"):
        loop = "" if r["chosen"].get("train.scan_layers", True) else ", unrolled"
        return f" (remat={r['chosen']['train.remat']}{loop})"
    if r["rung"] == 7 and r.get("key", "").startswith("7:"):
        return f" ({r['key'][2:]})"
    if r["rung"] == 8:
        variant = "" if r.get("key", "8") == "8" else f"{r['key'][2:]}, "
        return f" ({variant}{r['overrides'].get('train.batch_size')} seq. global)"
    return ""


def plot_ladder(result: dict, path: Path) -> Path:
    """A bar chart of model TFLOPS per GPU per rung, with the dense rate and the 60% target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rungs = [r for r in result["ladder"] if r.get("status") == "ok"]
    labels = [f"{r['rung']}. {r['what']}" for r in rungs]
    values = [r["model_tflops_per_device"] for r in rungs]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rungs) + 2.0))
    bars = ax.barh(labels[::-1], values[::-1], color="#4C72B0")
    for bar, r in zip(bars, rungs[::-1]):
        if r.get("speedup_vs_rung1"):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['speedup_vs_rung1']:.1f}x",
                    va="center", fontsize=9)
    dense = result.get("dense_tflops")
    if dense:
        ax.axvline(dense, color="grey", ls="--", lw=1, label=f"dense bf16 matmul, measured ({dense:.0f})")
        ax.axvline(0.6 * dense, color="#C44E52", ls=":", lw=1, label="target: 60% of dense")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(rungs)), ncol=2, fontsize=8)
    env = result.get("environment", {})
    ax.set(xlabel="model TFLOPS per GPU", title=f"{result.get('preset')} on {env.get('device')} "
           f"({env.get('date')}, {env.get('commit')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def device_slug(device_kind: str) -> str:
    """'NVIDIA H200' -> 'h200' (the results file name)."""
    import re

    words = device_kind.lower().replace("nvidia", "").split()
    return re.sub(r"[^a-z0-9]+", "-", "-".join(words)).strip("-") or "cpu"


def run_ladder(base_config, out_dir: Path, *, budget_s: float, tuned_backend: str = "tokamax",
               default_backend: str | None = None, ep_devices: int,
               preset: str, traces_dir: Path | None = None, timing: dict | None = None,
               compile_workers: int | None = None, rungs: set[int] | None = None, log=print) -> dict:
    """Compile and time every rung, phase by phase (LADDER_PHASES); writes step-<device>.json from the start and
    after every program, so a run cut short still leaves what it measured, then the PNG chart. A phase that
    would start after `budget_s` is skipped. With `traces_dir`, the profiled programs' traces and HLO texts are
    kept there (trace-<key>.json.gz, hlo-<key>.txt.gz). `timing`: warmup/steps/seconds for `Runner`. `rungs`: run
    only these (the others are "not run" in the table); rungs 6-8 then build on rung 4's config unless 4 or 5
    ran."""
    import gzip
    import shutil
    import tempfile

    import jax

    from dropless.core import xla_flags
    from dropless.bench.gmm import environment
    from dropless.models import transformer
    from dropless.train import metrics as metrics_lib

    start = time.monotonic()
    deadline = start + budget_s

    def say(message: str) -> None:
        log(f"[{time.monotonic() - start:6.1f} s] {message}")

    env = environment()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"step-{device_slug(env['device'])}.json"
    ep_devices = ep_devices if jax.device_count() >= ep_devices else 1
    dense = dense_matmul_tflops() if jax.default_backend() == "gpu" else dense_matmul_tflops(512, 0.0, 2)
    peak = metrics_lib.device_peak_tflops(env["device"])
    result = {"preset": preset, "environment": env, "dense_tflops": dense, "datasheet_peak_tflops": peak,
              "config": base_config.to_dict(), "xla_flags_env": os.environ.get("XLA_FLAGS", ""),
              "rungs": sorted(rungs) if rungs else "all", "phases": [], "variants": {}}

    def save():
        json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")

    save()
    say(f"dense bf16 matmul {dense:.0f} TFLOP/s; datasheet peak {peak}")
    flags = xla_flags.SCHEDULING_CANDIDATES if jax.default_backend() == "gpu" else {}
    variants_on = functools.partial(ladder_variants, base_config, tuned_backend=tuned_backend,
                                    default_backend=default_backend, flags=flags, ep_devices=ep_devices,
                                    offload_names=",".join(transformer.ACTIVATION_NAMES))
    variants = variants_on()
    # The budget decides which phases start; a compiled phase is always timed (seconds, against the minutes its
    # compilation cost: a run cut there lost six compiled programs).
    runner = Runner(dense, peak, math.inf, say, **(timing or {}))
    hlo_texts = {}
    scratch = Path(tempfile.mkdtemp(prefix="dropless-traces-"))
    for phase in range(len(LADDER_PHASES)):
        if phase == REBASE_PHASE:
            variants = variants_on(rung5=rung5_choice(result["variants"]))
        chosen = [v for v in select_rungs(variants, rungs) if ladder_phase(v.key) == phase]
        if not chosen:
            continue
        if time.monotonic() > deadline:
            for v in chosen:
                result["variants"][v.key] = {"key": v.key, "overrides": v.overrides, "xla_options": v.xla,
                                             "devices": v.devices, "status": "skipped: out of time"}
            continue
        phase_start = time.monotonic()
        programs = compile_variants(base_config, chosen, workers=compile_workers, log=say)
        result["phases"].append({"variants": [v.key for v in chosen],
                                 "compile_wall_s": round(time.monotonic() - phase_start, 1)})
        # Single-device programs first, then the multi-device ones (one state alive at a time).
        for program in sorted(programs.values(), key=lambda p: p.variant.devices):
            name = program.variant.key.replace(":", "-")
            record = runner.run(program, scratch / name if program.variant.profile else None)
            result["variants"][program.variant.key] = record
            hlo_texts[program.variant.key] = program.hlo_text
            if traces_dir and record.get("breakdown"):
                Path(traces_dir).mkdir(parents=True, exist_ok=True)
                shutil.copy(record["breakdown"]["trace"], Path(traces_dir) / f"trace-{name}.json.gz")
                with gzip.open(Path(traces_dir) / f"hlo-{name}.txt.gz", "wt") as stream:
                    stream.write(program.hlo_text)
            say(f"{program.variant.key:22s} {record['status']} "
                + (f"{record['step_ms']:.1f} ms, {record['model_tflops_per_device']:.0f} TFLOPS/device"
                   if record.get("step_ms") else ""))
            save()
        result["phases"][-1]["wall_s"] = round(time.monotonic() - phase_start, 1)
    shutil.rmtree(scratch, ignore_errors=True)
    result["ladder"] = assemble_ladder(result["variants"], hlo_texts)
    save()
    try:
        plot_ladder(result, json_path.with_suffix(".png"))
    except ImportError as error:  # matplotlib is optional on a bare GPU machine; redraw with --chart
        say(f"no chart ({error}); draw it later with 'dropless bench step --chart {json_path}'")
    log(format_ladder(result["ladder"], dense))
    return result


# ------------------------------------------------------------------------------------------------ CLI

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dropless bench step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="deepseek-v3-proxy", help="a preset name (see 'dropless presets')")
    parser.add_argument("--ladder", action="store_true", help="run the whole optimisation ladder")
    parser.add_argument("--out", default="benchmarks/results", help="where the ladder writes step-<device>.json/.png")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (at most)")
    parser.add_argument("--seconds", type=float, default=5.0, help="stop timing after this long (at least 3 steps)")
    parser.add_argument("--budget", type=float, default=1e9, help="ladder: skip the phases not started within this many seconds")
    parser.add_argument("--tuned-backend", default="tokamax", help="ladder rung 4: the tuned grouped GEMM's moe.gmm_backend")
    parser.add_argument("--default-backend",
                        help="ladder rung 3: the moe.gmm_backend running tokamax's kernel with its default heuristics "
                             "(default on GPUs: tokamax_default; 'none' skips the rung)")
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
    args = _parser().parse_args(argv)
    if args.chart:
        path = Path(args.chart)
        print(f"dropless: wrote {plot_ladder(json.loads(path.read_text()), path.with_suffix('.png'))}")
        return 0
    try:
        rungs = {int(r) for r in args.rungs.split(",")} if args.rungs else None
    except ValueError:
        rungs = {0}
    if rungs is not None and not rungs <= set(RUNGS):
        print(f"dropless: error: --rungs {args.rungs!r} must list rungs from 1 to 8, e.g. --rungs 1,4,5.",
              file=sys.stderr)
        return 2
    from dropless.core import xla_flags

    xla_flags.apply()
    import jax

    from dropless.core.config import build_config, parse_overrides
    from dropless.train import metrics as metrics_lib

    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    config = build_config(args.preset, parse_overrides(args.overrides))
    timing = {"warmup": args.warmup, "steps": args.steps, "seconds": args.seconds}
    if args.ladder:
        default_backend = args.default_backend or ("tokamax_default" if jax.default_backend() == "gpu" else None)
        run_ladder(config, Path(args.out), budget_s=args.budget, tuned_backend=args.tuned_backend,
                   default_backend=None if default_backend == "none" else default_backend,
                   ep_devices=args.ep_devices, preset=args.preset, traces_dir=args.traces and Path(args.traces),
                   timing=timing, compile_workers=args.compile_workers, rungs=rungs,
                   log=lambda s: print(s, flush=True))
        return 0
    gpu = jax.default_backend() == "gpu"
    dense = dense_matmul_tflops() if gpu else None
    peak = metrics_lib.device_peak_tflops(jax.devices()[0].device_kind)
    programs = compile_variants(config, [Variant("step", devices=jax.device_count(), pgle=args.pgle)],
                                log=lambda s: None)
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
        from dropless.bench.gmm import environment

        saved = {"preset": args.preset, "overrides": args.overrides, "environment": environment(),
                 "dense_tflops": dense, "datasheet_peak_tflops": peak, "config": config.to_dict(),
                 "xla_flags_env": os.environ.get("XLA_FLAGS", ""), "record": record}
        try:
            Path(args.record).parent.mkdir(parents=True, exist_ok=True)
            Path(args.record).write_text(json.dumps(saved, indent=1, default=str) + "\n")
        except OSError as error:
            print(f"dropless: error: cannot write --record {args.record} ({error.strerror}); pass a writable path.",
                  file=sys.stderr)
            return 2
    return 0
