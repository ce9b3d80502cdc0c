"""Partitioner: ranks for every shard of a proposal (TorchRec's ``GreedyPerfPartitioner``).

jaxrec pads each ``(columns, dtype)`` width group to its fullest rank: rows,
expected ids per destination (which size the fast-path id capacity, see
``jaxrec.distributed.capacity``), natural id payload and slots. What a step
costs on every device is therefore set by per-group maxima over ranks, and
the groups are independent: a group's padded cost depends only on how its own
shards spread. The partitioner balances each group: it knows every group's
total rows and expected ids from the proposal, so their balanced per-rank
means are its targets. It places options in order (row-wise first, then host
blocks, then free shards, each group's largest first, measured against its
targets) and puts each shard where it raises the padded step time and padded
memory least (each as a fraction of a perfectly balanced device); ties go to
the rank with the least load of its own, then the lowest rank.

A table-wise table that would push its rank past the group's targets (rows,
or expected ids: a small table read often sets the id capacity of the whole
group) and whose constraints allow row-wise sharding is split instead: its
rows are cut into pieces that fill the ranks with the most room under the
targets, preferring ranks that do not raise the group's slot count, when that
costs less than placing it whole. The pieces become a ``ROW_WISE`` sharding
over those ranks with uneven shard sizes (``build_layout`` accepts any exact
tiling).

A ``fused_uvm_caching`` group is balanced alike; its padded device memory is
its fullest rank's cache slots, and its padded host memory (rows, state and
cache metadata, ``storage.cache_host_bytes``) must fit too: a host's usable
host memory split over its ranks.

A shard that no rank can hold within the usable memory is set aside and its
table reported as not fitting; once everything else is placed, the set-aside
shards are placed anyway (where they hurt least) so that the memory the
proposal needs is known.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..types import ShardingType
from .cost_model import CostModel, GroupCost, key_name
from .enumerator import estimate_option
from .options import ShardingOption, ShardSpec
from .perf import Perf
from .placement import GroupStats, Placement
from .storage import cache_slots, row_sum_values

SLACK_ROWS = 0.02  # a rank's rows may exceed the group's balanced mean by this share
SLACK_IDS = 0.10  # and its expected ids per destination by this one before a table splits
SMALL = 0.5  # tables below this share of a balanced rank (rows and ids) stay whole,
FILL = 0.3  # unless the fill needs them to hold this share of the group (rows and ids)


class _Group:
    __slots__ = ("key", "cost", "model", "rows", "exp", "nat", "slots", "vub", "max_rows",
                 "max_exp", "max_nat", "max_slots", "max_vub", "split", "loads", "split_ids",
                 "total_rows", "total_exp", "cap_rows", "cap_exp", "opts", "tables", "mem_now",
                 "time_now", "cache", "fetch", "max_cache", "max_fetch", "ddr_now")  # fmt: skip

    def __init__(self, key, cost: GroupCost, model: CostModel, n: int):
        self.key, self.cost, self.model = key, cost, model
        self.rows = np.zeros(n, np.int64)
        self.exp = np.zeros(n)  # expected ids per source, summed over the rank's slots
        self.nat = np.zeros(n, np.int64)  # capacities of the features its slots read
        self.slots = np.zeros(n, np.int64)
        self.vub = np.zeros(n)  # row-sum values, bounded with each table's whole payload
        self.max_rows = self.max_nat = self.max_slots = 0
        self.max_exp = self.max_vub = 0.0
        self.split = False  # holds a column shard: updated by the XLA path (storage.py)
        self.loads: list[list[float]] = [[] for _ in range(n)]  # per rank, per slot
        # per rank, per column-split table: (its payload, row sums per step, peers)
        self.split_ids: list[dict[str, tuple[int, int, int]]] = [{} for _ in range(n)]
        self.total_rows = self.total_exp = 0.0
        self.cap_rows = self.cap_exp = math.inf  # balanced targets with slack
        self.opts: dict[int, str] = {}
        self.tables: list[str] = []
        self.mem_now = self.time_now = self.ddr_now = 0.0  # padded cost of the current maxima
        self.cache = np.zeros(n, np.int64)  # cached groups: cache slots
        self.fetch = np.zeros(n)  # and expected missed ids per source
        self.max_cache, self.max_fetch = 0, 0.0

    def price(self, rows, exp, nat, slots, split, vub, cache=0, fetch=0.0):
        """Padded (device memory, time, host memory) of the group for given maxima
        (arrays ok)."""
        c = self.model.capacities(exp, nat, key_name(self.key))
        v = vub if split else 0.0
        mem = self.cost.hbm(rows, c, slots, split, v, cache)
        return mem, self.cost.time(c, slots, v, fetch), self.cost.host(rows, cache)


class _Item(NamedTuple):
    """One shard on one rank, as the group bookkeeping sees it."""

    group: _Group
    rank: int
    nrows: int
    loads: tuple[float, ...]  # expected ids per source of each feature reading it
    natural: int  # the capacities of those features
    split: bool  # a column shard
    split_ids: int  # the table's whole payload (row-sum values are bounded by it)
    calls: int  # row sums per step of its optimizer
    table: str  # its key: row sums are exchanged once per table on a rank
    peers: int  # the table's other column blocks (each gets the row sums)
    cache: int  # cached shards: device cache slots
    fetch: float  # cached shards: expected missed ids per source

    @property
    def vub(self) -> float:
        return self.calls * len(self.group.rows) * self.split_ids if self.split else 0.0


class GreedyPerfPartitioner:
    """Places the shards of a proposal greedily (see the module docstring).

    Args:
        split: split table-wise tables by rows where they would set a width
            group's padding (``False``: place every table whole, as TorchRec).
    """

    def __init__(self, split: bool = True):
        self.split = split

    def partition(
        self, proposal: Sequence[ShardingOption], cost: CostModel, usable_bytes: float,
        usable_ddr: float = math.inf,
    ) -> Placement:  # fmt: skip
        """``usable_ddr``: host bytes per device (a host's usable memory / its devices)."""
        return _Run(proposal, cost, usable_bytes, self.split, usable_ddr).run()


_ORDER = {"fixed": 0, "host": 1, "free": 2}


class _Run:
    def __init__(self, proposal, cost: CostModel, usable: float, split: bool, usable_ddr):
        self.proposal = tuple(proposal)
        self.cost = cost
        self.usable = usable
        self.usable_ddr = usable_ddr
        self.padded_ddr = 0.0
        self.host_overflow: list[str] = []
        self.allow_split = split
        self.n = n = cost.topology.world_size
        self.groups: dict[tuple, _Group] = {}
        self.own_mem = np.zeros(n)  # tie-breaks while placing; exact ones in _result
        self.own_time = np.zeros(n)
        self.base_mem = [0.0, 0.0, 0.0]
        self.base_perf = Perf()
        self.padded_mem = 0.0
        self.overflow: list[str] = []
        self.deferred: list[tuple] = []
        self.forced = False  # placing what did not fit, to learn the memory it needs
        self.replaced: dict[int, ShardingOption] = {}  # split tables: their pieces
        self._bases = cost.items  # an item's fields but its group and rank, per shard
        self.m_ref = max(sum(o.total_bytes for o in proposal) / n, 1.0)
        self.t_ref = max(sum(o.perf for o in proposal) / n, 1e-12)

    def _group(self, o: ShardingOption, ncols: int) -> _Group:
        key = self.cost.group_key(o.table, ncols, o.cache)
        g = self.groups.get(key)
        if g is None:
            cost = self.cost.group_cost(o.table, ncols, o.cache is not None)
            g = self.groups[key] = _Group(key, cost, self.cost, self.n)
        return g

    def _own(self, r: int) -> float:
        return float(self.own_mem[r] / self.m_ref + self.own_time[r] / self.t_ref)

    def _item(self, o: ShardingOption, sh: ShardSpec, rank: int) -> _Item:
        base = self._bases.get((o, sh))
        if base is None:
            t = o.table
            split = sh.ncols < t.dim
            calls = self.cost.row_sum_calls(t) if split else 0
            peers = len({s.col0 for s in o.shards if s.nrows and s.ncols}) - 1 if split else 0
            loads = t.slot_loads(sh.nrows)
            cache = fetch = 0
            if o.cache is not None:
                cache = cache_slots(sh.nrows, o.cache.load_factor)
                fetch = self.cost.miss_rate(t, o.cache) * sum(loads)
            base = self._bases[(o, sh)] = (
                sh.nrows, loads, t.ids, split, t.ids, calls, t.key, peers, cache, fetch
            )  # fmt: skip
        return _Item(self._group(o, sh.ncols), rank, *base)

    def _items(self, o: ShardingOption, shards_ranks) -> list[_Item]:
        return [self._item(o, sh, r) for sh, r in shards_ranks if sh.nrows and sh.ncols]

    # ----- what-if and apply -----
    def _delta(self, items: Sequence[_Item]) -> tuple[float, float, float]:
        """Padded (device memory, time, host memory) increase of placing ``items``."""
        per: dict[int, list] = {}
        for it in items:
            g = it.group
            m = per.get(id(g))
            if m is None:
                m = per[id(g)] = [g, {}, False]
            d = m[1].setdefault(it.rank, [0, 0.0, 0, 0, 0.0, 0, 0.0])
            d[0] += it.nrows
            d[1] += sum(it.loads)
            d[2] += it.natural
            d[3] += len(it.loads)
            d[4] += it.vub
            d[5] += it.cache
            d[6] += it.fetch
            m[2] = m[2] or it.split
        dm = dt = dd = 0.0
        for g, ranks, split in per.values():
            rows, exp, nat = g.max_rows, g.max_exp, g.max_nat
            slots, vub = g.max_slots, g.max_vub
            cache, fetch = g.max_cache, g.max_fetch
            for r, (a, b, c, d, e, f, h) in ranks.items():
                rows = max(rows, int(g.rows[r]) + a)
                exp = max(exp, float(g.exp[r]) + b)
                nat = max(nat, int(g.nat[r]) + c)
                slots = max(slots, int(g.slots[r]) + d)
                vub = max(vub, float(g.vub[r]) + e)
                cache = max(cache, int(g.cache[r]) + f)
                fetch = max(fetch, float(g.fetch[r]) + h)
            mem, t, ddr = g.price(rows, exp, nat, slots, g.split or split, vub, cache, fetch)
            dm += float(mem) - g.mem_now
            dt += float(t) - g.time_now
            dd += float(ddr) - g.ddr_now
        return dm, dt, dd

    def _fit(self, dm, dd):
        """Whether device and host memory hold a ``dm`` / ``dd`` increase (arrays ok)."""
        return (self.padded_mem + dm <= self.usable) & (self.padded_ddr + dd <= self.usable_ddr)

    def _score(self, items, tie: float, index: int) -> tuple:
        dm, dt, dd = self._delta(items)
        fits = bool(self._fit(dm, dd))
        primary = dm / self.m_ref + dt / self.t_ref
        return (not fits, primary if fits else dm, tie, index)

    def _fits(self, items) -> bool:
        dm, _, dd = self._delta(items)
        return bool(self._fit(dm, dd))

    def _apply(self, o: ShardingOption, items: Sequence[_Item]) -> None:
        touched: dict[int, tuple[_Group, list[_Item]]] = {}
        for it in items:
            touched.setdefault(id(it.group), (it.group, []))[1].append(it)
        before = sum(g.mem_now for g, _ in touched.values())
        before_ddr = sum(g.ddr_now for g, _ in touched.values())
        for g, its in touched.values():
            r = np.array([it.rank for it in its])
            exp = np.array([sum(it.loads) for it in its])
            slots = np.array([len(it.loads) for it in its])
            nrows = np.array([it.nrows for it in its])
            np.add.at(g.rows, r, nrows)
            np.add.at(g.exp, r, exp)
            np.add.at(g.nat, r, [it.natural for it in its])
            np.add.at(g.slots, r, slots)
            np.add.at(g.vub, r, [it.vub for it in its])
            np.add.at(g.cache, r, [it.cache for it in its])
            np.add.at(g.fetch, r, [it.fetch for it in its])
            for it in its:
                g.loads[it.rank].extend(it.loads)
                if it.split:
                    g.split = True
                    g.split_ids[it.rank][it.table] = (it.split_ids, it.calls, it.peers)
            g.max_rows = max(g.max_rows, int(g.rows[r].max()))
            g.max_exp = max(g.max_exp, float(g.exp[r].max()))
            g.max_nat = max(g.max_nat, int(g.nat[r].max()))
            g.max_slots = max(g.max_slots, int(g.slots[r].max()))
            g.max_vub = max(g.max_vub, float(g.vub[r].max()))
            g.max_cache = max(g.max_cache, int(g.cache[r].max()))
            g.max_fetch = max(g.max_fetch, float(g.fetch[r].max()))
            m_id, m_slot, t_id, t_slot = g.cost.linear  # own load, for tie-breaks
            held = np.array([it.cache for it in its]) if g.cost.cached else nrows
            np.add.at(self.own_mem, r, held * g.cost.mem_row + exp * m_id + slots * m_slot)
            np.add.at(self.own_time, r, exp * t_id + slots * t_slot)
            g.opts.setdefault(id(o.table.optimizer), o.table.optimizer.name)
            if o.table.key not in g.tables:
                g.tables.append(o.table.key)
            mem, t, ddr = g.price(g.max_rows, g.max_exp, g.max_nat, g.max_slots, g.split,
                                  g.max_vub, g.max_cache, g.max_fetch)  # fmt: skip
            g.mem_now, g.time_now, g.ddr_now = float(mem), float(t), float(ddr)
        touched = {k: g for k, (g, _) in touched.items()}
        self.padded_mem += sum(g.mem_now for g in touched.values()) - before
        self.padded_ddr += sum(g.ddr_now for g in touched.values()) - before_ddr
        host = self.padded_ddr > self.usable_ddr
        if (self.padded_mem > self.usable or host) and o.table.key not in self.overflow:
            self.overflow.append(o.table.key)
            if host:
                self.host_overflow.append(o.table.key)

    # ----- placement per kind -----
    def _place_fixed(self, o: ShardingOption, ranks: list) -> None:
        items = self._items(o, zip(o.shards, o.ranks, strict=True))
        if not (self.forced or self._fits(items)):
            self.deferred.append((self._place_fixed, o, ranks))
            return
        self._apply(o, items)
        ranks[:] = o.ranks

    def _load(self, g: _Group, cands, nrows: int, exp: float) -> np.ndarray:
        """Each candidate's load in the group after adding a shard, as a share of the
        group's balanced targets (the larger of rows and expected ids)."""
        load = (g.rows[cands] + nrows) / g.cap_rows
        return np.maximum(load, (g.exp[cands] + exp) / g.cap_exp) if g.cap_exp > 0 else load

    def _best_rank(self, o: ShardingOption, sh: ShardSpec, cands: np.ndarray) -> tuple:
        """``(rank, fits, score)`` of the best rank for one shard among ``cands``
        (vectorised ``_score``; among equal scores the least loaded rank of the group)."""
        it = self._item(o, sh, -1)
        g = it.group
        e = sum(it.loads)
        split = g.split or it.split
        mem, tm, ddr = g.price(
            np.maximum(g.max_rows, g.rows[cands] + sh.nrows),
            np.maximum(g.max_exp, g.exp[cands] + e),
            np.maximum(g.max_nat, g.nat[cands] + it.natural),
            np.maximum(g.max_slots, g.slots[cands] + len(it.loads)),
            split,
            np.maximum(g.max_vub, g.vub[cands] + it.vub),
            np.maximum(g.max_cache, g.cache[cands] + it.cache),
            np.maximum(g.max_fetch, g.fetch[cands] + it.fetch),
        )
        dm, dt = mem - g.mem_now, tm - g.time_now
        fits = self._fit(dm, ddr - g.ddr_now) & np.ones(len(cands), bool)
        primary = np.where(fits, dm / self.m_ref + dt / self.t_ref, dm)
        load = self._load(g, cands, sh.nrows, e)
        own = self.own_mem[cands] / self.m_ref + self.own_time[cands] / self.t_ref
        i = np.lexsort((cands, own, load, primary, ~fits))[0]
        return int(cands[i]), bool(fits[i]), float(primary[i])

    def _fillable(self, o: ShardingOption) -> bool:
        """A table-wise table the fill may cut by rows (over any ranks)."""
        return (
            self.allow_split
            and o.sharding_type is ShardingType.TABLE_WISE
            and len(o.shards) == 1
            and len(o.ranks) == self.n > 1
            and o.table.rows > 1
            and o.table.constraints.allows(ShardingType.ROW_WISE)
        )

    def _place_small(self, g: _Group, o: ShardingOption, ranks: list) -> None:
        """A table at most ``SMALL`` of a balanced rank, whole: on the rank with the
        fewest slots of the group that stays within its share, then the least loaded
        (the least loaded if none does)."""
        cands = np.arange(self.n)
        t = o.table
        load = (g.rows + t.rows) / (g.total_rows / self.n)
        if g.total_exp > 0:
            load = np.maximum(load, (g.exp + t.expected_ids) / (g.total_exp / self.n))
        over = load > 1
        r = int(cands[np.lexsort((cands, load, np.where(over, load, g.slots), over))[0]])
        self._apply(o, self._items(o, [(o.shards[0], r)]))
        ranks[:] = [r]

    def _fill(self, group: _Group, opts: list[tuple[ShardingOption, list]]) -> None:
        """Lays a group's fillable tables over the ranks, filling each rank's rows up to
        the group's balanced share exactly. Tables are sorted by expected ids per row;
        each rank takes rows from the sparsest and the densest tables left in the
        proportion that also fills its share of expected ids (a two-pointer walk), so
        rows balance exactly and expected ids closely, with at most two tables cut at
        each rank boundary."""
        n = self.n
        total = int(group.total_rows)
        share = [total // n + (1 if r < total % n else 0) for r in range(n)]
        items = sorted(opts, key=lambda x: (x[0].table.expected_ids / x[0].table.rows,
                                            x[0].table.key))  # fmt: skip
        dens = [o.table.expected_ids / o.table.rows for o, _ in items]
        left_rows = [o.table.rows for o, _ in items]
        sizes: list[dict[int, int]] = [{} for _ in items]
        lo, hi = 0, len(items) - 1

        def take(i: int, r: int, amount: int) -> tuple[int, float]:
            amount = min(amount, left_rows[i])
            sizes[i][r] = sizes[i].get(r, 0) + amount
            left_rows[i] -= amount
            return amount, amount * dens[i]

        for r in range(n):
            a = share[r] - int(group.rows[r])  # rows this rank still takes
            b = group.total_exp / n - float(group.exp[r])  # and expected ids
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
        for i in range(len(items)):
            if left_rows[i]:  # rows beyond every share (ranks over it from other shards)
                g_rows = group.rows + np.array([sum(s.get(r, 0) for s in sizes)
                                                for r in range(n)])  # fmt: skip
                take(i, int(np.argmin(g_rows)), left_rows[i])
        sizes = [{r: v for r, v in s.items() if v} for s in sizes]
        self._level(group, [o.table for o, _ in items], dens, sizes)
        for (o, ranks), size in zip(items, sizes, strict=True):
            self._apply_fill(o, ranks, size)

    def _level(self, group: _Group, tables, dens, sizes: list[dict[int, int]]) -> None:
        """Lowers the group's slot count: moves pieces off the ranks with the most slots
        (smallest first) to ranks that stay within the targets' slack, preferring a
        rank that already holds a piece of the same table (the pieces merge)."""
        n = self.n
        rows = group.rows.astype(np.float64)
        exp = group.exp.copy()
        slots = group.slots.copy()
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

    def _apply_fill(self, o: ShardingOption, ranks: list, sizes: dict[int, int]) -> None:
        if len(sizes) == 1:
            (r,) = sizes
            self._apply(o, self._items(o, [(o.shards[0], r)]))
            ranks[:] = [r]
            return
        pieces = self._split_option(o, sizes)
        self._apply(pieces, self._items(o, zip(pieces.shards, pieces.ranks, strict=True)))
        self.replaced[id(o)] = pieces
        ranks[:] = pieces.ranks

    def _split_option(self, o: ShardingOption, sizes: dict[int, int]) -> ShardingOption:
        t, row0, shards, ranks = o.table, 0, [], []
        for r in sorted(sizes):
            shards.append(ShardSpec(row0, sizes[r], 0, t.dim))
            ranks.append(r)
            row0 += sizes[r]
        key = (id(t), tuple(shards), tuple(ranks), o.cache)  # proposals often cut alike
        cut = self.cost.cuts.get(key)
        if cut is None:
            cut = self.cost.cuts[key] = estimate_option(
                t,
                self.cost,
                ShardingType.ROW_WISE,
                tuple(shards),
                "fixed",
                tuple(ranks),
                cache=o.cache,
            )
        return cut

    def _place_free(self, o: ShardingOption, ranks: list) -> None:
        allowed = np.asarray(o.ranks)
        for j, sh in enumerate(o.shards):
            if ranks[j] is not None:
                continue
            taken = [r for r in ranks if r is not None]
            cands = allowed[~np.isin(allowed, taken)] if len(taken) < len(allowed) else allowed
            if not (sh.nrows and sh.ncols):
                ranks[j] = int(cands[0])
                continue
            best, fits, _ = self._best_rank(o, sh, cands)
            if not (fits or self.forced):
                self.deferred.append((self._place_free, o, ranks))
                return
            self._apply(o, self._items(o, [(sh, best)]))
            ranks[j] = best

    def _host_block(self, o: ShardingOption, block, host: int) -> list[tuple]:
        ranks = list(self.cost.topology.host_ranks(host))
        if len(block) < len(ranks):  # a partial block: the host's least loaded ranks
            ranks = sorted(ranks, key=lambda r: (self._own(r), r))[: len(block)]
        return list(zip(block, ranks, strict=True))

    def _best_host(self, o: ShardingOption, block, hosts: list[int]) -> int | None:
        """``_place_host``'s choice for a full block in one group, every host at once
        (``None`` for other blocks)."""
        lo = self.cost.topology.local_world_size
        cols = [(j, sh) for j, sh in enumerate(block) if sh.nrows and sh.ncols]
        if len(block) != lo or not cols or len({sh.ncols for _, sh in cols}) != 1:
            return None
        its = [self._item(o, sh, -1) for _, sh in cols]
        g, split = its[0].group, its[0].split
        h = np.asarray(hosts)
        at = h[:, None] * lo + np.asarray([j for j, _ in cols])[None, :]  # [host, shard] ranks

        def peak(arr, values):
            return (arr[at] + np.asarray(values)[None, :]).max(axis=1)

        mem, tm, ddr = g.price(
            np.maximum(g.max_rows, peak(g.rows, [it.nrows for it in its])),
            np.maximum(g.max_exp, peak(g.exp, [sum(it.loads) for it in its])),
            np.maximum(g.max_nat, peak(g.nat, [it.natural for it in its])),
            np.maximum(g.max_slots, peak(g.slots, [len(it.loads) for it in its])),
            g.split or split,
            np.maximum(g.max_vub, peak(g.vub, [it.vub for it in its])),
            np.maximum(g.max_cache, peak(g.cache, [it.cache for it in its])),
            np.maximum(g.max_fetch, peak(g.fetch, [it.fetch for it in its])),
        )
        dm, dt = mem - g.mem_now, tm - g.time_now
        fits = self._fit(dm, ddr - g.ddr_now) & np.ones(len(h), bool)
        primary = np.where(fits, dm / self.m_ref + dt / self.t_ref, dm)
        own = self.own_mem / self.m_ref + self.own_time / self.t_ref
        tie = own[h[:, None] * lo + np.arange(lo)[None, :]].sum(axis=1)
        return int(h[np.lexsort((h, tie, primary, ~fits))[0]])

    def _place_host(self, o: ShardingOption, ranks: list) -> None:
        size = len(o.shards) // o.blocks
        topo = self.cost.topology
        for b in range(o.blocks):
            if ranks[b * size] is not None:
                continue
            block = o.shards[b * size : (b + 1) * size]
            used = {r // topo.local_world_size for r in ranks if r is not None}
            hosts = [h for h in o.ranks if h not in used] or list(o.ranks)

            def key(h, block=block):
                pairs = self._host_block(o, block, h)
                tie = sum(self._own(r) for r in topo.host_ranks(h))
                return self._score(self._items(o, pairs), tie, h)

            host = self._best_host(o, block, hosts)
            if host is None:
                host = min(hosts, key=key)
            pairs = self._host_block(o, block, host)
            items = self._items(o, pairs)
            if not (self.forced or self._fits(items)):
                self.deferred.append((self._place_host, o, ranks))
                return
            self._apply(o, items)
            ranks[b * size : (b + 1) * size] = [r for _, r in pairs]

    # ----- the run -----
    def _targets(self) -> dict[int, float]:
        """Sets each group's balanced per-rank targets; returns each option's size
        against them (its largest shard's share of a balanced rank)."""
        sized = []
        for o in self.proposal:
            if o.placement == "replicated":
                continue
            for sh in o.shards:
                if sh.nrows and sh.ncols:
                    g = self._group(o, sh.ncols)
                    g.total_rows += sh.nrows
                    g.total_exp += sum(o.table.slot_loads(sh.nrows))
                    sized.append((o, sh, g))
        for g in self.groups.values():
            g.cap_rows = max(1.0, math.ceil(g.total_rows / self.n * (1 + SLACK_ROWS)))
            g.cap_exp = g.total_exp / self.n * (1 + SLACK_IDS)
        weight: dict[int, float] = {}
        for o, sh, g in sized:
            share = self._share(g, sh.nrows, sum(o.table.slot_loads(sh.nrows)))
            weight[id(o)] = max(weight.get(id(o), 0.0), share)
        return weight

    def _share(self, g: _Group, rows: int, exp: float) -> float:
        """A shard's size as a share of a balanced rank of its group (rows or ids)."""
        share = rows / max(g.total_rows / self.n, 1.0)
        return max(share, exp / (g.total_exp / self.n)) if g.total_exp > 0 else share

    def run(self) -> Placement:
        n = self.n
        ranks: list[list] = [[None] * len(o.shards) for o in self.proposal]
        for i, o in enumerate(self.proposal):
            if o.placement == "replicated":
                (w, s, io), perf = self.cost.replicated(o.table)
                self.base_mem = [self.base_mem[0] + w, self.base_mem[1] + s, self.base_mem[2] + io]
                self.base_perf = self.base_perf + perf
                self.padded_mem += w + s + io
                if self.padded_mem > self.usable:
                    self.overflow.append(o.table.key)
                self.own_mem += w + s + io
                self.own_time += perf.total
                ranks[i] = list(range(n))
        weight = self._targets()
        order = sorted(
            (i for i, o in enumerate(self.proposal) if o.placement != "replicated"),
            key=lambda i: (
                _ORDER[self.proposal[i].placement],
                -weight.get(id(self.proposal[i]), 0.0),
                self.proposal[i].table.key,
            ),
        )
        place = {"fixed": self._place_fixed, "free": self._place_free, "host": self._place_host}
        fill: dict[int, tuple[_Group, list]] = {}
        for i in order:
            o = self.proposal[i]
            if self._fillable(o):
                g = self._group(o, o.table.dim)
                fill.setdefault(id(g), (g, []))[1].append((o, ranks[i]))
            else:
                place[o.placement](o, ranks[i])
        for g, opts in fill.values():  # around what is placed: fixed, host, column shards
            # largest first: small tables whole, spread by slot count, unless the fill
            # needs them to hold enough of the group to even out every rank
            rows = exp = 0.0
            big, small = [], []
            for o, rs in opts:
                t = o.table
                need = rows < FILL * g.total_rows or exp < FILL * g.total_exp
                if need or self._share(g, t.rows, t.expected_ids) > SMALL:
                    big.append((o, rs))
                    rows, exp = rows + t.rows, exp + t.expected_ids
                else:
                    small.append((o, rs))
            for o, rs in small:
                self._place_small(g, o, rs)
            self._fill(g, big)
        self.forced = True  # what did not fit goes where it hurts least, to size the need
        for fn, o, rs in self.deferred:
            fn(o, rs)
        options = tuple(self.replaced.get(id(o), o) for o in self.proposal)
        return self._result(options, tuple(tuple(r) for r in ranks))

    def _result(self, options, ranks) -> Placement:
        mem = list(self.base_mem)
        perf = self.base_perf
        own_mem = np.zeros(self.n)
        own_time = np.zeros(self.n)
        own_ddr = np.zeros(self.n)
        ddr = 0.0
        for o in options:
            if o.placement == "replicated":
                (w, s, io), p = self.cost.replicated(o.table)
                own_mem += w + s + io
                own_time += p.total
        groups = []
        for g in self.groups.values():
            if not g.tables:
                continue
            c, exp, v, sent = self._exact(g)
            gm = g.cost.memory(g.max_rows, c, g.max_slots, g.split, v, g.max_cache)
            gp = g.cost.perf(c, g.max_slots, sent, g.max_fetch)
            gd = float(g.cost.host(g.max_rows, g.max_cache))
            mem = [a + b for a, b in zip(mem, gm, strict=True)]
            perf = perf + gp
            ddr += gd
            groups.append(
                GroupStats(g.key, tuple(g.tables), g.max_rows, c, exp, g.max_nat, g.max_slots,
                           g.cost.weighted, g.split, v, sent, gm, gp, tuple(g.opts.values()),
                           g.cost.sequence, g.max_cache, gd, self.n * g.max_fetch)
            )  # fmt: skip
            for r in range(self.n):  # unpadded: buffers sized for the rank's own load
                if g.nat[r]:
                    cr, _, vr, sr = self._exact(g, r)
                    rows, cache = int(g.rows[r]), int(g.cache[r])
                    own_mem[r] += sum(g.cost.memory(rows, cr, int(g.slots[r]), g.split, vr,
                                                    cache))  # fmt: skip
                    own_time[r] += float(g.cost.time(cr, int(g.slots[r]), sr, g.fetch[r]))
                    own_ddr[r] += float(g.cost.host(rows, cache))
        return Placement(
            options=options,
            shard_ranks=ranks,
            usable_bytes=self.usable,
            memory=tuple(mem),
            perf=perf,
            own_memory=tuple(float(x) for x in own_mem),
            own_perf=tuple(float(x) for x in own_time),
            groups=tuple(groups),
            overflow=tuple(self.overflow),
            split=tuple(o.table.key for o in self.proposal if id(o) in self.replaced),
            ddr=ddr,
            usable_ddr=self.usable_ddr,
            own_ddr=tuple(float(x) for x in own_ddr),
            host_overflow=tuple(self.host_overflow),
        )

    def _exact(self, g: _Group, rank: int | None = None) -> tuple[int, float, int, int]:
        """``(capacity, expected, row-sum values held, row-sum values sent)`` of a group
        (or of one rank's own load), summed exactly (``math.fsum``: independent of the
        order of slots)."""
        ranks = range(self.n) if rank is None else (rank,)
        exp = max(math.fsum(g.loads[r]) for r in ranks)
        nat = max(int(g.nat[r]) for r in ranks)
        c = self.cost.capacity_of(exp, nat, key_name(g.key))
        v = sent = 0
        if g.split:
            per = [[(row_sum_values(self.n, c, ids, calls), peers)
                    for ids, calls, peers in g.split_ids[r].values()] for r in ranks]  # fmt: skip
            v = max(sum(x for x, _ in p) for p in per)
            sent = max(sum(x * k for x, k in p) for p in per)
        return c, exp, v, sent
