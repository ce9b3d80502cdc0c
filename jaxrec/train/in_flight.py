"""A bound on how far a loop may dispatch ahead of the devices.

A jitted call returns before its program has run, so a Python loop can queue
many programs ahead. On XLA:CPU with several devices that can deadlock: each
device admits at most 32 programs in flight (a semaphore that XLA takes on its
worker pool, so devices do not take it in dispatch order). When later programs
hold all of one device's places before an earlier program with a collective
(``all_gather``, ``psum``, ``all_to_all``) gets one there, the other devices
wait in that collective for a participant that can never start, and after 40 s
XLA aborts the process ("Expected 8 threads to join the rendezvous, but only 7
of them arrived"). A plain ``shard_map`` + ``all_gather`` loop without jaxrec
reproduces it about 30 iterations ahead of the devices. Every loop that
dispatches multi-device programs (the train pipeline, evaluation) therefore
waits for the result of the program ``limit`` calls back before going on: the
host still overlaps the devices, but never by more than ``limit`` steps.
"""

from __future__ import annotations

import collections
from typing import Any

import jax


class InFlight:
    """Keeps at most ``limit`` dispatched results unfinished.

    Args:
        limit: results allowed to be outstanding (each may stand for several
            programs, e.g. a step and its metric update); 2 keeps the host one
            step ahead while the device runs the current one.

    Example:
        >>> window = InFlight(2)
        >>> for batch in batches:
        ...     state = update(state, eval_step(params, batch))
        ...     window.push(state)  # never donated later: it is waited on
    """

    def __init__(self, limit: int = 2):
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit=}")
        self.limit = limit
        self._pending: collections.deque = collections.deque()

    def push(self, result: Any) -> None:
        """Adds a just-dispatched result (a pytree of arrays that no later call
        donates); waits for the oldest ones beyond ``limit``."""
        self._pending.append(result)
        while len(self._pending) > self.limit:
            jax.block_until_ready(self._pending.popleft())

    def wait(self) -> None:
        """Waits for every pending result."""
        while self._pending:
            jax.block_until_ready(self._pending.popleft())
