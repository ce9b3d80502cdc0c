"""A planned plan shards a real model: same forward and training step as unsharded."""

import dataclasses

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
            name="t2",
            embedding_dim=6,
            num_embeddings=37,
            feature_names=["f3"],
            pooling=jr.PoolingType.MEAN,
        ),
        jr.EmbeddingBagConfig(name="t3", embedding_dim=8, num_embeddings=20, feature_names=["f4"]),
        jr.EmbeddingBagConfig(name="t4", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
    ]


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
        bags = {
            k: [rng.integers(0, ROWS[k], int(rng.integers(0, 4))).tolist() for _ in range(B)]
            for k in KEYS
        }
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
    caps = [
        ParameterConstraints(feature_capacities=[CAP] * n, **kw)
        for n, kw in ((2, {}), (1, {}), (1, {}), (1, {}))
    ]
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
    cons = {
        t: ParameterConstraints(feature_capacities=[CAP] * n, pooling_factors=[1.5] * n)
        for t, n in (("t1", 2), ("t2", 1), ("t3", 1), ("t4", 1))
    }
    plan = plan_for_model(Model(), mesh, batch_size=B, constraints=cons)
    sizes = {n: {s.shard_sizes[0] for s in p.sharding_spec} for n, p in plan.plan["ebc"].items()}
    assert any(len(v) > 1 for v in sizes.values()), sizes  # uneven pieces
    local, glob = _batches(1)
    _one_step_equals_unsharded(plan, optim.rowwise_adagrad(0.05), local, glob, mesh)


def _seq_tables():
    return [
        jr.EmbeddingConfig(
            name="t1", embedding_dim=8, num_embeddings=50, feature_names=["f1", "f2"]
        ),
        jr.EmbeddingConfig(name="t2", embedding_dim=8, num_embeddings=37, feature_names=["f3"]),
        jr.EmbeddingConfig(name="t3", embedding_dim=4, num_embeddings=20, feature_names=["f4"]),
        jr.EmbeddingConfig(name="t4", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
    ]


class SeqModel(nnx.Module):
    """Only EmbeddingCollections (sequence lookups): a loss over every valid id's row."""

    def __init__(self):
        self.ec = jr.EmbeddingCollection(_seq_tables(), rngs=nnx.Rngs(0))
        self.head8 = nnx.Linear(8, 1, rngs=nnx.Rngs(1))
        self.head4 = nnx.Linear(4, 1, rngs=nnx.Rngs(2))

    def __call__(self, kjt):
        total = 0.0
        for jt in self.ec(kjt).values():  # unsharded [C, D] or sharded [world, C, D] values
            v = jt.values()
            valid = jnp.arange(v.shape[-2]) < jnp.sum(jt.lengths(), axis=-1)[..., None]
            h = jnp.tanh((self.head8 if v.shape[-1] == 8 else self.head4)(v))[..., 0]
            total = total + jnp.sum(jnp.where(valid, h, 0.0))
        return total


def test_planned_sequence_model_trains_as_unsharded():
    """A model of EmbeddingCollections only is planned (every type the sharded EC runs),
    sharded by DistributedModelParallel and trained two steps as unsharded."""
    mesh = jax.make_mesh((WORLD,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    cons = {
        t: dataclasses.replace(c, feature_capacities=[CAP] * (2 if t == "t1" else 1))
        for t, c in MIXED.items()
    }
    plan = plan_for_model(SeqModel(), mesh, batch_size=B, constraints=cons)
    kinds = {n: p.sharding_type.value for n, p in plan.plan["ec"].items()}
    assert kinds == {
        "t1": "row_wise",
        "t2": "column_wise",
        "t3": "table_wise",
        "t4": "data_parallel",
    }
    opt = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1))
    loss_fn = lambda m, b: (0.05 * m(b[0]) - 1.0) ** 2
    data = [_batches(s) for s in (2, 3)]
    graphdef, ref = train.init_train_state(SeqModel(), opt)
    ref_step = train.make_train_step(graphdef, opt, loss_fn)
    model = d.DistributedModelParallel(SeqModel(), plan, mesh)
    assert isinstance(model.ec, d.ShardedEmbeddingCollection)
    sgraph, state = train.init_train_state(model, opt)
    step = train.make_train_step(sgraph, opt, loss_fn)
    for local, glob in data:
        ref, want, _ = ref_step(ref, glob)
        state, got, _ = step(state, d.shard_batch(local, mesh))
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    ref_tables = train.merge_model(graphdef, ref).ec.state_dict()
    for k, v in train.merge_model(sgraph, state).ec.state_dict().items():
        np.testing.assert_allclose(v, ref_tables[k], rtol=1e-4, atol=1e-6, err_msg=k)
