"""Proposers: which option each table uses (TorchRec's ``GreedyProposer``,
``GridSearchProposer``, ``UniformProposer``).

A proposer sees every table's options, proposes one option per table, and
hears back whether the partitioner fit the proposal and its estimated step
time. All are deterministic and bounded by ``max_proposals``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from .options import ShardingOption

Options = Sequence[Sequence[ShardingOption]]


def _by_perf(opts: Sequence[ShardingOption]) -> list[ShardingOption]:
    return sorted(opts, key=lambda o: (o.perf, o.per_device_bytes))


class Proposer:
    """Interface: ``load`` the options, then ``propose`` / ``feedback`` until ``None``."""

    name = "proposer"

    def load(self, options: Options, usable_bytes: float) -> None:
        raise NotImplementedError

    def propose(self) -> list[ShardingOption] | None:
        raise NotImplementedError

    def feedback(self, feasible: bool, seconds: float, overflow: Sequence[str]) -> None:
        del feasible, seconds, overflow


class GreedyProposer(Proposer):
    """Starts from every table's fastest option; while a proposal does not fit,
    moves the table with the largest per-device footprint (preferring tables
    the partitioner could not place) to its next faster option that needs less
    memory per device. After the first fit it tries ``patience`` more moves.
    """

    name = "greedy"

    def __init__(self, max_proposals: int = 64, patience: int = 4):
        self.max_proposals = max_proposals
        self.patience = patience

    def load(self, options: Options, usable_bytes: float) -> None:
        del usable_bytes
        self.opts = [_by_perf(o) for o in options]
        self.idx = [0] * len(self.opts)
        self.count = 0
        self.found = False
        self.since_found = 0
        self.done = False

    def propose(self):
        if self.done or self.count >= self.max_proposals:
            return None
        self.count += 1
        return [o[i] for o, i in zip(self.opts, self.idx, strict=True)]

    def feedback(self, feasible, seconds, overflow):
        del seconds
        if feasible:
            self.found = True
        if self.found:
            self.since_found += 1
            if self.since_found > self.patience:
                self.done = True
                return
        over = set(overflow)

        def key(t):
            cur = self.opts[t][self.idx[t]]
            return (cur.table.key not in over, -cur.per_device_bytes, t)

        for t in sorted(range(len(self.opts)), key=key):
            cur = self.opts[t][self.idx[t]].per_device_bytes
            nxt = next(
                (j for j in range(self.idx[t] + 1, len(self.opts[t]))
                 if self.opts[t][j].per_device_bytes < cur),
                None,
            )  # fmt: skip
            if nxt is not None:
                self.idx[t] = nxt
                return
        self.done = True


class UniformProposer(Proposer):
    """One proposal per sharding type: every table that allows it uses it
    (its fastest option of that type), the others their fastest option."""

    name = "uniform"

    def load(self, options: Options, usable_bytes: float) -> None:
        del usable_bytes
        self.opts = [_by_perf(o) for o in options]
        kinds = []
        for o in self.opts:
            for x in o:
                if x.sharding_type not in kinds:
                    kinds.append(x.sharding_type)
        self.kinds = sorted(kinds, key=lambda k: k.value)

    def propose(self):
        if not self.kinds:
            return None
        kind = self.kinds.pop(0)
        return [next((x for x in o if x.sharding_type is kind), o[0]) for o in self.opts]


class GridSearchProposer(Proposer):
    """A bounded grid: every combination of sharding types for the largest
    tables (as many as keep the grid within ``max_proposals``), the other
    tables fixed to their fastest option that fits on one device.

    A table's choices are its fastest option of each sharding type; options
    whose largest shard alone exceeds a device are dropped when any fits.
    """

    name = "grid"

    def __init__(self, max_proposals: int = 32):
        self.max_proposals = max_proposals

    def load(self, options: Options, usable_bytes: float) -> None:
        choices = []
        for opts in options:
            best: dict = {}
            for o in _by_perf(opts):
                best.setdefault(o.sharding_type, o)
            fit = [o for o in best.values() if o.per_device_bytes <= usable_bytes]
            choices.append(_by_perf(fit or list(best.values())))
        size = [max(o.total_bytes for o in c) for c in choices]
        order = sorted(range(len(choices)), key=lambda t: (-size[t], t))
        grid, total = [], 1
        for t in order:
            if len(choices[t]) > 1 and total * len(choices[t]) <= self.max_proposals:
                grid.append(t)
                total *= len(choices[t])
        self.choices = choices
        self.grid = sorted(grid)
        self.space = math.prod(len(choices[t]) for t in self.grid) if self.grid else 0
        self.it = itertools.product(*(choices[t] for t in self.grid)) if self.grid else iter(())

    def propose(self):
        combo = next(self.it, None)
        if combo is None:
            return None
        out = [c[0] for c in self.choices]
        for t, o in zip(self.grid, combo, strict=True):
            out[t] = o
        return out
