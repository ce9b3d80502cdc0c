"""Sparse training: the train step that never builds a dense table gradient."""

from .accumulate import make_accumulating_train_step as make_accumulating_train_step
from .accumulate import stack_micro_batches as stack_micro_batches
from .guard import BoundsCheckError as BoundsCheckError
from .guard import CapacityOverflowError as CapacityOverflowError
from .in_flight import InFlight as InFlight
from .pipeline import TrainPipeline as TrainPipeline
from .semi_sync import LookedUp as LookedUp
from .semi_sync import SemiSyncTrainStep as SemiSyncTrainStep
from .semi_sync import make_semi_sync_train_step as make_semi_sync_train_step
from .semi_sync_pipeline import TrainPipelineSemiSync as TrainPipelineSemiSync
from .sparse_dist_pipeline import TrainPipelineSparseDist as TrainPipelineSparseDist
from .sparse_dist_step import SparseDistTrainStep as SparseDistTrainStep
from .sparse_dist_step import make_sparse_dist_train_step as make_sparse_dist_train_step
from .step import TrainState as TrainState
from .step import TrainStep as TrainStep
from .step import init_train_state as init_train_state
from .step import make_eval_step as make_eval_step
from .step import make_train_step as make_train_step
from .step import merge_model as merge_model
