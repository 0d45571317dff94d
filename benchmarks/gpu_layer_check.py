"""The MoE layer through the GPU default (moe.gmm_backend=auto: dropless_mosaic, our tuned kernels) against references.

    python benchmarks/gpu_layer_check.py [--out results.json]      (make bench-layer-check)

On a GPU, for several routings (balanced, Dirichlet-like skew, every token on one expert, most experts empty)
and token counts that are not multiples of the kernels' 128-row tile, it runs the bf16 MoE layer forward and
backward (gradients w.r.t. the input, the router and every expert weight) with

  - `auto`  : the GPU default, the tuned grouped GEMM (bf16 operands, f32 accumulation, f32-output down projection),
  - `xla`   : jax.lax.ragged_dot in the same bf16 setting (what plain JAX users have),
  - `f32`   : the layer in float32 with XLA's highest matmul precision (the reference),

and reports each bf16 path's relative error ||path - f32|| / ||f32|| per output. The check passes when the default
path is within 2x (+1e-3) of the plain-JAX bf16 path's error on every output, i.e. it is as exact as bf16 allows.
The CPU tests cover the kernels in Pallas's interpreter; this is the same layer on the real device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dropless.bench.gmm import environment
from dropless.core.config import MoEConfig
from dropless.gmm.registry import make_gmm
from dropless.moe import init_moe, moe_layer

CASES = {
    # name: (tokens, experts, top-k, router bias ramp, one expert favoured)
    "balanced-1000-tokens": dict(tokens=1000, experts=32, top_k=8, skew=0.0),
    "skewed-4093-tokens": dict(tokens=4093, experts=32, top_k=8, skew=2.0),
    "one-expert-777-tokens": dict(tokens=777, experts=16, top_k=1, one_expert=True),
    "most-experts-empty-2048": dict(tokens=2048, experts=64, top_k=2, empty=56),
}


def _bias(case: dict) -> np.ndarray:
    experts = case["experts"]
    bias = np.linspace(case.get("skew", 0.0), -case.get("skew", 0.0), experts).astype(np.float32)
    if case.get("one_expert"):
        bias[:] = -100.0
        bias[3] = 100.0
    if case.get("empty"):
        bias[-case["empty"]:] = -100.0  # the last `empty` experts are never chosen
    return bias


def run_case(name: str, case: dict, hidden: int = 1024, width: int = 512, seed: int = 0) -> dict:
    cfg = MoEConfig(num_experts=case["experts"], num_experts_per_tok=case["top_k"], expert_intermediate_size=width,
                    num_shared_experts=1, score_func="sigmoid", routed_scaling_factor=2.5)
    keys = jax.random.split(jax.random.key(seed), 3)
    params = init_moe(keys[0], hidden, cfg, 0.02)
    x = jax.random.normal(keys[1], (1, case["tokens"], hidden), jnp.float32)
    cot = jax.random.normal(keys[2], (1, case["tokens"], hidden), jnp.float32)
    bias = jnp.asarray(_bias(case))

    def grads(backend: str, dtype):
        cfg_b = dataclasses.replace(cfg, gmm_backend=backend)

        def loss(params, x):
            y, stats = moe_layer(params, bias, x, cfg_b, compute_dtype=dtype)
            return jnp.sum(y.astype(jnp.float32) * cot), (y.astype(jnp.float32), stats)

        with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
            (_, (y, stats)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        return {"y": y, "dx": g[1], "d_router": g[0]["router"]["kernel"], "d_gate_up": g[0]["experts"]["gate_up"],
                "d_down": g[0]["experts"]["down"]}, stats

    reference, stats = grads("xla", jnp.float32)
    counts = np.asarray(stats.tokens_per_expert)
    record = {"case": name, **case, "tokens_per_expert": counts.tolist(), "empty_experts": int((counts == 0).sum()),
              "tokens_dropped": {}, "rel_err": {}}
    for path, backend in (("auto", "auto"), ("xla", "xla")):
        out, stats = grads(backend, jnp.bfloat16)
        record["tokens_dropped"][path] = int(stats.tokens_dropped)
        record["rel_err"][path] = {
            k: float(jnp.linalg.norm((out[k] - reference[k]).ravel()) / jnp.linalg.norm(reference[k].ravel()))
            for k in reference}
        record["finite_" + path] = bool(all(jnp.isfinite(v).all() for v in out.values()))
    auto, xla = record["rel_err"]["auto"], record["rel_err"]["xla"]
    record["ok"] = bool(record["finite_auto"] and record["tokens_dropped"]["auto"] == 0
                        and all(auto[k] <= 2 * xla[k] + 1e-3 for k in auto))
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="write the records as JSON here")
    args = parser.parse_args(argv)

    backend = type(make_gmm(MoEConfig(gmm_backend="auto"))).__name__
    print(f"device {jax.devices()[0].device_kind}; moe.gmm_backend=auto is {backend}")
    records = []
    for name, case in CASES.items():
        record = run_case(name, case)
        records.append(record)
        errs = " ".join(f"{k}={record['rel_err']['auto'][k]:.2e}/{record['rel_err']['xla'][k]:.2e}"
                        for k in record["rel_err"]["auto"])
        print(f"{'ok  ' if record['ok'] else 'FAIL'} {name}: empty experts {record['empty_experts']}, "
              f"rel. err auto/xla vs f32: {errs}")
    if args.out:
        with open(args.out, "w") as stream:
            json.dump({"environment": environment(), "auto_backend": backend,
                       "records": records}, stream, indent=1)
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
