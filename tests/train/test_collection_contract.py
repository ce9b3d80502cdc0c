"""The embedding-collection contract: the optimizer, the train step and checkpoints reach
collections only through EmbeddingCollectionInterface (a collection written outside
jaxrec trains), and the step is a TrainStep object."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxrec as jr
from jaxrec import checkpoint as ckpt
from jaxrec import optim, train
from jaxrec.distributed.planner.storage import table_optimizer
from jaxrec.embedding import CombinedOptimizer, EmbeddingCollectionInterface, EmbeddingTable
from jaxrec.embedding.blocks import Block, TableBlocks
from jaxrec.embedding.collection import embedding_collections, replace_collection
from jaxrec.embedding.optimizer import state_key
from jaxrec.embedding.tables import group_tables
from jaxrec.embedding.tape import tap
from jaxrec.inference import QuantEmbeddingBagCollection

ROWS, DIM, LR = 10, 3, 0.5


class OneIdPerBag(EmbeddingCollectionInterface):
    """A collection written against the contract only: one table, one id per bag of
    feature "a", output ``table[ids]`` ``[B, D]``, plain SGD on the rows."""

    def __init__(self, *, rngs):
        self.table_configs = (
            jr.EmbeddingBagConfig(
                name="t", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["a"]
            ),
        )
        self.prefix = "embedding_bags"
        self.weights = nnx.Dict(
            {"t": EmbeddingTable(jax.random.normal(rngs.params(), (ROWS, DIM)))}
        )

    def __call__(self, kjt):
        return tap(self, self.weights["t"].get_value()[kjt["a"].values()], kjt)

    def init_optimizer_state(self, optimizer, path):
        return {state_key(path, "t", 0): optimizer.for_table("t").init(ROWS, DIM)}

    def apply_sparse_gradients(
        self, optimizer, path, weights, sparse_state, calls, *, dep, implementation=None
    ):
        key = state_key(path, "t", 0)
        ids = jnp.concatenate([c.features["a"].values() for c in calls])
        grads = jnp.concatenate([c.grad for c in calls]) + 0.0 * dep
        dense = jnp.zeros((ROWS, DIM), jnp.float32).at[ids].add(grads)  # duplicates summed
        table, state = optim.apply_rows(
            optimizer.for_table("t"), weights["t"], sparse_state[key], jnp.arange(ROWS), dense
        )
        return {"t": table}, {**sparse_state, key: state}

    def reset_optimizer_rows(self, optimizer, path, group, sparse_state, rows):
        raise NotImplementedError("OneIdPerBag re-initialises no rows")

    def table_blocks(self, optimizer, path):
        block = (Block("t", 0, ROWS, 0, DIM, 0),)
        return TableBlocks({"t": block}, {state_key(path, "t", 0): block})


class Model(nnx.Module):
    def __init__(self):
        self.coll = OneIdPerBag(rngs=nnx.Rngs(0))

    def __call__(self, batch):
        kjt, c = batch
        return jnp.sum(self.coll(kjt) * c) + 0.5 * jnp.sum(self.coll(kjt) * c)  # called twice


def test_a_collection_written_against_the_contract_trains():
    model = Model()
    w0 = np.asarray(model.coll.weights["t"].get_value())
    opt = CombinedOptimizer(optax.sgd(0.1), optim.sgd(LR))
    graphdef, state = train.init_train_state(model, opt)
    assert list(state.opt_state.sparse) == ["coll/t"]
    step = train.make_train_step(graphdef, opt, lambda m, b: m(b))
    assert isinstance(step, train.TrainStep)
    ids = np.array([2, 7, 4], np.int32)
    kjt = jr.KeyedJaggedTensor.from_lengths_sync(["a"], ids, [1, 1, 1], capacities=[3])
    c = np.arange(9, dtype=np.float32).reshape(3, 3)
    state, loss, _ = step(state, (kjt, jnp.asarray(c)))
    want = w0.copy()
    want[ids] -= LR * 1.5 * c  # both calls' gradients, one update (ids unique)
    np.testing.assert_allclose(
        np.asarray(state.tables["coll"]["weights"]["t"][...]), want, rtol=1e-6
    )
    np.testing.assert_allclose(float(loss), 1.5 * np.sum(w0[ids] * c), rtol=1e-5)
    assert int(state.opt_state.sparse["coll/t"].count) == 1
    assert step.skipped_steps() == 0


def test_a_collection_missing_contract_methods_is_refused_when_built():
    class Bare(EmbeddingCollectionInterface):
        def init_optimizer_state(self, optimizer, path):
            return {}

    with pytest.raises(TypeError, match="Bare") as err:
        Bare()
    missing = ("apply_sparse_gradients", "reset_optimizer_rows", "table_blocks")
    assert all(m in str(err.value) for m in missing), err.value
    assert "init_optimizer_state" not in str(err.value)


def test_the_contract_collection_checkpoints_through_its_table_blocks():
    model = Model()
    opt = CombinedOptimizer(optax.sgd(0.1), optim.sgd(LR))
    graphdef, state = train.init_train_state(model, opt)
    ckpt.logical_state(graphdef, opt, state)  # reaches the table only through table_blocks


def test_which_collections_implement_the_contract():
    tables = [
        jr.EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, feature_names=["a"])
    ]
    ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
    ec = jr.EmbeddingCollection(
        [jr.EmbeddingConfig(name="s", embedding_dim=4, num_embeddings=8, feature_names=["a"])],
        rngs=nnx.Rngs(0),
    )
    quant = QuantEmbeddingBagCollection.from_float(ebc)  # inference-only: not a collection here
    model = nnx.Dict(ebc=ebc, ec=ec, quant=quant)
    assert [p for p, _ in embedding_collections(model)] == [("ebc",), ("ec",)]
    assert ebc.mesh is None and ec.mesh is None


def test_table_group_rows_and_quantized_grouping():
    tables = [
        jr.EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=5, feature_names=["x"]),
        jr.EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=3, feature_names=["y"]),
        jr.EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=7, feature_names=["z"]),
    ]
    groups = group_tables(tables)
    assert [(g.name, g.tables, g.table_rows) for g in groups] == [
        ("fp32_d4", ("a", "c"), (5, 7)),
        ("fp32_d8", ("b",), (3,)),
    ]
    by_dtype = group_tables(tables, {"a": "int8", "b": "int8", "c": "int4"})
    assert [(g.name, g.dtype, g.tables) for g in by_dtype] == [
        ("int8_d4", "int8", ("a",)),
        ("int8_d8", "int8", ("b",)),
        ("int4_d4", "int4", ("c",)),
    ]


def test_replace_collection_by_attribute_key_and_index():
    class Holder(nnx.Module):
        def __init__(self):
            self.attr = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
            self.d = nnx.Dict(k=nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
            self.l = nnx.List([nnx.Linear(1, 1, rngs=nnx.Rngs(0))])

    h = Holder()
    new = [nnx.Linear(1, 2, rngs=nnx.Rngs(0)) for _ in range(3)]
    for path, n in zip([("attr",), ("d", "k"), ("l", 0)], new, strict=True):
        replace_collection(h, path, n)
    assert h.attr is new[0] and h.d["k"] is new[1] and h.l[0] is new[2]


def test_planner_reads_a_combined_optimizer_by_type():
    per = optim.sgd(0.1)
    opt = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1), per_table={"t": per})
    assert table_optimizer(opt, "t") is per

    class LooksCombined:
        def for_table(self, name):
            return per

    with pytest.raises(TypeError, match="CombinedOptimizer"):
        table_optimizer(LooksCombined(), "t")
