"""RandomRecDataset: TorchRec's argument rules, Zipf ids, the planted model, and convergence."""

import numpy as np
import optax
import pytest
from flax import nnx

from jaxrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from jaxrec.datasets import RandomRecDataset, prefetch, random_rec_split, zipf_ids
from jaxrec.embedding import CombinedOptimizer
from jaxrec.models import DLRM
from jaxrec.optim import rowwise_adagrad
from jaxrec.train import init_train_state, make_eval_step, make_train_step


def mann_whitney_auc(labels, scores):
    """O(P * N) pairwise AUC (ties count 1/2): independent of the library's rank version."""
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    wins = 0.0
    for chunk in np.array_split(pos, max(1, len(pos) // 500)):
        d = chunk[:, None] - neg[None, :]
        wins += (d > 0).sum() + 0.5 * (d == 0).sum()
    return wins / (len(pos) * len(neg))


def test_torchrec_defaults_and_lengths():
    d = RandomRecDataset(["a", "b"], 500, ids_per_feature=3, num_dense=2)
    assert d.num_embeddings_per_feature == [100, 100]  # TorchRec's default hash size
    b = next(d.batches(50, shuffle=False))
    # min_ids_per_feature defaults to ids_per_feature: fixed bags of 3
    assert (b.sparse_features.lengths() == 3).all()
    assert b.sparse_features.capacity_per_key() == (150, 150)
    d = RandomRecDataset(["a"], 2000, hash_size=7, num_dense=0)
    lens = np.concatenate([np.asarray(x.sparse_features.lengths()) for x in d.batches(100)])
    assert set(lens.tolist()) == {0, 1, 2}  # TorchRec: 0..2 ids when nothing is given
    assert next(d.batches(8)).dense_features.shape == (8, 0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="hash_sizes has 1 entries for 2 keys"):
        RandomRecDataset(["a", "b"], 10, hash_sizes=[5])
    with pytest.raises(ValueError, match="min ids <= max ids"):
        RandomRecDataset(["a"], 10, ids_per_features=[1], min_ids_per_features=[2])


def test_zipf_frequencies_follow_power_law():
    rng = np.random.default_rng(0)
    ids = zipf_ids(rng, 50, 400_000, 1.2)
    assert ids.min() >= 0 and ids.max() < 50
    p = (np.arange(1, 51) ** -1.2) / (np.arange(1, 51) ** -1.2).sum()
    freq = np.bincount(ids, minlength=50) / len(ids)
    assert np.all(np.abs(freq - p) < 4 * np.sqrt(p / len(ids)) + 1e-4)
    uniform = zipf_ids(rng, 10, 100_000, None)
    np.testing.assert_allclose(np.bincount(uniform) / 1e5, 0.1, atol=0.006)


@pytest.mark.parametrize("alpha", [0.6, 1.0, 1.05, 1.5])
def test_zipf_ranks_follow_the_exact_law(alpha):
    """The rejection sampler (tables past 2^22 rows) against the exact law: the
    largest gap between the sampled and true cdfs within the KS bound at 1%, on a
    small support (every rank) and through ``zipf_ids`` past the cdf path's limit
    (its head, with the normaliser summed exactly)."""
    from jaxrec.datasets.random import _CDF_MAX, zipf_ranks

    rng = np.random.default_rng(3)
    size = 400_000
    bound = 1.63 / np.sqrt(size)
    for n in (1000, _CDF_MAX + 12345):
        p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
        p /= p.sum()
        if n < _CDF_MAX:
            ranks = zipf_ranks(rng, n, size, alpha)
        else:
            ranks = zipf_ids(rng, n, size, alpha) + 1
        assert ranks.min() >= 1 and ranks.max() <= n
        head = min(n, 2000)  # past the head the cdf is within the bound of both
        f = np.bincount(np.minimum(ranks, head + 1), minlength=head + 2)[1 : head + 1] / size
        assert np.abs(np.cumsum(f) - np.cumsum(p[:head])).max() < bound


def test_deterministic_and_planted_logits_recomputed():
    kw = dict(
        keys=["u", "i", "h"],
        hash_sizes=[30, 20, 40],
        ids_per_features=[1, 1, 3],
        min_ids_per_features=[1, 1, 0],
        num_dense=3,
        alpha=1.0,
        interactions=1,
    )
    a, b = RandomRecDataset(num_samples=300, **kw), RandomRecDataset(num_samples=300, **kw)
    np.testing.assert_array_equal(a.oracle_logits, b.oracle_logits)
    np.testing.assert_array_equal(a.labels(), b.labels())
    c = RandomRecDataset(num_samples=300, manual_seed=1, **kw)
    assert not np.array_equal(a.labels(), c.labels())
    # recompute the logits from the batches with plain Python loops
    m = a.model
    batch = next(a.batches(300, shuffle=False))
    kjt = batch.sparse_features
    for r in range(0, 300, 37):
        bags = [np.asarray(kjt[k].to_dense()[r]) for k in ["u", "i", "h"]]
        logit = m.intercept + float(
            np.asarray(batch.dense_features[r], np.float64) @ m.dense_weight
        )
        for k, bag in enumerate(bags):
            logit += np.mean(m.bias[k][bag]) if len(bag) else 0.0
        la, lb = (np.mean(m.latent[k][bags[k]], axis=0) for k in (0, 1))
        logit += float(la @ lb)
        assert logit == pytest.approx(a.oracle_logits[r], abs=1e-5)
    # labels are Bernoulli(sigmoid(logit)): the planted logits predict them
    big = RandomRecDataset(num_samples=20_000, **kw)
    p = 1 / (1 + np.exp(-big.oracle_logits))
    assert abs(big.labels().mean() - p.mean()) < 0.015


def test_split_shares_the_model():
    kw = dict(keys=["a", "b"], hash_sizes=[10, 10], ids_per_features=[1, 1], num_dense=2)
    train, test = random_rec_split(500, 300, seed=3, **kw)
    np.testing.assert_array_equal(train.model.bias[0], test.model.bias[0])
    assert len(train) == 500 and len(test) == 300
    auc = test.reference_metrics()["oracle_auc"]
    assert auc == pytest.approx(mann_whitney_auc(test.labels(), test.oracle_logits))


def test_dlrm_reaches_the_planted_auc():
    """A short DLRM run gets within 0.01 of the planted model's own test AUC."""
    keys = ["user", "item", "hist", "site"]
    kw = dict(
        keys=keys,
        hash_sizes=[60, 40, 80, 20],
        ids_per_features=[1, 1, 4, 1],
        min_ids_per_features=[1, 1, 0, 1],
        num_dense=4,
        alpha=0.8,
        interactions=2,
    )
    train, test = random_rec_split(200_000, 20_000, seed=0, **kw)
    tables = [
        EmbeddingBagConfig(
            name=f"t_{k}",
            embedding_dim=8,
            num_embeddings=n,
            feature_names=[k],
            pooling=PoolingType.MEAN if k == "hist" else PoolingType.SUM,
        )
        for k, n in zip(train.keys, train.num_embeddings_per_feature, strict=True)
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables, rngs=nnx.Rngs(0)),
        dense_in_features=4,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[32, 16, 1],
        rngs=nnx.Rngs(1),
    )

    def loss_fn(m, b):
        logits = m(b.dense_features, b.sparse_features)[:, 0]
        return optax.sigmoid_binary_cross_entropy(logits, b.labels).mean()

    opt = CombinedOptimizer(optax.adam(5e-3), rowwise_adagrad(0.2))
    graphdef, state = init_train_state(model, opt)
    step = make_train_step(graphdef, opt, loss_fn)
    score = make_eval_step(graphdef, lambda m, b: m(b.dense_features, b.sparse_features)[:, 0])
    for epoch in range(6):
        for batch in prefetch(train.batches(512, seed=0, epoch=epoch)):
            state, _, _ = step(state, batch)
    scores = np.concatenate(
        [np.asarray(score(state, b)) for b in test.batches(1000, shuffle=False)]
    )
    labels = test.labels()
    oracle = mann_whitney_auc(labels, test.oracle_logits)
    trained = mann_whitney_auc(labels, scores)
    assert oracle > 0.75  # the planted signal is strong enough to matter
    assert trained > oracle - 0.01, (trained, oracle)
