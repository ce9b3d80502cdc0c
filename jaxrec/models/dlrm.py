"""DLRM and its DCN / projection variants (TorchRec's ``torchrec.models.dlrm``).

Notation: ``B`` batch size, ``F`` sparse features, ``D`` embedding dim (one for
all tables), ``num_features`` dense features. Attribute names follow TorchRec's,
so a TorchRec DLRM ``state_dict`` imports with
:func:`jaxrec.models.load_torchrec_state_dict`::

    sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight
    dense_arch.model._mlp.<i>._linear.{weight,bias}
    inter_arch.crossnet.{W_kernels,V_kernels,bias}.<l>        (DLRM_DCN)
    inter_arch.interaction_branch{1,2}.model._mlp.<i>...      (DLRM_Projection)
    over_arch.model.0._mlp.<i>._linear.{weight,bias}, over_arch.model.1.{weight,bias}

Every model is an ``nnx.Module`` taking ``(dense_features, sparse_features)``
and works with :func:`jaxrec.train.make_train_step` (its embedding tables get
sparse updates, everything else the dense optimizer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from ..modules.crossnet import LowRankCrossNet
from ..modules.embedding_bag_collection import EmbeddingBagCollection
from ..modules.initializers import torch_linear
from ..modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from ..modules.mlp import MLP
from ..sparse import KeyedJaggedTensor, KeyedTensor
from .layer_args import LayerArgs

Pooled = EmbeddingBagCollection | ManagedCollisionEmbeddingBagCollection


def bag_collection_of(ebc: Pooled) -> EmbeddingBagCollection:
    """The EBC holding the tables (the one behind managed collision, if any)."""
    if isinstance(ebc, ManagedCollisionEmbeddingBagCollection):
        return ebc.embedding_bag_collection
    return ebc


def pooled_lookup(ebc: Pooled, features: KeyedJaggedTensor) -> KeyedTensor:
    """``ebc(features)``; a managed-collision EBC's pooled output (its remapped ids dropped)."""
    if isinstance(ebc, ManagedCollisionEmbeddingBagCollection):
        return ebc(features)[0]
    return ebc(features)


def check_same_dim(ebc: Pooled, model: str) -> int:
    """The single embedding dim of ``ebc``'s tables; error if they differ."""
    if not isinstance(ebc, Pooled):
        raise TypeError(
            f"{model} needs a jaxrec EmbeddingBagCollection (or a "
            f"ManagedCollisionEmbeddingBagCollection), got {type(ebc).__name__}"
        )
    ebc = bag_collection_of(ebc)
    dims = {t.name: t.embedding_dim for t in ebc.embedding_bag_configs()}
    if len(set(dims.values())) != 1:
        raise ValueError(f"{model}: all EmbeddingBagConfigs must have the same dimension, {dims=}")
    return next(iter(dims.values()))


def sparse_feature_names(ebc: Pooled, model: str) -> list[str]:
    """Feature names in table order; each must be read by exactly one table."""
    names = [f for t in bag_collection_of(ebc).embedding_bag_configs() for f in t.feature_names]
    shared = sorted({f for f in names if names.count(f) > 1})
    if shared:
        raise ValueError(
            f"{model} needs each feature read by one table, but {shared} are read by several "
            "(their pooled outputs would be named '<feature>@<table>')"
        )
    return names


class SparseArch(nnx.Module):
    """Pooled lookups of every sparse feature, stacked to ``[B, F, D]``.

    Args:
        embedding_bag_collection: tables of one embedding dim ``D``; a
            ``ManagedCollisionEmbeddingBagCollection`` (e.g. dynamic tables keyed
            by raw 64-bit ids) is looked up likewise (its remapped ids dropped).
    """

    def __init__(self, embedding_bag_collection: Pooled):
        self.D = check_same_dim(embedding_bag_collection, "SparseArch")
        self._sparse_feature_names = tuple(
            sparse_feature_names(embedding_bag_collection, "SparseArch")
        )
        self.F = len(self._sparse_feature_names)
        self.embedding_bag_collection = embedding_bag_collection

    @property
    def sparse_feature_names(self) -> list[str]:
        return list(self._sparse_feature_names)

    def __call__(self, features: KeyedJaggedTensor) -> jax.Array:
        """``[B, F, D]`` pooled embeddings in feature order."""
        kt = pooled_lookup(self.embedding_bag_collection, features)
        if tuple(kt.keys()) == self._sparse_feature_names:  # already in order: no copy
            values = kt.values()
        else:
            values = jnp.concatenate([kt[n] for n in self._sparse_feature_names], axis=1)
        return values.reshape(values.shape[0], self.F, self.D)


class DenseArch(nnx.Module):
    """ReLU MLP over the dense features: ``[B, num_features] -> [B, layer_sizes[-1]]``."""

    def __init__(
        self,
        in_features: int,
        layer_sizes: Sequence[int],
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        self.model = MLP(
            in_features,
            layer_sizes,
            bias=True,
            activation="relu",
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
        )

    def __call__(self, features: jax.Array) -> jax.Array:
        return self.model(features)


def _combine(dense_features: jax.Array, sparse_features: jax.Array) -> jax.Array:
    """``[B, F + 1, D]``: the dense embedding stacked in front of the sparse ones."""
    b, d = dense_features.shape
    if sparse_features.ndim != 3 or sparse_features.shape[0] != b or sparse_features.shape[2] != d:
        raise ValueError(
            f"sparse_features must be [B, F, D] = [{b}, F, {d}] to match dense_features "
            f"{dense_features.shape}; got {sparse_features.shape}"
        )
    return jnp.concatenate([dense_features[:, None, :], sparse_features], axis=1)


class InteractionArch(nnx.Module):
    """Pairwise dot products of the dense and sparse embeddings.

    Returns ``[B, D + F + F choose 2]``: the dense embedding, then the dot
    products of every pair among the ``F + 1`` embeddings (upper triangle,
    row-major, as ``torch.triu_indices(F + 1, F + 1, offset=1)``).
    """

    def __init__(self, num_sparse_features: int):
        self.F = num_sparse_features
        rows, cols = np.triu_indices(num_sparse_features + 1, k=1)
        self._triu = (tuple(rows.tolist()), tuple(cols.tolist()))

    def __call__(self, dense_features: jax.Array, sparse_features: jax.Array) -> jax.Array:
        if self.F <= 0:
            return dense_features
        combined = _combine(dense_features, sparse_features)
        interactions = jnp.einsum("bid,bjd->bij", combined, combined)
        rows, cols = (np.asarray(i) for i in self._triu)
        return jnp.concatenate([dense_features, interactions[:, rows, cols]], axis=1)


class InteractionDCNArch(nnx.Module):
    """A cross network over the flattened ``[B, (F + 1) * D]`` embeddings (DCN v2)."""

    def __init__(self, num_sparse_features: int, crossnet: Callable[[jax.Array], jax.Array]):
        self.F = num_sparse_features
        self.crossnet = crossnet

    def __call__(self, dense_features: jax.Array, sparse_features: jax.Array) -> jax.Array:
        if self.F <= 0:
            return dense_features
        combined = _combine(dense_features, sparse_features)
        return self.crossnet(combined.reshape(combined.shape[0], -1))


class InteractionProjectionArch(nnx.Module):
    """Two MLP branches projected against each other: ``[B, D + F1 * F2]``.

    Branch 1 maps the flattened ``[B, (F + 1) * D]`` embeddings to
    ``[B, F1 * D]``, branch 2 to ``[B, D * F2]``; the output is the dense
    embedding followed by the flattened ``[F1, D] @ [D, F2]`` products.
    """

    def __init__(
        self,
        num_sparse_features: int,
        interaction_branch1: Callable[[jax.Array], jax.Array],
        interaction_branch2: Callable[[jax.Array], jax.Array],
    ):
        self.F = num_sparse_features
        self.interaction_branch1 = interaction_branch1
        self.interaction_branch2 = interaction_branch2

    def __call__(self, dense_features: jax.Array, sparse_features: jax.Array) -> jax.Array:
        if self.F <= 0:
            return dense_features
        b, d = dense_features.shape
        flat = _combine(dense_features, sparse_features).reshape(b, -1)
        y = self.interaction_branch1(flat).reshape(b, -1, d)
        z = self.interaction_branch2(flat).reshape(b, d, -1)
        return jnp.concatenate([dense_features, (y @ z).reshape(b, -1)], axis=1)


class OverArch(nnx.Module):
    """ReLU MLP over ``layer_sizes[:-1]`` then a plain linear layer to ``layer_sizes[-1]``."""

    def __init__(
        self,
        in_features: int,
        layer_sizes: Sequence[int],
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        if len(layer_sizes) <= 1:
            raise ValueError(f"OverArch must have multiple layers, got {list(layer_sizes)}")
        kw = LayerArgs(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.model = nnx.Sequential(
            MLP(in_features, layer_sizes[:-1], bias=True, activation="relu", **kw),
            torch_linear(layer_sizes[-2], layer_sizes[-1], bias=True, **kw),
        )

    def __call__(self, features: jax.Array) -> jax.Array:
        return self.model(features)


class DLRM(nnx.Module):
    """The Deep Learning Recommendation Model (https://arxiv.org/abs/1906.00091).

    ``dense_arch`` embeds the dense features into the embedding space,
    ``sparse_arch`` pools one embedding per sparse feature, ``inter_arch``
    takes their pairwise dot products and ``over_arch`` maps the result to
    logits.

    Args:
        embedding_bag_collection: tables of one embedding dim ``D`` (or a
            ``ManagedCollisionEmbeddingBagCollection`` over them); each
            feature read by one table.
        dense_in_features: ``num_features``.
        dense_arch_layer_sizes: DenseArch layer sizes; the last must be ``D``.
        over_arch_layer_sizes: OverArch layer sizes (at least two; the last is
            the number of logits).
        rngs: ``nnx.Rngs`` for the dense parameters (tables were initialised
            with the collection).
        dtype, param_dtype: of the dense layers.

    Example:
        >>> ebc = EmbeddingBagCollection([
        ...     EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=100,
        ...                        feature_names=["f1"]),
        ...     EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=100,
        ...                        feature_names=["f2"])], rngs=nnx.Rngs(0))
        >>> model = DLRM(ebc, dense_in_features=100, dense_arch_layer_sizes=[20, 8],
        ...              over_arch_layer_sizes=[5, 1], rngs=nnx.Rngs(1))
        >>> kjt = KeyedJaggedTensor.from_offsets_sync(["f1", "f2"], [1, 2, 4, 5, 4, 3, 2, 9],
        ...                                           [0, 2, 4, 6, 8])
        >>> model(jnp.ones((2, 100)), kjt).shape
        (2, 1)
    """

    def __init__(
        self,
        embedding_bag_collection: Pooled,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        name = type(self).__name__
        embedding_dim = check_same_dim(embedding_bag_collection, name)
        if dense_arch_layer_sizes[-1] != embedding_dim:
            raise ValueError(
                f"embedding_bag_collection dimension ({embedding_dim}) and final dense "
                f"arch layer size ({dense_arch_layer_sizes[-1]}) must match."
            )
        kw = LayerArgs(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.sparse_arch = SparseArch(embedding_bag_collection)
        num_sparse = self.sparse_arch.F
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes, **kw)
        self.inter_arch, over_in = self._interaction(
            num_sparse, embedding_dim, dense_arch_layer_sizes, **kw
        )
        self.over_arch = OverArch(over_in, over_arch_layer_sizes, **kw)

    def _interaction(self, num_sparse: int, dim: int, dense_sizes, **kw) -> tuple[nnx.Module, int]:
        del dense_sizes, kw
        return InteractionArch(num_sparse), dim + math.comb(num_sparse, 2) + num_sparse

    def __call__(self, dense_features: jax.Array, sparse_features: KeyedJaggedTensor) -> jax.Array:
        """Logits ``[B, over_arch_layer_sizes[-1]]``.

        Args:
            dense_features: ``[B, num_features]`` float.
            sparse_features: the sparse features (batch size ``B``).
        """
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)
        concatenated = self.inter_arch(embedded_dense, embedded_sparse)
        return self.over_arch(concatenated)


class DLRM_DCN(DLRM):  # TorchRec's name
    """DLRM with a low-rank DCN v2 cross network as the interaction
    (https://arxiv.org/pdf/2008.13535.pdf); its output is ``[B, (F + 1) * D]``.

    Args:
        dcn_num_layers: cross layers.
        dcn_low_rank_dim: rank of each layer's ``W V`` factorisation.

    The other arguments are :class:`DLRM`'s.
    """

    def __init__(
        self,
        embedding_bag_collection: Pooled,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        dcn_num_layers: int,
        dcn_low_rank_dim: int,
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        self._dcn = (dcn_num_layers, dcn_low_rank_dim)
        super().__init__(
            embedding_bag_collection,
            dense_in_features,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
        )

    def _interaction(self, num_sparse: int, dim: int, dense_sizes, **kw) -> tuple[nnx.Module, int]:
        width = (num_sparse + 1) * dim
        num_layers, low_rank = self._dcn
        crossnet = LowRankCrossNet(
            width, num_layers, low_rank, rngs=kw["rngs"], param_dtype=kw["param_dtype"]
        )
        return InteractionDCNArch(num_sparse, crossnet), width


class DLRM_Projection(DLRM):  # TorchRec's name
    """DLRM whose interaction projects two MLP branches against each other.

    Args:
        interaction_branch1_layer_sizes: branch 1 DenseArch sizes; the last is
            ``F1 * D``.
        interaction_branch2_layer_sizes: branch 2 DenseArch sizes; the last is
            ``F2 * D``. The OverArch input is ``D + F1 * F2``.

    The other arguments are :class:`DLRM`'s.
    """

    def __init__(
        self,
        embedding_bag_collection: Pooled,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        interaction_branch1_layer_sizes: Sequence[int],
        interaction_branch2_layer_sizes: Sequence[int],
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        self._branches = (  # tuples: static module attributes must be hashable
            tuple(interaction_branch1_layer_sizes),
            tuple(interaction_branch2_layer_sizes),
        )
        super().__init__(
            embedding_bag_collection,
            dense_in_features,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
        )

    def _interaction(self, num_sparse: int, dim: int, dense_sizes, **kw) -> tuple[nnx.Module, int]:
        branches, projected = [], []
        for i, sizes in enumerate(self._branches, start=1):
            if sizes[-1] % dim != 0:
                raise ValueError(
                    f"Final interaction branch{i} layer size ({sizes[-1]}) is not a multiple "
                    f"of embedding size ({dim})"
                )
            projected.append(sizes[-1] // dim)
            branches.append(DenseArch(num_sparse * dim + dense_sizes[-1], sizes, **kw))
        inter = InteractionProjectionArch(num_sparse, *branches)
        return inter, dim + projected[0] * projected[1]
