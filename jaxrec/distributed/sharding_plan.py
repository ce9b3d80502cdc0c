"""Plan builders, as TorchRec's ``torchrec.distributed.sharding_plan``.

Each builder returns a generator ``(table_config, world_size, local_size) ->
ParameterSharding``; :func:`construct_module_sharding_plan` applies them to a
collection's tables. Ranks are flat indices into the mesh's devices; a "host"
is a row of ``local_size`` consecutive ranks (the last mesh axis).
Rows and columns that do not divide evenly are split in ceil-sized blocks
(the last shards are smaller, possibly empty), as TorchRec does for rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..configs import BaseEmbeddingConfig
from .types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingType,
    ShardMetadata,
)

Generator = Callable[[BaseEmbeddingConfig, int, int], ParameterSharding]
FUSED = EmbeddingComputeKernel.FUSED


def _blocks(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` (offset, size) blocks of ceil(n / k) covering ``n``."""
    size = -(-n // k)
    return [(min(i * size, n), max(0, min(size, n - i * size))) for i in range(k)]


def _check_ranks(ranks: Sequence[int], world_size: int, table: str) -> None:
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(
            f"table {table!r}: ranks {bad} are outside the world of {world_size} devices"
        )


def _host_ranks(host: int, world_size: int, local_size: int, table: str) -> list[int]:
    if world_size % local_size:
        raise ValueError(f"world_size {world_size} is not a multiple of local_size {local_size}")
    if not 0 <= host < world_size // local_size:
        raise ValueError(
            f"table {table!r}: host_index {host} out of range ({world_size // local_size} hosts)"
        )
    return list(range(host * local_size, (host + 1) * local_size))


def _spec(t, row_blocks, col_blocks, ranks) -> tuple[ShardMetadata, ...]:
    return tuple(
        ShardMetadata(shard_offsets=(r0, c0), shard_sizes=(nr, nc), placement=rank)
        for ((r0, nr), (c0, nc)), rank in zip(
            [(r, c) for c in col_blocks for r in row_blocks], ranks, strict=True
        )
    )


def data_parallel() -> Generator:
    def gen(t, world_size, local_size):
        del t, local_size
        return ParameterSharding(
            sharding_type=ShardingType.DATA_PARALLEL,
            compute_kernel=EmbeddingComputeKernel.DENSE,
            ranks=tuple(range(world_size)),
        )

    return gen


def table_wise(rank: int) -> Generator:
    """The whole table on ``rank``."""

    def gen(t, world_size, local_size):
        _check_ranks([rank], world_size, t.name)
        spec = _spec(t, [(0, t.num_embeddings)], [(0, t.embedding_dim)], [rank])
        return _sharding(ShardingType.TABLE_WISE, [rank], spec)

    return gen


def row_wise(ranks: Sequence[int] | None = None) -> Generator:
    """Rows split in blocks across ``ranks`` (default: every rank)."""

    def gen(t, world_size, local_size):
        rs = list(range(world_size)) if ranks is None else list(ranks)
        _check_ranks(rs, world_size, t.name)
        spec = _spec(t, _blocks(t.num_embeddings, len(rs)), [(0, t.embedding_dim)], rs)
        return _sharding(ShardingType.ROW_WISE, rs, spec)

    return gen


def column_wise(ranks: Sequence[int]) -> Generator:
    """Columns split in blocks, one per rank in ``ranks``."""

    def gen(t, world_size, local_size):
        _check_ranks(ranks, world_size, t.name)
        spec = _spec(t, [(0, t.num_embeddings)], _blocks(t.embedding_dim, len(ranks)), list(ranks))
        return _sharding(ShardingType.COLUMN_WISE, list(ranks), spec)

    return gen


def table_row_wise(host_index: int) -> Generator:
    """Rows split across the ranks of one host."""

    def gen(t, world_size, local_size):
        rs = _host_ranks(host_index, world_size, local_size, t.name)
        spec = _spec(t, _blocks(t.num_embeddings, len(rs)), [(0, t.embedding_dim)], rs)
        return _sharding(ShardingType.TABLE_ROW_WISE, rs, spec)

    return gen


def table_column_wise(host_index: int, num_shards: int | None = None) -> Generator:
    """Columns split across (the first ``num_shards``) ranks of one host."""

    def gen(t, world_size, local_size):
        rs = _host_ranks(host_index, world_size, local_size, t.name)[: num_shards or local_size]
        spec = _spec(t, [(0, t.num_embeddings)], _blocks(t.embedding_dim, len(rs)), rs)
        return _sharding(ShardingType.TABLE_COLUMN_WISE, rs, spec)

    return gen


def grid_shard(host_indexes: Sequence[int]) -> Generator:
    """One column block per host, rows split across each host's ranks."""

    def gen(t, world_size, local_size):
        hosts = [_host_ranks(h, world_size, local_size, t.name) for h in host_indexes]
        rows = _blocks(t.num_embeddings, local_size)
        cols = _blocks(t.embedding_dim, len(hosts))
        rs = [r for h in hosts for r in h]
        return _sharding(ShardingType.GRID_SHARD, rs, _spec(t, rows, cols, rs))

    return gen


def _sharding(kind, ranks, spec) -> ParameterSharding:
    return ParameterSharding(
        sharding_type=kind, compute_kernel=FUSED, ranks=tuple(ranks), sharding_spec=spec
    )


def construct_module_sharding_plan(
    module,
    per_param_sharding: Mapping[str, Generator],
    *,
    world_size: int,
    local_size: int | None = None,
) -> EmbeddingModuleShardingPlan:
    """Applies a builder per table of ``module`` (an embedding collection).

    Example:
        >>> plan = construct_module_sharding_plan(
        ...     ebc, {"t1": table_wise(rank=0), "t2": row_wise()}, world_size=8)
    """
    configs = {t.name: t for t in module.table_configs}
    unknown = sorted(set(per_param_sharding) - set(configs))
    missing = sorted(set(configs) - set(per_param_sharding))
    if unknown or missing:
        raise ValueError(
            f"per_param_sharding: unknown tables {unknown}, tables without a sharding {missing}"
        )
    local = world_size if local_size is None else local_size
    return EmbeddingModuleShardingPlan(
        {name: per_param_sharding[name](configs[name], world_size, local) for name in configs}
    )
