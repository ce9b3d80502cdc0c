"""Row resets inside a train step (managed-collision evictions): evict, reset, lookup, update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_models import KEYS, bag_tables, random_batch

import jaxrec as jr
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer
from jaxrec.embedding.reset import init_rows, reset_table_rows

KEY = jax.random.key(7)
K = 4  # static reset-list length per table
FILL = 1 << 20
NAMES = ["t1", "t2", "t3"]
SIZES = {"t1": 30, "t2": 12, "t3": 16}
DIMS = {"t1": 4, "t2": 8, "t3": 4}
GROUP = {"t1": ("fp32_d4", 0), "t3": ("fp32_d4", 30), "t2": ("fp32_d8", 0)}


class ResetModel(nnx.Module):
    """Resets ``batch[2][table]`` rows of the EBC's tables, then looks up (TorchRec's order)."""

    def __init__(self, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(bag_tables(), rngs=rngs)
        self.head = nnx.Linear(24, 1, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.uint32))

    def __call__(self, kjt, resets):
        key = jax.random.fold_in(KEY, self.calls.get_value())
        for table, rows in resets.items():
            reset_table_rows(self.ebc, table, rows, key)
        self.calls.set_value(self.calls.get_value() + 1)
        return self.head(self.ebc(kjt).values())[:, 0]


def loss_fn(model, batch):
    kjt, y, resets = batch
    return jnp.mean((model(kjt, resets) - y) ** 2)


def no_resets():
    return {t: jnp.full((K,), FILL, jnp.int32) for t in NAMES}


def expected_row(table, call, row):
    """One row's fresh value, drawn the documented way, one row at a time."""
    key = jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(KEY, call), NAMES.index(table)), row
    )
    return np.asarray(
        jax.random.uniform(
            key, (DIMS[table],), jnp.float32, -1 / SIZES[table] ** 0.5, 1 / SIZES[table] ** 0.5
        )
    )


def tables_np(state):
    w = state.tables["ebc"]["weights"]
    return {g: np.array(w[g].get_value()) for g in ("fp32_d4", "fp32_d8")}


def sparse_np(state):
    return jax.tree.map(np.array, state.opt_state.sparse)


OPTIMIZERS = {
    "rowwise_adagrad": lambda: CombinedOptimizer(optax.sgd(0.05), optim.rowwise_adagrad(0.1)),
    "adam_mixed": lambda: CombinedOptimizer(  # t1, t3 share a buffer, not an optimizer
        optax.sgd(0.05), optim.adam(0.05), per_table={"t3": optim.adagrad(0.2)}
    ),
}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_reset_rows_get_fresh_weights_and_state_in_the_step(opt_name):
    rng = np.random.default_rng(0)
    opt = OPTIMIZERS[opt_name]()
    graphdef, state = train.init_train_state(ResetModel(rngs=nnx.Rngs(0)), opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    for _ in range(2):  # non-zero optimizer state everywhere the batches touched
        kjt, y = random_batch(rng)
        state, _, _ = step(state, (kjt, y, no_resets()))
    kjt, y = random_batch(rng)
    looked_up = {
        k: set(np.asarray(kjt[k].values())[: int(kjt[k].lengths().sum())].tolist()) for k in KEYS
    }
    t1_seen = sorted(looked_up["a"] | looked_up["b"])
    # t1: one row the batch reads, one it does not; negatives and fill are ignored.
    t1_unseen = next(r for r in range(30) if r not in t1_seen)
    resets = {
        "t1": np.array([t1_seen[0], -1, t1_unseen, FILL]),
        "t2": np.array([11, 11, FILL, 99]),  # a duplicate
        "t3": np.array([0, 15, 3, FILL]),
    }
    resets = {t: jnp.asarray(r, jnp.int32) for t, r in resets.items()}

    # Reference: reset by hand on host copies, then a step that resets nothing.
    ref_tables, ref_sparse = tables_np(state), sparse_np(state)
    call = int(state.rest["calls"].get_value())
    reset_group_rows = {"fp32_d4": set(), "fp32_d8": set()}
    for t, rows in resets.items():
        g, off = GROUP[t]
        for r in {int(r) for r in rows if 0 <= r < SIZES[t]}:
            ref_tables[g][off + r] = expected_row(t, call, r)
            reset_group_rows[g].add(off + r)
            for key, st in ref_sparse.items():
                if not key.startswith(f"ebc/{g}"):
                    continue
                local = off + r if opt_name != "adam_mixed" or g == "fp32_d8" else r
                owner = {"t1": "ebc/fp32_d4", "t3": "ebc/fp32_d4#1", "t2": "ebc/fp32_d8"}
                if opt_name == "adam_mixed" and key != owner[t]:
                    continue
                for f in st._fields:
                    if f != "count":
                        getattr(st, f)[local] = 0
    ref_state = state._replace(
        tables=jax.tree.map(jnp.asarray, state.tables),
        opt_state=state.opt_state._replace(sparse=jax.tree.map(jnp.asarray, ref_sparse)),
    )
    ref_state.tables["ebc"]["weights"]["fp32_d4"].set_value(jnp.asarray(ref_tables["fp32_d4"]))
    ref_state.tables["ebc"]["weights"]["fp32_d8"].set_value(jnp.asarray(ref_tables["fp32_d8"]))
    before = tables_np(state)
    ref_state = jax.tree.map(jnp.copy, ref_state)

    state, loss, _ = step(state, (kjt, y, resets))
    ref_state, ref_loss, _ = step(ref_state, (kjt, y, no_resets()))

    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)  # the lookup read fresh rows
    got, want = tables_np(state), tables_np(ref_state)
    for g in got:
        np.testing.assert_allclose(got[g], want[g], rtol=1e-6, atol=1e-7)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        sparse_np(state),
        sparse_np(ref_state),
    )
    # Reset rows the batch did not read hold exactly the fresh draw; their state is initial.
    np.testing.assert_array_equal(got["fp32_d4"][t1_unseen], expected_row("t1", call, t1_unseen))
    assert not np.array_equal(got["fp32_d4"][t1_seen[0]], expected_row("t1", call, t1_seen[0]))
    t1_state = sparse_np(state)["ebc/fp32_d4"]
    for f in t1_state._fields[1:]:
        assert np.all(getattr(t1_state, f)[t1_unseen] == 0)
    # -1 did not write the last row of t1 (row 29), nor anything else outside the lists.
    touched = {r for r in t1_seen} | {30 + r for k in ("d", "b") for r in looked_up[k]}
    untouched = sorted(set(range(46)) - touched - reset_group_rows["fp32_d4"])
    np.testing.assert_array_equal(got["fp32_d4"][untouched], before["fp32_d4"][untouched])


def test_init_rows_per_row_and_with_init_fn():
    cfg = jr.EmbeddingBagConfig(name="t", embedding_dim=3, num_embeddings=100)
    rows = jnp.asarray([5, 99, 0], jnp.int32)
    a = init_rows(cfg, KEY, rows)
    b = init_rows(cfg, KEY, rows[::-1])  # position in the list does not matter
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[::-1])
    assert np.all(np.abs(np.asarray(a)) <= 0.1) and a.dtype == jnp.float32
    ones = jr.EmbeddingBagConfig(
        name="u",
        embedding_dim=3,
        num_embeddings=10,
        init_fn=lambda k, s, d: jnp.full(s, 0.5, d),
        data_type=jr.DataType.BF16,
    )
    c = init_rows(ones, KEY, rows)
    assert (
        c.shape == (3, 3) and c.dtype == jnp.bfloat16 and np.all(np.asarray(c, np.float32) == 0.5)
    )


def test_reset_outside_a_train_step_writes_weights_only():
    model = ResetModel(rngs=nnx.Rngs(0))
    w0 = np.array(model.ebc.weights["fp32_d8"].get_value())
    resets = no_resets() | {"t2": jnp.asarray([2, FILL, FILL, FILL], jnp.int32)}
    kjt, _ = random_batch(np.random.default_rng(1))
    nnx.jit(lambda m, k, r: m(k, r))(model, kjt, resets)
    w1 = np.asarray(model.ebc.weights["fp32_d8"].get_value())
    np.testing.assert_array_equal(w1[2], expected_row("t2", 0, 2))
    np.testing.assert_array_equal(np.delete(w1, 2, 0), np.delete(w0, 2, 0))
    with pytest.raises(KeyError, match="no table 'zz'"):
        reset_table_rows(model.ebc, "zz", jnp.zeros((1,), jnp.int32), KEY)
    with pytest.raises(TypeError, match="integer array"):
        reset_table_rows(model.ebc, "t1", jnp.zeros((1,), jnp.float32), KEY)
    with pytest.raises(NotImplementedError, match="unsharded"):
        reset_table_rows(model.head, "t1", jnp.zeros((1,), jnp.int32), KEY)


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_reset_step_stays_in_place(skip_nonfinite):
    """A 4M x 128 table with 1024 reset rows a step: updated in place, no table-sized
    temporary (also when the non-finite guard may write reset rows back)."""
    tables = [
        jr.EmbeddingBagConfig(
            name="big", embedding_dim=128, num_embeddings=4_000_000, feature_names=["f"]
        )
    ]

    class Big(nnx.Module):
        def __init__(self, rngs):
            self.ebc = jr.EmbeddingBagCollection(tables, rngs=rngs)
            self.head = nnx.Linear(128, 1, rngs=rngs)

    def big_loss(m, batch):
        kjt, rows = batch
        reset_table_rows(m.ebc, "big", rows, KEY)
        return jnp.sum(m.head(m.ebc(kjt).values()))

    opt = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Big(nnx.Rngs(0))))
    state = jax.eval_shape(lambda: train.init_train_state(Big(nnx.Rngs(0)), opt)[1])
    kjt = jr.KeyedJaggedTensor(
        ["f"],
        jnp.zeros(4096 * 20, jnp.int32),
        lengths=jnp.full((4096,), 20),
        capacities=(4096 * 20,),
    )
    rows = jnp.zeros((1024,), jnp.int32)
    step = train.make_train_step(graphdef, opt, big_loss, skip_nonfinite=skip_nonfinite)
    mem = step.lower(state, (kjt, rows)).compile().memory_analysis()
    table_bytes = 4_000_000 * 128 * 4
    assert mem.temp_size_in_bytes < table_bytes / 8, mem
    assert mem.alias_size_in_bytes >= table_bytes + 4_000_000 * 4, mem


def test_outside_collection_is_refused_in_the_step():
    """A collection the step does not own cannot be looked up in it (its rows would not train)."""
    opt = OPTIMIZERS["rowwise_adagrad"]()
    graphdef, state = train.init_train_state(ResetModel(rngs=nnx.Rngs(0)), opt)
    outside = jr.EmbeddingBagCollection(bag_tables(), rngs=nnx.Rngs(1))
    kjt, y = random_batch(np.random.default_rng(2))

    def lookup(model, batch):
        return jnp.mean(outside(batch[0]).values())

    with pytest.raises(ValueError, match="EmbeddingBagCollection was called inside a train step"):
        train.make_train_step(graphdef, opt, lookup)(state, (kjt, y, no_resets()))
