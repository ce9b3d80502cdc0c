"""Tables, batches and a train-step check shared by the model tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from torchrec_helpers import jax_kjt, random_kjt_arrays

import jaxrec as jr
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

B, DENSE, D = 6, 5, 4
KEYS = ["f1", "f2", "f3"]
ROWS = {"f1": 20, "f2": 12, "f3": 12}
CAPACITY = 32  # per key: every batch of B bags of <= 4 ids fits, so one compilation


def tables(dim=D):
    """t1 reads f1; t2 (MEAN) reads f2 and f3: two features of one table."""
    return [
        jr.EmbeddingBagConfig(
            name="t1", embedding_dim=dim, num_embeddings=20, feature_names=["f1"]
        ),
        jr.EmbeddingBagConfig(
            name="t2",
            embedding_dim=dim,
            num_embeddings=12,
            feature_names=["f2", "f3"],
            pooling=jr.PoolingType.MEAN,
        ),
    ]


def arrays(seed=0, keys=KEYS, rows=ROWS):
    """``(dense, values, lengths, labels)`` numpy, TorchRec layout, with empty bags."""
    rng = np.random.default_rng(seed)
    values, lengths = random_kjt_arrays(rng, keys, rows, B)
    dense = rng.normal(size=(B, DENSE)).astype(np.float32)
    labels = (rng.random(B) < 0.5).astype(np.float32)
    return dense, values, lengths, labels


def jax_batch(seed=0, keys=KEYS, rows=ROWS):
    dense, values, lengths, labels = arrays(seed, keys, rows)
    return (
        jnp.asarray(dense),
        jax_kjt(keys, values, lengths, capacity=CAPACITY),
        jnp.asarray(labels),
    )


def check_train_step(model, loss_fn, batches):
    """One train step per batch: finite loss, parameters and tables change and stay
    finite, and batches of one capacity bucket trace the step once."""
    traces = []

    def counted(m, b):
        traces.append(1)
        return loss_fn(m, b)

    opt = CombinedOptimizer(optax.adam(1e-2), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(model, opt)
    before = jax.tree.map(np.array, (state.params, state.tables))
    step = train.make_train_step(graphdef, opt, counted)
    state, loss, _ = step(state, batches[0])
    per_trace = len(traces)
    for b in batches[1:]:
        state, loss, _ = step(state, b)
    assert len(traces) == per_trace, "a batch of the same capacity bucket retraced the step"
    after = jax.tree.map(np.asarray, (state.params, state.tables))
    assert np.isfinite(float(loss))
    for a in jax.tree.leaves(after):
        assert np.all(np.isfinite(a))
    changed = [
        not np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    ]
    assert all(changed), "some parameter or table received no update"
    return train.merge_model(graphdef, state)


def abstract(build):
    """The model's structure without initialising it (its weights come from TorchRec)."""
    return nnx.eval_shape(build)
