"""Two-tower retrieval model (TorchRec's ``examples/retrieval/modules/two_tower.py``).

A query tower and a candidate tower embed two kinds of entities (users and
items) into one space; their dot product scores a pair. TorchRec's example
trains it with binary cross-entropy on labelled pairs
(:class:`TwoTowerTrainTask`); :func:`in_batch_softmax_loss` trains it from
positive pairs only, using the other candidates of the batch as negatives.
TorchRec's ``state_dict`` keys::

    ebc.embedding_bags.<query table | candidate table>.weight
    query_proj._mlp.<i>._linear.{weight,bias}
    candidate_proj._mlp.<i>._linear.{weight,bias}

Retrieval (TorchRec uses a FAISS index) is :func:`top_k_candidates`, an exact
maximum-inner-product search over precomputed candidate embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.typing import DTypeLike

from ..modules.mlp import MLP
from ..sparse import KeyedJaggedTensor
from .dlrm import (
    Pooled,
    bag_collection_of,
    check_same_dim,
    pooled_lookup,
    sparse_feature_names,
)
from .layer_args import LayerArgs


class TwoTower(nnx.Module):
    """Query and candidate towers over one two-table ``EmbeddingBagCollection``.

    The first table's features feed the query tower, the second's the
    candidate tower; each tower is a ReLU :class:`~jaxrec.modules.MLP` over
    the concatenated pooled embeddings of its features.

    Args:
        embedding_bag_collection: exactly two tables of one embedding dim.
        layer_sizes: MLP layer sizes of each tower (the last is the shared
            embedding width).
        rngs: ``nnx.Rngs`` for the towers.
        dtype, param_dtype: of the towers.

    Example:
        >>> model = TwoTower(ebc, layer_sizes=[16, 8], rngs=nnx.Rngs(0))
        >>> query, candidate = model(kjt)  # [B, 8] each
    """

    def __init__(
        self,
        embedding_bag_collection: Pooled,
        layer_sizes: Sequence[int],
        *,
        rngs: nnx.Rngs,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
    ):
        configs = bag_collection_of(embedding_bag_collection).embedding_bag_configs()
        if len(configs) != 2:
            raise ValueError(
                f"TwoTower expects two tables (query, candidate), got {[t.name for t in configs]}"
            )
        dim = check_same_dim(embedding_bag_collection, "TwoTower")
        sparse_feature_names(embedding_bag_collection, "TwoTower")  # no feature in both tables
        self._feature_names_query = tuple(configs[0].feature_names)
        self._candidate_feature_names = tuple(configs[1].feature_names)
        self.ebc = embedding_bag_collection
        kw = LayerArgs(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.query_proj = MLP(dim * len(self._feature_names_query), layer_sizes, **kw)
        self.candidate_proj = MLP(dim * len(self._candidate_feature_names), layer_sizes, **kw)

    def __call__(self, kjt: KeyedJaggedTensor) -> tuple[jax.Array, jax.Array]:
        """``(query_embedding, candidate_embedding)``, each ``[B, layer_sizes[-1]]``."""
        pooled = pooled_lookup(self.ebc, kjt)
        query = jnp.concatenate([pooled[f] for f in self._feature_names_query], axis=1)
        candidate = jnp.concatenate([pooled[f] for f in self._candidate_feature_names], axis=1)
        return self.query_proj(query), self.candidate_proj(candidate)


class TwoTowerTrainTask(nnx.Module):
    """TorchRec's training wrapper: BCE-with-logits on the towers' dot product.

    ``task(kjt, labels)`` returns ``(loss, (loss, logits, labels))`` (TorchRec's
    ``(loss, (loss.detach(), logits.detach(), labels.detach()))``), so
    ``make_train_step(graphdef, opt, lambda m, b: m(*b), has_aux=True)`` trains it.
    """

    def __init__(self, two_tower: TwoTower):
        self.two_tower = two_tower

    def __call__(self, kjt: KeyedJaggedTensor, labels: jax.Array) -> tuple[jax.Array, tuple]:
        query, candidate = self.two_tower(kjt)
        logits = jnp.sum(query * candidate, axis=1)
        loss = optax.sigmoid_binary_cross_entropy(logits, labels.astype(logits.dtype)).mean()
        return loss, (loss, logits, labels)


def in_batch_softmax_loss(
    query: jax.Array,
    candidate: jax.Array,
    temperature: float = 1.0,
    log_q: jax.Array | None = None,
) -> jax.Array:
    """Sampled softmax with in-batch negatives: row ``i``'s positive is candidate ``i``.

    ``logits = query @ candidate.T / temperature``, cross-entropy against the
    diagonal, averaged over the batch.

    Args:
        query: ``[B, W]`` query embeddings.
        candidate: ``[B, W]`` embeddings of each query's positive candidate.
        temperature: softmax temperature.
        log_q: optional ``[B]`` log-probability of each candidate appearing in a
            batch (popularity); subtracted from its logits (the "logQ
            correction" of sampled softmax), so popular items are not
            over-penalised as negatives.

    Returns:
        Scalar mean loss.
    """
    if query.ndim != 2 or query.shape != candidate.shape:
        raise ValueError(
            f"query and candidate must both be [B, W]: {query.shape=}, {candidate.shape=}"
        )
    logits = (query @ candidate.T).astype(jnp.float32) / temperature
    if log_q is not None:
        logits = logits - log_q.astype(jnp.float32)[None, :]
    labels = jnp.arange(query.shape[0])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def top_k_candidates(
    query: jax.Array, candidates: jax.Array, k: int
) -> tuple[jax.Array, jax.Array]:
    """Exact top-``k`` inner-product search (TorchRec's retrieval uses FAISS).

    Args:
        query: ``[Q, W]`` query embeddings.
        candidates: ``[N, W]`` candidate embeddings (``candidate_proj`` of every item).
        k: results per query.

    Returns:
        ``(scores [Q, k], ids [Q, k])``, best first.
    """
    if not 0 < k <= candidates.shape[0]:
        raise ValueError(f"k must be in [1, {candidates.shape[0]}], got {k}")
    return jax.lax.top_k(query @ candidates.T, k)
