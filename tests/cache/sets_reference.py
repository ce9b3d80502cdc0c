"""A plain loop over the set-associative cache's rules (``jaxrec.cache.sets``): the
oracle its programs are tested against. One id, one set, one slot at a time."""

from __future__ import annotations

import numpy as np

from jaxrec.cache.sets import set_hash_np

INT32_MAX = np.iinfo(np.int32).max


def random_batch(rng, rows: int, n: int, alpha: float | None):
    """``(ids, valid)``: ``n`` int32 ids, uniform (``alpha`` None) or Zipf over a shuffled
    table, the first three out of range (-2, ``rows``, ``rows + 7``), a tenth padding."""
    if alpha is None:
        ids = rng.integers(0, rows, n)
    else:
        ids = rng.permutation(rows)[np.minimum(rng.zipf(alpha, n) - 1, rows - 1)]
    ids = ids.astype(np.int32)
    ids[:3] = [-2, rows, rows + 7]  # out of range: kept out of range
    return ids, rng.random(n) < 0.9


class ReferenceSets:
    """A table's slot map as Python lists."""

    def __init__(self, rows, shards, slots, sets, lfu):
        self.rows_n, self.shards, self.slots, self.sets, self.lfu = rows, shards, slots, sets, lfu
        self.shard_rows = -(-rows // shards)
        self.held = [-1] * (shards * slots)  # shard-local row of each slot
        self.stamp = [0] * (shards * slots)
        self.counts = [0] * rows if lfu else []
        self.clock = 0

    def set_slots(self, row):
        shard, local = divmod(row, self.shard_rows)
        h = int(set_hash_np(np.array([local]))[0]) % self.sets
        q, r = divmod(self.slots, self.sets)
        first = shard * self.slots + h * q + min(h, r)
        return shard, local, list(range(first, first + q + (h < r)))

    def plan(self, ids, valid):
        """``(slots, fills, evicts, n_rows, overflow)``; state unchanged on overflow."""
        saved = (list(self.held), list(self.stamp), list(self.counts), self.clock)
        self.clock += 1
        total = self.shards * self.slots
        out = list(ids)
        where, misses = {}, set()
        for i, (x, v) in enumerate(zip(ids, valid, strict=True)):
            if not v:
                continue
            if x < 0 or x >= self.rows_n:
                out[i] = -1 if x < 0 else total
                continue
            shard, local, slots = self.set_slots(x)
            found = [s for s in slots if self.held[s] == local]
            if found:
                self.stamp[found[0]] = self.clock
                where[x] = found[0]
            else:
                misses.add(x)
        fills, evicts = [], []
        order = sorted(misses, key=lambda x: (self.set_slots(x)[2][0], self.set_slots(x)[1]))
        for x in order:
            shard, local, slots = self.set_slots(x)
            free = [s for s in slots if self.stamp[s] != self.clock]
            if not free:
                self.held, self.stamp, self.counts, self.clock = saved
                return None, None, None, None, True

            def key(s, shard=shard):
                if not self.lfu:
                    return (self.stamp[s], s)
                held = self.held[s]
                c = self.counts[shard * self.shard_rows + held] if held >= 0 else -1
                return (c, self.stamp[s], s)

            victim = min(free, key=key)
            if self.held[victim] >= 0:
                evicts.append((victim, shard * self.shard_rows + self.held[victim]))
            fills.append((victim, x))
            self.held[victim], self.stamp[victim] = local, self.clock
            where[x] = victim
        for i, (x, v) in enumerate(zip(ids, valid, strict=True)):
            if v and 0 <= x < self.rows_n:
                out[i] = where[x]
                if self.lfu:
                    self.counts[x] = min(self.counts[x] + 1, INT32_MAX)
        return out, fills, evicts, len(where), False
