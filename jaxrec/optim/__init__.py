"""Fused sparse optimizers (FBGEMM's set, optax idioms): pure functions, no model walking.

They are bound to tables by ``jaxrec.embedding.CombinedOptimizer``.
"""

from .base import EmbOptimType as EmbOptimType
from .base import NoParams as NoParams
from .base import SparseOptimizer as SparseOptimizer
from .base import WeightDecayMode as WeightDecayMode
from .base import apply_rows as apply_rows
from .optimizers import AdagradParams as AdagradParams
from .optimizers import AdamParams as AdamParams
from .optimizers import LarsSgdParams as LarsSgdParams
from .optimizers import SgdParams as SgdParams
from .optimizers import adagrad as adagrad
from .optimizers import adam as adam
from .optimizers import lamb as lamb
from .optimizers import lars_sgd as lars_sgd
from .optimizers import partial_rowwise_adam as partial_rowwise_adam
from .optimizers import partial_rowwise_lamb as partial_rowwise_lamb
from .optimizers import rowwise_adagrad as rowwise_adagrad
from .optimizers import sgd as sgd
