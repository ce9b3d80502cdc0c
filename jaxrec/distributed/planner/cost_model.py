"""The storage and perf estimators bound to one topology: per-group costs.

A width group's memory and time depend only on its padded maxima over ranks:
rows ``R``, expected ids per destination ``X`` and natural payload (the sum
of the capacities of the features a rank's slots read), which give the
fast-path capacity ``C`` (``jaxrec.distributed.capacity``), and slots ``S``.
Memory is linear in ``R``; buffers and time are piecewise linear in ``C`` and
``S`` (``storage.sharded_buffer_bytes``, ``perf.sharded_perf``). Everything
here takes numpy arrays, so the partitioner prices every candidate rank at once.
A ``fused_uvm_caching`` group also depends on its per-rank cache slots and
expected misses, and holds host memory (``storage.cache_host_bytes``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping

import numpy as np

from ..capacity import CAPACITY_FACTOR, SIGMAS, fast_path_capacity
from ..types import CacheParams
from .cache_stats import UniformCacheStatistics
from .options import ShardSpec, TableInfo
from .perf import Perf, cache_miss_seconds, replicated_perf, sharded_perf
from .storage import (
    Num,
    cache_host_bytes,
    cache_map_bytes,
    cache_slots,
    cache_staging_bytes,
    replicated_memory,
    row_sum_calls,
    sharded_buffer_bytes,
    slot_maps_on_device,
    state_bytes_per_row,
)
from .topology import Topology

CACHED = "fused_uvm_caching"  # the last element of a cached width group's key


def group_name(ncols: int, dtype: str, cached: bool = False) -> str:
    """A width group's name in the sharded collection (``layout.py``): ``fp32_c64``, or
    ``fp32_c64_cached`` for its ``fused_uvm_caching`` tables."""
    return f"{dtype.lower()}_c{ncols}" + ("_cached" if cached else "")


def key_name(key: tuple) -> str:
    """The name of the group with key ``(module, columns, dtype[, CACHED])``."""
    return group_name(key[1], key[2], key[-1] == CACHED)


def fast_path_capacities(
    expected, natural, capacity: int | None = None, factor: float = CAPACITY_FACTOR
) -> np.ndarray:
    """:func:`jaxrec.distributed.capacity.fast_path_capacity` over arrays (same floats).

    ``capacity``: a user's ``capacity=``, which replaces the statistics-sized
    value (``min(capacity, natural)``).
    """
    e = np.asarray(expected, np.float64)
    nat = np.asarray(natural, np.float64)
    if capacity is not None:
        c = np.minimum(float(capacity), nat)
    else:
        sized = np.ceil(factor * e + SIGMAS * np.sqrt(np.maximum(e, 0.0)))
        c = np.where(e > 0, np.minimum(nat, np.maximum(1.0, sized)), 1.0)
    return np.where(nat < 1, 1.0, c)


@dataclasses.dataclass(frozen=True)
class GroupCost:
    """Costs of one ``(columns, dtype, state bytes per row, weighted, sequence, cached)``
    width group."""

    topology: Topology
    ncols: int
    itemsize: int
    state_row: int
    weighted: bool
    sequence: bool = False  # an EmbeddingCollection's group: rows per id, not pooled blocks
    cached: bool = False  # fused_uvm_caching: HBM holds cache slots, host memory the rows

    @property
    def weight_row(self) -> int:
        return self.ncols * self.itemsize

    @property
    def mem_row(self) -> int:
        return self.ncols * self.itemsize + self.state_row

    def buffers(self, capacity, slots, split: bool = False, row_sum_values: Num = 0.0):
        """Lookup buffer bytes for fast-path capacity ``C`` and ``S`` slots (arrays ok)."""
        out = sharded_buffer_bytes(
            self.topology,
            self.ncols,
            capacity,
            slots,
            weighted=self.weighted,
            split=split,
            row_sum_values=row_sum_values,
            sequence=self.sequence,
        )
        if self.cached:
            out = out + cache_staging_bytes(self.topology, capacity, self.mem_row)
        return out

    def perf(self, capacity, slots, row_sum_sent: Num = 0.0, fetch: Num = 0.0) -> Perf:
        """``fetch``: expected missed ids per source on the busiest rank (cached groups)."""
        p = sharded_perf(
            self.topology,
            self.ncols,
            self.itemsize,
            self.state_row,
            capacity,
            slots,
            weighted=self.weighted,
            row_sum_sent=row_sum_sent,
            sequence=self.sequence,
        )
        if not self.cached:
            return p
        fetched = self.topology.world_size * fetch  # every source's misses on the rank
        ids = self.topology.world_size * capacity  # the ids the rank's slot maps plan
        return p._replace(
            prefetch_compute=cache_miss_seconds(self.topology, fetched, self.mem_row, ids)
        )

    def time(self, capacity, slots, row_sum_sent: Num = 0.0, fetch: Num = 0.0) -> float:
        return self.perf(capacity, slots, row_sum_sent, fetch).total

    @functools.cached_property
    def linear(self) -> tuple[float, float, float, float]:
        """``(bytes per id, bytes per slot, seconds per id, seconds per slot)``: the
        costs' slopes, for cheap per-rank load estimates."""
        return (
            float(self.buffers(1, 0)),
            float(self.buffers(0, 1)),
            float(self.time(1, 0)),
            float(self.time(0, 1)),
        )

    def memory(
        self, rows, capacity, slots, split: bool = False, row_sum_values: Num = 0.0, cache: Num = 0
    ):
        """``(weights, optimizer state, buffers)`` bytes on every device (of ``cache``
        slots in a cached group, of ``rows`` rows in others)."""
        buffers = float(self.buffers(capacity, slots, split, row_sum_values))
        held = cache if self.cached else rows
        if self.cached:  # the slot maps count with the buffers
            buffers += float(cache_map_bytes(rows, cache, slot_maps_on_device(self.topology)))
        return held * self.weight_row, held * self.state_row, buffers

    def hbm(
        self, rows, capacity, slots, split: bool = False, row_sum_values: Num = 0.0, cache: Num = 0
    ):
        """Device bytes (arrays ok): rows or cache slots, and buffers."""
        held = cache if self.cached else rows
        maps = (
            cache_map_bytes(rows, cache, slot_maps_on_device(self.topology)) if self.cached else 0
        )
        return held * self.mem_row + maps + self.buffers(capacity, slots, split, row_sum_values)

    def host(self, rows, cache):
        """Host bytes per rank: a cached group's rows (and, with several hosts, the slot
        maps), else 0."""
        if not self.cached:
            return 0.0
        return cache_host_bytes(rows, cache, self.mem_row, slot_maps_on_device(self.topology))


class CostModel:
    """Storage and perf estimates for one topology and ``capacity=`` setting.

    Args:
        topology: the devices.
        capacity: a user's ``capacity=`` (ids per destination for every width
            group, or ``{group name: ids}`` for some, at most the natural
            payload); ``None`` (or a group not named) sizes a group's fast
            path from its expected load.
        weighted_modules: module paths whose collections carry per-id weights.
        capacity_factor: the fast path's headroom over the expected load.
    """

    def __init__(
        self,
        topology: Topology,
        capacity: int | Mapping[str, int] | None = None,
        weighted_modules: Iterable[str] = frozenset(),
        capacity_factor: float = CAPACITY_FACTOR,
    ):
        fast_path_capacity(1.0, 1, capacity_factor)  # validates it
        self.topology = topology
        self.capacity = capacity
        self.capacity_factor = capacity_factor
        self.weighted_modules = frozenset(weighted_modules)
        self._groups: dict = {}
        self._state: dict = {}
        self._miss: dict = {}
        # the partitioner's memos, reused across the proposals of one plan() call
        self.cuts: dict = {}  # row-cut options
        self.items: dict = {}  # (option, shard) -> its placement fields (load.ShardLoad)

    def state_per_row(self, table: TableInfo, ncols: int) -> int:
        return state_bytes_per_row(table.optimizer, ncols, self._state)

    def row_sum_calls(self, table: TableInfo) -> int:
        return row_sum_calls(table.optimizer, self._state)

    def group_key(self, table: TableInfo, ncols: int, cache: CacheParams | None = None) -> tuple:
        """Shards stack by ``(columns, dtype)`` within one collection (``layout.py``);
        cached shards stack apart from the others."""
        key = (table.module, ncols, table.config.data_type.value)
        return key if cache is None else (*key, CACHED)

    def group_cost(self, table: TableInfo, ncols: int, cached: bool = False) -> GroupCost:
        weighted = table.module in self.weighted_modules
        key = (
            ncols,
            table.itemsize,
            self.state_per_row(table, ncols),
            weighted,
            table.sequence,
            cached,
        )
        cost = self._groups.get(key)
        if cost is None:
            cost = self._groups[key] = GroupCost(self.topology, *key)
        return cost

    def given(self, group: str) -> int | None:
        """The user's capacity for the width group named ``group`` (``fp32_c64``), if any."""
        if isinstance(self.capacity, Mapping):
            return self.capacity.get(group)
        return self.capacity

    def capacities(self, expected, natural, group: str) -> np.ndarray:
        """Fast-path capacities of a group for arrays of (expected, natural) loads."""
        return fast_path_capacities(expected, natural, self.given(group), self.capacity_factor)

    def capacity_of(self, expected: float, natural: int, group: str) -> int:
        """The capacity the sharded collection builds for a group (the shared formula)."""
        given = self.given(group)
        if natural < 1:
            return 1
        if given is not None:
            return max(1, min(given, natural))
        return fast_path_capacity(expected, natural, self.capacity_factor)

    def miss_rate(self, table: TableInfo, cache: CacheParams) -> float:
        """Expected share of the table's lookups that miss its cache (uniform ids unless
        the constraints give ``cache_statistics``)."""
        key = (id(table), cache.load_factor)
        if key not in self._miss:
            stats = table.constraints.cache_statistics or UniformCacheStatistics()
            rate = stats.expected_miss_rate(cache.load_factor, table.rows)
            self._miss[key] = (table, min(1.0, max(0.0, float(rate))))  # keeps ids unique
        return self._miss[key][1]

    def standalone(
        self, table: TableInfo, nrows, ncols: int, cache: CacheParams | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(device bytes, seconds, host bytes)`` of shards of ``nrows`` rows (an array)
        and ``ncols`` columns, each as if alone in its width group (cached with
        ``cache``, if given)."""
        g = self.group_cost(table, ncols, cache is not None)
        nrows = np.asarray(nrows, np.float64)
        name = group_name(ncols, table.config.data_type.value, cache is not None)
        loads = table.expected_ids * nrows / table.rows
        c = self.capacities(loads, table.ids, name)
        split = ncols < table.dim
        v = self.topology.world_size * np.minimum(c, table.ids) * self.row_sum_calls(table)
        v = v if split else 0.0
        if cache is None:
            mem = nrows * g.mem_row + g.buffers(c, table.num_features, split, v)
            # Perf is typed in floats; with the array ``c`` the time is an array too
            return mem, np.asarray(g.time(c, table.num_features, v), np.float64), 0.0 * nrows
        slots = np.array([cache_slots(int(r), cache.load_factor) for r in nrows], np.float64)
        fetch = self.miss_rate(table, cache) * loads
        mem = g.hbm(nrows, c, table.num_features, split, v, slots)
        sec = np.asarray(g.time(c, table.num_features, v, fetch), np.float64)
        return mem, sec, np.asarray(g.host(nrows, slots), np.float64)

    def shard_memory(self, table: TableInfo, shard: ShardSpec) -> float:
        """Bytes of one shard as if alone in its width group."""
        return float(self.standalone(table, [shard.nrows], shard.ncols)[0][0])

    def shard_perf(self, table: TableInfo, shard: ShardSpec) -> float:
        return float(self.standalone(table, [shard.nrows], shard.ncols)[1][0])

    def replicated(self, table: TableInfo) -> tuple[tuple[float, float, float], Perf]:
        """``((weights, state, buffers), perf)`` of a data-parallel table, per device."""
        s = self.state_per_row(table, table.dim)
        mem = replicated_memory(self.topology, table.rows, table.dim, table.itemsize, s, table.ids)
        perf = replicated_perf(
            self.topology, table.dim, table.itemsize, s, table.ids, table.num_features
        )
        return mem, perf
