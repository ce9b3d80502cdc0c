"""prefetch: order, errors re-raised where they occurred, bounded read-ahead, stopping."""

import threading
import time

import pytest

from jaxrec.datasets import prefetch


def test_prefetch_preserves_order():
    assert list(prefetch(iter(range(50)), size=3)) == list(range(50))
    assert list(prefetch([], size=1)) == []


def test_prefetch_reraises_producer_errors():
    def gen():
        yield 1
        yield 2
        raise RuntimeError("bad line 7")

    it = prefetch(gen())
    assert next(it) == 1 and next(it) == 2
    with pytest.raises(RuntimeError, match="bad line 7"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_prefetch_stops_when_the_consumer_stops():
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    before = threading.active_count()
    with prefetch(endless(), size=2) as it:
        assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    time.sleep(0.2)
    n = len(produced)
    time.sleep(0.2)
    assert len(produced) == n <= 5 + 2 + 1  # bounded read-ahead, then stopped
    assert threading.active_count() == before
    with pytest.raises(ValueError, match="size must be >= 1"):
        prefetch([], size=0)


def test_prefetch_runs_a_map_in_the_producer_thread():
    # the train pipeline prefetches map(to_device, loader): the transfers happen ahead
    threads = []

    def to_device(x):
        threads.append(threading.current_thread())
        return 2 * x

    assert list(prefetch(map(to_device, range(6)), size=2)) == [0, 2, 4, 6, 8, 10]
    assert threads and all(t is not threading.main_thread() for t in threads)
