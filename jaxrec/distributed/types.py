"""Sharding plan types (TorchRec's ``torchrec.distributed.types`` names)."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping


class ShardingType(enum.Enum):
    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    COLUMN_WISE = "column_wise"
    ROW_WISE = "row_wise"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"
    GRID_SHARD = "grid_shard"


class EmbeddingComputeKernel(enum.Enum):
    DENSE = "dense"  # data-parallel tables
    FUSED = "fused"  # sharded tables with the fused sparse optimizer, in device memory
    # the table and its optimizer state in host memory, a device cache of its rows
    # (``CacheParams``; see ``jaxrec.cache``)
    FUSED_UVM_CACHING = "fused_uvm_caching"


class CacheAlgorithm(enum.Enum):
    """Which cached row a miss replaces (FBGEMM's ``CacheAlgorithm``)."""

    LRU = "lru"  # the least recently used
    LFU = "lfu"  # the least frequently used (ids counted since the start)


def cache_slots(rows: int, load_factor: float) -> int:
    """Device cache slots of a shard of ``rows`` rows: ``ceil(load_factor * rows)``, at
    least 1 (the product rounded to 1e-6 first, so that 0.1 * 200 gives 20, not 21).
    The planner prices these and ``jaxrec.cache`` builds them."""
    return max(1, math.ceil(round(load_factor * rows, 6)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheParams:
    """The device cache of a ``fused_uvm_caching`` table (TorchRec's ``CacheParams``).

    Attributes:
        algorithm: the replacement policy.
        load_factor: cached rows as a fraction of the table's rows (of each
            shard's rows under row-wise sharding), in ``(0, 1]``.
    """

    algorithm: CacheAlgorithm = CacheAlgorithm.LRU
    load_factor: float = 0.2

    def __post_init__(self):
        object.__setattr__(self, "algorithm", CacheAlgorithm(self.algorithm))
        if not 0 < self.load_factor <= 1:
            raise ValueError(
                f"CacheParams.load_factor must be in (0, 1] (the cached fraction of the "
                f"table's rows), got {self.load_factor}"
            )

    def to_json(self) -> dict:
        return {"algorithm": self.algorithm.value, "load_factor": self.load_factor}

    @staticmethod
    def from_json(d: Mapping) -> CacheParams:
        return CacheParams(algorithm=CacheAlgorithm(d["algorithm"]), load_factor=d["load_factor"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardMetadata:
    """One shard: ``[row, col]`` offsets and sizes in the logical table, and its rank."""

    shard_offsets: tuple[int, int]
    shard_sizes: tuple[int, int]
    placement: int  # rank (flat index into the mesh's devices)

    def to_json(self) -> dict:
        return {
            "shard_offsets": list(self.shard_offsets),
            "shard_sizes": list(self.shard_sizes),
            "placement": f"rank:{self.placement}",
        }

    @staticmethod
    def from_json(d: Mapping) -> ShardMetadata:
        return ShardMetadata(
            shard_offsets=tuple(d["shard_offsets"]),
            shard_sizes=tuple(d["shard_sizes"]),
            placement=int(str(d["placement"]).split(":")[1].split("/")[0]),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParameterSharding:
    """How one table is sharded (TorchRec's ``ParameterSharding``).

    Attributes:
        sharding_type: the strategy.
        compute_kernel: ``"fused"`` for sharded tables, ``"dense"`` for data parallel.
        ranks: ranks holding a shard (every rank for data parallel).
        sharding_spec: the shards; ``None`` for data parallel (a full replica
            on every rank).
        cache_params: the device cache of a ``fused_uvm_caching`` table
            (``None`` otherwise).
    """

    sharding_type: ShardingType
    compute_kernel: EmbeddingComputeKernel
    ranks: tuple[int, ...]
    sharding_spec: tuple[ShardMetadata, ...] | None = None
    cache_params: CacheParams | None = None

    def __post_init__(self):
        cached = self.compute_kernel is EmbeddingComputeKernel.FUSED_UVM_CACHING
        if cached and self.cache_params is None:
            object.__setattr__(self, "cache_params", CacheParams())
        if not cached and self.cache_params is not None:
            raise ValueError(
                f"cache_params is for compute_kernel 'fused_uvm_caching', not "
                f"{self.compute_kernel.value!r}"
            )
        if cached and self.sharding_type is ShardingType.DATA_PARALLEL:
            raise ValueError("a data-parallel table cannot be cached (fused_uvm_caching)")

    def to_json(self) -> dict:
        return {
            "sharding_type": self.sharding_type.value,
            "compute_kernel": self.compute_kernel.value,
            "ranks": list(self.ranks),
            "sharding_spec": None
            if self.sharding_spec is None
            else [s.to_json() for s in self.sharding_spec],
            **({} if self.cache_params is None else {"cache_params": self.cache_params.to_json()}),
        }

    @staticmethod
    def from_json(d: Mapping) -> ParameterSharding:
        spec = d.get("sharding_spec")
        return ParameterSharding(
            sharding_type=ShardingType(d["sharding_type"]),
            compute_kernel=EmbeddingComputeKernel(d["compute_kernel"]),
            ranks=tuple(d["ranks"]),
            sharding_spec=None if spec is None else tuple(ShardMetadata.from_json(s) for s in spec),
            cache_params=CacheParams.from_json(d["cache_params"]) if "cache_params" in d else None,
        )


class EmbeddingModuleShardingPlan(dict):
    """``{table name: ParameterSharding}`` for one embedding collection."""

    def __str__(self) -> str:
        return _format_module("", self)


class ShardingPlan:
    """``{module path: EmbeddingModuleShardingPlan}`` (module paths joined with ``.``).

    Round-trips through JSON (``to_json`` / ``from_json``) and prints as
    TorchRec's tutorial shows a plan.
    """

    def __init__(self, plan: Mapping[str, Mapping[str, ParameterSharding]]):
        self.plan = {k: EmbeddingModuleShardingPlan(v) for k, v in plan.items()}

    def get_plan_for_module(self, module_path: str) -> EmbeddingModuleShardingPlan | None:
        return self.plan.get(module_path)

    def to_json(self) -> str:
        return json.dumps(
            {m: {t: p.to_json() for t, p in mp.items()} for m, mp in self.plan.items()}, indent=1
        )

    @staticmethod
    def from_json(text: str) -> ShardingPlan:
        raw = json.loads(text)
        return ShardingPlan(
            {m: {t: ParameterSharding.from_json(p) for t, p in mp.items()} for m, mp in raw.items()}
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, ShardingPlan) and self.plan == other.plan

    def __str__(self) -> str:
        return "\n".join(_format_module(path, mp) for path, mp in self.plan.items())


def _format_module(path: str, mp: Mapping[str, ParameterSharding]) -> str:
    lines = [f"module: {path}", ""]
    head = f" {'param':<16} | {'sharding type':<18} | {'compute kernel':<14} | ranks"
    lines += [head, " " + "-" * (len(head) - 1)]
    for name, p in mp.items():
        lines.append(
            f" {name:<16} | {p.sharding_type.value:<18} | {p.compute_kernel.value:<14} | "
            f"{list(p.ranks)}"
        )
    head2 = f" {'param':<16} | {'shard offsets':<14} | {'shard sizes':<14} | placement"
    lines += ["", head2, " " + "-" * (len(head2) - 1)]
    for name, p in mp.items():
        for s in p.sharding_spec or ():
            lines.append(
                f" {name:<16} | {str(list(s.shard_offsets)):<14} | "
                f"{str(list(s.shard_sizes)):<14} | rank:{s.placement}"
            )
    return "\n".join(lines)
