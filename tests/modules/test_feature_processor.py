"""Position-weighted feature processors and the feature-processed EBC."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from torchrec_helpers import (
    assert_close,
    jax_kjt,
    jit_call,
    needs_torchrec,
    numpy_weights,
    random_kjt_arrays,
    randomize,
    run_torch,
    to_torch,
    torch_kjt,
    torch_tables,
)

import jaxrec as jr
import jaxrec.modules as jm
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer

KEYS = ["f1", "f2"]
MAX_LEN = {"f1": 4, "f2": 3}
TABLES = [
    jr.EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=20, feature_names=["f1"]),
    jr.EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=10, feature_names=["f2"]),
]


def batch(seed=0, capacity=None):
    """Bags no longer than their feature's max length (TorchRec raises past it)."""
    rng = np.random.default_rng(seed)
    values, lengths = random_kjt_arrays(rng, KEYS, {"f1": 20, "f2": 10}, batch=5, max_len=3)
    return values, lengths, jax_kjt(KEYS, values, lengths, capacity=capacity)


def fp_ebc(collection=False, abstract=False):
    def build():
        ebc = jr.EmbeddingBagCollection(TABLES, is_weighted=True, rngs=nnx.Rngs(0))
        if collection:
            return jm.FeatureProcessedEmbeddingBagCollection(
                ebc, jm.PositionWeightedModuleCollection(MAX_LEN)
            )
        fps = {k: jm.PositionWeightedModule(n) for k, n in MAX_LEN.items()}
        return jm.FeatureProcessedEmbeddingBagCollection(ebc, fps)

    return nnx.eval_shape(build) if abstract else build()


def test_position_weighted_module_matches_torchrec():
    _, torchrec = needs_torchrec()
    from torchrec.modules.feature_processor_ import PositionWeightedModule

    theirs = randomize(PositionWeightedModule(4))
    ours = jm.PositionWeightedModule(4)
    jm.load_torchrec_state_dict(ours, theirs.state_dict())
    values, lengths = np.array([3, 1, 4, 1, 5, 9]), np.array([2, 0, 4])
    got = ours(jr.JaggedTensor(values, lengths=lengths, validate=True))
    jt = torchrec.JaggedTensor(values=to_torch(values), lengths=to_torch(lengths))
    want = run_torch(theirs, jt).weights()
    assert_close(got.weights()[:6], want.numpy())
    np.testing.assert_array_equal(got.values(), values)


@pytest.mark.parametrize("collection", [False, True])
def test_fp_ebc_matches_torchrec(collection):
    torch, torchrec = needs_torchrec()
    from torchrec.modules.feature_processor_ import (
        PositionWeightedModule,
        PositionWeightedModuleCollection,
    )
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    tebc = torchrec.EmbeddingBagCollection(tables=torch_tables(TABLES), is_weighted=True)
    fps = (
        PositionWeightedModuleCollection(MAX_LEN)
        if collection
        else {k: PositionWeightedModule(n) for k, n in MAX_LEN.items()}
    )
    theirs = randomize(FeatureProcessedEmbeddingBagCollection(tebc, fps))
    ours = fp_ebc(collection, abstract=True)
    assert sorted(jm.torchrec_keys(ours)) == sorted(theirs.state_dict())
    jm.load_torchrec_state_dict(ours, theirs.state_dict())
    values, lengths, kjt = batch()
    got = jit_call(ours, kjt)
    want = run_torch(theirs, torch_kjt(KEYS, values, lengths))
    assert got.keys() == want.keys() and got.values().shape == (5, 7)
    assert_close(got.values(), want.values().numpy())


def test_positions_past_max_length_are_truncated():
    pw = jm.PositionWeightedModule(2)
    pw.position_weight.set_value(jnp.asarray([2.0, 3.0]))
    jt = jr.JaggedTensor(np.array([1, 2, 3, 4, 0, 0]), lengths=np.array([3, 1]))
    np.testing.assert_array_equal(pw(jt).weights(), [2.0, 3.0, 0.0, 2.0, 0.0, 0.0])


class Head(nnx.Module):
    def __init__(self, *, rngs):
        self.fp_ebc = fp_ebc()
        self.head = nnx.Linear(7, 1, rngs=rngs)  # TorchRec key "head.weight" (transposed)

    def __call__(self, kjt):
        return self.head(self.fp_ebc(kjt).values())[:, 0]


def test_train_step_updates_position_weights_and_tables_like_autodiff():
    model = numpy_weights(lambda: Head(rngs=nnx.Rngs(1)))
    for k, p in model.fp_ebc._feature_processors.items():
        p.position_weight.set_value(jnp.linspace(0.5, 1.5, MAX_LEN[k]))

    def loss_fn(m, b):
        return jnp.mean((m(b[0]) - b[1]) ** 2)

    diff = nnx.Any(nnx.Param, jr.EmbeddingTable)
    y = jnp.arange(5, dtype=jnp.float32)
    _, _, kjt = batch(1, capacity=16)
    grads = nnx.jit(nnx.grad(loss_fn, argnums=nnx.DiffState(0, diff)))(model, (kjt, y))
    expect = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, diff), grads)

    opt = CombinedOptimizer(optax.sgd(0.1), optim.sgd(0.1))
    graphdef, state = train.init_train_state(model, opt)
    state, loss, _ = train.make_train_step(graphdef, opt, loss_fn)(state, (kjt, y))
    got = nnx.state(train.merge_model(graphdef, state), diff)
    jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-5, atol=1e-6), got, expect)
    pw = got["fp_ebc"]["_feature_processors"]["f1"]["position_weight"].get_value()
    assert not np.allclose(pw, np.linspace(0.5, 1.5, 4)) and np.isfinite(loss)


def test_fp_ebc_checks_its_arguments():
    ebc = jr.EmbeddingBagCollection(TABLES, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="is_weighted=True"):
        jm.FeatureProcessedEmbeddingBagCollection(ebc, {"f1": jm.PositionWeightedModule(2)})
    weighted = jr.EmbeddingBagCollection(TABLES, is_weighted=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="do not match"):
        jm.FeatureProcessedEmbeddingBagCollection(weighted, {"f1": jm.PositionWeightedModule(2)})
    with pytest.raises(ValueError, match="positive int"):
        jm.PositionWeightedModule(0)
