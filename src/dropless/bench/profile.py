"""`dropless profile`: trace real training steps and say where the device time goes.

`dropless profile --preset NAME --steps N [key=value ...]` compiles the training step, runs one step to warm
up, records N steps with `jax.profiler`, and breaks the device kernel time into

    grouped_gemm    everything inside the `gmm_up` / `gmm_down` scopes (the grouped-GEMM backend's whole cost:
                    the kernels, and for the naive backends their masking and packing), forward and backward
    other_matmul    every other matmul: dense MLP and shared experts, attention projections, router, lm_head
    attention       the rest of the `attention` scope: score and value matmuls (batched), softmax, RoPE, norm
    communication   collectives: all-to-all, all-gather, reduce-scatter, all-reduce, collective-permute
    other           everything else (permute/unpermute, activations, optimizer update, copies)

plus the communication share (communication / all kernel time; NVIDIA's 84% baseline figure is this ratio) and
the *exposed* communication: per device, the time during which a collective kernel runs on some stream and no
other kernel runs on any stream of that device (the union of its collectives' intervals minus the union of its
other kernels'), i.e. communication that nothing hides. Total minus exposed is what overlapping hid.
Each kernel event in the trace names the HLO instruction it ran (`hlo_op`); the compiled program's HLO text
gives that instruction's opcode and its `op_name` metadata, the `jax.named_scope` path of the code it came
from (docs/architecture.md's stage names). Kernels without an `hlo_op` (memcpy, or kernels inside a CUDA graph) are
classified by kernel name, and their share is reported as `unattributed_share`. The profiled program is
compiled without command buffers (CUDA graphs) for that reason; launch gaps differ, kernel times do not.
The breakdown is printed and saved as JSON next to the trace.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import jax

from dropless.bench import harness
from dropless.bench.records import environment, write_json
from dropless.core import xla_flags
from dropless.core.arguments import ArgumentParser, check_count, check_output
from dropless.core.config import ConfigError, build_config, parse_overrides
from dropless.train.setup import fit_check

CATEGORIES = ("grouped_gemm", "other_matmul", "attention", "communication", "other")
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
GROUPED_GEMM_SCOPES = ("gmm_up", "gmm_down")
ATTENTION_SCOPE = "attention"
# Kernel-name patterns, only for kernels the HLO cannot explain.
_NCCL_KINDS = (("alltoall", "all-to-all"), ("allgather", "all-gather"), ("reducescatter", "reduce-scatter"),
               ("allreduce", "all-reduce"), ("sendrecv", "collective-permute"))
_MATMUL_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul|wgmma", re.IGNORECASE)
_ATTENTION_KERNEL = re.compile(r"flash|fmha", re.IGNORECASE)
_GROUPED_KERNEL = re.compile(r"mosaic|ragged", re.IGNORECASE)
# Profiling needs each kernel's HLO instruction; CUDA graphs hide it (see the module docstring).
PROFILE_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


# ------------------------------------------------------------------------------------------------ HLO text

@dataclass(frozen=True)
class HloOp:
    """What the breakdown needs to know about one HLO instruction."""

    name: str
    opcode: str
    op_name: str  # the jax.named_scope path from the metadata, "" if none
    is_matmul: bool
    batched: bool  # a matmul with batch dimensions (attention scores), as opposed to x @ weight
    collective: str | None  # one of COLLECTIVES


_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^\s*([a-z][\w\-]*)\(")
_CALLS = re.compile(r"(?:calls|to_apply)=\{?%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_BATCHED = re.compile(r'lhs_batch_dims=\{\d|"lhs_batch_dimensions":\["\d')


def _skip_shape(rest: str) -> str:
    """The text after an instruction's result shape (a tuple shape is a parenthesised list)."""
    rest = rest.lstrip()
    if not rest.startswith("("):
        return rest.split(" ", 1)[1] if " " in rest else ""
    depth = 0
    for i, char in enumerate(rest):
        depth += char == "("
        depth -= char == ")"
        if depth == 0:
            return rest[i + 1:]
    return ""


def _collective(opcode: str) -> str | None:
    base = opcode.removesuffix("-start").removesuffix("-done").removeprefix("ragged-")
    return base if base in COLLECTIVES else None


def parse_hlo(text: str) -> dict[str, HloOp]:
    """Instruction name -> HloOp for every instruction of an HLO module's text (`compiled.as_text()`).

    Fusions, calls and async wrappers are resolved through the computations they call, so a fusion holding a
    dot is a matmul and an `async-start` wrapping an all-to-all is an all-to-all.
    """
    raw: dict[str, dict] = {}
    bodies: dict[str, list[str]] = defaultdict(list)
    computation = ""
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, rest = match.groups()
        opcode_match = _OPCODE.match(_skip_shape(rest))
        if not opcode_match:
            continue
        target = _TARGET.search(rest)
        op_name = _OP_NAME.search(rest)
        raw[name] = {"opcode": opcode_match.group(1), "calls": _CALLS.findall(rest),
                     "target": target.group(1) if target else "", "op_name": op_name.group(1) if op_name else "",
                     "batched": bool(_BATCHED.search(rest))}
        bodies[computation].append(name)

    def traits(name: str, depth: int = 0) -> tuple[bool, bool, str | None]:
        info = raw[name]
        opcode = info["opcode"]
        if opcode in ("dot", "ragged-dot", "convolution"):
            return True, info["batched"], None
        if opcode == "custom-call":
            is_matmul = bool(re.search(r"gemm|matmul|conv", info["target"], re.IGNORECASE))
            return is_matmul, is_matmul and info["batched"], None
        if _collective(opcode):
            return False, False, _collective(opcode)
        is_matmul, batched, collective = False, False, None
        if depth < 3:
            for callee in info["calls"]:
                for inner in bodies.get(callee, ()):
                    m, b, c = traits(inner, depth + 1)
                    is_matmul, batched, collective = is_matmul or m, batched or b, collective or c
        return is_matmul, batched, collective

    ops = {}
    for name, info in raw.items():
        is_matmul, batched, collective = traits(name)
        ops[name] = HloOp(name, info["opcode"], info["op_name"], is_matmul, batched, collective)
    return ops


def hlo_module_name(text: str) -> str:
    match = re.match(r"\s*HloModule\s+([\w.\-]+)", text)
    return match.group(1) if match else ""


# ------------------------------------------------------------------------------------------------ trace

@dataclass(frozen=True)
class KernelEvent:
    name: str
    duration_us: float
    hlo_op: str
    hlo_module: str
    device: str
    start_us: float = 0.0


def find_trace(directory: Path) -> Path:
    """The newest `*.trace.json.gz` (or `perfetto_trace.json.gz`) that jax.profiler wrote under `directory`."""
    candidates = sorted(Path(directory).rglob("*.trace.json.gz")) or sorted(Path(directory).rglob("perfetto_trace.json.gz"))
    if not candidates:
        raise FileNotFoundError(f"no *.trace.json.gz under {directory}; capture one with jax.profiler.trace(...).")
    return max(candidates, key=lambda path: path.stat().st_mtime)


def read_trace(path: Path) -> list[KernelEvent]:
    """Device kernel events of a Chrome-format trace written by jax.profiler.

    On GPUs these are the events of the `/device:GPU:N` processes' `Stream` threads (not the derived "XLA Ops"
    lines, which repeat them). Without device processes (XLA:CPU runs kernels on host threads) they are the
    host events that name an HLO instruction.
    """
    with gzip.open(path, "rt") as stream:
        document = json.load(stream)
    events = document["traceEvents"] if isinstance(document, dict) else document
    processes, threads = {}, {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        elif event.get("ph") == "M" and event.get("name") == "thread_name":
            threads[(event["pid"], event.get("tid"))] = event["args"]["name"]
    devices = {pid for pid, name in processes.items() if re.search(r"/device:[A-Z]+:\d+", name)}
    kernels = []
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        args = event.get("args") or {}
        pid = event.get("pid")
        if devices:
            if pid not in devices or not threads.get((pid, event.get("tid")), "").startswith("Stream"):
                continue
        elif "hlo_op" not in args:
            continue
        device = processes.get(pid, str(pid)) + (f":{args['device_ordinal']}" if "device_ordinal" in args else "")
        kernels.append(KernelEvent(event.get("name", ""), float(event["dur"]), str(args.get("hlo_op", "")),
                                   str(args.get("hlo_module", "")), device, float(event.get("ts", 0.0))))
    return kernels


# ------------------------------------------------------------------------------------------------ breakdown

def _scopes(op_name: str) -> set[str]:
    # "jit(train_step)/transpose(jvp(moe_layers))/while/body/moe/gmm_up/ragged_dot" -> its words
    return set(re.findall(r"[A-Za-z_][\w]*", op_name))


def classify(event: KernelEvent, ops: dict[str, HloOp]) -> tuple[str, str | None, bool]:
    """(category, collective kind or None, attributed): attributed is False when only the kernel name was used."""
    op = ops.get(event.hlo_op)
    if op is None:
        lower = event.name.lower().replace("_", "")
        if "nccl" in lower:
            kind = next((k for pattern, k in _NCCL_KINDS if pattern in lower), "collective-permute")
            return "communication", kind, False
        if _GROUPED_KERNEL.search(event.name):
            return "grouped_gemm", None, False
        if _ATTENTION_KERNEL.search(event.name):
            return "attention", None, False
        if _MATMUL_KERNEL.search(event.name):
            return "other_matmul", None, False
        return "other", None, False
    if op.collective:
        return "communication", op.collective, True
    scopes = _scopes(op.op_name)
    if scopes.intersection(GROUPED_GEMM_SCOPES):
        return "grouped_gemm", None, True
    if ATTENTION_SCOPE in scopes and not (op.is_matmul and not op.batched):
        return "attention", None, True
    if op.is_matmul:
        return "other_matmul", None, True
    return "other", None, True


def breakdown(events: list[KernelEvent], ops: dict[str, HloOp], *, module: str = "", steps: int = 1,
              top: int = 15) -> dict:
    """Kernel time per category (and per collective kind), shares, and the costliest HLO instructions.

    `module` keeps only that HLO module's kernels (jax names it `jit_<function>`); kernels of no module
    (memcpy) are kept. `steps` turns totals into per-step, per-device milliseconds.
    """
    kept = [e for e in events if not module or e.hlo_module in ("", module)]
    totals = dict.fromkeys(CATEGORIES, 0.0)
    collectives = dict.fromkeys(COLLECTIVES, 0.0)
    by_op: dict[tuple[str, str], float] = defaultdict(float)
    unattributed = 0.0
    for event in kept:
        category, kind, attributed = classify(event, ops)
        totals[category] += event.duration_us
        if kind:
            collectives[kind] += event.duration_us
        if not attributed:
            unattributed += event.duration_us
        by_op[(category, event.hlo_op or event.name)] += event.duration_us
    total = sum(totals.values())
    devices = max(1, len({e.device for e in kept}))
    per_step_ms = 1e-3 / (max(1, steps) * devices)
    waiting = collective_waiting_us(kept, ops)
    exposed = exposed_communication_us(kept, ops)

    def share(value: float) -> float:
        return value / total if total else 0.0

    costliest = sorted(by_op.items(), key=lambda item: -item[1])[:top]
    return {
        "module": module,
        "devices": devices,
        "steps": steps,
        "kernel_ms_per_step_per_device": total * per_step_ms,
        "ms_per_step_per_device": {k: v * per_step_ms for k, v in totals.items()},
        "share": {k: share(v) for k, v in totals.items()},
        "communication_share": share(totals["communication"]),
        "communication_ms_per_step_per_device": {k: v * per_step_ms for k, v in collectives.items()},
        "communication_waiting_ms_per_step_per_device": waiting * per_step_ms,
        "communication_exposed_ms_per_step_per_device": exposed * per_step_ms,
        "communication_exposed_share": share(exposed),
        "unattributed_share": share(unattributed),
        "top_ops": [{"category": c, "op": name, "op_name": ops[name].op_name if name in ops else "",
                     "ms_per_step_per_device": us * per_step_ms, "share": share(us)}
                    for (c, name), us in costliest],
    }


def collective_waiting_us(events: list[KernelEvent], ops: dict[str, HloOp]) -> float:
    """Microseconds that collective kernels spent waiting for another device, summed over devices.

    A collective ends on every device together, so a device that reaches it early runs its kernel longer, waiting
    for the last one. Per instance (the i-th kernel of one HLO collective on each device) the shortest of the
    devices' kernels is the collective itself; what any device ran beyond that is waiting. Instances are matched
    by order per device; a collective whose devices ran different numbers of kernels is left out."""
    runs: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for event in sorted(events, key=lambda e: e.start_us):
        if classify(event, ops)[0] == "communication":
            runs[event.hlo_op or event.name][event.device].append(event.duration_us)
    waiting = 0.0
    for per_device in runs.values():
        lists = list(per_device.values())
        if len(lists) < 2 or len({len(durations) for durations in lists}) != 1:
            continue
        for durations in zip(*lists):
            waiting += sum(durations) - len(durations) * min(durations)
    return waiting


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering exactly what `intervals` cover."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _uncovered(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the union of `intervals` outside the union of `cover` (both unions taken here)."""
    cover, total, i = _union(cover), 0.0, 0
    for start, end in _union(intervals):
        while i < len(cover) and cover[i][1] <= start:  # covers wholly before this interval: never needed again
            i += 1
        position, j = start, i
        while j < len(cover) and cover[j][0] < end:
            total += max(0.0, cover[j][0] - position)
            position = max(position, cover[j][1])
            j += 1
        total += max(0.0, end - position)
    return total


def exposed_communication_us(events: list[KernelEvent], ops: dict[str, HloOp]) -> float:
    """Microseconds, summed over devices, during which a collective kernel ran on a device and no other kernel
    (on any of that device's streams) did: the communication nothing hid. Waiting for another device counts
    as exposed when nothing else runs meanwhile."""
    collectives: dict[str, list[tuple[float, float]]] = defaultdict(list)
    compute: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        target = collectives if classify(event, ops)[0] == "communication" else compute
        target[event.device].append((event.start_us, event.start_us + event.duration_us))
    return sum(_uncovered(intervals, compute[device]) for device, intervals in collectives.items())


def format_breakdown(result: dict) -> str:
    lines = [f"device kernel time: {result['kernel_ms_per_step_per_device']:.2f} ms per step per device "
             f"({result['devices']} device(s), {result['steps']} step(s))"]
    for category in CATEGORIES:
        lines.append(f"  {category:14s} {result['ms_per_step_per_device'][category]:9.2f} ms  "
                     f"{100 * result['share'][category]:5.1f}%")
    kinds = ", ".join(f"{k} {v:.2f} ms" for k, v in result["communication_ms_per_step_per_device"].items() if v)
    lines.append(f"  communication share {100 * result['communication_share']:.1f}%" + (f" ({kinds})" if kinds else ""))
    if result.get("communication_exposed_ms_per_step_per_device") is not None:
        exposed = result["communication_exposed_ms_per_step_per_device"]
        hidden = result["ms_per_step_per_device"]["communication"] - exposed
        lines.append(f"  exposed communication {exposed:.2f} ms  {100 * result['communication_exposed_share']:5.1f}% "
                     f"(not overlapped with any other kernel; {hidden:.2f} ms hidden behind compute)")
    if result.get("communication_waiting_ms_per_step_per_device"):
        lines.append(f"  of which waiting for another device "
                     f"{result['communication_waiting_ms_per_step_per_device']:.2f} ms")
    if result["unattributed_share"] > 0.01:
        lines.append(f"  {100 * result['unattributed_share']:.1f}% of the time had no HLO instruction "
                     "(classified by kernel name)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ capture

def capture(compiled, state, batches, steps: int, trace_dir: Path):
    """Run `steps` steps of a compiled train step under jax.profiler; returns (state, trace file)."""
    trace_dir = Path(trace_dir)
    with jax.profiler.trace(str(trace_dir)):
        for i in range(steps):
            state, metrics = compiled(state, batches[i % len(batches)])
        jax.block_until_ready((state, metrics))
    return state, find_trace(trace_dir)


def profile_calls(compiled, args, calls: int, *, keep: Path | None = None, top: int = 15) -> dict:
    """Kernel-time breakdown of `calls` calls of `compiled` (compiled without command buffers on a GPU:
    PROFILE_COMPILER_OPTIONS) on `args`, its `top` costliest instructions listed. With `keep`, the trace and the
    HLO text are saved there as <keep>.trace.json.gz and <keep>.hlo.txt.gz."""
    jax.block_until_ready(compiled(*args))  # first-run allocations stay out of the trace
    text = compiled.as_text()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                out = compiled(*args)
            jax.block_until_ready(out)
        trace = find_trace(Path(trace_dir))
        events = read_trace(trace)
        if keep:
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(trace, keep.with_name(keep.name + ".trace.json.gz"))
            with gzip.open(keep.with_name(keep.name + ".hlo.txt.gz"), "wt") as stream:
                stream.write(text)
    return breakdown(events, parse_hlo(text), module=hlo_module_name(text), steps=calls, top=top)


def profile_compiled(compiled, state, batches, steps: int, trace_dir: Path, top: int = 15):
    """Trace `steps` steps of `compiled` and break its kernel time down (the `top` costliest instructions listed).
    Returns (state, breakdown dict)."""
    hlo_text = compiled.as_text()
    state, trace_file = capture(compiled, state, batches, steps, trace_dir)
    result = breakdown(read_trace(trace_file), parse_hlo(hlo_text), module=hlo_module_name(hlo_text), steps=steps,
                       top=top)
    result["trace"] = str(trace_file)
    return state, result


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="dropless profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="a preset name (see 'dropless presets')")
    parser.add_argument("--steps", type=int, default=3, help="training steps to trace (after one warm-up step)")
    parser.add_argument("--out", help="directory for the trace and breakdown.json (default: runs/profile-<preset>-<time>)")
    parser.add_argument("--top", type=int, default=15, help="the costliest HLO instructions to list")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. moe.gmm_backend=xla")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    xla_flags.apply()  # before JAX starts a backend
    check_count("--steps", args.steps)
    # a negative count would slice the list from its end: all but the last few
    check_count("--top", args.top, why=": the number of costliest instructions to list")
    config = fit_check(build_config(args.preset, parse_overrides(args.overrides)),
                       log=lambda line: print(line, file=sys.stderr))  # refused as `dropless train` would refuse it
    out = check_output("--out", args.out or f"runs/profile-{args.preset}-{datetime.datetime.now():%Y%m%d-%H%M%S}",
                       directory=True)
    if (out / "config.json").exists():
        raise ConfigError(f"--out {out} holds a run or a model (its config.json); give the profile a directory of "
                          "its own.")
    out.mkdir(parents=True, exist_ok=True)  # a path that cannot be written fails now, not after the steps
    setup = harness.build(config)
    options = PROFILE_COMPILER_OPTIONS if jax.default_backend() == "gpu" else {}
    compiled = harness.lower(setup).compile(compiler_options=options)
    state, batches = harness.init_state(setup), harness.random_batches(setup, 2)
    state, _ = compiled(state, batches[0])  # warm-up: first-run allocations stay out of the trace
    jax.block_until_ready(state)
    state, result = profile_compiled(compiled, state, batches, args.steps, out / "trace", top=args.top)
    result.update(preset=args.preset, overrides=args.overrides, device_count=jax.device_count(),
                  environment=environment())  # the device kind is environment's
    write_json(out / "breakdown.json", result, indent=2)
    print(format_breakdown(result))
    print(f"dropless: trace and breakdown.json in {out}", file=sys.stderr)
    return 0

