"""Every sharding type against the unsharded module: forward and training."""

import functools
import logging

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import PLANS, Model, batches, loss_fn, mesh_1d, mesh_2d

from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer
from jaxrec.sparse import KeyedJaggedTensor, to_id_words


def sharded_model(name, weighted=False, **kwargs):
    gens, hosts = PLANS[name]
    mesh = mesh_1d() if hosts == 1 else mesh_2d()
    model = Model(weighted, rngs=nnx.Rngs(1))
    plan = d.construct_module_sharding_plan(model.ebc, gens, world_size=8, local_size=8 // hosts)
    return d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh, **kwargs), mesh


SPARSE = {
    "adam": optim.adam(0.05),
    "rowwise_adagrad": optim.rowwise_adagrad(0.1),
    "partial_rowwise_lamb": optim.partial_rowwise_lamb(0.05),
}
STEPS = 2


@functools.cache
def reference(weighted: bool, opt_name: str):
    """Unsharded training on the global batches: forward output, losses, final state."""
    rng = np.random.default_rng(0)
    opt = CombinedOptimizer(optax.adam(0.01), SPARSE[opt_name])
    graphdef, state = train.init_train_state(Model(weighted, rngs=nnx.Rngs(1)), opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    losses, first = [], None
    for i in range(STEPS):
        _, glob = batches(rng, weighted=weighted)
        if i == 0:
            first = np.asarray(train.merge_model(graphdef, state).ebc(glob[0]).values())
        state, loss, _ = step(state, glob)
        losses.append(float(loss))
    model = train.merge_model(graphdef, state)
    params = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    return first, losses, {k: np.asarray(v) for k, v in model.ebc.state_dict().items()}, params


# Every plan trains on the statistics-sized exchange's fast path: with Adam, or with
# a row-wise optimizer where the plan splits columns (row-wise reductions across
# column shards: row-wise Adagrad on "column_wise", LAMB's row norms on
# "grid_shard"). Every type again with row-wise Adagrad and capacity=1, which forces
# the overflow path everywhere (many exchange rounds, several update passes, row
# sums across column shards within each pass): "mixed" holds row-wise, table-wise,
# column-wise and data-parallel tables, the host-based types run alone.
#
# Every type is one code path over shards (layout.py), so three Adam cases would
# repeat others and are left out, each a ~25 s compile: "column_wise" and
# "grid_shard" train with their row-wise optimizer below instead (the same layouts
# and fast path; Adam's element-wise state on narrow zero-padded column blocks is
# trained by "mixed" and "table_column_wise"); "table_wise" (whole tables on a rank,
# ranks with no shard of a group, two tables stacked in one buffer) is covered by
# "mixed" (t2 whole on rank 3, the only shard of its group), "row_wise" (t1 and t3
# stacked on every rank) and "grid_shard" (t3 whole on rank 2).
OVERFLOW_PLANS = ("mixed", "table_row_wise", "table_column_wise", "grid_shard")
ROWWISE_FAST = {"column_wise": "rowwise_adagrad", "grid_shard": "partial_rowwise_lamb"}
CASES = (
    [(name, "adam", None) for name in PLANS if name not in ("table_wise", *ROWWISE_FAST)]
    + [(name, "rowwise_adagrad", 1) for name in OVERFLOW_PLANS]
    + [(name, opt_name, None) for name, opt_name in ROWWISE_FAST.items()]
)


@pytest.mark.parametrize(("name", "opt_name", "capacity"), CASES)
def test_training_equals_unsharded(name, opt_name, capacity):
    """Forward output, losses, tables and dense params equal unsharded training.

    Row-wise optimizer state and row norms are reduced across column shards,
    so they equal unsharded training (TorchRec keeps one state per shard).
    With ``capacity=1`` most ids travel beyond the fast path: none is lost.
    """
    weighted = name in ("row_wise", "grid_shard")
    first, losses, tables_ref, params_ref = reference(weighted, opt_name)
    rng = np.random.default_rng(0)
    model, mesh = sharded_model(name, weighted, capacity=capacity)
    opt = CombinedOptimizer(optax.adam(0.01), SPARSE[opt_name])
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    for i in range(STEPS):
        local, _ = batches(rng, weighted=weighted)
        batch = d.shard_batch(local, mesh)
        if i == 0:
            out = train.merge_model(graphdef, state).ebc(batch[0]).values()
            np.testing.assert_allclose(out, first, rtol=1e-5, atol=1e-6)
        state, loss, _ = step(state, batch)
        np.testing.assert_allclose(float(loss), losses[i], rtol=1e-5)
    model = train.merge_model(graphdef, state)
    if capacity == 1:
        assert int(model.ebc.overflow_count.get_value().sum()) > 0  # the overflow path ran
    for k, v in model.ebc.state_dict().items():
        np.testing.assert_allclose(v, tables_ref[k], rtol=1e-4, atol=1e-6, err_msg=k)
    for x, y in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), params_ref, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_plan_json_roundtrip_and_print():
    model = Model(rngs=nnx.Rngs(0))
    gens, _ = PLANS["mixed"]
    plan = d.ShardingPlan({"ebc": d.construct_module_sharding_plan(model.ebc, gens, world_size=8)})
    assert d.ShardingPlan.from_json(plan.to_json()) == plan
    text = str(plan)
    assert "t1               | row_wise" in text and "rank:7" in text
    assert "t4               | data_parallel      | dense" in text


def test_drop_mode_overflow_is_counted_and_logged(caplog):
    """The opt-in drop mode ``overflow="warn"`` loses ids beyond capacity, loudly."""
    rng = np.random.default_rng(3)
    local, _ = batches(rng)
    kjts = [kjt for kjt, _ in local]
    forward = nnx.jit(lambda m, b: m.ebc(b).values())  # as in a train step
    model, mesh = sharded_model("row_wise", capacity=2, overflow="warn")
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        dropped = jax.block_until_ready(forward(model, d.shard_batch(kjts, mesh)))
    assert "input_dist dropped" in caplog.text
    assert int(model.ebc.overflow_count.get_value().sum()) > 0
    exact, mesh = sharded_model("row_wise", capacity=2)  # the default: extra rounds
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        caplog.clear()
        got = jax.block_until_ready(forward(exact, d.shard_batch(kjts, mesh)))
    assert "dropped" not in caplog.text  # at most "sent ... in extra exchange rounds"
    assert int(exact.ebc.overflow_count.get_value().sum()) > 0
    want = forward(sharded_model("row_wise", capacity=10**6)[0], d.shard_batch(kjts, mesh))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(dropped, want)


def test_drop_mode_overflow_raises_in_the_train_step():
    """``overflow="raise"``: the step that dropped ids raises, with its state."""
    rng = np.random.default_rng(3)
    local, _ = batches(rng)
    opt = CombinedOptimizer(optax.sgd(0.1), optim.sgd(0.1))
    model, mesh = sharded_model("row_wise", capacity=2, overflow="raise")
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    with pytest.raises(train.CapacityOverflowError, match="dropped \\d+ ids") as err:
        step(state, d.shard_batch(local, mesh))
    assert err.value.dropped > 0
    counts = train.merge_model(graphdef, err.value.state).ebc.overflow_count.get_value()
    assert int(counts.sum()) == err.value.dropped


def test_planned_when_no_plan_is_given():
    model = d.DistributedModelParallel(Model(rngs=nnx.Rngs(1)), None, mesh_1d())
    assert isinstance(model.ebc, d.ShardedEmbeddingBagCollection)
    assert set(model.ebc.plan) == {"t1", "t2", "t3", "t4"}


def test_bad_plans():
    model = Model(rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="tables without a sharding \\['t4'\\]"):
        d.construct_module_sharding_plan(
            model.ebc, {t: d.table_wise(0) for t in ("t1", "t2", "t3")}, world_size=8
        )
    with pytest.raises(ValueError, match="outside the world of 8"):
        d.construct_module_sharding_plan(
            model.ebc, {t: d.table_wise(9) for t in ("t1", "t2", "t3", "t4")}, world_size=8
        )
    plan = d.ShardingPlan({"nope": {}})
    with pytest.raises(ValueError, match="not embedding collections"):
        d.DistributedModelParallel(model, plan, mesh_1d())


def test_explicit_mesh_axes_are_refused():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    with pytest.raises(ValueError, match="Auto axes"):
        d.DistributedModelParallel(Model(rngs=nnx.Rngs(0)), None, mesh)


def _with_wide_id(kjt, wide: bool):
    """``kjt`` with the first id of ``f2`` made wide (``2**32 + id``: its low word is the
    old id, so a lookup that wrapped would read the old row) or, for the reference,
    ``-1`` (int32). Returns ``kjt`` unchanged when ``f2`` has no ids."""
    key = kjt.keys().index("f2")
    if int(np.asarray(kjt.lengths()).reshape(len(kjt.keys()), -1)[key].sum()) == 0:
        return kjt
    ids = np.asarray(kjt.values()).astype(np.int64)
    p = kjt.capacity_offsets()[key]
    ids[p] = 2**32 + ids[p] if wide else -1
    values = to_id_words(ids) if wide else ids.astype(np.int32)
    return KeyedJaggedTensor.from_parts(
        kjt.keys(),
        values,
        np.asarray(kjt.lengths()),
        kjt.weights_or_none(),
        capacities=kjt.capacity_per_key(),
        stride=kjt.stride(),
    )


def test_id_words_batch_equals_wide_ids_dropped():
    """Some devices' batches hold id words, the others int32 ids: ``shard_batch`` stacks
    words for all, the forward and a train step drop the wide ids (out of range)."""
    rng = np.random.default_rng(5)
    local, _ = batches(rng)
    wide_on = (0, 3, 6)
    words = [(_with_wide_id(k, True) if i in wide_on else k, y) for i, (k, y) in enumerate(local)]
    narrow = [(_with_wide_id(k, False) if i in wide_on else k, y) for i, (k, y) in enumerate(local)]
    assert sum(k.is_wide() for k, _ in words) == len(wide_on)
    model, mesh = sharded_model("row_wise")
    batch_w, batch_n = d.shard_batch(words, mesh), d.shard_batch(narrow, mesh)
    assert batch_w[0].is_wide() and batch_w[0].values().shape[-1] == 2
    forward = nnx.jit(lambda m, b: m.ebc(b).values())
    want = np.asarray(forward(model, batch_n[0]))
    np.testing.assert_array_equal(np.asarray(forward(model, batch_w[0])), want)
    assert not np.allclose(np.asarray(forward(model, d.shard_batch(local, mesh)[0])), want)
    opt = CombinedOptimizer(optax.sgd(0.1), optim.sgd(0.1))
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn, donate=False)
    state_n, loss_n, _ = step(state, batch_n)
    state_w, loss_w, _ = step(state, batch_w)
    assert float(loss_n) == float(loss_w)
    for a, b in zip(jax.tree.leaves(state_n), jax.tree.leaves(state_w), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
