"""Errors that hand back a state: raised after a cache load took the caller's buffers."""

from __future__ import annotations

import functools

from ..train.step import TrainState


class StateHandedBack(Exception):
    """An error raised after a cache load took the caller's table buffers (they are
    donated to it): ``state`` is the loaded state to go on with (``TrainPipeline``
    adopts it as ``pipeline.state``).

    Each such error is also of the original error's type, with its message, notes,
    traceback and cause: ``except TypeError`` still catches a step's ``TypeError``,
    and ``except StateHandedBack`` catches any of them.
    """

    state: TrainState


def with_state(err: Exception, state: TrainState) -> Exception:
    """``err`` as a :class:`StateHandedBack` of its own type (a copy) carrying ``state``.

    To raise: its ``__cause__`` is the original's cause (or the context it was raised
    in), so ``raise with_state(e, state)`` in ``e``'s handler shows ``e`` once. An error
    whose type cannot be extended, or whose message a copy from its ``args`` would
    change (an ``OSError`` with a filename), is returned itself with a ``state``
    attribute.
    """
    if isinstance(err, StateHandedBack):
        err.state = state
        return err
    new = _copy(err)
    if new is None:
        vars(err)["state"] = state
        return err
    new.__traceback__ = err.__traceback__
    new.__cause__ = err.__cause__
    if new.__cause__ is None and not err.__suppress_context__:
        new.__cause__ = err.__context__
    new.__suppress_context__ = True  # not err, the handled error it copies
    new.state = state
    return new


def _copy(err: Exception) -> StateHandedBack | None:
    """``err``'s args and attributes (notes too) in a :class:`StateHandedBack` of its
    type, or None where that type cannot be extended or the copy's message differs
    (``OSError``'s filename, say, is not in its args)."""
    try:
        kind = _handing_back(type(err))
        new = kind.__new__(kind, *err.args)
        vars(new).update(vars(err))
        if str(new) != str(err):
            return None
    except Exception:  # noqa: BLE001 (an exotic type: err itself carries the state)
        return None
    return new


@functools.cache
def _handing_back(kind: type[Exception]) -> type[StateHandedBack]:
    """A subclass of ``kind`` and :class:`StateHandedBack` named as ``kind`` (in
    tracebacks), pickled as ``kind`` (its class exists in this process only)."""

    class Handed(StateHandedBack, kind):
        def __reduce__(self):
            return kind, self.args, vars(self)

    Handed.__name__, Handed.__qualname__ = kind.__name__, kind.__qualname__
    Handed.__module__ = kind.__module__
    return Handed
