"""The planner's lookup-buffer estimate, recounted from the layout jaxrec builds.

The per-array byte model (what XLA's GPU compiler keeps live; see
``jaxrec/distributed/planner/storage.py``) is checked against compiled H100
programs by ``tests/gpu_compile/test_gpu_compile_train_step.py``. Here the
planner's bookkeeping (groups, padding, capacities, column splits, row sums)
is recounted independently from ``build_layout`` for plans of every sharding
type, so it stays right for plans the GPU test does not compile.
"""

import numpy as np
import pytest
from flax import nnx
from planner_cases import padded_table_bytes, recount

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import optim
from jaxrec.distributed import ShardingPlan
from jaxrec.distributed.capacity import fast_path_capacity
from jaxrec.distributed.layout import build_layout
from jaxrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from jaxrec.distributed.planner.perf import comm_bytes

B, CAP = 32, 96  # batch per device; ids per feature per device (mean: B, pooling factor 1)


def _tables():
    return [
        jr.EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=dim, feature_names=feats)
        for n, r, dim, feats in (
            ("tw", 5000, 64, ["a"]),
            ("rw", 9000, 64, ["b", "c"]),
            ("cw", 7000, 64, ["d"]),
            ("dp", 300, 32, ["e"]),
            ("trw", 8000, 64, ["f"]),
            ("tcw", 6000, 64, ["g"]),
            ("gs", 4000, 64, ["h"]),
        )
    ]


def _generators(hosts):
    return {
        "tw": d.table_wise(3),
        "rw": d.row_wise(),
        "cw": d.column_wise([1, 6]),
        "dp": d.data_parallel(),
        "trw": d.table_row_wise(hosts - 1),
        "tcw": d.table_column_wise(0),
        "gs": d.grid_shard(list(range(hosts))),  # one column block per host
    }


@pytest.mark.parametrize("hosts", [1, 2])
@pytest.mark.parametrize(
    ("opt", "calls"),
    [(optim.rowwise_adagrad(0.1), 1), (optim.adam(0.1), 0), (optim.lamb(0.1), 2)],
    ids=["rowwise_adagrad", "adam", "lamb"],
)
def test_buffer_estimate_recounts_the_layout(hosts, opt, calls):
    tables = _tables()
    world, local = 8, 8 // hosts
    shaped = nnx.eval_shape(lambda: jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0)))
    module = d.construct_module_sharding_plan(
        shaped, _generators(hosts), world_size=world, local_size=local
    )
    topo = Topology(world_size=world, local_world_size=local, batch_size=B)
    cons = {
        t.name: ParameterConstraints(
            feature_capacities=[CAP] * len(t.feature_names), pooling_factors=[1.0]
        )
        for t in tables
    }
    stats = EmbeddingShardingPlanner(topo, cons, optimizer=opt).estimate(
        ShardingPlan({"": module}), tables
    )
    layout = build_layout(tables, module, world)
    feats = [f for t in tables for f in t.feature_names]
    want = recount(
        tables, layout, world, B, dict.fromkeys(feats, float(B)), dict.fromkeys(feats, CAP), calls
    )
    assert stats.placement.memory[2] == pytest.approx(want["buffers"], rel=1e-9)
    assert stats.capacities == {"": want["capacities"]}
    comm = comm_bytes(stats.placement, topo)
    assert comm["ids_all_to_all"] == want["ids_all_to_all"]
    assert comm["fwd_output_all_to_all"] == comm["bwd_grad_all_to_all"] == want["blocks"]
    assert comm["row_sum_exchange"] == want["row_sum_bytes"]


def test_row_sum_values_count_only_for_row_wise_optimizers_on_column_splits():
    """Each column shard exchanges one float32 per unique row it received (at most
    ``N * min(C, ids)`` per split table on its rank) with the shards holding the same
    rows: its buffers hold them (in and out) where that exceeds its updated rows.
    Here 20 column-split tables on two ranks with sparse inputs (0.1 ids per bag,
    capacity 96) make the row sums the larger; with Adam, or split by rows, there
    are none."""
    tables = [
        jr.EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=1_000_000, embedding_dim=64, feature_names=[f"f{i}"]
        )
        for i in range(20)
    ]
    topo = Topology(world_size=8, batch_size=B)
    cons = {
        t.name: ParameterConstraints(feature_capacities=[CAP], pooling_factors=[0.1])
        for t in tables
    }
    shaped = nnx.eval_shape(lambda: jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0)))

    def stats(gen, opt):
        module = d.construct_module_sharding_plan(
            shaped, dict.fromkeys([t.name for t in tables], gen), world_size=8
        )
        plan = ShardingPlan({"": module})
        return EmbeddingShardingPlanner(topo, cons, optimizer=opt).estimate(plan, tables)

    rw = stats(d.column_wise([0, 1]), optim.rowwise_adagrad(0.1))
    adam = stats(d.column_wise([0, 1]), optim.adam(0.1))
    (g,) = rw.placement.groups
    c = g.capacity
    assert c == fast_path_capacity(20 * B * 0.1, 20 * CAP) < CAP
    values = 8 * 20 * c  # N * min(C, 96) per table, 20 tables on each of ranks 0 and 1
    assert g.row_sum_values == values and adam.placement.groups[0].row_sum_values == 0
    updated_rows = 8 * c * 32 * 4  # [N * C, 32] float32
    assert 2 * 4 * values > updated_rows
    delta = rw.placement.memory[2] - adam.placement.memory[2]
    assert delta == pytest.approx(2 * 4 * values - updated_rows, rel=1e-9)
    assert comm_bytes(rw.placement, topo)["row_sum_exchange"] == 4 * values  # one peer each
    assert comm_bytes(adam.placement, topo)["row_sum_exchange"] == 0
    opts = (optim.rowwise_adagrad(0.1), optim.adam(0.1))
    by_rows = [stats(d.row_wise(), o).placement.memory[2] for o in opts]
    assert by_rows[0] == by_rows[1]


def test_split_plan_recounts_the_layout():
    """A plan whose tables the partitioner cut by rows (uneven ROW_WISE pieces over some
    ranks): the layout tiles them, and tables, state, buffers and collective bytes
    recount exactly; estimate() of the plan gives the same figures."""
    rng = np.random.default_rng(0)
    tables, cons, means, caps = [], {}, {}, {}
    for i in range(24):
        rows = 2_000_000 if i < 2 else int(rng.integers(100, 200_000))
        t = jr.EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=rows, embedding_dim=32, feature_names=[f"f{i}"]
        )
        pf = float(rng.choice([1.0, 4.0, 30.0]))
        tables.append(t)
        cons[t.name] = ParameterConstraints(
            pooling_factors=[pf], feature_capacities=[64 * 40], is_weighted=i == 5
        )
        means[f"f{i}"], caps[f"f{i}"] = min(B * pf, 64 * 40), 64 * 40
    topo = Topology(world_size=8, batch_size=B, hbm_cap=8 * 2**30)
    planner = EmbeddingShardingPlanner(topo, cons)
    plan = planner.plan(tables)
    placed = planner.last_placement
    module = plan.plan[""]
    cut = [
        n
        for n, p in module.items()
        if p.sharding_type is d.ShardingType.ROW_WISE
        and len({s.shard_sizes[0] for s in p.sharding_spec}) > 1
    ]
    assert {"t0", "t1"} & set(cut) and len(cut) >= 3  # large tables set no padding
    layout = build_layout(tables, module, 8)
    want = recount(tables, layout, 8, B, means, caps, calls=1, weighted=True)
    assert placed.memory[2] == pytest.approx(want["buffers"], rel=1e-9)
    assert planner.last_stats.capacities == {"": want["capacities"]}
    assert comm_bytes(placed, topo)["ids_all_to_all"] == want["ids_all_to_all"]
    weights = padded_table_bytes(plan, tables, 8, lambda nc: 4)  # row-wise Adagrad: 4 B/row
    assert placed.memory[0] + placed.memory[1] == pytest.approx(weights, rel=1e-9)
    rows = [g.rows_per_rank for g in layout.groups]
    total = sum(t.num_embeddings for t in tables)
    assert max(rows) <= 1.03 * total / 8  # rows balanced within the slack
    again = planner.estimate(plan, tables)
    assert again.placement.memory == pytest.approx(placed.memory, rel=1e-12)
    assert again.capacities == planner.last_stats.capacities
