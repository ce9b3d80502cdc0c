"""The train step on id words: the same state as on the int32 batch."""

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
from jaxrec.sparse import to_id_words


def as_words(kjt, extra=None):
    """``kjt`` with its ids as id words; ``extra``: ``{position: id}`` replaces ids."""
    ids = np.asarray(kjt.values()).astype(np.int64)
    for p, x in (extra or {}).items():
        ids[p] = x
    return jr.KeyedJaggedTensor.from_parts(
        kjt.keys(),
        jnp.asarray(to_id_words(ids)),
        kjt.lengths(),
        kjt.weights_or_none(),
        capacities=kjt.capacity_per_key(),
        stride=kjt.stride(),
    )


def run(model, loss_fn, batches, sparse):
    opt = CombinedOptimizer(optax.adam(1e-2), sparse)
    graphdef, state = train.init_train_state(model, opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    losses = []
    for b in batches:
        state, loss, _ = step(state, b)
        losses.append(float(loss))
    return losses, [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("sparse", ["sgd", "rowwise_adagrad"])
def test_words_batch_trains_exactly_like_int32(weighted, sparse):
    opt = {"sgd": optim.sgd(0.1), "rowwise_adagrad": optim.rowwise_adagrad(0.1)}[sparse]
    rng = np.random.default_rng(0)
    batches = [random_batch(rng, weighted=weighted) for _ in range(3)]
    wide = [(as_words(k), y) for k, y in batches]
    assert all(k.is_wide() for k, _ in wide) and not batches[0][0].is_wide()
    model = lambda: BagModel(weighted, rngs=nnx.Rngs(0))
    losses, state = run(model(), mse, batches, opt)
    losses_w, state_w = run(model(), mse, wide, opt)
    assert losses == losses_w
    for a, b in zip(state, state_w, strict=True):
        np.testing.assert_array_equal(a, b)
    _, untrained = run(model(), mse, [], opt)
    assert any(not np.array_equal(a, b) for a, b in zip(state, untrained, strict=True))


def test_sequence_model_on_words_with_wide_ids_equals_them_dropped():
    """A wide id reads and trains nothing: the same state as the batch with its id -1."""
    rng = np.random.default_rng(1)
    kjt, _ = random_batch(rng, keys=["a", "b"])
    lengths = np.asarray(kjt.lengths())
    first = int(np.argmax(lengths > 0))  # a bag with ids: its first id goes wide
    key = first // kjt.stride()
    pos = kjt.capacity_offsets()[key] + int(lengths[key * kjt.stride() : first].sum())
    ids = np.asarray(kjt.values()).copy()
    ids[pos] = -1
    dropped = jr.KeyedJaggedTensor.from_parts(
        kjt.keys(),
        jnp.asarray(ids),
        kjt.lengths(),
        capacities=kjt.capacity_per_key(),
        stride=kjt.stride(),
    )
    loss = lambda m, b: m(b[0])
    model = lambda: SeqModel(rngs=nnx.Rngs(0))
    _, want = run(model(), loss, [(dropped,)], optim.sgd(0.1))
    _, got = run(model(), loss, [(as_words(kjt, {pos: 2**40 + 3}),)], optim.sgd(0.1))
    _, plain = run(model(), loss, [(kjt,)], optim.sgd(0.1))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(want, plain, strict=True))
