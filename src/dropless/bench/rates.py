"""`dropless bench rates`: measure the planner's rate table (`dropless/plan/rates.json`) on the present device.

    dropless bench rates --out rates-h200.json        then    dropless plan --rates rates-h200.json ...

Each rate is the median of timed batches of calls (`harness.time_calls`): the dense bf16 matmul, the grouped GEMM
forward + backward (the configured backend, `moe.gmm_backend=auto`) on a DeepSeek-V3 gate+up projection's balanced
rows split over 32, 128 and 256 groups (2,048, 512 and 256 rows per expert: the table's points), causal attention
forward + backward
(`jax.nn.dot_product_attention`), and HBM bandwidth (a streaming elementwise pass). The link and host-copy rates
need several devices or pinned host memory and keep the packaged table's values. `--size small` runs the same
programs on CPU-sized shapes (the tests do).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from dropless.bench import harness
from dropless.bench.records import environment, write_json
from dropless.core import xla_flags
from dropless.core.arguments import ArgumentParser, check_output
from dropless.core.config import ConfigError, MoEConfig
from dropless.gmm.registry import make_gmm
from dropless.plan.cost import load_rates, rate_key

# (dense matmul size, gmm rows / K / N, attention batch / seq / heads / head dim, HBM elements) per size class.
SIZES = {
    "full": {"matmul": 8192, "gmm": (65536, 7168, 4096), "attention": (4, 4096, 32, 128), "hbm": 1 << 28,
             "groups": (32, 128, 256), "batches": 5},
    "small": {"matmul": 64, "gmm": (256, 32, 32), "attention": (1, 32, 2, 16), "hbm": 1 << 14,
              "groups": (4, 16), "batches": 2},
}


def gmm_tflops(rows: int, k: int, n: int, groups: int, batches: int = 5) -> float:
    gmm = make_gmm(MoEConfig(num_experts=groups))
    key_x, key_w, key_d = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (rows, k), jnp.bfloat16)
    w = jax.random.normal(key_w, (groups, k, n), jnp.bfloat16)
    dy = jax.random.normal(key_d, (rows, n), jnp.bfloat16)
    sizes = jnp.full((groups,), rows // groups, jnp.int32)

    @jax.jit
    def fwdbwd(x, w, dy):
        out, pullback = jax.vjp(lambda a, b: gmm(a, b, sizes), x, w)
        return out, *pullback(dy)

    return 3 * 2 * rows * k * n / harness.time_calls(fwdbwd, [(x, w, dy)], batches=batches) / 1e12


def attention_tflops(batch: int, seq: int, heads: int, dim: int, batches: int = 5) -> float:
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, do = (jax.random.normal(key, (batch, seq, heads, dim), jnp.bfloat16) for key in keys)

    @jax.jit
    def fwdbwd(q, k, v, do):
        out, pullback = jax.vjp(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=True), q, k, v)
        return out, *pullback(do)

    causal_flops = 2 * 2 * batch * seq * seq * heads * dim / 2
    return 3 * causal_flops / harness.time_calls(fwdbwd, [(q, k, v, do)], batches=batches) / 1e12


def hbm_gbps(elements: int, batches: int = 5) -> float:
    x = jnp.ones((elements,), jnp.float32)
    scale = jax.jit(lambda a: a * 1.0001)
    return 2 * 4 * elements / harness.time_calls(scale, [(x,)], batches=batches) / 1e9


def measure(size: str = "full") -> dict:
    """A rate table entry for the default device, in the packaged table's form, each value with its source."""
    s = SIZES[size]
    device = jax.devices()[0]
    env = environment()
    note = f"measured by 'dropless bench rates' on {device.device_kind}, {env.get('date')}, commit {env.get('commit')}"
    base = load_rates()
    kept = base[rate_key(base, device.device_kind, device.platform)]
    rows, k, n = s["gmm"]
    batches = s["batches"]
    measured = {
        "dense_tflops": harness.dense_matmul_tflops(s["matmul"], warm_s=0.0 if size == "small" else 1.0,
                                                    batches=batches),
        "gmm": [(rows // groups, gmm_tflops(rows, k, n, groups, batches)) for groups in s["groups"]],
        "attention_tflops": attention_tflops(*s["attention"], batches),
        "hbm_gbps": hbm_gbps(s["hbm"], batches),
    }
    entry = json.loads(json.dumps(kept))  # a copy: links, host copies, overhead and memory keep their values
    entry["platform"] = device.platform
    entry["dense_tflops"] = {"value": measured["dense_tflops"], "source": note}
    entry["gmm_tflops"] = {"by_rows_per_expert": [{"rows": r, "value": v, "source": f"{note}; {rows} x {k} x {n}"}
                                                  for r, v in sorted(measured["gmm"])]}
    entry["attention_tflops"] = {"value": measured["attention_tflops"], "source": note}
    entry["hbm_gbps"] = {"value": measured["hbm_gbps"], "source": note}
    memory = (device.memory_stats() or {}).get("bytes_limit") if hasattr(device, "memory_stats") else None
    if memory:
        entry["memory_gib"] = {"value": memory / 1024**3, "source": note}
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="dropless bench rates", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the table (the packaged one with this device's entry) to this file")
    parser.add_argument("--name", help="the entry's key (default: the device kind without spaces, e.g. NVIDIA_H200)")
    parser.add_argument("--size", choices=tuple(SIZES), default=None,
                        help="shapes: full (a GPU's, the default there) or small (a CPU's, the default there)")
    args = parser.parse_args(argv)
    if args.out:  # checked before the minutes of measuring, not at the write after them
        check_output("--out", args.out)
    xla_flags.apply()
    cpu = jax.default_backend() == "cpu"
    if args.size == "full" and cpu:
        raise ConfigError("--size full measures a GPU's shapes (an 8,192-square matmul, grouped GEMMs of 65,536 "
                          "rows), beyond a CPU's time and memory; use --size small (the default on a CPU).")
    args.size = args.size or ("small" if cpu else "full")
    start = time.perf_counter()
    entry = measure(args.size)
    name = args.name or jax.devices()[0].device_kind.replace(" ", "_")
    table = {**load_rates(), name: entry}
    for key in ("dense_tflops", "attention_tflops", "hbm_gbps"):
        print(f"{key:18s} {entry[key]['value']:10.2f}")
    for point in entry["gmm_tflops"]["by_rows_per_expert"]:
        print(f"gmm {point['rows']:6d} rows/expert {point['value']:10.2f} TF/s")
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.out:
        write_json(args.out, table, indent=2)
        print(f"wrote {args.out}: use it with dropless plan --rates {args.out} --device {name}")
    return 0 if np.isfinite(entry["dense_tflops"]["value"]) else 1
