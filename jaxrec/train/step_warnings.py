"""Logging a train step's warnings on the host without waiting for the step.

Inside a train step, ``BoundsCheckMode.WARNING`` checks and the counts of ids
beyond the fast path of sharded collections (dropped with ``overflow="warn"``,
sent in extra rounds with ``"exact"``) are outputs of
the step's program (``StepReport.warnings`` / ``overflow_warned``, their
counts stacked in ``StepReport.counts``), not host callbacks: a program
holding a callback cannot be compiled without a live backend (deviceless for
a GPU, say), and each callback is a host round trip inside the step. The host
logs them with the same text as the callbacks of a plain module call, once
per step and in step order, when the step's counts are ready: checked at every
later step, and forced for all but the last two steps (their device work is
done by then in any pipelined loop, so this never waits on the step just
launched), or by :meth:`StepWarnings.flush`. A step reads one small array
(its stacked counts); the example ids only when a count is not zero.
"""

from __future__ import annotations

import collections

import numpy as np

from ..embedding.tape import log_overflow
from ..xla.bounds import log_out_of_range
from .guard import StepReport


class StepWarnings:
    """Pending warnings of recent train steps, logged once their counts are ready.

    Args:
        keep: at most this many steps stay pending; older ones are logged (a
            wait only if the device runs more than ``keep`` steps behind).
    """

    def __init__(self, keep: int = 2):
        self._keep = keep
        self._pending: collections.deque = collections.deque()

    def add(self, report: StepReport) -> None:
        """Queues a step's :class:`~jaxrec.train.guard.StepReport`, then logs every
        queued step that is ready (in order) or beyond ``keep``."""
        if report.counts is not None:  # a step that cannot warn costs nothing
            self._pending.append(report)
        while self._pending and (
            len(self._pending) > self._keep or self._pending[0].counts.is_ready()
        ):
            _log(self._pending.popleft())

    def flush(self) -> None:
        """Logs every pending step (waits for the last one)."""
        while self._pending:
            _log(self._pending.popleft())


def _log(report: StepReport) -> None:
    counts = np.asarray(report.counts)
    if not counts.any():
        return
    checks = list(report.warnings.items())
    for count, (where, (_, example)) in zip(counts[: len(checks)], checks, strict=True):
        if count > 0:
            log_out_of_range(int(count), int(example), where)
    for count, key in zip(counts[len(checks) :], report.overflow_warned, strict=True):
        log_overflow(count, key.split(":", 1)[1])
