"""Which rows of a table shard sit in which cache slots, and which row a miss replaces.

Host-side bookkeeping of one shard's device cache (FBGEMM keeps the same state in
``lxu_cache_state`` / ``lru_state`` / ``lfu_state`` on the device). Fully
associative: a miss may take any slot that the batch does not use. LRU evicts the
slots used longest ago; LFU the rows looked up least often since the start (counts
survive eviction, as FBGEMM's ``lfu_state`` does; ties: the slot used longest ago).
Ties left: the lowest slot.

A batch goes through :meth:`SlotMap.plan` (what it needs; nothing changes, so a
batch that does not fit leaves the cache as it was), :meth:`SlotMap.assign` (slots
for its missed rows, its slots stamped used now) and :meth:`SlotMap.touch` (its ids
as slots, its rows counted; :meth:`SlotMap.finish` after a plan that wrote the
hits' slots). The passes run in C++ when the extension is built (``jaxrec.cpu``),
else in numpy; both give the same slots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..distributed.types import CacheAlgorithm
from .native import AVAILABLE as NATIVE
from .native import require as _kernels


class CacheTooSmallError(ValueError):
    """A batch looks up more distinct rows of a shard than its cache has slots."""


class Plan(NamedTuple):
    """What one batch needs of a shard's cache (see :meth:`SlotMap.plan`); the slots
    of its cached rows are marked in ``SlotMap.marks`` (and, on the numpy path, have
    ``SlotMap.seen == epoch``)."""

    fill_rows: np.ndarray  # [M] int64, distinct rows not cached
    hits: int  # distinct cached rows
    epoch: int
    scanned: bool = False  # the hits' slots are in ``outs`` already (see SlotMap.finish)


class Assignment(NamedTuple):
    """One batch's moves (shard-local slots and rows)."""

    fill_slots: np.ndarray  # [M] int64, slots that receive a missed row
    fill_rows: np.ndarray  # [M] int64, the missed rows (shard-local)
    evict_slots: np.ndarray  # [V] int64, slots whose row goes back to host memory first
    evict_rows: np.ndarray  # [V] int64, those rows (shard-local)
    hits: int  # distinct rows found cached


class Move(NamedTuple):
    """A table's moves for one batch, by logical row (global slots, int64): the rows
    written back to the host first (``evict_*``), then the missed rows copied in."""

    fill_slots: np.ndarray  # [M] slots that receive a missed row
    fill_rows: np.ndarray  # [M] the missed rows
    evict_slots: np.ndarray  # [V] slots whose row goes back to the host first
    evict_rows: np.ndarray  # [V] those rows


class SlotMap:
    """The cache state of one shard: ``rows`` table rows, ``slots`` device slots.

    Memory: 4 bytes per row (its slot) + 16 per slot (its row, its last use) and a
    bit (the planned batch's mark; the numpy path 8 bytes); LRU 24 more per slot,
    LFU ~40 more per slot (the C++ victims' order: they cost O(victims), not
    O(slots)) and 4 per row (the counts).
    """

    def __init__(self, rows: int, slots: int, algorithm: CacheAlgorithm, native: bool = NATIVE):
        if slots < 1:
            raise ValueError(f"a cache needs at least one slot, got {slots}")
        self.rows, self.slots, self.algorithm = rows, slots, CacheAlgorithm(algorithm)
        self.slot_of_row = np.full(rows, -1, np.int32)
        self.row_of_slot = np.full(slots, -1, np.int64)
        self.last_used = np.zeros(slots, np.int64)
        self.counts = np.zeros(rows, np.uint32) if self.algorithm is CacheAlgorithm.LFU else None
        # the planned batch's slots: == epoch on the numpy path (made at its first use, 8
        # bytes a slot), a bit each for the C++ passes (their only record: L1-sized, no
        # random load per id)
        self._seen: np.ndarray | None = None
        self.marks = np.zeros((slots + 63) // 64, np.uint64)
        self._marked = False  # marks set by a plan not assigned
        if self.algorithm is CacheAlgorithm.LRU and NATIVE:  # the C++ pass's order (LruLog)
            self.lru_log = np.zeros(4 * slots, np.int32)
            self.lru_pos = np.zeros(slots, np.int64)
        else:
            self.lru_log, self.lru_pos = np.zeros(0, np.int32), np.zeros(0, np.int64)
        self.lru_ends = np.zeros(2, np.int64)  # head, tail (tail -1: rebuilt from last_used)
        lfu = self.algorithm is CacheAlgorithm.LFU and NATIVE
        # the C++ pass's (cache.h)
        self.lfu_order: object | None = _kernels().lfu_order() if lfu else None
        self.used = 0  # slots [0, used) have held a row
        self.clock = 0
        self.epoch = 0
        self.native = native and NATIVE

    @property
    def seen(self) -> np.ndarray:
        """The numpy path's record of the planned batch's slots (``== epoch``)."""
        if self._seen is None:  # zeros: no slot holds a current epoch (epochs start at 1)
            self._seen = np.zeros(self.slots, np.int64)
        return self._seen

    def plan(
        self, parts: Sequence[np.ndarray], where: str, outs: Sequence[np.ndarray] | None = None
    ) -> Plan:
        """What a batch's shard-local ids (``parts``, in range, repeats allowed) need.
        Raises ``CacheTooSmallError`` when its distinct rows cannot all be cached at
        once (fully associative: any number up to the slot count can); the slot map is
        then as it was (only the scratch marks differ).

        ``outs`` (int32, one per part; the C++ pass only): receive the hits' slots in
        the same pass, -1 for misses; :meth:`finish` then completes them, in place of
        :meth:`touch`."""
        self.epoch += 1
        if self._marked:  # a plan not assigned (a later table's too small)
            self.marks.fill(0)
        self._marked = True
        native = self.native and all(p.dtype == np.int32 for p in parts)
        scanned = native and outs is not None and all(o.dtype == np.int32 for o in outs)
        if native:
            miss = np.empty(sum(len(p) for p in parts), np.int64)
            hits = n_miss = 0
            none, kernels = np.zeros(0, np.int32), _kernels()
            for j, p in enumerate(parts):  # misses are marked -2 in slot_of_row until unmarked
                out = outs[j] if scanned and outs is not None else none
                h, n_miss = kernels.cache_scan(
                    p, self.slot_of_row, self.slots, miss, n_miss, out, 0, self.marks
                )
                hits += h
            fill_rows = np.sort(miss[:n_miss])  # as numpy's unique: the same slots either way
            self.slot_of_row[fill_rows] = -1
        else:
            ids = np.concatenate(parts) if len(parts) != 1 else parts[0]
            slots = self.slot_of_row[ids]
            miss = slots < 0
            fill_rows = np.unique(ids[miss]).astype(np.int64)
            seen = self.seen
            seen[slots[~miss]] = self.epoch
            hit = seen == self.epoch
            hits = int(np.count_nonzero(hit[: self.used]))
            if self.native:  # the C++ assign stamps the marked slots
                bits = np.packbits(hit, bitorder="little")
                self.marks.view(np.uint8)[: len(bits)] = bits
        if hits + len(fill_rows) > self.slots:
            n = hits + len(fill_rows)
            raise CacheTooSmallError(
                f"{where}: the batch looks up {n} distinct rows but the cache has "
                f"{self.slots} slots; raise CacheParams.load_factor to at least "
                f"{_up(n / max(self.rows, 1))} (better 2x that) or use smaller batches"
            )
        return Plan(fill_rows, hits, self.epoch, scanned)

    def assign(self, plan: Plan) -> Assignment:
        """Gives the planned batch's missed rows slots (evicting rows it does not use)
        and marks the batch's slots used now (LRU); nothing else may have been planned
        since."""
        if plan.epoch != self.epoch:
            raise ValueError("SlotMap.assign: another batch was planned since this one")
        self.clock += 1
        fill_rows = plan.fill_rows
        fresh = min(len(fill_rows), self.slots - self.used)
        k = len(fill_rows) - fresh
        if self.native and fill_rows.dtype == np.int64:
            fill_slots, evict_rows = np.empty(len(fill_rows), np.int64), np.empty(k, np.int64)
            counts = self.counts if self.counts is not None else np.zeros(0, np.uint32)
            # (the batch's slots are stamped in the same call)
            m = (self.slot_of_row, self.row_of_slot, self.last_used, counts)
            m += (self.used, self.clock, fill_slots, evict_rows, self.marks)
            m += (self.lru_log, self.lru_pos, self.lru_ends, self.lfu_order)  # victims' orders
            self.used = _kernels().cache_assign(fill_rows, *m)
            evict_slots = fill_slots[:k]
        else:
            fresh_slots = np.arange(self.used, self.used + fresh, dtype=np.int64)
            self.used += fresh
            seen = self.seen
            seen[fresh_slots] = self.epoch  # not victims either
            evict_slots = self._victims(k)
            evict_rows = self.row_of_slot[evict_slots]
            self.slot_of_row[evict_rows] = -1
            fill_slots = np.concatenate([evict_slots, fresh_slots])  # ascending
            self.slot_of_row[fill_rows] = fill_slots
            self.row_of_slot[fill_slots] = fill_rows
            seen[fill_slots] = self.epoch
            # the batch's slots are those seen now (its hits and fills)
            self.last_used[seen == self.epoch] = self.clock
            self.marks.fill(0)
            self._orders_stale()
        self._marked = False
        return Assignment(fill_slots, fill_rows, evict_slots, evict_rows, plan.hits)

    def finish(self, ids: np.ndarray, out: np.ndarray) -> None:
        """After a scanned :meth:`plan` (its ``outs``) and :meth:`assign`: the missed ids'
        slots into ``out`` (the hits' are there already), rows counted (LFU)."""
        _kernels().cache_fix(ids, self.slot_of_row, self.slots, 0, out, self._counts())

    def touch(self, ids: np.ndarray, out: np.ndarray, base: int) -> None:
        """``out[:] = base + slot`` of each id (assigned, in range), rows counted (LFU).
        (The batch's slots were stamped by :meth:`assign`.)"""
        if self.native and ids.dtype == out.dtype == np.int32:
            out.fill(-1)  # every id is remapped
            _kernels().cache_fix(ids, self.slot_of_row, self.slots, base, out, self._counts())
            return
        if self.counts is not None:  # saturating, as the C++ pass
            rows, n = np.unique(ids, return_counts=True)
            total = self.counts[rows].astype(np.int64) + n
            self.counts[rows] = np.minimum(total, np.iinfo(np.uint32).max)
        out[:] = self.slot_of_row[ids] + base

    def _orders_stale(self) -> None:
        """The C++ victim orders are rebuilt from the stamps and counts when next used."""
        self.lru_ends[1] = -1
        if self.lfu_order is not None:
            _kernels().lfu_reset(self.lfu_order)

    def _counts(self) -> np.ndarray:
        return self.counts if self.counts is not None else np.zeros(0, np.uint32)

    def _victims(self, k: int) -> np.ndarray:
        """``k`` occupied slots to empty, none the planned batch uses (sorted): the k
        smallest keys, as the C++ ``cache_assign``: LRU (last use, slot), LFU (the
        row's count, last use, slot)."""
        if k <= 0:
            return np.zeros(0, np.int64)
        free = np.flatnonzero(self.seen[: self.used] != self.epoch)
        if self.counts is None:  # LRU (LFU counts rows)
            order = np.lexsort((free, self.last_used[free]))
        else:
            count = self.counts[self.row_of_slot[free]]
            order = np.lexsort((free, self.last_used[free], count))
        return np.sort(free[order[:k]]).astype(np.int64)

    def cached(self) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, rows)`` of every occupied slot."""
        slots = np.flatnonzero(self.row_of_slot >= 0)
        return slots, self.row_of_slot[slots]

    def clear(self) -> None:
        """Empties the cache (its rows must be in host memory already); LFU counts stay."""
        self.slot_of_row.fill(-1)
        self.row_of_slot.fill(-1)
        self.last_used.fill(0)
        if self._seen is not None:
            self._seen.fill(0)
        self.marks.fill(0)
        self._orders_stale()
        self.used = 0


def _up(x: float) -> str:
    """``x`` to 3 significant digits, rounded up (a bound to reach, not to miss)."""
    if x <= 0:
        return "0"
    step = 10.0 ** (math.floor(math.log10(x)) - 2)
    return f"{math.ceil(x / step - 1e-9) * step:.3g}"
