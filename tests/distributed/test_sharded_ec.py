"""Sharded EmbeddingCollection (sequence lookups) against the unsharded module."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import batches, mesh_1d, mesh_2d

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer


def ec_tables():
    """Two widths (8 and 4), a shared table, uneven rows and columns."""
    return [
        jr.EmbeddingConfig(
            name="t1", embedding_dim=8, num_embeddings=50, feature_names=["f1", "f2"]
        ),
        jr.EmbeddingConfig(name="t2", embedding_dim=8, num_embeddings=37, feature_names=["f3"]),
        jr.EmbeddingConfig(name="t3", embedding_dim=4, num_embeddings=20, feature_names=["f4"]),
        jr.EmbeddingConfig(name="t4", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
    ]


def _valid(jt):
    """``[..., C]`` mask of real ids; works on one JaggedTensor or a stacked one."""
    if jt.lengths().ndim == 2:
        return jax.vmap(lambda v, n: jnp.arange(v.shape[0]) < jnp.sum(n))(jt.values(), jt.lengths())
    return jnp.arange(jt.values().shape[0]) < jnp.sum(jt.lengths())


class SeqModel(nnx.Module):
    def __init__(self, *, rngs):
        self.ec = jr.EmbeddingCollection(ec_tables(), need_indices=True, rngs=nnx.Rngs(0))
        self.head8 = nnx.Linear(8, 1, rngs=rngs)
        self.head4 = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, kjt):
        total = 0.0
        for jt in self.ec(kjt).values():
            v = jt.values()
            h = jnp.tanh((self.head8 if v.shape[-1] == 8 else self.head4)(v))[..., 0]
            total = total + jnp.sum(jnp.where(_valid(jt), h, 0.0))
        return total


def loss_fn(model, batch):
    kjt, _ = batch
    return (0.05 * model(kjt) - 1.0) ** 2


PLANS = {  # every sharding type, and data-parallel, across the two cases
    "1d": (
        {
            "t1": d.row_wise(),
            "t2": d.column_wise([3, 6, 0]),
            "t3": d.table_wise(5),
            "t4": d.data_parallel(),
        },
        mesh_1d,
        1,
    ),
    "2d": (
        {
            "t1": d.grid_shard([0, 1]),
            "t2": d.table_row_wise(1),
            "t3": d.table_column_wise(0, 2),
            "t4": d.table_wise(6),
        },
        mesh_2d,
        2,
    ),
}
STEPS = 2


def _rows(out, world):
    """``{name: [per-device list of [len, D] rows]}`` from a stacked or per-device output."""
    res = {}
    for name, jt in out.items():
        v, n = np.asarray(jt.values()), np.asarray(jt.lengths())
        res[name] = [v[i, : n[i].sum()] for i in range(world)]
    return res


def _optimizer():
    return CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))


@pytest.fixture(scope="module")
def unsharded():
    """The batches and unsharded training on them, shared by every case (they all train
    the same model on the same data): forward rows per device, losses, final model."""
    opt = _optimizer()
    rng = np.random.default_rng(5)
    data = [batches(rng) for _ in range(STEPS)]

    ref_def, ref = train.init_train_state(SeqModel(rngs=nnx.Rngs(1)), opt)
    ref_step = train.make_train_step(ref_def, opt, loss_fn)
    ref_model = train.merge_model(ref_def, ref)
    ref_rows = {name: [] for name in ref_model.ec.embedding_names}
    for kjt, _ in data[0][0]:  # the unsharded module on each device's batch
        for name, jt in ref_model.ec(kjt).items():
            ref_rows[name].append(np.asarray(jt.values())[: int(jnp.sum(jt.lengths()))])
    ref_losses = []
    for _, glob in data:
        ref, loss, _ = ref_step(ref, glob)
        ref_losses.append(float(loss))
    return data, ref_rows, ref_losses, train.merge_model(ref_def, ref)


@pytest.mark.parametrize(
    ("case", "capacity"),
    [("1d", 1), ("2d", None), ("2d", 1)],
    ids=["1d-overflow", "2d-statistics", "2d-overflow"],
)
def test_sequence_training_equals_unsharded(unsharded, case, capacity):
    """Forward rows (and ids) per device, losses, tables and dense params after training.

    ``capacity=1`` sends most ids beyond the fast path (extra rounds, several update
    passes): nothing may be lost. The statistics-sized exchange (no pooling factors:
    each feature's whole capacity, spread over its rows) runs its fast path."""
    data, ref_rows, ref_losses, ref_model = unsharded
    gens, make_mesh, hosts = PLANS[case]
    mesh = make_mesh()
    opt = _optimizer()
    model = SeqModel(rngs=nnx.Rngs(1))
    plan = d.construct_module_sharding_plan(model.ec, gens, world_size=8, local_size=8 // hosts)
    model = d.DistributedModelParallel(model, d.ShardingPlan({"ec": plan}), mesh, capacity=capacity)
    assert isinstance(model.ec, d.ShardedEmbeddingCollection)
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    for i, (local, _) in enumerate(data):
        batch = d.shard_batch(local, mesh)
        if i == 0:
            out = train.merge_model(graphdef, state).ec(batch[0])
            assert out["f1@t4"].values().shape == (8, 16, 4)
            ids = np.asarray(out["f2"].weights())  # need_indices: the ids
            np.testing.assert_array_equal(ids[3], np.asarray(local[3][0]["f2"].values()))
            for name, per_dev in _rows(out, 8).items():
                for got, want in zip(per_dev, ref_rows[name], strict=True):
                    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)
        state, loss, _ = step(state, batch)
        np.testing.assert_allclose(float(loss), ref_losses[i], rtol=1e-5)
    assert step.jitted._cache_size() == 1  # placements stable across steps: one compile
    model = train.merge_model(graphdef, state)
    if capacity == 1:
        assert int(model.ec.overflow_count.get_value().sum()) > 0  # the overflow path ran
    ref_tables = ref_model.ec.state_dict()
    for k, v in model.ec.state_dict().items():
        np.testing.assert_allclose(v, ref_tables[k], rtol=1e-4, atol=1e-6, err_msg=k)
    got, want = nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
