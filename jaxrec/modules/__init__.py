"""Flax NNX embedding modules."""

from ..embedding.tables import EmbeddingTable as EmbeddingTable
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
from .hash_zch import HashZchManagedCollisionModule as HashZchManagedCollisionModule
from .mc_collection import ManagedCollisionCollection as ManagedCollisionCollection
from .mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection as ManagedCollisionEmbeddingBagCollection,
)
from .mc_embedding_modules import (
    ManagedCollisionEmbeddingCollection as ManagedCollisionEmbeddingCollection,
)
from .mc_hash import hash_id_pairs as hash_id_pairs
from .mc_hash import hash_ids as hash_ids
from .mc_hash import hash_ids_64 as hash_ids_64
from .mc_modules import EVICTION_FILL as EVICTION_FILL
from .mc_modules import MCHManagedCollisionModule as MCHManagedCollisionModule
from .mc_modules import MCState as MCState
from .mc_policies import DistanceLFU_EvictionPolicy as DistanceLFU_EvictionPolicy
from .mc_policies import LFU_EvictionPolicy as LFU_EvictionPolicy
from .mc_policies import LRU_EvictionPolicy as LRU_EvictionPolicy
from .mc_policies import MCHEvictionPolicy as MCHEvictionPolicy
from .mc_policies import average_threshold_filter as average_threshold_filter
from .mc_policies import dynamic_threshold_filter as dynamic_threshold_filter
from .mlp import MLP as MLP
from .mlp import Perceptron as Perceptron
from .torchrec_state import load_torchrec_state_dict as load_torchrec_state_dict
from .torchrec_state import torchrec_keys as torchrec_keys
from .torchrec_state import torchrec_state_dict as torchrec_state_dict
from .zch_policies import FrequencyAdmission as FrequencyAdmission
from .zch_policies import HashZchEvictionConfig as HashZchEvictionConfig
from .zch_policies import HashZchEvictionPolicyName as HashZchEvictionPolicyName
from .zch_policies import ProbabilityAdmission as ProbabilityAdmission
