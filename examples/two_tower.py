"""Train a two-tower retrieval model with in-batch softmax, and measure recall@10.

The data: users and items have hidden taste vectors; each interaction is a
user and an item drawn from a softmax over ``taste(user) . taste(item) +
popularity(item)``. ``TwoTower`` (``jaxrec.models``, the model of TorchRec's
retrieval example) embeds users with the query tower and items with the
candidate tower (an ``EmbeddingBagCollection`` with one table each, then an
MLP per tower). It learns from positive pairs only: every other item of the
batch is a negative (``in_batch_softmax_loss``, with the logQ correction for
item popularity, which would otherwise make popular items look like
negatives too often). Retrieval is an exact top-k inner-product search
(``top_k_candidates``; TorchRec's example uses FAISS).

Each epoch prints the train loss and the recall@10 of held-out interactions,
next to random retrieval, the most-popular-items baseline and the hidden
model itself (the ceiling).

Run from the repository root (about 30 s on two CPU cores)::

    python examples/two_tower.py
"""

import argparse
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from jaxrec.embedding import CombinedOptimizer
from jaxrec.models import TwoTower, in_batch_softmax_loss, top_k_candidates
from jaxrec.optim import rowwise_adagrad
from jaxrec.train import init_train_state, make_eval_step, make_train_step

USERS, ITEMS, TASTE = 2000, 1000, 8
BATCH, EPOCHS, K, TEMPERATURE = 1024, 4, 10, 0.1


def make_world(rng):
    """Hidden tastes and popularity, and each user's item distribution ``[USERS, ITEMS]``."""
    user_taste = rng.normal(0, 1, (USERS, TASTE))
    item_taste = rng.normal(0, 1, (ITEMS, TASTE))
    popularity = rng.normal(0, 1, ITEMS)
    scores = user_taste @ item_taste.T / np.sqrt(TASTE) * 2.5 + popularity
    probs = np.exp(scores - scores.max(1, keepdims=True))
    return scores, probs / probs.sum(1, keepdims=True)


def interactions(n, probs, rng):
    """``n`` (user, item) pairs: a uniform user, an item from that user's distribution."""
    users = rng.integers(0, USERS, n)
    cdf = np.cumsum(probs, axis=1)
    items = np.concatenate(
        [
            (cdf[users[i : i + 20_000]] < rng.random((len(users[i : i + 20_000]), 1))).sum(1)
            for i in range(0, n, 20_000)
        ]
    )
    return users, np.minimum(items, ITEMS - 1)


def kjt(users, items):
    n = len(users)
    return KeyedJaggedTensor.from_lengths_sync(
        ["user", "item"],
        np.concatenate([users, items]),
        np.ones(2 * n, np.int64),
        capacities=[n, n],
    )


def recall_at_k(top, items):
    return float(np.mean([item in row for row, item in zip(top, items, strict=True)]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--epochs", type=int, default=EPOCHS, help="passes over the interactions")
    p.add_argument("--seed", type=int, default=0, help="data and shuffling")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(args.seed)
    scores, probs = make_world(rng)
    train_users, train_items = interactions(409_600, probs, rng)
    test_users, test_items = interactions(4096, probs, rng)
    freq = np.bincount(train_items, minlength=ITEMS) + 1
    log_q = np.log(freq / freq.sum()).astype(np.float32)  # in-batch sampling probability

    tables = [
        EmbeddingBagConfig(name=f"{f}_table", embedding_dim=16, num_embeddings=n, feature_names=[f])
        for f, n in (("user", USERS), ("item", ITEMS))
    ]
    model = TwoTower(
        EmbeddingBagCollection(tables, rngs=nnx.Rngs(0)), layer_sizes=[32, 16], rngs=nnx.Rngs(1)
    )

    def loss_fn(model, batch):
        features, item_log_q = batch
        query, candidate = model(features)
        return in_batch_softmax_loss(query, candidate, TEMPERATURE, item_log_q)

    optimizer = CombinedOptimizer(optax.adam(1e-3), rowwise_adagrad(0.05))
    graphdef, state = init_train_state(model, optimizer)
    step = make_train_step(graphdef, optimizer, loss_fn)
    towers = make_eval_step(graphdef, lambda m, features: m(features))

    all_items = kjt(np.arange(ITEMS) % USERS, np.arange(ITEMS))
    test_features = kjt(test_users, np.zeros_like(test_users))  # items unused for queries

    def evaluate(state) -> float:
        candidates = towers(state, all_items)[1]  # [ITEMS, 16]
        queries = towers(state, test_features)[0]  # [T, 16]
        return recall_at_k(np.asarray(top_k_candidates(queries, candidates, K)[1]), test_items)

    oracle = np.argsort(-scores[test_users], axis=1)[:, :K]
    popular = np.tile(np.argsort(-freq)[:K], (len(test_users), 1))
    print(f"{len(train_users)} training interactions, {USERS} users, {ITEMS} items")
    print(
        f"recall@{K} of held-out interactions: random {K / ITEMS:.4f}, most popular "
        f"{recall_at_k(popular, test_items):.4f}, hidden model (ceiling) "
        f"{recall_at_k(oracle, test_items):.4f}"
    )
    print(f"epoch 0: recall@{K} {evaluate(state):.4f}")
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(train_users))
        losses = []
        for lo in range(0, len(order) - BATCH + 1, BATCH):
            idx = order[lo : lo + BATCH]
            batch = kjt(train_users[idx], train_items[idx]), jnp.asarray(log_q[train_items[idx]])
            state, loss, _ = step(state, batch)
            losses.append(loss)
        train_loss = float(jnp.mean(jnp.stack(losses)))
        print(
            f"epoch {epoch}: train loss {train_loss:.4f}, recall@{K} {evaluate(state):.4f} "
            f"({time.perf_counter() - start:.1f} s)"
        )


if __name__ == "__main__":
    main()
