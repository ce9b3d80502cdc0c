"""Train a small recommender with jaxrec on synthetic click data.

The model: an ``EmbeddingBagCollection`` over four sparse features (``user``,
``item``, the item's ``category`` and a multi-hot ``history`` of past items that
shares the item table) and an ``nnx`` MLP over the pooled embeddings plus four
dense features, predicting a click logit.

The data has a planted signal: clicks are drawn from a hidden logistic model
over per-user and per-item biases, a few "hot" categories, the number of hot
items in the history and a linear term in the dense features. Training uses
binary cross-entropy and ``CombinedOptimizer(optax.adam, rowwise_adagrad)``
(Adam for the MLP, FBGEMM's row-wise Adagrad for the tables, which get sparse
updates). Minibatches are built with ``KeyedJaggedTensor.from_lengths_sync``
with fixed capacities, so the step compiles once. Each epoch prints the mean
train loss and the held-out AUC (rank-based, numpy), next to the AUC of the
hidden model itself, the best any model can reach.

Run it from the repository root with jaxrec installed (``pip install -e .``);
it takes about 15 s on two CPU cores::

    python examples/train_ebc.py
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from jaxrec.embedding import CombinedOptimizer
from jaxrec.optim import rowwise_adagrad
from jaxrec.train import init_train_state, make_eval_step, make_train_step

USERS, ITEMS, CATEGORIES, DENSE = 2000, 1000, 20, 4
MAX_HISTORY = 8
BATCH, EPOCHS = 512, 5
KEYS = ["user", "item", "category", "history"]
CAPACITIES = [BATCH, BATCH, BATCH, BATCH * MAX_HISTORY]  # fixed: one compilation


def make_data(n: int, truth: dict, rng: np.random.Generator) -> dict:
    """``n`` impressions with clicks drawn from the hidden logistic model ``truth``."""
    item = rng.integers(0, ITEMS, n)
    hist_len = rng.integers(0, MAX_HISTORY + 1, n)
    history = rng.integers(0, ITEMS, hist_len.sum())
    data = {
        "user": rng.integers(0, USERS, n),
        "item": item,
        "category": truth["category_of"][item],
        "hist_len": hist_len,
        "history": history,
        "dense": rng.standard_normal((n, DENSE)).astype(np.float32),
    }
    owner = np.repeat(np.arange(n), hist_len)  # the impression each history id belongs to
    hot_in_history = np.bincount(owner, weights=truth["hot_item"][history], minlength=n)
    logit = (
        truth["user_bias"][data["user"]]
        + truth["item_bias"][item]
        + truth["category_bias"][data["category"]]
        + 0.5 * hot_in_history
        + data["dense"] @ truth["dense_w"]
        - 1.0
    )
    data["logit"] = logit
    data["label"] = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return data


def batches(data: dict, rng: np.random.Generator | None = None):
    """``(kjt, dense, labels)`` minibatches of ``BATCH`` rows (the remainder is dropped)."""
    n = len(data["label"])
    order = rng.permutation(n) if rng is not None else np.arange(n)
    starts = np.concatenate([[0], np.cumsum(data["hist_len"])])
    for lo in range(0, n - BATCH + 1, BATCH):
        idx = order[lo : lo + BATCH]
        hist = [data["history"][starts[i] : starts[i + 1]] for i in idx]
        values = np.concatenate(
            [data["user"][idx], data["item"][idx], data["category"][idx], *hist]
        )
        lengths = np.concatenate([np.ones(3 * BATCH, np.int32), data["hist_len"][idx]])
        kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, capacities=CAPACITIES)
        yield kjt, jnp.asarray(data["dense"][idx]), jnp.asarray(data["label"][idx])


class Recommender(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        tables = [
            EmbeddingBagConfig(
                name="users", num_embeddings=USERS, embedding_dim=16, feature_names=["user"]
            ),
            EmbeddingBagConfig(
                name="items",
                num_embeddings=ITEMS,
                embedding_dim=16,
                feature_names=["item", "history"],
            ),
            EmbeddingBagConfig(
                name="categories",
                num_embeddings=CATEGORIES,
                embedding_dim=8,
                feature_names=["category"],
            ),
        ]
        self.ebc = EmbeddingBagCollection(tables, rngs=rngs)
        width = sum(t.embedding_dim * len(t.feature_names) for t in tables) + DENSE
        self.mlp = nnx.Sequential(
            nnx.Linear(width, 64, rngs=rngs),
            nnx.relu,
            nnx.Linear(64, 32, rngs=rngs),
            nnx.relu,
            nnx.Linear(32, 1, rngs=rngs),
        )

    def __call__(self, kjt: KeyedJaggedTensor, dense: jax.Array) -> jax.Array:
        pooled = self.ebc(kjt).values()  # [B, 56]
        return self.mlp(jnp.concatenate([pooled, dense], axis=1))[:, 0]  # logits [B]


def bce(model, batch):
    kjt, dense, labels = batch
    return optax.sigmoid_binary_cross_entropy(model(kjt, dense), labels).mean()


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Rank-based (Mann-Whitney) AUC; tied scores share their average rank."""
    order = np.argsort(scores, kind="stable")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)  # 1-based average ranks
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--epochs", type=int, default=EPOCHS, help="passes over the training set")
    p.add_argument("--seed", type=int, default=0, help="data and shuffling")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(args.seed)
    truth = {
        "user_bias": rng.normal(0, 0.8, USERS),
        "item_bias": rng.normal(0, 0.8, ITEMS),
        "category_of": rng.integers(0, CATEGORIES, ITEMS),
        "category_bias": np.where(np.arange(CATEGORIES) < 3, 1.5, 0.0),  # 3 hot categories
        "hot_item": rng.random(ITEMS) < 0.1,
        "dense_w": np.array([0.8, -0.5, 0.3, 0.0]),
    }
    train, test = make_data(163_840, truth, rng), make_data(20_480, truth, rng)

    model = Recommender(rngs=nnx.Rngs(0))
    optimizer = CombinedOptimizer(optax.adam(3e-4), rowwise_adagrad(0.02))
    graphdef, state = init_train_state(model, optimizer)
    step = make_train_step(graphdef, optimizer, bce)
    predict = make_eval_step(graphdef, lambda m, b: m(b[0], b[1]))

    def evaluate(state) -> float:
        scores = np.concatenate([np.asarray(predict(state, b)) for b in batches(test)])
        return auc(test["label"][: len(scores)], scores)

    n_train, n_test = len(train["label"]), len(test["label"])
    print(f"train {n_train}, test {n_test}, click rate {train['label'].mean():.3f}")
    print(f"hidden-model AUC on test (the ceiling): {auc(test['label'], test['logit']):.4f}")
    print(f"epoch 0: test AUC {evaluate(state):.4f}")
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        losses = []
        for batch in batches(train, rng):
            state, loss, _ = step(state, batch)
            losses.append(loss)
        train_loss = float(jnp.mean(jnp.stack(losses)))
        test_auc, elapsed = evaluate(state), time.perf_counter() - start
        print(
            f"epoch {epoch}: train loss {train_loss:.4f}, test AUC {test_auc:.4f} ({elapsed:.1f} s)"
        )


if __name__ == "__main__":
    main()
