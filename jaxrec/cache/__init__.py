"""Tables in host memory with a device cache of their rows (TorchRec's ``fused_uvm_caching``)."""

from ..distributed.types import CacheAlgorithm as CacheAlgorithm
from ..distributed.types import CacheParams as CacheParams
from .configs import cached_configs as cached_configs
from .configs import device_plan as device_plan
from .configs import slots_per_shard as slots_per_shard
from .host import HostTable as HostTable
from .mover import MovePaths as MovePaths
from .placement import host_rows as host_rows
from .row_cache import CacheStats as CacheStats
from .row_cache import Prepared as Prepared
from .row_cache import RowCache as RowCache
from .slots import CacheTooSmallError as CacheTooSmallError
from .stats import measure_miss_rates as measure_miss_rates
from .step import CachedTrainStep as CachedTrainStep
from .step import prefetching as prefetching
