"""The gradient tape: how a train step sees every embedding lookup in a model.

During a sparse train step, each embedding collection call passes its output
through :func:`tap`. The step first traces the loss once with shapes only to
learn every call's output shape, then differentiates the loss with respect to
a zero "probe" added to each output: the probe's gradient is d loss / d output,
from which the sparse path builds per-row gradients. Outside a train step
``tap`` is the identity. Tables are never differentiated.
"""

from __future__ import annotations

import contextvars
import dataclasses
import time
from typing import Any, Protocol, SupportsInt

import jax
import jax.numpy as jnp
from flax import nnx

from ..xla.bounds import FatalReport, collect_checks, logger
from .collection import EmbeddingCollectionInterface
from .touched import CallFeatures, mark_touched

_TAPE: contextvars.ContextVar[Tape | None] = contextvars.ContextVar("jaxrec_tape", default=None)


@dataclasses.dataclass
class Call:
    """One collection call seen by the tape."""

    path: tuple  # module path in the model
    module: EmbeddingCollectionInterface  # the collection (for its static layout only)
    features: CallFeatures  # the KeyedJaggedTensor it looked up (or a Prefetched holding it)
    shapes: Any  # pytree of ShapeDtypeStruct of its tapped output
    output: Any = None  # the output as the collection looked it up (before any replacement)


class RowResetter(Protocol):
    """What re-initialised rows: it resets their optimizer state too (``TableStorage``, a
    sharded collection)."""

    def reset_optimizer_rows(self, optimizer, path, group, sparse_state, rows) -> dict: ...


@dataclasses.dataclass
class Reset:
    """Rows of one table group re-initialised during the forward (see ``reset.py``)."""

    path: tuple  # the collection's module path in the model
    module: RowResetter  # the collection (or the TableStorage) that reset the rows
    group: str  # its table group (stacked buffer) name
    rows: jax.Array  # [K] group rows; fill entries are >= the group's rows
    old: jax.Array  # [K, D] the rows' values before the reset (written back if the step skips)


class Tape:
    """Records collection calls; adds ``probes[i]`` to the i-th call's output.

    With ``outputs`` (a semi-synchronous step, see ``jaxrec.train.semi_sync``), the
    i-th call's output is replaced by ``outputs[i]`` (looked up a step earlier)
    before its probe is added.
    """

    def __init__(self, model: nnx.Module, probes: list | None = None, outputs: list | None = None):
        self.paths = {id(m): p for p, m in nnx.iter_modules(model)}
        self.probes = probes
        self.outputs = outputs
        self.calls: list[Call] = []
        self.overflow: list = []  # dropped-id counts of sharded calls that raise
        # (mode, count) of calls whose counts the host logs: dropped ids ("warn") and
        # ids sent in extra exchange rounds ("exact")
        self.overflow_warned: list = []
        self.resets: list[Reset] = []  # rows re-initialised during the forward (see reset.py)
        # Bounds checks: FATAL ones are not raised from a callback inside the donated
        # step; WARNING ones are step outputs too, so the program holds no callback.
        self.fatal: list[FatalReport] = []
        self.warning: list[FatalReport] = []

    def __enter__(self) -> Tape:
        self._token = _TAPE.set(self)
        self._checks = collect_checks(warnings=True)
        checks = self._checks.__enter__()
        assert checks.warning is not None  # warnings=True: collected, not logged
        self.fatal, self.warning = checks.fatal, checks.warning
        return self

    def __exit__(self, *exc) -> None:
        self._checks.__exit__(*exc)
        _TAPE.reset(self._token)


def tap(module: EmbeddingCollectionInterface, output: Any, features: CallFeatures) -> Any:
    """Identity, except inside a train step's tape (see module docstring)."""
    tape = _TAPE.get()
    if tape is None:
        return output
    i = len(tape.calls)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), output)
    tape.calls.append(Call(_path(tape, module, "was called"), module, features, shapes, output))
    if tape.outputs is not None:
        output = _given(tape.outputs, i, shapes)
    if tape.probes is None:
        return output
    mark_touched(module, features)  # rows this step may change (delta checkpoints; touched.py)
    return jax.tree.map(jnp.add, output, tape.probes[i])


def _given(outputs: list, i: int, shapes: Any) -> Any:
    """``outputs[i]``, checked against the shapes of the output it replaces."""
    if i >= len(outputs):
        raise ValueError(
            f"collection call {i} has no given output ({len(outputs)} given): the model made "
            "more collection calls than when its outputs were looked up; the calls must not "
            "depend on the batch's values"
        )
    given = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), outputs[i])
    if given != shapes:
        raise ValueError(
            f"collection call {i}: the given output {given} does not match the output "
            f"{shapes} it replaces; look the outputs up on batches of the same shapes"
        )
    return outputs[i]


def report_overflow(count: jax.Array, mode: str = "raise") -> bool:
    """Hands a sharded call's count of ids beyond its fast path to the train step, which
    raises on dropped ones (``mode="raise"``) or returns the count for the host to log
    (``"warn"``: dropped; ``"exact"``: sent in extra exchange rounds).

    Returns False outside a train step (the caller then logs instead).
    """
    if mode not in ("raise", "warn", "exact"):
        raise ValueError(f"report_overflow: mode must be 'raise', 'warn' or 'exact', got {mode!r}")
    tape = _TAPE.get()
    if tape is None:
        return False
    if tape.probes is not None:  # the differentiated pass, not the shape-only one
        if mode == "raise":
            tape.overflow.append(count)
        else:
            tape.overflow_warned.append((mode, count))
    return True


_LAST_REROUTE_LOG = [-float("inf")]
REROUTE_LOG_SECONDS = 60.0  # extra rounds are logged at most this often


def log_overflow(count: SupportsInt, mode: str = "warn") -> None:
    """The warning of a sharded call whose ``count > 0`` ids did not fit the fast path:
    dropped (``mode="warn"``) or sent in extra rounds (``"exact"``, logged at most once a
    minute: a fast path sized too small costs time on every step)."""
    if not int(count):
        return
    if mode == "exact":
        now = time.monotonic()
        if now - _LAST_REROUTE_LOG[0] < REROUTE_LOG_SECONDS:
            return
        _LAST_REROUTE_LOG[0] = now
        logger.warning(
            "input_dist sent %d ids beyond the per-destination capacity in extra exchange "
            "rounds (exact, but slower; counted in overflow_count); raise capacity= or give "
            "pooling_factors to size it",
            int(count),
        )
        return
    logger.warning(
        "input_dist dropped %d ids that did not fit the per-destination "
        "capacity (counted in overflow_count); raise capacity= or use overflow='exact'",
        int(count),
    )


def record_reset(module: RowResetter, group: str, rows: jax.Array, old: jax.Array) -> bool:
    """Tells the train step that ``rows`` of ``module``'s ``group`` were re-initialised
    (their values were ``old``), so that it resets their optimizer state too, or puts
    ``old`` back if it skips its update. Returns False outside a train step."""
    tape = _TAPE.get()
    if tape is None:
        return False
    tape.resets.append(Reset(_path(tape, module, "reset rows"), module, group, rows, old))
    return True


def call_path(module: nnx.Module) -> tuple:
    """``module``'s path in the model a train step is tracing (an error outside one)."""
    tape = _TAPE.get()
    if tape is None:
        raise ValueError(f"{type(module).__name__} needs a train step's tape to find its path")
    return _path(tape, module, "was called")


def _path(tape: Tape, module: object, did: str) -> tuple:
    """``module``'s path in the model being trained (an error if it is not part of it)."""
    if id(module) not in tape.paths:
        raise ValueError(
            f"{type(module).__name__} {did} inside a train step but is not part of "
            "the model being trained; make it an attribute of the model"
        )
    return tape.paths[id(module)]
