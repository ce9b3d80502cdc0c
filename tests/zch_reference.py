"""A plain-Python dynamic table index: dicts and loops over the rules of
``jaxrec.modules.zch_index`` (the oracle of its tests).

Ids are Python ints (their uint64 value). Only the id hash is shared with the
code under test (``hash64_np``, itself checked against the in-graph hash).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from jaxrec.sparse.ids64 import hash64_np

FILL = 2**31 - 1


class ReferenceZch:
    """policy: "lru" | "lfu" | "ttl"; admission: None | ("freq", n) | ("prob", p)."""

    def __init__(
        self,
        slots,
        ways,
        *,
        total_buckets=None,
        bucket_offset=0,
        row_offset=0,
        seed=0,
        policy="lru",
        ttl=None,
        admission=None,
    ):
        self.slots, self.ways = slots, ways
        self.total = total_buckets or slots // ways
        self.b0, self.r0, self.seed = bucket_offset, row_offset, seed
        self.policy, self.ttl, self.admission = policy, ttl, admission
        self.slot_of: dict[int, int] = {}
        self.id_at: list[int | None] = [None] * slots
        self.last_seen = [-1] * slots
        self.counts = [0] * slots
        self.sketch = [0] * slots
        self.now = 0

    def _hash(self, i: int) -> tuple[int, int]:
        h = int(hash64_np(np.array([i], np.uint64), seed=self.seed)[0])
        return (h >> 32) % self.total - self.b0, h & 0xFFFFFFFF  # local bucket, low word

    def _local(self, i):
        b, _ = self._hash(i)
        return 0 <= b < self.slots // self.ways

    def remap(self, ids, valid=None):
        valid = [True] * len(ids) if valid is None else valid
        return [
            self.r0 + self.slot_of[i] if v and self._local(i) and i in self.slot_of else FILL
            for i, v in zip(ids, valid, strict=True)
        ]

    def _order(self, s):
        free = self.last_seen[s] < 0
        if free:
            return (0, 0, 0, s % self.ways)
        busy = self.last_seen[s] == self.now
        if self.policy == "ttl":
            ok = self.now - self.last_seen[s] > self.ttl and not busy
            return (1 if ok else 2, self.last_seen[s], self.last_seen[s], s % self.ways)
        if self.policy == "lfu":
            return (2 if busy else 1, self.counts[s], self.last_seen[s], s % self.ways)
        return (2 if busy else 1, self.last_seen[s], self.last_seen[s], s % self.ways)

    def _cells(self, b, h_lo):
        w = self.ways
        first = h_lo % w
        second = (first + 1 + (h_lo >> 16) % max(w - 1, 1)) % w if w > 1 else first
        return b * w + first, b * w + second

    def train(self, ids, valid=None):
        """One training call: rows, evicted rows (sorted), counters."""
        valid = [True] * len(ids) if valid is None else valid
        self.now += 1
        now = self.now
        real = [i for i, v in zip(ids, valid, strict=True) if v and self._local(i)]
        for i in real:  # hits
            if i in self.slot_of:
                s = self.slot_of[i]
                self.last_seen[s] = now
                self.counts[s] += 1
        missed = Counter(i for i in real if i not in self.slot_of)
        by_bucket: dict[int, list[int]] = {}
        for i in sorted(missed, key=lambda i: (self._hash(i)[0], i)):
            by_bucket.setdefault(self._hash(i)[0], []).append(i)
        admitted_ok = {}
        if self.admission and self.admission[0] == "freq":  # every sighting first
            for i in missed:
                b, h = self._hash(i)
                c1, c2 = self._cells(b, h)
                self.sketch[c1] += missed[i]
                if c2 != c1:
                    self.sketch[c2] += missed[i]
        for i in missed:
            b, h = self._hash(i)
            if self.admission is None:
                admitted_ok[i] = True
            elif self.admission[0] == "freq":
                c1, c2 = self._cells(b, h)
                admitted_ok[i] = min(self.sketch[c1], self.sketch[c2]) >= self.admission[1]
            else:
                admitted_ok[i] = h < min(int(self.admission[1] * 2**32), 2**32)
        evicted, admitted, rejected = [], 0, 0
        for b, group in by_bucket.items():
            cand = sorted(range(b * self.ways, (b + 1) * self.ways), key=self._order)
            classes = [self._order(s)[0] for s in cand]
            r = 0
            for i in group:
                if not admitted_ok[i]:
                    rejected += 1
                    continue
                if r >= self.ways or classes[r] == 2:
                    rejected += 1
                    r += 1
                    continue
                s = cand[r]
                r += 1
                if self.id_at[s] is not None:
                    evicted.append(self.r0 + s)
                    del self.slot_of[self.id_at[s]]
                self.id_at[s], self.slot_of[i] = i, s
                self.last_seen[s], self.counts[s] = now, missed[i]
                admitted += 1
        rows = self.remap(ids, valid)
        counters = {"admitted": admitted, "evicted": len(evicted), "rejected": rejected}
        return rows, sorted(evicted), counters

    def occupancy(self):
        return len(self.slot_of)

    def arrays(self):
        """The state as the device holds it: id words, last_seen, counts (empty slots' words
        are whatever was written last, so compare them where last_seen >= 0)."""
        ids = np.array([i or 0 for i in self.id_at], np.uint64)
        return {
            "id_lo": (ids & np.uint64(0xFFFFFFFF)).astype(np.uint32),
            "id_hi": (ids >> np.uint64(32)).astype(np.uint32),
            "last_seen": np.array(self.last_seen, np.int32),
            "counts": np.array(self.counts, np.int32),
        }
