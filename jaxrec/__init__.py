"""jaxrec: TorchRec rebuilt natively for JAX.

The public names below load on first use (PEP 562 ``__getattr__``), so that a
light module such as ``jaxrec.jobs.dlrm_flags`` imports without JAX:
``jaxrec-train-dlrm --help`` answers before JAX and Flax load. ``jaxrec.X``
for any subpackage ``X`` imports it, as an eager ``import jaxrec`` once did.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING

# First, before anything starts JAX's backend: no CUDA-plugin traceback without a GPU.
from .gpu_presence import skip_cuda_checks_without_gpu as _skip_cuda_checks

_skip_cuda_checks()

if TYPE_CHECKING:  # the same names, for type checkers (import-linter reads them too)
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
    from .modules import (
        ManagedCollisionEmbeddingCollection as ManagedCollisionEmbeddingCollection,
    )
    from .modules import MCHManagedCollisionModule as MCHManagedCollisionModule
    from .ops import BoundsCheckMode as BoundsCheckMode
    from .sparse import JaggedTensor as JaggedTensor
    from .sparse import KeyedJaggedTensor as KeyedJaggedTensor
    from .sparse import KeyedTensor as KeyedTensor

# Each public name and the module that defines it.
_SOURCES = {
    "DataType": "configs",
    "EmbeddingBagConfig": "configs",
    "EmbeddingConfig": "configs",
    "PoolingType": "configs",
    "CombinedOptimizer": "embedding",
    "EmbeddingBagCollection": "modules",
    "EmbeddingCollection": "modules",
    "EmbeddingTable": "modules",
    "ManagedCollisionCollection": "modules",
    "ManagedCollisionEmbeddingBagCollection": "modules",
    "ManagedCollisionEmbeddingCollection": "modules",
    "MCHManagedCollisionModule": "modules",
    "BoundsCheckMode": "ops",
    "JaggedTensor": "sparse",
    "KeyedJaggedTensor": "sparse",
    "KeyedTensor": "sparse",
}
__all__ = ["embedding", "optim", "train", *_SOURCES]

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _SOURCES:
        value = getattr(importlib.import_module(f".{_SOURCES[name]}", __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f".{name}", __name__)  # a subpackage
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
