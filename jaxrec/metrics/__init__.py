"""Recommendation metrics (TorchRec's `torchrec.metrics`), jit-able and mergeable.

Every metric has pure `init` / `update` / `merge` / `compute` / `reduce` methods over
a fixed-shape pytree state; see `base.py`.
"""

from .auc import AUCMetric as AUCMetric
from .auc import AUPRCMetric as AUPRCMetric
from .auc import SampleBuffer as SampleBuffer
from .auc import roc_auc as roc_auc
from .base import Metric as Metric
from .base import Sum as Sum
from .base import SumMetric as SumMetric
from .base import validate_inputs as validate_inputs
from .collection import MetricCollection as MetricCollection
from .collection import RecMetricModule as RecMetricModule
from .gauc import GAUCMetric as GAUCMetric
from .ndcg import NDCGMetric as NDCGMetric
from .ne import CaliFreeNEMetric as CaliFreeNEMetric
from .ne import NEMetric as NEMetric
from .processes import reduce_across_processes as reduce_across_processes
from .rates import AccuracyMetric as AccuracyMetric
from .rates import CalibrationMetric as CalibrationMetric
from .rates import CTRMetric as CTRMetric
from .regression import MAEMetric as MAEMetric
from .regression import MSEMetric as MSEMetric
from .segmented_ne import SegmentedNEMetric as SegmentedNEMetric
from .session_rates import PrecisionSessionMetric as PrecisionSessionMetric
from .session_rates import RecallSessionMetric as RecallSessionMetric
from .sessions import rank_within_session as rank_within_session
from .streaming_auc import StreamingAUCMetric as StreamingAUCMetric
from .streaming_auc import StreamingAUPRCMetric as StreamingAUPRCMetric
from .throughput import ThroughputMetric as ThroughputMetric
from .window import WindowedMetric as WindowedMetric
from .window import WindowState as WindowState
