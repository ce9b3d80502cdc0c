"""The storage and perf estimators bound to one topology: per-group linear costs.

Both estimators are linear in a width group's padded maxima (rows ``R``,
per-destination ids ``C``, slots ``S``), which keeps the partitioner's
what-if questions O(1).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .options import ShardSpec, TableInfo
from .perf import Perf, replicated_perf, sharded_perf_coeffs
from .storage import (
    replicated_memory,
    row_sum_bytes,
    row_sum_calls,
    sharded_memory_coeffs,
    state_bytes_per_row,
)
from .topology import Topology


@dataclasses.dataclass(frozen=True)
class GroupCost:
    """Costs of one ``(columns, dtype, state bytes)`` group: ``mem = a*R + b*C + c*S``,
    plus, once it holds a column shard, ``max(mem_id_split * C, row sums)`` (see
    :meth:`buffers`)."""

    weight_row: float
    state_row: float
    mem_row: float
    mem_id: float
    mem_id_split: float
    mem_slot: float
    perf_id: Perf
    perf_slot: Perf
    time_id: float  # perf_id.total
    time_slot: float

    def buffers(self, ids, slots, split: bool = False, row_sum: float = 0.0):
        """Lookup buffer bytes (``ids`` may be an array). A group with column shards
        holds, after its row gradients, either its row-sum vectors or its updated
        rows: the update computes the rows from the completed sums, so the
        vectors are dead by then (``storage.row_sum_bytes``)."""
        extra = np.maximum(ids * self.mem_id_split, row_sum) if split else 0.0
        return ids * self.mem_id + slots * self.mem_slot + extra

    def memory(
        self, rows: float, ids: float, slots: float, split: bool = False, row_sum: float = 0.0
    ) -> tuple[float, float, float]:
        """``(weights, optimizer state, buffers)`` bytes."""
        buffers = float(self.buffers(ids, slots, split, row_sum))
        return rows * self.weight_row, rows * self.state_row, buffers

    def perf(self, ids: float, slots: float) -> Perf:
        return self.perf_id.scale(ids) + self.perf_slot.scale(slots)


class CostModel:
    """Storage and perf estimates for one topology and id capacity."""

    def __init__(self, topology: Topology, capacity: int | None = None):
        self.topology = topology
        self.capacity = capacity
        self._groups: dict = {}
        self._state: dict = {}

    def state_per_row(self, table: TableInfo, ncols: int) -> int:
        return state_bytes_per_row(table.optimizer, ncols, self._state)

    def group_key(self, table: TableInfo, ncols: int) -> tuple:
        """Shards stack by ``(columns, dtype)`` within one collection (``layout.py``)."""
        return (table.module, ncols, table.config.data_type.value)

    def group_cost(self, table: TableInfo, ncols: int) -> GroupCost:
        key = (ncols, table.itemsize, self.state_per_row(table, ncols))
        cost = self._groups.get(key)
        if cost is None:
            m = sharded_memory_coeffs(self.topology, *key)
            pi, ps = sharded_perf_coeffs(self.topology, *key)
            cost = GroupCost(ncols * key[1], key[2], *m, pi, ps, pi.total, ps.total)
            self._groups[key] = cost
        return cost

    def capped(self, ids: float) -> float:
        return ids if self.capacity is None else min(ids, self.capacity)

    def row_sums(self, table: TableInfo) -> float:
        """Bytes on every device of a column-split table's per-row sums (see storage)."""
        return row_sum_bytes(table.rows, row_sum_calls(table.optimizer, self._state))

    def shard_memory(self, table: TableInfo, shard: ShardSpec) -> float:
        """Bytes of one shard as if alone in its width group."""
        g = self.group_cost(table, shard.ncols)
        split = shard.ncols < table.dim
        row_sum = self.row_sums(table) if split else 0.0
        buffers = g.buffers(self.capped(table.ids), table.num_features, split, row_sum)
        return shard.nrows * g.mem_row + float(buffers)

    def shard_perf(self, table: TableInfo, shard: ShardSpec) -> float:
        g = self.group_cost(table, shard.ncols)
        return self.capped(table.ids) * g.time_id + table.num_features * g.time_slot

    def replicated(self, table: TableInfo) -> tuple[tuple[float, float, float], Perf]:
        """``((weights, state, buffers), perf)`` of a data-parallel table, per device."""
        s = self.state_per_row(table, table.dim)
        mem = replicated_memory(self.topology, table.rows, table.dim, table.itemsize, s, table.ids)
        perf = replicated_perf(
            self.topology, table.dim, table.itemsize, s, table.ids, table.num_features
        )
        return mem, perf
