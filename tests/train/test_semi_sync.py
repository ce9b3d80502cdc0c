"""The semi-synchronous step and pipeline (TorchRec's TrainPipelineSemiSync) against an
independent semi-synchronous loop: numpy lookups and row-wise Adagrad, jax.grad and optax
for the dense part; sharded (8 CPU devices) against unsharded."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import batches as sharded_batches
from sharding_cases import loss_fn as sharded_loss
from sharding_cases import mesh_1d, tables
from train_models import SeqModel, mse, random_batch

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

KEYS = ["a", "b", "c"]
TABLES = {"t0": (50, 4, ["a", "b"]), "t1": (20, 8, ["c"])}  # rows, dim, features
FEATURE_TABLE = {"a": "t0", "b": "t0", "c": "t1"}
B, STEPS, DENSE_LR, SPARSE_LR, EPS = 8, 5, 0.05, 0.5, 1e-8


class Model(nnx.Module):
    def __init__(self, *, rngs):
        configs = [
            jr.EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=dim, feature_names=f)
            for n, (r, dim, f) in TABLES.items()
        ]
        self.ebc = jr.EmbeddingBagCollection(configs, rngs=rngs)
        self.head = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, kjt):
        return jnp.tanh(self.head(self.ebc(kjt).values())[:, 0])


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def make_batches(seed=0, n=STEPS):
    """``n`` batches as ``(kjt, y)`` and as ``{feature: bags}`` for the reference. Ids are
    drawn from few rows so that consecutive batches share rows (staleness shows)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        bags = {
            k: [rng.integers(0, 6, int(rng.integers(0, 4))).tolist() for _ in range(B)]
            for k in KEYS
        }
        lengths = [len(b) for k in KEYS for b in bags[k]]
        values = [i for k in KEYS for b in bags[k] for i in b]
        kjt = jr.KeyedJaggedTensor.from_lengths_sync(
            KEYS, values, lengths, capacities={k: 4 * B for k in KEYS}
        )
        y = rng.normal(size=B).astype(np.float32)
        out.append(((kjt, jnp.asarray(y)), (bags, y)))
    return out


def _model_and_state():
    model = Model(rngs=nnx.Rngs(3))
    opt = CombinedOptimizer(optax.adam(DENSE_LR), optim.rowwise_adagrad(SPARSE_LR, eps=EPS))
    graphdef, state = train.init_train_state(model, opt)
    return model, opt, graphdef, state


def reference_losses(model, data):
    """The semi-synchronous loop written out: batch ``i + 1`` pooled from the tables before
    batch ``i``'s row-wise Adagrad update; dense head by jax.grad and optax.adam."""
    tables = {n: np.array(model.ebc.state_dict()[f"embedding_bags.{n}.weight"]) for n in TABLES}
    accum = {n: np.zeros(TABLES[n][0], np.float64) for n in TABLES}
    head = {"w": jnp.asarray(model.head.kernel[...]), "b": jnp.asarray(model.head.bias[...])}
    adam = optax.adam(DENSE_LR)
    head_state = adam.init(head)

    def pool(bags):  # [B, 16]: features a, b, c side by side, SUM pooling
        cols = [np.stack([tables[FEATURE_TABLE[k]][bag].sum(0) for bag in bags[k]]) for k in KEYS]
        return np.concatenate(cols, axis=1).astype(np.float32)

    def dense_loss(head, pooled, y):
        return jnp.mean((jnp.tanh(pooled @ head["w"] + head["b"])[:, 0] - y) ** 2)

    losses, ahead = [], pool(data[0][1][0])
    for i, (_, (bags, y)) in enumerate(data):
        pooled = ahead
        ahead = pool(data[min(i + 1, len(data) - 1)][1][0])  # before batch i's update
        loss, (g_head, g_pooled) = jax.value_and_grad(dense_loss, argnums=(0, 1))(head, pooled, y)
        losses.append(float(loss))
        updates, head_state = adam.update(g_head, head_state, head)
        head = optax.apply_updates(head, updates)
        g_pooled, col = np.asarray(g_pooled, np.float64), 0
        row_grads = {n: np.zeros(tables[n].shape) for n in TABLES}
        for k in KEYS:
            n = FEATURE_TABLE[k]
            dim = TABLES[n][1]
            for bag_i, bag in enumerate(bags[k]):
                for row in bag:
                    row_grads[n][row] += g_pooled[bag_i, col : col + dim]
            col += dim
        for n in TABLES:
            touched = np.flatnonzero(np.abs(row_grads[n]).sum(1) > 0)
            g = row_grads[n][touched]
            accum[n][touched] += (g * g).mean(1)
            step = SPARSE_LR / (np.sqrt(accum[n][touched]) + EPS)
            tables[n][touched] -= (step[:, None] * g).astype(np.float32)
    return losses, tables


def _run(pipeline, data):
    it, losses = iter(data), []
    while True:
        try:
            losses.append(float(pipeline.progress(it)[0]))
        except StopIteration:
            return losses


def test_semi_sync_pipeline_equals_reference_and_differs_from_sync():
    data = make_batches()
    model, opt, graphdef, state = _model_and_state()
    want, want_tables = reference_losses(model, data)

    step = train.make_semi_sync_train_step(graphdef, opt, loss_fn)
    pipeline = train.TrainPipelineSemiSync(step, state, to_device=lambda b: b)
    got = _run(pipeline, [b for b, _ in data])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    trained = train.merge_model(graphdef, pipeline.state)
    for n in TABLES:
        got_table = trained.ebc.state_dict()[f"embedding_bags.{n}.weight"]
        np.testing.assert_allclose(got_table, want_tables[n], rtol=1e-5, atol=1e-6)
    assert step.jitted._cache_size() == 1  # the drain reuses the one program

    _, opt, graphdef, state = _model_and_state()
    sync = train.make_train_step(graphdef, opt, loss_fn)
    sync_losses = []
    for batch, _ in data:
        state, loss, _ = sync(state, batch)
        sync_losses.append(float(loss))
    assert sync_losses[0] == pytest.approx(got[0], rel=1e-6)  # nothing stale yet
    assert np.max(np.abs(np.subtract(sync_losses[1:], got[1:]))) > 1e-4  # stale embeddings


def test_start_batch_trains_the_first_batches_synchronously():
    """``start_batch=2``: batches 0 and 1 as the synchronous step trains them, then
    semi-sync from batch 2 on (its lookup primed with the tables after batch 1)."""
    data = [b for b, _ in make_batches(seed=2)]
    _, opt, graphdef, state = _model_and_state()
    sync = train.make_train_step(graphdef, opt, loss_fn)
    want = []
    for batch in data[:2]:
        state, loss, _ = sync(state, batch)
        want.append(float(loss))
    step = train.make_semi_sync_train_step(graphdef, opt, loss_fn)
    looked_up = step.lookup(state, data[2])
    for batch, after in zip(data[2:], data[3:] + data[-1:], strict=True):
        state, loss, _, looked_up = step(state, looked_up, batch, after)
        want.append(float(loss))

    _, opt, graphdef, start = _model_and_state()
    step = train.make_semi_sync_train_step(graphdef, opt, loss_fn)
    pipeline = train.TrainPipelineSemiSync(step, start, to_device=lambda b: b, start_batch=2)
    got = _run(pipeline, data)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(pipeline.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="start_batch"):
        train.TrainPipelineSemiSync(step, start, start_batch=-1)


def test_step_by_hand_and_the_lookup_ahead():
    """``step.lookup`` is the collection's output; the step trains batch ``i`` on the
    outputs it is handed (other outputs change the loss) and returns the next ones."""
    data = [b for b, _ in make_batches(seed=1, n=2)]
    model, opt, graphdef, state = _model_and_state()
    step = train.make_semi_sync_train_step(graphdef, opt, loss_fn, donate=False)
    found = step.lookup(state, data[0])
    (looked_up,) = found.outputs
    np.testing.assert_allclose(looked_up, model.ebc(data[0][0]).values(), rtol=1e-6)
    _, loss, _, ahead = step(state, found, data[0], data[1])
    np.testing.assert_allclose(ahead.outputs[0], model.ebc(data[1][0]).values(), rtol=1e-6)
    assert float(loss) == pytest.approx(float(loss_fn(model, data[0])), rel=1e-6)
    _, other, _, _ = step(state, found._replace(outputs=[looked_up * 2.0]), data[0], data[1])
    assert float(other) != pytest.approx(float(loss), rel=1e-3)
    with pytest.raises(ValueError, match="does not match the output"):
        step(state, found._replace(outputs=[looked_up[:, :4]]), data[0], data[1])


def test_first_step_equals_sync_for_a_collection_called_twice():
    """An EmbeddingCollection (tuple outputs) called twice: two carried outputs, and with
    nothing stale yet the first step is the synchronous step, state and loss."""
    rng = np.random.default_rng(4)
    batch, after = random_batch(rng, keys=["a", "b"]), random_batch(rng, keys=["a", "b"])
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(SeqModel(rngs=nnx.Rngs(0)), opt)
    semi = train.make_semi_sync_train_step(graphdef, opt, mse, donate=False)
    found = semi.lookup(state, batch)
    assert len(found.outputs) == 2 and isinstance(found.outputs[0], tuple)
    got, got_loss, _, _ = semi(state, found, batch, after)
    want, want_loss, _ = train.make_train_step(graphdef, opt, mse, donate=False)(state, batch)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_lookup_adds_no_dense_compute():
    """The dense half of the lookup ahead is dead code: the semi-synchronous program costs
    about the synchronous one, not a second dense forward nor a second lookup."""
    data = [b for b, _ in make_batches(seed=2, n=2)]

    class Wide(Model):  # a dense part far costlier than the lookups
        def __init__(self, *, rngs):
            super().__init__(rngs=rngs)
            self.mlp = nnx.Linear(16, 512, rngs=rngs)
            self.out = nnx.Linear(512, 512, rngs=rngs)

        def __call__(self, kjt):
            return jnp.tanh(self.out(self.mlp(self.ebc(kjt).values())).sum(1))

    opt = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(Wide(rngs=nnx.Rngs(0)), opt)
    sync = train.make_train_step(graphdef, opt, loss_fn)  # donating, as in training (only lowered)
    semi = train.make_semi_sync_train_step(graphdef, opt, loss_fn)
    found = semi.lookup(state, data[0])
    sync_c = sync.lower(state, data[0]).compile()
    semi_c = semi.lower(state, found, data[0], data[1]).compile()
    dense_forward = 2 * B * 512 * 512  # the larger matmul alone
    assert semi_c.cost_analysis()["flops"] - sync_c.cost_analysis()["flops"] < dense_forward / 4
    # batch i's own lookup is dead (its bounds checks come with the carried outputs), and
    # no table is copied to keep its old value beside the in-place update
    sync_hlo, semi_hlo = sync_c.as_text(), semi_c.as_text()
    lookups = lambda hlo: len(re.findall(r"custom_call_target=\"jaxrec_kjt_embedding_bag\"", hlo))
    assert lookups(semi_hlo) == lookups(sync_hlo)
    for table in jax.tree.leaves(state.tables):
        shape = f"f32[{','.join(map(str, table.shape))}]"
        copies = [ln for ln in semi_hlo.splitlines() if shape in ln and " copy(" in ln]
        assert not copies, copies


def test_state_dependent_inputs_are_refused():
    """A feature's weights computed from a parameter would get no gradient through an
    output looked up a step ahead: refused when the step traces."""

    class Scaled(Model):
        def __init__(self, *, rngs):
            super().__init__(rngs=rngs)
            self.scale = nnx.Param(jnp.ones(()))

        def __call__(self, kjt):
            (values, lengths, _), aux = kjt.tree_flatten()
            w = jnp.full(values.shape, 1.0, jnp.float32) * self.scale[...]
            kjt = jr.KeyedJaggedTensor.from_parts(
                aux[0], values, lengths, w, capacities=aux[1], stride=aux[2]
            )
            return jnp.tanh(self.head(self.ebc(kjt).values())[:, 0])

    configs = [
        jr.EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=dim, feature_names=f)
        for n, (r, dim, f) in TABLES.items()
    ]
    model = Scaled(rngs=nnx.Rngs(0))
    model.ebc = jr.EmbeddingBagCollection(configs, is_weighted=True, rngs=nnx.Rngs(0))
    opt = CombinedOptimizer(optax.sgd(0.1), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_semi_sync_train_step(graphdef, opt, loss_fn)
    batch = make_batches(n=1)[0][0]
    with pytest.raises(ValueError, match=r"\['ebc'\].*depend on the model's state"):
        step.lookup(state, batch)


def test_needs_a_semi_sync_step():
    with pytest.raises(TypeError, match="make_semi_sync_train_step"):
        train.TrainPipelineSemiSync(train.make_train_step(None, None, None), None)


class TwoTables(nnx.Module):
    """A row-wise (shared by two features) and a table-wise table once sharded."""

    def __init__(self, *, rngs):
        self.ebc = jr.EmbeddingBagCollection([tables()[0], tables()[2]], rngs=nnx.Rngs(0))
        self.head = nnx.Linear(24, 1, rngs=rngs)

    def __call__(self, kjt):
        return jnp.tanh(self.head(self.ebc(kjt).values())[:, 0])


def test_sharded_semi_sync_equals_unsharded():
    """DistributedModelParallel on 8 CPU devices (a row-wise and a table-wise table in one
    collection): the semi-synchronous losses and trained tables equal the unsharded
    semi-synchronous pipeline's."""
    rng = np.random.default_rng(0)
    data = [sharded_batches(rng) for _ in range(3)]
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))

    graphdef, state = train.init_train_state(TwoTables(rngs=nnx.Rngs(1)), opt)
    step = train.make_semi_sync_train_step(graphdef, opt, sharded_loss)
    pipeline = train.TrainPipelineSemiSync(step, state, to_device=lambda b: b)
    want = _run(pipeline, [glob for _, glob in data])
    want_tables = train.merge_model(graphdef, pipeline.state).ebc.state_dict()

    model = TwoTables(rngs=nnx.Rngs(1))
    plan = {"t1": d.row_wise(), "t3": d.table_wise(4)}
    mesh = mesh_1d()
    plan = d.construct_module_sharding_plan(model.ebc, plan, world_size=8, local_size=8)
    model = d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh)
    s_graphdef, s_state = train.init_train_state(model, opt)
    s_step = train.make_semi_sync_train_step(s_graphdef, opt, sharded_loss)
    s_pipeline = train.TrainPipelineSemiSync(s_step, s_state, mesh=mesh)
    got = _run(s_pipeline, [[jax.tree.map(np.asarray, b) for b in local] for local, _ in data])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    got_tables = train.merge_model(s_graphdef, s_pipeline.state).ebc.state_dict()
    for k, v in want_tables.items():
        np.testing.assert_allclose(got_tables[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
