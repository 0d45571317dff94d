"""The same collectives as benchmarks/collectives.py through PyTorch's NCCL (one process per GPU), and a plain
peer copy between the two GPUs: what the link and NCCL give outside XLA, as a ceiling for the JAX figures.
Only for the device machines (PyTorch is not a dropless dependency). Appends one JSON line to --out.

  python3 benchmarks/collectives_torch.py --out collectives.jsonl      (make bench-collectives runs it)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _timed(fn, calls: int = 20, batches: int = 7) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def _worker(rank: int, world: int, rows: int, hidden: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, init_method="tcp://127.0.0.1:29513")
    x = torch.ones(rows, hidden, dtype=torch.bfloat16, device="cuda")
    gathered = torch.empty(world * rows, hidden, dtype=torch.bfloat16, device="cuda")
    scattered = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    exchanged = torch.empty_like(x)
    results = {
        "all_gather": _timed(lambda: dist.all_gather_into_tensor(gathered, x)),
        "reduce_scatter": _timed(lambda: dist.reduce_scatter_tensor(scattered, gathered)),
        "all_to_all": _timed(lambda: dist.all_to_all_single(exchanged, x)),
    }
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> int:
    import torch
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=7168)
    args = p.parse_args()
    world = torch.cuda.device_count()
    row_bytes = args.hidden * 2
    block = args.rows * row_bytes
    a = torch.ones(args.rows, args.hidden, dtype=torch.bfloat16, device="cuda:0")
    b = torch.empty_like(a, device="cuda:1")
    copy_s = _timed(lambda: b.copy_(a, non_blocking=True))
    ops = {"peer_copy": {"ms": 1e3 * copy_s, "GBps_per_device": block / copy_s / 1e9}}
    print(f"torch: peer_copy {1e3 * copy_s:.3f} ms, {block / copy_s / 1e9:.0f} GB/s", flush=True)
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    workers = [context.Process(target=_worker, args=(r, world, args.rows, args.hidden, queue)) for r in range(world)]
    for w in workers:
        w.start()
    timings = queue.get()
    for w in workers:
        w.join()
    received = {"all_gather": (world - 1) * block, "reduce_scatter": (world - 1) * block,
                "all_to_all": (world - 1) * block // world}
    for name, seconds in timings.items():
        ops[name] = {"ms": 1e3 * seconds, "GBps_per_device": received[name] / seconds / 1e9}
        print(f"torch: {name} {1e3 * seconds:.3f} ms, {ops[name]['GBps_per_device']:.0f} GB/s per GPU", flush=True)
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    with open(args.out, "a") as stream:
        stream.write(json.dumps({"label": "torch-nccl", "env": env, "torch": torch.__version__,
                                 "nccl": ".".join(map(str, torch.cuda.nccl.version())), "devices": world,
                                 "block": [args.rows, args.hidden], "ops": ops}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
