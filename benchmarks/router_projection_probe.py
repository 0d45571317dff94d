"""A diagnostic of router collapse, not a training option: the router balance benchmark with every router seeing its
input with the batch's mean direction projected out, h - (h·c)c, c = the unit mean of the layer's router inputs
over the step's tokens (outside the gradient); the experts still get h itself.

    python benchmarks/router_projection_probe.py --preset tiny --steps 100 --eval-every 25 --out R.json --chart R.png

It asks whether the routers' collapse comes from their input's common part (`router_input_common_share`, docs/
training.md): the load staying balanced when the routers cannot see the common direction is the bound that the
leak-free training options (moe.router_common_rate, moe.router_common_source) are measured against. Arguments and
record are benchmarks/router_balance.py's, with variant "project-batch-mean".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import dropless.moe.layer as moe_layer

sys.path.insert(0, str(Path(__file__).parent))
import router_balance  # noqa: E402

VARIANT = "project-batch-mean"
DESCRIPTION = ("diagnostic: every router sees its input with the batch's mean direction projected out (the batch "
               "mean leaks across tokens; not a training option)")
_route = moe_layer.route


def _projected_route(kernel_DE, bias_E, x_TD, moe_cfg, *, mesh=None, common_BD=None):
    x = x_TD.astype(jnp.float32)
    mean_D = jax.lax.stop_gradient(jnp.mean(x, axis=0))
    c_D = mean_D / jnp.maximum(jnp.linalg.norm(mean_D), 1e-12)
    return _route(kernel_DE, bias_E, (x - jnp.outer(x @ c_D, c_D)).astype(x_TD.dtype), moe_cfg, mesh=mesh,
                  common_BD=common_BD)


def main() -> None:
    if any(arg.startswith("moe.router_common") for arg in sys.argv):
        raise SystemExit("router_projection_probe.py runs the routers without their running input means; drop the "
                         "moe.router_common_* overrides.")
    sys.argv.append("moe.router_common_rate=0")  # the batch mean's projection alone, whatever the preset says
    if "--variant" in sys.argv:
        raise SystemExit("router_projection_probe.py runs the preset's own settings; drop --variant.")
    moe_layer.route = _projected_route
    router_balance.main()
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    record = json.loads(out.read_text())
    record |= {"variant": VARIANT, "description": DESCRIPTION}
    out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
