"""Out-of-range id handling, with FBGEMM's ``BoundsCheckMode`` choices.

``WARNING`` (the default, as in FBGEMM) and ``IGNORE`` drop out-of-range ids:
they contribute zero to their bag (FBGEMM instead reads row 0). ``WARNING``
also logs how many ids were dropped and one example. Outside a train step (a
plain or jitted module call, an eval step, inference) it logs from a host
callback that runs only when a bad id is present. Inside a train step it is
collected instead (:func:`collect_checks`): the counts are outputs of the
step's program, which then holds no host callback (a program with one cannot
be compiled without a live backend, e.g. deviceless for a GPU), and the host
logs the same text a step or two later (``jaxrec/train/step_warnings.py``).
``FATAL`` raises at run time (a ``JaxRuntimeError`` whose message names the
feature); inside a train step it is collected too: the step applies nothing
and raises ``jaxrec.train.BoundsCheckError`` holding the unchanged state.
``NONE`` skips the check: an out-of-range id then reads an arbitrary row (XLA
clamps gather indices, and in a stacked buffer that is a neighbouring table's
row): use it only for ids known to be valid. Ids are out of range when ``< 0``
or ``>= num_embeddings``, compared in the ids' own dtype (any JAX integer
dtype; never after a narrowing cast, so a uint32 id >= 2**31 is out of range,
not a negative row).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger("jaxrec")


class BoundsCheckMode(enum.Enum):
    FATAL = "FATAL"
    WARNING = "WARNING"
    IGNORE = "IGNORE"
    NONE = "NONE"


class FatalReport(NamedTuple):
    """A check collected by :func:`collect_checks` (values of the trace that made it)."""

    where: str  # names the lookup (feature / table)
    count: jax.Array  # int32 scalar: ids out of range
    example: jax.Array  # one of them (any value when count is 0)


class Checks(NamedTuple):
    """The reports collected by :func:`collect_checks`, in the order they were made."""

    fatal: list[FatalReport]
    warning: list[FatalReport] | None  # None: WARNING logs from a host callback

    def by_mode(self) -> list[tuple[BoundsCheckMode, FatalReport]]:
        """Every collected check with its mode, FATAL ones first."""
        return [(BoundsCheckMode.FATAL, r) for r in self.fatal] + [
            (BoundsCheckMode.WARNING, r) for r in self.warning or ()
        ]


_SINK: contextvars.ContextVar[Checks | None] = contextvars.ContextVar("jaxrec_checks", default=None)


@contextlib.contextmanager
def collect_checks(*, warnings: bool | None = None) -> Iterator[Checks]:
    """Inside, checks are appended to the yielded lists instead of calling back to the host.

    ``FATAL`` checks are always collected: a host callback that raises inside
    a jitted step with donated arguments leaves the caller with deleted
    buffers; the train step skips its update and raises ``BoundsCheckError``
    with the unchanged state instead. ``WARNING`` checks are collected when
    ``warnings`` is True (a train step: its program then holds no callback),
    keep their callback when False, and follow the enclosing collector when
    None (no enclosing one: the callback). Every check goes through
    :func:`report_out_of_range`. The values belong to the trace that made
    them: code that checks inside another transformation (a ``shard_map``
    body) collects its own reports there, returns them and reports them again
    outside.
    """
    if warnings is None:
        outer = _SINK.get()
        warnings = outer is not None and outer.warning is not None
    checks = Checks([], [] if warnings else None)
    token = _SINK.set(checks)
    try:
        yield checks
    finally:
        _SINK.reset(token)


@contextlib.contextmanager
def collect_fatal() -> Iterator[list[FatalReport]]:
    """:func:`collect_checks` for ``FATAL`` alone (``WARNING`` keeps its callback)."""
    with collect_checks(warnings=False) as checks:
        yield checks.fatal


# ``where`` -> message of a check about something other than ids (bag layouts,
# weights), set by :func:`report_check`.
_MESSAGES: dict[str, Callable[[int, int], str]] = {}


def out_of_range_message(count: int, example: int, where: str) -> str:
    message = _MESSAGES.get(where)
    if message is not None:
        return message(count, example)
    return (
        f"{count} ids out of range in {where} (e.g. id {example}); ids must lie in "
        "[0, num_embeddings): hash or remap them before the lookup"
    )


def log_out_of_range(count: int, example: int, where: str) -> None:
    """The ``WARNING`` log line of a check that found ``count > 0`` bad inputs."""
    logger.warning(
        "%s; they were dropped (contribute zero)", out_of_range_message(count, example, where)
    )


def _report(mode: BoundsCheckMode, where: str):
    def callback(count, example):
        count, example = int(count), int(example)
        if count == 0:
            return
        if mode is BoundsCheckMode.FATAL:
            raise ValueError(out_of_range_message(count, example, where))
        log_out_of_range(count, example, where)

    return callback


def check_ids(
    ids: jax.Array,
    valid: jax.Array,
    num_embeddings: jax.Array | np.ndarray | int,
    mode: BoundsCheckMode,
    where: str,
) -> jax.Array:
    """Returns the ``valid`` mask with out-of-range ids removed (per ``mode``).

    Args:
        ids: ``[C]`` integer ids.
        valid: ``[C]`` bool, False for padding.
        num_embeddings: rows of the table each id indexes (scalar or ``[C]``).
        mode: what to do with out-of-range ids.
        where: names the lookup in messages.
    """
    mode = BoundsCheckMode(mode)
    if mode is BoundsCheckMode.NONE:
        return valid
    ids = jnp.asarray(ids)  # numpy ids could not be indexed by the traced argmax
    in_range = ids_in_range(ids, num_embeddings)
    if mode is not BoundsCheckMode.IGNORE:
        bad = valid & ~in_range
        count = jnp.sum(bad, dtype=jnp.int32)
        example = jnp.zeros((), ids.dtype)
        if ids.shape[0]:  # the argmax pass only when an id is bad
            # (zeros_like(ids[0]) varies over the mesh axes ids do, inside a shard_map)
            first_bad = lambda: ids[jnp.argmax(bad)]
            example = jax.lax.cond(count > 0, first_bad, lambda: jnp.zeros_like(ids[0]))
        report_out_of_range(count, example, mode, where)
    return valid & in_range


def ids_in_range(ids: jax.Array, num_embeddings: jax.Array | np.ndarray | int) -> jax.Array:
    """``0 <= ids < num_embeddings``, compared in the ids' own integer width.

    Mixing dtypes would promote: uint32 with int32 becomes int32 without x64,
    so a uint32 id >= 2**31 wrapped to a negative number and passed the check.
    The bound is clipped into the ids' dtype instead (a table larger than the
    dtype's range holds every non-negative id).
    """
    info = jnp.iinfo(ids.dtype)
    if isinstance(num_embeddings, jax.Array):  # traced or device bound
        num = num_embeddings
        last = num - 1
        if jnp.iinfo(num.dtype).max > info.max:
            last = jnp.minimum(last, info.max)
        limit = jnp.maximum(last, 0).astype(ids.dtype)
    else:
        num = np.asarray(num_embeddings, np.int64)
        top = min(int(info.max), int(np.iinfo(np.int64).max))
        limit = np.clip(num - 1, 0, top).astype(ids.dtype)
    ok = (ids <= limit) & (num > 0)
    return ok & (ids >= 0) if info.min < 0 else ok


def report_out_of_range(
    count: jax.Array, example: jax.Array, mode: BoundsCheckMode, where: str
) -> None:
    """WARNING logs and FATAL raises (at run time) when ``count > 0`` ids were out of range.

    Under :func:`collect_checks` (a train step) they are collected instead.
    """
    mode = BoundsCheckMode(mode)
    if mode in (BoundsCheckMode.NONE, BoundsCheckMode.IGNORE):
        return
    sink = _SINK.get()
    if sink is not None:
        into = sink.fatal if mode is BoundsCheckMode.FATAL else sink.warning
        if into is not None:
            into.append(FatalReport(where, jnp.asarray(count, jnp.int32), jnp.asarray(example)))
            return
    jax.lax.cond(
        count > 0,
        lambda: jax.debug.callback(_report(mode, where), count, example),
        lambda: None,
    )


def report_out_of_range_many(
    counts: jax.Array, examples: jax.Array, mode: BoundsCheckMode, wheres: Sequence[str]
) -> None:
    """:func:`report_out_of_range` of ``len(wheres)`` checks at once (``counts`` and
    ``examples`` ``[len(wheres)]``): collected one by one, or one host callback for all."""
    mode = BoundsCheckMode(mode)
    if mode in (BoundsCheckMode.NONE, BoundsCheckMode.IGNORE) or not wheres:
        return
    sink = _SINK.get()
    into = None if sink is None else sink.fatal if mode is BoundsCheckMode.FATAL else sink.warning
    if into is not None:
        for i, where in enumerate(wheres):
            into.append(FatalReport(where, counts[i].astype(jnp.int32), examples[i]))
        return
    callbacks = [_report(mode, where) for where in wheres]

    def callback(counts, examples):
        for report, count, example in zip(callbacks, counts, examples, strict=True):
            report(count, example)

    jax.lax.cond(
        jnp.sum(counts) > 0,
        lambda: jax.debug.callback(callback, counts, examples),
        lambda: None,
    )


def report_check(
    count: jax.Array,
    example: jax.Array,
    mode: BoundsCheckMode,
    where: str,
    message: Callable[[int, int], str],
) -> None:
    """:func:`report_out_of_range` for other bad inputs (bag layouts, weights).

    ``message(count, example)`` is the text of the warning, of the ``FATAL``
    error and of a train step's ``BoundsCheckError``; ``where`` must name this
    check alone (it keys the message).
    """
    _MESSAGES[where] = message
    report_out_of_range(count, example, mode, where)
