"""Tie-aware ROC AUC and AUPRC over score groups, fixed shapes, jit-able.

Both the exact metrics (sorted sample buffers) and the streaming ones (histograms)
reduce to the same maths over *groups* of equal score, ordered by descending score:
`pos[g]` and `neg[g]` are the weighted positives `sum(w * y)` and negatives
`sum(w * (1 - y))` of group g. Trailing empty groups are allowed (they add nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def auc_from_groups(pos: jax.Array, neg: jax.Array) -> jax.Array:
    """ROC AUC = P(score of a positive > score of a negative) + P(tie) / 2, weighted.

    Equals the trapezoidal area under the ROC curve with one point per distinct
    score (scikit-learn's `roc_auc_score`). 0.5 when there are no positives or no
    negatives (TorchRec's no-signal default).

    Args:
      pos, neg: `[G]` weighted positives / negatives per group, descending score.
    """
    pos_above = jnp.cumsum(pos) - pos
    total_pos, total_neg = jnp.sum(pos), jnp.sum(neg)
    area = jnp.sum(neg * (pos_above + 0.5 * pos))
    denom = total_pos * total_neg
    return jnp.where(denom > 0, area / jnp.where(denom > 0, denom, 1.0), 0.5)


def auc_tie_error_bound(pos: jax.Array, neg: jax.Array) -> jax.Array:
    """Largest possible |AUC error| from scoring each group's pairs as ties:
    `sum(pos * neg) / (2 P N)` (0 when the AUC is the 0.5 default)."""
    denom = jnp.sum(pos) * jnp.sum(neg)
    return jnp.where(denom > 0, 0.5 * jnp.sum(pos * neg) / jnp.where(denom > 0, denom, 1.0), 0.0)


def auprc_from_groups(pos: jax.Array, neg: jax.Array) -> jax.Array:
    """Area under the precision-recall curve as TorchRec computes it: a Riemann sum
    `sum_g (recall_g - recall_{g-1}) * precision_g` over distinct scores (average
    precision, scikit-learn's `average_precision_score`). 0 when there are no
    positives (TorchRec's result).
    """
    tp, fp = jnp.cumsum(pos), jnp.cumsum(neg)
    seen = tp + fp
    precision = jnp.where(seen > 0, tp / jnp.where(seen > 0, seen, 1.0), 1.0)
    total_pos = jnp.sum(pos)
    ok = total_pos > 0
    return jnp.where(ok, jnp.sum(pos * precision) / jnp.where(ok, total_pos, 1.0), 0.0)


def group_by_score(
    scores: jax.Array, labels: jax.Array, weights: jax.Array, valid: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sorts samples by descending score and sums them per distinct score.

    Args:
      scores, labels, weights: `[n]`.
      valid: `[n]` bool; invalid entries (buffer padding) contribute nothing.

    Returns:
      `(pos, neg)`, each `[n]`: per-group weighted positives / negatives in
      descending score order, zero-padded.
    """
    n = scores.shape[0]
    w = jnp.where(valid, weights, 0.0)
    # Padding sorts last as its own (zero-weight) group, so it never splits a tie.
    key = jnp.where(valid, -scores, jnp.inf)
    key, y, w = jax.lax.sort((key, labels, w), num_keys=1)
    start = jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]])
    group = jnp.cumsum(start) - 1
    pos = jax.ops.segment_sum(w * y, group, num_segments=n, indices_are_sorted=True)
    neg = jax.ops.segment_sum(w * (1.0 - y), group, num_segments=n, indices_are_sorted=True)
    return pos, neg
