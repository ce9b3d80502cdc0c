"""Gradient accumulation: one accumulated step over k micro-batches equals one plain step on
their concatenation (tables, every optimizer state, dense params), sharded and unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sharding_cases import KEYS as SHARDED_KEYS
from sharding_cases import Model, batches, loss_fn, mesh_1d
from test_eviction_reset import FILL as RESET_FILL
from test_eviction_reset import ResetModel, no_resets
from test_eviction_reset import loss_fn as reset_loss
from train_models import random_batch

import jaxrec as jr
from jaxrec import distributed as d
from jaxrec import models, optim, train
from jaxrec.checkpoint import logical_state
from jaxrec.embedding import CombinedOptimizer
from jaxrec.train.accumulate import concat_bags

KEYS = ["f1", "f2", "f3"]
ROWS = {"f1": 40, "f2": 25, "f3": 60}
B, CAP, DENSE = 8, 32, 4  # per micro-batch; CAP per key
SPARSE = {"rowwise_adagrad": lambda: optim.rowwise_adagrad(0.1), "adam": lambda: optim.adam(0.05)}


def dlrm():
    tables = [
        jr.EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f1"]),
        jr.EmbeddingBagConfig(
            name="t2",
            embedding_dim=8,
            num_embeddings=25,
            feature_names=["f2"],
            pooling=jr.PoolingType.MEAN,
        ),
        jr.EmbeddingBagConfig(name="t3", embedding_dim=8, num_embeddings=60, feature_names=["f3"]),
    ]
    ebc = jr.EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
    return models.DLRM(ebc, DENSE, [16, 8], [8, 1], rngs=nnx.Rngs(1))


def zipf_bags(rng, n_bags, rows):
    """Skewed ids (a few hot rows): micro-batches share many ids."""
    return [((rng.zipf(1.3, int(rng.integers(0, 5))) - 1) % rows).tolist() for _ in range(n_bags)]


def kjt_of(bags, cap):
    lengths = [len(b) for k in KEYS for b in bags[k]]
    values = [i for k in KEYS for b in bags[k] for i in b]
    return jr.KeyedJaggedTensor.from_lengths_sync(
        KEYS, values, lengths, capacities={k: cap for k in KEYS}
    )


def micro_and_concat(rng, k):
    """``k`` micro-batches and the same data as one batch of ``k * B``."""
    micro, all_bags = [], {f: [] for f in KEYS}
    dense = rng.normal(size=(k, B, DENSE)).astype(np.float32)
    y = (rng.random((k, B)) < 0.3).astype(np.float32)
    for i in range(k):
        bags = {f: zipf_bags(rng, B, ROWS[f]) for f in KEYS}
        for f in KEYS:
            all_bags[f] += bags[f]
        micro.append((jnp.asarray(dense[i]), kjt_of(bags, CAP), jnp.asarray(y[i])))
    concat = (
        jnp.asarray(dense.reshape(k * B, DENSE)),
        kjt_of(all_bags, k * CAP),
        jnp.asarray(y.reshape(k * B)),
    )
    return micro, concat


def host(state):
    return jax.tree.map(np.asarray, state)


def assert_close(got, want, rtol=2e-5, atol=1e-6):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol), got, want)


def max_table_diff(a, b):
    return max(
        float(np.max(np.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a.tables), jax.tree.leaves(b.tables), strict=True)
    )


def bce_with_aux(reduction):
    """Per-example BCE reduced by ``reduction``; aux: the micro-batch's label sum."""

    def loss(model, batch):
        dense, kjt, y = batch
        per_example = optax.sigmoid_binary_cross_entropy(model(dense, kjt)[:, 0], y)
        return getattr(jnp, reduction)(per_example), jnp.sum(y)

    return loss


@pytest.mark.parametrize(
    ("opt_name", "k", "reduction"), [("rowwise_adagrad", 2, "sum"), ("adam", 4, "mean")]
)
def test_accumulated_step_equals_concatenated_step(opt_name, k, reduction):
    """Tables, every optimizer state and dense params after one accumulated step equal one
    plain step on the concatenated batch; k plain steps differ (so this test can fail)."""
    rng = np.random.default_rng(k)
    opt = CombinedOptimizer(optax.adam(0.01), SPARSE[opt_name]())
    graphdef, init = train.init_train_state(dlrm(), opt)
    init = host(init)
    micro, concat = micro_and_concat(rng, k)
    loss_fn = bce_with_aux(reduction)
    kw = dict(has_aux=True, donate=False, skip_nonfinite=True)
    plain = train.make_train_step(graphdef, opt, loss_fn, **kw)
    accum = train.make_accumulating_train_step(
        graphdef, opt, loss_fn, micro_batches=k, loss_reduction=reduction, **kw
    )

    want, want_loss, _ = plain(init, concat)
    got, got_loss, aux = accum(init, train.stack_micro_batches(micro))
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    assert_close(host(got), host(want), rtol=1e-4 if reduction == "sum" else 2e-5)
    np.testing.assert_array_equal(np.asarray(aux), [float(np.sum(b[2])) for b in micro])
    assert {int(s.count) for s in got.opt_state.sparse.values()} == {1}
    assert accum.skipped_steps() == 0

    if opt_name == "adam":  # k plain steps: rows in several micro-batches step several times
        seq = init
        for b in micro:
            seq, _, _ = plain(seq, b)
        assert max_table_diff(host(seq), host(want)) > 1e-3

        # one non-finite micro-batch skips the whole accumulated step (same program)
        dense, kjt, y = micro[1]
        micro[1] = (dense, kjt, y.at[3].set(jnp.nan))
        skipped, loss, _ = accum(init, train.stack_micro_batches(micro))
        assert np.isnan(float(loss))
        jax.tree.map(np.testing.assert_array_equal, host(skipped), init)
        assert accum.skipped_steps() == 1


def test_skipped_step_undoes_the_row_resets_of_every_micro_batch():
    """Micro-batch 0 re-initialises rows (as a managed-collision eviction does), micro-batch
    1 has a NaN label: the skipped step writes the reset rows back, bit for bit."""
    rng = np.random.default_rng(5)
    opt = CombinedOptimizer(optax.sgd(0.01), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(ResetModel(rngs=nnx.Rngs(0)), opt)
    init = host(state)
    resets = no_resets()
    resets["t1"] = jnp.array([3, 5, 29, RESET_FILL], jnp.int32)
    kjt, y = random_batch(rng)
    micro = [(*random_batch(rng), resets), (kjt, y.at[2].set(jnp.nan), no_resets())]
    accum = train.make_accumulating_train_step(
        graphdef, opt, reset_loss, micro_batches=2, donate=False, skip_nonfinite=True
    )
    got, loss, _ = accum(init, train.stack_micro_batches(micro))
    assert np.isnan(float(loss)) and accum.skipped_steps() == 1
    jax.tree.map(np.testing.assert_array_equal, host(got), init)
    micro[1] = (kjt, y, no_resets())  # the same step applies when every micro-batch is finite
    got, _, _ = accum(init, train.stack_micro_batches(micro))
    before, after = (x.tables["ebc"]["weights"]["fp32_d4"] for x in (init, host(got)))
    assert np.all(np.abs(after[[3, 5, 29]] - before[[3, 5, 29]]) > 0)


def test_concat_bags_equals_the_concatenated_batch():
    """The sharded merge's ragged concatenation (weighted, id words, empty bags) against
    a KJT built from the concatenated bags on the host."""
    rng = np.random.default_rng(6)
    caps = {"a": 12, "b": 9}  # bags of 0..3 ids, 3 bags per micro-batch
    micro_bags = [
        {
            f: [rng.integers(0, 2**40, int(rng.integers(0, 4))).tolist() for _ in range(3)]
            for f in caps
        }
        for _ in range(3)
    ]

    def kjt_of_bags(bags, scale):
        keys = list(caps)
        vals = [i for f in keys for b in bags[f] for i in b]
        return jr.KeyedJaggedTensor.from_lengths_sync(
            keys,
            np.asarray(vals, np.int64),
            [len(b) for f in keys for b in bags[f]],
            weights=np.arange(len(vals), dtype=np.float32) + 0.5,
            capacities={f: scale * c for f, c in caps.items()},
        )

    kjts = [kjt_of_bags(b, 1) for b in micro_bags]
    merged = concat_bags(train.stack_micro_batches(kjts))
    want = kjt_of_bags({f: [x for b in micro_bags for x in b[f]] for f in caps}, 3)
    assert merged.stride() == 9 and merged.capacity_per_key() == want.capacity_per_key()
    np.testing.assert_array_equal(merged.lengths(), want.lengths())
    for f in caps:
        for got, ref in zip(merged[f].to_dense(), want[f].to_dense(), strict=True):
            np.testing.assert_array_equal(got, ref)
        ws = [x for k in kjts for x in k[f].to_dense_weights()]
        for got, ref in zip(merged[f].to_dense_weights(), ws, strict=True):
            np.testing.assert_array_equal(got, ref)


def test_mismatched_micro_batches_are_refused():
    rng = np.random.default_rng(4)
    micro, _ = micro_and_concat(rng, 2)
    dense, kjt, y = micro[1]
    other_caps = jr.KeyedJaggedTensor.from_parts(
        kjt.keys(),
        jnp.pad(kjt.values(), (0, 3)),
        kjt.lengths(),
        capacities=(CAP + 3, CAP, CAP),
        stride=kjt.stride(),
    )
    with pytest.raises(ValueError, match="(?s)micro-batch 1 differs .* capacities and stride"):
        train.stack_micro_batches([micro[0], (dense, other_caps, y)])
    with pytest.raises(ValueError, match=r"leaf \[0\] differs in shape"):
        train.stack_micro_batches([micro[0], (dense[:4], kjt, y)])
    with pytest.raises(ValueError, match="batches is empty"):
        train.stack_micro_batches([])
    opt = CombinedOptimizer(optax.sgd(0.01), optim.sgd(0.1))
    graphdef, state = train.init_train_state(dlrm(), opt)
    loss_fn = bce_with_aux("mean")
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        train.make_accumulating_train_step(graphdef, opt, loss_fn, micro_batches=0)
    with pytest.raises(ValueError, match="loss_reduction must be 'mean' or 'sum'"):
        train.make_accumulating_train_step(
            graphdef, opt, loss_fn, micro_batches=2, loss_reduction="avg"
        )
    step = train.make_accumulating_train_step(graphdef, opt, loss_fn, micro_batches=3)
    with pytest.raises(ValueError, match="needs leading size 3"):
        step(state, train.stack_micro_batches(micro))


# ----- sharded (DMP, 8 CPU devices) against the unsharded concatenated step -----


def sharded_micro_batches(rng, k, mesh):
    """``k`` sharded weighted micro-batches and their concatenation as one unsharded batch
    (bag order does not change a step: the loss is a mean over bags)."""
    micro, bags, weights, ys = [], {f: [] for f in SHARDED_KEYS}, {f: [] for f in SHARDED_KEYS}, []
    for _ in range(k):
        local, (kjt, y) = batches(rng, weighted=True)
        micro.append(d.shard_batch(local, mesh))
        for f in SHARDED_KEYS:
            bags[f] += [x.tolist() for x in kjt[f].to_dense()]
            weights[f] += [x.tolist() for x in kjt[f].to_dense_weights()]
        ys.append(np.asarray(y))
    lengths = [len(x) for f in SHARDED_KEYS for x in bags[f]]
    values = [i for f in SHARDED_KEYS for x in bags[f] for i in x]
    w = np.asarray([i for f in SHARDED_KEYS for x in weights[f] for i in x], np.float32)
    caps = {f: 8 * k * 16 for f in SHARDED_KEYS}
    kjt = jr.KeyedJaggedTensor.from_lengths_sync(
        SHARDED_KEYS, values, lengths, weights=w, capacities=caps
    )
    return micro, (kjt, jnp.asarray(np.concatenate(ys)))


# one compile covers both: t1 and t4 row-wise (ids exchanged to every rank), t2 and t3
# table-wise on ranks 7 and 1
PLAN = {"t1": d.row_wise(), "t2": d.table_wise(7), "t3": d.table_wise(1), "t4": d.row_wise()}


def test_sharded_accumulation_equals_unsharded_concatenated():
    k, mesh = 2, mesh_1d()
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    rng = np.random.default_rng(11)
    micro, concat = sharded_micro_batches(rng, k, mesh)

    graphdef, ref = train.init_train_state(Model(weighted=True, rngs=nnx.Rngs(1)), opt)
    ref, ref_loss, _ = train.make_train_step(graphdef, opt, loss_fn)(ref, concat)
    want = logical_state(graphdef, opt, ref)

    model = Model(weighted=True, rngs=nnx.Rngs(1))
    plan = d.construct_module_sharding_plan(model.ebc, PLAN, world_size=8)
    model = d.DistributedModelParallel(model, d.ShardingPlan({"ebc": plan}), mesh)
    sgraph, state = train.init_train_state(model, opt)
    step = train.make_accumulating_train_step(sgraph, opt, loss_fn, micro_batches=k)
    state, loss, _ = step(state, train.stack_micro_batches(micro))
    got = logical_state(sgraph, opt, state)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for name, fields in want.tables.items():
        for field, v in fields.items():
            np.testing.assert_allclose(
                got.tables[name][field], v, rtol=1e-4, atol=1e-6, err_msg=f"{name}.{field}"
            )
    assert_close(got.params, want.params, rtol=1e-4)
    assert_close(got.dense_opt, want.dense_opt, rtol=1e-4)
