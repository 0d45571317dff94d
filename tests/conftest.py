"""Suite-wide ordering for `make test`: the longest files run first.

`make test` gives each of its workers whole files (`--dist loadfile`), one at a time from the front of the
collection order (`--no-loadscope-reorder`). Started last, a file of several minutes keeps one worker busy after
the others have run out of work; started first, it runs beside the many short files, and the workers end
together. LONGEST_FIRST lists the files of a minute or more, longest first (measured on 2 CPU cores with
--durations); every other file keeps its place after them.
"""

from __future__ import annotations

LONGEST_FIRST = (
    "test_train_faults.py", "test_train_parallel.py", "test_fp8_model.py", "test_fp8.py", "test_gmm_tuning.py",
    "test_models_transformer.py", "test_bench_step.py", "test_cli.py", "test_train.py", "test_bench_ep.py",
    "test_train_checkpoint.py", "test_bench_scale.py", "test_models_mtp.py",
)


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # sort is stable: tests keep their order inside a file, and the unlisted files theirs.
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
