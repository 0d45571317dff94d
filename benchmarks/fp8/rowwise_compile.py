"""What XLA's e4m3 dot costs to compile: one dense FP8 matmul through XLA (the `rowwise` recipe's non-native path),
forward and both gradients, compiled and timed under XLA's default GEMM autotuning and with autotuning off
(`make bench-fp8-rowwise-compile`).

    python benchmarks/fp8/rowwise_compile.py --out fp8-rowwise-compile.json [--shapes 32768x7168x36864,...]

Off our kernels, `rowwise`'s dense products are e4m3 dot_generals that XLA hands to cuBLASLt, autotuning each
while it compiles; our kernels are not autotuned by XLA. Each setting runs in its own process (XLA reads XLA_FLAGS
once): for each shape T x K x N (the proxy's dense MLP gate+up and down, an attention projection),
`jax.jit(jax.value_and_grad(loss))` of `dropless.fp8.dense.fp8_matmul(x, w, Recipe("rowwise", native=False))`
is lowered, compiled (seconds) and run (ms, median of 5 after one warm-up), then the bf16 matmul. Each shape is
printed before it compiles, so a setting that runs out of time names the compile it was in.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = {"default": "", "autotune_off": "--xla_gpu_autotune_level=0"}
DEFAULT_SHAPES = "32768x7168x36864,32768x18432x7168,32768x7168x1536"


def measure(shapes: list[tuple[int, int, int]]) -> list[dict]:
    from dropless.core import xla_flags

    xla_flags.apply()  # the flags a training run compiles with, before the backend starts
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dropless.fp8.dense import fp8_matmul
    from dropless.fp8.recipe import Recipe

    out = []
    for t, k, n in shapes:
        kx, kw = jax.random.split(jax.random.key(0))
        x = jax.random.normal(kx, (t, k), jnp.bfloat16)
        w = jax.random.normal(kw, (k, n), jnp.float32) * k ** -0.5
        for name, matmul in (("xla_e4m3", lambda x, w: fp8_matmul(x, w, Recipe("rowwise", native=False))),
                             ("bf16", lambda x, w: x @ w.astype(x.dtype))):
            step = jax.jit(jax.value_and_grad(lambda x, w, f=matmul: jnp.sum(f(x, w).astype(jnp.float32)),
                                              argnums=(0, 1)))
            print(json.dumps({"compiling": f"{t}x{k}x{n}", "path": name}), flush=True)
            t0 = time.perf_counter()
            compiled = step.lower(x, w).compile()
            compile_s = time.perf_counter() - t0
            jax.block_until_ready(compiled(x, w))
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(x, w))
                times.append((time.perf_counter() - t0) * 1e3)
            ms = float(np.median(times))
            out.append({"shape": f"{t}x{k}x{n}", "path": name, "compile_s": round(compile_s, 2), "ms": round(ms, 3),
                        "tflops": round(6 * t * k * n / ms / 1e9, 1)})
            print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--shapes", default=DEFAULT_SHAPES)
    p.add_argument("--timeout", type=float, default=240, help="seconds per setting")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    if a.child:
        print("RESULT " + json.dumps(measure(shapes)), flush=True)
        return
    if not a.out:
        p.error("--out is required")
    from dropless.bench.records import environment, write_json

    records = []
    for setting, flags in SETTINGS.items():
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
        t0 = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, __file__, "--child", "--shapes", a.shapes], env=env, text=True,
                                  capture_output=True, timeout=a.timeout)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            rows = json.loads(lines[-1][7:]) if lines else []
            error = None if lines else (done.stderr.strip().splitlines() or ["no output"])[-1]
        except subprocess.TimeoutExpired as e:
            partial = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            lines = [json.loads(ln) for ln in partial.splitlines() if ln.startswith("{")]
            rows = [r for r in lines if "compiling" not in r]
            stuck = lines[-1] if lines and "compiling" in lines[-1] else None
            error = f"did not finish in {a.timeout:.0f} s" + (
                f", compiling {stuck['path']} at {stuck['compiling']}" if stuck else "")
        for r in rows:
            records.append({"setting": setting, "xla_flags": flags, **r})
        records.append({"setting": setting, "xla_flags": flags, "process_s": round(time.perf_counter() - t0, 1),
                        "error": error})
        print(setting, records[-1], flush=True)
        write_json(a.out, {"benchmark": "fp8-rowwise-compile", "environment": environment(), "records": records})


if __name__ == "__main__":
    main()
