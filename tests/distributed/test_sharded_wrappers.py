"""Collections inside a feature-processed or managed-collision collection, sharded by
DistributedModelParallel, train as unsharded (position weights, evictions and all)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import batches, mesh_1d

import jaxrec as jr
import jaxrec.modules as jm
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

STEPS = 2


class Wrapped(nnx.Module):
    """An FPEBC over f1..f3 and an MC-EBC over f4 (16 slots for 20 raw ids: it evicts)."""

    def __init__(self):
        fp_tables = [
            jr.EmbeddingBagConfig(
                name="t1", embedding_dim=8, num_embeddings=50, feature_names=["f1", "f2"]
            ),
            jr.EmbeddingBagConfig(
                name="t2",
                embedding_dim=6,
                num_embeddings=37,
                feature_names=["f3"],
                pooling=jr.PoolingType.MEAN,
            ),
        ]
        ebc = jr.EmbeddingBagCollection(fp_tables, is_weighted=True, rngs=nnx.Rngs(0))
        pw = {f: jm.PositionWeightedModule(3) for f in ("f1", "f2", "f3")}
        for i, m in enumerate(pw.values()):
            m.position_weight.set_value(jnp.linspace(0.5, 1.5, 3) + i)
        self.fp = jm.FeatureProcessedEmbeddingBagCollection(ebc, pw)
        mc_tables = [
            jr.EmbeddingBagConfig(
                name="t3", embedding_dim=4, num_embeddings=16, feature_names=["f4"]
            )
        ]
        mch = jm.MCHManagedCollisionModule(
            16,
            eviction_policy=jm.LFU_EvictionPolicy(),
            eviction_interval=1,
            history_capacity=128,
        )
        self.mc = jm.ManagedCollisionEmbeddingBagCollection(
            jr.EmbeddingBagCollection(mc_tables, rngs=nnx.Rngs(1)),
            jm.ManagedCollisionCollection({"t3": mch}, mc_tables),
            rngs=nnx.Rngs(2),
        )
        self.head = nnx.Linear(26, 1, rngs=nnx.Rngs(3))

    def __call__(self, kjt):
        pooled = [self.fp(kjt).values(), self.mc(kjt)[0].values()]
        return jnp.tanh(self.head(jnp.concatenate(pooled, axis=1))[:, 0])


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def test_wrapped_collections_train_as_unsharded():
    """The plan names the FPEBC's collection by its own path (as the planner does) and the
    MC-EBC by the wrapper's path (as TorchRec's plans do). Position weights get the
    unsharded gradient through a data-parallel and a column-split MEAN table; evicted
    rows are reset in the row-wise table with their optimizer state."""
    mesh = mesh_1d()
    opt = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1))
    rng = np.random.default_rng(4)
    data = [batches(rng) for _ in range(STEPS)]
    graphdef, ref = train.init_train_state(Wrapped(), opt)
    ref_step = train.make_train_step(graphdef, opt, loss_fn, skip_nonfinite=True)

    model = Wrapped()
    fp_plan = d.construct_module_sharding_plan(
        model.fp.embedding_bag_collection(),
        {"t1": d.data_parallel(), "t2": d.column_wise([1, 2, 3])},
        world_size=8,
    )
    mc_plan = d.construct_module_sharding_plan(
        model.mc.embedding_bag_collection, {"t3": d.row_wise()}, world_size=8
    )
    plan = d.ShardingPlan({"fp._embedding_bag_collection": fp_plan, "mc": mc_plan})
    model = d.DistributedModelParallel(model, plan, mesh)
    assert isinstance(model.fp, d.ShardedFeatureProcessedEmbeddingBagCollection)
    assert isinstance(model.mc.embedding_bag_collection, d.ShardedEmbeddingBagCollection)
    sgraph, state = train.init_train_state(model, opt)
    step = train.make_train_step(sgraph, opt, loss_fn, skip_nonfinite=True)  # masks resets
    for local, glob in data:
        ref, want, _ = ref_step(ref, glob)
        state, got, _ = step(state, d.shard_batch(local, mesh))
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    ref_model, model = train.merge_model(graphdef, ref), train.merge_model(sgraph, state)
    evicted = np.asarray(ref_model.mc.evict()["t3"])
    assert (evicted < 16).any()  # rows were reset in the last step
    np.testing.assert_array_equal(np.asarray(model.mc.evict()["t3"]), evicted)
    pairs = [
        (model.fp.embedding_bag_collection(), ref_model.fp.embedding_bag_collection()),
        (model.mc.embedding_bag_collection, ref_model.mc.embedding_bag_collection),
    ]
    for coll, ref_coll in pairs:
        want = ref_coll.state_dict()
        for k, v in coll.state_dict().items():
            np.testing.assert_allclose(v, want[k], rtol=1e-4, atol=1e-6, err_msg=k)
    got, want = nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)  # position weights, head


def test_bad_arguments_say_what_to_fix():
    model = Wrapped()
    with pytest.raises(TypeError, match="must be a FeatureProcessedEmbeddingBagCollection"):
        d.ShardedFeatureProcessedEmbeddingBagCollection(model.mc)
    with pytest.raises(ValueError, match="pass the plan of fp_ebc's collection and the mesh"):
        d.ShardedFeatureProcessedEmbeddingBagCollection(model.fp)
    local, _ = batches(np.random.default_rng(0))
    mcc = d.GlobalBatchManagedCollision(model.mc.managed_collision_collection)
    with pytest.raises(ValueError, match="stacked per device"):
        mcc(local[0][0])
    mc_plan = d.construct_module_sharding_plan(
        model.mc.embedding_bag_collection, {"t3": d.row_wise()}, world_size=8
    )
    plan = d.ShardingPlan({"mc": mc_plan, "mc._embedding_module": mc_plan})
    with pytest.raises(ValueError, match="names both 'mc' and mc._embedding_module"):
        d.DistributedModelParallel(model, plan, mesh_1d())
