"""Training with expert parallelism equals training on one device: in one process, and across two processes.

Float32, the tiny preset's architecture at test_train.SMALL's widths on random tokens (tests/parallel_train_worker.py):
the per-step losses and every trained parameter and router bias agree to 1e-5 relative, and nothing is dropped.
Across two processes: the real `dropless train`, its losses equal to one process's.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from dropless.core.config import load_preset
from dropless.train.metrics import read_metrics
from tests import parallel_train_worker
from tests.test_train import SMALL

ROOT = Path(__file__).resolve().parents[1]
# The tiny preset's layers (MLA, one dense layer, then MoE layers of 8 experts in 4 groups with a shared expert, the
# routers' running input means) at the widths of test_train.SMALL: compiling the step, once per mesh, is what these
# tests spend.
NARROW = {k: v for k, v in SMALL.items() if k.startswith(("model.", "moe."))}


def train_losses(overrides: dict, devices=None) -> dict:
    return parallel_train_worker.train_losses({**NARROW, **overrides}, devices)


@pytest.fixture(scope="module")
def one_device():
    return train_losses({}, devices=jax.devices()[:1])


def _assert_same_training(got, want):
    assert got["tokens_dropped"] == 0 == want["tokens_dropped"]
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["checksums"], want["checksums"], rtol=1e-5)


def test_expert_parallel_training_matches_one_device(one_device):
    expert_parallel = train_losses({"parallel.expert": 4, "parallel.data": 2})
    assert expert_parallel["devices"] == 8 and one_device["devices"] == 1
    _assert_same_training(expert_parallel, one_device)


def test_unrolled_layers_and_gradient_accumulation_with_expert_parallelism_match_one_device(one_device):
    """`train.scan_layers=false` (deepseek-v3-proxy's setting: each layer's shard_map in straight-line code) and two
    microbatches of 8 sequences over 8 devices (expert 4 x data 2) train as one scanned batch of 16 on one device."""
    unrolled = train_losses({"parallel.expert": 4, "parallel.data": 2, "train.scan_layers": False,
                             "train.grad_accum_steps": 2})
    _assert_same_training(unrolled, one_device)


def test_routers_common_direction_and_attention_within_documents_with_expert_parallelism_match_one_device():
    """Two options whose numbers depend on how the batch is split over devices, in one run:
    moe.router_common_source="other_sequences" (each sequence's direction from the batch's other sequences, which
    expert x data parallelism splits over devices) with the running means it keeps, and data.document_mask (each
    device's rows attend within their own documents, forward and backward: the document ids enter each layer's
    per-batch-shard attention beside q, k and v). The same training."""
    options = {"moe.router_common_rate": 0.3, "moe.router_common_source": "other_sequences",
               "data.document_mask": True, "data.eos_id": 5}
    _assert_same_training(train_losses({**options, "parallel.expert": 4, "parallel.data": 2}),
                          train_losses(options, devices=jax.devices()[:1]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_processes(commands: list[list[str]]) -> list[tuple[int, str, str]]:
    """Run `commands[i]` as process i of one jax.distributed run on localhost (2 CPU devices each). Returns each
    one's (exit status, stdout, stderr)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0",
           "DROPLESS_COORDINATOR": f"127.0.0.1:{_free_port()}", "DROPLESS_NUM_PROCESSES": str(len(commands))}
    workers = [subprocess.Popen(command, cwd=ROOT, env={**env, "DROPLESS_PROCESS_ID": str(i)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i, command in enumerate(commands)]
    try:
        outputs = [worker.communicate(timeout=400) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    return [(worker.returncode, stdout, stderr) for worker, (stdout, stderr) in zip(workers, outputs)]


def run_two_processes(command: list[str]) -> list[str]:
    """Run `command` as processes 0 and 1 (run_processes); both must succeed. Returns their standard outputs."""
    results = run_processes([command, command])
    for status, _, stderr in results:
        assert status == 0, stderr[-3000:]
    return [stdout for _, stdout, _ in results]


def test_dropless_train_across_two_processes_matches_one_process(tmp_path):
    """The real CLI in two jax.distributed processes (2 CPU devices each) sharing one run directory, the expert axis
    across both (parallel.expert=4): the losses equal one process's on 8 devices, process 0 writes config,
    tokenizer and metrics, both take part in the checkpoint, nothing is dropped."""
    from dropless.train import checkpoint as ckpt
    from dropless.train.loop import train
    from tests.test_train import small_config, write_corpus

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus)
    # train_losses' settings (OVERRIDES, the tiny preset's batch and schedule horizon): the one-process run below
    # trains the very step test_expert_parallel_training_matches_one_device compiled, and loads it from the cache.
    tiny = load_preset("tiny").train
    settings = {**SMALL, **parallel_train_worker.OVERRIDES, "train.batch_size": tiny.batch_size,
                "train.schedule_steps": tiny.steps, "parallel.expert": 4, "train.eval_every": 2,
                "train.checkpoint_every": 2, "train.steps": 3, "train.plot": False}
    run_dir = tmp_path / "run"
    outputs = run_two_processes([sys.executable, "-m", "dropless.cli", "train", "--data", str(corpus),
                                 "--run-dir", str(run_dir), "--no-progress", "parallel.data=1",
                                 *(f"{k}={v}" for k, v in settings.items())])
    assert "4 cpu device(s)" in outputs[0] and "tokens dropped: 0" in outputs[0]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]  # written once, by process 0
    assert all(r["tokens_dropped"] == 0 for r in records if "loss" in r)
    assert ckpt.latest_step(run_dir) == 3
    # One process, 8 devices (expert 4 x data 2), the same run: the same losses in float32 (step 3's loss follows
    # two updates of every parameter and router bias).
    train(small_config(corpus, **{**settings, "parallel.data": 2}), tmp_path / "one", progress=False,
          log=lambda s: None)
    one_losses = [r["loss"] for r in read_metrics(tmp_path / "one") if "loss" in r]
    np.testing.assert_allclose([r["loss"] for r in records if "loss" in r], one_losses, rtol=1e-5)
