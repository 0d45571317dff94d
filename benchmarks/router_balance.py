"""Router balance: how the worst MoE layer's load (max/mean tokens per expert) and the held-out loss evolve over a
short training run, for one variant of the router's settings; one record and one chart (make bench-router).

    python benchmarks/router_balance.py --variant defaults --out router-defaults.json --chart router-defaults.png \
        [--preset deepseek-v3-proxy] [--steps 300] [--eval-every 50] [key=value ...]

A variant is a named set of overrides (VARIANTS below) applied on top of the preset and the command line's
key=value pairs: `defaults` is the preset as it is, `deepseek-v3` DeepSeek-V3's router settings, and every other
variant a change to DeepSeek-V3's router settings. The run is the very step `dropless train` runs (dropless.train.setup.build) on the run's batches
(dropless.data), every step's per-layer expert shares read back (`expert_share`, dropless.train.step), the
held-out loss every --eval-every steps on fixed held-out batches; no checkpoints are written. The record holds,
per step, every MoE layer's max/mean load and the largest |router bias|, every 10 steps each layer's full expert
shares and biases and the share of its selection scores' and logits' variance that differs by token
(`dropless.moe.balance.token_variance_share`: near 0, every token routes alike), the share of the logits'
per-token variance along one direction (`top_direction_share`: near 1, tokens rank the experts in at most two
ways) and the share of the router input's mean square common to the tokens (`input_common_share`: near 1, every
token's input is nearly the same vector) and, with moe.router_common_rate, the running mean's cosine with the
step's mean input (`common_alignment`), the held-out curve, the steps
at which the worst layer's load first stays at or below 2.0 and 1.3, tokens/s and tokens dropped, and a probe of
whether the bias steers the selection (`bias_probe`).
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import jax
import numpy as np

from dropless.bench import harness
from dropless.bench.records import environment, write_json
from dropless.core import config as config_lib
from dropless.core import xla_flags
from dropless.train.metrics import host_metrics, load_ratios, router_row_names


def _unit_router_std(config) -> float:
    return 1.0 / math.sqrt(config.model.hidden_size)  # router logits of std ~1 over RMS-normalised inputs


# DeepSeek-V3's published router settings, the base of every variant but `defaults`, so that a variant means the
# same change whatever the preset's own router settings are (the proxy preset's differ; the records up to e26f892
# name these settings `defaults`). Router logits start with std init_std * sqrt(hidden) = 0.02 * sqrt(7168) = 1.7,
# while the bias moves 0.001 per step.
DEEPSEEK_V3_ROUTER = {"moe.bias_update_rate": 0.001, "moe.bias_update_rule": "sign", "moe.router_common_rate": 0.0,
                      "moe.router_common_source": "running", "moe.seq_aux_loss_weight": 0.0001}

# Each variant: a description and a function of the base config giving its overrides, on top of DEEPSEEK_V3_ROUTER.
VARIANTS = {
    "defaults": ("the preset as it is", lambda c: {}),
    "deepseek-v3": ("DeepSeek-V3's router settings: bias_update_rate 1e-3, no common-direction removal, "
                    "seq_aux_loss_weight 1e-4", lambda c: {}),
    "router-std-unit": ("router init std 1/sqrt(hidden): initial router logits of std 1",
                        lambda c: {"model.router_init_std": _unit_router_std(c)}),
    "router-std-small": ("router init std 0.1/sqrt(hidden): initial router logits of std 0.1",
                         lambda c: {"model.router_init_std": 0.1 * _unit_router_std(c)}),
    "bias-rate-1e-2": ("bias_update_rate 1e-2 (DeepSeek-V3's: 1e-3)", lambda c: {"moe.bias_update_rate": 0.01}),
    "z-loss-1e-3": ("z_loss_weight 1e-3 (DeepSeek-V3's: 0), ST-MoE's router z-loss against saturated scores",
                    lambda c: {"moe.z_loss_weight": 1e-3}),
    "aux-1e-2": ("aux_loss_weight 1e-2 (DeepSeek-V3's: 0), the Switch/GShard batch balance loss",
                 lambda c: {"moe.aux_loss_weight": 0.01}),
    "seq-aux-1e-2": ("seq_aux_loss_weight 1e-2 (DeepSeek-V3's: 1e-4)", lambda c: {"moe.seq_aux_loss_weight": 0.01}),
    "router-lr-0.1": ("router_lr_scale 0.1: the routers' Adam updates a tenth of the other weights'",
                      lambda c: {"train.router_lr_scale": 0.1}),
    "router-lr-0.01": ("router_lr_scale 0.01", lambda c: {"train.router_lr_scale": 0.01}),
    "router-lr-0.1-bias-1e-2": ("router_lr_scale 0.1 and bias_update_rate 1e-2",
                                lambda c: {"train.router_lr_scale": 0.1, "moe.bias_update_rate": 0.01}),
    "router-lr-0.1-bias-3e-2": ("router_lr_scale 0.1 and bias_update_rate 3e-2",
                                lambda c: {"train.router_lr_scale": 0.1, "moe.bias_update_rate": 0.03}),
    "center-1": ("bias_center_rate 1: the bias also equalises the experts' mean selection scores each step",
                 lambda c: {"moe.bias_center_rate": 1.0}),
    "common-0.1": ("router_common_rate 0.1: every router sees its input without the direction of the input's "
                   "running mean over tokens", lambda c: {"moe.router_common_rate": 0.1}),
    "common-0.3": ("router_common_rate 0.3", lambda c: {"moe.router_common_rate": 0.3}),
    "other-0.1": ("router_common_source other_sequences, router_common_rate 0.1: in training each sequence's router "
                  "input loses the direction of the batch's other sequences' mean; the running mean serves inference",
                  lambda c: {"moe.router_common_source": "other_sequences", "moe.router_common_rate": 0.1}),
    "other-0.3": ("router_common_source other_sequences, router_common_rate 0.3",
                  lambda c: {"moe.router_common_source": "other_sequences", "moe.router_common_rate": 0.3}),
    "other-0.1-bias-1e-2": ("router_common_source other_sequences, router_common_rate 0.1, bias_update_rate 1e-2",
                            lambda c: {"moe.router_common_source": "other_sequences", "moe.router_common_rate": 0.1,
                                       "moe.bias_update_rate": 0.01}),
    "other-0.3-bias-1e-2": ("router_common_source other_sequences, router_common_rate 0.3, bias_update_rate 1e-2",
                            lambda c: {"moe.router_common_source": "other_sequences", "moe.router_common_rate": 0.3,
                                       "moe.bias_update_rate": 0.01}),
    **{f"other-0.3-bias-1e-2-first-{steps}": (
        f"router_common_source other_sequences for the first {steps} steps (router_common_other_steps), the running "
        "mean after them, router_common_rate 0.3, bias_update_rate 1e-2",
        lambda c, steps=steps: {"moe.router_common_source": "other_sequences", "moe.router_common_rate": 0.3,
                                "moe.router_common_other_steps": steps, "moe.bias_update_rate": 0.01})
       for steps in (100, 200)},
    "common-1": ("router_common_rate 1: the previous step's mean router input",
                 lambda c: {"moe.router_common_rate": 1.0}),
    "common-1-bias-1e-2": ("router_common_rate 1 and bias_update_rate 1e-2: the direction of the previous step's "
                           "mean router input, in training as in evaluation",
                           lambda c: {"moe.router_common_rate": 1.0, "moe.bias_update_rate": 0.01}),
    "common-0.3-bias-1e-2": ("router_common_rate 0.3 and bias_update_rate 1e-2",
                             lambda c: {"moe.router_common_rate": 0.3, "moe.bias_update_rate": 0.01}),
    "common-0.3-bias-3e-2": ("router_common_rate 0.3 and bias_update_rate 3e-2",
                             lambda c: {"moe.router_common_rate": 0.3, "moe.bias_update_rate": 0.03}),
    "other-0.3-bias-1e-2-seq-aux-1e-2": (
        "router_common_source other_sequences, router_common_rate 0.3, bias_update_rate 1e-2, seq_aux_loss_weight "
        "1e-2", lambda c: {"moe.router_common_source": "other_sequences", "moe.router_common_rate": 0.3,
                           "moe.bias_update_rate": 0.01, "moe.seq_aux_loss_weight": 0.01}),
    "common-0.3-bias-1e-2-seq-aux-1e-2": (
        "router_common_rate 0.3, bias_update_rate 1e-2 and seq_aux_loss_weight 1e-2",
        lambda c: {"moe.router_common_rate": 0.3, "moe.bias_update_rate": 0.01, "moe.seq_aux_loss_weight": 0.01}),
    **{f"{name}-0.3-bias-{rate_name}-proportional": (
        f"router_common_source {source}, router_common_rate 0.3, bias_update_rate {rate_name}, bias_update_rule "
        "proportional", lambda c, source=source, rate=rate: {
            "moe.router_common_source": source, "moe.router_common_rate": 0.3, "moe.bias_update_rate": rate,
            "moe.bias_update_rule": "proportional"})
       for name, source in (("common", "running"), ("other", "other_sequences"))
       for rate_name, rate in (("1e-2", 0.01), ("3e-2", 0.03))},
    "center-0.3": ("bias_center_rate 0.3", lambda c: {"moe.bias_center_rate": 0.3}),
    "router-std-small-bias-1e-2": ("router init std 0.1/sqrt(hidden) and bias_update_rate 1e-2",
                                   lambda c: {"model.router_init_std": 0.1 * _unit_router_std(c),
                                              "moe.bias_update_rate": 0.01}),
}


def variant_overrides(name: str, config) -> dict:
    """The config overrides of variant `name` on `config`: none for `defaults`, else DeepSeek-V3's router settings
    with the variant's change."""
    changes = VARIANTS[name][1](config)
    return changes if name == "defaults" else {**DEEPSEEK_V3_ROUTER, **changes}


def first_step_at_or_below(steps: list[int], worst: list[float], level: float) -> int | None:
    """The first step from which the worst layer's load stays at or below `level` to the end (None: never)."""
    for i in range(len(worst)):
        if all(value <= level for value in worst[i:]):
            return steps[i]
    return None


TRACE_EVERY = 10  # steps between the full per-expert rows kept in the record
WINDOW = 10  # steps per trailing window: the load of a layer over its last WINDOW batches together


def bias_probe(setup, state, batch) -> list[dict]:
    """Whether the correction bias steers selection on this device: per router row, the most loaded expert's share
    as it is, and again with that expert's bias set to -1e3 (which no score in [0, 1] can outweigh, so a share
    that stays high there means the bias does not reach the selection)."""
    from dropless.models.transformer import forward
    from dropless.train.step import expert_shares

    config = setup.config
    k = config.moe.num_experts_per_tok

    @jax.jit
    def shares(params, model_state, tokens):
        _, aux = forward(params, model_state, tokens, config, executor=setup.executor)
        return expert_shares(aux["moe"].tokens_per_expert, k)

    tokens = batch[:, :-1]  # a training batch holds S + 1 tokens per row (inputs and targets)
    before = np.asarray(shares(state.params, state.model_state, tokens))
    rows = []
    for row, expert in enumerate(before.argmax(-1)):
        bias = state.model_state["router_bias"].at[row, expert].set(-1e3)
        after = np.asarray(shares(state.params, {**state.model_state, "router_bias": bias}, tokens))
        rows.append({"row": row, "expert": int(expert), "share": round(float(before[row, expert]), 4),
                     "share_with_bias_-1e3": round(float(after[row, expert]), 4)})
    return rows


def run(config, log) -> dict:
    tc = config.train
    setup, state, dataset, to_device, evaluate = harness.training_run(config)
    curve, steps, loads, bias_max, losses, dropped = [(0, evaluate(state))], [], [], [], [], 0
    # A step's load is one batch's; with few sequences per step, which experts a batch's content calls on moves it
    # from step to step whatever the balancing does. The trailing window's load (each layer's shares summed over
    # the last WINDOW steps, equal tokens per step) is what the balancing leaves over several batches.
    recent, window_loads = [], []
    shares = ("router_token_share", "router_logit_token_share", "router_logit_top_direction",
              "router_input_common_share") + (("router_common_alignment",) if config.moe.router_common_rate else ())
    trace = {"steps": [], "expert_share": [], "router_bias": [], **{key: [] for key in shares}}
    last_batch = None
    t0, timed_tokens = None, 0
    with dataset.prefetch(0, tc.batch_size, tc.steps, transform=to_device) as batches:
        for step in range(tc.steps):
            batch = next(batches)
            state, metrics = setup.step(state, batch)
            m = host_metrics(jax.device_get({k: metrics[k] for k in (
                "loss", "tokens_dropped", "expert_share", "router_bias", "router_token_share",
                "router_logit_token_share", "router_logit_covariance", "router_input_common_share",
                *shares[4:])}))
            if step == 2:  # time from here: compilation and warm-up are behind
                t0 = time.perf_counter()
            elif step > 2:
                timed_tokens += tc.batch_size * tc.seq_len
            steps.append(step + 1)
            loads.append([round(float(r), 4) for r in load_ratios(m["expert_share"])])
            recent = (recent + [np.asarray(m["expert_share"], np.float64)])[-WINDOW:]
            window_loads.append([round(float(r), 4) for r in load_ratios(np.mean(recent, axis=0))])
            bias_max.append(round(float(np.abs(m["router_bias"]).max()), 5))
            losses.append(round(float(m["loss"]), 4))
            dropped += int(m["tokens_dropped"])
            if step == 0 or (step + 1) % TRACE_EVERY == 0:
                trace["steps"].append(step + 1)
                trace["expert_share"].append(np.round(np.asarray(m["expert_share"], np.float64), 4).tolist())
                trace["router_bias"].append(np.round(np.asarray(m["router_bias"], np.float64), 4).tolist())
                for key in shares:
                    trace[key].append(np.round(np.asarray(m[key], np.float64), 4).tolist())
            last_batch = batch
            if (step + 1) % tc.eval_every == 0 or step + 1 == tc.steps:
                pause = time.perf_counter()
                curve.append((step + 1, evaluate(state)))
                if t0 is not None:  # evaluations are not training time
                    t0 += time.perf_counter() - pause
                log(f"step {step + 1:4d} worst load {max(loads[-1]):.2f} held-out loss {curve[-1][1]:.4f}; share of "
                    f"the selection scores' / logits' variance that is per token (lowest layer) "
                    f"{np.min(m['router_token_share']):.3f} / {np.min(m['router_logit_token_share']):.3f}; of the "
                    f"logits' per-token variance along one direction (highest layer) "
                    f"{np.max(m['router_logit_top_direction']):.3f}; of the router input's mean square common to "
                    f"the tokens (highest layer) {np.max(m['router_input_common_share']):.3f}"
                    + (f"; cosine of the running mean with the step's (lowest layer) "
                       f"{np.min(m['router_common_alignment']):.3f}" if "router_common_alignment" in m else ""))
    worst = [max(row) for row in loads]
    window_worst = [max(row) for row in window_loads]
    late = [w for s, w in zip(steps, worst) if s > 200]
    probe = bias_probe(setup, state, last_batch) if tc.steps else []
    log(f"bias probe: {probe}")
    return {"trace": trace, "bias_probe": probe, "layers": router_row_names(config), "steps": steps, "max_load": loads, "worst_max_load": worst,
            "max_abs_bias": bias_max, "train_loss": losses, "eval": curve, "final_eval_loss": curve[-1][1],
            "worst_max_load_at": {str(s): worst[s - 1] for s in (50, 100, 150, 200, 300) if s <= len(worst)},
            "steady_at_or_below_2.0_from": first_step_at_or_below(steps, worst, 2.0),
            "steady_at_or_below_1.3_from": first_step_at_or_below(steps, worst, 1.3),
            "window_steps": WINDOW, "window_max_load": window_loads,
            "window_worst_max_load_at": {str(s): window_worst[s - 1] for s in (50, 100, 150, 200, 300)
                                         if s <= len(window_worst)},
            "window_steady_at_or_below_2.0_from": first_step_at_or_below(steps, window_worst, 2.0),
            "window_steady_at_or_below_1.3_from": first_step_at_or_below(steps, window_worst, 1.3),
            "worst_max_load_mean_201_300": round(float(np.mean(late)), 4) if late else None,
            "tokens_dropped": dropped, "tokens_per_s": None if t0 is None else timed_tokens / (time.perf_counter() - t0)}


def chart(result: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_load, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    for name, column in zip(result["layers"], np.asarray(result["max_load"]).T):
        ax_load.plot(result["steps"], column, lw=1, label=name)
    if "window_max_load" in result:
        ax_load.plot(result["steps"], [max(row) for row in result["window_max_load"]], color="black", lw=1.5,
                     label=f"worst layer, last {result['window_steps']} steps' batches together")
    for level in (1.3, 2.0):
        ax_load.axhline(level, color="grey", lw=0.8, ls="--")
    ax_load.set(xlabel="step", ylabel="max / mean tokens per expert", title="expert load per MoE layer")
    ax_load.legend()
    steps, eval_losses = zip(*result["eval"])
    ax_loss.plot(steps, eval_losses, "o-", label=f"held-out (final {result['final_eval_loss']:.3f})")
    ax_loss.plot(result["steps"], result["train_loss"], lw=0.8, alpha=0.6, label="train")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="loss")
    ax_loss.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="defaults", choices=sorted(VARIANTS))
    p.add_argument("--out", required=True)
    p.add_argument("--chart", required=True)
    p.add_argument("--preset", default="deepseek-v3-proxy")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("overrides", nargs="*", help="key=value config overrides, before the variant's")
    a = p.parse_intermixed_args()
    xla_flags.apply()
    base = config_lib.load_preset(a.preset).replace(
        **{"train.steps": a.steps, "train.eval_every": a.eval_every, **config_lib.parse_overrides(a.overrides)})
    description = VARIANTS[a.variant][0]
    overrides = functools.partial(variant_overrides, a.variant)
    config = base.replace(**overrides(base))
    result = run(config, lambda m: print(f"{a.variant}: {m}", flush=True))
    record = {"benchmark": "router-balance", "variant": a.variant, "description": description,
              "environment": environment(), "preset": a.preset, "overrides": overrides(base),
              "config": config.to_flat_dict(), **result}
    write_json(a.out, record)
    chart(result, a.chart, f"{a.preset} ({a.variant}), {config.train.batch_size} x {config.train.seq_len} tokens "
                           "per step")
    print(f"{a.variant}: worst layer max/mean at steps {result['worst_max_load_at']}; steady <= 2.0 from step "
          f"{result['steady_at_or_below_2.0_from']}, <= 1.3 from step {result['steady_at_or_below_1.3_from']}; "
          f"over the last {WINDOW} steps {result['window_worst_max_load_at']}, steady <= 1.3 from step "
          f"{result['window_steady_at_or_below_1.3_from']}; "
          f"final held-out loss {result['final_eval_loss']:.4f}; "
          + (f"{result['tokens_per_s']:,.0f} tokens/s" if result["tokens_per_s"] else "too few steps to time"),
          flush=True)


if __name__ == "__main__":
    main()
