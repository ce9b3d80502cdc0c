"""SimpleDeepFMNN against TorchRec, and trained with make_train_step."""

import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from model_inputs import (
    DENSE,
    KEYS,
    abstract,
    arrays,
    check_train_step,
    jax_batch,
    tables,
)
from torchrec_helpers import (
    assert_close,
    jit_call,
    needs_torchrec,
    numpy_weights,
    randomize,
    to_torch,
    torch_kjt,
    torch_tables,
)

import jaxrec as jr
from jaxrec import models


def build():
    ebc = jr.EmbeddingBagCollection(tables(), rngs=nnx.Rngs(0))
    return models.SimpleDeepFMNN(
        DENSE, ebc, hidden_layer_size=7, deep_fm_dimension=3, rngs=nnx.Rngs(1)
    )


def test_simple_deepfm_matches_torchrec():
    _, torchrec = needs_torchrec()
    from torchrec.models.deepfm import SimpleDeepFMNN

    ebc = torchrec.EmbeddingBagCollection(tables=torch_tables(tables()))
    theirs = randomize(SimpleDeepFMNN(DENSE, ebc, hidden_layer_size=7, deep_fm_dimension=3))
    ours = abstract(build)
    assert sorted(models.torchrec_keys(ours)) == sorted(theirs.state_dict())
    models.load_torchrec_state_dict(ours, theirs.state_dict())
    dense, values, lengths, _ = arrays(seed=4)
    got = jit_call(ours, dense, jr.KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths))
    want = theirs(to_torch(dense), torch_kjt(KEYS, values, lengths)).detach().numpy()
    assert got.shape == (6, 1) and bool(jnp.all((got > 0) & (got < 1)))  # probabilities
    assert_close(got, want)


def test_simple_deepfm_train_step():
    def bce_on_probabilities(model, batch):
        dense, kjt, labels = batch
        p = jnp.clip(model(dense, kjt)[:, 0], 1e-7, 1 - 1e-7)
        return optax.losses.sigmoid_binary_cross_entropy(jnp.log(p) - jnp.log1p(-p), labels).mean()

    check_train_step(numpy_weights(build), bce_on_probabilities, [jax_batch(1), jax_batch(2)])


def test_simple_deepfm_requires_one_dim():
    mixed = [*tables(), jr.EmbeddingBagConfig(name="t3", embedding_dim=8, num_embeddings=4)]
    with pytest.raises(ValueError, match="same dimension"):
        nnx.eval_shape(
            lambda: models.SimpleDeepFMNN(
                DENSE, jr.EmbeddingBagCollection(mixed, rngs=nnx.Rngs(0)), 4, 2, rngs=nnx.Rngs(0)
            )
        )
