"""A planned plan shards a real model: same forward and training step as unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.distributed.planner import ParameterConstraints, plan_for_model
from jaxrec.embedding import CombinedOptimizer

KEYS = ["f1", "f2", "f3", "f4"]
ROWS = {"f1": 10, "f2": 50, "f3": 37, "f4": 20}
B, CAP, WORLD = 4, 16, 8


def _tables():
    return [
        jr.EmbeddingBagConfig(
            name="t1", embedding_dim=8, num_embeddings=50, feature_names=["f1", "f2"]
        ),
        jr.EmbeddingBagConfig(
            name="t2", embedding_dim=6, num_embeddings=37, feature_names=["f3"],
            pooling=jr.PoolingType.MEAN,
        ),
        jr.EmbeddingBagConfig(name="t3", embedding_dim=8, num_embeddings=20, feature_names=["f4"]),
        jr.EmbeddingBagConfig(name="t4", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
    ]  # fmt: skip


class Model(nnx.Module):
    def __init__(self):
        self.ebc = jr.EmbeddingBagCollection(_tables(), rngs=nnx.Rngs(0))
        self.head = nnx.Linear(34, 1, rngs=nnx.Rngs(1))

    def __call__(self, kjt):
        return jnp.tanh(self.head(self.ebc(kjt).values())[:, 0])


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def _kjt(bags, caps):
    lengths = [len(b) for k in KEYS for b in bags[k]]
    values = [i for k in KEYS for b in bags[k] for i in b]
    return jr.KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, capacities=caps)


def _batches(seed):
    rng = np.random.default_rng(seed)
    local, glob, ys = [], {k: [] for k in KEYS}, []
    for _ in range(WORLD):
        bags = {k: [rng.integers(0, ROWS[k], int(rng.integers(0, 4))).tolist() for _ in range(B)]
                for k in KEYS}  # fmt: skip
        y = rng.normal(size=B).astype(np.float32)
        ys.append(y)
        local.append((_kjt(bags, {k: CAP for k in KEYS}), y))
        for k in KEYS:
            glob[k] += bags[k]
    return local, (_kjt(glob, None), jnp.asarray(np.concatenate(ys)))


MIXED = {
    "t1": ParameterConstraints(sharding_types=["row_wise"]),
    "t2": ParameterConstraints(sharding_types=["column_wise"], min_partition=3),
    "t3": ParameterConstraints(sharding_types=["table_wise"]),
    "t4": ParameterConstraints(sharding_types=["data_parallel"]),
}


def test_planned_model_matches_unsharded():
    mesh = jax.make_mesh((WORLD,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    caps = [ParameterConstraints(feature_capacities=[CAP] * n, **kw)
            for n, kw in ((2, {}), (1, {}), (1, {}), (1, {}))]  # fmt: skip
    free = {t: c for t, c in zip(("t1", "t2", "t3", "t4"), caps, strict=True)}
    auto = plan_for_model(Model(), mesh, batch_size=B, constraints=free)
    mixed = plan_for_model(Model(), mesh, batch_size=B, constraints=MIXED)
    kinds = {p.sharding_type.value for p in mixed.plan["ebc"].values()}
    assert kinds == {"row_wise", "column_wise", "table_wise", "data_parallel"}
    local, glob = _batches(0)
    forward = nnx.jit(lambda ebc, kjt: ebc(kjt).values())  # eager shard_map is very slow
    ref = np.asarray(forward(Model().ebc, glob[0]))
    for plan in (auto, mixed):  # the sharded collection alone: forward only
        sebc = d.ShardedEmbeddingBagCollection(Model().ebc, plan.plan["ebc"], mesh)
        out = forward(sebc, d.shard_batch([k for k, _ in local], mesh))
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6)

    # One training step of the whole model under the mixed plan.
    _one_step_equals_unsharded(mixed, optim.adam(0.05), local, glob, mesh)


def _one_step_equals_unsharded(plan, sparse, local, glob, mesh):
    opt = CombinedOptimizer(optax.sgd(0.1), sparse)
    graphdef, state = train.init_train_state(Model(), opt)
    state, loss_ref, _ = train.make_train_step(graphdef, opt, loss_fn)(state, glob)
    tables_ref = train.merge_model(graphdef, state).ebc.state_dict()
    model = d.DistributedModelParallel(Model(), plan, mesh)
    graphdef, state = train.init_train_state(model, opt)
    state, loss, _ = train.make_train_step(graphdef, opt, loss_fn)(
        state, d.shard_batch(local, mesh)
    )
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5)
    for k, v in train.merge_model(graphdef, state).ebc.state_dict().items():
        np.testing.assert_allclose(v, tables_ref[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_uneven_row_pieces_train_as_unsharded():
    """The planner cuts these small tables into uneven row pieces over the 8 ranks (its
    balancing); one row-wise Adagrad step under that plan equals the unsharded step."""
    mesh = jax.make_mesh((WORLD,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    cons = {t: ParameterConstraints(feature_capacities=[CAP] * n, pooling_factors=[1.5] * n)
            for t, n in (("t1", 2), ("t2", 1), ("t3", 1), ("t4", 1))}  # fmt: skip
    plan = plan_for_model(Model(), mesh, batch_size=B, constraints=cons)
    sizes = {n: {s.shard_sizes[0] for s in p.sharding_spec} for n, p in plan.plan["ebc"].items()}
    assert any(len(v) > 1 for v in sizes.values()), sizes  # uneven pieces
    local, glob = _batches(1)
    _one_step_equals_unsharded(plan, optim.rowwise_adagrad(0.05), local, glob, mesh)
