"""Ratio metrics over weighted sums: CTR, calibration, accuracy (TorchRec's names)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from .base import SumMetric, safe_div


def to_probabilities(p: jax.Array, from_logits: bool) -> jax.Array:
    return jax.nn.sigmoid(p) if from_logits else p


@dataclasses.dataclass(frozen=True, kw_only=True)
class CTRMetric(SumMetric):
    """Weighted click-through rate `sum(w * y) / sum(w)` (TorchRec's `CTRMetric`);
    0 when the total weight is 0. Predictions are not used.

    Returns (compute): {"ctr": ...}.
    """

    namespace: ClassVar[str] = "ctr"
    output_names: ClassVar[tuple[str, ...]] = ("ctr",)
    state_names: ClassVar[tuple[str, ...]] = ("ctr_num", "ctr_denom")

    def batch_sums(self, p, y, w):
        return {"ctr_num": jnp.sum(w * y, axis=-1), "ctr_denom": jnp.sum(w, axis=-1)}

    def compute_sums(self, sums):
        return {"ctr": safe_div(sums["ctr_num"], sums["ctr_denom"])}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibrationMetric(SumMetric):
    """Calibration `sum(w * p) / sum(w * y)` (TorchRec's `CalibrationMetric`);
    0 when `sum(w * y) <= 0` (e.g. no positive labels).

    Attributes:
      from_logits: predictions are logits (a sigmoid is applied first).

    Returns (compute): {"calibration": ...}.
    """

    from_logits: bool = False

    namespace: ClassVar[str] = "calibration"
    output_names: ClassVar[tuple[str, ...]] = ("calibration",)
    state_names: ClassVar[tuple[str, ...]] = ("calibration_num", "calibration_denom")

    def batch_sums(self, p, y, w):
        p = to_probabilities(p, self.from_logits)
        return {
            "calibration_num": jnp.sum(w * p, axis=-1),
            "calibration_denom": jnp.sum(w * y, axis=-1),
        }

    def compute_sums(self, sums):
        num, denom = sums["calibration_num"], sums["calibration_denom"]
        ok = denom > 0
        return {"calibration": jnp.where(ok, num / jnp.where(ok, denom, 1.0), 0.0)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AccuracyMetric(SumMetric):
    """Weighted accuracy `sum(w * ((p >= threshold) == y)) / sum(w)` (TorchRec's
    `AccuracyMetric`); 0 when the total weight is 0. Labels are compared exactly,
    so soft labels count as wrong, as in TorchRec.

    Attributes:
      threshold: decision threshold on the probability (TorchRec's default 0.5).
      from_logits: predictions are logits (a sigmoid is applied first).

    Returns (compute): {"accuracy": ...}.
    """

    threshold: float = 0.5
    from_logits: bool = False

    namespace: ClassVar[str] = "accuracy"
    output_names: ClassVar[tuple[str, ...]] = ("accuracy",)
    state_names: ClassVar[tuple[str, ...]] = ("accuracy_sum", "weighted_num_samples")

    def batch_sums(self, p, y, w):
        p = to_probabilities(p, self.from_logits)
        hit = ((p >= self.threshold).astype(w.dtype) == y).astype(w.dtype)
        return {
            "accuracy_sum": jnp.sum(w * hit, axis=-1),
            "weighted_num_samples": jnp.sum(w, axis=-1),
        }

    def compute_sums(self, sums):
        return {"accuracy": safe_div(sums["accuracy_sum"], sums["weighted_num_samples"])}
