"""ParameterConstraints: what a table allows and what its inputs look like."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..types import CacheParams, EmbeddingComputeKernel, ShardingType
from .cache_stats import CacheStatistics

EK = EmbeddingComputeKernel


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
        compute_kernels: allowed kernels: ``"fused"`` (sharded, in device
            memory), ``"fused_uvm_caching"`` (sharded, the table and its
            optimizer state in host memory with a device cache of its rows) and
            ``"dense"`` (data parallel); excluding a kernel excludes the sharding
            types that need it. ``None``: ``fused`` first, ``fused_uvm_caching``
            only for tables that do not fit otherwise (the planner tries caching
            only when no all-``fused`` plan fits); naming only
            ``"fused_uvm_caching"`` caches the table always.
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
        hbm_only: never cache the table (``fused`` only, as ``compute_kernels=
            ["fused", "dense"]``); TorchRec has no such field.
        cache_params: the cache a ``fused_uvm_caching`` option of the table gets
            (TorchRec's name; default ``CacheParams()``, load factor 0.2).
        cache_statistics: what the table's ids look like to its cache (a
            ``ZipfCacheStatistics``, a measured ``MissRateCurve``); default
            uniform ids, miss rate ``1 - load_factor``.
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
    hbm_only: bool = False
    ranks: Sequence[int] | None = None
    is_weighted: bool = False
    cache_params: CacheParams | None = None
    cache_statistics: CacheStatistics | None = None

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
        if self.hbm_only and ck is not None and ck == (EK.FUSED_UVM_CACHING,):
            raise ValueError(
                "ParameterConstraints: hbm_only=True (never cache) contradicts "
                "compute_kernels=['fused_uvm_caching'] (always cache); drop one"
            )
        if self.cache_params is not None and not isinstance(self.cache_params, CacheParams):
            raise TypeError(
                "ParameterConstraints.cache_params must be a CacheParams, got "
                f"{type(self.cache_params).__name__}"
            )

    def kernels(self, sharding_type: ShardingType) -> tuple[EmbeddingComputeKernel, ...]:
        """The compute kernels allowed with ``sharding_type``, ``fused`` first."""
        if self.sharding_types is not None and sharding_type not in self.sharding_types:
            return ()
        if sharding_type is ShardingType.DATA_PARALLEL:
            ok = (EK.DENSE,)
        else:
            ok = (EK.FUSED,) if self.hbm_only else (EK.FUSED, EK.FUSED_UVM_CACHING)
        return tuple(k for k in ok if self.compute_kernels is None or k in self.compute_kernels)

    def allows(self, sharding_type: ShardingType) -> bool:
        return bool(self.kernels(sharding_type))

    @property
    def allows_caching(self) -> bool:
        """Some sharding type may use ``fused_uvm_caching``."""
        return any(EK.FUSED_UVM_CACHING in self.kernels(st) for st in ShardingType)

    @property
    def cache_only(self) -> bool:
        """The table is always cached: its constraints allow no ``fused`` kernel."""
        no_fused = self.compute_kernels is not None and EK.FUSED not in self.compute_kernels
        return no_fused and self.allows_caching

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
