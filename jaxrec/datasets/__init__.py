"""Datasets: Criteo (TSV and TorchRec's npy layout), MovieLens, random data with a planted model.

Every dataset is a :class:`TableDataset` with ``keys``, ``num_embeddings_per_feature``,
``num_dense`` and ``batches(batch_size, ...)`` yielding host-side :class:`Batch` es
with static capacities. TorchRec: ``torchrec.datasets``.
"""

from .batching import Batch as Batch
from .batching import Prefetcher as Prefetcher
from .batching import Ragged as Ragged
from .batching import Table as Table
from .batching import TableDataset as TableDataset
from .batching import prefetch as prefetch
from .random import PlantedModel as PlantedModel
from .random import RandomRecDataset as RandomRecDataset
from .random import random_rec_split as random_rec_split
from .random import roc_auc as roc_auc
from .random import zipf_ids as zipf_ids
