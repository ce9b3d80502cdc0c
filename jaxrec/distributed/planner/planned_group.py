"""One width group's bookkeeping while the partitioner places shards.

A group holds its ``Load`` per rank and its maxima over ranks (``peak``), and
prices them: the group's padded device memory, step time and host memory
depend only on the maxima. ``what_if`` prices shards before they are placed;
``add`` places them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .cost_model import CostModel, GroupCost, key_name
from .load import ZERO, Load, ShardLoad
from .options import ShardingOption, ShardSpec, TableInfo
from .placement import GroupStats
from .storage import cache_slots, row_sum_values


class Item(NamedTuple):
    """One shard on one rank (``-1``: not chosen yet), as the group bookkeeping sees it."""

    group: PlannedGroup
    rank: int
    shard: ShardLoad


def shard_load(cost: CostModel, o: ShardingOption, sh: ShardSpec) -> ShardLoad:
    """What a (non-empty) shard of ``o`` adds to the rank that holds it."""
    t = o.table
    split = sh.ncols < t.dim
    calls = cost.row_sum_calls(t) if split else 0
    peers = len({s.col0 for s in o.shards if s.nrows and s.ncols}) - 1 if split else 0
    loads = t.slot_loads(sh.nrows)
    cache = fetch = 0
    if o.cache is not None:
        cache = cache_slots(sh.nrows, o.cache.load_factor)
        fetch = cost.miss_rate(t, o.cache) * sum(loads)
    vub = calls * cost.topology.world_size * t.ids if split else 0.0
    load = Load(sh.nrows, sum(loads), t.ids, len(loads), vub, cache, fetch)
    return ShardLoad(load, loads, split, t.ids, calls, t.key, peers)


class PlannedGroup:
    __slots__ = (
        "key",
        "cost",
        "model",
        "n",
        "load",
        "peak",
        "split",
        "loads",
        "split_ids",
        "total_rows",
        "total_exp",
        "cap_rows",
        "cap_exp",
        "opts",
        "tables",
        "mem_now",
        "time_now",
        "ddr_now",
    )

    def __init__(self, key, cost: GroupCost, model: CostModel, n: int):
        self.key, self.cost, self.model, self.n = key, cost, model, n
        self.load = Load.zeros(n)
        self.peak = ZERO  # the load's maxima over ranks
        self.split = False  # holds a column shard: updated by the XLA path (storage.py)
        self.loads: list[list[float]] = [[] for _ in range(n)]  # per rank, per slot
        # per rank, per column-split table: (its payload, row sums per step, peers)
        self.split_ids: list[dict[str, tuple[int, int, int]]] = [{} for _ in range(n)]
        self.total_rows = self.total_exp = 0.0
        self.cap_rows = self.cap_exp = math.inf  # balanced targets with slack
        self.opts: dict[int, str] = {}
        self.tables: list[str] = []
        self.mem_now = self.time_now = self.ddr_now = 0.0  # padded cost of the current peak

    def price(self, peak: Load, split: bool):
        """Padded (device memory, time, host memory) of the group for given maxima
        (arrays ok)."""
        c = self.model.capacities(peak.exp, peak.nat, key_name(self.key))
        v = peak.vub if split else 0.0
        mem = self.cost.hbm(peak.rows, c, peak.slots, split, v, peak.cache)
        t = self.cost.time(c, peak.slots, v, peak.fetch)
        return mem, t, self.cost.host(peak.rows, peak.cache)

    def what_if(self, candidates: Load, split: bool):
        """The padded (device memory, time, host memory) increase if some ranks' loads
        became ``candidates`` (arrays: one increase per candidate)."""
        mem, t, ddr = self.price(self.peak.top(candidates), self.split or split)
        return mem - self.mem_now, t - self.time_now, ddr - self.ddr_now

    def what_if_ranks(self, deltas: dict[int, Load], split: bool) -> tuple[float, float, float]:
        """``what_if`` for ``deltas`` added to their ranks at once."""
        mem, t, ddr = self.price(self.peak.top_at(self.load, deltas), self.split or split)
        return float(mem) - self.mem_now, float(t) - self.time_now, float(ddr) - self.ddr_now

    def add(self, items: list[Item], table: TableInfo) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Places ``items`` (of ``table``); returns their ranks and the own device memory
        and time they add there (linear estimates, for tie-breaks)."""
        r = np.array([it.rank for it in items])
        if len(items) == 1:  # the common case, without the arrays (the same sums)
            d = items[0].shard.load
            for a, x in zip(self.load, d, strict=True):
                a[r[0]] += x
            placed = self.load.item(int(r[0]))
        else:
            d = Load.stack([it.shard.load for it in items])
            self.load.add_at(r, d)
            placed = self.load.at(r).peak()
        for it in items:
            self.loads[it.rank].extend(it.shard.loads)
            if it.shard.split:
                self.split = True
                self.split_ids[it.rank][it.shard.table] = (
                    it.shard.split_ids,
                    it.shard.calls,
                    it.shard.peers,
                )
        self.peak = self.peak.top(placed)
        m_id, m_slot, t_id, t_slot = self.cost.linear
        held = d.cache if self.cost.cached else d.rows
        own_mem = held * self.cost.mem_row + d.exp * m_id + d.slots * m_slot
        own_time = d.exp * t_id + d.slots * t_slot
        self.opts.setdefault(id(table.optimizer), table.optimizer.name)
        if table.key not in self.tables:
            self.tables.append(table.key)
        mem, t, ddr = self.price(self.peak, self.split)
        self.mem_now, self.time_now, self.ddr_now = float(mem), float(t), float(ddr)
        return r, own_mem, own_time

    def stats(self) -> GroupStats:
        """The group's padded sizes and costs, summed exactly (see ``exact``)."""
        c, exp, v, sent = self.exact()
        peak = self.peak
        return GroupStats(
            key=self.key,
            tables=tuple(self.tables),
            rows_per_rank=peak.rows,
            capacity=c,
            expected_ids=exp,
            natural_ids=peak.nat,
            slots=peak.slots,
            weighted=self.cost.weighted,
            column_split=self.split,
            row_sum_values=v,
            row_sum_sent=sent,
            memory=self.cost.memory(peak.rows, c, peak.slots, self.split, v, peak.cache),
            perf=self.cost.perf(c, peak.slots, sent, peak.fetch),
            optimizers=tuple(self.opts.values()),
            sequence=self.cost.sequence,
            cache_rows=peak.cache,
            host=float(self.cost.host(peak.rows, peak.cache)),
            fetched=self.n * peak.fetch,
        )

    def own(self, rank: int) -> tuple[float, float, float]:
        """Rank ``rank``'s unpadded (device memory, time, host memory): buffers sized
        for its own load."""
        c, _, v, sent = self.exact(rank)
        load = self.load.item(rank)
        mem = sum(self.cost.memory(load.rows, c, load.slots, self.split, v, load.cache))
        t = float(self.cost.time(c, load.slots, sent, self.load.fetch[rank]))
        return mem, t, float(self.cost.host(load.rows, load.cache))

    def exact(self, rank: int | None = None) -> tuple[int, float, int, int]:
        """``(capacity, expected, row-sum values held, row-sum values sent)`` of the
        group (or of one rank's own load), summed exactly (``math.fsum``: independent
        of the order of slots)."""
        ranks = range(self.n) if rank is None else (rank,)
        exp = max(math.fsum(self.loads[r]) for r in ranks)
        nat = max(int(self.load.nat[r]) for r in ranks)
        c = self.model.capacity_of(exp, nat, key_name(self.key))
        v = sent = 0
        if self.split:
            per = [
                [(row_sum_values(self.n, c, ids, calls), peers) for ids, calls, peers in held]
                for held in (self.split_ids[r].values() for r in ranks)
            ]
            v = max(sum(x for x, _ in p) for p in per)
            sent = max(sum(x * k for x, k in p) for p in per)
        return c, exp, v, sent
