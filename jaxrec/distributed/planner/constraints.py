"""ParameterConstraints: what a table allows and what its inputs look like."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..types import EmbeddingComputeKernel, ShardingType


def _types(values, enum_cls, field: str, table: str = "") -> tuple | None:
    if values is None:
        return None
    if isinstance(values, str | enum_cls):
        values = [values]
    out = []
    for v in values:
        try:
            out.append(v if isinstance(v, enum_cls) else enum_cls(str(v).lower()))
        except ValueError:
            allowed = [e.value for e in enum_cls]
            raise ValueError(
                f"ParameterConstraints.{field}: unknown value {v!r}{table}; use one of {allowed}"
            ) from None
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParameterConstraints:
    """Per-table constraints and input statistics (TorchRec's ``ParameterConstraints``).

    Attributes:
        sharding_types: allowed sharding types (``ShardingType`` or their
            values such as ``"row_wise"``); ``None`` allows every type.
        compute_kernels: allowed kernels; jaxrec has ``"fused"`` (sharded
            tables, fused optimizer) and ``"dense"`` (data parallel), so
            excluding one excludes the sharding types that use it.
        pooling_factors: mean ids per bag, one per feature of the table (or
            one for all). They size the id exchange's fast path (pass the same
            ``pooling_factors`` to ``DistributedModelParallel``). Default:
            unknown, so, as the sharded collection does without them, every
            feature is expected to fill its capacity (which defaults to one id
            per bag, TorchRec's default pooling factor).
        num_poolings: bags per sample per feature (default 1.0).
        batch_sizes: samples per device per feature (default: the topology's).
        feature_capacities: the static KJT capacity per device of each feature
            (the most ids it can hold); default
            ``ceil(batch_size * pooling_factor * num_poolings)``.
        min_partition: smallest column block when splitting columns (default 32).
        hbm_only: tables live in device memory. jaxrec has no host-memory
            (UVM/caching) kernel, so every table is HBM-only; ``False`` is rejected.
        ranks: if given, the only ranks the table's shards may use (table-wise
            and column-wise shards).
        is_weighted: the table's features carry per-id weights (TorchRec's
            name); a collection with any weighted table sends weights with its
            ids, so its id buffers grow by a third.

    Example:
        >>> ParameterConstraints(sharding_types=["row_wise"], pooling_factors=[20.0])
    """

    sharding_types: Sequence[ShardingType | str] | None = None
    compute_kernels: Sequence[EmbeddingComputeKernel | str] | None = None
    pooling_factors: Sequence[float] | None = None
    num_poolings: Sequence[float] | None = None
    batch_sizes: Sequence[int] | None = None
    feature_capacities: Sequence[int] | None = None
    min_partition: int | None = None
    hbm_only: bool = True
    ranks: Sequence[int] | None = None
    is_weighted: bool = False

    def __post_init__(self):
        st = _types(self.sharding_types, ShardingType, "sharding_types")
        ck = _types(self.compute_kernels, EmbeddingComputeKernel, "compute_kernels")
        object.__setattr__(self, "sharding_types", st)
        object.__setattr__(self, "compute_kernels", ck)
        for f in ("pooling_factors", "num_poolings", "batch_sizes", "feature_capacities", "ranks"):
            v = getattr(self, f)
            if v is not None:
                v = (v,) if isinstance(v, int | float) else tuple(v)
                if any(not x >= 0 for x in v) or (f != "ranks" and any(x == 0 for x in v)):
                    raise ValueError(f"ParameterConstraints.{f} must be positive, got {v}")
                object.__setattr__(self, f, v)
        if self.min_partition is not None and self.min_partition < 1:
            raise ValueError(f"min_partition must be >= 1, got {self.min_partition}")
        if not self.hbm_only:
            raise ValueError(
                "hbm_only=False asks for host-memory (UVM/caching) tables, which jaxrec does not "
                "have; tables that do not fit must be split across devices (row_wise, "
                "table_row_wise, column_wise) or use more devices"
            )

    def allows(self, sharding_type: ShardingType) -> bool:
        if self.sharding_types is not None and sharding_type not in self.sharding_types:
            return False
        if self.compute_kernels is not None:
            dense = sharding_type is ShardingType.DATA_PARALLEL
            kernel = EmbeddingComputeKernel.DENSE if dense else EmbeddingComputeKernel.FUSED
            return kernel in self.compute_kernels
        return True

    def per_feature(self, field: str, num_features: int, default):
        """The field's value for each feature (one value broadcasts)."""
        v = getattr(self, field)
        if v is None:
            return (default,) * num_features
        if len(v) == 1:
            return v * num_features
        if len(v) != num_features:
            raise ValueError(
                f"ParameterConstraints.{field} has {len(v)} values for a table with "
                f"{num_features} features; give one value or one per feature"
            )
        return v
