"""FP8 probe, dense GEMMs: what XLA's e4m3 matmul runs at for each operand layout and XLA setting, beside PyTorch.

    python benchmarks/fp8/xla_layouts.py --out fp8-probe-xla.json [--settings default,cublaslt,autotune0] [--no-torch]
    (part of make bench-fp8-probe)

Each XLA setting runs in its own process (XLA reads XLA_FLAGS once per process) under a time limit, and so does
PyTorch's reference (torch._scaled_mm, where torch is installed: it is no dependency of dropless); this process
gathers their JSON lines into one record, so a setting cut off by its limit keeps what it measured. Per variant:
TF/s, the custom calls and entry ops of the optimized HLO (which GEMM runs, whether a transpose fusion precedes it)
and the cuBLAS backend config. Layouts: NT = [M,K]·[N,K] (both operands K-major, `lax.dot_general` contracting
dim 1 of both); NN = [M,K]·[K,N] (`lax.dot`). Shapes: 8192³, then DeepSeek-V3's gate-up (65536x7168 -> 4096) and
down (65536x2048 -> 7168) under the default setting. Timing: median of 5 batches of 10 back-to-back calls (JAX: host
clock, one block_until_ready per batch; PyTorch: CUDA events).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

from dropless.bench.records import environment, write_json

ITERS, BATCHES = 10, 5
# name: (XLA_FLAGS, variants, with the DeepSeek-V3 shapes)
SETTINGS = {
    "default": ("", "all", True),
    "cublaslt": ("--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true", "layouts", False),
    "autotune0": ("--xla_gpu_autotune_level=0", "layouts", False),
}
TIMEOUT_S = {"default": 240, "cublaslt": 60, "autotune0": 60, "torch": 90}
SQUARE = (8192, 8192, 8192)
DSV3 = [(65536, 7168, 4096), (65536, 2048, 7168)]
LAYOUT_VARIANTS = ("f8 dot NN ->bf16", "f8 dot_general NT ->bf16")
DSV3_VARIANTS = ("bf16 dot_general NT", "f8 dot NN ->bf16", "f8 dot_general NT ->bf16",
                 "f8 NT ->f32, *row*col epilogue, ->bf16 (rowwise)")


def emit(**record):
    print(json.dumps(record), flush=True)


def jax_variants(jnp, lax, m, k, n):
    """name -> (function, arguments) of one M x K x N product. Not here: e4m3 with precision=HIGHEST, which did not
    finish within 75-120 s on the H200 (JAX 0.11.2) and so cost every variant after it."""
    import jax

    f8 = jnp.float8_e4m3fn
    nt = (((1,), (1,)), ((), ()))
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.bfloat16)
    bt = jax.random.normal(kb, (n, k), jnp.bfloat16)
    b = bt.T
    a8, b8, bt8 = a.astype(f8), b.astype(f8), bt.astype(f8)
    sa, sb = jnp.float32(1.0), jnp.float32(1.0)
    sa_M, sb_N = jnp.ones((m,), jnp.float32), jnp.ones((n,), jnp.float32)
    bf16 = lambda v: v.astype(jnp.bfloat16)
    return {
        "bf16 dot NN": (lambda x, y: x @ y, (a, b)),
        "bf16 dot_general NT": (lambda x, y: lax.dot_general(x, y, nt), (a, bt)),
        "f8 dot NN ->bf16": (lambda x, y: lax.dot(x, y, preferred_element_type=jnp.bfloat16), (a8, b8)),
        "f8 dot_general NT ->bf16": (lambda x, y: lax.dot_general(x, y, nt, preferred_element_type=jnp.bfloat16),
                                     (a8, bt8)),
        "f8 dot_general NT ->f32": (lambda x, y: lax.dot_general(x, y, nt, preferred_element_type=jnp.float32),
                                    (a8, bt8)),
        "f8 dot NN ->f32": (lambda x, y: lax.dot(x, y, preferred_element_type=jnp.float32), (a8, b8)),
        "dequant bf16 scalar scales NT ->bf16": (
            lambda x, y, u, v: lax.dot_general(bf16(x) * bf16(u), bf16(y) * bf16(v), nt,
                                               preferred_element_type=jnp.bfloat16), (a8, bt8, sa, sb)),
        "dequant f32 scalar scales NT ->f32 then bf16": (
            lambda x, y, u, v: bf16(lax.dot_general(x.astype(jnp.float32) * u, y.astype(jnp.float32) * v, nt,
                                                    preferred_element_type=jnp.float32)), (a8, bt8, sa, sb)),
        "f8 NT ->f32, *sa*sb epilogue, ->bf16 (tensorwise)": (
            lambda x, y, u, v: bf16(lax.dot_general(x, y, nt, preferred_element_type=jnp.float32) * (u * v)),
            (a8, bt8, sa, sb)),
        "f8 NT ->f32, *row*col epilogue, ->bf16 (rowwise)": (
            lambda x, y, u, v: bf16(lax.dot_general(x, y, nt, preferred_element_type=jnp.float32)
                                    * u[:, None] * v[None, :]), (a8, bt8, sa_M, sb_N)),
    }


def jax_worker(setting: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax import lax

    _, which, with_dsv3 = SETTINGS[setting]

    def timed(f, *args):
        f(*args).block_until_ready()
        f(*args).block_until_ready()
        times = []
        for _ in range(BATCHES):
            t0 = time.perf_counter()
            for _ in range(ITERS):
                out = f(*args)
            out.block_until_ready()
            times.append((time.perf_counter() - t0) / ITERS)
        return float(np.median(times)) * 1e3

    for shape in [SQUARE] + (DSV3 if with_dsv3 else []):
        m, k, n = shape
        flops = 2 * m * k * n
        variants = jax_variants(jnp, lax, m, k, n)
        keep = LAYOUT_VARIANTS if which == "layouts" else DSV3_VARIANTS if shape != SQUARE else tuple(variants)
        for name, (fn, args) in variants.items():
            if name not in keep:
                continue
            try:
                f = jax.jit(fn)
                hlo = f.lower(*args).compile().as_text()
                ms = timed(f, *args)
                entry = hlo[hlo.find("ENTRY"):]
                emit(lib="jax", setting=setting, op=name, shape=list(shape), ms=ms, tflops=flops / ms / 1e9,
                     custom_calls=re.findall(r'custom_call_target="([^"]+)"', hlo),
                     entry_ops=sorted(set(re.findall(r"\s(transpose|convert|fusion|copy|multiply|custom-call)\(",
                                                     entry))),
                     gemm_backend_config=[c[:600] for c in re.findall(
                         r'custom_call_target="__cublas[^"]*".*?backend_config=(\{.*?\})\n', hlo)][:2])
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                emit(lib="jax", setting=setting, op=name, shape=list(shape),
                     error=f"{type(e).__name__}: {str(e)[:400]}")
        del variants


def torch_worker() -> None:
    import torch

    f8 = torch.float8_e4m3fn

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(BATCHES):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(ITERS):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / ITERS)
        return float(np.median(times))

    def one_shape(m, k, n):  # its tensors go when it returns
        flops = 2 * m * k * n
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ms = timed(lambda: a @ b.T)
        emit(lib="torch", op="bf16 mm NT", shape=[m, k, n], ms=ms, tflops=flops / ms / 1e9)
        a8, b8 = a.to(f8), b.to(f8)
        one = torch.ones((), device="cuda")
        sa_M1, sb_1N = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
        scaled = lambda sa, sb, **kw: (lambda: torch._scaled_mm(a8, b8.T, scale_a=sa, scale_b=sb, **kw))
        variants = {"_scaled_mm tensorwise": scaled(one, one, out_dtype=torch.bfloat16),
                    "_scaled_mm tensorwise fast_accum": scaled(one, one, out_dtype=torch.bfloat16, use_fast_accum=True),
                    "_scaled_mm rowwise": scaled(sa_M1, sb_1N, out_dtype=torch.bfloat16),
                    "_scaled_mm rowwise fast_accum": scaled(sa_M1, sb_1N, out_dtype=torch.bfloat16,
                                                            use_fast_accum=True)}
        if (m, k, n) == SQUARE:
            variants["_scaled_mm tensorwise f32 out"] = scaled(one, one, out_dtype=torch.float32)
        for name, fn in variants.items():
            try:
                ms = timed(fn)
                emit(lib="torch", op=name, shape=[m, k, n], ms=ms, tflops=flops / ms / 1e9)
            except Exception as e:  # noqa: BLE001
                emit(lib="torch", op=name, shape=[m, k, n], error=str(e)[:300])
        if (m, k, n) == SQUARE:  # which cuBLAS kernels run
            from torch.profiler import ProfilerActivity, profile

            for name in ("_scaled_mm tensorwise", "_scaled_mm tensorwise fast_accum", "_scaled_mm rowwise"):
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    variants[name]()
                    torch.cuda.synchronize()
                emit(lib="torch", op=name, kernels=sorted(
                    {e.key for e in prof.key_averages() if e.device_type.name == "CUDA"}))

    emit(lib="torch", torch=torch.__version__)
    for shape in [SQUARE] + DSV3:
        one_shape(*shape)
        torch.cuda.empty_cache()


def gather(worker: str, xla_flags: str | None) -> tuple[list[dict], dict]:
    """Run one worker process; its JSON lines, and how it ended (a timeout keeps the lines printed before it)."""
    env = dict(os.environ)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    command = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--out", "-"]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S[worker])
        stdout, status = done.stdout, {"returncode": done.returncode, "stderr_tail": done.stderr[-2000:]}
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        status = {"timed_out_s": TIMEOUT_S[worker]}
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return lines, {"worker": worker, "xla_flags": xla_flags, "seconds": time.perf_counter() - t0, **status}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON record to write")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {','.join(SETTINGS)}")
    p.add_argument("--no-torch", action="store_true", help="leave out PyTorch's reference")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one setting (or 'torch') in this process
    args = p.parse_args()
    if args.worker:
        torch_worker() if args.worker == "torch" else jax_worker(args.worker)
        return 0
    settings = [s for s in args.settings.split(",") if s]
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        p.error(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    records, processes = [], []
    for setting in settings:
        lines, status = gather(setting, SETTINGS[setting][0])
        records += lines
        processes.append(status)
    if not args.no_torch:
        if importlib.util.find_spec("torch") is None:
            processes.append({"worker": "torch", "skipped": "PyTorch is not installed"})
        else:
            lines, status = gather("torch", None)
            records += lines
            processes.append(status)
    # environment() after the workers: it initialises JAX's GPU client here, which would hold their memory
    write_json(args.out, {"benchmark": "fp8-probe-xla-layouts", "environment": environment(),
                          "timing": f"median of {BATCHES} batches of {ITERS} back-to-back calls",
                          "processes": processes, "records": records})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
