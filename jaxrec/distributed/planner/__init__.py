"""The sharding planner (TorchRec's ``torchrec.distributed.planner``)."""

from .cache_stats import CacheStatistics as CacheStatistics
from .cache_stats import MissRateCurve as MissRateCurve
from .cache_stats import UniformCacheStatistics as UniformCacheStatistics
from .cache_stats import ZipfCacheStatistics as ZipfCacheStatistics
from .constraints import ParameterConstraints as ParameterConstraints
from .cost_model import CostModel as CostModel
from .enumerator import enumerate_options as enumerate_options
from .options import ShardingOption as ShardingOption
from .options import ShardSpec as ShardSpec
from .options import TableInfo as TableInfo
from .partitioner import GreedyPerfPartitioner as GreedyPerfPartitioner
from .perf import Perf as Perf
from .placement import Placement as Placement
from .planner import EmbeddingShardingPlanner as EmbeddingShardingPlanner
from .planner import PlannerError as PlannerError
from .planner import plan_for_model as plan_for_model
from .proposers import CachingProposer as CachingProposer
from .proposers import GreedyProposer as GreedyProposer
from .proposers import GridSearchProposer as GridSearchProposer
from .proposers import Proposer as Proposer
from .proposers import UniformProposer as UniformProposer
from .stats import PlanStats as PlanStats
from .storage import state_bytes_per_row as state_bytes_per_row
from .table_specs import load_table_specs as load_table_specs
from .topology import Topology as Topology
