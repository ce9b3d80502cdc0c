"""jaxrec: TorchRec rebuilt natively for JAX."""

# First, before anything starts JAX's backend: no CUDA-plugin traceback without a GPU.
from .gpu_presence import skip_cuda_checks_without_gpu as _skip_cuda_checks

_skip_cuda_checks()

# Subpackages an ``import jaxrec`` has always made reachable as attributes
# (``jaxrec.train.make_train_step``); the package face may import any layer.
from . import embedding as embedding
from . import optim as optim
from . import train as train
from .configs import DataType as DataType
from .configs import EmbeddingBagConfig as EmbeddingBagConfig
from .configs import EmbeddingConfig as EmbeddingConfig
from .configs import PoolingType as PoolingType
from .embedding import CombinedOptimizer as CombinedOptimizer
from .modules import EmbeddingBagCollection as EmbeddingBagCollection
from .modules import EmbeddingCollection as EmbeddingCollection
from .modules import EmbeddingTable as EmbeddingTable
from .modules import ManagedCollisionCollection as ManagedCollisionCollection
from .modules import (
    ManagedCollisionEmbeddingBagCollection as ManagedCollisionEmbeddingBagCollection,
)
from .modules import ManagedCollisionEmbeddingCollection as ManagedCollisionEmbeddingCollection
from .modules import MCHManagedCollisionModule as MCHManagedCollisionModule
from .ops import BoundsCheckMode as BoundsCheckMode
from .sparse import JaggedTensor as JaggedTensor
from .sparse import KeyedJaggedTensor as KeyedJaggedTensor
from .sparse import KeyedTensor as KeyedTensor

__version__ = "0.1.0"
