"""Logging a train step's warnings on the host without waiting for the step.

Inside a train step, ``BoundsCheckMode.WARNING`` checks and the dropped-id
counts of sharded collections built with ``overflow="warn"`` are outputs of
the step's program (``StepReport.warnings`` / ``StepReport.overflow_warned``),
not host callbacks: a program holding a callback cannot be compiled without a
live backend (deviceless for a GPU, say), and each callback is a host round
trip inside the step. The host logs them with the same text as the callbacks
of a plain module call, once per step and in step order, when the step's
counts are ready: checked at every later step, and forced for all but the last
two steps (their device work is done by then in any pipelined loop, so this
never waits on the step just launched), or by :meth:`StepWarnings.flush`.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from ..ops.bounds import log_out_of_range
from .tape import log_overflow


class StepWarnings:
    """Pending warnings of recent train steps, logged once their counts are ready.

    Args:
        keep: at most this many steps stay pending; older ones are logged (a
            wait only if the device runs more than ``keep`` steps behind).
    """

    def __init__(self, keep: int = 2):
        self._keep = keep
        self._pending: collections.deque = collections.deque()

    def add(
        self, warnings: Mapping[str, tuple[jax.Array, jax.Array]], overflow: Sequence[jax.Array]
    ) -> None:
        """Queues one step's ``where -> (count, example)`` checks and dropped-id counts,
        then logs every queued step that is ready (in order) or beyond ``keep``."""
        if warnings or overflow:  # a step that cannot warn costs nothing
            self._pending.append((dict(warnings), tuple(overflow)))
        while self._pending and (len(self._pending) > self._keep or _ready(self._pending[0])):
            _log(*self._pending.popleft())

    def flush(self) -> None:
        """Logs every pending step (waits for the last one)."""
        while self._pending:
            _log(*self._pending.popleft())


def _ready(entry: Any) -> bool:
    return all(x.is_ready() for x in jax.tree.leaves(entry))


def _log(warnings, overflow) -> None:
    warnings, overflow = jax.device_get((warnings, overflow))  # one transfer for the step
    for where, (count, example) in warnings.items():
        if int(count) > 0:
            log_out_of_range(int(count), int(example), where)
    for dropped in overflow:
        log_overflow(dropped)
