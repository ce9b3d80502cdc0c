"""The sharding planner: fit, capacity, errors, determinism, constraints, balance, speed."""

import json

import numpy as np
import pytest
from planner_cases import GiB, MiB, padded_table_bytes, random_tables, recount

import jaxrec as jr
from jaxrec import optim
from jaxrec.distributed import ShardingPlan, ShardingType, table_wise
from jaxrec.distributed import construct_module_sharding_plan as construct
from jaxrec.distributed.capacity import fast_path_capacity
from jaxrec.distributed.layout import build_layout
from jaxrec.distributed.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlannerError,
    Topology,
    state_bytes_per_row,
)

ST = ShardingType


def _cfg(name, rows, dim, **kw):
    return jr.EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=dim, **kw)


def _plan(tables, topo, **kw):
    planner = EmbeddingShardingPlanner(topo, kw.pop("constraints", None), **kw)
    plan = planner.plan(tables)
    build_layout(tables, plan.plan[""], topo.world_size)  # shards tile every table
    return planner, plan


def test_state_bytes_per_row():
    assert state_bytes_per_row(optim.rowwise_adagrad(0.1), 64) == 4
    assert state_bytes_per_row(optim.adam(0.1), 64) == 8 * 64
    assert state_bytes_per_row(optim.partial_rowwise_adam(0.1), 64) == 4 * 64 + 4
    assert state_bytes_per_row(optim.sgd(0.1), 64) == 0


def test_table_bigger_than_a_device_is_never_whole_on_one():
    topo = Topology(world_size=8, hbm_cap=1 * GiB, batch_size=64)
    big = _cfg("big", 3_000_000, 128)  # 1.43 GiB of weights alone
    tables = [big, _cfg("small", 1000, 128)]
    for opt in ("sgd", "rowwise_adagrad", "adam"):
        _, plan = _plan(tables, topo, optimizer=opt)
        p = plan.plan[""]["big"]
        assert p.sharding_type is not ST.DATA_PARALLEL
        shards = [s for s in p.sharding_spec if s.shard_sizes[0] and s.shard_sizes[1]]
        assert len({s.placement for s in shards}) > 1
        assert all(s.shard_sizes != (big.num_embeddings, big.embedding_dim) for s in shards)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("opt", ["rowwise_adagrad", "adam"])
def test_per_device_memory_never_exceeds_capacity(seed, opt):
    tables = random_tables(seed, 40)
    topo = Topology(world_size=8, hbm_cap=6 * GiB, batch_size=256)
    planner, plan = _plan(tables, topo, optimizer=opt)
    placed = planner.last_placement
    usable = topo.hbm_cap * 0.85
    assert placed.hbm <= usable
    o = optim.adam(0.1) if opt == "adam" else optim.rowwise_adagrad(0.1)
    recomputed = padded_table_bytes(plan, tables, 8, lambda nc: state_bytes_per_row(o, nc))
    assert recomputed == pytest.approx(placed.memory[0] + placed.memory[1], rel=1e-9)
    assert recomputed + placed.memory[2] <= usable


def test_infeasible_error_explains():
    topo = Topology(world_size=4, hbm_cap=2 * GiB, batch_size=64)
    tables = [_cfg("huge", 20_000_000, 64), _cfg("ok", 1000, 64)]
    cons = {
        "huge": ParameterConstraints(sharding_types=["table_wise", "column_wise"], hbm_only=True)
    }
    with pytest.raises(PlannerError) as e:
        EmbeddingShardingPlanner(topo, cons, optimizer="adam").plan(tables)
    msg = str(e.value)
    assert "huge" in msg and "GiB" in msg and "'ok'" not in msg
    assert "best capacity found" in msg
    assert "more devices alone will not help: ['huge']" in msg
    assert "allow row_wise" in msg
    assert "smaller optimizer state" in msg and "row-wise Adagrad" in msg


def test_infeasible_together_names_the_tables_that_did_not_fit():
    topo = Topology(world_size=2, hbm_cap=1 * GiB, batch_size=64)
    tables = [_cfg(f"t{i}", 1_000_000, 64) for i in range(8)]  # 2 GiB with state: 1 GiB/device
    never = {t.name: ParameterConstraints(hbm_only=True) for t in tables}  # no host memory
    with pytest.raises(PlannerError, match="could not place") as e:
        EmbeddingShardingPlanner(topo, never, optimizer="sgd").plan(tables)
    assert "about 3" in str(e.value) or "about 4" in str(e.value)  # devices suggested


def test_deterministic():
    tables = random_tables(3, 60)
    topo = Topology(world_size=16, local_world_size=8, hbm_cap=8 * GiB)
    a = EmbeddingShardingPlanner(topo, optimizer="adam").plan(tables).to_json()
    b = EmbeddingShardingPlanner(topo, optimizer="adam").plan(list(tables)).to_json()
    assert a == b


def test_constraints_respected():
    tables = [
        _cfg("rw", 50_000, 64),
        _cfg("cw", 10_000, 64),
        _cfg("pinned", 10_000, 32),
        _cfg("dp", 100, 16),
        _cfg("dense_only", 100, 16),
        _cfg("free", 200_000, 32),
    ]
    cons = {
        "rw": ParameterConstraints(sharding_types=["row_wise"]),
        "cw": ParameterConstraints(sharding_types=[ST.COLUMN_WISE], min_partition=16),
        "pinned": ParameterConstraints(sharding_types=["table_wise"], ranks=[5, 6]),
        "dp": ParameterConstraints(sharding_types=["data_parallel"]),
        "dense_only": ParameterConstraints(compute_kernels=["dense"]),
    }
    _, plan = _plan(tables, Topology(world_size=8), constraints=cons)
    p = plan.plan[""]
    assert p["rw"].sharding_type is ST.ROW_WISE and p["rw"].ranks == tuple(range(8))
    assert p["cw"].sharding_type is ST.COLUMN_WISE
    assert all(s.shard_sizes[1] >= 16 for s in p["cw"].sharding_spec)
    assert p["pinned"].sharding_type is ST.TABLE_WISE and p["pinned"].ranks[0] in (5, 6)
    assert p["dp"].sharding_type is ST.DATA_PARALLEL
    assert p["dense_only"].sharding_type is ST.DATA_PARALLEL


def test_constraint_errors():
    with pytest.raises(ValueError, match="unknown value 'diagonal'"):
        ParameterConstraints(sharding_types=["diagonal"])
    with pytest.raises(ValueError, match="contradicts"):
        ParameterConstraints(hbm_only=True, compute_kernels=["fused_uvm_caching"])
    with pytest.raises(ValueError, match="unknown tables"):
        EmbeddingShardingPlanner(Topology(world_size=2), {"nope": ParameterConstraints()}).plan(
            [_cfg("a", 10, 8)]
        )
    with pytest.raises(PlannerError, match="allow no sharding"):
        cons = {"a": ParameterConstraints(sharding_types=["grid_shard"])}
        EmbeddingShardingPlanner(Topology(world_size=2), cons).plan([_cfg("a", 10, 8)])


def test_multi_host_types_and_json_round_trip():
    tables = random_tables(4, 12)
    cons = {
        "t0": ParameterConstraints(sharding_types=["table_row_wise"]),
        "t1": ParameterConstraints(sharding_types=["grid_shard"], min_partition=8),
        "t2": ParameterConstraints(sharding_types=["table_column_wise"], min_partition=8),
    }
    topo = Topology(world_size=16, local_world_size=4, hbm_cap=16 * GiB)
    _, plan = _plan(tables, topo, constraints=cons)
    p = plan.plan[""]
    assert p["t0"].sharding_type is ST.TABLE_ROW_WISE
    assert len({r // 4 for r in p["t0"].ranks}) == 1
    assert p["t1"].sharding_type is ST.GRID_SHARD
    assert p["t2"].sharding_type is ST.TABLE_COLUMN_WISE
    assert len({r // 4 for r in p["t2"].ranks}) == 1
    again = ShardingPlan.from_json(plan.to_json())
    assert again == plan
    assert json.loads(again.to_json()) == json.loads(plan.to_json())


def test_symmetric_workload_is_balanced():
    tables = [_cfg(f"t{i}", 100_000, 64, feature_names=[f"f{i}"]) for i in range(32)]
    cons = {t.name: ParameterConstraints(pooling_factors=[10.0]) for t in tables}
    planner, _ = _plan(tables, Topology(world_size=8), constraints=cons)
    own = np.asarray(planner.last_placement.own_perf)
    assert own.max() / own.mean() <= 1.1
    mem = np.asarray(planner.last_placement.own_memory)
    assert mem.max() / mem.mean() <= 1.1


def test_skewed_workload_beats_table_wise_round_robin():
    rng = np.random.default_rng(0)
    tables, cons = [], {}
    for i in range(24):
        big = i % 6 == 0
        tables.append(_cfg(f"t{i}", 2_000_000 if big else 20_000, 64))
        cons[f"t{i}"] = ParameterConstraints(
            pooling_factors=[100.0 if big else float(rng.integers(1, 3))]
        )
    topo = Topology(world_size=8, hbm_cap=32 * GiB)
    planner, plan = _plan(tables, topo, constraints=cons)
    ebc_like = type("M", (), {"table_configs": tables})
    rr = construct(
        ebc_like, {t.name: table_wise(i % 8) for i, t in enumerate(tables)}, world_size=8
    )
    rr_stats = planner.estimate(ShardingPlan({"": rr}), tables)
    ours = planner.last_placement
    assert ours.perf.total < rr_stats.placement.perf.total
    assert ours.hbm <= rr_stats.placement.hbm
    assert "the given plan" in str(rr_stats)


def test_statistics_sized_buffers_beat_the_worst_case():
    """Default id buffers are sized from the expected load (pooling factors), a little
    above it; capacity= at least the natural payload gives the worst-case buffers."""
    tables = [_cfg("a", 1_000_000, 64), _cfg("b", 1_000_000, 64)]
    cons = {
        t: ParameterConstraints(
            sharding_types=["row_wise"], pooling_factors=[50.0], feature_capacities=[1024 * 80]
        )
        for t in ("a", "b")
    }
    topo = Topology(world_size=8, batch_size=1024)
    sized, _ = _plan(tables, topo, constraints=cons)
    worst, _ = _plan(tables, topo, constraints=cons, capacity=10**9)
    (g,) = sized.last_placement.groups
    assert g.expected_ids == pytest.approx(2 * 1024 * 50 / 8)  # two slots per rank
    assert g.natural_ids == 2 * 1024 * 80
    assert g.capacity == fast_path_capacity(g.expected_ids, g.natural_ids) < g.natural_ids
    assert worst.last_placement.groups[0].capacity == g.natural_ids
    assert sized.last_placement.memory[2] < worst.last_placement.memory[2] / 5
    assert sized.last_placement.perf.total < worst.last_placement.perf.total
    assert sized.last_stats.capacities == {"": {"fp32_c64": g.capacity}}
    assert f"| {g.capacity} |" in str(sized.last_stats)  # printed next to the expected load


def test_capacity_below_the_expected_load_is_refused_and_below_the_sized_one_warned():
    tables = [_cfg("a", 1_000_000, 64)]
    cons = {"a": ParameterConstraints(sharding_types=["row_wise"], pooling_factors=[50.0])}
    topo = Topology(world_size=8, batch_size=1024)
    expected = 1024 * 50 / 8
    sized = fast_path_capacity(expected, 1024 * 50)
    with pytest.raises(PlannerError) as e:
        _plan(tables, topo, constraints=cons, capacity=int(expected) - 1)
    msg = str(e.value)
    assert f"capacity={int(expected) - 1}" in msg and "fp32_c64" in msg
    assert f"expects {expected:.0f}" in msg and f"statistics: {sized}" in msg
    planner, _ = _plan(tables, topo, constraints=cons, capacity=int(expected) + 10)
    (w,) = planner.last_stats.warnings()
    assert "extra exchange rounds" in w and f"statistics: {sized}" in w
    assert "WARNING" in str(planner.last_stats)
    planner, _ = _plan(tables, topo, constraints=cons, capacity=sized)
    assert planner.last_stats.warnings() == []
    with pytest.raises(PlannerError, match="fp32_c64 expects"):  # {group name: capacity}
        _plan(tables, topo, constraints=cons, capacity={"fp32_c64": int(expected) - 1})
    planner, _ = _plan(tables, topo, constraints=cons, capacity={"fp16_c64": 1})  # not here
    assert planner.last_stats.capacities == {"": {"fp32_c64": sized}}
    with pytest.raises(ValueError, match="capacity must be"):
        EmbeddingShardingPlanner(topo, capacity={"fp32_c64": 0})


def test_planning_200_tables_on_32_devices():
    """A production-shaped plan completes with its stats. Its time is measured by
    bench/planner.py, not bounded here (a wall-clock bound failed on a loaded machine)."""
    tables = random_tables(5, 200)
    topo = Topology(world_size=32, local_world_size=8, hbm_cap=80 * GiB)
    planner, _ = _plan(tables, topo)
    text = str(planner.last_stats)
    assert "step estimate" in text and "balance" in text


def test_topology():
    t = Topology(world_size=16, local_world_size=8)
    assert t.num_hosts == 2 and t.hbm_cap == 32 * GiB and t.batch_size == 512
    with pytest.raises(ValueError, match="must divide"):
        Topology(world_size=8, local_world_size=3)
    d = Topology.from_devices(batch_size=128)
    assert d.world_size == 8 and d.compute_device == "cpu" and d.batch_size == 128
    assert Topology.from_devices(hbm_cap=MiB).hbm_cap == MiB


# Per-device collective operand bytes of bench/sharded.py's train step (T=8 tables of
# 100000 x 64, B=512, L=10, 8 devices; "2x4" = 2 hosts), from
# bench/results/sharded_cpu8_2026-11-25.jsonl, where they equal the compiled HLO's:
# ids (rows and per-bag counts), partial blocks (forward, and their gradients
# backward), data-parallel row gradients and the row sums column shards send peers.
BENCH_BYTES = {
    "table_wise": (180224, 1048576, 0, 0),
    "row_wise": (318176, 8388608, 0, 0),
    "column_wise": (360448, 1048576, 0, 327680),
    "data_parallel": (0, 0, 10690560, 0),
    "table_row_wise": (252640, 4194304, 0, 0),
    "table_column_wise": (720896, 1048576, 0, 1966080),
    "grid_shard": (501248, 4194304, 0, 1310720),
}


@pytest.mark.parametrize("kind", sorted(BENCH_BYTES))
def test_comm_estimate_matches_the_exchange(kind):
    """Every stage as in the compiled HLO (bench/sharded.py's recorded bytes), and as an
    independent recount from the layout (``planner_cases.recount``)."""
    from jaxrec import distributed as d
    from jaxrec.distributed.planner.perf import comm_bytes

    gen = {
        "table_wise": lambda t: d.table_wise(t % 8),
        "row_wise": lambda t: d.row_wise(),
        "column_wise": lambda t: d.column_wise([2 * t % 8, (2 * t + 1) % 8]),
        "data_parallel": lambda t: d.data_parallel(),
        "table_row_wise": lambda t: d.table_row_wise(t % 2),
        "table_column_wise": lambda t: d.table_column_wise(t % 2),
        "grid_shard": lambda t: d.grid_shard([0, 1]),
    }[kind]
    tables = [_cfg(f"t{t}", 100_000, 64, feature_names=[f"f{t}"]) for t in range(8)]
    hosts = 2 if kind in ("table_row_wise", "table_column_wise", "grid_shard") else 1
    topo = Topology(world_size=8, local_world_size=8 // hosts, batch_size=512)
    ebc_like = type("M", (), {"table_configs": tables})
    plan = construct(
        ebc_like, {f"t{t}": gen(t) for t in range(8)}, world_size=8, local_size=8 // hosts
    )
    cons = {
        t.name: ParameterConstraints(feature_capacities=[512 * 10], pooling_factors=[10.0])
        for t in tables
    }
    stats = EmbeddingShardingPlanner(topo, cons).estimate(ShardingPlan({"": plan}), tables)
    got = comm_bytes(stats.placement, topo)
    feats = [f"f{t}" for t in range(8)]
    want = recount(
        tables,
        build_layout(tables, plan, 8),
        8,
        512,
        dict.fromkeys(feats, 5120.0),
        dict.fromkeys(feats, 5120),
        calls=1,
    )
    ids, blocks, gather, row_sums = BENCH_BYTES[kind]
    assert got == {
        "ids_all_to_all": ids,
        "fwd_output_all_to_all": blocks,
        "bwd_grad_all_to_all": blocks,
        "dp_row_grad_all_gather": gather,
        "row_sum_exchange": row_sums,
    }
    assert (want["ids_all_to_all"], want["row_sum_bytes"]) == (ids, row_sums)
    if kind == "row_wise":  # 8 slots per rank, 5120 / 8 ids each: fast_path_capacity's example
        assert stats.capacities == {"": {"fp32_c64": 5847}}
        assert got["ids_all_to_all"] == 8 * (5847 + 8 * 512) * 4  # rows + per-bag counts


def test_width_groups_pad_per_collection():
    """Two collections pad separately: {path: tables} plans both, keyed by path."""
    a = [_cfg("x", 1_000_000, 64), _cfg("y", 10, 64)]
    b = [_cfg("x", 1_000, 64)]  # the same table name in another collection
    planner = EmbeddingShardingPlanner(Topology(world_size=2))
    plan = planner.plan({"tower_a.ebc": a, "tower_b.ebc": b})
    assert set(plan.plan) == {"tower_a.ebc", "tower_b.ebc"}
    assert set(plan.plan["tower_b.ebc"]) == {"x"}
    keys = {g.key[0] for g in planner.last_placement.groups}
    assert keys <= {"tower_a.ebc", "tower_b.ebc"}
    assert "tower_b.ebc.x" in str(planner.last_stats)


def test_vectorised_capacities_equal_the_collections_formula():
    """The partitioner prices candidates with an array copy of fast_path_capacity."""
    from jaxrec.distributed.planner.cost_model import fast_path_capacities

    rng = np.random.default_rng(0)
    expected = np.concatenate([[0.0, 0.5, 1.0, 5120.0], rng.uniform(0, 1e6, 500)])
    natural = np.concatenate([[0, 1, 7, 40960], rng.integers(0, 2_000_000, 500)])
    for factor in (1.0, 1.1, 1.7):
        got = fast_path_capacities(expected, natural, factor=factor)
        pairs = zip(expected, natural, strict=True)
        want = [fast_path_capacity(float(e), int(n), factor) for e, n in pairs]
        assert got.tolist() == want
    assert fast_path_capacities(expected, natural, capacity=64).tolist() == [
        max(1, min(64, int(n))) for n in natural
    ]
