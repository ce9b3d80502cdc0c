"""Datasets: Criteo (TSV and TorchRec's npy layout), MovieLens, random data with a planted model.

Every dataset is a :class:`TableDataset` with ``keys``, ``num_embeddings_per_feature``,
``num_dense`` and ``batches(batch_size, ...)`` yielding host-side :class:`Batch` es
with static capacities. TorchRec: ``torchrec.datasets``.
"""

from .batching import Batch as Batch
from .batching import Part as Part
from .batching import Ragged as Ragged
from .batching import Table as Table
from .batching import TableDataset as TableDataset
from .criteo import CRITEO_KAGGLE_NUM_EMBEDDINGS as CRITEO_KAGGLE_NUM_EMBEDDINGS
from .criteo import CriteoDataset as CriteoDataset
from .criteo import criteo_split as criteo_split
from .criteo import load_npy as load_npy
from .criteo import load_tsv as load_tsv
from .criteo import synthetic_criteo as synthetic_criteo
from .criteo import synthetic_criteo_split as synthetic_criteo_split
from .criteo_tsv import DEFAULT_CAT_NAMES as DEFAULT_CAT_NAMES
from .criteo_tsv import DEFAULT_INT_NAMES as DEFAULT_INT_NAMES
from .criteo_tsv import CriteoParseError as CriteoParseError
from .criteo_tsv import ParseStats as ParseStats
from .criteo_tsv import dense_log_transform as dense_log_transform
from .criteo_tsv import iter_criteo_tsv as iter_criteo_tsv
from .criteo_tsv import preprocess_criteo as preprocess_criteo
from .criteo_tsv import read_criteo_tsv as read_criteo_tsv
from .criteo_tsv import tsv_to_npys as tsv_to_npys
from .movielens import MovieLensDataset as MovieLensDataset
from .movielens import extract_ml100k as extract_ml100k
from .movielens import fetch_movielens_100k as fetch_movielens_100k
from .movielens import load_movielens as load_movielens
from .movielens import movielens_split as movielens_split
from .movielens_files import RawRatings as RawRatings
from .movielens_files import read_atomic as read_atomic
from .movielens_files import read_movielens as read_movielens
from .multi_hot import MultiHot as MultiHot
from .prefetch import Prefetcher as Prefetcher
from .prefetch import prefetch as prefetch
from .random import PlantedModel as PlantedModel
from .random import RandomRecDataset as RandomRecDataset
from .random import random_rec_split as random_rec_split
from .random import zipf_ids as zipf_ids
