"""Flax NNX embedding modules."""

from .embedding_bag_collection import EmbeddingBagCollection as EmbeddingBagCollection
from .embedding_collection import EmbeddingCollection as EmbeddingCollection
from .tables import EmbeddingTable as EmbeddingTable
