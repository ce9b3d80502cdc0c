"""Skipping a train step's update without copying its tables.

A step skips its update when a ``FATAL`` bounds check failed, or, with
``make_train_step(skip_nonfinite=True)``, when the loss or a gradient (dense
params, embedding outputs) is not finite. Skipping must leave every piece of
state as it was, yet the tables are huge and updated in place, so a
``where(ok, new_table, old_table)`` (a pass over every table, and a second
buffer) is out. Instead:

* the sparse update runs on the same features with every length zeroed: no id
  is valid, no row is touched (the C++ kernel, the XLA and Pallas paths and
  the sharded collections all read the ids from the lengths); the optimizer
  step counters, which those updates advance, are selected back;
* rows a managed-collision reset re-initialised during the forward are
  written back (the reset reads their ``K`` previous values just before its
  write; nothing table-sized), and their optimizer rows are not reset;
* small things are selected with ``where``: dense params, dense optimizer
  state, step counters and ``rest`` (batch stats, managed-collision state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..distributed.input_dist import Prefetched
from ..embedding.tables import TableStorage
from ..embedding.tape import Reset
from ..sparse import KeyedJaggedTensor
from ..xla.bounds import FatalReport, out_of_range_message
from .table_update import CollectionCall, TableBuffers


class StepReport(NamedTuple):
    """What the jitted step returns beside ``(state, loss, aux)`` (read by the wrappers)."""

    dropped: jax.Array | None  # row-wise ids dropped for capacity (sharded, overflow="raise")
    skipped: jax.Array | None  # bool scalar: nothing was applied (None: the step never skips)
    fatal: dict[str, tuple[jax.Array, jax.Array]]  # where -> (count, example) of FATAL checks
    # ... of WARNING checks, and per sharded call with overflow="warn" or "exact" its ids
    # beyond the fast path ("<index>:<mode>" -> count): logged by the host (see
    # step_warnings.py), not by callbacks inside the step.
    warnings: dict[str, tuple[jax.Array, jax.Array]]
    overflow_warned: dict[str, jax.Array]
    # int32 [n]: those counts stacked (checks, then overflows), the one array the host
    # reads per step (None: nothing can warn)
    counts: jax.Array | None


class BoundsCheckError(ValueError):
    """A ``BoundsCheckMode.FATAL`` check found out-of-range ids inside a train step.

    The step applied nothing: ``state`` is the state it was given, valid and
    unchanged (the input was donated, so use this one). ``failures`` maps each
    failing lookup (``where`` names its features / table) to
    ``(count, example id)``; ``where``, ``count`` and ``example`` are the first
    failure's. :class:`~jaxrec.train.TrainPipeline` reads the report one step
    late: its ``state`` then also holds the following (good) step.
    """

    def __init__(self, failures: Mapping[str, tuple[int, int]], state: Any):
        text = "; ".join(out_of_range_message(c, e, w) for w, (c, e) in failures.items())
        super().__init__(f"{text}. The step applied nothing; err.state is the unchanged state")
        self.failures = dict(failures)
        self.where, (self.count, self.example) = next(iter(self.failures.items()))
        self.state = state


def merge_reports(reports: Sequence[FatalReport]) -> dict[str, tuple[jax.Array, jax.Array]]:
    """``where -> (count, example)``: counts of the same lookup (called twice) summed."""
    out: dict[str, tuple[jax.Array, jax.Array]] = {}
    for r in reports:
        if r.where in out:
            count, example = out[r.where]
            example = jnp.where(count > 0, example, r.example.astype(example.dtype))
            out[r.where] = (count + r.count, example)
        else:
            out[r.where] = (r.count, r.example)
    return out


def warned(warnings: dict, overflow: Sequence[tuple[str, jax.Array]]) -> tuple:
    """``(warnings, overflow, counts)`` of a :class:`StepReport`; ``overflow`` holds
    ``(mode, count)`` per sharded call."""
    warnings = dict(sorted(warnings.items()))  # the order a jitted function returns a dict in
    by_call = {f"{i:05d}:{mode}": c for i, (mode, c) in enumerate(overflow)}
    counts = [c for c, _ in warnings.values()] + list(by_call.values())
    stacked = jnp.stack([jnp.asarray(c, jnp.int32) for c in counts]) if counts else None
    return warnings, by_call, stacked


def fatal_failures(
    fatal: Mapping[str, tuple[jax.Array, jax.Array]],
) -> dict[str, tuple[int, int]]:
    """The failed checks of a step's report, on the host (one sync)."""
    got = jax.device_get(dict(fatal))
    return {w: (int(c), int(e)) for w, (c, e) in got.items() if int(c) > 0}


def apply_mask(loss, g_params, g_probes, fatal, skip_nonfinite: bool) -> jax.Array | None:
    """Bool scalar: apply this step's update (``None``: nothing can stop it)."""
    checks = [count == 0 for count, _ in fatal.values()]
    if skip_nonfinite:
        checks.append(jnp.all(jnp.isfinite(loss)))
        for g in jax.tree.leaves((g_params, g_probes)):
            if jnp.issubdtype(g.dtype, jnp.inexact):
                checks.append(jnp.all(jnp.isfinite(g)))
    return jnp.all(jnp.stack(checks)) if checks else None


def without_ids(
    features: KeyedJaggedTensor | Prefetched, ok: jax.Array
) -> KeyedJaggedTensor | Prefetched:
    """``features`` (a KeyedJaggedTensor, leaves of any leading shape) with every length
    zeroed unless ``ok``: a sparse update from it touches no row."""
    if isinstance(features, Prefetched):  # a pipelined step's call: its ids already arrived
        return features.masked(_zero_lengths(features.kjt, ok), ok)
    if not isinstance(features, KeyedJaggedTensor):
        raise NotImplementedError(
            f"cannot skip the sparse update of a lookup on {type(features).__name__}; "
            "collections are called with a KeyedJaggedTensor"
        )
    return _zero_lengths(features, ok)


def _zero_lengths(kjt: KeyedJaggedTensor, ok: jax.Array) -> KeyedJaggedTensor:
    children, aux = kjt.tree_flatten()  # VBE: inverse_indices is a fourth child
    values, lengths, *rest = children
    lengths = jnp.where(ok, lengths, jnp.zeros_like(lengths))
    return KeyedJaggedTensor.tree_unflatten(aux, (values, lengths, *rest))


def mask_sparse_inputs(
    ok: jax.Array, tables: nnx.State, resets: Sequence[Reset], calls: Sequence[CollectionCall]
) -> tuple[nnx.State, list[Reset], list[CollectionCall]]:
    """Unless ``ok``: rows reset in the forward get their previous values back (undone
    last first, so a row reset twice in one forward gets its pre-step value), no
    optimizer row is reset (all rows fill) and no call has a valid id."""
    buffers = TableBuffers(tables)
    fills = []
    for r in reversed(resets):
        w = buffers[r.path, r.group]
        buffers[r.path, r.group] = w.at[jnp.where(ok, w.shape[0], r.rows)].set(r.old, mode="drop")
        fills.insert(0, w.shape[0])
    resets = [
        dataclasses.replace(r, rows=_no_reset_rows(r, ok, n))
        for r, n in zip(resets, fills, strict=True)
    ]
    calls = [
        c._replace(lookup=c.lookup._replace(features=without_ids(c.lookup.features, ok)))
        for c in calls
    ]
    return buffers.state(), resets, calls


def _no_reset_rows(reset: Reset, ok: jax.Array, buffer_rows: int) -> jax.Array:
    """The reset's rows unless ``ok`` is False: then all fill (no optimizer row is reset);
    a sharded collection's fill is its global buffer's row count."""
    if isinstance(reset.module, TableStorage):
        buffer_rows = reset.module.group(reset.group).num_rows
    return jnp.where(ok, reset.rows, buffer_rows)


def keep_counts(new: dict, old: Mapping, ok: jax.Array) -> dict:
    """``new`` sparse states with the step counters of ``old`` unless ``ok``."""
    out = dict(new)
    for k, st in new.items():
        if k in old:  # every sparse optimizer state has a count (jaxrec.optim.base)
            out[k] = st._replace(count=jnp.where(ok, st.count, old[k].count))
    return out


class SkipCounter:
    """Counts skipped steps from the steps' device flags without waiting on the latest step.

    ``add`` keeps the last two flags pending and folds older ones (their steps
    have finished); calling the counter folds all (it waits for the last step).
    """

    def __init__(self):
        self._total = 0
        self._pending: list = []

    def add(self, skipped: jax.Array | None) -> None:
        if skipped is None:
            return
        self._pending.append(skipped)
        while len(self._pending) > 2:
            self._total += int(self._pending.pop(0))

    def __call__(self) -> int:
        """Steps skipped so far (synchronises with the last step)."""
        self._total += sum(int(x) for x in self._pending)
        self._pending = []
        return self._total


class CapacityOverflowError(RuntimeError):
    """A sharded collection dropped ids that did not fit its per-destination capacity.

    The step was applied without them; ``state`` is the state after it (the
    input state was donated).
    """

    def __init__(self, dropped: int, state: Any):
        super().__init__(
            f"input_dist dropped {dropped} ids that did not fit the per-destination "
            "capacity in this step (overflow='raise' drops them); use overflow='exact' (the "
            "default: extra exchange rounds, nothing dropped) or pass a larger capacity= to "
            "DistributedModelParallel"
        )
        self.dropped = dropped
        self.state = state


def raise_for_report(report: StepReport, state: Any) -> None:
    """Raises the error a step's report calls for, with ``state`` (a host sync only when
    the step has FATAL checks or can drop ids)."""
    if report.fatal:
        failures = fatal_failures(report.fatal)
        if failures:
            raise BoundsCheckError(failures, state)
    if report.dropped is not None and int(report.dropped) > 0:
        raise CapacityOverflowError(int(report.dropped), state)
