"""ShardedFeatureProcessedEmbeddingBagCollection: feature processors before a sharded EBC.

TorchRec's ``ShardedFeatureProcessedEmbeddingBagCollection``. The position
weights are dense parameters, replicated like the rest of the dense model;
each device weights its own batch (a bag lives on one device, so positions
are those of the unsharded module), then the sharded collection pools.
Their gradient comes from :mod:`weight_grads` (the sharded lookup is not
differentiated by JAX).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Unpack

import jax
from flax import nnx

from ..modules.feature_processor import FeatureProcessedEmbeddingBagCollection, apply_processors
from ..sparse import KeyedJaggedTensor, KeyedTensor
from .sharded_base import ShardOptions
from .sharded_ebc import ShardedEmbeddingBagCollection
from .types import ParameterSharding
from .weight_grads import weight_gradient_term


class ShardedFeatureProcessedEmbeddingBagCollection(nnx.Module):
    """A ``FeatureProcessedEmbeddingBagCollection`` whose collection is sharded.

    Args:
        fp_ebc: the unsharded module (its processors are kept, its collection is
            sharded), or one whose collection is a ``ShardedEmbeddingBagCollection``
            already (then ``plan`` and ``mesh`` are ``None``).
        plan: ``{table: ParameterSharding}`` for its collection.
        mesh: the device mesh.
        options: as :class:`ShardedEmbeddingBagCollection`.

    Call it on a stacked KJT (:func:`shard_batch`); it returns the pooled
    ``KeyedTensor`` ``[world * B, sum(D)]``, equal to the unsharded module's on
    the concatenated batch, and trains the position weights as it does.
    """

    def __init__(
        self,
        fp_ebc: FeatureProcessedEmbeddingBagCollection,
        plan: Mapping[str, ParameterSharding] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        **options: Unpack[ShardOptions],
    ):
        if not isinstance(fp_ebc, FeatureProcessedEmbeddingBagCollection):
            raise TypeError(
                "fp_ebc must be a FeatureProcessedEmbeddingBagCollection, got "
                f"{type(fp_ebc).__name__}"
            )
        inner = fp_ebc.embedding_bag_collection()
        if isinstance(inner, ShardedEmbeddingBagCollection):
            if plan is not None or mesh is not None or options:
                raise ValueError("fp_ebc's collection is sharded already: pass no plan or mesh")
        else:
            if plan is None or mesh is None:
                raise ValueError("pass the plan of fp_ebc's collection and the mesh")
            inner = ShardedEmbeddingBagCollection(inner, plan, mesh, **options)
        self._feature_processors = fp_ebc._feature_processors
        self._embedding_bag_collection = inner

    def is_weighted(self) -> bool:
        return True

    def embedding_bag_collection(self) -> ShardedEmbeddingBagCollection:
        return self._embedding_bag_collection

    def __call__(self, features: KeyedJaggedTensor) -> KeyedTensor:
        features = features.narrow_ids()  # id words -> int32 rows; wide ids out of range
        features.require_uniform_stride(type(self).__name__)
        processors = self._feature_processors
        processed = jax.vmap(lambda kjt: apply_processors(processors, kjt))(features)
        weights = processed.weights()
        fixed = jax.tree.map(jax.lax.stop_gradient, processed)
        coll = self._embedding_bag_collection
        out = coll(fixed)
        tables = {name: v.get_value() for name, v in coll.weights.items()}
        term = weight_gradient_term(coll, tables, fixed, weights)
        values = out.values()
        return KeyedTensor(out.keys(), out.length_per_key(), values + term.astype(values.dtype))
