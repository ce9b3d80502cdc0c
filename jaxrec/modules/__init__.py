"""Flax NNX embedding modules."""

from .activation import SwishLayerNorm as SwishLayerNorm
from .crossnet import CrossNet as CrossNet
from .crossnet import LowRankCrossNet as LowRankCrossNet
from .crossnet import LowRankMixtureCrossNet as LowRankMixtureCrossNet
from .crossnet import VectorCrossNet as VectorCrossNet
from .deepfm import DeepFM as DeepFM
from .deepfm import FactorizationMachine as FactorizationMachine
from .embedding_bag_collection import EmbeddingBagCollection as EmbeddingBagCollection
from .embedding_collection import EmbeddingCollection as EmbeddingCollection
from .embedding_tower import EmbeddingTower as EmbeddingTower
from .embedding_tower import EmbeddingTowerCollection as EmbeddingTowerCollection
from .feature_processor import (
    FeatureProcessedEmbeddingBagCollection as FeatureProcessedEmbeddingBagCollection,
)
from .feature_processor import PositionWeightedModule as PositionWeightedModule
from .feature_processor import PositionWeightedModuleCollection as PositionWeightedModuleCollection
from .mlp import MLP as MLP
from .mlp import Perceptron as Perceptron
from .tables import EmbeddingTable as EmbeddingTable
from .torchrec_state import load_torchrec_state_dict as load_torchrec_state_dict
from .torchrec_state import torchrec_keys as torchrec_keys
from .torchrec_state import torchrec_state_dict as torchrec_state_dict
