"""Merging metric states across processes (multi-host)."""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

from .base import State


class Mergeable(Protocol):
    """A ``Metric`` or ``MetricCollection``: anything with ``merge``."""

    def merge(self, a: Any, b: Any, /) -> Any: ...


def reduce_across_processes(metric: Mergeable, state: State) -> State:
    """Merges the states of every process (TorchRec's metric `sync()` across ranks).

    For states each process built from its own batches (process-local arrays). A
    state computed by one global `jit` over a multi-process mesh is already global:
    reducing it again would count every sample `process_count` times.

    Args:
      metric: a `Metric` or `MetricCollection` (anything with `merge`).
      state: this process's state; same structure and shapes on every process.

    Returns:
      The merged state (process order 0, 1, ...) as jax arrays, identical on every
      process; equal to the input with one process. Call outside `jit` (it gathers
      through the host).
    """
    gathered = multihost_utils.process_allgather(state)  # leaves: [P, ...] numpy
    out = jax.tree.map(lambda x: jnp.asarray(x[0]), gathered)
    merge = jax.jit(metric.merge)
    for i in range(1, jax.process_count()):
        out = merge(out, jax.tree.map(lambda x, i=i: x[i], gathered))
    return out
