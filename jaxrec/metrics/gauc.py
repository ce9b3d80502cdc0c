"""Group (session) AUC: the mean of per-session AUCs (TorchRec's `GAUCMetric`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from .base import SumMetric
from .sessions import per_task, segmented_cumsum, sort_sessions

SESSION_WEIGHTINGS = ("session", "num_samples")


@jax.jit  # also when `update` runs eagerly: one compile, not one per primitive
def session_aucs(p: jax.Array, y: jax.Array, w: jax.Array, session_ids: jax.Array):
    """Weighted ROC AUC of each session of a batch (ties count half).

    Args:
      p, y, w: `[B]` predictions, labels in [0, 1], weights.
      session_ids: `[B]` integer session ids.

    Returns:
      `(auc, counted, num_samples)`, each `[B]` indexed by session `0 .. S-1`
      (entries past `S` are empty): the AUC, whether the session counts (it has
      positive and negative weight and not all predictions equal: TorchRec's
      masks), and its number of samples.
    """
    n = p.shape[0]
    s = sort_sessions(session_ids, p, descending=False)
    y, w = y[s.order], w[s.order]
    pos, neg = w * y, w * (1.0 - y)
    # Negative weight of the session strictly below each tie group, plus half the
    # group's own negatives (ties).
    neg_upto = segmented_cumsum(neg, s.segment)
    neg_below = neg_upto[s.group_first] - neg[s.group_first]
    neg_tied = jax.ops.segment_sum(neg, s.group, num_segments=n, indices_are_sorted=True)
    area = pos * (neg_below + 0.5 * neg_tied[s.group])

    def seg(x, op=jax.ops.segment_sum):
        return op(x, s.segment, num_segments=n, indices_are_sorted=True)

    total_pos, total_neg = seg(pos), seg(neg)
    denom = total_pos * total_neg
    auc = seg(area) / jnp.where(denom > 0, denom, 1.0)
    varied = seg(s.key, jax.ops.segment_max) > seg(s.key, jax.ops.segment_min)
    counted = (total_pos > 0) & (total_neg > 0) & varied
    return auc, counted, seg(jnp.ones_like(p))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GAUCMetric(SumMetric):
    """Group AUC: the AUC of each session (user, query) of a batch, averaged over
    sessions (TorchRec's `GAUCMetric`).

    A session counts when it has positive and negative weight and its predictions
    are not all equal (TorchRec's masks); each counted session adds its AUC to
    `auc_sum` and 1 to `num_samples` (TorchRec's name for the session count). With
    `session_weighting="num_samples"`, a session adds `n * auc` and `n` instead (`n`
    its number of samples: the impression-weighted GAUC of the DIN paper).

    Sessions are per batch, as in TorchRec (a session split across batches counts
    as two). Ties in predictions count half within a session; TorchRec's
    `argsort` makes them depend on sample order (identical when predictions are
    distinct). TorchRec also reads a prediction of exactly 0 as padding when it
    tests "all predictions equal"; here only equal values are.

    `update(state, predictions, labels, weights, session_ids=ids)`: `ids` `[B]`
    integer, one per sample, shared by the tasks; any values, in any order
    (TorchRec takes `num_candidates`, the lengths of contiguous sessions:
    `ids = jnp.repeat(jnp.arange(S), num_candidates, total_repeat_length=B)`).

    Attributes:
      session_weighting: "session" (TorchRec) or "num_samples".
      session_key: the keyword `update` takes the session ids by (TorchRec's
        `session_key`).

    Returns (compute): {"gauc": mean AUC of the counted sessions (0.5 with none,
    as TorchRec), "gauc_num_samples": the number (or samples) of counted sessions}.
    """

    session_weighting: str = "session"
    session_key: str = "session_ids"

    namespace: ClassVar[str] = "gauc"
    output_names: ClassVar[tuple[str, ...]] = ("gauc", "gauc_num_samples")
    state_names: ClassVar[tuple[str, ...]] = ("auc_sum", "num_samples")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.session_weighting not in SESSION_WEIGHTINGS:
            raise ValueError(
                f"GAUCMetric: session_weighting must be one of {SESSION_WEIGHTINGS}, "
                f"got {self.session_weighting!r}"
            )

    def input_names(self) -> tuple[str, ...]:
        return (self.session_key,)

    def batch_sums(self, p, y, w, **inputs):
        def one(p, y, w, ids):
            auc, counted, size = session_aucs(p, y, w, ids)
            weight = size if self.session_weighting == "num_samples" else 1.0
            weight = jnp.where(counted, weight, 0.0)
            return jnp.sum(weight * auc), jnp.sum(weight)

        auc_sum, num = per_task(one, self.num_tasks, p, y, w, shared=(inputs[self.session_key],))
        return {"auc_sum": auc_sum, "num_samples": num}

    def compute_sums(self, sums):
        num = sums["num_samples"]
        gauc = jnp.where(num > 0, sums["auc_sum"] / jnp.where(num > 0, num, 1.0), 0.5)
        return {"gauc": gauc, "gauc_num_samples": num}
