"""Errors that hand back a state: raised after a cache load took the caller's buffers."""

from __future__ import annotations

from ..train.step import TrainState


def hand_back(err: BaseException, state: TrainState, note: str) -> None:
    """Gives ``err`` the attribute ``state``: the state after a cache load, to go on
    with (the load took the caller's table buffers; ``TrainPipeline`` adopts it as
    ``pipeline.state``), and ``note`` saying so. The error keeps its type and identity
    (``except TypeError`` still catches a step's ``TypeError``)."""
    # Any exception takes attributes; pipeline.py reads it (exceptions declare none).
    err.state = state  # pyright: ignore[reportAttributeAccessIssue]
    err.add_note(note)
