"""Sharding plan types (TorchRec's ``torchrec.distributed.types`` names)."""

from __future__ import annotations

import dataclasses
import enum
import json
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
    FUSED = "fused"  # sharded tables with the fused sparse optimizer


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
    """

    sharding_type: ShardingType
    compute_kernel: EmbeddingComputeKernel
    ranks: tuple[int, ...]
    sharding_spec: tuple[ShardMetadata, ...] | None = None

    def to_json(self) -> dict:
        return {
            "sharding_type": self.sharding_type.value,
            "compute_kernel": self.compute_kernel.value,
            "ranks": list(self.ranks),
            "sharding_spec": None
            if self.sharding_spec is None
            else [s.to_json() for s in self.sharding_spec],
        }

    @staticmethod
    def from_json(d: Mapping) -> ParameterSharding:
        spec = d.get("sharding_spec")
        return ParameterSharding(
            sharding_type=ShardingType(d["sharding_type"]),
            compute_kernel=EmbeddingComputeKernel(d["compute_kernel"]),
            ranks=tuple(d["ranks"]),
            sharding_spec=None if spec is None else tuple(ShardMetadata.from_json(s) for s in spec),
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
