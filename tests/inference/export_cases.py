"""Shared small DLRM and batches for the export and serving tests."""

import os

import numpy as np
from flax import nnx

from jaxrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from jaxrec.models import DLRM

KEYS = ("f0", "f1", "f2")
ROWS = (50, 30, 20)
MAX_IDS = 3
NUM_DENSE = 4
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_model():
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n, feature_names=[k])
        for i, (k, n) in enumerate(zip(KEYS, ROWS, strict=True))
    ]
    ebc = EmbeddingBagCollection(tables, rngs=nnx.Rngs(0))
    return DLRM(
        ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[8, 1],
        rngs=nnx.Rngs(1),
    )


def make_batch(b, seed=0):
    """``(dense, kjt, raw dict)``: up to MAX_IDS ids per sample, some empty bags."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, MAX_IDS + 1, (len(KEYS), b))
    raw = {
        k: [rng.integers(0, ROWS[i], n).tolist() for n in lengths[i]] for i, k in enumerate(KEYS)
    }
    values = np.concatenate([np.concatenate([[], *raw[k]]) for k in KEYS]).astype(np.int32)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        list(KEYS), values, lengths.reshape(-1), capacities=b * MAX_IDS
    )
    dense = rng.standard_normal((b, NUM_DENSE)).astype(np.float32)
    return dense, kjt, raw
