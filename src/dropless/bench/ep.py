"""`dropless bench ep`: expert-parallel dispatch/combine and MoE-layer weak scaling, per strategy.

For one MoE layer of a preset (default: the DeepSeek-V3 proxy, 32 experts, top-8, hidden 7168) with a fixed
number of tokens per device, in bf16, forward + backward (gradients w.r.t. the input and the routed experts):

- the layer's time on ONE device (all experts there) and on N devices (`parallel.expert = N`, N x the
  tokens) for each dispatch strategy; weak-scaling efficiency = one-device time / N-device time, both compiled
  with the same XLA options (`--xla`; PGLE programs against the plain one-device program), timed in alternating
  rounds (one-device batch, N-device batch, `--iters` times): the median of the rounds' ratios, and their range,
  so that a drift of the GPUs' clocks over the run (a few percent between two timings of one program) does not
  decide it;
- from a `jax.profiler` trace of the N-device program: communication kernel time (the dispatch/combine
  collectives) and its share of all kernel time (dropless.bench.profile's breakdown);
- the useful bandwidth: bytes of the rows that must cross devices (one per remote (token, device) pair,
  four trips in forward + backward, two of them towards the experts in `moe.dispatch_dtype`) per second of
  communication kernel time, per device;
- rows sent with and without deduplication, alltoall overflow, and the routing's max/mean expert load;
each under `random` routing (a random router) and `skewed` routing (a router bias favouring low expert ids).
Results: benchmarks/results/ep-<device>.json; `--table` prints the BENCHMARKS.md table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dropless.bench import pgle, profile, report
from dropless.bench.harness import time_calls
from dropless.bench.records import environment, results_path, write_json
from dropless.core import xla_flags
from dropless.core.arguments import ArgumentParser, check_choices, check_count, check_output
from dropless.core.config import ConfigError, ParallelConfig, build_config, parse_overrides
from dropless.core.mesh import batch_sharding, make_mesh
from dropless.core.xla_flags import SCHEDULING_CANDIDATES
from dropless.ep import ExpertParallelExecutor, make_strategy
from dropless.ep.wire import Wire
from dropless.gmm import make_gmm
from dropless.moe import init_moe, moe_layer, route

STRATEGIES = ("auto", "allgather", "alltoall", "ragged")
SKEWS = ("random", "skewed")
# Router bias for `skewed`: a ramp from +SKEW to -SKEW over the experts (selection only; sigmoid scores ~0.5).
SKEW = 0.05
# Seconds of back-to-back calls per timed batch: several calls, so that the figure is the device's throughput
# (as in training, where steps are dispatched ahead) and not one call's latency with its dispatch and sync.
CALLS_SECONDS = 0.5


def _layer_program(moe_cfg, mesh, strategy):
    """jit(forward + backward of one bf16 MoE layer) on `mesh`; strategy None = the single-device executor."""
    executor = None if strategy is None else ExpertParallelExecutor(mesh, strategy, make_gmm(moe_cfg),
                                                                    moe_cfg.local_buffer_factor)

    def forward_backward(params, bias_E, x_BSD, cotangent_BSD):
        def loss(experts, x_BSD):
            y_BSD, stats = moe_layer({**params, "experts": experts}, bias_E, x_BSD, moe_cfg,
                                     compute_dtype=jnp.bfloat16, executor=executor)
            return jnp.sum(y_BSD.astype(jnp.float32) * cotangent_BSD), stats
        # The loss is returned too: otherwise XLA drops the forward combine (nothing would read y_BSD).
        (value, stats), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params["experts"], x_BSD)
        return grads, (value, stats)

    replicated = NamedSharding(mesh, P())
    experts = NamedSharding(mesh, P("expert"))
    params = {"router": {"kernel": replicated}, "experts": {"gate_up": experts, "down": experts}}
    if moe_cfg.num_shared_experts:
        params["shared"] = {"gate_up": replicated, "down": replicated}
    tokens = batch_sharding(mesh)
    return jax.jit(forward_backward, in_shardings=(params, replicated, tokens, tokens),
                   out_shardings=((params["experts"], tokens), replicated))


def _placed(compiled, args):
    """`args` moved to the shardings `compiled` takes, once: otherwise every timed call would first copy the
    other devices' share of the input there (a peer copy over the link, timed as part of the layer)."""
    return jax.device_put(args, compiled.input_shardings[0])


def paired_rounds(baseline, baseline_args, program, args, rounds: int, target_s: float = CALLS_SECONDS) -> dict:
    """Time `baseline` and `program` in alternating batches, `rounds` times: each round's ratio baseline/program
    is taken from timings a second apart. -> medians of both, the median ratio and the ratios' range."""
    pairs = [(time_calls(baseline, [baseline_args], batches=1, target_s=target_s),
              time_calls(program, [args], batches=1, target_s=target_s)) for _ in range(rounds)]
    ratios = [b / p for b, p in pairs]
    return {"layer_ms": 1e3 * statistics.median(p for _, p in pairs),
            "single_device_ms": 1e3 * statistics.median(b for b, _ in pairs),
            "weak_scaling_efficiency": statistics.median(ratios),
            "efficiency_range": [min(ratios), max(ratios)], "rounds": rounds,
            "rounds_ms": [[1e3 * b, 1e3 * p] for b, p in pairs]}  # [one device, N devices] per round


def _compiled(lowered, options: dict):
    """(`lowered` compiled with `options` to be timed, and again without command buffers to be profiled:
    kernels inside CUDA graphs name no HLO instruction, dropless.bench.profile). Once per program, for every
    routing it is run with. Off the GPU there are no CUDA graphs: the one program serves both (as in
    dropless.bench.scale and dropless.bench.profile), and the options, all of them the GPU compiler's
    (SCHEDULING_CANDIDATES, PGLE's), change nothing: `lowered` compiles once for every set of them."""
    if jax.default_backend() != "gpu":
        compiled = lowered.compile()
        return compiled, compiled
    compiled = lowered.compile(compiler_options=options or None)
    return compiled, lowered.compile(compiler_options={**options, **profile.PROFILE_COMPILER_OPTIONS})


def _kernel_time(breakdown: dict, top: int = 12) -> dict:
    """The part of a profile breakdown a record keeps: where the kernel time went, by category and costliest
    instruction (so that the N-device program's extra time can be attributed against the one-device one)."""
    return {"kernel_ms": breakdown["kernel_ms_per_step_per_device"],
            "kernel_ms_by_category": breakdown["ms_per_step_per_device"],
            "top_ops": [{"op_name": op["op_name"] or op["op"], "category": op["category"],
                         "ms": op["ms_per_step_per_device"]} for op in breakdown["top_ops"][:top]]}


def _inputs(config, devices: int, tokens_per_device: int, seed: int = 0):
    """(params, x_BSD, cotangent_BSD) in bf16 activations for `devices` x `tokens_per_device` tokens."""
    hidden, seq = config.model.hidden_size, min(config.train.seq_len, tokens_per_device)
    shape = (devices * tokens_per_device // seq, seq, hidden)

    @jax.jit
    def make(key):
        key_params, key_x, key_cotangent = jax.random.split(key, 3)
        params = init_moe(key_params, hidden, config.moe, config.model.init_std)
        normal = lambda key: jax.random.normal(key, shape, jnp.bfloat16)
        return params, normal(key_x), normal(key_cotangent)
    return make(jax.random.key(seed))


def _router_bias(moe_cfg, skew: str):
    ramp = jnp.linspace(SKEW, -SKEW, moe_cfg.num_experts) if skew == "skewed" else jnp.zeros(moe_cfg.num_experts)
    return ramp.astype(jnp.float32)


def needed_rows(params, bias_E, x_BSD, moe_cfg, devices: int) -> int:
    """Rows that must cross devices whatever the strategy: one per (token, other device holding its experts).

    Tokens are split evenly and in order over the devices of the (1, 1, devices) mesh.
    """
    x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
    ids_TK = np.asarray(jax.jit(lambda k, b, x: route(k, b, x, moe_cfg).expert_ids_TK)(
        params["router"]["kernel"], bias_E, x_TD))
    tokens = ids_TK.shape[0]
    holds_TP = np.zeros((tokens, devices), bool)
    holds_TP[np.arange(tokens)[:, None], ids_TK // (moe_cfg.num_experts // devices)] = True
    holds_TP[np.arange(tokens), np.arange(tokens) // (tokens // devices)] = False  # its own device
    return int(holds_TP.sum())


def measure(config, strategies, skews, *, tokens_per_device: int, devices: list, iters: int, profile_iters: int,
            chunks: tuple[int, ...] = (1,), xla: tuple[str, ...] = ("none",), traces: Path | None = None,
            log=print) -> list[dict]:
    """One record per (strategy, chunks, xla, skew) on all `devices`, plus the one-device baseline per skew.
    `chunks`: the values of moe.dispatch_chunks to measure for every strategy, in the same run; `xla`: names of
    `dropless.core.xla_flags.SCHEDULING_CANDIDATES` to compile each expert-parallel program with ("none": without;
    "pgle": compiled again with its own profiled kernel costs, dropless.bench.pgle). With `traces`, every profiled
    program's trace and HLO text are kept there."""
    count = len(devices)
    one = make_mesh(ParallelConfig(data=1), devices[:1])
    many = make_mesh(ParallelConfig(data=1, expert=count), devices, num_experts=config.moe.num_experts)
    params, x_BSD, cotangent_BSD = _inputs(config, count, tokens_per_device)
    rows = x_BSD.shape[0] // count  # one device's share: the first device's tokens of the N-device runs
    arguments = {skew: (params, _router_bias(config.moe, skew), x_BSD[:rows], cotangent_BSD[:rows]) for skew in skews}
    baselines, records = _baselines(config, one, arguments, skews, xla, iters=iters, profile_iters=profile_iters,
                                    traces=traces, log=log)
    arguments = {skew: (params, _router_bias(config.moe, skew), x_BSD, cotangent_BSD) for skew in skews}
    for name, chunk_count, flags in [(name, n, f) for name in strategies for n in chunks for f in xla]:
        strategy = make_strategy(config.replace(**{"moe.dispatch": name, "parallel.expert": count,
                                                   "moe.dispatch_chunks": chunk_count}), platform=devices[0].platform)
        program = _layer_program(config.moe, many, strategy)
        options = dict(SCHEDULING_CANDIDATES.get(flags, {}))
        lowered = program.lower(*arguments[skews[0]])
        pgle_status = None
        with tempfile.TemporaryDirectory(prefix="dropless-pgle-") as scratch:  # PGLE's costs, read when compiling
            if flags == "pgle":  # compiled with the measured costs of this program's kernels
                def three_calls(fn):
                    args = _placed(fn, arguments[skews[0]])
                    return [fn(*args) for _ in range(3)][-1]

                with_costs, pgle_status = pgle.profiled_options(lowered, three_calls, Path(scratch))
                options = with_costs or {}
                log(f"ep: {name}, {chunk_count} chunk(s): PGLE {pgle_status}")
            compiled, profiled = _compiled(lowered, options)
        same = flags if flags in SCHEDULING_CANDIDATES else "none"  # the baseline compiled alike
        for skew in skews:
            record = _record(config, strategy, (compiled, profiled), arguments[skew], baselines[skew, same],
                             name=name, chunk_count=chunk_count, flags=flags, skew=skew, same=same,
                             pgle_status=pgle_status, devices=count, tokens_per_device=tokens_per_device,
                             iters=iters, profile_iters=profile_iters, traces=traces)
            records.append(record)
            _log_record(record, log)
    return records


def _baselines(config, one, arguments: dict, skews, xla, *, iters: int, profile_iters: int, traces: Path | None,
               log) -> tuple[dict, list[dict]]:
    """The one-device program, compiled with each set of XLA options the N-device programs get: ({(skew, flags):
    (the compiled program, its placed arguments)}, timed again beside each N-device program; their records)."""
    baseline_lowered = _layer_program(config.moe, one, None).lower(*arguments[skews[0]])
    baselines, records = {}, []
    for flags in dict.fromkeys(["none", *(f for f in xla if f in SCHEDULING_CANDIDATES)]):
        baseline, profiled = _compiled(baseline_lowered, dict(SCHEDULING_CANDIDATES.get(flags, {})))
        for skew in skews:
            args = _placed(baseline, arguments[skew])
            layer_ms = 1e3 * time_calls(baseline, [args], batches=iters, target_s=CALLS_SECONDS)
            baselines[skew, flags] = baseline, args
            keep = traces and traces / f"single-device-{flags}-{skew}"
            records.append({"strategy": "single-device", "xla": flags, "skew": skew, "devices": 1,
                            "layer_ms": layer_ms, **_kernel_time(profile.profile_calls(profiled, args, profile_iters, keep=keep))})
            log(f"ep: 1 device, xla {flags}, {skew}: {layer_ms:.2f} ms")
    return baselines, records


def _record(config, strategy, programs, arguments, baseline, *, name: str, chunk_count: int, flags: str, skew: str,
            same: str, pgle_status: str | None, devices: int, tokens_per_device: int, iters: int,
            profile_iters: int, traces: Path | None) -> dict:
    """One N-device program under one routing: timed against `baseline` in alternating rounds, profiled, and
    its rows counted."""
    compiled, profiled = programs
    count, hidden = devices, config.model.hidden_size
    args = _placed(compiled, arguments)
    timing = paired_rounds(*baseline, compiled, args, iters)
    _, (_, stats) = jax.device_get(compiled(*args))
    keep = traces and traces / f"{name}-{chunk_count}-{flags}-{skew}"
    breakdown = profile.profile_calls(profiled, args, profile_iters, keep=keep)
    comm_ms = breakdown["ms_per_step_per_device"]["communication"]
    needed = needed_rows(*args[:3], config.moe, count)
    record = {
        "strategy": name, "chunks": chunk_count, "xla": flags,
        **({"pgle": pgle_status} if pgle_status else {}),
        "chosen": strategy.resolve(tokens_per_device, config.moe.num_experts_per_tok, count,
                                   config.moe.num_experts // count).name,
        "skew": skew, "devices": count, "tokens_per_device": tokens_per_device,
        "dispatch_dtype": config.moe.dispatch_dtype,
        **timing, "single_device_xla": same,
        "comm_ms": comm_ms, "comm_share": breakdown["communication_share"],
        "comm_waiting_ms": breakdown["communication_waiting_ms_per_step_per_device"],
        "comm_ms_by_kind": {k: v for k, v in breakdown["communication_ms_per_step_per_device"].items() if v},
        **_kernel_time(breakdown),
        "rows_needed_per_device": needed / count,
        "rows_sent_per_device": int(stats.rows_sent) / count,
        "rows_sent_without_dedup_per_device": int(stats.rows_sent_without_dedup) / count,
        "overflowed": int(stats.dispatch_overflowed), "tokens_dropped": int(stats.tokens_dropped),
        "max_load_ratio": float(stats.max_load_ratio),
    }
    if comm_ms > 0:  # forward: dispatch + combine; backward: their transposes
        # bytes per value over the four trips: the two back from the experts in bf16, the two towards them (the
        # dispatch, the combine's backward) in moe.dispatch_dtype
        trip_bytes = 2 * 2 + 2 * Wire.from_config(config.moe.dispatch_dtype).bytes_per_value(2, hidden)
        useful = needed / count * hidden * trip_bytes
        record["useful_GBps_per_device"] = useful / (comm_ms * 1e-3) / 1e9
    return record


def _log_record(record: dict, log) -> None:
    low, high = record["efficiency_range"]
    log(f"ep: {record['devices']} devices, {record['strategy']} in {record['chunks']} chunk(s), xla {record['xla']}, "
        f"{record['skew']}: "
        f"{record['layer_ms']:.2f} ms against {record['single_device_ms']:.2f} ms on one device in the same "
        f"rounds (efficiency {record['weak_scaling_efficiency']:.3f}, rounds {low:.3f}-{high:.3f}), "
        f"communication {record['comm_ms']:.2f} ms = "
        f"{100 * record['comm_share']:.1f}% of kernel time ({record['comm_waiting_ms']:.2f} ms of it waiting "
        f"for another device), rows sent {record['rows_sent_per_device']:.0f} "
        f"(without dedup {record['rows_sent_without_dedup_per_device']:.0f}) per device")


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dropless bench ep", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="deepseek-v3-proxy", help="the preset whose MoE layer is measured")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per device (fixed: weak scaling)")
    p.add_argument("--devices", type=int, default=2, help="devices for the expert-parallel runs")
    p.add_argument("--strategies", default="", help=f"comma-separated from {', '.join(STRATEGIES)} "
                                                    "(default: all that the platform runs)")
    p.add_argument("--skews", default=",".join(SKEWS), help=f"comma-separated from {', '.join(SKEWS)}")
    p.add_argument("--chunks", default="1", help="comma-separated values of moe.dispatch_chunks to measure per "
                                                 "strategy in the same run, e.g. 1,2,4")
    p.add_argument("--xla", default="none", help="comma-separated: 'none', 'pgle' (profile-guided latency "
                                                 "estimation) and/or names of dropless.core.xla_flags."
                                                 "SCHEDULING_CANDIDATES to compile each expert-parallel program with, "
                                                 "e.g. none,latency_hiding_scheduler,pgle")
    p.add_argument("--iters", type=int, default=5, help="timed batches of calls per measurement: each N-device "
                                                        "program runs this many rounds alternating with the "
                                                        "one-device program (the median ratio is kept)")
    p.add_argument("--profile-iters", type=int, default=8, help="calls traced for the kernel-time breakdown (the "
                                                                "waiting for another device varies from call to call)")
    p.add_argument("--out", default="benchmarks/results/ep-{device}.json", help="results JSON ({device} filled in)")
    p.add_argument("--table", action="store_true", help="print the markdown table at the end")
    p.add_argument("--traces", metavar="DIR", help="keep each profiled program's trace and HLO text in DIR")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. moe.dedup=false")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    if args.traces:
        check_output("--traces", args.traces, directory=True)
    xla_flags.apply()  # before JAX starts a backend: ragged_all_to_all needs its decomposer flag
    check_count("--devices", args.devices)
    check_count("--tokens", args.tokens)
    check_count("--iters", args.iters, why=": the rounds whose median ratio is kept")
    check_count("--profile-iters", args.profile_iters, why=": the calls traced for the kernel-time breakdown")
    devices = jax.devices()[:args.devices]
    if len(devices) < args.devices:
        raise ConfigError(f"--devices {args.devices} but only {len(devices)} are present; lower --devices.")
    platform = devices[0].platform
    strategies = [s for s in args.strategies.split(",") if s] or [
        s for s in STRATEGIES if s != "ragged" or platform == "gpu"]
    skews = [s for s in args.skews.split(",") if s]
    check_choices("--strategies", strategies, STRATEGIES)
    check_choices("--skews", skews, SKEWS)
    try:
        chunks = tuple(int(n) for n in args.chunks.split(",") if n)
    except ValueError:
        chunks = ()
    if not chunks or min(chunks) < 1 or any(args.tokens % n for n in chunks):
        raise ConfigError(f"--chunks {args.chunks!r} must list positive divisors of --tokens {args.tokens}, "
                          "e.g. 1,2,4.")
    xla = tuple(x for x in args.xla.split(",") if x)
    if not xla or (unknown := [x for x in xla if x not in ("none", "pgle", *xla_flags.SCHEDULING_CANDIDATES)]):
        raise ConfigError(f"--xla {args.xla!r}: choose from none, pgle, {', '.join(xla_flags.SCHEDULING_CANDIDATES)}.")
    config = build_config(args.preset, parse_overrides(args.overrides))
    seq = config.train.seq_len  # each device holds --tokens / seq sequences: a remainder would go unmeasured
    if args.tokens > seq and args.tokens % seq:
        raise ConfigError(f"--tokens {args.tokens} must be a multiple of train.seq_len={seq} (whole sequences per "
                          f"device), or at most it; e.g. --tokens {args.tokens // seq * seq}.")
    out = results_path(args.out, devices[0].device_kind)  # checked before measuring
    records = measure(config, strategies, skews, tokens_per_device=args.tokens, devices=devices, iters=args.iters,
                      profile_iters=args.profile_iters, chunks=chunks, xla=xla,
                      traces=Path(args.traces) if args.traces else None)
    result = {"preset": args.preset, "tokens_per_device": args.tokens, "overrides": args.overrides,
              "environment": environment(), "records": records}
    write_json(out, result)
    if args.table:
        print(report.ep_markdown(records))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
