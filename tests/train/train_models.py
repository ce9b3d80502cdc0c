"""Small models and batches shared by the train-step tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxrec as jr

KEYS = ["a", "b", "c", "d"]
ROWS = {"a": 30, "b": 16, "c": 12, "d": 16}  # b is read by t1 (30 rows) and t3 (16)


def bag_tables():
    """Mixed groups: t1 (d4, shared by a and b) + t3 (d4) stacked; t2 (d8, MEAN)."""
    return [
        jr.EmbeddingBagConfig(
            name="t1", embedding_dim=4, num_embeddings=30, feature_names=["a", "b"]
        ),
        jr.EmbeddingBagConfig(
            name="t2",
            embedding_dim=8,
            num_embeddings=12,
            feature_names=["c"],
            pooling=jr.PoolingType.MEAN,
        ),
        jr.EmbeddingBagConfig(
            name="t3", embedding_dim=4, num_embeddings=16, feature_names=["d", "b"]
        ),
    ]


class BagModel(nnx.Module):
    """EBC -> linear; the EBC sits one level down, as in real models."""

    def __init__(self, weighted=False, *, rngs):
        self.sparse = nnx.Dict(ebc=jr.EmbeddingBagCollection(bag_tables(), weighted, rngs=rngs))
        self.head = nnx.Linear(4 + 4 + 8 + 4 + 4, 1, rngs=rngs)

    def __call__(self, kjt):
        return self.head(self.sparse["ebc"](kjt).values())[:, 0]


class SeqModel(nnx.Module):
    """EmbeddingCollection read twice (gradients of both calls must add up)."""

    def __init__(self, *, rngs):
        self.ec = jr.EmbeddingCollection(
            [
                jr.EmbeddingConfig(
                    name="s", embedding_dim=4, num_embeddings=30, feature_names=["a", "b"]
                )
            ],
            rngs=rngs,
        )
        self.w = nnx.Param(jax.random.normal(rngs.params(), (4,)))

    def __call__(self, kjt):
        first = self.ec(kjt)
        second = self.ec(kjt)
        total = sum(jnp.sum(jt.values() @ self.w) for jt in first.values())
        return total + jnp.sum(second["b"].values() ** 2)


def random_batch(rng, batch=6, weighted=False, keys=KEYS):
    lengths, values = [], []
    for k in keys:
        for b in range(batch):
            n = 0 if b == 0 else int(rng.integers(0, 5))  # bag 0 always empty
            ids = rng.integers(0, ROWS[k], n).tolist()
            if b == 1 and n:
                ids = [ids[0]] * n  # duplicate ids in one bag
            lengths.append(n)
            values.extend(ids)
    w = rng.uniform(0.2, 2.0, len(values)).astype(np.float32) if weighted else None
    caps = {k: 32 for k in keys}
    kjt = jr.KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=w, capacities=caps)
    y = jnp.asarray(rng.normal(size=batch), jnp.float32)
    return kjt, y


def mse(model, batch):
    kjt, y = batch
    return jnp.mean((model(kjt) - y) ** 2)
