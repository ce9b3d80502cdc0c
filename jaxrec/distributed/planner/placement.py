"""What the partitioner returns: a placed proposal with its padded estimates."""

from __future__ import annotations

import dataclasses
import math

from .cost_model import key_name
from .options import ShardingOption
from .perf import Perf


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupStats:
    """One width group after placement: its padded per-rank sizes and costs."""

    key: tuple  # (module path, columns, dtype[, "fused_uvm_caching"])
    tables: tuple[str, ...]
    rows_per_rank: int
    capacity: int  # fast-path ids per (source, destination): the buffers' size
    expected_ids: float  # the largest mean ids a destination receives from one source
    natural_ids: int  # the largest possible payload (a capacity that never overflows)
    slots: int
    weighted: bool
    column_split: bool  # holds a column shard: updated by the XLA path
    row_sum_values: int  # float32 row sums held per step (the fullest rank's, all calls)
    row_sum_sent: int  # float32 row sums the busiest rank sends its peers per step
    memory: tuple[float, float, float]  # weights, state, buffers (per device)
    perf: Perf
    optimizers: tuple[str, ...]
    sequence: bool = False  # an EmbeddingCollection's group (rows per id travel back)
    cache_rows: int = 0  # cached groups: device cache slots per rank
    host: float = 0.0  # cached groups: host bytes per rank (rows, state, cache metadata)
    fetched: float = 0.0  # cached groups: rows the busiest rank fetches per step

    @property
    def name(self) -> str:
        """The group's name in the sharded collection (``layout.py``): ``fp32_c64``."""
        return key_name(self.key)

    @property
    def cached(self) -> bool:
        return self.name.endswith("_cached")


@dataclasses.dataclass(frozen=True)
class Placement:
    """A partitioned proposal and its estimates (per device, padded as jaxrec allocates).

    ``options`` are the proposal's, except table-wise tables the partitioner
    split by rows, which appear as their ``ROW_WISE`` pieces. Host memory
    (``ddr``, cached groups' rows, state and cache metadata) is per device too,
    padded like the rest: a host holds ``local_world_size`` times it.
    """

    options: tuple[ShardingOption, ...]
    shard_ranks: tuple[tuple[int, ...], ...]  # per option, per shard
    usable_bytes: float
    memory: tuple[float, float, float]  # weights, optimizer state, buffers per device
    perf: Perf  # per step (every device runs the same padded shapes)
    own_memory: tuple[float, ...]  # per rank: bytes of its own shards, unpadded
    own_perf: tuple[float, ...]  # per rank: seconds for its own shards, unpadded
    groups: tuple[GroupStats, ...]
    overflow: tuple[str, ...]  # tables placed beyond the usable memory (device or host)
    split: tuple[str, ...] = ()  # table-wise tables cut by rows to balance their groups
    ddr: float = 0.0  # host bytes per device
    usable_ddr: float = math.inf  # per device: the usable host memory / local_world_size
    own_ddr: tuple[float, ...] = ()  # per rank, unpadded
    host_overflow: tuple[str, ...] = ()  # the tables of overflow that host memory refused

    @property
    def hbm(self) -> float:
        return sum(self.memory)

    @property
    def feasible(self) -> bool:
        return not self.overflow

    @property
    def cached(self) -> bool:
        return any(o.cache is not None for o in self.options)

    @property
    def balance(self) -> float:
        """max / mean of the per-rank own time (1.0 is perfect)."""
        mean = sum(self.own_perf) / len(self.own_perf)
        return max(self.own_perf) / mean if mean > 0 else 1.0

    @property
    def capacities(self) -> dict[str, dict[str, int]]:
        """``{module path: {group name: fast-path capacity}}`` the collections build."""
        out: dict[str, dict[str, int]] = {}
        for g in self.groups:
            out.setdefault(g.key[0], {})[g.name] = g.capacity
        return out

    def fullness(self) -> float:
        """The larger of device and host memory use as a share of their usable bytes."""
        host = self.ddr / self.usable_ddr if self.usable_ddr else math.inf
        return max(self.hbm / self.usable_bytes, host if self.ddr else 0.0)
