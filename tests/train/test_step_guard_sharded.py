"""The non-finite guard and FATAL bounds checks in a sharded (row-wise, 8 CPU devices) step."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import PLANS, Model, batches, loss_fn, mesh_1d
from test_step_guard import assert_bitwise_equal, host

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

SPARSE = {"adam": lambda: optim.adam(0.05), "rowwise_adagrad": lambda: optim.rowwise_adagrad(0.1)}
# "mixed" holds row-wise tables too: row-wise Adagrad on them is covered there.
CASES = [("row_wise", "adam"), ("mixed", "rowwise_adagrad")]


def setup(plan_name, opt_name, bounds=jr.BoundsCheckMode.WARNING, **kwargs):
    """``(mesh, initial state, step, fresh)``: ``fresh()`` builds another initial state.

    The references below train a fresh state with the same step: the sharded step
    compiles once per test (a second ``make_train_step`` would compile it again, the
    slowest part of these tests), and the same program makes a bitwise comparison fair.
    """
    mesh = mesh_1d()
    opt = CombinedOptimizer(optax.adam(0.01), SPARSE[opt_name]())

    def fresh():
        model = Model(rngs=nnx.Rngs(1))
        model.ebc.bounds_check_mode = bounds
        plan = d.construct_module_sharding_plan(model.ebc, PLANS[plan_name][0], world_size=8)
        model = d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh)
        return train.init_train_state(model, opt)

    graphdef, state = fresh()
    step = train.make_train_step(graphdef, opt, loss_fn, **kwargs)
    return mesh, state, step, lambda: fresh()[1]


def three_batches(mesh, poison):
    rng = np.random.default_rng(0)
    good1, bad, good2 = (batches(rng)[0] for _ in range(3))
    bad = poison(bad)
    return [d.shard_batch(b, mesh) for b in (good1, bad, good2)]


def nan_label(local):
    kjt, y = local[3]
    return [*local[:3], (kjt, np.where(np.arange(y.shape[0]) == 1, np.nan, y)), *local[4:]]


def bad_id(local):
    kjt, y = local[5]
    values = np.asarray(kjt.values()).copy()
    start = kjt.capacity_offsets()[kjt.keys().index("f2")]
    assert int(kjt["f2"].lengths().sum()) > 0
    values[start] = 50  # t1 has 50 rows
    kjt = jr.KeyedJaggedTensor.from_parts(
        kjt.keys(),
        jnp.asarray(values),
        kjt.lengths(),
        capacities=kjt.capacity_per_key(),
        stride=kjt.stride(),
    )
    return [*local[:5], (kjt, y), *local[6:]]


@pytest.mark.parametrize(("plan_name", "opt_name"), CASES)
def test_sharded_nan_step_changes_nothing(plan_name, opt_name):
    mesh, state, step, fresh = setup(plan_name, opt_name, skip_nonfinite=True)
    good1, bad, good2 = three_batches(mesh, nan_label)
    state, _, _ = step(state, good1)
    before = host(state)
    state, loss, _ = step(state, bad)
    assert np.isnan(float(loss))
    assert_bitwise_equal(host(state), before)
    assert step.skipped_steps() == 1
    state, _, _ = step(state, good2)
    ref = fresh()  # never sees the bad batch
    for b in (good1, good2):
        ref, _, _ = step(ref, b)
    assert step.skipped_steps() == 1  # the reference's steps were not skipped
    assert_bitwise_equal(host(state), host(ref))


def test_sharded_fatal_raises_with_the_unchanged_state():
    fatal = jr.BoundsCheckMode.FATAL
    mesh, state, step, fresh = setup("row_wise", "rowwise_adagrad", fatal)
    good1, bad, good2 = three_batches(mesh, bad_id)
    state, _, _ = step(state, good1)
    before = host(state)
    with pytest.raises(train.BoundsCheckError, match=r"1 ids out of range .*'f2'.*id 50") as err:
        step(state, bad)
    assert_bitwise_equal(host(err.value.state), before)
    state, _, _ = step(err.value.state, good2)
    ref = fresh()  # never sees the bad batch
    for b in (good1, good2):
        ref, _, _ = step(ref, b)
    assert_bitwise_equal(host(state), host(ref))
