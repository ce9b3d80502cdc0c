"""Evicted rows on their way back to the host while later batches are prepared.

A pipeline prepares batch ``i + 1`` (and stages its missed rows from the host)
while batch ``i``'s evicted rows are still on the device or being written back.
On the staged path a fill of such a row would read a stale host value: it is
*late*, and copied again when its batch is loaded (``Mover.apply``). In place (the
CPU's), moves read the host in program order and nothing is ever late.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np

from .ids import CachedTable
from .mover import Pending
from .slots import Move

MAX_BATCHES = 255  # batches whose evicted rows are not back yet: the uint8 counts' bound


class Evicted(NamedTuple):
    """A prepared batch whose evicted rows are not back on the host yet."""

    serial: int  # its prepare's number
    rows: dict[str, np.ndarray]  # per table key: its distinct evicted rows, local rows


class InFlight:
    """The evictions of prepared batches not yet back on the host, and the last load's
    write-back still to do (``RowCache``'s bookkeeping between prepare and load).

    Invariants (``lock`` guards ``batches`` and ``counts``; ``prepare`` may run in a
    pipeline's thread while a load writes back):

    - ``batches`` are in ascending serial order, at most :data:`MAX_BATCHES` of them.
    - ``counts[key][r]`` is the number of ``batches`` that evict local row ``r`` of
      table ``key`` (a batch's rows are distinct: each adds one), so a fill is late
      exactly where its row's count is nonzero. Checked cheaply: a release never takes
      a count below zero.
    - ``pending`` is the last applied load's evictions and its serial, or ``None``; its
      batch leaves ``batches`` once :meth:`write_back` has written them.
    - ``counting=False`` (the in-place path): ``batches`` and ``counts`` stay empty.
    """

    def __init__(self, tables: Iterable[CachedTable], *, counting: bool):
        tables = list(tables)
        self.offsets = {t.key: t.host.rows[0] for t in tables}  # first logical row held here
        self.counts: dict[str, np.ndarray] = {}  # a uint8 per host row held here
        if counting:
            for t in tables:
                self.counts[t.key] = np.zeros(t.host.rows[1] - t.host.rows[0], np.uint8)
        self.counting = counting
        self.batches: list[Evicted] = []
        self.pending: tuple[Pending, int] | None = None
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.batches)

    def check_room(self) -> None:
        """Refuses another prepared batch when :data:`MAX_BATCHES` wait already."""
        if len(self.batches) >= MAX_BATCHES:
            raise ValueError(
                f"{len(self.batches)} prepared batches are not loaded yet: load "
                f"some first (at most {MAX_BATCHES} may wait)"
            )

    def late(self, moves: Mapping[str, Move]) -> dict[str, np.ndarray] | None:
        """Per table, which fill rows an earlier batch evicts whose value is not back on
        the host yet (``None``: none is in flight)."""
        with self.lock:
            if not self.batches:
                return None
            return {
                key: self.counts[key][m.fill_rows - self.offsets[key]] > 0
                for key, m in moves.items()
            }

    def add(self, serial: int, moves: Mapping[str, Move]) -> None:
        """Records prepared batch ``serial``'s evictions (after every earlier one's)."""
        if not self.counting:
            return
        evicted = {k: m.evict_rows - self.offsets[k] for k, m in moves.items()}
        with self.lock:
            if self.batches and serial <= self.batches[-1].serial:
                raise RuntimeError(f"batch {serial} recorded after {self.batches[-1].serial}")
            for k, rows in evicted.items():
                self.counts[k][rows] += 1  # distinct rows: one add each
            self.batches.append(Evicted(serial, evicted))

    def hold(self, pending: Pending, serial: int) -> None:
        """Load ``serial`` ran: its evictions are on their way (:meth:`write_back`)."""
        self.pending = (pending, serial)

    def write_back(self) -> None:
        """Waits for the last load's evicted rows and writes them to the host (kept for
        another try if that fails)."""
        if self.pending is not None:
            pending, serial = self.pending
            pending.write_back()
            self.pending = None
            self.release(serial)

    def release(self, serial: int) -> None:
        """The evictions of batches up to ``serial`` are back on the host."""
        with self.lock:
            done = [b for b in self.batches if b.serial <= serial]
            for b in done:
                for k, rows in b.rows.items():
                    if len(rows) and not self.counts[k][rows].all():
                        raise RuntimeError(f"table {k!r}: an evicted row counted out twice")
                    self.counts[k][rows] -= 1
            self.batches = self.batches[len(done) :]

    def clear(self) -> None:
        """Forgets everything in flight (the host tables were replaced)."""
        with self.lock:
            self.pending = None
            self.batches = []
            for c in self.counts.values():
                c.fill(0)
