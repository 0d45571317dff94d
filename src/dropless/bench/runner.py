"""Compile and time variants of the real training step: the engine of `bench step`, its ladder and `bench scale`.

A `Variant` names one program (config overrides, per-compile XLA options, devices). `compile_variants` lowers
each distinct config once and compiles every variant in parallel threads; `Runner` then times the compiled
programs one after another, never while anything compiles, and returns one record per program: step time,
tokens/s, model TFLOPS per device and MFU (`summarize`), peak device memory, tokens dropped, and on request a
kernel-time breakdown (`dropless.bench.profile`) or a PGLE recompilation (`dropless.bench.pgle`).
"""

from __future__ import annotations

import re
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import jax

from dropless.bench import harness, pgle, profile
from dropless.bench.harness import GIB, peak_bytes, time_steps
from dropless.core.debug import debugging
from dropless.models import flops as flops_lib
from dropless.models.transformer import layer_counts
from dropless.train import metrics as metrics_lib


def summarize(config, times: list[float], metrics: dict, *, devices: int, dense_tflops: float | None,
              peak_tflops: float | None) -> dict:
    """Throughput figures of one timed program (pure: testable without a device)."""
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


def short_error(error: BaseException) -> str:
    """One line for the results table. Out-of-memory is named as such: XLA reports it from deep inside (its
    autotuner's "All configs failed" wraps "Out of memory while trying to allocate 56.02GiB")."""
    full = str(error)
    if oom := re.search(r"Out of memory while trying to allocate [0-9.]+ ?[KMGT]i?B", full):
        return f"out of memory: {oom.group(0)[len('Out of memory while '):]}"
    text = full.strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def compile_variants(base_config, variants: list[Variant], *, workers: int | None = None, log=print) -> dict[str, Program]:
    """Lower every variant (serially: tracing holds the GIL), then compile them all in parallel threads.

    Variants with the same config and devices share one lowering; only their XLA options differ.
    """
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
            jobs.append(program)
        except Exception as error:  # noqa: BLE001 - one broken rung must not stop the ladder
            program.error = short_error(error)
            log(f"  {v.key}: cannot be built: {program.error}")

    def compile_one(program: Program) -> None:
        start = time.perf_counter()
        try:
            program.compiled = program.lowering.compile(compiler_options=program.variant.xla or None)
            program.hlo_text = program.compiled.as_text()
        except Exception as error:  # noqa: BLE001
            program.error = short_error(error)
        program.compile_s = time.perf_counter() - start
        log(f"  compiled {program.variant.key} in {program.compile_s:.0f} s" + (f": {program.error}" if program.error else ""))

    log(f"dropless: compiling {len(jobs)} programs ({len(lowered)} lowerings) in parallel")
    harness.compile_in_threads(compile_one, jobs, workers)
    return programs


def _fit(compiled) -> tuple[int | None, str | None]:
    """(the compiled program's peak device bytes, why it does not fit on this device or None)."""
    peak = peak_bytes(compiled)
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if peak is not None and limit and peak > limit:
        return peak, f"needs {peak / GIB:.1f} GiB of {limit / GIB:.1f}"
    return peak, None


# ------------------------------------------------------------------------------------------------ timing

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
                state, _, _ = time_steps(program.compiled, state, batches, warmup=1, steps=0)
                state, result = profile.profile_compiled(program.compiled, state, batches, 2, trace_dir)
                record.update(status="ok", breakdown=result)
            else:
                state = self._time(program, state, batches, record, trace_dir)
            self._state = state
        except Exception as error:  # noqa: BLE001
            self._state_key = None
            record["status"] = f"error: {short_error(error)}"
            if debugging():  # the record and the caller's table carry the one-line status
                self.log(traceback.format_exc(limit=3))
        return record

    def _time(self, program: Program, state, batches, record: dict, trace_dir: Path | None):
        """Time `program` into `record` (and, for a profile_after variant, trace it too); returns the state."""
        v = program.variant
        state, times, metrics = time_steps(program.compiled, state, batches, warmup=self.warmup,
                                           steps=self.steps, seconds=self.seconds)
        record.update(status="ok", step_ms_all=[round(1e3 * t, 2) for t in times],
                      **summarize(program.config, times, metrics, devices=v.devices,
                                  dense_tflops=self.dense_tflops, peak_tflops=self.peak_tflops),
                      rows_sent=int(metrics["rows_sent"]),
                      rows_sent_without_dedup=int(metrics["rows_sent_without_dedup"]),
                      dispatch_overflows=int(metrics["dispatch_overflows"]))
        if v.profile_after:
            with tempfile.TemporaryDirectory() as scratch:
                state, breakdown = profile.profile_compiled(program.compiled, state, batches, 2,
                                                            trace_dir or Path(scratch))
            record["breakdown"] = {name: value for name, value in breakdown.items() if name != "trace"}
        return state

    def _recompile_with_costs(self, program: Program, state, batches):
        """PGLE (dropless.bench.pgle): profile three steps (of the graph-free program pgle compiles), compile again
        with their kernel costs (replacing `program.compiled`), and check the new program still fits.
        Returns (state, status, peak bytes)."""
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
