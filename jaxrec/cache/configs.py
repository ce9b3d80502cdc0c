"""The device side of cached tables: each becomes a table of cache slots."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ..configs import BaseEmbeddingConfig
from ..distributed.types import (
    CacheParams,
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardMetadata,
    cache_slots,
)


def slots_per_shard(rows: int, shards: int, params: CacheParams) -> int:
    """Slots of each row shard's cache (``cache_slots`` of the ceil-sized shard: every
    shard gets as many, so the slot table splits evenly)."""
    return cache_slots(-(-rows // shards), params.load_factor)


def cached_configs(
    configs: Sequence[BaseEmbeddingConfig], params: Mapping[str, CacheParams]
) -> list[BaseEmbeddingConfig]:
    """``configs`` with each table named in ``params`` (unsharded) as its slot table."""
    out = []
    for c in configs:
        if c.name in params:
            c = dataclasses.replace(
                c,
                num_embeddings=slots_per_shard(c.num_embeddings, 1, params[c.name]),
                cached_rows=c.num_embeddings,
            )
        out.append(c)
    return out


def device_plan(
    configs: Sequence[BaseEmbeddingConfig], plan: Mapping[str, ParameterSharding]
) -> tuple[list[BaseEmbeddingConfig], EmbeddingModuleShardingPlan]:
    """The slot tables and their plan for a collection whose plan (over the logical
    tables, e.g. from the planner) has ``fused_uvm_caching`` tables.

    A cached table keeps its sharding type, ranks and column split; each of its row
    shards gets ``slots_per_shard`` slots (``num_embeddings`` = row shards x slots),
    and its kernel on the device is ``fused``.
    """
    out_configs, out_plan = [], EmbeddingModuleShardingPlan()
    for c in configs:
        p = plan[c.name]
        if p.compute_kernel is not EmbeddingComputeKernel.FUSED_UVM_CACHING:
            out_configs.append(c)
            out_plan[c.name] = p
            continue
        shards, params = p.sharding_spec, p.cache_params
        if shards is None or params is None:  # a cached table is sharded, with its params
            raise ValueError(f"table {c.name!r}: a fused_uvm_caching plan without its shards")
        starts = sorted({s.shard_offsets[0] for s in shards})
        slots = slots_per_shard(c.num_embeddings, len(starts), params)
        spec = tuple(
            ShardMetadata(
                shard_offsets=(starts.index(s.shard_offsets[0]) * slots, s.shard_offsets[1]),
                shard_sizes=(slots, s.shard_sizes[1]),
                placement=s.placement,
            )
            for s in shards
        )
        out_configs.append(
            dataclasses.replace(c, num_embeddings=len(starts) * slots, cached_rows=c.num_embeddings)
        )
        out_plan[c.name] = dataclasses.replace(
            p, compute_kernel=EmbeddingComputeKernel.FUSED, cache_params=None, sharding_spec=spec
        )
    return out_configs, out_plan
