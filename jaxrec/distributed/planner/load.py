"""The partitioner's load: what a width group's padded cost depends on, per rank.

A width group is padded to its fullest rank in each of seven quantities
(``Load``'s fields), so its cost is a function of their maxima over ranks.
One ``Load`` holds them per rank (``[n]`` arrays), for a candidate set of
ranks (``[k]`` or ``[hosts, shards]`` arrays, to score every candidate at
once), as maxima (Python scalars) or as what one shard adds (Python scalars).
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import numpy as np


def _max(a, b):  # the partitioner's hot path: no np.ndim
    return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


class Load(NamedTuple):
    """Seven quantities of a width group (per rank, per candidate, or their maxima).

    Each field is a Python scalar or an array; operations are fieldwise and
    broadcast like numpy.
    """

    rows: Any  # rows held (int)
    exp: Any  # expected ids per source, summed over the slots (float)
    nat: Any  # natural payload: the capacities of the features the slots read (int)
    slots: Any  # (int)
    vub: Any  # row-sum values, bounded with each table's whole payload (float)
    cache: Any  # cached groups: device cache slots (int)
    fetch: Any  # cached groups: expected missed ids per source (float)

    @classmethod
    def zeros(cls, n: int) -> Load:
        """Per-rank arrays of ``n`` ranks, empty."""
        i, f = np.int64, np.float64
        return cls(*(np.zeros(n, t) for t in (i, f, i, i, f, i, f)))

    @classmethod
    def stack(cls, loads) -> Load:
        """Arrays ``[len(loads)]`` from scalar loads."""
        return cls(*(np.asarray(v) for v in zip(*loads, strict=True)))

    def plus(self, other: Load) -> Load:
        return Load._make(map(operator.add, self, other))

    def top(self, other: Load) -> Load:
        """Fieldwise maximum (arrays broadcast; scalars stay Python scalars)."""
        return Load._make(map(_max, self, other))

    def at(self, index) -> Load:
        """The arrays indexed by ``index`` (ranks, or an array of them)."""
        return Load(*(a[index] for a in self))

    def item(self, rank: int) -> Load:
        """Rank ``rank``'s load as Python scalars."""
        return Load._make([a[rank].item() for a in self])

    def peak(self, axis: int | None = None) -> Load:
        """Maxima over ``axis`` (``None``: over all, as Python scalars)."""
        if axis is None:
            return Load(*(a.max().item() for a in self))
        return Load(*(a.max(axis=axis) for a in self))

    def top_at(self, loads: Load, deltas: dict[int, Load]) -> Load:
        """These maxima raised by ``loads`` (per-rank arrays) plus ``deltas`` at their
        ranks, as Python scalars (a loop: the partitioner's hot path)."""
        peak = list(self)
        for r, d in deltas.items():
            for i, (a, x) in enumerate(zip(loads, d, strict=True)):
                v = a[r].item() + x
                if v > peak[i]:  # as max(): ties keep the current maximum
                    peak[i] = v
        return Load._make(peak)

    def add_at(self, ranks, deltas: Load) -> None:
        """Adds ``deltas`` (arrays aligned with ``ranks``) to these per-rank arrays, in
        place (repeated ranks add up)."""
        for a, d in zip(self, deltas, strict=True):
            np.add.at(a, ranks, d)


ZERO = Load(0, 0.0, 0, 0, 0.0, 0, 0.0)  # maxima (and deltas) before anything is placed


class ShardLoad(NamedTuple):
    """A shard's placement fields (memoised per ``(option, shard)`` in
    ``CostModel.items``)."""

    load: Load  # what it adds to its rank (scalars)
    loads: tuple[float, ...]  # expected ids per source of each feature reading it
    split: bool  # a column shard
    split_ids: int  # the table's whole payload (row-sum values are bounded by it)
    calls: int  # row sums per step of its optimizer
    table: str  # its key: row sums are exchanged once per table on a rank
    peers: int  # the table's other column blocks (each gets the row sums)
