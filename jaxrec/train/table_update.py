"""The train step's sparse update: each embedding collection applies its calls' gradients.

The step only routes: it hands every collection (see
``jaxrec.embedding.EmbeddingCollectionInterface``) its buffers, the sparse
optimizer state and the calls it made, in call order; how gradients reach
rows (pooled or sequence lookups, one or several optimizers per stacked
buffer, shards under ``shard_map``) is the collection's business.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..embedding.collection import EmbeddingCollectionInterface, LookupGrad
from ..embedding.optimizer import CombinedOptimizer
from ..ops import Implementation


class CollectionCall(NamedTuple):
    """One collection call of a step: where the collection sits, and its gradient."""

    path: tuple  # the collection's module path in the model
    collection: EmbeddingCollectionInterface
    lookup: LookupGrad


class TableBuffers:
    """A ``TrainState``'s table buffers, addressed by ``(collection path, buffer name)``."""

    def __init__(self, tables: nnx.State):
        with_path, self._treedef = jax.tree_util.tree_flatten_with_path(tables)
        self._leaves = [leaf for _, leaf in with_path]
        self._index = {
            tuple(k.key for k in p if isinstance(k, jax.tree_util.DictKey)): i
            for i, (p, _) in enumerate(with_path)
        }

    def __getitem__(self, key: tuple[tuple, str]) -> jax.Array:
        path, name = key
        return self._leaves[self._index[(*path, "weights", name)]]

    def __setitem__(self, key: tuple[tuple, str], value: jax.Array) -> None:
        path, name = key
        self._leaves[self._index[(*path, "weights", name)]] = value

    def state(self) -> nnx.State:
        """The tables with every buffer as last set."""
        return jax.tree_util.tree_unflatten(self._treedef, self._leaves)


def apply_sparse_gradients(
    optimizer: CombinedOptimizer,
    tables: nnx.State,
    sparse_state: Mapping[str, Any],
    calls: Sequence[CollectionCall],
    loss: jax.Array,
    implementation: Implementation,
) -> tuple[nnx.State, dict[str, Any]]:
    """``(tables, sparse_state)`` after every collection's fused update from ``calls``."""
    # A data dependency of every row update on the loss orders the forward's
    # table reads before the in-place scatters. Without it, when the output
    # gradient does not depend on the looked-up rows (a linear head), XLA:CPU
    # copies each table (2 GB for 4M x 128) to keep the old one alive; an
    # optimization_barrier does not prevent that. The where() keeps a non-finite
    # loss from turning updates into NaN.
    dep = jnp.where(jnp.isfinite(loss), loss, 0.0)
    by_path: dict[tuple, tuple[EmbeddingCollectionInterface, list[LookupGrad]]] = {}
    for call in calls:
        by_path.setdefault(call.path, (call.collection, []))[1].append(call.lookup)
    buffers, sparse_state = TableBuffers(tables), dict(sparse_state)
    for path, (collection, lookups) in by_path.items():
        weights = {name: buffers[path, name] for name in collection.weights}
        weights, sparse_state = collection.apply_sparse_gradients(
            optimizer, path, weights, sparse_state, lookups, dep=dep, implementation=implementation
        )
        for name, w in weights.items():
            buffers[path, name] = w
    return buffers.state(), sparse_state
