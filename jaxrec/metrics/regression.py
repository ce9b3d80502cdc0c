"""Regression metrics over weighted sums: MSE / RMSE / R^2 and MAE (TorchRec's names).

Predictions are raw values here (no sigmoid).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from .base import SumMetric, safe_div


@dataclasses.dataclass(frozen=True, kw_only=True)
class MSEMetric(SumMetric):
    """Weighted mean squared error and its root (TorchRec's `MSEMetric`).

    `mse = sum(w * (y - p)^2) / sum(w)`, `rmse = sqrt(mse)`, both 0 when the total
    weight is 0. With `include_r_squared`, also TorchRec's
    `r_squared = 1 - sum(w (y - p)^2) / (sum(w y^2) - sum(w y)^2 / sum(w))`
    (1 when the denominator is 0, nan when the total weight is 0).

    Returns (compute): {"mse": ..., "rmse": ...[, "r_squared": ...]}.
    """

    include_r_squared: bool = False

    namespace: ClassVar[str] = "mse"
    binary_labels: ClassVar[bool] = False
    state_names: ClassVar[tuple[str, ...]] = (
        "error_sum",
        "weighted_num_samples",
        "label_sum",
        "label_squared_sum",
    )

    def outputs(self) -> tuple[str, ...]:
        return ("mse", "rmse", "r_squared") if self.include_r_squared else ("mse", "rmse")

    def batch_sums(self, p, y, w):
        return {
            "error_sum": jnp.sum(w * jnp.square(y - p), axis=-1),
            "weighted_num_samples": jnp.sum(w, axis=-1),
            "label_sum": jnp.sum(w * y, axis=-1),
            "label_squared_sum": jnp.sum(w * jnp.square(y), axis=-1),
        }

    def compute_sums(self, sums):
        err, num = sums["error_sum"], sums["weighted_num_samples"]
        mse = safe_div(err, num)
        out = {"mse": mse, "rmse": jnp.sqrt(mse)}
        if self.include_r_squared:
            # nan without samples (0 / 0), as TorchRec.
            total = sums["label_squared_sum"] - jnp.square(sums["label_sum"]) / num
            out["r_squared"] = 1.0 - safe_div(err, total, default=0.0)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class MAEMetric(SumMetric):
    """Weighted mean absolute error `sum(w * |y - p|) / sum(w)` (TorchRec's
    `MAEMetric`); 0 when the total weight is 0.

    Returns (compute): {"mae": ...}.
    """

    namespace: ClassVar[str] = "mae"
    binary_labels: ClassVar[bool] = False
    output_names: ClassVar[tuple[str, ...]] = ("mae",)
    state_names: ClassVar[tuple[str, ...]] = ("error_sum", "weighted_num_samples")

    def batch_sums(self, p, y, w):
        return {
            "error_sum": jnp.sum(w * jnp.abs(y - p), axis=-1),
            "weighted_num_samples": jnp.sum(w, axis=-1),
        }

    def compute_sums(self, sums):
        return {"mae": safe_div(sums["error_sum"], sums["weighted_num_samples"])}
