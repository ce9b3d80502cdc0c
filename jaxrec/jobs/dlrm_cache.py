"""The job's tables in host memory (TorchRec's ``fused_uvm_caching``): which the plan
caches, their slot tables on the devices, their host tables and the ``RowCache``.

A table is cached when ``--cache-tables`` names it or when the planner caches it
because the tables do not fit the devices' memory (``--hbm-gib``). Its logical rows
and optimizer rows live in host memory, initialised there a chunk at a time (never
whole on a device); the device holds ``--cache-load-factor`` of its rows.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from ..cache import (
    CacheParams,
    CacheStats,
    HostTable,
    RowCache,
    cached_configs,
    device_plan,
    host_rows,
)
from ..cache.configs import slots_per_shard
from ..cache.ids import feature_spans, with_values
from ..cache.stats import measure_miss_rates
from ..configs import BaseEmbeddingConfig, EmbeddingBagConfig
from ..datasets import Part, TableDataset
from ..distributed import CacheAlgorithm, EmbeddingModuleShardingPlan, init_keys
from ..distributed.planner import MissRateCurve, ParameterConstraints
from ..distributed.types import EmbeddingComputeKernel
from ..embedding import CombinedOptimizer
from ..sparse import KeyedJaggedTensor
from ..train import TrainState
from .dlrm_config import DlrmJobConfig
from .dlrm_parts import EBC_PATH, build_model, logical_plan, make_mesh

CACHED = EmbeddingComputeKernel.FUSED_UVM_CACHING


def check_cache_flags(config: DlrmJobConfig) -> None:
    """Fails early (before any data is read) on cache flags that cannot work."""
    if config.hbm_gib is not None and config.sharding != "planner":
        raise SystemExit("--hbm-gib is the planner's device memory: use --sharding planner")
    if config.hbm_gib is not None and not config.hbm_gib > 0:
        raise SystemExit(f"--hbm-gib must be positive, got {config.hbm_gib}")
    if not 0 < config.cache_load_factor <= 1:
        raise SystemExit(
            f"--cache-load-factor must be in (0, 1] (the cached share of a table's rows), "
            f"got {config.cache_load_factor}"
        )
    if config.cache_statistics_batches < 0:
        raise SystemExit(
            f"--cache-statistics-batches must be 0 or more, got {config.cache_statistics_batches}"
        )
    if config.cache_statistics_batches and config.sharding != "planner":
        raise SystemExit(
            "--cache-statistics-batches prices the planner's caches: use --sharding planner"
        )
    if config.cache_scale_up and config.sharding != "planner":
        raise SystemExit("--cache-scale-up is the planner's: use --sharding planner")
    if config.cache_scale_up and config.devices == 1 and config.hbm_gib is None:
        raise SystemExit("--cache-scale-up: one device plans only with --hbm-gib")
    if config.cache_statistics_batches and config.devices == 1 and config.hbm_gib is None:
        raise SystemExit(
            "--cache-statistics-batches: one device plans only with --hbm-gib "
            "(else nothing is planned or priced)"
        )
    if config.cache_tables and config.sharding == "data_parallel":
        raise SystemExit(
            "--cache-tables: data_parallel tables (a replica on every device) cannot be "
            "cached: use another --sharding"
        )


def cache_params(config: DlrmJobConfig) -> CacheParams:
    return CacheParams(
        algorithm=CacheAlgorithm(config.cache_algorithm), load_factor=config.cache_load_factor
    )


def forced(config: DlrmJobConfig, configs: Sequence[EmbeddingBagConfig]) -> list[str]:
    """The tables ``--cache-tables`` names (``all``: every table)."""
    if not config.cache_tables:
        return []
    names = [c.name for c in configs]
    if config.cache_tables == "all":
        return names
    wanted = [t.strip() for t in config.cache_tables.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in names]
    if unknown or not wanted:
        what = f"no table {unknown}" if unknown else f"{config.cache_tables!r} names no table"
        raise SystemExit(f"--cache-tables: {what}; the tables are {names} (or pass 'all')")
    return wanted


def constraints(
    config: DlrmJobConfig,
    configs: Sequence[EmbeddingBagConfig],
    stats: Mapping[str, MissRateCurve] | None = None,
) -> dict[str, ParameterConstraints]:
    """The planner's constraints: ``--cache-tables`` cached always; any other table the
    planner caches gets the same ``CacheParams``; ``stats``: ``{table: CacheStatistics}``
    (default: uniform ids)."""
    always, params, stats = set(forced(config, configs)), cache_params(config), stats or {}
    return {
        c.name: ParameterConstraints(
            compute_kernels=[CACHED] if c.name in always else None,
            cache_params=params,
            cache_statistics=stats.get(c.name),
        )
        for c in configs
    }


def measured_statistics(
    config: DlrmJobConfig, data: TableDataset, configs: Sequence[EmbeddingBagConfig]
) -> dict[str, MissRateCurve]:
    """Each table's miss rates on the first ``--cache-statistics-batches`` steps of the
    one-process stream (every process measures the same, so all plan alike). A step's
    ids are every device's batch together: a cache of the whole table sees them so
    (a row shard's cache sees its rows of them, at about the table's rates)."""
    n = config.cache_statistics_batches
    if not n:
        return {}
    sample = data.batches(
        config.batch_size, shuffle=True, seed=config.seed, epoch=0, part=Part(0, 1)
    )
    kjts = [b.sparse_features for b in itertools.islice(sample, n * config.devices)]
    steps = [kjts[i : i + config.devices] for i in range(0, len(kjts), config.devices)]
    out = {}
    for c in configs:
        features = dict.fromkeys(c.feature_names)  # (feature_spans reads only `in`)
        batches = []
        for step in steps:
            ids = [
                np.asarray(k.values())[lo:hi]
                for k in step
                for _, lo, hi, _ in feature_spans(k, features)
            ]
            ids = np.concatenate(ids) if ids else np.zeros(0, np.int32)
            batches.append(ids[(ids >= 0) & (ids < c.num_embeddings)])  # as the cache does
        out[c.name] = measure_miss_rates(
            batches, c.num_embeddings, algorithm=config.cache_algorithm
        )
    return out


def with_forced(
    config: DlrmJobConfig,
    configs: Sequence[EmbeddingBagConfig],
    plan: EmbeddingModuleShardingPlan,
) -> EmbeddingModuleShardingPlan:
    """``plan`` (an explicit ``--sharding``'s) with the ``--cache-tables`` cached."""
    out = EmbeddingModuleShardingPlan(plan)  # (data_parallel refused by check_cache_flags)
    for name in forced(config, configs):
        out[name] = dataclasses.replace(
            plan[name], compute_kernel=CACHED, cache_params=cache_params(config)
        )
    return out


def cached_tables(plan: EmbeddingModuleShardingPlan) -> dict[str, CacheParams]:
    """``{table: CacheParams}`` of the plan's cached tables."""
    return {n: p.cache_params for n, p in plan.items() if p.compute_kernel is CACHED}


def device_tables(
    configs: Sequence[EmbeddingBagConfig],
    plan: EmbeddingModuleShardingPlan | None,
    cached: Mapping[str, CacheParams],
) -> tuple[list[EmbeddingBagConfig], EmbeddingModuleShardingPlan | None]:
    """``(configs, plan)`` of the devices' tables: each cached table as its slots
    (``plan`` None: unsharded)."""
    if not cached:
        return list(configs), plan
    if plan is None:
        return _bags(cached_configs(configs, cached)), None
    slot_configs, slot_plan = device_plan(configs, plan)
    return _bags(slot_configs), slot_plan


def _bags(configs: Sequence[BaseEmbeddingConfig]) -> list[EmbeddingBagConfig]:
    """``configs`` as bag configs (the slot tables of bag tables are bag tables)."""
    out = [c for c in configs if isinstance(c, EmbeddingBagConfig)]
    if len(out) != len(configs):
        raise TypeError(f"expected EmbeddingBagConfigs, got {[type(c).__name__ for c in configs]}")
    return out


def row_cache(
    config: DlrmJobConfig,
    data: TableDataset,
    configs: list[EmbeddingBagConfig],
    cached: Mapping[str, CacheParams],
    graphdef: nnx.GraphDef,
    optimizer: CombinedOptimizer,
    state: TrainState,
) -> RowCache:
    """The ``RowCache`` of the cached tables, each process's host tables holding the
    rows its devices cache (``host_rows``), drawn on the host with the values the
    all-device model of the same ``--seed`` has (its collection's init key)."""
    key = init_keys(lambda: build_model(config, data, configs))[EBC_PATH]
    hosts = {}
    for stream, c in enumerate(configs):
        if c.name in cached:
            rows = host_rows(graphdef, optimizer, state, c)
            opt = optimizer.for_table(c.name)
            hosts[c.name] = HostTable.create(c, opt, rows=rows, key=key, stream=stream)
    return RowCache(graphdef, optimizer, state, hosts, cached, slot_maps=config.cache_slot_maps)


def slot_view(
    kjt: KeyedJaggedTensor,
    configs: Sequence[EmbeddingBagConfig],
    plan: EmbeddingModuleShardingPlan,
    cached: Mapping[str, CacheParams],
) -> KeyedJaggedTensor:
    """``kjt`` with each cached table's ids as the first slot of the row shard that holds
    them: the loads the id exchange sees once the cache rewrites ids as slots (for
    ``measure_capacities``; the slot within a shard does not change a load)."""
    geometry = {}
    for c in configs:
        if c.name in cached:
            shards = len({s.shard_offsets[0] for s in plan[c.name].sharding_spec})
            rows, slots = (
                -(-c.num_embeddings // shards),
                slots_per_shard(c.num_embeddings, shards, cached[c.name]),
            )
            geometry.update({f: (rows, slots) for f in c.feature_names})
    values = np.array(kjt.values())
    offsets = kjt.capacity_offsets()
    for k, f in enumerate(kjt.keys()):
        if f in geometry:
            rows, slots = geometry[f]
            part = values[offsets[k] : offsets[k + 1]]
            values[offsets[k] : offsets[k + 1]] = (part // rows) * slots
    return with_values(kjt, values)


class PlacedTables(NamedTuple):
    """Where :func:`place_tables` puts the logical tables."""

    mesh: jax.sharding.Mesh | None  # None: one device, unsharded
    plan: EmbeddingModuleShardingPlan | None  # the logical tables' (None: unsharded)
    cached: dict[str, CacheParams]  # the cached tables
    stats: dict[str, MissRateCurve]  # measured (--cache-statistics-batches), by table


def place_tables(
    config: DlrmJobConfig, data: TableDataset, configs: list[EmbeddingBagConfig]
) -> PlacedTables:
    """``(mesh or None, logical plan or None, {cached table: CacheParams}, {table:
    measured MissRateCurve})`` (the curves only with ``--cache-statistics-batches``).

    One device runs unsharded; with ``--hbm-gib`` the planner still decides, on a
    one-device mesh, which tables must be cached."""
    if config.dynamic_tables:  # on the devices, row-wise by the id's hash; nothing cached
        if config.devices == 1:
            return PlacedTables(None, None, {}, {})
        mesh = make_mesh(config)
        abstract = nnx.eval_shape(lambda: build_model(config, data, configs))
        return PlacedTables(mesh, logical_plan(config, abstract, mesh), {}, {})
    planned = config.sharding == "planner" and (config.devices > 1 or config.hbm_gib is not None)
    if config.devices == 1 and not planned:
        forced_cached = {t: cache_params(config) for t in forced(config, configs)}
        return PlacedTables(None, None, forced_cached, {})
    mesh = make_mesh(config)
    abstract = nnx.eval_shape(lambda: build_model(config, data, configs))  # nothing allocated
    stats: dict[str, MissRateCurve] = {}
    if config.sharding == "planner":
        stats = measured_statistics(config, data, configs)
        plan = logical_plan(config, abstract, mesh, constraints(config, configs, stats))
    else:
        plan = with_forced(config, configs, logical_plan(config, abstract, mesh))
    cached = cached_tables(plan)
    if config.devices == 1:
        return PlacedTables(None, None, cached, stats)
    return PlacedTables(mesh, plan, cached, stats)


def cached_text(
    configs: Sequence[EmbeddingBagConfig],
    cached: Mapping[str, CacheParams],
    stats: Mapping[str, MissRateCurve] | None = None,
) -> str:
    rows, stats = {c.name: c.num_embeddings for c in configs}, stats or {}

    def about(t: str) -> str:
        lf, miss = cached[t].load_factor, ""
        if t in stats:
            miss = f", measured miss rate {stats[t].expected_miss_rate(lf, rows[t]):.3f}"
        return f"{t} ({rows[t]:,} rows, load factor {lf:g}{miss})"

    algorithms = "/".join(sorted({p.algorithm.value for p in cached.values()}))
    return f"in host memory with a device cache ({algorithms}): " + ", ".join(map(about, cached))


def cache_summary(
    rc: RowCache, stats: Mapping[str, MissRateCurve] | None = None
) -> dict[str, dict[str, object]]:
    """Per cached table: its rows, device slots and hit rate over every lookup,
    training and evaluation (and, with measured ``stats``, the hit rate the planner
    expected). Each process counts the lookups of the row shards it owns, so with
    several processes the counts are summed (every process calls this)."""
    stats = stats or {}
    counts = np.array([[rc.stats[n].ids, rc.stats[n].misses] for n in rc.tables], np.int64)
    if jax.process_count() > 1:
        counts = multihost_utils.process_allgather(counts).sum(axis=0)
    out: dict[str, dict[str, object]] = {}
    for (name, t), (ids, misses) in zip(rc.tables.items(), counts, strict=True):
        counted = CacheStats(ids=int(ids), misses=int(misses))
        out[name] = {
            "rows": t.host.config.num_embeddings,
            "slots": t.slots * len(t.maps),
            "hit_rate": round(counted.hit_rate, 4) if ids else None,
        }
        if name in stats:
            lf, rows = t.slots / t.shard_rows, t.host.config.num_embeddings
            miss = stats[name].expected_miss_rate(lf, rows)
            out[name]["planned_hit_rate"] = round(1 - miss, 4)
    return out
