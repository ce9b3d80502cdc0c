"""Which rows of a table shard sit in which cache slots, and which row a miss replaces.

Host-side bookkeeping of one shard's device cache (FBGEMM keeps the same state in
``lxu_cache_state`` / ``lru_state`` / ``lfu_state`` on the device). Fully
associative: a miss may take any slot that the batch does not use. LRU evicts the
slots used longest ago; LFU the rows looked up least often since the start (counts
survive eviction, as FBGEMM's ``lfu_state`` does).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..distributed.types import CacheAlgorithm


class CacheTooSmallError(ValueError):
    """A batch looks up more distinct rows of a shard than its cache has slots."""


class Plan(NamedTuple):
    """What one batch needs of a shard's cache (see :meth:`SlotMap.plan`)."""

    fill_rows: np.ndarray  # [M] int64, distinct rows not cached
    hit_slots: np.ndarray  # slots of the cached ids (repeats allowed)
    hits: int  # distinct cached rows
    counts: tuple | None  # LFU: (distinct rows, ids per row)


class Assignment(NamedTuple):
    """One batch's moves (shard-local slots and rows)."""

    fill_slots: np.ndarray  # [M] int64, slots that receive a missed row
    fill_rows: np.ndarray  # [M] int64, the missed rows (shard-local)
    evict_slots: np.ndarray  # [V] int64, slots whose row goes back to host memory first
    evict_rows: np.ndarray  # [V] int64, those rows (shard-local)
    hits: int  # distinct rows found cached


class SlotMap:
    """The cache state of one shard: ``rows`` table rows, ``slots`` device slots.

    Memory: 4 bytes per row (its slot) + 16 per slot (its row, its last use), and 4
    more per row for LFU (the counts).
    """

    def __init__(self, rows: int, slots: int, algorithm: CacheAlgorithm):
        if slots < 1:
            raise ValueError(f"a cache needs at least one slot, got {slots}")
        self.rows, self.slots, self.algorithm = rows, slots, CacheAlgorithm(algorithm)
        self.slot_of_row = np.full(rows, -1, np.int32)
        self.row_of_slot = np.full(slots, -1, np.int64)
        self.last_used = np.zeros(slots, np.int64)
        self.counts = np.zeros(rows, np.uint32) if self.algorithm is CacheAlgorithm.LFU else None
        self.used = 0  # slots [0, used) have held a row
        self.clock = 0
        self._seen = np.zeros(slots, bool)  # scratch of plan()

    def plan(self, ids: np.ndarray, where: str) -> Plan:
        """What a batch's shard-local ``ids`` (repeats allowed) need, without changing
        anything. Raises ``CacheTooSmallError`` when its distinct rows cannot all be
        cached at once (fully associative: any number up to the slot count can)."""
        slots = self.slot_of_row[ids]
        miss = slots < 0
        fill_rows = np.unique(ids[miss]).astype(np.int64)
        hit_slots = slots[~miss]
        self._seen[hit_slots] = True  # distinct hits without sorting them
        hits = int(np.count_nonzero(self._seen[: self.used]))
        self._seen[hit_slots] = False
        if hits + len(fill_rows) > self.slots:
            n = hits + len(fill_rows)
            raise CacheTooSmallError(
                f"{where}: the batch looks up {n} distinct rows but the cache has "
                f"{self.slots} slots; raise CacheParams.load_factor to at least "
                f"{n / max(self.rows, 1):.3g} (better 2x that) or use smaller batches"
            )
        counts = None
        if self.counts is not None:  # LFU counts every id
            counts = np.unique(ids, return_counts=True)
        return Plan(fill_rows, hit_slots, hits, counts)

    def assign(self, plan: Plan) -> Assignment:
        """Gives the planned batch's missed rows slots (evicting others) and marks its
        rows used; nothing else may have been assigned since :meth:`plan`."""
        self.clock += 1
        if plan.counts is not None:
            rows, n = plan.counts
            total = self.counts[rows].astype(np.int64) + n
            self.counts[rows] = np.minimum(total, np.iinfo(np.uint32).max)
        fill_rows = plan.fill_rows
        fresh = min(len(fill_rows), self.slots - self.used)
        fill_slots = np.arange(self.used, self.used + fresh, dtype=np.int64)
        self.used += fresh
        self.last_used[plan.hit_slots] = self.clock  # the batch's hits and fresh slots stay
        self.last_used[fill_slots] = self.clock
        evict_slots = self._victims(len(fill_rows) - fresh)
        evict_rows = self.row_of_slot[evict_slots]
        self.slot_of_row[evict_rows] = -1
        fill_slots = np.concatenate([fill_slots, evict_slots])
        self.slot_of_row[fill_rows] = fill_slots
        self.row_of_slot[fill_slots] = fill_rows
        self.last_used[fill_slots] = self.clock
        return Assignment(fill_slots, fill_rows, evict_slots, evict_rows, plan.hits)

    def _victims(self, k: int) -> np.ndarray:
        """``k`` occupied slots to empty, none used by this batch (stamped ``clock``)."""
        if k <= 0:
            return np.zeros(0, np.int64)
        if self.algorithm is CacheAlgorithm.LRU:
            key = self.last_used.copy()
        else:
            key = self.counts[self.row_of_slot].astype(np.int64)
            key[self.last_used == self.clock] = np.iinfo(np.int64).max
        return np.sort(np.argpartition(key, k - 1)[:k]).astype(np.int64)

    def cached(self) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, rows)`` of every occupied slot."""
        slots = np.flatnonzero(self.row_of_slot >= 0)
        return slots, self.row_of_slot[slots]

    def clear(self) -> None:
        """Empties the cache (its rows must be in host memory already); LFU counts stay."""
        self.slot_of_row.fill(-1)
        self.row_of_slot.fill(-1)
        self.last_used.fill(0)
        self.used = 0
