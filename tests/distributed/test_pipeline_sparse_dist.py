"""TrainPipelineSparseDist (ids distributed a step ahead) against the plain train step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import batches, tables
from test_sharded_ec import ec_tables

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer


class PooledAndSequence(nnx.Module):
    """A sharded EmbeddingBagCollection and EmbeddingCollection reading one batch."""

    def __init__(self, *, rngs):
        self.ebc = jr.EmbeddingBagCollection([tables()[0], tables()[2]], rngs=nnx.Rngs(0))
        self.ec = jr.EmbeddingCollection([ec_tables()[0]], rngs=nnx.Rngs(2))
        self.head = nnx.Linear(24, 1, rngs=rngs)

    def __call__(self, kjt):
        seq = sum(jnp.sum(jt.values()) for jt in self.ec(kjt).values())
        return jnp.tanh(self.head(self.ebc(kjt).values())[:, 0] + 0.01 * seq)


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


# Pooled: a row-wise table (50 rows over 8 ranks, read by two features) and a
# table-wise one; sequence: a row-wise table.
PLAN = {"t1": d.row_wise(), "t3": d.table_wise(3)}
EC_PLAN = {"t1": d.row_wise()}


def _setup(make, **kwargs):
    """Capacity 2: most ids take the exact overflow rounds."""
    model = PooledAndSequence(rngs=nnx.Rngs(1))
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    plan = d.ShardingPlan(
        {
            k: d.construct_module_sharding_plan(getattr(model, k), p, world_size=8, local_size=8)
            for k, p in (("ebc", PLAN), ("ec", EC_PLAN))
        }
    )
    model = d.DistributedModelParallel(model, plan, mesh, capacity=2)
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(model, opt)
    return make(graphdef, opt, loss_fn, skip_nonfinite=True, **kwargs), state, graphdef, mesh


def _host_batches():
    rng = np.random.default_rng(0)
    out = [[jax.tree.map(np.asarray, b) for b in batches(rng)[0]] for _ in range(3)]
    out[1][5] = (out[1][5][0], np.full_like(out[1][5][1], np.nan))  # a skipped step
    return out


def test_sparse_dist_pipeline_equals_plain_steps():
    """Losses and every piece of state (tables, optimizer states, dense params, overflow
    counts) equal the plain step's, bit for bit: the same ids reach the same shards and
    the same update runs, only round 0's all_to_all moved one step earlier. Covers the
    exact overflow rounds (taken in the consuming step), a skipped step (the ids that
    arrived ahead are masked), the first batch's priming and the last one's draining."""
    data = _host_batches()
    step, state, _, mesh = _setup(train.make_train_step)
    want = []
    for local in data:
        state, loss, _ = step(state, d.shard_batch(local, mesh))
        want.append(float(loss))
    assert step.skipped_steps() == 1

    p_step, p_state, graphdef, mesh = _setup(train.make_sparse_dist_train_step)
    pipeline = train.TrainPipelineSparseDist(p_step, p_state, mesh=mesh)
    it, got = iter(data), []
    while True:
        try:
            got.append(float(pipeline.progress(it)[0]))
        except StopIteration:
            break
    np.testing.assert_array_equal(got, want)
    assert pipeline.skipped_steps() == 1
    assert p_step.jitted._cache_size() == 1  # the drain reuses the one program
    for a, b in zip(jax.tree.leaves(pipeline.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    model = train.merge_model(graphdef, pipeline.state)
    assert int(model.ebc.overflow_count.get_value().sum()) > 0  # the overflow rounds ran
    assert int(model.ec.overflow_count.get_value().sum()) > 0

    # The step reads the ids it is handed (not a round 0 of its own): another batch's
    # ids change the loss.
    b0, b2 = (d.shard_batch(data[i], mesh) for i in (0, 2))
    copy = lambda: jax.tree.map(jnp.copy, pipeline.state)  # the step donates it
    right = p_step.jitted(copy(), p_step.input_dist(pipeline.state, b2), b2, b2)[1]
    wrong = p_step.jitted(copy(), p_step.input_dist(pipeline.state, b0), b2, b2)[1]
    assert float(right) != float(wrong)


def test_ids_that_depend_on_model_state_are_refused():
    """Ids a parameter changes before the sharded lookup would be sent with the previous
    step's parameters: the pipelined step refuses them when it traces."""

    def shifted_loss(model, batch):  # the shift is 0, but it is read from a parameter
        kjt, y = batch
        shift = (model.head.bias[...][0] > 1e30).astype(kjt.values().dtype)
        (values, lengths, weights), aux = kjt.tree_flatten()
        kjt = jr.KeyedJaggedTensor.from_parts(
            aux[0], values + shift, lengths, weights, capacities=aux[1], stride=aux[2]
        )
        return loss_fn(model, (kjt, y))

    _, state, graphdef, mesh = _setup(train.make_train_step)
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    p_step = train.make_sparse_dist_train_step(graphdef, opt, shifted_loss)
    batch = d.shard_batch(_host_batches()[0], mesh)
    with pytest.raises(ValueError, match=r"\['ebc', 'ec'\] depend on the model's state"):
        jax.eval_shape(p_step.input_dist, state, batch)
