"""The planner's cache scale-up (``scale_up_caches=True``, TorchRec's
``EmbeddingOffloadScaleupProposer``): device memory a cached plan leaves free goes to
larger caches, where the misses it saves are the most per byte, within the devices."""

import dataclasses

import pytest
from planner_cases import GiB

import jaxrec as jr
from jaxrec.distributed import CacheParams, ShardingPlan
from jaxrec.distributed.layout import build_layout
from jaxrec.distributed.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Topology,
    ZipfCacheStatistics,
    scaleup,
)
from jaxrec.distributed.types import EmbeddingComputeKernel

UVM = EmbeddingComputeKernel.FUSED_UVM_CACHING
SIZES = [40_000_000, 20_000_000, 10_000_000, 5_000_000, 1_000_000]


def _tables(sizes, dim=64):
    return [
        jr.EmbeddingBagConfig(name=f"t{i}", num_embeddings=n, embedding_dim=dim)
        for i, n in enumerate(sizes)
    ]


def _plan(tables, topo, cons=None, scale=True):
    planner = EmbeddingShardingPlanner(topo, cons, scale_up_caches=scale)
    plan = planner.plan(tables)
    return plan, planner.last_placement, planner.last_stats


def _factors(plan):
    return {
        n: ps.cache_params.load_factor
        for n, ps in plan.plan[""].items()
        if ps.compute_kernel is UVM
    }


def test_spare_device_memory_goes_to_the_cache_within_the_devices():
    # 8.5 GiB: with one host t0's device slot maps take 4 bytes per row of its 20M-row
    # shards and 8 per slot (~0.16 GB a device at a load factor of 0.48); at 8 GiB they
    # leave room for the first rung (0.4) only, not the finer rung past it this checks
    hbm = int(8.5 * GiB)
    tables, topo = _tables(SIZES), Topology(world_size=2, hbm_cap=hbm, batch_size=4096)
    base, placed0, _ = _plan(tables, topo, scale=False)
    plan, placed, stats = _plan(tables, topo)
    before, after = _factors(base), _factors(plan)
    assert before == {"t0": 0.2}  # TorchRec's default load factor, much memory left
    assert set(after) == {"t0"} and after["t0"] > 2 * before["t0"], after
    usable = topo.hbm_cap * 0.85
    assert placed0.hbm < 0.85 * usable and 0.95 * usable < placed.hbm <= usable
    assert placed.perf.total < placed0.perf.total  # fewer misses a step
    for name, ps in plan.plan[""].items():  # only caches changed
        assert ps.sharding_type == base.plan[""][name].sharding_type, name
    assert ShardingPlan.from_json(plan.to_json()) == plan
    build_layout(tables, plan.plan[""], topo.world_size)
    assert "+scale_up" in str(stats)


def test_the_last_rung_is_the_table_whole_where_its_constraints_allow():
    """Room for all of t0 beside t1: forced into a cache (``cache_only``), it climbs to a
    cache of every row; allowed ``fused`` too, its last rung is the table itself."""
    tables = _tables([3_000_000, 1_000_000])
    row = 64 * 4 + 4  # weights and row-wise Adagrad's state
    topo = Topology(world_size=1, hbm_cap=int(4_200_000 * row / 0.85), batch_size=512)
    forced = {"t0": ParameterConstraints(compute_kernels=["fused_uvm_caching"])}
    plan, placed, stats = _plan(tables, topo, forced)
    assert _factors(plan) == {"t0": 1.0}
    option = next(o for o in placed.options if o.table.key.endswith("t0"))
    allowed = dataclasses.replace(option.table, constraints=ParameterConstraints())
    whole = scaleup._rung(dataclasses.replace(option, table=allowed), stats.cost, 1.0)
    assert whole.cache is None and whole.shards == option.shards
    assert scaleup._rung(option, stats.cost, 1.0).cache.load_factor == 1.0
    assert scaleup._target(0.5, None) == 1.0 and scaleup._target(0.2, None) == 0.4
    assert scaleup._target(0.4, 0.8) == pytest.approx(0.5656, abs=1e-4)
    assert scaleup._target(0.4, 0.43) is None  # within 10%: not worth a partition


def test_the_budget_goes_where_misses_drop_most():
    """Two tables alike but for their ids, both cached at 0.1: the uniform one's misses
    fall with every row cached, the Zipf one's hardly (its hot rows are cached already),
    so the memory goes to the uniform one."""
    tables = _tables([30_000_000, 30_000_000])
    stats = {"t0": ZipfCacheStatistics(alpha=1.2), "t1": None}
    cons = {
        n: ParameterConstraints(
            compute_kernels=["fused_uvm_caching"],
            cache_params=CacheParams(load_factor=0.1),
            cache_statistics=s,
        )
        for n, s in stats.items()
    }
    row = 64 * 4 + 4
    topo = Topology(world_size=1, hbm_cap=int(0.5 * 30_000_000 * row / 0.85), batch_size=4096)
    plan, _, _ = _plan(tables, topo, cons)
    f = _factors(plan)
    assert f["t1"] - 0.1 > 4 * (f["t0"] - 0.1) > 0, f  # t0 gets only what is left


def test_alike_tables_share_the_memory():
    """Four alike tables priced as uniform ids (straight curves: every byte gains the
    same anywhere) share the spare memory rung by rung instead of one taking it all."""
    tables = _tables([30_000_000] * 4)
    cons = {t.name: ParameterConstraints(compute_kernels=["fused_uvm_caching"]) for t in tables}
    row = 64 * 4 + 4
    # 1.6 tables' rows (a load factor of 0.4 each) and, with one host, their device slot
    # maps: 4 bytes per row of every table and 8 per slot
    maps = 4 * 30_000_000 * 4 + 1.6 * 30_000_000 * 8
    topo = Topology(
        world_size=1, hbm_cap=int((1.6 * 30_000_000 * row + maps) / 0.85), batch_size=4096
    )
    f = sorted(_factors(_plan(tables, topo, cons)[0]).values())
    assert f[0] > 0.3 and f[-1] / f[0] < 1.5, f  # each raised, within a rung of the others
