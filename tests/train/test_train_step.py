"""The sparse train step against dense autodiff, and its memory invariant."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_models import BagModel, SeqModel, mse, random_batch

import jaxrec as jr
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

LR = 0.05
MODE = [jr.BoundsCheckMode.WARNING]


def dense_sgd_step(model, loss_fn, batch, lr=LR):
    """Reference: plain autodiff through the tables (dense [rows, dim] grads) + SGD."""
    diff = nnx.Any(nnx.Param, jr.EmbeddingTable)
    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, diff))(model, batch)
    params = nnx.state(model, diff)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def snapshot(model):
    return jax.tree.map(np.array, nnx.state(model, nnx.Any(nnx.Param, jr.EmbeddingTable)))


@pytest.mark.parametrize("weighted", [False, True])
def test_sgd_step_equals_dense_autodiff(weighted):
    rng = np.random.default_rng(0)
    model = BagModel(weighted, rngs=nnx.Rngs(0))
    opt = CombinedOptimizer(optax.sgd(LR), optim.sgd(LR))
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, mse)
    for _ in range(3):
        batch = random_batch(rng, weighted=weighted)
        expect = dense_sgd_step(
            train.merge_model(graphdef, jax.tree.map(jnp.copy, state)), mse, batch
        )
        state, loss, _ = step(state, batch)
        got = snapshot(train.merge_model(graphdef, state))
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
            got,
            jax.tree.map(np.asarray, expect),
        )
        assert np.isfinite(loss)


def test_sequence_collection_called_twice():
    rng = np.random.default_rng(1)
    model = SeqModel(rngs=nnx.Rngs(0))
    opt = CombinedOptimizer(optax.sgd(LR), optim.sgd(LR))
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, lambda m, b: m(b[0]))
    batch = random_batch(rng, keys=["a", "b"])
    before = train.merge_model(graphdef, jax.tree.map(jnp.copy, state))
    expect = dense_sgd_step(before, lambda m, b: m(b[0]), batch)
    state, _, _ = step(state, batch)
    got = snapshot(train.merge_model(graphdef, state))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        got,
        jax.tree.map(np.asarray, expect),
    )


def test_untouched_rows_never_change_and_state_is_donated():
    rng = np.random.default_rng(2)
    model = BagModel(rngs=nnx.Rngs(0))
    opt = CombinedOptimizer(optax.adam(1e-2), optim.adam(0.1))
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, mse)
    kjt, y = random_batch(rng)
    before = np.array(state.tables["sparse"]["ebc"]["weights"]["fp32_d4"].get_value())
    old = state
    state, _, _ = step(state, (kjt, y))
    after = np.asarray(state.tables["sparse"]["ebc"]["weights"]["fp32_d4"].get_value())
    touched = set()
    for key, off in (("a", 0), ("b", 0), ("d", 30), ("b", 30)):
        jt = kjt[key]
        touched |= {off + int(i) for i in np.asarray(jt.values())[: int(jt.lengths().sum())]}
    untouched = sorted(set(range(46)) - touched)
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert not np.allclose(after[sorted(touched)], before[sorted(touched)])
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(old.tables["sparse"]["ebc"]["weights"]["fp32_d4"].get_value())
    count = state.opt_state.sparse["sparse/ebc/fp32_d4"].count
    assert int(count) == 1


def test_has_aux_eval_step_and_describe():
    rng = np.random.default_rng(3)
    model = BagModel(rngs=nnx.Rngs(0))
    opt = CombinedOptimizer(
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        optim.rowwise_adagrad(0.01),
        per_table={"t2": optim.sgd(0.5)},
    )
    graphdef, state = train.init_train_state(model, opt)
    groups = opt.param_groups(model, state.opt_state)
    assert groups[0]["name"] == "dense" and groups[0]["lr"] == pytest.approx(0.1)
    by_name = {g["name"]: g for g in groups}
    assert by_name["sparse.ebc.embedding_bags.t2.weight"]["optimizer"] == "EXACT_SGD"
    assert by_name["sparse.ebc.embedding_bags.t1.weight"]["optimizer"] == "EXACT_ROWWISE_ADAGRAD"
    assert "EXACT_ROWWISE_ADAGRAD" in opt.describe(model, state.opt_state)
    step = train.make_train_step(graphdef, opt, lambda m, b: (mse(m, b), {"n": 1}), has_aux=True)
    batch = random_batch(rng)
    evaluate = train.make_eval_step(graphdef, mse)
    before = evaluate(state, batch)
    state, loss, aux = step(state, batch)
    assert aux == {"n": 1} and float(loss) == pytest.approx(float(before), rel=1e-6)
    assert float(evaluate(state, batch)) < float(before)
    with pytest.raises(ValueError, match="match no table"):
        CombinedOptimizer(optax.sgd(0.1), optim.sgd(0.1), per_table={"zz": optim.sgd(1)}).init(
            model
        )


def test_mixed_optimizers_in_one_stacked_group():
    """t1 and t3 share a stacked buffer but not an optimizer."""
    rng = np.random.default_rng(4)
    model = BagModel(rngs=nnx.Rngs(0))
    opt = CombinedOptimizer(optax.sgd(0.0), optim.sgd(LR), per_table={"t3": optim.sgd(2 * LR)})
    graphdef, state = train.init_train_state(model, opt)
    assert sorted(state.opt_state.sparse) == [
        "sparse/ebc/fp32_d4",
        "sparse/ebc/fp32_d4#1",
        "sparse/ebc/fp32_d8",
    ]
    step = train.make_train_step(graphdef, opt, mse)
    batch = random_batch(rng)
    before = train.merge_model(graphdef, jax.tree.map(jnp.copy, state))
    w0 = np.array(before.sparse["ebc"].weights["fp32_d4"].get_value())
    diff = nnx.Any(nnx.Param, jr.EmbeddingTable)
    g = nnx.grad(mse, argnums=nnx.DiffState(0, diff))(before, batch)
    g = np.asarray(g["sparse"]["ebc"]["weights"]["fp32_d4"].get_value())
    state, _, _ = step(state, batch)
    w1 = np.asarray(state.tables["sparse"]["ebc"]["weights"]["fp32_d4"].get_value())
    np.testing.assert_allclose(w1[:30], w0[:30] - LR * g[:30], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(w1[30:], w0[30:] - 2 * LR * g[30:], rtol=1e-5, atol=1e-7)


def _abstract_step(dense_autodiff: bool, **step_kwargs):
    """Compiles a step for a 4M x 128 fp32 table without allocating it."""
    tables = [
        jr.EmbeddingBagConfig(
            name="big", embedding_dim=128, num_embeddings=4_000_000, feature_names=["f"]
        )
    ]

    class Big(nnx.Module):
        def __init__(self, rngs):
            self.ebc = jr.EmbeddingBagCollection(tables, rngs=rngs, bounds_check_mode=MODE[0])
            self.head = nnx.Linear(128, 1, rngs=rngs)

    opt = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1))
    abstract = nnx.eval_shape(lambda: Big(nnx.Rngs(0)))
    graphdef = nnx.graphdef(abstract)
    state = jax.eval_shape(lambda: train.init_train_state(Big(nnx.Rngs(0)), opt)[1])
    kjt = jr.KeyedJaggedTensor(
        ["f"],
        jnp.zeros(4096 * 20, jnp.int32),
        lengths=jnp.full((4096,), 20),
        capacities=(4096 * 20,),
    )

    def loss_fn(m, kjt):
        return jnp.sum(m.head(m.ebc(kjt).values()))

    if not dense_autodiff:
        step = train.make_train_step(graphdef, opt, loss_fn, **step_kwargs)
        return step.lower(state, kjt).compile()

    def dense_step(tables, state, kjt):  # plain JAX: grads through the table
        def f(tables):
            return loss_fn(nnx.merge(graphdef, state.params, tables, state.rest), kjt)

        g = jax.grad(f)(tables)
        return jax.tree.map(lambda t, d: t - 0.1 * d, tables, g)

    return jax.jit(dense_step, donate_argnums=0).lower(state.tables, state, kjt).compile()


def test_memory_invariant_no_dense_table_gradient():
    table_bytes = 4_000_000 * 128 * 4
    mem = _abstract_step(dense_autodiff=False).memory_analysis()
    # Temporaries scale with the batch (81,920 ids x 128 x 4 B = 42 MB per buffer), not the table.
    assert mem.temp_size_in_bytes < table_bytes / 8, mem
    # The table (2 GB) and the row-wise state (16 MB) are aliased input -> output: updated in place.
    assert mem.alias_size_in_bytes >= table_bytes + 4_000_000 * 4, mem
    dense = _abstract_step(dense_autodiff=True).memory_analysis()
    assert dense.temp_size_in_bytes >= table_bytes, dense  # the baseline this guards against
