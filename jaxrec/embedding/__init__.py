"""The embedding core: stacked tables, their optimizer state, and how a train step reaches them.

Everything a collection (unsharded, sharded, managed-collision) shares lives
here, below the modules that build collections and the train step that uses
them: the stacked table layout (``tables``), the gradient tape that sees every
lookup (``tape``), row resets during a forward (``reset``), fused sparse row
updates (``sparse_update``), and ``CombinedOptimizer``, which binds the fused
optimizers of ``jaxrec.optim`` to tables.
"""

from .optimizer import CombinedOptimizer as CombinedOptimizer
from .optimizer import CombinedOptState as CombinedOptState
from .tables import EmbeddingTable as EmbeddingTable
from .tables import TableGroup as TableGroup
