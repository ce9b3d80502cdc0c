"""Recall and precision of the top-k of each session (TorchRec's `RecallSessionMetric`,
`PrecisionSessionMetric`: recall@k / precision@k)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from .base import SumMetric
from .sessions import per_task, rank_within_session


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TopKSessionMetric(SumMetric):
    """A sample is predicted positive when fewer than `top_threshold` samples of
    its session have a strictly greater prediction (ties share the best rank, so a
    session may have more than `top_threshold` predicted positives, as TorchRec).
    With `run_ranking_of_labels`, labels are likewise replaced by "in the top
    `top_threshold` by label"."""

    top_threshold: int
    run_ranking_of_labels: bool = False
    session_key: str = "session_ids"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.top_threshold, int) or self.top_threshold < 1:
            raise ValueError(
                f"{type(self).__name__}: top_threshold must be a positive int (the k "
                f"of recall@k), got {self.top_threshold!r}"
            )

    def input_names(self) -> tuple[str, ...]:
        return (self.session_key,)

    def batch_sums(self, p, y, w, **inputs):
        k = self.top_threshold

        def one(p, y, w, ids):
            top = (rank_within_session(p, ids) < k).astype(w.dtype)
            if self.run_ranking_of_labels:
                y = (rank_within_session(y, ids) < k).astype(w.dtype)
            return (
                jnp.sum(w * y * top),
                jnp.sum(w * y * (1.0 - top)),
                jnp.sum(w * (1.0 - y) * top),
            )

        tp, fn, fp = per_task(one, self.num_tasks, p, y, w, shared=(inputs[self.session_key],))
        return {"num_true_pos": tp, "num_false_neg": fn, "num_false_pos": fp}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecallSessionMetric(_TopKSessionMetric):
    """Session-level recall@k: the weighted share of positive samples that are in
    the top `top_threshold` of their session by prediction (TorchRec's
    `RecallSessionMetric` with `SessionMetricDef(top_threshold=k)`).

    `update(..., session_ids=ids)`: `[B]` integer ids, one per sample.

    Attributes:
      top_threshold: k.
      run_ranking_of_labels: a sample's label is 1 when it is in the top k of its
        session by label (TorchRec's option).
      session_key: the keyword of the session ids in `update`.

    Returns (compute): {"recall_session_level": tp / (tp + fn)}; nan while there
    is no positive weight (TorchRec's value, with its warning).
    """

    namespace: ClassVar[str] = "recall_session_level"
    output_names: ClassVar[tuple[str, ...]] = ("recall_session_level",)
    state_names: ClassVar[tuple[str, ...]] = ("num_true_pos", "num_false_neg", "num_false_pos")

    def compute_sums(self, sums):
        tp = sums["num_true_pos"]
        return {"recall_session_level": tp / (tp + sums["num_false_neg"])}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionSessionMetric(_TopKSessionMetric):
    """Session-level precision@k: the weighted share of the top `top_threshold`
    samples of each session by prediction that are positive (TorchRec's
    `PrecisionSessionMetric`).

    Attributes: as `RecallSessionMetric`.

    Returns (compute): {"precision_session_level": tp / (tp + fp)}; nan while no
    sample was predicted positive (TorchRec's value).
    """

    namespace: ClassVar[str] = "precision_session_level"
    output_names: ClassVar[tuple[str, ...]] = ("precision_session_level",)
    state_names: ClassVar[tuple[str, ...]] = ("num_true_pos", "num_false_neg", "num_false_pos")

    def compute_sums(self, sums):
        tp = sums["num_true_pos"]
        return {"precision_session_level": tp / (tp + sums["num_false_pos"])}
