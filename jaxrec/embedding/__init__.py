"""The embedding core: stacked tables, their optimizer state, and how a train step reaches them.

Everything a collection (unsharded, sharded, managed-collision) shares lives
here, below the modules that build collections and the train step that uses
them: the stacked table layout (``tables``), the gradient tape that sees every
lookup (``tape``), row resets during a forward (``reset``), fused sparse row
updates (``sparse_update``), ``CombinedOptimizer``, which binds the fused
optimizers of ``jaxrec.optim`` to tables, and the contract every collection
with tables implements for the optimizer, the train step and checkpoints
(``collection``: :class:`EmbeddingCollectionInterface`).
"""

from .collection import EmbeddingCollectionInterface as EmbeddingCollectionInterface
from .collection import GradSource as GradSource
from .collection import LookupGrad as LookupGrad
from .collection import PlanLocal as PlanLocal
from .collection import embedding_collections as embedding_collections
from .optimizer import CombinedOptimizer as CombinedOptimizer
from .optimizer import CombinedOptState as CombinedOptState
from .tables import EmbeddingTable as EmbeddingTable
from .tables import TableGroup as TableGroup
from .touched import TouchedRows as TouchedRows
from .touched import track_touched_rows as track_touched_rows
