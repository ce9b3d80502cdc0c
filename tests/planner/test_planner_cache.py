"""The planner's host-memory tier (fused_uvm_caching): constraints, miss rates, storage and
perf of cached shards against hand counts, caching only what does not fit, and the goal
model (tables 4x the devices' memory)."""

import math

import numpy as np
import pytest
from planner_cases import GiB, random_tables

import jaxrec as jr
from jaxrec.distributed import CacheParams, ShardingPlan, ShardingType
from jaxrec.distributed.layout import build_layout
from jaxrec.distributed.planner import (
    EmbeddingShardingPlanner,
    MissRateCurve,
    ParameterConstraints,
    PlannerError,
    Topology,
    UniformCacheStatistics,
    ZipfCacheStatistics,
)
from jaxrec.distributed.planner.cache_stats import generalized_harmonic
from jaxrec.distributed.planner.storage import sharded_buffer_bytes
from jaxrec.distributed.types import EmbeddingComputeKernel

ST = ShardingType
UVM = EmbeddingComputeKernel.FUSED_UVM_CACHING

# MLPerf DLRM's 26 Criteo Terabyte tables (ids capped at 40M), scaled up below.
CRITEO_TB = [
    39884406,
    39043,
    17289,
    7420,
    20263,
    3,
    7120,
    1543,
    63,
    38532951,
    2953546,
    403346,
    10,
    2208,
    11938,
    155,
    4,
    976,
    14,
    39979771,
    25641295,
    39664984,
    585935,
    12972,
    108,
    36,
]
ROW = 128 * 4 + 4  # dim 128 fp32 and one row-wise Adagrad float


def _cfg(name, rows, dim, **kw):
    return jr.EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=dim, **kw)


def test_constraints_kernels():
    c = ParameterConstraints(compute_kernels=["fused_uvm_caching"])
    assert c.cache_only and c.allows(ST.ROW_WISE) and not c.allows(ST.DATA_PARALLEL)
    assert ParameterConstraints().kernels(ST.TABLE_WISE) == (EmbeddingComputeKernel.FUSED, UVM)
    never = ParameterConstraints(hbm_only=True)
    assert never.kernels(ST.ROW_WISE) == (EmbeddingComputeKernel.FUSED,)
    assert not never.allows_caching and ParameterConstraints().allows_caching
    assert not ParameterConstraints(compute_kernels=["fused"]).allows_caching
    with pytest.raises(ValueError, match="hbm_only=True"):
        ParameterConstraints(hbm_only=True, compute_kernels=["fused_uvm_caching"])
    with pytest.raises(TypeError, match="CacheParams"):
        ParameterConstraints(cache_params={"load_factor": 0.1})


@pytest.mark.parametrize("alpha", [0.8, 1.0, 1.05, 1.2])
def test_zipf_miss_rate_matches_a_direct_sum(alpha):
    rows = 300_000
    p = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    cum = np.cumsum(p) / p.sum()
    zipf = ZipfCacheStatistics(alpha)
    for lf in (0.001, 0.01, 0.1, 0.5, 1.0):
        k = int(lf * rows)
        assert zipf.expected_miss_rate(lf, rows) == pytest.approx(1 - cum[k - 1], abs=1e-9)
        assert (
            zipf.expected_miss_rate(lf, rows)
            < UniformCacheStatistics().expected_miss_rate(lf, rows)
            or lf == 1.0
        )
    assert generalized_harmonic(2e6, alpha) == pytest.approx(
        np.sum(np.arange(1, 2_000_001, dtype=np.float64) ** -alpha), rel=1e-12
    )


def test_miss_rate_curve():
    c = MissRateCurve(load_factors=[0.1, 0.2], miss_rates=[0.3, 0.1])
    assert c.expected_miss_rate(0.0, 10) == 1.0 and c.expected_miss_rate(1.0, 10) == 0.0
    assert c.expected_miss_rate(0.15, 10) == pytest.approx(0.2)
    assert c.expected_miss_rate(0.6, 10) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="increase"):
        MissRateCurve(load_factors=[0.2, 0.1], miss_rates=[0.3, 0.1])


def test_a_model_that_fits_is_never_cached():
    """The same plan as with caching forbidden, bit for bit."""
    tables = random_tables(0, 40)
    topo = Topology(world_size=8, hbm_cap=6 * GiB, batch_size=256)
    free = EmbeddingShardingPlanner(topo, optimizer="adam").plan(tables)
    never = {t.name: ParameterConstraints(hbm_only=True) for t in tables}
    pinned = EmbeddingShardingPlanner(topo, never, optimizer="adam").plan(tables)
    assert free.to_json() == pinned.to_json()
    assert all(ps.compute_kernel is not UVM for ps in free.plan[""].values())


def test_caches_only_the_tables_that_do_not_fit():
    tables = random_tables(4, 30)
    topo = Topology(world_size=4, hbm_cap=2 * GiB)
    never = {t.name: ParameterConstraints(hbm_only=True) for t in tables}
    with pytest.raises(PlannerError, match="allow host memory") as e:
        EmbeddingShardingPlanner(topo, never, optimizer="sgd").plan(tables)
    assert "even with tables cached" not in str(e.value)
    planner = EmbeddingShardingPlanner(topo, optimizer="sgd")
    plan = planner.plan(tables)
    p = plan.plan[""]
    cached = [n for n, ps in p.items() if ps.compute_kernel is UVM]
    assert 0 < len(cached) < len(tables) // 4
    for n in cached:
        assert p[n].cache_params == CacheParams() and p[n].sharding_type is not ST.DATA_PARALLEL
    build_layout(tables, p, topo.world_size)  # the shards tile the logical tables
    assert ShardingPlan.from_json(plan.to_json()) == plan
    placed = planner.last_placement
    assert placed.hbm <= topo.hbm_cap * 0.85 and 0 < placed.ddr <= placed.usable_ddr
    again = planner.estimate(plan, tables)  # a given plan is priced alike
    assert again.placement.hbm == pytest.approx(placed.hbm)
    assert again.placement.ddr == pytest.approx(placed.ddr)
    text = str(planner.last_stats)
    assert "host memory (cached tables" in text and "cache misses" in text
    assert "cached 0.2" in text and "_cached |" in text


def test_cached_table_priced_by_hand():
    """One row-wise cached table: device cache, host bytes and miss time recounted."""
    rows, dim, lf, n, batch = 1000, 64, 0.25, 4, 512
    t = _cfg("t", rows, dim)
    topo = Topology(world_size=n, batch_size=batch, ddr_cap=64 * 2**20)

    def plan(stats=None):
        cons = ParameterConstraints(
            sharding_types=["row_wise"],
            compute_kernels=["fused_uvm_caching"],
            cache_params=CacheParams(load_factor=lf),
            cache_statistics=stats,
        )
        planner = EmbeddingShardingPlanner(topo, {"t": cons}, optimizer="rowwise_adagrad")
        ps = planner.plan([t]).plan[""]["t"]
        assert ps.compute_kernel is UVM and ps.cache_params.load_factor == lf
        assert [s.shard_sizes for s in ps.sharding_spec] == [(rows // n, dim)] * n
        return planner.last_placement

    placed = plan()  # fits in HBM, cached as the constraints ask
    row = dim * 4 + 4
    slots = math.ceil(lf * rows / n)  # 63 per rank
    assert placed.memory[0] == slots * dim * 4 and placed.memory[1] == slots * 4
    # one host: the slot maps are on the device (jaxrec.cache.sets), host memory holds
    # the rows and their optimizer state only
    assert placed.ddr == rows / n * row
    fetched = (1 - lf) * batch * n / n  # every device's ids, a quarter of them per rank
    miss = 2 * fetched * row * (1 / topo.hbm_to_ddr_mem_bw + 1 / topo.hbm_mem_bw)
    # and the plan of the n * C ids a rank receives reads each id's set (32 int32 rows)
    # and writes its slot (3 int32) in device memory, whatever the miss rate
    (group,) = placed.groups
    planned = n * group.capacity * (32 * 4 + 3 * 4) / topo.hbm_mem_bw
    assert placed.perf.prefetch_compute == pytest.approx(miss + planned, rel=1e-12)
    p = np.arange(1, rows + 1, dtype=np.float64) ** -1.05
    zipf_miss = 1 - p[: int(lf * rows)].sum() / p.sum()
    skewed = plan(ZipfCacheStatistics(1.05))
    assert skewed.groups[0].capacity == group.capacity
    assert skewed.perf.prefetch_compute == pytest.approx(
        miss * zipf_miss / (1 - lf) + planned, rel=1e-9
    )
    small = Topology(world_size=n, batch_size=batch, ddr_cap=100_000)
    with pytest.raises(PlannerError, match="host memory per host") as e:
        cons = {"t": ParameterConstraints(compute_kernels=["fused_uvm_caching"])}
        EmbeddingShardingPlanner(small, cons).plan([t])
    assert "ddr_cap" in str(e.value)


def test_slot_maps_priced_on_one_host_and_on_two():
    """The same cached table on one host (slot maps on the device: 8 bytes a slot, 4 a
    row, and the plan's temporaries per id received; host memory holds the rows only)
    and on two hosts (the maps in host memory: 4 bytes a row and 16 a slot there, none
    on the device), recounted by hand."""
    rows, dim, lf, n, batch = 1000, 64, 0.25, 4, 512
    t = _cfg("t", rows, dim)
    cons = {
        "t": ParameterConstraints(
            sharding_types=["row_wise"],
            compute_kernels=["fused_uvm_caching"],
            cache_params=CacheParams(load_factor=lf),
        )
    }
    row = dim * 4 + 4  # columns and one row-wise Adagrad float
    shard, slots = rows // n, math.ceil(lf * rows / n)
    placed = {}
    for hosts in (1, 2):
        topo = Topology(
            world_size=n, local_world_size=n // hosts, batch_size=batch, ddr_cap=64 * 2**20
        )
        assert topo.num_hosts == hosts
        planner = EmbeddingShardingPlanner(topo, cons, optimizer="rowwise_adagrad")
        ps = planner.plan([t]).plan[""]["t"]
        assert ps.compute_kernel is UVM
        assert [s.shard_sizes for s in ps.sharding_spec] == [(shard, dim)] * n
        p = placed[hosts] = planner.last_placement
        (g,) = p.groups
        ids = n * g.capacity  # the ids a rank receives (and its slot map plans) a step
        lookup = sharded_buffer_bytes(topo, dim, g.capacity, g.slots)  # as uncached
        staging = 2 * ids * row  # the rows fetched and evicted
        assert p.memory[0] == slots * dim * 4 and p.memory[1] == slots * 4
        fetched = (1 - lf) * batch  # every device's ids, a quarter of them per rank
        moved = 2 * fetched * row * (1 / topo.hbm_to_ddr_mem_bw + 1 / topo.hbm_mem_bw)
        if hosts == 1:
            maps = shard * 4 + slots * 8  # LFU count per row; row and last use per slot
            plan_tmp = ids * (32 * (4 + 1) + 12)  # each id's set compared, and a sort
            assert p.memory[2] == lookup + staging + maps + plan_tmp
            assert p.ddr == shard * row
            reads = ids * (32 * 4 + 12)  # each id's set read, its slot written
            assert p.perf.prefetch_compute == pytest.approx(
                moved + reads / topo.hbm_mem_bw, rel=1e-12
            )
        else:
            assert p.memory[2] == lookup + staging  # no slot map on the device
            assert p.ddr == shard * (row + 4) + slots * 16  # row -> slot; slot metadata
            assert p.perf.prefetch_compute == pytest.approx(moved, rel=1e-12)
    # the same shards and capacities, so the device difference is the maps and the plan
    assert placed[1].groups[0].capacity == placed[2].groups[0].capacity
    ids = n * placed[1].groups[0].capacity
    assert placed[1].memory[2] - placed[2].memory[2] == (
        shard * 4 + slots * 8 + ids * (32 * (4 + 1) + 12)
    )
    assert placed[2].ddr - placed[1].ddr == shard * 4 + slots * 16


def _criteo(times: float, hbm: float) -> list:
    """The Criteo TB tables scaled so that with row-wise Adagrad state they hold at least
    ``times * hbm`` bytes."""
    scale = math.ceil(times * hbm / (sum(CRITEO_TB) * ROW))
    return [
        _cfg(f"t{i}", r * scale, 128, feature_names=(f"f{i}",)) for i, r in enumerate(CRITEO_TB)
    ]


def _by_hand(plan: ShardingPlan, tables, n: int, hosts: int) -> tuple[float, float, float]:
    """(table bytes in HBM, host bytes, slot map bytes in HBM) per device, recounted from
    the plan: per (kernel, columns) group every rank holds the fullest rank's rows (cache
    slots for a cached group, ``ceil(load_factor * shard rows)`` per shard), each with its
    columns and one row-wise Adagrad float; host memory holds a cached group's padded
    rows. Its slot maps: with one host on the device, 4 bytes per row and 8 per slot; with
    several in host memory, a 4-byte slot index per row and 16 bytes per slot."""
    rows: dict = {}
    slots: dict = {}
    for ps in plan.plan[""].values():
        for s in ps.sharding_spec:
            nr, nc = s.shard_sizes
            key = (ps.compute_kernel, nc)
            rows.setdefault(key, np.zeros(n, np.int64))[s.placement] += nr
            if ps.compute_kernel is UVM:
                lf = ps.cache_params.load_factor
                slots.setdefault(key, np.zeros(n, np.int64))[s.placement] += math.ceil(lf * nr)
    hbm = host = maps = 0.0
    for (kernel, nc), r in rows.items():
        row = nc * 4 + 4
        if kernel is UVM:
            s = slots[(kernel, nc)].max()
            hbm += s * row
            if hosts == 1:
                host += r.max() * row
                maps += r.max() * 4 + s * 8
            else:
                host += r.max() * (row + 4) + s * 16
        else:
            hbm += r.max() * row
    return hbm, host, maps


@pytest.mark.parametrize(
    ("hosts", "times", "lf"),
    [(2, 4, 0.2), (1, 3, 0.1)],
    ids=["4x-one-host-hbm-on-two-hosts", "3x-on-one-host"],
)
def test_goal_tables_several_times_the_device_memory(hosts, times, lf):
    """8 x 80 GiB per host with 2 TiB of host memory each; tables ``times`` x the HBM of
    one host (26 Criteo-like tables, dim 128, row-wise Adagrad)."""
    n = 8 * hosts
    topo = Topology(
        world_size=n, local_world_size=8, hbm_cap=80 * GiB, ddr_cap=2048 * GiB, batch_size=4096
    )
    tables = _criteo(times, 8 * 80 * GiB)
    total = sum(t.num_embeddings for t in tables) * ROW
    assert total >= times * 8 * 80 * GiB
    cons = {t.name: ParameterConstraints(cache_params=CacheParams(load_factor=lf)) for t in tables}
    planner = EmbeddingShardingPlanner(topo, cons, optimizer="rowwise_adagrad")
    plan = planner.plan(tables)
    placed = planner.last_placement
    p = plan.plan[""]
    assert any(ps.compute_kernel is UVM for ps in p.values())
    assert any(ps.compute_kernel is EmbeddingComputeKernel.FUSED for ps in p.values())
    for t in tables:  # every row of every table is placed exactly once
        cells = sum(s.shard_sizes[0] * s.shard_sizes[1] for s in p[t.name].sharding_spec)
        assert cells == t.num_embeddings * t.embedding_dim
    hbm, host, maps = _by_hand(plan, tables, n, hosts)
    assert placed.memory[0] + placed.memory[1] == pytest.approx(hbm, rel=1e-12)
    assert placed.ddr == pytest.approx(host, rel=1e-12)
    assert (maps > 0) == (hosts == 1) and maps < placed.memory[2]  # counted as buffers
    assert hbm + placed.memory[2] <= 0.85 * 80 * GiB  # buffers: the planner's own count
    assert 8 * host <= 0.9 * 2048 * GiB  # per host
    fused = sum(
        s.shard_sizes[0] * (s.shard_sizes[1] * 4 + 4)
        for ps in p.values()
        if ps.compute_kernel is not UVM
        for s in ps.sharding_spec
    )
    assert fused <= n * 0.85 * 80 * GiB < total  # the rest lives in host memory


def test_goal_four_times_one_hosts_memory_is_refused_naming_host_memory():
    """4 x (8 x 80 GiB) of tables cannot fit one host with 2 TiB: its devices and host
    memory together hold less, whatever the load factor.

    The caches are asked at a load factor of 0.15: at the default 0.2 every table's cache
    (20% of ~2.6 TiB over 8 devices) with its device slot maps (4 bytes per row, 8 per
    slot: ~3.5 GiB a device with one host) leaves no plan that fits the devices, and the
    message names host memory (``ddr_cap >=``) only from plans that do."""
    topo = Topology(world_size=8, hbm_cap=80 * GiB, ddr_cap=2048 * GiB, batch_size=4096)
    tables = _criteo(4, 8 * 80 * GiB)
    cons = {
        t.name: ParameterConstraints(cache_params=CacheParams(load_factor=0.15)) for t in tables
    }
    with pytest.raises(PlannerError) as e:
        EmbeddingShardingPlanner(topo, cons, optimizer="rowwise_adagrad").plan(tables)
    msg = str(e.value)
    assert "even with tables cached in host memory" in msg and "1843.20 GiB usable" in msg
    assert "whatever the cache load factor" in msg
    assert "more host memory" in msg and "ddr_cap >=" in msg and "more hosts: about 2" in msg
    assert e.value.stats is not None and e.value.stats.placement.cached


@pytest.mark.parametrize("batch, cacheable", [(4096, True), (65536, False)])
def test_a_table_one_step_fills_is_not_cached(batch, cacheable):
    """``small`` (260k rows) must be cached for the plan to fit. At a load factor of 0.2
    its cache holds 52k rows: enough for the ~4k distinct rows of 4096 uniform ids a
    step, not for the ~58k of 65536 (jaxrec's cache needs each batch's rows in slots),
    so the planner then finds no plan rather than one whose first batch fails.

    260k rows, not fewer: a cache's device bytes beside its slots grow with the ids a
    step (rows staged 2 x 260 bytes and the slot map's plan 172 bytes per id) and the
    table (4 bytes per row); at 65536 ids a 200k-row table's cache would need more
    device memory than the table itself (below ~225k rows), and no cap then separates
    them."""
    tables = [_cfg("big", 4_000_000, 64), _cfg("small", 260_000, 64)]
    only = {
        "big": ParameterConstraints(hbm_only=True),
        "small": ParameterConstraints(sharding_types=["table_wise"]),
    }

    def used(kernels):
        cons = dict(
            only, small=ParameterConstraints(sharding_types=["table_wise"], compute_kernels=kernels)
        )
        planner = EmbeddingShardingPlanner(Topology(world_size=1, batch_size=batch), cons)
        planner.plan(tables)
        return planner.last_placement.hbm

    fused, cached = used(["fused"]), used(["fused_uvm_caching"])
    assert cached < fused  # 260k rows against a cache of 52k (and its buffers)
    topo = Topology(world_size=1, batch_size=batch, hbm_cap=int((fused + cached) / 2 / 0.85))
    planner = EmbeddingShardingPlanner(topo, only)
    if not cacheable:
        with pytest.raises(PlannerError):
            planner.plan(tables)
        return
    p = planner.plan(tables).plan[""]
    assert p["small"].compute_kernel is UVM and p["big"].compute_kernel is not UVM
