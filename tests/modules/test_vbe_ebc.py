"""Variable batch per key (VBE): an EBC on deduplicated user features equals the
same EBC on the expanded batch, forward and through several train steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxrec as jr
from jaxrec import optim, train
from jaxrec.embedding import CombinedOptimizer
from jaxrec.sparse import KeyedJaggedTensor, dedup_features, expand_vbe

B, USERS = 32, 5  # samples per batch, distinct users among them (about 6x duplication)
ROWS = {"user_hist": 200, "user_geo": 30, "item": 100}


def tables(mean_item=False):
    return [
        jr.EmbeddingBagConfig(
            name="t_user", embedding_dim=8, num_embeddings=200, feature_names=["user_hist"]
        ),
        jr.EmbeddingBagConfig(
            name="t_geo",
            embedding_dim=8,
            num_embeddings=30,
            feature_names=["user_geo"],
            pooling=jr.PoolingType.MEAN,
        ),
        jr.EmbeddingBagConfig(
            name="t_item",
            embedding_dim=4,
            num_embeddings=100,
            feature_names=["item"],
            pooling=jr.PoolingType.MEAN if mean_item else jr.PoolingType.SUM,
        ),
    ]


def batch(rng, weighted=False, users=USERS):
    """A plain batch whose user features repeat per user (Zipf ids), its VBE twin
    (user features padded to ``USERS`` bags: one shape for every batch) and labels."""
    user_of = rng.integers(0, users, B)
    per_user = {
        k: [np.minimum(rng.zipf(1.3, rng.integers(0, 6)), ROWS[k]) - 1 for _ in range(users)]
        for k in ("user_hist", "user_geo")
    }
    bags = {k: [per_user[k][u] for u in user_of] for k in per_user}
    bags["item"] = [rng.integers(0, ROWS["item"], rng.integers(0, 4)) for _ in range(B)]
    keys = list(bags)
    # a weight per user, so that samples of one user hold equal bags
    ws = {
        k: [np.full(len(x), 1.0 + u % 3, np.float32) for x, u in zip(bags[k], user_of, strict=True)]
        for k in keys
    }
    values = np.concatenate([np.concatenate(bags[k]) for k in keys]).astype(np.int32)
    lengths = np.asarray([len(x) for k in keys for x in bags[k]], np.int32)
    weights = np.concatenate([np.concatenate(ws[k]) for k in keys]) if weighted else None
    caps = {k: 256 for k in keys}
    plain = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights, capacities=caps)
    groups = {"user_hist": user_of, "user_geo": user_of}
    vbe = dedup_features(
        plain, groups, stride_per_key={"user_hist": USERS, "user_geo": USERS}, capacities=caps
    )
    y = rng.normal(size=B).astype(np.float32)
    return plain, vbe, y


def test_dedup_layout_and_expand_roundtrip():
    plain, vbe, _ = batch(np.random.default_rng(0), weighted=True)
    assert vbe.variable_stride_per_key() and not plain.variable_stride_per_key()
    assert vbe.stride() == B and vbe.stride_per_key() == [USERS, USERS, B]
    assert vbe.lengths().shape == (2 * USERS + B,)
    back = expand_vbe(vbe, capacities=plain.capacity_per_key())
    np.testing.assert_array_equal(back.lengths(), plain.lengths())
    np.testing.assert_array_equal(back.values(), plain.values())
    np.testing.assert_array_equal(back.weights(), plain.weights())
    per_key = [int(np.asarray(vbe[k].lengths()).sum()) for k in vbe.keys()]
    np.testing.assert_array_equal(vbe.length_per_key(), per_key)


@pytest.mark.parametrize("weighted", [False, True])
def test_forward_equals_expanded_batch(weighted):
    rng = np.random.default_rng(1)
    ebc = jr.EmbeddingBagCollection(tables(mean_item=True), weighted, rngs=nnx.Rngs(0))
    plain, vbe, _ = batch(rng, weighted)
    want = ebc(plain)
    got = jax.jit(lambda k: ebc(k).values())(vbe)
    assert ebc(vbe).keys() == want.keys()
    np.testing.assert_allclose(got, want.values(), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(want.values())).sum() > 0


class Model(nnx.Module):
    def __init__(self, *, rngs):
        self.ebc = jr.EmbeddingBagCollection(tables(), rngs=nnx.Rngs(0))
        self.head = nnx.Linear(20, 1, rngs=rngs)

    def __call__(self, kjt):
        return jnp.tanh(self.head(self.ebc(kjt).values())[:, 0])


def loss_fn(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)


def run(which, steps=3):
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(Model(rngs=nnx.Rngs(1)), opt)
    step = train.make_train_step(graphdef, opt, loss_fn)
    rng, losses = np.random.default_rng(2), []
    for _ in range(steps):
        plain, vbe, y = batch(rng)
        state, loss, _ = step(state, (plain if which == "plain" else vbe, y))
        losses.append(float(loss))
    return state, losses


def test_train_steps_equal_expanded_batch():
    """Row-wise Adagrad: losses, tables, optimizer state and dense params agree."""
    ref, ref_losses = run("plain")
    got, losses = run("vbe")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_vbe_backward_runs_on_the_small_batch():
    """The tapped output (what the step differentiates) is per user, not per sample."""
    ebc = jr.EmbeddingBagCollection(tables(), rngs=nnx.Rngs(0))
    _, vbe, _ = batch(np.random.default_rng(3))
    with jr.embedding.tape.Tape(ebc) as tape:
        ebc(vbe)
    (call,) = tape.calls
    rows = sum(s.shape[0] for s in jax.tree.leaves(call.shapes))
    assert rows < len(ebc.groups) * B  # user groups hold USERS rows, not B


def test_sequence_collection_refuses_vbe():
    ec = jr.EmbeddingCollection(
        [
            jr.EmbeddingConfig(
                name="t", embedding_dim=4, num_embeddings=200, feature_names=["user_hist"]
            )
        ],
        rngs=nnx.Rngs(0),
    )
    _, vbe, _ = batch(np.random.default_rng(4))
    with pytest.raises(NotImplementedError, match="variable batch per key"):
        ec(vbe.permute([0]))


def test_a_skipped_step_on_a_vbe_batch_applies_nothing():
    """``skip_nonfinite``: a VBE batch with a NaN label leaves the state bit-identical
    (the skip masks the VBE KJT's lengths and keeps its inverse indices), a finite one
    trains."""
    opt = CombinedOptimizer(optax.adam(0.01), optim.rowwise_adagrad(0.1))
    graphdef, state = train.init_train_state(Model(rngs=nnx.Rngs(1)), opt)
    step = train.make_train_step(graphdef, opt, loss_fn, donate=False, skip_nonfinite=True)
    _, vbe, y = batch(np.random.default_rng(5))
    bad = y.copy()
    bad[0] = np.nan
    after, _, _ = step(state, (vbe, bad))
    assert step.skipped_steps() == 1
    for x, want in zip(jax.tree.leaves(after), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(x, want)
    trained, _, _ = step(state, (vbe, y))
    assert step.skipped_steps() == 1
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(trained.tables), jax.tree.leaves(state.tables), strict=True)
    ]
    assert any(changed)
