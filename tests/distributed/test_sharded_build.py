"""DistributedModelParallel of a model constructor: each device draws only its own shards,
with the values the eager unsharded build has (TorchRec's ``meta`` device, in JAX).

The reference is the eager, unsharded model built by the same constructor: its tables
(``state_dict``) and dense layers must equal the sharded build's bit for bit, under
every sharding type, for pooled and sequence collections and inside the
feature-processed and managed-collision wrappers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import PLANS, Model, mesh_1d, mesh_2d
from test_sharded_ec import SeqModel
from test_sharded_wrappers import Wrapped

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.distributed.abstract_build import build_abstract
from jaxrec.distributed.planner import EmbeddingShardingPlanner, Topology
from jaxrec.embedding import CombinedOptimizer
from jaxrec.embedding.tables import EmbeddingTable, recording_init_keys
from jaxrec.models import DLRM


def _equal_states(a: nnx.Module, b: nnx.Module):
    """Every variable of the eager model ``a`` but its tables (dense layers, position
    weights, managed-collision state) equals ``b``'s."""
    what = nnx.Not(EmbeddingTable)
    sb = dict(nnx.to_flat_state(nnx.state(b, what)))
    for path, x in nnx.to_flat_state(nnx.state(a, what)):
        got, want = sb[path].get_value(), x.get_value()
        if jnp.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))


def _equal_tables(reference: dict, sharded: dict):
    assert sorted(reference) == sorted(sharded)
    for k, v in reference.items():
        np.testing.assert_array_equal(np.asarray(sharded[k]), np.asarray(v), err_msg=k)


@pytest.mark.parametrize("name", list(PLANS))
def test_every_sharding_type_draws_the_eager_values(name):
    gens, hosts = PLANS[name]
    mesh = mesh_1d() if hosts == 1 else mesh_2d()
    eager = Model(rngs=nnx.Rngs(1))
    module_plan = d.construct_module_sharding_plan(
        eager.ebc, gens, world_size=8, local_size=8 // hosts
    )
    built = d.DistributedModelParallel(
        lambda: Model(rngs=nnx.Rngs(1)), d.ShardingPlan({"ebc": module_plan}), mesh
    )
    assert isinstance(built.ebc, d.ShardedEmbeddingBagCollection)
    _equal_tables(eager.ebc.state_dict(), built.ebc.state_dict())
    _equal_states(eager, built)
    mine = jax.sharding.PartitionSpec(tuple(mesh.axis_names))
    for group, var in built.ebc.weights.items():  # each device holds its own block
        spec = var.get_value().sharding.spec
        replicated = built.ebc.buffers[group].replicated
        assert spec == (jax.sharding.PartitionSpec() if replicated else mine)


def test_sequence_collections_and_the_planner():
    """plan=None: the planner plans the abstract model."""
    make = lambda: SeqModel(rngs=nnx.Rngs(2))  # noqa: E731
    eager = make()
    built = d.DistributedModelParallel(make, None, mesh_1d())
    assert isinstance(built.ec, d.ShardedEmbeddingCollection)
    _equal_tables(eager.ec.state_dict(), built.ec.state_dict())
    _equal_states(eager, built)


def test_feature_processed_and_managed_collision_wrappers():
    eager = Wrapped()
    fp_plan = d.construct_module_sharding_plan(
        eager.fp.embedding_bag_collection(),
        {"t1": d.data_parallel(), "t2": d.column_wise([1, 2, 3])},
        world_size=8,
    )
    mc_plan = d.construct_module_sharding_plan(
        eager.mc.embedding_bag_collection, {"t3": d.row_wise()}, world_size=8
    )
    plan = d.ShardingPlan({"fp._embedding_bag_collection": fp_plan, "mc": mc_plan})
    built = d.DistributedModelParallel(Wrapped, plan, mesh_1d())
    _equal_tables(
        eager.fp.embedding_bag_collection().state_dict(),
        built.fp.embedding_bag_collection().state_dict(),
    )
    _equal_tables(
        eager.mc.embedding_bag_collection.state_dict(),
        built.mc.embedding_bag_collection.state_dict(),
    )
    # Position weights, managed-collision state, head: as the eager model's, sharded alike.
    _equal_states(d.DistributedModelParallel(eager, plan, mesh_1d()), built)


def test_a_collection_the_plan_leaves_out_is_drawn_whole_and_replicated():
    class Two(nnx.Module):
        def __init__(self):
            self.a = jr.EmbeddingBagCollection(
                [jr.EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=40)],
                rngs=nnx.Rngs(0),
            )
            self.b = jr.EmbeddingBagCollection(
                [jr.EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=30)],
                rngs=nnx.Rngs(1),
            )

    eager = Two()
    plan = d.ShardingPlan(
        {"a": d.construct_module_sharding_plan(eager.a, {"a": d.row_wise()}, world_size=8)}
    )
    built = d.DistributedModelParallel(Two, plan, mesh_1d())
    assert isinstance(built.b, jr.EmbeddingBagCollection)
    _equal_tables(eager.b.state_dict(), built.b.state_dict())
    _equal_tables(eager.a.state_dict(), built.a.state_dict())


def _dlrm(rows):
    tables = [
        jr.EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=16, num_embeddings=n, feature_names=[f"f{i}"]
        )
        for i, n in enumerate(rows)
    ]
    ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
    return DLRM(ebc, 4, [16, 16], [16, 1], rngs=nnx.Rngs(1))


def _dlrm_batches(rows, world, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(world):
        keys = [f"f{i}" for i in range(len(rows))]
        values = np.concatenate([rng.integers(0, n, 8) for n in rows])
        kjt = jr.KeyedJaggedTensor.from_lengths_sync(
            keys, values, np.full(4 * len(rows), 2), capacities={k: 8 for k in keys}
        )
        out.append(
            (
                rng.normal(size=(4, 4)).astype(np.float32),
                kjt,
                rng.integers(0, 2, 4).astype(np.float32),
            )
        )
    return out


def _dlrm_loss(model, batch):
    dense, kjt, y = batch
    return optax.sigmoid_binary_cross_entropy(model(dense, kjt)[:, 0], y).mean()


def test_a_dlrm_larger_than_one_device_s_share_trains_under_the_planner_s_plan():
    """Device memory below the largest table: the planner splits it by rows, each device
    draws its rows only, and training from the constructor's build equals training
    from the eager build's shards."""
    rows = (200_000, 3_000, 50_000, 700)
    make = lambda: _dlrm(rows)  # noqa: E731
    mesh = mesh_1d()
    abstract, _ = build_abstract(make, mesh)
    table_bytes = 200_000 * 16 * 4
    topology = Topology(world_size=8, hbm_cap=table_bytes // 3, batch_size=4)
    plan = EmbeddingShardingPlanner(topology=topology).plan(abstract)
    big = plan.plan["sparse_arch.embedding_bag_collection"]["t0"]
    assert len(big.sharding_spec) > 1, big  # the table is split: no device holds it whole

    built = d.DistributedModelParallel(make, plan, mesh)
    eager = make()
    ebc = built.sparse_arch.embedding_bag_collection
    _equal_tables(eager.sparse_arch.embedding_bag_collection.state_dict(), ebc.state_dict())
    _equal_states(eager, built)
    group = next(g for g in ebc.layout.groups if "t0" in g.tables)
    assert group.rows_per_rank < rows[0]
    for shard in ebc.weights[group.name].get_value().addressable_shards:
        assert shard.data.shape[0] == group.rows_per_rank

    opt = CombinedOptimizer(optax.adam(1e-3), optim.rowwise_adagrad(0.1))
    from_eager = d.DistributedModelParallel(make(), plan, mesh)
    graphdef, state = train.init_train_state(built, opt)
    graphdef2, state2 = train.init_train_state(from_eager, opt)
    step = train.make_train_step(graphdef, opt, _dlrm_loss)
    for seed in range(2):
        batch = d.shard_batch(_dlrm_batches(rows, 8, seed), mesh)
        state, loss, _ = step(state, batch)
        state2, loss2, _ = step(state2, batch)
        assert np.isfinite(float(loss)) and float(loss) == float(loss2)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    del graphdef2


def test_an_abstract_model_without_its_constructor_is_refused():
    abstract = nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(1)))
    with pytest.raises(ValueError, match="Pass its constructor"):
        d.DistributedModelParallel(abstract, None, mesh_1d())
    with pytest.raises(TypeError, match="function of no arguments"):
        d.DistributedModelParallel(3, None, mesh_1d())


def test_tables_with_an_init_fn_are_refused_by_shard():
    class One(nnx.Module):
        def __init__(self):
            t = jr.EmbeddingBagConfig(
                name="t",
                embedding_dim=4,
                num_embeddings=16,
                init_fn=lambda k, s, dt: jnp.ones(s, dt),
            )
            self.ebc = jr.EmbeddingBagCollection([t], rngs=nnx.Rngs(0))

    make = One
    plan = d.ShardingPlan(
        {"ebc": d.construct_module_sharding_plan(make().ebc, {"t": d.row_wise()}, world_size=8)}
    )
    with pytest.raises(ValueError, match="init_fn"):
        d.DistributedModelParallel(make, plan, mesh_1d())


@pytest.mark.parametrize("draw", [True, False])
def test_the_dense_values_program_draws_no_table(draw):
    """The jitted program that builds the dense values returns no table and its
    temporaries are far below the tables' bytes: XLA dropped their draws (or, as
    build_abstract traces it, their placeholders)."""
    make = lambda: _dlrm((400_000, 10, 10, 10))  # noqa: E731

    def values():
        with recording_init_keys(draw=draw):
            return nnx.state(make(), nnx.Not(EmbeddingTable))

    stats = jax.jit(values).lower().compile().memory_analysis()
    table_bytes = 400_000 * 16 * 4
    assert stats.temp_size_in_bytes + stats.output_size_in_bytes < table_bytes / 20, stats
