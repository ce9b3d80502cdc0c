"""SimpleDeepFMNN (TorchRec's ``torchrec.models.deepfm``).

The dense features are embedded into the sparse embedding space; DeepFM's deep
(MLP) and FM (second-order) interactions run over the dense embedding and every
pooled sparse embedding; a sigmoid over-arch gives a probability ``[B, 1]``.
TorchRec's ``state_dict`` keys::

    sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight
    dense_arch.model.{0,2}.{weight,bias}
    inter_arch.deep_fm.dense_module.0.{weight,bias}
    over_arch.model.0.{weight,bias}
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from ..modules.deepfm import DeepFM, FactorizationMachine
from ..modules.initializers import torch_linear
from ..sparse import KeyedJaggedTensor, KeyedTensor
from .dlrm import Pooled, check_same_dim, pooled_lookup, sparse_feature_names
from .layer_args import LayerArgs


class SparseArch(nnx.Module):
    """The pooled embeddings of every sparse feature, as a ``KeyedTensor`` ``[B, F * D]``."""

    def __init__(self, embedding_bag_collection: Pooled):
        self.embedding_bag_collection = embedding_bag_collection

    def __call__(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return pooled_lookup(self.embedding_bag_collection, features)


class DenseArch(nnx.Module):
    """``relu(Linear(relu(Linear(x))))``: ``[B, in_features] -> [B, embedding_dim]``."""

    def __init__(
        self,
        in_features: int,
        hidden_layer_size: int,
        embedding_dim: int,
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        kw = LayerArgs(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.model = nnx.Sequential(
            torch_linear(in_features, hidden_layer_size, **kw),
            jax.nn.relu,
            torch_linear(hidden_layer_size, embedding_dim, **kw),
            jax.nn.relu,
        )

    def __call__(self, features: jax.Array) -> jax.Array:
        return self.model(features)


class FMInteractionArch(nnx.Module):
    """DeepFM's deep and FM interactions over ``[dense, sparse_1, ..., sparse_F]``.

    Returns ``[B, D + deep_fm_dimension + 1]``: the dense embedding, the deep
    interaction (``relu(Linear(fm_in_features, deep_fm_dimension))`` over the
    flattened embeddings) and the FM term.

    Args:
        fm_in_features: ``D + sum of the sparse features' dims``.
        sparse_feature_names: the features to read from the ``KeyedTensor``, in order.
        deep_fm_dimension: output width of the deep interaction.
    """

    def __init__(
        self,
        fm_in_features: int,
        sparse_feature_names: Sequence[str],
        deep_fm_dimension: int,
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        self.sparse_feature_names = tuple(sparse_feature_names)
        linear = torch_linear(
            fm_in_features, deep_fm_dimension, rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )
        self.deep_fm = DeepFM(dense_module=nnx.Sequential(linear, jax.nn.relu))
        self.fm = FactorizationMachine()

    def __call__(self, dense_features: jax.Array, sparse_features: KeyedTensor) -> jax.Array:
        if not self.sparse_feature_names:
            return dense_features
        tensors = [dense_features, *(sparse_features[n] for n in self.sparse_feature_names)]
        return jnp.concatenate([dense_features, self.deep_fm(tensors), self.fm(tensors)], axis=1)


class OverArch(nnx.Module):
    """``sigmoid(Linear(in_features, 1))``: a click probability ``[B, 1]``."""

    def __init__(
        self,
        in_features: int,
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        linear = torch_linear(in_features, 1, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.model = nnx.Sequential(linear, jax.nn.sigmoid)

    def __call__(self, features: jax.Array) -> jax.Array:
        return self.model(features)


class SimpleDeepFMNN(nnx.Module):
    """A DeepFM recommender (https://arxiv.org/pdf/1703.04247.pdf), as TorchRec builds it.

    Note that, as in TorchRec, the output is already a probability (the
    over-arch ends in a sigmoid): train it with binary cross-entropy on
    probabilities, not on logits.

    Args:
        num_dense_features: dense input width.
        embedding_bag_collection: tables of one embedding dim ``D``.
        hidden_layer_size: DenseArch hidden width.
        deep_fm_dimension: width of the deep interaction.
        rngs: ``nnx.Rngs`` for the dense parameters.
        dtype, param_dtype: of the dense layers.

    Example:
        >>> model = SimpleDeepFMNN(100, ebc, hidden_layer_size=20, deep_fm_dimension=5,
        ...                        rngs=nnx.Rngs(0))
        >>> model(dense, kjt).shape
        (B, 1)
    """

    def __init__(
        self,
        num_dense_features: int,
        embedding_bag_collection: Pooled,
        hidden_layer_size: int,
        deep_fm_dimension: int,
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        embedding_dim = check_same_dim(embedding_bag_collection, "SimpleDeepFMNN")
        feature_names = sparse_feature_names(embedding_bag_collection, "SimpleDeepFMNN")
        fm_in_features = embedding_dim * (1 + len(feature_names))
        kw = LayerArgs(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.sparse_arch = SparseArch(embedding_bag_collection)
        self.dense_arch = DenseArch(num_dense_features, hidden_layer_size, embedding_dim, **kw)
        self.inter_arch = FMInteractionArch(fm_in_features, feature_names, deep_fm_dimension, **kw)
        self.over_arch = OverArch(embedding_dim + deep_fm_dimension + 1, **kw)

    def __call__(self, dense_features: jax.Array, sparse_features: KeyedJaggedTensor) -> jax.Array:
        """Probabilities ``[B, 1]`` from ``[B, num_dense_features]`` and the sparse features."""
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)
        concatenated = self.inter_arch(embedded_dense, embedded_sparse)
        return self.over_arch(concatenated)
