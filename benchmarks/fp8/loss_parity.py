"""FP8 loss parity: the same model, data and seed trained with bf16 and with each FP8 recipe; held-out loss curves
in one chart and one record (make bench-fp8-parity).

    python benchmarks/fp8/loss_parity.py --out fp8-parity.json --chart fp8-parity.png \
        [--preset deepseek-v3-proxy] [--modes off,blockwise,rowwise] [--steps 300] [--merge] [key=value ...]

A mode is a `train.fp8` recipe, optionally with the weight gradient's dtype after a colon
(`blockwise:bfloat16` sets `train.fp8_wgrad_dtype=bfloat16`); the record keys each run by its mode.

Each mode runs the very step `dropless train` runs (dropless.train.setup.build) on the run's batches
(dropless.data), evaluating the held-out loss every --eval-every steps on the fixed held-out batches; no
checkpoints are written (the proxy's optimizer state is ~47 GB). The record holds every curve, each mode's final
held-out loss and its relative difference from bf16's (the `off` run), tokens/s and tokens dropped. Each run names
the environment (commit, date) it ran in. --merge keeps the runs of modes not given in --modes from the --out
record already there, when it was made with the same configuration (one device call can then add a mode that
did not fit in an earlier one).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from dropless.bench import harness
from dropless.bench.records import environment, write_json
from dropless.core import config as config_lib
from dropless.core import xla_flags


def run(config, log, mode: str) -> dict:
    tc = config.train
    setup, state, dataset, to_device, evaluate = harness.training_run(config)
    curve, losses, dropped = [(0, evaluate(state))], [], 0
    t0, timed_tokens = None, 0
    with dataset.prefetch(0, tc.batch_size, tc.steps, transform=to_device) as batches:
        for step in range(tc.steps):
            state, metrics = setup.step(state, next(batches))
            if step == 2:  # time from here: compilation and warm-up are behind
                jax.block_until_ready(state)
                t0 = time.perf_counter()
            elif step > 2:
                timed_tokens += tc.batch_size * tc.seq_len
            if (step + 1) % tc.log_every == 0:
                m = jax.device_get(metrics)
                losses.append((step + 1, float(m["loss"])))
                dropped += int(m["tokens_dropped"])
            if (step + 1) % tc.eval_every == 0 or step + 1 == tc.steps:
                jax.block_until_ready(state)
                pause = time.perf_counter()
                curve.append((step + 1, evaluate(state)))
                t0 += time.perf_counter() - pause  # evaluations are not training time
                log(f"{mode:9s} step {step + 1:4d} held-out loss {curve[-1][1]:.4f}")
    jax.block_until_ready(state)
    return {"fp8": mode, "eval": curve, "train_loss": losses, "tokens_dropped_logged_steps": dropped,
            "tokens_per_s": timed_tokens / (time.perf_counter() - t0), "final_eval_loss": curve[-1][1],
            "environment": environment()}


def mode_settings(mode: str) -> dict:
    """The config settings of a mode: `recipe` or `recipe:wgrad_dtype`."""
    recipe, _, wgrad = mode.partition(":")
    return {"train.fp8": recipe} | ({"train.fp8_wgrad_dtype": wgrad} if wgrad else {})


def kept_runs(path: str, config: dict, modes: list[str]) -> list[dict]:
    """The runs of other modes in the record at `path`, each with its environment; an error sentence where the
    record's configuration differs from this one's in a setting both have (their curves would not compare;
    settings added to or removed from the config since the record are not compared)."""
    old = json.loads(Path(path).read_text())
    old_config = old.get("config", {})
    differ = sorted(k for k in config.keys() & old_config.keys() if config[k] != old_config[k])
    if differ:
        raise SystemExit(f"{path} was made with another configuration ({', '.join(differ[:5])}); run without "
                         "--merge or with the same overrides.")
    return [{**r, "environment": r.get("environment", old["environment"])} for r in old["runs"]
            if r["fp8"] not in modes]


def chart(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        steps, losses = zip(*r["eval"])
        ax.plot(steps, losses, marker="o", markersize=3,
                label=("bf16" if r["fp8"] == "off" else f"fp8 {r['fp8']}") + f" (final {r['final_eval_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--chart", required=True)
    p.add_argument("--preset", default="deepseek-v3-proxy")
    p.add_argument("--modes", default="off,blockwise,rowwise")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--merge", action="store_true", help="keep the --out record's runs of the other modes")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    a = p.parse_args()
    xla_flags.apply()
    base = config_lib.load_preset(a.preset).replace(
        **{"train.steps": a.steps, "train.eval_every": a.eval_every, "train.log_every": 10,
           **config_lib.parse_overrides(a.overrides)})
    modes = a.modes.split(",")
    merging = a.merge and Path(a.out).exists()
    runs = kept_runs(a.out, base.to_flat_dict(), modes) if merging else []
    notes = {"note": "tokens_per_s is over steps 3 to the last, without evaluations; each run names the "
                     "environment (commit, date) of the call it ran in, so tokens/s compare only within one call"}
    for mode in modes:
        runs.append(run(base.replace(**mode_settings(mode)), lambda m: print(m, flush=True), mode))
        write_json(a.out, {"benchmark": "fp8-loss-parity", "environment": environment(), "preset": a.preset,
                           "config": base.to_flat_dict(), "runs": runs, **notes})
    bf16 = next((r for r in runs if r["fp8"] == "off"), None)
    for r in runs:
        if bf16 is not None:
            r["final_vs_bf16"] = r["final_eval_loss"] / bf16["final_eval_loss"] - 1
        print(f"{r['fp8']:9s} final held-out {r['final_eval_loss']:.4f}"
              + (f" ({r['final_vs_bf16']:+.2%} vs bf16)" if bf16 is not None else "")
              + f", {r['tokens_per_s']:,.0f} tokens/s", flush=True)
    write_json(a.out, {"benchmark": "fp8-loss-parity", "environment": environment(), "preset": a.preset,
                       "config": base.to_flat_dict(), "runs": runs, **notes})
    chart(runs, a.chart, f"{a.preset}, {base.train.batch_size} x {base.train.seq_len} tokens per step")


if __name__ == "__main__":
    main()
