"""Proposers: which option each table uses (TorchRec's ``GreedyProposer``,
``GridSearchProposer``, ``UniformProposer``; ``CachingProposer`` picks the
tables that go to host memory when nothing fits in device memory).

A proposer sees every table's options, proposes one option per table, and
hears back whether the partitioner fit the proposal and its estimated step
time. All are deterministic and bounded by ``max_proposals``.
"""

from __future__ import annotations

import abc
import itertools
import math
from collections.abc import Sequence

from .options import ShardingOption

Options = Sequence[Sequence[ShardingOption]]


def _by_perf(opts: Sequence[ShardingOption]) -> list[ShardingOption]:
    return sorted(opts, key=lambda o: (o.perf, o.per_device_bytes))


class Proposer(abc.ABC):
    """Interface: ``load`` the options, then ``propose`` / ``feedback`` until ``None``."""

    name = "proposer"

    @abc.abstractmethod
    def load(self, options: Options, usable_bytes: float) -> None:
        """Takes every table's options (and the usable bytes per device) for a search."""

    @abc.abstractmethod
    def propose(self) -> list[ShardingOption] | None:
        """One option per table, or ``None``: no proposal left."""

    def feedback(
        self,
        feasible: bool,
        seconds: float,
        overflow: Sequence[str],
        host_overflow: Sequence[str] = (),
    ) -> None:
        """``overflow``: the tables placed beyond memory, ``host_overflow`` those of them
        beyond host memory."""
        del feasible, seconds, overflow, host_overflow


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

    def feedback(self, feasible, seconds, overflow, host_overflow=()):
        del seconds, host_overflow
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
                (
                    j
                    for j in range(self.idx[t] + 1, len(self.opts[t]))
                    if self.opts[t][j].per_device_bytes < cur
                ),
                None,
            )
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

    A table's choices are its fastest option of each sharding type (and of
    each with a device cache, when cached options are offered); options whose
    largest shard alone exceeds a device are dropped when any fits.
    """

    name = "grid"

    def __init__(self, max_proposals: int = 32):
        self.max_proposals = max_proposals

    def load(self, options: Options, usable_bytes: float) -> None:
        choices = []
        for opts in options:
            best: dict = {}
            for o in _by_perf(opts):
                best.setdefault((o.sharding_type, o.cache is None), o)
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


class CachingProposer(Proposer):
    """Caches the fewest tables that make a proposal fit (``fused_uvm_caching``).

    Every table starts at its fastest ``fused`` option that fits a device alone
    (else its smallest); tables with cached options are ranked: first those
    whose ``fused`` options fit no device, then by device bytes freed per
    second their misses add (rarely read large tables first). The first ``k``
    take their fastest cached option. Device memory frees up and host memory
    fills as ``k`` grows, so ``k`` doubles while device memory overflows, then
    bisects to the smallest ``k`` that fits the devices (it fits the hosts, or
    no larger ``k`` does).
    """

    name = "caching"

    def load(self, options: Options, usable_bytes: float) -> None:
        self.base, alts, rank = [], [], []
        for t, opts in enumerate(options):
            fused = _by_perf([o for o in opts if o.cache is None])
            cached = _by_perf([o for o in opts if o.cache is not None])
            fit = [o for o in fused if o.per_device_bytes <= usable_bytes]
            base = (
                fit[0]
                if fit
                else min(fused, key=lambda o: (o.per_device_bytes, o.perf), default=None)
            )
            alt = next((o for o in cached if o.per_device_bytes <= usable_bytes), None)
            alt = alt or (cached[0] if cached else None)
            self.base.append(base or alt)
            alts.append(alt if base is not None else None)
            if base is not None and alt is not None:
                freed = base.total_bytes - alt.total_bytes
                rank.append((bool(fit), -freed / max(alt.perf - base.perf, 1e-12), t))
        self.alts = alts
        self.order = [t for *_, t in sorted(rank)]
        self.lo: int = 0
        self.hi: int | None = None  # the smallest k known to fit (or overflow the hosts)
        self.k: int | None = min(1, len(self.order))  # the next proposal's; None: done

    def propose(self):
        if self.k is None or not self.order:
            return None
        out = list(self.base)
        for t in self.order[: self.k]:
            out[t] = self.alts[t]
        return out

    def feedback(self, feasible, seconds, overflow, host_overflow=()):
        del seconds, overflow
        k = self.k
        if k is None:
            raise RuntimeError("CachingProposer.feedback without a proposal (propose gave None)")
        if feasible or host_overflow:  # caching enough, or already too much
            self.hi = k
        else:
            self.lo = k
        if self.hi is None:  # doubling: device memory overflows
            self.k = None if k >= len(self.order) else min(2 * k, len(self.order))
        else:
            mid = (self.lo + self.hi) // 2
            self.k = mid if mid > self.lo else None
