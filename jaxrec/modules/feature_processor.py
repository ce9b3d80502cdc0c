"""Feature processors: position weights, and the EmbeddingBagCollection they feed.

TorchRec's ``PositionWeightedModule`` turns the position of each id in its bag
into a learned per-sample weight; ``FeatureProcessedEmbeddingBagCollection``
applies such processors per feature, then runs a weighted
``EmbeddingBagCollection``. The position weights are dense parameters
(``nnx.Param``): a train step updates them with the dense optimizer, while the
tables still get sparse updates.

::

    # bag of feature "f" (max_feature_length L = 4):  ids [7, 2, 9]
    #                                      positions    0  1  2
    # weights = position_weight[[0, 1, 2]];  pooled = sum_j weights[j] * table[ids[j]]
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from ..sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from .embedding_bag_collection import EmbeddingBagCollection


def bag_positions(jt: JaggedTensor) -> tuple[jax.Array, jax.Array]:
    """``[C]`` position of each value inside its bag, and ``[C]`` True for non-padding."""
    b = jt.num_bags()
    seg = jt.segment_ids()  # padding: b
    offsets = jt.offsets()  # [b + 1]
    positions = jnp.arange(jt.capacity(), dtype=offsets.dtype) - offsets[seg]
    return positions, seg < b


def position_weights(jt: JaggedTensor, position_weight: jax.Array) -> jax.Array:
    """``[C]`` float weights ``position_weight[position]``, 0 for padding.

    Positions at or past ``len(position_weight)`` (bags longer than the
    ``max_feature_length``) get weight 0: they are truncated. TorchRec raises an
    index error there instead; under ``jit`` a lookup cannot raise.
    """
    length = position_weight.shape[0]
    positions, valid = bag_positions(jt)
    keep = valid & (positions < length)
    gathered = jnp.take(position_weight, jnp.clip(positions, 0, length - 1), axis=0)
    return jnp.where(keep, gathered, jnp.zeros((), position_weight.dtype))


def _check_length(name: str, length: object) -> int:
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        raise ValueError(f"max feature length of {name!r} must be a positive int, got {length!r}")
    return length


class PositionWeightedModule(nnx.Module):
    """Adds position weights to one id-list feature (TorchRec's ``PositionWeightedModule``).

    Args:
        max_feature_length: the truncation size ``L``: the number of learned
            weights (``position_weight``, ``[L]``, initialised to ones).
        param_dtype: dtype of ``position_weight``.

    Example:
        >>> pw = PositionWeightedModule(max_feature_length=4)
        >>> jt = JaggedTensor(values=[5, 7, 1], lengths=[1, 2])
        >>> pw(jt).weights().tolist()
        [1.0, 1.0, 1.0]
    """

    def __init__(self, max_feature_length: int, *, param_dtype: DTypeLike = jnp.float32):
        self.max_feature_length = _check_length("feature", max_feature_length)
        self.position_weight = nnx.Param(jnp.ones((max_feature_length,), param_dtype))

    def reset_parameters(self) -> None:
        self.position_weight.set_value(jnp.ones_like(self.position_weight.get_value()))

    def __call__(self, features: JaggedTensor) -> JaggedTensor:
        """The same ids and lengths, with ``weights`` set to the position weights."""
        w = position_weights(features, self.position_weight.get_value())
        return JaggedTensor(features.values(), weights=w, lengths=features.lengths())


class PositionWeightedModuleCollection(nnx.Module):
    """Position weights for several features of a KJT (TorchRec's
    ``PositionWeightedModuleCollection``); other keys get weight 1.

    Args:
        max_feature_lengths: ``{feature: L}``; ``position_weights.<feature>`` is ``[L]``.
        param_dtype: dtype of the weights.
    """

    def __init__(
        self, max_feature_lengths: Mapping[str, int], *, param_dtype: DTypeLike = jnp.float32
    ):
        lengths = {k: _check_length(k, v) for k, v in max_feature_lengths.items()}
        self._max_feature_lengths = tuple(lengths.items())  # hashable static metadata
        self.position_weights = nnx.Dict(
            {k: nnx.Param(jnp.ones((n,), param_dtype)) for k, n in lengths.items()}
        )

    @property
    def max_feature_lengths(self) -> dict[str, int]:
        return dict(self._max_feature_lengths)

    def reset_parameters(self) -> None:
        for p in self.position_weights.values():
            p.set_value(jnp.ones_like(p.get_value()))

    def __call__(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        processors = {k: self._weights_fn(k) for k in self.max_feature_lengths}
        return _apply(features, processors)

    def _weights_fn(self, key: str):
        return lambda jt: position_weights(jt, self.position_weights[key].get_value())


def _apply(features: KeyedJaggedTensor, processors: Mapping) -> KeyedJaggedTensor:
    """The KJT with per-key weights from ``processors[key](jt)``; 1 for other keys."""
    parts = []
    for key in features.keys():
        jt = features[key]
        if key in processors:
            parts.append(processors[key](jt).astype(jnp.float32))
        else:
            parts.append(jnp.where(bag_positions(jt)[1], 1.0, 0.0).astype(jnp.float32))
    weights = jnp.concatenate(parts) if parts else features.weights_or_none()
    return KeyedJaggedTensor(
        features.keys(),
        features.values(),
        weights,
        lengths=features.lengths(),
        stride=features.stride(),
        capacities=features.capacity_per_key(),
        validate=False,
    )


class FeatureProcessedEmbeddingBagCollection(nnx.Module):
    """An EmbeddingBagCollection whose per-sample weights come from feature processors.

    TorchRec's ``FeatureProcessedEmbeddingBagCollection``: the input KJT's
    weights are replaced by each feature's processor output (keys without a
    processor get weight 1), then the weighted collection pools them.

    Args:
        embedding_bag_collection: an ``EmbeddingBagCollection`` built with
            ``is_weighted=True``.
        feature_processors: ``{feature: PositionWeightedModule}`` covering
            exactly the collection's feature names, or a
            :class:`PositionWeightedModuleCollection`.

    Example:
        >>> ebc = EmbeddingBagCollection(
        ...     [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
        ...                         feature_names=["f"])], is_weighted=True, rngs=nnx.Rngs(0))
        >>> fp_ebc = FeatureProcessedEmbeddingBagCollection(ebc, {"f": PositionWeightedModule(8)})
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], [1, 2, 3], [2, 1])
        >>> fp_ebc(kjt).values().shape
        (2, 4)
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        feature_processors: Mapping[str, PositionWeightedModule] | PositionWeightedModuleCollection,
    ):
        if not isinstance(embedding_bag_collection, EmbeddingBagCollection):
            raise TypeError(
                "embedding_bag_collection must be a jaxrec EmbeddingBagCollection, got "
                f"{type(embedding_bag_collection).__name__}"
            )
        if not embedding_bag_collection.is_weighted():
            raise ValueError(
                "the EmbeddingBagCollection must accept weighted inputs for feature processors: "
                "build it with is_weighted=True"
            )
        names = [
            f for t in embedding_bag_collection.embedding_bag_configs() for f in t.feature_names
        ]
        self._feature_names = tuple(dict.fromkeys(names))
        self._embedding_bag_collection = embedding_bag_collection
        if isinstance(feature_processors, PositionWeightedModuleCollection):
            self._feature_processors = feature_processors
        else:
            if set(feature_processors) != set(self._feature_names):
                raise ValueError(
                    f"feature processors for {sorted(feature_processors)} do not match the "
                    f"collection's feature names {sorted(self._feature_names)}"
                )
            self._feature_processors = nnx.Dict(dict(feature_processors))

    def __call__(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings ``[B, sum(D)]``, as the wrapped collection returns them."""
        features.require_uniform_stride(type(self).__name__)  # positions need every sample
        features = features.narrow_ids()  # id words -> int32 rows; wide ids out of range
        return self._embedding_bag_collection(apply_processors(self._feature_processors, features))

    def is_weighted(self) -> bool:
        return True

    def embedding_bag_collection(self) -> EmbeddingBagCollection:
        return self._embedding_bag_collection


def apply_processors(
    processors: PositionWeightedModuleCollection | Mapping[str, PositionWeightedModule],
    features: KeyedJaggedTensor,
) -> KeyedJaggedTensor:
    """``features`` weighted by ``processors`` (a :class:`PositionWeightedModuleCollection`
    or ``{feature: PositionWeightedModule}``); keys without a processor get weight 1."""
    if isinstance(processors, PositionWeightedModuleCollection):
        return processors(features)
    return _apply(features, {k: _weights_of(processors[k]) for k in processors})


def _weights_of(processor: PositionWeightedModule):
    return lambda jt: processor(jt).weights()
