"""Sharded embedding collections on a device mesh (TorchRec's ``torchrec.distributed``)."""

from .abstract_build import init_keys as init_keys
from .capacity import fast_path_capacity as fast_path_capacity
from .global_mc import GlobalBatchManagedCollision as GlobalBatchManagedCollision
from .model_parallel import DistributedModelParallel as DistributedModelParallel
from .model_parallel import shard_batch as shard_batch
from .multihost import initialize as initialize
from .multihost import launched_processes as launched_processes
from .multihost import mesh_devices as mesh_devices
from .multihost import process_ranks as process_ranks
from .peers import lost_process as lost_process
from .qcomms import CommType as CommType
from .qcomms import QCommsConfig as QCommsConfig
from .sharded_ebc import ShardedEmbeddingBagCollection as ShardedEmbeddingBagCollection
from .sharded_ec import ShardedEmbeddingCollection as ShardedEmbeddingCollection
from .sharded_fp import (
    ShardedFeatureProcessedEmbeddingBagCollection as ShardedFeatureProcessedEmbeddingBagCollection,
)
from .sharded_mc import ShardedManagedCollisionCollection as ShardedManagedCollisionCollection
from .sharded_zch import ShardedHashZchCollection as ShardedHashZchCollection
from .sharding_plan import column_wise as column_wise
from .sharding_plan import construct_module_sharding_plan as construct_module_sharding_plan
from .sharding_plan import data_parallel as data_parallel
from .sharding_plan import grid_shard as grid_shard
from .sharding_plan import row_wise as row_wise
from .sharding_plan import table_column_wise as table_column_wise
from .sharding_plan import table_row_wise as table_row_wise
from .sharding_plan import table_wise as table_wise
from .types import CacheAlgorithm as CacheAlgorithm
from .types import CacheParams as CacheParams
from .types import EmbeddingComputeKernel as EmbeddingComputeKernel
from .types import EmbeddingModuleShardingPlan as EmbeddingModuleShardingPlan
from .types import ParameterSharding as ParameterSharding
from .types import ShardingPlan as ShardingPlan
from .types import ShardingType as ShardingType
from .types import ShardMetadata as ShardMetadata
from .watchdog import PEER_LOST as PEER_LOST
from .watchdog import stop_watching as stop_watching
from .watchdog import watch_processes as watch_processes
