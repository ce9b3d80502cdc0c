"""Synthetic Criteo-like click data with a planted signal, shared by the model examples.

Each impression has ``DENSE`` dense features and the sparse features in
``FEATURES``: single ids, except ``history``, a multi-hot bag of up to
``MAX_HISTORY`` ids. Clicks are drawn from a hidden logistic model with
per-id biases, a linear term in the dense features and **pairwise
interactions**: latent vectors of (user, item), (item, site) and
(category, device) are multiplied, so models that learn feature crosses
(DLRM's dot products, DCN, FM) can beat a purely additive one. The hidden
model's own AUC on the test set is the ceiling any model can reach.

Minibatches are ``(dense, KeyedJaggedTensor, labels)`` with fixed per-key
capacities, so a train step compiles once.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from jaxrec.embedding import CombinedOptimizer
from jaxrec.optim import rowwise_adagrad
from jaxrec.train import init_train_state, make_eval_step, make_train_step

FEATURES = {"user": 2000, "item": 1000, "site": 300, "category": 50, "device": 20, "history": 1000}
DENSE, MAX_HISTORY, LATENT = 8, 5, 4
PAIRS = [("user", "item"), ("item", "site"), ("category", "device")]


def table_configs(embedding_dim: int) -> list[EmbeddingBagConfig]:
    """One table per feature, all of one dim (DLRM and DeepFM need that); MEAN for history."""
    return [
        EmbeddingBagConfig(
            name=f"t_{f}",
            embedding_dim=embedding_dim,
            num_embeddings=n,
            feature_names=[f],
            pooling=PoolingType.MEAN if f == "history" else PoolingType.SUM,
        )
        for f, n in FEATURES.items()
    ]


def make_truth(rng: np.random.Generator) -> dict:
    """The hidden model: biases, latent vectors and dense weights."""
    return {
        "bias": {f: rng.normal(0, 0.5, n) for f, n in FEATURES.items()},
        "latent": {f: rng.normal(0, 0.7, (n, LATENT)) for f, n in FEATURES.items()},
        "dense_w": rng.normal(0, 0.4, DENSE),
    }


def make_data(n: int, truth: dict, rng: np.random.Generator) -> dict:
    """``n`` impressions and their clicks (Zipf-like ids: a few are frequent)."""
    data = {}
    for f, card in FEATURES.items():
        if f != "history":
            data[f] = (
                np.minimum(rng.zipf(1.3, n) - 1, card - 1)
                if f == "item"
                else (rng.integers(0, card, n))
            )
    data["hist_len"] = rng.integers(0, MAX_HISTORY + 1, n)
    data["history"] = rng.integers(0, FEATURES["history"], data["hist_len"].sum())
    data["dense"] = rng.standard_normal((n, DENSE)).astype(np.float32)
    owner = np.repeat(np.arange(n), data["hist_len"])
    hist_bias = np.bincount(owner, truth["bias"]["history"][data["history"]], minlength=n)
    logit = hist_bias / np.maximum(data["hist_len"], 1) + data["dense"] @ truth["dense_w"] - 0.5
    for f in FEATURES:
        if f != "history":
            logit = logit + truth["bias"][f][data[f]]
    for a, b in PAIRS:
        logit = logit + np.sum(truth["latent"][a][data[a]] * truth["latent"][b][data[b]], axis=1)
    data["logit"] = logit
    data["label"] = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return data


def batches(data: dict, batch_size: int, rng: np.random.Generator | None = None):
    """``(dense [B, DENSE], kjt, labels [B])`` minibatches; the remainder is dropped."""
    keys = list(FEATURES)
    assert keys[-1] == "history"  # values below: the single-id keys, then the history bags
    caps = [batch_size * (MAX_HISTORY if k == "history" else 1) for k in keys]
    n = len(data["label"])
    order = rng.permutation(n) if rng is not None else np.arange(n)
    starts = np.concatenate([[0], np.cumsum(data["hist_len"])])
    for lo in range(0, n - batch_size + 1, batch_size):
        idx = order[lo : lo + batch_size]
        hist = [data["history"][starts[i] : starts[i + 1]] for i in idx]
        singles = [k for k in keys if k != "history"]
        values = np.concatenate([*(data[k][idx] for k in singles), *hist])
        lengths = np.concatenate(
            [np.ones(len(singles) * batch_size, np.int64), data["hist_len"][idx]]
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, capacities=caps)
        yield jnp.asarray(data["dense"][idx]), kjt, jnp.asarray(data["label"][idx])


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Rank-based (Mann-Whitney) AUC; tied scores share their average rank."""
    order = np.argsort(scores, kind="stable")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def parse_args(description: str, argv=None) -> argparse.Namespace:
    """The flags of the model examples: ``train_ctr_model``'s keyword arguments."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=1024, help="impressions per step")
    p.add_argument("--num-train", type=int, default=409_600, help="training impressions")
    p.add_argument("--num-test", type=int, default=20_480, help="held-out impressions")
    p.add_argument("--dense-lr", type=float, default=1e-3, help="Adam, for the MLPs")
    p.add_argument("--sparse-lr", type=float, default=0.05, help="row-wise Adagrad, for tables")
    return p.parse_args(argv)


def train_ctr_model(
    model: nnx.Module,
    loss_fn: Callable,
    score_fn: Callable,
    *,
    epochs: int = 3,
    batch_size: int = 1024,
    dense_lr: float = 1e-3,
    sparse_lr: float = 0.05,
    num_train: int = 409_600,
    num_test: int = 20_480,
) -> None:
    """Trains ``model`` on fresh synthetic data, printing the loss and test AUC per epoch.

    ``loss_fn(model, (dense, kjt, labels))`` is the training loss and
    ``score_fn(model, (dense, kjt, labels))`` a ``[B]`` score for AUC. Tables
    get FBGEMM's row-wise Adagrad (sparse updates), the rest Adam.
    """
    rng = np.random.default_rng(0)
    truth = make_truth(rng)
    train, test = make_data(num_train, truth, rng), make_data(num_test, truth, rng)
    optimizer = CombinedOptimizer(optax.adam(dense_lr), rowwise_adagrad(sparse_lr))
    graphdef, state = init_train_state(model, optimizer)
    step = make_train_step(graphdef, optimizer, loss_fn)
    evaluate_batch = make_eval_step(graphdef, lambda m, b: (loss_fn(m, b), score_fn(m, b)))

    def evaluate(state) -> tuple[float, float]:
        losses, scores = zip(
            *(evaluate_batch(state, b) for b in batches(test, batch_size)), strict=True
        )
        scores = np.concatenate([np.asarray(s) for s in scores])
        return float(np.mean(losses)), auc(test["label"][: len(scores)], scores)

    print(f"train {num_train}, test {num_test}, click rate {train['label'].mean():.3f}")
    print(f"hidden-model AUC on test (the ceiling): {auc(test['label'], test['logit']):.4f}")
    test_loss, test_auc = evaluate(state)
    print(f"epoch 0: test loss {test_loss:.4f}, test AUC {test_auc:.4f}")
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        losses = []
        for batch in batches(train, batch_size, rng):
            state, loss, _ = step(state, batch)
            losses.append(loss)
        train_loss = float(jnp.mean(jnp.stack(losses)))
        test_loss, test_auc = evaluate(state)
        print(
            f"epoch {epoch}: train loss {train_loss:.4f}, test loss {test_loss:.4f}, "
            f"test AUC {test_auc:.4f} ({time.perf_counter() - start:.1f} s)"
        )
    jax.block_until_ready(state)
