"""TorchRec's "Introduction to TorchRec" tutorial, rebuilt with jaxrec.

Walks through the tutorial up to "Distributed Training and Sharding", section by
section, printing what the tutorial prints:

1. Embeddings recap: ``nn.Embedding`` and ``nn.EmbeddingBag`` as jaxrec ops.
2. ``EmbeddingBagCollection`` with a product and a user table.
3. ``JaggedTensor``: one ragged feature.
4. ``KeyedJaggedTensor``: several ragged features.
5. The ``EmbeddingBagCollection`` forward pass, returning a ``KeyedTensor``.
6. jaxrec extras: a jitted forward (sparse features are pytrees) and the
   TorchRec-style ``state_dict``.

Run it from the repository root (CPU is enough), with jaxrec installed
(``pip install -e .``) or on the path (``PYTHONPATH=.``)::

    python examples/intro.py
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingTable,
    JaggedTensor,
    KeyedJaggedTensor,
    PoolingType,
)
from jaxrec.ops import pooled_lookup, sequence_lookup

# No options; parsed first so that --help answers before the walk-through runs.
argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
np.set_printoptions(precision=4, suppress=True)


def section(title: str) -> None:
    print(f"\n=== {title} ===")


# --- 1. Embeddings recap -------------------------------------------------------
section("1. Embeddings recap")

# The tutorial's torch.rand(10, 4) draw, copied so that the numbers match.
weights = jnp.array(
    [
        [0.8823, 0.9150, 0.3829, 0.9593],
        [0.3904, 0.6009, 0.2566, 0.7936],
        [0.9408, 0.1332, 0.9346, 0.5936],
        [0.8694, 0.5677, 0.7411, 0.4294],
        [0.8854, 0.5739, 0.2666, 0.6274],
        [0.2696, 0.4414, 0.2969, 0.8317],
        [0.1053, 0.2695, 0.3588, 0.1994],
        [0.5472, 0.0062, 0.9516, 0.0753],
        [0.8860, 0.5832, 0.3376, 0.8090],
        [0.5779, 0.9040, 0.5547, 0.3423],
    ]
)
print("Weights:", weights)

# jaxrec lookups take jagged input: a flat id buffer plus per-bag lengths.
# ids [[1, 3]] is one bag (batch size 1) holding two ids.
ids = jnp.array([[1, 3]])
print("Input row IDS: ", ids)
values, lengths = ids.reshape(-1), jnp.array([2])

# nn.Embedding: one row per id, [C, D]; reshape back to [batch, ids, D].
embeddings = sequence_lookup(weights, values, lengths).reshape(1, 2, 4)
print("Embedding Collection Results: ")
print(embeddings)
print("Shape: ", embeddings.shape)
assert jnp.array_equal(embeddings, weights[ids])  # the same as plain indexing

# nn.EmbeddingBag (MEAN is its default mode): one pooled row per bag, [B, D].
pooled_embeddings = pooled_lookup(weights, values, lengths, pooling=PoolingType.MEAN)
print("Embedding Bag Collection Results: ")
print(pooled_embeddings)
print("Shape: ", pooled_embeddings.shape)
print("Mean: ", jnp.mean(embeddings, axis=1))

# --- 2. EmbeddingBagCollection -------------------------------------------------
section("2. From EmbeddingBag to EmbeddingBagCollection")

ebc = EmbeddingBagCollection(
    tables=[
        EmbeddingBagConfig(
            name="product_table",
            embedding_dim=64,
            num_embeddings=4096,
            feature_names=["product"],
            pooling=PoolingType.SUM,
        ),
        EmbeddingBagConfig(
            name="user_table",
            embedding_dim=64,
            num_embeddings=4096,
            feature_names=["user"],
            pooling=PoolingType.SUM,
        ),
    ],
    rngs=nnx.Rngs(0),
)
for t in ebc.embedding_bag_configs():
    mode = t.pooling.value.lower()
    print(f"{t.name}: EmbeddingBag({t.num_embeddings}, {t.embedding_dim}, mode={mode!r})")

# --- 3. JaggedTensor -----------------------------------------------------------
section("3. JaggedTensor")

# Batch size 2: 1 id in example 1 (5), 2 ids in example 2 (7, 1).
id_list_feature_lengths = jnp.array([1, 2])
id_list_feature_values = jnp.array([5, 7, 1])

# Lengths can be converted to offsets for easy indexing of values.
id_list_feature_offsets = jnp.cumsum(id_list_feature_lengths)
print("Offsets: ", id_list_feature_offsets)
print("First Batch: ", id_list_feature_values[: id_list_feature_offsets[0]])
print(
    "Second Batch: ",
    id_list_feature_values[id_list_feature_offsets[0] : id_list_feature_offsets[1]],
)

jt = JaggedTensor(values=id_list_feature_values, lengths=id_list_feature_lengths)
print("Offsets: ", jt.offsets())
print("List of Values: ", jt.to_dense())
print(jt)

# --- 4. KeyedJaggedTensor ------------------------------------------------------
section("4. KeyedJaggedTensor")

product_jt = JaggedTensor(values=jnp.array([1, 2, 3, 1, 5, 7, 9]), lengths=jnp.array([3, 4]))
user_jt = JaggedTensor(values=jnp.array([2, 3, 4, 1]), lengths=jnp.array([2, 2]))
kjt = KeyedJaggedTensor.from_jt_dict({"product": product_jt, "user": user_jt})

# Batch size 2: products [1, 2, 3] and [1, 5, 7, 9]; users [2, 3] and [4, 1].
print("Keys: ", kjt.keys())
print("Lengths: ", kjt.lengths())
print("Values: ", kjt.values())
# to_dict gives one JaggedTensor per key: static slices of the KJT's buffers.
for key, feature in kjt.to_dict().items():
    print(f"to_dict[{key!r}]: ", feature.to_dense())
print(kjt)

# --- 5. EmbeddingBagCollection forward -----------------------------------------
section("5. EmbeddingBagCollection forward")

# The result is a KeyedTensor: [batch, 64 + 64] pooled embeddings, keyed by feature.
result = ebc(kjt)
print(result.keys())
print(result.values().shape)
for key, embedding in result.to_dict().items():
    print(key, embedding.shape)

# --- 6. jit and state_dict -----------------------------------------------------
section("6. jaxrec: jit and state_dict")

# A KeyedJaggedTensor is a pytree: its arrays are leaves and its keys and
# per-key capacities are static metadata, so it passes straight through jit.
leaves, treedef = jax.tree_util.tree_flatten(kjt)
print("KJT leaves: ", [leaf.shape for leaf in leaves])
print("KJT treedef: ", treedef)


@nnx.jit
def forward(model: EmbeddingBagCollection, features: KeyedJaggedTensor) -> jax.Array:
    print("  (tracing)", features)  # runs once per distinct static layout
    return model(features).values()


jitted = forward(ebc, kjt)
print("jit forward: ", jitted.shape, "matches eager:", bool(jnp.allclose(jitted, result.values())))

# New ids and lengths with the same per-key capacities (7, 4): no retrace.
kjt2 = KeyedJaggedTensor(
    keys=["product", "user"], values=[4, 8, 15, 16, 23, 42, 7, 1, 2, 3, 5], lengths=[5, 2, 1, 3]
)
print("second batch: ", forward(ebc, kjt2).shape)

# TorchRec-style state_dict: one [num_embeddings, embedding_dim] entry per table.
for name, weight in ebc.state_dict().items():
    print(name, weight.shape)

# The nnx state behind it: tables with the same (dim, dtype) share one stacked buffer.
for path, table in nnx.to_flat_state(nnx.state(ebc, EmbeddingTable)):
    print("nnx state:", "/".join(map(str, path)), table.shape)
