"""Embedding towers: an embedding module feeding its own interaction module.

TorchRec's ``EmbeddingTower`` / ``EmbeddingTowerCollection``. A tower is the
unit TorchRec's tower sharding places on one host; here it is the same logical
grouping (``embedding`` then ``interaction``), with TorchRec's parameter names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..sparse import KeyedJaggedTensor
from .embedding_bag_collection import EmbeddingBagCollection
from .embedding_collection import EmbeddingCollection


def tower_input_params(module: nnx.Module) -> tuple[bool, bool]:
    """``(needs features, needs weighted_features)`` for a tower's embedding module.

    An ``EmbeddingCollection`` reads ``features``; an ``EmbeddingBagCollection``
    reads ``weighted_features`` if it is weighted, else ``features``; any other
    module gets both.
    """
    if isinstance(module, EmbeddingCollection):
        return True, False
    if isinstance(module, EmbeddingBagCollection):
        return not module.is_weighted(), module.is_weighted()
    return True, True


class EmbeddingTower(nnx.Module):
    """``interaction(embedding(*args, **kwargs))``.

    Args:
        embedding_module: an embedding collection (or any module).
        interaction_module: a module or callable on the embedding output,
            returning ``[B, N]``.

    Example:
        >>> tower = EmbeddingTower(ebc, lambda kt: kt.values())
        >>> tower(kjt).shape  # [B, sum(D)]
    """

    def __init__(
        self, embedding_module: nnx.Module, interaction_module: Callable[[Any], jax.Array]
    ):
        if not callable(embedding_module) or not callable(interaction_module):
            raise TypeError("embedding_module and interaction_module must be callable")
        self.embedding = embedding_module
        self.interaction = interaction_module

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        return self.interaction(self.embedding(*args, **kwargs))


class EmbeddingTowerCollection(nnx.Module):
    """Several towers; their ``[B, N_i]`` outputs concatenated to ``[B, sum(N_i)]``.

    Each tower receives ``features``, ``weighted_features`` or both, as
    :func:`tower_input_params` says for its embedding module.

    Args:
        towers: the :class:`EmbeddingTower` s (parameters at ``towers.<i>.*``).

    Example:
        >>> towers = EmbeddingTowerCollection([tower_0, tower_1])
        >>> towers(features=kjt, weighted_features=weighted_kjt).shape
    """

    def __init__(self, towers: Sequence[EmbeddingTower]):
        for i, t in enumerate(towers):
            if not isinstance(t, EmbeddingTower):
                raise TypeError(f"towers[{i}] must be an EmbeddingTower, got {type(t).__name__}")
        self.towers = nnx.List(list(towers))
        self._input_params = tuple(tower_input_params(t.embedding) for t in towers)

    def __call__(
        self,
        features: KeyedJaggedTensor | None = None,
        weighted_features: KeyedJaggedTensor | None = None,
    ) -> jax.Array:
        for i, (tower, (kjt, wkjt)) in enumerate(zip(self.towers, self._input_params, strict=True)):
            if (kjt and features is None) or (wkjt and weighted_features is None):
                need = [n for n, f in (("features", kjt), ("weighted_features", wkjt)) if f]
                raise ValueError(f"tower {i} ({type(tower.embedding).__name__}) needs {need}")
        outputs = []
        for tower, (kjt, wkjt) in zip(self.towers, self._input_params, strict=True):
            if kjt and wkjt:
                outputs.append(tower(features, weighted_features))
            elif wkjt:
                outputs.append(tower(weighted_features))
            else:
                outputs.append(tower(features))
        return jnp.concatenate(outputs, axis=1)
