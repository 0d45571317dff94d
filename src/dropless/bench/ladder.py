"""The optimisation ladder of `dropless bench step --ladder`: nine rungs on the same model and per-device batch.

  1 naive dropless: jax.lax.ragged_dot         5 + the best rematerialisation policy (none, moe, full) and
                                                 layer loop (scanned, or unrolled: train.scan_layers=false)
  2 capacity factor 1.25 (drops tokens)        6 + activations offloaded to pinned host memory (remat=full)
  3 tokamax's kernel, default heuristics        7 + XLA scheduling flags, each verified to change the program
    (moe.gmm_backend=tokamax_mosaic)           8 expert parallelism on 2 devices, the default dispatch (also
                                                 with all flags, the collective flags alone, with PGLE, or in 2 chunks)
  4 the tuned grouped GEMM (moe.gmm_backend=dropless_mosaic)
                                               9 + FP8 matmuls on rung 5's choice (train.fp8=blockwise, rowwise)

Rungs 5 and 7 are chosen by measurement in the same run, and rungs 6-9 are built on rung 5's choice; every
variant tried is kept in the JSON. The ladder runs in phases (LADDER_PHASES: the anchor rungs first); each
phase's programs are compiled in parallel threads (`dropless.bench.runner`), then timed one after another,
never while anything compiles.
"""

from __future__ import annotations

import functools
import gzip
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import jax

from dropless.bench import report
from dropless.bench.harness import dense_matmul_tflops
from dropless.bench.profile import PROFILE_COMPILER_OPTIONS
from dropless.bench.records import device_slug, environment, write_json
from dropless.bench.runner import Runner, Variant, compile_variants
from dropless.core import xla_flags
from dropless.core.config import ConfigError
from dropless.models import transformer
from dropless.train import metrics as metrics_lib

RUNGS = {
    1: "naive dropless: jax.lax.ragged_dot",
    2: "capacity factor 1.25 (drops tokens)",
    3: "tokamax, default heuristics",
    4: "tuned grouped GEMM",
    5: "+ best rematerialisation policy and layer loop",
    6: "+ activations offloaded to host memory",
    7: "+ XLA scheduling flags",
    8: "expert parallelism, 2 devices",
    9: "+ FP8 matmuls (train.fp8), on rung 5's choice",
}
FP8_RECIPES = ("blockwise", "rowwise")
REMAT_POLICIES = ("none", "moe", "full")
# Rung 8 also tries the dispatch in chunks (moe.dispatch_chunks), whose exchanges may overlap the grouped GEMMs.
# Four chunks were slower than two in every run on two H200s and compiled slowest; two chunks stay as the check.
EP_CHUNKS = (2,)
# ...and, besides all flags together, the collective-scheduling flags alone: all together also combine the
# gradient all-reduces into 256 MiB collectives, which leaves the scheduler less to overlap.
EP_FLAGS = ("latency_hiding_scheduler", "combine_all_reduce")
NO_DEFAULT_BACKEND = ("not run: tokamax's own kernel (moe.gmm_backend=tokamax_mosaic, the default of "
                      "--default-backend on GPUs) needs a GPU")
# The ladder runs in phases, each compiled in parallel and then timed, so that a run cut short by its budget
# still has its first rungs: the anchors first (1, 3, 4, 2), then rung 5's remat policies and layer loops, then
# what builds on rung 5's choice: offloading, flags and the profile, and expert parallelism last.
LADDER_PHASES = (("1", "3", "4", "2"), ("5:",), ("6", "7:", "profile", "9:"), ("8", "8:", "profile:ep"))
REBASE_PHASE = 2  # from this phase on, variants are rebuilt on rung 5's measured choice


# ------------------------------------------------------------------------------------------------ variants

def ladder_variants(base_config, *, tuned_backend: str, default_backend: str | None, flags: dict[str, dict],
                    ep_devices: int, offload_names: str, rung5: dict | None = None) -> list[Variant]:
    """Every program the ladder needs. Rung 5 varies rung 4's config (the tuned backend, remat none, scanned
    layers); rungs 6-8 build on `rung5`, the overrides rung 5 chose (rung 4's until it has been measured)."""
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
    variants += [Variant(f"9:fp8={recipe}", {**best, "train.fp8": recipe}) for recipe in FP8_RECIPES]
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


def ladder_phase(key: str) -> int:
    """The phase (index into LADDER_PHASES) of a ladder variant's key."""
    for index, members in enumerate(LADDER_PHASES):
        if any(key == m or (m.endswith(":") and key.startswith(m)) for m in members):  # "5:" = every "5:..."
            return index
    raise KeyError(f"ladder variant {key!r} belongs to no phase")


# ------------------------------------------------------------------------------------------------ assembly

def hlo_changed(program_text: str, reference_text: str) -> bool:
    """True if two compiled programs differ beyond their module names and metadata (a flag did something)."""
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


def _rung(number: int, record: dict | None, **extra) -> dict:
    base = {"rung": number, "what": RUNGS[number]}
    if record is None:
        return {**base, "status": extra.pop("missing", "not run"), **extra}
    return {**base, **record, **extra}


def assemble_ladder(records: dict[str, dict], hlo_texts: dict[str, str], *, noise: float = 0.01) -> list[dict]:
    """Turn the measured variants into the eight rungs (pure, testable).

    Rung 5 is the fastest remat policy or layer loop on rung 4's config; rung 6 is rung 5's choice with remat=full
    and offloading; rung 7 is the fastest of rung 5's program + one flag or + all flags, counting only flags that
    changed the compiled program or its time by more than `noise`; rung 8 the fastest expert-parallel variant.
    """
    rungs = [_rung(n, records.get(str(n))) for n in (1, 2)]
    rungs.append(_rung(3, records.get("3"), missing=NO_DEFAULT_BACKEND))
    tuned = records.get("4")
    rungs.append(_rung(4, tuned))
    reference = tuned if tuned and tuned.get("status") == "ok" else records.get("3")
    remat = [r for r in [reference, *(records.get(f"5:remat={p}") for p in REMAT_POLICIES), records.get("5:unrolled")]
             if r]
    best_remat = _fastest(remat)
    chosen = best_remat and best_remat["overrides"]
    rungs.append(_rung(5, best_remat, tried={r["key"]: r.get("step_ms") or r.get("status") for r in remat},
                       chosen=chosen and {"train.remat": chosen.get("train.remat", "none"),
                                          "train.scan_layers": chosen.get("train.scan_layers", True)}))
    rungs.append(_rung(6, records.get("6")))
    rungs.append(_flags_rung(records, hlo_texts, best_remat or reference, noise))  # flags went on rung 5's choice
    ep = [r for key, r in records.items() if key == "8" or key.startswith("8:")]
    rungs.append(_rung(8, _fastest(ep) or (ep[0] if ep else None),
                       tried={r["key"]: r.get("step_ms") or r.get("status") for r in ep}))
    return ladder_table(rungs)


def _flags_rung(records: dict[str, dict], hlo_texts: dict[str, str], reference: dict | None, noise: float) -> dict:
    """Rung 7: a verdict per flag against `reference` (rung 5's program), and the fastest kept variant."""
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
        return _rung(7, None, flags=verdicts,
                     missing=flag_records[0].get("status", "not run") if flag_records else "not run")
    return _rung(7, best_flags or reference, flags=verdicts,
                 note=None if best_flags else "no flag made the step faster; rung 7 = rung 5's program")


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


# ------------------------------------------------------------------------------------------------ running

def run_ladder(base_config, out_dir: Path, *, budget_s: float, tuned_backend: str = "dropless_mosaic",
               default_backend: str | None = None, ep_devices: int,
               preset: str, traces_dir: Path | None = None, timing: dict | None = None,
               compile_workers: int | None = None, rungs: set[int] | None = None, log=print) -> dict:
    """Compile and time every rung, phase by phase (LADDER_PHASES); writes step-<device>.json from the start and
    after every program, so a run cut short still leaves what it measured, then the PNG chart. A phase that
    would start after `budget_s` is skipped. With `traces_dir`, the profiled programs' traces and HLO texts are
    kept there (trace-<key>.json.gz, hlo-<key>.txt.gz). `timing`: warmup/steps/seconds for `Runner`. `rungs`: run
    only these (the others are "not run" in the table); rungs 6-8 then build on rung 4's config unless 4 or 5
    ran."""
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
    save = functools.partial(write_json, json_path, result, indent=2)
    save()
    say(f"dense bf16 matmul {dense:.0f} TFLOP/s; datasheet peak {peak}")
    flags = xla_flags.SCHEDULING_CANDIDATES if jax.default_backend() == "gpu" else {}
    variants_on = functools.partial(ladder_variants, base_config, tuned_backend=tuned_backend,
                                    default_backend=default_backend, flags=flags, ep_devices=ep_devices,
                                    offload_names=",".join(transformer.ACTIVATION_NAMES))
    variants = variants_on()
    # The budget decides which phases start; a compiled phase is always timed: its timing takes seconds, against
    # the minutes its compilation cost.
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
            result["variants"].update({v.key: _skipped(v) for v in chosen})
            continue
        _run_phase(base_config, chosen, runner, result, hlo_texts, scratch=scratch, traces_dir=traces_dir,
                   workers=compile_workers, save=save, say=say)
    shutil.rmtree(scratch, ignore_errors=True)
    result["ladder"] = assemble_ladder(result["variants"], hlo_texts)
    save()
    # No rung ran here: none runs on this device, or none started within --budget.
    if not any(r.get("status") == "ok" for r in result["ladder"]):
        asked = f"--rungs {','.join(map(str, sorted(rungs)))}" if rungs else "every rung"
        raise ConfigError(f"no rung of the ladder ran ({asked} on {jax.default_backend()}, --budget {budget_s:g} s); "
                          f"the record {json_path} says why for each: choose rungs this device runs, or a larger "
                          "--budget.")
    try:
        report.ladder_chart(result, json_path.with_suffix(".png"))
    except ImportError as error:  # matplotlib is optional on a bare GPU machine; redraw with --chart
        say(f"no chart ({error}); draw it later with 'dropless bench step --chart {json_path}'")
    log(report.ladder_markdown(result["ladder"], dense))
    return result


def _skipped(v: Variant) -> dict:
    return {"key": v.key, "overrides": v.overrides, "xla_options": v.xla, "devices": v.devices,
            "status": "skipped: out of time"}


def _run_phase(base_config, chosen: list[Variant], runner: Runner, result: dict, hlo_texts: dict[str, str], *,
               scratch: Path, traces_dir: Path | None, workers: int | None, save, say) -> None:
    """Compile one phase's variants in parallel, then time them one by one, saving the JSON after each."""
    phase_start = time.monotonic()
    programs = compile_variants(base_config, chosen, workers=workers, log=say)
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
