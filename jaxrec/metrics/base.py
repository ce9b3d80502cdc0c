"""Metric protocol, input checks and the sum-state base shared by the scalar metrics.

A metric is a frozen dataclass with pure, jit-able methods over a pytree state of
fixed shape (TorchRec's `RecMetricComputation`, without the mutable module):

    state = metric.init()
    state = metric.update(state, predictions, labels, weights)   # per batch, under jit
    state = metric.merge(state_a, state_b)                       # steps, shards, hosts
    results = metric.compute(state)                              # {"ne": ..., "logloss": ...}

Sum states are float accumulators with a compensation term (Neumaier's two-sum), so
that float32 sums over millions of batches keep about float64's accuracy (TorchRec
keeps float64 states; JAX runs float32 unless `jax_enable_x64` is set, in which case
the states are float64).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

State: TypeAlias = Any  # a metric's state: any pytree of arrays (each metric its own)


def acc_dtype() -> jnp.dtype:
    """float64 when `jax_enable_x64` is on, else float32."""
    return jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64))


class Sum(NamedTuple):
    """A compensated sum: the value is `hi + lo`."""

    hi: jax.Array
    lo: jax.Array


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    # Knuth's two-sum: s + err == a + b exactly (XLA does not reassociate floats).
    s = a + b
    bp = s - a
    return s, (a - (s - bp)) + (b - bp)


def sum_zeros(shape: tuple[int, ...]) -> Sum:
    return Sum(jnp.zeros(shape, acc_dtype()), jnp.zeros(shape, acc_dtype()))


def sum_add(acc: Sum, x: jax.Array) -> Sum:
    s, err = _two_sum(acc.hi, x)
    return Sum(s, acc.lo + err)


def sum_merge(a: Sum, b: Sum) -> Sum:
    s, err = _two_sum(a.hi, b.hi)
    return Sum(s, a.lo + b.lo + err)


def sum_value(acc: Sum) -> jax.Array:
    return acc.hi + acc.lo


def _is_sum(x: object) -> bool:
    return isinstance(x, Sum)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Metric:
    """Base of every metric.

    Attributes:
      num_tasks: None for inputs of shape `[B]` (results are scalars); an int T for
        inputs of shape `[T, B]` (TorchRec's `n_tasks`; results have shape `[T]`).
    """

    num_tasks: int | None = None

    namespace: ClassVar[str] = ""
    output_names: ClassVar[tuple[str, ...]] = ()
    binary_labels: ClassVar[bool] = True  # labels in [0, 1] (False for regression)

    def __post_init__(self) -> None:
        if self.num_tasks is not None and (
            not isinstance(self.num_tasks, int) or self.num_tasks < 1
        ):
            raise ValueError(
                f"{type(self).__name__}: num_tasks must be None or a positive int, "
                f"got {self.num_tasks!r}"
            )

    @property
    def task_shape(self) -> tuple[int, ...]:
        return () if self.num_tasks is None else (self.num_tasks,)

    def outputs(self) -> tuple[str, ...]:
        """Names of the entries `compute` returns."""
        return self.output_names

    def key_prefix(self) -> str:
        """TorchRec's ``MetricPrefix`` of the results: ``"lifetime_"`` or ``"window_"``."""
        return "lifetime_"

    def input_names(self) -> tuple[str, ...]:
        """Per-sample inputs `update` needs beside predictions, labels and weights
        (TorchRec's ``required_inputs``, e.g. ``"session_ids"``), passed by keyword."""
        return ()

    def take_inputs(
        self, inputs: Mapping[str, npt.ArrayLike], batch_size: int
    ) -> dict[str, jax.Array]:
        """Checks the keyword inputs of `update`: exactly `input_names()`, each an
        integer array of shape `[B]`."""
        name = type(self).__name__
        want = self.input_names()
        missing = [k for k in want if k not in inputs]
        extra = sorted(set(inputs) - set(want))
        if missing or extra:
            raise ValueError(
                f"{name}.update takes the inputs {list(want)} by keyword; "
                f"missing {missing}, unexpected {extra}"
            )
        out = {}
        for k in want:
            x = jnp.asarray(inputs[k])
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"{name}: {k} must be an integer array, got {x.dtype=}")
            if x.shape != (batch_size,):
                raise ValueError(
                    f"{name}: {k} must have shape [B] = ({batch_size},) (one per sample, "
                    f"shared by the tasks), got {x.shape=}"
                )
            out[k] = x
        return out

    def init(self) -> State:
        raise NotImplementedError

    def update(
        self,
        state: State,
        predictions: jax.typing.ArrayLike,
        labels: jax.typing.ArrayLike,
        weights: jax.typing.ArrayLike | None = None,
    ) -> State:
        raise NotImplementedError

    def merge(self, a: State, b: State) -> State:
        raise NotImplementedError

    def compute(self, state: State) -> dict[str, jax.Array]:
        raise NotImplementedError

    def reduce(self, state: State, axis_name: str | tuple[str, ...]) -> State:
        """Combines the per-device states of a `jax.shard_map` axis (call inside it)."""
        raise NotImplementedError

    def check(self, state: State) -> None:
        """Host-side check of a concrete state; raises when a result would be wrong."""
        del state

    def prepare(
        self,
        predictions: jax.typing.ArrayLike,
        labels: jax.typing.ArrayLike,
        weights: jax.typing.ArrayLike | None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Checks shapes and dtypes (at trace time) and casts to the accumulator dtype."""
        name = type(self).__name__
        predictions = jnp.asarray(predictions)
        labels = jnp.asarray(labels)
        if not jnp.issubdtype(predictions.dtype, jnp.floating):
            raise TypeError(f"{name}: predictions must be floating point, got {predictions.dtype=}")
        want_ndim = 1 if self.num_tasks is None else 2
        if predictions.ndim != want_ndim or (
            self.num_tasks is not None and predictions.shape[0] != self.num_tasks
        ):
            want = "[B]" if self.num_tasks is None else f"[{self.num_tasks}, B]"
            raise ValueError(
                f"{name}: predictions must have shape {want} (num_tasks={self.num_tasks}), "
                f"got {predictions.shape=}"
            )
        if labels.shape != predictions.shape:
            raise ValueError(
                f"{name}: labels must have the shape of predictions, got "
                f"{labels.shape=} and {predictions.shape=}"
            )
        dtype = acc_dtype()
        if weights is None:
            weights = jnp.ones(predictions.shape, dtype)
        else:
            weights = jnp.asarray(weights)
            if weights.shape != predictions.shape:
                if self.num_tasks is not None and weights.shape == predictions.shape[1:]:
                    weights = jnp.broadcast_to(weights, predictions.shape)
                else:
                    raise ValueError(
                        f"{name}: weights must have the shape of predictions (or [B] "
                        f"with num_tasks), got {weights.shape=} and {predictions.shape=}"
                    )
        return predictions.astype(dtype), labels.astype(dtype), weights.astype(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SumMetric(Metric):
    """A metric whose state is a dict of sums over the batch axis (TorchRec's
    `dist_reduce_fx="sum"` states). Subclasses define `state_names`, `batch_sums`
    and `compute_sums`; `state_shape` may add trailing axes (histograms).
    """

    state_names: ClassVar[tuple[str, ...]] = ()

    def state_shape(self) -> tuple[int, ...]:
        return self.task_shape

    def state_shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of one state (all `state_shape()` unless a metric says otherwise)."""
        del name
        return self.state_shape()

    def batch_sums(
        self, p: jax.Array, y: jax.Array, w: jax.Array, **inputs: jax.Array
    ) -> dict[str, jax.Array]:
        raise NotImplementedError

    def compute_sums(self, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        raise NotImplementedError

    def init(self) -> dict[str, Sum]:
        return {k: sum_zeros(self.state_shape_of(k)) for k in self.state_names}

    def update(self, state, predictions, labels, weights=None, **inputs):
        p, y, w = self.prepare(predictions, labels, weights)
        sums = self.batch_sums(p, y, w, **self.take_inputs(inputs, p.shape[-1]))
        return {k: sum_add(state[k], sums[k]) for k in self.state_names}

    def merge(self, a, b):
        return jax.tree.map(sum_merge, a, b, is_leaf=_is_sum)

    def compute(self, state):
        sums = {k: sum_value(state[k]) for k in self.state_names}
        return self.compute_sums(sums)

    def reduce(self, state, axis_name):
        # psum of hi and of lo: one float rounding per reduction, none accumulated.
        return jax.tree.map(
            lambda s: Sum(jax.lax.psum(s.hi, axis_name), jax.lax.psum(s.lo, axis_name)),
            state,
            is_leaf=_is_sum,
        )


def replicated_like(x: jax.Array) -> NamedSharding | None:
    """A replicated sharding on `x`'s mesh if `x` is sharded over explicit mesh axes
    (`jax.make_mesh`'s default), else None. Scatters into a replicated state need it
    as `out_sharding` (XLA then scatters locally and all-reduces)."""
    sharding = jax.typeof(x).sharding
    if sharding.mesh.empty or all(s is None for s in sharding.spec):
        return None
    return NamedSharding(sharding.mesh, P())


def gather_invariant(x: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """`all_gather` along a new leading axis whose result is typed as replicated over
    `axis_name` (a `shard_map` with `out_specs=P()` accepts it): each device places
    its value at its index and a `psum` combines them."""
    n, i = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    dtype = jnp.int32 if x.dtype == jnp.bool_ else x.dtype
    placed = jnp.zeros((n, *x.shape), dtype).at[i].set(x.astype(dtype))
    return jax.lax.psum(placed, axis_name).astype(x.dtype)


def safe_div(num: jax.Array, denom: jax.Array, default: float = 0.0) -> jax.Array:
    """`num / denom`, or `default` where `denom == 0` (TorchRec's `torch.where` idiom)."""
    zero = denom == 0
    return jnp.where(zero, default, num / jnp.where(zero, 1, denom))


def validate_inputs(
    predictions: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    weights: jax.typing.ArrayLike | None = None,
    *,
    probabilities: bool = True,
    binary_labels: bool = True,
) -> None:
    """Host-side value checks (not jit-able): everything finite, weights >= 0,
    predictions in [0, 1] if `probabilities`, labels in [0, 1] if `binary_labels`.
    Raises ValueError naming the first bad entry.
    """
    rules = {
        "predictions": "in [0, 1] (pass from_logits=True for logits)" if probabilities else "",
        "labels": "in [0, 1]" if binary_labels else "",
        "weights": ">= 0",
    }
    args = {"predictions": predictions, "labels": labels, "weights": weights}
    for arg, x in args.items():
        if x is None:
            continue
        x = np.asarray(x, dtype=np.float64)
        bad = ~np.isfinite(x)
        if arg == "weights":
            bad |= x < 0
        elif rules[arg]:
            bad |= (x < 0) | (x > 1)
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            rule = " and ".join(r for r in ("finite", rules[arg]) if r)
            raise ValueError(
                f"{arg} must be {rule}; {int(bad.sum())} entries are not, "
                f"first at index {idx}: {x[idx]!r}"
            )
