"""Lifetime and window results of any sum-state metric (TorchRec's `lifetime_*` and
`window_*` values).

TorchRec keeps, beside each state, a `window_` copy fed by a deque of the last
batches' states (`WindowBuffer`: batches are dropped once they hold more than
`window_size` samples). Here the window is a ring of the last `window_batches`
batch states, stacked on a leading axis of static size, merged at `compute`. With
a fixed batch size `B`, TorchRec's `window_size=N` is `window_batches = N // B`
(TorchRec's window is per rank: `ceil(N / world_size)` samples each).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .base import Metric, State, SumMetric


class WindowState(NamedTuple):
    """`lifetime`: the metric's state over every batch; `ring`: its state of each of
    the last `window_batches` batches (leaves `[W, ...]`, zeros before the first
    `W` batches); `head`: the ring slot the next batch writes (int32)."""

    lifetime: State
    ring: State
    head: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowedMetric(Metric):
    """A sum-state metric reported over its lifetime and over the last
    `window_batches` batches.

    Attributes:
      metric: any `SumMetric` (NE, CTR, calibration, GAUC, NDCG, segmented NE, ...).
        Buffered AUC keeps its own window: `AUCMetric(on_overflow="window")`.
      window_batches: batches in the window (static).

    `merge` and `reduce` combine shards of the same steps (data parallel: device
    `d`'s batch `i` is a part of global batch `i`), so the states must have seen
    the same number of batches.

    Returns (compute): the metric's outputs twice, prefixed: {"lifetime_ne": ...,
    "window_ne": ..., ...}; with `MetricCollection(key_format="torchrec")` the keys
    are TorchRec's `"ne-DefaultTask|lifetime_ne"` and `"...|window_ne"`.

    Example:
      >>> m = WindowedMetric(metric=NEMetric(), window_batches=100)
      >>> state = jax.jit(m.update)(m.init(), probs, labels)
      >>> m.compute(state)  # {"lifetime_ne": ..., "window_ne": ..., ...}
    """

    metric: SumMetric
    window_batches: int

    def __post_init__(self) -> None:
        if not isinstance(self.metric, SumMetric):
            raise TypeError(
                f"WindowedMetric: metric must be a SumMetric (a state of sums), got "
                f"{type(self.metric).__name__}; for exact AUC/AUPRC use "
                "on_overflow='window' with capacity = the window in samples"
            )
        if self.num_tasks is not None and self.num_tasks != self.metric.num_tasks:
            raise ValueError(
                f"WindowedMetric: num_tasks={self.num_tasks} differs from the metric's "
                f"{self.metric.num_tasks}; leave it unset"
            )
        object.__setattr__(self, "num_tasks", self.metric.num_tasks)
        if not isinstance(self.window_batches, int) or self.window_batches < 1:
            raise ValueError(
                "WindowedMetric: window_batches must be a positive int, "
                f"got {self.window_batches!r}"
            )

    @property
    def namespace(self) -> str:  # type: ignore[override]
        return self.metric.namespace

    @property
    def binary_labels(self) -> bool:  # type: ignore[override]
        return self.metric.binary_labels

    @property
    def from_logits(self) -> bool:
        return getattr(self.metric, "from_logits", False)

    def key_prefix(self) -> str:
        return ""  # the output names carry TorchRec's prefixes

    def outputs(self) -> tuple[str, ...]:
        names = self.metric.outputs()
        return tuple(f"lifetime_{n}" for n in names) + tuple(f"window_{n}" for n in names)

    def input_names(self) -> tuple[str, ...]:
        return self.metric.input_names()

    def init(self) -> WindowState:
        one = self.metric.init()
        ring = jax.tree.map(lambda x: jnp.zeros((self.window_batches, *x.shape), x.dtype), one)
        return WindowState(one, ring, jnp.zeros((), jnp.int32))

    def update(self, state, predictions, labels, weights=None, **inputs):
        batch = self.metric.update(self.metric.init(), predictions, labels, weights, **inputs)
        ring = jax.tree.map(lambda r, b: r.at[state.head].set(b), state.ring, batch)
        return WindowState(
            self.metric.merge(state.lifetime, batch),
            ring,
            (state.head + 1) % self.window_batches,
        )

    def merge(self, a, b):
        return WindowState(
            self.metric.merge(a.lifetime, b.lifetime), self.metric.merge(a.ring, b.ring), a.head
        )

    def reduce(self, state, axis_name):
        return WindowState(
            self.metric.reduce(state.lifetime, axis_name),
            self.metric.reduce(state.ring, axis_name),
            state.head,
        )

    def window_state(self, state: WindowState) -> State:
        """The metric's state over the window (the ring's batches merged)."""
        merged, _ = jax.lax.scan(
            lambda acc, b: (self.metric.merge(acc, b), None), self.metric.init(), state.ring
        )
        return merged

    def compute(self, state):
        lifetime = self.metric.compute(state.lifetime)
        window = self.metric.compute(self.window_state(state))
        return {f"lifetime_{k}": v for k, v in lifetime.items()} | {
            f"window_{k}": v for k, v in window.items()
        }

    def check(self, state) -> None:
        self.metric.check(state.lifetime)
