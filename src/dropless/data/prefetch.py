"""A background thread that produces the next batches while the accelerator runs the current step.

`Prefetcher(produce, start, stop, depth)` yields `produce(start), produce(start + 1), ...` in order, keeping
up to `depth` results ready. An exception raised by `produce` is re-raised in the consumer at the step
where it happened; `close()` (or leaving the `with` block) stops the thread and waits for it.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")

_POLL_SECONDS = 0.1  # how often a blocked producer checks whether the consumer has gone away


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_DONE = object()


class Prefetcher(Iterator[T]):
    """Yields `produce(step)` for step in [start, stop) (forever if stop is None), `depth` ahead.

    `depth=0` produces synchronously in `__next__`, with no thread: the same results, for debugging.
    """

    def __init__(self, produce: Callable[[int], T], start: int = 0, stop: int | None = None, depth: int = 2):
        assert depth >= 0
        self._produce, self._step, self._stop, self._depth = produce, start, stop, depth
        self._closed = threading.Event()
        self._finished = False
        self._thread = None
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._run, args=(start,), name="dropless-prefetch", daemon=True)
            self._thread.start()

    def _run(self, step: int) -> None:
        while not self._closed.is_set():
            if self._stop is not None and step >= self._stop:
                self._put(_DONE)
                return
            try:
                item = self._produce(step)
            except BaseException as error:  # handed to the consumer, which re-raises it
                self._put(_Failure(error))
                return
            if not self._put(item):
                return
            step += 1

    def _put(self, item) -> bool:
        """Block until there is room or the consumer closed us; True if the item was queued."""
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Prefetcher[T]":
        return self

    def __next__(self) -> T:
        if self._finished or self._closed.is_set():
            raise StopIteration
        if self._thread is None:
            if self._stop is not None and self._step >= self._stop:
                self._finished = True
                raise StopIteration
            try:
                item = self._produce(self._step)
            except BaseException:
                self._finished = True
                raise
            self._step += 1
            return item
        item = self._queue.get()
        if item is _DONE:
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            raise item.error
        return item

    def close(self) -> None:
        """Stop the producer thread and wait for it; idempotent."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "Prefetcher[T]":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self):
        self._closed.set()  # lets an abandoned producer thread exit
