"""``prefetch``: an iterator run in a background thread, a bounded number of items ahead.

The one background producer of jaxrec: data loading overlapped with training
(``prefetch(data.batches(...))``) and the train pipeline's batch preparation and
host-to-device transfers (``prefetch(map(to_device, loader), size=depth)``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

_DONE = object()


def prefetch(iterable: Iterable, size: int = 2) -> Prefetcher:
    """Runs ``iterable`` in a background thread, at most ``size`` items ahead.

    Order is preserved; an exception raised by the producer is re-raised in
    the consumer where it occurred; ``close()`` (or ``with``, or dropping the
    iterator) stops the thread.

    Example:
        >>> for batch in prefetch(data.batches(1024), size=2):
        ...     state, loss, _ = step(state, jax.device_put(batch))
    """
    return Prefetcher(iterable, size)


class Prefetcher:
    """The iterator :func:`prefetch` returns."""

    def __init__(self, iterable: Iterable, size: int = 2):
        if size < 1:
            raise ValueError(f"prefetch size must be >= 1, got {size}")
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._finished = False
        # the thread gets the queue and the flag, not ``self``: dropping the iterator stops it
        self._thread = threading.Thread(
            target=_produce,
            args=(iter(iterable), self._queue, self._stop),
            name="jaxrec-prefetch",
            daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        item, err = self._queue.get()
        if item is _DONE:
            self.close()
            if err is not None:
                raise err
            raise StopIteration
        return item

    def close(self) -> None:
        """Stops the producer thread (pending items are dropped)."""
        self._finished = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)  # absent when __init__ raised
        if stop is not None:
            stop.set()


def _put(q: queue.Queue, stop: threading.Event, item) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _produce(it: Iterator, q: queue.Queue, stop: threading.Event) -> None:
    try:
        for item in it:
            if not _put(q, stop, (item, None)):
                return
        _put(q, stop, (_DONE, None))
    except BaseException as e:  # handed to the consumer
        _put(q, stop, (_DONE, e))
