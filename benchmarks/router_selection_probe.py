"""A diagnostic, not a training option: moe.router_common_source=other_sequences with the common direction
removed from the expert *selection* only, the combine weights computed from the unprojected logits (as the
aux-loss-free bias steers selection only). Evaluation runs the training pass as well (each sequence's direction
from the batch's other sequences): with weights that see the whole input, the running mean cannot be folded into
the router's weight, so no exported model could route like this.

    python benchmarks/router_selection_probe.py [--weights projected] --variant other-0.3 --preset tiny \
        --steps 100 --eval-every 25 --out R.json --chart R.png

It asks whether the held-out cost of removing the common direction (docs/training.md, "Router health") comes from
the combine weights losing it. `--weights projected` keeps the option's own combine weights and changes only the
evaluation (to the training pass), the like-for-like reference. Arguments and record are
benchmarks/router_balance.py's (the variant must set moe.router_common_source=other_sequences), with
"-selection-only" (or "-train-eval") appended to the variant's name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp

import dropless.moe.layer as moe_layer
from dropless.models import transformer
from dropless.moe import router

sys.path.insert(0, str(Path(__file__).parent))
import router_balance  # noqa: E402

_route, _forward = router.route, transformer.forward


def selection_only_route(kernel_DE, bias_E, x_TD, moe_cfg, *, mesh=None, common_BD=None):
    """`router.route`'s selection; its combine weights and probabilities from the logits without the projection."""
    routing = _route(kernel_DE, bias_E, x_TD, moe_cfg, mesh=mesh, common_BD=common_BD)
    if common_BD is None:
        return routing
    logits_TE = router.router_logits(kernel_DE, x_TD)
    scores_TE = router.scores_from_logits(logits_TE, moe_cfg.score_func)
    weights_TK = jnp.take_along_axis(scores_TE, routing.expert_ids_TK, axis=-1)
    if moe_cfg.norm_topk_prob:
        weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
    probs_TE = scores_TE if moe_cfg.score_func == "softmax" else \
        scores_TE / (jnp.sum(scores_TE, axis=-1, keepdims=True) + 1e-20)
    return router.Routing(routing.expert_ids_TK, weights_TK * moe_cfg.routed_scaling_factor, logits_TE, probs_TE,
                          routing.choice_TE)


def main() -> None:
    whole = True
    if "--weights" in sys.argv:
        at = sys.argv.index("--weights")
        choice = sys.argv[at + 1] if at + 1 < len(sys.argv) else ""
        if choice not in ("whole", "projected"):
            raise SystemExit(f"--weights {choice!r}: choose whole (the default) or projected.")
        whole = choice == "whole"
        del sys.argv[at:at + 2]
    variant = sys.argv[sys.argv.index("--variant") + 1] if "--variant" in sys.argv else "defaults"
    overrides = router_balance.VARIANTS.get(variant, ("", lambda c: {}))[1]
    if overrides(router_balance.config_lib.load_preset("tiny")).get("moe.router_common_source") != "other_sequences":
        raise SystemExit(f"--variant {variant} does not set moe.router_common_source=other_sequences; choose e.g. "
                         "other-0.3.")
    if whole:
        moe_layer.route = selection_only_route
    transformer.forward = lambda *args, **kwargs: _forward(*args, **{**kwargs, "training": True})
    router_balance.main()
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    record = json.loads(out.read_text())
    what = ("; the projection for the expert selection only, the combine weights from the whole input" if whole
            else "")
    record |= {"variant": record["variant"] + ("-selection-only" if whole else "-train-eval"),
               "description": record["description"] + what + "; evaluation on the training pass (diagnostic)"}
    out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
