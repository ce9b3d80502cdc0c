"""What the planner reasons about: tables with their inputs, and sharding options."""

from __future__ import annotations

import dataclasses
import functools

from ...configs import BaseEmbeddingConfig, EmbeddingConfig
from ...optim import SparseOptimizer
from ..types import CacheParams, EmbeddingComputeKernel, ShardingType
from .constraints import ParameterConstraints
from .storage import DTYPE_BYTES


@dataclasses.dataclass(frozen=True, eq=False)
class TableInfo:
    """One table of one module, with its constraints, optimizer and id statistics."""

    module: str  # module path ("" for a bare collection)
    config: BaseEmbeddingConfig
    constraints: ParameterConstraints
    optimizer: SparseOptimizer
    feature_caps: tuple[int, ...]  # ids per device per feature (static KJT capacities)
    # mean ids per device per feature: batch * pooling factor * num_poolings, at most the cap
    feature_means: tuple[float, ...] = ()

    def __post_init__(self):
        if not self.feature_means:
            object.__setattr__(self, "feature_means", tuple(float(c) for c in self.feature_caps))

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def key(self) -> str:
        return f"{self.module}.{self.name}" if self.module else self.name

    @property
    def rows(self) -> int:
        return self.config.num_embeddings

    @property
    def dim(self) -> int:
        return self.config.embedding_dim

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.config.data_type]

    @functools.cached_property
    def ids(self) -> int:
        return sum(self.feature_caps)

    @property
    def num_features(self) -> int:
        return len(self.feature_caps)

    @property
    def sequence(self) -> bool:
        """A sequence table (``EmbeddingCollection``): one output row per id, not per bag."""
        return isinstance(self.config, EmbeddingConfig)

    @functools.cached_property
    def expected_ids(self) -> float:
        """Mean ids per device per step over the table's features."""
        return float(sum(self.feature_means))

    def slot_loads(self, nrows: int) -> tuple[float, ...]:
        """Expected ids per source of each feature reading a shard of ``nrows`` rows
        (ids spread over rows uniformly): ``mean * nrows / rows``, the formula of
        ``jaxrec.distributed.capacity``."""
        return tuple(m * nrows / self.rows for m in self.feature_means)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """A block ``[row0, row0 + nrows) x [col0, col0 + ncols)`` of a table."""

    row0: int
    nrows: int
    col0: int
    ncols: int


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingOption:
    """One way to shard one table, before ranks are chosen.

    ``placement`` says what the partitioner chooses: ``"replicated"`` (data
    parallel, nothing), ``"fixed"`` (shard ``i`` on ``ranks[i]``: row-wise),
    ``"free"`` (each shard on any allowed rank, distinct ranks: table-wise,
    column-wise) or ``"host"`` (``blocks`` groups of consecutive shards, each
    group on its own host: shard ``j`` of a full group on the host's local rank
    ``j``, a smaller group on distinct ranks of the host).

    ``cache``: the device cache of a ``fused_uvm_caching`` option (``None``: ``fused``,
    or ``dense`` for data parallel).

    Estimates are standalone (the table as if alone in its width group):
    ``per_device_bytes`` is its largest shard's device memory, ``total_bytes``
    all its shards' (times the world size for replicas), ``host_bytes`` and
    ``total_host_bytes`` the same in host memory (cached options), ``perf``
    seconds summed over shards.
    """

    table: TableInfo
    sharding_type: ShardingType
    shards: tuple[ShardSpec, ...]
    placement: str
    ranks: tuple[int, ...] = ()  # "fixed": one per shard; "free": allowed ranks; "host": hosts
    blocks: int = 0  # "host"
    per_device_bytes: float = 0.0
    total_bytes: float = 0.0
    perf: float = 0.0
    cache: CacheParams | None = None
    host_bytes: float = 0.0
    total_host_bytes: float = 0.0

    @property
    def compute_kernel(self) -> EmbeddingComputeKernel:
        if self.placement == "replicated":
            return EmbeddingComputeKernel.DENSE
        if self.cache is not None:
            return EmbeddingComputeKernel.FUSED_UVM_CACHING
        return EmbeddingComputeKernel.FUSED

    @property
    def label(self) -> str:
        t = self.sharding_type.value
        cols = {s.ncols for s in self.shards}
        if self.sharding_type in (
            ShardingType.COLUMN_WISE,
            ShardingType.TABLE_COLUMN_WISE,
            ShardingType.GRID_SHARD,
        ):
            t = f"{t}/{len({(s.col0, s.ncols) for s in self.shards})}x{max(cols)}"
        return t if self.cache is None else f"{t} cached {self.cache.load_factor:g}"
