"""The background prefetcher: same order as direct calls, errors reach the consumer, clean shutdown."""

import threading
import time

import pytest

from dropless.data import Prefetcher


def _square(step):
    return step * step


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_yields_produce_of_each_step_in_order(depth):
    with Prefetcher(_square, start=5, stop=25, depth=depth) as items:
        assert list(items) == [_square(s) for s in range(5, 25)]


@pytest.mark.parametrize("depth", [0, 2])
def test_a_finished_prefetcher_keeps_raising_stop_iteration(depth):
    # A second next() after the end must not wait for a producer that has already returned.
    with Prefetcher(_square, start=0, stop=3, depth=depth) as items:
        assert list(items) == [0, 1, 4]
        with pytest.raises(StopIteration):
            next(items)
        assert list(items) == []


def test_unbounded_without_stop():
    with Prefetcher(_square, start=0, depth=2) as items:
        assert [next(items) for _ in range(50)] == [_square(s) for s in range(50)]


def test_order_holds_with_a_slow_consumer_and_a_jittery_producer():
    def produce(step):
        time.sleep(0.001 * (step % 3))
        return step

    with Prefetcher(produce, start=0, stop=30, depth=4) as items:
        seen = []
        for item in items:
            seen.append(item)
            time.sleep(0.001 * (item % 2))
    assert seen == list(range(30))


@pytest.mark.parametrize("depth", [0, 2])
def test_producer_error_reaches_the_consumer_at_its_step(depth):
    def produce(step):
        if step == 7:
            raise KeyError(f"bad step {step}")
        return step

    items = Prefetcher(produce, start=3, stop=20, depth=depth)
    assert [next(items) for _ in range(4)] == [3, 4, 5, 6]
    with pytest.raises(KeyError, match="bad step 7"):
        next(items)
    with pytest.raises(StopIteration):
        next(items)
    items.close()


def test_runs_ahead_at_most_depth_items():
    produced = []

    def produce(step):
        produced.append(step)
        return step

    with Prefetcher(produce, start=0, depth=3) as items:
        next(items)
        time.sleep(0.3)
        # One item consumed, `depth` waiting in the queue, and at most one blocked on the full queue.
        assert 4 <= len(produced) <= 5


def test_close_stops_the_thread_even_when_it_is_blocked_on_a_full_queue():
    items = Prefetcher(_square, start=0, depth=2)
    time.sleep(0.05)
    thread = items._thread
    assert thread.is_alive()
    items.close()
    assert not thread.is_alive()
    with pytest.raises(StopIteration):
        next(items)
    items.close()  # idempotent


def test_leaving_the_with_block_early_joins_the_thread():
    before = threading.active_count()
    with Prefetcher(_square, start=0, stop=1000, depth=2) as items:
        next(items)
    assert threading.active_count() == before
