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

The bookkeeping lives apart: ``load.Load`` (a group's seven padded quantities
per rank, per candidate, or their maxima), ``planned_group.PlannedGroup`` (a
group's loads, priced and updated) and ``fill`` (the row cuts of fillable
tables).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..types import ShardingType
from . import fill
from .cost_model import CostModel
from .load import Load
from .options import ShardingOption, ShardSpec
from .perf import Perf
from .placement import Placement
from .planned_group import Item, PlannedGroup, shard_load

SLACK_ROWS = 0.02  # a rank's rows may exceed the group's balanced mean by this share
SLACK_IDS = 0.10  # and its expected ids per destination by this one before a table splits
SMALL = 0.5  # tables below this share of a balanced rank (rows and ids) stay whole,
FILL = 0.3  # unless the fill needs them to hold this share of the group (rows and ids)


class GreedyPerfPartitioner:
    """Places the shards of a proposal greedily (see the module docstring).

    Args:
        split: split table-wise tables by rows where they would set a width
            group's padding (``False``: place every table whole, as TorchRec).
    """

    def __init__(self, split: bool = True):
        self.split = split

    def partition(
        self,
        proposal: Sequence[ShardingOption],
        cost: CostModel,
        usable_bytes: float,
        usable_ddr: float = math.inf,
    ) -> Placement:
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
        self.groups: dict[tuple, PlannedGroup] = {}
        self.own_mem = np.zeros(n)  # tie-breaks while placing; exact ones in _result
        self.own_time = np.zeros(n)
        self.base_mem = [0.0, 0.0, 0.0]
        self.base_perf = Perf()
        self.padded_mem = 0.0
        self.overflow: list[str] = []
        self.deferred: list[tuple] = []
        self.forced = False  # placing what did not fit, to learn the memory it needs
        self.replaced: dict[int, ShardingOption] = {}  # split tables: their pieces
        self._bases = cost.items  # each shard's ShardLoad, kept across proposals
        self.m_ref = max(sum(o.total_bytes for o in proposal) / n, 1.0)
        self.t_ref = max(sum(o.perf for o in proposal) / n, 1e-12)

    def _group(self, o: ShardingOption, ncols: int) -> PlannedGroup:
        key = self.cost.group_key(o.table, ncols, o.cache)
        g = self.groups.get(key)
        if g is None:
            cost = self.cost.group_cost(o.table, ncols, o.cache is not None)
            g = self.groups[key] = PlannedGroup(key, cost, self.cost, self.n)
        return g

    def _own(self, r: int) -> float:
        return float(self.own_mem[r] / self.m_ref + self.own_time[r] / self.t_ref)

    def _item(self, o: ShardingOption, sh: ShardSpec, rank: int) -> Item:
        shard = self._bases.get((o, sh))
        if shard is None:
            shard = self._bases[(o, sh)] = shard_load(self.cost, o, sh)
        return Item(self._group(o, sh.ncols), rank, shard)

    def _items(self, o: ShardingOption, shards_ranks) -> list[Item]:
        return [self._item(o, sh, r) for sh, r in shards_ranks if sh.nrows and sh.ncols]

    # ----- what-if and apply -----
    def _delta(self, items: Sequence[Item]) -> tuple[float, float, float]:
        """Padded (device memory, time, host memory) increase of placing ``items``."""
        deltas: dict[int, dict[int, Load]] = {}  # per group, per rank: what it adds
        split: dict[int, bool] = {}  # per group: whether a column shard is among them
        for it in items:
            d = deltas.setdefault(id(it.group), {})
            d[it.rank] = d[it.rank].plus(it.shard.load) if it.rank in d else it.shard.load
            split[id(it.group)] = split.get(id(it.group), False) or it.shard.split
        groups = {id(it.group): it.group for it in items}
        dm = dt = dd = 0.0
        for k, d in deltas.items():
            gm, gt, gd = groups[k].what_if_ranks(d, split[k])
            dm += gm
            dt += gt
            dd += gd
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

    def _apply(self, o: ShardingOption, items: Sequence[Item]) -> None:
        touched: dict[int, tuple[PlannedGroup, list[Item]]] = {}
        for it in items:
            touched.setdefault(id(it.group), (it.group, []))[1].append(it)
        before = sum(g.mem_now for g, _ in touched.values())
        before_ddr = sum(g.ddr_now for g, _ in touched.values())
        for g, its in touched.values():
            r, own_mem, own_time = g.add(its, o.table)
            np.add.at(self.own_mem, r, own_mem)
            np.add.at(self.own_time, r, own_time)
        self.padded_mem += sum(g.mem_now for g, _ in touched.values()) - before
        self.padded_ddr += sum(g.ddr_now for g, _ in touched.values()) - before_ddr
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

    def _load(self, g: PlannedGroup, cands, nrows: int, exp: float) -> np.ndarray:
        """Each candidate's load in the group after adding a shard, as a share of the
        group's balanced targets (the larger of rows and expected ids)."""
        load = (g.load.rows[cands] + nrows) / g.cap_rows
        return np.maximum(load, (g.load.exp[cands] + exp) / g.cap_exp) if g.cap_exp > 0 else load

    def _best_rank(self, o: ShardingOption, sh: ShardSpec, cands: np.ndarray) -> tuple:
        """``(rank, fits, score)`` of the best rank for one shard among ``cands``
        (vectorised ``_score``; among equal scores the least loaded rank of the group)."""
        g, _, shard = self._item(o, sh, -1)
        dm, dt, ddr = g.what_if(g.load.at(cands).plus(shard.load), shard.split)
        fits = self._fit(dm, ddr) & np.ones(len(cands), bool)
        primary = np.where(fits, dm / self.m_ref + dt / self.t_ref, dm)
        load = self._load(g, cands, sh.nrows, shard.load.exp)
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

    def _place_small(self, g: PlannedGroup, o: ShardingOption, ranks: list) -> None:
        """A table at most ``SMALL`` of a balanced rank, whole: on the rank with the
        fewest slots of the group that stays within its share, then the least loaded
        (the least loaded if none does)."""
        cands = np.arange(self.n)
        t = o.table
        load = (g.load.rows + t.rows) / (g.total_rows / self.n)
        if g.total_exp > 0:
            load = np.maximum(load, (g.load.exp + t.expected_ids) / (g.total_exp / self.n))
        over = load > 1
        r = int(cands[np.lexsort((cands, load, np.where(over, load, g.load.slots), over))[0]])
        self._apply(o, self._items(o, [(o.shards[0], r)]))
        ranks[:] = [r]

    def _fill(self, group: PlannedGroup, opts: list[tuple[ShardingOption, list]]) -> None:
        """Lays a group's fillable tables over the ranks (``fill.cut``)."""
        items = sorted(
            opts, key=lambda x: (x[0].table.expected_ids / x[0].table.rows, x[0].table.key)
        )
        sizes = fill.cut(group, [o.table for o, _ in items])
        for (o, ranks), size in zip(items, sizes, strict=True):
            self._apply_fill(o, ranks, size)

    def _apply_fill(self, o: ShardingOption, ranks: list, sizes: dict[int, int]) -> None:
        if len(sizes) == 1:
            (r,) = sizes
            self._apply(o, self._items(o, [(o.shards[0], r)]))
            ranks[:] = [r]
            return
        pieces = fill.pieces(self.cost, o, sizes)
        self._apply(pieces, self._items(o, zip(pieces.shards, pieces.ranks, strict=True)))
        self.replaced[id(o)] = pieces
        ranks[:] = pieces.ranks

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
        lo = self.cost.topology.ranks_per_host
        cols = [(j, sh) for j, sh in enumerate(block) if sh.nrows and sh.ncols]
        if len(block) != lo or not cols or len({sh.ncols for _, sh in cols}) != 1:
            return None
        its = [self._item(o, sh, -1) for _, sh in cols]
        g = its[0].group
        h = np.asarray(hosts)
        at = h[:, None] * lo + np.asarray([j for j, _ in cols])[None, :]  # [host, shard] ranks
        added = g.load.at(at).plus(Load.stack([it.shard.load for it in its]))
        dm, dt, ddr = g.what_if(added.peak(axis=1), its[0].shard.split)
        fits = self._fit(dm, ddr) & np.ones(len(h), bool)
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
            used = {r // topo.ranks_per_host for r in ranks if r is not None}
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

    def _share(self, g: PlannedGroup, rows: int, exp: float) -> float:
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
        fill: dict[int, tuple[PlannedGroup, list]] = {}
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
        weights, state, buffers = self.base_mem
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
            st = g.stats()
            weights += st.memory[0]
            state += st.memory[1]
            buffers += st.memory[2]
            perf = perf + st.perf
            ddr += st.host
            groups.append(st)
            for r in range(self.n):  # unpadded: buffers sized for the rank's own load
                if g.load.nat[r]:
                    m, t, d = g.own(r)
                    own_mem[r] += m
                    own_time[r] += t
                    own_ddr[r] += d
        return Placement(
            options=options,
            shard_ranks=ranks,
            usable_bytes=self.usable,
            memory=(weights, state, buffers),
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
