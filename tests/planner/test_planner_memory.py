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

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import optim
from jaxrec.distributed import ShardingPlan
from jaxrec.distributed.layout import build_layout
from jaxrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

B, CAP = 32, 96  # batch per device; ids per feature per device


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
        "gs": d.grid_shard([0, hosts - 1]),
    }


def expected_buffers(tables, layout, world, row_sum_calls) -> float:
    """Bytes per device, from the arrays the sharded step builds (numpy, by hand)."""
    conf = {t.name: t for t in tables}
    total = 0.0
    for g in layout.groups:
        # per-destination capacity: the fullest rank's slot payload (natural_capacity)
        cap = max(sum(CAP for _ in slots) for slots in g.slots)
        ids = world * cap  # ids this device receives
        split = sorted({s[0] for r in g.shards for s in r if g.ncols < conf[s[0]].embedding_dim})
        id_bytes = 2 * 12 + 8 + 8  # send+recv (rows, segments, scales), sort pairs, CUB scratch
        summed = ids * g.ncols * 4  # de-duplicated row gradients, float32
        blocks = 2 * world * g.max_slots * B * g.ncols * 4  # one all_to_all's send + receive
        total += ids * id_bytes + summed + blocks
        if split:  # then the updated rows, or before them the row-sum vectors (in + out)
            row_sums = sum(row_sum_calls * 2 * 4 * conf[t].num_embeddings for t in split)
            total += max(summed, row_sums)
    for name in layout.replicated:
        t = conf[name]
        n = world * CAP * len(t.feature_names)
        total += n * (3 * t.embedding_dim * 4 + 4 + 1 + 8 + 8)  # 3 gathered float32 copies
    return total


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
    cons = {t.name: ParameterConstraints(feature_capacities=[CAP] * len(t.feature_names))
            for t in tables}  # fmt: skip
    stats = EmbeddingShardingPlanner(topo, cons, optimizer=opt).estimate(
        ShardingPlan({"": module}), tables
    )
    layout = build_layout(tables, module, world)
    want = expected_buffers(tables, layout, world, calls)
    assert stats.placement.memory[2] == pytest.approx(want, rel=1e-9)


def test_row_sum_vectors_count_only_for_row_wise_optimizers_on_column_splits():
    """A column-split table with row-wise Adagrad costs its row-sum vector (2 x 4 B per
    logical row) on every device where that exceeds its updated rows; split by rows,
    or with Adam, it costs none."""
    t = jr.EmbeddingBagConfig(name="t", num_embeddings=1_000_000, embedding_dim=64,
                              feature_names=["f"])  # fmt: skip
    topo = Topology(world_size=8, batch_size=B)
    cons = {"t": ParameterConstraints(feature_capacities=[CAP])}
    shaped = nnx.eval_shape(lambda: jr.EmbeddingBagCollection([t], rngs=nnx.Rngs(0)))

    def buffers(gen, opt):
        module = d.construct_module_sharding_plan(shaped, {"t": gen}, world_size=8)
        plan = ShardingPlan({"": module})
        return EmbeddingShardingPlanner(topo, cons, optimizer=opt).estimate(plan, [t])

    rw = buffers(d.column_wise([0, 1]), optim.rowwise_adagrad(0.1)).placement.memory[2]
    adam = buffers(d.column_wise([0, 1]), optim.adam(0.1)).placement.memory[2]
    updated_rows = 8 * CAP * 32 * 4  # [N * C, 32] float32 on each of the two column shards
    assert rw - adam == pytest.approx(2 * 4 * t.num_embeddings - updated_rows, rel=1e-9)
    opts = (optim.rowwise_adagrad(0.1), optim.adam(0.1))
    by_rows = [buffers(d.row_wise(), o).placement.memory[2] for o in opts]
    assert by_rows[0] == by_rows[1]
    assert np.isfinite(rw)
