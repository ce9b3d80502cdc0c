"""Dynamic batching: concurrent requests' instances in one compiled call.

A :class:`DynamicBatcher` owns one thread that calls the model. Requests arrive
already decoded (the per-sample arrays of :func:`~jaxrec.inference.request.batch_arrays`);
the thread takes the oldest, then keeps adding queued requests while the
batch holds at most ``max_batch_size`` instances, waiting at most
``batch_timeout_ms`` for more (the names of TF-Serving's batching parameters;
Triton calls the wait ``max_queue_delay_microseconds``). With a zero timeout
it never waits: it takes what queued up while the previous call ran, so one
client alone sees no added latency and many clients share calls. The rows of
the answer are split back per request, in order; a request larger than
``max_batch_size`` runs alone.

Shapes: the model pads every call to its batch bucket (powers of two by
default, :class:`~jaxrec.inference.ExportedModel`), so batches of any size
compile at most ``log2(max_batch_size) + 1`` times.

Failures stay with their request: the finite-output check runs on each
request's own rows, and a call that raises is retried one request at a time,
so a bad request fails alone and its batch-mates get their answers.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .artifact import ExportedModel
from .request import check_finite_output

Done = Callable[[list | Exception], None]  # receives the predictions (a list) or the exception


class Pending(NamedTuple):
    """One decoded request waiting for the model.

    Attributes:
        arrays: ``(dense, values, lengths[, weights])``, each ``[n, ...]``.
        n: its number of instances.
        done: called once, from the batcher's thread, with a list of ``n``
            JSON-able predictions or the exception that failed the request.
    """

    arrays: tuple
    n: int
    done: Done


def prediction_rows(out: np.ndarray) -> list:
    """Model output ``[n, ...]`` as JSON-able rows: a float per instance when it
    has one value, else (nested) lists."""
    return [float(row.reshape(())) if row.size == 1 else row.tolist() for row in out]


class DynamicBatcher:
    """Runs queued requests through ``model.run`` in batches (see the module docstring).

    Args:
        model: an :class:`~jaxrec.inference.ExportedModel` (``run`` and
            ``max_batch_size`` are used).
        max_batch_size: the most instances in one call (capped by the model's
            own ``max_batch_size``); 1 runs every request alone.
        batch_timeout_ms: how long the first request of a batch may wait for
            others; 0 takes only what is already queued.
    """

    def __init__(
        self, model: ExportedModel, *, max_batch_size: int = 256, batch_timeout_ms: float = 0.0
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if not batch_timeout_ms >= 0:
            raise ValueError(f"batch_timeout_ms must be >= 0, got {batch_timeout_ms}")
        cap = getattr(model, "max_batch_size", None)
        self.model = model
        self.max_batch_size = int(max_batch_size if cap is None else min(max_batch_size, cap))
        self.timeout = float(batch_timeout_ms) / 1e3
        self.calls = 0  # compiled calls made, and the instances they carried
        self.instances = 0
        self.largest = 0
        self._queue: queue.SimpleQueue[Pending | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="jaxrec-batcher", daemon=True)
        self._thread.start()

    def submit(self, item: Pending) -> None:
        """Queues a request; ``item.done`` is called when it is answered."""
        self._queue.put(item)

    def close(self, timeout: float = 5.0) -> None:
        """Stops the thread after the batch it is running (queued requests are dropped)."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        carry: Pending | None = None
        while True:
            first = carry if carry is not None else self._queue.get()
            carry = None
            if first is None:
                return
            batch, n, stop = [first], first.n, False
            deadline = time.monotonic() + self.timeout
            while n < self.max_batch_size:
                left = deadline - time.monotonic()
                try:
                    item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                if n + item.n > self.max_batch_size:
                    carry = item  # first of the next batch
                    break
                batch.append(item)
                n += item.n
            self._run(batch)
            if stop:
                return

    def _run(self, batch: list[Pending]) -> None:
        if len(batch) == 1:
            arrays = batch[0].arrays
        else:
            columns = zip(*(p.arrays for p in batch), strict=True)
            arrays = tuple(np.concatenate(parts) for parts in columns)
        try:
            out = self.model.run(*arrays)
        except Exception as e:  # find the request that failed, one by one
            if len(batch) > 1:
                for p in batch:
                    self._run([p])
            else:
                _call(batch[0].done, e)
            return
        n = sum(p.n for p in batch)
        self.calls += 1
        self.instances += n
        self.largest = max(self.largest, n)
        start = 0
        for p in batch:
            rows = out[start : start + p.n]
            start += p.n
            try:
                check_finite_output(rows)  # instance numbers within this request
                result: list | Exception = prediction_rows(rows)
            except Exception as e:
                result = e
            _call(p.done, result)


def _call(done: Done, result: list | Exception) -> None:
    with contextlib.suppress(Exception):  # a callback must not kill the batcher's thread
        done(result)
