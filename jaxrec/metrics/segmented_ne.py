"""NE per segment of a feature (TorchRec's `SegmentedNEMetric`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .base import SumMetric, replicated_like, sum_value
from .ne import ne_from_sums, ne_sums

_SUMS = ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels")


def _per_group(values: jax.Array, group: jax.Array, num_groups: int) -> jax.Array:
    """Sums `values` `[*tasks, B]` per group `[B]` (ids outside `[0, num_groups)`
    are dropped, and counted by the caller): `[*tasks, num_groups]`."""
    out = jnp.zeros((*values.shape[:-1], num_groups), values.dtype)
    return out.at[..., group].add(values, mode="drop", out_sharding=replicated_like(values))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SegmentedNEMetric(SumMetric):
    """NE (and optionally log loss) of each segment of the samples, e.g. per
    country or per surface (TorchRec's `SegmentedNEMetric`).

    `update(..., grouping_keys=g)`: `g` `[B]` integer in `[0, num_groups)`, one per
    sample, shared by the tasks. Under `jit` an id out of range cannot raise: it is
    counted, `compute` then returns nan for every segment and `check` (host)
    raises with the count.

    Attributes:
      num_groups: static number of segments.
      include_logloss: also report the log loss of each segment.
      eta: TorchRec's clamp, 1e-12.
      grouping_key: the keyword of the segment ids in `update` (TorchRec's
        `grouping_keys`).

    Returns (compute): TorchRec's names, one entry per segment:
    {"segmented_ne_0": ..., "segmented_ne_1": ..., ["logloss_0": ..., ...]}; a
    segment without samples is nan (0 / 0, as TorchRec).
    """

    num_groups: int
    include_logloss: bool = False
    eta: float = 1e-12
    grouping_key: str = "grouping_keys"

    namespace: ClassVar[str] = "segmented_ne"
    state_names: ClassVar[tuple[str, ...]] = (*_SUMS, "out_of_range_samples")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.num_groups, int) or self.num_groups < 1:
            raise ValueError(
                f"SegmentedNEMetric: num_groups must be a positive int, got {self.num_groups!r}"
            )

    def state_shape_of(self, name: str) -> tuple[int, ...]:
        if name == "out_of_range_samples":
            return ()
        return (*self.task_shape, self.num_groups)

    def input_names(self) -> tuple[str, ...]:
        return (self.grouping_key,)

    def outputs(self) -> tuple[str, ...]:
        names = [f"segmented_ne_{g}" for g in range(self.num_groups)]
        if self.include_logloss:
            names += [f"logloss_{g}" for g in range(self.num_groups)]
        return tuple(names)

    def batch_sums(self, p, y, w, **inputs):
        g = inputs[self.grouping_key]
        bad = (g < 0) | (g >= self.num_groups)
        g = jnp.where(bad, self.num_groups, g)  # negative ids would wrap: drop them too
        values = {
            "cross_entropy_sum": ne_sums(p, y, w, self.eta, False),
            "weighted_num_samples": w,
            "pos_labels": w * y,
            "neg_labels": w * (1.0 - y),
        }
        out = {k: _per_group(v, g, self.num_groups) for k, v in values.items()}
        out["out_of_range_samples"] = jnp.sum(bad).astype(w.dtype)
        return out

    def compute_sums(self, sums):
        ce, pos, neg = sums["cross_entropy_sum"], sums["pos_labels"], sums["neg_labels"]
        num = sums["weighted_num_samples"]
        bad = sums["out_of_range_samples"] > 0
        ne = jnp.where(bad, jnp.nan, ne_from_sums(ce, num, pos, neg, self.eta))
        out = {f"segmented_ne_{g}": ne[..., g] for g in range(self.num_groups)}
        if self.include_logloss:
            logloss = jnp.where(bad, jnp.nan, ce / jnp.maximum(pos + neg, self.eta))
            out |= {f"logloss_{g}": logloss[..., g] for g in range(self.num_groups)}
        return out

    def check(self, state) -> None:
        bad = int(np.asarray(sum_value(state["out_of_range_samples"])))
        if bad:
            raise ValueError(
                f"SegmentedNEMetric: {bad} samples had {self.grouping_key} outside "
                f"[0, num_groups={self.num_groups}); their segment is unknown, so every "
                "result is nan. Use num_groups > the largest id, or map ids into range."
            )
