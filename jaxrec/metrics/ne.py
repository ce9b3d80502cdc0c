"""Normalized entropy and log loss (TorchRec's `NEMetric`, `include_logloss=True`),
and calibration-free NE (TorchRec's `CaliFreeNEMetric`)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from .base import SumMetric

_LN2 = math.log(2.0)


def log_clamped(p: jax.Array, eta: float) -> jax.Array:
    """`log(clamp(p, eta, 1 - eta))`, accurate in float32.

    In float32 `1 - 1e-12 == 1`, so the upper clamp is applied as
    `log1p(-max(1 - p, eta))` (`1 - p` is exact for p >= 0.5).
    """
    high = jnp.log1p(-jnp.maximum(1.0 - p, eta))
    low = jnp.log(jnp.clip(p, eta, 0.5))
    return jnp.where(p > 0.5, high, low)


def log1m_clamped(p: jax.Array, eta: float) -> jax.Array:
    """`log(1 - clamp(p, eta, 1 - eta))`, accurate in float32."""
    low = jnp.log1p(-jnp.clip(p, eta, 0.5))
    high = jnp.log(jnp.maximum(1.0 - p, eta))
    return jnp.where(p < 0.5, low, high)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NEMetric(SumMetric):
    """Normalized entropy: weighted binary cross entropy divided by the entropy of
    the weighted base rate (TorchRec's `NEMetric`; log base 2 as there).

    `ne = sum(w * CE(p, y)) / (-P log2(ctr) - N log2(1 - ctr))` with
    `P = sum(w * y)`, `N = sum(w * (1 - y))`, `ctr = P / max(sum(w), eta)`, and
    predictions and `ctr` clamped to `[eta, 1 - eta]`. Also reports TorchRec's
    `logloss = sum(w * CE) / max(P + N, eta)` (base-2 cross entropy per unit weight).

    Attributes:
      from_logits: predictions are logits (uses `log_sigmoid`, exact far into the tails).
      eta: TorchRec's clamp, 1e-12.
      include_logloss: also report "logloss".
      allow_missing_label_with_zero_weight: as TorchRec, report `eta` instead of
        inf/nan for tasks whose total weight is 0.

    Returns (compute): {"ne": [T] or scalar, "logloss": ...}. With all labels positive
    (or all negative) the base entropy is ~0 and NE is huge, as in TorchRec; with no
    samples NE is nan.
    """

    from_logits: bool = False
    eta: float = 1e-12
    include_logloss: bool = True
    allow_missing_label_with_zero_weight: bool = False

    namespace: ClassVar[str] = "ne"
    state_names: ClassVar[tuple[str, ...]] = (
        "cross_entropy_sum",
        "weighted_num_samples",
        "pos_labels",
        "neg_labels",
    )

    def outputs(self) -> tuple[str, ...]:
        return ("ne", "logloss") if self.include_logloss else ("ne",)

    def batch_sums(self, p, y, w):
        ce = ne_sums(p, y, w, self.eta, self.from_logits)
        return {
            "cross_entropy_sum": jnp.sum(ce, axis=-1),
            "weighted_num_samples": jnp.sum(w, axis=-1),
            "pos_labels": jnp.sum(w * y, axis=-1),
            "neg_labels": jnp.sum(w * (1.0 - y), axis=-1),
        }

    def compute_sums(self, sums):
        eta = self.eta
        ce_sum, num = sums["cross_entropy_sum"], sums["weighted_num_samples"]
        pos, neg = sums["pos_labels"], sums["neg_labels"]
        mean_label = pos / jnp.maximum(num, eta)
        ce_norm = -(pos * log_clamped(mean_label, eta) + neg * log1m_clamped(mean_label, eta))
        ne = ce_sum / ce_norm * _LN2
        if self.allow_missing_label_with_zero_weight:
            ne = jnp.where(num > 0, ne, eta)
        out = {"ne": ne}
        if self.include_logloss:
            out["logloss"] = ce_sum / jnp.maximum(pos + neg, eta)
        return out


def ne_sums(p: jax.Array, y: jax.Array, w: jax.Array, eta: float, from_logits: bool):
    """Per-sample base-2 cross entropy `[*tasks, B]` of `NEMetric`."""
    if from_logits:
        floor = math.log(eta)
        log_p = jnp.maximum(jax.nn.log_sigmoid(p), floor)
        log_q = jnp.maximum(jax.nn.log_sigmoid(-p), floor)
    else:
        log_p, log_q = log_clamped(p, eta), log1m_clamped(p, eta)
    return -w * (y * log_p + (1.0 - y) * log_q) / _LN2


def ne_from_sums(ce_sum, num, pos, neg, eta: float) -> jax.Array:
    """NE from its four sums (`NEMetric.compute_sums`' formula)."""
    mean_label = pos / jnp.maximum(num, eta)
    ce_norm = -(pos * log_clamped(mean_label, eta) + neg * log1m_clamped(mean_label, eta))
    return ce_sum / ce_norm * _LN2


@dataclasses.dataclass(frozen=True, kw_only=True)
class CaliFreeNEMetric(SumMetric):
    """Calibration-free NE (TorchRec's `CaliFreeNEMetric`, namespace "cali_free_ne").

    TorchRec's formula: `ne / (-P log2(m) - (W - P) log2(1 - m))` with `ne` as
    `NEMetric`'s, `P = sum(w * y)`, `W = sum(w)` and `m = sum(w * p) / W` the mean
    prediction. The denominator is a sum over samples (TorchRec does not divide it
    by `W`), so the value scales as `1 / W`; it is given here as TorchRec computes it.

    Attributes:
      eta: TorchRec's clamp, 1e-12.
      allow_missing_label_with_zero_weight: as TorchRec, report `eta` when a task's
        total weight is 0.

    Returns (compute): {"cali_free_ne": ...}.
    """

    eta: float = 1e-12
    allow_missing_label_with_zero_weight: bool = False

    namespace: ClassVar[str] = "cali_free_ne"
    output_names: ClassVar[tuple[str, ...]] = ("cali_free_ne",)
    state_names: ClassVar[tuple[str, ...]] = (
        "cross_entropy_sum",
        "weighted_num_samples",
        "pos_labels",
        "neg_labels",
        "weighted_sum_predictions",
    )

    def batch_sums(self, p, y, w):
        return {
            "cross_entropy_sum": jnp.sum(ne_sums(p, y, w, self.eta, False), axis=-1),
            "weighted_num_samples": jnp.sum(w, axis=-1),
            "pos_labels": jnp.sum(w * y, axis=-1),
            "neg_labels": jnp.sum(w * (1.0 - y), axis=-1),
            "weighted_sum_predictions": jnp.sum(w * p, axis=-1),
        }

    def compute_sums(self, sums):
        num, pos = sums["weighted_num_samples"], sums["pos_labels"]
        ne = ne_from_sums(
            sums["cross_entropy_sum"], jnp.maximum(num, self.eta), pos, sums["neg_labels"], self.eta
        )
        mean_pred = sums["weighted_sum_predictions"] / num
        out = ne / (-pos * jnp.log2(mean_pred) - (num - pos) * jnp.log2(1.0 - mean_pred))
        if self.allow_missing_label_with_zero_weight:
            out = jnp.where(jnp.all(num > 0), out, self.eta)
        return {"cali_free_ne": out}
