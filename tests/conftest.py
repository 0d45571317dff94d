"""Suite-wide ordering for `make test`: the longest files run first.

`make test` gives each of its workers whole files (`--dist loadfile`), one at a time from the front of the
collection order (`--no-loadscope-reorder`). Started last, a file of several minutes keeps one worker busy after
the others have run out of work; started first, it runs beside the many short files, and the workers end
together. LONGEST_FIRST lists the files of 20 seconds or more, longest first (measured on 2 CPU cores with
--durations), except that the two whose tests start `dropless train` processes lead: those processes run beside
the worker's own tests from the start. Every other file keeps its place after them.

Python's cyclic garbage collector runs rarely in the workers (`pytest_configure`): tracing and lowering allocate
objects by the million, and each full collection walks the whole heap of JAX's caches and compiled programs.

The workers start with the XLA flags every dropless command adds to XLA_FLAGS (`xla_flags.apply`, idempotent):
JAX's persistent compilation cache keys each program by XLA_FLAGS as it is when the program compiles, so a worker
whose environment a command changed mid-run would miss what the other workers, and the commands the tests start
in subprocesses, compiled before or without it.
"""

from __future__ import annotations

from dropless.cli import fewer_collections
from dropless.core import xla_flags

LONGEST_FIRST = (
    "test_train_faults.py", "test_train_parallel.py", "test_gmm_tuning.py", "test_fp8_model.py",
    "test_gmm_fp8_kernels.py", "test_fp8.py", "test_ep_contract.py", "test_train_checkpoint.py", "test_train_step.py",
    "test_models_transformer.py", "test_plan_cost.py", "test_train.py", "test_cli.py", "test_plan_search.py",
    "test_bench_ep.py", "test_bench_step.py", "test_ep_wire.py", "test_moe_layer.py", "test_ep_executor.py",
    "test_bench_scale.py", "test_models_mtp.py", "test_bench_plan.py", "test_gmm.py", "test_models_attention.py",
    "test_moe_permute.py", "test_convert_fixtures.py", "test_train_offload.py", "test_ep_alltoall.py",
)


def pytest_configure(config) -> None:
    fewer_collections()  # the dropless command's own setting
    xla_flags.apply()


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # sort is stable: tests keep their order inside a file, and the unlisted files theirs.
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
