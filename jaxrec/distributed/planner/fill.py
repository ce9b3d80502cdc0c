"""The partitioner's fill: a width group's splittable tables cut by rows over its ranks.

``cut`` fills each rank's rows up to the group's balanced share exactly.
Tables come sorted by expected ids per row; each rank takes rows from the
sparsest and the densest tables left in the proportion that also fills its
share of expected ids (a two-pointer walk), so rows balance exactly and
expected ids closely, with at most two tables cut at each rank boundary.
``level`` then lowers the group's slot count.
"""

from __future__ import annotations

import math

import numpy as np

from ..types import ShardingType
from .cost_model import CostModel
from .enumerator import estimate_option
from .options import ShardingOption, ShardSpec, TableInfo
from .planned_group import PlannedGroup


def cut(group: PlannedGroup, tables: list[TableInfo]) -> list[dict[int, int]]:
    """Rows of each of ``tables`` (sorted by expected ids per row) per rank."""
    n = group.n
    total = int(group.total_rows)
    share = [total // n + (1 if r < total % n else 0) for r in range(n)]
    dens = [t.expected_ids / t.rows for t in tables]
    left_rows = [t.rows for t in tables]
    sizes: list[dict[int, int]] = [{} for _ in tables]
    lo, hi = 0, len(tables) - 1

    def take(i: int, r: int, amount: int) -> tuple[int, float]:
        amount = min(amount, left_rows[i])
        sizes[i][r] = sizes[i].get(r, 0) + amount
        left_rows[i] -= amount
        return amount, amount * dens[i]

    for r in range(n):
        a = share[r] - int(group.load.rows[r])  # rows this rank still takes
        b = group.total_exp / n - float(group.load.exp[r])  # and expected ids
        while a > 0 and lo <= hi:
            if not left_rows[lo]:
                lo += 1
                continue
            if not left_rows[hi]:
                hi -= 1
                continue
            want = max(b, 0.0) / a  # the density that fills both at once
            if lo == hi or want <= dens[lo]:
                x, e = take(lo, r, a)
            elif want >= dens[hi]:
                x, e = take(hi, r, a)
            else:  # y rows of the densest and a - y of the sparsest
                y = round((b - dens[lo] * a) / (dens[hi] - dens[lo]))
                if y > left_rows[hi]:
                    x, e = take(hi, r, y)
                elif a - y > left_rows[lo]:
                    x, e = take(lo, r, a - y)
                else:
                    x1, e1 = take(hi, r, y) if y > 0 else (0, 0.0)
                    x2, e2 = take(lo, r, a - y)
                    x, e = x1 + x2, e1 + e2
            a -= x
            b -= e
    for i in range(len(tables)):
        if left_rows[i]:  # rows beyond every share (ranks over it from other shards)
            g_rows = group.load.rows + np.array([sum(s.get(r, 0) for s in sizes) for r in range(n)])
            take(i, int(np.argmin(g_rows)), left_rows[i])
    sizes = [{r: v for r, v in s.items() if v} for s in sizes]
    level(group, tables, dens, sizes)
    return sizes


def level(group: PlannedGroup, tables, dens, sizes: list[dict[int, int]]) -> None:
    """Lowers the group's slot count: moves pieces off the ranks with the most slots
    (smallest first) to ranks that stay within the targets' slack, preferring a
    rank that already holds a piece of the same table (the pieces merge). Edits
    ``sizes`` in place."""
    n = group.n
    rows = group.load.rows.astype(np.float64)
    exp = group.load.exp.copy()
    slots = group.load.slots.copy()
    held = np.zeros((len(tables), n), bool)  # table i has a piece on rank q
    on: list[set[int]] = [set() for _ in range(n)]  # the tables with a piece on a rank
    for i, (t, size) in enumerate(zip(tables, sizes, strict=True)):
        for r, v in size.items():
            rows[r] += v
            exp[r] += v * dens[i]
            slots[r] += t.num_features
            held[i, r] = True
            on[r].add(i)
    floor = math.ceil(slots.sum() / n)
    stuck: set[int] = set()
    for _ in range(8 * n):
        free = [r for r in range(n) if r not in stuck]
        if not free:
            return
        r = max(free, key=lambda q: (slots[q], -q))
        if slots[r] <= floor:
            return
        best = None
        for i in sorted(on[r]):
            v, nf = sizes[i][r], tables[i].num_features
            gain = np.where(held[i], 0, nf)
            ok = (rows + v <= group.cap_rows) & (exp + v * dens[i] <= group.cap_exp)
            ok &= slots + gain < slots[r]
            ok[r] = False
            for q in np.flatnonzero(ok):
                move = (bool(gain[q] > 0), v, int(slots[q] + gain[q]), rows[q], int(q), i)
                best = move if best is None or move < best else best
        if best is None:
            stuck.add(r)
            continue
        _, v, _, _, q, i = best
        nf = tables[i].num_features
        rows[r] -= v
        exp[r] -= v * dens[i]
        slots[r] -= nf
        if not held[i, q]:
            slots[q] += nf
        rows[q] += v
        exp[q] += v * dens[i]
        sizes[i][q] = sizes[i].get(q, 0) + v
        del sizes[i][r]
        held[i, r], held[i, q] = False, True
        on[r].discard(i)
        on[q].add(i)


def pieces(cost: CostModel, o: ShardingOption, sizes: dict[int, int]) -> ShardingOption:
    """Table-wise ``o`` cut into ``sizes`` rows per rank: a ``ROW_WISE`` option
    (memoised in ``cost.cuts``: proposals often cut alike)."""
    t, row0, shards, ranks = o.table, 0, [], []
    for r in sorted(sizes):
        shards.append(ShardSpec(row0, sizes[r], 0, t.dim))
        ranks.append(r)
        row0 += sizes[r]
    key = (id(t), tuple(shards), tuple(ranks), o.cache)
    cut = cost.cuts.get(key)
    if cut is None:
        cut = cost.cuts[key] = estimate_option(
            t, cost, ShardingType.ROW_WISE, tuple(shards), "fixed", tuple(ranks), cache=o.cache
        )
    return cut
