"""The timing harness: the real training step built for measurement, and how calls and steps are timed.

`build(config)` returns the mesh, the shardings and the jitted `dropless.train.step` train step (state donated):
the very step `dropless.train.loop` runs (`dropless.train.setup`), without the data. `lower(setup)` lowers it
from abstract shapes, so a program can be compiled and its memory analysed without allocating a single parameter
(`dropless plan --compiled` compares XLA's memory analysis with the plan this way). Batches are uniform random token ids:
the router, the expert loads and every matmul are real; only the text is not.

Timing: `time_calls` (batches of back-to-back calls, one device sync per batch: a kernel's throughput),
`time_steps` (train steps one by one, each ended by a sync), `dense_matmul_tflops` (the dense bf16 reference
rate), and `compile_in_threads` (XLA's compilers release the GIL, so programs compile in parallel threads).
A kernel is checked against an f32 reference before it is timed (`REL_ERR_LIMIT`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import statistics
import sys
import threading
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from dropless.core import mesh as mesh_lib
from dropless.core.config import Config
from dropless.data.loader import load_token_dataset, resolve_eos_id
from dropless.train import setup as setup_lib
from dropless.train.setup import StepSetup, init_state  # noqa: F401  (the benchmarks' entry points)
from dropless.train.step import TrainState, make_eval_step

GIB = 1024**3
# A path's bf16 output against its f32 reference, before it is timed: correct paths stay well below (bf16 has
# an 8-bit mantissa), a wrong row gives an error of order one.
REL_ERR_LIMIT = 1e-2


# ------------------------------------------------------------------------------------------------ the step

def batch_shape(config: Config) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((config.train.batch_size, config.train.seq_len + 1), jnp.int32)


def abstract_args(setup: StepSetup) -> tuple[TrainState, jax.ShapeDtypeStruct]:
    """The step's arguments as ShapeDtypeStructs carrying their shardings (nothing is allocated)."""
    state = jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
                         setup.state_shapes, setup.state_shardings)
    batch = batch_shape(setup.config)
    return state, jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=setup.batch_sharding)


def build(config: Config, devices=None) -> StepSetup:
    """`dropless.train.setup.build` for the config as a run would train it: data.document_mask's id resolved from
    the data's tokenizer first, as a new run resolves it (the benchmarks' random batches hold few such ids, so the
    mask costs what it costs in training, not what a real corpus's documents would save)."""
    return setup_lib.build(config.replace(**{"data.eos_id": resolve_eos_id(config.data, config.model.vocab_size)}),
                           devices)


def lower(setup: StepSetup) -> jax.stages.Lowered:
    return setup.step.lower(*abstract_args(setup))


def random_batches(setup: StepSetup, count: int, seed: int = 0) -> list[jax.Array]:
    """`count` [B, S+1] batches of uniform random token ids, placed on the mesh."""
    rng = np.random.default_rng(seed)
    shape = batch_shape(setup.config).shape
    return [mesh_lib.place(rng.integers(0, setup.config.model.vocab_size, shape, dtype=np.int32), setup.batch_sharding)
            for _ in range(count)]


def peak_bytes(compiled) -> int | None:
    """The compiled program's peak device memory: arguments + outputs - donated aliases + XLA's temporaries."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
               + stats.temp_size_in_bytes)


def training_run(config: Config):
    """The trainer's step and held-out evaluation without its loop, for benchmarks that read every step: returns
    (setup, state, dataset, to_device, evaluate), where `evaluate(state)` is the mean held-out loss over the run's
    fixed held-out batches (`train.eval_batches`) and `to_device` places a batch for the step."""
    tc = config.train
    dataset, _ = load_token_dataset(config.data, config.model.vocab_size, tc.seq_len)
    setup = build(config)
    state = init_state(setup)
    eval_step = jax.jit(make_eval_step(config, setup.executor))

    def to_device(batch):
        return jax.device_put(batch, setup.batch_sharding)

    eval_data = [to_device(b) for b in dataset.eval_batches(tc.eval_batches, tc.batch_size)]

    def evaluate(s) -> float:
        return float(np.mean(jax.device_get([eval_step(s.params, s.model_state, b) for b in eval_data])))

    return setup, state, dataset, to_device, evaluate


# ------------------------------------------------------------------------------------------------ timing

@contextlib.contextmanager
def watchdog(seconds: float, what: str, fix: str, *, exit_code: int = 3):
    """End the process with one line naming `what` and the `fix` if the block has not finished in `seconds`. A GPU
    kernel that never completes (a deadlocked candidate) cannot be interrupted from Python; without this a tuner
    would wait forever and say nothing."""
    def expire():
        print(f"dropless: error: {what} did not finish in {seconds:g} s, so it never completes; {fix}", file=sys.stderr,
              flush=True)
        os._exit(exit_code)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def time_calls(fn: Callable, arg_sets: list[tuple], *, target_s: float = 0.06, batches: int = 5) -> float:
    """Median seconds per call: `batches` batches of back-to-back calls rotating over `arg_sets`, one sync
    per batch (the device runs the calls in order, so the last one's completion times the batch)."""
    jax.block_until_ready(fn(*arg_sets[0]))  # warm-up: compile and first run
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[1 % len(arg_sets)]))
    one = time.perf_counter() - t0
    calls = max(1, min(50, int(target_s / max(one, 1e-6))))
    if one > 0.1:  # a slow path (XLA's dense-masked ragged_dot): fewer samples, same median
        batches = min(batches, 3)
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for i in range(calls):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def time_steps(compiled, state, batches, *, warmup: int = 2, steps: int = 10, seconds: float = 5.0):
    """Run `warmup` steps, then time steps one by one until `steps` are timed or `seconds` have passed
    (at least 3). Returns (state, step times in seconds, the last step's metrics on the host)."""
    metrics = None
    for i in range(warmup):
        state, metrics = compiled(state, batches[i % len(batches)])
    jax.block_until_ready((state, metrics))
    times: list[float] = []
    while len(times) < steps and (len(times) < 3 or sum(times) < seconds):
        start = time.perf_counter()
        state, metrics = compiled(state, batches[len(times) % len(batches)])
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return state, times, jax.device_get(metrics)


def dense_matmul_tflops(size: int = 8192, warm_s: float = 1.0, batches: int = 7) -> float:
    """The bf16 rate of `a @ b` (size^3) on the default device: after `warm_s` seconds of the same matmul (a GPU
    that has just woken up runs below its clocks), the median of `batches` batches of back-to-back calls on two
    rotating input pairs, one sync per batch (`time_calls`, as the grouped-GEMM benchmark times its dense
    reference). A sync after every call would charge the host's round trip to the GPU, and that is a large part
    of one call of this size."""
    keys = jax.random.split(jax.random.key(0), 4)
    pairs = [tuple(jax.random.normal(k, (size, size), jnp.bfloat16) for k in keys[i:i + 2]) for i in (0, 2)]
    matmul = jax.jit(lambda x, y: x @ y)
    start = time.perf_counter()
    jax.block_until_ready(matmul(*pairs[0]))
    while time.perf_counter() - start < warm_s:
        jax.block_until_ready(matmul(*pairs[0]))
    return 2 * size**3 / time_calls(matmul, pairs, target_s=0.1, batches=batches) / 1e12


# ------------------------------------------------------------------------------------------------ compiling

def compile_in_threads(compile_one: Callable, jobs: Iterable, workers: int | None = None) -> list:
    """`[compile_one(job) for job in jobs]`, run in parallel threads (tracing holds the GIL, XLA's and Mosaic
    GPU's compilers mostly do not). `workers`: at most this many at once (default: one per job, up to the
    CPU count)."""
    jobs = list(jobs)
    workers = workers or min(len(jobs) or 1, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(compile_one, jobs))


def _bits(a):
    return jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize])


# One fused reduction per pair of leaves, no temporary of the leaves' size (a 256-expert weight gradient is 30 GB).
_equal_bits = jax.jit(lambda a, b: jnp.all(_bits(a) == _bits(b)))


def same_bits(got, want) -> bool:
    """Whether two pytrees of arrays hold the same bits, leaf by leaf (NaNs included, so not `==`)."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return all(g.shape == w.shape and g.dtype == w.dtype and bool(_equal_bits(g, w)) for g, w in pairs)


def first_line(error: BaseException, limit: int = 300) -> str:
    """An exception's first line, for a results record."""
    return str(error).split("\n")[0][:limit]
