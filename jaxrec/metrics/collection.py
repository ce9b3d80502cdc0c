"""Several metrics behind one update (TorchRec's `RecMetricModule`).

`MetricCollection` is pure (state in, state out, jit-able); `RecMetricModule` is a
small stateful host wrapper around it for training loops (jitted update with a
donated state, host-side overflow check before compute).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .base import Metric, State, validate_inputs
from .processes import reduce_across_processes

KEY_FORMATS = ("flat", "torchrec")


class MetricCollection:
    """Metrics sharing inputs, with one state dict `{name: metric_state}`.

    Args:
      metrics: `{name: metric}`, or a sequence of metrics named by their namespace
        ("ne", "auc", "calibration", ...). Every metric must have the same `num_tasks`.
      task_names: names of the tasks for TorchRec-style keys; defaults to
        `("DefaultTask",)` for single-task metrics and `("task0", ...)` otherwise.

    `compute(state)` keys:
      - `key_format="flat"` (default): `"{name}-{output}"`, e.g. "ne-ne",
        "ne-logloss", "auc-auc", "calibration-calibration"; values are scalars, or
        `[T]` arrays with `num_tasks`;
      - `key_format="torchrec"`: TorchRec's `"{name}-{task}|{prefix}{output}"`,
        e.g. "ne-DefaultTask|lifetime_ne", one scalar per task; the prefix is
        ``"window_"`` for buffered AUC/AUPRC with `on_overflow="window"` (TorchRec's
        windowed AUC), ``"lifetime_"`` otherwise.

    Example:
      >>> metrics = MetricCollection([NEMetric(), AUCMetric(capacity=1 << 16)])
      >>> state = metrics.init()
      >>> state = jax.jit(metrics.update)(state, probs, labels, weights)
      >>> metrics.compute(state)["ne-ne"]
    """

    def __init__(
        self,
        metrics: Mapping[str, Metric] | Sequence[Metric],
        *,
        task_names: Sequence[str] | None = None,
    ) -> None:
        if isinstance(metrics, Mapping):
            items = tuple(metrics.items())
        else:
            items = tuple((m.namespace, m) for m in metrics)
        names = [n for n, _ in items]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"MetricCollection: metric names {dupes} repeat; pass a dict "
                "{name: metric} with distinct names"
            )
        if not items:
            raise ValueError("MetricCollection: needs at least one metric")
        for n, m in items:
            if not isinstance(m, Metric):
                raise TypeError(f"MetricCollection: {n!r} is {type(m).__name__}, not a Metric")
        tasks = {m.num_tasks for _, m in items}
        if len(tasks) > 1:
            raise ValueError(
                f"MetricCollection: metrics disagree on num_tasks ({sorted(map(str, tasks))}); "
                "they share the same inputs"
            )
        self.metrics: tuple[tuple[str, Metric], ...] = items
        self.num_tasks: int | None = tasks.pop()
        n_tasks = self.num_tasks or 1
        if task_names is None:
            task_names = (
                ("DefaultTask",)
                if self.num_tasks is None
                else tuple(f"task{i}" for i in range(n_tasks))
            )
        if len(task_names) != n_tasks:
            raise ValueError(
                f"MetricCollection: {len(task_names)} task_names for num_tasks={self.num_tasks}"
            )
        self.task_names = tuple(task_names)

    def init(self) -> dict[str, State]:
        return {n: m.init() for n, m in self.metrics}

    def input_names(self) -> tuple[str, ...]:
        """Every keyword input some metric needs (`session_ids`, `grouping_keys`, ...)."""
        return tuple(dict.fromkeys(k for _, m in self.metrics for k in m.input_names()))

    def update(self, state, predictions, labels, weights=None, **inputs):
        """Updates every metric; `inputs` (keyword, `[B]` each) go to the metrics
        whose `input_names()` list them."""
        extra = sorted(set(inputs) - set(self.input_names()))
        if extra:
            raise ValueError(
                f"MetricCollection.update: no metric takes the inputs {extra}; "
                f"the metrics take {list(self.input_names())}"
            )
        out = {}
        for n, m in self.metrics:
            mine = {k: inputs[k] for k in m.input_names() if k in inputs}
            out[n] = m.update(state[n], predictions, labels, weights, **mine)
        return out

    def merge(self, a, b):
        return {n: m.merge(a[n], b[n]) for n, m in self.metrics}

    def reduce(self, state, axis_name):
        """Combines per-device states inside `jax.shard_map` (see `Metric.reduce`)."""
        return {n: m.reduce(state[n], axis_name) for n, m in self.metrics}

    def check(self, state) -> None:
        for n, m in self.metrics:
            m.check(state[n])

    def compute(self, state, *, key_format: str = "flat") -> dict[str, jax.Array]:
        if key_format not in KEY_FORMATS:
            raise ValueError(f"key_format must be one of {KEY_FORMATS}, got {key_format!r}")
        out = {}
        for n, m in self.metrics:
            for key, value in m.compute(state[n]).items():
                if key_format == "flat":
                    out[f"{n}-{key}"] = value
                    continue
                for t, task in enumerate(self.task_names):
                    v = value if self.num_tasks is None else value[t]
                    out[f"{n}-{task}|{m.key_prefix()}{key}"] = v
        return out


class RecMetricModule:
    """Stateful host wrapper over a `MetricCollection` (TorchRec's `RecMetricModule`).

    Args:
      metrics: a `MetricCollection`, or what its constructor takes.
      validate: check input values on the host every update (`validate_inputs`;
        costs a device-to-host copy).
      process_local: each process feeds its own batches (not one global jit): then
        `compute` first merges the states of all processes.

    Example:
      >>> module = RecMetricModule([NEMetric(), CalibrationMetric()])
      >>> for probs, labels in batches:
      ...     module.update(probs, labels)
      >>> module.compute()  # {"ne-ne": 0.83, "ne-logloss": ..., ...} as Python floats
    """

    def __init__(
        self,
        metrics: MetricCollection | Mapping[str, Metric] | Sequence[Metric],
        *,
        validate: bool = False,
        process_local: bool = False,
        key_format: str = "flat",
    ) -> None:
        if not isinstance(metrics, MetricCollection):
            metrics = MetricCollection(metrics)
        self.collection = metrics
        self.validate = validate
        self.process_local = process_local
        self.key_format = key_format
        self._update = jax.jit(metrics.update, donate_argnums=0)
        self._compute = jax.jit(metrics.compute, static_argnames="key_format")
        self.reset()

    def reset(self) -> None:
        # Distinct buffers: the update donates the state, and init may share constants.
        self.state = jax.tree.map(lambda x: jnp.array(x, copy=True), self.collection.init())

    def update(self, predictions, labels, weights=None, **inputs) -> None:
        """One batch; `inputs`: the metrics' keyword inputs (`session_ids=...`)."""
        if self.validate:
            ms = [m for _, m in self.collection.metrics]
            binary = all(m.binary_labels for m in ms)
            logits = any(getattr(m, "from_logits", False) for m in ms)
            validate_inputs(
                predictions,
                labels,
                weights,
                probabilities=binary and not logits,
                binary_labels=binary,
            )
        self.state = self._update(self.state, predictions, labels, weights, **inputs)

    def compute(self) -> dict[str, float | np.ndarray]:
        """Results as Python floats (or numpy arrays with num_tasks); raises if a
        buffered metric overflowed."""
        state = self.state
        if self.process_local:
            state = reduce_across_processes(self.collection, state)
        self.collection.check(state)
        out = jax.device_get(self._compute(state, key_format=self.key_format))
        return {k: float(v) if np.ndim(v) == 0 else np.asarray(v) for k, v in out.items()}
