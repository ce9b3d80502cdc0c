"""Exact AUC and AUPRC over a fixed-capacity sample buffer (TorchRec's `AUCMetric`,
`AUPRCMetric`).

TorchRec keeps every (prediction, label, weight) of the last `window_size` samples
in growing Python lists. Here the buffer has a static `capacity`; `on_overflow`
picks what happens when more samples arrive than fit:

- `"error"` (default, lifetime metric): the state records the overflow, `compute`
  returns nan and `check` (host) raises, saying what capacity is needed;
- `"window"` (TorchRec's semantics): a ring buffer keeps the most recent
  `capacity` samples.

The buffer is a ring: samples in chronological order sit at
`(head - size + k) % capacity` for `k < size` ("error" mode never wraps: `head == size`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .base import Metric, acc_dtype, gather_invariant, replicated_like, validate_inputs
from .ranking import auc_from_groups, auprc_from_groups, group_by_score
from .rates import to_probabilities


class SampleBuffer(NamedTuple):
    """Buffered samples. `predictions`, `labels`, `weights`: `[*tasks, capacity]`;
    `size`: valid entries; `head`: next write position; `seen`: samples offered
    (int32, saturating); `overflow`: "error" mode lost samples."""

    predictions: jax.Array
    labels: jax.Array
    weights: jax.Array
    size: jax.Array
    head: jax.Array
    seen: jax.Array
    overflow: jax.Array


def _saturating_add(a: jax.Array, b: jax.Array | int) -> jax.Array:
    limit = jnp.iinfo(jnp.int32).max
    return jnp.where(a > limit - b, limit, a + b).astype(jnp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _BufferMetric(Metric):
    capacity: int
    on_overflow: str = "error"
    from_logits: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"{name}: capacity must be a positive int, got {self.capacity!r}")
        if self.on_overflow not in ("error", "window"):
            raise ValueError(
                f"{name}: on_overflow must be 'error' or 'window', got {self.on_overflow!r}"
            )

    def key_prefix(self) -> str:
        return "window_" if self.on_overflow == "window" else "lifetime_"

    def init(self) -> SampleBuffer:
        shape = (*self.task_shape, self.capacity)
        buf = lambda: jnp.zeros(shape, acc_dtype())
        count = lambda: jnp.zeros((), jnp.int32)
        return SampleBuffer(buf(), buf(), buf(), count(), count(), count(), jnp.zeros((), bool))

    def update(self, state, predictions, labels, weights=None):
        p, y, w = self.prepare(predictions, labels, weights)
        p = to_probabilities(p, self.from_logits)
        rep = replicated_like(p)
        if rep is not None:  # a batch sharded over explicit mesh axes: gather it
            p, y, w = (jax.sharding.reshard(x, rep) for x in (p, y, w))
        cap, batch = self.capacity, p.shape[-1]
        if self.on_overflow == "window":
            if batch > cap:  # only the newest `cap` samples can survive
                p, y, w = p[..., -cap:], y[..., -cap:], w[..., -cap:]
            n = min(batch, cap)
            pos = (state.head + jnp.arange(n)) % cap
            overflow = state.overflow
            head = (state.head + n) % cap
        else:
            n = batch
            pos = state.head + jnp.arange(n)  # past the end: dropped, and flagged
            overflow = state.overflow | (state.size + n > cap)
            head = jnp.minimum(state.head + n, cap)  # == size: "error" mode never wraps
        size = jnp.minimum(state.size + n, cap)
        put = lambda buf, v: buf.at[..., pos].set(v, mode="drop")
        return SampleBuffer(
            put(state.predictions, p),
            put(state.labels, y),
            put(state.weights, w),
            size.astype(jnp.int32),
            head.astype(jnp.int32),
            _saturating_add(state.seen, batch),
            overflow,
        )

    def merge(self, a, b):
        """`b`'s samples after `a`'s; "window" keeps the newest `capacity` of both."""
        cap = self.capacity
        k = jnp.arange(cap)
        total = a.size + b.size
        keep = jnp.minimum(total, cap)
        # Result slot k holds combined sample j = total - keep + k (the newest ones);
        # "error" mode keeps the oldest, but an overflowing state reports nan anyway.
        j = k + (total - keep if self.on_overflow == "window" else 0)
        from_a = j < a.size
        ia = (a.head - a.size + j) % cap
        ib = (b.head - b.size + (j - a.size)) % cap
        valid = k < keep

        def pick(xa, xb):
            v = jnp.where(from_a, xa[..., ia], xb[..., ib])
            return jnp.where(valid, v, 0.0)

        overflow = a.overflow | b.overflow
        if self.on_overflow == "error":
            overflow = overflow | (total > cap)
        return SampleBuffer(
            pick(a.predictions, b.predictions),
            pick(a.labels, b.labels),
            pick(a.weights, b.weights),
            keep.astype(jnp.int32),
            (keep % cap if self.on_overflow == "window" else keep).astype(jnp.int32),
            _saturating_add(a.seen, b.seen),
            overflow,
        )

    def reduce(self, state, axis_name):
        gathered = jax.tree.map(lambda x: gather_invariant(x, axis_name), state)
        first = jax.tree.map(lambda x: x[0], gathered)
        rest = jax.tree.map(lambda x: x[1:], gathered)
        out, _ = jax.lax.scan(lambda c, s: (self.merge(c, s), None), first, rest)
        return out

    def check(self, state) -> None:
        if self.on_overflow == "error" and bool(np.asarray(state.overflow)):
            seen = int(np.asarray(state.seen))
            raise ValueError(
                f"{type(self).__name__}: {seen} samples were given to a buffer of capacity "
                f"{self.capacity}; the result would be wrong. Use capacity >= {seen} "
                "(for the whole run), on_overflow='window' (TorchRec's windowed AUC), "
                "or the streaming histogram metric."
            )

    def _per_task(self, state, fn):
        valid = jnp.arange(self.capacity) < state.size

        def one(p, y, w):
            return fn(*group_by_score(p, y, w, valid))

        if self.num_tasks is None:
            value = one(state.predictions, state.labels, state.weights)
        else:
            value = jax.vmap(one)(state.predictions, state.labels, state.weights)
        return jnp.where(state.overflow, jnp.nan, value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AUCMetric(_BufferMetric):
    """Exact weighted ROC AUC over buffered samples (TorchRec's `AUCMetric`).

    Ties in predictions count half (scikit-learn's `roc_auc_score`); TorchRec's
    sort-based trapezoid instead depends on the order of tied samples. Returns 0.5
    when there are no positives or no negatives (as TorchRec) and nan after an
    "error"-mode overflow.

    Attributes:
      capacity: static buffer size in samples (per task).
      on_overflow: "error" (lifetime; overflow -> nan and `check` raises) or
        "window" (the newest `capacity` samples, TorchRec's `window_size`).
      from_logits: predictions are logits (only their order matters for AUC).

    Returns (compute): {"auc": ...}.
    """

    namespace: ClassVar[str] = "auc"
    output_names: ClassVar[tuple[str, ...]] = ("auc",)

    def compute(self, state):
        return {"auc": self._per_task(state, auc_from_groups)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AUPRCMetric(_BufferMetric):
    """Exact weighted area under the precision-recall curve over buffered samples
    (TorchRec's `AUPRCMetric`: Riemann sum over distinct predictions, i.e. average
    precision). 0 when there are no positives; nan after an "error"-mode overflow.

    Attributes: as `AUCMetric`.

    Returns (compute): {"auprc": ...}.
    """

    namespace: ClassVar[str] = "auprc"
    output_names: ClassVar[tuple[str, ...]] = ("auprc",)

    def compute(self, state):
        return {"auprc": self._per_task(state, auprc_from_groups)}


@jax.jit
def _roc_auc(predictions: jax.Array, labels: jax.Array, weights: jax.Array) -> jax.Array:
    valid = jnp.ones(predictions.shape, bool)
    return auc_from_groups(*group_by_score(predictions, labels, weights, valid))


def roc_auc(
    labels: jax.typing.ArrayLike,
    predictions: jax.typing.ArrayLike,
    weights: jax.typing.ArrayLike | None = None,
) -> float:
    """Exact weighted ROC AUC of whole arrays, in one host call: :class:`AUCMetric`'s
    maths in float64 (whatever `jax_enable_x64` says), for evaluations that already
    hold every sample.

    Ties in predictions count half; 0.5 when there are no positives or no negatives.

    Args:
      labels: `[N]` (any shape, flattened) in [0, 1].
      predictions: `[N]` finite scores; probabilities or logits (only their order
        matters).
      weights: `[N]` >= 0, or None (all 1).

    Returns:
      The AUC as a Python float.

    Example::

        >>> roc_auc([0, 1, 0, 1], [0.1, 0.8, 0.4, 0.4])
        0.875
    """
    y = np.asarray(labels, np.float64).reshape(-1)
    p = np.asarray(predictions, np.float64).reshape(-1)
    w = np.ones_like(p) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    if not y.size == p.size == w.size:
        raise ValueError(
            f"roc_auc: labels, predictions and weights need the same number of entries, "
            f"got {y.size}, {p.size} and {w.size}"
        )
    validate_inputs(p, y, None if weights is None else w, probabilities=False)
    with jax.enable_x64(True):
        return float(_roc_auc(jnp.asarray(p), jnp.asarray(y), jnp.asarray(w)))
