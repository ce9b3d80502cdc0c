"""Normalized discounted cumulative gain per session (TorchRec's `NDCGMetric`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from .base import SumMetric
from .sessions import per_task, sort_sessions


@functools.partial(
    jax.jit,
    static_argnames=(
        "k",
        "exponential_gain",
        "decreasing",
        "remove_single_length_sessions",
        "scale_by_weights_tensor",
    ),
)
def session_ndcg_terms(
    p: jax.Array,
    y: jax.Array,
    w: jax.Array,
    session_ids: jax.Array,
    *,
    k: int,
    exponential_gain: bool,
    decreasing: bool,
    remove_single_length_sessions: bool,
    scale_by_weights_tensor: bool,
) -> tuple[jax.Array, jax.Array]:
    """TorchRec's per-batch NDCG sums for one task.

    Args:
      p, y, w: `[B]` predictions, labels (graded relevance), weights.
      session_ids: `[B]` integer session ids.
      k, exponential_gain, decreasing, remove_single_length_sessions,
        scale_by_weights_tensor: as `NDCGMetric`.

    Returns:
      `(sum_ndcg, num_sessions)` scalars.
    """
    n = p.shape[0]
    if scale_by_weights_tensor:
        y, p = w * y, w * p

    def dcg(key):
        s = sort_sessions(session_ids, key, descending=True)
        rank = jnp.arange(n) - s.session_first + 1  # 1-based position in the session
        discount = 1.0 / jnp.log2(rank + 1.0)
        if k > 0:
            discount = jnp.where(rank <= k, discount, 0.0)
        gain = y[s.order]
        if exponential_gain:
            gain = jnp.exp2(gain) - 1.0
        total = jax.ops.segment_sum(
            gain * discount, s.segment, num_segments=n, indices_are_sorted=True
        )
        return total, s

    observed, s = dcg(p)
    ideal, _ = dcg(y)  # same sessions, same segment order (sorted by id first)
    ideal = jnp.where(ideal == 0, 1e-6, ideal)  # TorchRec's guard: such sessions score 0
    ndcg = observed / ideal
    report = 1.0 - ndcg if decreasing else ndcg
    length = jax.ops.segment_sum(
        jnp.ones_like(p), s.segment, num_segments=n, indices_are_sorted=True
    )
    if not scale_by_weights_tensor:  # TorchRec: scale by the session's largest weight
        report = report * jax.ops.segment_max(
            w[s.order], s.segment, num_segments=n, indices_are_sorted=True
        )
    keep = length > (1 if remove_single_length_sessions else 0)
    return jnp.sum(jnp.where(keep, report, 0.0)), jnp.sum(keep.astype(p.dtype))


@dataclasses.dataclass(frozen=True, kw_only=True)
class NDCGMetric(SumMetric):
    """NDCG@k per session, averaged over sessions (TorchRec's `NDCGMetric`).

    Per session, samples are ranked by prediction (ties keep batch order; TorchRec's
    unstable sort leaves them unspecified) and
    `dcg = sum_{rank <= k} gain / log2(rank + 1)` with `gain = label` (or
    `2^label - 1` with `exponential_gain`); `ndcg = dcg / ideal_dcg` (the labels
    ranked by themselves; a session whose ideal DCG is 0 scores ndcg 0). The
    state sums TorchRec's report per session, `1 - ndcg` (or `ndcg` with
    `report_ndcg_as_decreasing_curve=False`) times the session's largest weight,
    and counts sessions; the result is their ratio.

    `update(..., session_ids=ids)`: `[B]` integer ids, one per sample, shared by
    the tasks (TorchRec's `session_id` required input, which must be equal across
    tasks there). Sessions are per batch.

    Attributes:
      k: cut-off rank; -1 (TorchRec's default) for the whole session.
      exponential_gain: gain `2^label - 1` instead of `label`.
      report_ndcg_as_decreasing_curve: report `1 - ndcg` (TorchRec's default).
      remove_single_length_sessions: skip sessions of one sample.
      scale_by_weights_tensor: multiply labels and predictions by the weights
        first (and do not scale by the largest weight).
      session_key: the keyword of the session ids in `update`.

    Returns (compute): {"ndcg": ...} (nan before any session, as TorchRec's 0 / 0).
    """

    k: int = -1
    exponential_gain: bool = False
    report_ndcg_as_decreasing_curve: bool = True
    remove_single_length_sessions: bool = False
    scale_by_weights_tensor: bool = False
    session_key: str = "session_ids"

    namespace: ClassVar[str] = "ndcg"
    binary_labels: ClassVar[bool] = False  # graded relevance
    output_names: ClassVar[tuple[str, ...]] = ("ndcg",)
    state_names: ClassVar[tuple[str, ...]] = ("sum_ndcg", "num_sessions")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.k, int) or not (self.k == -1 or self.k >= 1):
            raise ValueError(f"NDCGMetric: k must be -1 (all) or a positive int, got {self.k!r}")

    def input_names(self) -> tuple[str, ...]:
        return (self.session_key,)

    def batch_sums(self, p, y, w, **inputs):
        def one(p, y, w, ids):
            return session_ndcg_terms(
                p,
                y,
                w,
                ids,
                k=self.k,
                exponential_gain=self.exponential_gain,
                decreasing=self.report_ndcg_as_decreasing_curve,
                remove_single_length_sessions=self.remove_single_length_sessions,
                scale_by_weights_tensor=self.scale_by_weights_tensor,
            )

        total, count = per_task(one, self.num_tasks, p, y, w, shared=(inputs[self.session_key],))
        return {"sum_ndcg": total, "num_sessions": count}

    def compute_sums(self, sums):
        return {"ndcg": sums["sum_ndcg"] / sums["num_sessions"]}
