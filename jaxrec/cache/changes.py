"""The rows of cached tables changed since the last delta link (``RowCache.publish_delta``).

A cached table's row changes only in a train step, while it sits in a slot, and
the step marks that slot (``jaxrec.embedding.track_touched_rows``: the batch's ids
are slots, so the marks are over slots). A slot can hold other rows later, so a
row trained since the last link is, at the next publish, either

- still in the slot it was trained in: the row a marked slot holds now (what the
  device holds, ``RowCache.flush``'s view: prefetched batches not loaded yet do
  not count), or
- evicted since, by a load after the link: written back to its host table.

So the changed rows are ``{row a marked slot holds now} | {rows loads wrote back
since the last link}``, a superset (looked-up rows whose update was zero, rows
evicted unchanged) whose values are read from the flushed host tables, so a
delta holds exactly the logical rows' current values. Evictions are recorded when
their batch is *loaded*, not prepared: a batch prefetched before a link may evict,
after it, a row trained after it.

Cost, from ``RowCache.save_base`` (or ``restore_deltas``) on: a bool per host row
held here (1 byte, against at least ``4 * dim`` of its weights), and per load a
write of one byte per evicted row (rows the load moves anyway). No per-id host
work: the device slot maps' path stays on the device. A publish reads each slot
table's marks (a bool per slot), the occupied slots and the written-back mask.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from .ids import CachedTable
from .slots import Move


class ChangedRows:
    """Per cached table (checkpoint key), the host rows that loads wrote back since the
    marks were cleared: a bool per row this process holds."""

    def __init__(self, tables: Iterable[CachedTable]):
        tables = list(tables)
        self.offsets = {t.key: t.host.rows[0] for t in tables}
        self.masks = {t.key: np.zeros(t.host.rows[1] - t.host.rows[0], np.bool_) for t in tables}

    def written_back(self, moves: Mapping[str, Move]) -> None:
        """Records a loaded batch's evictions (its :class:`Move` per key, logical rows)."""
        for key, m in moves.items():
            if len(m.evict_rows):
                self.masks[key][m.evict_rows - self.offsets[key]] = True

    def rows(self, key: str) -> np.ndarray:
        """The recorded logical rows of ``key``: ascending int64."""
        return np.flatnonzero(self.masks[key]).astype(np.int64) + self.offsets[key]

    def clear(self) -> None:
        for mask in self.masks.values():
            mask.fill(False)


def changed_rows(
    changes: ChangedRows,
    marked: Mapping[str, np.ndarray],
    held: Mapping[str, tuple[np.ndarray, np.ndarray]],
) -> dict[str, np.ndarray]:
    """``{key: ascending int64 logical rows changed since the last link}`` for each cached
    table in ``held``.

    Args:
        changes: the rows written back since the last link.
        marked: per table key, the slots train steps marked (global slot ids).
        held: per table key, ``(slots, rows)`` the device holds now (this process's).
    """
    out = {}
    for key, (slots, rows) in held.items():
        now = rows[np.isin(slots, marked[key])]
        out[key] = np.union1d(now, changes.rows(key)).astype(np.int64)
    return out
