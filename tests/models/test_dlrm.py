"""DLRM, DLRM_DCN and DLRM_Projection against TorchRec, and trained with make_train_step."""

import jax.numpy as jnp
import numpy as np
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

DENSE_SIZES, OVER_SIZES = [6, 4], [5, 3, 1]
VARIANTS = {
    "DLRM": {},
    "DLRM_DCN": dict(dcn_num_layers=2, dcn_low_rank_dim=3),
    "DLRM_Projection": dict(
        interaction_branch1_layer_sizes=[8, 8], interaction_branch2_layer_sizes=[6, 12]
    ),
}


def build(name, seed=0):
    ebc = jr.EmbeddingBagCollection(tables(), rngs=nnx.Rngs(seed))
    cls = getattr(models, name)
    return cls(ebc, DENSE, DENSE_SIZES, OVER_SIZES, **VARIANTS[name], rngs=nnx.Rngs(seed + 1))


def bce(model, batch):
    dense, kjt, labels = batch
    return optax.sigmoid_binary_cross_entropy(model(dense, kjt)[:, 0], labels).mean()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_dlrm_matches_torchrec(name):
    _, torchrec = needs_torchrec()
    from torchrec.models import dlrm

    ebc = torchrec.EmbeddingBagCollection(tables=torch_tables(tables()))
    theirs = getattr(dlrm, name)(ebc, DENSE, DENSE_SIZES, OVER_SIZES, **VARIANTS[name])
    randomize(theirs, scale=0.4)
    ours = abstract(lambda: build(name))
    assert sorted(models.torchrec_keys(ours)) == sorted(theirs.state_dict())
    models.load_torchrec_state_dict(ours, theirs.state_dict())
    dense, values, lengths, _ = arrays(seed=3)
    got = jit_call(ours, dense, jr.KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths))
    want = theirs(to_torch(dense), torch_kjt(KEYS, values, lengths)).detach().numpy()
    assert got.shape == (6, 1) and got.dtype == jnp.float32
    assert_close(got, want)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_dlrm_train_step(name):
    # DLRM initialises for real; the variants take numpy weights (init compiles are slow on CPU)
    model = build(name) if name == "DLRM" else numpy_weights(lambda: build(name))
    check_train_step(model, bce, [jax_batch(1), jax_batch(2)])


def test_interaction_arch_output_layout():
    f, d = 3, 2
    dense = jnp.arange(4.0).reshape(2, d)
    sparse = jnp.arange(12.0).reshape(2, f, d) / 10
    out = models.InteractionArch(f)(dense, sparse)
    assert out.shape == (2, d + f + f * (f - 1) // 2)
    combined = np.concatenate([np.asarray(dense)[:, None], np.asarray(sparse)], axis=1)
    pairs = [(i, j) for i in range(f + 1) for j in range(i + 1, f + 1)]  # row-major triu
    want = [[combined[b, i] @ combined[b, j] for i, j in pairs] for b in range(2)]
    np.testing.assert_allclose(out[:, d:], want, rtol=1e-6)


def test_dlrm_checks_its_configuration():
    ebc = nnx.eval_shape(lambda: jr.EmbeddingBagCollection(tables(), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="final dense arch layer size"):
        models.DLRM(ebc, DENSE, [6, 5], OVER_SIZES, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="OverArch must have multiple layers"):
        models.DLRM(ebc, DENSE, DENSE_SIZES, [1], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="not a multiple of embedding size"):
        models.DLRM_Projection(ebc, DENSE, DENSE_SIZES, OVER_SIZES, [8, 6], [8], rngs=nnx.Rngs(0))
    mixed = [*tables(), jr.EmbeddingBagConfig(name="t3", embedding_dim=8, num_embeddings=4)]
    with pytest.raises(ValueError, match="same dimension"):
        models.SparseArch(
            nnx.eval_shape(lambda: jr.EmbeddingBagCollection(mixed, rngs=nnx.Rngs(0)))
        )
    shared = [
        jr.EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=4, feature_names=["f"])
        for n in "ab"
    ]
    with pytest.raises(ValueError, match=r"\['f'\] are read by several"):
        models.SparseArch(
            nnx.eval_shape(lambda: jr.EmbeddingBagCollection(shared, rngs=nnx.Rngs(0)))
        )
