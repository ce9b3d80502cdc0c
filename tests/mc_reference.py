"""Plain-Python reference of TorchRec's MCH managed collision (lists and dicts, no arrays).

It follows ``torchrec.modules.mc_modules`` step by step: history of ids per
training call, coalesce every ``eviction_interval`` calls (unique ids, counts,
last access), optional threshold filter, frequency order, match, metadata
update, merged ranking (Python's stable sort), head/tail pairing, re-sort.
Scores use numpy float32 as TorchRec (and jaxrec) do.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

BIG = 2**32 - 1  # empty slot


class RefMCH:
    def __init__(
        self,
        zch_size,
        policy,
        interval,
        *,
        decay=1.0,
        threshold=None,
        input_hash_size=2**32 - 1,
        offset=0,
        history_capacity=None,
        max_evictions=None,
        mch_size=None,
    ):
        self.z, self.policy, self.interval, self.decay = zch_size, policy, interval, decay
        self.threshold, self.size, self.offset = threshold, input_hash_size, offset
        self.h, self.cap, self.mch = history_capacity, max_evictions, mch_size
        # sorted table entries: [key, row, count, last_access]
        self.table = [[BIG, offset + i, 0, 0] for i in range(zch_size)]
        self.iter, self.last_eviction, self.history = 0, 0, []

    def key(self, raw):
        return raw if raw is not None and 0 <= raw < self.size else None

    def step(self, raw_ids, training=True, residual=None):
        """``raw_ids``: list (None = padding). Returns (rows, evicted rows in order)."""
        keys = [self.key(r) for r in raw_ids]
        evicted = []
        if training:
            self.iter += 1
            for k in keys:
                if k is not None and (self.h is None or len(self.history) < self.h):
                    self.history.append((k, self.iter))
            if self.iter - self.last_eviction == self.interval:
                evicted = self._evict()
                self.last_eviction, self.history = self.iter, []
        slot_of = {e[0]: e[1] for e in self.table if e[0] != BIG}
        miss = self.offset + self.z - 1
        rows = []
        for k in keys:
            if k in slot_of:
                rows.append(slot_of[k])
            elif k is not None and self.mch:
                rows.append(self.offset + self.z + residual(k))
            else:
                rows.append(miss)
        return rows, evicted

    def _score(self, count, last):
        dist = np.float32(self.iter - last + 1)
        if self.policy == "lfu":
            return count
        if self.policy == "lru":
            return -(dist ** np.float32(self.decay))
        return np.float32(count) / dist ** np.float32(self.decay)

    def _evict(self):
        counts = Counter(k for k, _ in self.history)
        last = {}
        for k, it in self.history:
            last[k] = max(last.get(k, 0), it)
        uniq = sorted(counts)
        if self.threshold is not None and uniq:
            kind, mult = self.threshold
            total, n = np.float32(sum(counts[k] for k in uniq)), np.float32(len(uniq))
            t = total / n if kind == "average" else total * (np.float32(mult) / n)
            uniq = [k for k in uniq if counts[k] > t]
        order = sorted(uniq, key=lambda k: -counts[k])  # stable: ids ascending on ties
        index = {e[0]: i for i, e in enumerate(self.table) if e[0] != BIG}
        new = []
        for k in order:
            if k in index:
                e = self.table[index[k]]
                e[2] += counts[k]
                e[3] = last[k]
            else:
                new.append(k)
        merged = [self._score(e[2], e[3]) for e in self.table]
        merged[self.z - 1] = float("inf")  # the miss slot stays
        merged += [self._score(counts[k], last[k]) for k in new]
        ranked = sorted(range(len(merged)), key=lambda i: -merged[i])
        head, tail = ranked[: self.z], ranked[self.z :]
        sel = [i - self.z for i in head if i >= self.z]
        ev = [i for i in tail if i < self.z]
        if self.cap is not None and len(sel) > self.cap:
            sel, ev = sel[: self.cap], ev[len(ev) - self.cap :]
        rows = []
        for e, s in zip(ev, sel, strict=True):
            k = new[s]
            rows.append(self.table[e][1])
            self.table[e][0], self.table[e][2], self.table[e][3] = k, counts[k], last[k]
        self.table.sort(key=lambda e: e[0])
        return rows
