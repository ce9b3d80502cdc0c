"""Partitioner: ranks for every shard of a proposal (TorchRec's ``GreedyPerfPartitioner``).

jaxrec pads each ``(columns, dtype)`` width group to its fullest rank (rows,
ids per destination, slots), so what a step costs on every device is set by
the per-group maxima over ranks. The partitioner places options in order
(row-wise first, then host blocks and free shards, largest first) and puts
each shard where it raises the padded step time and padded memory least,
each measured as a fraction of a perfectly balanced device; ties go to the
rank with the least load of its own, then the lowest rank. A shard that no
rank can hold within the usable memory is set aside and its table reported as
not fitting; once everything else is placed, the set-aside shards are placed
anyway (where they hurt least) so that the memory the proposal needs is known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .cost_model import CostModel, GroupCost
from .options import ShardingOption
from .perf import Perf


class _Group:
    __slots__ = ("key", "cost", "rows", "ids", "slots", "max_rows", "max_ids", "max_slots", "opts",
                 "tables", "split", "row_sum")  # fmt: skip

    def __init__(self, key, cost: GroupCost, n: int):
        self.key, self.cost = key, cost
        self.rows = np.zeros(n, np.int64)
        self.ids = np.zeros(n, np.int64)
        self.slots = np.zeros(n, np.int64)
        self.max_rows = self.max_ids = self.max_slots = 0
        self.opts: dict[int, str] = {}
        self.tables: list[str] = []
        self.split = False  # holds a column shard: updated by the XLA path (storage.py)
        self.row_sum = 0.0  # bytes of its column-split tables' row-sum vectors

    def buffers(self, ids, slots, split=None, row_sum=None):
        split = self.split if split is None else split
        return self.cost.buffers(ids, slots, split, self.row_sum if row_sum is None else row_sum)


@dataclasses.dataclass(frozen=True)
class GroupStats:
    """One width group after placement: its padded per-rank sizes and costs."""

    key: tuple  # (module path, columns, dtype)
    tables: tuple[str, ...]
    rows_per_rank: int
    ids_per_destination: float
    slots: int
    memory: tuple[float, float, float]  # weights, state, buffers (per device)
    perf: Perf
    optimizers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Placement:
    """A partitioned proposal and its estimates (per device, padded as jaxrec allocates)."""

    options: tuple[ShardingOption, ...]
    shard_ranks: tuple[tuple[int, ...], ...]  # per option, per shard
    usable_bytes: float
    memory: tuple[float, float, float]  # weights, optimizer state, buffers per device
    perf: Perf  # per step (every device runs the same padded shapes)
    own_memory: tuple[float, ...]  # per rank: bytes of its own shards, unpadded
    own_perf: tuple[float, ...]  # per rank: seconds for its own shards, unpadded
    groups: tuple[GroupStats, ...]
    overflow: tuple[str, ...]  # tables placed beyond the usable memory

    @property
    def hbm(self) -> float:
        return sum(self.memory)

    @property
    def feasible(self) -> bool:
        return not self.overflow

    @property
    def balance(self) -> float:
        """max / mean of the per-rank own time (1.0 is perfect)."""
        mean = sum(self.own_perf) / len(self.own_perf)
        return max(self.own_perf) / mean if mean > 0 else 1.0


class GreedyPerfPartitioner:
    """Places the shards of a proposal greedily (see the module docstring)."""

    def partition(
        self, proposal: Sequence[ShardingOption], cost: CostModel, usable_bytes: float
    ) -> Placement:
        return _Run(proposal, cost, usable_bytes).run()


_ORDER = {"fixed": 0, "host": 1, "free": 2}


class _Run:
    def __init__(self, proposal, cost: CostModel, usable: float):
        self.proposal = tuple(proposal)
        self.cost = cost
        self.usable = usable
        self.n = n = cost.topology.world_size
        self.groups: dict[tuple, _Group] = {}
        self.own_mem = np.zeros(n)
        self.own_time = np.zeros(n)
        self.base_mem = [0.0, 0.0, 0.0]
        self.base_perf = Perf()
        self.padded_mem = 0.0
        self.overflow: list[str] = []
        self.deferred: list[tuple] = []
        self.forced = False  # placing what did not fit, to learn the memory it needs
        self.m_ref = max(sum(o.total_bytes for o in proposal) / n, 1.0)
        self.t_ref = max(sum(o.perf for o in proposal) / n, 1e-12)
        self.cap = cost.capacity

    def _capped(self, ids):
        return ids if self.cap is None else min(ids, self.cap)

    def _group(self, o: ShardingOption, ncols: int) -> _Group:
        key = self.cost.group_key(o.table, ncols)
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = _Group(key, self.cost.group_cost(o.table, ncols), self.n)
        return g

    def _own(self, r: int) -> float:
        return float(self.own_mem[r] / self.m_ref + self.own_time[r] / self.t_ref)

    # ----- what-if and apply -----
    def _delta(self, items) -> tuple[float, float]:
        """Padded (memory, time) increase of placing ``items``
        [(group, rank, rows, ids, slots, column split, table key, row-sum bytes)]."""
        new: dict[int, list] = {}
        for g, r, nr, ids, ns, split, key, rs in items:
            m = new.get(id(g))
            if m is None:
                m = new[id(g)] = [g, g.max_rows, g.max_ids, g.max_slots, g.split, g.row_sum, set()]
            m[1] = max(m[1], int(g.rows[r]) + nr)
            m[2] = max(m[2], int(g.ids[r]) + ids)
            m[3] = max(m[3], int(g.slots[r]) + ns)
            m[4] = m[4] or split
            if split and key not in g.tables and key not in m[6]:
                m[5] += rs
                m[6].add(key)
        dm = dt = 0.0
        for g, rows, ids, slots, split, row_sum, _ in new.values():
            c = g.cost
            new_ids, old_ids = self._capped(ids), self._capped(g.max_ids)
            d_slots = slots - g.max_slots
            dm += (rows - g.max_rows) * c.mem_row
            dm += float(g.buffers(new_ids, slots, split, row_sum) - g.buffers(old_ids, g.max_slots))
            dt += (new_ids - old_ids) * c.time_id + d_slots * c.time_slot
        return dm, dt

    def _fits(self, items) -> bool:
        return self.padded_mem + self._delta(items)[0] <= self.usable

    def _apply(self, o: ShardingOption, items) -> None:
        dm, _ = self._delta(items)
        if self.padded_mem + dm > self.usable and o.table.key not in self.overflow:
            self.overflow.append(o.table.key)
        self.padded_mem += dm
        for g, r, nr, ids, ns, split, key, rs in items:
            if split and key not in g.tables:
                g.row_sum += rs
            g.split = g.split or split
            g.rows[r] += nr
            g.ids[r] += ids
            g.slots[r] += ns
            g.max_rows = max(g.max_rows, int(g.rows[r]))
            g.max_ids = max(g.max_ids, int(g.ids[r]))
            g.max_slots = max(g.max_slots, int(g.slots[r]))
            c, cids = g.cost, self._capped(ids)
            own = c.buffers(cids, ns, split, rs if split else 0.0)
            self.own_mem[r] += nr * c.mem_row + float(own)
            self.own_time[r] += cids * c.time_id + ns * c.time_slot
            g.opts.setdefault(id(o.table.optimizer), o.table.optimizer.name)
            if o.table.key not in g.tables:
                g.tables.append(o.table.key)

    def _score(self, items, tie: float, index: int) -> tuple:
        dm, dt = self._delta(items)
        fits = self.padded_mem + dm <= self.usable
        primary = dm / self.m_ref + dt / self.t_ref
        return (not fits, primary if fits else dm, tie, index)

    def _items(self, o: ShardingOption, shards_ranks) -> list:
        t = o.table
        rs = self.cost.row_sums(t)
        return [
            (
                self._group(o, sh.ncols),
                r,
                sh.nrows,
                t.ids,
                t.num_features,
                sh.ncols < t.dim,
                t.key,
                rs,
            )
            for sh, r in shards_ranks
            if sh.nrows and sh.ncols
        ]

    # ----- placement per kind -----
    def _place_fixed(self, o: ShardingOption, ranks: list) -> None:
        items = self._items(o, zip(o.shards, o.ranks, strict=True))
        if not (self.forced or self._fits(items)):
            self.deferred.append((self._place_fixed, o, ranks))
            return
        self._apply(o, items)
        ranks[:] = o.ranks

    def _best_rank(self, o: ShardingOption, sh, cands: np.ndarray) -> tuple[int, bool]:
        """The best rank for one shard among ``cands`` (vectorised ``_score``)."""
        g, t = self._group(o, sh.ncols), o.table
        c = g.cost
        d_rows = np.maximum(g.rows[cands] + sh.nrows - g.max_rows, 0)
        new_ids = np.maximum(g.ids[cands] + t.ids, g.max_ids)
        if self.cap is not None:
            new_ids = np.minimum(new_ids, self.cap)
        old_ids = self._capped(g.max_ids)
        d_ids = new_ids - old_ids
        d_slots = np.maximum(g.slots[cands] + t.num_features - g.max_slots, 0)
        split = sh.ncols < t.dim
        row_sum = g.row_sum + (self.cost.row_sums(t) if split and t.key not in g.tables else 0.0)
        new_slots = np.maximum(g.slots[cands] + t.num_features, g.max_slots)
        new_buf = g.buffers(new_ids, new_slots, g.split or split, row_sum)
        dm = d_rows * c.mem_row + new_buf - g.buffers(old_ids, g.max_slots)
        dt = d_ids * c.time_id + d_slots * c.time_slot
        fits = self.padded_mem + dm <= self.usable
        primary = np.where(fits, dm / self.m_ref + dt / self.t_ref, dm)
        own = self.own_mem[cands] / self.m_ref + self.own_time[cands] / self.t_ref
        i = np.lexsort((cands, own, primary, ~fits))[0]
        return int(cands[i]), bool(fits[i])

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
            best, fits = self._best_rank(o, sh, cands)
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

            host = min(hosts, key=key)
            pairs = self._host_block(o, block, host)
            items = self._items(o, pairs)
            if not (self.forced or self._fits(items)):
                self.deferred.append((self._place_host, o, ranks))
                return
            self._apply(o, items)
            ranks[b * size : (b + 1) * size] = [r for _, r in pairs]

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
        order = sorted(
            (i for i, o in enumerate(self.proposal) if o.placement != "replicated"),
            key=lambda i: (
                _ORDER[self.proposal[i].placement],
                -(self.proposal[i].per_device_bytes / self.m_ref
                  + self.proposal[i].perf / len(self.proposal[i].shards) / self.t_ref),
                self.proposal[i].table.key,
            ),
        )  # fmt: skip
        place = {"fixed": self._place_fixed, "free": self._place_free, "host": self._place_host}
        for i in order:
            place[self.proposal[i].placement](self.proposal[i], ranks[i])
        self.forced = True  # what did not fit goes where it hurts least, to size the need
        for fn, o, rs in self.deferred:
            fn(o, rs)
        return self._result(tuple(tuple(r) for r in ranks))

    def _result(self, ranks) -> Placement:
        mem = list(self.base_mem)
        perf = self.base_perf
        groups = []
        for g in self.groups.values():
            ids = self._capped(g.max_ids)
            gm = g.cost.memory(g.max_rows, ids, g.max_slots, g.split, g.row_sum)
            gp = g.cost.perf(ids, g.max_slots)
            mem = [a + b for a, b in zip(mem, gm, strict=True)]
            perf = perf + gp
            groups.append(
                GroupStats(g.key, tuple(g.tables), g.max_rows, ids, g.max_slots, gm, gp,
                           tuple(g.opts.values()))
            )  # fmt: skip
        return Placement(
            options=self.proposal,
            shard_ranks=ranks,
            usable_bytes=self.usable,
            memory=tuple(mem),
            perf=perf,
            own_memory=tuple(float(x) for x in self.own_mem),
            own_perf=tuple(float(x) for x in self.own_time),
            groups=tuple(groups),
            overflow=tuple(self.overflow),
        )
