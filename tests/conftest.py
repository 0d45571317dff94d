"""Suite-wide ordering for `make test`: the longest files run first.

`make test` gives each of its workers whole files (`--dist loadfile`), one at a time from the front of the
collection order (`--no-loadscope-reorder`). Started last, a file of several minutes keeps one worker busy after
the others have run out of work; started first, it runs beside the many short files, and the workers end
together. LONGEST_FIRST lists the files of 20 seconds or more, longest first (measured on 2 CPU cores with
--durations), except that the two whose tests start `dropless train` processes lead: those processes run beside
the worker's own tests from the start. Every other file keeps its place after them.

Python's cyclic garbage collector runs rarely in the workers (`pytest_configure`): tracing and lowering allocate
objects by the million, and each full collection walks the whole heap of JAX's caches and compiled programs.

The GPU interpreter's callbacks take their arguments without a copy to a JAX array (`pytest_configure`, where
the reason is given).

The workers start with the XLA flags every dropless command adds to XLA_FLAGS (`xla_flags.apply`, idempotent):
JAX's persistent compilation cache keys each program by XLA_FLAGS as it is when the program compiles, so a worker
whose environment a command changed mid-run would miss what the other workers, and the commands the tests start
in subprocesses, compiled before or without it.
"""

from __future__ import annotations

import inspect

import numpy as np

from dropless.cli import fewer_collections
from dropless.core import xla_flags

LONGEST_FIRST = (
    "test_train_faults.py", "test_train_parallel.py", "test_gmm_tuning.py", "test_fp8_model.py", "test_fp8.py",
    "test_generate_cache.py", "test_train_checkpoint.py", "test_gmm_fp8_kernels.py", "test_train_step.py",
    "test_train.py", "test_ep_contract.py", "test_bench_ep.py", "test_models_transformer.py", "test_ep_executor.py",
    "test_models_documents.py", "test_generate_speculative.py", "test_plan_cost.py", "test_cli.py",
    "test_bench_step.py", "test_moe_layer.py", "test_ep_wire.py", "test_bench_scale.py", "test_models_mtp.py",
    "test_bench_plan.py", "test_ep_alltoall.py", "test_moe_permute.py", "test_convert_fixtures.py",
    "test_models_attention.py", "test_train_offload.py", "test_train_evaluate.py", "test_gmm.py",
    "test_cli_errors.py", "test_bench_expert_stage.py", "test_ep_chunked.py",
)


def pytest_configure(config) -> None:
    fewer_collections()  # the dropless command's own setting
    xla_flags.apply()
    _io_callbacks_without_copies()


def _io_callbacks_without_copies() -> None:
    """Pallas's Mosaic GPU interpreter (the kernel tests) runs every shared-memory access and barrier as a
    `jax.experimental.io_callback`, some 1,200 per kernel call, and JAX copies each callback's arguments, numpy
    arrays from XLA, into JAX arrays on a CPU device first (`io_callback_impl`): a quarter to a third of the kernel tests' time. The
    interpreter reads them back as numpy, so its callbacks here take XLA's numpy arrays as they come (its one
    reader that wants a JAX array, `_to_int`, also takes a numpy scalar). The kernels' arithmetic runs in XLA either
    way; only the copies go. Applied only where JAX's functions are the ones this was written against; elsewhere
    the tests run the unchanged, slower interpreter."""
    try:
        from jax._src import callback, config, mesh, sharding_impls, tree_util, xla_bridge
        from jax._src.pallas.mosaic_gpu.interpret import shared_memory
    except ImportError:
        return
    expected = ["args", "result_avals", "callback", "sharding", "ordered"]
    if (list(inspect.signature(callback.io_callback_impl).parameters) != expected
            or "api.device_put(args, cpu_device)" not in inspect.getsource(callback.io_callback_impl)
            or list(inspect.signature(getattr(shared_memory, "_to_int", len)).parameters) != ["x"]):
        return

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        del result_avals, sharding, ordered
        cpu_device, *_ = xla_bridge.local_devices(backend="cpu")
        with (config.default_device(cpu_device),
              sharding_impls._internal_use_concrete_mesh(mesh.empty_concrete_mesh),
              mesh.use_abstract_mesh(mesh.empty_abstract_mesh)):
            return tree_util.tree_map(np.asarray, callback(*args))

    to_int = shared_memory._to_int
    callback.io_callback_impl = io_callback_impl
    shared_memory._to_int = lambda x: x.item() if isinstance(x, np.ndarray) else to_int(x)


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # sort is stable: tests keep their order inside a file, and the unlisted files theirs.
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
