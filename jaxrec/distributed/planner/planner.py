"""EmbeddingShardingPlanner: tables + topology + constraints -> ShardingPlan."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import TypedDict, Unpack

import jax
from flax import nnx

from ...configs import BaseEmbeddingConfig
from ...modules.embedding_bag_collection import EmbeddingBagCollection
from ...modules.embedding_collection import EmbeddingCollection
from ..capacity import CAPACITY_FACTOR, check_capacity
from ..types import (
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)
from .constraints import ParameterConstraints
from .cost_model import CostModel
from .enumerator import enumerate_options, estimate_option
from .options import ShardingOption, ShardSpec, TableInfo
from .partitioner import GreedyPerfPartitioner
from .placement import Placement
from .proposers import (
    CachingProposer,
    GreedyProposer,
    GridSearchProposer,
    Proposer,
    UniformProposer,
)
from .scaleup import scale_up_caches
from .stats import PlanStats, capacity_errors, infeasible_message
from .storage import OptimizerSpec, resolve_optimizer, table_optimizer
from .topology import Topology


class PlannerError(ValueError):
    """No plan fits; the message says which tables, how big, and what would fit.

    ``stats``: the report on the closest plan found (``None`` if none was placed).
    """

    def __init__(self, message: str, stats: PlanStats | None = None):
        super().__init__(message)
        self.stats = stats


# What the planner plans: a model, a collection, a table list or {module path: tables}.
ModelOrTables = (
    nnx.Module | Sequence[BaseEmbeddingConfig] | Mapping[str, Sequence[BaseEmbeddingConfig]]
)


class PlannerOptions(TypedDict, total=False):
    """The :class:`EmbeddingShardingPlanner` arguments ``plan_for_model`` passes on."""

    capacity_factor: float
    reserved_hbm_fraction: float
    reserved_ddr_fraction: float
    proposers: Sequence[Proposer] | None
    partitioner: GreedyPerfPartitioner | None
    scale_up_caches: bool


def collect_tables(model_or_tables: ModelOrTables) -> dict[str, list[BaseEmbeddingConfig]]:
    """``{module path: tables}`` from a model, a collection, a table list or such a dict.

    A model's ``EmbeddingBagCollection`` s and ``EmbeddingCollection`` s (sequence
    tables: ``EmbeddingConfig`` s, whose lookups return a row per id) are planned.
    Paths are joined with ``.`` as ``DistributedModelParallel`` expects; a
    bare table list is module ``""``.
    """
    if isinstance(model_or_tables, Mapping):
        return {str(k): list(v) for k, v in model_or_tables.items()}
    if isinstance(model_or_tables, Sequence) and not isinstance(model_or_tables, str):
        tables = list(model_or_tables)
        bad = [type(t).__name__ for t in tables if not isinstance(t, BaseEmbeddingConfig)]
        if bad:
            raise TypeError(f"plan() takes a model or a list of table configs, got items {bad}")
        return {"": tables}
    if not isinstance(model_or_tables, nnx.Module):
        raise TypeError(
            "plan() takes an nnx.Module, a list of EmbeddingBagConfig / EmbeddingConfig or "
            f"{{module path: tables}}, got {type(model_or_tables).__name__}"
        )
    out = {}
    for path, module in nnx.iter_modules(model_or_tables):
        if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
            out[".".join(map(str, path))] = list(module.table_configs)
    if not out:
        raise ValueError("the model has no EmbeddingBagCollection or EmbeddingCollection to plan")
    return out


class EmbeddingShardingPlanner:
    """Plans how every embedding table is sharded (TorchRec's ``EmbeddingShardingPlanner``).

    Pipeline: the enumerator lists each table's options with storage and perf
    estimates; each proposer proposes one option per table; the partitioner
    gives every shard a rank and estimates the padded memory and step time;
    the fastest proposal that fits wins (ties: less memory, then the first
    found). Everything is deterministic.

    Tables live in device memory (``fused``) whenever a plan fits so. When
    none does, the search runs again with the cached options
    (``fused_uvm_caching``: table and optimizer state in host memory, a device
    cache of ``load_factor`` of the rows) of the tables whose constraints
    allow them, with a ``CachingProposer`` that caches as few tables as fit;
    host memory (``Topology.ddr_cap`` per host) must hold what is cached.

    Args:
        topology: the devices (default ``Topology.from_devices()``).
        constraints: ``{table name: ParameterConstraints}``; a key
            ``"<module path>.<table>"`` wins over the bare table name.
        optimizer: the fused sparse optimizer whose state is sized: a
            ``SparseOptimizer``, a ``CombinedOptimizer`` (per-table overrides)
            or a name (``"adam"``); default row-wise Adagrad (4 bytes per row).
        capacity: the ``capacity=`` given to ``DistributedModelParallel`` (ids
            per (source, destination) per width group, or ``{group name: ids}``
            for some groups, at most the natural payload), ``None`` to size
            each group's fast path from the input
            statistics (``jaxrec.distributed.capacity``). A capacity below a
            group's expected ids per destination is refused (every step would
            take extra exchange rounds); one below the statistics-sized value
            gets a warning in the stats.
        capacity_factor: the fast path's headroom over the expected load (the
            same ``capacity_factor=`` as ``DistributedModelParallel``'s).
        reserved_hbm_fraction: share of each device's memory kept for dense
            parameters and activations (TorchRec's storage reservation, 15%).
        reserved_ddr_fraction: share of each host's memory kept for the
            process, the input pipeline and the system (10%; TorchRec keeps
            none) when tables are cached in host memory.
        proposers: default greedy, uniform and a bounded grid search.
        scale_up_caches: when the best plan caches tables, spend the device
            memory it leaves free on larger caches (load factors doubled, then
            tables whole on the device), best step time per byte first
            (TorchRec's ``EmbeddingOffloadScaleupProposer``; ``scaleup.py``).

    Example:
        >>> planner = EmbeddingShardingPlanner(Topology(world_size=8), optimizer="adam")
        >>> plan = planner.plan(model)
        >>> print(planner.last_stats)
    """

    def __init__(
        self,
        topology: Topology | None = None,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        *,
        optimizer: OptimizerSpec = None,
        capacity: int | Mapping[str, int] | None = None,
        capacity_factor: float = CAPACITY_FACTOR,
        reserved_hbm_fraction: float = 0.15,
        reserved_ddr_fraction: float = 0.1,
        proposers: Sequence[Proposer] | None = None,
        partitioner: GreedyPerfPartitioner | None = None,
        scale_up_caches: bool = False,
    ):
        for name, v in (("hbm", reserved_hbm_fraction), ("ddr", reserved_ddr_fraction)):
            if not 0 <= v < 1:
                raise ValueError(f"reserved_{name}_fraction must be in [0, 1), got {v}")
        check_capacity(capacity)
        self.topology = topology
        self.constraints = dict(constraints or {})
        self.optimizer = resolve_optimizer(optimizer)
        self.capacity = capacity
        self.capacity_factor = capacity_factor
        self.reserved_hbm_fraction = reserved_hbm_fraction
        self.reserved_ddr_fraction = reserved_ddr_fraction
        self.proposers = proposers
        self.partitioner = partitioner or GreedyPerfPartitioner()
        self.scale_up_caches = scale_up_caches
        self.last_placement: Placement | None = None
        self.last_stats: PlanStats | None = None

    def _setup(self, model_or_tables, topology, constraints):
        """Topology, constraints, modules, table infos, cost model, usable HBM per device
        and usable host memory per device (a host's, split over its devices) of one call."""
        topo = topology or self.topology or Topology.from_devices()
        cons = self.constraints if constraints is None else dict(constraints)
        modules = collect_tables(model_or_tables)
        tables = self._table_infos(modules, topo, cons)
        weighted = {t.module for t in tables if t.constraints.is_weighted}
        return (
            topo,
            cons,
            modules,
            tables,
            CostModel(topo, self.capacity, weighted, self.capacity_factor),
            (topo.hbm_cap * (1 - self.reserved_hbm_fraction)),
            topo.ddr_cap * (1 - self.reserved_ddr_fraction) / topo.ranks_per_host,
        )

    def _table_infos(self, modules, topo: Topology, constraints) -> list[TableInfo]:
        infos = []
        known = set()
        for path, tables in modules.items():
            for t in tables:
                key = f"{path}.{t.name}" if path else t.name
                known |= {key, t.name}
                c = constraints.get(key, constraints.get(t.name)) or ParameterConstraints()
                f = t.num_features()
                pf = c.per_feature("pooling_factors", f, 1.0)
                npool = c.per_feature("num_poolings", f, 1.0)
                bs = c.per_feature("batch_sizes", f, topo.batch_size)
                caps = c.per_feature("feature_capacities", f, None)
                caps = tuple(
                    int(cap) if cap is not None else max(1, math.ceil(b * p * q))
                    for cap, b, p, q in zip(caps, bs, pf, npool, strict=True)
                )
                means = tuple(  # what the sharded collection assumes: capacities if unknown
                    float(cap) if c.pooling_factors is None else min(float(b * p * q), float(cap))
                    for cap, b, p, q in zip(caps, bs, pf, npool, strict=True)
                )
                opt = table_optimizer(self.optimizer, t.name)
                infos.append(TableInfo(path, t, c, opt, caps, means))
        unknown = sorted(set(constraints) - known)
        if unknown:
            raise ValueError(f"constraints name unknown tables {unknown}")
        names = [i.key for i in infos]
        dup = sorted({k for k in names if names.count(k) > 1})
        if dup:
            raise ValueError(f"tables {dup} appear twice in one module")
        return infos

    def plan(
        self,
        model_or_tables: ModelOrTables,
        topology: Topology | None = None,
        constraints: Mapping[str, ParameterConstraints] | None = None,
    ) -> ShardingPlan:
        """The best plan found; raises :class:`PlannerError` when nothing fits.

        Args:
            model_or_tables: an ``nnx.Module`` (every ``EmbeddingBagCollection``
                and ``EmbeddingCollection`` in it, keyed by module path), a list of
                ``EmbeddingBagConfig`` / ``EmbeddingConfig`` (module ``""``) or
                ``{module path: [configs]}``.
            topology, constraints: override the constructor's.
        """
        start = time.perf_counter()
        setup = self._setup(model_or_tables, topology, constraints)
        topo, cons, modules, tables, cost, usable, usable_ddr = setup
        options = [enumerate_options(t, cost) for t in tables]
        empty = [t.key for t, o in zip(tables, options, strict=True) if not o]
        if empty:
            raise PlannerError(
                f"tables {empty}: their constraints allow no sharding on {topo.world_size} "
                "devices (check sharding_types, compute_kernels, ranks, min_partition)"
            )
        proposers = self.proposers or (GreedyProposer(), UniformProposer(), GridSearchProposer())
        best: tuple | None = None
        refused: tuple | None = None  # the best plan whose groups expect more than capacity=
        closest: Placement | None = None
        seen: dict[tuple, Placement] = {}
        counts: dict[str, int] = {}

        def search(options, proposers):
            nonlocal best, refused, closest
            for p in proposers:
                p.load(options, usable)
                while (proposal := p.propose()) is not None:
                    key = tuple(id(o) for o in proposal)
                    placed = seen.get(key)
                    if placed is None:
                        placed = self.partitioner.partition(proposal, cost, usable, usable_ddr)
                        seen[key] = placed
                        counts[p.name] = counts.get(p.name, 0) + 1
                    p.feedback(
                        placed.feasible, placed.perf.total, placed.overflow, placed.host_overflow
                    )
                    if placed.feasible:
                        rank = (placed.perf.total, placed.hbm)
                        errors = capacity_errors(placed, cost)
                        if errors and (refused is None or rank < refused[0]):
                            refused = (rank, errors, placed)
                        if not errors and (best is None or rank < best[0]):
                            best = (rank, placed, p.name, proposal)
                    elif closest is None or placed.fullness() < closest.fullness():
                        closest = placed

        search(options, proposers)
        cached = None
        if best is None and refused is None:  # nothing fits in HBM: cache what may be cached
            cached = [
                [o for o in enumerate_options(t, cost, caching=True) if o.cache is not None]
                if not t.constraints.cache_only
                else []
                for t in tables
            ]
            if any(cached):
                options = [o + c for o, c in zip(options, cached, strict=True)]
                search(options, (*proposers, CachingProposer()))
        if best is not None and self.scale_up_caches and best[1].cached:
            proposal, placed = scale_up_caches(
                best[3],
                best[1],
                cost,
                lambda trial: self.partitioner.partition(trial, cost, usable, usable_ddr),
                lambda placed: not capacity_errors(placed, cost),
            )
            if placed is not best[1]:
                best = ((placed.perf.total, placed.hbm), placed, best[2] + "+scale_up", proposal)
        elapsed = time.perf_counter() - start
        if best is None and refused is not None:
            stats = PlanStats(refused[2], cost, self.reserved_hbm_fraction, counts, "", elapsed)
            raise PlannerError(
                f"capacity={self.capacity} is below the expected ids per destination, so every "
                "step would take extra exchange rounds: "
                + "; ".join(refused[1])
                + ". Pass capacity=None (sized from the statistics) or at least the "
                "statistics-sized value",
                stats,
            )
        if best is None:
            stats = closest and PlanStats(
                closest, cost, self.reserved_hbm_fraction, counts, "", elapsed
            )
            host_fits = [p.ddr for p in seen.values() if p.hbm <= usable and p.ddr]
            raise PlannerError(
                infeasible_message(
                    tables,
                    options,
                    closest,
                    cost,
                    usable,
                    cons,
                    any(o.cache for opts in options for o in opts),
                    min(host_fits, default=None),
                    self.reserved_ddr_fraction,
                ),
                stats,
            )
        placed = best[1]
        self.last_placement = placed
        self.last_stats = PlanStats(
            placed, cost, self.reserved_hbm_fraction, counts, best[2], elapsed
        )
        return to_sharding_plan(placed, modules)

    def estimate(
        self,
        plan: ShardingPlan,
        model_or_tables: ModelOrTables,
        topology: Topology | None = None,
        constraints: Mapping[str, ParameterConstraints] | None = None,
    ) -> PlanStats:
        """The same estimates and printed stats for a given (e.g. hand-written) plan.

        Constraints here only supply input statistics (pooling factors,
        capacities); the plan's choices are taken as they are.
        """
        start = time.perf_counter()
        setup = self._setup(model_or_tables, topology, constraints)
        topo, cons, modules, tables, cost, usable, usable_ddr = setup
        options = []
        for t in tables:
            ps = (plan.get_plan_for_module(t.module) or {}).get(t.name)
            if ps is None:
                raise ValueError(f"the plan has no sharding for table {t.key!r}")
            if ps.sharding_type is ShardingType.DATA_PARALLEL:
                shards, placement, ranks = (ShardSpec(0, t.rows, 0, t.dim),), "replicated", ()
            else:
                shards = tuple(
                    ShardSpec(
                        s.shard_offsets[0], s.shard_sizes[0], s.shard_offsets[1], s.shard_sizes[1]
                    )
                    for s in ps.sharding_spec
                )
                placement, ranks = "fixed", tuple(s.placement for s in ps.sharding_spec)
            options.append(
                estimate_option(
                    t, cost, ps.sharding_type, shards, placement, ranks, cache=ps.cache_params
                )
            )
        placed = self.partitioner.partition(options, cost, usable, usable_ddr)
        elapsed = time.perf_counter() - start
        return PlanStats(placed, cost, self.reserved_hbm_fraction, {}, "the given plan", elapsed)


def _parameter_sharding(o: ShardingOption, ranks: Sequence[int]) -> ParameterSharding:
    if o.placement == "replicated":
        return ParameterSharding(
            sharding_type=ShardingType.DATA_PARALLEL,
            compute_kernel=EmbeddingComputeKernel.DENSE,
            ranks=tuple(ranks),
        )
    spec = tuple(
        ShardMetadata(shard_offsets=(s.row0, s.col0), shard_sizes=(s.nrows, s.ncols), placement=r)
        for s, r in zip(o.shards, ranks, strict=True)
    )
    return ParameterSharding(
        sharding_type=o.sharding_type,
        compute_kernel=o.compute_kernel,
        ranks=tuple(ranks),
        sharding_spec=spec,
        cache_params=o.cache,
    )


def to_sharding_plan(placed: Placement, modules: Mapping[str, Sequence]) -> ShardingPlan:
    """The ``ShardingPlan`` of a placement, modules and tables in the input's order."""
    by_key = {o.table.key: (o, r) for o, r in zip(placed.options, placed.shard_ranks, strict=True)}
    plan = {}
    for path, tables in modules.items():
        plan[path] = {
            t.name: _parameter_sharding(*by_key[f"{path}.{t.name}" if path else t.name])
            for t in tables
        }
    return ShardingPlan(plan)


def plan_for_model(
    model: nnx.Module,
    mesh: jax.sharding.Mesh,
    *,
    optimizer: OptimizerSpec = None,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    batch_size: int | None = None,
    capacity: int | Mapping[str, int] | None = None,
    topology: Topology | None = None,
    **planner_kwargs: Unpack[PlannerOptions],
) -> ShardingPlan:
    """Plans every ``EmbeddingBagCollection`` and ``EmbeddingCollection`` of ``model``.

    What ``DistributedModelParallel`` calls when given no plan. The topology
    comes from ``mesh`` (its flat device order is the rank order; with more
    than one mesh axis the last axis is a host, as the plan builders assume),
    unless ``topology`` is given.

    Args:
        model: an ``nnx.Module`` (or a bare collection).
        mesh: the ``jax.sharding.Mesh`` the model will be sharded over.
        optimizer: the sparse optimizer (or ``CombinedOptimizer``) the model
            will train with, to size its state; default row-wise Adagrad.
        constraints: ``{table: ParameterConstraints}``.
        batch_size: samples per device per step (default 512, TorchRec's).
        capacity: the same ``capacity=`` as given to ``DistributedModelParallel``.
        topology: overrides what is read from the mesh.
        **planner_kwargs: other :class:`EmbeddingShardingPlanner` arguments.
    """
    if topology is None:
        devices = list(mesh.devices.flat)
        local = mesh.devices.shape[-1] if mesh.devices.ndim > 1 else None
        extra = {} if batch_size is None else {"batch_size": batch_size}
        topology = Topology.from_devices(devices, local_world_size=local, **extra)
    elif topology.world_size != mesh.size:
        raise ValueError(f"topology.world_size={topology.world_size} but the mesh has {mesh.size}")
    planner = EmbeddingShardingPlanner(
        topology, constraints, optimizer=optimizer, capacity=capacity, **planner_kwargs
    )
    return planner.plan(model)
